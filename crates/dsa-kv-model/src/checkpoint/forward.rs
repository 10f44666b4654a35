//! The forward of a checkpoint's model through a [`KvStore`], in the published
//! implementations' math (transformers' `DeepseekV32` / `GlmMoeDsa`) with our cache in
//! between: per layer, every new token's MLA row (the normed latent and the rotated key
//! RoPE part, in the cache's encoding) and indexer key (`LayerNorm(wk x)`, RoPE on its
//! first 64 values, FP8 with its scale) are written first; then each token's indexer
//! scores `Σ_h w_h · relu(q_h · k_j)` over the cached keys (the query in FP8, as the
//! DeepGEMM kernel takes it, `w_h = weights_proj(x)_h · heads^-½ · 128^-½`), the top-k
//! (or every position when the context fits, or the previous layer's selection on a GLM
//! layer that shares it), MLA over the selected rows in the absorbed form, the output
//! projection, and the dense MLP or the routed experts. Same loop order as the built-in
//! model: batch-invariant, so paged and unpaged runs give the same bits.
//!
//! Where it departs from the published code on purpose: the cache holds rows in BF16 or
//! `fp8_ds_mla` and indexer keys in FP8 (the published forward keeps them in float), and
//! the indexer's query is FP8 like the kernel's. A published forward run in float32 then
//! differs from ours by that rounding; `tests/hf_checkpoint.rs` says by how much.

use dsa_kv_core::config::KvDtype;
use dsa_kv_core::layout::FP8_DS_MLA_ROW_BYTES;
use dsa_kv_core::ops::mla::quantize_fp8_ds_mla_row;
use dsa_kv_core::ops::quant::{dequantize_fp8_token, quantize_fp8_token};

use super::config::Family;
use super::weights::{FeedForward, HfLayer, HfModel, Mlp};
use crate::config::{INDEX_DIM, INDEX_VALUE_BYTES, LATENT, ROPE};
use crate::math::{add, dot, exp, to_bf16, SumOrder};
use crate::model::{attend_head, decode_row, index_scores, output_of, top_k};
use crate::trace::{HeadTrace, IndexTrace, Trace, TracePoint};
use crate::{CacheFormat, KvStore, ModelError, TokenOut};

/// `w · x / sqrt(mean(x²) + eps)`.
pub(super) fn rmsnorm_w(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = dot(x, x) / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| w * (v * r)).collect()
}

/// `LayerNorm(x) · w + b` (eps 1e-6, biased variance).
fn layernorm(x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
    let n = x.len() as f32;
    let mut mean = 0f32;
    for v in x {
        mean += v;
    }
    mean /= n;
    let mut var = 0f32;
    for v in x {
        var += (v - mean) * (v - mean);
    }
    var /= n;
    let r = 1.0 / (var + 1e-6).sqrt();
    x.iter()
        .zip(w.iter().zip(b))
        .map(|(v, (w, b))| (v - mean) * r * w + b)
        .collect()
}

/// `x / (1 + e^-x)`.
pub(super) fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// `1 / (1 + e^-x)`.
pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

impl Mlp {
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        let g = self.gate.apply(x);
        let u = self.up.apply(x);
        let h: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        self.down.apply(&h)
    }
}

/// A token's q latent and its MLA query, per head (nope, RoPE part rotated).
struct Query {
    q_resid: Vec<f32>,
    heads: Vec<(Vec<f32>, Vec<f32>)>,
}

impl HfModel {
    /// Runs one request's new tokens `tokens` at positions `first..` (the cache holds
    /// `0..first`); writes their KV to `kv`; returns each token's output and final
    /// hidden state, and the traces of `points`.
    pub(crate) fn run(
        &self,
        format: &CacheFormat,
        kv: &mut dyn KvStore,
        first: u32,
        tokens: &[u32],
        points: &[TracePoint],
        traces: &mut Vec<Trace>,
    ) -> Result<(Vec<TokenOut>, Vec<Vec<f32>>), ModelError> {
        let c = &self.cfg;
        // A checkpoint's ids come from its tokenizer: one past the vocabulary is an error,
        // not another token (the built-in model folds ids into its vocabulary instead).
        if let Some((index, &token)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= c.vocab)
        {
            return Err(ModelError::TokenOutOfVocab {
                token,
                index,
                vocab: c.vocab,
            });
        }
        let mut xs: Vec<Vec<f32>> = tokens
            .iter()
            .map(|&t| {
                let r = t as usize;
                self.embed.w[r * c.hidden..(r + 1) * c.hidden].to_vec()
            })
            .collect();
        // The previous indexer layer's selection of each new token (GLM's shared layers).
        let mut shared: Vec<Vec<u32>> = vec![Vec::new(); tokens.len()];
        for (l, layer) in self.layers.iter().enumerate() {
            let hs: Vec<Vec<f32>> = xs
                .iter()
                .map(|x| rmsnorm_w(x, &layer.input_norm, c.rms_norm_eps))
                .collect();
            let queries: Vec<Query> = hs
                .iter()
                .enumerate()
                .map(|(i, h)| self.query(layer, h, first + i as u32))
                .collect();
            for (i, h) in hs.iter().enumerate() {
                self.write_kv(format, kv, l, layer, h, first + i as u32)?;
            }
            for (i, (h, q)) in hs.iter().zip(&queries).enumerate() {
                let pos = first + i as u32;
                let point = TracePoint { layer: l, pos };
                let mut trace = points.contains(&point).then(|| Trace::new(point));
                let sel = match &layer.indexer {
                    Some(_) => {
                        let s = self.select(format, kv, l, layer, h, q, pos, trace.as_mut())?;
                        shared[i] = s.clone();
                        s
                    }
                    None => shared[i].clone(),
                };
                let attn = self.attend(format, kv, l, layer, q, &sel, trace.as_mut())?;
                traces.extend(trace);
                add(&mut xs[i], &attn);
                let hn = rmsnorm_w(&xs[i], &layer.post_norm, c.rms_norm_eps);
                let ff = self.feed_forward(&layer.ffn, &hn);
                add(&mut xs[i], &ff);
            }
        }
        let outs = xs
            .iter()
            .enumerate()
            .map(|(i, x)| output_of(&self.logits(x), first + i as u32))
            .collect();
        Ok((outs, xs))
    }

