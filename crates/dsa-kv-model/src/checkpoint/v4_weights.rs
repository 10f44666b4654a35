//! A `deepseek_v4` checkpoint's weights under the names transformers saves them with
//! (`model.layers.{l}.self_attn.*`, `….mlp.*`, `….{attn,ffn}_hc.*`, `model.hc_head.*`),
//! every shape checked against the configuration, every tensor taken once, leftovers
//! refused (but the MTP layer's `mtp.*`, which transformers ignores too), and the two
//! RoPE tables the configuration asks for. `v4_forward.rs` runs them.

use dsa_kv_core::config::file::{read_regular_text, MAX_CONFIG_FILE_BYTES};
use std::path::Path;

use super::tensors::Tensors;
use super::v4_config::{HfV4Config, V4MlpKind};
use super::weights::{Mlp, Rope};
use super::CheckpointError;
use crate::config::{INDEX_DIM, LATENT};
use crate::math::Mat;

/// A manifold hyper-connection's weights (`fn`, `base`, `scale`).
pub(crate) struct Hc {
    /// `[outputs, hc_mult · hidden]`.
    pub(crate) fn_: Mat,
    pub(crate) base: Vec<f32>,
    pub(crate) scale: Vec<f32>,
}

/// A compressor (the attention's at width 512, or the indexer's at 128).
pub(crate) struct V4Comp {
    /// `[coff · width, hidden]`.
    pub(crate) kv: Mat,
    /// `[coff · width, hidden]`.
    pub(crate) gate: Mat,
    /// `position_bias`: `[ratio, coff · width]`.
    pub(crate) ape: Mat,
    /// `kv_norm`: `[width]`.
    pub(crate) norm: Vec<f32>,
}

/// The indexer of a ratio-4 layer.
pub(crate) struct V4HfIndexer {
    pub(crate) comp: V4Comp,
    /// `[index_heads · 128, q_lora]`.
    pub(crate) q_b: Mat,
    /// `scorer.weights_proj`: `[index_heads, hidden]`.
    pub(crate) weights: Mat,
}

/// A layer's attention.
pub(crate) struct V4HfAttn {
    /// `[q_lora, hidden]`.
    pub(crate) q_a: Mat,
    pub(crate) q_a_norm: Vec<f32>,
    /// `[heads · 512, q_lora]`.
    pub(crate) q_b: Mat,
    /// `[512, hidden]`.
    pub(crate) kv: Mat,
    pub(crate) kv_norm: Vec<f32>,
    /// `[o_groups · o_lora, heads · 512 / o_groups]`: group `g`'s rows
    /// `g·o_lora .. (g+1)·o_lora`.
    pub(crate) o_a: Mat,
    /// `[hidden, o_groups · o_lora]`.
    pub(crate) o_b: Mat,
    pub(crate) sinks: Vec<f32>,
    pub(crate) comp: Option<V4Comp>,
    pub(crate) index: Option<V4HfIndexer>,
}

/// How a layer's router picks its experts.
pub(crate) enum V4Route {
    /// Top-k of the scores plus `e_score_correction_bias`.
    Bias(Vec<f32>),
    /// `tid2eid`: per token id, its `experts_per_token` experts.
    Hash(Vec<u32>),
}

/// A layer's mixture of experts.
pub(crate) struct V4Moe {
    /// `gate.weight`: `[experts, hidden]`.
    pub(crate) router: Mat,
    pub(crate) route: V4Route,
    /// `experts.gate_up_proj`: `[experts, 2 · intermediate, hidden]` (gate rows first).
    pub(crate) gate_up: Vec<f32>,
    /// `experts.down_proj`: `[experts, hidden, intermediate]`.
    pub(crate) down: Vec<f32>,
    pub(crate) shared: Mlp,
}

/// A decoder layer.
pub(crate) struct V4HfLayer {
    pub(crate) input_norm: Vec<f32>,
    pub(crate) post_norm: Vec<f32>,
    pub(crate) attn_hc: Hc,
    pub(crate) ffn_hc: Hc,
    pub(crate) attn: V4HfAttn,
    pub(crate) moe: V4Moe,
}

/// The published MTP layer (`mtp.0.*`, the names of DeepSeek's release, which vLLM
/// loads): for the token at `j` and the target's residual streams at `j − 1`,
/// `h_proj(hnorm(streams)) + e_proj(enorm(embed(token)))` into a window-only decoder
/// layer, then its own `hc_head`, `norm` and `head`.
pub(crate) struct V4HfMtp {
    pub(crate) enorm: Vec<f32>,
    pub(crate) hnorm: Vec<f32>,
    /// `[hidden, hidden]`.
    pub(crate) e_proj: Mat,
    /// `[hidden, hidden]`, applied to each stream.
    pub(crate) h_proj: Mat,
    pub(crate) layer: V4HfLayer,
    pub(crate) hc_head: Hc,
    pub(crate) norm: Vec<f32>,
    /// `None`: the target's head.
    pub(crate) head: Option<Mat>,
    /// `emb.tok_emb.weight`; `None`: the target's embedding.
    pub(crate) embed: Option<Mat>,
}

/// A `deepseek_v4` model loaded from a checkpoint.
pub(crate) struct HfV4Model {
    pub(crate) cfg: HfV4Config,
    pub(crate) embed: Mat,
    /// `None`: tied to the embedding.
    pub(crate) head: Option<Mat>,
    pub(crate) norm: Vec<f32>,
    /// `hc_head`: `fn [hc_mult, hc_mult · hidden]`, `base [hc_mult]`, `scale [1]`.
    pub(crate) hc_head: Hc,
    pub(crate) layers: Vec<V4HfLayer>,
    /// The MTP layer, when the configuration asks for one (`num_nextn_predict_layers`)
    /// and the checkpoint has its tensors.
    pub(crate) mtp: Option<V4HfMtp>,
    /// Window-only layers' RoPE.
    pub(crate) main_rope: Rope,
    /// Compressed layers' RoPE (queries, latent, compressor, indexer).
    pub(crate) compress_rope: Rope,
    /// With `Some`, the forward keeps every row as computed and reads those instead of
    /// the cache's rounded bytes, and leaves its queries unrounded: the oracle test's
    /// way to separate the math from the cache's formats. Not a serving path.
    pub(crate) float: Option<std::sync::Mutex<super::v4_forward::FloatRows>>,
}

