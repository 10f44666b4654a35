//! Configuration: model dimensions ([`DsaModel`]) and the engine settings users set in
//! code or in a TOML/JSON file ([`EngineConfig`]), with the V1/V2 selection and the
//! validation rules of brief §3 ([`EngineConfig::resolve`]).

mod engine;
mod model;

pub use engine::{
    star_cached_tokens, ConfigError, CpMode, EngineConfig, KvCacheConfig, LayoutKind, ModelConfig,
    ParallelConfig, ResolvedConfig, SchedulerConfig, SpecDecodeConfig, SpecMode, V2Choice,
    DSA_TOKENS_PER_BLOCK,
};
pub use model::{
    ComponentBytes, DsaModel, DsaModelSpec, IndexerDtype, IndexerLayers, KvDtype, LayerKind,
    LayerSet, ModelError, ModelPreset,
};

#[cfg(test)]
mod tests;
