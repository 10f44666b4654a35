//! What a device does with a step plan, behind one trait that the host and the CUDA
//! backends implement: run the copy plans, build the step metadata, write every new
//! token's KV through the ops (the synthetic "forward"), replay drafts against the draft
//! cache, and verify cached KV by reading it back through the block tables. The parts
//! both backends share (`StepCore`, `Cache`, verification, digests) live here too.

use std::sync::Arc;

use half::bf16;
use serde::Serialize;

use super::forward::{ForwardError, ForwardFactory, Proposals, Sampled, Sampling};
use super::kv_source::{KvPosition, KvSource};
use crate::transfer::{CacheKind, MemRegion, PoolRegion};
use dsa_kv_core::config::{DsaModel, IndexerDtype, KvDtype};
use dsa_kv_core::core::scheduler::StepPlan;
use dsa_kv_core::core::{PrefixHash, ReuseScope};
use dsa_kv_core::ids::{Fence, LayerId, RequestId, Tier, TokenId};
use dsa_kv_core::layout::{PoolPlan, Role};
use dsa_kv_core::metadata::{
    DraftSnapshot, MetadataDims, MetadataError, MetadataLayout, StepMetadata, StepRequest,
};
use dsa_kv_core::ops::mla::{quantize_fp8_ds_mla_row, quantize_nvfp4_row, RowView};
use dsa_kv_core::ops::quant::{f32_to_e4m3, quantize_fp4_token, quantize_fp8_token, ScaleFormat};
use dsa_kv_core::ops::OpError;
use dsa_kv_core::storage::{BackendError, HostStorage, KvStorage, StorageError};

/// A device failure.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// Pool memory or a copy failed.
    #[error("device {device}: storage: {source}")]
    Storage {
        /// Device index.
        device: usize,
        /// The failure.
        #[source]
        source: StorageError,
    },
    /// The step metadata could not be built.
    #[error("device {device}: metadata: {source}")]
    Metadata {
        /// Device index.
        device: usize,
        /// The failure.
        #[source]
        source: MetadataError,
    },
    /// An op refused its inputs.
    #[error("device {device}: op: {source}")]
    Op {
        /// Device index.
        device: usize,
        /// The failure.
        #[source]
        source: OpError,
    },
    /// The backend failed (for the CUDA backend a `cuda::CudaError`: see
    /// [`BackendError::downcast_ref`]).
    #[error("device {device}: {source}")]
    Backend {
        /// Device index.
        device: usize,
        /// The failure.
        #[source]
        source: BackendError,
    },
    /// The forward failed.
    #[error("device {device}: forward: {source}")]
    Forward {
        /// Device index.
        device: usize,
        /// The failure.
        #[source]
        source: ForwardError,
    },
    /// A draft replay without a draft cache.
    #[error("device {device}: the step has draft slots but the device has no draft cache")]
    NoDraftCache {
        /// Device index.
        device: usize,
    },
    /// A windowed model's pools could not be built, or a copy fell outside them.
    #[error("device {device}: {source}")]
    Pools {
        /// Device index.
        device: usize,
        /// The failure.
        #[source]
        source: crate::windowed::PoolError,
    },
}

impl DeviceError {
    /// A forward's failure on device `device`; an op's refusal stays an op error (the
    /// same error a device reports wherever the op runs).
    pub fn forward(device: usize, source: ForwardError) -> DeviceError {
        match source {
            ForwardError::Op(source) => DeviceError::Op { device, source },
            source => DeviceError::Forward { device, source },
        }
    }
}

/// Whether, and on which layers, the runtime reads cached KV back and compares it with
/// what the synthetic writer wrote: before a step that reuses or moved a request's KV,
/// and when a request finishes. Only meaningful with the synthetic writer (the expected
/// bytes are its own); a framework forward writes KV nobody here can predict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub enum Verification {
    /// No read-backs (the default for a framework forward).
    Off,
    /// The first, middle and last target layer and every draft layer.
    Sample,
    /// Every layer of every buffer.
    All,
}

impl Verification {
    /// The layers of a cache (`layers`, ascending) that verification reads.
    pub fn select(&self, layers: &[LayerId]) -> Vec<LayerId> {
        match (self, layers) {
            (Verification::Off, _) => Vec::new(),
            (Verification::All, _) | (_, []) => layers.to_vec(),
            (Verification::Sample, _) => {
                let mut v = vec![
                    layers[0],
                    layers[layers.len() / 2],
                    layers[layers.len() - 1],
                ];
                v.dedup();
                v
            }
        }
    }

