//! [`StepMetadata`]: what the DSA kernels read each step, built on the host with the
//! exact semantics of the device path (the rules below).
//!
//! For a batch (context requests first, then generation requests), with request `r`
//! holding `c_r` cached and `n_r` new tokens and `kv_r = c_r + n_r`:
//! * indexer page table `[r][b] = slot × indexer_page_scale` (padding clamped to 0);
//! * block table `[r][b] = slot` for `b < ceil(kv_r / T)`, −1 after;
//! * for each new token `g = c_r + j`: payload offset `page × T(D+S) + (g mod T) × D`,
//!   scale offset `page × T(D+S) + T·D + (g mod T) × S` with `page = table[r][g / T]`
//!   (64-bit), MLA token slot `slot × T + g mod T`, request index `r`;
//! * context tokens: causal window `ks = start of r in the concatenated context KV`,
//!   `ke = ks + c_r + j + 1`;
//! * full-KV mappings: when some context request has cached tokens (and full-KV is
//!   enabled), own buffers with the offsets of every KV token of every context request,
//!   request-major; otherwise the bindings alias the slot mappings. A step without
//!   context requests leaves them as they were.
//!
//! Padding (for CUDA graphs): mappings −1 (skip), request indices and windows 0.

use serde::Serialize;

use super::buffers::{Bindings, BufferId, BufferRole, ChangeLog, Data, MetaBuffer};
use super::MetadataError;
use crate::core::scheduler::{PlannedRequest, RequestKind};
use crate::core::RowStamp;
use crate::layout::{IndexerPageLayout, LayoutError, PoolPlan, Role, RowLayout};

/// The per-manager constants the metadata needs (target and draft managers differ).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct MetadataLayout {
    /// Tokens per block `T`.
    pub tokens_per_block: u32,
    /// Indexer pages per slot (V1: 1; V2: the `IndexKey` converter scale).
    pub indexer_page_scale: u32,
    /// Indexer page geometry; `None` when no layer owns an indexer (mappings are −1).
    pub indexer: Option<IndexerPageLayout>,
}

impl MetadataLayout {
    /// The constants of `plan`: tokens per block, the (uniform) indexer page scale and
    /// the indexer page geometry.
    pub fn from_plan(plan: &PoolPlan) -> Result<Self, LayoutError> {
        let indexer = plan
            .placements()
            .iter()
            .find(|p| p.role == Role::IndexKey)
            .map(|p| match p.row {
                RowLayout::ValuesThenScales {
                    data_bytes,
                    scale_bytes,
                } => Ok(IndexerPageLayout {
                    tokens_per_block: p.tokens_per_page(),
                    data_bytes,
                    scale_bytes,
                }),
                _ => Err(LayoutError::NoSuchBuffer {
                    layer: p.layer,
                    role: Role::IndexKey,
                    hint: ": an indexer buffer must use the values-then-scales page layout",
                }),
            })
            .transpose()?;
        Ok(MetadataLayout {
            tokens_per_block: plan.tokens_per_block(),
            indexer_page_scale: plan.indexer_page_scale()?,
            indexer,
        })
    }
}

/// Sizes of one buffer set, fixed at creation.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct MetadataDims {
    /// Rows of the page tables.
    pub max_num_sequences: usize,
    /// Columns of the page tables (pad to a multiple of 4 for 16-byte vector copies).
    pub max_blocks_per_seq: usize,
    /// New tokens per step.
    pub max_num_tokens: usize,
    /// KV tokens of all context requests of a step (full-KV mappings).
    pub max_context_kv_tokens: usize,
}

/// One request of a step, as the scheduler and the cache manager describe it.
#[derive(Clone, Copy, Debug)]
pub struct StepRequest<'a> {
    /// Context or generation.
    pub kind: RequestKind,
    /// Physical slot of every block the request holds (the manager's block table row).
    pub block_slots: &'a [i32],
    /// What changed in `block_slots` since the row the previous step carried for this
    /// request ([`BlockRow::stamp`](crate::core::BlockRow::stamp));
    /// [`RowStamp::UNKNOWN`] rewrites the row whole. With a true stamp, a request that
    /// stays at its batch index costs the page tables only its changed columns. The
    /// stamp is a promise: columns it says are unchanged are neither rewritten nor
    /// validated again (the scheduler's stamps are true; a row changed by hand must be
    /// stamped unknown, as [`BlockRow::make_mut`](crate::core::BlockRow::make_mut) does).
    pub row: RowStamp,
    /// KV tokens before this step.
    pub num_cached: u32,
    /// Tokens this step adds (query tokens).
    pub num_new: u32,
    /// Helix context parallelism: this rank is inactive for the request and adds no
    /// tokens this step.
    pub helix_inactive: bool,
}

