//! [`V4Model`]: the weights and the forward of one request's new tokens through a
//! [`V4Store`]; the math is in the module docs.

use dsa_kv_core::config::{IndexerDtype, V4Spec};
use dsa_kv_core::ops::model1::{dequantize_model1_row, quantize_model1_row, MODEL1_NOPE};
use dsa_kv_core::rng::SplitMix64;

use super::store::{
    decode_index_key, encode_index_key, fp8_query, Model1Row, StateKind, V4Contiguous, V4Store,
    INDEX_ENTRY_BYTES,
};
use crate::checkpoint::HfV4Model;
use crate::math::{add, dot8, exp, relu, rmsnorm8, rope, rope_cos_sin, to_bf16, Mat};
use crate::model::{output_of, top_k};
use crate::unpaged::Generation;
use crate::{ModelError, TokenOut, INDEX_DIM, LATENT, ROPE};

/// The V4 model's dimensions. The cache rows have V4's real sizes (a 512-wide latent,
/// 128-wide indexer keys, the 128-token window); everything else is small.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct V4ModelConfig {
    /// Per target layer: 0 (window only), 4 or 128.
    pub ratios: Vec<u32>,
    /// Whether the model has an MTP draft layer (window only, after the target layers).
    pub mtp: bool,
    /// Hidden size.
    pub hidden: usize,
    /// Vocabulary (token ids are taken modulo this).
    pub vocab: usize,
    /// Attention heads.
    pub heads: usize,
    /// Indexer heads.
    pub index_heads: usize,
    /// Compressed entries a ratio-4 query attends (the indexer's top-k; a positive
    /// multiple of 64, as the sparse decode takes).
    pub topk: u32,
    /// Raw positions every layer attends, the query's included.
    pub window: u32,
    /// MLP hidden size.
    pub mlp: usize,
    /// Weight seed.
    pub seed: u64,
    /// Values per position of the target state the MTP layer reads (a checkpoint's
    /// published MTP: `hc_mult × hidden`, kept by the cache as BF16,
    /// [`V4Spec::mtp_input_width`]); 0 for the built-in model, whose MTP layer reads the
    /// token only.
    pub mtp_input: usize,
}

impl V4ModelConfig {
    /// A tiny V4: one layer of each kind (`[0, 4, 128]`), the MTP layer, hidden 64, 2
    /// heads, 2 indexer heads, top-64, the 128-token window, vocabulary 256.
    pub fn tiny(seed: u64) -> Self {
        V4ModelConfig {
            ratios: vec![0, 4, 128],
            mtp: true,
            hidden: 64,
            vocab: 256,
            heads: 2,
            index_heads: 2,
            topk: 64,
            window: 128,
            mlp: 128,
            seed,
            mtp_input: 0,
        }
    }

    /// The cache structure of this model, for [`V4Plan`](dsa_kv_core::layout::V4Plan).
    /// Its `num_q_heads` is the sparse decode kernel's (64): the cache does not depend on
    /// the head count.
    pub fn spec(&self) -> Result<V4Spec, ModelError> {
        let spec = V4Spec {
            name: format!("tiny V4 {:?}", self.ratios),
            compress_ratios: self.ratios.clone(),
            num_mtp_layers: u32::from(self.mtp),
            window: self.window,
            index_topk: self.topk,
            num_q_heads: 64,
            indexer_dtype: IndexerDtype::Fp8,
            mtp_input_width: if self.mtp {
                u32::try_from(self.mtp_input).map_err(|_| {
                    ModelError::Cache(format!("an MTP input of {} values", self.mtp_input))
                })?
            } else {
                0
            },
        };
        spec.validate()
            .map_err(|e| ModelError::Cache(format!("not a V4 structure: {e}")))?;
        Ok(spec)
    }
}

/// One token's attention in one layer, as a sparse decode kernel sees it: the positions
/// of the window rows and the compressed entries read (in that order), and per head the
/// bf16 query (RoPE applied), the sink logit and the output over the rows (512 wide,
/// before the inverse RoPE).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct V4Trace {
    /// The layer.
    pub layer: usize,
    /// The query's position.
    pub pos: u32,
    /// Window positions read, ascending.
    pub window: Vec<u32>,
    /// Compressed entries read, ascending.
    pub entries: Vec<u32>,
    /// The softmax scale (`512^−½`).
    pub softmax_scale: f32,
    /// Per head: the sink logit.
    pub sink: Vec<f32>,
    /// Per head: the query (values of bf16).
    pub q: Vec<Vec<f32>>,
    /// Per head: the attention output.
    pub out: Vec<Vec<f32>>,
}