    /// Whether anything is read back.
    pub fn is_on(&self) -> bool {
        *self != Verification::Off
    }
}

/// How many layers of each cache verification reads, out of how many: what a
/// "positions × layers verified" count means.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct VerifiedLayers {
    /// Target layers read, and the target cache's layers.
    pub target: (usize, usize),
    /// Draft-cache layers read, and its layers (separate draft cache only).
    pub draft: Option<(usize, usize)>,
}

/// How the device was set up.
#[derive(Clone)]
pub struct DeviceSetup {
    /// The model.
    pub model: DsaModel,
    /// Target pool plan.
    pub target_plan: PoolPlan,
    /// Target GPU and host slots per pool group (host empty: no host tier).
    pub target_slots: (Vec<u32>, Vec<u32>),
    /// Draft pool plan (separate draft cache), with the same slot counts.
    pub draft_plan: Option<PoolPlan>,
    /// Metadata buffer sizes (target, draft).
    pub dims: (MetadataDims, Option<MetadataDims>),
    /// The KV the synthetic writer writes (what verification expects).
    pub source: Arc<dyn KvSource>,
    /// What verification reads.
    pub verify: Verification,
    /// Builds the device's forward: the framework's model, or `None` for the backend's
    /// own synthetic writer of [`source`](Self::source) (each backend writes its memory
    /// its way: [`SyntheticWriter`](crate::synthetic::SyntheticWriter) on the host).
    pub forward: Option<ForwardFactory>,
    /// Per-tensor scale of FP8 MLA rows.
    pub fp8_tensor_scale: f32,
}

/// One piece of cached KV to check: positions `[0, tokens.len())` of a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VerifySpec {
    /// The request.
    pub id: RequestId,
    /// Token of each position.
    pub tokens: Vec<TokenId>,
    /// The request's reuse scope (the expected KV depends on it).
    pub scope: ReuseScope,
    /// Target block slots.
    pub block_slots: Vec<i32>,
    /// Draft block slots (separate draft cache).
    pub draft_block_slots: Option<Vec<i32>>,
}

/// One request to verify: positions `[0, tokens.len())` through its target (and draft)
/// block tables.
#[derive(Clone, Copy)]
pub struct VerifyRef<'a> {
    pub id: RequestId,
    pub scope: ReuseScope,
    pub tokens: &'a [TokenId],
    pub slots: &'a [i32],
    pub draft_slots: Option<&'a [i32]>,
}

impl<'a> VerifyRef<'a> {
    /// The step's requests whose cached KV (reused or moved) is checked before anything
    /// new is written.
    pub(crate) fn of_step(plan: &'a StepPlan) -> impl Iterator<Item = VerifyRef<'a>> {
        plan.requests.iter().filter_map(|r| {
            Some(VerifyRef {
                id: r.id,
                scope: r.scope,
                tokens: r.verify_tokens.as_deref()?,
                slots: &r.block_slots,
                draft_slots: r.draft_block_slots.as_deref(),
            })
        })
    }

    /// Whole requests asked for by the coordinator.
    pub(crate) fn of_specs(specs: &'a [VerifySpec]) -> impl Iterator<Item = VerifyRef<'a>> {
        specs.iter().map(|s| VerifyRef {
            id: s.id,
            scope: s.scope,
            tokens: &s.tokens,
            slots: &s.block_slots,
            draft_slots: s.draft_block_slots.as_deref(),
        })
    }
}

/// Verifies each request with `one` (a backend's check of one request); returns the
/// positions verified and every mismatch.
pub(crate) fn verify_all<'a>(
    reqs: impl Iterator<Item = VerifyRef<'a>>,
    mut one: impl FnMut(VerifyRef<'a>, &mut Vec<Mismatch>) -> Result<u64, DeviceError>,
) -> Result<(u64, Vec<Mismatch>), DeviceError> {
    let mut mismatches = Vec::new();
    let mut n = 0;
    for r in reqs {
        n += one(r, &mut mismatches)?;
    }
    Ok((n, mismatches))
}

/// A byte mismatch found by verification.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    /// The request.
    pub id: RequestId,
    /// Token position.
    pub position: u32,
    /// Layer.
    pub layer: LayerId,
    /// Buffer role.
    pub role: Role,
}

/// What a device did for one step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DeviceStepReport {
    /// Device index.
    pub device: usize,
    /// Target fence completed.
    pub target_fence: Fence,
    /// Draft fence completed.
    pub draft_fence: Option<Fence>,
    /// New tokens written (each on every target layer).
    pub tokens_written: u64,
    /// Slot copies executed.
    pub slot_copies: u64,
    /// Cached token positions verified (each on the verified layers).
    pub tokens_verified: u64,
    /// Mismatches found (empty when every byte matched).
    pub mismatches: Vec<Mismatch>,
    /// Hash of the bound metadata (identical on every tensor-parallel rank).
    pub metadata_digest: u64,
    /// Time spent, in microseconds.
    pub elapsed_us: u64,
    /// What the forward sampled, or that the engine samples.
    pub sampling: Sampling,
}

