//! A model with sliding windows (DeepSeek-V4) on a device: [`V4Pools`], the byte pools
//! a [`V4Plan`] lays out (per life cycle, per tier, per pool), [`WindowedView`] (where
//! each life cycle's GPU pools are, for the forward: [`CacheView::windowed`]),
//! [`PoolBytes`] (a forward's access to them by life cycle and pool: the device's own
//! pools, or a batch's host memory) and [`WindowedHostDevice`], the host backend of such
//! a model: a [`DeviceBackend`] whose step runs the plan's copies (offload, onboarding)
//! then the [`Forward`] over a [`Batch`] whose requests carry their block rows and
//! window page tables.

use std::time::Instant;

use dsa_kv_core::core::scheduler::StepPlan;
use dsa_kv_core::core::WindowedSlots;
use dsa_kv_core::ids::{SlotId, Tier};
use dsa_kv_core::layout::{Retention, V4Plan};
use dsa_kv_core::metadata::{MetadataDims, MetadataLayout, StepMetadata};
use dsa_kv_core::ops::CopyPlan;

use crate::backend::{
    digest_pools, DeviceBackend, DeviceError, DeviceStepReport, Mismatch, VerifySpec,
};
use crate::forward::{
    Batch, BatchMemory, CacheView, Forward, ForwardError, HostMemory, MetadataView, Phase, Region,
    Sampling,
};
use crate::transfer::{CacheKind, MemKind, MemRegion, PoolRegion};

/// Where a windowed model's GPU pools are: per life cycle of its plan (plan order), per
/// pool, the region. Part of the batch's [`CacheView`].
#[derive(Clone, Debug, PartialEq)]
pub struct WindowedView {
    /// The plan (which buffer of which layer lives where, in which format).
    pub plan: V4Plan,
    /// Per life cycle, per pool: its GPU-tier bytes.
    pub pools: Vec<Vec<Region>>,
}

impl WindowedView {
    /// The index among the window life cycles of life cycle `lc` (plan order), if it is
    /// one (the order of a request's `window_tables`).
    pub fn window_index(&self, lc: usize) -> Option<usize> {
        window_index(&self.plan, lc)
    }

    /// Window life cycles.
    pub fn window_life_cycles(&self) -> usize {
        window_life_cycles(&self.plan)
    }
}

fn window_index(plan: &V4Plan, lc: usize) -> Option<usize> {
    let lcs = plan.life_cycles();
    if lcs.get(lc)?.retention == Retention::Full {
        return None;
    }
    Some(
        lcs[..lc]
            .iter()
            .filter(|l| l.retention != Retention::Full)
            .count(),
    )
}

fn window_life_cycles(plan: &V4Plan) -> usize {
    plan.life_cycles()
        .iter()
        .filter(|l| l.retention != Retention::Full)
        .count()
}

/// A forward's access to a windowed model's GPU-tier pools by life cycle and pool: the
/// device's own [`V4Pools`], or a [`Batch`]'s host memory ([`BatchPools`]). A pool the
/// plan does not have is empty.
pub trait PoolBytes {
    /// The plan.
    fn plan(&self) -> &V4Plan;
    /// The bytes of pool `pool` of life cycle `lc`.
    fn gpu_pool(&self, lc: usize, pool: usize) -> &[u8];
    /// The same, writable.
    fn gpu_pool_mut(&mut self, lc: usize, pool: usize) -> &mut [u8];
    /// The index among the window life cycles of life cycle `lc`, if it is one.
    fn window_index(&self, lc: usize) -> Option<usize> {
        window_index(self.plan(), lc)
    }
    /// Window life cycles.
    fn window_life_cycles(&self) -> usize {
        window_life_cycles(self.plan())
    }
}

/// A host batch's pools, found by the regions of its [`WindowedView`].
pub struct BatchPools<'v, 'm, 'a> {
    view: &'v WindowedView,
    host: &'m mut HostMemory<'a>,
}

