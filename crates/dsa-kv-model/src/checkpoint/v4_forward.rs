//! The forward of a `deepseek_v4` checkpoint's model through a [`V4Store`], in
//! transformers' `DeepseekV4` math with our V4 cache in between. Per layer, in the
//! built-in V4 model's order (every new token's rows first, then each token's
//! attention, so paged and unpaged runs give the same bits):
//!
//! * the hyper-connection collapses the `hc_mult` residual streams (`pre`), then
//!   `input_layernorm`;
//! * the latent `kv_norm(kv_proj x)`, RoPE on its last 64 values, as a MODEL1 window
//!   row; on compressed layers the state row `[kv_proj x | gate_proj x + position_bias]`
//!   and, at a group's last token, the entry (per channel a softmax over the group's
//!   slots read back from the state cache, the ratio-4 overlap as the built-in model's),
//!   `kv_norm`, RoPE at the group's first position, a MODEL1 row; on ratio-4 layers the
//!   indexer's own compressor at width 128, RoPE on its last 64, an FP8 key;
//! * the query `q_b_norm(q_b_proj(q_a_norm(q_a_proj x)))` per head, RoPE on its last 64,
//!   in BF16 as the sparse decode takes it; the indexer's queries `q_b_proj(q_res)` with
//!   RoPE on their last 64, in FP8 as the kernel takes them, its scores
//!   `Σ_h w_h · heads^−½ · relu(q_h · k) · 128^−½` and top-k (every visible entry when
//!   they fit); attention over the window and the entries with the sink, the inverse
//!   RoPE, the grouped output projection;
//! * the hyper-connection expands the output (`post`) and mixes the streams (`comb`,
//!   Sinkhorn-normalized); the same around the mixture of experts (`sqrtsoftplus`,
//!   `softmax` or `sigmoid` scores, top-k by score plus correction bias or the token's
//!   `tid2eid` row, normalized and scaled weights, clamped SwiGLU experts summed in
//!   ascending expert order, a shared expert);
//! * at the end `hc_head` collapses the streams, then the final norm and the head.
//!
//! Window-only layers rotate with the main RoPE (`rope_theta`), compressed layers with
//! the compress RoPE (`compress_rope_theta`, YaRN without an attention factor).
//! Where it departs from the published code on purpose: the cache holds MODEL1 rows
//! (E4M3 with power-of-two scales, BF16 RoPE part) and FP8 indexer keys, the queries are
//! BF16 (attention) and FP8 (indexer) as the kernels take them; the published forward
//! keeps all of it in float.

use std::collections::HashMap;

use dsa_kv_core::ops::model1::{dequantize_model1_row, MODEL1_NOPE};

use super::forward::{rmsnorm_w, sigmoid, silu};
use super::v4_config::V4Scoring;
use super::v4_weights::{Hc, HfV4Model, V4Comp, V4HfLayer, V4HfMtp, V4Route};
use super::weights::Rope;
use crate::config::{INDEX_DIM, LATENT};
use crate::math::{dot, exp, relu, to_bf16, Mat};
use crate::model::{output_of, top_k};
use crate::v4::{decode_index_key, encode_index_key, fp8_query, Model1Row, StateKind, V4Store};
use crate::{ModelError, TokenOut};

/// `x / sqrt(mean(x²) + eps)`.
fn rmsnorm_plain(x: &[f32], eps: f32) -> Vec<f32> {
    let ms = dot(x, x) / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().map(|v| v * r).collect()
}

/// `ln(1 + e^x)` as torch's `softplus` (the identity above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + exp(x)).ln()
    }
}

