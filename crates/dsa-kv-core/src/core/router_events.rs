//! Router-grade KV events: the vLLM / Dynamo `BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared` payloads a KV-aware router consumes, one event per full block,
//! parents before children, with token ids and a 64-bit block hash. A block's medium
//! (see [`Medium`]) changing is a removal on the old medium and a store on the new one;
//! a parent leaving the GPU takes its descendants' announcements with it (parents first).
//! `RouterView` (feature `testing`) replays them and checks each against what it has seen:
//! the reference consumer that tests hold against
//! [`KvCacheManager::router_blocks`](super::KvCacheManager::router_blocks).

use serde::{Deserialize, Serialize};

use crate::ids::Tier;

/// Where a block's KV lives, in the router's vocabulary (vLLM's `medium`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub enum Medium {
    /// Every page of the block, and of every block before it in its prefix, is in GPU
    /// memory: reusable without a copy.
    #[serde(rename = "GPU")]
    Gpu,
    /// A page of the block or of a block before it is in pinned host memory: reusable
    /// after onboarding. Along any prefix the GPU blocks come first, as tiered routers
    /// (a device index, then host tiers continuing its matches) expect.
    #[serde(rename = "CPU_PINNED")]
    CpuPinned,
}

impl Medium {
    /// The wire name (vLLM's `medium`): `"GPU"` or `"CPU_PINNED"`, as serde writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::CpuPinned => "CPU_PINNED",
        }
    }
}

impl From<Tier> for Medium {
    fn from(t: Tier) -> Self {
        match t {
            Tier::Gpu => Medium::Gpu,
            Tier::Host => Medium::CpuPinned,
        }
    }
}

/// One change to the set of full blocks a router may route on.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum RouterEvent {
    /// A full block became reusable on `medium`.
    BlockStored {
        /// The block's 64-bit hash ([`BlockKey::hash64`](super::BlockKey::hash64)); one
        /// per event.
        block_hashes: Vec<u64>,
        /// The parent block's hash, `None` for the first block of a prefix.
        parent_block_hash: Option<u64>,
        /// The block's token ids (exactly `block_size` of them).
        token_ids: Vec<u32>,
        /// Tokens per block (64 for DSA).
        block_size: u32,
        /// Where the block is.
        medium: Medium,
        /// LoRA adapter id of the block's reuse scope.
        lora_id: Option<u64>,
        /// LoRA adapter name (the crate knows adapters by id only: always `None`).
        lora_name: Option<String>,
    },
    /// A full block is no longer reusable on `medium`.
    BlockRemoved {
        /// The block's hash; one per event.
        block_hashes: Vec<u64>,
        /// Where it was.
        medium: Medium,
    },
    /// Every block on every medium was dropped (`reset_prefix_cache`).
    AllBlocksCleared,
}

/// A full block as a router knows it: its hash and where it is.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub struct RouterBlock {
    /// [`BlockKey::hash64`](super::BlockKey::hash64) of the block's key.
    pub hash: u64,
    /// Where the block is.
    pub medium: Medium,
}

impl Medium {
    /// Every medium.
    pub const ALL: [Medium; 2] = [Medium::Gpu, Medium::CpuPinned];
}