impl<'a> StepRequest<'a> {
    /// A planned request as this step's request: its target row (`draft`: its
    /// draft-manager row, empty when it has none) with that row's stamp.
    pub fn planned(r: &'a PlannedRequest, draft: bool) -> Self {
        let (block_slots, row) = if draft {
            r.draft_block_slots
                .as_ref()
                .map_or((&[][..], RowStamp::UNKNOWN), |d| (&d[..], d.stamp()))
        } else {
            (&r.block_slots[..], r.block_slots.stamp())
        };
        StepRequest {
            kind: r.kind,
            block_slots,
            row,
            num_cached: r.num_cached,
            num_new: r.tokens.len() as u32,
            helix_inactive: false,
        }
    }

    /// Tokens this step adds on this rank.
    pub fn added(&self) -> u32 {
        if self.helix_inactive {
            0
        } else {
            self.num_new
        }
    }
}

/// Counts of the prepared step.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize)]
pub struct StepCounts {
    /// Requests.
    pub num_requests: usize,
    /// Context requests (they come first).
    pub num_context_requests: usize,
    /// New tokens (all requests).
    pub num_tokens: usize,
    /// New tokens of context requests (they come first).
    pub num_context_tokens: usize,
    /// Entries of the full-KV mappings (0 when aliased).
    pub num_full_kv_tokens: usize,
}

/// The metadata buffers of one model instance on one device, with an optional draft
/// set for speculative decoding. See the module docs for the contents.
#[derive(Debug)]
pub struct StepMetadata {
    pub(super) buffers: Vec<MetaBuffer>,
    pub(super) target: Bindings,
    pub(super) target_dims: MetadataDims,
    pub(super) draft: Option<(Bindings, MetadataDims)>,
    pub(super) bound: Bindings,
    pub(super) bound_dims: MetadataDims,
    pub(super) layout: MetadataLayout,
    pub(super) full_kv_enabled: bool,
    /// Shared per-step buffers (identical for the target and the draft forward).
    pub(super) req_idx_per_token: Vec<i32>,
    pub(super) cu_seqlen_ks: Vec<i32>,
    pub(super) cu_seqlen_ke: Vec<i32>,
    pub(super) kinds: Vec<RequestKind>,
    pub(super) num_new: Vec<u32>,
    pub(super) helix_inactive: Vec<bool>,
    /// Blocks given per request, for the target (0) and the draft (1) set.
    pub(super) blocks_given: [Vec<u32>; 2],
    /// Columns written in each page-table row of the target (0) and draft (1) set since
    /// it was last padded whole: a rewrite re-pads only those, not the whole row.
    pub(super) row_cols: [Vec<usize>; 2],
    /// Per set and row: the block-table columns the last fill made valid (−1 after),
    /// and the version of the row it wrote ([`RowStamp`]; 0: unknown).
    pub(super) row_valid: [Vec<usize>; 2],
    pub(super) row_version: [Vec<u64>; 2],
    /// Per set and row: leading columns of the held row known to be non-negative.
    pub(super) row_ok: [Vec<usize>; 2],
    /// Per set: the indexer page scale its rows were filled with (a change rewrites
    /// every row).
    pub(super) filled_scale: [u32; 2],
    /// The validation's leading non-negative columns of each request (for the fill).
    pub(super) ok_scratch: Vec<usize>,
    /// Page-table cells the last fill wrote (both tables; padding included).
    pub(super) table_writes: usize,
    /// Sum of a mix of every page-table cell written (see
    /// [`table_digest`](Self::table_digest)).
    pub(super) table_digest: u64,
    pub(super) counts: StepCounts,
    /// Bumped by every prepare and restore of a draft replay.
    pub(super) epoch: u64,
    /// Epoch of the active draft replay.
    pub(super) replay: Option<u64>,
}

/// A set's buffers (one per role, in [`BufferRole::ALL`] order) and their bindings.
fn alloc_set(buffers: &mut Vec<MetaBuffer>, d: &MetadataDims) -> Bindings {
    Bindings::from_roles(|role| {
        buffers.push(role.alloc(d));
        BufferId((buffers.len() - 1) as u32)
    })
}

