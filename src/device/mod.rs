//! The contract between the coordinator and one device, and its host implementation:
//! the step a device runs ([`DeviceBackend`], [`DeviceSetup`], [`DeviceStepReport`]),
//! what verification checks ([`VerifySpec`], [`Mismatch`], [`Verification`]), the forward
//! boundary a framework's model plugs into ([`Forward`], [`Batch`]: the [`forward`] module), where new
//! tokens' KV comes from ([`KvSource`]), and [`HostDevice`]. The actors use this module;
//! the CUDA backend (`crate::cuda`, feature `cuda`) implements it. Nothing here names the
//! crate's CUDA backend: a backend's failures arrive as a
//! [`BackendError`](crate::storage::BackendError), its device handle as a
//! [`ForwardSetup::extension`]; only the batch's stream is a cudarc type (feature `cuda`).

pub(crate) mod backend;
pub mod forward;
mod host;
mod kv_source;

pub use backend::{
    BackendFactory, DeviceBackend, DeviceError, DeviceSetup, DeviceStepReport, Mismatch,
    Verification, VerifiedLayers, VerifySpec,
};
pub use forward::{
    Batch, CacheView, Forward, ForwardError, ForwardFactory, ForwardSetup, HostMemory,
    IndexerCacheView, LayerCache, MemoryKind, MetaBuffer, MetadataView, MlaCacheView, Phase,
    Region, RowsView,
};
pub use host::HostDevice;
pub use kv_source::{KvPosition, KvSource, SyntheticKv};
