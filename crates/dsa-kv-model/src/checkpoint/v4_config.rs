//! `config.json` of a transformers `deepseek_v4` checkpoint (`DeepseekV4ForCausalLM`,
//! transformers ≥ 5.8): the keys its implementation reads, with their defaults and the
//! legacy keys it folds in (`compress_ratios`, `compress_rate_csa` / `_hca`,
//! `num_hash_layers`, `qk_rope_head_dim`, a flat `rope_scaling` / `rope_parameters`),
//! checked against what our V4 cache stores (a 512-wide latent of 448 NoPE and 64 RoPE
//! values in MODEL1 rows, 128-wide indexer keys, compression ratios 4 and 128).
//!
//! What the implementation does with each key is in ARCHITECTURE.md ("Plan:
//! DeepSeek-V4's hybrid caches", item 7). transformers builds no MTP layer; we load
//! the published one (`mtp.0.*`) when `num_nextn_predict_layers` asks for it.

use dsa_kv_core::config::file::json_with_path;
use dsa_kv_core::config::{IndexerDtype, V4Spec};
use serde::Deserialize;
use serde_json::Value;

use super::config::{RopeConfig, Yarn};
use super::CheckpointError;
use crate::config::{INDEX_DIM, LATENT, ROPE};

/// How a V4 router scores its experts (`scoring_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum V4Scoring {
    /// `sqrt(softplus(logit))` (the published models).
    SqrtSoftplus,
    /// `softmax` over the experts.
    Softmax,
    /// `sigmoid(logit)`.
    Sigmoid,
}

/// What a V4 layer's feed-forward routes by (`mlp_layer_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum V4MlpKind {
    /// `hash_moe`: a frozen token → experts table (`tid2eid`).
    HashMoe,
    /// `moe`: the router's top-k, bias-corrected.
    Moe,
}

/// A `deepseek_v4` checkpoint's configuration, as the model reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct HfV4Config {
    /// `vocab_size`.
    pub vocab: usize,
    /// `hidden_size`.
    pub hidden: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `q_lora_rank`.
    pub q_lora: usize,
    /// `o_groups`: head groups of the grouped output projection.
    pub o_groups: usize,
    /// `o_lora_rank`: each group's intermediate width.
    pub o_lora: usize,
    /// Per layer: 0 (sliding window only), 4 (compressed sparse) or 128 (heavily
    /// compressed), from `layer_types` and `compress_rates`.
    pub ratios: Vec<u32>,
    /// `sliding_window`: raw positions a query attends, its own included.
    pub window: u32,
    /// `index_n_heads`.
    pub index_heads: usize,
    /// `index_topk`.
    pub index_topk: u32,
    /// `n_routed_experts`.
    pub experts: usize,
    /// `num_experts_per_tok`.
    pub experts_per_token: usize,
    /// `moe_intermediate_size` (each routed expert and the shared expert).
    pub moe_intermediate: usize,
    /// `scoring_func`.
    pub scoring: V4Scoring,
    /// `routed_scaling_factor`.
    pub routed_scaling: f32,
    /// `swiglu_limit`: the clamp of the experts' gate and up values.
    pub swiglu_limit: f32,
    /// Per layer: hash-routed or top-k routed (`mlp_layer_types`, else the first
    /// `num_hash_layers`, default 3, hash-routed).
    pub mlp: Vec<V4MlpKind>,
    /// `hc_mult`: the hyper-connections' residual streams.
    pub hc_mult: usize,
    /// `hc_sinkhorn_iters`.
    pub hc_sinkhorn_iters: usize,
    /// `hc_eps`.
    pub hc_eps: f32,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f32,
    /// `tie_word_embeddings`.
    pub tie_embeddings: bool,
    /// The RoPE of window-only layers (`rope_theta`, no scaling).
    pub main_rope: RopeConfig,
    /// The RoPE of compressed layers, for queries, latent, compressor and indexer alike
    /// (`compress_rope_theta`, YaRN when given, with its attention factor 1: cos and sin
    /// are not scaled).
    pub compress_rope: RopeConfig,
    /// `num_nextn_predict_layers` (transformers builds none; with the checkpoint's
    /// `mtp.0.*` tensors, we build the first).
    pub mtp_layers: usize,
}