impl StepMetadata {
    /// Allocates the target set (and a draft set sized from the draft manager, when
    /// speculative decoding uses a separate draft cache). `full_kv` enables the full-KV
    /// mappings for context requests with cached tokens (context MLA over cached KV).
    pub fn new(
        layout: MetadataLayout,
        dims: MetadataDims,
        draft_dims: Option<MetadataDims>,
        full_kv: bool,
    ) -> Result<Self, MetadataError> {
        for d in std::iter::once(&dims).chain(draft_dims.as_ref()) {
            if d.max_num_sequences == 0 || d.max_blocks_per_seq == 0 || d.max_num_tokens == 0 {
                return Err(MetadataError::BadDims { dims: *d });
            }
        }
        if draft_dims.is_some_and(|d| {
            d.max_num_sequences != dims.max_num_sequences || d.max_num_tokens != dims.max_num_tokens
        }) {
            return Err(MetadataError::BadDims {
                dims: draft_dims.expect("checked"),
            });
        }
        let mut buffers = Vec::new();
        let target = alloc_set(&mut buffers, &dims);
        let draft = draft_dims.map(|d| (alloc_set(&mut buffers, &d), d));
        Ok(StepMetadata {
            buffers,
            target,
            target_dims: dims,
            draft,
            bound: target.with_alias(true),
            bound_dims: dims,
            layout,
            full_kv_enabled: full_kv,
            req_idx_per_token: vec![0; dims.max_num_tokens],
            cu_seqlen_ks: vec![0; dims.max_num_tokens],
            cu_seqlen_ke: vec![0; dims.max_num_tokens],
            kinds: Vec::new(),
            num_new: Vec::new(),
            helix_inactive: Vec::new(),
            blocks_given: [Vec::new(), Vec::new()],
            row_cols: [
                vec![0; dims.max_num_sequences],
                vec![0; draft_dims.map_or(0, |d| d.max_num_sequences)],
            ],
            row_valid: [
                vec![0; dims.max_num_sequences],
                vec![0; draft_dims.map_or(0, |d| d.max_num_sequences)],
            ],
            row_version: [
                vec![0; dims.max_num_sequences],
                vec![0; draft_dims.map_or(0, |d| d.max_num_sequences)],
            ],
            row_ok: [
                vec![0; dims.max_num_sequences],
                vec![0; draft_dims.map_or(0, |d| d.max_num_sequences)],
            ],
            ok_scratch: Vec::new(),
            filled_scale: [layout.indexer_page_scale; 2],
            table_writes: 0,
            table_digest: DIGEST_SEED,
            counts: StepCounts::default(),
            epoch: 0,
            replay: None,
        })
    }

    pub(super) fn i32s(&self, id: BufferId) -> &[i32] {
        match &self.buffers[id.0 as usize].data {
            Data::I32(v) => v,
            Data::I64(_) => unreachable!("invariant: buffer {id:?} holds i32"),
        }
    }

    pub(super) fn i64s(&self, id: BufferId) -> &[i64] {
        match &self.buffers[id.0 as usize].data {
            Data::I64(v) => v,
            Data::I32(_) => unreachable!("invariant: buffer {id:?} holds i64"),
        }
    }

    pub(super) fn i32s_mut(&mut self, id: BufferId) -> &mut [i32] {
        match &mut self.buffers[id.0 as usize].data {
            Data::I32(v) => v,
            Data::I64(_) => unreachable!("invariant: buffer {id:?} holds i32"),
        }
    }

    /// Validates a batch against `dims` and `layout`; returns the step counts.
    pub(super) fn validate_for(
        &mut self,
        which: usize,
        layout: &MetadataLayout,
        dims: &MetadataDims,
        reqs: &[StepRequest],
    ) -> Result<StepCounts, MetadataError> {
        if reqs.len() > dims.max_num_sequences {
            return Err(MetadataError::TooManyRequests {
                got: reqs.len(),
                max: dims.max_num_sequences,
            });
        }
        let t = u64::from(layout.tokens_per_block);
        let mut c = StepCounts {
            num_requests: reqs.len(),
            ..Default::default()
        };
        let mut context_kv = 0usize;
        let mut any_cached_context = false;
        self.ok_scratch.clear();
        for (i, r) in reqs.iter().enumerate() {
            if r.kind == RequestKind::Context {
                if i > c.num_context_requests {
                    return Err(MetadataError::ContextAfterGeneration { index: i });
                }
                c.num_context_requests += 1;
                c.num_context_tokens += r.added() as usize;
                context_kv += (r.num_cached + r.added()) as usize;
                any_cached_context |= r.num_cached > 0;
            }
            if r.block_slots.len() > dims.max_blocks_per_seq {
                return Err(MetadataError::TooManyBlocks {
                    request: i,
                    blocks: r.block_slots.len(),
                    max: dims.max_blocks_per_seq,
                });
            }
            let kv = u64::from(r.num_cached) + u64::from(r.added());
            let needed = kv.div_ceil(t) as usize;
            // Leading non-negative slots: known for the columns this row kept since the
            // last fill (its stamp says which), counted from there on.
            let len = r.block_slots.len();
            let kept = match (self.row_version[which].get(i), self.row_cols[which].get(i)) {
                (Some(&v), Some(&cols)) => r.row.rewrite_from(v, len).min(cols),
                _ => 0,
            };
            let known = self.row_ok[which].get(i).map_or(0, |&ok| ok.min(kept));
            let ok = known
                + r.block_slots[known..]
                    .iter()
                    .position(|&s| s < 0)
                    .unwrap_or(len - known);
            self.ok_scratch.push(ok);
            if needed > ok {
                return Err(MetadataError::BlocksShort {
                    request: i,
                    kv_len: kv,
                    needed,
                    given: ok,
                });
            }
            c.num_tokens += r.added() as usize;
        }
        if c.num_tokens > dims.max_num_tokens {
            return Err(MetadataError::TooManyTokens {
                got: c.num_tokens,
                max: dims.max_num_tokens,
            });
        }
        if self.full_kv_enabled && any_cached_context {
            if context_kv > dims.max_context_kv_tokens {
                return Err(MetadataError::ContextKvOverflow {
                    got: context_kv,
                    max: dims.max_context_kv_tokens,
                });
            }
            c.num_full_kv_tokens = context_kv;
        }
        Ok(c)
    }

