//! The CUDA backend: per-device contexts and streams, our kernels (`kernels/*.cu`,
//! compiled by NVRTC for `sm_90a` when a device is opened), VMM pools with a fixed base
//! address, a pinned host tier, and [`CudaDevice`], the [`DeviceBackend`] that runs steps
//! on a GPU with the same contract as [`HostDevice`].
//!
//! Every entry point first checks that the CUDA driver library can be loaded and returns
//! [`CudaError::NoDevice`] when it cannot (CI machines, laptops): nothing here panics
//! for want of a GPU.
//!
//! * [`Gpu`]: one device: context, a compute and a copy stream, the compiled kernels,
//!   raw device buffers ([`DeviceBuffer`]) and host↔device copies.
//! * [`kernels`]: launch wrappers with launch geometry chosen for bandwidth.
//! * [`VmmPool`]: reserve the address range once, map 2 MiB-granular physical chunks,
//!   grow and shrink without moving the base; peer access per device.
//! * [`PinnedHost`]: page-locked, CPU-readable (not write-combined), device-mapped host
//!   memory: the offload tier and read-back staging.
//! * [`CudaStorage`]: a [`KvStorage`] over VMM pools and pinned host pools; copy plans
//!   run as batched-copy kernels on the copy stream, ordered against the compute stream
//!   with events.
//! * [`CudaSyntheticWriter`]: the synthetic writer on a GPU (what `CudaDevice` runs when
//!   no model is plugged in).
//! * [`v4`]: DeepSeek-V4's cache kernels (MODEL1 quantize-and-scatter and gather, the
//!   compressor-state scatter) and their host twins.
//! * `nccl` (feature `nccl`): the NCCL transport of KV pages between engines.
//!
//! [`DeviceBackend`]: dsa_kv_device::DeviceBackend
//! [`HostDevice`]: dsa_kv_device::HostDevice
//! [`KvStorage`]: dsa_kv_core::storage::KvStorage

// Every unsafe operation sits in its own `unsafe` block with its reason, inside `unsafe fn`
// too (the kernel launches through `launch!` among them).
#![deny(unsafe_op_in_unsafe_fn)]

mod buffers;
#[cfg(feature = "nccl")]
mod control;
mod device;
mod gpu;
pub(crate) mod guard;
pub mod kernels;
mod metadata;
#[cfg(feature = "nccl")]
pub mod nccl;
mod storage;
mod synthetic;
pub mod v4;
mod vmm;

#[cfg(test)]
mod tests;

/// The cudarc this backend is built on (a framework's kernels use its types: the
/// batch's stream is a `cudarc::driver::CudaStream`).
pub use cudarc;

pub use buffers::{DeviceBuffer, PinnedHost, Plain};
pub use device::CudaDevice;
pub(crate) use gpu::check;
pub use gpu::{
    compile, compile_kernels, device_count, driver_error, driver_present, CudaError, Gpu, ARCH,
    KERNEL_SOURCES,
};
pub use kernels::Kernels;
pub use metadata::DeviceMetadata;
pub use storage::{CudaStorage, GpuPoolAlloc};
pub use synthetic::CudaSyntheticWriter;
pub use vmm::VmmPool;
