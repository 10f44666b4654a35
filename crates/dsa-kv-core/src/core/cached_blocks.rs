//! A read-only view of the reuse tree's pages and their tiers: the state that
//! [`KvEvent`](super::KvEvent)s describe, so a consumer of the events (a router, a test)
//! can check its mirror against the truth.

use std::collections::HashMap;

use serde::Serialize;

use super::manager::KvCacheManager;
use super::radix::NodeRef;
use super::reuse_key::BlockKey;
use super::router_events::{Medium, RouterBlock};
use crate::ids::{LifeCycleId, Tier};

/// One life cycle's page of a block in the reuse tree.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug, Serialize)]
pub struct CachedPage {
    /// The block's chained key.
    pub key: BlockKey,
    /// The parent block's key (`None` for the first block under a scope root).
    pub parent: Option<BlockKey>,
    /// The life cycle the page belongs to.
    pub life_cycle: LifeCycleId,
    /// Where the page is now.
    pub tier: Tier,
}

impl KvCacheManager {
    /// Every page of every block in the reuse tree, sorted by (key, life cycle).
    /// O(blocks × life cycles) and allocating: meant for tests and diagnostics, not for
    /// the step path.
    pub fn cached_blocks(&self) -> Vec<CachedPage> {
        let mut out: Vec<CachedPage> = self
            .tree
            .blocks()
            .flat_map(|(r, node)| {
                let parent = self.tree.parent_block_key(r);
                node.pages
                    .iter()
                    .enumerate()
                    .map(move |(lc, &pid)| CachedPage {
                        key: node.key,
                        parent,
                        life_cycle: LifeCycleId(lc as u16),
                        tier: self.pages[pid].tier,
                    })
            })
            .collect();
        out.sort_unstable();
        out
    }
}

impl KvCacheManager {
    /// Every full block of the reuse tree as a router sees it (hash and medium, see
    /// [`RouterEvent`](super::RouterEvent)), sorted: what replaying
    /// [`take_router_events`](Self::take_router_events) from the start gives.
    /// Allocating; for resynchronizing a router and for tests.
    pub fn router_blocks(&self) -> Vec<RouterBlock> {
        // Computed from the pages, top down, independently of the media the events
        // announced (which the invariant checks hold against this).
        let mut on_gpu: HashMap<NodeRef, bool> = HashMap::new();
        let mut out = Vec::new();
        for r in self.tree.blocks_top_down() {
            let parent_on_gpu = self.tree.parent_block(r).is_none_or(|p| on_gpu[&p]);
            let gpu = parent_on_gpu && self.pages_on_gpu(r);
            on_gpu.insert(r, gpu);
            if self.tree.node(r).tokens.len() == self.tpb as usize {
                out.push(RouterBlock {
                    hash: self.tree.node(r).key.hash64(),
                    medium: if gpu { Medium::Gpu } else { Medium::CpuPinned },
                });
            }
        }
        out.sort_unstable();
        out
    }
}
