//! The step metadata on the device: one device buffer per metadata buffer (target set,
//! draft set, shared per-token buffers), allocated once at the configured maxima so the
//! addresses never change (CUDA graphs capture them). Each step the bound set is brought
//! up to date from pinned staging on the compute stream, stream-ordered after the
//! previous step's kernels (which read the same buffers) and before this step's forward;
//! the staging is double-buffered, so the host fills one half while the other may still
//! be in flight.
//!
//! The two page tables are **persistent**: only the cells the host wrote since the last
//! upload travel, as `(cell, value)` pairs that one `apply_table_cells` kernel writes
//! (the host's change log, [`StepMetadata::mirror_changes`]). A step whose rows kept
//! their stamps moves a few dozen cells, not the batch's `rows × columns`. When the log
//! gave up (more than a quarter of a table written) the used part is copied as before.
//! Every other buffer holds per-token or per-request values and is copied up to its
//! extent.

use std::collections::HashMap;

use cudarc::driver::{sys, CudaEvent};

use super::{check, driver_error, CudaError, DeviceBuffer, Gpu, PinnedHost};
use dsa_kv_core::metadata::mirror::{MetaRef, MirrorChanges};
use dsa_kv_core::metadata::StepMetadata;

/// Device copies of every metadata buffer. See the module docs.
pub struct DeviceMetadata {
    /// Device buffer of each metadata buffer, and how many leading elements of it may
    /// differ from padding (what the last upload covered).
    bufs: HashMap<MetaRef, (DeviceBuffer, usize)>,
    /// Each half: byte copies from offset 0, `(cell, value)` pairs from `pairs_at`.
    staging: [PinnedHost; 2],
    pairs_at: usize,
    /// Pairs one upload can carry (a quarter of the two largest tables: a change log
    /// gives up past a quarter of its table).
    pairs_cap: usize,
    /// Where the pairs are copied for the kernel.
    pairs_dev: DeviceBuffer,
    /// Recorded after the uploads from each staging half.
    staged: [Option<CudaEvent>; 2],
    next: usize,
    /// Bytes and page-table cells moved by the last call (reports, tests, benches).
    last_bytes: usize,
    last_cells: usize,
    last_table_copies: usize,
}

/// Staging offsets are aligned to this.
const ALIGN: usize = 256;

/// Bytes of one `(cell, value)` pair.
const PAIR: usize = 8;

/// Bit of a pair's cell that names the block table (else the indexer page table).
const SECOND_TABLE: u32 = 1 << 31;

impl DeviceMetadata {
    /// Allocates the buffers and uploads their current contents.
    pub fn new(gpu: &Gpu, meta: &StepMetadata) -> Result<Self, CudaError> {
        let mut bufs = HashMap::new();
        let (mut total, mut largest_set) = (0usize, [0usize; 2]);
        let mut tables = [0usize; 2];
        let sets = [meta.set_buffers(false), meta.set_buffers(true)];
        for r in meta.mirror_refs() {
            let host = meta.mirror_bytes(r);
            let b = DeviceBuffer::from_slice(gpu, host, "step metadata")?;
            let padded = host.len().next_multiple_of(ALIGN);
            total += padded;
            for (i, set) in sets.iter().enumerate() {
                if let (MetaRef::Set(id), Some(ids)) = (r, set) {
                    if ids.contains(&id) {
                        largest_set[i] += padded;
                    }
                    if ids[..2].contains(&id) {
                        tables[i] += host.len() / 4;
                    }
                }
            }
            bufs.insert(r, (b, 0));
        }
        // One upload moves one set and the shared buffers.
        let shared: usize = [MetaRef::ReqIdx, MetaRef::Ks, MetaRef::Ke]
            .iter()
            .map(|&r| meta.mirror_bytes(r).len().next_multiple_of(ALIGN))
            .sum();
        let stage = (largest_set[0].max(largest_set[1]) + shared).min(total);
        let pairs_cap = (tables[0].max(tables[1]) / 4 + 1).min(1 << 20);
        let bytes = stage + pairs_cap * PAIR;
        let staging = [
            PinnedHost::zeroed(gpu, bytes, "metadata staging")?,
            PinnedHost::zeroed(gpu, bytes, "metadata staging")?,
        ];
        let pairs_dev = DeviceBuffer::zeroed(gpu, pairs_cap * PAIR, "page-table cells")?;
        gpu.synchronize()?;
        Ok(DeviceMetadata {
            bufs,
            staging,
            pairs_at: stage,
            pairs_cap,
            pairs_dev,
            staged: [None, None],
            next: 0,
            last_bytes: 0,
            last_cells: 0,
            last_table_copies: 0,
        })
    }

    /// Device address of a buffer.
    pub fn addr(&self, r: MetaRef) -> u64 {
        self.bufs.get(&r).map_or(0, |(b, _)| b.ptr())
    }

    /// Bytes the last [`upload`](Self::upload) copied (pairs included).
    pub fn last_bytes(&self) -> usize {
        self.last_bytes
    }

    /// Page-table cells the last [`upload`](Self::upload) sent as pairs (0 when the
    /// tables were copied by their extent or nothing changed).
    pub fn last_cells(&self) -> usize {
        self.last_cells
    }

