//! What moves: the exported blocks, the importer's reserved pages, the pool regions of
//! both sides, and [`plan_writes`], which pairs them into descriptors.
//!
//! A page is one slot of **every** pool of its pool group (MLA rows, NVFP4 scales and
//! indexer keys alike), in every cache (target and draft) and on every device of the
//! engine. The plan is built from the pool regions each side reports; a region missing
//! on either side is an error, never a skipped pool. Contiguous runs (slot `s, s+1, …` on
//! the source and `d, d+1, …` on the destination, same pool) become one descriptor.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::{MemRegion, Segment, WriteBatch};
pub use dsa_kv_core::core::scheduler::BlockPages;
pub use dsa_kv_core::core::PageLoc;
use dsa_kv_core::core::ReuseScope;
use dsa_kv_core::ids::{LifeCycleId, PoolGroupId, RequestId, SlotId, Tier, TokenId};
use dsa_kv_core::layout::Role;

/// The most blocks one transfer moves: a 1M-token prefix of 64-token blocks. An offer,
/// a ticket or a digest list from a peer with more is refused while it is decoded.
pub const MAX_TRANSFER_BLOCKS: usize = 1 << 14;

/// The most tokens an offer from a peer may carry (the longest context any preset
/// serves: 1M tokens).
pub const MAX_TRANSFER_TOKENS: usize = 1 << 20;

/// The most pools a layout may list in a peer's message (V1 layouts have a few per
/// layer, V2 layouts a few in all).
pub const MAX_POOLS: usize = 4096;

/// The most pool regions an engine may announce to a peer (pools × caches × tiers ×
/// devices).
pub const MAX_REGIONS: usize = 1 << 14;

/// The most roles one pool may hold (a pool's buffers: MLA key, scales, indexer key).
pub const MAX_POOL_ROLES: usize = 16;

/// The most window life cycles a tail may list (DeepSeek-V4 has three).
pub const MAX_TAIL_WINDOWS: usize = 64;

/// The most slots one window life cycle's tail may list (a 128-token window in pages
/// of one token, with room to spare).
pub const MAX_TAIL_SLOTS: usize = 1 << 12;

/// Which cache a page belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheKind {
    /// The target model's cache (a windowed model's compressed life cycle: its blocks).
    Target,
    /// The separate MTP draft cache.
    Draft,
    /// A window life cycle of a model with sliding windows (its index among the window
    /// life cycles, in the plan's order): the pages of a tail.
    Window(u16),
}

/// One window life cycle's part of a windowed model's tail: what a request resuming at
/// the transfer's boundary reads from before it (see
/// `dsa_kv_core::core::ModelCache::export_prefix`). Both sides' tails at one boundary
/// have the same first position and the same number of pages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowTail {
    /// The window life cycle (its index among them, the plan's order).
    pub window: u16,
    /// The first position of the tail's first page.
    pub start: u64,
    /// Its pages' slots (GPU tier), in position order.
    #[serde(deserialize_with = "dsa_kv_core::bounded::vec::<_, _, MAX_TAIL_SLOTS>")]
    pub slots: Vec<SlotId>,
}

impl WindowTail {
    /// The tail of `tables` (per window life cycle, the manager's `(start, slots)`).
    pub fn of_tables(tables: Vec<(u64, Vec<SlotId>)>) -> Vec<WindowTail> {
        tables
            .into_iter()
            .enumerate()
            .map(|(w, (start, slots))| WindowTail {
                window: w as u16,
                start,
                slots,
            })
            .collect()
    }

    /// Its pages, tagged with their cache (the window's GPU pools).
    pub fn pages(&self) -> impl Iterator<Item = (CacheKind, PageLoc)> + '_ {
        self.slots.iter().map(|&slot| {
            (
                CacheKind::Window(self.window),
                PageLoc {
                    life_cycle: LifeCycleId(0),
                    tier: Tier::Gpu,
                    group: PoolGroupId(0),
                    slot,
                },
            )
        })
    }
}

/// A block's pages, tagged with their cache: target, then draft.
pub fn block_pages(b: &BlockPages) -> impl Iterator<Item = (CacheKind, PageLoc)> + '_ {
    let t = b.target.iter().map(|p| (CacheKind::Target, *p));
    t.chain(b.draft.iter().map(|p| (CacheKind::Draft, *p)))
}

/// The pages of each unit a transfer moves and checks (one digest each): every block,
/// then the tail as one unit when it moves.
pub fn transfer_units(
    blocks: &[BlockPages],
    tail: &[WindowTail],
) -> Vec<Vec<(CacheKind, PageLoc)>> {
    let mut out: Vec<Vec<(CacheKind, PageLoc)>> =
        blocks.iter().map(|b| block_pages(b).collect()).collect();
    if !tail.is_empty() {
        out.push(tail.iter().flat_map(WindowTail::pages).collect());
    }
    out
}

