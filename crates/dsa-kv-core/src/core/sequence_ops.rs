//! The life of a sequence: resize, commit (with rebasing of duplicate blocks),
//! suspend, resume (with onboarding and copy-on-resume), stop and close.
//!
//! Invariants kept here: committed ≤ history ≤ capacity; blocks =
//! ceil(capacity / T); `resize` and `resume` return `Ok(false)` and change nothing when
//! space is short; nobody writes a committed page.

use super::error::{KvError, SeqStatus};
use super::events::KvEvent;
use super::manager::{KvCacheManager, SeqHandle};
use super::radix::Insert;
use crate::ids::{Fence, LifeCycleId, PageId, Tier, TokenId};

impl KvCacheManager {
    /// An export or an import is driven only through its own calls (`close`, and
    /// `commit_import` for an import): any other operation could move pinned pages or
    /// expose reserved ones.
    fn refuse_transfer(&self, idx: usize, op: &'static str) -> Result<(), KvError> {
        let s = self.seq(idx);
        if s.pinned || s.importing {
            return Err(KvError::Transfer {
                id: s.id,
                why: format!(
                    "{op} is not allowed on an {}: close it{}",
                    if s.pinned { "export" } else { "import" },
                    if s.pinned {
                        ""
                    } else {
                        ", or commit it with commit_import"
                    }
                ),
            });
        }
        Ok(())
    }

    pub(super) fn require_active(&self, idx: usize, op: &'static str) -> Result<(), KvError> {
        let s = self.seq(idx);
        if s.status != SeqStatus::Active {
            return Err(KvError::NotActive {
                id: s.id,
                status: s.status,
                op,
            });
        }
        Ok(())
    }

    /// Sets capacity (history + the next step's inputs) and history in one call.
    ///
    /// Growing allocates GPU pages, evicting other pages if needed; when that is
    /// impossible it returns `Ok(false)` and leaves every structure exactly as before.
    /// Shrinking frees the trailing pages (e.g. rejected draft tokens); they were never
    /// committed, so no cache entry can point at them.
    pub fn resize(&mut self, h: &SeqHandle, capacity: u64, history: u64) -> Result<bool, KvError> {
        self.reap_dropped();
        let idx = self.seq_index(h)?;
        self.refuse_transfer(idx, "resizing")?;
        self.require_active(idx, "resizing")?;
        let s = self.seq(idx);
        if history < s.history {
            return Err(KvError::HistoryBackwards {
                id: s.id,
                current: s.history,
                requested: history,
            });
        }
        if capacity < history {
            return Err(KvError::CapacityBelowHistory {
                id: s.id,
                capacity,
                history,
            });
        }
        let n = self.n_lc;
        let old_blocks = s.pages.len() / n;
        let new_blocks = capacity.div_ceil(self.tpb);
        if new_blocks > old_blocks as u64 {
            let id = s.id;
            let mut needs = vec![0u32; self.allocators[0].len()];
            for lc in 0..n {
                needs[self.lc_group[lc].index()] += 1;
            }
            for (g, per_block) in needs.iter_mut().enumerate() {
                let cap = self.allocators[0][g].capacity();
                if new_blocks * u64::from(*per_block) > u64::from(cap) {
                    return Err(KvError::SequenceTooLong {
                        id,
                        tokens: capacity,
                        blocks: new_blocks,
                        group: crate::ids::PoolGroupId(g as u16),
                        capacity: cap,
                        capacity_tokens: u64::from(cap) / u64::from(*per_block) * self.tpb,
                    });
                }
                *per_block *= (new_blocks - old_blocks as u64) as u32;
            }
            if !self.make_room_on_gpu(&needs) {
                self.stats.resize_failures += 1;
                self.debug_check();
                return Ok(false);
            }
            let mut fresh = Vec::with_capacity(needs.iter().sum::<u32>() as usize);
            for _ in old_blocks as u64..new_blocks {
                for lc in 0..n {
                    self.new_locked_pages(LifeCycleId(lc as u16), 1, &mut fresh);
                }
            }
            let mut ready = fresh
                .iter()
                .filter_map(|f| f.1)
                .max()
                .unwrap_or(Fence::NONE);
            if let Some(p) = &self.current_plan {
                ready = ready.max(p.fence);
            }
            self.finish_plan();
            // Appended blocks need no change mark: the kept row is shorter.
            let s = self.seq_mut(idx);
            s.pages.extend(fresh.iter().map(|f| f.0));
            s.ready_after = s.ready_after.max(ready);
        } else if (new_blocks as usize) < old_blocks {
            let s = self.seq_mut(idx);
            s.table_mark = s.table_mark.min(new_blocks as usize);
            let tail: Vec<PageId> = s.pages.drain(new_blocks as usize * n..).collect();
            for pid in tail.into_iter().rev() {
                debug_assert!(
                    self.pages[pid].node.is_none(),
                    "a trailing block is never committed"
                );
                self.unref(pid, true);
            }
        }
        let s = self.seq_mut(idx);
        s.capacity = capacity;
        s.history = history;
        self.debug_check();
        Ok(true)
    }

