//! A small but real DeepSeek-V3.2-style model (random weights from a seed) that runs
//! through the cache: the reference forward behind the exactness test.
//!
//! Per layer, for every new token: the MLA latent (512) and its RoPE part (64) are
//! written as one cache row in the cache's encoding (BF16 or `fp8_ds_mla`, the crate's
//! quantizers), the lightning indexer's key (128, RoPE on its first 64 values) as FP8
//! with its scale word; then each new token attends: the indexer scores every cached
//! token `j ≤ p` as `Σ_h w_h · relu(q_h · k_j) · scale_j` (FP8 queries), the top-k
//! (ties to the earlier position) become global token indices, and sparse MLA attends
//! over those rows only in the absorbed form (query projected into the latent space,
//! softmax, output through the value projection). A small MLP, logits over a small
//! vocabulary, greedy sampling.
//!
//! **Batch invariance.** Every value is computed for one token of one request with
//! loops in a fixed order (dot products by ascending index, softmax sums by ascending
//! position), reading only that request's cache: the result cannot depend on batch
//! size, batch mates, chunk size or position in the batch. The cache is reached only
//! through [`KvStore`]: [`unpaged::Contiguous`] (one request, contiguous rows, no reuse:
//! the reference) and [`paged::ModelForward`] (the runtime's pools through the step
//! metadata, as the DSA kernels read them) run the same code. [`trace`] captures the
//! intermediate values of one layer of one token; [`dump`] writes one layer of one step
//! as `.npy` files for external kernels.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dump;
mod npy;
pub mod paged;
pub mod trace;
pub mod unpaged;

use half::bf16;

use dsa_kv_core::config::KvDtype;
use dsa_kv_core::layout::{
    FP8_DS_MLA_ROPE_OFFSET, FP8_DS_MLA_ROW_BYTES, FP8_DS_MLA_SCALE_OFFSET, FP8_DS_MLA_TILE,
};
use dsa_kv_core::ops::mla::quantize_fp8_ds_mla_row;
use dsa_kv_core::ops::quant::{dequantize_fp8_token, e4m3_to_f32, quantize_fp8_token, ScaleFormat};
use dsa_kv_core::rng::SplitMix64;
use trace::{HeadTrace, IndexTrace, Trace, TracePoint, TracedRun};

/// Latent width of an MLA row (`kv_lora_rank`).
pub const LATENT: usize = 512;
/// RoPE part of an MLA row.
pub const ROPE: usize = 64;
/// Indexer key and query width.
pub const INDEX_DIM: usize = 128;
/// Indexer key bytes in the cache (FP8).
pub const INDEX_VALUE_BYTES: usize = INDEX_DIM;

/// The model's dimensions. The cache rows have DeepSeek-V3.2's real sizes; everything
/// the cache does not store is small.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// Decoder layers (the cache must have as many target layers).
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Vocabulary (token ids are taken modulo this).
    pub vocab: usize,
    /// MLA query heads.
    pub heads: usize,
    /// Per-head "nope" query width (projected into the 512-wide latent).
    pub nope_dim: usize,
    /// Per-head value width.
    pub v_dim: usize,
    /// Indexer query heads.
    pub index_heads: usize,
    /// Tokens each query attends to (the indexer's top-k); smaller contexts attend to
    /// every token.
    pub topk: usize,
    /// MLP hidden size.
    pub mlp: usize,
    /// Weight seed.
    pub seed: u64,
}

impl ModelConfig {
    /// A tiny DeepSeek-V3.2: 2 layers, hidden 64, 2 MLA heads, 2 indexer heads, top-64,
    /// vocabulary 256; small enough for the host backend in CI.
    pub fn tiny(seed: u64) -> Self {
        ModelConfig {
            layers: 2,
            hidden: 64,
            vocab: 256,
            heads: 2,
            nope_dim: 32,
            v_dim: 32,
            index_heads: 2,
            topk: 64,
            mlp: 128,
            seed,
        }
    }
}

/// A row-major `[rows, cols]` f32 matrix.
#[derive(Clone, Debug)]
pub(crate) struct Mat {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) w: Vec<f32>,
}

