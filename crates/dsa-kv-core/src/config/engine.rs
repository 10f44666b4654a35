//! Engine configuration (TOML, JSON or YAML file, or code) and its resolution: which layout
//! (V1 / V2) the cache uses, which layers each manager holds, and every incompatibility,
//! checked up front:
//!
//! * `use_kv_cache_manager_v2: auto` takes the model default (the DSA presets default to
//!   V2; no default means V1); an explicit `true` / `false` wins.
//! * V2 with a sparse (DSA) model and any of beam width > 1, a KV connector or STAR
//!   context parallelism is one [`ConfigError::Unsupported`] listing all of them and the
//!   way out; a dense model in the same situation falls back to V1 with a warning.
//! * V1 + STAR works: context tokens are cached on every CP rank, query tokens only on
//!   the last ([`star_cached_tokens`]).
//! * Helix works without block reuse; on inactive ranks a step adds no tokens.
//! * Unknown fields and bad values are errors naming the field.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::model::{
    DsaModel, IndexerDtype, IndexerLayers, KvDtype, LayerSet, ModelError, ModelPreset,
};

/// The only page size DSA kernels accept (DeepGEMM's paged logits and FlashMLA read
/// 64-token pages).
pub const DSA_TOKENS_PER_BLOCK: u32 = 64;

/// Which pool layout a configuration resolves to (the planner in [`crate::layout`]
/// reads it).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayoutKind {
    /// TensorRT-LLM V1: primary pool + one indexer pool per indexer layer.
    V1,
    /// TensorRT-LLM V2: coalesced buffers, pool groups, page-index converters.
    V2,
}

/// `use_kv_cache_manager_v2`: `auto`, `true` or `false`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum V2Choice {
    /// The model's default (V1 when the model has none).
    #[default]
    Auto,
    /// An explicit choice.
    Explicit(bool),
}

impl Serialize for V2Choice {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            V2Choice::Auto => s.serialize_str("auto"),
            V2Choice::Explicit(b) => s.serialize_bool(*b),
        }
    }
}

impl<'de> Deserialize<'de> for V2Choice {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            B(bool),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::B(b) => Ok(V2Choice::Explicit(b)),
            Raw::S(s) => match s.as_str() {
                "auto" => Ok(V2Choice::Auto),
                "true" => Ok(V2Choice::Explicit(true)),
                "false" => Ok(V2Choice::Explicit(false)),
                other => Err(serde::de::Error::custom(format!(
                    "use_kv_cache_manager_v2: expected auto, true or false, got {other:?}"
                ))),
            },
        }
    }
}

/// Which model, with optional overrides of the preset.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ModelConfig {
    /// `deepseek-v3.2`, `glm-5`, `glm-5.2`, `mistral-large-3`, or a model with sliding
    /// windows: `deepseek-v4-flash`, `deepseek-v4-pro` (of the overrides below, only
    /// `indexer_dtype` applies to them).
    pub preset: ModelPreset,
    /// Target layers (required for Mistral Large 3).
    #[serde(default)]
    pub num_layers: Option<u32>,
    /// MTP layers.
    #[serde(default)]
    pub num_mtp_layers: Option<u32>,
    /// MLA row dtype.
    #[serde(default)]
    pub kv_dtype: Option<KvDtype>,
    /// Indexer key dtype.
    #[serde(default)]
    pub indexer_dtype: Option<IndexerDtype>,
    /// Which target layers own an indexer (the preset's pattern when absent; e.g. a
    /// checkpoint's GLM layers that share the previous layer's top-k).
    #[serde(default)]
    pub indexer_layers: Option<IndexerLayers>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            preset: ModelPreset::DeepSeekV32,
            num_layers: None,
            num_mtp_layers: None,
            kv_dtype: None,
            indexer_dtype: None,
            indexer_layers: None,
        }
    }
}

