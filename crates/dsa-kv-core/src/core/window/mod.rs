//! DeepSeek-V4's window life cycles (the raw sliding window and the compressor states):
//! pages a sequence needs only for a while.
//!
//! * **Rings.** Per sequence and window life cycle, a run of pages covering positions
//!   `[start, end)`, `start` page-aligned. [`ensure`](WindowCache::ensure) appends pages
//!   so the next step's writes fit; [`commit`](WindowCache::commit) frees the pages
//!   that lie wholly behind what the next query reads ([`WindowSpec::reads_from`]).
//! * **Tails.** When a 256-token block ending at `E` is committed, the pages covering the
//!   `tail_tokens` positions before `E` can be linked to that block's key (by the same
//!   [`commit`](WindowCache::commit), before it frees anything): a request that later resumes at `E` (a
//!   prefix hit) starts its rings from them ([`open`](WindowCache::open)) and reads them
//!   in place. `E` is a multiple of every page size, so a tail is whole pages, all
//!   before every position any sequence writes: tail pages are never written again.
//! * **Eviction.** Tails are dropped least recently used first when a ring needs room
//!   ([`ensure`](WindowCache::ensure) evicts only when that makes it succeed), or when
//!   their block leaves the prefix tree ([`drop_tail`](WindowCache::drop_tail)).
//! * **Fences.** A freed slot is released with the last issued fence (a step in flight
//!   may still read it); a slot handed out before that fence completed makes the
//!   sequence's next step wait ([`wait_for`](WindowCache::wait_for)), as in the block
//!   manager.
//!
//! Every operation either succeeds or changes nothing (eviction to make room happens
//! only when the room then suffices).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use super::fence::Fence;
use super::reuse_key::BlockKey;
use super::slot_allocator::SlotAllocator;
use crate::ids::{LifeCycleId, RequestId, SlotId};
use crate::layout::{Retention, V4Plan};

#[cfg(test)]
mod tests;

/// Use stamps below this mark demoted tails (evicted before every other tail).
const DEMOTED_STAMPS: u64 = 1 << 48;

/// One window life cycle's geometry.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct WindowSpec {
    /// The life cycle (its slot space).
    pub life_cycle: LifeCycleId,
    /// Tokens per page (slot).
    pub tokens_per_page: u32,
    /// The most positions a query reads, itself included.
    pub retain: u32,
    /// Positions before a block boundary that a request resuming there reads.
    pub tail_tokens: u32,
}

impl WindowSpec {
    /// The group the reads align to: `retain − tail_tokens` (the raw window: 1; a ratio-4
    /// state: 4; a ratio-128 state: 128).
    pub fn group(&self) -> u64 {
        u64::from(self.retain - self.tail_tokens)
    }

    /// The lowest position a query at `q` reads: `q − 127` for the raw window; for a
    /// compressor state, the start of the previous group that the entry being built at `q`
    /// pools from (ratio 4: `4·⌊q/4⌋ − 4`; ratio 128: `128·⌊q/128⌋`). Never decreasing in
    /// `q`, so what one query does not read no later query does.
    pub fn reads_from(&self, q: u64) -> u64 {
        let g = self.group();
        let back = u64::from(self.tail_tokens) / g;
        (q / g).saturating_sub(back) * g
    }
}

impl WindowSpec {
    /// The window life cycles of `plan`, by id.
    pub fn of_plan(plan: &V4Plan) -> Vec<WindowSpec> {
        plan.life_cycles()
            .iter()
            .filter_map(|lc| match lc.retention {
                Retention::Full => None,
                Retention::Window { tokens } => Some(WindowSpec {
                    life_cycle: lc.id,
                    tokens_per_page: lc.tokens_per_page,
                    retain: tokens,
                    tail_tokens: lc.tail_tokens,
                }),
            })
            .collect()
    }

    fn page(&self) -> u64 {
        u64::from(self.tokens_per_page)
    }

    /// Pages of a tail at a boundary.
    fn tail_pages(&self) -> u64 {
        u64::from(self.tail_tokens).div_ceil(self.page())
    }
}

