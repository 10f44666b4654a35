//! [`Model`]: the weights and the forward of one request's new tokens through a
//! [`KvStore`] (per layer: every new token's KV first, then each token's indexer top-k,
//! sparse MLA over the selected rows and MLP), and [`TokenOut`], what a token's logits
//! come to. See the crate docs for the math and why it is batch-invariant.

use half::bf16;

use super::checkpoint::{HfConfig, HfModel};
use super::config::{ModelConfig, INDEX_DIM, INDEX_VALUE_BYTES, LATENT, ROPE};
use super::math::{add, dot, exp, relu, rmsnorm32, rope, sum32, to_bf16, Lanes32, Mat, SumOrder};
use super::trace::{HeadTrace, IndexTrace, Trace, TracePoint, TracedRun};
use super::weights::Layer;
use super::{CacheFormat, KvStore, ModelError};
use dsa_kv_core::config::KvDtype;
use dsa_kv_core::layout::{
    FP8_DS_MLA_ROPE_OFFSET, FP8_DS_MLA_ROW_BYTES, FP8_DS_MLA_SCALE_OFFSET, FP8_DS_MLA_TILE,
};
use dsa_kv_core::ops::mla::quantize_fp8_ds_mla_row;
use dsa_kv_core::ops::quant::{dequantize_fp8_token, e4m3_to_f32, quantize_fp8_token};
use dsa_kv_core::rng::SplitMix64;

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