impl Mat {
    /// Uniform in `±sqrt(3 / cols)` (unit variance outputs for unit inputs).
    fn random(rng: &mut SplitMix64, rows: usize, cols: usize) -> Mat {
        let a = (3.0 / cols as f64).sqrt();
        let w = (0..rows * cols)
            .map(|_| ((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * a)
            .map(|x| x as f32)
            .collect();
        Mat { rows, cols, w }
    }

    /// `out = W · x`, each output a dot product by ascending index.
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        debug_assert_eq!(x.len(), self.cols);
        self.w.chunks_exact(self.cols).map(|r| dot(r, x)).collect()
    }

    /// `out = Wᵀ · x`, each output summed by ascending row.
    fn apply_t(&self, x: &[f32]) -> Vec<f32> {
        debug_assert_eq!(x.len(), self.rows);
        let mut out = vec![0f32; self.cols];
        for (r, &xr) in self.w.chunks_exact(self.cols).zip(x) {
            for (o, &w) in out.iter_mut().zip(r) {
                *o += w * xr;
            }
        }
        out
    }
}

/// Dot product by ascending index.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = 0f32;
    for (x, y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}

/// The output of `logits` at `pos`: the greedy token (the lowest id among equal maxima)
/// and the FNV-1a digest of the logits' bits.
pub(crate) fn output_of(logits: &[f32], pos: u32) -> TokenOut {
    let mut greedy = 0;
    for (k, &v) in logits.iter().enumerate() {
        if v > logits[greedy] {
            greedy = k;
        }
    }
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in logits {
        for b in v.to_bits().to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    TokenOut {
        pos,
        greedy: greedy as u32,
        logits_digest: h,
    }
}

/// `x += y`, element by element.
fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn rmsnorm(x: &[f32]) -> Vec<f32> {
    let ms = dot(x, x) / x.len() as f32;
    let r = 1.0 / (ms + 1e-6).sqrt();
    x.iter().map(|v| v * r).collect()
}

/// `max(x, 0)`, +0 for ±0 and NaN-free inputs alike (no platform `max` semantics).
fn relu(x: f32) -> f32 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

/// `e^x` in plain f32 operations (no fused multiply-add, no platform `expf`), so a GPU
/// twin computes the same bits: `x = k·ln 2 + r` (two-part ln 2), a degree-7 Taylor
/// polynomial of `e^r` (Horner), times `2^k`. Below −87 (where `2^k` would be
/// subnormal) it returns 0. Inputs here are `≤ 0` (softmax after the maximum).
pub(crate) fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < -87.0 {
        return 0.0;
    }
    let x = if x > 88.0 { 88.0 } else { x };
    let k = (x * std::f32::consts::LOG2_E).round();
    let r = x - k * 0.693_145_75 - k * 1.428_606_8e-6;
    let mut p = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    p * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

/// The rotation of pair `i` of an `n`-wide RoPE part at `pos`: `(cos θ, sin θ)` with
/// `θ = pos · 10000^(−2i/n)`, computed in f64 and rounded (GPU forwards take a table of
/// these values, so both compute the same bits).
pub(crate) fn rope_cos_sin(pos: u32, i: usize, n: usize) -> (f32, f32) {
    let theta = (pos as f64) * 10000f64.powf(-((2 * i) as f64) / n as f64);
    (theta.cos() as f32, theta.sin() as f32)
}

/// Rotary embedding of `x` (pairs `(2i, 2i+1)`) at `pos`.
fn rope(x: &mut [f32], pos: u32) {
    let n = x.len();
    for i in 0..n / 2 {
        let (c, s) = rope_cos_sin(pos, i, n);
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

#[derive(Clone)]
pub(crate) struct Layer {
    pub(crate) w_dkv: Mat,
    pub(crate) w_kr: Mat,
    pub(crate) w_ik: Mat,
    pub(crate) w_iq: Vec<Mat>,
    pub(crate) w_iw: Mat,
    pub(crate) w_qn: Vec<Mat>,
    pub(crate) w_uk: Vec<Mat>,
    pub(crate) w_qr: Vec<Mat>,
    pub(crate) w_uv: Vec<Mat>,
    pub(crate) w_o: Mat,
    pub(crate) w_1: Mat,
    pub(crate) w_2: Mat,
}

impl Layer {
    fn random(rng: &mut SplitMix64, cfg: &ModelConfig) -> Layer {
        let h = cfg.hidden;
        let heads = |rng: &mut SplitMix64, n: usize, rows: usize, cols: usize| -> Vec<Mat> {
            (0..n).map(|_| Mat::random(rng, rows, cols)).collect()
        };
        Layer {
            w_dkv: Mat::random(rng, LATENT, h),
            w_kr: Mat::random(rng, ROPE, h),
            w_ik: Mat::random(rng, INDEX_DIM, h),
            w_iq: heads(rng, cfg.index_heads, INDEX_DIM, h),
            w_iw: Mat::random(rng, cfg.index_heads, h),
            w_qn: heads(rng, cfg.heads, cfg.nope_dim, h),
            w_uk: heads(rng, cfg.heads, cfg.nope_dim, LATENT),
            w_qr: heads(rng, cfg.heads, ROPE, h),
            w_uv: heads(rng, cfg.heads, cfg.v_dim, LATENT),
            w_o: Mat::random(rng, h, cfg.heads * cfg.v_dim),
            w_1: Mat::random(rng, cfg.mlp, h),
            w_2: Mat::random(rng, h, cfg.mlp),
        }
    }
}

/// Where the MTP draft layer's KV lives in a [`KvStore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftCache {
    /// The store's layer index (0 in a separate draft cache; after the target layers
    /// when the MTP layer shares the target's cache).
    pub layer: usize,
    /// Whether that layer has an indexer cache.
    pub indexer: bool,
}

/// A layer's weights and the cache layer it reads and writes.
#[derive(Clone, Copy)]
struct At<'a> {
    w: &'a Layer,
    cache: usize,
    indexer: bool,
}

/// A draft chain's view: positions from `from` on live in local buffers (computed, not
/// yet in the cache), earlier ones are read from `base`.
struct Overlay<'a> {
    base: &'a dyn KvStore,
    layer: usize,
    from: u32,
    rows: Vec<Vec<u8>>,
    keys: Vec<(Vec<u8>, Vec<u8>)>,
    row_bytes: usize,
}

impl<'a> Overlay<'a> {
    fn new(base: &'a dyn KvStore, layer: usize, from: u32, row_bytes: usize) -> Self {
        Overlay {
            base,
            layer,
            from,
            rows: Vec::new(),
            keys: Vec::new(),
            row_bytes,
        }
    }

