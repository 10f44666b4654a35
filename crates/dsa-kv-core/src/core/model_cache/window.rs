//! The sliding-window kind (DeepSeek-V4): the [`WindowCache`] over the raw window and
//! the compressor states, kept in step with the block manager of the compressed life
//! cycle (256-token blocks of compressed KV and indexer keys):
//!
//! * **Create.** A prompt is served from the deepest cached block boundary that still has
//!   a window tail (a hit without one would need the window recomputed, which is not
//!   bit-exact); the back-off is counted ([`WindowKindStats::backed_off_blocks`]).
//! * **Resize** grows (or shrinks) both; when either has no room, neither changes (the
//!   windows are asked first, read-only: the block manager's evictions cannot be undone).
//! * **Commit** checks what the windows would refuse, commits the tokens to the blocks,
//!   links a tail at every block boundary crossed whose block entered the prefix tree,
//!   then lets the windows free what lies behind them.
//! * **Retention** (`tail_interval`): the tails at the last two boundaries of a prompt
//!   (where the same prompt, resent with or without MTP, resumes) and every
//!   `tail_interval`-th boundary stay in the LRU order of use; the others are *demoted*
//!   (first to go when the windows need room) once the sequence is two blocks past them.
//!   At close, the sequence's last two boundaries keep their tails (where its next turn
//!   resumes).
//! * **Eviction.** A block leaving the prefix tree drops its tail (the manager's
//!   `Removed` / `AllBlocksCleared` events).
//! * **Preemption** is by recompute: a windowed sequence cannot be suspended (its rings
//!   live on the GPU only).

use std::collections::HashMap;

use super::router::TailCover;
use super::transfer::Transfer;
use super::WindowKindStats;
use crate::core::error::KvError;
use crate::core::events::KvEvent;
use crate::core::manager::{Created, KvCacheManager, SeqHandle, SeqOptions};
use crate::core::reuse_key::{BlockKey, KeyHasher, ReuseScope};
use crate::core::window::{WindowCache, WindowSpec};
use crate::core::{RouterBlock, RouterEvent};
use crate::ids::{RequestId, SlotId, TokenId};
use crate::layout::V4Plan;

/// A sequence's retention state.
#[derive(Debug)]
struct WinSeq {
    /// The key of the last committed whole block (the scope's root before any).
    last_key: BlockKey,
    /// Committed tokens.
    committed: u64,
    /// The prompt's length.
    prompt_len: u64,
    /// Boundaries this sequence linked or met and has not yet demoted, oldest first.
    recent: Vec<(u64, BlockKey)>,
}

/// The sliding-window kind. See the module docs.
pub(crate) struct WindowKind {
    pub(super) cache: WindowCache,
    seqs: HashMap<RequestId, WinSeq>,
    /// Exports and imports in flight (their ids share the requests' space).
    pub(super) transfers: HashMap<RequestId, Transfer>,
    hasher: KeyHasher,
    /// The block manager's events, passed on when the caller records them.
    events: Vec<KvEvent>,
    record: bool,
    tail_interval: u32,
    block_tokens: u64,
    stats: WindowKindStats,
    /// The router's view (while router events are recorded).
    cover: Option<TailCover>,
}

impl WindowKind {
    pub(super) fn new(
        plan: &V4Plan,
        slots: Vec<u32>,
        tail_interval: u32,
        record: bool,
    ) -> Result<Self, KvError> {
        Ok(WindowKind {
            cache: WindowCache::new(WindowSpec::of_plan(plan), slots)?,
            seqs: HashMap::new(),
            transfers: HashMap::new(),
            hasher: KeyHasher::default(),
            events: Vec::new(),
            record,
            tail_interval,
            block_tokens: u64::from(plan.tokens_per_block()),
            stats: WindowKindStats::default(),
            cover: None,
        })
    }

    pub(super) fn cache(&self) -> &WindowCache {
        &self.cache
    }

    pub(super) fn stats(&self) -> WindowKindStats {
        WindowKindStats {
            windows: self.cache.stats(),
            ..self.stats
        }
    }

    pub(super) fn block_tokens(&self) -> u64 {
        self.block_tokens
    }

    /// Whether `id` is taken by a sequence or a transfer.
    pub(super) fn taken(&self, id: RequestId) -> bool {
        self.seqs.contains_key(&id) || self.transfers.contains_key(&id)
    }

    fn seq(&self, id: RequestId) -> Result<&WinSeq, KvError> {
        self.seqs.get(&id).ok_or(KvError::UnknownRequest { id })
    }