/// What the window cache refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WindowError {
    /// No open sequence has this id.
    #[error("request {id} has no window rings: it was never opened here or was closed")]
    UnknownRequest {
        /// The id.
        id: RequestId,
    },
    /// The id is open already.
    #[error("request {id} already has window rings: close it first")]
    DuplicateRequest {
        /// The id.
        id: RequestId,
    },
    /// A resume point without a tail.
    #[error("no window tail is kept for block {key}: resume at a block that has one")]
    NoTail {
        /// The block.
        key: BlockKey,
    },
    /// A boundary that is not a block boundary, or not one the rings can link.
    #[error("request {id}: cannot link a tail at position {boundary}: {why}")]
    BadTail {
        /// The request.
        id: RequestId,
        /// The boundary.
        boundary: u64,
        /// Why.
        why: &'static str,
    },
    /// A window life cycle index past the specs.
    #[error("window life cycle {lc} does not exist: there are {count}")]
    NoLifeCycle {
        /// The index given.
        lc: usize,
        /// Window life cycles.
        count: usize,
    },
    /// A geometry that is not a window: empty pages, or a tail that is not whole groups
    /// shorter than the retention.
    #[error("window life cycle {spec:?}: pages must hold tokens, and the tail must be whole groups shorter than the retention")]
    BadSpec {
        /// The spec.
        spec: WindowSpec,
    },
    /// A slot count per life cycle that does not match the specs.
    #[error(
        "window slots {got:?}: give one non-zero count per window life cycle ({want} of them)"
    )]
    BadSlots {
        /// The counts given.
        got: Vec<u32>,
        /// Life cycles.
        want: usize,
    },
}

/// A page: a slot of one window life cycle and who holds it.
#[derive(Clone, Debug)]
struct Page {
    lc: usize,
    slot: SlotId,
    /// Rings holding it (0 or 1 for a page a ring wrote; any number for a tail's page).
    ring_refs: u32,
    /// Tails holding it.
    tail_refs: u32,
    /// In use (else in the free list).
    live: bool,
}

/// A sequence's rings: per window life cycle, the first position of the first page and
/// the pages, in position order.
#[derive(Clone, Debug)]
struct Rings {
    start: Vec<u64>,
    pages: Vec<VecDeque<u32>>,
    /// Committed positions (everything before is final).
    committed: u64,
    /// The fence the sequence's next step must wait for (slots handed out early).
    wait_for: Fence,
}

impl Rings {
    fn end(&self, lc: usize, spec: &WindowSpec) -> u64 {
        self.start[lc] + self.pages[lc].len() as u64 * spec.page()
    }
}

/// A tail: the pages covering the positions before `boundary`, per life cycle.
#[derive(Clone, Debug)]
struct Tail {
    boundary: u64,
    pages: Vec<Vec<u32>>,
    stamp: u64,
}

/// Counters.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug, serde::Serialize)]
pub struct WindowStats {
    /// Tails linked.
    pub tails_linked: u64,
    /// Tails a sequence resumed from.
    pub tails_adopted: u64,
    /// Tails evicted to make room.
    pub tails_evicted: u64,
    /// Tails dropped because their block left the tree, or released by policy.
    pub tails_dropped: u64,
    /// Pages freed behind the window.
    pages_freed_behind: u64,
}

impl WindowStats {
    /// Pages freed behind the window.
    pub fn pages_freed_behind(&self) -> u64 {
        self.pages_freed_behind
    }
}

/// The window life cycles' pages, rings and tails.
#[derive(Debug)]
pub struct WindowCache {
    specs: Vec<WindowSpec>,
    alloc: Vec<SlotAllocator>,
    pages: Vec<Page>,
    free_pages: Vec<u32>,
    seqs: HashMap<RequestId, Rings>,
    tails: BTreeMap<BlockKey, Tail>,
    /// Tails by last use (demoted tails first).
    lru: BTreeSet<(u64, BlockKey)>,
    /// The next use stamp (starts above every demotion stamp).
    stamp: u64,
    /// The next demotion stamp.
    demoted: u64,
    stats: WindowStats,
    /// Tails linked (`true`) and removed (`false`) since the last
    /// [`take_tail_log`](Self::take_tail_log), while [`log_tails`](Self::log_tails) is on.
    tail_log: Vec<(BlockKey, bool)>,
    log_tails: bool,
}