/// A layer's weights and the cache layer it reads and writes.
#[derive(Clone, Copy)]
pub(crate) struct At<'a> {
    pub(crate) w: &'a Layer,
    pub(crate) cache: usize,
    pub(crate) indexer: bool,
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
    /// A checkpoint's model ([`Model::from_checkpoint`]): it runs instead of the built-in
    /// layers (`layers` is empty then).
    pub(crate) hf: Option<Box<HfModel>>,
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
            hf: None,
        })
    }

    /// The model of the Hugging Face checkpoint in `dir` (`config.json` and
    /// safetensors of `DeepseekV32ForCausalLM` or `GlmMoeDsaForCausalLM`; see
    /// [`checkpoint`](crate::checkpoint)) for a cache in `format`, whose per-layer
    /// indexers must be the checkpoint's ([`HfConfig::indexer`]). Its
    /// [`config`](Self::config) reports the checkpoint's dimensions (`topk` is
    /// `index_topk`, `mlp` the dense layers' width, `seed` 0).
    pub fn from_checkpoint(
        dir: &std::path::Path,
        format: CacheFormat,
    ) -> Result<Model, ModelError> {
        let hf = HfModel::load(dir)?;
        let c = &hf.cfg;
        if format.indexer != c.indexer {
            return Err(ModelError::Cache(format!(
                "the cache's indexer layers are {:?}, the checkpoint's {:?}: set \
                 model.num_layers = {} and the indexer layers to the checkpoint's",
                format.indexer, c.indexer, c.layers
            )));
        }
        if !matches!(format.kv_dtype, KvDtype::Bf16 | KvDtype::Fp8DsMla) {
            return Err(ModelError::Cache(format!(
                "MLA rows in {:?}: the reference model writes bf16 or fp8_ds_mla",
                format.kv_dtype
            )));
        }
        let cfg = ModelConfig {
            layers: c.layers,
            hidden: c.hidden,
            vocab: c.vocab,
            heads: c.heads,
            nope_dim: c.nope_dim,
            v_dim: c.v_dim,
            index_heads: c.index_heads,
            topk: c.index_topk,
            mlp: c.intermediate,
            seed: 0,
        };
        let empty = || Mat {
            rows: 0,
            cols: 0,
            w: Vec::new(),
        };
        Ok(Model {
            cfg,
            format,
            embed: empty(),
            layers: Vec::new(),
            draft: Layer::empty(),
            w_out: empty(),
            hf: Some(Box::new(hf)),
        })
    }

    /// The logits after final hidden state `x` ([`run_hidden`](Self::run_hidden)): the
    /// output head over the final norm.
    pub fn logits(&self, x: &[f32]) -> Vec<f32> {
        match &self.hf {
            Some(hf) => hf.logits(x),
            None => self.w_out.apply32(&rmsnorm32(x)),
        }
    }

    /// The checkpoint's configuration, for a model loaded from one.
    pub fn checkpoint(&self) -> Option<&HfConfig> {
        self.hf.as_ref().map(|h| &h.cfg)
    }

    /// The dimensions.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The cache format the model was built for.
    pub fn format(&self) -> &CacheFormat {
        &self.format
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
        if let Some(hf) = &self.hf {
            return hf.run(&self.format, kv, first, tokens, points, traces);
        }
        let mut xs: Vec<Vec<f32>> = tokens.iter().map(|&t| self.embedding(t)).collect();
        for (l, layer) in self.layers.iter().enumerate() {
            let at = At {
                w: layer,
                cache: l,
                indexer: self.format.indexer[l],
            };
            let normed: Vec<Vec<f32>> = xs.iter().map(|x| rmsnorm32(x)).collect();
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

    pub(crate) fn embedding(&self, t: u32) -> Vec<f32> {
        let r = t as usize % self.cfg.vocab;
        self.embed.w[r * self.cfg.hidden..(r + 1) * self.cfg.hidden].to_vec()
    }

    pub(crate) fn mlp(&self, layer: &Layer, x: &mut [f32]) {
        let hmid = layer.w_1.apply32(&rmsnorm32(x));
        let hmid: Vec<f32> = hmid.into_iter().map(relu).collect();
        add(x, &layer.w_2.apply32(&hmid));
    }

    /// The logits of final hidden state `x`: greedy token and digest.
    pub(crate) fn output(&self, x: &[f32], pos: u32) -> TokenOut {
        output_of(&self.logits(x), pos)
    }

    pub(crate) fn write_kv(
        &self,
        kv: &mut dyn KvStore,
        at: At<'_>,
        xn: &[f32],
        pos: u32,
    ) -> Result<(), ModelError> {
        let (l, layer) = (at.cache, at.w);
        let mut row = layer.w_dkv.apply32(xn);
        let mut pe = layer.w_kr.apply32(xn);
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
            let mut k = layer.w_ik.apply32(xn);
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
                let mut q = w.apply32(xn);
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
        let w = layer.w_iw.apply32(xn);
        let scored = index_scores(kv, l, pos, &qs, &w, SumOrder::Lanes32)?;
        if let (Some(trace), Some(mut t)) = (trace, index) {
            t.weights = w;
            t.logits = scored.iter().map(|&(s, _)| s).collect();
            trace.index = Some(t);
        }
        if n <= self.cfg.topk {
            return Ok((0..=pos).collect());
        }
        Ok(top_k(scored, self.cfg.topk))
    }

    pub(crate) fn attend(
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
            let q_lat = layer.w_uk[h].apply_t(&layer.w_qn[h].apply32(xn));
            let mut q_pe = layer.w_qr[h].apply32(xn);
            rope(&mut q_pe, pos);
            let o_lat = attend_head(&q_lat, &q_pe, &rows, scale, SumOrder::Lanes32);
            heads.extend(layer.w_uv[h].apply32(&o_lat));
            if let Some(t) = trace.as_deref_mut() {
                t.heads.push(HeadTrace { q_lat, q_pe, o_lat });
            }
        }
        let out = layer.w_o.apply32(&heads);
        if let Some(t) = trace {
            t.attn_out.clone_from(&out);
        }
        Ok(out)
    }

    /// A cache row as `(latent, rope)` in f32.
    fn decode_row(&self, r: &[u8]) -> (Vec<f32>, Vec<f32>) {
        decode_row(&self.format, r)
    }
}

