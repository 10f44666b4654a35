//! [`HostDevice`]: the device contract with the pools in host memory
//! ([`HostStorage`](dsa_kv_core::storage::HostStorage)). The embedded default, and the
//! reference the CUDA backend matches: it runs the copy plans, builds the step metadata,
//! hands the forward a [`Batch`] over host memory (the same view a GPU forward gets, with
//! host addresses), replays drafts against the draft cache and verifies cached KV.

use super::backend::{
    cache_regions, digest_pools, pool_ids, run_copies, Cache, DeviceError, DeviceSetup, Mismatch,
    StepCore, VerifyRef,
};
use super::forward::{
    Batch, BatchMemory, CacheView, Forward, ForwardSetup, HostMemory, MemKind, MetadataView, Phase,
    Region, Sampling,
};
use super::step::StepHooks;
use crate::synthetic::SyntheticWriter;
use crate::transfer::{CacheKind, MemRegion, PoolRegion};
use dsa_kv_core::core::scheduler::StepPlan;
use dsa_kv_core::ids::Tier;
use dsa_kv_core::metadata::MetadataLayout;

/// A device whose pools live in host memory.
pub struct HostDevice {
    core: StepCore,
    target: Cache,
    target_view: CacheView,
    draft: Option<(Cache, CacheView)>,
    forward: Box<dyn Forward>,
}

/// The view of a host cache's GPU-tier pools.
fn host_view(index: usize, setup: &DeviceSetup, cache: &Cache) -> Result<CacheView, DeviceError> {
    StepCore::cache_view(index, setup, &cache.plan, |p| {
        let b = cache.store.pool(Tier::Gpu, p.pool_group, p.pool.get());
        Region {
            addr: b.as_ptr() as u64,
            bytes: b.len() as u64,
        }
    })
}

impl HostDevice {
    /// Allocates the pools and metadata buffers of device `index`.
    pub fn new(index: usize, setup: DeviceSetup) -> Result<Self, DeviceError> {
        let (g, h) = (&setup.target_slots.0, &setup.target_slots.1);
        let target = Cache::new(index, setup.target_plan.clone(), g, h)?;
        let target_view = host_view(index, &setup, &target)?;
        let draft = match &setup.draft_plan {
            Some(p) => {
                let c = Cache::new(index, p.clone(), g, h)?;
                let v = host_view(index, &setup, &c)?;
                Some((c, v))
            }
            None => None,
        };
        let core = StepCore::new(index, &setup, target.layout)?;
        let meta = &core.meta;
        let forward_setup = ForwardSetup {
            device: index,
            memory: MemKind::Host,
            model: &setup.model,
            target: &target_view,
            draft: draft.as_ref().map(|(_, v)| v),
            metadata: MetadataView::of(meta, |r| meta.mirror_bytes(r).as_ptr() as u64),
            max_num_tokens: setup.dims.0.max_num_tokens,
            max_num_sequences: setup.dims.0.max_num_sequences,
            extension: None,
            #[cfg(feature = "cuda")]
            stream: None,
        };
        let forward = match &setup.forward {
            Some(f) => f(&forward_setup),
            None => SyntheticWriter::new(&forward_setup, setup.source.clone())
                .map(|w| Box::new(w) as Box<dyn Forward>),
        }
        .map_err(|e| DeviceError::forward(index, e))?;
        Ok(HostDevice {
            core,
            target,
            target_view,
            draft,
            forward,
        })
    }