/// A compressor: per token a `[kv | score]` state row of `coff · width` values each.
#[derive(Clone)]
pub(super) struct Compressor {
    pub(super) ratio: u32,
    pub(super) width: usize,
    /// 2 when groups overlap (ratio 4), else 1.
    pub(super) coff: usize,
    pub(super) w_kv: Mat,
    pub(super) w_score: Mat,
    /// `[ratio, coff · width]`: the score bias of a token's place in its group.
    pub(super) ape: Mat,
}

impl Compressor {
    fn random(rng: &mut SplitMix64, ratio: u32, width: usize, hidden: usize) -> Compressor {
        let coff = if ratio == 4 { 2 } else { 1 };
        Compressor {
            ratio,
            width,
            coff,
            w_kv: Mat::random(rng, coff * width, hidden),
            w_score: Mat::random(rng, coff * width, hidden),
            ape: Mat::random(rng, ratio as usize, coff * width),
        }
    }

    /// The state row of the token at `p` (normed hidden state `xn`).
    fn state_row(&self, xn: &[f32], p: u32) -> Vec<f32> {
        let n = self.coff * self.width;
        let mut row = self.w_kv.apply8(xn);
        let mut score = self.w_score.apply8(xn);
        let r = (p % self.ratio) as usize;
        add(&mut score, &self.ape.w[r * n..(r + 1) * n]);
        row.extend(score);
        row
    }

    /// Compressed entry `w`, from the state rows in `kv`: per channel, the softmax of
    /// the slots' scores weighting their kv values, slots in ascending token order.
    fn entry(
        &self,
        kv: &dyn V4Store,
        layer: usize,
        kind: StateKind,
        w: u32,
    ) -> Result<Vec<f32>, ModelError> {
        let (r, d) = (self.ratio, self.width);
        // (state row, which half of it).
        let mut slots = Vec::with_capacity(2 * r as usize);
        if self.coff == 2 && w > 0 {
            for t in r * (w - 1)..r * w {
                slots.push((kv.state(layer, kind, t)?, 0));
            }
        }
        for t in r * w..r * (w + 1) {
            slots.push((kv.state(layer, kind, t)?, self.coff - 1));
        }
        let scores = self.coff * d;
        let mut out = vec![0f32; d];
        for (c, o) in out.iter_mut().enumerate() {
            let m = slots.iter().fold(f32::NEG_INFINITY, |m, (row, h)| {
                let s = row[scores + h * d + c];
                if s > m {
                    s
                } else {
                    m
                }
            });
            let (mut sum, mut acc) = (0f32, 0f32);
            for (row, h) in &slots {
                let e = exp(row[scores + h * d + c] - m);
                sum += e;
                acc += e * row[h * d + c];
            }
            *o = acc / sum;
        }
        Ok(out)
    }
}

/// The indexer of a ratio-4 layer.
#[derive(Clone)]
pub(super) struct Indexer {
    pub(super) comp: Compressor,
    pub(super) w_q: Vec<Mat>,
    pub(super) w_w: Mat,
}

/// One layer's weights.
#[derive(Clone)]
pub(super) struct V4Layer {
    pub(super) ratio: u32,
    pub(super) w_kv: Mat,
    pub(super) w_q: Vec<Mat>,
    pub(super) sink: Vec<f32>,
    pub(super) w_o: Mat,
    pub(super) w_1: Mat,
    pub(super) w_2: Mat,
    pub(super) comp: Option<Compressor>,
    pub(super) index: Option<Indexer>,
}

impl V4Layer {
    fn random(rng: &mut SplitMix64, ratio: u32, cfg: &V4ModelConfig) -> V4Layer {
        let h = cfg.hidden;
        let w_kv = Mat::random(rng, LATENT, h);
        let w_q = (0..cfg.heads)
            .map(|_| Mat::random(rng, LATENT, h))
            .collect();
        let sink = Mat::random(rng, 1, cfg.heads).w;
        let w_o = Mat::random(rng, h, cfg.heads * LATENT);
        let w_1 = Mat::random(rng, cfg.mlp, h);
        let w_2 = Mat::random(rng, h, cfg.mlp);
        let comp = (ratio > 0).then(|| Compressor::random(rng, ratio, LATENT, h));
        let index = (ratio == 4).then(|| Indexer {
            comp: Compressor::random(rng, 4, INDEX_DIM, h),
            w_q: (0..cfg.index_heads)
                .map(|_| Mat::random(rng, INDEX_DIM, h))
                .collect(),
            w_w: Mat::random(rng, cfg.index_heads, h),
        });
        V4Layer {
            ratio,
            w_kv,
            w_q,
            sink,
            w_o,
            w_1,
            w_2,
            comp,
            index,
        }
    }
}

