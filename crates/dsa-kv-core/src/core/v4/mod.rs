//! DeepSeek-V4's cache manager: the block manager ([`KvCacheManager`]) over the
//! compressed life cycle (256-token blocks of compressed KV and indexer keys: allocated,
//! reused, evicted and offloaded as the MLA blocks of the other models), and the
//! [`WindowCache`] over the raw window and the compressor states, kept in step:
//!
//! * **Create.** A prompt is served from the deepest cached block boundary that still has
//!   a window tail (a hit without one would need the window recomputed, which is not
//!   bit-exact); the back-off is counted (`V4Stats::backed_off_blocks`).
//! * **Resize** grows (or shrinks) both; when either has no room, neither changes (the
//!   windows are asked first, read-only: the block manager's evictions cannot be undone).
//! * **Commit** checks what the windows would refuse, commits the tokens to the blocks,
//!   links a tail at every block boundary crossed whose block entered the prefix tree,
//!   then lets the windows free what lies behind them.
//! * **Retention** ([`V4Options::tail_interval`]): the tails at the last two boundaries of
//!   a prompt (where the same prompt, resent with or without MTP, resumes) and every
//!   `tail_interval`-th boundary stay in the LRU order of use; the others are *demoted*
//!   (first to go when the windows need room) once the sequence is two blocks past them.
//!   At close, the sequence's last two boundaries keep their tails (where its next turn
//!   resumes).
//! * **Eviction.** A block leaving the prefix tree drops its tail (the manager's
//!   `Removed` / `AllBlocksCleared` events, which are passed on through
//!   [`take_events`](V4CacheManager::take_events)).
//! * **Preemption** is by recompute: a V4 sequence cannot be suspended (its windows live
//!   on the GPU only); close it and create it again.

use std::collections::HashMap;

use super::error::KvError;
use super::events::KvEvent;
use super::manager::{KvCacheManager, ManagerOptions, SeqHandle, SeqOptions, TierSlots};
use super::reuse_key::{BlockKey, KeyHasher, ReuseScope};
use super::window::{WindowCache, WindowError, WindowSpec, WindowStats};
use crate::ids::{Fence, LifeCycleId, RequestId, SlotId, TokenId};
use crate::layout::V4Plan;

pub(super) mod scheduler;
#[cfg(test)]
mod tests;
pub(super) mod transfer;

/// The V4 manager's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct V4Options {
    /// The block manager's (partial reuse must be off: V4 hits end on block boundaries).
    pub blocks: ManagerOptions,
    /// Every `tail_interval`-th block boundary of a sequence keeps its tail in LRU order
    /// (0: only a prompt's and a closed sequence's last two boundaries do).
    pub tail_interval: u32,
}

impl Default for V4Options {
    fn default() -> Self {
        V4Options {
            blocks: ManagerOptions {
                enable_partial_reuse: false,
                ..ManagerOptions::default()
            },
            tail_interval: 16,
        }
    }
}

/// Slots of every life cycle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct V4Slots {
    /// The compressed life cycle's blocks per tier (host empty: no host tier).
    pub blocks: TierSlots,
    /// Per window life cycle, in [`V4Plan`] order.
    pub windows: Vec<u32>,
}

/// What the V4 manager refuses.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum V4Error {
    /// From the block manager.
    #[error(transparent)]
    Blocks(#[from] KvError),
    /// From the window cache.
    #[error(transparent)]
    Windows(#[from] WindowError),
    /// A plan without compressed layers (window-only models are not supported).
    #[error("{model} has no compressed layer: a window-only model has no blocks to manage")]
    NoBlocks {
        /// The model.
        model: String,
    },
    /// Partial-block reuse asked for.
    #[error(
        "enable_partial_reuse must be off for DeepSeek-V4: a hit must end on a 256-token \
         boundary, where every compression group is whole"
    )]
    PartialReuse,
    /// An empty prompt.
    #[error("request {id}: the prompt is empty")]
    EmptyPrompt {
        /// The request.
        id: RequestId,
    },
    /// A suspend asked for.
    #[error(
        "request {id}: a DeepSeek-V4 sequence cannot be suspended (its windows live on the \
         GPU only); preempt it by recompute: close it and create it again"
    )]
    NoSuspend {
        /// The request.
        id: RequestId,
    },
}