    /// Passes the block manager's events on, dropping the tails of blocks that left the
    /// tree.
    #[inline(never)]
    pub(super) fn sync(&mut self, blocks: &mut KvCacheManager) {
        let issued = blocks.issued_fence();
        for e in blocks.take_events() {
            match &e {
                KvEvent::Removed { key } => {
                    self.cache.drop_tail(key, issued);
                }
                KvEvent::AllBlocksCleared => self.cache.drop_all_tails(issued),
                _ => {}
            }
            if self.record {
                self.events.push(e);
            }
        }
        if let Some(cover) = self.cover.as_mut() {
            cover.blocks(blocks.take_router_events());
            for (key, linked) in self.cache.take_tail_log() {
                if linked {
                    cover.linked(&key);
                } else {
                    cover.dropped(&key);
                }
            }
        }
    }

    /// Router events since the last call: the block manager's, for the blocks a hit
    /// can reach (see [`TailCover`]).
    pub(super) fn take_router_events(&mut self, blocks: &mut KvCacheManager) -> Vec<RouterEvent> {
        self.sync(blocks);
        self.cover.as_mut().map(TailCover::take).unwrap_or_default()
    }

    /// Starts or stops recording router events. Started with blocks cached, the
    /// filter learns them and their tails silently (consumers resynchronize from
    /// [`router_blocks`](Self::router_blocks)).
    pub(super) fn set_record_router_events(&mut self, blocks: &mut KvCacheManager, on: bool) {
        self.sync(blocks);
        blocks.set_record_router_events(on);
        self.cache.log_tails(on);
        if !on {
            self.cover = None;
            return;
        }
        if self.cover.is_none() {
            let mut cover = TailCover::default();
            cover.blocks(blocks.router_stored_all());
            for key in self.cache.tail_keys() {
                cover.linked(key);
            }
            cover.take();
            self.cover = Some(cover);
        }
    }

    /// The blocks a router should hold: those with a tail at or below them (computed
    /// from the tree and the tails, not from the filter's state).
    pub(super) fn router_blocks(&self, blocks: &KvCacheManager) -> Vec<RouterBlock> {
        blocks.router_blocks_covering(|k| self.cache.has_tail(k))
    }

    #[inline(never)]
    pub(super) fn take_events(&mut self, blocks: &mut KvCacheManager) -> Vec<KvEvent> {
        self.sync(blocks);
        std::mem::take(&mut self.events)
    }

    /// The deepest of `keys` (a prompt's cached block keys, in order) that keeps a
    /// tail: how many blocks a hit may use.
    pub(super) fn deepest_tail(&self, keys: &[BlockKey]) -> usize {
        (1..=keys.len())
            .rev()
            .find(|&j| self.cache.has_tail(&keys[j - 1]))
            .unwrap_or(0)
    }

    #[inline(never)]
    pub(super) fn create(
        &mut self,
        blocks: &mut KvCacheManager,
        id: RequestId,
        scope: ReuseScope,
        prompt: &[TokenId],
        opts: SeqOptions,
    ) -> Result<Created, KvError> {
        if prompt.is_empty() {
            return Err(KvError::InvalidOption {
                field: "prompt",
                value: "[]".into(),
                why: "a sequence needs at least one prompt token",
            });
        }
        if self.taken(id) {
            return Err(KvError::DuplicateRequest { id });
        }
        let t = self.block_tokens;
        let cached = blocks.probe_reuse(scope, prompt)? / t;
        let keys = blocks.block_keys(scope, &prompt[..(cached * t) as usize]);
        let hit = self.deepest_tail(&keys);
        let reuse = hit as u64 * t;
        // Only the hit is offered to the block manager: its reuse stops at the tail.
        let created = blocks.create(id, scope, &prompt[..reuse as usize + 1], opts)?;
        debug_assert_eq!(created.reused_tokens, reuse, "a probed prefix is served");
        let resume = hit.checked_sub(1).map(|j| keys[j]);
        if let Err(e) = self.cache.open(id, resume.as_ref()) {
            let mut h = created.handle;
            blocks.close(&mut h)?;
            return Err(e.into());
        }
        let backed_off = cached - hit as u64;
        self.stats.lookups += 1;
        self.stats.lookup_tokens += prompt.len() as u64;
        self.stats.reused_tokens += reuse;
        self.stats.backed_off_blocks += backed_off;
        self.seqs.insert(
            id,
            WinSeq {
                last_key: resume.unwrap_or_else(|| scope.root_key()),
                committed: reuse,
                prompt_len: prompt.len() as u64,
                recent: resume.map(|k| vec![(reuse, k)]).unwrap_or_default(),
            },
        );
        self.sync(blocks);
        Ok(created)
    }