    /// Builds the metadata of a step into the bound (target) buffers. Errors leave every
    /// buffer as it was.
    pub fn prepare(
        &mut self,
        layout: &MetadataLayout,
        reqs: &[StepRequest],
    ) -> Result<StepCounts, MetadataError> {
        if self.replay.is_some() {
            return Err(MetadataError::ReplayActive);
        }
        let dims = self.bound_dims;
        let counts = self.validate_for(0, layout, &dims, reqs)?;
        // The shared per-token buffers hold values up to the last prepare's tokens (after
        // a replay's restore, the same prepare's): only those are re-padded.
        let old_tokens = self.counts.num_tokens;
        self.layout = *layout;
        self.counts = counts;
        self.kinds.clear();
        self.kinds.extend(reqs.iter().map(|r| r.kind));
        self.num_new.clear();
        self.num_new.extend(reqs.iter().map(|r| r.num_new));
        self.helix_inactive.clear();
        self.helix_inactive
            .extend(reqs.iter().map(|r| r.helix_inactive));
        self.blocks_given[0].clear();
        self.blocks_given[0].extend(reqs.iter().map(|r| r.block_slots.len() as u32));
        // Shared per-token buffers.
        let mut tok = 0;
        let mut kv_start = 0i32;
        for (r, req) in reqs.iter().enumerate() {
            let kv = (req.num_cached + req.added()) as i32;
            for j in 0..req.added() as i32 {
                self.req_idx_per_token[tok] = r as i32;
                let ctx = req.kind == RequestKind::Context;
                self.cu_seqlen_ks[tok] = if ctx { kv_start } else { 0 };
                self.cu_seqlen_ke[tok] = if ctx {
                    kv_start + req.num_cached as i32 + j + 1
                } else {
                    0
                };
                tok += 1;
            }
            if req.kind == RequestKind::Context {
                kv_start += kv;
            }
        }
        let stale = tok..old_tokens.max(tok);
        self.req_idx_per_token[stale.clone()].fill(0);
        self.cu_seqlen_ks[stale.clone()].fill(0);
        self.cu_seqlen_ke[stale].fill(0);
        let set = self.bound_set();
        self.fill_set(&set, self.bound_dims, reqs, counts);
        Ok(counts)
    }

    /// The buffer set that is bound now.
    pub(super) fn bound_set(&self) -> Bindings {
        match &self.draft {
            Some((d, _)) if self.bound.indexer_page_table == d.indexer_page_table => *d,
            _ => self.target,
        }
    }

    /// Takes an i32 buffer out of the arena to rewrite it (the heap block, and so its
    /// address, does not move); give it back with [`put_i32`](Self::put_i32).
    fn take_i32(&mut self, id: BufferId) -> (Vec<i32>, usize) {
        let b = &mut self.buffers[id.0 as usize];
        match &mut b.data {
            Data::I32(v) => (std::mem::take(v), b.dirty),
            Data::I64(_) => unreachable!("invariant: buffer {id:?} holds i32"),
        }
    }

    /// Puts back a rewritten buffer whose first `used` entries are valid; pads the rest
    /// that the previous use had written.
    fn put_i32(&mut self, id: BufferId, mut v: Vec<i32>, old_dirty: usize, used: usize, pad: i32) {
        if old_dirty > used {
            v[used..old_dirty].fill(pad);
        }
        let b = &mut self.buffers[id.0 as usize];
        b.data = Data::I32(v);
        b.dirty = used;
    }

    fn take_i64(&mut self, id: BufferId) -> (Vec<i64>, usize) {
        let b = &mut self.buffers[id.0 as usize];
        match &mut b.data {
            Data::I64(v) => (std::mem::take(v), b.dirty),
            Data::I32(_) => unreachable!("invariant: buffer {id:?} holds i64"),
        }
    }

