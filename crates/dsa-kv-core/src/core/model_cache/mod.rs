//! [`ModelCache`]: the caches of one model, composed from attention-type managers over
//! one block manager, one slot budget and one fence clock. The scheduler drives every
//! model family through it; what differs between families is data (which kinds are
//! attached), never another scheduler.
//!
//! * **Full context** (every model): the [`KvCacheManager`] over the blocks of the
//!   full-context life cycles (DeepSeek-V3.2's MLA latent + indexer keys, V4's
//!   compressed caches), with prefix reuse, eviction, tiers and transfers.
//! * **Sliding window** (DeepSeek-V4, [`window`]): the raw window and the compressors'
//!   states in per-request rings ([`WindowCache`]), with a *tail* kept at retained block
//!   boundaries so that a prefix hit can resume there. It hooks into the full-context
//!   kind's life cycle: a hit backs off to the deepest boundary with a tail; a resize
//!   grows both or neither; a commit links a tail at every boundary whose block entered
//!   the prefix tree; a block leaving the tree drops its tail; its sequences cannot be
//!   suspended (the rings live on the GPU only), so the scheduler preempts them by
//!   recompute.
//!
//! The next kinds (pooled indexer keys, recurrent-state snapshots) attach the same way:
//! state per request and per retained boundary, the same hooks.
//!
//! Reads go to the block manager through `Deref`; every change goes through the methods
//! here, which keep the attached kinds in step.

use std::ops::Deref;

use super::error::KvError;
use super::events::KvEvent;
use super::manager::{Created, KvCacheManager, ManagerOptions, SeqHandle, SeqOptions, TierSlots};
use super::reset::ResetReport;
use super::reuse_key::ReuseScope;
use super::window::{WindowCache, WindowStats};
use crate::ids::{Fence, RequestId, SlotId, TokenId};
use crate::layout::V4Plan;

mod by_id;
mod router;
#[cfg(test)]
mod tests;
mod transfer;
pub(super) mod window;

pub use by_id::CacheById;
pub use transfer::PrefixPages;
use window::WindowKind;

/// Slots of a windowed model's life cycles: the blocks' per tier, one count per window
/// life cycle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowedSlots {
    /// The full-context (compressed) life cycle's blocks per tier (host empty: no host
    /// tier).
    pub blocks: TierSlots,
    /// Per window life cycle, in the plan's order.
    pub windows: Vec<u32>,
}

/// Counters of the sliding-window kind.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug, serde::Serialize)]
pub struct WindowKindStats {
    /// Prompts looked up.
    pub lookups: u64,
    /// Prompt tokens looked up.
    pub lookup_tokens: u64,
    /// Tokens served from the cache.
    pub reused_tokens: u64,
    /// Cached blocks not used because no tail was kept at their boundary (summed over
    /// lookups).
    pub backed_off_blocks: u64,
    /// Tails demoted by the retention policy.
    pub tails_demoted: u64,
    /// The rings' and tails' own counters.
    pub windows: WindowStats,
}

/// The caches of one model. See the module docs.
pub struct ModelCache {
    blocks: KvCacheManager,
    window: Option<Box<WindowKind>>,
}

impl From<KvCacheManager> for ModelCache {
    fn from(blocks: KvCacheManager) -> Self {
        ModelCache::new(blocks)
    }
}

impl Deref for ModelCache {
    type Target = KvCacheManager;

    fn deref(&self) -> &KvCacheManager {
        &self.blocks
    }
}

impl ModelCache {
    /// A model whose only kind is the full-context one (DeepSeek-V3.2, GLM-5, Mistral
    /// Large 3).
    pub fn new(blocks: KvCacheManager) -> Self {
        ModelCache {
            blocks,
            window: None,
        }
    }