impl WindowCache {
    /// A cache for `specs` with `slots[i]` slots in life cycle `specs[i]`.
    pub fn new(specs: Vec<WindowSpec>, slots: Vec<u32>) -> Result<Self, WindowError> {
        for spec in &specs {
            let ok = spec.tokens_per_page > 0
                && spec.retain > spec.tail_tokens
                && u64::from(spec.tail_tokens).is_multiple_of(spec.group());
            if !ok {
                return Err(WindowError::BadSpec { spec: *spec });
            }
        }
        if slots.len() != specs.len() || slots.contains(&0) {
            return Err(WindowError::BadSlots {
                got: slots,
                want: specs.len(),
            });
        }
        Ok(WindowCache {
            alloc: slots.iter().map(|&n| SlotAllocator::new(n)).collect(),
            specs,
            pages: Vec::new(),
            free_pages: Vec::new(),
            seqs: HashMap::new(),
            tails: BTreeMap::new(),
            lru: BTreeSet::new(),
            stamp: DEMOTED_STAMPS,
            demoted: 0,
            stats: WindowStats::default(),
            tail_log: Vec::new(),
            log_tails: false,
        })
    }

    /// The life cycles.
    pub fn specs(&self) -> &[WindowSpec] {
        &self.specs
    }

    /// Counters.
    pub fn stats(&self) -> WindowStats {
        self.stats
    }

    /// Slots in use per life cycle.
    pub fn used_slots(&self) -> Vec<u32> {
        self.alloc.iter().map(SlotAllocator::num_occupied).collect()
    }

    /// Tails kept.
    pub fn num_tails(&self) -> usize {
        self.tails.len()
    }

    /// The blocks that have a tail.
    pub fn tail_keys(&self) -> impl Iterator<Item = &BlockKey> {
        self.tails.keys()
    }

    /// Whether a tail is kept for `key`.
    pub fn has_tail(&self, key: &BlockKey) -> bool {
        self.tails.contains_key(key)
    }

    /// Open sequences.
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    fn rings(&self, id: RequestId) -> Result<&Rings, WindowError> {
        self.seqs.get(&id).ok_or(WindowError::UnknownRequest { id })
    }

    /// `id`'s rings and the spec of window life cycle `lc`.
    fn rings_lc(&self, id: RequestId, lc: usize) -> Result<(&Rings, &WindowSpec), WindowError> {
        let spec = self.specs.get(lc).ok_or(WindowError::NoLifeCycle {
            lc,
            count: self.specs.len(),
        })?;
        Ok((self.rings(id)?, spec))
    }

    /// Opens `id`'s rings at position 0, or at the boundary of the tail kept for `resume`
    /// (its pages become the rings' first pages, shared and read-only). Returns the
    /// position the rings start serving from (0 or the tail's boundary).
    pub fn open(&mut self, id: RequestId, resume: Option<&BlockKey>) -> Result<u64, WindowError> {
        if self.seqs.contains_key(&id) {
            return Err(WindowError::DuplicateRequest { id });
        }
        let n = self.specs.len();
        let mut rings = Rings {
            start: vec![0; n],
            pages: vec![VecDeque::new(); n],
            committed: 0,
            wait_for: Fence::NONE,
        };
        if let Some(key) = resume {
            let tail = self
                .tails
                .get(key)
                .ok_or(WindowError::NoTail { key: *key })?;
            let boundary = tail.boundary;
            for (lc, spec) in self.specs.iter().enumerate() {
                rings.start[lc] = boundary - spec.tail_pages() * spec.page();
                rings.pages[lc] = tail.pages[lc].iter().copied().collect();
            }
            rings.committed = boundary;
            for lc_pages in &rings.pages {
                for &p in lc_pages {
                    self.pages[p as usize].ring_refs += 1;
                }
            }
            self.touch(key);
            self.stats.tails_adopted += 1;
        }
        let at = rings.committed;
        self.seqs.insert(id, rings);
        Ok(at)
    }

    /// Opens empty rings for `id` positioned as if `at` positions were committed: each
    /// life cycle's ring starts at the page holding what the next query reads
    /// ([`reads_from`](WindowSpec::reads_from)`(at)`). [`ensure`](Self::ensure)`(id, at,
    /// ..)` then gives fresh pages for exactly a tail's span before `at`: the pages an
    /// import writes before [`commit`](Self::commit) links them as the tail at `at`.
    pub fn open_at(&mut self, id: RequestId, at: u64) -> Result<(), WindowError> {
        if self.seqs.contains_key(&id) {
            return Err(WindowError::DuplicateRequest { id });
        }
        let n = self.specs.len();
        let start = self
            .specs
            .iter()
            .map(|s| s.reads_from(at) / s.page() * s.page())
            .collect();
        self.seqs.insert(
            id,
            Rings {
                start,
                pages: vec![VecDeque::new(); n],
                committed: at,
                wait_for: Fence::NONE,
            },
        );
        Ok(())
    }