    fn put_i64(&mut self, id: BufferId, mut v: Vec<i64>, old_dirty: usize, used: usize) {
        if old_dirty > used {
            v[used..old_dirty].fill(-1);
        }
        let b = &mut self.buffers[id.0 as usize];
        b.data = Data::I64(v);
        b.dirty = used;
    }

    /// Fills every buffer of `set` for a validated batch and rebinds the full-KV
    /// mappings (own buffers or alias) of that set.
    pub(super) fn fill_set(
        &mut self,
        set: &Bindings,
        dims: MetadataDims,
        reqs: &[StepRequest],
        counts: StepCounts,
    ) {
        let t = self.layout.tokens_per_block;
        let scale = self.layout.indexer_page_scale as i32;
        let b = dims.max_blocks_per_seq;
        let rows = reqs.len() * b;
        let (mut ix, ix_dirty) = self.take_i32(set.indexer_page_table);
        let (mut bt, bt_dirty) = self.take_i32(set.block_table);
        let which = usize::from(set.indexer_page_table != self.target.indexer_page_table);
        let mut row_cols = std::mem::take(&mut self.row_cols[which]);
        let mut row_valid = std::mem::take(&mut self.row_valid[which]);
        let mut row_version = std::mem::take(&mut self.row_version[which]);
        let mut row_ok = std::mem::take(&mut self.row_ok[which]);
        if self.filled_scale[which] != self.layout.indexer_page_scale {
            // Kept indexer columns hold `slot × old scale`: nothing is kept.
            row_version.fill(0);
            self.filled_scale[which] = self.layout.indexer_page_scale;
        }
        let mut digest = self.table_digest;
        // What this fill writes is logged for a mirror (device copies).
        let mut ix_log = std::mem::take(&mut self.buffers[set.indexer_page_table.0 as usize].log);
        let mut bt_log = std::mem::take(&mut self.buffers[set.block_table.0 as usize].log);
        let (ix_len, bt_len) = (ix.len(), bt.len());
        let mut writes = 0usize;
        for (r, req) in reqs.iter().enumerate() {
            let row = r * b..(r + 1) * b;
            let valid = (req.num_cached + req.added()).div_ceil(t) as usize;
            let (ixr, btr) = (&mut ix[row.clone()], &mut bt[row]);
            let len = req.block_slots.len();
            let (old_len, old_valid) = (row_cols[r], row_valid[r]);
            // Columns before `from` hold this row already (the same request's row, or
            // the row it was derived from, was written here by the last fill).
            let from = req.row.rewrite_from(row_version[r], len).min(old_len);
            for (dst, &slot) in ixr[from..len].iter_mut().zip(&req.block_slots[from..]) {
                *dst = slot.max(0).saturating_mul(scale);
            }
            // Past `len` the row holds padding except what the last fill wrote there.
            let stale = old_len.max(len);
            ixr[len..stale].fill(0);
            // Block table: slots below `valid`, −1 from there (already −1 past the last
            // fill's `old_valid`).
            let bt_from = from.min(old_valid).min(valid);
            btr[bt_from..valid].copy_from_slice(&req.block_slots[bt_from..valid]);
            if old_valid > valid {
                btr[valid..old_valid].fill(-1);
            }
            let bt_to = valid.max(old_valid);
            writes += wrote(
                &mut ix_log,
                &mut digest,
                0,
                r * b + from,
                &ixr[from..stale],
                ix_len,
            ) + wrote(
                &mut bt_log,
                &mut digest,
                1,
                r * b + bt_from,
                &btr[bt_from..bt_to],
                bt_len,
            );
            row_cols[r] = len;
            row_valid[r] = valid;
            row_version[r] = req.row.version;
            row_ok[r] = self.ok_scratch.get(r).copied().unwrap_or(0);
        }
        // Rows past this batch are re-padded whole below.
        let old_rows = ix_dirty.max(bt_dirty).div_ceil(b.max(1));
        for r in reqs.len()..old_rows.min(row_cols.len()) {
            row_cols[r] = 0;
            row_valid[r] = 0;
            row_version[r] = 0;
            row_ok[r] = 0;
        }
        self.row_cols[which] = row_cols;
        self.row_valid[which] = row_valid;
        self.row_version[which] = row_version;
        self.row_ok[which] = row_ok;
        // `put_i32` re-pads what the last fill used past this batch's rows.
        for (t, pad, dirty, log, len) in [
            (0, 0, ix_dirty, &mut ix_log, ix_len),
            (1, -1, bt_dirty, &mut bt_log, bt_len),
        ] {
            let pads = [pad; 512];
            let mut at = rows;
            while at < dirty {
                let n = (dirty - at).min(pads.len());
                writes += wrote(log, &mut digest, t, at, &pads[..n], len);
                at += n;
            }
        }
        self.table_writes = writes;
        self.table_digest = digest;
        self.buffers[set.indexer_page_table.0 as usize].log = ix_log;
        self.buffers[set.block_table.0 as usize].log = bt_log;
        self.put_i32(set.indexer_page_table, ix, ix_dirty, rows, 0);
        self.put_i32(set.block_table, bt, bt_dirty, rows, -1);
        let (mut lens, lens_dirty) = self.take_i32(set.kv_lens);
        let (mut cached, cached_dirty) = self.take_i32(set.num_cached);
        for (r, req) in reqs.iter().enumerate() {
            lens[r] = (req.num_cached + req.added()) as i32;
            cached[r] = req.num_cached as i32;
        }
        self.put_i32(set.kv_lens, lens, lens_dirty, reqs.len(), 0);
        self.put_i32(set.num_cached, cached, cached_dirty, reqs.len(), 0);
        self.fill_slot_mappings(set, dims);
        if counts.num_context_requests > 0 {
            let own = counts.num_full_kv_tokens > 0;
            self.bound = set.with_alias(!own);
            if own {
                self.fill_full_kv(set, dims);
            }
        } else {
            // A step with no context request leaves the full-KV bindings as they were.
            let aliased = self.bound.full_kv_aliased();
            self.bound = set.with_alias(aliased);
        }
    }