/// Counters.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub struct V4Stats {
    /// Prompts looked up.
    pub lookups: u64,
    /// Tokens served from the cache.
    pub reused_tokens: u64,
    /// Cached blocks not used because no tail was kept at their boundary (summed over
    /// lookups).
    pub backed_off_blocks: u64,
    /// Tails demoted by the retention policy.
    pub tails_demoted: u64,
}

/// A sequence: its block-manager handle and what the retention policy needs.
#[derive(Debug)]
struct V4Seq {
    handle: SeqHandle,
    /// The key of the last committed whole block (the scope's root before any).
    last_key: BlockKey,
    /// Committed tokens.
    committed: u64,
    /// The prompt's length.
    prompt_len: u64,
    /// Boundaries this sequence linked or met and has not yet demoted, oldest first.
    recent: Vec<(u64, BlockKey)>,
}

/// The result of [`V4CacheManager::create`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct V4Created {
    /// Prompt tokens served from the cache (a multiple of 256).
    pub reused_tokens: u64,
    /// Cached blocks skipped because they had no tail.
    pub backed_off_blocks: u64,
}

/// DeepSeek-V4's cache manager.
pub struct V4CacheManager {
    plan: V4Plan,
    blocks: KvCacheManager,
    windows: WindowCache,
    seqs: HashMap<RequestId, V4Seq>,
    /// Exports and imports in flight (their ids share the requests' space).
    transfers: HashMap<RequestId, transfer::Transfer>,
    hasher: KeyHasher,
    events: Vec<KvEvent>,
    opts: V4Options,
    stats: V4Stats,
}

impl V4CacheManager {
    /// A manager for `plan` with `slots`.
    pub fn new(plan: V4Plan, slots: V4Slots, opts: V4Options) -> Result<Self, V4Error> {
        if opts.blocks.enable_partial_reuse {
            return Err(V4Error::PartialReuse);
        }
        let pool_plan = plan
            .compressed_pool_plan()
            .ok_or_else(|| V4Error::NoBlocks {
                model: plan.spec().name.clone(),
            })?;
        // The block manager always records its events: a block leaving the tree must
        // drop its tail. They reach the caller only when it asked for them.
        let block_opts = ManagerOptions {
            record_events: true,
            ..opts.blocks.clone()
        };
        let blocks = KvCacheManager::new(pool_plan, slots.blocks, block_opts)?;
        let windows = WindowCache::new(WindowSpec::of_plan(&plan), slots.windows)?;
        Ok(V4CacheManager {
            plan,
            blocks,
            windows,
            seqs: HashMap::new(),
            transfers: HashMap::new(),
            hasher: KeyHasher::default(),
            events: Vec::new(),
            opts,
            stats: V4Stats::default(),
        })
    }

    /// The plan.
    pub fn plan(&self) -> &V4Plan {
        &self.plan
    }

    /// The block manager of the compressed life cycle (read-only).
    pub fn blocks(&self) -> &KvCacheManager {
        &self.blocks
    }

    /// The window cache (read-only).
    pub fn windows(&self) -> &WindowCache {
        &self.windows
    }

    /// Counters.
    pub fn stats(&self) -> V4Stats {
        self.stats
    }

    /// The window cache's counters.
    pub fn window_stats(&self) -> WindowStats {
        self.windows.stats()
    }

    fn block_tokens(&self) -> u64 {
        u64::from(self.plan.tokens_per_block())
    }

    fn seq(&self, id: RequestId) -> Result<&V4Seq, V4Error> {
        Self::get(&self.seqs, id)
    }