impl DeviceStepReport {
    /// The report of device `device` that ran `plan`'s step and did nothing else: no
    /// tokens written, no copies, nothing verified, the engine samples (set the fields
    /// a backend measures on the result).
    pub fn new(device: usize, plan: &StepPlan) -> Self {
        DeviceStepReport {
            device,
            target_fence: plan.target_fence,
            draft_fence: plan.draft_fence,
            tokens_written: 0,
            slot_copies: 0,
            tokens_verified: 0,
            mismatches: Vec::new(),
            metadata_digest: 0,
            elapsed_us: 0,
            sampling: Sampling::ByEngine,
        }
    }

    /// What the forward sampled (`None` when the engine samples).
    pub fn sampled(&self) -> Option<&Sampled> {
        match &self.sampling {
            Sampling::Sampled(s) => Some(s),
            Sampling::ByEngine => None,
        }
    }
}

/// Builds one device backend: `(device index, setup)`.
pub type BackendFactory =
    Arc<dyn Fn(usize, DeviceSetup) -> Result<Box<dyn DeviceBackend>, DeviceError> + Send + Sync>;

/// The device operations a step needs.
pub trait DeviceBackend: Send + 'static {
    /// Device index.
    fn index(&self) -> usize;
    /// Runs copies, verifies requested cached KV (when verification is on), builds the
    /// metadata and runs the forward. On a GPU it returns once the work is enqueued.
    fn execute_step(&mut self, plan: &StepPlan) -> Result<DeviceStepReport, DeviceError>;
    /// Rebinds the metadata to the draft buffers for the plan's draft slots. The
    /// default: a device without a separate draft cache ([`DeviceError::NoDraftCache`]).
    fn draft_prepare(&mut self, plan: &StepPlan) -> Result<DraftSnapshot, DeviceError> {
        let _ = plan;
        Err(DeviceError::NoDraftCache {
            device: self.index(),
        })
    }
    /// Runs the forward's draft layers on the draft cache through the bound draft
    /// metadata; returns the tokens of the batch and the drafts proposed. The default:
    /// no separate draft cache.
    fn draft_forward(&mut self, plan: &StepPlan) -> Result<(u64, Proposals), DeviceError> {
        let _ = plan;
        Err(DeviceError::NoDraftCache {
            device: self.index(),
        })
    }
    /// Restores the target bindings. The default: no separate draft cache.
    fn draft_restore(&mut self, snapshot: &DraftSnapshot) -> Result<(), DeviceError> {
        let _ = snapshot;
        Err(DeviceError::NoDraftCache {
            device: self.index(),
        })
    }
    /// Verifies whole requests; returns (positions verified, mismatches).
    fn verify(&mut self, specs: &[VerifySpec]) -> Result<(u64, Vec<Mismatch>), DeviceError>;
    /// SHA-256 (hex) of every GPU-tier pool byte of the target and draft caches, in plan
    /// order: tensor-parallel ranks holding replicated KV report the same digest.
    fn cache_digest(&mut self) -> Result<String, DeviceError>;
    /// Waits until every step enqueued so far has completed on the device and reports a
    /// failure found only there. The host backend has nothing to wait for.
    fn synchronize(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    /// The metadata set bound now (target, or draft during a replay); `None` for a
    /// backend without step metadata.
    fn bindings(&self) -> Option<dsa_kv_core::metadata::Bindings> {
        None
    }
    /// Every pool of the target and draft caches on every tier, as memory a transport
    /// registers (KV transfer between engines); empty for a backend that cannot share
    /// its memory.
    fn pool_regions(&mut self) -> Vec<PoolRegion> {
        Vec::new()
    }
}

