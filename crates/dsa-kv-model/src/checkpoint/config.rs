//! `config.json` of a Hugging Face DSA checkpoint (`DeepseekV32ForCausalLM`,
//! `GlmMoeDsaForCausalLM`, transformers 5.x): the keys their implementations read, with
//! their defaults, checked against what our cache stores (latent 512, RoPE 64, indexer
//! key 128).

use dsa_kv_core::config::file::json_with_path;
use serde::Deserialize;

use super::CheckpointError;
use crate::config::{INDEX_DIM, LATENT, ROPE};

/// Which published implementation the checkpoint is for. The two differ, for the
/// cache, only in the indexer's RoPE (half-split pairs `(i, i + 32)` in DeepSeek-V3.2,
/// interleaved pairs `(2i, 2i + 1)` in GLM) and in GLM's layers that reuse the previous
/// layer's top-k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `model_type = "deepseek_v32"`.
    DeepseekV32,
    /// `model_type = "glm_moe_dsa"`.
    GlmMoeDsa,
}

/// The RoPE of the checkpoint: `default` or `yarn`.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    /// `rope_theta`.
    pub theta: f64,
    /// YaRN's parameters, when `rope_type = "yarn"`.
    pub yarn: Option<Yarn>,
}

/// YaRN's parameters (`rope_parameters` with `rope_type = "yarn"`).
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    /// `factor`.
    pub factor: f64,
    /// `original_max_position_embeddings`.
    pub original_max: f64,
    /// `beta_fast` (default 32).
    pub beta_fast: f64,
    /// `beta_slow` (default 1).
    pub beta_slow: f64,
    /// `mscale` (0 when absent).
    pub mscale: f64,
    /// `mscale_all_dim` (0 when absent).
    pub mscale_all_dim: f64,
    /// `truncate` (default true: the correction range is rounded to whole dimensions).
    pub truncate: bool,
}

/// What a layer's feed-forward is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    /// `gate_proj`, `up_proj`, `down_proj` of width `intermediate_size`.
    Dense,
    /// Routed experts plus a shared expert.
    Moe,
}

/// The checkpoint's configuration, as the model reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// Which implementation.
    pub family: Family,
    /// `vocab_size`.
    pub vocab: usize,
    /// `hidden_size`.
    pub hidden: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `q_lora_rank`.
    pub q_lora: usize,
    /// `qk_nope_head_dim`.
    pub nope_dim: usize,
    /// `v_head_dim`.
    pub v_dim: usize,
    /// `index_n_heads`.
    pub index_heads: usize,
    /// `index_topk`.
    pub index_topk: usize,
    /// `intermediate_size` (dense layers).
    pub intermediate: usize,
    /// `moe_intermediate_size` (each expert; the shared expert is `n_shared_experts` wide).
    pub moe_intermediate: usize,
    /// `n_routed_experts`.
    pub experts: usize,
    /// `n_shared_experts`.
    pub shared_experts: usize,
    /// `num_experts_per_tok`.
    pub experts_per_token: usize,
    /// `n_group`.
    pub groups: usize,
    /// `topk_group`.
    pub topk_groups: usize,
    /// `norm_topk_prob`.
    pub norm_topk_prob: bool,
    /// `routed_scaling_factor`.
    pub routed_scaling: f32,
    /// `rms_norm_eps` (the layers' and the final norm; the q and kv latent norms use
    /// 1e-6 whatever this says, as the implementations do).
    pub rms_norm_eps: f32,
    /// `attention_bias`: biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`.
    pub attention_bias: bool,
    /// `tie_word_embeddings`: the output head is the embedding.
    pub tie_embeddings: bool,
    /// The RoPE.
    pub rope: RopeConfig,
    /// Per layer: dense or MoE (`mlp_layer_types`, else the first
    /// `first_k_dense_replace` layers dense).
    pub mlp: Vec<MlpKind>,
    /// Per layer: whether it owns an indexer (GLM's `indexer_types`: `"shared"` layers
    /// reuse the previous layer's top-k; DeepSeek-V3.2: every layer).
    pub indexer: Vec<bool>,
}