impl<'v, 'm, 'a> BatchPools<'v, 'm, 'a> {
    /// The pools of a host batch: `None` when the batch is not on the host or its cache
    /// has no windows.
    pub fn of(batch: &'m mut Batch<'a>) -> Option<BatchPools<'a, 'm, 'a>> {
        let view = batch.cache.windowed.as_ref()?;
        let host = batch.host()?;
        Some(BatchPools { view, host })
    }
}

impl PoolBytes for BatchPools<'_, '_, '_> {
    fn plan(&self) -> &V4Plan {
        &self.view.plan
    }

    fn gpu_pool(&self, lc: usize, pool: usize) -> &[u8] {
        match self.view.pools.get(lc).and_then(|p| p.get(pool)) {
            Some(r) => self.host.bytes(r.addr, r.bytes).unwrap_or(&[]),
            None => &[],
        }
    }

    fn gpu_pool_mut(&mut self, lc: usize, pool: usize) -> &mut [u8] {
        match self.view.pools.get(lc).and_then(|p| p.get(pool)) {
            Some(r) => self.host.bytes_mut(r.addr, r.bytes).unwrap_or(&mut []),
            None => &mut [],
        }
    }
}

impl PoolBytes for V4Pools {
    fn plan(&self) -> &V4Plan {
        &self.plan
    }

    fn gpu_pool(&self, lc: usize, pool: usize) -> &[u8] {
        self.pool(lc, Tier::Gpu, pool)
    }

    fn gpu_pool_mut(&mut self, lc: usize, pool: usize) -> &mut [u8] {
        self.pool_mut(lc, Tier::Gpu, pool)
    }
}

/// One device of the host backend for a windowed model: [`V4Pools`] in host memory and
/// a [`Forward`]. See the module docs.
pub struct WindowedHostDevice {
    index: usize,
    pools: V4Pools,
    view: CacheView,
    /// The DSA kernels' step metadata does not apply to a windowed model: the batch's
    /// metadata buffers stay empty (a forward reads each request's `block_slots` and
    /// `window_tables`).
    meta: StepMetadata,
    forward: Box<dyn Forward>,
}

impl WindowedHostDevice {
    /// Device `index` with zeroed pools for `plan` and `slots` (as the cache was built
    /// with), running `forward`.
    pub fn new(
        index: usize,
        plan: &V4Plan,
        slots: &WindowedSlots,
        forward: Box<dyn Forward>,
    ) -> Result<Self, DeviceError> {
        let mut pools = V4Pools::new(plan, slots).map_err(|source| DeviceError::Pools {
            device: index,
            source,
        })?;
        let regions = pools
            .bytes
            .iter_mut()
            .map(|tiers| {
                tiers[0]
                    .iter_mut()
                    .map(|b| Region {
                        addr: b.as_mut_ptr() as u64,
                        bytes: b.len() as u64,
                    })
                    .collect()
            })
            .collect();
        let view = windowed_cache_view(plan, regions);
        let meta = windowed_step_metadata(plan).map_err(|source| DeviceError::Pools {
            device: index,
            source,
        })?;
        Ok(WindowedHostDevice {
            index,
            pools,
            view,
            meta,
            forward,
        })
    }

    /// The pools.
    pub fn pools(&self) -> &V4Pools {
        &self.pools
    }
}

/// The pool regions of a windowed model's pools on device `device`, as a transport
/// registers them: the compressed life cycle's as the target cache's pool group 0 (GPU
/// and host tiers: the blocks), each window life cycle's as [`CacheKind::Window`] (GPU:
/// the tails). `pool(lc, tier, pool)` gives a pool's memory and slots (`None`, or no
/// slots: not on that tier). Each region's roles are the plan's buffers in that pool.
pub fn windowed_regions(
    device: usize,
    plan: &V4Plan,
    pool: impl Fn(usize, Tier, usize) -> Option<(MemRegion, u32)>,
) -> Vec<PoolRegion> {
    let mut out = Vec::new();
    for (i, lc) in plan.life_cycles().iter().enumerate() {
        let (cache, tiers): (CacheKind, &[Tier]) = match window_index(plan, i) {
            None => (CacheKind::Target, &Tier::ALL),
            Some(w) => (CacheKind::Window(w as u16), &[Tier::Gpu]),
        };
        for &tier in tiers {
            for (j, p) in lc.pools.iter().enumerate() {
                let Some((region, slots)) = pool(i, tier, j).filter(|(_, n)| *n > 0) else {
                    continue;
                };
                let roles = crate::backend::sorted_roles(
                    plan.buffers()
                        .iter()
                        .filter(|b| b.life_cycle == lc.id && b.pool == p.id)
                        .map(|b| b.role),
                );
                out.push(PoolRegion {
                    device: device as u32,
                    cache,
                    tier,
                    group: dsa_kv_core::ids::PoolGroupId(0),
                    pool: p.id.get(),
                    slot_bytes: p.slot_bytes(),
                    slots,
                    roles,
                    region,
                });
            }
        }
    }
    out
}