    /// Finalizes `tokens` (their KV is written). Every block that becomes full enters
    /// the reuse tree; a block equal to one already there is rebased onto the tree's
    /// page (or donates its own page when that one is on the GPU and the tree's is not).
    /// History rises to the committed length when it was lower.
    pub fn commit(&mut self, h: &SeqHandle, tokens: &[TokenId]) -> Result<(), KvError> {
        self.reap_dropped();
        let idx = self.seq_index(h)?;
        self.refuse_transfer(idx, "committing")?;
        Self::validate_tokens(tokens)?;
        let s = self.seq(idx);
        if s.stopped {
            return Err(KvError::CommitAfterStop { id: s.id });
        }
        let total = s.committed() + tokens.len() as u64;
        if total > s.capacity {
            return Err(KvError::CommitBeyondCapacity {
                id: s.id,
                adding: tokens.len() as u64,
                total,
                capacity: s.capacity,
            });
        }
        let first_block = s.committed() / self.tpb;
        let s = self.seq_mut(idx);
        s.tokens.extend_from_slice(tokens);
        s.history = s.history.max(total);
        for b in first_block..total / self.tpb {
            self.commit_block(idx, b as usize, self.tpb as usize);
        }
        self.debug_check();
        Ok(())
    }

    /// Links block `b` (its first `len` tokens) of sequence `idx` into the tree.
    fn commit_block(&mut self, idx: usize, b: usize, len: usize) {
        let n = self.n_lc;
        let tpb = self.tpb as usize;
        let s = self.seq(idx);
        if !self.opts.enable_block_reuse || s.tree_stopped || s.nodes.len() != b {
            self.seq_mut(idx).tree_stopped = true;
            return;
        }
        let parent = match s.nodes.last() {
            Some(&p) => p,
            None => {
                let (key, lora_id) = (s.scope_key, s.lora_id);
                self.tree.root_or_insert(key, lora_id)
            }
        };
        let Some(parent_node) = self.tree.get(parent) else {
            // The previous block left the tree (it was replaced by a donation and then
            // evicted): the chain is broken, stop adding blocks.
            self.seq_mut(idx).tree_stopped = true;
            return;
        };
        let parent_key = parent_node.key;
        // Field-level borrows: the tokens stay borrowed while the tree and hasher change.
        let s = self.seqs[idx].as_ref().expect("invariant: live sequence");
        let tokens = &s.tokens[b * tpb..b * tpb + len];
        let key = self.hasher.block_key(&parent_key, tokens);
        let pages: Vec<PageId> = s.pages[b * n..(b + 1) * n].to_vec();
        let priority = s.priority;
        let locked = s.status == SeqStatus::Active;
        let mut removed = Vec::new();
        let outcome = self
            .tree
            .insert(parent, key, tokens, &pages, tpb, &mut removed);
        match outcome {
            Insert::New(node) => {
                for &pid in &pages {
                    self.dequeue(pid);
                    let p = &mut self.pages[pid];
                    p.node = Some(node);
                    p.committed = true;
                    p.priority = priority;
                    self.refresh_queue(pid);
                }
                if len == tpb && self.record_router_events {
                    self.router_announce(node);
                }
                if self.opts.record_events {
                    // A suspended sequence's pages may sit on different tiers (each pool
                    // group is evicted on its own): the event names life cycle 0's tier
                    // and every page elsewhere follows as a move from that tier.
                    let tier = self.pages[pages[0]].tier;
                    self.events.push(KvEvent::Stored {
                        key,
                        parent: parent_key,
                        num_tokens: len as u32,
                        tier,
                        priority,
                    });
                    for (lc, &pid) in pages.iter().enumerate().skip(1) {
                        let to = self.pages[pid].tier;
                        if to != tier {
                            self.events.push(KvEvent::TierUpdated {
                                key,
                                life_cycle: LifeCycleId(lc as u16),
                                from: tier,
                                to,
                            });
                        }
                    }
                }
                self.seq_mut(idx).nodes.push(node);
            }
            Insert::Duplicate(node) if len == tpb => {
                self.stats.rebased_blocks += 1;
                let record_router = self.record_router_events;
                for (lc, &ours) in pages.iter().enumerate() {
                    let theirs = self.tree.node(node).pages[lc];
                    if self.pages[theirs].tier == Tier::Gpu || self.pages[ours].tier != Tier::Gpu {
                        // Rebase: use the tree's page, free our private copy. Also when
                        // ours is off the GPU too (a suspended sequence, offloaded):
                        // donating it would gain nothing.
                        self.add_ref(theirs, locked);
                        let s = self.seq_mut(idx);
                        s.pages[b * n + lc] = theirs;
                        s.table_mark = s.table_mark.min(b);
                        self.unref(ours, locked);
                    } else {
                        // Donate: our GPU page becomes the block's page; the old one is
                        // unlinked (freed unless someone still holds it).
                        self.tree.set_page(node, lc, ours);
                        let (from, to) = (self.pages[theirs].tier, self.pages[ours].tier);
                        self.dequeue(ours);
                        let p = &mut self.pages[ours];
                        p.node = Some(node);
                        p.committed = true;
                        p.priority = priority;
                        self.refresh_queue(ours);
                        self.pages[theirs].node = None;
                        self.settle(theirs);
                        if self.opts.record_events {
                            self.events.push(KvEvent::TierUpdated {
                                key,
                                life_cycle: LifeCycleId(lc as u16),
                                from,
                                to,
                            });
                        }
                    }
                }
                if record_router {
                    self.router_refresh(node);
                }
                self.seq_mut(idx).nodes.push(node);
            }
            // A partial block equal to, or a prefix of, a block already cached: nothing to
            // store, our page stays private.
            Insert::Duplicate(_) | Insert::Useless => self.seq_mut(idx).tree_stopped = true,
        }
        self.handle_removed(removed);
    }