/// The indexer's score of every causal position `j ≤ pos` of cache layer `l`:
/// `Σ_h w_h · relu(q_h · k_j) · scale_j` (the FP8 key and its scale read from `kv`),
/// with its position. Each 128-wide `q_h · k_j` is summed in `order` ([`dot32`]'s warp
/// order for the reference model, ascending for a checkpoint's); the heads always by
/// ascending `h`.
///
/// [`dot32`]: super::math::dot32
pub(crate) fn index_scores(
    kv: &dyn KvStore,
    l: usize,
    pos: u32,
    qs: &[Vec<f32>],
    w: &[f32],
    order: SumOrder,
) -> Result<Vec<(f32, u32)>, ModelError> {
    let mut scored = Vec::with_capacity(pos as usize + 1);
    let mut k = [0f32; INDEX_DIM];
    for j in 0..=pos {
        let (values, scale) = kv.index_key(l, j)?;
        for (o, &b) in k.iter_mut().zip(values) {
            *o = e4m3_to_f32(b);
        }
        let scale = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]);
        let mut s = 0f32;
        for (q, wh) in qs.iter().zip(w) {
            let d = match order {
                SumOrder::Ascending => dot(q, &k),
                SumOrder::Lanes32 => super::math::dot32(q, &k),
            };
            s += wh * relu(d);
        }
        scored.push((s * scale, j));
    }
    Ok(scored)
}

/// The `k` best-scored positions, ascending (highest score first; equal scores: the
/// earlier position).
pub(crate) fn top_k(mut scored: Vec<(f32, u32)>, k: usize) -> Vec<u32> {
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut top: Vec<u32> = scored[..k].iter().map(|&(_, j)| j).collect();
    top.sort_unstable();
    top
}

/// One head's attention over decoded `rows` (latent, RoPE part) in the absorbed form:
/// `Σ_j softmax_j(scale · (q_lat · latent_j + q_pe · rope_j)) · latent_j` (512 wide).
///
/// In [`SumOrder::Lanes32`] (the reference model) a row's score is one 576-term
/// [`Lanes32`] sum (the latent's 512 products, then the RoPE part's 64: product `i` of
/// the concatenation to lane `i mod 32`) and the softmax denominator a [`sum32`] over
/// the rows; in [`SumOrder::Ascending`] (a checkpoint's) `q_lat · latent` and
/// `q_pe · rope` are ascending dots added, the denominator ascending. Either way the
/// maximum is a comparison fold and each output element sums its rows by ascending
/// selected position.
pub(crate) fn attend_head(
    q_lat: &[f32],
    q_pe: &[f32],
    rows: &[(Vec<f32>, Vec<f32>)],
    scale: f32,
    order: SumOrder,
) -> Vec<f32> {
    let scores: Vec<f32> = rows
        .iter()
        .map(|(lat, pe)| match order {
            SumOrder::Ascending => (dot(q_lat, lat) + dot(q_pe, pe)) * scale,
            SumOrder::Lanes32 => {
                let mut l = Lanes32::new();
                l.add_dot(q_lat, lat);
                l.add_dot(q_pe, pe);
                l.sum() * scale
            }
        })
        .collect();
    let m = scores
        .iter()
        .fold(f32::NEG_INFINITY, |m, &s| if s > m { s } else { m });
    let e: Vec<f32> = scores.iter().map(|s| exp(s - m)).collect();
    let sum = match order {
        SumOrder::Ascending => {
            let mut sum = 0f32;
            for v in &e {
                sum += v;
            }
            sum
        }
        SumOrder::Lanes32 => sum32(&e),
    };
    let mut o_lat = vec![0f32; LATENT];
    for ((lat, _), ej) in rows.iter().zip(&e) {
        let p = ej / sum;
        for (o, v) in o_lat.iter_mut().zip(lat) {
            *o += p * v;
        }
    }
    o_lat
}

/// A cache row of `format` as `(latent, rope)` in f32.
pub(crate) fn decode_row(format: &CacheFormat, r: &[u8]) -> (Vec<f32>, Vec<f32>) {
    let bf = |b: &[u8]| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    match format.kv_dtype {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::unpaged::{generate, Contiguous};
    use dsa_kv_core::ops::quant::ScaleFormat;

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