/// The V4 model: weights from a seed, or a `deepseek_v4` checkpoint's
/// ([`V4Model::from_checkpoint`]).
pub struct V4Model {
    pub(super) cfg: V4ModelConfig,
    pub(super) embed: Mat,
    pub(super) layers: Vec<V4Layer>,
    /// The MTP draft layer (window only; shares the embedding and the output head).
    pub(super) draft: V4Layer,
    pub(super) w_out: Mat,
    /// A checkpoint's model: it runs instead of the built-in weights (whose fields are
    /// then empty; its MTP layer, if any, is the checkpoint's).
    pub(super) hf: Option<Box<HfV4Model>>,
}

/// The bf16 MODEL1 row of `x` (448 NoPE, 64 RoPE values).
pub(crate) fn model1(x: &[f32]) -> Model1Row {
    let mut row = Model1Row {
        data: [0; dsa_kv_core::ops::model1::MODEL1_DATA],
        scales: [0; dsa_kv_core::ops::model1::MODEL1_SCALES],
    };
    quantize_model1_row(&to_bf16(x), &mut row.data, &mut row.scales);
    row
}

/// The inverse rotation of [`rope`] at `pos`.
fn rope_inverse(x: &mut [f32], pos: u32) {
    let n = x.len();
    for i in 0..n / 2 {
        let (c, s) = rope_cos_sin(pos, i, n);
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * c + b * s;
        x[2 * i + 1] = b * c - a * s;
    }
}

/// One head over `rows` (keys and values alike) and a sink: `Σ_j p_j · row_j` with
/// `p_j = e^(s_j − m) / (e^(sink − m) + Σ_i e^(s_i − m))`, `s_j = scale · q · row_j`
/// ([`dot8`]).
pub(crate) fn attend_sink(q: &[f32], rows: &[[f32; LATENT]], scale: f32, sink: f32) -> Vec<f32> {
    let scores: Vec<f32> = rows.iter().map(|r| dot8(q, r) * scale).collect();
    let m = scores.iter().fold(sink, |m, &s| if s > m { s } else { m });
    let e: Vec<f32> = scores.iter().map(|s| exp(s - m)).collect();
    let mut sum = exp(sink - m);
    for v in &e {
        sum += v;
    }
    let mut out = vec![0f32; LATENT];
    for (r, ej) in rows.iter().zip(&e) {
        let p = ej / sum;
        for (o, v) in out.iter_mut().zip(r) {
            *o += p * v;
        }
    }
    out
}

impl V4Model {
    /// Builds the weights of `cfg`.
    pub fn new(cfg: V4ModelConfig) -> Result<V4Model, ModelError> {
        cfg.spec()?;
        if cfg.hidden == 0 || cfg.vocab == 0 || cfg.heads == 0 || cfg.index_heads == 0 {
            return Err(ModelError::Cache(format!(
                "hidden, vocab, heads and index_heads must be at least 1 (got {cfg:?})"
            )));
        }
        let mut rng = SplitMix64(cfg.seed);
        let embed = Mat::random(&mut rng, cfg.vocab, cfg.hidden);
        let layers: Vec<V4Layer> = cfg
            .ratios
            .iter()
            .map(|&r| V4Layer::random(&mut rng, r, &cfg))
            .collect();
        let w_out = Mat::random(&mut rng, cfg.vocab, cfg.hidden);
        // The draft starts from the last target layer's attention and MLP (an untrained
        // random draft would almost never agree with the target), without compressors.
        let draft = V4Layer {
            ratio: 0,
            comp: None,
            index: None,
            ..layers[layers.len() - 1].clone()
        };
        Ok(V4Model {
            cfg,
            embed,
            layers,
            draft,
            w_out,
            hf: None,
        })
    }

