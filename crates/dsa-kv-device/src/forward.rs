//! The forward boundary: what a serving framework implements ([`Forward`]) and what it is
//! handed each step ([`Batch`]): the scheduled requests, every layer's cache as the DSA
//! kernels address it ([`CacheView`]), the step metadata buffers ([`MetadataView`]) and
//! the memory they live in (CUDA: the device's compute stream; host backend:
//! [`HostMemory`], safe slices over the same addresses). A device actor calls the forward
//! once per step, on its own thread, after the step's copies and metadata are in place
//! in stream order.
//!
//! Addresses are plain `u64`s: device pointers on the CUDA backend, host pointers on the
//! host backend. Pools and metadata buffers are allocated once, so every address is the
//! same on every step (a captured CUDA graph stays valid); only the counts change.

use std::any::Any;

use dsa_kv_core::config::{DsaModel, IndexerDtype, KvDtype};
use serde::Serialize;

use dsa_kv_core::core::scheduler::{PlannedRequest, RequestOutcome};
use dsa_kv_core::ids::{LayerId, RequestId, TokenId};
use dsa_kv_core::layout::{BufferPlacement, PoolPlan, Role};
use dsa_kv_core::metadata::mirror::MetaRef;
use dsa_kv_core::metadata::{BufferRole, StepCounts, StepMetadata};
use dsa_kv_core::ops::OpError;
use dsa_kv_core::storage::BackendError;

/// A framework's model, run by a device actor once per step. See the module docs.
///
/// `forward` must write the KV of every new token of the batch (the slot mappings say
/// where) and may read any cached token (the page tables say where). It runs on the
/// device's thread with its CUDA context current; on the CUDA backend it enqueues its
/// kernels on [`Batch::cuda_stream`] and returns without waiting for them, unless it
/// samples (reading its tokens back waits for them).
///
/// It returns what it sampled ([`Sampling::Sampled`]: the coordinator checks that every
/// device sampled the same, then commits the step itself), or
/// [`Sampling::ByEngine`] when the engine samples outside the forward and commits each
/// step with `KvCacheHandle::commit` / `commit_and_step`.
pub trait Forward: Send + 'static {
    /// The target model's forward for one step.
    fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError>;

    /// The draft (MTP) layers' forward during a draft replay: the batch views the draft
    /// cache and the draft-bound metadata. Runs only with a separate draft cache;
    /// returns the draft tokens proposed for each request's next step (every device
    /// must propose the same). The default does nothing and proposes none.
    fn draft_forward(&mut self, batch: &mut Batch<'_>) -> Result<Proposals, ForwardError> {
        let _ = batch;
        Ok(Proposals::new())
    }

    /// Called after the device has waited for all enqueued work (a synchronize the
    /// framework or verification asked for): report a failure the forward's kernels
    /// could only record on the device. The default has nothing to check.
    fn after_synchronize(&mut self) -> Result<(), ForwardError> {
        Ok(())
    }
}

/// Draft tokens proposed for each request's next step (an MTP layer's proposals), in
/// the plan's order.
pub type Proposals = Vec<(RequestId, Vec<TokenId>)>;

/// What a forward sampled in one step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Sampled {
    /// One outcome per planned request, in the plan's order: the drafts it accepted and,
    /// where the request produces a token ([`PlannedRequest::produces_token`]), the token
    /// sampled after them.
    pub outcomes: Vec<RequestOutcome>,
    /// Drafts proposed for the requests' next steps by a draft layer that shares the
    /// target's cache (a separate draft cache proposes from `draft_forward`).
    pub drafts: Proposals,
}

impl Sampled {
    /// `outcomes`, no drafts proposed.
    pub fn new(outcomes: Vec<RequestOutcome>) -> Self {
        Sampled {
            outcomes,
            drafts: Proposals::new(),
        }
    }

    /// The same with `drafts` proposed for the next steps.
    pub fn with_drafts(mut self, drafts: Proposals) -> Self {
        self.drafts = drafts;
        self
    }
}

