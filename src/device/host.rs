//! [`HostDevice`]: the device contract with the pools in host memory
//! ([`HostStorage`](crate::storage::HostStorage)). The embedded default, and the reference the CUDA backend matches:
//! it runs the copy plans, builds the step metadata, writes every new token's KV through
//! the host ops, replays drafts against the draft cache and verifies cached KV.

use std::time::Instant;

use half::bf16;

use super::backend::{
    digest_pools, new_tokens, pool_ids, quantize_key, run_copies, verify_all, Cache, DeviceBackend,
    DeviceError, DeviceSetup, DeviceStepReport, Mismatch, StepCore, StepWork, VerifyRef,
    VerifySpec,
};
use super::kv_source::KvSource;
use crate::config::{DsaModel, KvDtype};
use crate::core::scheduler::StepPlan;
use crate::ids::Tier;
use crate::layout::{BufferPlacement, Role};
use crate::metadata::{DraftSnapshot, MetadataError, StepMetadata};
use crate::ops::indexer_k::{indexer_k_scatter, IndexerMappings};
use crate::ops::mla::{
    mla_scatter_bf16, mla_scatter_fp8, mla_scatter_fp8_ds_mla, mla_scatter_nvfp4, RowView,
};
use crate::ops::quant::ScaleFormat;
use crate::ops::OpError;

/// A device whose pools live in host memory.
pub struct HostDevice {
    core: StepCore,
    target: Cache,
    draft: Option<Cache>,
}

impl HostDevice {
    /// Allocates the pools and metadata buffers of device `index`.
    pub fn new(index: usize, setup: DeviceSetup) -> Result<Self, DeviceError> {
        let (g, h) = (&setup.target_slots.0, &setup.target_slots.1);
        let target = Cache::new(index, setup.target_plan.clone(), g, h)?;
        let draft = match &setup.draft_plan {
            Some(p) => Some(Cache::new(index, p.clone(), g, h)?),
            None => None,
        };
        let core = StepCore::new(index, &setup, target.layout)?;
        Ok(HostDevice {
            core,
            target,
            draft,
        })
    }

    /// Verifies one request on the target cache (and the draft cache when it has one).
    fn verify_one(&self, r: VerifyRef<'_>, out: &mut Vec<Mismatch>) -> u64 {
        let mut n = self.core.verify_cache(&self.target, r, r.slots, out);
        if let (Some(d), Some(slots)) = (&self.draft, r.draft_slots) {
            n += self.core.verify_cache(d, r, slots, out);
        }
        n
    }
}

impl DeviceBackend for HostDevice {
    fn index(&self) -> usize {
        self.core.index
    }

    fn bindings(&self) -> Option<crate::metadata::Bindings> {
        Some(self.core.meta.bindings())
    }

    fn execute_step(&mut self, plan: &StepPlan) -> Result<DeviceStepReport, DeviceError> {
        let start = Instant::now();
        let dev = self.core.index;
        let slot_copies = run_copies(
            dev,
            plan,
            &mut self.target.store,
            self.draft.as_mut().map(|d| &mut d.store),
        )?;
        // Cached KV that was reused or moved is checked before anything new is written.
        let (verified, mismatches) = verify_all(VerifyRef::of_step(plan), |r, out| {
            Ok(self.verify_one(r, out))
        })?;
        let reqs = StepCore::step_requests(plan, false);
        self.core
            .meta
            .prepare(&self.target.layout, &reqs)
            .map_err(|e| self.core.meta_err(e))?;
        let written = write_tokens(
            &self.core.meta,
            &mut self.target,
            &self.core.model,
            &*self.core.source,
            self.core.fp8_tensor_scale,
            plan,
        )
        .map_err(|e| self.core.op(e))?;
        let work = StepWork {
            written,
            slot_copies,
            verified,
            mismatches,
        };
        Ok(self.core.step_report(plan, work, start))
    }

    fn draft_prepare(&mut self, plan: &StepPlan) -> Result<DraftSnapshot, DeviceError> {
        let layout = self.draft.as_ref().map(|d| d.layout);
        self.core.prepare_draft(layout, plan)
    }