    /// The model of the transformers `deepseek_v4` checkpoint in `dir` (`config.json`
    /// and its safetensors; see [`crate::checkpoint`]). Its [`config`](Self::config)
    /// reports the checkpoint's dimensions (`mlp` is the experts' width, `seed` 0). With
    /// the published MTP layer's tensors (`mtp.0.*`, which transformers ignores) and
    /// `num_nextn_predict_layers` ≥ 1 it drafts with that layer (`mtp`, `mtp_input`);
    /// without them it serves without drafts.
    pub fn from_checkpoint(dir: &std::path::Path) -> Result<V4Model, ModelError> {
        let hf = HfV4Model::load(dir)?;
        let c = &hf.cfg;
        let cfg = V4ModelConfig {
            ratios: c.ratios.clone(),
            mtp: hf.mtp.is_some(),
            mtp_input: if hf.mtp.is_some() {
                c.hc_mult * c.hidden
            } else {
                0
            },
            hidden: c.hidden,
            vocab: c.vocab,
            heads: c.heads,
            index_heads: c.index_heads,
            topk: c.index_topk,
            window: c.window,
            mlp: c.moe_intermediate,
            seed: 0,
        };
        cfg.spec()?;
        let empty = || Mat {
            rows: 0,
            cols: 0,
            w: Vec::new(),
        };
        Ok(V4Model {
            cfg,
            embed: empty(),
            layers: Vec::new(),
            draft: V4Layer {
                ratio: 0,
                w_kv: empty(),
                w_q: Vec::new(),
                sink: Vec::new(),
                w_o: empty(),
                w_1: empty(),
                w_2: empty(),
                comp: None,
                index: None,
            },
            w_out: empty(),
            hf: Some(Box::new(hf)),
        })
    }

    /// [`from_checkpoint`](Self::from_checkpoint) with the cache's rounding switched off:
    /// the forward keeps every window row, entry and indexer key as computed (in memory,
    /// for every position: not a serving path) and reads those, and its queries stay
    /// unrounded. The oracle test runs it to show that what separates our logits from
    /// transformers' float forward is the cache's formats, not the math.
    #[doc(hidden)]
    pub fn from_checkpoint_unrounded(dir: &std::path::Path) -> Result<V4Model, ModelError> {
        let mut m = Self::from_checkpoint(dir)?;
        if let Some(hf) = &mut m.hf {
            hf.float = Some(std::sync::Mutex::new(Default::default()));
        }
        Ok(m)
    }

    /// For a model from [`from_checkpoint_unrounded`](Self::from_checkpoint_unrounded):
    /// the ratio-4 layer `layer`'s selection at `pos` (ascending) and the score of every
    /// visible entry, from the last run that selected there (`None` where every visible
    /// entry was taken, or for another model).
    #[doc(hidden)]
    pub fn unrounded_selection(&self, layer: usize, pos: u32) -> Option<(Vec<u32>, Vec<f32>)> {
        let f = self.hf.as_ref()?.float.as_ref()?;
        let f = f.lock().unwrap_or_else(|e| e.into_inner());
        f.selections.get(&(layer, pos)).cloned()
    }

    /// For a model from [`from_checkpoint_unrounded`](Self::from_checkpoint_unrounded):
    /// makes layer `layer` attend `entries` at `pos` instead of its indexer's selection
    /// (the oracle test hands it transformers' own); `false` for another model.
    #[doc(hidden)]
    pub fn force_unrounded_selection(&self, layer: usize, pos: u32, entries: Vec<u32>) -> bool {
        let Some(f) = self.hf.as_ref().and_then(|h| h.float.as_ref()) else {
            return false;
        };
        let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
        f.forced.insert((layer, pos), entries);
        true
    }

    /// The logits of a final hidden state as [`run_hidden`](Self::run_hidden) returns it
    /// (the oracle tests compare them with a published implementation's).
    pub fn logits(&self, hidden: &[f32]) -> Vec<f32> {
        match &self.hf {
            Some(hf) => hf.target_logits(hidden),
            None => self.w_out.apply8(&rmsnorm8(hidden)),
        }
    }

    /// Whether the model is a checkpoint's ([`from_checkpoint`](Self::from_checkpoint)).
    pub fn is_checkpoint(&self) -> bool {
        self.hf.is_some()
    }

    /// The dimensions.
    pub fn config(&self) -> &V4ModelConfig {
        &self.cfg
    }

    /// The MTP layer's cache layer (after the target layers).
    pub fn mtp_layer(&self) -> usize {
        self.cfg.ratios.len()
    }

    fn embedding(&self, t: u32) -> Vec<f32> {
        let r = t as usize % self.cfg.vocab;
        self.embed.w[r * self.cfg.hidden..(r + 1) * self.cfg.hidden].to_vec()
    }