    fn touch(&mut self, key: &BlockKey) {
        self.stamp += 1;
        if let Some(t) = self.tails.get_mut(key) {
            self.lru.remove(&(t.stamp, *key));
            t.stamp = self.stamp;
            self.lru.insert((t.stamp, *key));
        }
    }

    /// Pages each life cycle would need for `id`'s rings to reach position `end`.
    fn needed(&self, rings: &Rings, end: u64) -> Vec<u64> {
        self.specs
            .iter()
            .enumerate()
            .map(|(lc, spec)| {
                end.saturating_sub(rings.end(lc, spec))
                    .div_ceil(spec.page())
            })
            .collect()
    }

    /// Slots each life cycle would have free if every tail were dropped.
    fn reclaimable(&self) -> Vec<u64> {
        let mut out: Vec<u64> = self
            .alloc
            .iter()
            .map(|a| u64::from(a.available()))
            .collect();
        for (i, p) in self.pages.iter().enumerate() {
            if p.live && p.ring_refs == 0 {
                debug_assert!(p.tail_refs > 0, "page {i}: a live page is held");
                out[p.lc] += 1;
            }
        }
        out
    }

    /// Whether [`ensure`](Self::ensure)`(id, end, ..)` would succeed now (changes
    /// nothing). Dropping tails only adds room, so it still would after any tails go.
    pub fn fits(&self, id: RequestId, end: u64) -> Result<bool, WindowError> {
        let need = self.needed(self.rings(id)?, end);
        let free = |(&n, a): (&u64, &SlotAllocator)| n <= u64::from(a.available());
        if need.iter().zip(&self.alloc).all(free) {
            return Ok(true);
        }
        Ok(need.iter().zip(&self.reclaimable()).all(|(n, c)| n <= c))
    }

    /// Checks what [`commit`](Self::commit) would check (changes nothing).
    pub fn check_commit(
        &self,
        id: RequestId,
        committed: u64,
        tails: &[(u64, BlockKey)],
        block_tokens: u64,
    ) -> Result<(), WindowError> {
        let rings = self.rings(id)?;
        if committed < rings.committed {
            return Err(WindowError::BadTail {
                id,
                boundary: committed,
                why: "committed positions never go back",
            });
        }
        for &(boundary, _) in tails {
            self.tail_pages_at(id, boundary, committed, block_tokens)?;
        }
        Ok(())
    }

    /// Extends `id`'s rings so positions up to `end` (exclusive) can be written. With too
    /// few free slots, tails are evicted (least recently used first) when that makes room;
    /// `Ok(false)`, nothing changed, when even that would not. `completed`: the last
    /// completed fence (slots freed after it are handed out with a wait); `issued`: the
    /// last issued one (an evicted tail's page may still be read by a step in flight).
    pub fn ensure(
        &mut self,
        id: RequestId,
        end: u64,
        completed: Fence,
        issued: Fence,
    ) -> Result<bool, WindowError> {
        let rings = self.rings(id)?;
        let need = self.needed(rings, end);
        let short = |cache: &WindowCache| {
            need.iter()
                .zip(&cache.alloc)
                .any(|(&n, a)| n > u64::from(a.available()))
        };
        if short(self) {
            let could = self.reclaimable();
            if need.iter().zip(&could).any(|(n, c)| n > c) {
                return Ok(false);
            }
            while short(self) {
                let &(_, key) = self
                    .lru
                    .iter()
                    .next()
                    .expect("invariant: reclaimable room means a tail is left to drop");
                self.remove_tail(&key, issued);
                self.stats.tails_evicted += 1;
            }
        }
        let mut wait = Fence::NONE;
        let mut added: Vec<(usize, u32)> = Vec::new();
        for (lc, &n) in need.iter().enumerate() {
            for _ in 0..n {
                let grant = self.alloc[lc]
                    .allocate(completed)
                    .expect("invariant: availability was checked");
                if let Some(f) = grant.wait_for {
                    wait = wait.max(f);
                }
                let page = Page {
                    lc,
                    slot: grant.slot,
                    ring_refs: 1,
                    tail_refs: 0,
                    live: true,
                };
                let pid = match self.free_pages.pop() {
                    Some(p) => {
                        self.pages[p as usize] = page;
                        p
                    }
                    None => {
                        self.pages.push(page);
                        (self.pages.len() - 1) as u32
                    }
                };
                added.push((lc, pid));
            }
        }
        let rings = self.seqs.get_mut(&id).expect("invariant: checked above");
        for (lc, pid) in added {
            rings.pages[lc].push_back(pid);
        }
        rings.wait_for = rings.wait_for.max(wait);
        Ok(true)
    }