    #[inline(never)]
    pub(super) fn resize(
        &mut self,
        blocks: &mut KvCacheManager,
        h: &SeqHandle,
        capacity: u64,
        history: u64,
    ) -> Result<bool, KvError> {
        let id = h.id();
        self.seq(id)?;
        // The windows are asked first, without changing anything: the block manager may
        // evict or offload cached blocks to make room, which cannot be undone.
        if !self.cache.fits(id, capacity)? {
            return Ok(false);
        }
        if !blocks.resize(h, capacity, history)? {
            self.sync(blocks);
            return Ok(false);
        }
        let (completed, issued) = (blocks.completed_fence(), blocks.issued_fence());
        // The room was there, and the block manager's evictions only drop tails (more
        // room).
        let grown = self.cache.ensure(id, capacity, completed, issued)?;
        assert!(
            grown,
            "invariant: windows that fit before a resize fit after it"
        );
        self.cache.truncate(id, capacity, issued)?;
        self.sync(blocks);
        Ok(true)
    }

    #[inline(never)]
    pub(super) fn commit(
        &mut self,
        blocks: &mut KvCacheManager,
        h: &SeqHandle,
        tokens: &[TokenId],
    ) -> Result<(), KvError> {
        let id = h.id();
        let t = self.block_tokens;
        let s = self.seq(id)?;
        let before = s.committed;
        let committed = before + tokens.len() as u64;
        // The keys of the boundaries crossed, from the committed tokens and the new ones.
        let old = blocks.committed_tokens(h)?;
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
        self.cache.check_commit(id, committed, &crossed, t)?;
        blocks.commit(h, tokens)?;
        // Only blocks the block manager linked into the prefix tree get a tail: a tail
        // without its block could never be resumed from (reuse off, or the chain broken).
        let in_tree = blocks.tree_blocks(h)? * t;
        crossed.retain(|&(e, _)| e <= in_tree);
        let issued = blocks.issued_fence();
        self.cache.commit(id, committed, &crossed, t, issued)?;
        let s = self.seqs.get_mut(&id).expect("invariant: checked above");
        s.committed = committed;
        s.last_key = key;
        s.recent.extend(crossed);
        self.retire_tails(id, false);
        self.sync(blocks);
        Ok(())
    }

    /// Whether the tail at `boundary` stays in LRU order for a sequence whose prompt
    /// has `prompt_len` tokens.
    fn keeps(&self, boundary: u64, prompt_len: u64) -> bool {
        let t = self.block_tokens;
        let last_prompt = prompt_len / t * t;
        let interval = u64::from(self.tail_interval) * t;
        (boundary + t >= last_prompt && boundary <= last_prompt)
            || (interval > 0 && boundary.is_multiple_of(interval))
    }

    /// Demotes the tails of `id`'s boundaries that are two blocks behind (all but the
    /// last two at `closing`) and that the policy does not keep.
    fn retire_tails(&mut self, id: RequestId, closing: bool) {
        let t = self.block_tokens;
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
            if !self.keeps(boundary, prompt_len) && self.cache.demote(&key) {
                self.stats.tails_demoted += 1;
            }
        }
        self.seqs.get_mut(&id).expect("invariant: live").recent = recent;
    }

    #[inline(never)]
    pub(super) fn close(
        &mut self,
        blocks: &mut KvCacheManager,
        h: &mut SeqHandle,
    ) -> Result<(), KvError> {
        let id = h.id();
        self.seq(id)?;
        self.retire_tails(id, true);
        self.seqs.remove(&id);
        let issued = blocks.issued_fence();
        self.cache.close(id, issued)?;
        blocks.close(h)?;
        self.sync(blocks);
        Ok(())
    }

    /// `id`'s page table per window life cycle: the first position held and the slots.
    #[inline(never)]
    pub(super) fn tables_into(
        &self,
        id: RequestId,
        out: &mut Vec<(u64, Vec<SlotId>)>,
    ) -> Result<(), KvError> {
        for lc in 0..self.cache.specs().len() {
            out.push(self.cache.page_table(id, lc)?);
        }
        Ok(())
    }

    /// Checks the windows' invariants and that every tail's block is cached (tests;
    /// panics with the broken rule).
    pub(super) fn check_invariants(&self, blocks: &KvCacheManager) {
        self.cache.check_invariants();
        assert_eq!(
            self.seqs.len() + self.transfers.len(),
            self.cache.num_sequences(),
            "one ring set per sequence and transfer"
        );
        assert_eq!(
            self.seqs.len() + self.transfers.len(),
            blocks.num_sequences(),
            "one block sequence each"
        );
        let cached: std::collections::BTreeSet<BlockKey> =
            blocks.cached_blocks().into_iter().map(|c| c.key).collect();
        for key in self.cache.tail_keys() {
            assert!(cached.contains(key), "the tail of {key} outlived its block");
        }
    }
}