    fn output(&self, x: &[f32], pos: u32) -> TokenOut {
        output_of(&self.w_out.apply8(&rmsnorm8(x)), pos)
    }

    fn mlp(layer: &V4Layer, x: &mut [f32]) {
        let mid: Vec<f32> = layer
            .w_1
            .apply8(&rmsnorm8(x))
            .into_iter()
            .map(relu)
            .collect();
        add(x, &layer.w_2.apply8(&mid));
    }

    /// Runs one request's new `tokens` at positions `first..` (the caches hold what
    /// positions `0..first` wrote): writes their rows and returns each token's output.
    pub fn run(
        &self,
        kv: &mut dyn V4Store,
        first: u32,
        tokens: &[u32],
    ) -> Result<Vec<TokenOut>, ModelError> {
        Ok(self.run_hidden(kv, first, tokens)?.0)
    }

    /// [`run`](Self::run), also returning each token's final hidden state (the MTP draft
    /// layer's input).
    pub fn run_hidden(
        &self,
        kv: &mut dyn V4Store,
        first: u32,
        tokens: &[u32],
    ) -> Result<(Vec<TokenOut>, Vec<Vec<f32>>), ModelError> {
        self.run_layers(kv, first, tokens, &[], &mut Vec::new())
    }

    /// [`run_hidden`](Self::run_hidden), also tracing the attention of `points`
    /// (`(layer, position)`; those not among the new positions are ignored), in layer
    /// order, then position order. Every output bit is the untraced run's.
    pub fn run_traced(
        &self,
        kv: &mut dyn V4Store,
        first: u32,
        tokens: &[u32],
        points: &[(usize, u32)],
    ) -> Result<(Vec<TokenOut>, Vec<V4Trace>), ModelError> {
        let mut traces = Vec::new();
        let (outs, _) = self.run_layers(kv, first, tokens, points, &mut traces)?;
        Ok((outs, traces))
    }

    fn run_layers(
        &self,
        kv: &mut dyn V4Store,
        first: u32,
        tokens: &[u32],
        points: &[(usize, u32)],
        traces: &mut Vec<V4Trace>,
    ) -> Result<(Vec<TokenOut>, Vec<Vec<f32>>), ModelError> {
        if first.checked_add(tokens.len() as u32).is_none() || tokens.len() > u32::MAX as usize {
            return Err(ModelError::Access(format!(
                "positions {first}.. of {} tokens pass u32",
                tokens.len()
            )));
        }
        if let Some(hf) = &self.hf {
            if !points.is_empty() {
                return Err(ModelError::Unsupported(
                    "attention traces are the built-in V4 model's: a checkpoint's model runs \
                     untraced"
                        .into(),
                ));
            }
            return hf.run(kv, first, tokens);
        }
        let mut xs: Vec<Vec<f32>> = tokens.iter().map(|&t| self.embedding(t)).collect();
        for (l, layer) in self.layers.iter().enumerate() {
            let normed: Vec<Vec<f32>> = xs.iter().map(|x| rmsnorm8(x)).collect();
            // Every new token's rows first: a token attends to the new tokens before it,
            // and an entry closed inside the step is seen by its closing token.
            for (i, xn) in normed.iter().enumerate() {
                self.write(kv, l, layer, xn, first + i as u32)?;
            }
            for (i, xn) in normed.iter().enumerate() {
                let q = first + i as u32;
                let mut trace = points.contains(&(l, q)).then(|| V4Trace {
                    layer: l,
                    pos: q,
                    ..V4Trace::default()
                });
                let attn = self.attend(kv, l, layer, xn, q, trace.as_mut())?;
                traces.extend(trace);
                add(&mut xs[i], &attn);
                Self::mlp(layer, &mut xs[i]);
            }
        }
        let outs = xs
            .iter()
            .enumerate()
            .map(|(i, x)| self.output(x, first + i as u32))
            .collect();
        Ok((outs, xs))
    }

    /// The window row of the token at `p`.
    fn window_row(layer: &V4Layer, xn: &[f32], p: u32) -> Model1Row {
        let mut c = rmsnorm8(&layer.w_kv.apply8(xn));
        rope(&mut c[MODEL1_NOPE..], p);
        model1(&c)
    }