    /// Index of local position `pos`, if it is one.
    fn local(&self, layer: usize, pos: u32) -> Result<Option<usize>, ModelError> {
        if layer != self.layer {
            return Err(ModelError::Access(format!(
                "the draft chain reads layer {layer}, not {}",
                self.layer
            )));
        }
        Ok(pos.checked_sub(self.from).map(|i| i as usize))
    }
}

impl KvStore for Overlay<'_> {
    fn write_row(&mut self, layer: usize, pos: u32, row: &[u8]) -> Result<(), ModelError> {
        match self.local(layer, pos)? {
            Some(i) if i == self.rows.len() && row.len() == self.row_bytes => {
                self.rows.push(row.to_vec());
                Ok(())
            }
            _ => Err(ModelError::Access(format!(
                "the draft chain writes position {pos} out of order"
            ))),
        }
    }

    fn write_index_key(
        &mut self,
        layer: usize,
        pos: u32,
        values: &[u8],
        scale: &[u8],
    ) -> Result<(), ModelError> {
        match self.local(layer, pos)? {
            Some(i) if i == self.keys.len() => {
                self.keys.push((values.to_vec(), scale.to_vec()));
                Ok(())
            }
            _ => Err(ModelError::Access(format!(
                "the draft chain writes key {pos} out of order"
            ))),
        }
    }

    fn index_key(&self, layer: usize, pos: u32) -> Result<(&[u8], &[u8]), ModelError> {
        match self.local(layer, pos)? {
            Some(i) => self
                .keys
                .get(i)
                .map(|(v, s)| (v.as_slice(), s.as_slice()))
                .ok_or_else(|| ModelError::Access(format!("draft key {pos} not computed"))),
            None => self.base.index_key(layer, pos),
        }
    }

    fn rows(&self, layer: usize, positions: &[u32]) -> Result<Vec<&[u8]>, ModelError> {
        let split = positions.partition_point(|&p| p < self.from);
        let mut out = self.base.rows(layer, &positions[..split])?;
        for &p in &positions[split..] {
            let i = self.local(layer, p)?.unwrap_or(usize::MAX);
            out.push(
                self.rows
                    .get(i)
                    .ok_or_else(|| ModelError::Access(format!("draft row {p} not computed")))?,
            );
        }
        Ok(out)
    }