    /// Runs the forward of `phase` over the bound metadata; returns the batch's tokens.
    fn forward_phase(
        &mut self,
        phase: Phase,
        plan: &StepPlan,
    ) -> Result<(u64, Sampling), DeviceError> {
        let dev = self.core.index;
        let (cache, view) = match phase {
            Phase::Target => (&mut self.target, &self.target_view),
            Phase::Draft => match self.draft.as_mut() {
                Some((c, v)) => (c, &*v),
                None => return Err(DeviceError::NoDraftCache { device: dev }),
            },
        };
        let meta = &self.core.meta;
        let mut batch = Batch {
            step: plan.step,
            device: dev,
            phase,
            requests: &plan.requests,
            cache: view,
            metadata: MetadataView::of(meta, |r| meta.mirror_bytes(r).as_ptr() as u64),
            host_meta: meta,
            memory: BatchMemory::Host(HostMemory::new(cache.store.gpu_pools_mut(), meta)),
            extension: None,
        };
        let sampling = batch
            .run(&mut *self.forward)
            .map_err(|e| DeviceError::forward(dev, e))?;
        Ok((meta.counts().num_tokens as u64, sampling))
    }

    /// Verifies one request on the target cache (and the draft cache when it has one).
    fn verify_request(&self, r: VerifyRef<'_>, out: &mut Vec<Mismatch>) -> u64 {
        let mut n = self.core.verify_cache(&self.target, r, r.slots, out);
        if let (Some((d, _)), Some(slots)) = (&self.draft, r.draft_slots) {
            n += self.core.verify_cache(d, r, slots, out);
        }
        n
    }
}

impl StepHooks for HostDevice {
    fn core(&self) -> &StepCore {
        &self.core
    }

    fn core_mut(&mut self) -> &mut StepCore {
        &mut self.core
    }

    fn copies(&mut self, plan: &StepPlan) -> Result<u64, DeviceError> {
        run_copies(
            self.core.index,
            plan,
            &mut self.target.store,
            self.draft.as_mut().map(|(d, _)| &mut d.store),
        )
    }

    fn verify_one(
        &mut self,
        r: VerifyRef<'_>,
        out: &mut Vec<Mismatch>,
    ) -> Result<u64, DeviceError> {
        Ok(self.verify_request(r, out))
    }

    fn layouts(&self) -> (MetadataLayout, Option<MetadataLayout>) {
        (
            self.target.layout,
            self.draft.as_ref().map(|(d, _)| d.layout),
        )
    }

    fn run_forward(
        &mut self,
        phase: Phase,
        plan: &StepPlan,
    ) -> Result<(u64, Sampling), DeviceError> {
        self.forward_phase(phase, plan)
    }

    fn pool_regions(&mut self) -> Vec<PoolRegion> {
        let index = self.core.index;
        let caches = std::iter::once((CacheKind::Target, &mut self.target))
            .chain(self.draft.as_mut().map(|(c, _)| (CacheKind::Draft, c)));
        let mut out = Vec::new();
        for (kind, c) in caches {
            let slots = c.store.slots().clone();
            let store = &mut c.store;
            let mut addrs = std::collections::HashMap::new();
            for t in Tier::ALL {
                for (g, gp) in c.plan.pool_groups().iter().enumerate() {
                    if slots[t.index()].get(g).is_none() {
                        continue;
                    }
                    for p in &gp.pools {
                        let len = store.pool(t, gp.id, p.id.get()).len() as u64;
                        let addr = store.pool_ptr(t, gp.id, p.id.get()) as u64;
                        addrs.insert((t, gp.id, p.id.get()), (addr, len));
                    }
                }
            }
            out.extend(cache_regions(index, kind, &c.plan, &slots, |t, g, p| {
                addrs.get(&(t, g, p)).map(|&(addr, len)| MemRegion {
                    addr,
                    len,
                    mem: MemKind::Host,
                })
            }));
        }
        out
    }

    fn cache_digest(&mut self) -> Result<String, DeviceError> {
        let caches = std::iter::once(&self.target).chain(self.draft.as_ref().map(|(c, _)| c));
        let pools: Vec<&[u8]> = caches
            .flat_map(|c| {
                pool_ids(&c.plan)
                    .into_iter()
                    .map(move |(g, p)| c.store.pool(Tier::Gpu, g, p))
            })
            .collect();
        Ok(digest_pools(pools.into_iter()))
    }
}