#[derive(Deserialize)]
struct Raw {
    model_type: String,
    #[serde(default = "d_vocab")]
    vocab_size: usize,
    #[serde(default = "d_hidden")]
    hidden_size: usize,
    #[serde(default = "d_moe_intermediate")]
    moe_intermediate_size: usize,
    #[serde(default = "d_layers")]
    num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    num_attention_heads: usize,
    #[serde(default = "d_one")]
    num_key_value_heads: usize,
    #[serde(default = "d_head_dim")]
    head_dim: usize,
    #[serde(default = "d_q_lora")]
    q_lora_rank: usize,
    #[serde(default = "d_experts_per_token")]
    num_experts_per_tok: usize,
    #[serde(default = "d_experts")]
    n_routed_experts: usize,
    #[serde(default = "d_one")]
    n_shared_experts: usize,
    #[serde(default = "d_scoring")]
    scoring_func: String,
    #[serde(default = "d_scaling")]
    routed_scaling_factor: f32,
    #[serde(default = "d_theta")]
    rope_theta: f64,
    layer_types: Option<Vec<String>>,
    compress_rates: Option<Value>,
    compress_ratios: Option<Vec<u32>>,
    compress_rate_csa: Option<u32>,
    compress_rate_hca: Option<u32>,
    #[serde(default = "d_compress_theta")]
    compress_rope_theta: f64,
    #[serde(default = "d_hc_mult")]
    hc_mult: usize,
    #[serde(default = "d_sinkhorn")]
    hc_sinkhorn_iters: usize,
    #[serde(default = "d_eps")]
    hc_eps: f32,
    mlp_layer_types: Option<Vec<String>>,
    num_hash_layers: Option<usize>,
    #[serde(default = "d_swiglu")]
    swiglu_limit: f32,
    #[serde(default = "d_window")]
    sliding_window: u32,
    #[serde(default = "d_o_groups")]
    o_groups: usize,
    #[serde(default = "d_o_lora")]
    o_lora_rank: usize,
    #[serde(default = "d_heads")]
    index_n_heads: usize,
    #[serde(default = "d_index_dim")]
    index_head_dim: usize,
    #[serde(default = "d_topk")]
    index_topk: u32,
    #[serde(default = "d_one")]
    num_nextn_predict_layers: usize,
    #[serde(default = "d_eps")]
    rms_norm_eps: f32,
    #[serde(default)]
    tie_word_embeddings: bool,
    /// The published checkpoint's FP8 settings (its weights are dequantized at load).
    quantization_config: Option<Value>,
    partial_rotary_factor: Option<f64>,
    qk_rope_head_dim: Option<usize>,
    rope_parameters: Option<Value>,
    rope_scaling: Option<Value>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
}

// transformers' `DeepseekV4Config` defaults (V4-Flash).
fn d_vocab() -> usize {
    129_280
}
fn d_hidden() -> usize {
    4096
}
fn d_moe_intermediate() -> usize {
    2048
}
fn d_layers() -> usize {
    43
}
fn d_heads() -> usize {
    64
}
fn d_one() -> usize {
    1
}
fn d_head_dim() -> usize {
    512
}
fn d_q_lora() -> usize {
    1024
}
fn d_experts_per_token() -> usize {
    6
}
fn d_experts() -> usize {
    256
}
fn d_scoring() -> String {
    "sqrtsoftplus".into()
}
fn d_scaling() -> f32 {
    1.5
}
fn d_theta() -> f64 {
    10_000.0
}
fn d_compress_theta() -> f64 {
    160_000.0
}
fn d_hc_mult() -> usize {
    4
}
fn d_sinkhorn() -> usize {
    20
}
fn d_eps() -> f32 {
    1e-6
}
fn d_swiglu() -> f32 {
    10.0
}
fn d_window() -> u32 {
    128
}
fn d_o_groups() -> usize {
    8
}
fn d_o_lora() -> usize {
    1024
}
fn d_index_dim() -> usize {
    128
}
fn d_topk() -> u32 {
    512
}

/// The largest size a configuration may give (2^24; products of two stay below 2^48).
const MAX_SIZE: usize = 1 << 24;

fn bad(key: &str, what: String) -> CheckpointError {
    CheckpointError::Config {
        key: key.to_string(),
        what,
    }
}

const CSA: &str = "compressed_sparse_attention";
const HCA: &str = "heavily_compressed_attention";
const SLIDING: &str = "sliding_attention";