    /// Writes everything the token at `p` writes in layer `l`: its window row, its
    /// state rows and, when it closes a group, the group's entry and indexer key.
    fn write(
        &self,
        kv: &mut dyn V4Store,
        l: usize,
        layer: &V4Layer,
        xn: &[f32],
        p: u32,
    ) -> Result<(), ModelError> {
        kv.write_window(l, p, &Self::window_row(layer, xn, p))?;
        let Some(comp) = &layer.comp else {
            return Ok(());
        };
        kv.write_state(l, StateKind::Kv, p, &comp.state_row(xn, p))?;
        if let Some(ix) = &layer.index {
            kv.write_state(l, StateKind::Index, p, &ix.comp.state_row(xn, p))?;
        }
        if !(p + 1).is_multiple_of(layer.ratio) {
            return Ok(());
        }
        let w = p / layer.ratio;
        let mut e = rmsnorm8(&comp.entry(kv, l, StateKind::Kv, w)?);
        rope(&mut e[MODEL1_NOPE..], layer.ratio * w);
        kv.write_entry(l, w, &model1(&e))?;
        if let Some(ix) = &layer.index {
            let mut k = rmsnorm8(&ix.comp.entry(kv, l, StateKind::Index, w)?);
            rope(&mut k[..ROPE], layer.ratio * w);
            kv.write_index_entry(l, w, &encode_index_key(&k))?;
        }
        Ok(())
    }

    /// The compressed entries a query at `q` of a ratio-4 layer attends: every visible
    /// entry up to top-k, else the indexer's top-k (ascending).
    fn select(
        &self,
        kv: &dyn V4Store,
        l: usize,
        ix: &Indexer,
        xn: &[f32],
        q: u32,
    ) -> Result<Vec<u32>, ModelError> {
        let visible = (q + 1) / 4;
        if visible <= self.cfg.topk {
            return Ok((0..visible).collect());
        }
        let qs: Vec<Vec<f32>> = ix
            .w_q
            .iter()
            .map(|w| {
                let mut v = w.apply8(xn);
                rope(&mut v[..ROPE], q);
                fp8_query(&v)
            })
            .collect();
        let weights = ix.w_w.apply8(xn);
        let mut scored = Vec::with_capacity(visible as usize);
        for w in 0..visible {
            let (k, scale) = decode_index_key(&kv.index_entry(l, w)?);
            let mut s = 0f32;
            for (qh, wh) in qs.iter().zip(&weights) {
                s += wh * relu(dot8(qh, &k));
            }
            scored.push((s * scale, w));
        }
        Ok(top_k(scored, self.cfg.topk as usize))
    }

    /// The attention output of the token at `q` in layer `l` (`trace`: what a sparse
    /// decode kernel is handed and computes, per head).
    fn attend(
        &self,
        kv: &dyn V4Store,
        l: usize,
        layer: &V4Layer,
        xn: &[f32],
        q: u32,
        mut trace: Option<&mut V4Trace>,
    ) -> Result<Vec<f32>, ModelError> {
        let decode = |r: Model1Row| dequantize_model1_row(&r.data, &r.scales);
        let low = (q + 1).saturating_sub(self.cfg.window);
        let mut rows = Vec::with_capacity((q + 1 - low) as usize);
        for p in low..=q {
            rows.push(decode(kv.window(l, p)?));
        }
        let entries: Vec<u32> = match (&layer.index, layer.ratio) {
            (Some(ix), _) => self.select(kv, l, ix, xn, q)?,
            (None, 0) => Vec::new(),
            (None, r) => (0..(q + 1) / r).collect(),
        };
        for &w in &entries {
            rows.push(decode(kv.entry(l, w)?));
        }
        let scale = 1.0 / (LATENT as f32).sqrt();
        if let Some(t) = trace.as_deref_mut() {
            t.window = (low..=q).collect();
            t.entries = entries;
            t.softmax_scale = scale;
            t.sink = layer.sink.clone();
        }
        let mut heads = Vec::with_capacity(self.cfg.heads * LATENT);
        for (w_q, &sink) in layer.w_q.iter().zip(&layer.sink) {
            let mut qh = rmsnorm8(&w_q.apply8(xn));
            rope(&mut qh[MODEL1_NOPE..], q);
            // The query in bf16, as the sparse decode kernel takes it.
            let qh: Vec<f32> = to_bf16(&qh).iter().map(|v| v.to_f32()).collect();
            let mut o = attend_sink(&qh, &rows, scale, sink);
            if let Some(t) = trace.as_deref_mut() {
                t.q.push(qh);
                t.out.push(o.clone());
            }
            rope_inverse(&mut o[MODEL1_NOPE..], q);
            heads.extend(o);
        }
        Ok(layer.w_o.apply8(&heads))
    }