    /// Drops one ring or tail reference of each page; frees those nobody holds.
    fn unref(&mut self, pids: impl IntoIterator<Item = u32>, ring: bool, last_use: Fence) {
        for pid in pids {
            let p = &mut self.pages[pid as usize];
            if ring {
                p.ring_refs -= 1;
            } else {
                p.tail_refs -= 1;
            }
            if p.ring_refs == 0 && p.tail_refs == 0 {
                p.live = false;
                self.alloc[p.lc]
                    .release(p.slot, last_use)
                    .expect("invariant: a live page's slot is occupied");
                self.free_pages.push(pid);
            }
        }
    }

    /// Records that `id` has `committed` final positions, links the tails of the blocks
    /// given (`(boundary, key)`: boundaries it has now committed, in any order), then frees
    /// every page wholly behind what its next query reads
    /// ([`reads_from`](WindowSpec::reads_from)`(committed)`).
    /// `issued`: the last fence issued (a step in flight may still read a freed page).
    /// A bad tail refuses the whole call, nothing changed.
    pub fn commit(
        &mut self,
        id: RequestId,
        committed: u64,
        tails: &[(u64, BlockKey)],
        block_tokens: u64,
        issued: Fence,
    ) -> Result<(), WindowError> {
        self.check_commit(id, committed, tails, block_tokens)?;
        let mut linked = Vec::with_capacity(tails.len());
        for &(boundary, key) in tails {
            linked.push((
                key,
                boundary,
                self.tail_pages_at(id, boundary, committed, block_tokens)?,
            ));
        }
        for (key, boundary, pages) in linked {
            self.link(key, boundary, pages);
        }
        // Field borrows: the specs are read while the rings change (no copy per step).
        let specs = &self.specs;
        let rings = self.seqs.get_mut(&id).expect("invariant: checked above");
        rings.committed = committed;
        let mut freed = Vec::new();
        for (lc, spec) in specs.iter().enumerate() {
            let low = spec.reads_from(committed);
            while rings.start[lc] + spec.page() <= low {
                match rings.pages[lc].pop_front() {
                    Some(p) => freed.push(p),
                    None => break,
                }
                rings.start[lc] += spec.page();
            }
            if rings.pages[lc].is_empty() {
                // Nothing held: the ring restarts at the page holding `low`.
                rings.start[lc] = low / spec.page() * spec.page();
            }
        }
        self.stats.pages_freed_behind += freed.len() as u64;
        self.unref(freed, true, issued);
        Ok(())
    }

    /// Frees `id`'s pages wholly at or past position `end` (capacity given back after a
    /// rollback). Positions before the committed ones are never given back.
    pub fn truncate(&mut self, id: RequestId, end: u64, issued: Fence) -> Result<(), WindowError> {
        let specs = &self.specs;
        let rings = self
            .seqs
            .get_mut(&id)
            .ok_or(WindowError::UnknownRequest { id })?;
        let end = end.max(rings.committed);
        let mut freed = Vec::new();
        for (lc, spec) in specs.iter().enumerate() {
            while !rings.pages[lc].is_empty() && rings.end(lc, spec) - spec.page() >= end {
                freed.push(rings.pages[lc].pop_back().expect("invariant: not empty"));
            }
        }
        self.unref(freed, true, issued);
        Ok(())
    }

