//! The contract between the coordinator and one device, and its host implementation:
//! the step a device runs ([`DeviceBackend`], [`DeviceSetup`], [`DeviceStepReport`]),
//! what verification checks ([`VerifySpec`], [`Mismatch`], [`VerifyLayers`]), where new
//! tokens' KV comes from ([`KvSource`]), and [`HostDevice`]. The actors use this module;
//! the CUDA backend (`crate::cuda`, feature `cuda`) implements it. Nothing here names
//! CUDA: a backend's failures arrive as a [`BackendError`](crate::storage::BackendError).

pub(crate) mod backend;
mod host;
mod kv_source;

pub use backend::{
    BackendFactory, DeviceBackend, DeviceError, DeviceSetup, DeviceStepReport, Mismatch,
    VerifiedLayers, VerifyLayers, VerifySpec,
};
pub use host::HostDevice;
pub use kv_source::{KvPosition, KvSource, SyntheticKv};