/// A windowed model's forward that writes nothing and samples nothing
/// ([`Sampling::ByEngine`]: the engine commits its tokens): the default of a windowed
/// preset on the host backend, for tests, tools and an embedder's first steps. A model's
/// own forward (e.g. `dsa_kv_model::v4::V4ModelForward`) writes and reads the pools.
#[derive(Clone, Copy, Debug, Default)]
pub struct WritesNothing;

impl Forward for WritesNothing {
    fn forward(&mut self, _: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        Ok(Sampling::ByEngine)
    }
}

/// The cache view of a windowed device whose pools are `regions` (per life cycle of
/// `plan`, per pool, its GPU-tier bytes): no DSA layers, the [`WindowedView`].
pub fn windowed_cache_view(plan: &V4Plan, regions: Vec<Vec<Region>>) -> CacheView {
    CacheView {
        layers: Vec::new(),
        tokens_per_block: plan.tokens_per_block(),
        windowed: Some(WindowedView {
            plan: plan.clone(),
            pools: regions,
        }),
    }
}

/// The step metadata a windowed device binds to its batches: the smallest of the
/// compressed life cycle's layout (a windowed forward reads its tables from the planned
/// requests, not from the DSA metadata).
pub fn windowed_step_metadata(plan: &V4Plan) -> Result<StepMetadata, PoolError> {
    let setup = |what: String| PoolError::Setup(what);
    let blocks = plan
        .compressed_pool_plan()
        .ok_or_else(|| setup("the plan has no compressed life cycle".into()))?;
    let layout = MetadataLayout::from_plan(&blocks).map_err(|e| setup(e.to_string()))?;
    let dims = MetadataDims {
        max_num_sequences: 1,
        max_blocks_per_seq: 4,
        max_num_tokens: 1,
        max_context_kv_tokens: 1,
    };
    StepMetadata::new(layout, dims, None, false).map_err(|e| setup(e.to_string()))
}

impl DeviceBackend for WindowedHostDevice {
    fn index(&self) -> usize {
        self.index
    }

    fn execute_step(&mut self, plan: &StepPlan) -> Result<DeviceStepReport, DeviceError> {
        let start = Instant::now();
        if !plan.draft_copies.is_empty() {
            return Err(DeviceError::NoDraftCache { device: self.index });
        }
        let copies = self
            .pools
            .apply(&plan.copies)
            .map_err(|source| DeviceError::Pools {
                device: self.index,
                source,
            })?;
        let meta = &self.meta;
        let pools = self
            .pools
            .bytes
            .iter_mut()
            .flat_map(|tiers| tiers[0].iter_mut().map(Vec::as_mut_slice));
        let mut batch = Batch {
            step: plan.step,
            device: self.index,
            phase: Phase::Target,
            requests: &plan.requests,
            cache: &self.view,
            metadata: MetadataView::of(meta, |r| meta.mirror_bytes(r).as_ptr() as u64),
            host_meta: meta,
            memory: BatchMemory::Host(HostMemory::new(pools, meta)),
            extension: None,
        };
        let sampling = batch
            .run(&mut *self.forward)
            .map_err(|e| DeviceError::forward(self.index, e))?;
        let mut r = DeviceStepReport::new(self.index, plan);
        r.tokens_written = plan.requests.iter().map(|p| p.tokens.len() as u64).sum();
        r.slot_copies = copies;
        r.sampling = sampling;
        r.elapsed_us = start.elapsed().as_micros() as u64;
        Ok(r)
    }