/// Who samples a step's tokens. See [`Forward`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub enum Sampling {
    /// The forward sampled; the coordinator commits the step itself.
    Sampled(Sampled),
    /// The engine samples outside the forward and commits the step.
    ByEngine,
}

/// Builds the forward of one device, on the caller of `KvCacheBuilder::start`, after the
/// device's pools exist.
pub type ForwardFactory = std::sync::Arc<
    dyn Fn(&ForwardSetup<'_>) -> Result<Box<dyn Forward>, ForwardError> + Send + Sync,
>;

/// A forward's failure. A failed forward fails the step on every device, like any device
/// error.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ForwardError {
    /// The framework's own error.
    #[error("{0}")]
    Framework(BackendError),
    /// An op of the forward refused its inputs (the synthetic writer's scatters).
    #[error("op: {0}")]
    Op(#[from] OpError),
    /// A host-memory access outside the pools and metadata of this batch.
    #[error("host memory: {what}")]
    Memory {
        /// What was asked for.
        what: String,
    },
    /// The forward cannot run on this backend.
    #[error("{what}")]
    Unsupported {
        /// What, and what to do instead.
        what: String,
    },
}

impl ForwardError {
    /// Wraps a framework error.
    pub fn framework(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        ForwardError::Framework(BackendError::new(e))
    }
}

/// Where a batch's addresses point: the one memory vocabulary of the crate (a transfer's
/// regions use it too). [`MemKind::Host`]: use [`Batch::host`]; [`MemKind::Device`]: the
/// pools and metadata are on that CUDA device, use `Batch::cuda_stream`.
pub use crate::transfer::MemKind;

/// Whose forward a batch is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The target model (every target layer).
    Target,
    /// The draft (MTP) layers against the separate draft cache.
    Draft,
}

/// A byte range at an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub bytes: u64,
}

impl Region {
    /// Whether `[addr, addr + len)` lies inside this region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.bytes)
    }
}

/// Page index of a layer's buffer counted from the pool's base: `slot × scale + offset`
/// (pages of the buffer's page size), so a kernel that takes one base per pool and a
/// page table of its own can address the layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageConversion {
    /// Pages of this kind per slot.
    pub scale: u32,
    /// This layer's page inside a slot.
    pub offset: u32,
}

impl PageConversion {
    /// The layer's page for `slot`, counted from the pool base.
    pub fn page(&self, slot: u32) -> u64 {
        u64::from(slot) * u64::from(self.scale) + u64::from(self.offset)
    }
}

/// Rows of one layer's MLA cache (or of its NVFP4 block scales) as the MLA kernels
/// address them: `[pages, tokens_per_page, row_bytes]` from `base` with `stride(0) =
/// page_stride`. A block-table entry (a slot) is the page; token slot `slot × 64 +
/// offset` (the slot mapping, and FlashMLA-style global token indices) names a row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowsView {
    /// The whole pool the rows live in.
    pub pool: Region,
    /// Address of row 0 of page 0 of this layer (`pool.addr` + the layer's offset in a
    /// slot).
    pub base: u64,
    /// Bytes between consecutive pages (the pool's slot size).
    pub page_stride: u64,
    /// Pages (slots) in the pool.
    pub pages: u32,
    /// Rows per page (64).
    pub tokens_per_page: u32,
    /// Bytes per row.
    pub row_bytes: u32,
    /// The same pages counted from `pool.addr` in units of `tokens_per_page × row_bytes`
    /// (when the layout packs this kind of buffer that way; V2 does).
    pub pool_pages: Option<PageConversion>,
}

impl RowsView {
    /// Address of row `offset` of page `slot`.
    pub fn row_addr(&self, slot: u32, offset: u32) -> u64 {
        self.base
            + u64::from(slot) * self.page_stride
            + u64::from(offset) * u64::from(self.row_bytes)
    }

    /// Address of token slot `token_slot` (`slot × tokens_per_page + offset`; must be ≥ 0).
    pub fn token_addr(&self, token_slot: i64) -> u64 {
        let t = u64::from(self.tokens_per_page);
        let s = token_slot as u64;
        self.row_addr((s / t) as u32, (s % t) as u32)
    }
}