fn mat(t: &mut Tensors, name: &str, rows: usize, cols: usize) -> Result<Mat, CheckpointError> {
    Ok(Mat {
        rows,
        cols,
        w: t.take(name, &[rows, cols])?,
    })
}

/// Which names the checkpoint stores its tensors under.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Names {
    /// What transformers' `save_pretrained` writes (5.17): the published checkpoint's
    /// names under `model.` (`model.layers.{l}.attn.wq_a.weight`, `…ffn.experts.{e}.w1`,
    /// `…hc_attn_fn`, `head.weight`). The published checkpoint itself (no `model.`) is
    /// renamed to these at load ([`published_name`]).
    Saved,
    /// transformers' module names (`model.layers.{l}.self_attn.q_a_proj.weight`,
    /// `…mlp.experts.gate_up_proj`, `…attn_hc.fn`, `lm_head.weight`).
    Modules,
}

impl Names {
    fn detect(t: &Tensors) -> Names {
        if t.has("model.layers.0.attn_norm.weight") {
            Names::Saved
        } else {
            Names::Modules
        }
    }

    /// `(saved, modules)` by scheme.
    fn pick<'a>(self, saved: &'a str, modules: &'a str) -> &'a str {
        match self {
            Names::Saved => saved,
            Names::Modules => modules,
        }
    }
}

fn hc(
    t: &mut Tensors,
    names: [String; 3],
    outs: usize,
    cols: usize,
    scales: usize,
) -> Result<Hc, CheckpointError> {
    let [f, b, s] = names;
    Ok(Hc {
        fn_: mat(t, &f, outs, cols)?,
        base: t.take(&b, &[outs])?,
        scale: t.take(&s, &[scales])?,
    })
}

/// A compressor at `p` (ratio-4 ones carry two halves per row).
fn comp(
    t: &mut Tensors,
    nm: Names,
    p: &str,
    ratio: usize,
    width: usize,
    hidden: usize,
) -> Result<V4Comp, CheckpointError> {
    let coff = if ratio == 4 { 2 } else { 1 };
    let n = |saved: &str, modules: &str| format!("{p}{}", nm.pick(saved, modules));
    Ok(V4Comp {
        kv: mat(t, &n("wkv.weight", "kv_proj.weight"), coff * width, hidden)?,
        gate: mat(
            t,
            &n("wgate.weight", "gate_proj.weight"),
            coff * width,
            hidden,
        )?,
        ape: mat(t, &n("ape", "position_bias"), ratio, coff * width)?,
        norm: t.take(&n("norm.weight", "kv_norm.weight"), &[width])?,
    })
}

/// A SwiGLU MLP at `p`: `w1` / `w3` / `w2` (saved) or `gate_proj` / `up_proj` /
/// `down_proj` (modules).
fn mlp(
    t: &mut Tensors,
    nm: Names,
    p: &str,
    width: usize,
    hidden: usize,
) -> Result<Mlp, CheckpointError> {
    let n = |saved: &str, modules: &str| format!("{p}{}.weight", nm.pick(saved, modules));
    Ok(Mlp {
        gate: mat(t, &n("w1", "gate_proj"), width, hidden)?,
        up: mat(t, &n("w3", "up_proj"), width, hidden)?,
        down: mat(t, &n("w2", "down_proj"), hidden, width)?,
    })
}

/// The name under which transformers saves a tensor of DeepSeek's published checkpoint
/// (whose names have no `model.`): `embed.weight`, `norm.weight`, `hc_head_{fn,base,scale}`
/// and `layers.*` move under `model.`; `head.weight` and `mtp.*` stay.
fn published_name(name: &str) -> Option<String> {
    let moved = match name {
        "embed.weight" => "model.embed_tokens.weight",
        "norm.weight" => "model.norm.weight",
        "hc_head_fn" => "model.hc_head.hc_fn",
        "hc_head_base" => "model.hc_head.hc_base",
        "hc_head_scale" => "model.hc_head.hc_scale",
        n if n.starts_with("layers.") => return Some(format!("model.{n}")),
        _ => return None,
    };
    Some(moved.into())
}

/// Whether transformers ignores `name` on load (`(^|\.)mtp\.`: the MTP layer).
fn is_mtp(name: &str) -> bool {
    name.starts_with("mtp.") || name.contains(".mtp.")
}