impl ModelConfig {
    /// The structure of a model with sliding windows (a DeepSeek-V4 preset) with its
    /// `indexer_dtype` override; `Ok(None)` for a DSA preset. An override that does not
    /// apply to such a model is a typed error naming it.
    pub fn windowed_spec(&self) -> Result<Option<super::V4Spec>, ConfigError> {
        let Some(preset) = self.preset.windowed() else {
            return Ok(None);
        };
        for (field, set) in [
            ("model.num_layers", self.num_layers.is_some()),
            ("model.num_mtp_layers", self.num_mtp_layers.is_some()),
            ("model.kv_dtype", self.kv_dtype.is_some()),
            ("model.indexer_layers", self.indexer_layers.is_some()),
        ] {
            if set {
                return invalid(
                    field,
                    "set",
                    format!(
                        "{} has a fixed layer structure and MODEL1 rows: only \
                         model.indexer_dtype applies to it",
                        preset.name()
                    ),
                );
            }
        }
        let mut spec = preset.spec();
        if let Some(d) = self.indexer_dtype {
            spec.indexer_dtype = d;
        }
        spec.validate().map_err(|e| ConfigError::Invalid {
            field: "model.indexer_dtype",
            value: format!("{:?}", spec.indexer_dtype),
            why: e.to_string(),
        })?;
        Ok(Some(spec))
    }

    /// The validated model.
    pub fn build(&self) -> Result<DsaModel, ModelError> {
        let mut spec = self.preset.spec(self.num_layers)?;
        if let Some(n) = self.num_mtp_layers {
            spec.num_mtp_layers = n;
        }
        if let Some(d) = self.kv_dtype {
            spec.kv_dtype = d;
        }
        if let Some(d) = self.indexer_dtype {
            spec.indexer_dtype = d;
        }
        if let Some(l) = &self.indexer_layers {
            spec.indexer_layers = l.clone();
        }
        DsaModel::new(spec)
    }
}

/// KV-cache settings, named as in TensorRT-LLM's `KvCacheConfig`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct KvCacheConfig {
    /// Tokens per block (must be 64 for DSA).
    pub tokens_per_block: u32,
    /// `auto`, `true` or `false`.
    pub use_kv_cache_manager_v2: V2Choice,
    /// Fraction of free GPU memory for the cache when no explicit budget is given.
    pub free_gpu_memory_fraction: f64,
    /// Token cap of the GPU cache.
    pub max_tokens: Option<u64>,
    /// Explicit GPU budget in bytes.
    pub max_gpu_total_bytes: Option<u64>,
    /// Host (offload) tier in bytes, for the target and any separate draft cache together
    /// (both get the same slot count); 0 or absent: no host tier.
    pub host_cache_size: Option<u64>,
    /// Prefix reuse.
    pub enable_block_reuse: bool,
    /// Reuse of a leading part of a block.
    pub enable_partial_reuse: bool,
    /// Resume refuses above this GPU utilization (0, 1].
    pub max_util_for_resume: f64,
}

impl Default for KvCacheConfig {
    fn default() -> Self {
        KvCacheConfig {
            tokens_per_block: DSA_TOKENS_PER_BLOCK,
            use_kv_cache_manager_v2: V2Choice::Auto,
            free_gpu_memory_fraction: 0.9,
            max_tokens: None,
            max_gpu_total_bytes: None,
            host_cache_size: None,
            enable_block_reuse: true,
            enable_partial_reuse: true,
            max_util_for_resume: 0.97,
        }
    }
}

/// Context-parallel mode.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpMode {
    /// No context parallelism.
    #[default]
    None,
    /// Helix: decode-time KV sharding across CP ranks.
    Helix,
    /// STAR attention: context blocks on every rank, queries on the last.
    Star,
}

/// Parallelism of one model instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct ParallelConfig {
    /// Tensor-parallel size (one device actor per rank; identical page tables).
    pub tp_size: u32,
    /// Context-parallel mode.
    pub cp_mode: CpMode,
    /// This rank's CP index.
    pub cp_rank: u32,
    /// CP group size.
    pub cp_size: u32,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            tp_size: 1,
            cp_mode: CpMode::None,
            cp_rank: 0,
            cp_size: 1,
        }
    }
}

/// Speculative decoding mode.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpecMode {
    /// No speculation.
    #[default]
    None,
    /// The model's MTP layers draft tokens.
    Mtp,
    /// An Eagle3 draft head (its own dense KV cache lives outside dsa-kv).
    Eagle3,
}

/// Speculative decoding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct SpecDecodeConfig {
    /// Mode.
    pub mode: SpecMode,
    /// Draft tokens per step.
    pub draft_tokens: u32,
    /// MTP layers in their own manager (draft replay) instead of the target's.
    pub separate_draft_cache: bool,
}

impl Default for SpecDecodeConfig {
    fn default() -> Self {
        SpecDecodeConfig {
            mode: SpecMode::None,
            draft_tokens: 0,
            separate_draft_cache: true,
        }
    }
}