    /// A model with sliding windows (DeepSeek-V4): the block manager over `plan`'s
    /// compressed life cycle and the windows over its window life cycles. Every
    /// `tail_interval`-th block boundary of a sequence keeps its tail in LRU order (0:
    /// only a prompt's and a closed sequence's last two boundaries do). Partial-block
    /// reuse must be off (a hit ends on a block boundary, where every compression group
    /// is whole); the block manager always records its events (a block leaving the tree
    /// drops its tail), handed on by [`take_events`](Self::take_events) only when
    /// `opts.record_events` asks for them.
    pub fn windowed(
        plan: &V4Plan,
        slots: WindowedSlots,
        opts: ManagerOptions,
        tail_interval: u32,
    ) -> Result<Self, KvError> {
        if opts.enable_partial_reuse {
            return Err(KvError::InvalidOption {
                field: "enable_partial_reuse",
                value: "true".into(),
                why: "a model with sliding windows hits only at whole-block boundaries, where \
                      every compression group is whole: turn partial reuse off",
            });
        }
        let pool_plan = plan
            .compressed_pool_plan()
            .ok_or_else(|| KvError::InvalidOption {
                field: "model",
                value: plan.spec().name.clone(),
                why: "a window-only model has no blocks to manage: at least one layer must \
                      compress",
            })?;
        let record = opts.record_events;
        let block_opts = ManagerOptions {
            record_events: true,
            ..opts
        };
        let blocks = KvCacheManager::new(pool_plan, slots.blocks, block_opts)?;
        let window = WindowKind::new(plan, slots.windows, tail_interval, record)?;
        Ok(ModelCache {
            blocks,
            window: Some(Box::new(window)),
        })
    }

    /// The block manager of the full-context life cycle (read-only; also through
    /// `Deref`).
    pub fn blocks(&self) -> &KvCacheManager {
        &self.blocks
    }

    /// The window cache, when the model has sliding windows.
    pub fn windows(&self) -> Option<&WindowCache> {
        self.window.as_deref().map(WindowKind::cache)
    }

    /// The block manager's counters ([`KvCacheManager::stats`]); with sliding windows the
    /// prefix lookups and the tokens reused are the window kind's (a hit stops at the
    /// deepest boundary with a tail, so the block manager is offered only the hit).
    #[inline]
    pub fn stats(&self) -> super::ManagerStats {
        let mut m = self.blocks.stats();
        if let Some(w) = self.window.as_deref() {
            let k = w.stats();
            m.lookup_tokens = k.lookup_tokens;
            m.reused_tokens = k.reused_tokens;
        }
        m
    }

    /// The sliding-window kind's counters, when the model has one.
    #[inline]
    pub fn window_stats(&self) -> Option<WindowKindStats> {
        self.window.as_deref().map(WindowKind::stats)
    }

    /// Whether a sequence may be suspended (its pages kept, offloaded to the host tier
    /// and brought back). Not with sliding windows: preempt by recompute instead.
    pub fn can_suspend(&self) -> bool {
        self.window.is_none()
    }

    /// Creates a sequence for `prompt` (see [`KvCacheManager::create`]); with sliding
    /// windows the hit is the deepest cached block boundary that keeps a tail, and the
    /// sequence's rings open there.
    pub fn create(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        prompt: &[TokenId],
        opts: SeqOptions,
    ) -> Result<Created, KvError> {
        match self.window.as_deref_mut() {
            None => self.blocks.create(id, scope, prompt, opts),
            Some(w) => w.create(&mut self.blocks, id, scope, prompt, opts),
        }
    }

    /// Brings a suspended sequence's blocks to the GPU (`Ok(false)`, nothing changed,
    /// when they do not fit).
    #[inline]
    pub fn resume(&mut self, h: &SeqHandle) -> Result<bool, KvError> {
        let ok = self.blocks.resume(h)?;
        self.sync();
        Ok(ok)
    }

    /// Suspends a sequence; refused with sliding windows ([`KvError::NoSuspend`]).
    pub fn suspend(&mut self, h: &SeqHandle) -> Result<(), KvError> {
        if self.window.is_some() {
            return Err(KvError::NoSuspend { id: h.id() });
        }
        self.blocks.suspend(h)
    }

