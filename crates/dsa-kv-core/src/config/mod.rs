//! Configuration: model dimensions ([`DsaModel`]) and the engine settings users set in
//! code or in a TOML/JSON/YAML file ([`EngineConfig`]). [`EngineConfig::resolve`] selects
//! the layout and checks every rule up front:
//!
//! * `use_kv_cache_manager_v2 = "auto"` takes the model default (the DSA presets default
//!   to V2; no default means V1); an explicit `true` / `false` wins.
//! * V2 with a sparse (DSA) model and any of beam width > 1, a KV connector or STAR
//!   context parallelism is one [`ConfigError::Unsupported`] listing all of them and the
//!   way out (another CP mode, or V1); a dense model in the same situation falls back to
//!   V1 with a warning.
//! * V1 + STAR works: context tokens are cached on every CP rank, query tokens only on
//!   the last ([`star_cached_tokens`]).
//! * Helix works without block reuse; on inactive ranks a step adds no tokens.
//! * Unknown fields and bad values are errors naming the field.

mod engine;
pub mod file;
mod model;
mod v4;

pub use engine::{
    limits, star_cached_tokens, ConfigError, CpMode, EngineConfig, KvCacheConfig, LayoutKind,
    ModelConfig, ParallelConfig, ResolvedConfig, SchedulerConfig, SpecDecodeConfig, SpecMode,
    TransferConfig, V2Choice, DSA_TOKENS_PER_BLOCK,
};
pub use model::{
    ComponentBytes, DsaModel, DsaModelSpec, IndexerDtype, IndexerLayers, KvDtype, LayerKind,
    LayerSet, ModelError, ModelPreset,
};
pub use v4::{
    V4Error, V4LayerKind, V4Preset, V4Spec, MAX_MTP_INPUT_WIDTH, V4_BLOCK_TOKENS,
    V4_WINDOW_PAGE_TOKENS,
};

#[cfg(test)]
mod tests;