    fn global_index(&self, layer: usize, pos: u32) -> Result<i64, ModelError> {
        match self.local(layer, pos)? {
            Some(_) => Err(ModelError::Access(format!(
                "draft position {pos} is not in the cache"
            ))),
            None => self.base.global_index(layer, pos),
        }
    }
}

/// How the cache rows are encoded, and whether a layer has an indexer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheFormat {
    /// MLA row encoding (BF16 or `fp8_ds_mla`).
    pub kv_dtype: KvDtype,
    /// Scale format of the FP8 tiles and indexer keys.
    pub scale_format: ScaleFormat,
    /// Per layer: whether it has an indexer (layers without one attend densely).
    pub indexer: Vec<bool>,
}

impl CacheFormat {
    /// Bytes of one MLA row.
    pub fn row_bytes(&self) -> usize {
        match self.kv_dtype {
            KvDtype::Fp8DsMla => FP8_DS_MLA_ROW_BYTES,
            _ => 2 * (LATENT + ROPE),
        }
    }
}

/// Where a forward reads and writes one request's cache. Positions count from the
/// request's first token.
pub trait KvStore {
    /// Writes the MLA row of position `pos` of `layer`.
    fn write_row(&mut self, layer: usize, pos: u32, row: &[u8]) -> Result<(), ModelError>;
    /// Writes the indexer key (FP8 values, 4-byte scale word) of position `pos`.
    fn write_index_key(
        &mut self,
        layer: usize,
        pos: u32,
        values: &[u8],
        scale: &[u8],
    ) -> Result<(), ModelError>;
    /// Reads the indexer key of position `pos` (values, scale word).
    fn index_key(&self, layer: usize, pos: u32) -> Result<(&[u8], &[u8]), ModelError>;
    /// Reads the MLA rows of `positions` (ascending), in that order.
    fn rows(&self, layer: usize, positions: &[u32]) -> Result<Vec<&[u8]>, ModelError>;
    /// The global token index a sparse MLA kernel is handed for position `pos` (what
    /// [`rows`](Self::rows) reads). The default, for a store without pages: the
    /// position itself.
    fn global_index(&self, layer: usize, pos: u32) -> Result<i64, ModelError> {
        let _ = layer;
        Ok(i64::from(pos))
    }
}

/// A model run's failure.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The cache's shape does not fit the model.
    #[error("the model cannot use this cache: {0}")]
    Cache(String),
    /// A cache access outside what the step's metadata covers.
    #[error("cache access: {0}")]
    Access(String),
}

/// One token's output: the greedy next token and a digest of the logits' bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenOut {
    /// Position of the token the logits follow.
    pub pos: u32,
    /// `argmax` of the logits (the lowest id among equal maxima).
    pub greedy: u32,
    /// FNV-1a of the logits' f32 bit patterns, in vocabulary order.
    pub logits_digest: u64,
}

/// The model: weights from a seed.
pub struct Model {
    pub(crate) cfg: ModelConfig,
    pub(crate) format: CacheFormat,
    pub(crate) embed: Mat,
    pub(crate) layers: Vec<Layer>,
    /// The MTP draft layer (shares the embedding and the output head).
    pub(crate) draft: Layer,
    pub(crate) w_out: Mat,
}

