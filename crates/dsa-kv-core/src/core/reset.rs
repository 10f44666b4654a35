//! Resetting the prefix cache: after a weight update every cached block holds KV of the
//! old weights, so serving frameworks (vLLM's and SGLang's `reset_prefix_cache`) drop the
//! whole reuse tree. Refused, changing nothing, while any sequence holds pages; otherwise
//! every tree page on every tier is freed (behind the fences of work already issued, as
//! any freed slot) and routers get one [`KvEvent::AllBlocksCleared`].

use serde::Serialize;

use super::error::KvError;
use super::events::KvEvent;
use super::manager::KvCacheManager;
use super::router_events::RouterEvent;
use crate::ids::Tier;

/// What [`KvCacheManager::reset_prefix_cache`] dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ResetReport {
    /// Blocks removed from the reuse tree.
    pub blocks: u64,
    /// Pages freed on the GPU tier (one slot each).
    pub gpu_pages: u64,
    /// Pages freed on the host tier (one slot each).
    pub host_pages: u64,
}

impl KvCacheManager {
    /// Live sequences (active or suspended) holding at least one page.
    pub fn sequences_holding_pages(&self) -> usize {
        self.seqs
            .iter()
            .flatten()
            .filter(|s| !s.pages.is_empty())
            .count()
    }

    /// Drops every cached block: the reuse tree is emptied (scope roots included), every
    /// tree page on the GPU and the host tier is freed, and one
    /// [`KvEvent::AllBlocksCleared`] is recorded (no `Removed` per block). A cache that is
    /// already empty resets to the same state and records the event again, so a router
    /// that missed the first one still converges.
    ///
    /// Sequences whose handles were dropped are closed first (see
    /// [`SeqHandle`](super::SeqHandle)). Then, while any live sequence holds pages, the
    /// call is refused with [`KvError::PrefixCacheInUse`] and nothing changes. Sequences
    /// holding no page (created without reuse and not grown yet) may stay open: their
    /// later blocks start a new tree.
    ///
    /// Freed slots carry the fence of the work issued so far, so a copy plan not yet run
    /// (an offload decided before the reset) finishes before a new owner writes them.
    pub fn reset_prefix_cache(&mut self) -> Result<ResetReport, KvError> {
        self.reap_dropped();
        let sequences = self.sequences_holding_pages();
        if sequences > 0 {
            return Err(KvError::PrefixCacheInUse { sequences });
        }
        let mut removed = Vec::new();
        self.tree.clear(&mut removed);
        let mut report = ResetReport {
            blocks: removed.len() as u64,
            ..ResetReport::default()
        };
        for r in removed {
            for pid in r.pages {
                // No sequence refers to a page, so every live page is a droppable tree
                // page, queued for eviction on its tier.
                match self.pages[pid].tier {
                    Tier::Gpu => report.gpu_pages += 1,
                    Tier::Host => report.host_pages += 1,
                }
                self.pages[pid].node = None;
                self.free_page(pid);
            }
        }
        debug_assert_eq!(self.pages.num_live(), 0, "every page was a tree page");
        if self.opts.record_events {
            self.events.push(KvEvent::AllBlocksCleared);
        }
        if self.record_router_events {
            self.router_events.push(RouterEvent::AllBlocksCleared);
        }
        self.debug_check();
        Ok(report)
    }
}
