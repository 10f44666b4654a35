//! The reference consumer of [`RouterEvent`]s (feature `testing`): a router's view,
//! replayed event by event, each checked against the events before it. Tests hold it
//! against [`KvCacheManager::router_blocks`](super::KvCacheManager::router_blocks).

use std::collections::HashSet;

use thiserror::Error;

use super::router_events::{Medium, RouterBlock, RouterEvent};

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