    /// The logits after final hidden state `x`: the head (or the tied embedding) over
    /// the final norm.
    pub(crate) fn logits(&self, x: &[f32]) -> Vec<f32> {
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        head.apply(&rmsnorm_w(x, &self.norm, self.cfg.rms_norm_eps))
    }

    fn query(&self, layer: &HfLayer, h: &[f32], pos: u32) -> Query {
        let a = &layer.attn;
        let q_resid = rmsnorm_w(&a.q_a.apply(h), &a.q_a_norm, 1e-6);
        let q = a.q_b.apply(&q_resid);
        let per = self.cfg.nope_dim + ROPE;
        let heads = q
            .chunks_exact(per)
            .map(|hq| {
                let mut pe = hq[self.cfg.nope_dim..].to_vec();
                self.rope.interleaved(&mut pe, pos);
                (hq[..self.cfg.nope_dim].to_vec(), pe)
            })
            .collect();
        Query { q_resid, heads }
    }

    fn write_kv(
        &self,
        format: &CacheFormat,
        kv: &mut dyn KvStore,
        l: usize,
        layer: &HfLayer,
        h: &[f32],
        pos: u32,
    ) -> Result<(), ModelError> {
        let a = &layer.attn;
        let ckv = a.kv_a.apply(h);
        let mut row = rmsnorm_w(&ckv[..LATENT], &a.kv_a_norm, 1e-6);
        let mut pe = ckv[LATENT..].to_vec();
        self.rope.interleaved(&mut pe, pos);
        row.extend_from_slice(&pe);
        let row = to_bf16(&row);
        let bytes = match format.kv_dtype {
            KvDtype::Fp8DsMla => {
                let mut out = vec![0u8; FP8_DS_MLA_ROW_BYTES];
                quantize_fp8_ds_mla_row(&row, format.scale_format, &mut out);
                out
            }
            _ => row.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        };
        kv.write_row(l, pos, &bytes)?;
        if let Some(ix) = &layer.indexer {
            let mut k = layernorm(&ix.wk.apply(h), &ix.k_norm_w, &ix.k_norm_b);
            self.index_rope(&mut k[..ROPE], pos);
            let (mut values, mut scale) = ([0u8; INDEX_VALUE_BYTES], [0u8; 4]);
            quantize_fp8_token(&to_bf16(&k), format.scale_format, &mut values, &mut scale);
            kv.write_index_key(l, pos, &values, &scale)?;
        }
        Ok(())
    }

    /// The indexer's RoPE: half-split pairs in DeepSeek-V3.2, interleaved in GLM.
    fn index_rope(&self, x: &mut [f32], pos: u32) {
        match self.cfg.family {
            Family::DeepseekV32 => self.rope.half_split(x, pos),
            Family::GlmMoeDsa => self.rope.interleaved(x, pos),
        }
    }

