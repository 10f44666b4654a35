//! The checkpoint's weights under their published names (`model.layers.{l}.self_attn.*`,
//! `….mlp.*`), shapes checked against the configuration, and the RoPE tables the
//! configuration asks for.

use dsa_kv_core::config::file::{read_regular_text, MAX_CONFIG_FILE_BYTES};
use std::path::Path;

use super::config::{yarn_mscale, HfConfig, MlpKind, RopeConfig};
use super::tensors::Tensors;
use super::CheckpointError;
use crate::config::{INDEX_DIM, LATENT, ROPE};
use crate::math::Mat;

/// A linear layer `y = W x (+ b)`, `W` as stored (`[out, in]`).
pub(crate) struct Linear {
    pub(crate) w: Mat,
    pub(crate) b: Option<Vec<f32>>,
}

impl Linear {
    pub(crate) fn apply(&self, x: &[f32]) -> Vec<f32> {
        let mut y = self.w.apply(x);
        if let Some(b) = &self.b {
            for (v, b) in y.iter_mut().zip(b) {
                *v += b;
            }
        }
        y
    }
}

/// The MLA attention of a layer.
pub(crate) struct Attention {
    pub(crate) q_a: Linear,
    pub(crate) q_a_norm: Vec<f32>,
    /// `[heads · (nope + 64), q_lora]`: per head its no-RoPE part, then its RoPE part.
    pub(crate) q_b: Mat,
    /// `[512 + 64, hidden]`: the latent, then the key's RoPE part.
    pub(crate) kv_a: Linear,
    pub(crate) kv_a_norm: Vec<f32>,
    /// Per head, `kv_b_proj`'s key rows `[nope, 512]` (the query is absorbed through them).
    pub(crate) w_uk: Vec<Mat>,
    /// Per head, `kv_b_proj`'s value rows `[v, 512]`.
    pub(crate) w_uv: Vec<Mat>,
    pub(crate) o: Linear,
}

/// The lightning indexer of a layer.
pub(crate) struct Indexer {
    /// `[index_heads · 128, q_lora]`.
    pub(crate) wq_b: Mat,
    /// `[128, hidden]`.
    pub(crate) wk: Mat,
    pub(crate) k_norm_w: Vec<f32>,
    pub(crate) k_norm_b: Vec<f32>,
    /// `[index_heads, hidden]`.
    pub(crate) weights_proj: Mat,
}

/// A gated MLP `down(silu(gate x) · up x)`.
pub(crate) struct Mlp {
    pub(crate) gate: Mat,
    pub(crate) up: Mat,
    pub(crate) down: Mat,
}

/// A layer's feed-forward.
pub(crate) enum FeedForward {
    Dense(Mlp),
    Moe {
        /// `[experts, hidden]`.
        router: Mat,
        /// `e_score_correction_bias` (selection only).
        bias: Vec<f32>,
        experts: Vec<Mlp>,
        shared: Mlp,
    },
}

/// A decoder layer.
pub(crate) struct HfLayer {
    pub(crate) input_norm: Vec<f32>,
    pub(crate) post_norm: Vec<f32>,
    pub(crate) attn: Attention,
    pub(crate) indexer: Option<Indexer>,
    pub(crate) ffn: FeedForward,
}

/// The RoPE: per pair `i` of the 64 RoPE dimensions its frequency, and the attention
/// factor YaRN multiplies the rotation by.
pub(crate) struct Rope {
    pub(crate) inv_freq: [f64; ROPE / 2],
    pub(crate) factor: f64,
}

impl Rope {
    pub(crate) fn new(cfg: &HfConfig) -> Rope {
        Self::of(&cfg.rope, false)
    }

    /// `r`'s RoPE with YaRN's attention factor forced to 1 (DeepSeek-V4's: neither cos
    /// nor sin is scaled).
    pub(crate) fn unscaled(r: &RopeConfig) -> Rope {
        Self::of(r, true)
    }