    /// Sets capacity and history (see [`KvCacheManager::resize`]); with sliding windows
    /// both kinds grow or neither changes (`Ok(false)`).
    #[inline]
    pub fn resize(&mut self, h: &SeqHandle, capacity: u64, history: u64) -> Result<bool, KvError> {
        match self.window.as_deref_mut() {
            None => self.blocks.resize(h, capacity, history),
            Some(w) => w.resize(&mut self.blocks, h, capacity, history),
        }
    }

    /// Commits `tokens` (their rows are written): whole blocks enter the prefix tree;
    /// with sliding windows a tail is linked at every block boundary crossed whose block
    /// did, and the rings free what lies behind them.
    #[inline]
    pub fn commit(&mut self, h: &SeqHandle, tokens: &[TokenId]) -> Result<(), KvError> {
        match self.window.as_deref_mut() {
            None => self.blocks.commit(h, tokens),
            Some(w) => w.commit(&mut self.blocks, h, tokens),
        }
    }

    /// Ends a speculative step: commits the verified tokens and gives back the
    /// positions of the rejected drafts (see [`KvCacheManager::accept_tokens`]).
    #[inline]
    pub fn accept_tokens(&mut self, h: &SeqHandle, accepted: &[TokenId]) -> Result<(), KvError> {
        if self.window.is_none() {
            return self.blocks.accept_tokens(h, accepted);
        }
        self.commit(h, accepted)?;
        let history = self.blocks.info_of(h)?.history;
        let shrunk = self.resize(h, history, history)?;
        debug_assert!(shrunk, "shrinking never needs room");
        Ok(())
    }

    /// Closes the sequence: its blocks stay in the prefix tree; with sliding windows the
    /// tails the retention policy keeps stay and every other window page is freed.
    pub fn close(&mut self, h: &mut SeqHandle) -> Result<(), KvError> {
        match self.window.as_deref_mut() {
            None => self.blocks.close(h),
            Some(w) => w.close(&mut self.blocks, h),
        }
    }

    /// Request `id`'s window page tables (per window life cycle: the first position held
    /// and the slots), written into `out` (emptied first; left empty without windows).
    #[inline]
    pub fn window_tables_into(
        &self,
        id: RequestId,
        out: &mut Vec<(u64, Vec<SlotId>)>,
    ) -> Result<(), KvError> {
        out.clear();
        match self.window.as_deref() {
            None => Ok(()),
            Some(w) => w.tables_into(id, out),
        }
    }