    /// Verification is off for a windowed model (no synthetic writer to predict its
    /// bytes; its cache is checked against its unpaged run): nothing is read back.
    fn verify(&mut self, _: &[VerifySpec]) -> Result<(u64, Vec<Mismatch>), DeviceError> {
        Ok((0, Vec::new()))
    }

    fn pool_regions(&mut self) -> Vec<PoolRegion> {
        let plan = self.pools.plan.clone();
        let bytes = &self.pools.bytes;
        windowed_regions(self.index, &plan, |lc, tier, pool| {
            let b = bytes.get(lc)?[tier_index(tier)].get(pool)?;
            let slot = plan.life_cycles()[lc].pools[pool].slot_bytes();
            let region = MemRegion {
                addr: b.as_ptr() as u64,
                len: b.len() as u64,
                mem: MemKind::Host,
            };
            Some((region, (b.len() as u64 / slot.max(1)) as u32))
        })
    }

    fn cache_digest(&mut self) -> Result<String, DeviceError> {
        let pools = self
            .pools
            .bytes
            .iter()
            .flat_map(|t| t[0].iter().map(Vec::as_slice));
        Ok(digest_pools(pools))
    }
}

/// Pools that cannot be built, or a copy outside them.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// Pools that cannot be built for the plan and slots.
    #[error("windowed pools: {0}")]
    Setup(String),
    /// A copy outside the pools.
    #[error("windowed pool copy: {0}")]
    Copy(String),
}

/// The slots of one life cycle's pools on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct V4PoolSlots {
    /// Slots on the GPU tier.
    pub gpu: u32,
    /// Slots on the host tier (0 for a window life cycle).
    pub host: u32,
    /// Its index among the window life cycles (the manager's `lc`), if it is one.
    pub window: Option<usize>,
}

/// Per life cycle of `plan` (plan order), the slots a device's pools hold for `slots`
/// (as the manager was built with): the compressed life cycle on the GPU and the host
/// tier, each window life cycle on the GPU. A missing count is a typed error.
pub fn v4_pool_slots(plan: &V4Plan, slots: &WindowedSlots) -> Result<Vec<V4PoolSlots>, PoolError> {
    let mut windows = 0;
    plan.life_cycles()
        .iter()
        .map(|lc| {
            let (gpu, host, window) = match lc.retention {
                Retention::Full => (
                    slots.blocks.gpu.first().copied(),
                    slots.blocks.host.first().copied().unwrap_or(0),
                    None,
                ),
                Retention::Window { .. } => {
                    windows += 1;
                    (
                        slots.windows.get(windows - 1).copied(),
                        0,
                        Some(windows - 1),
                    )
                }
            };
            let gpu = gpu.ok_or_else(|| {
                PoolError::Setup(format!(
                    "no slot count for the {} life cycle: give WindowedSlots one per window life cycle",
                    lc.kind.name()
                ))
            })?;
            Ok(V4PoolSlots { gpu, host, window })
        })
        .collect()
}

fn tier_index(t: Tier) -> usize {
    match t {
        Tier::Gpu => 0,
        Tier::Host => 1,
    }
}

/// The pools of every life cycle of a plan: the compressed one on the GPU and (with a
/// host tier) on the host, the window ones on the GPU.
pub struct V4Pools {
    plan: V4Plan,
    /// Per life cycle (plan order): per tier (GPU, host): per pool: its bytes.
    pub(crate) bytes: Vec<[Vec<Vec<u8>>; 2]>,
    /// Per life cycle: its index among the window life cycles (the manager's `lc`).
    window_index: Vec<Option<usize>>,
}