impl SpecDecodeConfig {
    /// Draft tokens per decode step for a model `name` with `mtp_layers` MTP layers:
    /// 0 without speculation (then `draft_tokens` must be 0), else `draft_tokens` in
    /// 1..=16; MTP needs an MTP layer.
    pub fn draft_tokens(&self, name: &str, mtp_layers: u32) -> Result<u32, ConfigError> {
        let n = match self.mode {
            SpecMode::None => {
                if self.draft_tokens > 0 {
                    return invalid(
                        "spec_decode.draft_tokens",
                        self.draft_tokens,
                        "needs spec_decode.mode mtp or eagle3",
                    );
                }
                0
            }
            SpecMode::Mtp | SpecMode::Eagle3 => {
                if self.draft_tokens == 0 || self.draft_tokens > 16 {
                    return invalid(
                        "spec_decode.draft_tokens",
                        self.draft_tokens,
                        "must be in 1..=16 with speculative decoding",
                    );
                }
                self.draft_tokens
            }
        };
        if self.mode == SpecMode::Mtp && mtp_layers == 0 {
            return invalid(
                "spec_decode.mode",
                "mtp",
                format!("{name} has no MTP layer: set model.num_mtp_layers or use eagle3"),
            );
        }
        Ok(n)
    }
}

/// Scheduler limits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct SchedulerConfig {
    /// Requests per step.
    pub max_num_sequences: u32,
    /// New tokens per step (prefill chunks + decode tokens).
    pub max_num_tokens: u32,
    /// Longest prefill chunk of one request per step.
    pub max_prefill_chunk: u32,
    /// Longest sequence (prompt + output).
    pub max_seq_len: u32,
    /// Beam width (dsa-kv's V2 supports 1).
    pub max_beam_width: u32,
    /// Name of a KV connector, if one is configured.
    pub kv_connector: Option<String>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_sequences: 256,
            max_num_tokens: 8192,
            max_prefill_chunk: 2048,
            max_seq_len: 32_768,
            max_beam_width: 1,
            kv_connector: None,
        }
    }
}

impl SchedulerConfig {
    /// Checks every field against [`limits`] (positive, and small enough that what is
    /// sized from it fits), whatever the model.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_beam_width == 0 {
            return invalid("scheduler.max_beam_width", 0, "must be at least 1");
        }
        for (field, v, max) in [
            (
                "scheduler.max_num_sequences",
                self.max_num_sequences,
                limits::MAX_NUM_SEQUENCES,
            ),
            (
                "scheduler.max_num_tokens",
                self.max_num_tokens,
                limits::MAX_NUM_TOKENS,
            ),
            (
                "scheduler.max_prefill_chunk",
                self.max_prefill_chunk,
                limits::MAX_NUM_TOKENS,
            ),
            (
                "scheduler.max_seq_len",
                self.max_seq_len,
                limits::MAX_SEQ_LEN,
            ),
        ] {
            if v == 0 {
                return invalid(field, 0, "must be positive");
            }
            if v > max {
                return invalid(
                    field,
                    v,
                    format!(
                        "must be at most {max} (positions, page tables and slot mappings are \
                         sized from it)"
                    ),
                );
            }
        }
        Ok(())
    }
}

/// Everything an engine is configured with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct EngineConfig {
    /// The model.
    pub model: ModelConfig,
    /// The cache.
    pub kv_cache: KvCacheConfig,
    /// Parallelism.
    pub parallel: ParallelConfig,
    /// Speculative decoding.
    pub spec_decode: SpecDecodeConfig,
    /// Scheduler limits.
    pub scheduler: SchedulerConfig,
    /// KV transfers between engines.
    pub transfer: TransferConfig,
}

/// KV transfers between engines (prefill / decode disaggregation).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct TransferConfig {
    /// How long an export or an import lives without a renewal, in milliseconds: an
    /// export's pins are then released, an import aborted (its pages freed), so a peer
    /// that dies mid-transfer costs at most this long. Writes into an import must land
    /// a drain margin (2 s, at most half the lease) before it ends.
    pub lease_ms: u64,
}

impl Default for TransferConfig {
    /// A 30-second lease.
    fn default() -> Self {
        TransferConfig { lease_ms: 30_000 }
    }
}

impl TransferConfig {
    /// Checks the lease (0.1 s to a day).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(100..=86_400_000).contains(&self.lease_ms) {
            return invalid(
                "transfer.lease_ms",
                self.lease_ms,
                "must be between 100 (0.1 s) and 86400000 (a day)",
            );
        }
        Ok(())
    }
}