    /// A sequence, borrowing only the map (so the block manager can be borrowed too).
    fn get(seqs: &HashMap<RequestId, V4Seq>, id: RequestId) -> Result<&V4Seq, V4Error> {
        seqs.get(&id)
            .ok_or(V4Error::Blocks(KvError::UnknownRequest { id }))
    }

    /// Passes the block manager's events on, dropping the tails of blocks that left the
    /// tree.
    fn sync_events(&mut self) {
        let issued = self.blocks.issued_fence();
        for e in self.blocks.take_events() {
            match &e {
                KvEvent::Removed { key } => {
                    self.windows.drop_tail(key, issued);
                }
                KvEvent::AllBlocksCleared => self.windows.drop_all_tails(issued),
                _ => {}
            }
            if self.opts.blocks.record_events {
                self.events.push(e);
            }
        }
    }

    /// The events since the last call (the block manager's, in order).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.sync_events();
        std::mem::take(&mut self.events)
    }

    /// Copy plans the block manager decided since the last call (onloads of reused blocks
    /// from the host tier, offloads), in the order they must run.
    pub fn take_copy_plans(&mut self) -> Vec<crate::ops::CopyPlan> {
        self.blocks.take_copy_plans()
    }

    /// Router events (the block manager's, for KV-aware routers) since the last call.
    pub fn take_router_events(&mut self) -> Vec<super::RouterEvent> {
        self.blocks.take_router_events()
    }

    /// Turns the recording of router events on or off.
    pub fn set_record_router_events(&mut self, on: bool) {
        self.blocks.set_record_router_events(on);
    }

    /// Creates a sequence for `prompt`, serving its longest cached prefix of whole blocks
    /// whose last boundary has a window tail (never the last token). The sequence starts
    /// suspended in the block manager; [`resume`](Self::resume) brings its blocks to the
    /// GPU.
    pub fn create(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        prompt: &[TokenId],
        opts: SeqOptions,
    ) -> Result<V4Created, V4Error> {
        if prompt.is_empty() {
            return Err(V4Error::EmptyPrompt { id });
        }
        if self.seqs.contains_key(&id) || self.transfers.contains_key(&id) {
            return Err(KvError::DuplicateRequest { id }.into());
        }
        let t = self.block_tokens();
        let cached = self.blocks.probe_reuse(scope, prompt)? / t;
        // The deepest cached boundary with a tail.
        let keys = self
            .blocks
            .block_keys(scope, &prompt[..(cached * t) as usize]);
        let hit = (1..=keys.len())
            .rev()
            .find(|&j| self.windows.has_tail(&keys[j - 1]))
            .unwrap_or(0);
        let reuse = hit as u64 * t;
        let created = self
            .blocks
            .create(id, scope, &prompt[..reuse as usize + 1], opts)?;
        debug_assert_eq!(created.reused_tokens, reuse, "a probed prefix is served");
        let resume = hit.checked_sub(1).map(|j| keys[j]);
        if let Err(e) = self.windows.open(id, resume.as_ref()) {
            let mut h = created.handle;
            self.blocks.close(&mut h)?;
            return Err(e.into());
        }
        let backed_off = cached - hit as u64;
        self.stats.lookups += 1;
        self.stats.reused_tokens += reuse;
        self.stats.backed_off_blocks += backed_off;
        self.seqs.insert(
            id,
            V4Seq {
                handle: created.handle,
                last_key: resume.unwrap_or_else(|| scope.root_key()),
                committed: reuse,
                prompt_len: prompt.len() as u64,
                recent: resume.map(|k| vec![(reuse, k)]).unwrap_or_default(),
            },
        );
        self.sync_events();
        Ok(V4Created {
            reused_tokens: reuse,
            backed_off_blocks: backed_off,
        })
    }

    /// Brings the sequence's reused blocks to the GPU (`Ok(false)`, nothing changed, when
    /// they do not fit).
    pub fn resume(&mut self, id: RequestId) -> Result<bool, V4Error> {
        let h = &Self::get(&self.seqs, id)?.handle;
        let ok = self.blocks.resume(h)?;
        self.sync_events();
        Ok(ok)
    }

    /// Refused: see [`V4Error::NoSuspend`].
    pub fn suspend(&mut self, id: RequestId) -> Result<(), V4Error> {
        self.seq(id)?;
        Err(V4Error::NoSuspend { id })
    }

    /// Sets capacity (history + the next step's positions) and history. Grows the blocks
    /// and the windows together; `Ok(false)`, nothing changed, when either has no room.
    /// Shrinking gives back pages past the capacity.
    pub fn resize(&mut self, id: RequestId, capacity: u64, history: u64) -> Result<bool, V4Error> {
        let h = &Self::get(&self.seqs, id)?.handle;
        // The windows are asked first, without changing anything: the block manager may
        // evict or offload cached blocks to make room, which cannot be undone.
        if !self.windows.fits(id, capacity)? {
            return Ok(false);
        }
        if !self.blocks.resize(h, capacity, history)? {
            self.sync_events();
            return Ok(false);
        }
        let (completed, issued) = (self.blocks.completed_fence(), self.blocks.issued_fence());
        // The room was there, and the block manager's evictions only drop tails (more
        // room).
        let grown = self.windows.ensure(id, capacity, completed, issued)?;
        assert!(
            grown,
            "invariant: windows that fit before a resize fit after it"
        );
        self.windows.truncate(id, capacity, issued)?;
        self.sync_events();
        Ok(true)
    }

    /// Commits `tokens` (their rows are written): whole blocks enter the prefix tree, a
    /// tail is linked at every block boundary crossed, and the windows free what lies
    /// behind them.
    pub fn commit(&mut self, id: RequestId, tokens: &[TokenId]) -> Result<(), V4Error> {
        let t = self.block_tokens();
        let s = Self::get(&self.seqs, id)?;
        let h = &s.handle;
        let before = s.committed;
        let committed = before + tokens.len() as u64;
        // The keys of the boundaries crossed, from the committed tokens and the new ones.
        let old = self.blocks.committed_tokens(h)?;
        let mut key = s.last_key;
        let mut crossed = Vec::new();
        // Allocated only when a boundary is crossed (once per block, not per token).
        let mut block = Vec::new();
        for e in (before / t + 1)..=(committed / t) {
            block.clear();
            block.extend(((e - 1) * t..e * t).map(|i| match i.checked_sub(before) {
                None => old[i as usize],
                Some(j) => tokens[j as usize],
            }));
            key = self.hasher.block_key(&key, &block);
            crossed.push((e * t, key));
        }
        // Everything the windows would refuse is refused before the blocks change.
        self.windows.check_commit(id, committed, &crossed, t)?;
        self.blocks.commit(h, tokens)?;
        // Only blocks the block manager linked into the prefix tree get a tail: a tail
        // without its block could never be resumed from (reuse off, or the chain broken).
        let in_tree = self.blocks.tree_blocks(h)? * t;
        crossed.retain(|&(e, _)| e <= in_tree);
        let issued = self.blocks.issued_fence();
        self.windows.commit(id, committed, &crossed, t, issued)?;
        let s = self.seqs.get_mut(&id).expect("invariant: checked above");
        s.committed = committed;
        s.last_key = key;
        s.recent.extend(crossed);
        self.retire_tails(id, false);
        self.sync_events();
        Ok(())
    }

    /// Whether the tail at `boundary` stays in LRU order for a sequence whose prompt
    /// has `prompt_len` tokens.
    fn keeps(&self, boundary: u64, prompt_len: u64) -> bool {
        let t = self.block_tokens();
        let last_prompt = prompt_len / t * t;
        let interval = u64::from(self.opts.tail_interval) * t;
        (boundary + t >= last_prompt && boundary <= last_prompt)
            || (interval > 0 && boundary.is_multiple_of(interval))
    }

    /// Demotes the tails of `id`'s boundaries that are two blocks behind (all but the
    /// last two at `closing`) and that the policy does not keep.
    fn retire_tails(&mut self, id: RequestId, closing: bool) {
        let t = self.block_tokens();
        let s = self.seqs.get_mut(&id).expect("invariant: live sequence");
        let (committed, prompt_len) = (s.committed, s.prompt_len);
        let mut recent = std::mem::take(&mut s.recent);
        let mut i = 0;
        while i < recent.len() {
            let (boundary, key) = recent[i];
            let behind = if closing {
                recent.len() - i > 2
            } else {
                boundary + 2 * t <= committed
            };
            if !behind {
                i += 1;
                continue;
            }
            recent.remove(i);
            if !self.keeps(boundary, prompt_len) && self.windows.demote(&key) {
                self.stats.tails_demoted += 1;
            }
        }
        self.seqs.get_mut(&id).expect("invariant: live").recent = recent;
    }

    /// Closes the sequence: its blocks stay in the prefix tree, the tails the policy
    /// keeps stay, every other window page is freed.
    pub fn close(&mut self, id: RequestId) -> Result<(), V4Error> {
        self.seq(id)?;
        self.retire_tails(id, true);
        let mut s = self.seqs.remove(&id).expect("invariant: checked above");
        let issued = self.blocks.issued_fence();
        self.windows.close(id, issued)?;
        self.blocks.close(&mut s.handle)?;
        self.sync_events();
        Ok(())
    }

    /// Committed tokens of `id`.
    pub fn committed(&self, id: RequestId) -> Result<u64, V4Error> {
        Ok(self.seq(id)?.committed)
    }

    /// The GPU slots of `id`'s blocks (the compressed caches' block table).
    pub fn block_slots(&self, id: RequestId) -> Result<Vec<SlotId>, V4Error> {
        Ok(self
            .blocks
            .block_slots(&self.seq(id)?.handle, LifeCycleId(0))?)
    }

    /// `id`'s page table of window life cycle `lc` (an index into the window specs):
    /// the first position held and the slots.
    pub fn window_table(&self, id: RequestId, lc: usize) -> Result<(u64, Vec<SlotId>), V4Error> {
        self.seq(id)?;
        Ok(self.windows.page_table(id, lc)?)
    }

    /// The fence `id`'s next step must wait for (slots handed out before their last
    /// reader finished).
    pub fn wait_for(&self, id: RequestId) -> Result<Fence, V4Error> {
        let s = self.seq(id)?;
        let blocks = self.blocks.info_of(&s.handle)?.ready_after;
        Ok(blocks.max(self.windows.wait_for(id)?))
    }

    /// Issues the fence of a step about to run.
    pub fn issue_fence(&mut self) -> Fence {
        self.blocks.issue_fence()
    }

    /// Marks every step up to `f` finished.
    pub fn complete_fences(&mut self, f: Fence) -> Result<(), V4Error> {
        Ok(self.blocks.complete_fences(f)?)
    }

    /// Empties the prefix tree (refused while a sequence holds pages) and drops every
    /// tail.
    pub fn reset_prefix_cache(&mut self) -> Result<(), V4Error> {
        self.blocks.reset_prefix_cache()?;
        self.sync_events();
        Ok(())
    }

    /// Checks every invariant of both halves and that every tail's block is cached
    /// (tests; panics with the broken rule).
    pub fn check_invariants(&self) {
        self.blocks.check_invariants();
        self.windows.check_invariants();
        assert_eq!(
            self.seqs.len() + self.transfers.len(),
            self.windows.num_sequences(),
            "one ring set per sequence and transfer"
        );
        assert_eq!(
            self.seqs.len() + self.transfers.len(),
            self.blocks.num_sequences(),
            "one block sequence each"
        );
        let cached: std::collections::BTreeSet<BlockKey> = self
            .blocks
            .cached_blocks()
            .into_iter()
            .map(|c| c.key)
            .collect();
        for key in self.windows.tail_keys() {
            assert!(cached.contains(key), "the tail of {key} outlived its block");
        }
    }
}