impl Model {
    /// Builds the weights of `cfg` for a cache in `format`.
    pub fn new(cfg: ModelConfig, format: CacheFormat) -> Result<Model, ModelError> {
        if format.indexer.len() != cfg.layers {
            return Err(ModelError::Cache(format!(
                "the cache has {} target layers, the model {}: set model.num_layers = {}",
                format.indexer.len(),
                cfg.layers,
                cfg.layers
            )));
        }
        if cfg.layers == 0 || cfg.vocab == 0 || cfg.topk == 0 || cfg.heads == 0 {
            return Err(ModelError::Cache(format!(
                "layers, vocab, topk and heads must be at least 1 (got {cfg:?})"
            )));
        }
        if !matches!(format.kv_dtype, KvDtype::Bf16 | KvDtype::Fp8DsMla) {
            return Err(ModelError::Cache(format!(
                "MLA rows in {:?}: the reference model writes bf16 or fp8_ds_mla",
                format.kv_dtype
            )));
        }
        let mut rng = SplitMix64(cfg.seed);
        let h = cfg.hidden;
        let embed = Mat::random(&mut rng, cfg.vocab, h);
        let layers: Vec<Layer> = (0..cfg.layers)
            .map(|_| Layer::random(&mut rng, &cfg))
            .collect();
        let w_out = Mat::random(&mut rng, cfg.vocab, h);
        // The MTP draft layer starts from the last decoder layer's weights (an untrained
        // random draft would almost never agree with the target).
        let draft = layers[cfg.layers - 1].clone();
        Ok(Model {
            cfg,
            format,
            embed,
            layers,
            draft,
            w_out,
        })
    }
    /// The dimensions.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Runs one request's new tokens `tokens` at positions `first..` (the cache holds
    /// positions `0..first`): writes their KV to `kv` and returns each token's output.
    pub fn run(
        &self,
        kv: &mut dyn KvStore,
        first: u32,
        tokens: &[u32],
    ) -> Result<Vec<TokenOut>, ModelError> {
        Ok(self.run_hidden(kv, first, tokens)?.0)
    }

    /// [`run`](Self::run), also returning each token's final hidden state (the MTP
    /// draft layer's input).
    pub fn run_hidden(
        &self,
        kv: &mut dyn KvStore,
        first: u32,
        tokens: &[u32],
    ) -> Result<(Vec<TokenOut>, Vec<Vec<f32>>), ModelError> {
        self.run_layers(kv, first, tokens, &[], &mut Vec::new())
    }

    /// [`run_hidden`](Self::run_hidden), also tracing `points` (those that are not
    /// among the new positions are ignored): the traces come in layer order, then
    /// position order. Every output bit is the untraced run's.
    pub fn run_traced(
        &self,
        kv: &mut dyn KvStore,
        first: u32,
        tokens: &[u32],
        points: &[TracePoint],
    ) -> Result<TracedRun, ModelError> {
        let mut traces = Vec::new();
        let (outputs, hidden) = self.run_layers(kv, first, tokens, points, &mut traces)?;
        Ok(TracedRun {
            outputs,
            hidden,
            traces,
        })
    }

    fn run_layers(
        &self,
        kv: &mut dyn KvStore,
        first: u32,
        tokens: &[u32],
        points: &[TracePoint],
        traces: &mut Vec<Trace>,
    ) -> Result<(Vec<TokenOut>, Vec<Vec<f32>>), ModelError> {
        let mut xs: Vec<Vec<f32>> = tokens.iter().map(|&t| self.embedding(t)).collect();
        for (l, layer) in self.layers.iter().enumerate() {
            let at = At {
                w: layer,
                cache: l,
                indexer: self.format.indexer[l],
            };
            let normed: Vec<Vec<f32>> = xs.iter().map(|x| rmsnorm(x)).collect();
            // Every new token's KV first: a token attends to the new tokens before it.
            for (i, xn) in normed.iter().enumerate() {
                self.write_kv(kv, at, xn, first + i as u32)?;
            }
            for (i, xn) in normed.iter().enumerate() {
                let point = TracePoint {
                    layer: l,
                    pos: first + i as u32,
                };
                let mut trace =
                    (!points.is_empty() && points.contains(&point)).then(|| Trace::new(point));
                let attn = self.attend(kv, at, xn, point.pos, trace.as_mut())?;
                traces.extend(trace);
                add(&mut xs[i], &attn);
                self.mlp(layer, &mut xs[i]);
            }
        }
        let outs = xs
            .iter()
            .enumerate()
            .map(|(i, x)| self.output(x, first + i as u32))
            .collect();
        Ok((outs, xs))
    }

    fn embedding(&self, t: u32) -> Vec<f32> {
        let r = t as usize % self.cfg.vocab;
        self.embed.w[r * self.cfg.hidden..(r + 1) * self.cfg.hidden].to_vec()
    }

    fn mlp(&self, layer: &Layer, x: &mut [f32]) {
        let hmid = layer.w_1.apply(&rmsnorm(x));
        let hmid: Vec<f32> = hmid.into_iter().map(relu).collect();
        add(x, &layer.w_2.apply(&hmid));
    }