/// A configuration that cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {message}")]
    Io {
        /// Path.
        path: String,
        /// OS message.
        message: String,
    },
    /// The text is not valid TOML/JSON for the schema (names the field and position).
    #[error("invalid config {source_name}: {message}")]
    Parse {
        /// File name or `<string>`.
        source_name: String,
        /// Parser message.
        message: String,
    },
    /// A field with a bad value.
    #[error("{field} = {value} is invalid: {why}")]
    Invalid {
        /// Dotted field name.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is required.
        why: String,
    },
    /// V2 with a sparse model and features it does not support.
    #[error(
        "KV cache manager V2 for sparse-attention (DSA) models is not supported with {}. \
         Set kv_cache.use_kv_cache_manager_v2 = false to use the V1 layout{}",
        .incompatible.join(", "),
        .hint
    )]
    Unsupported {
        /// Every incompatibility found.
        incompatible: Vec<&'static str>,
        /// What else can be changed.
        hint: String,
    },
    /// The model is invalid.
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl EngineConfig {
    /// Parses TOML; unknown fields are errors naming the field and position.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            source_name: "<toml>".into(),
            message: e.to_string(),
        })
    }

    /// Parses JSON; an error names the field (`kv_cache.max_tokens: invalid type …`).
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        super::file::json_with_path(text).map_err(|e| ConfigError::Parse {
            source_name: "<json>".into(),
            message: e.to_string(),
        })
    }

    /// Parses YAML (the format TensorRT-LLM's `extra_llm_api_options` files use; the
    /// keys are this crate's, not TensorRT-LLM's). A document nested deeper than
    /// [`MAX_YAML_NESTING`](super::file::MAX_YAML_NESTING) is refused before the YAML parser sees it (its time grows
    /// with the square of the depth).
    pub fn from_yaml_str(text: &str) -> Result<Self, ConfigError> {
        let parse = |message| ConfigError::Parse {
            source_name: "<yaml>".into(),
            message,
        };
        use super::file::{yaml_too_deep, MAX_YAML_NESTING};
        if let Some((line, depth)) = yaml_too_deep(text, MAX_YAML_NESTING) {
            return Err(parse(format!(
                "nested too deeply at line {line}: indentation, entries and brackets count \
                 {depth}, past the limit of {MAX_YAML_NESTING} (an engine configuration is \
                 three levels deep)"
            )));
        }
        serde_yaml_ng::from_str(text).map_err(|e| parse(e.to_string()))
    }

    /// Reads a `.toml`, `.json`, `.yaml` or `.yml` file: a regular file of at most
    /// [`MAX_CONFIG_FILE_BYTES`](super::file::MAX_CONFIG_FILE_BYTES).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = super::file::read_regular_text(path, super::file::MAX_CONFIG_FILE_BYTES)
            .map_err(|e| ConfigError::Io {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let parsed = match ext {
            "toml" => Self::from_toml_str(&text),
            "json" => Self::from_json_str(&text),
            "yaml" | "yml" => Self::from_yaml_str(&text),
            other => {
                return Err(ConfigError::Parse {
                    source_name: path.display().to_string(),
                    message: format!(
                        "unknown extension {other:?}: use .toml, .json, .yaml or .yml"
                    ),
                })
            }
        };
        parsed.map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                source_name: path.display().to_string(),
                message,
            },
            other => other,
        })
    }

    /// Validates and resolves the configuration.
    pub fn resolve(&self) -> Result<ResolvedConfig, ConfigError> {
        resolve(self)
    }

    /// Validates and resolves the configuration for a model built in code (the `model`
    /// section is ignored): models the file schema cannot describe, such as a custom
    /// indexer mask, go through the same rules.
    pub fn resolve_with(&self, model: DsaModel) -> Result<ResolvedConfig, ConfigError> {
        resolve_with_model(self, model)
    }
}

/// The decisions a configuration resolves to.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedConfig {
    /// The validated model.
    pub model: DsaModel,
    /// V1 or V2.
    pub layout: LayoutKind,
    /// Layers of the target manager.
    pub target_layers: LayerSet,
    /// Layers of a separate draft manager (MTP with `separate_draft_cache`).
    pub draft_layers: Option<LayerSet>,
    /// Draft tokens per decode step (0 without speculation).
    pub draft_tokens: u32,
    /// Block reuse after resolution.
    pub enable_block_reuse: bool,
    /// Non-fatal adjustments (also logged with `tracing::warn!`).
    pub warnings: Vec<String>,
    /// The source configuration.
    pub config: EngineConfig,
}