/// The pool regions of one cache: `addr(tier, group, pool)` gives each pool's memory
/// (`None`: the tier does not exist).
pub fn cache_regions(
    device: usize,
    cache: CacheKind,
    plan: &PoolPlan,
    slots: &[Vec<u32>; 2],
    addr: impl Fn(Tier, dsa_kv_core::ids::PoolGroupId, u16) -> Option<MemRegion>,
) -> Vec<PoolRegion> {
    let mut out = Vec::new();
    for tier in Tier::ALL {
        for g in plan.pool_groups() {
            let Some(&n) = slots[tier.index()].get(g.id.index()) else {
                continue;
            };
            for p in &g.pools {
                let Some(region) = addr(tier, g.id, p.id.get()) else {
                    continue;
                };
                let roles = sorted_roles(
                    plan.placements()
                        .iter()
                        .filter(|b| b.pool_group == g.id && b.pool == p.id)
                        .map(|b| b.role),
                );
                out.push(PoolRegion {
                    device: device as u32,
                    cache,
                    tier,
                    group: g.id,
                    pool: p.id.get(),
                    slot_bytes: p.slot_bytes,
                    slots: n,
                    roles,
                    region,
                });
            }
        }
    }
    out
}

/// The distinct roles of a pool's buffers, sorted (a [`PoolRegion`]'s `roles`).
pub(crate) fn sorted_roles(roles: impl Iterator<Item = Role>) -> Vec<Role> {
    let mut v: Vec<Role> = roles.collect();
    v.sort();
    v.dedup();
    v
}

/// SHA-256 over pools in a fixed order: each pool's length, then its bytes (fed in
/// any number of pieces, so a GPU pool can be hashed without a host copy of it).
#[derive(Default)]
pub struct PoolDigest(sha2::Sha256);

impl PoolDigest {
    /// Starts the next pool, of `len` bytes.
    pub fn pool(&mut self, len: u64) {
        sha2::Digest::update(&mut self.0, len.to_le_bytes());
    }

    /// The next bytes of the current pool.
    pub fn bytes(&mut self, b: &[u8]) {
        sha2::Digest::update(&mut self.0, b);
    }