impl HfV4Config {
    /// Parses and checks `config.json`.
    pub fn parse(json: &str) -> Result<HfV4Config, CheckpointError> {
        let r: Raw = json_with_path(json).map_err(|e| CheckpointError::Config {
            key: e.path.unwrap_or_else(|| "config.json".into()),
            what: format!("not a DeepSeek-V4 checkpoint configuration: {}", e.message),
        })?;
        if r.model_type != "deepseek_v4" {
            return Err(bad(
                "model_type",
                format!("{:?}: this loader reads deepseek_v4", r.model_type),
            ));
        }
        let rope_dim = match (r.partial_rotary_factor, r.qk_rope_head_dim) {
            (Some(f), _) => (r.head_dim as f64 * f) as usize,
            (None, Some(d)) => d,
            (None, None) => ROPE,
        };
        let fixed = [
            ("head_dim", r.head_dim, LATENT),
            (
                "qk_rope_head_dim (head_dim × partial_rotary_factor)",
                rope_dim,
                ROPE,
            ),
            ("index_head_dim", r.index_head_dim, INDEX_DIM),
            ("num_key_value_heads", r.num_key_value_heads, 1),
        ];
        for (key, got, want) in fixed {
            if got != want {
                return Err(bad(
                    key,
                    format!(
                        "{got}: the V4 cache stores {want} (MODEL1 rows: 448 NoPE + 64 RoPE \
                         values of one KV head; 128-wide indexer keys)"
                    ),
                ));
            }
        }
        for (key, on) in [
            ("attention_bias", r.attention_bias),
            ("mlp_bias", r.mlp_bias),
        ] {
            if on {
                return Err(bad(key, "true: DeepSeek-V4 has no biases there".into()));
            }
        }
        super::config::check_layers(r.num_hidden_layers)?;
        let sizes = [
            ("vocab_size", r.vocab_size),
            ("hidden_size", r.hidden_size),
            ("num_hidden_layers", r.num_hidden_layers),
            ("num_attention_heads", r.num_attention_heads),
            ("q_lora_rank", r.q_lora_rank),
            ("o_groups", r.o_groups),
            ("o_lora_rank", r.o_lora_rank),
            ("index_n_heads", r.index_n_heads),
            ("moe_intermediate_size", r.moe_intermediate_size),
            ("n_routed_experts", r.n_routed_experts),
            ("num_experts_per_tok", r.num_experts_per_tok),
            ("hc_mult", r.hc_mult),
            ("hc_sinkhorn_iters", r.hc_sinkhorn_iters.max(1)),
        ];
        for (key, v) in sizes {
            if v == 0 || v > MAX_SIZE {
                return Err(bad(key, format!("{v}: between 1 and {MAX_SIZE}")));
            }
        }
        if r.n_shared_experts != 1 {
            return Err(bad(
                "n_shared_experts",
                format!(
                    "{}: the implementation builds exactly one shared expert",
                    r.n_shared_experts
                ),
            ));
        }
        if r.num_experts_per_tok > r.n_routed_experts {
            return Err(bad(
                "num_experts_per_tok",
                format!(
                    "{} of {} experts",
                    r.num_experts_per_tok, r.n_routed_experts
                ),
            ));
        }
        if !r.num_attention_heads.is_multiple_of(r.o_groups) {
            return Err(bad(
                "o_groups",
                format!(
                    "{}: must divide num_attention_heads ({})",
                    r.o_groups, r.num_attention_heads
                ),
            ));
        }
        let layers = r.num_hidden_layers;
        let ratios = ratios(&r, layers)?;
        let mlp = match &r.mlp_layer_types {
            Some(t) => {
                if t.len() < layers {
                    return Err(bad(
                        "mlp_layer_types",
                        format!("{} entries for {layers} layers", t.len()),
                    ));
                }
                t[..layers]
                    .iter()
                    .map(|k| match k.as_str() {
                        "hash_moe" => Ok(V4MlpKind::HashMoe),
                        "moe" => Ok(V4MlpKind::Moe),
                        o => Err(bad("mlp_layer_types", format!("{o:?}: hash_moe or moe"))),
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            None => {
                let hash = r.num_hash_layers.unwrap_or(3);
                (0..layers)
                    .map(|l| {
                        if l < hash {
                            V4MlpKind::HashMoe
                        } else {
                            V4MlpKind::Moe
                        }
                    })
                    .collect()
            }
        };
        let scoring = match r.scoring_func.as_str() {
            "sqrtsoftplus" => V4Scoring::SqrtSoftplus,
            "softmax" => V4Scoring::Softmax,
            "sigmoid" => V4Scoring::Sigmoid,
            o => {
                return Err(bad(
                    "scoring_func",
                    format!("{o:?}: sqrtsoftplus, softmax or sigmoid"),
                ))
            }
        };
        let positive = [
            ("routed_scaling_factor", f64::from(r.routed_scaling_factor)),
            ("swiglu_limit", f64::from(r.swiglu_limit)),
            ("hc_eps", f64::from(r.hc_eps)),
            ("rms_norm_eps", f64::from(r.rms_norm_eps)),
        ];
        for (key, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(key, format!("{v}: a positive number")));
            }
        }
        if let Some(q) = &r.quantization_config {
            // The loader dequantizes F8_E4M3 weights by 128 × 128 blocks (DeepSeek's).
            let block = &q["weight_block_size"];
            if !block.is_null() && *block != serde_json::json!([128, 128]) {
                return Err(bad(
                    "quantization_config.weight_block_size",
                    format!("{block}: the loader reads FP8 weights in 128 × 128 blocks"),
                ));
            }
        }
        let (main_rope, compress_rope) = ropes(&r)?;
        let c = HfV4Config {
            vocab: r.vocab_size,
            hidden: r.hidden_size,
            heads: r.num_attention_heads,
            q_lora: r.q_lora_rank,
            o_groups: r.o_groups,
            o_lora: r.o_lora_rank,
            ratios,
            window: r.sliding_window,
            index_heads: r.index_n_heads,
            index_topk: r.index_topk,
            experts: r.n_routed_experts,
            experts_per_token: r.num_experts_per_tok,
            moe_intermediate: r.moe_intermediate_size,
            scoring,
            routed_scaling: r.routed_scaling_factor,
            swiglu_limit: r.swiglu_limit,
            mlp,
            hc_mult: r.hc_mult,
            hc_sinkhorn_iters: r.hc_sinkhorn_iters,
            hc_eps: r.hc_eps,
            rms_norm_eps: r.rms_norm_eps,
            tie_embeddings: r.tie_word_embeddings,
            main_rope,
            compress_rope,
            mtp_layers: r.num_nextn_predict_layers,
        };
        // The cache's own rules (window, top-k) with their messages.
        c.spec()?;
        Ok(c)
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.ratios.len()
    }

    /// The cache structure of a model built from this checkpoint with its MTP layer
    /// when the configuration asks for one (one window-only layer reading `hc_mult ×
    /// hidden` target values; a checkpoint without the `mtp.0.*` tensors loads without
    /// it, and then [`V4ModelConfig::spec`](crate::v4::V4ModelConfig::spec) of the loaded
    /// model is the one to plan with). Its `num_q_heads` is the sparse decode kernel's
    /// (64): the cache does not depend on the head count.
    pub fn spec(&self) -> Result<V4Spec, CheckpointError> {
        let mtp = self.mtp_layers > 0;
        let spec = V4Spec {
            name: format!("deepseek_v4 checkpoint ({} layers)", self.ratios.len()),
            compress_ratios: self.ratios.clone(),
            num_mtp_layers: u32::from(mtp),
            window: self.window,
            index_topk: self.index_topk,
            num_q_heads: 64,
            indexer_dtype: IndexerDtype::Fp8,
            mtp_input_width: if mtp {
                u32::try_from(self.hc_mult * self.hidden).unwrap_or(u32::MAX)
            } else {
                0
            },
        };
        spec.validate()
            .map_err(|e| bad("layer_types / sliding_window / index_topk", e.to_string()))?;
        Ok(spec)
    }
}

/// Per layer 0, 4 or 128: `layer_types` (with `compress_rates`), else the legacy
/// `compress_ratios`, else transformers' default (two heavily compressed layers, then
/// heavily compressed and compressed sparse alternating: `[128, 128, 128, 4, 128, 4, …]`).
fn ratios(r: &Raw, layers: usize) -> Result<Vec<u32>, CheckpointError> {
    let mut csa = 4;
    let mut hca = 128;
    if let Some(v) = &r.compress_rates {
        let m = v.as_object().ok_or_else(|| {
            bad(
                "compress_rates",
                format!("{v}: an object of layer type → rate"),
            )
        })?;
        for (k, v) in m {
            let rate = v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| bad("compress_rates", format!("{k}: {v} is not a rate")))?;
            match k.as_str() {
                CSA => csa = rate,
                HCA => hca = rate,
                o => return Err(bad("compress_rates", format!("{o:?}: not a layer type"))),
            }
        }
    }
    csa = r.compress_rate_csa.unwrap_or(csa);
    hca = r.compress_rate_hca.unwrap_or(hca);
    if (csa, hca) != (4, 128) {
        return Err(bad(
            "compress_rates",
            format!("{csa} and {hca}: the V4 cache holds ratio-4 and ratio-128 entries"),
        ));
    }
    let types: Vec<u32> = match (&r.layer_types, &r.compress_ratios) {
        (Some(t), _) => t
            .iter()
            .map(|k| match k.as_str() {
                SLIDING => Ok(0),
                CSA => Ok(csa),
                HCA => Ok(hca),
                o => Err(bad(
                    "layer_types",
                    format!("{o:?}: {SLIDING}, {CSA} or {HCA}"),
                )),
            })
            .collect::<Result<_, _>>()?,
        (None, Some(c)) => {
            if let Some(&x) = c.iter().find(|&&x| !matches!(x, 0 | 4 | 128)) {
                return Err(bad("compress_ratios", format!("{x}: 0, 4 or 128")));
            }
            c.clone()
        }
        (None, None) => (0..layers)
            .map(|i| match i {
                0 | 1 => hca,
                i if (i - 2) % 2 == 1 => csa,
                _ => hca,
            })
            .collect(),
    };
    if types.len() < layers {
        return Err(bad(
            "layer_types",
            format!("{} entries for {layers} layers", types.len()),
        ));
    }
    // Entries past the target layers are the MTP layers' (the published lists end in
    // the MTP layer's 0): the MTP layer we build is window-only.
    if let Some(&x) = types[layers..].iter().find(|&&x| x != 0) {
        return Err(bad(
            "compress_ratios",
            format!("{x} for an MTP layer (past the {layers} target layers): its layer is window-only (0)"),
        ));
    }
    Ok(types[..layers].to_vec())
}

