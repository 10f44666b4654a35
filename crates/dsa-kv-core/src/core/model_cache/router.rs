//! What a router sees of a model with sliding windows. A prefix hit can end only at a
//! block boundary that keeps a window tail, so a block is worth announcing only when a
//! hit can reach it: when a tail is kept at it or at a block below it. [`TailCover`]
//! passes the block manager's [`RouterEvent`]s through that rule: a block is announced
//! (`BlockStored`) when the first tail at or below it is linked, withdrawn
//! (`BlockRemoved`) when the last one goes, and its tier moves are passed on only while
//! it is announced. The announced set stays closed under parents (a tail covers its
//! whole prefix), so a router replays the stream as it does any other, and its overlap
//! score for a prompt is never below the hit the cache gives (it is above only where
//! the prompt leaves the covering tail's path after the last tail on its own).
//! [`ModelCache::router_blocks`](super::ModelCache::router_blocks) computes the same set
//! from the tree and the tails, independently, for resynchronizing and for tests.

use std::collections::HashMap;

use crate::core::reuse_key::BlockKey;
use crate::core::RouterEvent;

/// A block the block manager announced (or one still covered after it left).
#[derive(Debug)]
struct Node {
    parent: Option<u64>,
    /// Its `BlockStored` as the block manager last sent it; `None` once removed.
    stored: Option<RouterEvent>,
    /// Tails at or below it.
    covered: u32,
}

/// The router filter of a windowed model. See the module docs.
#[derive(Debug, Default)]
pub(super) struct TailCover {
    nodes: HashMap<u64, Node>,
    /// Per tail (its block's hash): the blocks it covers, itself first.
    paths: HashMap<u64, Vec<u64>>,
    out: Vec<RouterEvent>,
}

fn medium_of(e: &RouterEvent) -> Option<crate::core::Medium> {
    match e {
        RouterEvent::BlockStored { medium, .. } => Some(*medium),
        _ => None,
    }
}

impl TailCover {
    /// Takes the block manager's events, in order.
    pub(super) fn blocks(&mut self, events: Vec<RouterEvent>) {
        for e in events {
            match &e {
                RouterEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    ..
                } => {
                    for &h in block_hashes {
                        let n = self.nodes.entry(h).or_insert(Node {
                            parent: *parent_block_hash,
                            stored: None,
                            covered: 0,
                        });
                        n.parent = *parent_block_hash;
                        n.stored = Some(e.clone());
                        if n.covered > 0 {
                            self.out.push(e.clone());
                        }
                    }
                }
                RouterEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => {
                    for &h in block_hashes {
                        let Some(n) = self.nodes.get_mut(&h) else {
                            continue;
                        };
                        n.stored = None;
                        if n.covered > 0 {
                            self.out.push(RouterEvent::BlockRemoved {
                                block_hashes: vec![h],
                                medium: *medium,
                            });
                        } else {
                            self.nodes.remove(&h);
                        }
                    }
                }
                RouterEvent::AllBlocksCleared => {
                    self.nodes.clear();
                    self.paths.clear();
                    self.out.push(e);
                }
            }
        }
    }

    /// A tail was linked at `key`'s block: it and every block before it are covered.
    pub(super) fn linked(&mut self, key: &BlockKey) {
        let tail = key.hash64();
        if self.paths.contains_key(&tail) {
            return;
        }
        let mut path = Vec::new();
        let mut newly = Vec::new();
        let mut at = Some(tail);
        while let Some(h) = at {
            let Some(n) = self.nodes.get_mut(&h) else {
                break;
            };
            n.covered += 1;
            path.push(h);
            if n.covered == 1 {
                if let Some(e) = &n.stored {
                    newly.push(e.clone());
                }
            }
            at = n.parent;
        }
        // Parents first.
        self.out.extend(newly.into_iter().rev());
        self.paths.insert(tail, path);
    }

    /// The tail at `key`'s block went: the blocks it alone covered are withdrawn,
    /// children first.
    pub(super) fn dropped(&mut self, key: &BlockKey) {
        let Some(path) = self.paths.remove(&key.hash64()) else {
            return;
        };
        for h in path {
            let Some(n) = self.nodes.get_mut(&h) else {
                continue;
            };
            n.covered = n.covered.saturating_sub(1);
            if n.covered > 0 {
                continue;
            }
            match n.stored.as_ref().and_then(medium_of) {
                Some(medium) => self.out.push(RouterEvent::BlockRemoved {
                    block_hashes: vec![h],
                    medium,
                }),
                None => {
                    self.nodes.remove(&h);
                }
            }
        }
    }

    /// The events for the router since the last call.
    pub(super) fn take(&mut self) -> Vec<RouterEvent> {
        std::mem::take(&mut self.out)
    }
}