/// Softmax of `x` in place (max subtracted, sum in order).
fn softmax(x: &mut [f32]) {
    let m = x
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = exp(*v - m);
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// The hyper-connection's weights for one token's streams `x` (`n × hidden`):
/// `(pre, post, comb)` with `comb[j · n + k]` the weight of input stream `j` in output
/// stream `k`.
fn hc_weights(
    hc: &Hc,
    x: &[f32],
    n: usize,
    iters: usize,
    eps: f32,
    norm_eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mix = hc.fn_.apply(&rmsnorm_plain(x, norm_eps));
    let (s0, s1, s2) = (hc.scale[0], hc.scale[1], hc.scale[2]);
    let pre: Vec<f32> = (0..n)
        .map(|i| sigmoid(mix[i] * s0 + hc.base[i]) + eps)
        .collect();
    let post: Vec<f32> = (0..n)
        .map(|i| 2.0 * sigmoid(mix[n + i] * s1 + hc.base[n + i]))
        .collect();
    let mut comb: Vec<f32> = (0..n * n)
        .map(|i| mix[2 * n + i] * s2 + hc.base[2 * n + i])
        .collect();
    for row in comb.chunks_exact_mut(n) {
        softmax(row);
        for v in row.iter_mut() {
            *v += eps;
        }
    }
    let cols = |c: &mut [f32]| {
        for k in 0..n {
            let mut s = 0f32;
            for j in 0..n {
                s += c[j * n + k];
            }
            for j in 0..n {
                c[j * n + k] /= s + eps;
            }
        }
    };
    let rows = |c: &mut [f32]| {
        for row in c.chunks_exact_mut(n) {
            let mut s = 0f32;
            for v in row.iter() {
                s += v;
            }
            for v in row.iter_mut() {
                *v /= s + eps;
            }
        }
    };
    cols(&mut comb);
    for _ in 1..iters {
        rows(&mut comb);
        cols(&mut comb);
    }
    (pre, post, comb)
}

/// `Σ_i w_i · x_i` over the streams.
fn collapse(x: &[f32], w: &[f32], hidden: usize) -> Vec<f32> {
    let mut out = vec![0f32; hidden];
    for (stream, &wi) in x.chunks_exact(hidden).zip(w) {
        for (o, v) in out.iter_mut().zip(stream) {
            *o += wi * v;
        }
    }
    out
}

/// The streams after a block: `x'_k = post_k · y + Σ_j comb[j][k] · x_j`.
fn expand(x: &[f32], y: &[f32], post: &[f32], comb: &[f32], n: usize, hidden: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * hidden];
    for k in 0..n {
        let o = &mut out[k * hidden..(k + 1) * hidden];
        for (c, v) in o.iter_mut().zip(y) {
            *c = post[k] * v;
        }
        for j in 0..n {
            let w = comb[j * n + k];
            for (c, v) in o.iter_mut().zip(&x[j * hidden..(j + 1) * hidden]) {
                *c += w * v;
            }
        }
    }
    out
}

/// The last 64 of `x` rotated by `rope` at `pos`.
fn rope_tail(rope: &Rope, x: &mut [f32], pos: u32) {
    let n = x.len();
    rope.interleaved(&mut x[n - 64..], pos);
}

impl V4Comp {
    /// The state row of the token with normed hidden state `x` at `p`: `[kv | gate +
    /// position_bias[p mod ratio]]`.
    fn state_row(&self, x: &[f32], p: u32) -> Vec<f32> {
        let mut row = self.kv.apply(x);
        let mut gate = self.gate.apply(x);
        let r = (p as usize) % self.ape.rows;
        for (g, b) in gate
            .iter_mut()
            .zip(&self.ape.w[r * self.ape.cols..(r + 1) * self.ape.cols])
        {
            *g += b;
        }
        row.extend(gate);
        row
    }

    /// Entry `w` (ratio `r`, `width` wide), from the state rows in `kv`: per channel the
    /// softmax of the slots' gates weighting their kv values (ratio 4: the first halves of
    /// the previous group, then the second halves of this one), then `kv_norm`.
    fn entry(
        &self,
        kv: &dyn V4Store,
        layer: usize,
        kind: StateKind,
        w: u32,
        width: usize,
        eps: f32,
    ) -> Result<Vec<f32>, ModelError> {
        let r = self.ape.rows as u32;
        let coff = if r == 4 { 2 } else { 1 };
        let mut slots = Vec::with_capacity(2 * r as usize);
        if coff == 2 && w > 0 {
            for t in r * (w - 1)..r * w {
                slots.push((kv.state(layer, kind, t)?, 0));
            }
        }
        for t in r * w..r * (w + 1) {
            slots.push((kv.state(layer, kind, t)?, coff - 1));
        }
        let gates = coff * width;
        let mut out = vec![0f32; width];
        let mut p = vec![0f32; slots.len()];
        for (c, o) in out.iter_mut().enumerate() {
            for (pi, (row, h)) in p.iter_mut().zip(&slots) {
                *pi = row[gates + h * width + c];
            }
            softmax(&mut p);
            let mut acc = 0f32;
            for (pi, (row, h)) in p.iter().zip(&slots) {
                acc += pi * row[h * width + c];
            }
            *o = acc;
        }
        Ok(rmsnorm_w(&out, &self.norm, eps))
    }
}