    /// The pages of `id`'s rings covering the positions before `boundary`, a block
    /// boundary at or before `committed`.
    fn tail_pages_at(
        &self,
        id: RequestId,
        boundary: u64,
        committed: u64,
        block_tokens: u64,
    ) -> Result<Vec<Vec<u32>>, WindowError> {
        let rings = self.rings(id)?;
        let bad = |why| WindowError::BadTail { id, boundary, why };
        if boundary == 0 || block_tokens == 0 || !boundary.is_multiple_of(block_tokens) {
            return Err(bad("not a positive multiple of the block size"));
        }
        if boundary > committed {
            return Err(bad("past the committed positions"));
        }
        let mut pages = Vec::with_capacity(self.specs.len());
        for (lc, spec) in self.specs.iter().enumerate() {
            if !boundary.is_multiple_of(spec.page()) {
                return Err(bad("not a multiple of every page size"));
            }
            let n = spec.tail_pages();
            let Some(first) = boundary.checked_sub(n * spec.page()) else {
                return Err(bad("its tail would start before position 0"));
            };
            if n > 0 && (first < rings.start[lc] || boundary > rings.end(lc, spec)) {
                return Err(bad(
                    "the rings no longer hold its pages (a boundary committed earlier)",
                ));
            }
            let skip = (first.saturating_sub(rings.start[lc]) / spec.page()) as usize;
            pages.push(
                rings.pages[lc]
                    .iter()
                    .skip(skip)
                    .take(n as usize)
                    .copied()
                    .collect(),
            );
        }
        Ok(pages)
    }

    /// Keeps `pages` as the tail of `key`; a tail kept already is only marked used (same
    /// prefix, same bytes).
    fn link(&mut self, key: BlockKey, boundary: u64, pages: Vec<Vec<u32>>) {
        if self.tails.contains_key(&key) {
            self.touch(&key);
            return;
        }
        for &p in pages.iter().flatten() {
            self.pages[p as usize].tail_refs += 1;
        }
        self.stamp += 1;
        self.tails.insert(
            key,
            Tail {
                boundary,
                pages,
                stamp: self.stamp,
            },
        );
        self.lru.insert((self.stamp, key));
        self.stats.tails_linked += 1;
        if self.log_tails {
            self.tail_log.push((key, true));
        }
    }

    fn remove_tail(&mut self, key: &BlockKey, last_use: Fence) -> bool {
        let Some(t) = self.tails.remove(key) else {
            return false;
        };
        self.lru.remove(&(t.stamp, *key));
        self.unref(t.pages.into_iter().flatten(), false, last_use);
        if self.log_tails {
            self.tail_log.push((*key, false));
        }
        true
    }

    /// Starts or stops logging which tails are linked and removed (off: the log is
    /// emptied and stays so).
    pub fn log_tails(&mut self, on: bool) {
        self.log_tails = on;
        if !on {
            self.tail_log = Vec::new();
        }
    }

    /// Tails linked (`true`) and removed (`false`) since the last call, in order.
    pub fn take_tail_log(&mut self) -> Vec<(BlockKey, bool)> {
        std::mem::take(&mut self.tail_log)
    }

    /// Makes the tail of `key` the next to be evicted (after those demoted earlier) while
    /// keeping it usable: the retention policy's way of saying nobody is likely to resume
    /// there. A later use (a resume, a new link of the same block) promotes it again.
    /// Whether one was kept.
    pub fn demote(&mut self, key: &BlockKey) -> bool {
        let Some(t) = self.tails.get_mut(key) else {
            return false;
        };
        self.lru.remove(&(t.stamp, *key));
        self.demoted += 1;
        t.stamp = self.demoted;
        self.lru.insert((t.stamp, *key));
        true
    }

    /// Whether the tail of `key` is demoted.
    pub fn is_demoted(&self, key: &BlockKey) -> bool {
        self.tails
            .get(key)
            .is_some_and(|t| t.stamp < DEMOTED_STAMPS)
    }

    /// Drops the tail of `key` (its block left the prefix tree, or the retention policy
    /// let it go); its pages are freed unless a ring still reads them. Whether one was
    /// kept.
    pub fn drop_tail(&mut self, key: &BlockKey, issued: Fence) -> bool {
        let dropped = self.remove_tail(key, issued);
        self.stats.tails_dropped += u64::from(dropped);
        dropped
    }

    /// Drops every tail (the prefix tree was cleared).
    pub fn drop_all_tails(&mut self, issued: Fence) {
        let keys: Vec<BlockKey> = self.tails.keys().copied().collect();
        for k in keys {
            self.drop_tail(&k, issued);
        }
    }

    /// Closes `id`: every page only it held is freed.
    pub fn close(&mut self, id: RequestId, issued: Fence) -> Result<(), WindowError> {
        let rings = self
            .seqs
            .remove(&id)
            .ok_or(WindowError::UnknownRequest { id })?;
        self.unref(rings.pages.into_iter().flatten(), true, issued);
        Ok(())
    }