/// One pool of one cache on one tier of one device, as registered memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolRegion {
    /// Device index inside the engine (tensor-parallel rank).
    pub device: u32,
    /// Target or draft cache.
    pub cache: CacheKind,
    /// Tier.
    pub tier: Tier,
    /// Pool group.
    pub group: PoolGroupId,
    /// Pool inside the group.
    pub pool: u16,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Slots.
    pub slots: u32,
    /// The roles of the buffers in this pool (MLA key, scales, indexer key).
    #[serde(deserialize_with = "dsa_kv_core::bounded::vec::<_, _, MAX_POOL_ROLES>")]
    pub roles: Vec<Role>,
    /// The memory: `slots × slot_bytes` bytes, slot `s` at `addr + s × slot_bytes`.
    pub region: MemRegion,
}

impl PoolRegion {
    /// The address of `slot`; `None` past the pool or past the address space (a
    /// region from a peer is not trusted to be sensible).
    fn slot_addr(&self, slot: SlotId) -> Option<u64> {
        if slot.0 >= self.slots {
            return None;
        }
        self.region
            .addr
            .checked_add(u64::from(slot.0).checked_mul(self.slot_bytes)?)
    }

    /// Whether the region's own numbers hold: `slots × slot_bytes` bytes fit in its
    /// memory, which ends inside the address space.
    fn is_consistent(&self) -> bool {
        u64::from(self.slots)
            .checked_mul(self.slot_bytes)
            .is_some_and(|n| n <= self.region.len)
            && self.region.addr.checked_add(self.region.len).is_some()
    }
}

/// One pool of the engine's layout (the pools every transfer must cover).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PoolRef {
    /// Target or draft cache.
    pub cache: CacheKind,
    /// Pool group.
    pub group: PoolGroupId,
    /// Pool inside the group.
    pub pool: u16,
}

/// The full blocks an engine exported: pinned where they are until released.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportedBlocks {
    /// The export's id (chosen by the caller; releases it).
    pub id: RequestId,
    /// The reuse scope (LoRA, salt) the keys chain from.
    pub scope: ReuseScope,
    /// Tokens of the exported blocks (`blocks.len() × tokens_per_block`).
    #[serde(deserialize_with = "dsa_kv_core::bounded::vec::<_, _, MAX_TRANSFER_TOKENS>")]
    pub tokens: Vec<TokenId>,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// The engine's layout fingerprint: both sides must agree.
    pub layout: String,
    /// Every pool of the layout (both caches): a plan must cover each of them.
    #[serde(deserialize_with = "dsa_kv_core::bounded::vec::<_, _, MAX_POOLS>")]
    pub pools: Vec<PoolRef>,
    /// The blocks, in prefix order.
    #[serde(deserialize_with = "dsa_kv_core::bounded::vec::<_, _, MAX_TRANSFER_BLOCKS>")]
    pub blocks: Vec<BlockPages>,
    /// A model with sliding windows: the tail at the last block's boundary, per window
    /// life cycle (empty for a model without windows).
    #[serde(
        default,
        deserialize_with = "dsa_kv_core::bounded::vec::<_, _, MAX_TAIL_WINDOWS>"
    )]
    pub tail: Vec<WindowTail>,
}

/// The importer's reservation: pages for the blocks it did not hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportTicket {
    /// The import's id on the importer.
    pub id: RequestId,
    /// The export it answers (the exporter's id).
    pub export: RequestId,
    /// Leading blocks already cached here: not transferred.
    pub skipped: u32,
    /// The importer's layout fingerprint.
    pub layout: String,
    /// Every pool of the importer's layout (both caches).
    #[serde(deserialize_with = "dsa_kv_core::bounded::vec::<_, _, MAX_POOLS>")]
    pub pools: Vec<PoolRef>,
    /// Pages reserved for blocks `skipped..`, in prefix order.
    #[serde(deserialize_with = "dsa_kv_core::bounded::vec::<_, _, MAX_TRANSFER_BLOCKS>")]
    pub blocks: Vec<BlockPages>,
    /// A model with sliding windows: pages reserved for the export's tail, per window
    /// life cycle; empty when this engine keeps a tail at the boundary already (nothing
    /// of the windows moves) or the model has no windows.
    #[serde(
        default,
        deserialize_with = "dsa_kv_core::bounded::vec::<_, _, MAX_TAIL_WINDOWS>"
    )]
    pub tail: Vec<WindowTail>,
    /// Milliseconds from the ticket's issue within which every byte must have landed
    /// (the importer's window closes then; its lease ends a drain margin later).
    pub write_within_ms: u64,
    /// The same deadline as a moment of the importer's process (not sent: `None` on
    /// the exporter's side).
    #[serde(skip)]
    pub write_by: Option<Instant>,
}