    /// Ends a speculative step: commits the verified tokens (the target token and the
    /// accepted drafts; history rises to them) and shrinks capacity back to history, which
    /// frees the pages that only held rejected draft tokens. Rejected tokens are never
    /// committed, so the prefix cache can never serve them.
    pub fn accept_tokens(&mut self, h: &SeqHandle, accepted: &[TokenId]) -> Result<(), KvError> {
        self.reap_dropped();
        let idx = self.seq_index(h)?;
        self.refuse_transfer(idx, "accepting tokens")?;
        self.require_active(idx, "accepting tokens")?;
        self.commit(h, accepted)?;
        let history = self.seq(idx).history;
        let grew = self.resize(h, history, history)?;
        debug_assert!(grew, "shrinking never needs room");
        Ok(())
    }

    /// Stops adding blocks to the cache: a partial trailing block is committed as the
    /// sequence's last block (so a later request can reuse part of it). Idempotent.
    pub fn stop_committing(&mut self, h: &SeqHandle) -> Result<(), KvError> {
        self.reap_dropped();
        let idx = self.seq_index(h)?;
        self.refuse_transfer(idx, "stopping commits")?;
        self.stop_committing_idx(idx);
        self.debug_check();
        Ok(())
    }

    fn stop_committing_idx(&mut self, idx: usize) {
        let s = self.seq(idx);
        if s.stopped {
            return;
        }
        let rem = (s.committed() % self.tpb) as usize;
        let b = (s.committed() / self.tpb) as usize;
        if rem > 0 && s.pending_copy.is_none() {
            self.commit_block(idx, b, rem);
        }
        self.seq_mut(idx).stopped = true;
    }