    /// Runs `prompt` then `max_new` greedy tokens alone on a fresh contiguous cache (the
    /// reference every paged run is checked against): the generated tokens and every
    /// position's output (the last generated token's own output is not computed).
    pub fn generate(&self, prompt: &[u32], max_new: u32) -> Result<Generation, ModelError> {
        let mut kv = V4Contiguous::new();
        let mut outputs = self.run(&mut kv, 0, prompt)?;
        let mut tokens = Vec::new();
        while (tokens.len() as u32) < max_new {
            let t = outputs.last().map_or(0, |o| o.greedy);
            tokens.push(t);
            if tokens.len() as u32 == max_new {
                break;
            }
            let p = (prompt.len() + tokens.len() - 1) as u32;
            outputs.extend(self.run(&mut kv, p, &[t])?);
        }
        Ok(Generation { outputs, tokens })
    }

    /// Writes the MTP layer's rows for the kept `tokens` at positions `first..`, whose
    /// final hidden states ([`run_hidden`](Self::run_hidden)) are `hidden` (one per
    /// token; the built-in model ignores them).
    ///
    /// The built-in model's row of a position depends only on its token and position.
    /// A checkpoint's published MTP layer reads the target too: its row at slot `j` is
    /// built from the token at `j` and the target's residual streams at `j − 1` (RoPE at
    /// `j − 1`; slot 0 holds nothing). So the streams of every kept position are kept
    /// (BF16, [`StateKind::MtpInput`]), and slot `first` reads those of `first − 1`,
    /// written by the step before or carried in a prefix hit's tail: rows depend only
    /// on the tokens up to their own, like the target's, and a hit at any block
    /// boundary loses no MTP row.
    pub fn draft_write(
        &self,
        kv: &mut dyn V4Store,
        first: u32,
        tokens: &[u32],
        hidden: &[Vec<f32>],
    ) -> Result<(), ModelError> {
        self.has_draft()?;
        let Some(hf) = &self.hf else {
            for (i, &t) in tokens.iter().enumerate() {
                let p = first + i as u32;
                let row = Self::window_row(&self.draft, &rmsnorm8(&self.embedding(t)), p);
                kv.write_window(self.mtp_layer(), p, &row)?;
            }
            return Ok(());
        };
        if hidden.len() != tokens.len() {
            return Err(ModelError::Access(format!(
                "{} MTP inputs for {} tokens",
                hidden.len(),
                tokens.len()
            )));
        }
        let layer = self.mtp_layer();
        let kept: Vec<Vec<f32>> = hidden.iter().map(|h| hf.mtp_kept(h)).collect();
        // The previous position's streams first (a later write may reuse its page).
        let before = if first > 0 && !tokens.is_empty() {
            Some(kv.state(layer, StateKind::MtpInput, first - 1)?)
        } else {
            None
        };
        for (i, h) in kept.iter().enumerate() {
            kv.write_state(layer, StateKind::MtpInput, first + i as u32, h)?;
        }
        for (i, &t) in tokens.iter().enumerate() {
            let j = first + i as u32;
            let h = match (i, &before) {
                (0, Some(h)) => h,
                (0, None) => continue,
                _ => &kept[i - 1],
            };
            hf.mtp_write(kv, j, t, h)?;
        }
        Ok(())
    }

    fn has_draft(&self) -> Result<(), ModelError> {
        if !self.cfg.mtp {
            return Err(ModelError::Unsupported(
                "this V4 model has no MTP layer: build it with `mtp: true` to draft".into(),
            ));
        }
        Ok(())
    }

    /// The MTP layer's `k` proposals for positions `last + 2 ..`: `hidden` is the
    /// target's final hidden state at `last`, `next` the token sampled there; the MTP
    /// layer's window in `kv` holds positions up to `last`. Each proposal's own window
    /// row is kept here, not written.
    pub fn propose(
        &self,
        kv: &dyn V4Store,
        last: u32,
        hidden: &[f32],
        next: u32,
        k: usize,
    ) -> Result<Vec<u32>, ModelError> {
        Ok(self
            .propose_logits(kv, last, hidden, next, k)?
            .into_iter()
            .map(|(t, _)| t)
            .collect())
    }