/// One layer's MLA latent cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaCacheView {
    /// The rows: BF16 1152 B, FP8 576 B, `fp8_ds_mla` 656 B, NVFP4 288 B of E2M1 pairs.
    pub rows: RowsView,
    /// Row encoding.
    pub encoding: KvDtype,
    /// Per-tensor scale of FP8 rows (stored value = real value / scale).
    pub fp8_tensor_scale: f32,
    /// NVFP4 only: one FP8 scale per 16 elements (36 B per row), in its own buffer.
    pub block_scales: Option<RowsView>,
}

/// One layer's lightning-indexer K cache as DeepGEMM's fused paged view
/// `[pages, 64, 1, D + S]`: each page holds 64 payloads of `D` bytes, then 64 scale
/// words of `S` bytes; `stride(0)` is `page_bytes`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IndexerCacheView {
    /// The whole pool.
    pub pool: Region,
    /// Address of page 0 of this layer: the indexer page table (`slot × page_scale`)
    /// and the payload / scale slot mappings (byte offsets) count from here.
    pub base: u64,
    /// Bytes per page, `64 × (D + S)`.
    pub page_bytes: u64,
    /// Payload bytes per token `D` (FP8: 128, FP4: 64).
    pub value_bytes: u32,
    /// Scale bytes per token `S` (4).
    pub scale_bytes: u32,
    /// Tokens per page (64).
    pub tokens_per_page: u32,
    /// Indexer pages per slot (the page table holds `slot × page_scale`).
    pub page_scale: u32,
    /// Pages addressable from `base` (to the end of the pool).
    pub pages: u64,
    /// The same pages counted from `pool.addr`: `slot × scale + offset`.
    pub pool_pages: PageConversion,
    /// FP8 or FP4 payloads.
    pub dtype: IndexerDtype,
}

impl IndexerCacheView {
    /// Address of token `offset`'s payload in page `page` (an indexer page-table entry).
    pub fn value_addr(&self, page: u64, offset: u32) -> u64 {
        self.base + page * self.page_bytes + u64::from(offset) * u64::from(self.value_bytes)
    }

    /// Address of token `offset`'s scale word in page `page`.
    pub fn scale_addr(&self, page: u64, offset: u32) -> u64 {
        self.base
            + page * self.page_bytes
            + u64::from(self.tokens_per_page) * u64::from(self.value_bytes)
            + u64::from(offset) * u64::from(self.scale_bytes)
    }
}

/// One layer of a cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerCache {
    /// The layer.
    pub layer: LayerId,
    /// Its MLA cache (every DSA layer has one).
    pub mla: Option<MlaCacheView>,
    /// Its indexer K cache (layers that own an indexer).
    pub indexer: Option<IndexerCacheView>,
}

/// A whole cache (target or draft): every layer, in layer order.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheView {
    /// Layers, ascending (a DSA model's; empty for a model with sliding windows).
    pub layers: Vec<LayerCache>,
    /// Tokens per block (64; 256 for a model with sliding windows).
    pub tokens_per_block: u32,
    /// A model with sliding windows (DeepSeek-V4): its plan and where each life cycle's
    /// pools are. `None` for a DSA model.
    pub windowed: Option<crate::windowed::WindowedView>,
}