    /// The fence `id`'s next step must wait for before writing its new pages.
    pub fn wait_for(&self, id: RequestId) -> Result<Fence, WindowError> {
        Ok(self.rings(id)?.wait_for)
    }

    /// `id`'s page table of window life cycle `lc` (an index into [`specs`](Self::specs)):
    /// the first position its first page holds, and the slots in position order (slot
    /// `i` holds positions `[start + i·P, start + (i+1)·P)`).
    pub fn page_table(&self, id: RequestId, lc: usize) -> Result<(u64, Vec<SlotId>), WindowError> {
        let (rings, _) = self.rings_lc(id, lc)?;
        Ok((
            rings.start[lc],
            rings.pages[lc]
                .iter()
                .map(|&p| self.pages[p as usize].slot)
                .collect(),
        ))
    }

    /// The slot holding position `pos` of `id` in life cycle `lc`, if its rings hold it.
    pub fn slot_of(
        &self,
        id: RequestId,
        lc: usize,
        pos: u64,
    ) -> Result<Option<SlotId>, WindowError> {
        let (rings, spec) = self.rings_lc(id, lc)?;
        if pos < rings.start[lc] {
            return Ok(None);
        }
        let i = ((pos - rings.start[lc]) / spec.page()) as usize;
        Ok(rings.pages[lc].get(i).map(|&p| self.pages[p as usize].slot))
    }

    /// Whether `id` may write position `pos` of life cycle `lc`: its rings hold the page,
    /// nobody else does, and no tail does.
    pub fn writable(&self, id: RequestId, lc: usize, pos: u64) -> Result<bool, WindowError> {
        let (rings, spec) = self.rings_lc(id, lc)?;
        if pos < rings.start[lc] || pos < rings.committed {
            return Ok(false);
        }
        let i = ((pos - rings.start[lc]) / spec.page()) as usize;
        Ok(rings.pages[lc].get(i).is_some_and(|&p| {
            let p = &self.pages[p as usize];
            p.ring_refs == 1 && p.tail_refs == 0
        }))
    }

    /// Checks every internal invariant (tests; panics with the broken rule).
    pub fn check_invariants(&self) {
        let n = self.pages.len();
        let mut ring = vec![0u32; n];
        let mut tail = vec![0u32; n];
        for r in self.seqs.values() {
            for (lc, pages) in r.pages.iter().enumerate() {
                assert!(
                    r.start[lc].is_multiple_of(self.specs[lc].page()),
                    "ring start page-aligned"
                );
                for &p in pages {
                    assert_eq!(
                        self.pages[p as usize].lc, lc,
                        "a ring page of its life cycle"
                    );
                    ring[p as usize] += 1;
                }
            }
        }
        for (key, t) in &self.tails {
            assert!(self.lru.contains(&(t.stamp, *key)), "every tail in the LRU");
            for (lc, pages) in t.pages.iter().enumerate() {
                assert_eq!(
                    pages.len() as u64,
                    self.specs[lc].tail_pages(),
                    "whole tails"
                );
                for &p in pages {
                    tail[p as usize] += 1;
                }
            }
        }
        assert_eq!(self.lru.len(), self.tails.len(), "LRU entries are tails");
        let mut live = vec![0u32; self.specs.len()];
        let mut slots = BTreeSet::new();
        assert_eq!(
            self.pages.iter().filter(|p| !p.live).count(),
            self.free_pages.len(),
            "the free list is the dead pages"
        );
        for (i, p) in self.pages.iter().enumerate() {
            if !p.live {
                assert_eq!((ring[i], tail[i]), (0, 0), "a free page is held by nobody");
                continue;
            }
            assert_eq!(
                (p.ring_refs, p.tail_refs),
                (ring[i], tail[i]),
                "page {i} refs"
            );
            assert!(p.ring_refs + p.tail_refs > 0, "a live page is held");
            assert!(
                self.alloc[p.lc].is_occupied(p.slot),
                "a live page's slot is occupied"
            );
            assert!(
                slots.insert((p.lc, p.slot)),
                "no two live pages share a slot"
            );
            live[p.lc] += 1;
        }
        for (lc, a) in self.alloc.iter().enumerate() {
            assert_eq!(a.num_occupied(), live[lc], "occupied slots are live pages");
        }
    }
}
