//! Export and import of full blocks (moving KV between engines), built on sequences so
//! every rule of the manager holds for them:
//!
//! * **export** ([`KvCacheManager::export_blocks`]): a suspended sequence over the cached
//!   full blocks of a prefix (no partial block), whose pages are **pinned**: held, and not
//!   evictable or movable on any tier, so their slots stay valid while a transfer reads
//!   them. A request resuming over a pinned page still on the host tier waits (its resume
//!   returns `false`) until the export is closed. Closing the export's handle releases it.
//! * **import** ([`KvCacheManager::begin_import`]): an active sequence over the leading
//!   blocks already cached here (skipped: not transferred; resumed, so they come to the
//!   GPU) plus fresh locked GPU pages for the rest, which nothing else can reach: the
//!   transfer writes into them. [`KvCacheManager::commit_import`] commits the tokens (the
//!   blocks enter the reuse tree, a block someone cached meanwhile is rebased onto the
//!   tree's page) and closes the sequence; closing it instead (an abort, a failed
//!   transfer) frees the fresh pages and leaves the tree as it was.

use super::error::KvError;
use super::manager::{KvCacheManager, SeqHandle, SeqOptions};
use super::reuse_key::{BlockKey, ReuseScope};
use crate::ids::{LifeCycleId, PoolGroupId, RequestId, SlotId, Tier, TokenId};
use serde::{Deserialize, Serialize};

/// Where one page of a block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageLoc {
    /// The page's life cycle.
    pub life_cycle: LifeCycleId,
    /// Tier.
    pub tier: Tier,
    /// Pool group.
    pub group: PoolGroupId,
    /// Slot in the group.
    pub slot: SlotId,
}

/// The most pages a block may list per cache when decoded from a peer: one per life
/// cycle, and layouts have a handful.
pub const MAX_BLOCK_PAGES: usize = 256;

/// A full block: its chained reuse key and its pages, one per life cycle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockLoc {
    /// The chained reuse key.
    pub key: BlockKey,
    /// One page per life cycle.
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, MAX_BLOCK_PAGES>")]
    pub pages: Vec<PageLoc>,
}

/// An open import: the handle and how many leading blocks were already cached.
#[derive(Debug)]
pub struct Import {
    /// The import's sequence (commit or close it).
    pub handle: SeqHandle,
    /// Leading blocks already cached here (not to be transferred).
    pub skipped: u32,
    /// The reserved blocks `skipped..`, in prefix order.
    pub blocks: Vec<BlockLoc>,
}

impl KvCacheManager {
    /// The chained reuse keys of the full blocks of `tokens` under `scope` (a trailing
    /// partial block has none).
    pub fn block_keys(&mut self, scope: ReuseScope, tokens: &[TokenId]) -> Vec<BlockKey> {
        let mut parent = scope.root_key();
        tokens
            .chunks_exact(self.tpb as usize)
            .map(|b| {
                parent = self.hasher.block_key(&parent, b);
                parent
            })
            .collect()
    }

    fn whole_blocks(&self, id: RequestId, tokens: &[TokenId]) -> Result<(), KvError> {
        Self::validate_tokens(tokens)?;
        if !self.opts.enable_block_reuse {
            return Err(KvError::Transfer {
                id,
                why: "block reuse is off here: exported or imported blocks live in the reuse \
                      tree; enable enable_block_reuse"
                    .into(),
            });
        }
        if tokens.is_empty() || !(tokens.len() as u64).is_multiple_of(self.tpb) {
            return Err(KvError::Transfer {
                id,
                why: format!(
                    "{} tokens are not a whole number of {}-token blocks: only full blocks \
                     move (the decode engine recomputes the partial tail)",
                    tokens.len(),
                    self.tpb
                ),
            });
        }
        Ok(())
    }

    fn block_locs(&self, pages: &[crate::ids::PageId], keys: &[BlockKey]) -> Vec<BlockLoc> {
        pages
            .chunks_exact(self.n_lc)
            .zip(keys)
            .map(|(ps, &key)| BlockLoc {
                key,
                pages: ps
                    .iter()
                    .map(|&pid| {
                        let p = &self.pages[pid];
                        PageLoc {
                            life_cycle: p.life_cycle,
                            tier: p.tier,
                            group: p.group,
                            slot: p.slot,
                        }
                    })
                    .collect(),
            })
            .collect()
    }

    /// Pins the cached full blocks of `tokens` (the longest cached prefix of its whole
    /// blocks whose bytes are in place) for a transfer to read, wherever they are;
    /// returns the export's handle (close it to release the pins) and the blocks, in
    /// prefix order. Fewer blocks than `tokens` has are returned when the rest is not
    /// cached, or when a block's page is still to be copied between tiers (a copy planned
    /// but not yet run by a step: its slot does not hold the bytes yet); none: an empty
    /// list.
    pub fn export_blocks(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
    ) -> Result<(SeqHandle, Vec<BlockLoc>), KvError> {
        self.reap_dropped();
        self.whole_blocks(id, tokens)?;
        if self.by_id.contains_key(&id) {
            return Err(KvError::DuplicateRequest { id });
        }
        let done = self.clock.completed();
        let m = self.tree.match_prefix(
            &mut self.hasher,
            &scope.root_key(),
            tokens,
            self.tpb as usize,
            false,
        );
        let ready = m
            .full
            .iter()
            .take_while(|&&n| {
                self.tree
                    .node(n)
                    .pages
                    .iter()
                    .all(|&p| self.pages[p].ready <= done)
            })
            .count();
        let lookup = &tokens[..ready * self.tpb as usize];
        let c = self.open(id, scope, lookup, false, false, SeqOptions::default())?;
        let idx = self.seq_index(&c.handle)?;
        self.seq_mut(idx).pinned = true;
        let pages = self.seq(idx).pages.clone();
        for &pid in &pages {
            self.pages[pid].pins += 1;
            self.refresh_queue(pid);
        }
        let keys = self.block_keys(
            scope,
            &tokens[..pages.len() / self.n_lc * self.tpb as usize],
        );
        let blocks = self.block_locs(&pages, &keys);
        self.debug_check();
        Ok((c.handle, blocks))
    }