    /// Unlocks every page (they stay on the GPU but may be offloaded to make room).
    /// Idempotent on a suspended sequence.
    pub fn suspend(&mut self, h: &SeqHandle) -> Result<(), KvError> {
        self.reap_dropped();
        let idx = self.seq_index(h)?;
        self.refuse_transfer(idx, "suspending")?;
        if self.seq(idx).status == SeqStatus::Suspended {
            return Ok(());
        }
        self.seq_mut(idx).status = SeqStatus::Suspended;
        for i in 0..self.seq(idx).pages.len() {
            let pid = self.seq(idx).pages[i];
            let p = &mut self.pages[pid];
            p.locks -= 1;
            p.holders += 1;
            self.refresh_queue(pid);
        }
        self.debug_check();
        Ok(())
    }

    /// Brings every page of a suspended sequence to the GPU and locks it; a reused
    /// partial block is copied into a private page first. Returns `Ok(false)`, changing
    /// nothing, when any pool group's GPU utilization is above `max_util_for_resume` or
    /// the pages do not fit. `Ok(true)` on an active sequence.
    pub fn resume(&mut self, h: &SeqHandle) -> Result<bool, KvError> {
        self.reap_dropped();
        let idx = self.seq_index(h)?;
        self.refuse_transfer(idx, "resuming")?;
        if self.seq(idx).status == SeqStatus::Active {
            return Ok(true);
        }
        if self
            .usage(Tier::Gpu)
            .iter()
            .any(|u| u.utilization > self.opts.max_util_for_resume)
        {
            self.stats.resume_refusals += 1;
            return Ok(false);
        }
        let n = self.n_lc;
        let pending = self.seq(idx).pending_copy.map(|b| b as usize);
        let own: Vec<PageId> = self.seq(idx).pages.clone();
        // Our own pages must not be chosen as victims while we make room.
        let stamps: Vec<(PageId, (u8, u64))> = own
            .iter()
            .filter_map(|&p| self.dequeue(p).map(|s| (p, s)))
            .collect();
        // A pinned page (an exported block a transfer is reading) cannot move: wait until
        // the export is released.
        if own
            .iter()
            .any(|&p| self.pages[p].pins > 0 && self.pages[p].tier != Tier::Gpu)
        {
            for (pid, stamp) in stamps {
                self.requeue(pid, stamp);
            }
            self.stats.resume_refusals += 1;
            return Ok(false);
        }
        let mut needs = vec![0u32; self.allocators[0].len()];
        for (i, &pid) in own.iter().enumerate() {
            let copy = pending == Some(i / n);
            if copy || self.pages[pid].tier != Tier::Gpu {
                needs[self.pages[pid].group.index()] += 1;
            }
        }
        if !self.make_room_on_gpu(&needs) {
            for (pid, stamp) in stamps {
                self.requeue(pid, stamp);
            }
            self.stats.resume_refusals += 1;
            self.debug_check();
            return Ok(false);
        }
        let mut fresh = Vec::new();
        for (i, &pid) in own.iter().enumerate() {
            if pending == Some(i / n) {
                // Copy-on-resume: a private page with the shared page's bytes.
                let (lc, group, src) = {
                    let p = &self.pages[pid];
                    (p.life_cycle, p.group, (p.tier, p.slot))
                };
                fresh.clear();
                self.new_locked_pages(lc, 1, &mut fresh);
                let (copy, wait) = fresh[0];
                let dst = self.pages[copy].slot;
                let fence = self.plan_copy(group, src, (Tier::Gpu, dst), wait);
                self.pages[copy].ready = fence;
                self.stats.partial_copies += 1;
                self.seq_mut(idx).pages[i] = copy;
                self.unref(pid, false);
            } else {
                if self.pages[pid].tier != Tier::Gpu {
                    self.migrate(pid, Tier::Gpu);
                }
                let p = &mut self.pages[pid];
                p.holders -= 1;
                p.locks += 1;
                self.refresh_queue(pid);
            }
        }
        let ready = self.current_plan.as_ref().map_or(Fence::NONE, |p| p.fence);
        self.finish_plan();
        let s = self.seq_mut(idx);
        s.pending_copy = None;
        s.status = SeqStatus::Active;
        // Pages may have moved (onboarded, copied) while the sequence was suspended.
        s.table_mark = 0;
        s.ready_after = s.ready_after.max(ready);
        self.debug_check();
        Ok(true)
    }

