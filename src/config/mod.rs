//! Configuration: model dimensions ([`DsaModel`]) and, in later modules, the cache
//! manager settings users set in code or in a file.

mod model;

pub use model::{
    ComponentBytes, DsaModel, DsaModelSpec, IndexerDtype, IndexerLayers, KvDtype, LayerKind,
    LayerSet, ModelError, ModelPreset,
};