impl CacheView {
    /// The view of `plan` whose GPU-tier pools are at `pool(group, pool) -> (addr,
    /// bytes)`. Errors when a buffer's layout is not one a DSA kernel reads.
    pub(crate) fn new(
        plan: &PoolPlan,
        fp8_tensor_scale: f32,
        kv_dtype: KvDtype,
        indexer_dtype: IndexerDtype,
        mut pool: impl FnMut(&BufferPlacement) -> Region,
    ) -> Result<CacheView, String> {
        let t = plan.tokens_per_block();
        let slot_bytes = |p: &BufferPlacement| {
            plan.pool_groups()[p.pool_group.index()].pools[p.pool.index()].slot_bytes
        };
        let rows = |p: &BufferPlacement, region: Region| -> RowsView {
            let sb = slot_bytes(p);
            let row_bytes = p.row.bytes_per_token();
            let page = u64::from(p.tokens_per_page()) * u64::from(row_bytes);
            let c = p.converter;
            let packed = c.expansion == 1
                && page == p.page_stride
                && p.offset_in_slot == u64::from(c.layer_offset) * page
                && sb == u64::from(c.scale) * page;
            RowsView {
                pool: region,
                base: region.addr + p.offset_in_slot,
                page_stride: sb,
                pages: (region.bytes / sb.max(1)) as u32,
                tokens_per_page: p.tokens_per_page(),
                row_bytes,
                pool_pages: packed.then_some(PageConversion {
                    scale: c.scale,
                    offset: c.layer_offset,
                }),
            }
        };
        let mut layers: Vec<LayerCache> = plan
            .layer_ids()
            .map(|layer| LayerCache {
                layer,
                mla: None,
                indexer: None,
            })
            .collect();
        for p in plan.placements() {
            let Some(l) = layers.iter_mut().find(|l| l.layer == p.layer) else {
                continue;
            };
            match p.role {
                Role::Key => {
                    let block_scales = match plan.placement(p.layer, Role::KeyBlockScale) {
                        Ok(sp) => Some(rows(sp, pool(sp))),
                        Err(_) => None,
                    };
                    l.mla = Some(MlaCacheView {
                        rows: rows(p, pool(p)),
                        encoding: kv_dtype,
                        fp8_tensor_scale,
                        block_scales,
                    });
                }
                Role::IndexKey => {
                    let dsa_kv_core::layout::RowLayout::ValuesThenScales {
                        data_bytes,
                        scale_bytes,
                    } = p.row
                    else {
                        return Err(format!(
                            "layer {} indexer buffer is not in the values-then-scales page layout",
                            p.layer.get()
                        ));
                    };
                    let region = pool(p);
                    let page_bytes = p.page_stride;
                    let c = p.converter;
                    if c.expansion != 1
                        || p.offset_in_slot != u64::from(c.layer_offset) * page_bytes
                    {
                        return Err(format!(
                            "layer {} indexer pages are not whole pages of their pool",
                            p.layer.get()
                        ));
                    }
                    l.indexer = Some(IndexerCacheView {
                        pool: region,
                        base: region.addr + p.offset_in_slot,
                        page_bytes,
                        value_bytes: data_bytes,
                        scale_bytes,
                        tokens_per_page: p.tokens_per_page(),
                        page_scale: c.scale,
                        pages: region.bytes.saturating_sub(p.offset_in_slot) / page_bytes.max(1),
                        pool_pages: PageConversion {
                            scale: c.scale,
                            offset: c.layer_offset,
                        },
                        dtype: indexer_dtype,
                    });
                }
                _ => {}
            }
        }
        Ok(CacheView {
            layers,
            tokens_per_block: t,
            windowed: None,
        })
    }

    /// The view of one layer.
    pub fn layer(&self, layer: LayerId) -> Option<&LayerCache> {
        self.layers.iter().find(|l| l.layer == layer)
    }
}

/// Element type of a metadata buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// `i32`.
    I32,
    /// `i64`.
    I64,
}

impl Elem {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Elem::I32 => 4,
            Elem::I64 => 8,
        }
    }
}

/// What a metadata buffer holds, beyond the per-set roles of [`BufferRole`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetaRole {
    /// A buffer of the bound set.
    Set(BufferRole),
    /// `[max_num_tokens]` i32: request index of each new token.
    ReqIdxPerToken,
    /// `[max_num_tokens]` i32: causal window start of each context token.
    CuSeqlenKs,
    /// `[max_num_tokens]` i32: causal window end (exclusive) of each context token.
    CuSeqlenKe,
}