    /// Writes the indexer byte offsets (payload, scale) of KV tokens `gs` of request `r`
    /// through the set's indexer page table, and the MLA token slots when asked.
    fn write_offsets(
        &self,
        set: &Bindings,
        dims: MetadataDims,
        r: usize,
        gs: std::ops::Range<u32>,
        out: (&mut [i64], &mut [i64], Option<&mut [i64]>),
    ) {
        let t = self.layout.tokens_per_block;
        let scale = self.layout.indexer_page_scale.max(1) as i32;
        let row = &self.i32s(set.indexer_page_table)
            [r * dims.max_blocks_per_seq..(r + 1) * dims.max_blocks_per_seq];
        let (vals, scales, mut mla) = out;
        if gs.is_empty() {
            return;
        }
        // Block and position advance token by token (no division per token); the
        // page's offsets are computed once per block.
        let (mut block, mut pos) = ((gs.start / t) as usize, gs.start % t);
        let page_of = |block: usize| {
            let page = row[block];
            let (v, s) = match self.layout.indexer {
                Some(ix) => (
                    ix.value_offset(page as u64, 0) as i64,
                    ix.scale_offset(page as u64, 0) as i64,
                ),
                None => (-1, -1),
            };
            // Physical slots come from the indexer page table (`slot × scale`, scale
            // ≥ 1), so a recompute needs nothing but the bound set.
            (v, s, i64::from(page / scale) * i64::from(t))
        };
        let (has, vs, ss) = match self.layout.indexer {
            Some(ix) => (true, i64::from(ix.data_bytes), i64::from(ix.scale_bytes)),
            None => (false, 0, 0),
        };
        let mut base = page_of(block);
        for i in 0..gs.len() {
            if pos == t {
                (block, pos) = (block + 1, 0);
                base = page_of(block);
            }
            let p = i64::from(pos);
            vals[i] = if has { base.0 + p * vs } else { -1 };
            scales[i] = if has { base.1 + p * ss } else { -1 };
            if let Some(m) = mla.as_deref_mut() {
                m[i] = base.2 + p;
            }
            pos += 1;
        }
    }

    /// Slot mappings of every new token, from the set's tables and cached lengths.
    pub(super) fn fill_slot_mappings(&mut self, set: &Bindings, dims: MetadataDims) {
        let (mut v, vd) = self.take_i64(set.slot_mapping_value);
        let (mut s, sd) = self.take_i64(set.slot_mapping_scale);
        let (mut m, md) = self.take_i64(set.mla_slot_mapping);
        let mut tok = 0;
        for r in 0..self.counts.num_requests {
            if self.helix_inactive[r] {
                continue;
            }
            let c = self.i32s(set.num_cached)[r] as u32;
            let n = self.num_new[r] as usize;
            let out = (
                &mut v[tok..tok + n],
                &mut s[tok..tok + n],
                Some(&mut m[tok..tok + n]),
            );
            self.write_offsets(set, dims, r, c..c + n as u32, out);
            tok += n;
        }
        self.put_i64(set.slot_mapping_value, v, vd, tok);
        self.put_i64(set.slot_mapping_scale, s, sd, tok);
        self.put_i64(set.mla_slot_mapping, m, md, tok);
    }