impl V4Pools {
    /// Zeroed pools for `plan` with `slots` (as the manager was built with).
    pub fn new(plan: &V4Plan, slots: &WindowedSlots) -> Result<V4Pools, PoolError> {
        let sizes = v4_pool_slots(plan, slots)?;
        let bytes = plan
            .life_cycles()
            .iter()
            .zip(&sizes)
            .map(|(lc, s)| {
                let tier = |n: u32| -> Vec<Vec<u8>> {
                    lc.pools
                        .iter()
                        .map(|p| vec![0u8; (u64::from(n) * p.slot_bytes()) as usize])
                        .collect()
                };
                [tier(s.gpu), tier(s.host)]
            })
            .collect();
        Ok(V4Pools {
            plan: plan.clone(),
            bytes,
            window_index: sizes.iter().map(|s| s.window).collect(),
        })
    }

    /// The plan.
    pub fn plan(&self) -> &V4Plan {
        &self.plan
    }

    /// Window life cycles (the manager's `lc` counts them).
    pub fn window_life_cycles(&self) -> usize {
        self.window_index.iter().flatten().count()
    }

    /// The index among the window life cycles of life cycle `lc` (plan order), if it is
    /// one.
    pub fn window_index(&self, lc: usize) -> Option<usize> {
        self.window_index.get(lc).copied().flatten()
    }

    /// The bytes of pool `pool` of life cycle `lc` (plan order) on `tier` (empty for a
    /// tier the life cycle does not have): what a kernel or a dump reads.
    pub fn pool(&self, lc: usize, tier: Tier, pool: usize) -> &[u8] {
        self.bytes
            .get(lc)
            .and_then(|t| t[tier_index(tier)].get(pool))
            .map_or(&[], Vec::as_slice)
    }

    /// [`pool`](Self::pool), writable (a transfer landing, a fault injected in a test).
    pub fn pool_mut(&mut self, lc: usize, tier: Tier, pool: usize) -> &mut [u8] {
        self.bytes
            .get_mut(lc)
            .and_then(|t| t[tier_index(tier)].get_mut(pool))
            .map_or(&mut [], Vec::as_mut_slice)
    }

    /// Copies whole slots of every pool of life cycle `lc` from `src`'s `src_tier` (another
    /// device's pools of the same plan) into this device's GPU tier (`(source slot,
    /// destination slot)` pairs, in order): an in-process transport, what a P/D
    /// transfer's wire carries.
    pub fn copy_slots_from(
        &mut self,
        src: &V4Pools,
        src_tier: Tier,
        lc: usize,
        pairs: &[(SlotId, SlotId)],
    ) -> Result<(), PoolError> {
        let (Some(from), Some(to)) = (
            src.plan.life_cycles().get(lc),
            self.plan.life_cycles().get(lc),
        ) else {
            return Err(PoolError::Copy(format!("no life cycle {lc}")));
        };
        if from.pools != to.pools {
            return Err(PoolError::Copy(format!(
                "life cycle {lc}: the two devices' pools differ (not the same plan)"
            )));
        }
        for (pool, p) in to.pools.iter().enumerate() {
            let n = p.slot_bytes() as usize;
            for &(s, d) in pairs {
                let (a, b) = (s.index() * n, d.index() * n);
                let from = src.bytes[lc][tier_index(src_tier)][pool].get(a..a + n);
                let to = self.bytes[lc][0][pool].get_mut(b..b + n);
                match (from, to) {
                    (Some(f), Some(t)) => t.copy_from_slice(f),
                    _ => {
                        return Err(PoolError::Copy(format!(
                            "life cycle {lc}: slot {s:?} → {d:?} is past the pools"
                        )))
                    }
                }
            }
        }
        Ok(())
    }