/// One persistent metadata buffer: allocated once at the configured maxima.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetaBuffer {
    /// What it holds.
    pub role: MetaRole,
    /// Address (the same on every step).
    pub addr: u64,
    /// Element type.
    pub elem: Elem,
    /// Elements allocated.
    pub capacity: usize,
    /// Elements this step uses (the rest is padding: −1 mappings and block-table
    /// entries, 0 page-table entries, lengths, request indices and windows).
    pub used: usize,
}

/// Every step-metadata buffer the kernels read, bound for this batch's phase (the draft
/// set during a replay). The contents are documented on [`BufferRole`] and in
/// [`dsa_kv_core::metadata`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetadataView {
    /// `[max_num_sequences, max_blocks_per_seq]` i32: indexer page per block.
    pub indexer_page_table: MetaBuffer,
    /// `[max_num_sequences, max_blocks_per_seq]` i32: slot per block, −1 past the KV.
    pub block_table: MetaBuffer,
    /// `[max_num_tokens]` i64: byte offset of each new token's indexer payload.
    pub slot_mapping_value: MetaBuffer,
    /// `[max_num_tokens]` i64: byte offset of each new token's indexer scale word.
    pub slot_mapping_scale: MetaBuffer,
    /// `[max_num_tokens]` i64: token slot of each new token's MLA row.
    pub mla_slot_mapping: MetaBuffer,
    /// Full-KV payload offsets of every KV token of the context requests.
    pub full_kv_value: MetaBuffer,
    /// Full-KV scale offsets.
    pub full_kv_scale: MetaBuffer,
    /// The full-KV bindings alias the slot mappings (no context request has cached
    /// tokens): `full_kv_*` are then the slot-mapping buffers.
    pub full_kv_aliased: bool,
    /// `[max_num_sequences]` i32: KV tokens of each request after this step.
    pub kv_lens: MetaBuffer,
    /// `[max_num_sequences]` i32: KV tokens of each request before this step.
    pub num_cached: MetaBuffer,
    /// Request index of each new token.
    pub req_idx_per_token: MetaBuffer,
    /// Causal window starts.
    pub cu_seqlen_ks: MetaBuffer,
    /// Causal window ends.
    pub cu_seqlen_ke: MetaBuffer,
    /// Columns of the page tables.
    pub max_blocks_per_seq: usize,
    /// Counts of this step.
    pub counts: StepCounts,
}

impl MetadataView {
    /// The view of the bound set of `meta`, each buffer at `addr(buffer)`.
    pub fn of(meta: &StepMetadata, addr: impl Fn(MetaRef) -> u64) -> MetadataView {
        let b = meta.bindings();
        let c = meta.counts();
        let rows = c.num_requests * meta.max_blocks_per_seq();
        let full = if b.full_kv_aliased() {
            c.num_tokens
        } else {
            c.num_full_kv_tokens
        };
        let buf = |r: MetaRef, role: MetaRole, used: usize| {
            let eb = meta.mirror_elem_bytes(r);
            MetaBuffer {
                role,
                addr: addr(r),
                elem: if eb == 8 { Elem::I64 } else { Elem::I32 },
                capacity: meta.mirror_bytes(r).len() / eb,
                used,
            }
        };
        let set = |id, used| buf(MetaRef::Set(id), MetaRole::Set(meta.buffer_role(id)), used);
        MetadataView {
            indexer_page_table: set(b.indexer_page_table, rows),
            block_table: set(b.block_table, rows),
            slot_mapping_value: set(b.slot_mapping_value, c.num_tokens),
            slot_mapping_scale: set(b.slot_mapping_scale, c.num_tokens),
            mla_slot_mapping: set(b.mla_slot_mapping, c.num_tokens),
            full_kv_value: set(b.full_kv_value, full),
            full_kv_scale: set(b.full_kv_scale, full),
            full_kv_aliased: b.full_kv_aliased(),
            kv_lens: set(b.kv_lens, c.num_requests),
            num_cached: set(b.num_cached, c.num_requests),
            req_idx_per_token: buf(MetaRef::ReqIdx, MetaRole::ReqIdxPerToken, c.num_tokens),
            cu_seqlen_ks: buf(MetaRef::Ks, MetaRole::CuSeqlenKs, c.num_tokens),
            cu_seqlen_ke: buf(MetaRef::Ke, MetaRole::CuSeqlenKe, c.num_tokens),
            max_blocks_per_seq: meta.max_blocks_per_seq(),
            counts: c,
        }
    }