/// The largest values [`EngineConfig::resolve`] accepts: everything sized from them
/// (page tables, slot mappings, per-request state, device actors) then fits in memory
/// and in the integer types that hold it, and a bad value is a typed error naming its
/// field instead of an overflow or an aborted allocation.
pub mod limits {
    /// `scheduler.max_seq_len`: 16 Mi tokens (the longest DSA context is 1 Mi).
    pub const MAX_SEQ_LEN: u32 = 1 << 24;
    /// `scheduler.max_num_sequences`.
    pub const MAX_NUM_SEQUENCES: u32 = 1 << 16;
    /// `scheduler.max_num_tokens` and `scheduler.max_prefill_chunk`: 4 Mi tokens a step.
    pub const MAX_NUM_TOKENS: u32 = 1 << 22;
    /// `max_num_sequences × ceil((max_seq_len + drafts + 1) / 64)`: the entries of one
    /// page table (256 MiB of `i32`; a runtime holds up to four).
    pub const MAX_PAGE_TABLE_ENTRIES: u64 = 1 << 26;
    /// `kv_cache.max_tokens`: 2^40 tokens.
    pub const MAX_KV_TOKENS: u64 = 1 << 40;
    /// `parallel.tp_size` (and the builder's device count).
    pub const MAX_DEVICES: u32 = 128;
    /// `parallel.cp_size`.
    pub const MAX_CP_SIZE: u32 = 1024;
}

fn invalid<T>(
    field: &'static str,
    value: impl fmt::Display,
    why: impl Into<String>,
) -> Result<T, ConfigError> {
    Err(ConfigError::Invalid {
        field,
        value: value.to_string(),
        why: why.into(),
    })
}

/// Tokens of one request a STAR rank caches: the context on every rank, the query only
/// on the last rank.
pub fn star_cached_tokens(
    context_tokens: u64,
    query_tokens: u64,
    cp_rank: u32,
    cp_size: u32,
) -> u64 {
    context_tokens
        + if cp_rank + 1 == cp_size {
            query_tokens
        } else {
            0
        }
}

fn resolve(c: &EngineConfig) -> Result<ResolvedConfig, ConfigError> {
    resolve_with_model(c, c.model.build()?)
}

