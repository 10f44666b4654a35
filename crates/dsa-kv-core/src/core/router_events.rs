//! Router-grade KV events: the vLLM / Dynamo `BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared` payloads a KV-aware router consumes, one event per full block,
//! parents before children, with token ids and a 64-bit block hash. A block's medium
//! (see [`Medium`]) changing is a removal on the old medium and a store on the new one;
//! a parent leaving the GPU takes its descendants' announcements with it (parents first).
//! [`RouterView`] replays them and checks each against what it has seen: the reference
//! consumer that tests hold against [`KvCacheManager::router_blocks`](super::KvCacheManager::router_blocks).

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use thiserror::Error;

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

/// An event that does not follow from the events before it.
#[derive(Clone, PartialEq, Eq, Debug, Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// A store of a block already stored on that medium.
    #[error("block {hash:#018x} stored twice on {medium:?}")]
    DuplicateStore {
        /// The block.
        hash: u64,
        /// The medium.
        medium: Medium,
    },
    /// A store whose parent is on no medium: a parent must be stored before its children.
    #[error("block {hash:#018x} stored before its parent {parent:#018x}")]
    UnknownParent {
        /// The block.
        hash: u64,
        /// Its parent.
        parent: u64,
    },
    /// A removal of a block not stored on that medium.
    #[error("block {hash:#018x} removed from {medium:?} where it is not stored")]
    UnknownRemove {
        /// The block.
        hash: u64,
        /// The medium.
        medium: Medium,
    },
    /// A malformed event (not one hash, token count not the block size).
    #[error("malformed event: {0}")]
    Malformed(String),
}

/// What a router learns from [`RouterEvent`]s: the set of (block, medium). Applies each
/// event after checking it is consistent with the events before it.
#[derive(Clone, Debug, Default)]
pub struct RouterView {
    blocks: HashSet<RouterBlock>,
}

impl RouterView {
    /// A view of the given blocks (a snapshot to resynchronize from).
    pub fn from_blocks(blocks: impl IntoIterator<Item = RouterBlock>) -> Self {
        RouterView {
            blocks: blocks.into_iter().collect(),
        }
    }

    /// Applies one event.
    pub fn apply(&mut self, e: &RouterEvent) -> Result<(), ReplayError> {
        match e {
            RouterEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                ..
            } => {
                let &[hash] = block_hashes.as_slice() else {
                    return Err(ReplayError::Malformed(format!(
                        "{} hashes in one BlockStored",
                        block_hashes.len()
                    )));
                };
                if token_ids.len() != *block_size as usize {
                    return Err(ReplayError::Malformed(format!(
                        "{} token ids for block size {block_size}",
                        token_ids.len()
                    )));
                }
                if let Some(parent) = *parent_block_hash {
                    if !self.contains(parent) {
                        return Err(ReplayError::UnknownParent { hash, parent });
                    }
                }
                let b = RouterBlock {
                    hash,
                    medium: *medium,
                };
                if !self.blocks.insert(b) {
                    return Err(ReplayError::DuplicateStore {
                        hash,
                        medium: *medium,
                    });
                }
            }
            RouterEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                for &hash in block_hashes {
                    let b = RouterBlock {
                        hash,
                        medium: *medium,
                    };
                    if !self.blocks.remove(&b) {
                        return Err(ReplayError::UnknownRemove {
                            hash,
                            medium: *medium,
                        });
                    }
                }
            }
            RouterEvent::AllBlocksCleared => {
                self.blocks.clear();
            }
        }
        Ok(())
    }

    /// Whether the block is stored on any medium.
    pub fn contains(&self, hash: u64) -> bool {
        Medium::ALL
            .iter()
            .any(|&medium| self.blocks.contains(&RouterBlock { hash, medium }))
    }

    /// The blocks the view holds, sorted.
    pub fn blocks(&self) -> Vec<RouterBlock> {
        let mut v: Vec<RouterBlock> = self.blocks.iter().copied().collect();
        v.sort_unstable();
        v
    }
}

impl Medium {
    /// Every medium.
    pub const ALL: [Medium; 2] = [Medium::Gpu, Medium::CpuPinned];
}
