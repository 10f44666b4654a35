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
//!     // The model sampled a token for each request that produces one: commit them.
//!     let commit = kv.commit(report.outcomes(|_| TokenId(7))).await?;
//!     if !commit.finished.is_empty() {
//!         break;
//!     }
//! }
//! assert_eq!(steps, 4); // the prompt's step gives the first token, three decodes the rest
//! kv.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! # The layers (each a crate of the workspace, re-exported here)
//!
//! * [`actors`]: the runtime (coordinator, device actors, draft replay) and its handle.
//! * `publish` (feature `zmq`): router events on the vLLM / Dynamo ZMQ wire.
//! * `dsa-kv-device`: [`device`] (the step a device runs, the host device, the forward
//!   boundary, the synthetic writer) and [`transfer`] (KV pages between engines; NIXL
//!   with feature `nixl`).
//! * `dsa-kv-cuda` (feature `cuda`): `cuda`, the CUDA backend and our kernels; the NCCL
//!   transport with feature `nccl`.
//! * `dsa-kv-core`, synchronous, no async runtime, no CUDA: [`config`] (model dims,
//!   engine configuration), [`layout`] (pool plans, V1 or V2), [`core`] (allocation,
//!   reuse, eviction, quota, the scheduler), [`metadata`] (the kernels' step metadata),
//!   [`ops`] (host reference ops), [`storage`] (bytes), [`ids`], [`rng`], [`sync`].
//! * `dsa-kv-model`: the reference DSA model the tests and examples run (not a
//!   dependency of the runtime).
//!
//! Feature `fault-injection` adds the runtime's fault drills. See `ARCHITECTURE.md`.
#![warn(missing_docs)]

pub mod actors;
pub mod prelude;
#[cfg(feature = "zmq")]
pub mod publish;

pub use dsa_kv_core::{config, core, ids, layout, metadata, ops, rng, storage, sync};
#[cfg(feature = "cuda")]
pub use dsa_kv_cuda as cuda;
pub use dsa_kv_device as device;
pub use dsa_kv_device::synthetic;

/// KV pages between engines: [`dsa_kv_device::transfer`], and the NCCL transport of the
/// CUDA backend (feature `nccl`).
pub mod transfer {
    #[cfg(feature = "nccl")]
    pub use dsa_kv_cuda::nccl;
    pub use dsa_kv_device::transfer::*;
}

// The README's Rust examples run as doctests, so they cannot drift from the crate.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;