    /// The digest, in hex.
    pub fn hex(self) -> String {
        sha2::Digest::finalize(self.0)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// [`PoolDigest`] of whole pools.
pub fn digest_pools<'a>(pools: impl Iterator<Item = &'a [u8]>) -> String {
    let mut d = PoolDigest::default();
    for p in pools {
        d.pool(p.len() as u64);
        d.bytes(p);
    }
    d.hex()
}

/// `(group, pool)` of every pool of `plan`, in plan order.
pub fn pool_ids(plan: &PoolPlan) -> Vec<(dsa_kv_core::ids::PoolGroupId, u16)> {
    plan.pool_groups()
        .iter()
        .enumerate()
        .flat_map(|(g, grp)| {
            (0..grp.pools.len()).map(move |p| (dsa_kv_core::ids::PoolGroupId(g as u16), p as u16))
        })
        .collect()
}

/// One cache (target or draft) as the host sees it: its plan, metadata layout, slot
/// sizes and host pools (the pools themselves for [`HostDevice`](crate::HostDevice); for the CUDA backend a
/// small read-back mirror holding only the slots being verified, in block-table order).
pub struct Cache {
    pub plan: PoolPlan,
    pub layout: MetadataLayout,
    pub store: HostStorage,
    pub slot_bytes: Vec<Vec<u64>>,
}

impl Cache {
    /// Host pools for `plan` (GPU tier always; host tier when `host_slots` is given).
    pub fn new(
        index: usize,
        plan: PoolPlan,
        gpu_slots: &[u32],
        host_slots: &[u32],
    ) -> Result<Cache, DeviceError> {
        let layout = MetadataLayout::from_plan(&plan).map_err(|e| DeviceError::Metadata {
            device: index,
            source: MetadataError::Layout(e),
        })?;
        let store = HostStorage::new(&plan, gpu_slots, host_slots).map_err(|source| {
            DeviceError::Storage {
                device: index,
                source,
            }
        })?;
        let slot_bytes = plan
            .pool_groups()
            .iter()
            .map(|g| g.pools.iter().map(|p| p.slot_bytes).collect())
            .collect();
        Ok(Cache {
            plan,
            layout,
            store,
            slot_bytes,
        })
    }
}

/// What a step did on a device (the parts of its report the backend measures).
pub(crate) struct StepWork {
    pub(crate) written: u64,
    pub(crate) slot_copies: u64,
    pub(crate) verified: u64,
    pub(crate) mismatches: Vec<Mismatch>,
    pub(crate) sampling: Sampling,
}

/// What every backend shares: the step metadata, the KV source and the expected
/// encodings used by verification.
pub struct StepCore {
    pub index: usize,
    pub model: DsaModel,
    pub meta: StepMetadata,
    pub source: Arc<dyn KvSource>,
    pub verify: Verification,
    pub fp8_tensor_scale: f32,
}

impl StepCore {
    /// The shared state of device `index`, with metadata buffers for `layout`.
    pub fn new(
        index: usize,
        setup: &DeviceSetup,
        layout: MetadataLayout,
    ) -> Result<Self, DeviceError> {
        let meta =
            StepMetadata::new(layout, setup.dims.0, setup.dims.1, true).map_err(|source| {
                DeviceError::Metadata {
                    device: index,
                    source,
                }
            })?;
        Ok(StepCore {
            index,
            model: setup.model.clone(),
            meta,
            source: setup.source.clone(),
            verify: setup.verify,
            fp8_tensor_scale: setup.fp8_tensor_scale,
        })
    }

    /// The step's requests to verify (none when verification is off).
    pub(crate) fn step_verifies<'a>(
        &self,
        plan: &'a StepPlan,
    ) -> impl Iterator<Item = VerifyRef<'a>> + 'a {
        let on = self.verify.is_on();
        VerifyRef::of_step(plan).filter(move |_| on)
    }