    /// Page tables the last [`upload`](Self::upload) copied by their used part (their
    /// change log gave up, or the pairs did not fit).
    pub fn last_table_copies(&self) -> usize {
        self.last_table_copies
    }

    /// Enqueues on the compute stream what makes the device buffers of the bound set and
    /// the shared buffers equal to `meta`'s: the page tables' logged cells (or their
    /// used part when the log gave up), and for every other buffer the elements that
    /// differ from padding now or did at the last upload. Takes the tables' change logs
    /// (this must be the metadata's only mirror).
    pub fn upload(&mut self, gpu: &Gpu, meta: &mut StepMetadata) -> Result<(), CudaError> {
        let dev = gpu.ordinal();
        let k = self.next;
        self.next ^= 1;
        if let Some(ev) = self.staged[k].take() {
            // The copies out of this half (two uploads ago) must be done before it is
            // overwritten; normally they long are.
            ev.synchronize()
                .map_err(|e| driver_error(dev, "cuEventSynchronize", e))?;
        }
        let b = meta.bindings();
        let tables = [
            MetaRef::Set(b.indexer_page_table),
            MetaRef::Set(b.block_table),
        ];
        let mut ids = Vec::with_capacity(9);
        for id in [
            b.indexer_page_table,
            b.block_table,
            b.slot_mapping_value,
            b.slot_mapping_scale,
            b.mla_slot_mapping,
            b.full_kv_value,
            b.full_kv_scale,
            b.kv_lens,
            b.num_cached,
        ] {
            // Aliased full-KV bindings name the slot-mapping buffers again.
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        let all =
            ids.into_iter()
                .map(MetaRef::Set)
                .chain([MetaRef::ReqIdx, MetaRef::Ks, MetaRef::Ke]);
        gpu.bind()?;
        let stream = gpu.compute().cu_stream();
        let (pairs_at, pairs_cap) = (self.pairs_at, self.pairs_cap);
        let (head, pairs) = self.staging[k].as_mut_slice().split_at_mut(pairs_at);
        let (mut off, mut cells, mut copies) = (0usize, 0usize, 0usize);
        for r in all {
            let Some((buf, dev_extent)) = self.bufs.get_mut(&r) else {
                continue;
            };
            let host_extent = meta.mirror_extent(r);
            let table = tables.iter().position(|&t| t == r);
            if let (Some(which), MirrorChanges::Ranges(ranges)) = (table, meta.mirror_changes(r)) {
                let n: usize = ranges.iter().map(|&(s, e)| (e - s) as usize).sum();
                if cells + n <= pairs_cap {
                    let host = meta.mirror_bytes(r);
                    let tag = if which == 1 { SECOND_TABLE } else { 0 };
                    let mut out = pairs[cells * PAIR..(cells + n) * PAIR].chunks_exact_mut(PAIR);
                    for &(s, e) in ranges {
                        for c in s..e {
                            let p = out.next().expect("sized above");
                            let v = &host[c as usize * 4..c as usize * 4 + 4];
                            p[..4].copy_from_slice(&(c | tag).to_ne_bytes());
                            p[4..].copy_from_slice(v);
                        }
                    }
                    cells += n;
                    *dev_extent = host_extent;
                    meta.mirror_take_changes(r);
                    continue;
                }
            }
            let eb = meta.mirror_elem_bytes(r);
            let bytes = host_extent.max(*dev_extent) * eb;
            *dev_extent = host_extent;
            if table.is_some() {
                // The copy below brings the whole table up to date.
                meta.mirror_take_changes(r);
                copies += 1;
            }
            if bytes == 0 {
                continue;
            }
            let src = &meta.mirror_bytes(r)[..bytes];
            let dst = head
                .get_mut(off..off + bytes)
                .ok_or_else(|| CudaError::Invalid {
                    device: dev,
                    what: format!("metadata staging of {} B is too small", off + bytes),
                })?;
            dst.copy_from_slice(src);
            let from = dst.as_ptr();
            // SAFETY: `buf` holds the whole buffer (≥ `bytes`); the source is pinned
            // staging that is not written again before the event recorded below.
            check(dev, "cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(buf.ptr(), from.cast(), bytes, stream)
            })?;
            off = (off + bytes).next_multiple_of(ALIGN);
        }
        if cells > 0 {
            let from = pairs.as_ptr();
            // SAFETY: `pairs_dev` holds `pairs_cap ≥ cells` pairs; the source is pinned
            // staging not written again before the event recorded below.
            check(dev, "cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(self.pairs_dev.ptr(), from.cast(), cells * PAIR, stream)
            })?;
            let (a, b) = (self.addr(tables[0]), self.addr(tables[1]));
            // SAFETY: every cell was logged inside its table (the host buffers have the
            // device buffers' lengths), and the pairs were copied just before on this
            // stream.
            unsafe {
                gpu.kernels().apply_table_cells(
                    gpu.compute(),
                    dev,
                    a,
                    b,
                    self.pairs_dev.ptr(),
                    cells,
                )?
            };
        }
        self.last_bytes = off + cells * PAIR;
        self.last_cells = cells;
        self.last_table_copies = copies;
        self.staged[k] = Some(
            gpu.compute()
                .record_event(None)
                .map_err(|e| driver_error(dev, "cuEventRecord", e))?,
        );
        Ok(())
    }
}
