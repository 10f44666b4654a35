//! dsa-kv: the paged KV-cache manager for DeepSeek Sparse Attention (DSA) models
//! (DeepSeek-V3.2, GLM-5, GLM-5.2, Mistral Large 3), as an actor runtime a Rust serving
//! framework embeds.
//!
//! The MLA latent cache and the lightning-indexer K cache share one allocation life
//! cycle: one slot id addresses a block's MLA page and its indexer page in every layer,
//! so reuse, eviction, offload and quota cover both.
//!
//! # The runtime
//!
//! An engine builds a [`KvCacheBuilder`](actors::KvCacheBuilder), submits requests and
//! steps: each step schedules a batch, runs it on every device (the framework's model
//! through the [`Forward`](device::Forward) boundary, or the synthetic writer) and
//! returns what ran; the engine commits each request's next token.
//!
//! ```
//! use dsa_kv::prelude::*;
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), RuntimeError> {
//! let mut config = EngineConfig::default(); // DeepSeek-V3.2, FP8 MLA rows and indexer keys
//! config.model.num_layers = Some(2); // a small cache for this example
//! config.kv_cache.max_tokens = Some(4096);
//! let kv = KvCacheBuilder::new().config(config).start().await?; // host backend
//!
//! let prompt: Vec<TokenId> = (0..100).map(TokenId).collect();
//! kv.submit(SubmitRequest::new(RequestId(1), prompt, 4)).await?;
//! let mut steps = 0;
//! loop {
//!     let report = kv.step(Drafts::none()).await?; // plan, run on every device
//!     steps += 1;
//!     // The default forward (the synthetic writer) samples nothing: the engine commits
//!     // a token for each request that produces one. A forward that samples returns
//!     // `Sampling::Sampled` and the runtime commits it (`report.committed`).
//!     let commit = kv.commit(report.outcomes_from(|_| TokenId(7))).await?;
//!     if !commit.finished.is_empty() {
//!         break;
//!     }
//! }
//! assert_eq!(steps, 4); // the prompt's step gives the first token, three decodes the rest
//! kv.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! # What the crate offers
//!
//! * [`actors`]: the runtime (coordinator, device actors, draft replay) and its handle;
//!   the handle module lists its methods by group.
//! * [`prelude`]: the types an engine loop names, in one import.
//! * [`config`]: model dims and the engine configuration (TOML / YAML / JSON).
//! * [`device`]: the forward boundary a framework's model plugs into
//!   ([`Forward`](device::Forward), [`Batch`](device::Batch)), where new tokens' KV
//!   comes from ([`KvSource`](device::KvSource)), verification, the host device.
//! * [`transfer`]: KV pages between engines (prefill/decode disaggregation): the
//!   [`session`](transfer::session) two engines speak to hand a prefix over (bounded
//!   frames, digests, commit or abort), the transport trait, the local transport, NIXL
//!   (feature `nixl`), NCCL (feature `nccl`).
//! * `cuda` (feature `cuda`, on by default): the CUDA backend
//!   (`cuda::CudaDevice::factory`), loaded at run time (a typed error without a GPU).
//! * `publish` (feature `zmq`): router events on the vLLM / Dynamo ZMQ wire.
//! * The vocabulary the runtime's types use: [`core`] (requests, reuse scopes, events,
//!   errors, capacity planning), [`layout`] (pool plans, V1 or V2), [`metadata`] (what
//!   the kernels' step metadata holds), [`ids`].
//!
//! Each layer is a crate of the workspace, and this crate re-exports what an engine needs
//! of it: `dsa-kv-core` (synchronous: the cache manager, scheduler, layouts, metadata,
//! host reference ops; no async runtime, no CUDA), `dsa-kv-device` (the device contract:
//! a new backend implements it there), `dsa-kv-cuda`, and `dsa-kv-model` (the reference
//! DSA model the tests and examples run; not a dependency of the runtime). Feature
//! `testing` adds what tests and self-checks read (the handle's `check_invariants`,
//! `cache_digests`, `bindings`; each layer's internals: the raw allocators and fences in
//! `sync`, `ops`, `storage`, `rng`); feature `fault-injection` the runtime's fault
//! drills. See `ARCHITECTURE.md`.
#![warn(missing_docs)]

pub mod actors;
pub mod prelude;
#[cfg(feature = "zmq")]
pub mod publish;

pub use dsa_kv_core::{config, ids, layout};
#[cfg(feature = "testing")]
pub use dsa_kv_core::{ops, rng, storage, sync};

/// The cache manager's vocabulary as the runtime's types use it: requests and their
/// outcomes ([`scheduler`](crate::core::scheduler)), reuse scopes and keys, KV and router events, errors,
/// capacity planning ([`quota`](crate::core::quota)). The synchronous core itself (the manager, the
/// scheduler) is the `dsa-kv-core` crate; with feature `testing` all of it is here too.
pub mod core {
    pub use dsa_kv_core::core::quota;
    #[cfg(feature = "testing")]
    pub use dsa_kv_core::core::*;
    pub use dsa_kv_core::core::{
        BlockKey, BlockLoc, CachedPage, KvError, KvEvent, Medium, PageLoc, PageStatus, PrefixHash,
        ResetReport, ReuseScope, RouterBlock, RouterEvent, SeqStatus, DEFAULT_PRIORITY,
        MAX_PRIORITY, MIN_PRIORITY,
    };

    /// Requests as the runtime takes them and reports them, and the scheduler's errors
    /// and counters.
    pub mod scheduler {
        #[cfg(feature = "testing")]
        pub use dsa_kv_core::core::scheduler::*;
        pub use dsa_kv_core::core::scheduler::{
            Finished, PlannedRequest, RequestKind, RequestOutcome, SchedError, SchedulerLimits,
            SchedulerStats, SubmitRequest, TransferStats,
        };
    }
}

/// DeepSeek-V4 (hybrid caches: a raw sliding window on every layer, compressed KV and
/// indexer keys on 256-token blocks, compressor state) through the one runtime: the
/// structure ([`V4Spec`](v4::V4Spec), [`V4Preset`](v4::V4Preset)) and plan
/// ([`V4Plan`](v4::V4Plan)) are data; [`KvCacheBuilder::windowed`](actors::KvCacheBuilder::windowed)
/// sizes the pools and builds the [`ModelCache`](core::ModelCache) with its window kind
/// under the same scheduler, coordinator and devices as every model. The host backend's
/// device is [`WindowedHostDevice`](v4::WindowedHostDevice) running the framework's
/// [`Forward`](device::Forward).
///
/// Serving the tiny V4 reference model (`dsa-kv-model`) on one host device:
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use dsa_kv::prelude::*;
/// use dsa_kv::v4::*;
/// use dsa_kv_model::v4::{V4Model, V4ModelConfig, V4ModelForward, V4Outputs};
///
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let model = Arc::new(V4Model::new(V4ModelConfig::tiny(7))?);
/// let outputs = Arc::new(Mutex::new(V4Outputs::default()));
/// let m = model.clone();
/// let backend: WindowedBackendFactory = Arc::new(move |i, setup: &WindowedSetup| {
///     let forward = V4ModelForward::new(m.clone(), outputs.clone());
///     let device = WindowedHostDevice::new(i, &setup.plan, &setup.slots, Box::new(forward))?;
///     Ok(Box::new(device) as Box<dyn DeviceBackend>)
/// });
/// let mut config = EngineConfig::default();
/// config.kv_cache.max_gpu_total_bytes = Some(64 << 20); // every pool of one device
/// config.scheduler.max_num_sequences = 4;
/// config.scheduler.max_num_tokens = 512;
/// config.spec_decode.mode = SpecMode::Mtp; // 3 drafts a step from the MTP layer
/// config.spec_decode.draft_tokens = 3;
/// let kv = KvCacheBuilder::new()
///     .config(config)
///     .windowed(WindowedModel::new(model.config().spec()?, backend))
///     .start()
///     .await?;
///
/// let prompt: Vec<TokenId> = (0..40).map(TokenId).collect();
/// kv.submit(SubmitRequest::new(RequestId(1), prompt, 4)).await?;
/// let waiter = { let kv = kv.clone(); tokio::spawn(async move { kv.wait(RequestId(1)).await }) };
/// while !waiter.is_finished() {
///     kv.step(Drafts::none()).await?; // the forward samples; the runtime commits
/// }
/// let done = waiter.await??;
/// assert_eq!(done.finished.output().len(), 4);
/// kv.shutdown().await;
/// # Ok(())
/// # }
/// ```
pub mod v4 {
    pub use crate::actors::{
        host_windowed_backend, WindowedBackendFactory, WindowedModel, WindowedSetup,
    };
    pub use dsa_kv_core::config::{V4LayerKind, V4Preset, V4Spec};
    pub use dsa_kv_core::core::{ModelCache, TierSlots, WindowKindStats, WindowedSlots};
    pub use dsa_kv_core::layout::{V4Buffer, V4LifeCycle, V4LifeCycleKind, V4PageFormat, V4Plan};
    pub use dsa_kv_device::windowed::{
        PoolBytes, V4Pools, WindowedHostDevice, WindowedView, WritesNothing,
    };
    pub use dsa_kv_device::DeviceBackend;
}

/// What the kernels' step metadata holds, as a forward reads it through
/// [`MetadataView`](device::MetadataView): its dimensions and buffer roles.
pub mod metadata {
    #[cfg(feature = "testing")]
    pub use dsa_kv_core::metadata::*;
    pub use dsa_kv_core::metadata::{
        BufferId, BufferRole, MetadataDims, MetadataError, MetadataLayout, RequestKind,
    };
}

/// The device side an engine sees: the forward boundary ([`forward`](crate::device::forward)), where new tokens'
/// KV comes from, verification, the host device, and the backend factory type. A new
/// backend implements the contract of the `dsa-kv-device` crate (its step hooks); with
/// feature `testing` all of that crate is here.
pub mod device {
    pub use dsa_kv_device::forward;
    pub use dsa_kv_device::forward::{
        Batch, CacheView, Forward, ForwardError, ForwardFactory, ForwardSetup, HostMemory,
        IndexerCacheView, LayerCache, MemKind, MetaBuffer, MetadataView, MlaCacheView, Phase,
        Proposals, Region, RowsView, Sampled, Sampling,
    };
    #[cfg(feature = "testing")]
    pub use dsa_kv_device::*;
    pub use dsa_kv_device::{
        BackendFactory, DeviceBackend, DeviceError, DeviceSetup, DeviceStepReport, HostDevice,
        KvPosition, KvSource, Mismatch, SyntheticKv, Verification, VerifiedLayers, VerifySpec,
    };
}

/// The CUDA backend (feature `cuda`): [`CudaDevice::factory`](cuda::CudaDevice::factory)
/// for the builder, its errors, the GPUs it sees, and the cudarc it is built on. The
/// kernels and buffers behind it are the `dsa-kv-cuda` crate; with feature `testing`
/// all of it is here.
#[cfg(feature = "cuda")]
pub mod cuda {
    #[cfg(feature = "testing")]
    pub use dsa_kv_cuda::*;
    pub use dsa_kv_cuda::{
        cudarc, device_count, driver_present, CudaDevice, CudaError, GpuPoolAlloc,
    };
}

pub mod transfer;

// The README's Rust examples run as doctests, so they cannot drift from the crate.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;