    /// Whole requests to verify (none when verification is off).
    pub(crate) fn spec_verifies<'a>(
        &self,
        specs: &'a [VerifySpec],
    ) -> impl Iterator<Item = VerifyRef<'a>> + 'a {
        let on = self.verify.is_on();
        VerifyRef::of_specs(specs).filter(move |_| on)
    }

    pub(crate) fn meta_err(&self, source: MetadataError) -> DeviceError {
        DeviceError::Metadata {
            device: self.index,
            source,
        }
    }

    pub(crate) fn step_requests<'a>(plan: &'a StepPlan, draft: bool) -> Vec<StepRequest<'a>> {
        plan.requests
            .iter()
            .map(|r| StepRequest::planned(r, draft))
            .collect()
    }

    fn layers_to_verify(&self, plan: &PoolPlan) -> Vec<LayerId> {
        self.verify.select(&plan.layer_ids().collect::<Vec<_>>())
    }

    /// Reads positions `[0, tokens.len())` of one request back through `slots` (its
    /// block slots in this cache; no step metadata involved) and compares every byte with
    /// the expected encoding. The expected KV is derived here from the request's scope
    /// and its whole token list, independently of what the step plans told the writer.
    pub fn verify_cache(
        &self,
        cache: &Cache,
        r: VerifyRef<'_>,
        slots: &[i32],
        out: &mut Vec<Mismatch>,
    ) -> u64 {
        let (id, tokens) = (r.id, r.tokens);
        let mut prefix = PrefixHash::root(r.scope);
        let positions: Vec<KvPosition> = (0u32..)
            .zip(tokens)
            .map(|(pos, &token)| {
                prefix = prefix.then(token);
                KvPosition { token, pos, prefix }
            })
            .collect();
        let spec = self.model.spec();
        let t = cache.layout.tokens_per_block;
        let mut key = vec![bf16::ZERO; spec.index_head_dim as usize];
        let mut row = vec![bf16::ZERO; self.model.mla_row_elems() as usize];
        let layers = self.layers_to_verify(&cache.plan);
        for &layer in &layers {
            for &at in &positions {
                let pos = at.pos;
                // No page for this position (a short or −1 table entry): every buffer
                // of the layer mismatches, as a page past the pool does below.
                let slot = match slots.get((pos / t) as usize) {
                    Some(&slot) if slot >= 0 => slot,
                    _ => {
                        for role in [Role::IndexKey, Role::Key] {
                            if cache.plan.placement(layer, role).is_ok() {
                                out.push(Mismatch {
                                    id,
                                    position: pos,
                                    layer,
                                    role,
                                });
                            }
                        }
                        continue;
                    }
                };
                if let (Ok(p), Some(ix)) = (
                    cache.plan.placement(layer, Role::IndexKey),
                    cache.layout.indexer,
                ) {
                    self.source.indexer_key(at, layer, &mut key);
                    let width = ix.data_bytes as usize;
                    let (mut v, mut s) = (vec![0u8; width], [0u8; 4]);
                    quantize_key(spec.indexer_dtype, &key, &mut v, &mut s);
                    let pool = cache.store.pool(Tier::Gpu, p.pool_group, p.pool.get());
                    let view = &pool[p.offset_in_slot as usize..];
                    let page = u64::from(slot as u32) * u64::from(cache.layout.indexer_page_scale);
                    let vo = ix.value_offset(page, pos % t) as usize;
                    let so = ix.scale_offset(page, pos % t) as usize;
                    if view.get(vo..vo + width) != Some(&v[..])
                        || view.get(so..so + 4) != Some(&s[..])
                    {
                        out.push(Mismatch {
                            id,
                            position: pos,
                            layer,
                            role: Role::IndexKey,
                        });
                    }
                }
                if let Ok(p) = cache.plan.placement(layer, Role::Key) {
                    self.source.mla_row(at, layer, &mut row);
                    let rv = RowView::of(p, cache.slot_bytes[p.pool_group.index()][p.pool.index()]);
                    let slot_tok = i64::from(slot) * i64::from(t) + i64::from(pos % t);
                    let (data, scale) = self.encode_mla(&row);
                    let pool = cache.store.pool(Tier::Gpu, p.pool_group, p.pool.get());
                    let o = rv.offset(slot_tok) as usize;
                    let mut ok = pool.get(o..o + data.len()) == Some(&data[..]);
                    if let (Some(scale), Ok(sp)) =
                        (scale, cache.plan.placement(layer, Role::KeyBlockScale))
                    {
                        let sv = RowView::of(
                            sp,
                            cache.slot_bytes[sp.pool_group.index()][sp.pool.index()],
                        );
                        let spool = cache.store.pool(Tier::Gpu, sp.pool_group, sp.pool.get());
                        let so = sv.offset(slot_tok) as usize;
                        ok &= spool.get(so..so + scale.len()) == Some(&scale[..]);
                    }
                    if !ok {
                        out.push(Mismatch {
                            id,
                            position: pos,
                            layer,
                            role: Role::Key,
                        });
                    }
                }
            }
        }
        tokens.len() as u64 * layers.len() as u64
    }

    /// The stored bytes of one MLA row (and its NVFP4 block scales).
    pub(crate) fn encode_mla(&self, row: &[bf16]) -> (Vec<u8>, Option<Vec<u8>>) {
        match self.model.spec().kv_dtype {
            KvDtype::Bf16 => (
                row.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
                None,
            ),
            KvDtype::Fp8 => (
                row.iter()
                    .map(|v| f32_to_e4m3(v.to_f32() / self.fp8_tensor_scale))
                    .collect(),
                None,
            ),
            KvDtype::Fp8DsMla => {
                let mut out = vec![0u8; 656];
                quantize_fp8_ds_mla_row(row, ScaleFormat::Ue8m0, &mut out);
                (out, None)
            }
            KvDtype::Nvfp4 => {
                let (mut d, mut s) = (vec![0u8; row.len() / 2], vec![0u8; row.len() / 16]);
                quantize_nvfp4_row(row, &mut d, &mut s);
                (d, Some(s))
            }
        }
    }

    /// The step's report once its work is done.
    pub(crate) fn step_report(
        &self,
        plan: &StepPlan,
        work: StepWork,
        start: std::time::Instant,
    ) -> DeviceStepReport {
        DeviceStepReport {
            device: self.index,
            target_fence: plan.target_fence,
            draft_fence: plan.draft_fence,
            tokens_written: work.written,
            slot_copies: work.slot_copies,
            tokens_verified: work.verified,
            mismatches: work.mismatches,
            metadata_digest: self.metadata_digest(),
            elapsed_us: start.elapsed().as_micros() as u64,
            sampling: work.sampling,
        }
    }

    /// Binds the draft set for the plan's replay (`layout`: the draft cache's, `None`
    /// when this device has no draft cache).
    pub(crate) fn prepare_draft(
        &mut self,
        layout: Option<MetadataLayout>,
        plan: &StepPlan,
    ) -> Result<DraftSnapshot, DeviceError> {
        let layout = layout.ok_or(DeviceError::NoDraftCache { device: self.index })?;
        let reqs = Self::step_requests(plan, true);
        self.meta
            .prepare_draft(&layout, &reqs)
            .map_err(|e| self.meta_err(e))
    }

    /// Whether a draft forward may run: the device has a draft cache and a replay is
    /// bound.
    pub(crate) fn check_draft_forward(&self, has_draft: bool) -> Result<(), DeviceError> {
        if !has_draft {
            return Err(DeviceError::NoDraftCache { device: self.index });
        }
        if !self.meta.in_draft_replay() {
            return Err(DeviceError::Metadata {
                device: self.index,
                source: MetadataError::NotInReplay,
            });
        }
        Ok(())
    }

    /// The forward's view of a cache of `setup`'s model whose GPU-tier pools are at
    /// `pool(placement)`.
    pub fn cache_view(
        index: usize,
        setup: &DeviceSetup,
        plan: &PoolPlan,
        pool: impl FnMut(&dsa_kv_core::layout::BufferPlacement) -> super::forward::Region,
    ) -> Result<super::forward::CacheView, DeviceError> {
        let spec = setup.model.spec();
        super::forward::CacheView::new(
            plan,
            setup.fp8_tensor_scale,
            spec.kv_dtype,
            spec.indexer_dtype,
            pool,
        )
        .map_err(|what| DeviceError::Forward {
            device: index,
            source: ForwardError::Unsupported { what },
        })
    }

    /// Restores the target set after a replay.
    pub(crate) fn restore(&mut self, snapshot: &DraftSnapshot) -> Result<(), DeviceError> {
        self.meta.restore(snapshot).map_err(|e| self.meta_err(e))
    }

    /// Hash of the page tables' history ([`StepMetadata::table_digest`]: every cell the
    /// fills wrote, kept as they write) and this step's slot mappings: FNV-1a over 32-bit
    /// words. It costs the step's tokens, not the batch's context.
    pub(crate) fn metadata_digest(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |x: i64| {
            for w in [x as u32, (x >> 32) as u32] {
                h = (h ^ u64::from(w)).wrapping_mul(0x100_0000_01b3);
            }
        };
        eat(self.meta.table_digest() as i64);
        let n = self.meta.counts().num_tokens;
        self.meta.slot_mapping_value()[..n]
            .iter()
            .for_each(|&x| eat(x));
        self.meta.mla_slot_mapping()[..n]
            .iter()
            .for_each(|&x| eat(x));
        h
    }
}

/// Runs the plan's target and draft copy plans on their storages, in order; returns the
/// slot copies executed.
pub fn run_copies<S: KvStorage>(
    device: usize,
    plan: &StepPlan,
    target: &mut S,
    draft: Option<&mut S>,
) -> Result<u64, DeviceError> {
    let storage = |source| DeviceError::Storage { device, source };
    let mut n = 0;
    for cp in &plan.copies {
        target.execute(cp).map_err(storage)?;
        n += cp.num_slot_copies() as u64;
    }
    if !plan.draft_copies.is_empty() {
        let draft = draft.ok_or(DeviceError::NoDraftCache { device })?;
        for cp in &plan.draft_copies {
            draft.execute(cp).map_err(storage)?;
            n += cp.num_slot_copies() as u64;
        }
    }
    Ok(n)
}

pub fn quantize_key(dtype: IndexerDtype, key: &[bf16], values: &mut [u8], scale: &mut [u8]) {
    match dtype {
        IndexerDtype::Fp8 => quantize_fp8_token(key, ScaleFormat::Ue8m0, values, scale),
        IndexerDtype::Fp4 => quantize_fp4_token(key, values, scale),
    }
}