    /// Reserves pages for importing the full blocks of `tokens`: leading blocks cached
    /// here are skipped (and brought to the GPU), the others get fresh GPU pages. The
    /// fresh pages are writable at once: a reservation whose slots still wait for copies
    /// planned but not yet run (making room offloaded their previous pages) is undone and
    /// refused as `Ok(None)`; it fits after the next step has run those copies.
    /// `Ok(None)` when there is no room on the GPU now, and an error for an import that
    /// can never fit; either way the reservation is undone (no page, hold or tree block
    /// of it stays).
    pub fn begin_import(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
    ) -> Result<Option<Import>, KvError> {
        self.reap_dropped();
        self.whole_blocks(id, tokens)?;
        let mut c = self.open(id, scope, tokens, false, false, SeqOptions::default())?;
        let skipped = c.reused_tokens / self.tpb;
        let placed = self.resume(&c.handle).and_then(|ok| {
            Ok(ok
                && self.resize(&c.handle, tokens.len() as u64, c.reused_tokens)?
                && self.info_of(&c.handle)?.ready_after <= self.clock.completed())
        });
        if placed != Ok(true) {
            // Nothing of the import stays: the held blocks are released.
            self.close(&mut c.handle)?;
            return placed.map(|_| None);
        }
        let idx = self.seq_index(&c.handle)?;
        self.seq_mut(idx).importing = true;
        // The fresh pages in ascending slot order along the prefix (they are private and
        // unwritten, so which block gets which is free): a contiguous set of slots is then
        // one run, one descriptor per pool, whatever order the allocator handed them out
        // in (recycled slots come back last-freed first).
        let n = self.n_lc;
        let blocks = tokens.len() / self.tpb as usize;
        let s = self.seqs[idx].as_mut().expect("invariant: live sequence");
        for lc in 0..n {
            let mut fresh: Vec<_> = (skipped as usize..blocks)
                .map(|b| s.pages[b * n + lc])
                .collect();
            fresh.sort_by_key(|&p| self.pages[p].slot);
            for (k, p) in fresh.into_iter().enumerate() {
                s.pages[(skipped as usize + k) * n + lc] = p;
            }
        }
        // (The import opened the sequence in this call, so its mark is 0 already; kept
        // so that reordering stays marked if that ever changes.)
        s.table_mark = s.table_mark.min(skipped as usize);
        let keys = self.block_keys(scope, tokens);
        self.seq_mut(idx).import_key = keys.last().copied();
        let first = skipped as usize * self.n_lc;
        let blocks = self.block_locs(&self.seq(idx).pages[first..], &keys[skipped as usize..]);
        self.debug_check();
        Ok(Some(Import {
            handle: c.handle,
            skipped: skipped as u32,
            blocks,
        }))
    }

    /// Links the imported blocks into the reuse tree (their bytes have landed) and closes
    /// the import. `tokens` are the tokens `begin_import` was given.
    pub fn commit_import(&mut self, h: &mut SeqHandle, tokens: &[TokenId]) -> Result<(), KvError> {
        self.reap_dropped();
        let idx = self.seq_index(h)?;
        let s = self.seq(idx);
        let done = s.committed() as usize;
        let (root, expected) = (s.scope_key, s.import_key);
        let mut chained = root;
        for b in tokens.chunks_exact(self.tpb as usize) {
            chained = self.hasher.block_key(&chained, b);
        }
        let s = self.seq(idx);
        if tokens.len() as u64 != s.capacity
            || s.tokens[..] != tokens[..done]
            || expected != Some(chained)
        {
            return Err(KvError::Transfer {
                id: s.id,
                why: "commit_import got other tokens than begin_import".into(),
            });
        }
        if !s.importing {
            return Err(KvError::Transfer {
                id: s.id,
                why: "commit_import on a sequence that is not an import".into(),
            });
        }
        self.seq_mut(idx).importing = false;
        if let Err(e) = self.commit(h, &tokens[done..]) {
            self.seq_mut(idx).importing = true;
            return Err(e);
        }
        self.close(h)
    }

    /// Tier and slot of every page a live sequence holds (tests: an export's pages must
    /// not move while it lives).
    #[cfg(test)]
    pub(super) fn seq_page_slots(&self, h: &SeqHandle) -> Vec<(Tier, SlotId)> {
        let idx = self.seq_index(h).expect("live");
        self.seq(idx)
            .pages
            .iter()
            .map(|&p| (self.pages[p].tier, self.pages[p].slot))
            .collect()
    }
}
