//! The contract between the coordinator and one device, and its host implementation:
//! the step a device runs ([`DeviceBackend`], [`DeviceSetup`], [`DeviceStepReport`]),
//! what verification checks ([`VerifySpec`], [`Mismatch`], [`Verification`]), the forward
//! boundary a framework's model plugs into ([`Forward`], [`Batch`]: the [`forward`] module), where new
//! tokens' KV comes from ([`KvSource`]), [`HostDevice`], the synthetic writer of the host
//! ([`synthetic`]) and KV transfer between engines ([`transfer`]). The `dsa-kv` actors use
//! this crate; `dsa-kv-cuda` implements it on a GPU. Nothing here names the CUDA
//! backend: a backend's failures arrive as a
//! [`BackendError`](dsa_kv_core::storage::BackendError), its device handle as a
//! [`ForwardSetup::extension`]; only the batch's stream is a cudarc type (feature `cuda`).

pub mod backend;
pub mod forward;
mod host;
mod kv_source;
mod step;
pub mod sync_loop;
pub mod synthetic;
pub mod transfer;
pub mod windowed;

pub use backend::{
    BackendFactory, DeviceBackend, DeviceError, DeviceSetup, DeviceStepReport, Mismatch,
    Verification, VerifiedLayers, VerifySpec,
};
pub use forward::{
    Batch, CacheView, Forward, ForwardError, ForwardFactory, ForwardSetup, HostMemory,
    IndexerCacheView, LayerCache, MemKind, MetaBuffer, MetadataView, MlaCacheView, Phase,
    Proposals, Region, RowsView, Sampled, Sampling,
};
pub use host::HostDevice;
pub use kv_source::{KvPosition, KvSource, SyntheticKv};
pub use step::StepHooks;