    fn fill_full_kv(&mut self, set: &Bindings, dims: MetadataDims) {
        let (mut v, vd) = self.take_i64(set.full_kv_value);
        let (mut s, sd) = self.take_i64(set.full_kv_scale);
        let mut at = 0;
        for r in 0..self.counts.num_context_requests {
            let len = self.i32s(set.kv_lens)[r] as usize;
            self.write_offsets(
                set,
                dims,
                r,
                0..len as u32,
                (&mut v[at..at + len], &mut s[at..at + len], None),
            );
            at += len;
        }
        self.put_i64(set.full_kv_value, v, vd, at);
        self.put_i64(set.full_kv_scale, s, sd, at);
    }

    /// Recomputes the slot mappings from corrected cached lengths (after speculative
    /// acceptance or an overlap scheduler), as the device does: one length per request
    /// of the prepared step. The full-KV mappings and their alias state are not touched.
    pub fn recompute_slot_mappings(&mut self, num_cached: &[u32]) -> Result<(), MetadataError> {
        if num_cached.len() != self.counts.num_requests {
            return Err(MetadataError::RequestCount {
                got: num_cached.len(),
                expected: self.counts.num_requests,
            });
        }
        let t = self.layout.tokens_per_block;
        for (r, &c) in num_cached.iter().enumerate() {
            // In u64: a cached length near u32::MAX is refused, not wrapped.
            let kv = u64::from(c)
                + u64::from(if self.helix_inactive[r] {
                    0
                } else {
                    self.num_new[r]
                });
            let needed = kv.div_ceil(u64::from(t.max(1)));
            let given = self.blocks_given[usize::from(self.replay.is_some())][r];
            if needed > u64::from(given) {
                return Err(MetadataError::BlocksShort {
                    request: r,
                    kv_len: kv,
                    needed: needed as usize,
                    given: given as usize,
                });
            }
        }
        let set = self.bound_set();
        let dims = self.bound_dims;
        for (r, &c) in num_cached.iter().enumerate() {
            let added = if self.helix_inactive[r] {
                0
            } else {
                self.num_new[r]
            };
            self.i32s_mut(set.num_cached)[r] = c as i32;
            self.i32s_mut(set.kv_lens)[r] = (c + added) as i32;
        }
        self.fill_slot_mappings(&set, dims);
        Ok(())
    }

    // ---- read access ----------------------------------------------------------------

    /// Counts of the prepared step.
    pub fn counts(&self) -> StepCounts {
        self.counts
    }

    /// Page-table cells (indexer page table and block table, padding included) the last
    /// [`prepare`](Self::prepare) or [`prepare_draft`](Self::prepare_draft) wrote: with
    /// true [`RowStamp`]s and requests that keep their batch index, the columns that
    /// changed, not the batch's context.
    pub fn last_table_writes(&self) -> usize {
        self.table_writes
    }

    /// A digest of the page tables' history: the wrapping sum of a 64-bit mix of every
    /// cell write the fills made (table, index, value) since creation. Two metadata that
    /// were filled alike (tensor-parallel ranks given the same plans) have the same
    /// digest; a step that writes one cell differently makes them differ (short of a
    /// 64-bit collision), and they stay different unless later writes happen to cancel
    /// the difference (the sum does not see write order: X = 5 then 7 on one rank and 7
    /// then 5 on another agree again), so compare every step. It costs the cells
    /// written, not the tables' size.
    pub fn table_digest(&self) -> u64 {
        self.table_digest
    }

    /// Current bindings (which buffer plays which role; full-KV alias state).
    pub fn bindings(&self) -> Bindings {
        self.bound
    }

    /// The layout constants the bound buffers were built with.
    pub fn layout(&self) -> MetadataLayout {
        self.layout
    }

    /// Columns of the bound page tables.
    pub fn max_blocks_per_seq(&self) -> usize {
        self.bound_dims.max_blocks_per_seq
    }

    /// The address of a buffer (stable for the metadata's life).
    pub fn buffer_addr(&self, id: BufferId) -> usize {
        self.buffers[id.0 as usize].addr()
    }

    /// What a buffer holds.
    pub fn buffer_role(&self, id: BufferId) -> BufferRole {
        self.buffers[id.0 as usize].role
    }

    /// Bound indexer page table, `[max_num_sequences × max_blocks_per_seq]`.
    pub fn indexer_page_table(&self) -> &[i32] {
        self.i32s(self.bound.indexer_page_table)
    }

    /// Bound physical block table.
    pub fn block_table(&self) -> &[i32] {
        self.i32s(self.bound.block_table)
    }

    /// Bound payload offsets of the new tokens (`[max_num_tokens]`, −1 padded).
    pub fn slot_mapping_value(&self) -> &[i64] {
        self.i64s(self.bound.slot_mapping_value)
    }

    /// Bound scale offsets of the new tokens.
    pub fn slot_mapping_scale(&self) -> &[i64] {
        self.i64s(self.bound.slot_mapping_scale)
    }

    /// Bound MLA token slots of the new tokens.
    pub fn mla_slot_mapping(&self) -> &[i64] {
        self.i64s(self.bound.mla_slot_mapping)
    }