/// The main and the compress RoPE: `rope_parameters` nested as `{main, compress}`, or a
/// flat `rope_parameters` / `rope_scaling` whose YaRN keys apply to the compress RoPE.
fn ropes(r: &Raw) -> Result<(RopeConfig, RopeConfig), CheckpointError> {
    let theta = |key: &str, t: f64| {
        if t.is_finite() && t > 1.0 {
            Ok(t)
        } else {
            Err(bad(key, format!("{t}: must be above 1")))
        }
    };
    let p = r.rope_parameters.as_ref().or(r.rope_scaling.as_ref());
    let nested = p.and_then(|p| Some((p.get("main")?, p.get("compress")?)));
    let (main, compress) = match nested {
        Some((m, c)) => (Some(m), Some(c)),
        None => (None, p),
    };
    let num = |v: Option<&Value>, key: &str| v.and_then(|v| v.get(key)).and_then(Value::as_f64);
    let main_theta = theta(
        "rope_theta",
        num(main, "rope_theta").unwrap_or(r.rope_theta),
    )?;
    if let Some(k) = main.and_then(|m| m.get("rope_type").or(m.get("type"))) {
        if k != "default" {
            return Err(bad(
                "rope_parameters.main.rope_type",
                format!("{k}: the window layers' RoPE is unscaled"),
            ));
        }
    }
    let compress_theta = theta(
        "compress_rope_theta",
        num(compress.filter(|_| nested.is_some()), "rope_theta").unwrap_or(r.compress_rope_theta),
    )?;
    let kind = compress
        .and_then(|c| c.get("rope_type").or(c.get("type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let yarn = match kind {
        "default" => None,
        "yarn" => {
            if let Some(a) = num(compress, "attention_factor").filter(|&a| a != 1.0) {
                return Err(bad(
                    "rope_parameters.attention_factor",
                    format!("{a}: the V4 reference scales neither cos nor sin (1)"),
                ));
            }
            let factor = num(compress, "factor")
                .ok_or_else(|| bad("rope_parameters.factor", "missing for yarn".into()))?;
            let original_max =
                num(compress, "original_max_position_embeddings").ok_or_else(|| {
                    bad(
                        "rope_parameters.original_max_position_embeddings",
                        "missing for yarn".into(),
                    )
                })?;
            let nz = |key: &str, d: f64| num(compress, key).filter(|&x| x != 0.0).unwrap_or(d);
            let (beta_fast, beta_slow) = (nz("beta_fast", 32.0), nz("beta_slow", 1.0));
            if !(beta_fast.is_finite()
                && beta_fast > 0.0
                && beta_slow.is_finite()
                && beta_slow > 0.0)
            {
                return Err(bad(
                    "rope_parameters.beta_fast / beta_slow",
                    format!("{beta_fast} / {beta_slow}: positive numbers"),
                ));
            }
            if !(factor.is_finite()
                && factor > 0.0
                && original_max.is_finite()
                && original_max > 0.0)
            {
                return Err(bad(
                    "rope_parameters.factor",
                    format!("{factor} over {original_max} positions"),
                ));
            }
            Some(Yarn {
                factor,
                original_max,
                beta_fast,
                beta_slow,
                mscale: 0.0,
                mscale_all_dim: 0.0,
                truncate: compress
                    .and_then(|c| c.get("truncate"))
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
            })
        }
        o => {
            return Err(bad(
                "rope_parameters.rope_type",
                format!("{o:?}: default and yarn are supported"),
            ))
        }
    };
    Ok((
        RopeConfig {
            theta: main_theta,
            yarn: None,
        },
        RopeConfig {
            theta: compress_theta,
            yarn,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A published-shape configuration (V4-Flash's keys as its `config.json` ships
    /// them: the legacy `compress_ratios`, `num_hash_layers`, a flat YaRN).
    fn flash_json() -> String {
        let mut ratios = vec![0u32, 0];
        ratios.extend((2..43).map(|i| if i % 2 == 0 { 4 } else { 128 }));
        serde_json::json!({
            "model_type": "deepseek_v4",
            "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
            "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
            "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
            "compress_ratios": ratios, "num_hash_layers": 3,
            "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
            "sliding_window": 128, "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
            "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1},
            "n_routed_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
            "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
            "hc_mult": 4, "hc_sinkhorn_iters": 20, "num_nextn_predict_layers": 1
        })
        .to_string()
    }

    #[test]
    fn a_flash_configuration_gives_the_flash_cache() {
        let c = HfV4Config::parse(&flash_json()).unwrap();
        assert_eq!(c.layers(), 43);
        assert_eq!(&c.ratios[..4], &[0, 0, 4, 128]);
        let spec = c.spec().unwrap();
        assert_eq!(spec.compress_ratios, V4Spec::flash().compress_ratios);
        assert_eq!(spec.window, 128);
        assert_eq!((spec.num_mtp_layers, spec.mtp_input_width), (1, 4 * 4096));
        // The MTP layer's entry of the published list must be window-only.
        let with_mtp = |r: u32| {
            let mut v: serde_json::Value = serde_json::from_str(&flash_json()).unwrap();
            v["compress_ratios"].as_array_mut().unwrap().push(r.into());
            HfV4Config::parse(&v.to_string())
        };
        assert_eq!(with_mtp(0).unwrap().ratios, c.ratios);
        assert!(matches!(with_mtp(4), Err(CheckpointError::Config { .. })));
        assert_eq!(
            c.mlp[..4],
            [
                V4MlpKind::HashMoe,
                V4MlpKind::HashMoe,
                V4MlpKind::HashMoe,
                V4MlpKind::Moe
            ]
        );
        assert_eq!(
            c.main_rope,
            RopeConfig {
                theta: 10_000.0,
                yarn: None
            }
        );
        assert_eq!(c.compress_rope.theta, 160_000.0);
        let y = c.compress_rope.yarn.unwrap();
        assert_eq!(
            (y.factor, y.original_max, y.beta_fast, y.beta_slow),
            (16.0, 65536.0, 32.0, 1.0)
        );
        assert_eq!(
            (c.scoring, c.routed_scaling, c.swiglu_limit),
            (V4Scoring::SqrtSoftplus, 1.5, 10.0)
        );
        assert_eq!((c.hc_mult, c.hc_sinkhorn_iters, c.mtp_layers), (4, 20, 1));
    }

    /// transformers' own form: `layer_types`, `compress_rates`, `mlp_layer_types` and a
    /// nested `rope_parameters`; and its defaults when nothing is given.
    #[test]
    fn the_modern_keys_and_the_defaults() {
        let c = HfV4Config::parse(
            &serde_json::json!({
                "model_type": "deepseek_v4", "num_hidden_layers": 3,
                "layer_types": [SLIDING, CSA, HCA],
                "compress_rates": {CSA: 4, HCA: 128},
                "mlp_layer_types": ["moe", "hash_moe", "moe"],
                "index_topk": 64,
                "rope_parameters": {
                    "main": {"rope_type": "default", "rope_theta": 5000.0},
                    "compress": {"rope_type": "yarn", "rope_theta": 80000.0, "factor": 4,
                                 "original_max_position_embeddings": 4096, "attention_factor": 1.0}
                }
            })
            .to_string(),
        )
        .unwrap();
        assert_eq!(c.ratios, vec![0, 4, 128]);
        assert_eq!(
            c.mlp,
            vec![V4MlpKind::Moe, V4MlpKind::HashMoe, V4MlpKind::Moe]
        );
        assert_eq!(
            (c.main_rope.theta, c.compress_rope.theta),
            (5000.0, 80000.0)
        );
        assert_eq!(c.compress_rope.yarn.unwrap().factor, 4.0);
        // Defaults: V4-Flash's sizes, transformers' default layer schedule.
        let d =
            HfV4Config::parse(r#"{"model_type": "deepseek_v4", "num_hidden_layers": 6}"#).unwrap();
        assert_eq!(d.ratios, vec![128, 128, 128, 4, 128, 4]);
        assert_eq!(
            (d.hidden, d.heads, d.q_lora, d.o_groups, d.o_lora),
            (4096, 64, 1024, 8, 1024)
        );
        assert_eq!((d.index_heads, d.index_topk, d.window), (64, 512, 128));
        assert_eq!(
            d.compress_rope,
            RopeConfig {
                theta: 160_000.0,
                yarn: None
            }
        );
        assert_eq!(d.mlp[2..4], [V4MlpKind::HashMoe, V4MlpKind::Moe]);
    }

    /// What the cache cannot hold, or the implementation does not build, is refused
    /// with the key named.
    #[test]
    fn refusals_name_the_key() {
        let base: Value = serde_json::from_str(&flash_json()).unwrap();
        let cases: Vec<(&str, Value, &str)> = vec![
            (
                "model_type",
                serde_json::json!("deepseek_v32"),
                "model_type",
            ),
            ("head_dim", serde_json::json!(256), "head_dim"),
            (
                "qk_rope_head_dim",
                serde_json::json!(32),
                "qk_rope_head_dim",
            ),
            ("index_head_dim", serde_json::json!(64), "index_head_dim"),
            (
                "num_key_value_heads",
                serde_json::json!(2),
                "num_key_value_heads",
            ),
            ("compress_rate_csa", serde_json::json!(8), "compress_rates"),
            (
                "compress_ratios",
                serde_json::json!([0, 2]),
                "compress_ratios",
            ),
            ("num_hidden_layers", serde_json::json!(50), "layer_types"),
            ("o_groups", serde_json::json!(7), "o_groups"),
            ("index_topk", serde_json::json!(100), "index_topk"),
            ("sliding_window", serde_json::json!(0), "sliding_window"),
            ("scoring_func", serde_json::json!("relu"), "scoring_func"),
            ("n_shared_experts", serde_json::json!(2), "n_shared_experts"),
            ("hidden_size", serde_json::json!(0), "hidden_size"),
            (
                "rope_scaling",
                serde_json::json!({"type": "yarn", "factor": 4, "original_max_position_embeddings": 4096, "attention_factor": 1.3}),
                "attention_factor",
            ),
            (
                "rope_scaling",
                serde_json::json!({"type": "dynamic"}),
                "rope_type",
            ),
        ];
        for (key, value, named) in cases {
            let mut j = base.clone();
            j[key] = value;
            let e = HfV4Config::parse(&j.to_string()).unwrap_err().to_string();
            assert!(e.contains(named), "{key}: {e}");
        }
    }
}