impl ImportTicket {
    /// The bytes the exporter may write for this import: every reserved page's slot in
    /// every pool of its group, in both caches, on every device, as ranges of
    /// `regions` (the importer's own
    /// `KvCacheHandle::transfer_regions`),
    /// adjacent ranges merged, sorted.
    /// A transport window opened with them accepts writes there and nowhere else.
    pub fn write_ranges(&self, regions: &[PoolRegion]) -> Result<Vec<MemRegion>, PlanError> {
        let mut out: Vec<MemRegion> = Vec::new();
        for r in regions {
            if !r.is_consistent() {
                return Err(PlanError::BadPage {
                    what: format!(
                        "region: pool {} of group {} claims {} slots of {} B in {} B at {:#x}",
                        r.pool, r.group, r.slots, r.slot_bytes, r.region.len, r.region.addr
                    ),
                });
            }
        }
        for unit in transfer_units(&self.blocks, &self.tail) {
            for (cache, p) in unit {
                let mut found = false;
                for r in regions
                    .iter()
                    .filter(|r| (r.cache, r.tier, r.group) == (cache, p.tier, p.group))
                {
                    let addr = r.slot_addr(p.slot).ok_or_else(|| PlanError::BadPage {
                        what: format!(
                            "slot {} of the ticket: pool {} of group {} has {} slots",
                            p.slot, r.pool, r.group, r.slots
                        ),
                    })?;
                    out.push(MemRegion {
                        addr,
                        len: r.slot_bytes,
                        mem: r.region.mem,
                    });
                    found = true;
                }
                if !found {
                    return Err(PlanError::MissingRegion {
                        side: "destination",
                        device: 0,
                        cache,
                        tier: p.tier,
                        group: p.group,
                        pool: 0,
                    });
                }
            }
        }
        out.sort_by_key(|m| (m.mem_key(), m.addr));
        let mut merged: Vec<MemRegion> = Vec::with_capacity(out.len());
        for m in out {
            match merged.last_mut() {
                Some(l) if l.mem == m.mem && l.addr + l.len == m.addr => l.len += m.len,
                _ => merged.push(m),
            }
        }
        Ok(merged)
    }
}

/// Why two sides cannot be paired.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The engines' layouts differ (model, dtypes, layout kind, caches).
    #[error("the engines' KV layouts differ (exporter {exporter}, importer {importer}): both must run the same model, dtypes, layout and draft cache")]
    LayoutMismatch {
        /// The exporter's fingerprint.
        exporter: String,
        /// The importer's fingerprint.
        importer: String,
    },
    /// The ticket does not describe the exported blocks.
    #[error("the import ticket does not match the export: {0}")]
    TicketMismatch(String),
    /// A pool region one side needs is not in its region list.
    #[error("no {side} region for device {device}, {cache:?} cache, {tier} tier, group {group}, pool {pool}: register every pool of both sides")]
    MissingRegion {
        /// `"source"` or `"destination"`.
        side: &'static str,
        /// Device.
        device: u32,
        /// Cache.
        cache: CacheKind,
        /// Tier.
        tier: Tier,
        /// Group.
        group: PoolGroupId,
        /// Pool.
        pool: u16,
    },
    /// A page's slot is outside its pool, or the two sides' slot sizes differ.
    #[error("bad page {what}")]
    BadPage {
        /// What was wrong.
        what: String,
    },
}

/// The writes of one transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WritePlan {
    /// Batches by (source memory, destination memory).
    pub batches: Vec<WriteBatch>,
    /// Pages moved (per cache, life cycle and device).
    pub pages: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Descriptors before coalescing (one per page per pool).
    pub uncoalesced: usize,
    /// Per source pool: its region and the range of each of its segments in `batches`
    /// (`(batch, segment)`), for reports and the mutation drills.
    pub per_pool: Vec<(PoolRegion, Vec<(usize, usize)>)>,
}

impl WritePlan {
    /// Descriptors posted.
    pub fn descriptors(&self) -> usize {
        self.batches.iter().map(|b| b.segments.len()).sum()
    }

    /// The same plan without the segments of the source pools `drop` selects. Only for
    /// mutation drills: it proves a checker notices what such a transfer leaves behind
    /// (a real transfer never drops a pool). Feature `testing`.
    #[cfg(any(test, feature = "testing"))]
    pub fn without_pools(&self, drop: impl Fn(&PoolRegion) -> bool) -> WritePlan {
        let mut gone = std::collections::HashSet::new();
        for (r, segs) in &self.per_pool {
            if drop(r) {
                gone.extend(segs.iter().copied());
            }
        }
        let mut out = self.clone();
        out.per_pool.retain(|(r, _)| !drop(r));
        for (bi, b) in out.batches.iter_mut().enumerate() {
            let mut i = 0;
            b.segments.retain(|_| {
                let keep = !gone.contains(&(bi, i));
                i += 1;
                keep
            });
        }
        out.bytes = out.batches.iter().map(WriteBatch::bytes).sum();
        out
    }
}

type PoolKey = (u32, CacheKind, Tier, PoolGroupId, u16);

fn index_regions(regions: &[PoolRegion]) -> BTreeMap<PoolKey, &PoolRegion> {
    regions
        .iter()
        .map(|r| ((r.device, r.cache, r.tier, r.group, r.pool), r))
        .collect()
}