/// The rows as the forward computed them, before the cache's rounding (kept only by a
/// model built with [`V4Model::from_checkpoint_unrounded`](crate::v4::V4Model::from_checkpoint_unrounded)).
#[derive(Default)]
pub(crate) struct FloatRows {
    /// `(layer, position)` → the window row.
    window: HashMap<(usize, u32), Vec<f32>>,
    /// `(layer, entry)` → the compressed entry.
    entries: HashMap<(usize, u32), Vec<f32>>,
    /// `(layer, entry)` → the indexer key.
    keys: HashMap<(usize, u32), Vec<f32>>,
    /// `(layer, position)` → the indexer's selection (ascending) and every visible
    /// entry's score, where it selected.
    pub(crate) selections: HashMap<(usize, u32), (Vec<u32>, Vec<f32>)>,
    /// `(layer, position)` → a selection to use instead of the indexer's.
    pub(crate) forced: HashMap<(usize, u32), Vec<u32>>,
}

impl HfV4Model {
    /// Records into the unrounded rows, when kept.
    fn keep<T>(&self, f: impl FnOnce(&mut FloatRows) -> T) {
        if let Some(m) = &self.float {
            f(&mut m.lock().unwrap_or_else(|e| e.into_inner()));
        }
    }

    /// Reads the unrounded rows, when kept.
    fn kept<T>(&self, f: impl FnOnce(&FloatRows) -> Option<T>) -> Option<T> {
        self.float
            .as_ref()
            .and_then(|m| f(&m.lock().unwrap_or_else(|e| e.into_inner())))
    }

    /// Layer `l`'s compression ratio (0 for the MTP layer, after the target layers).
    fn ratio(&self, l: usize) -> u32 {
        self.cfg.ratios.get(l).copied().unwrap_or(0)
    }

    fn rope(&self, l: usize) -> &Rope {
        if self.ratio(l) == 0 {
            &self.main_rope
        } else {
            &self.compress_rope
        }
    }