    /// Every buffer of the view, in field order.
    pub fn buffers(&self) -> [MetaBuffer; 12] {
        [
            self.indexer_page_table,
            self.block_table,
            self.slot_mapping_value,
            self.slot_mapping_scale,
            self.mla_slot_mapping,
            self.full_kv_value,
            self.full_kv_scale,
            self.kv_lens,
            self.num_cached,
            self.req_idx_per_token,
            self.cu_seqlen_ks,
            self.cu_seqlen_ke,
        ]
    }
}

/// What a forward factory knows about its device.
pub struct ForwardSetup<'a> {
    /// Device index (tensor-parallel rank).
    pub device: usize,
    /// Where the addresses point.
    pub memory: MemKind,
    /// The model (dimensions and cache encodings).
    pub model: &'a DsaModel,
    /// The target cache.
    pub target: &'a CacheView,
    /// The draft cache (separate draft cache only).
    pub draft: Option<&'a CacheView>,
    /// The target metadata buffers (addresses; counts are those of no step yet).
    pub metadata: MetadataView,
    /// Most new tokens in one step (`max_num_tokens`).
    pub max_num_tokens: usize,
    /// Most requests in one step.
    pub max_num_sequences: usize,
    /// The backend's own handle of the device (read it with
    /// [`extension`](Self::extension)).
    pub extension: Option<&'a (dyn Any + Send + Sync)>,
    /// The compute stream the forward will run on (CUDA backend; read it with
    /// [`cuda_stream`](Self::cuda_stream)).
    #[cfg(feature = "cuda")]
    pub stream: Option<std::sync::Arc<cudarc::driver::CudaStream>>,
}

impl ForwardSetup<'_> {
    /// The backend's own handle of the device, if it is a `T` (the CUDA backend gives
    /// its `Arc<dsa_kv_cuda::Gpu>`: context, streams, our kernels).
    pub fn extension<T: Any>(&self) -> Option<&T> {
        self.extension?.downcast_ref::<T>()
    }

    /// The compute stream the forward will run on (CUDA backend).
    #[cfg(feature = "cuda")]
    pub fn cuda_stream(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaStream>> {
        self.stream.as_ref()
    }
}

/// One step's batch, as a forward sees it. See the module docs.
pub struct Batch<'a> {
    /// Step number.
    pub step: u64,
    /// Device index.
    pub device: usize,
    /// Target model or draft layers.
    pub phase: Phase,
    /// The scheduled requests, context requests first (ids, kinds, cached and new token
    /// counts, the new tokens with drafts last, and host copies of the block slots:
    /// `block_slots` for the target cache, `draft_block_slots` for the draft cache).
    pub requests: &'a [PlannedRequest],
    /// The cache this phase reads and writes, per layer.
    pub cache: &'a CacheView,
    /// The metadata buffers bound for this phase.
    pub metadata: MetadataView,
    pub(crate) host_meta: &'a StepMetadata,
    pub(crate) memory: BatchMemory<'a>,
    pub(crate) extension: Option<&'a (dyn Any + Send + Sync)>,
}

pub(crate) enum BatchMemory<'a> {
    Host(HostMemory<'a>),
    #[cfg(feature = "cuda")]
    Cuda {
        ordinal: usize,
        stream: &'a std::sync::Arc<cudarc::driver::CudaStream>,
    },
}