/// `config.json` as written by transformers 5.x (only the keys the model reads; the
/// rest are ignored, as transformers ignores keys its implementation does not read).
#[derive(Deserialize)]
struct Raw {
    model_type: String,
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    q_lora_rank: Option<usize>,
    kv_lora_rank: usize,
    qk_nope_head_dim: usize,
    qk_rope_head_dim: usize,
    v_head_dim: usize,
    index_n_heads: usize,
    index_head_dim: usize,
    index_topk: usize,
    intermediate_size: usize,
    moe_intermediate_size: usize,
    n_routed_experts: usize,
    // The routing keys are required: transformers' defaults for them differ by model type
    // and version (e.g. a scaling of 2.5, 8 groups), and `save_pretrained` writes them all,
    // so a configuration without them is not one a published checkpoint has.
    n_shared_experts: usize,
    num_experts_per_tok: usize,
    n_group: usize,
    topk_group: usize,
    norm_topk_prob: bool,
    routed_scaling_factor: f32,
    rms_norm_eps: f32,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    tie_word_embeddings: bool,
    rope_parameters: Option<RawRope>,
    rope_scaling: Option<RawRope>,
    rope_theta: Option<f64>,
    mlp_layer_types: Option<Vec<String>>,
    first_k_dense_replace: Option<usize>,
    indexer_types: Option<Vec<String>>,
    max_position_embeddings: Option<f64>,
}

#[derive(Deserialize, Clone)]
struct RawRope {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
    mscale: Option<f64>,
    mscale_all_dim: Option<f64>,
    truncate: Option<bool>,
    attention_factor: Option<f64>,
}

/// The largest size a configuration may give (2^24; products of two stay below 2^48).
const MAX_SIZE: usize = 1 << 24;

/// The most layers a configuration may give: the per-layer lists the parser builds stay
/// small whatever a file claims (the published models have fewer than 100).
pub(super) const MAX_LAYERS: usize = 4096;

/// Refuses a layer count past [`MAX_LAYERS`].
pub(super) fn check_layers(layers: usize) -> Result<(), CheckpointError> {
    if layers > MAX_LAYERS {
        return Err(bad(
            "num_hidden_layers",
            format!("{layers}: at most {MAX_LAYERS} (the published models have fewer than 100)"),
        ));
    }
    Ok(())
}

fn bad(key: &str, what: String) -> CheckpointError {
    CheckpointError::Config {
        key: key.to_string(),
        what,
    }
}