    /// [`propose`](Self::propose) with each proposal's logits (a checkpoint's model; the
    /// built-in model's are not kept: empty). For the oracle tests.
    #[doc(hidden)]
    pub fn propose_logits(
        &self,
        kv: &dyn V4Store,
        last: u32,
        hidden: &[f32],
        next: u32,
        k: usize,
    ) -> Result<Vec<(u32, Vec<f32>)>, ModelError> {
        self.has_draft()?;
        let layer = self.mtp_layer();
        let mut local = DraftOverlay {
            base: kv,
            layer,
            from: last + 1,
            rows: Vec::new(),
        };
        let mut out = Vec::with_capacity(k);
        if let Some(hf) = &self.hf {
            // Slot `last + 1` holds the sampled token and the target's streams at
            // `last` (the row the next step writes); then each draft with the MTP
            // layer's own output streams.
            let saved = hf.float_window_rows(layer, last + 1..last + 1 + k as u32);
            let (mut h, mut tok) = (hf.mtp_kept(hidden), next);
            let mut chain = || -> Result<(), ModelError> {
                for i in 0..k as u32 {
                    let j = last + 1 + i;
                    let (logits, y) = hf.mtp_step(&mut local, j, tok, &h)?;
                    tok = output_of(&logits, j).greedy;
                    out.push((tok, logits));
                    h = hf.mtp_kept(&y);
                }
                Ok(())
            };
            let done = chain();
            if let Some(rows) = saved {
                hf.restore_float_window_rows(layer, rows);
            }
            done?;
            return Ok(out);
        }
        let (mut h, mut tok) = (hidden.to_vec(), next);
        for i in 0..k as u32 {
            let pos = last + 1 + i;
            let row = Self::window_row(&self.draft, &rmsnorm8(&self.embedding(tok)), pos);
            local.write_window(layer, pos, &row)?;
            let mut x = self.embedding(tok);
            add(&mut x, &rmsnorm8(&h));
            let attn = self.attend(&local, layer, &self.draft, &rmsnorm8(&x), pos, None)?;
            add(&mut x, &attn);
            Self::mlp(&self.draft, &mut x);
            tok = self.output(&x, pos).greedy;
            out.push((tok, Vec::new()));
            h = x;
        }
        Ok(out)
    }
}

/// A draft chain's view of the MTP layer's window: positions from `from` on are kept
/// here, earlier ones read from `base`.
struct DraftOverlay<'a> {
    base: &'a dyn V4Store,
    layer: usize,
    from: u32,
    rows: Vec<Model1Row>,
}

impl DraftOverlay<'_> {
    fn only_window<T>(&self, what: &str) -> Result<T, ModelError> {
        Err(ModelError::Access(format!(
            "the draft chain reaches {what}: the MTP layer is window-only"
        )))
    }
}

impl V4Store for DraftOverlay<'_> {
    fn write_window(&mut self, layer: usize, pos: u32, row: &Model1Row) -> Result<(), ModelError> {
        if layer != self.layer || pos != self.from + self.rows.len() as u32 {
            return Err(ModelError::Access(format!(
                "the draft chain writes layer {layer} position {pos} out of order"
            )));
        }
        self.rows.push(*row);
        Ok(())
    }

    fn window(&self, layer: usize, pos: u32) -> Result<Model1Row, ModelError> {
        match pos.checked_sub(self.from) {
            Some(i) if layer == self.layer => self
                .rows
                .get(i as usize)
                .copied()
                .ok_or_else(|| ModelError::Access(format!("draft row {pos} not computed"))),
            _ => self.base.window(layer, pos),
        }
    }

    fn write_state(&mut self, _: usize, _: StateKind, _: u32, _: &[f32]) -> Result<(), ModelError> {
        self.only_window("compressor state")
    }

    fn state(&self, _: usize, _: StateKind, _: u32) -> Result<Vec<f32>, ModelError> {
        self.only_window("compressor state")
    }

    fn write_entry(&mut self, _: usize, _: u32, _: &Model1Row) -> Result<(), ModelError> {
        self.only_window("compressed entries")
    }

    fn entry(&self, _: usize, _: u32) -> Result<Model1Row, ModelError> {
        self.only_window("compressed entries")
    }

    fn write_index_entry(
        &mut self,
        _: usize,
        _: u32,
        _: &[u8; INDEX_ENTRY_BYTES],
    ) -> Result<(), ModelError> {
        self.only_window("indexer keys")
    }

    fn index_entry(&self, _: usize, _: u32) -> Result<[u8; INDEX_ENTRY_BYTES], ModelError> {
        self.only_window("indexer keys")
    }
}
