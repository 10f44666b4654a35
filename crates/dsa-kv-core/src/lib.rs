//! dsa-kv-core: the synchronous core of dsa-kv, the paged KV-cache manager for
//! DeepSeek Sparse Attention (DSA) models (DeepSeek-V3.2, GLM-5, GLM-5.2, Mistral Large 3).
//! No async runtime, no CUDA: the `dsa-kv` crate runs this core in its actors.
//!
//! The MLA latent cache and the lightning-indexer K cache share one allocation life
//! cycle: one slot id addresses a block's MLA page and its indexer page in every layer,
//! so reuse, eviction, offload and quota cover both. Data flows one way:
//!
//! [`config`] (model dims) → [`layout`] (pool plan: V1 or V2) → [`core`] (allocation,
//! reuse, eviction, quota) → [`ops`] / [`storage`] (bytes). See `ARCHITECTURE.md` at the
//! workspace root.
//!
//! ```
//! use dsa_kv_core::config::{DsaModel, LayerSet};
//! use dsa_kv_core::core::{quota, KvCacheManager, ManagerOptions, ReuseScope, SeqOptions, TierSlots};
//! use dsa_kv_core::ids::{RequestId, TokenId};
//! use dsa_kv_core::layout::{LayoutKind, PoolPlan};
//!
//! let model = DsaModel::deepseek_v32();
//! let plan = PoolPlan::for_model(&model, LayerSet::Target, LayoutKind::V2, 64)?;
//! assert_eq!(plan.cache_bytes_per_token(), 43_188); // MLA + indexer, 61 layers
//! let slots = quota::slots_for_budget(&plan, 1 << 30) as u32; // a 1 GiB budget
//! let mut kv = KvCacheManager::new(
//!     plan,
//!     TierSlots { gpu: vec![slots], host: vec![] },
//!     ManagerOptions::default(),
//! )?;
//!
//! let prompt: Vec<TokenId> = (0..100).map(TokenId).collect();
//! let mut seq = kv
//!     .create(RequestId(1), ReuseScope::SHARED, &prompt, SeqOptions::default())?
//!     .handle;
//! assert!(kv.resume(&seq)?); // bring (reused) pages to the GPU
//! assert!(kv.resize(&seq, 100, 0)?); // room for the prompt
//! kv.commit(&seq, &prompt)?; // its KV is written: full blocks become reusable
//! kv.close(&mut seq)?;
//!
//! // The next request with the same prefix reuses it (never the last prompt token).
//! assert_eq!(kv.probe_reuse(ReuseScope::SHARED, &prompt)?, 99);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]

pub mod bounded;
pub mod config;
pub mod core;
pub mod ids;
pub mod layout;
pub mod metadata;
pub mod ops;
pub mod rng;
pub mod storage;
pub mod sync;