/// Resolves `c` for an already built model (code-level configuration can use models the
/// file schema cannot describe, e.g. a dense mask).
fn resolve_with_model(c: &EngineConfig, model: DsaModel) -> Result<ResolvedConfig, ConfigError> {
    let kv = &c.kv_cache;
    if kv.tokens_per_block != DSA_TOKENS_PER_BLOCK {
        return invalid(
            "kv_cache.tokens_per_block",
            kv.tokens_per_block,
            "must be 64 for DSA: the DeepGEMM paged indexer-logits kernel and FlashMLA read 64-token pages",
        );
    }
    for (field, v) in [
        (
            "kv_cache.free_gpu_memory_fraction",
            kv.free_gpu_memory_fraction,
        ),
        ("kv_cache.max_util_for_resume", kv.max_util_for_resume),
    ] {
        if !(v > 0.0 && v <= 1.0) {
            return invalid(field, v, "must be in (0, 1]");
        }
    }
    if kv.max_tokens == Some(0) {
        return invalid(
            "kv_cache.max_tokens",
            0,
            "must be positive (leave it out for no cap)",
        );
    }
    if let Some(t) = kv.max_tokens.filter(|&t| t > limits::MAX_KV_TOKENS) {
        return invalid(
            "kv_cache.max_tokens",
            t,
            format!("must be at most {} tokens", limits::MAX_KV_TOKENS),
        );
    }
    if kv.max_gpu_total_bytes == Some(0) {
        return invalid(
            "kv_cache.max_gpu_total_bytes",
            0,
            "must be positive (leave it out to use free_gpu_memory_fraction)",
        );
    }
    let p = &c.parallel;
    if p.tp_size == 0 {
        return invalid("parallel.tp_size", 0, "must be at least 1");
    }
    if p.tp_size > limits::MAX_DEVICES {
        return invalid(
            "parallel.tp_size",
            p.tp_size,
            format!(
                "must be at most {} (one device actor and thread per rank)",
                limits::MAX_DEVICES
            ),
        );
    }
    if p.cp_size == 0 {
        return invalid("parallel.cp_size", 0, "must be at least 1");
    }
    if p.cp_size > limits::MAX_CP_SIZE {
        return invalid(
            "parallel.cp_size",
            p.cp_size,
            format!("must be at most {}", limits::MAX_CP_SIZE),
        );
    }
    if p.cp_rank >= p.cp_size {
        return invalid(
            "parallel.cp_rank",
            p.cp_rank,
            format!("must be below cp_size {}", p.cp_size),
        );
    }
    if p.cp_mode == CpMode::None && p.cp_size > 1 {
        return invalid(
            "parallel.cp_size",
            p.cp_size,
            "is above 1 but cp_mode is none: choose helix or star",
        );
    }
    c.transfer.validate()?;
    c.scheduler.validate()?;
    let s = &c.scheduler;
    // The page tables are allocated at their maxima: bound their size before anything
    // is (4 bytes an entry, two tables per set, a second set for the draft cache).
    let entries = u64::from(s.max_num_sequences)
        * (u64::from(s.max_seq_len) + 1 + 16).div_ceil(u64::from(DSA_TOKENS_PER_BLOCK));
    if entries > limits::MAX_PAGE_TABLE_ENTRIES {
        return invalid(
            "scheduler.max_seq_len",
            s.max_seq_len,
            format!(
                "with scheduler.max_num_sequences = {} the page tables would hold {entries} \
                 entries each (the most is {}): lower max_seq_len or max_num_sequences",
                s.max_num_sequences,
                limits::MAX_PAGE_TABLE_ENTRIES
            ),
        );
    }
    let sd = &c.spec_decode;
    let draft_tokens = sd.draft_tokens(&model.spec().name, model.spec().num_mtp_layers)?;
    if sd.mode == SpecMode::Eagle3 && sd.separate_draft_cache {
        return invalid(
            "spec_decode.separate_draft_cache",
            true,
            "an Eagle3 draft head has a dense KV cache that dsa-kv does not manage: set it to false \
             (dsa-kv still reserves and rolls back the draft tokens in the target cache)",
        );
    }
    let mut warnings = Vec::new();
    let sparse = model.num_indexer_layers() > 0
        || (model.spec().mtp_has_indexer && model.spec().num_mtp_layers > 0);
    let mut use_v2 = match kv.use_kv_cache_manager_v2 {
        V2Choice::Auto => model.spec().default_kv_manager_v2.unwrap_or(false),
        V2Choice::Explicit(b) => b,
    };
    if use_v2 {
        let mut incompatible = Vec::new();
        if s.max_beam_width > 1 {
            incompatible.push("max_beam_width > 1");
        }
        if s.kv_connector.is_some() {
            incompatible.push("kv_connector");
        }
        if p.cp_mode == CpMode::Star {
            incompatible.push("STAR context parallelism");
        }
        if !incompatible.is_empty() {
            if sparse {
                let mut hint = String::new();
                if p.cp_mode == CpMode::Star {
                    hint.push_str(", or use cp_mode none or helix instead of star");
                }
                if s.max_beam_width > 1 {
                    hint.push_str(", or set scheduler.max_beam_width = 1");
                }
                if s.kv_connector.is_some() {
                    hint.push_str(", or remove scheduler.kv_connector");
                }
                return Err(ConfigError::Unsupported { incompatible, hint });
            }
            let w = format!(
                "KV cache manager V2 is not supported with {}: falling back to the V1 layout",
                incompatible.join(", ")
            );
            tracing::warn!("{w}");
            warnings.push(w);
            use_v2 = false;
        }
    }
    if p.cp_mode == CpMode::Helix && kv.enable_block_reuse {
        return invalid(
            "kv_cache.enable_block_reuse",
            true,
            "Helix context parallelism shards the KV history across ranks, so blocks cannot be reused: set it to false",
        );
    }
    let (target_layers, draft_layers) = match (sd.mode, sd.separate_draft_cache) {
        (SpecMode::Mtp, true) => (LayerSet::Target, Some(LayerSet::MtpOnly)),
        (SpecMode::Mtp, false) => (LayerSet::TargetAndMtp, None),
        _ => (LayerSet::Target, None),
    };
    Ok(ResolvedConfig {
        model,
        layout: if use_v2 {
            LayoutKind::V2
        } else {
            LayoutKind::V1
        },
        target_layers,
        draft_layers,
        draft_tokens,
        enable_block_reuse: kv.enable_block_reuse,
        warnings,
        config: c.clone(),
    })
}