    /// The positions token `pos` attends to, ascending: every position when the
    /// context fits in the top-k, else the `index_topk` best scores (equal scores: the
    /// earlier position).
    #[allow(clippy::too_many_arguments)]
    fn select(
        &self,
        format: &CacheFormat,
        kv: &dyn KvStore,
        l: usize,
        layer: &HfLayer,
        h: &[f32],
        q: &Query,
        pos: u32,
        trace: Option<&mut Trace>,
    ) -> Result<Vec<u32>, ModelError> {
        let c = &self.cfg;
        let n = pos as usize + 1;
        if n <= c.index_topk && trace.is_none() {
            return Ok((0..=pos).collect());
        }
        let ix = layer
            .indexer
            .as_ref()
            .expect("invariant: select runs on indexer layers");
        let mut index = trace.is_some().then(IndexTrace::default);
        let qs: Vec<Vec<f32>> = ix
            .wq_b
            .apply(&q.q_resid)
            .chunks_exact(INDEX_DIM)
            .map(|hq| {
                let mut hq = hq.to_vec();
                self.index_rope(&mut hq[..ROPE], pos);
                let (mut v, mut s) = ([0u8; INDEX_DIM], [0u8; 4]);
                quantize_fp8_token(&to_bf16(&hq), format.scale_format, &mut v, &mut s);
                if let Some(t) = index.as_mut() {
                    t.q_fp8.push(v);
                    t.q_scale.push(s);
                }
                let mut out = vec![0f32; INDEX_DIM];
                dequantize_fp8_token(&v, &s, &mut out);
                out
            })
            .collect();
        let fold = ((c.index_heads as f64).powf(-0.5) * (INDEX_DIM as f64).powf(-0.5)) as f32;
        let w: Vec<f32> = ix.weights_proj.apply(h).iter().map(|v| v * fold).collect();
        let scored = index_scores(kv, l, pos, &qs, &w, SumOrder::Ascending)?;
        if let (Some(trace), Some(mut t)) = (trace, index) {
            t.weights = w;
            t.logits = scored.iter().map(|&(s, _)| s).collect();
            trace.index = Some(t);
        }
        if n <= c.index_topk {
            return Ok((0..=pos).collect());
        }
        Ok(top_k(scored, c.index_topk))
    }

    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        format: &CacheFormat,
        kv: &dyn KvStore,
        l: usize,
        layer: &HfLayer,
        q: &Query,
        sel: &[u32],
        mut trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, ModelError> {
        let a = &layer.attn;
        let rows: Vec<(Vec<f32>, Vec<f32>)> = kv
            .rows(l, sel)?
            .into_iter()
            .map(|r| decode_row(format, r))
            .collect();
        let scale = self.softmax_scale;
        if let Some(t) = trace.as_deref_mut() {
            t.global = sel
                .iter()
                .map(|&p| kv.global_index(l, p))
                .collect::<Result<_, _>>()?;
            t.selected = sel.to_vec();
            t.softmax_scale = scale;
        }
        let mut heads = Vec::with_capacity(self.cfg.heads * self.cfg.v_dim);
        for (hd, (q_nope, q_pe)) in q.heads.iter().enumerate() {
            let q_lat = a.w_uk[hd].apply_t(q_nope);
            let o_lat = attend_head(&q_lat, q_pe, &rows, scale, SumOrder::Ascending);
            heads.extend(a.w_uv[hd].apply(&o_lat));
            if let Some(t) = trace.as_deref_mut() {
                t.heads.push(HeadTrace {
                    q_lat,
                    q_pe: q_pe.clone(),
                    o_lat,
                });
            }
        }
        let out = a.o.apply(&heads);
        if let Some(t) = trace {
            t.attn_out.clone_from(&out);
        }
        Ok(out)
    }

    fn feed_forward(&self, ffn: &FeedForward, x: &[f32]) -> Vec<f32> {
        let c = &self.cfg;
        match ffn {
            FeedForward::Dense(m) => m.apply(x),
            FeedForward::Moe {
                router,
                bias,
                experts,
                shared,
            } => {
                let s: Vec<f32> = router.apply(x).into_iter().map(sigmoid).collect();
                let biased: Vec<f32> = s.iter().zip(bias).map(|(s, b)| s + b).collect();
                // Groups ranked by the sum of their two best biased scores.
                let per = c.experts / c.groups;
                let mut groups: Vec<(f32, usize)> = biased
                    .chunks_exact(per)
                    .enumerate()
                    .map(|(g, ch)| {
                        let mut top = [f32::NEG_INFINITY; 2];
                        for &v in ch {
                            if v > top[0] {
                                top = [v, top[0]];
                            } else if v > top[1] {
                                top[1] = v;
                            }
                        }
                        (top[0] + top[1], g)
                    })
                    .collect();
                groups.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let keep: Vec<usize> = groups[..c.topk_groups].iter().map(|&(_, g)| g).collect();
                let mut cand: Vec<(f32, usize)> = biased
                    .iter()
                    .enumerate()
                    .filter(|(e, _)| keep.contains(&(e / per)))
                    .map(|(e, &v)| (v, e))
                    .collect();
                cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let chosen = &cand[..c.experts_per_token];
                let mut w: Vec<f32> = chosen.iter().map(|&(_, e)| s[e]).collect();
                if c.norm_topk_prob {
                    let mut sum = 0f32;
                    for v in &w {
                        sum += v;
                    }
                    for v in w.iter_mut() {
                        *v /= sum + 1e-20;
                    }
                }
                let mut out = vec![0f32; x.len()];
                for (&(_, e), wi) in chosen.iter().zip(&w) {
                    let y = experts[e].apply(x);
                    for (o, v) in out.iter_mut().zip(&y) {
                        *o += wi * c.routed_scaling * v;
                    }
                }
                add(&mut out, &shared.apply(x));
                out
            }
        }
    }
}