    /// Bound full-KV payload offsets (the slot mappings when aliased).
    pub fn full_kv_value(&self) -> &[i64] {
        self.i64s(self.bound.full_kv_value)
    }

    /// Bound full-KV scale offsets (the slot mappings when aliased).
    pub fn full_kv_scale(&self) -> &[i64] {
        self.i64s(self.bound.full_kv_scale)
    }

    /// Bound KV length per request.
    pub fn kv_lens(&self) -> &[i32] {
        self.i32s(self.bound.kv_lens)
    }

    /// Bound cached length per request.
    pub fn num_cached(&self) -> &[i32] {
        self.i32s(self.bound.num_cached)
    }

    /// Request index of each new token.
    pub fn req_idx_per_token(&self) -> &[i32] {
        &self.req_idx_per_token
    }

    /// Causal window start of each context token.
    pub fn cu_seqlen_ks(&self) -> &[i32] {
        &self.cu_seqlen_ks
    }

    /// Causal window end (exclusive) of each context token.
    pub fn cu_seqlen_ke(&self) -> &[i32] {
        &self.cu_seqlen_ke
    }

    /// The buffers of the target set (`draft == false`) or of the draft set (`None`
    /// without draft buffers), one per role in [`BufferRole::ALL`] order.
    pub fn set_buffers(&self, draft: bool) -> Option<[BufferId; 9]> {
        if draft {
            self.draft.map(|(s, _)| s.ids())
        } else {
            Some(self.target.ids())
        }
    }

    /// Dimensions of the target set and of the draft set.
    pub fn dims(&self) -> (MetadataDims, Option<MetadataDims>) {
        (self.target_dims, self.draft.map(|(_, d)| d))
    }

    /// The contents of an i32 buffer (`None` for an i64 buffer).
    pub fn buffer_i32(&self, id: BufferId) -> Option<&[i32]> {
        match &self.buffers.get(id.0 as usize)?.data {
            Data::I32(v) => Some(v),
            Data::I64(_) => None,
        }
    }

    /// The contents of an i64 buffer (`None` for an i32 buffer).
    pub fn buffer_i64(&self, id: BufferId) -> Option<&[i64]> {
        match &self.buffers.get(id.0 as usize)?.data {
            Data::I64(v) => Some(v),
            Data::I32(_) => None,
        }
    }

    /// Whether a draft replay is active.
    pub fn in_draft_replay(&self) -> bool {
        self.replay.is_some()
    }
}

/// Starting value of [`StepMetadata::table_digest`].
const DIGEST_SEED: u64 = 0xcbf2_9ce4_8422_2325;

/// One page-table cell (table 0: indexer, 1: block table) as the 64-bit word `index ∥
/// value` (table in the top bit), xor-shifted and multiplied: not linear, so cells that
/// swap values change the sum; [`StepMetadata::table_digest`] adds them up (wrapping).
/// Cells are independent of each other: one multiply each, no chain (a serial hash
/// chain cost ~3 ms for a 128K-context batch's full rewrite on the H200 host).
fn cell_mix(table: u32, index: usize, value: i32) -> u64 {
    let x = ((index as u64) << 32 | u64::from(value as u32)) ^ (u64::from(table) << 63);
    (x ^ (x >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A fill wrote `cells` at `at..` of a table of `len` cells: logged for the mirror and
/// added to the digest. Returns how many.
fn wrote(
    log: &mut ChangeLog,
    digest: &mut u64,
    table: u32,
    at: usize,
    cells: &[i32],
    len: usize,
) -> usize {
    log.record(at, at + cells.len(), len);
    *digest = add_cells(*digest, table, at, cells);
    cells.len()
}

/// Adds cells `at..` holding `values` to the digest: two cells a word (their values,
/// xored with a multiple of the first one's index and the table bit), xor-shifted and
/// multiplied, the words summed; an odd last cell alone by [`cell_mix`]. One multiply per
/// two cells, and no chain between words.
fn add_cells(h: u64, table: u32, at: usize, values: &[i32]) -> u64 {
    const STEP: u64 = 0xff51_afd7_ed55_8ccd;
    let tag = u64::from(table) << 63;
    let mut index_term = (at as u64).wrapping_mul(STEP);
    let mut sum = h;
    let pairs = values.chunks_exact(2);
    let odd = pairs.remainder();
    for p in pairs {
        let x = (u64::from(p[0] as u32) | u64::from(p[1] as u32) << 32) ^ index_term ^ tag;
        sum = sum.wrapping_add((x ^ (x >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        index_term = index_term.wrapping_add(STEP.wrapping_mul(2));
    }
    if let [v] = odd {
        sum = sum.wrapping_add(cell_mix(table, at + values.len() - 1, *v));
    }
    sum
}
