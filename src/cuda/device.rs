//! [`CudaDevice`]: the [`DeviceBackend`] of one GPU. The step metadata is built on the
//! host by the same [`StepMetadata`](crate::metadata::StepMetadata) as the host backend
//! and uploaded; new tokens' KV (from the [`KvSource`](crate::actors::KvSource)) is
//! uploaded as BF16 and quantized and scattered by our kernels on the compute stream;
//! copy plans run on the copy stream ([`CudaStorage`]). Verification reads the verified
//! slots back into a host mirror and compares every byte with the host encodings, so a
//! kernel that disagrees with its host reference is caught by the serving run itself.

use std::sync::Arc;
use std::time::Instant;

use half::bf16;

use super::guard::{guard_error, GuardMaps, GuardedOp};
use super::kernels::{DevRows, Guard, GuardFailure, MlaEncoding};
use super::{CudaError, CudaStorage, DeviceBuffer, Gpu};
use crate::config::{IndexerDtype, KvDtype};
use crate::core::scheduler::StepPlan;
use crate::device::backend::{
    new_tokens, pool_ids, run_copies, verify_all, Cache, PoolDigest, StepCore, StepWork, VerifyRef,
};
use crate::device::{
    BackendFactory, DeviceBackend, DeviceError, DeviceSetup, DeviceStepReport, Mismatch, VerifySpec,
};
use crate::ids::{PoolGroupId, SlotId, Tier};
use crate::layout::Role;
use crate::metadata::{DraftSnapshot, MetadataError};
use crate::ops::mla::RowView;
use crate::storage::HostStorage;

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
}

/// Bytes per piece when a whole GPU pool is read back for its digest.
const DIGEST_PIECE: usize = 64 << 20;

#[derive(Default)]
struct Scratch {
    maps: Option<DeviceBuffer>,
    input: Option<DeviceBuffer>,
    values: Option<DeviceBuffer>,
    scales: Option<DeviceBuffer>,
    /// The step's fail flag (`kernels/guard.cu`).
    fail: Option<DeviceBuffer>,
}

/// A device actor's backend on one GPU. See the module docs.
pub struct CudaDevice {
    core: StepCore,
    gpu: Arc<Gpu>,
    target: GpuCache,
    draft: Option<GpuCache>,
    scratch: Scratch,
}

impl CudaDevice {
    /// Opens GPU `ordinal` for device index `index` and allocates its pools (VMM), host
    /// tier (pinned) and metadata buffers.
    pub fn new(index: usize, ordinal: usize, setup: DeviceSetup) -> Result<Self, DeviceError> {
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
        let cache = |plan: &crate::layout::PoolPlan| -> Result<GpuCache, DeviceError> {
            Ok(GpuCache {
                host: Cache::new(index, plan.clone(), &vec![0; g.len()], &[])?,
                mirror_slots: 0,
                dev: CudaStorage::new(gpu.clone(), plan, g, h, RESERVE_FACTOR).map_err(storage)?,
            })
        };
        let target = cache(&setup.target_plan)?;
        let draft = setup.draft_plan.as_ref().map(cache).transpose()?;
        let core = StepCore::new(index, &setup, target.host.layout)?;
        Ok(CudaDevice {
            core,
            gpu,
            target,
            draft,
            scratch: Scratch::default(),
        })
    }