    /// The logits of final hidden state `x`: greedy token and digest.
    fn output(&self, x: &[f32], pos: u32) -> TokenOut {
        output_of(&self.w_out.apply(&rmsnorm(x)), pos)
    }

    fn draft_at(&self, cache: DraftCache) -> At<'_> {
        At {
            w: &self.draft,
            cache: cache.layer,
            indexer: cache.indexer,
        }
    }

    /// Writes the MTP draft layer's KV of `tokens` at positions `first..` into `cache`. The
    /// draft layer's KV of a position depends only on its token and position, so it is
    /// the same for every request that shares the prefix.
    pub fn draft_write(
        &self,
        kv: &mut dyn KvStore,
        cache: DraftCache,
        first: u32,
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        let at = self.draft_at(cache);
        for (i, &t) in tokens.iter().enumerate() {
            self.write_kv(kv, at, &rmsnorm(&self.embedding(t)), first + i as u32)?;
        }
        Ok(())
    }

    /// The MTP draft layer's `k` proposals for positions `last + 2 ..`: `hidden` is the
    /// target's final hidden state at `last`, `next` the token sampled there (position
    /// `last + 1`); `cache` in `kv` holds the draft KV of positions
    /// `0..=last`. Each proposal is the draft layer's greedy token; the chain feeds each
    /// proposal back with the draft's own hidden state (its KV is computed here, not
    /// written). Deterministic and batch-invariant like the target.
    pub fn propose(
        &self,
        kv: &dyn KvStore,
        cache: DraftCache,
        last: u32,
        hidden: &[f32],
        next: u32,
        k: usize,
    ) -> Result<Vec<u32>, ModelError> {
        let at = self.draft_at(cache);
        let mut local = Overlay::new(kv, cache.layer, last + 1, self.format.row_bytes());
        let mut h = hidden.to_vec();
        let mut tok = next;
        let mut out = Vec::with_capacity(k);
        for i in 0..k as u32 {
            let pos = last + 1 + i;
            self.write_kv(&mut local, at, &rmsnorm(&self.embedding(tok)), pos)?;
            let mut x = self.embedding(tok);
            add(&mut x, &rmsnorm(&h));
            let attn = self.attend(&local, at, &rmsnorm(&x), pos, None)?;
            add(&mut x, &attn);
            self.mlp(&self.draft, &mut x);
            tok = self.output(&x, pos).greedy;
            out.push(tok);
            h = x;
        }
        Ok(out)
    }

    fn write_kv(
        &self,
        kv: &mut dyn KvStore,
        at: At<'_>,
        xn: &[f32],
        pos: u32,
    ) -> Result<(), ModelError> {
        let (l, layer) = (at.cache, at.w);
        let mut row = layer.w_dkv.apply(xn);
        let mut pe = layer.w_kr.apply(xn);
        rope(&mut pe, pos);
        row.extend_from_slice(&pe);
        let row = to_bf16(&row);
        let bytes = match self.format.kv_dtype {
            KvDtype::Fp8DsMla => {
                let mut out = vec![0u8; FP8_DS_MLA_ROW_BYTES];
                quantize_fp8_ds_mla_row(&row, self.format.scale_format, &mut out);
                out
            }
            _ => row.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        };
        kv.write_row(l, pos, &bytes)?;
        if at.indexer {
            let mut k = layer.w_ik.apply(xn);
            rope(&mut k[..ROPE], pos);
            let (mut values, mut scale) = ([0u8; INDEX_VALUE_BYTES], [0u8; 4]);
            quantize_fp8_token(
                &to_bf16(&k),
                self.format.scale_format,
                &mut values,
                &mut scale,
            );
            kv.write_index_key(l, pos, &values, &scale)?;
        }
        Ok(())
    }

    /// The positions token `pos` attends to, ascending: the indexer's top-k of `0..=pos`
    /// (every position when there are at most `topk`, or the layer has no indexer).
    /// A `trace` gets the indexer's queries, weights and scores (computed also when
    /// every position is selected).
    fn select(
        &self,
        kv: &dyn KvStore,
        at: At<'_>,
        xn: &[f32],
        pos: u32,
        trace: Option<&mut Trace>,
    ) -> Result<Vec<u32>, ModelError> {
        let (l, layer) = (at.cache, at.w);
        let n = pos as usize + 1;
        if !at.indexer || (n <= self.cfg.topk && trace.is_none()) {
            return Ok((0..=pos).collect());
        }
        let mut index = trace.is_some().then(IndexTrace::default);
        // FP8 queries (quantized and read back as the kernel reads them), weights.
        let qs: Vec<Vec<f32>> = layer
            .w_iq
            .iter()
            .map(|w| {
                let mut q = w.apply(xn);
                rope(&mut q[..ROPE], pos);
                let (mut v, mut s) = ([0u8; INDEX_DIM], [0u8; 4]);
                quantize_fp8_token(&to_bf16(&q), self.format.scale_format, &mut v, &mut s);
                if let Some(t) = index.as_mut() {
                    t.q_fp8.push(v);
                    t.q_scale.push(s);
                }
                let mut out = vec![0f32; INDEX_DIM];
                dequantize_fp8_token(&v, &s, &mut out);
                out
            })
            .collect();
        let w = layer.w_iw.apply(xn);
        let mut scored = Vec::with_capacity(n);
        let mut k = [0f32; INDEX_DIM];
        for j in 0..=pos {
            let (values, scale) = kv.index_key(l, j)?;
            for (o, &b) in k.iter_mut().zip(values) {
                *o = e4m3_to_f32(b);
            }
            let scale = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]);
            let mut s = 0f32;
            for (q, wh) in qs.iter().zip(&w) {
                s += wh * relu(dot(q, &k));
            }
            scored.push((s * scale, j));
        }
        if let (Some(trace), Some(mut t)) = (trace, index) {
            t.weights = w;
            t.logits = scored.iter().map(|&(s, _)| s).collect();
            trace.index = Some(t);
        }
        if n <= self.cfg.topk {
            return Ok((0..=pos).collect());
        }
        // Highest score first; equal scores: the earlier position.
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut top: Vec<u32> = scored[..self.cfg.topk].iter().map(|&(_, j)| j).collect();
        top.sort_unstable();
        Ok(top)
    }

    fn attend(
        &self,
        kv: &dyn KvStore,
        at: At<'_>,
        xn: &[f32],
        pos: u32,
        mut trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, ModelError> {
        let (l, layer) = (at.cache, at.w);
        let sel = self.select(kv, at, xn, pos, trace.as_deref_mut())?;
        let rows: Vec<(Vec<f32>, Vec<f32>)> = kv
            .rows(l, &sel)?
            .into_iter()
            .map(|r| self.decode_row(r))
            .collect();
        let scale = 1.0 / ((self.cfg.nope_dim + ROPE) as f32).sqrt();
        if let Some(t) = trace.as_deref_mut() {
            t.global = sel
                .iter()
                .map(|&p| kv.global_index(l, p))
                .collect::<Result<_, _>>()?;
            t.selected = sel;
            t.softmax_scale = scale;
        }
        let mut heads = Vec::with_capacity(self.cfg.heads * self.cfg.v_dim);
        for h in 0..self.cfg.heads {
            let q_lat = layer.w_uk[h].apply_t(&layer.w_qn[h].apply(xn));
            let mut q_pe = layer.w_qr[h].apply(xn);
            rope(&mut q_pe, pos);
            let scores: Vec<f32> = rows
                .iter()
                .map(|(lat, pe)| (dot(&q_lat, lat) + dot(&q_pe, pe)) * scale)
                .collect();
            let m = scores
                .iter()
                .fold(f32::NEG_INFINITY, |m, &s| if s > m { s } else { m });
            let e: Vec<f32> = scores.iter().map(|s| exp(s - m)).collect();
            let mut sum = 0f32;
            for v in &e {
                sum += v;
            }
            let mut o_lat = vec![0f32; LATENT];
            for ((lat, _), ej) in rows.iter().zip(&e) {
                let p = ej / sum;
                for (o, v) in o_lat.iter_mut().zip(lat) {
                    *o += p * v;
                }
            }
            heads.extend(layer.w_uv[h].apply(&o_lat));
            if let Some(t) = trace.as_deref_mut() {
                t.heads.push(HeadTrace { q_lat, q_pe, o_lat });
            }
        }
        let out = layer.w_o.apply(&heads);
        if let Some(t) = trace {
            t.attn_out.clone_from(&out);
        }
        Ok(out)
    }

    /// A cache row as `(latent, rope)` in f32.
    fn decode_row(&self, r: &[u8]) -> (Vec<f32>, Vec<f32>) {
        let bf = |b: &[u8]| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        match self.format.kv_dtype {
            KvDtype::Fp8DsMla => {
                let lat = (0..LATENT)
                    .map(|i| {
                        let so = FP8_DS_MLA_SCALE_OFFSET + 4 * (i / FP8_DS_MLA_TILE);
                        let s = f32::from_le_bytes([r[so], r[so + 1], r[so + 2], r[so + 3]]);
                        e4m3_to_f32(r[i]) * s
                    })
                    .collect();
                let pe = (0..ROPE)
                    .map(|i| bf(&r[FP8_DS_MLA_ROPE_OFFSET + 2 * i..]))
                    .collect();
                (lat, pe)
            }
            _ => {
                let lat = (0..LATENT).map(|i| bf(&r[2 * i..])).collect();
                let pe = (0..ROPE).map(|i| bf(&r[2 * (LATENT + i)..])).collect();
                (lat, pe)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::unpaged::{generate, Contiguous};
    use super::*;

    fn format(kv_dtype: KvDtype) -> CacheFormat {
        CacheFormat {
            kv_dtype,
            scale_format: ScaleFormat::Ue8m0,
            indexer: vec![true, false],
        }
    }

    /// Chunking a prompt (any split) gives the bits of one pass: batch invariance.
    #[test]
    fn chunks_give_the_bits_of_one_pass() {
        let m = Model::new(ModelConfig::tiny(3), format(KvDtype::Fp8DsMla)).unwrap();
        let prompt: Vec<u32> = (0..150).map(|i| (i * 13 + 5) % 300).collect();
        let mut one = Contiguous::new(&m.format);
        let whole = m.run(&mut one, 0, &prompt).unwrap();
        for split in [[1, 70], [64, 65], [100, 149]] {
            let mut kv = Contiguous::new(&m.format);
            let mut outs = m.run(&mut kv, 0, &prompt[..split[0]]).unwrap();
            outs.extend(
                m.run(&mut kv, split[0] as u32, &prompt[split[0]..split[1]])
                    .unwrap(),
            );
            outs.extend(
                m.run(&mut kv, split[1] as u32, &prompt[split[1]..])
                    .unwrap(),
            );
            assert_eq!(outs, whole, "split at {split:?}");
        }
        // Past top-64 the indexer selects: the logits are not those of dense attention.
        let dense = Model::new(
            ModelConfig {
                topk: 1000,
                ..ModelConfig::tiny(3)
            },
            format(KvDtype::Fp8DsMla),
        )
        .unwrap();
        let all = dense
            .run(&mut Contiguous::new(&m.format), 0, &prompt)
            .unwrap();
        assert_eq!(
            all[..64],
            whole[..64],
            "up to top-k every token is selected"
        );
        assert_ne!(all[149], whole[149], "sparse attention is exercised");
    }

    /// The row encoding reaches the logits; generation is deterministic.
    #[test]
    fn the_encoding_matters_and_runs_repeat() {
        let prompt: Vec<u32> = (0..90).collect();
        let g = |d| {
            let m = Model::new(ModelConfig::tiny(3), format(d)).unwrap();
            generate(&m, &format(d), &prompt, 5).unwrap()
        };
        assert_eq!(g(KvDtype::Bf16), g(KvDtype::Bf16));
        assert_ne!(
            g(KvDtype::Bf16).outputs.last(),
            g(KvDtype::Fp8DsMla).outputs.last()
        );
        assert_eq!(g(KvDtype::Bf16).tokens.len(), 5);
    }

    #[test]
    fn a_cache_it_cannot_use_is_refused() {
        let e = |f| {
            Model::new(ModelConfig::tiny(3), f)
                .err()
                .unwrap()
                .to_string()
        };
        assert!(e(format(KvDtype::Nvfp4)).contains("bf16 or fp8_ds_mla"));
        let three = CacheFormat {
            indexer: vec![true; 3],
            ..format(KvDtype::Bf16)
        };
        assert!(e(three).contains("set model.num_layers = 2"));
    }
}