    /// Executes the manager's copy plans (offload, onboarding) in order: every pool of
    /// the compressed life cycle, slot by slot.
    pub fn apply(&mut self, plans: &[CopyPlan]) -> Result<u64, PoolError> {
        let mut copied = 0;
        let lc = self
            .plan
            .life_cycles()
            .iter()
            .position(|lc| lc.retention == Retention::Full)
            .ok_or_else(|| PoolError::Setup("the plan has no compressed life cycle".into()))?;
        let slot_bytes: Vec<usize> = self.plan.life_cycles()[lc]
            .pools
            .iter()
            .map(|p| p.slot_bytes() as usize)
            .collect();
        for copy in plans.iter().flat_map(|p| &p.copies) {
            if copy.pool_group.index() != 0 {
                return Err(PoolError::Copy(format!(
                    "a copy of pool group {}: V4 blocks have one",
                    copy.pool_group.index()
                )));
            }
            let (src, dst) = (tier_index(copy.src_tier), tier_index(copy.dst_tier));
            for (pool, &n) in slot_bytes.iter().enumerate() {
                for &(s, d) in &copy.pairs {
                    let range = |slot: SlotId, t: usize| {
                        let at = slot.index() * n;
                        (at + n <= self.bytes[lc][t][pool].len()).then_some(at..at + n)
                    };
                    let (Some(from), Some(to)) = (range(s, src), range(d, dst)) else {
                        return Err(PoolError::Copy(format!(
                            "copy {s:?} → {d:?} ({:?} → {:?}) is past the pools",
                            copy.src_tier, copy.dst_tier
                        )));
                    };
                    let data = self.bytes[lc][src][pool][from].to_vec();
                    self.bytes[lc][dst][pool][to].copy_from_slice(&data);
                }
            }
            copied += copy.pairs.len() as u64;
        }
        Ok(copied)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsa_kv_core::config::V4Spec;
    use dsa_kv_core::core::TierSlots;
    use dsa_kv_core::ids::{Fence, PoolGroupId};
    use dsa_kv_core::ops::GroupCopy;

    fn pools() -> V4Pools {
        let plan = V4Plan::new(&V4Spec {
            compress_ratios: vec![4, 128],
            ..V4Spec::flash()
        })
        .unwrap();
        let slots = WindowedSlots {
            blocks: TierSlots {
                gpu: vec![4],
                host: vec![3],
            },
            windows: vec![2, 5, 6],
        };
        V4Pools::new(&plan, &slots).unwrap()
    }

    fn copy(src: Tier, dst: Tier, pairs: Vec<(SlotId, SlotId)>) -> CopyPlan {
        CopyPlan {
            fence: Fence(1),
            wait_for: Fence(0),
            copies: vec![GroupCopy {
                pool_group: PoolGroupId(0),
                src_tier: src,
                dst_tier: dst,
                pairs,
            }],
        }
    }

    /// Pools have the plan's bytes per slot; copies move whole slots of every pool of
    /// the compressed life cycle between the tiers, pair by pair in order; a pair past
    /// the pools is refused (the pairs before it have moved).
    #[test]
    fn pools_are_sized_by_the_plan_and_copies_move_whole_slots() {
        let mut p = pools();
        let lcs = p.plan().life_cycles().to_vec();
        for (i, lc) in lcs.iter().enumerate() {
            let slots = match lc.retention {
                Retention::Full => 4,
                Retention::Window { .. } => [2, 5, 6][i - 1],
            };
            for (j, pool) in lc.pools.iter().enumerate() {
                assert_eq!(
                    p.pool(i, Tier::Gpu, j).len() as u64,
                    slots * pool.slot_bytes()
                );
            }
        }
        let n = lcs[0].pools[0].slot_bytes() as usize;
        p.pool_mut(0, Tier::Gpu, 0)[2 * n + 5] = 7;
        p.apply(&[copy(Tier::Gpu, Tier::Host, vec![(SlotId(2), SlotId(1))])])
            .unwrap();
        assert_eq!(p.pool(0, Tier::Host, 0)[n + 5], 7);
        p.apply(&[copy(Tier::Host, Tier::Gpu, vec![(SlotId(1), SlotId(0))])])
            .unwrap();
        assert_eq!(p.pool(0, Tier::Gpu, 0)[5], 7);
        let e = p
            .apply(&[copy(Tier::Gpu, Tier::Host, vec![(SlotId(0), SlotId(3))])])
            .unwrap_err();
        assert!(matches!(e, PoolError::Copy(_)), "{e}");
        assert!(p.pool(9, Tier::Gpu, 0).is_empty());
    }
}