impl<'a> Batch<'a> {
    /// The batch of a CUDA backend: pools and metadata on GPU `ordinal`, the forward's
    /// kernels on `stream` (for [`DeviceBackend`](crate::DeviceBackend) implementations).
    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments)]
    pub fn on_cuda(
        step: u64,
        device: usize,
        phase: Phase,
        requests: &'a [PlannedRequest],
        cache: &'a CacheView,
        metadata: MetadataView,
        host_meta: &'a StepMetadata,
        (ordinal, stream): (usize, &'a std::sync::Arc<cudarc::driver::CudaStream>),
        extension: Option<&'a (dyn Any + Send + Sync)>,
    ) -> Self {
        Batch {
            step,
            device,
            phase,
            requests,
            cache,
            metadata,
            host_meta,
            memory: BatchMemory::Cuda { ordinal, stream },
            extension,
        }
    }

    /// Runs `forward`'s method for this batch's phase: the target's sampling, or the
    /// draft layers' proposals as [`Sampled::drafts`] (no outcomes).
    pub fn run(&mut self, forward: &mut dyn Forward) -> Result<Sampling, ForwardError> {
        match self.phase {
            Phase::Target => forward.forward(self),
            Phase::Draft => forward
                .draft_forward(self)
                .map(|drafts| Sampling::Sampled(Sampled::default().with_drafts(drafts))),
        }
    }

    /// Where the addresses point.
    pub fn memory(&self) -> MemKind {
        match &self.memory {
            BatchMemory::Host(_) => MemKind::Host,
            #[cfg(feature = "cuda")]
            BatchMemory::Cuda { ordinal, .. } => MemKind::Device {
                ordinal: *ordinal as u32,
            },
        }
    }

    /// Host copies of this batch's metadata (on the CUDA backend: what was uploaded),
    /// bound for this phase.
    pub fn host_metadata(&self) -> &'a StepMetadata {
        self.host_meta
    }

    /// Safe access to the pools and metadata (host backend; `None` on a GPU).
    pub fn host(&mut self) -> Option<&mut HostMemory<'a>> {
        match &mut self.memory {
            BatchMemory::Host(h) => Some(h),
            #[cfg(feature = "cuda")]
            BatchMemory::Cuda { .. } => None,
        }
    }

    /// The device's compute stream (CUDA backend; `None` on the host). Kernels enqueued
    /// here run after this step's copies and metadata uploads and before the next step's.
    #[cfg(feature = "cuda")]
    pub fn cuda_stream(&self) -> Option<&'a std::sync::Arc<cudarc::driver::CudaStream>> {
        match &self.memory {
            BatchMemory::Cuda { stream, .. } => Some(stream),
            BatchMemory::Host(_) => None,
        }
    }

    /// The backend's own handle of the device, if it is a `T` (see
    /// [`ForwardSetup::extension`]).
    pub fn extension<T: Any>(&self) -> Option<&T> {
        self.extension?.downcast_ref::<T>()
    }
}