    /// A [`BackendFactory`] that puts device index `i` on GPU `ordinals[i]`.
    pub fn factory(ordinals: Vec<usize>) -> BackendFactory {
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
            Ok(Box::new(CudaDevice::new(i, ordinal, setup)?) as Box<dyn DeviceBackend>)
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
    fn verify_one(
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

    /// Writes the KV of the plan's new tokens into `cache` through the bound metadata,
    /// every scatter guarded by the step's fail flag, then waits for the step and reads
    /// the flag back: a mapping out of range fails the step with the error the host
    /// reference gives, and (like the host) neither that op nor any later one wrote.
    fn write_and_check(
        core: &StepCore,
        gpu: &Gpu,
        scratch: &mut Scratch,
        cache: &GpuCache,
        plan: &StepPlan,
    ) -> Result<u64, DeviceError> {
        let dev = core.index;
        let cuda = |source: CudaError| DeviceError::Backend {
            device: dev,
            source: source.into(),
        };
        DeviceBuffer::ensure(&mut scratch.fail, gpu, 8, "fail flag").map_err(cuda)?;
        let flag = scratch.fail.as_ref().expect("invariant: ensured");
        gpu.upload(flag, &[u64::MAX]).map_err(cuda)?;
        let flag_ptr = flag.ptr();
        let mut ops = Vec::new();
        let n = Self::write_tokens(core, gpu, scratch, cache, plan, flag_ptr, &mut ops)
            .map_err(cuda)?;
        // The step is complete when its kernels are: errors surface here, per step.
        gpu.synchronize().map_err(cuda)?;
        let mut got = [0u64];
        let flag = scratch.fail.as_ref().expect("invariant: ensured");
        gpu.download(flag, &mut got).map_err(cuda)?;
        let Some(f) = GuardFailure::decode(got[0]) else {
            return Ok(n);
        };
        let meta = &core.meta;
        let maps = GuardMaps {
            value: meta.slot_mapping_value(),
            scale: meta.slot_mapping_scale(),
            rows: meta.mla_slot_mapping(),
        };
        let source = guard_error(&ops, f, maps).map_err(|what| {
            cuda(CudaError::Invalid {
                device: gpu.ordinal(),
                what,
            })
        })?;
        Err(DeviceError::Op {
            device: dev,
            source,
        })
    }

    /// Enqueues the writes of the plan's new tokens; `ops` receives each guarded op.
    fn write_tokens(
        core: &StepCore,
        gpu: &Gpu,
        scratch: &mut Scratch,
        cache: &GpuCache,
        plan: &StepPlan,
        fail_flag: u64,
        ops: &mut Vec<GuardedOp>,
    ) -> Result<u64, CudaError> {
        let toks = new_tokens(plan);
        let n = toks.len();
        if n == 0 {
            return Ok(0);
        }
        let dev = gpu.ordinal();
        let mut guard = |op: GuardedOp| {
            ops.push(op);
            Some(Guard {
                flag: fail_flag,
                op: ops.len() as u32 - 1,
            })
        };
        let meta = &core.meta;
        let mut maps: Vec<i64> = Vec::with_capacity(3 * n);
        maps.extend_from_slice(&meta.slot_mapping_value()[..n]);
        maps.extend_from_slice(&meta.slot_mapping_scale()[..n]);
        maps.extend_from_slice(&meta.mla_slot_mapping()[..n]);
        DeviceBuffer::ensure(&mut scratch.maps, gpu, maps.len() * 8, "slot mappings")?;
        let map_buf = scratch.maps.as_ref().expect("invariant: ensured");
        gpu.upload(map_buf, &maps)?;
        let (vmap, smap, mla) = (
            map_buf.ptr(),
            map_buf.ptr() + n as u64 * 8,
            map_buf.ptr() + 2 * n as u64 * 8,
        );
        let spec = core.model.spec();
        let row_elems = core.model.mla_row_elems() as usize;
        let key_elems = spec.index_head_dim as usize;
        DeviceBuffer::ensure(
            &mut scratch.input,
            gpu,
            n * row_elems.max(key_elems) * 2,
            "KV input",
        )?;
        DeviceBuffer::ensure(&mut scratch.values, gpu, n * 128, "quantized keys")?;
        DeviceBuffer::ensure(&mut scratch.scales, gpu, n * 4, "key scales")?;
        let input = scratch.input.as_ref().expect("invariant: ensured");
        let (values, scales) = (
            scratch.values.as_ref().expect("invariant: ensured").ptr(),
            scratch.scales.as_ref().expect("invariant: ensured").ptr(),
        );
        let plan_ref = &cache.host.plan;
        let mut host_in: Vec<bf16> = Vec::with_capacity(n * row_elems.max(key_elems));
        let mut one = vec![bf16::ZERO; row_elems.max(key_elems)];
        let stream = gpu.compute();
        let k = gpu.kernels();
        for p in plan_ref.placements() {
            let pool = cache.dev.pool_ptr(Tier::Gpu, p.pool_group, p.pool.get());
            let pool_len = cache.dev.pool_len(Tier::Gpu, p.pool_group, p.pool.get());
            match p.role {
                Role::IndexKey => {
                    host_in.clear();
                    for &at in &toks {
                        core.source.indexer_key(at, p.layer, &mut one[..key_elems]);
                        host_in.extend_from_slice(&one[..key_elems]);
                    }
                    gpu.upload(input, &host_in)?;
                    let width = core.model.indexer_data_bytes() as usize;
                    let fp4 = spec.indexer_dtype == IndexerDtype::Fp4;
                    let cache_len = pool_len.saturating_sub(p.offset_in_slot);
                    let g = guard(GuardedOp::Indexer {
                        cache_len,
                        width: width as u64,
                    });
                    // SAFETY: scratch buffers hold n keys / values / scales; the cache
                    // view is this pool from the layer's offset to its end.
                    unsafe {
                        k.quantize_indexer(stream, dev, input.ptr(), values, scales, n, fp4, true)?;
                        k.indexer_k_scatter(
                            stream,
                            dev,
                            pool + p.offset_in_slot,
                            cache_len,
                            values,
                            scales,
                            vmap,
                            smap,
                            n,
                            width,
                            g,
                        )?;
                    }
                }
                Role::Key => {
                    host_in.clear();
                    for &at in &toks {
                        core.source.mla_row(at, p.layer, &mut one[..row_elems]);
                        host_in.extend_from_slice(&one[..row_elems]);
                    }
                    gpu.upload(input, &host_in)?;
                    let view = |pl: &crate::layout::BufferPlacement| DevRows {
                        pool: cache.dev.pool_ptr(Tier::Gpu, pl.pool_group, pl.pool.get()),
                        pool_len: cache.dev.pool_len(Tier::Gpu, pl.pool_group, pl.pool.get()),
                        base: pl.offset_in_slot,
                        block_stride: cache.host.slot_bytes[pl.pool_group.index()][pl.pool.index()],
                        tokens_per_block: pl.tokens_per_page(),
                    };
                    let enc = match spec.kv_dtype {
                        KvDtype::Bf16 => MlaEncoding::Bf16,
                        KvDtype::Fp8 => MlaEncoding::Fp8 {
                            tensor_scale: core.fp8_tensor_scale,
                        },
                        KvDtype::Fp8DsMla => MlaEncoding::Fp8DsMla { ue8m0: true },
                        KvDtype::Nvfp4 => {
                            let sp =
                                plan_ref
                                    .placement(p.layer, Role::KeyBlockScale)
                                    .map_err(|e| CudaError::Invalid {
                                        device: dev,
                                        what: format!("NVFP4 layer without block scales: {e}"),
                                    })?;
                            MlaEncoding::Nvfp4 { scales: view(sp) }
                        }
                    };
                    // SAFETY: `input` holds n rows; the views are this cache's pools.
                    // The host reference's views, from the layout: the guard checks
                    // and the error names exactly what the host would.
                    let rows = |pl: &crate::layout::BufferPlacement| {
                        RowView::of(
                            pl,
                            cache.host.slot_bytes[pl.pool_group.index()][pl.pool.index()],
                        )
                    };
                    let main = view(p);
                    let data_view = rows(p);
                    debug_assert_eq!(data_view.row_bytes, enc.row_bytes(), "kernel row size");
                    let g = guard(GuardedOp::Mla {
                        view: data_view,
                        cache_len: main.pool_len,
                        scales: match enc {
                            MlaEncoding::Nvfp4 { scales } => {
                                let sp = plan_ref
                                    .placement(p.layer, Role::KeyBlockScale)
                                    .expect("invariant: the encoding was built from it");
                                Some((rows(sp), scales.pool_len))
                            }
                            _ => None,
                        },
                    });
                    unsafe { k.mla_scatter(stream, dev, main, enc, input.ptr(), mla, n, g)? };
                }
                _ => {}
            }
        }
        Ok(n as u64)
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

impl DeviceBackend for CudaDevice {
    fn index(&self) -> usize {
        self.core.index
    }

    fn bindings(&self) -> Option<crate::metadata::Bindings> {
        Some(self.core.meta.bindings())
    }

    fn execute_step(&mut self, plan: &StepPlan) -> Result<DeviceStepReport, DeviceError> {
        let start = Instant::now();
        let dev = self.core.index;
        self.gpu.bind().map_err(|e| self.cuda(e))?;
        let slot_copies = run_copies(
            dev,
            plan,
            &mut self.target.dev,
            self.draft.as_mut().map(|d| &mut d.dev),
        )?;
        // Cached KV that was reused or moved is checked before anything new is written.
        let (verified, mismatches) =
            verify_all(VerifyRef::of_step(plan), |r, out| self.verify_one(r, out))?;
        let reqs = StepCore::step_requests(plan, false);
        self.core
            .meta
            .prepare(&self.target.host.layout, &reqs)
            .map_err(|e| self.core.meta_err(e))?;
        let written =
            Self::write_and_check(&self.core, &self.gpu, &mut self.scratch, &self.target, plan)?;
        let work = StepWork {
            written,
            slot_copies,
            verified,
            mismatches,
        };
        Ok(self.core.step_report(plan, work, start))
    }

    fn draft_prepare(&mut self, plan: &StepPlan) -> Result<DraftSnapshot, DeviceError> {
        let layout = self.draft.as_ref().map(|d| d.host.layout);
        self.core.prepare_draft(layout, plan)
    }

    fn draft_forward(&mut self, plan: &StepPlan) -> Result<u64, DeviceError> {
        let dev = self.core.index;
        self.gpu.bind().map_err(|e| self.cuda(e))?;
        let draft = self
            .draft
            .as_ref()
            .ok_or(DeviceError::NoDraftCache { device: dev })?;
        if !self.core.meta.in_draft_replay() {
            return Err(DeviceError::Metadata {
                device: dev,
                source: MetadataError::NotInReplay,
            });
        }
        Self::write_and_check(&self.core, &self.gpu, &mut self.scratch, draft, plan)
    }

    fn draft_restore(&mut self, snapshot: &DraftSnapshot) -> Result<(), DeviceError> {
        self.core.restore(snapshot)
    }

    fn verify(&mut self, specs: &[VerifySpec]) -> Result<(u64, Vec<Mismatch>), DeviceError> {
        self.gpu.bind().map_err(|e| self.cuda(e))?;
        verify_all(VerifyRef::of_specs(specs), |r, out| self.verify_one(r, out))
    }

    fn cache_digest(&mut self) -> Result<String, DeviceError> {
        self.gpu.bind().map_err(|e| self.cuda(e))?;
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