/// The decoder layer whose tensors are under `p` (`model.layers.{l}.`, or the MTP
/// layer's `mtp.0.`): attention (with its compressor and indexer at ratio 4 or 128),
/// experts routed as `kind` says, norms and hyper-connections.
fn layer(
    t: &mut Tensors,
    nm: Names,
    cfg: &HfV4Config,
    p: &str,
    ratio: usize,
    kind: V4MlpKind,
) -> Result<V4HfLayer, CheckpointError> {
    let (d, h, n) = (cfg.hidden, cfg.heads, cfg.hc_mult);
    let hc_outs = (2 + n) * n;
    let a = format!("{p}{}", nm.pick("attn.", "self_attn."));
    let an = |saved: &str, modules: &str| format!("{a}{}", nm.pick(saved, modules));
    let c = format!("{a}compressor.");
    let ix = format!("{a}{}", nm.pick("indexer.", "compressor.indexer."));
    let index = if ratio == 4 {
        let ixc = format!("{ix}{}", nm.pick("compressor.", ""));
        Some(V4HfIndexer {
            comp: comp(t, nm, &ixc, 4, INDEX_DIM, d)?,
            q_b: mat(
                t,
                &format!("{ix}{}", nm.pick("wq_b.weight", "q_b_proj.weight")),
                cfg.index_heads * INDEX_DIM,
                cfg.q_lora,
            )?,
            weights: mat(
                t,
                &format!(
                    "{ix}{}",
                    nm.pick("weights_proj.weight", "scorer.weights_proj.weight")
                ),
                cfg.index_heads,
                d,
            )?,
        })
    } else {
        None
    };
    let attn = V4HfAttn {
        q_a: mat(t, &an("wq_a.weight", "q_a_proj.weight"), cfg.q_lora, d)?,
        q_a_norm: t.take(&an("q_norm.weight", "q_a_norm.weight"), &[cfg.q_lora])?,
        q_b: mat(
            t,
            &an("wq_b.weight", "q_b_proj.weight"),
            h * LATENT,
            cfg.q_lora,
        )?,
        kv: mat(t, &an("wkv.weight", "kv_proj.weight"), LATENT, d)?,
        kv_norm: t.take(&an("norm.weight", "kv_norm.weight"), &[LATENT])?,
        o_a: mat(
            t,
            &an("wo_a.weight", "o_a_proj.weight"),
            cfg.o_groups * cfg.o_lora,
            h * LATENT / cfg.o_groups,
        )?,
        o_b: mat(
            t,
            &an("wo_b.weight", "o_b_proj.weight"),
            d,
            cfg.o_groups * cfg.o_lora,
        )?,
        sinks: t.take(&an("attn_sink", "sinks"), &[h])?,
        comp: (ratio > 0)
            .then(|| comp(t, nm, &c, ratio, LATENT, d))
            .transpose()?,
        index,
    };
    let mp = format!("{p}{}", nm.pick("ffn.", "mlp."));
    let (e, k, i) = (cfg.experts, cfg.experts_per_token, cfg.moe_intermediate);
    let route = match kind {
        V4MlpKind::Moe => V4Route::Bias(t.take(
            &format!(
                "{mp}{}",
                nm.pick("gate.bias", "gate.e_score_correction_bias")
            ),
            &[e],
        )?),
        V4MlpKind::HashMoe => {
            let name = format!("{mp}gate.tid2eid");
            let ids = t.take_ints(&name, &[cfg.vocab, k])?;
            let table = ids
                .iter()
                .map(|&x| u32::try_from(x).ok().filter(|&x| (x as usize) < e))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| CheckpointError::Tensor {
                    name: name.clone(),
                    what: format!("an expert id outside 0..{e}"),
                })?;
            V4Route::Hash(table)
        }
    };
    let (gate_up, down) = match nm {
        Names::Modules => (
            t.take(&format!("{mp}experts.gate_up_proj"), &[e, 2 * i, d])?,
            t.take(&format!("{mp}experts.down_proj"), &[e, d, i])?,
        ),
        Names::Saved => {
            let (mut gate_up, mut down) = (Vec::new(), Vec::new());
            for x in 0..e {
                let m = mlp(t, nm, &format!("{mp}experts.{x}."), i, d)?;
                gate_up.extend(m.gate.w);
                gate_up.extend(m.up.w);
                down.extend(m.down.w);
            }
            (gate_up, down)
        }
    };
    let moe = V4Moe {
        router: mat(t, &format!("{mp}gate.weight"), e, d)?,
        route,
        gate_up,
        down,
        shared: mlp(t, nm, &format!("{mp}shared_experts."), i, d)?,
    };
    let hcn = |saved: &str, modules: &str| {
        ["fn", "base", "scale"].map(|k| match nm {
            Names::Saved => format!("{p}{saved}_{k}"),
            Names::Modules => format!("{p}{modules}.{k}"),
        })
    };
    Ok(V4HfLayer {
        input_norm: t.take(
            &format!(
                "{p}{}",
                nm.pick("attn_norm.weight", "input_layernorm.weight")
            ),
            &[d],
        )?,
        post_norm: t.take(
            &format!(
                "{p}{}",
                nm.pick("ffn_norm.weight", "post_attention_layernorm.weight")
            ),
            &[d],
        )?,
        attn_hc: hc(t, hcn("hc_attn", "attn_hc"), hc_outs, n * d, 3)?,
        ffn_hc: hc(t, hcn("hc_ffn", "ffn_hc"), hc_outs, n * d, 3)?,
        attn,
        moe,
    })
}

impl HfV4Model {
    /// Reads the checkpoint in `dir` (`config.json` and its safetensors).
    pub(crate) fn load(dir: &Path) -> Result<HfV4Model, CheckpointError> {
        let path = dir.join("config.json");
        let text =
            read_regular_text(&path, MAX_CONFIG_FILE_BYTES).map_err(|e| CheckpointError::Io {
                path: path.display().to_string(),
                what: e.to_string(),
            })?;
        let cfg = HfV4Config::parse(&text)?;
        let mut t = Tensors::load(dir)?;
        if !t.has("model.layers.0.attn_norm.weight") && t.has("layers.0.attn_norm.weight") {
            t.rename(published_name)?;
        }
        let m = Self::from_tensors(cfg, &mut t)?;
        // transformers ignores `mtp.*`; so do we unless the MTP layer was loaded (then a
        // second MTP layer's tensors are refused: one is supported).
        let left: Vec<String> = t
            .left()
            .into_iter()
            .filter(|n| m.mtp.is_some() || !is_mtp(n))
            .collect();
        if !left.is_empty() {
            return Err(CheckpointError::Tensor {
                name: left[0].clone(),
                what: format!(
                    "{} tensor(s) that this configuration has no place for: {}",
                    left.len(),
                    left.iter().take(4).cloned().collect::<Vec<_>>().join(", ")
                ),
            });
        }
        Ok(m)
    }