    /// Runs one request's new `tokens` at positions `first..` (the caches hold what
    /// positions `0..first` wrote): writes their rows and returns each token's output
    /// and final residual streams (`hc_mult × hidden`, before `hc_head`: what the MTP
    /// layer reads).
    pub(crate) fn run(
        &self,
        kv: &mut dyn V4Store,
        first: u32,
        tokens: &[u32],
    ) -> Result<(Vec<TokenOut>, Vec<Vec<f32>>), ModelError> {
        let c = &self.cfg;
        let (h, n) = (c.hidden, c.hc_mult);
        if first == 0 {
            // A new sequence: the unrounded rows of another one must not be read.
            self.keep(|f| {
                f.window.clear();
                f.entries.clear();
                f.keys.clear();
                f.selections.clear();
            });
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(ModelError::Access(format!(
                "token {t} is past the checkpoint's vocabulary of {}",
                c.vocab
            )));
        }
        let mut xs: Vec<Vec<f32>> = tokens
            .iter()
            .map(|&t| {
                let e = &self.embed.w[t as usize * h..(t as usize + 1) * h];
                e.repeat(n)
            })
            .collect();
        for (l, layer) in self.layers.iter().enumerate() {
            self.layer_forward(kv, l, layer, &mut xs, first, 0, tokens)?;
        }
        let head = self.head.as_ref().unwrap_or(&self.embed);
        let outs = xs
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let y = self.collapse_head(&self.hc_head, &self.norm, x);
                output_of(&head.apply(&y), first + i as u32)
            })
            .collect();
        Ok((outs, xs))
    }

    /// The logits of the target's final residual streams `x` (`run`'s second output).
    pub(crate) fn target_logits(&self, x: &[f32]) -> Vec<f32> {
        let y = self.collapse_head(&self.hc_head, &self.norm, x);
        self.head.as_ref().unwrap_or(&self.embed).apply(&y)
    }

    /// `hc_head` collapses the streams `x`, then `norm`.
    fn collapse_head(&self, hc: &Hc, norm: &[f32], x: &[f32]) -> Vec<f32> {
        let c = &self.cfg;
        let n = c.hc_mult;
        let mix = hc.fn_.apply(&rmsnorm_plain(x, c.rms_norm_eps));
        let pre: Vec<f32> = (0..n)
            .map(|k| sigmoid(mix[k] * hc.scale[0] + hc.base[k]) + c.hc_eps)
            .collect();
        rmsnorm_w(&collapse(x, &pre, c.hidden), norm, c.rms_norm_eps)
    }

    /// One decoder layer over the residual streams `xs` of the tokens at slots
    /// `first..`: every token's rows first, then each token's attention and experts.
    /// `shift`: the slot's RoPE position is `slot − shift` (the MTP layer's row of the
    /// token at `j` stands at position `j − 1`).
    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        kv: &mut dyn V4Store,
        l: usize,
        layer: &V4HfLayer,
        xs: &mut [Vec<f32>],
        first: u32,
        shift: u32,
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (h, n) = (c.hidden, c.hc_mult);
        let hcw: Vec<_> = xs
            .iter()
            .map(|x| {
                hc_weights(
                    &layer.attn_hc,
                    x,
                    n,
                    c.hc_sinkhorn_iters,
                    c.hc_eps,
                    c.rms_norm_eps,
                )
            })
            .collect();
        let normed: Vec<Vec<f32>> = xs
            .iter()
            .zip(&hcw)
            .map(|(x, (pre, _, _))| {
                rmsnorm_w(&collapse(x, pre, h), &layer.input_norm, c.rms_norm_eps)
            })
            .collect();
        for (i, xn) in normed.iter().enumerate() {
            self.write(kv, l, layer, xn, first + i as u32, shift)?;
        }
        for (i, xn) in normed.iter().enumerate() {
            let y = self.attend(kv, l, layer, xn, first + i as u32, shift)?;
            let (_, post, comb) = &hcw[i];
            xs[i] = expand(&xs[i], &y, post, comb, n, h);
            let (pre, post, comb) = hc_weights(
                &layer.ffn_hc,
                &xs[i],
                n,
                c.hc_sinkhorn_iters,
                c.hc_eps,
                c.rms_norm_eps,
            );
            let xm = rmsnorm_w(&collapse(&xs[i], &pre, h), &layer.post_norm, c.rms_norm_eps);
            let m = self.moe(layer, &xm, tokens[i]);
            xs[i] = expand(&xs[i], &m, &post, &comb, n, h);
        }
        Ok(())
    }

    /// The MTP layer's input streams for the token `t` at slot `j ≥ 1` and the target's
    /// streams `h` at position `j − 1`: `h_proj(hnorm(h_k)) + e_proj(enorm(embed(t)))` per
    /// stream `k`, the embedding zeroed at position 0 (as vLLM's MTP layer does).
    fn mtp_streams(&self, mtp: &V4HfMtp, t: u32, j: u32, h: &[f32]) -> Vec<f32> {
        let c = &self.cfg;
        let d = c.hidden;
        let embed = mtp.embed.as_ref().unwrap_or(&self.embed);
        let e = if j == 1 {
            vec![0f32; d]
        } else {
            embed.w[t as usize * d..(t as usize + 1) * d].to_vec()
        };
        let e = mtp.e_proj.apply(&rmsnorm_w(&e, &mtp.enorm, c.rms_norm_eps));
        let mut out = Vec::with_capacity(h.len());
        for hk in h.chunks_exact(d) {
            let v = mtp.h_proj.apply(&rmsnorm_w(hk, &mtp.hnorm, c.rms_norm_eps));
            out.extend(v.iter().zip(&e).map(|(a, b)| a + b));
        }
        out
    }

    fn mtp_layer(&self) -> Result<&V4HfMtp, ModelError> {
        self.mtp.as_ref().ok_or_else(|| {
            ModelError::Unsupported("this checkpoint has no MTP layer (mtp.0.*)".into())
        })
    }

    fn check_mtp(&self, t: u32, j: u32, h: &[f32]) -> Result<(), ModelError> {
        let c = &self.cfg;
        if j == 0 || t as usize >= c.vocab || h.len() != c.hc_mult * c.hidden {
            return Err(ModelError::Access(format!(
                "MTP row at slot {j} for token {t} with {} input values: the slot must be \
                 at least 1, the token below {}, the input {} values",
                h.len(),
                c.vocab,
                c.hc_mult * c.hidden
            )));
        }
        Ok(())
    }

    /// Writes the MTP layer's window row at slot `j` (cache layer `layers()`) for the
    /// token `t` at `j` and the target's streams `h` at `j − 1`.
    pub(crate) fn mtp_write(
        &self,
        kv: &mut dyn V4Store,
        j: u32,
        t: u32,
        h: &[f32],
    ) -> Result<(), ModelError> {
        self.check_mtp(t, j, h)?;
        let c = &self.cfg;
        let mtp = self.mtp_layer()?;
        let x = self.mtp_streams(mtp, t, j, h);
        let (pre, _, _) = hc_weights(
            &mtp.layer.attn_hc,
            &x,
            c.hc_mult,
            c.hc_sinkhorn_iters,
            c.hc_eps,
            c.rms_norm_eps,
        );
        let xn = rmsnorm_w(
            &collapse(&x, &pre, c.hidden),
            &mtp.layer.input_norm,
            c.rms_norm_eps,
        );
        self.write(kv, self.layers.len(), &mtp.layer, &xn, j, 1)
    }

    /// The MTP layer at slot `j` (writes its row, attends its window): the logits of
    /// the token at `j + 1` and the layer's output streams (the next draft's input).
    pub(crate) fn mtp_step(
        &self,
        kv: &mut dyn V4Store,
        j: u32,
        t: u32,
        h: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        self.check_mtp(t, j, h)?;
        let mtp = self.mtp_layer()?;
        let mut xs = vec![self.mtp_streams(mtp, t, j, h)];
        self.layer_forward(kv, self.layers.len(), &mtp.layer, &mut xs, j, 1, &[t])?;
        let y = self.collapse_head(&mtp.hc_head, &mtp.norm, &xs[0]);
        let head = mtp
            .head
            .as_ref()
            .or(self.head.as_ref())
            .unwrap_or(&self.embed);
        let out = xs.pop().expect("one token");
        Ok((head.apply(&y), out))
    }

    /// In the unrounded oracle mode, the kept window rows of layer `l` at `slots` (a
    /// draft chain's rows go there too and must not outlive it); `None` otherwise.
    #[allow(clippy::type_complexity)]
    pub(crate) fn float_window_rows(
        &self,
        l: usize,
        slots: std::ops::Range<u32>,
    ) -> Option<Vec<(u32, Option<Vec<f32>>)>> {
        self.kept(|f| Some(slots.map(|j| (j, f.window.get(&(l, j)).cloned())).collect()))
    }

    /// Puts back what [`float_window_rows`](Self::float_window_rows) returned.
    #[allow(clippy::type_complexity)]
    pub(crate) fn restore_float_window_rows(&self, l: usize, rows: Vec<(u32, Option<Vec<f32>>)>) {
        self.keep(|f| {
            for (j, r) in rows {
                match r {
                    Some(r) => f.window.insert((l, j), r),
                    None => f.window.remove(&(l, j)),
                };
            }
        });
    }

    /// What the cache keeps of the target's streams for the MTP layer: BF16 (every
    /// value as stored), or as computed in the unrounded oracle mode.
    pub(crate) fn mtp_kept(&self, h: &[f32]) -> Vec<f32> {
        if self.float.is_some() {
            return h.to_vec();
        }
        to_bf16(h).iter().map(|v| v.to_f32()).collect()
    }

    /// Everything the token at `p` writes in layer `l`.
    fn write(
        &self,
        kv: &mut dyn V4Store,
        l: usize,
        layer: &V4HfLayer,
        x: &[f32],
        p: u32,
        shift: u32,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let a = &layer.attn;
        let rope = self.rope(l);
        let mut lat = rmsnorm_w(&a.kv.apply(x), &a.kv_norm, c.rms_norm_eps);
        rope_tail(rope, &mut lat, p - shift);
        kv.write_window(l, p, &crate::v4::model1(&lat))?;
        self.keep(|f| f.window.insert((l, p), lat.clone()));
        let Some(comp) = &a.comp else {
            return Ok(());
        };
        kv.write_state(l, StateKind::Kv, p, &comp.state_row(x, p))?;
        if let Some(ix) = &a.index {
            kv.write_state(l, StateKind::Index, p, &ix.comp.state_row(x, p))?;
        }
        let r = self.ratio(l);
        if !(p + 1).is_multiple_of(r) {
            return Ok(());
        }
        let w = p / r;
        let mut e = comp.entry(kv, l, StateKind::Kv, w, LATENT, c.rms_norm_eps)?;
        rope_tail(rope, &mut e, r * w);
        kv.write_entry(l, w, &crate::v4::model1(&e))?;
        self.keep(|f| f.entries.insert((l, w), e.clone()));
        if let Some(ix) = &a.index {
            let mut k = ix
                .comp
                .entry(kv, l, StateKind::Index, w, INDEX_DIM, c.rms_norm_eps)?;
            rope_tail(rope, &mut k, r * w);
            self.keep(|f| f.keys.insert((l, w), k.clone()));
            kv.write_index_entry(l, w, &encode_index_key(&k))?;
        }
        Ok(())
    }

    /// The ratio-4 layer's selection for the query at `q`.
    fn select(
        &self,
        kv: &dyn V4Store,
        l: usize,
        layer: &V4HfLayer,
        x: &[f32],
        q_res: &[f32],
        q: u32,
    ) -> Result<Vec<u32>, ModelError> {
        let c = &self.cfg;
        let visible = (q + 1) / 4;
        if visible <= c.index_topk {
            return Ok((0..visible).collect());
        }
        let Some(ix) = &layer.attn.index else {
            return Ok((0..visible).collect());
        };
        if let Some(sel) = self.kept(|f| f.forced.get(&(l, q)).cloned()) {
            return Ok(sel);
        }
        let all = ix.q_b.apply(q_res);
        let qs: Vec<Vec<f32>> = all
            .chunks_exact(INDEX_DIM)
            .map(|v| {
                let mut v = v.to_vec();
                rope_tail(&self.compress_rope, &mut v, q);
                if self.float.is_some() {
                    return v;
                }
                fp8_query(&v)
            })
            .collect();
        let hs = (c.index_heads as f32).powf(-0.5);
        let ks = (INDEX_DIM as f32).powf(-0.5);
        let weights: Vec<f32> = ix.weights.apply(x).iter().map(|w| w * hs).collect();
        let mut scored = Vec::with_capacity(visible as usize);
        for w in 0..visible {
            let (k, scale) = match self.kept(|f| f.keys.get(&(l, w)).cloned()) {
                Some(exact) => {
                    let mut k = [0f32; INDEX_DIM];
                    k.copy_from_slice(&exact);
                    (k, 1.0)
                }
                None => decode_index_key(&kv.index_entry(l, w)?),
            };
            let mut s = 0f32;
            for (qh, wh) in qs.iter().zip(&weights) {
                s += wh * (relu(dot(qh, &k)) * ks);
            }
            scored.push((s * scale, w));
        }
        let scores: Vec<f32> = scored.iter().map(|&(s, _)| s).collect();
        let sel = top_k(scored, c.index_topk as usize);
        self.keep(|f| f.selections.insert((l, q), (sel.clone(), scores)));
        Ok(sel)
    }

    /// The attention output of the token at `q` in layer `l`.
    fn attend(
        &self,
        kv: &dyn V4Store,
        l: usize,
        layer: &V4HfLayer,
        x: &[f32],
        q: u32,
        shift: u32,
    ) -> Result<Vec<f32>, ModelError> {
        let c = &self.cfg;
        let a = &layer.attn;
        let rope = self.rope(l);
        let decode = |r: Model1Row| dequantize_model1_row(&r.data, &r.scales);
        let low = (q + 1).saturating_sub(c.window).max(shift);
        let mut rows = Vec::with_capacity((q + 1 - low) as usize);
        let exact = |m: &HashMap<(usize, u32), Vec<f32>>, key| -> Option<[f32; LATENT]> {
            m.get(&key)
                .map(|v| v.as_slice().try_into().expect("512 values"))
        };
        for p in low..=q {
            rows.push(match self.kept(|f| exact(&f.window, (l, p))) {
                Some(r) => r,
                None => decode(kv.window(l, p)?),
            });
        }
        let q_res = rmsnorm_w(&a.q_a.apply(x), &a.q_a_norm, c.rms_norm_eps);
        let entries: Vec<u32> = match self.ratio(l) {
            0 => Vec::new(),
            4 => self.select(kv, l, layer, x, &q_res, q)?,
            r => (0..(q + 1) / r).collect(),
        };
        for &w in &entries {
            rows.push(match self.kept(|f| exact(&f.entries, (l, w))) {
                Some(r) => r,
                None => decode(kv.entry(l, w)?),
            });
        }
        let scale = (LATENT as f32).powf(-0.5);
        let all = a.q_b.apply(&q_res);
        let mut heads = Vec::with_capacity(c.heads * LATENT);
        for (qh, &sink) in all.chunks_exact(LATENT).zip(&a.sinks) {
            let mut qh = rmsnorm_plain(qh, c.rms_norm_eps);
            rope_tail(rope, &mut qh, q - shift);
            if self.float.is_none() {
                qh = to_bf16(&qh).iter().map(|v| v.to_f32()).collect();
            }
            let mut o = crate::v4::attend_sink(&qh, &rows, scale, sink);
            rope.interleaved_inverse(&mut o[MODEL1_NOPE..], q - shift);
            heads.extend(o);
        }
        // The grouped output projection: group g's heads through rows g·o_lora.. of o_a.
        let per = heads.len() / c.o_groups;
        let mut mid = Vec::with_capacity(c.o_groups * c.o_lora);
        for (g, part) in heads.chunks_exact(per).enumerate() {
            let rows = Mat {
                rows: c.o_lora,
                cols: per,
                w: a.o_a.w[g * c.o_lora * per..(g + 1) * c.o_lora * per].to_vec(),
            };
            mid.extend(rows.apply(part));
        }
        Ok(a.o_b.apply(&mid))
    }

    /// The mixture of experts of the token `token` with normed input `x`.
    fn moe(&self, layer: &V4HfLayer, x: &[f32], token: u32) -> Vec<f32> {
        let c = &self.cfg;
        let m = &layer.moe;
        let (k, i, d) = (c.experts_per_token, c.moe_intermediate, c.hidden);
        let logits = m.router.apply(x);
        let scores: Vec<f32> = match c.scoring {
            V4Scoring::SqrtSoftplus => logits.iter().map(|&v| softplus(v).sqrt()).collect(),
            V4Scoring::Sigmoid => logits.iter().map(|&v| sigmoid(v)).collect(),
            V4Scoring::Softmax => {
                let mut s = logits.clone();
                softmax(&mut s);
                s
            }
        };
        let mut picked: Vec<usize> = match &m.route {
            V4Route::Bias(b) => {
                let scored: Vec<(f32, u32)> = scores
                    .iter()
                    .zip(b)
                    .enumerate()
                    .map(|(j, (s, b))| (s + b, j as u32))
                    .collect();
                top_k(scored, k).into_iter().map(|j| j as usize).collect()
            }
            V4Route::Hash(t) => t[token as usize * k..(token as usize + 1) * k]
                .iter()
                .map(|&j| j as usize)
                .collect(),
        };
        let mut total = 0f32;
        for &j in &picked {
            total += scores[j];
        }
        picked.sort_unstable();
        let clamp = |g: f32, u: f32| {
            let g = if g > c.swiglu_limit {
                c.swiglu_limit
            } else {
                g
            };
            let u = u.clamp(-c.swiglu_limit, c.swiglu_limit);
            silu(g) * u
        };
        let mut out = vec![0f32; d];
        for &j in &picked {
            let w = scores[j] / (total + 1e-20) * c.routed_scaling;
            let gu = &m.gate_up[j * 2 * i * d..(j + 1) * 2 * i * d];
            let mid: Vec<f32> = (0..i)
                .map(|r| {
                    clamp(
                        dot(&gu[r * d..(r + 1) * d], x),
                        dot(&gu[(i + r) * d..(i + r + 1) * d], x),
                    )
                })
                .collect();
            let down = &m.down[j * d * i..(j + 1) * d * i];
            for (r, o) in out.iter_mut().enumerate() {
                *o += dot(&down[r * i..(r + 1) * i], &mid) * w;
            }
        }
        let s = &m.shared;
        let g = s.gate.apply(x);
        let u = s.up.apply(x);
        let mid: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| clamp(g, u)).collect();
        for (o, v) in out.iter_mut().zip(s.down.apply(&mid)) {
            *o += v;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use dsa_kv_core::core::scheduler::{Scheduler, SchedulerLimits, SubmitRequest};
    use dsa_kv_core::core::{ManagerOptions, ModelCache, TierSlots, WindowedSlots};
    use dsa_kv_core::ids::{RequestId, TokenId};
    use dsa_kv_core::layout::V4Plan;
    use dsa_kv_core::rng::SplitMix64;
    use dsa_kv_device::sync_loop::SyncLoop;
    use dsa_kv_device::windowed::WindowedHostDevice;

    use super::super::v4_weights::tests::{dir, tensors, tiny_config, write};
    use super::super::HfV4Config;
    use crate::v4::{V4Contiguous, V4Model, V4ModelForward, V4Outputs};

    /// A random tiny `deepseek_v4` checkpoint (layers `[0, 4, 128]`, the first
    /// hash-routed) written to a fresh folder, and its model.
    fn model(name: &str, seed: u64) -> (std::path::PathBuf, Arc<V4Model>) {
        let json = tiny_config();
        let cfg = HfV4Config::parse(&json.to_string()).unwrap();
        let d = dir(name);
        write(&d, &json, &tensors(&cfg, &mut SplitMix64(seed)));
        let m = V4Model::from_checkpoint(&d).unwrap();
        (d, Arc::new(m))
    }

    /// Chunking changes no bit: one 700-token run equals the same tokens in chunks of
    /// 1 to 310 that straddle the 4- and 128-token groups and the window; the outputs are
    /// not degenerate (several greedy tokens).
    #[test]
    fn a_checkpoint_model_is_chunk_invariant() {
        let (d, m) = model("chunks", 3);
        let mut rng = SplitMix64(4);
        let prompt: Vec<u32> = (0..700).map(|_| rng.below(32) as u32).collect();
        let whole = m.run(&mut V4Contiguous::new(), 0, &prompt).unwrap();
        let mut kv = V4Contiguous::new();
        let mut outs = Vec::new();
        let mut at = 0;
        for n in [1usize, 3, 130, 256, 310] {
            outs.extend(m.run(&mut kv, at as u32, &prompt[at..at + n]).unwrap());
            at += n;
        }
        assert_eq!(outs, whole);
        let mut greedy: Vec<u32> = whole.iter().map(|o| o.greedy).collect();
        greedy.sort_unstable();
        greedy.dedup();
        assert!(greedy.len() > 3, "degenerate outputs: {greedy:?}");
        assert!(
            m.draft_write(&mut kv, 0, &[1], &[]).is_err(),
            "no MTP layer"
        );
        std::fs::remove_dir_all(d).unwrap();
    }

    /// Through the V4 scheduler, cache manager and a host device's pools (a shared
    /// prefix reused at a tail, chunked prefill, decoding), every request's tokens and
    /// every position's output equal the model run alone on a contiguous cache.
    #[test]
    fn a_checkpoint_model_runs_paged_as_unpaged() {
        let (d, m) = model("paged", 5);
        let plan = V4Plan::new(&m.config().spec().unwrap()).unwrap();
        let slots = WindowedSlots {
            blocks: TierSlots {
                gpu: vec![10],
                host: vec![],
            },
            windows: vec![16, 300, 200],
        };
        let opts = ManagerOptions {
            enable_partial_reuse: false,
            ..ManagerOptions::default()
        };
        let cache = ModelCache::windowed(&plan, slots.clone(), opts, 16).unwrap();
        let limits = SchedulerLimits {
            max_num_sequences: 2,
            max_num_tokens: 256,
            max_prefill_chunk: 150,
            max_seq_len: 2048,
            draft_tokens: 0,
            livelock_steps: 8,
            max_context_kv_tokens: 1 << 20,
            transfer_lease: std::time::Duration::from_secs(60),
        };
        let mut s = Scheduler::new(cache, None, limits);
        let outputs = Arc::new(Mutex::new(V4Outputs::default()));
        let forward = Box::new(V4ModelForward::new(m.clone(), outputs.clone()));
        let mut dev = WindowedHostDevice::new(0, &plan, &slots, forward).unwrap();
        let mut rng = SplitMix64(6);
        let system: Vec<u32> = (0..520).map(|_| rng.below(32) as u32).collect();
        let mut prompts = HashMap::new();
        for i in 0..3u64 {
            let mut p = system.clone();
            p.extend((0..10 + rng.below(60)).map(|_| rng.below(32) as u32));
            let toks = p.iter().map(|&t| TokenId(t)).collect();
            s.submit(SubmitRequest::new(RequestId(i), toks, 12))
                .unwrap();
            prompts.insert(RequestId(i), p);
        }
        let mut got = HashMap::new();
        let mut reused = 0;
        let mut run = SyncLoop::new();
        while let Some(step) = run.step(&mut s, &mut [&mut dev]).unwrap() {
            assert!(step.plan.failed.is_empty(), "{:?}", step.plan.failed);
            for f in step.finished {
                reused += f.reused_tokens;
                let out = f.output().iter().map(|t| t.0).collect::<Vec<u32>>();
                got.insert(f.id, out);
            }
        }
        let out = outputs.lock().unwrap();
        assert!(out.conflicts.is_empty(), "{:?}", out.conflicts);
        let mut positions = 0u64;
        for (id, p) in &prompts {
            let g = m.generate(p, 12).unwrap();
            assert_eq!(got[id], g.tokens, "request {id}");
            for (&pos, o) in &out.tokens[&(0, *id)] {
                assert_eq!(*o, g.outputs[pos as usize], "request {id}, position {pos}");
                positions += 1;
            }
        }
        assert!(
            reused >= 512,
            "the shared prefix was reused ({reused} tokens)"
        );
        // Every position but the reused ones was computed (the last token's own output
        // is not: generation stops there).
        let all: u64 = prompts.values().map(|p| p.len() as u64 + 11).sum();
        assert_eq!(positions + reused, all, "positions computed");
        std::fs::remove_dir_all(d).unwrap();
    }
}