/// The host backend's pools (GPU tier of the batch's cache) and metadata, as safe
/// slices found by address.
pub struct HostMemory<'a> {
    pub(crate) pools: Vec<(Region, &'a mut [u8])>,
    pub(crate) metadata: Vec<(u64, MetaSlice<'a>)>,
}

#[derive(Clone, Copy)]
pub(crate) enum MetaSlice<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl<'a> HostMemory<'a> {
    /// Host memory over `pools` (each at its own address) and every buffer of `meta`.
    pub(crate) fn new(pools: impl Iterator<Item = &'a mut [u8]>, meta: &'a StepMetadata) -> Self {
        let pools = pools
            .map(|b| {
                let r = Region {
                    addr: b.as_ptr() as u64,
                    bytes: b.len() as u64,
                };
                (r, b)
            })
            .collect();
        let metadata = meta
            .mirror_refs()
            .into_iter()
            .map(|r| {
                let bytes = meta.mirror_bytes(r);
                let slice = match r {
                    MetaRef::Set(id) => match meta.buffer_i32(id) {
                        Some(v) => MetaSlice::I32(v),
                        None => MetaSlice::I64(meta.buffer_i64(id).unwrap_or(&[])),
                    },
                    MetaRef::ReqIdx => MetaSlice::I32(meta.req_idx_per_token()),
                    MetaRef::Ks => MetaSlice::I32(meta.cu_seqlen_ks()),
                    MetaRef::Ke => MetaSlice::I32(meta.cu_seqlen_ke()),
                };
                (bytes.as_ptr() as u64, slice)
            })
            .collect();
        HostMemory { pools, metadata }
    }

    /// Two disjoint ranges inside pools, both writable (e.g. NVFP4 rows and their block
    /// scales).
    pub fn two_mut<'s>(
        &'s mut self,
        a: (u64, u64),
        b: (u64, u64),
    ) -> Result<(&'s mut [u8], &'s mut [u8]), ForwardError> {
        let (ia, ib) = (self.pool_index(a.0, a.1)?, self.pool_index(b.0, b.1)?);
        if ia == ib {
            return Err(ForwardError::Memory {
                what: format!("{:#x} and {:#x} are in the same pool", a.0, b.0),
            });
        }
        let (lo, hi) = (ia.min(ib), ia.max(ib));
        let (left, right) = self.pools.split_at_mut(hi);
        let ((rl, bl), (rh, bh)) = (&mut left[lo], &mut right[0]);
        let cut = |r: &Region, b: &'s mut [u8], (addr, len): (u64, u64)| {
            &mut b[(addr - r.addr) as usize..][..len as usize]
        };
        let (lo_range, hi_range) = if ia < ib { (a, b) } else { (b, a) };
        let (x, y) = (cut(rl, bl, lo_range), cut(rh, bh, hi_range));
        Ok(if ia < ib { (x, y) } else { (y, x) })
    }
    fn pool_index(&self, addr: u64, len: u64) -> Result<usize, ForwardError> {
        self.pools
            .iter()
            .position(|(r, _)| r.contains(addr, len))
            .ok_or_else(|| ForwardError::Memory {
                what: format!("{len} bytes at {addr:#x} are not inside one pool of this cache"),
            })
    }

    /// `len` bytes at `addr` (inside one pool).
    pub fn bytes(&self, addr: u64, len: u64) -> Result<&[u8], ForwardError> {
        let i = self.pool_index(addr, len)?;
        let (r, b) = &self.pools[i];
        let o = (addr - r.addr) as usize;
        Ok(&b[o..o + len as usize])
    }

    /// `len` bytes at `addr` (inside one pool), writable.
    pub fn bytes_mut(&mut self, addr: u64, len: u64) -> Result<&mut [u8], ForwardError> {
        let i = self.pool_index(addr, len)?;
        let (r, b) = &mut self.pools[i];
        let o = (addr - r.addr) as usize;
        Ok(&mut b[o..o + len as usize])
    }

    /// The whole pool holding `region` (one of the views' `pool`s), writable.
    pub fn pool_mut(&mut self, region: Region) -> Result<&mut [u8], ForwardError> {
        self.bytes_mut(region.addr, region.bytes)
    }

    fn meta(&self, b: &MetaBuffer) -> Result<MetaSlice<'a>, ForwardError> {
        self.metadata
            .iter()
            .find(|(a, _)| *a == b.addr)
            .map(|(_, s)| *s)
            .ok_or_else(|| ForwardError::Memory {
                what: format!("no metadata buffer at {:#x}", b.addr),
            })
    }

    /// The contents of an i32 metadata buffer (all `capacity` elements).
    pub fn i32s(&self, b: &MetaBuffer) -> Result<&'a [i32], ForwardError> {
        match self.meta(b)? {
            MetaSlice::I32(s) => Ok(s),
            MetaSlice::I64(_) => Err(ForwardError::Memory {
                what: format!("metadata buffer {:?} holds i64", b.role),
            }),
        }
    }

    /// The contents of an i64 metadata buffer (all `capacity` elements).
    pub fn i64s(&self, b: &MetaBuffer) -> Result<&'a [i64], ForwardError> {
        match self.meta(b)? {
            MetaSlice::I64(s) => Ok(s),
            MetaSlice::I32(_) => Err(ForwardError::Memory {
                what: format!("metadata buffer {:?} holds i32", b.role),
            }),
        }
    }
}