    fn from_tensors(cfg: HfV4Config, t: &mut Tensors) -> Result<HfV4Model, CheckpointError> {
        let nm = Names::detect(t);
        let (d, n) = (cfg.hidden, cfg.hc_mult);
        let embed = mat(t, "model.embed_tokens.weight", cfg.vocab, d)?;
        // Grown as layers load: the configuration's count is not trusted with a
        // reservation (2^24 layers would reserve gigabytes before the first tensor).
        let mut layers = Vec::new();
        for (l, &ratio) in cfg.ratios.iter().enumerate() {
            let p = format!("model.layers.{l}.");
            layers.push(layer(t, nm, &cfg, &p, ratio as usize, cfg.mlp[l])?);
        }
        let norm = t.take("model.norm.weight", &[d])?;
        let hc_head = hc(
            t,
            ["hc_fn", "hc_base", "hc_scale"].map(|k| format!("model.hc_head.{k}")),
            n,
            n * d,
            1,
        )?;
        let head_name = nm.pick("head.weight", "lm_head.weight");
        let head = if cfg.tie_embeddings {
            if let Some(w) = t.take_opt(head_name, &[cfg.vocab, d])? {
                if w != embed.w {
                    return Err(CheckpointError::Tensor {
                        name: head_name.into(),
                        what: "differs from the embedding, but tie_word_embeddings is true".into(),
                    });
                }
            }
            None
        } else {
            Some(mat(t, head_name, cfg.vocab, d)?)
        };
        let mtp = if cfg.mtp_layers > 0 && t.left().iter().any(|n| n.starts_with("mtp.0.")) {
            let head = t.take_opt("mtp.0.head.weight", &[cfg.vocab, d])?;
            let embed = t.take_opt("mtp.0.emb.tok_emb.weight", &[cfg.vocab, d])?;
            let m = |w: Vec<f32>| Mat {
                rows: cfg.vocab,
                cols: d,
                w,
            };
            Some(V4HfMtp {
                enorm: t.take("mtp.0.enorm.weight", &[d])?,
                hnorm: t.take("mtp.0.hnorm.weight", &[d])?,
                e_proj: mat(t, "mtp.0.e_proj.weight", d, d)?,
                h_proj: mat(t, "mtp.0.h_proj.weight", d, d)?,
                layer: layer(t, Names::Saved, &cfg, "mtp.0.", 0, V4MlpKind::Moe)?,
                hc_head: hc(
                    t,
                    ["fn", "base", "scale"].map(|k| format!("mtp.0.hc_head_{k}")),
                    n,
                    n * d,
                    1,
                )?,
                norm: t.take("mtp.0.norm.weight", &[d])?,
                head: head.map(m),
                embed: embed.map(m),
            })
        } else {
            None
        };
        Ok(HfV4Model {
            mtp,
            main_rope: Rope::unscaled(&cfg.main_rope),
            compress_rope: Rope::unscaled(&cfg.compress_rope),
            float: None,
            cfg,
            embed,
            head,
            norm,
            hc_head,
            layers,
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::collections::BTreeMap;

    use safetensors::tensor::TensorView;
    use safetensors::Dtype;

    use super::*;
    use dsa_kv_core::rng::SplitMix64;

    /// Tensors by name: shape, little-endian bytes, dtype.
    pub(crate) type Named = BTreeMap<String, (Vec<usize>, Vec<u8>, Dtype)>;
    /// An edit of a checkpoint's tensors.
    type Edit = Box<dyn Fn(&mut Named)>;

    /// A tiny `deepseek_v4` configuration our cache can hold (head 512, RoPE 64,
    /// indexer 128; window 128, top-64), layers `[0, 4, 128]`, the first hash-routed.
    pub(crate) fn tiny_config() -> serde_json::Value {
        serde_json::json!({
            "model_type": "deepseek_v4", "vocab_size": 32, "hidden_size": 16,
            "num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 512,
            "q_lora_rank": 8, "o_groups": 2, "o_lora_rank": 6,
            "compress_ratios": [0, 4, 128], "num_hash_layers": 1,
            "index_n_heads": 2, "index_head_dim": 128, "index_topk": 64,
            "sliding_window": 128, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 5, "hc_mult": 2, "hc_sinkhorn_iters": 3
        })
    }

    /// Every tensor the tiny configuration needs, by name: (shape, values), with
    /// `tid2eid` as i64.
    pub(crate) fn tensors(cfg: &HfV4Config, rng: &mut SplitMix64) -> Named {
        let mut out = BTreeMap::new();
        let mut f = |name: String, shape: Vec<usize>| {
            let n: usize = shape.iter().product();
            let bytes: Vec<u8> = (0..n)
                .flat_map(|_| ((rng.below(2001) as f32 - 1000.0) / 1000.0).to_le_bytes())
                .collect();
            out.insert(name, (shape, bytes, Dtype::F32));
        };
        let (d, h, n, e, i) = (
            cfg.hidden,
            cfg.heads,
            cfg.hc_mult,
            cfg.experts,
            cfg.moe_intermediate,
        );
        f("model.embed_tokens.weight".into(), vec![cfg.vocab, d]);
        f("lm_head.weight".into(), vec![cfg.vocab, d]);
        f("model.norm.weight".into(), vec![d]);
        f("model.hc_head.hc_fn".into(), vec![n, n * d]);
        f("model.hc_head.hc_base".into(), vec![n]);
        f("model.hc_head.hc_scale".into(), vec![1]);
        let mut ints = Vec::new();
        for (l, &r) in cfg.ratios.iter().enumerate() {
            let p = format!("model.layers.{l}.");
            for k in ["input_layernorm", "post_attention_layernorm"] {
                f(format!("{p}{k}.weight"), vec![d]);
            }
            for k in ["attn_hc", "ffn_hc"] {
                f(format!("{p}{k}.fn"), vec![(2 + n) * n, n * d]);
                f(format!("{p}{k}.base"), vec![(2 + n) * n]);
                f(format!("{p}{k}.scale"), vec![3]);
            }
            let a = format!("{p}self_attn.");
            f(format!("{a}q_a_proj.weight"), vec![cfg.q_lora, d]);
            f(format!("{a}q_a_norm.weight"), vec![cfg.q_lora]);
            f(format!("{a}q_b_proj.weight"), vec![h * 512, cfg.q_lora]);
            f(format!("{a}kv_proj.weight"), vec![512, d]);
            f(format!("{a}kv_norm.weight"), vec![512]);
            f(
                format!("{a}o_a_proj.weight"),
                vec![cfg.o_groups * cfg.o_lora, h * 512 / cfg.o_groups],
            );
            f(
                format!("{a}o_b_proj.weight"),
                vec![d, cfg.o_groups * cfg.o_lora],
            );
            f(format!("{a}sinks"), vec![h]);
            let mut comp = |p: String, r: usize, w: usize| {
                let coff = if r == 4 { 2 } else { 1 };
                f(format!("{p}kv_proj.weight"), vec![coff * w, d]);
                f(format!("{p}gate_proj.weight"), vec![coff * w, d]);
                f(format!("{p}position_bias"), vec![r, coff * w]);
                f(format!("{p}kv_norm.weight"), vec![w]);
            };
            if r > 0 {
                comp(format!("{a}compressor."), r as usize, 512);
            }
            if r == 4 {
                let ix = format!("{a}compressor.indexer.");
                comp(ix.clone(), 4, 128);
                f(
                    format!("{ix}q_b_proj.weight"),
                    vec![cfg.index_heads * 128, cfg.q_lora],
                );
                f(
                    format!("{ix}scorer.weights_proj.weight"),
                    vec![cfg.index_heads, d],
                );
            }
            let m = format!("{p}mlp.");
            f(format!("{m}gate.weight"), vec![e, d]);
            match cfg.mlp[l] {
                V4MlpKind::Moe => f(format!("{m}gate.e_score_correction_bias"), vec![e]),
                V4MlpKind::HashMoe => ints.push(format!("{m}gate.tid2eid")),
            }
            f(format!("{m}experts.gate_up_proj"), vec![e, 2 * i, d]);
            f(format!("{m}experts.down_proj"), vec![e, d, i]);
            for (k, s) in [
                ("gate_proj", vec![i, d]),
                ("up_proj", vec![i, d]),
                ("down_proj", vec![d, i]),
            ] {
                f(format!("{m}shared_experts.{k}.weight"), s);
            }
        }
        for name in ints {
            let k = cfg.experts_per_token;
            let bytes: Vec<u8> = (0..cfg.vocab * k)
                .flat_map(|_| (rng.below(e as u64) as i64).to_le_bytes())
                .collect();
            out.insert(name, (vec![cfg.vocab, k], bytes, Dtype::I64));
        }
        out
    }

    pub(crate) fn write(dir: &Path, cfg: &serde_json::Value, t: &Named) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let views: Vec<(String, TensorView<'_>)> = t
            .iter()
            .map(|(k, (s, b, dt))| (k.clone(), TensorView::new(*dt, s.clone(), b).unwrap()))
            .collect();
        let bytes = safetensors::serialize(views, None).unwrap();
        std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    }

    pub(crate) fn dir(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("dsa-kv-v4-weights-{}-{name}", std::process::id()))
    }

    /// Every tensor lands where the configuration says, once; with
    /// `num_nextn_predict_layers` 0 the MTP layer's are skipped as transformers skips
    /// them.
    #[test]
    fn a_complete_checkpoint_loads() {
        let mut json = tiny_config();
        json["num_nextn_predict_layers"] = 0.into();
        let cfg = HfV4Config::parse(&json.to_string()).unwrap();
        let mut t = tensors(&cfg, &mut SplitMix64(1));
        t.insert(
            "mtp.0.enorm.weight".into(),
            (vec![2], vec![0; 8], Dtype::F32),
        );
        let d = dir("ok");
        write(&d, &json, &t);
        let m = HfV4Model::load(&d).unwrap();
        assert_eq!(m.layers.len(), 3);
        assert!(m.layers[0].attn.comp.is_none() && m.layers[0].attn.index.is_none());
        assert!(m.layers[1].attn.index.is_some());
        assert_eq!(m.layers[2].attn.comp.as_ref().unwrap().ape.rows, 128);
        assert!(matches!(m.layers[0].moe.route, V4Route::Hash(ref v) if v.len() == 32 * 2));
        assert!(matches!(m.layers[1].moe.route, V4Route::Bias(_)));
        let (shape, bytes, _) = &t["model.layers.1.self_attn.sinks"];
        let want: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(shape, &vec![4]);
        assert_eq!(m.layers[1].attn.sinks, want);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A missing tensor, a wrong shape, a leftover and an expert id past the experts
    /// are refused, naming the tensor.
    #[test]
    fn an_incomplete_or_foreign_checkpoint_is_refused() {
        let json = tiny_config();
        let cfg = HfV4Config::parse(&json.to_string()).unwrap();
        let full = tensors(&cfg, &mut SplitMix64(2));
        let edits: Vec<(&str, Edit)> = vec![
            (
                "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
                Box::new(|t| {
                    t.remove(
                        "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
                    );
                }),
            ),
            (
                "model.layers.2.self_attn.compressor.position_bias",
                Box::new(|t| {
                    let v = t
                        .get_mut("model.layers.2.self_attn.compressor.position_bias")
                        .unwrap();
                    v.0 = vec![64, 1024];
                }),
            ),
            (
                "model.layers.0.self_attn.compressor.kv_proj.weight",
                Box::new(|t| {
                    t.insert(
                        "model.layers.0.self_attn.compressor.kv_proj.weight".into(),
                        (vec![1], vec![0; 4], Dtype::F32),
                    );
                }),
            ),
            (
                "model.layers.0.mlp.gate.tid2eid",
                Box::new(|t| {
                    let v = t.get_mut("model.layers.0.mlp.gate.tid2eid").unwrap();
                    v.1[..8].copy_from_slice(&9i64.to_le_bytes());
                }),
            ),
        ];
        for (i, (name, edit)) in edits.into_iter().enumerate() {
            let mut t = full.clone();
            edit(&mut t);
            let d = dir(&format!("bad{i}"));
            write(&d, &json, &t);
            match HfV4Model::load(&d) {
                Err(CheckpointError::Tensor { name: got, .. }) => assert_eq!(got, name),
                Err(e) => panic!("{name}: {e}"),
                Ok(_) => panic!("{name}: loaded"),
            }
            std::fs::remove_dir_all(&d).unwrap();
        }
    }
    /// A float tensor stored as integers is reported as such (before: "missing"), and
    /// `V4Model::from_checkpoint` passes the loader's typed error on (before: flattened
    /// into `ModelError::Cache(String)`).
    #[test]
    fn an_integer_tensor_where_floats_belong_is_named_and_typed() {
        let json = tiny_config();
        let cfg = HfV4Config::parse(&json.to_string()).unwrap();
        let mut t = tensors(&cfg, &mut SplitMix64(3));
        let name = "model.layers.1.self_attn.sinks";
        let (shape, bytes, _) = t[name].clone();
        let ints: Vec<u8> = bytes
            .chunks_exact(4)
            .flat_map(|_| 1i64.to_le_bytes())
            .collect();
        t.insert(name.into(), (shape, ints, Dtype::I64));
        let d = dir("ints");
        write(&d, &json, &t);
        match crate::v4::V4Model::from_checkpoint(&d) {
            Err(crate::ModelError::Checkpoint(CheckpointError::Tensor { name: got, what })) => {
                assert_eq!(got, name);
                assert!(what.contains("stored as integers"), "{what}");
            }
            Err(e) => panic!("{e:?}"),
            Ok(_) => panic!("loaded"),
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Random f32 tensors under a prefix, by the published names (`f(name, shape)`).
    fn filler<'a>(
        out: &'a mut Named,
        rng: &'a mut SplitMix64,
        prefix: &'a str,
    ) -> impl FnMut(&str, Vec<usize>) + 'a {
        move |name: &str, shape: Vec<usize>| {
            let count: usize = shape.iter().product();
            let bytes: Vec<u8> = (0..count)
                .flat_map(|_| ((rng.below(2001) as f32 - 1000.0) / 1000.0).to_le_bytes())
                .collect();
            out.insert(format!("{prefix}{name}"), (shape, bytes, Dtype::F32));
        }
    }

    /// A decoder layer's tensors under `prefix` by the published names (ratio `r`;
    /// top-k routed unless `hash`, whose `tid2eid` goes in as I64).
    fn published_layer(
        cfg: &HfV4Config,
        rng: &mut SplitMix64,
        prefix: &str,
        r: usize,
        hash: bool,
    ) -> Named {
        let (d, n, e, i, h) = (
            cfg.hidden,
            cfg.hc_mult,
            cfg.experts,
            cfg.moe_intermediate,
            cfg.heads,
        );
        let mut out = BTreeMap::new();
        let mut ids = Vec::new();
        {
            let mut f = filler(&mut out, rng, prefix);
            f("attn_norm.weight", vec![d]);
            f("ffn_norm.weight", vec![d]);
            for k in ["hc_attn", "hc_ffn"] {
                f(&format!("{k}_fn"), vec![(2 + n) * n, n * d]);
                f(&format!("{k}_base"), vec![(2 + n) * n]);
                f(&format!("{k}_scale"), vec![3]);
            }
            f("attn.wq_a.weight", vec![cfg.q_lora, d]);
            f("attn.q_norm.weight", vec![cfg.q_lora]);
            f("attn.wq_b.weight", vec![h * 512, cfg.q_lora]);
            f("attn.wkv.weight", vec![512, d]);
            f("attn.norm.weight", vec![512]);
            f(
                "attn.wo_a.weight",
                vec![cfg.o_groups * cfg.o_lora, h * 512 / cfg.o_groups],
            );
            f("attn.wo_b.weight", vec![d, cfg.o_groups * cfg.o_lora]);
            f("attn.attn_sink", vec![h]);
            let mut comp = |p: &str, w: usize| {
                let coff = if r == 4 { 2 } else { 1 };
                f(&format!("{p}wkv.weight"), vec![coff * w, d]);
                f(&format!("{p}wgate.weight"), vec![coff * w, d]);
                f(&format!("{p}ape"), vec![r, coff * w]);
                f(&format!("{p}norm.weight"), vec![w]);
            };
            if r > 0 {
                comp("attn.compressor.", 512);
            }
            if r == 4 {
                comp("attn.indexer.compressor.", 128);
                f(
                    "attn.indexer.wq_b.weight",
                    vec![cfg.index_heads * 128, cfg.q_lora],
                );
                f("attn.indexer.weights_proj.weight", vec![cfg.index_heads, d]);
            }
            f("ffn.gate.weight", vec![e, d]);
            if hash {
                ids.push(format!("{prefix}ffn.gate.tid2eid"));
            } else {
                f("ffn.gate.bias", vec![e]);
            }
            for x in 0..e {
                f(&format!("ffn.experts.{x}.w1.weight"), vec![i, d]);
                f(&format!("ffn.experts.{x}.w3.weight"), vec![i, d]);
                f(&format!("ffn.experts.{x}.w2.weight"), vec![d, i]);
            }
            f("ffn.shared_experts.w1.weight", vec![i, d]);
            f("ffn.shared_experts.w3.weight", vec![i, d]);
            f("ffn.shared_experts.w2.weight", vec![d, i]);
        }
        for name in ids {
            let k = cfg.experts_per_token;
            let bytes: Vec<u8> = (0..cfg.vocab * k)
                .flat_map(|_| (rng.below(e as u64) as i64).to_le_bytes())
                .collect();
            out.insert(name, (vec![cfg.vocab, k], bytes, Dtype::I64));
        }
        out
    }

    /// The published MTP layer's tensors (`mtp.0.*`: the decoder layer under the
    /// published names, the MTP projections, norms and head) of `cfg`.
    fn mtp_tensors(cfg: &HfV4Config, rng: &mut SplitMix64) -> Named {
        let (d, n) = (cfg.hidden, cfg.hc_mult);
        let mut out = published_layer(cfg, rng, "mtp.0.", 0, false);
        {
            let mut f = filler(&mut out, rng, "mtp.0.");
            for k in ["enorm", "hnorm", "norm"] {
                f(&format!("{k}.weight"), vec![d]);
            }
            f("e_proj.weight", vec![d, d]);
            f("h_proj.weight", vec![d, d]);
            f("head.weight", vec![cfg.vocab, d]);
            f("hc_head_fn", vec![n, n * d]);
            f("hc_head_base", vec![n]);
            f("hc_head_scale", vec![1]);
        }
        out
    }

    /// A whole checkpoint by the published names (no `model.`), its MTP layer included.
    fn published(cfg: &HfV4Config, rng: &mut SplitMix64) -> Named {
        let (d, n) = (cfg.hidden, cfg.hc_mult);
        let mut out = BTreeMap::new();
        for (l, &r) in cfg.ratios.iter().enumerate() {
            let hash = cfg.mlp[l] == V4MlpKind::HashMoe;
            out.extend(published_layer(
                cfg,
                rng,
                &format!("layers.{l}."),
                r as usize,
                hash,
            ));
        }
        out.extend(mtp_tensors(cfg, rng));
        {
            let mut f = filler(&mut out, rng, "");
            f("embed.weight", vec![cfg.vocab, d]);
            f("head.weight", vec![cfg.vocab, d]);
            f("norm.weight", vec![d]);
            f("hc_head_fn", vec![n, n * d]);
            f("hc_head_base", vec![n]);
            f("hc_head_scale", vec![1]);
        }
        out
    }

    /// `t` as DeepSeek publishes it: every routed expert's weights FP4 (E2M1 packed two
    /// to an I8, low nibble first) with an F8_E8M0 scale per 32 values, every other 2-D
    /// `.weight` but the embedding and head F8_E4M3 with an F8_E8M0 scale per 128 × 128
    /// block, from random codes; and the same values dequantized here (by the formats'
    /// definitions, apart from the loader) as F32.
    fn quantize(t: &Named, rng: &mut SplitMix64) -> (Named, Named) {
        let fp4 = [
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        ];
        let e4m3 = |b: u8| -> f32 {
            let (e, m) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
            let v = if e == 0 {
                m / 8.0 / 64.0
            } else {
                (1.0 + m / 8.0) * 2f32.powi(e - 7)
            };
            if b & 0x80 != 0 {
                -v
            } else {
                v
            }
        };
        let (mut q, mut plain) = (BTreeMap::new(), BTreeMap::new());
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        for (name, (shape, bytes, dt)) in t {
            let skip = *dt != Dtype::F32
                || shape.len() != 2
                || !name.ends_with(".weight")
                || name.ends_with("embed.weight")
                || name.ends_with("head.weight")
                || name.contains("norm");
            if skip {
                q.insert(name.clone(), (shape.clone(), bytes.clone(), *dt));
                plain.insert(name.clone(), (shape.clone(), bytes.clone(), *dt));
                continue;
            }
            let (rows, cols) = (shape[0], shape[1]);
            let base = name.strip_suffix(".weight").unwrap();
            let mut values = vec![0f32; rows * cols];
            if name.contains(".experts.") && !name.contains("shared") {
                let exps: Vec<u8> = (0..rows * cols / 32)
                    .map(|_| 120 + rng.below(10) as u8)
                    .collect();
                let mut packed = Vec::with_capacity(rows * cols / 2);
                for r in 0..rows {
                    for j in 0..cols / 2 {
                        let (lo, hi) = (rng.below(16) as u8, rng.below(16) as u8);
                        packed.push(lo | (hi << 4));
                        let s = 2f32.powi(i32::from(exps[r * cols / 32 + 2 * j / 32]) - 127);
                        values[r * cols + 2 * j] = fp4[lo as usize] * s;
                        values[r * cols + 2 * j + 1] = fp4[hi as usize] * s;
                    }
                }
                q.insert(name.clone(), (vec![rows, cols / 2], packed, Dtype::I8));
                q.insert(
                    format!("{base}.scale"),
                    (vec![rows, cols / 32], exps, Dtype::F8_E8M0),
                );
            } else {
                let grid = [rows.div_ceil(128), cols.div_ceil(128)];
                let exps: Vec<u8> = (0..grid[0] * grid[1])
                    .map(|_| 118 + rng.below(10) as u8)
                    .collect();
                let codes: Vec<u8> = (0..rows * cols)
                    .map(|_| {
                        let b = rng.below(255) as u8;
                        if b & 0x7f == 0x7f {
                            0
                        } else {
                            b
                        }
                    })
                    .collect();
                for (k, &b) in codes.iter().enumerate() {
                    let (r, c) = (k / cols, k % cols);
                    let e = exps[(r / 128) * grid[1] + c / 128];
                    values[k] = e4m3(b) * 2f32.powi(i32::from(e) - 127);
                }
                q.insert(name.clone(), (shape.clone(), codes, Dtype::F8_E4M3));
                q.insert(
                    format!("{base}.scale"),
                    (grid.to_vec(), exps, Dtype::F8_E8M0),
                );
            }
            plain.insert(name.clone(), (shape.clone(), f32s(&values), Dtype::F32));
        }
        (q, plain)
    }

    /// With `num_nextn_predict_layers` 1 the published MTP layer loads (its head its
    /// own, its embedding the target's); without its tensors the model has none (a
    /// transformers re-save drops them); a missing MTP tensor or a second MTP layer is
    /// refused, naming the tensor.
    #[test]
    fn the_published_mtp_layer_loads_or_is_refused_by_name() {
        let json = tiny_config();
        let cfg = HfV4Config::parse(&json.to_string()).unwrap();
        assert_eq!(cfg.mtp_layers, 1, "transformers' default");
        let mut rng = SplitMix64(4);
        let base = tensors(&cfg, &mut rng);
        let mtp = mtp_tensors(&cfg, &mut rng);
        let load = |t: &Named, name: &str| {
            let d = dir(name);
            write(&d, &json, t);
            let m = HfV4Model::load(&d);
            std::fs::remove_dir_all(&d).unwrap();
            m
        };
        let mut full = base.clone();
        full.extend(mtp.clone());
        let m = load(&full, "mtp").unwrap();
        let mt = m.mtp.as_ref().expect("an MTP layer");
        assert!(mt.head.is_some() && mt.embed.is_none());
        assert!(mt.layer.attn.comp.is_none() && matches!(mt.layer.moe.route, V4Route::Bias(_)));
        let (_, bytes, _) = &mtp["mtp.0.h_proj.weight"];
        assert_eq!(mt.h_proj.w[0].to_le_bytes(), bytes[..4]);
        assert!(load(&base, "none").unwrap().mtp.is_none());
        let mut partial = full.clone();
        partial.remove("mtp.0.attn.wkv.weight");
        match load(&partial, "partial") {
            Err(CheckpointError::Tensor { name, .. }) => assert_eq!(name, "mtp.0.attn.wkv.weight"),
            other => panic!("{:?}", other.map(|_| ())),
        }
        let mut second = full.clone();
        second.insert(
            "mtp.1.enorm.weight".into(),
            (vec![cfg.hidden], vec![0; 4 * cfg.hidden], Dtype::F32),
        );
        match load(&second, "second") {
            Err(CheckpointError::Tensor { name, .. }) => assert_eq!(name, "mtp.1.enorm.weight"),
            other => panic!("{:?}", other.map(|_| ())),
        }
    }

    /// A checkpoint in the published format (names without `model.`, a 4-entry
    /// `compress_ratios` with the MTP layer's 0, F8_E4M3 weights with F8_E8M0 block
    /// scales, FP4 routed experts, the MTP layer) loads dequantized: its model gives the
    /// same logits and MTP drafts, bit for bit, as the same values stored as F32. A
    /// missing scale, a scale of another shape, a NaN exponent, an F8_E5M2 weight and a
    /// scale of no weight are refused, naming the tensor.
    #[test]
    fn a_published_format_checkpoint_loads_dequantized_or_is_refused_by_name() {
        use crate::v4::{V4Contiguous, V4Model};
        let mut json = tiny_config();
        json["hidden_size"] = 32.into();
        json["moe_intermediate_size"] = 32.into();
        json["compress_ratios"] = serde_json::json!([0, 4, 128, 0]);
        json["num_nextn_predict_layers"] = 1.into();
        json["expert_dtype"] = "fp4".into();
        json["quantization_config"] = serde_json::json!({
            "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic", "weight_block_size": [128, 128]
        });
        let cfg = HfV4Config::parse(&json.to_string()).unwrap();
        let mut rng = SplitMix64(9);
        let (q, plain) = quantize(&published(&cfg, &mut rng), &mut rng);
        assert!(q.values().any(|t| t.2 == Dtype::I8) && q.values().any(|t| t.2 == Dtype::F8_E4M3));
        let run = |t: &Named, name: &str| {
            let d = dir(name);
            write(&d, &json, t);
            let m = V4Model::from_checkpoint(&d);
            std::fs::remove_dir_all(&d).unwrap();
            m
        };
        let (mq, mp) = (run(&q, "fp8").unwrap(), run(&plain, "f32").unwrap());
        assert!(mq.config().mtp);
        let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 32).collect();
        let go = |m: &V4Model| {
            let mut kv = V4Contiguous::new();
            let (_, h) = m.run_hidden(&mut kv, 0, &prompt).unwrap();
            m.draft_write(&mut kv, 0, &prompt, &h).unwrap();
            let logits: Vec<u32> = h
                .iter()
                .flat_map(|x| m.logits(x))
                .map(f32::to_bits)
                .collect();
            let drafts = m.propose_logits(&kv, 39, &h[39], 5, 2).unwrap();
            (
                logits,
                drafts
                    .into_iter()
                    .map(|d| (d.0, d.1.iter().map(|v| v.to_bits()).collect::<Vec<_>>()))
                    .collect::<Vec<_>>(),
            )
        };
        assert!(go(&mq) == go(&mp), "the published format's model differs");
        let refuse = |edit: &dyn Fn(&mut Named), want: &str| {
            let mut t = q.clone();
            edit(&mut t);
            match run(&t, "bad") {
                Err(crate::ModelError::Checkpoint(CheckpointError::Tensor { name, what })) => {
                    assert_eq!(name, want, "{what}")
                }
                Err(e) => panic!("{want}: {e}"),
                Ok(_) => panic!("{want}: loaded"),
            }
        };
        let w = "layers.1.attn.wq_b.weight";
        refuse(
            &|t| {
                t.remove("layers.1.attn.wq_b.scale");
            },
            w,
        );
        refuse(
            &|t| t.get_mut("layers.1.attn.wq_b.scale").unwrap().0 = vec![8, 2],
            "layers.1.attn.wq_b.scale",
        );
        refuse(
            &|t| t.get_mut("layers.2.ffn.experts.1.w2.scale").unwrap().1[0] = 0xff,
            "layers.2.ffn.experts.1.w2.scale",
        );
        refuse(&|t| t.get_mut(w).unwrap().2 = Dtype::F8_E5M2, w);
        refuse(
            &|t| {
                t.insert(
                    "layers.0.attn.extra.scale".into(),
                    (vec![1, 1], vec![127], Dtype::F8_E8M0),
                );
            },
            "layers.0.attn.extra.scale",
        );
    }
}