    /// The KV events since the last call (the block manager's, in order).
    #[inline]
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        match self.window.as_deref_mut() {
            None => self.blocks.take_events(),
            Some(w) => w.take_events(&mut self.blocks),
        }
    }

    /// Empties the prefix tree (see [`KvCacheManager::reset_prefix_cache`]) and drops
    /// every tail.
    pub fn reset_prefix_cache(&mut self) -> Result<ResetReport, KvError> {
        let r = self.blocks.reset_prefix_cache()?;
        self.sync();
        Ok(r)
    }

    /// Prompt tokens [`create`](Self::create) would serve from the cache now (with
    /// sliding windows: up to the deepest cached boundary that keeps a tail); holds
    /// nothing.
    pub fn probe_reuse(&mut self, scope: ReuseScope, prompt: &[TokenId]) -> Result<u64, KvError> {
        let cached = self.blocks.probe_reuse(scope, prompt)?;
        let Some(w) = self.window.as_deref() else {
            return Ok(cached);
        };
        let t = w.block_tokens();
        let keys = self
            .blocks
            .block_keys(scope, &prompt[..(cached / t * t) as usize]);
        Ok(w.deepest_tail(&keys) as u64 * t)
    }

    /// The block manager for what reads through `&mut` (the kept block-table rows'
    /// marks) and changes nothing an attached kind follows.
    #[inline]
    pub(crate) fn blocks_for_rows(&mut self) -> &mut KvCacheManager {
        &mut self.blocks
    }

    /// The chained reuse keys of `tokens`' whole blocks under `scope` (see
    /// [`KvCacheManager::block_keys`]).
    pub fn block_keys(&mut self, scope: ReuseScope, tokens: &[TokenId]) -> Vec<super::BlockKey> {
        self.blocks.block_keys(scope, tokens)
    }

    /// Closes sequences whose handles were dropped without a close.
    pub fn close_dropped(&mut self) -> usize {
        let n = self.blocks.close_dropped();
        self.sync();
        n
    }

    /// Issues the fence of a step about to run.
    #[inline]
    pub fn issue_fence(&mut self) -> Fence {
        self.blocks.issue_fence()
    }

    /// Marks every step up to `f` finished.
    #[inline]
    pub fn complete_fences(&mut self, f: Fence) -> Result<(), KvError> {
        self.blocks.complete_fences(f)
    }

    /// Copy plans decided since the last call (see [`KvCacheManager::take_copy_plans`]).
    #[inline]
    pub fn take_copy_plans(&mut self) -> Vec<crate::ops::CopyPlan> {
        self.blocks.take_copy_plans()
    }

    /// Router events since the last call (see [`KvCacheManager::take_router_events`]);
    /// with sliding windows only for the blocks a hit can reach, those with a tail at
    /// or below them (see the `router` module).
    #[inline]
    pub fn take_router_events(&mut self) -> Vec<super::RouterEvent> {
        match self.window.as_deref_mut() {
            None => self.blocks.take_router_events(),
            Some(w) => w.take_router_events(&mut self.blocks),
        }
    }

    /// Turns the recording of router events on or off.
    pub fn set_record_router_events(&mut self, on: bool) {
        match self.window.as_deref_mut() {
            None => self.blocks.set_record_router_events(on),
            Some(w) => w.set_record_router_events(&mut self.blocks, on),
        }
    }

    /// The blocks a router holds after replaying every router event (see
    /// [`KvCacheManager::router_blocks`]); with sliding windows those with a tail at or
    /// below them, computed from the tree and the tails.
    pub fn router_blocks(&self) -> Vec<super::RouterBlock> {
        match self.window.as_deref() {
            None => self.blocks.router_blocks(),
            Some(w) => w.router_blocks(&self.blocks),
        }
    }

    /// Fault drills: see [`KvCacheManager::inject_room_failures`].
    pub fn inject_room_failures(&mut self, seed: u64, percent: u8) {
        self.blocks.inject_room_failures(seed, percent);
    }

    /// The block manager, writable, for what the attached kinds need not follow: moving
    /// whole blocks between engines without windows. Refused with windows
    /// ([`KvError::Transfer`]: their tails must move with the blocks; see
    /// [`export_prefix`](Self::export_prefix)).
    pub(crate) fn blocks_for_transfer(
        &mut self,
        id: RequestId,
    ) -> Result<&mut KvCacheManager, KvError> {
        if self.window.is_some() {
            return Err(KvError::Transfer {
                id,
                why: "a model with sliding windows moves its blocks with their window tails: \
                      use the scheduler's export_prefix / begin_prefix_import / \
                      commit_prefix_import"
                    .into(),
            });
        }
        Ok(&mut self.blocks)
    }

    /// Passes the block manager's removals on to the attached kinds.
    #[inline]
    fn sync(&mut self) {
        if let Some(w) = self.window.as_deref_mut() {
            w.sync(&mut self.blocks);
        }
    }

    /// Checks every invariant of every kind (tests; panics with the broken rule).
    pub fn check_invariants(&self) {
        self.blocks.check_invariants();
        if let Some(w) = self.window.as_deref() {
            w.check_invariants(&self.blocks);
        }
    }
}