    /// Ends the sequence: commits a partial trailing block (see
    /// [`stop_committing`](Self::stop_committing)), releases every page (committed
    /// pages stay cached until evicted, the rest is freed) and retires the id.
    /// Idempotent: closing a closed handle does nothing. Dropping the handle instead
    /// closes the sequence too (see [`SeqHandle`]).
    pub fn close(&mut self, h: &mut SeqHandle) -> Result<(), KvError> {
        self.reap_dropped();
        if h.closed && h.manager == self.id {
            return Ok(());
        }
        let idx = self.seq_index(h)?;
        self.close_idx(idx);
        h.closed = true;
        self.debug_check();
        Ok(())
    }

    fn close_idx(&mut self, idx: usize) {
        self.stop_committing_idx(idx);
        let s = self.seqs[idx].take().expect("invariant: live sequence");
        let locked = s.status == SeqStatus::Active;
        // Tail first: the last blocks become the least recently used, so they are
        // evicted before the shared prefix.
        for &pid in s.pages.iter().rev() {
            if s.pinned {
                self.pages[pid].pins -= 1;
            }
            self.unref(pid, locked);
        }
        self.by_id.remove(&s.id);
        self.free_seq_slots.push(idx as u32);
    }

    /// Closes, exactly as [`close`](Self::close) would and in the order they were
    /// dropped, the sequences whose [`SeqHandle`]s were dropped without `close`; returns
    /// how many. Every `&mut self` method of the manager does this first; call it to make
    /// read-only queries (`usage`, `num_sequences`, …) see the dropped handles now.
    pub fn close_dropped(&mut self) -> usize {
        let mut closed = 0;
        while let Some((slot, gen)) = self.dropped.pop() {
            let live = self
                .seqs
                .get(slot as usize)
                .and_then(Option::as_ref)
                .is_some_and(|s| s.gen == gen);
            // A handle reports only a sequence it did not close, and nothing else ends
            // a sequence: the check guards against a stale report all the same.
            if live {
                self.close_idx(slot as usize);
                closed += 1;
            }
        }
        if closed > 0 {
            self.debug_check();
        }
        closed
    }

    /// The hot-path guard of [`close_dropped`](Self::close_dropped): one atomic check
    /// when no handle was dropped.
    #[inline]
    pub(super) fn reap_dropped(&mut self) {
        if !self.dropped.is_empty() {
            self.close_dropped();
        }
    }
}