/// The importer's tail pages must answer the exporter's tail: the same window life
/// cycles in order, each starting at the same position with as many pages.
fn check_tails(export: &[WindowTail], ticket: &[WindowTail]) -> Result<(), PlanError> {
    let shape = |v: &[WindowTail]| -> Vec<(u16, u64, usize)> {
        v.iter()
            .map(|w| (w.window, w.start, w.slots.len()))
            .collect()
    };
    if shape(export) != shape(ticket) {
        return Err(PlanError::TicketMismatch(format!(
            "the ticket's tail (window, first position, pages) is {:?}, the export's {:?}",
            shape(ticket),
            shape(export)
        )));
    }
    Ok(())
}

/// Pairs the exported blocks `export.blocks[ticket.skipped..]` with the ticket's pages
/// (and, for a model with sliding windows, the export's tail with the ticket's tail
/// pages, when the ticket has them) and both sides' pool regions into writes: every
/// pool of every page's group, on every device, one descriptor per contiguous run.
pub fn plan_writes(
    export: &ExportedBlocks,
    src: &[PoolRegion],
    ticket: &ImportTicket,
    dst: &[PoolRegion],
) -> Result<WritePlan, PlanError> {
    if export.layout != ticket.layout {
        return Err(PlanError::LayoutMismatch {
            exporter: export.layout.clone(),
            importer: ticket.layout.clone(),
        });
    }
    if ticket.export != export.id {
        return Err(PlanError::TicketMismatch(format!(
            "ticket {} answers export {}, not export {}",
            ticket.id, ticket.export, export.id
        )));
    }
    let skipped = ticket.skipped as usize;
    if skipped + ticket.blocks.len() != export.blocks.len() {
        return Err(PlanError::TicketMismatch(format!(
            "{} skipped + {} reserved blocks for {} exported",
            skipped,
            ticket.blocks.len(),
            export.blocks.len()
        )));
    }
    for (side, regions) in [("source", src), ("destination", dst)] {
        if let Some(r) = regions.iter().find(|r| !r.is_consistent()) {
            return Err(PlanError::BadPage {
                what: format!(
                    "region: the {side}'s pool {} of group {} claims {} slots of {} B in {} B at {:#x}",
                    r.pool, r.group, r.slots, r.slot_bytes, r.region.len, r.region.addr
                ),
            });
        }
    }
    let (src_ix, dst_ix) = (index_regions(src), index_regions(dst));
    let devices = |ix: &BTreeMap<PoolKey, &PoolRegion>| {
        let mut d: Vec<u32> = ix.keys().map(|k| k.0).collect();
        d.dedup();
        d
    };
    let devs = devices(&src_ix);
    if devs != devices(&dst_ix) {
        return Err(PlanError::TicketMismatch(format!(
            "the exporter has devices {devs:?}, the importer {:?}: both engines need the same tensor-parallel size",
            devices(&dst_ix)
        )));
    }
    // Every pool of each group: the pool ids the exporter registered for it.
    let pools = |ix: &BTreeMap<PoolKey, &PoolRegion>| {
        let mut of: BTreeMap<(CacheKind, PoolGroupId), Vec<u16>> = BTreeMap::new();
        for k in ix.keys() {
            let v = of.entry((k.1, k.3)).or_default();
            if !v.contains(&k.4) {
                v.push(k.4);
            }
        }
        of
    };
    let pools_of = pools(&src_ix);
    // The layout's own pool list, not the regions handed in, says what must be covered.
    let mut ours = export.pools.clone();
    ours.sort();
    let mut theirs = ticket.pools.clone();
    theirs.sort();
    if ours != theirs {
        return Err(PlanError::TicketMismatch(format!(
            "the exporter's layout has pools {ours:?}, the importer's {theirs:?}"
        )));
    }
    let mut want: BTreeMap<(CacheKind, PoolGroupId), Vec<u16>> = BTreeMap::new();
    for p in &ours {
        want.entry((p.cache, p.group)).or_default().push(p.pool);
    }
    let mut have = pools_of.clone();
    have.values_mut().for_each(|v| v.sort());
    if have != want {
        return Err(PlanError::TicketMismatch(format!(
            "the source regions cover pools {have:?}, the layout has {want:?}: register every \
             pool of both caches"
        )));
    }
    if pools_of != pools(&dst_ix) {
        return Err(PlanError::TicketMismatch(format!(
            "the exporter registered pools {pools_of:?} (cache, group → pools), the importer {:?}",
            pools(&dst_ix)
        )));
    }
    // (source pool key, destination pool key) → (source slot, destination slot) pairs.
    let mut runs: BTreeMap<(PoolKey, PoolKey), Vec<(u32, u32)>> = BTreeMap::new();
    // (source page, destination page), tagged with their cache.
    let mut paired: Vec<((CacheKind, PageLoc), (CacheKind, PageLoc))> = Vec::new();
    for (e, t) in export.blocks[skipped..].iter().zip(&ticket.blocks) {
        if e.key != t.key {
            return Err(PlanError::TicketMismatch(format!(
                "block key {} where the export has {}",
                t.key, e.key
            )));
        }
        if (e.target.len(), e.draft.len()) != (t.target.len(), t.draft.len()) {
            return Err(PlanError::TicketMismatch(format!(
                "block {} has {}+{} (target+draft) pages here and {}+{} on the exporter",
                e.key,
                t.target.len(),
                t.draft.len(),
                e.target.len(),
                e.draft.len()
            )));
        }
        paired.extend(block_pages(e).zip(block_pages(t)));
    }
    if !ticket.tail.is_empty() {
        check_tails(&export.tail, &ticket.tail)?;
        for (e, t) in export.tail.iter().zip(&ticket.tail) {
            paired.extend(e.pages().zip(t.pages()));
        }
    }
    let mut pages = 0u64;
    for ((cache, sp), (_, dp)) in paired {
        if (sp.life_cycle, sp.group) != (dp.life_cycle, dp.group) {
            return Err(PlanError::TicketMismatch(format!(
                "page {sp:?} paired with {dp:?}"
            )));
        }
        let pools = pools_of
            .get(&(cache, sp.group))
            .ok_or_else(|| PlanError::MissingRegion {
                side: "source",
                device: devs.first().copied().unwrap_or(0),
                cache,
                tier: sp.tier,
                group: sp.group,
                pool: 0,
            })?;
        for &d in &devs {
            for &p in pools {
                let sk = (d, cache, sp.tier, sp.group, p);
                let dk = (d, cache, dp.tier, dp.group, p);
                let missing = |side, k: PoolKey| PlanError::MissingRegion {
                    side,
                    device: k.0,
                    cache: k.1,
                    tier: k.2,
                    group: k.3,
                    pool: k.4,
                };
                let s = src_ix.get(&sk).ok_or_else(|| missing("source", sk))?;
                let t = dst_ix.get(&dk).ok_or_else(|| missing("destination", dk))?;
                if s.slot_bytes != t.slot_bytes {
                    return Err(PlanError::BadPage {
                        what: format!(
                            "size: pool {p} of group {} is {} B per slot on the exporter and {} B on the importer",
                            sp.group, s.slot_bytes, t.slot_bytes
                        ),
                    });
                }
                for (side, r, slot) in [("source", s, sp.slot), ("destination", t, dp.slot)] {
                    if slot.0 >= r.slots {
                        return Err(PlanError::BadPage {
                            what: format!(
                                "slot {slot} on the {side}: pool {p} of group {} has {} slots",
                                sp.group, r.slots
                            ),
                        });
                    }
                }
                runs.entry((sk, dk))
                    .or_default()
                    .push((sp.slot.0, dp.slot.0));
            }
            pages += 1;
        }
    }
    let mut batches: Vec<WriteBatch> = Vec::new();
    let mut per_pool: BTreeMap<PoolKey, Vec<(usize, usize)>> = BTreeMap::new();
    let mut uncoalesced = 0;
    let mut bytes = 0;
    for ((sk, dk), mut pairs) in runs {
        let (s, t) = (src_ix[&sk], dst_ix[&dk]);
        let bi = match batches
            .iter()
            .position(|b| (b.src_mem, b.dst_mem) == (s.region.mem, t.region.mem))
        {
            Some(i) => i,
            None => {
                batches.push(WriteBatch {
                    src_mem: s.region.mem,
                    dst_mem: t.region.mem,
                    segments: Vec::new(),
                });
                batches.len() - 1
            }
        };
        uncoalesced += pairs.len();
        pairs.sort_unstable();
        let mut i = 0;
        while i < pairs.len() {
            let (s0, d0) = pairs[i];
            let mut n = 1;
            let at = |k: usize| (u64::from(s0) + k as u64, u64::from(d0) + k as u64);
            while i + n < pairs.len()
                && (u64::from(pairs[i + n].0), u64::from(pairs[i + n].1)) == at(n)
            {
                n += 1;
            }
            let len = n as u64 * s.slot_bytes;
            per_pool
                .entry(sk)
                .or_default()
                .push((bi, batches[bi].segments.len()));
            // Both slots were checked against their pools above, and consistent
            // regions end inside the address space.
            batches[bi].segments.push(Segment {
                src: s
                    .slot_addr(SlotId(s0))
                    .expect("invariant: a checked slot of a consistent region"),
                dst: t
                    .slot_addr(SlotId(d0))
                    .expect("invariant: a checked slot of a consistent region"),
                len,
            });
            bytes += len;
            i += n;
        }
    }
    Ok(WritePlan {
        batches,
        pages,
        bytes,
        uncoalesced,
        per_pool: per_pool
            .into_iter()
            .map(|(k, v)| (src_ix[&k].clone(), v))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::MemKind;
    use dsa_kv_core::core::BlockKey;
    use dsa_kv_core::ids::LifeCycleId;

    fn region(cache: CacheKind, tier: Tier, pool: u16, addr: u64, slot_bytes: u64) -> PoolRegion {
        PoolRegion {
            device: 0,
            cache,
            tier,
            group: PoolGroupId(0),
            pool,
            slot_bytes,
            slots: 16,
            roles: vec![if pool == 0 { Role::Key } else { Role::IndexKey }],
            region: MemRegion {
                addr,
                len: 16 * slot_bytes,
                mem: MemKind::Host,
            },
        }
    }

    fn block(k: u8, slots: &[(CacheKind, Tier, u32)]) -> BlockPages {
        let pages = |c: CacheKind| {
            slots
                .iter()
                .filter(|s| s.0 == c)
                .map(|&(_, tier, s)| PageLoc {
                    life_cycle: LifeCycleId(0),
                    tier,
                    group: PoolGroupId(0),
                    slot: SlotId(s),
                })
                .collect()
        };
        BlockPages {
            key: BlockKey([k; 32]),
            target: pages(Target),
            draft: pages(Draft),
        }
    }

    use CacheKind::{Draft, Target, Window};
    use Tier::{Gpu, Host};

    fn pools() -> Vec<PoolRef> {
        let p = |cache, pool| PoolRef {
            cache,
            group: PoolGroupId(0),
            pool,
        };
        vec![p(Target, 0), p(Target, 1), p(Draft, 0), p(Draft, 1)]
    }

    fn sides() -> (
        ExportedBlocks,
        Vec<PoolRegion>,
        ImportTicket,
        Vec<PoolRegion>,
    ) {
        // Four blocks; block 0 is already cached on the importer. Source slots 3, 4, 9
        // (the last one on the host tier); destination slots 0, 1, 2.
        let export = ExportedBlocks {
            id: RequestId(5),
            scope: ReuseScope::SHARED,
            tokens: vec![TokenId(1); 256],
            tokens_per_block: 64,
            layout: "L".into(),
            pools: pools(),
            blocks: vec![
                block(1, &[(Target, Gpu, 7), (Draft, Gpu, 7)]),
                block(2, &[(Target, Gpu, 3), (Draft, Gpu, 3)]),
                block(3, &[(Target, Gpu, 4), (Draft, Gpu, 4)]),
                block(4, &[(Target, Host, 9), (Draft, Host, 9)]),
            ],
            tail: Vec::new(),
        };
        let ticket = ImportTicket {
            id: RequestId(70),
            export: RequestId(5),
            write_within_ms: 28_000,
            write_by: None,
            skipped: 1,
            layout: "L".into(),
            pools: pools(),
            blocks: vec![
                block(2, &[(Target, Gpu, 0), (Draft, Gpu, 0)]),
                block(3, &[(Target, Gpu, 1), (Draft, Gpu, 1)]),
                block(4, &[(Target, Gpu, 2), (Draft, Gpu, 2)]),
            ],
            tail: Vec::new(),
        };
        let mut src = Vec::new();
        let mut dst = Vec::new();
        for (i, cache) in [Target, Draft].into_iter().enumerate() {
            let base = 0x10_0000 * (i as u64 + 1);
            src.push(region(cache, Gpu, 0, base, 1000));
            src.push(region(cache, Gpu, 1, base + 0x1_0000, 100));
            src.push(region(cache, Host, 0, base + 0x2_0000, 1000));
            src.push(region(cache, Host, 1, base + 0x3_0000, 100));
            dst.push(region(cache, Gpu, 0, base + 0x80_0000, 1000));
            dst.push(region(cache, Gpu, 1, base + 0x81_0000, 100));
        }
        (export, src, ticket, dst)
    }

    #[test]
    fn every_pool_of_every_cache_with_runs_coalesced() {
        let (export, src, ticket, dst) = sides();
        let plan = plan_writes(&export, &src, &ticket, &dst).unwrap();
        // 3 blocks × 2 caches = 6 pages; 2 pools each = 12 page copies.
        assert_eq!(plan.pages, 6);
        assert_eq!(plan.uncoalesced, 12);
        assert_eq!(plan.bytes, 6 * 1100);
        // Per cache and pool: GPU slots 3,4 → 0,1 is one run; host slot 9 → 2 another.
        assert_eq!(plan.descriptors(), 8);
        assert_eq!(plan.batches.len(), 1);
        let segs = &plan.batches[0].segments;
        // Target, GPU, pool 0: slots 3..5 → 0..2, one segment of 2000 bytes.
        assert!(segs.contains(&Segment {
            src: 0x10_0000 + 3000,
            dst: 0x90_0000,
            len: 2000
        }));
        // Draft, host, pool 1: slot 9 → slot 2.
        assert!(segs.contains(&Segment {
            src: 0x20_0000 + 0x3_0000 + 900,
            dst: 0xA1_0000 + 200,
            len: 100
        }));
        // Dropping the indexer pools removes exactly their segments.
        let mutated = plan.without_pools(|r| r.roles.contains(&Role::IndexKey));
        assert_eq!(mutated.descriptors(), 4);
        assert_eq!(mutated.bytes, 6 * 1000);
    }

    #[test]
    fn mismatches_are_refused() {
        let (export, src, ticket, dst) = sides();
        let mut t = ticket.clone();
        t.layout = "other".into();
        assert!(matches!(
            plan_writes(&export, &src, &t, &dst),
            Err(PlanError::LayoutMismatch { .. })
        ));
        let mut t = ticket.clone();
        t.blocks[1].key = BlockKey([9; 32]);
        assert!(matches!(
            plan_writes(&export, &src, &t, &dst),
            Err(PlanError::TicketMismatch(_))
        ));
        // A destination without the draft cache's indexer pool: refused, not skipped.
        let d: Vec<_> = dst
            .iter()
            .filter(|r| !(r.cache == Draft && r.pool == 1))
            .cloned()
            .collect();
        assert!(matches!(
            plan_writes(&export, &src, &ticket, &d),
            Err(PlanError::TicketMismatch(_))
        ));
        // A source without the host tier of that pool (block 4 lives there).
        let s: Vec<_> = src
            .iter()
            .filter(|r| !(r.cache == Draft && r.pool == 1 && r.tier == Host))
            .cloned()
            .collect();
        assert!(matches!(
            plan_writes(&export, &s, &ticket, &dst),
            Err(PlanError::MissingRegion {
                side: "source",
                cache: Draft,
                tier: Host,
                pool: 1,
                ..
            })
        ));
        // Both sides leave the indexer pool out of their regions: the layout's pool list
        // still requires it.
        let no_ix = |v: &[PoolRegion]| -> Vec<PoolRegion> {
            v.iter().filter(|r| r.pool != 1).cloned().collect()
        };
        assert!(matches!(
            plan_writes(&export, &no_ix(&src), &ticket, &no_ix(&dst)),
            Err(PlanError::TicketMismatch(_))
        ));
        // A region claiming more slots than its bytes hold.
        let mut big = dst.clone();
        big[0].slots = u32::MAX;
        assert!(matches!(
            plan_writes(&export, &src, &ticket, &big),
            Err(PlanError::BadPage { .. })
        ));
        let mut t = ticket.clone();
        t.blocks[0].target[0].slot = SlotId(16);
        assert!(matches!(
            plan_writes(&export, &src, &t, &dst),
            Err(PlanError::BadPage { .. })
        ));
        // A ticket answering another export.
        let mut t = ticket.clone();
        t.export = RequestId(6);
        assert!(matches!(
            plan_writes(&export, &src, &t, &dst),
            Err(PlanError::TicketMismatch(_))
        ));
        // The audit's peer-supplied address: a remote region ending past the address
        // space is refused (it used to overflow: a panic in a debug build, a wrapped
        // address in a release build).
        let mut wrap = dst.clone();
        for r in &mut wrap {
            r.region.addr = u64::MAX - 10;
        }
        assert!(matches!(
            plan_writes(&export, &src, &ticket, &wrap),
            Err(PlanError::BadPage { .. })
        ));
        assert!(ticket.write_ranges(&wrap).is_err());
    }

    #[test]
    fn write_ranges_are_the_reserved_slots_of_every_pool() {
        let (_, _, ticket, dst) = sides();
        let r = ticket.write_ranges(&dst).unwrap();
        // Destination slots 0, 1, 2 of each of the four pools (two caches × two pools),
        // adjacent slots merged: one range of three slots per pool.
        let want: Vec<MemRegion> = [
            (0x90_0000, 1000),
            (0x91_0000, 100),
            (0xA0_0000, 1000),
            (0xA1_0000, 100),
        ]
        .iter()
        .map(|&(addr, slot)| MemRegion {
            addr,
            len: 3 * slot,
            mem: MemKind::Host,
        })
        .collect();
        assert_eq!(r, want);
        // Without the draft cache's regions: refused, not skipped.
        let d: Vec<_> = dst.iter().filter(|r| r.cache == Target).cloned().collect();
        assert!(matches!(
            ticket.write_ranges(&d),
            Err(PlanError::MissingRegion { cache: Draft, .. })
        ));
    }

    fn tail(spans: &[(u64, &[u32])]) -> Vec<WindowTail> {
        WindowTail::of_tables(
            spans
                .iter()
                .map(|(start, slots)| (*start, slots.iter().map(|&s| SlotId(s)).collect()))
                .collect(),
        )
    }

    /// A windowed model's transfer: the tail's pages land in the window pools (one
    /// region per window life cycle and pool), next to the blocks; a ticket without tail
    /// pages (the importer keeps a tail there) moves none; a tail of another shape, or a
    /// window pool missing on either side, is refused.
    #[test]
    fn a_tail_moves_into_the_window_pools_with_the_blocks() {
        let (mut export, mut src, mut ticket, mut dst) = sides();
        // Window 0: two pages of 64 B (pool 0) and 8 B (pool 1); window 1: one page of
        // 32 B; window 2: none (a ratio-128 state at the boundary).
        let windows: [(u16, &[u64]); 3] = [(0, &[64, 8]), (1, &[32]), (2, &[16])];
        for (w, sizes) in windows {
            for (pool, &n) in sizes.iter().enumerate() {
                let mut r = region(Window(w), Gpu, pool as u16, 0, n);
                r.roles = vec![Role::WindowKey];
                let base = 0x40_0000 + 0x1_0000 * (u64::from(w) * 4 + pool as u64);
                src.push(PoolRegion {
                    region: MemRegion {
                        addr: base,
                        ..r.region
                    },
                    ..r.clone()
                });
                dst.push(PoolRegion {
                    region: MemRegion {
                        addr: base + 0x80_0000,
                        ..r.region
                    },
                    ..r
                });
                for side in [&mut export.pools, &mut ticket.pools] {
                    side.push(PoolRef {
                        cache: Window(w),
                        group: PoolGroupId(0),
                        pool: pool as u16,
                    });
                }
            }
        }
        export.tail = tail(&[(384, &[5, 6]), (508, &[2]), (512, &[])]);
        ticket.tail = tail(&[(384, &[0, 1]), (508, &[9]), (512, &[])]);
        let plan = plan_writes(&export, &src, &ticket, &dst).unwrap();
        // 6 block pages as before, and 3 tail pages.
        assert_eq!(plan.pages, 6 + 3);
        assert_eq!(plan.bytes, 6 * 1100 + 2 * 72 + 32);
        // Window 0's slots 5, 6 → 0, 1: one segment per pool.
        let segs = &plan.batches[0].segments;
        assert!(segs.contains(&Segment {
            src: 0x40_0000 + 5 * 64,
            dst: 0xC0_0000,
            len: 128
        }));
        assert!(segs.contains(&Segment {
            src: 0x41_0000 + 5 * 8,
            dst: 0xC1_0000,
            len: 16
        }));
        assert!(segs.contains(&Segment {
            src: 0x44_0000 + 2 * 32,
            dst: 0xC4_0000 + 9 * 32,
            len: 32
        }));
        assert_eq!(plan.descriptors(), 8 + 3);
        // The window ranges the importer opens: its tail slots, nothing else of them.
        let ranges = ticket.write_ranges(&dst).unwrap();
        let window_ranges: Vec<&MemRegion> =
            ranges.iter().filter(|m| m.addr >= 0xC0_0000).collect();
        assert_eq!(
            window_ranges,
            [
                &MemRegion {
                    addr: 0xC0_0000,
                    len: 128,
                    mem: MemKind::Host
                },
                &MemRegion {
                    addr: 0xC1_0000,
                    len: 16,
                    mem: MemKind::Host
                },
                &MemRegion {
                    addr: 0xC4_0000 + 9 * 32,
                    len: 32,
                    mem: MemKind::Host
                },
            ]
        );
        // Dropping the window pools removes exactly the tail's bytes (the drill).
        let mutated = plan.without_pools(|r| matches!(r.cache, Window(_)));
        assert_eq!(mutated.bytes, 6 * 1100);
        // The importer keeps a tail at the boundary: nothing of the windows moves.
        let mut held = ticket.clone();
        held.tail.clear();
        let p = plan_writes(&export, &src, &held, &dst).unwrap();
        assert_eq!((p.pages, p.bytes), (6, 6 * 1100));
        // A tail of another shape: refused.
        for bad in [
            tail(&[(320, &[0, 1]), (508, &[9]), (512, &[])]),
            tail(&[(384, &[0]), (508, &[9]), (512, &[])]),
            tail(&[(384, &[0, 1]), (508, &[9])]),
        ] {
            let mut t = ticket.clone();
            t.tail = bad;
            assert!(matches!(
                plan_writes(&export, &src, &t, &dst),
                Err(PlanError::TicketMismatch(_))
            ));
        }
        // A tail where the export has none: refused.
        let mut e = export.clone();
        e.tail.clear();
        assert!(matches!(
            plan_writes(&e, &src, &ticket, &dst),
            Err(PlanError::TicketMismatch(_))
        ));
        // A tail slot past its pool: refused.
        let mut t = ticket.clone();
        t.tail[1].slots[0] = SlotId(16);
        assert!(matches!(
            plan_writes(&export, &src, &t, &dst),
            Err(PlanError::BadPage { .. })
        ));
        assert!(t.write_ranges(&dst).is_err());
        // The importer without window 1's pool: refused, not skipped.
        let d: Vec<_> = dst
            .iter()
            .filter(|r| r.cache != Window(1))
            .cloned()
            .collect();
        assert!(plan_writes(&export, &src, &ticket, &d).is_err());
        assert!(matches!(
            ticket.write_ranges(&d),
            Err(PlanError::MissingRegion {
                cache: Window(1),
                ..
            })
        ));
    }
}
