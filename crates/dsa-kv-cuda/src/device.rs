//! [`CudaDevice`]: the [`DeviceBackend`] of one GPU. The step metadata is built on the
//! host by the same [`StepMetadata`](dsa_kv_core::metadata::StepMetadata) as the host backend
//! and uploaded into persistent device buffers ([`DeviceMetadata`]); copy plans run on
//! the copy stream ([`CudaStorage`]); the forward (the framework's model, or the
//! synthetic writer) runs on the compute stream. A step is enqueued, not waited for: the
//! compute stream waits for the step's copies, the next step's copies wait for this
//! step's kernels, and the host synchronizes only when verification reads back, when a
//! digest is taken, or when the embedder asks ([`DeviceBackend::synchronize`]).

use std::sync::Arc;

use cudarc::driver::CudaEvent;

use super::metadata::DeviceMetadata;
use super::{CudaError, CudaStorage, CudaSyntheticWriter, Gpu, GpuPoolAlloc};
use dsa_kv_core::core::scheduler::StepPlan;
use dsa_kv_core::ids::{PoolGroupId, SlotId, Tier};
use dsa_kv_core::metadata::MetadataLayout;
use dsa_kv_core::storage::HostStorage;
use dsa_kv_device::backend::{pool_ids, run_copies, Cache, PoolDigest, StepCore, VerifyRef};
use dsa_kv_device::forward::{
    Batch, CacheView, Forward, ForwardSetup, MemKind, MetadataView, Phase, Region, Sampling,
};
use dsa_kv_device::{BackendFactory, DeviceBackend, DeviceError, DeviceSetup, Mismatch, StepHooks};

/// Address space reserved per GPU pool, as a multiple of its initial size.
const RESERVE_FACTOR: usize = 2;

struct GpuCache {
    /// Plan, layout and a small host mirror: the slots being verified, read back in
    /// block-table order (mirror slot `j` holds the request's block `j`). It grows to the
    /// longest request verified, never to the pool's size.
    host: Cache,
    /// Slots per pool group the mirror holds now.
    mirror_slots: u32,
    dev: CudaStorage,
    /// The forward's view of the GPU pools.
    view: CacheView,
}

/// Bytes per piece when a whole GPU pool is read back for its digest.
const DIGEST_PIECE: usize = 64 << 20;