    fn of(r: &RopeConfig, unit_factor: bool) -> Rope {
        let d = ROPE as f64;
        let theta = r.theta;
        let mut inv_freq = [0f64; ROPE / 2];
        for (i, f) in inv_freq.iter_mut().enumerate() {
            *f = 1.0 / theta.powf((2 * i) as f64 / d);
        }
        let Some(y) = &r.yarn else {
            return Rope {
                inv_freq,
                factor: 1.0,
            };
        };
        let corr = |r: f64| {
            d * (y.original_max / (r * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (corr(y.beta_fast), corr(y.beta_slow));
        if y.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
        if low == high {
            high += 0.001;
        }
        for (i, f) in inv_freq.iter_mut().enumerate() {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolated = *f;
            let interpolated = *f / y.factor;
            *f = interpolated * ramp + extrapolated * (1.0 - ramp);
        }
        let factor = if unit_factor {
            1.0
        } else if y.mscale != 0.0 && y.mscale_all_dim != 0.0 {
            yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
        } else {
            yarn_mscale(y.factor, 1.0)
        };
        Rope { inv_freq, factor }
    }

    /// `(cos, sin)` of pair `i` at `pos`, times the attention factor.
    ///
    /// Deliberately in f64, rounded to f32 once at the end: transformers forms the angle
    /// as an f32 product (`inv_freq` × position), whose rounding grows with the position;
    /// ours is the closer value. The oracle's tolerances in `tests/hf_checkpoint.rs`
    /// cover the difference, and it keeps our paged and unpaged runs bit-identical either
    /// way (both use this function).
    fn cos_sin(&self, pos: u32, i: usize) -> (f32, f32) {
        let a = f64::from(pos) * self.inv_freq[i];
        (
            (a.cos() * self.factor) as f32,
            (a.sin() * self.factor) as f32,
        )
    }

    /// Rotates the pairs `(2i, 2i + 1)` of `x` (64 values) to `pos`.
    pub(crate) fn interleaved(&self, x: &mut [f32], pos: u32) {
        for i in 0..ROPE / 2 {
            let (c, s) = self.cos_sin(pos, i);
            let (a, b) = (x[2 * i], x[2 * i + 1]);
            x[2 * i] = a * c - b * s;
            x[2 * i + 1] = b * c + a * s;
        }
    }

    /// The inverse of [`interleaved`](Self::interleaved) at `pos`.
    pub(crate) fn interleaved_inverse(&self, x: &mut [f32], pos: u32) {
        for i in 0..ROPE / 2 {
            let (c, s) = self.cos_sin(pos, i);
            let (a, b) = (x[2 * i], x[2 * i + 1]);
            x[2 * i] = a * c + b * s;
            x[2 * i + 1] = b * c - a * s;
        }
    }

    /// Rotates the pairs `(i, i + 32)` of `x` (64 values) to `pos`.
    pub(crate) fn half_split(&self, x: &mut [f32], pos: u32) {
        let h = ROPE / 2;
        for i in 0..h {
            let (c, s) = self.cos_sin(pos, i);
            let (a, b) = (x[i], x[i + h]);
            x[i] = a * c - b * s;
            x[i + h] = b * c + a * s;
        }
    }
}

/// A model loaded from a checkpoint.
pub(crate) struct HfModel {
    pub(crate) cfg: HfConfig,
    pub(crate) embed: Mat,
    pub(crate) layers: Vec<HfLayer>,
    pub(crate) norm: Vec<f32>,
    /// `None`: tied to the embedding.
    pub(crate) lm_head: Option<Mat>,
    pub(crate) rope: Rope,
    /// The MLA softmax scale: `qk_head_dim^-0.5`, times YaRN's `mscale²`.
    pub(crate) softmax_scale: f32,
}

fn mat(t: &mut Tensors, name: &str, rows: usize, cols: usize) -> Result<Mat, CheckpointError> {
    Ok(Mat {
        rows,
        cols,
        w: t.take(name, &[rows, cols])?,
    })
}

fn mlp(t: &mut Tensors, p: &str, width: usize, hidden: usize) -> Result<Mlp, CheckpointError> {
    Ok(Mlp {
        gate: mat(t, &format!("{p}gate_proj.weight"), width, hidden)?,
        up: mat(t, &format!("{p}up_proj.weight"), width, hidden)?,
        down: mat(t, &format!("{p}down_proj.weight"), hidden, width)?,
    })
}

/// Per head `h`, rows `h·(a + b) + off .. + n` of `m` (`[heads·(a+b), cols]`).
fn head_rows(m: &Mat, heads: usize, per: usize, off: usize, n: usize) -> Vec<Mat> {
    (0..heads)
        .map(|h| {
            let start = (h * per + off) * m.cols;
            Mat {
                rows: n,
                cols: m.cols,
                w: m.w[start..start + n * m.cols].to_vec(),
            }
        })
        .collect()
}

impl HfModel {
    /// Reads the checkpoint in `dir` (`config.json` and its safetensors).
    pub(crate) fn load(dir: &Path) -> Result<HfModel, CheckpointError> {
        let path = dir.join("config.json");
        let text =
            read_regular_text(&path, MAX_CONFIG_FILE_BYTES).map_err(|e| CheckpointError::Io {
                path: path.display().to_string(),
                what: e.to_string(),
            })?;
        let cfg = HfConfig::parse(&text)?;
        let mut t = Tensors::load(dir)?;
        let (d, h) = (cfg.hidden, cfg.heads);
        let (dn, dv) = (cfg.nope_dim, cfg.v_dim);
        let embed = mat(&mut t, "model.embed_tokens.weight", cfg.vocab, d)?;
        // Grown as layers load: the configuration's count is not trusted with a
        // reservation (2^24 layers would reserve gigabytes before the first tensor).
        let mut layers = Vec::new();
        for l in 0..cfg.layers {
            let p = format!("model.layers.{l}.");
            let a = format!("{p}self_attn.");
            let linear =
                |t: &mut Tensors, n: &str, o: usize, i: usize| -> Result<Linear, CheckpointError> {
                    let w = mat(t, &format!("{a}{n}.weight"), o, i)?;
                    let b = if cfg.attention_bias {
                        Some(t.take(&format!("{a}{n}.bias"), &[o])?)
                    } else {
                        None
                    };
                    Ok(Linear { w, b })
                };
            let q_a = linear(&mut t, "q_a_proj", cfg.q_lora, d)?;
            let kv_a = linear(&mut t, "kv_a_proj_with_mqa", LATENT + ROPE, d)?;
            let o = linear(&mut t, "o_proj", d, h * dv)?;
            let kv_b = mat(
                &mut t,
                &format!("{a}kv_b_proj.weight"),
                h * (dn + dv),
                LATENT,
            )?;
            let attn = Attention {
                q_a,
                q_a_norm: t.take(&format!("{a}q_a_layernorm.weight"), &[cfg.q_lora])?,
                q_b: mat(
                    &mut t,
                    &format!("{a}q_b_proj.weight"),
                    h * (dn + ROPE),
                    cfg.q_lora,
                )?,
                kv_a,
                kv_a_norm: t.take(&format!("{a}kv_a_layernorm.weight"), &[LATENT])?,
                w_uk: head_rows(&kv_b, h, dn + dv, 0, dn),
                w_uv: head_rows(&kv_b, h, dn + dv, dn, dv),
                o,
            };
            let ix = format!("{a}indexer.");
            let has = t.has(&format!("{ix}wk.weight"));
            if has != cfg.indexer[l] {
                return Err(CheckpointError::Tensor {
                    name: format!("{ix}*"),
                    what: format!(
                        "layer {l} {} indexer weights, but the configuration says it {} one",
                        if has { "has" } else { "has no" },
                        if cfg.indexer[l] {
                            "owns"
                        } else {
                            "shares the previous layer's"
                        }
                    ),
                });
            }
            let indexer = if cfg.indexer[l] {
                Some(Indexer {
                    wq_b: mat(
                        &mut t,
                        &format!("{ix}wq_b.weight"),
                        cfg.index_heads * INDEX_DIM,
                        cfg.q_lora,
                    )?,
                    wk: mat(&mut t, &format!("{ix}wk.weight"), INDEX_DIM, d)?,
                    k_norm_w: t.take(&format!("{ix}k_norm.weight"), &[INDEX_DIM])?,
                    k_norm_b: t.take(&format!("{ix}k_norm.bias"), &[INDEX_DIM])?,
                    weights_proj: mat(
                        &mut t,
                        &format!("{ix}weights_proj.weight"),
                        cfg.index_heads,
                        d,
                    )?,
                })
            } else {
                None
            };
            let m = format!("{p}mlp.");
            let ffn = match cfg.mlp[l] {
                MlpKind::Dense => FeedForward::Dense(mlp(&mut t, &m, cfg.intermediate, d)?),
                MlpKind::Moe => FeedForward::Moe {
                    router: mat(&mut t, &format!("{m}gate.weight"), cfg.experts, d)?,
                    bias: t
                        .take_opt(&format!("{m}gate.e_score_correction_bias"), &[cfg.experts])?
                        .unwrap_or_else(|| vec![0.0; cfg.experts]),
                    experts: (0..cfg.experts)
                        .map(|e| mlp(&mut t, &format!("{m}experts.{e}."), cfg.moe_intermediate, d))
                        .collect::<Result<_, _>>()?,
                    shared: mlp(
                        &mut t,
                        &format!("{m}shared_experts."),
                        cfg.moe_intermediate * cfg.shared_experts,
                        d,
                    )?,
                },
            };
            layers.push(HfLayer {
                input_norm: t.take(&format!("{p}input_layernorm.weight"), &[d])?,
                post_norm: t.take(&format!("{p}post_attention_layernorm.weight"), &[d])?,
                attn,
                indexer,
                ffn,
            });
        }
        let norm = t.take("model.norm.weight", &[d])?;
        let lm_head = if cfg.tie_embeddings {
            // A tied checkpoint may still carry the head: it must equal the embedding.
            if let Some(w) = t.take_opt("lm_head.weight", &[cfg.vocab, d])? {
                if w != embed.w {
                    return Err(CheckpointError::Tensor {
                        name: "lm_head.weight".into(),
                        what: "differs from the embedding, but tie_word_embeddings is true".into(),
                    });
                }
            }
            None
        } else {
            Some(mat(&mut t, "lm_head.weight", cfg.vocab, d)?)
        };
        // The MTP layer (layer `num_hidden_layers`) is not part of the model, as in
        // transformers; anything else left over is refused.
        let mtp = format!("model.layers.{}.", cfg.layers);
        let left: Vec<String> = t
            .left()
            .into_iter()
            .filter(|n| !n.starts_with(&mtp))
            .collect();
        if !left.is_empty() {
            return Err(CheckpointError::Tensor {
                name: left[0].clone(),
                what: format!(
                    "{} tensor(s) that this configuration has no place for (e.g. an MTP \
                     layer, or another architecture): {}",
                    left.len(),
                    left.iter().take(4).cloned().collect::<Vec<_>>().join(", ")
                ),
            });
        }
        let rope = Rope::new(&cfg);
        let mut scale = (cfg.qk_head_dim() as f64).powf(-0.5);
        if let Some(y) = &cfg.rope.yarn {
            if y.mscale_all_dim != 0.0 {
                let m = yarn_mscale(y.factor, y.mscale_all_dim);
                scale *= m * m;
            }
        }
        Ok(HfModel {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            softmax_scale: scale as f32,
        })
    }
}