impl HfConfig {
    /// Parses and checks `config.json`.
    pub fn parse(json: &str) -> Result<HfConfig, CheckpointError> {
        let r: Raw = json_with_path(json).map_err(|e| CheckpointError::Config {
            key: e.path.unwrap_or_else(|| "config.json".into()),
            what: format!("not a DSA checkpoint configuration: {}", e.message),
        })?;
        let family = match r.model_type.as_str() {
            "deepseek_v32" => Family::DeepseekV32,
            "glm_moe_dsa" => Family::GlmMoeDsa,
            other => {
                return Err(bad(
                    "model_type",
                    format!("{other:?}: this loader reads deepseek_v32 and glm_moe_dsa"),
                ))
            }
        };
        let fixed = [
            ("kv_lora_rank", r.kv_lora_rank, LATENT),
            ("qk_rope_head_dim", r.qk_rope_head_dim, ROPE),
            ("index_head_dim", r.index_head_dim, INDEX_DIM),
        ];
        for (key, got, want) in fixed {
            if got != want {
                return Err(bad(
                    key,
                    format!("{got}: the cache stores {want} (DeepSeek-V3.2's and GLM-5's size)"),
                ));
            }
        }
        let q_lora = r.q_lora_rank.ok_or_else(|| {
            bad(
                "q_lora_rank",
                "missing: the DSA implementations need it (the indexer reads the q latent)".into(),
            )
        })?;
        check_layers(r.num_hidden_layers)?;
        let positive = [
            ("vocab_size", r.vocab_size),
            ("hidden_size", r.hidden_size),
            ("num_hidden_layers", r.num_hidden_layers),
            ("num_attention_heads", r.num_attention_heads),
            ("q_lora_rank", q_lora),
            ("index_n_heads", r.index_n_heads),
            ("index_topk", r.index_topk),
            ("n_group", r.n_group),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err(bad(key, "0: must be at least 1".into()));
            }
        }
        // Every size is bounded, so the products the loader forms (heads × head dims,
        // experts × intermediate sizes) cannot overflow, whatever a file says; the
        // published models are far below.
        let sizes = [
            ("vocab_size", r.vocab_size),
            ("hidden_size", r.hidden_size),
            ("num_hidden_layers", r.num_hidden_layers),
            ("num_attention_heads", r.num_attention_heads),
            ("q_lora_rank", q_lora),
            ("qk_nope_head_dim", r.qk_nope_head_dim),
            ("v_head_dim", r.v_head_dim),
            ("index_n_heads", r.index_n_heads),
            ("index_topk", r.index_topk),
            ("intermediate_size", r.intermediate_size),
            ("moe_intermediate_size", r.moe_intermediate_size),
            ("n_routed_experts", r.n_routed_experts),
            ("n_shared_experts", r.n_shared_experts),
            ("num_experts_per_tok", r.num_experts_per_tok),
            ("n_group", r.n_group),
            ("topk_group", r.topk_group),
            (
                "first_k_dense_replace",
                r.first_k_dense_replace.unwrap_or(0),
            ),
        ];
        for (key, v) in sizes {
            if v > MAX_SIZE {
                return Err(bad(key, format!("{v}: at most {MAX_SIZE}")));
            }
        }
        let layers = r.num_hidden_layers;
        let mlp = match (&r.mlp_layer_types, r.first_k_dense_replace) {
            (Some(t), _) => {
                if t.len() != layers {
                    return Err(bad(
                        "mlp_layer_types",
                        format!("{} entries for {layers} layers", t.len()),
                    ));
                }
                t.iter()
                    .map(|k| match k.as_str() {
                        "dense" => Ok(MlpKind::Dense),
                        "sparse" => Ok(MlpKind::Moe),
                        o => Err(bad("mlp_layer_types", format!("{o:?}: dense or sparse"))),
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            (None, None) => {
                return Err(bad(
                    "mlp_layer_types",
                    "missing, and so is first_k_dense_replace: one of them must say which \
                     layers are dense"
                        .into(),
                ))
            }
            (None, Some(k)) => (0..layers)
                .map(|l| if l < k { MlpKind::Dense } else { MlpKind::Moe })
                .collect(),
        };
        if mlp.contains(&MlpKind::Moe) {
            if r.n_routed_experts == 0 || r.num_experts_per_tok == 0 {
                return Err(bad(
                    "n_routed_experts",
                    "MoE layers need experts and num_experts_per_tok ≥ 1".into(),
                ));
            }
            if !r.n_routed_experts.is_multiple_of(r.n_group)
                || r.n_routed_experts / r.n_group < 2
                || r.topk_group == 0
                || r.topk_group > r.n_group
                || r.num_experts_per_tok > r.topk_group * (r.n_routed_experts / r.n_group)
            {
                return Err(bad(
                    "n_group",
                    format!(
                        "{} experts in {} groups (top {} groups, {} experts per token): the \
                         experts must split into groups of at least 2, and the chosen groups \
                         must hold the experts per token",
                        r.n_routed_experts, r.n_group, r.topk_group, r.num_experts_per_tok
                    ),
                ));
            }
        }
        let indexer = match (family, &r.indexer_types) {
            (Family::GlmMoeDsa, Some(t)) => {
                if t.len() != layers {
                    return Err(bad(
                        "indexer_types",
                        format!("{} entries for {layers} layers", t.len()),
                    ));
                }
                let m = t
                    .iter()
                    .map(|k| match k.as_str() {
                        "full" => Ok(true),
                        "shared" => Ok(false),
                        o => Err(bad("indexer_types", format!("{o:?}: full or shared"))),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if !m[0] {
                    return Err(bad(
                        "indexer_types",
                        "layer 0 is shared: it has no earlier layer's top-k to reuse".into(),
                    ));
                }
                m
            }
            _ => vec![true; layers],
        };
        let rope = rope(&r)?;
        Ok(HfConfig {
            family,
            vocab: r.vocab_size,
            hidden: r.hidden_size,
            layers,
            heads: r.num_attention_heads,
            q_lora,
            nope_dim: r.qk_nope_head_dim,
            v_dim: r.v_head_dim,
            index_heads: r.index_n_heads,
            index_topk: r.index_topk,
            intermediate: r.intermediate_size,
            moe_intermediate: r.moe_intermediate_size,
            experts: r.n_routed_experts,
            shared_experts: r.n_shared_experts,
            experts_per_token: r.num_experts_per_tok,
            groups: r.n_group,
            topk_groups: r.topk_group,
            norm_topk_prob: r.norm_topk_prob,
            routed_scaling: r.routed_scaling_factor,
            rms_norm_eps: r.rms_norm_eps,
            attention_bias: r.attention_bias,
            tie_embeddings: r.tie_word_embeddings,
            rope,
            mlp,
            indexer,
        })
    }

    /// `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.nope_dim + ROPE
    }
}

/// `get_mscale` of the implementations: `0.1 · m · ln(s) + 1` for `s > 1`, else 1.
pub(crate) fn yarn_mscale(s: f64, m: f64) -> f64 {
    if s <= 1.0 {
        1.0
    } else {
        0.1 * m * s.ln() + 1.0
    }
}

fn rope(r: &Raw) -> Result<RopeConfig, CheckpointError> {
    // transformers moves the legacy `rope_scaling` / `rope_theta` into `rope_parameters`.
    let p = r.rope_parameters.clone().or_else(|| r.rope_scaling.clone());
    let theta = p
        .as_ref()
        .and_then(|p| p.rope_theta)
        .or(r.rope_theta)
        .unwrap_or(10_000.0);
    if theta <= 1.0 || !theta.is_finite() {
        return Err(bad("rope_theta", format!("{theta}: must be above 1")));
    }
    let Some(p) = p else {
        return Ok(RopeConfig { theta, yarn: None });
    };
    let kind = p
        .rope_type
        .clone()
        .or(p.kind.clone())
        .unwrap_or("default".into());
    match kind.as_str() {
        "default" => Ok(RopeConfig { theta, yarn: None }),
        "yarn" => {
            if p.attention_factor.is_some() {
                return Err(bad(
                    "rope_parameters.attention_factor",
                    "an explicit YaRN attention factor is not supported".into(),
                ));
            }
            let original_max = p
                .original_max_position_embeddings
                .or(r.max_position_embeddings)
                .ok_or_else(|| {
                    bad(
                        "rope_parameters.original_max_position_embeddings",
                        "missing".into(),
                    )
                })?;
            let factor = match p.factor {
                Some(f) => f,
                None => r.max_position_embeddings.unwrap_or(original_max) / original_max,
            };
            // `or` in the implementations: 0 (or absent) takes the default.
            let nz = |v: Option<f64>, d: f64| v.filter(|&x| x != 0.0).unwrap_or(d);
            let y = Yarn {
                factor,
                original_max,
                beta_fast: nz(p.beta_fast, 32.0),
                beta_slow: nz(p.beta_slow, 1.0),
                mscale: p.mscale.unwrap_or(0.0),
                mscale_all_dim: p.mscale_all_dim.unwrap_or(0.0),
                truncate: p.truncate.unwrap_or(true),
            };
            if !(y.factor.is_finite() && y.factor > 0.0 && y.original_max > 0.0) {
                return Err(bad(
                    "rope_parameters.factor",
                    format!("{} over {} positions", y.factor, y.original_max),
                ));
            }
            Ok(RopeConfig {
                theta,
                yarn: Some(y),
            })
        }
        other => Err(bad(
            "rope_parameters.rope_type",
            format!("{other:?}: default and yarn are supported"),
        )),
    }
}