/// A device actor's backend on one GPU. See the module docs.
pub struct CudaDevice {
    core: StepCore,
    gpu: Arc<Gpu>,
    target: GpuCache,
    draft: Option<GpuCache>,
    meta_dev: DeviceMetadata,
    forward: Box<dyn Forward>,
    /// Recorded after the last forward enqueued: the last step's fence on the device.
    step_done: Option<CudaEvent>,
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Our pools and buffers wait for the GPU in their own `Drop` before they free
        // anything (`VmmPool`, `DeviceBuffer`, `PinnedHost`). The plugged-in forward is a
        // framework's: it enqueues on our compute stream without waiting (the `Forward`
        // contract), so the last step's kernels may still use memory it owns, and only
        // this device knows when they are done. Wait before it goes.
        if self.gpu.bind().is_ok() {
            let _ = self.gpu.synchronize();
        }
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` for device index `index` and allocates its pools (VMM), host
    /// tier (pinned) and metadata buffers.
    pub fn new(index: usize, ordinal: usize, setup: DeviceSetup) -> Result<Self, DeviceError> {
        Self::with_pools(index, ordinal, setup, GpuPoolAlloc::Vmm)
    }

    /// [`new`](Self::new) with the GPU pools allocated as `alloc` says.
    pub fn with_pools(
        index: usize,
        ordinal: usize,
        setup: DeviceSetup,
        alloc: GpuPoolAlloc,
    ) -> Result<Self, DeviceError> {
        let cuda = |source: CudaError| DeviceError::Backend {
            device: index,
            source: source.into(),
        };
        let storage = |source| DeviceError::Storage {
            device: index,
            source,
        };
        let elems = setup.model.mla_row_elems();
        if elems != 576 {
            return Err(cuda(CudaError::Invalid {
                device: ordinal,
                what: format!(
                    "the CUDA kernels write 576-element MLA rows (kv_lora_rank 512 + \
                     qk_rope_head_dim 64, as every DSA preset); this model's rows have {elems}: \
                     use the host backend"
                ),
            }));
        }
        let gpu = Gpu::open(ordinal).map_err(cuda)?;
        let (g, h) = (&setup.target_slots.0, &setup.target_slots.1);
        let cache = |plan: &dsa_kv_core::layout::PoolPlan| -> Result<GpuCache, DeviceError> {
            let dev = CudaStorage::new(gpu.clone(), plan, g, h, RESERVE_FACTOR, alloc)
                .map_err(storage)?;
            let view = StepCore::cache_view(index, &setup, plan, |p| Region {
                addr: dev.pool_ptr(Tier::Gpu, p.pool_group, p.pool.get()),
                bytes: dev.pool_len(Tier::Gpu, p.pool_group, p.pool.get()),
            })?;
            Ok(GpuCache {
                host: Cache::new(index, plan.clone(), &vec![0; g.len()], &[])?,
                mirror_slots: 0,
                dev,
                view,
            })
        };
        let target = cache(&setup.target_plan)?;
        let draft = setup.draft_plan.as_ref().map(cache).transpose()?;
        let core = StepCore::new(index, &setup, target.host.layout)?;
        let meta_dev = DeviceMetadata::new(&gpu, &core.meta).map_err(cuda)?;
        let meta = &core.meta;
        let forward_setup = ForwardSetup {
            device: index,
            memory: MemKind::Device {
                ordinal: ordinal as u32,
            },
            model: &setup.model,
            target: &target.view,
            draft: draft.as_ref().map(|d| &d.view),
            metadata: MetadataView::of(meta, |r| meta_dev.addr(r)),
            max_num_tokens: setup.dims.0.max_num_tokens,
            max_num_sequences: setup.dims.0.max_num_sequences,
            extension: Some(&gpu),
            stream: Some(gpu.compute().clone()),
        };
        // The synthetic writer of this backend: our kernels on the batch's stream.
        let forward = match &setup.forward {
            Some(f) => f(&forward_setup),
            None => CudaSyntheticWriter::new(&forward_setup, setup.source.clone())
                .map(|w| Box::new(w) as Box<dyn Forward>),
        }
        .map_err(|e| DeviceError::forward(index, e))?;
        Ok(CudaDevice {
            core,
            gpu,
            target,
            draft,
            meta_dev,
            forward,
            step_done: None,
        })
    }

    /// A [`BackendFactory`] that puts device index `i` on GPU `ordinals[i]`.
    pub fn factory(ordinals: Vec<usize>) -> BackendFactory {
        Self::factory_with(ordinals, GpuPoolAlloc::Vmm)
    }

    /// [`factory`](Self::factory) with the GPU pools allocated as `alloc` says
    /// ([`GpuPoolAlloc::Ipc`]: pools a KV transport between processes maps directly).
    pub fn factory_with(ordinals: Vec<usize>, alloc: GpuPoolAlloc) -> BackendFactory {
        Arc::new(move |i, setup| {
            let ordinal = *ordinals.get(i).ok_or_else(|| DeviceError::Backend {
                device: i,
                source: CudaError::NoDevice {
                    reason: format!(
                        "device index {i} has no GPU: {} ordinal(s) were given",
                        ordinals.len()
                    ),
                }
                .into(),
            })?;
            Ok(Box::new(CudaDevice::with_pools(i, ordinal, setup, alloc)?)
                as Box<dyn DeviceBackend>)
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The target cache's storage (pool addresses, read-back, peer access).
    pub fn target_storage(&mut self) -> &mut CudaStorage {
        &mut self.target.dev
    }

    fn cuda(&self, source: CudaError) -> DeviceError {
        DeviceError::Backend {
            device: self.core.index,
            source: source.into(),
        }
    }

    /// Verifies one request on the target cache (and the draft cache when it has one),
    /// reading its slots back first.
    fn verify_request(
        &mut self,
        r: VerifyRef<'_>,
        out: &mut Vec<Mismatch>,
    ) -> Result<u64, DeviceError> {
        let dev = self.core.index;
        let mirrored = refresh(dev, &mut self.target, r.slots, r.tokens.len())?;
        let mut n = self.core.verify_cache(&self.target.host, r, &mirrored, out);
        if let (Some(d), Some(ds)) = (self.draft.as_mut(), r.draft_slots) {
            let mirrored = refresh(dev, d, ds, r.tokens.len())?;
            n += self.core.verify_cache(&d.host, r, &mirrored, out);
        }
        Ok(n)
    }

    /// Uploads the bound metadata and runs the forward of `phase` on the compute
    /// stream; records the step's fence. Returns the batch's tokens.
    fn forward_phase(
        &mut self,
        phase: Phase,
        plan: &StepPlan,
    ) -> Result<(u64, Sampling), DeviceError> {
        let dev = self.core.index;
        let cuda = |source: CudaError| DeviceError::Backend {
            device: dev,
            source: source.into(),
        };
        let view = match phase {
            Phase::Target => &self.target.view,
            Phase::Draft => match &self.draft {
                Some(d) => &d.view,
                None => return Err(DeviceError::NoDraftCache { device: dev }),
            },
        };
        self.meta_dev
            .upload(&self.gpu, &mut self.core.meta)
            .map_err(cuda)?;
        let meta = &self.core.meta;
        let meta_dev = &self.meta_dev;
        let mut batch = Batch::on_cuda(
            plan.step,
            dev,
            phase,
            &plan.requests,
            view,
            MetadataView::of(meta, |r| meta_dev.addr(r)),
            meta,
            (self.gpu.ordinal(), self.gpu.compute()),
            Some(&self.gpu),
        );
        let r = batch.run(&mut *self.forward);
        // Whatever the forward enqueued before failing is fenced too.
        self.step_done = Some(
            self.gpu
                .compute()
                .record_event(None)
                .map_err(|e| cuda(super::driver_error(self.gpu.ordinal(), "cuEventRecord", e)))?,
        );
        let sampling = r.map_err(|e| DeviceError::forward(dev, e))?;
        Ok((meta.counts().num_tokens as u64, sampling))
    }

    /// Bytes of metadata the last forward's upload copied.
    pub fn last_metadata_upload_bytes(&self) -> usize {
        self.meta_dev.last_bytes()
    }
}

/// Reads the slots holding positions `[0, tokens)` (every pool group) back into the
/// cache's host mirror, block `j` into mirror slot `j`; returns the block table that
/// addresses the mirror (−1 where the request's table has −1).
fn refresh(
    device: usize,
    cache: &mut GpuCache,
    slots: &[i32],
    tokens: usize,
) -> Result<Vec<i32>, DeviceError> {
    let t = cache.host.layout.tokens_per_block as usize;
    let blocks = &slots[..tokens.div_ceil(t).min(slots.len())];
    let need = blocks.len() as u32;
    if need > cache.mirror_slots {
        let groups = cache.host.plan.pool_groups().len();
        let grow = need.next_power_of_two();
        cache.host.store = HostStorage::new(&cache.host.plan, &vec![grow; groups], &[])
            .map_err(|source| DeviceError::Storage { device, source })?;
        cache.mirror_slots = grow;
    }
    // Every pool group has the same slot count. A slot outside the pool is not read
    // back: the mirror table gets −1 there, which verification reports as a mismatch,
    // as the host backend does for the same slot.
    let pool_slots =
        cache.dev.pool_len(Tier::Gpu, PoolGroupId(0), 0) / cache.host.slot_bytes[0][0].max(1);
    let in_pool = |s: i32| s >= 0 && (s as u64) < pool_slots;
    let pairs: Vec<(SlotId, SlotId)> = blocks
        .iter()
        .enumerate()
        .filter(|(_, &s)| in_pool(s))
        .map(|(j, &s)| (SlotId(s as u32), SlotId(j as u32)))
        .collect();
    for g in 0..cache.host.plan.pool_groups().len() {
        cache
            .dev
            .read_slots_into(PoolGroupId(g as u16), &pairs, &mut cache.host.store)
            .map_err(|source| DeviceError::Backend {
                device,
                source: source.into(),
            })?;
    }
    Ok(blocks
        .iter()
        .enumerate()
        .map(|(j, &s)| if in_pool(s) { j as i32 } else { -1 })
        .collect())
}

impl StepHooks for CudaDevice {
    fn core(&self) -> &StepCore {
        &self.core
    }

    fn core_mut(&mut self) -> &mut StepCore {
        &mut self.core
    }

    fn bind(&mut self) -> Result<(), DeviceError> {
        self.gpu.bind().map_err(|e| self.cuda(e))
    }

    fn copies(&mut self, plan: &StepPlan) -> Result<u64, DeviceError> {
        run_copies(
            self.core.index,
            plan,
            &mut self.target.dev,
            self.draft.as_mut().map(|d| &mut d.dev),
        )
    }

    fn verify_one(
        &mut self,
        r: VerifyRef<'_>,
        out: &mut Vec<Mismatch>,
    ) -> Result<u64, DeviceError> {
        self.verify_request(r, out)
    }

    fn layouts(&self) -> (MetadataLayout, Option<MetadataLayout>) {
        (
            self.target.host.layout,
            self.draft.as_ref().map(|d| d.host.layout),
        )
    }

    fn run_forward(
        &mut self,
        phase: Phase,
        plan: &StepPlan,
    ) -> Result<(u64, Sampling), DeviceError> {
        self.forward_phase(phase, plan)
    }

    fn synchronize(&mut self) -> Result<(), DeviceError> {
        self.gpu.bind().map_err(|e| self.cuda(e))?;
        self.gpu.synchronize().map_err(|e| self.cuda(e))?;
        self.forward
            .after_synchronize()
            .map_err(|e| DeviceError::forward(self.core.index, e))
    }

    fn pool_regions(&mut self) -> Vec<dsa_kv_device::transfer::PoolRegion> {
        use dsa_kv_device::transfer::{CacheKind, MemKind, MemRegion};
        let ordinal = self.gpu.ordinal() as u32;
        let caches = std::iter::once((CacheKind::Target, &self.target))
            .chain(self.draft.as_ref().map(|c| (CacheKind::Draft, c)));
        caches
            .flat_map(|(kind, c)| {
                let d = &c.dev;
                dsa_kv_device::backend::cache_regions(
                    self.core.index,
                    kind,
                    &c.host.plan,
                    d.slots(),
                    |t, g, p| {
                        Some(match t {
                            Tier::Gpu => MemRegion {
                                addr: d.pool_ptr(t, g, p),
                                len: d.pool_len(t, g, p),
                                mem: MemKind::Device { ordinal },
                            },
                            Tier::Host => MemRegion {
                                addr: d.host_pool_ptr(g, p),
                                len: d.pool_len(t, g, p),
                                mem: MemKind::Host,
                            },
                        })
                    },
                )
            })
            .collect()
    }

    fn cache_digest(&mut self) -> Result<String, DeviceError> {
        // Streamed: a GPU pool is never copied to the host whole.
        let mut digest = PoolDigest::default();
        for c in std::iter::once(&self.target).chain(self.draft.as_ref()) {
            for (g, p) in pool_ids(&c.host.plan) {
                digest.pool(c.dev.pool_len(Tier::Gpu, g, p));
                c.dev
                    .read_pool_pieces(Tier::Gpu, g, p, DIGEST_PIECE, |b| digest.bytes(b))
                    .map_err(|e| self.cuda(e))?;
            }
        }
        Ok(digest.hex())
    }
}