    fn draft_forward(&mut self, plan: &StepPlan) -> Result<u64, DeviceError> {
        let dev = self.core.index;
        let draft = self
            .draft
            .as_mut()
            .ok_or(DeviceError::NoDraftCache { device: dev })?;
        if !self.core.meta.in_draft_replay() {
            return Err(DeviceError::Metadata {
                device: dev,
                source: MetadataError::NotInReplay,
            });
        }
        write_tokens(
            &self.core.meta,
            draft,
            &self.core.model,
            &*self.core.source,
            self.core.fp8_tensor_scale,
            plan,
        )
        .map_err(|source| DeviceError::Op {
            device: dev,
            source,
        })
    }

    fn draft_restore(&mut self, snapshot: &DraftSnapshot) -> Result<(), DeviceError> {
        self.core.restore(snapshot)
    }

    fn verify(&mut self, specs: &[VerifySpec]) -> Result<(u64, Vec<Mismatch>), DeviceError> {
        verify_all(VerifyRef::of_specs(specs), |r, out| {
            Ok(self.verify_one(r, out))
        })
    }

    fn cache_digest(&mut self) -> Result<String, DeviceError> {
        let caches = std::iter::once(&self.target).chain(self.draft.as_ref());
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

/// Writes the KV of the plan's new tokens into `cache` through the bound metadata.
fn write_tokens(
    meta: &StepMetadata,
    cache: &mut Cache,
    model: &DsaModel,
    source: &dyn KvSource,
    fp8_scale: f32,
    plan: &StepPlan,
) -> Result<u64, OpError> {
    let toks = new_tokens(plan);
    let n = toks.len();
    let vm = &meta.slot_mapping_value()[..n];
    let sm = &meta.slot_mapping_scale()[..n];
    let mla = &meta.mla_slot_mapping()[..n];
    let spec = model.spec();
    let placements: Vec<BufferPlacement> = cache.plan.placements().to_vec();
    let mut key = vec![bf16::ZERO; spec.index_head_dim as usize];
    let mut row = vec![bf16::ZERO; model.mla_row_elems() as usize];
    for p in &placements {
        match p.role {
            Role::IndexKey => {
                let width = model.indexer_data_bytes() as usize;
                let mut vals = vec![0u8; n * width];
                let mut scales = vec![0u8; n * 4];
                for (i, &at) in toks.iter().enumerate() {
                    source.indexer_key(at, p.layer, &mut key);
                    quantize_key(
                        spec.indexer_dtype,
                        &key,
                        &mut vals[i * width..(i + 1) * width],
                        &mut scales[i * 4..i * 4 + 4],
                    );
                }
                let pool = cache.store.pool_mut(Tier::Gpu, p.pool_group, p.pool.get());
                let view = &mut pool[p.offset_in_slot as usize..];
                indexer_k_scatter(
                    view,
                    &vals,
                    &scales,
                    IndexerMappings {
                        value: vm,
                        scale: sm,
                    },
                    width,
                )?;
            }
            Role::Key => {
                let mut rows = Vec::with_capacity(n * row.len());
                for &at in &toks {
                    source.mla_row(at, p.layer, &mut row);
                    rows.extend_from_slice(&row);
                }
                let rv = RowView::of(p, cache.slot_bytes[p.pool_group.index()][p.pool.index()]);
                match spec.kv_dtype {
                    KvDtype::Bf16 => mla_scatter_bf16(
                        cache.store.pool_mut(Tier::Gpu, p.pool_group, p.pool.get()),
                        &rv,
                        &rows,
                        mla,
                    )?,
                    KvDtype::Fp8 => mla_scatter_fp8(
                        cache.store.pool_mut(Tier::Gpu, p.pool_group, p.pool.get()),
                        &rv,
                        &rows,
                        mla,
                        fp8_scale,
                    )?,
                    KvDtype::Fp8DsMla => mla_scatter_fp8_ds_mla(
                        cache.store.pool_mut(Tier::Gpu, p.pool_group, p.pool.get()),
                        &rv,
                        &rows,
                        mla,
                        ScaleFormat::Ue8m0,
                    )?,
                    KvDtype::Nvfp4 => {
                        let sp = *cache
                            .plan
                            .placement(p.layer, Role::KeyBlockScale)
                            .expect("invariant: NVFP4 layers have a block-scale buffer");
                        let sv = RowView::of(
                            &sp,
                            cache.slot_bytes[sp.pool_group.index()][sp.pool.index()],
                        );
                        let (data, scales) = cache.store.two_pools_mut(
                            Tier::Gpu,
                            p.pool_group,
                            p.pool.get(),
                            sp.pool.get(),
                        );
                        mla_scatter_nvfp4(data, &rv, scales, &sv, &rows, mla)?;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(n as u64)
}
