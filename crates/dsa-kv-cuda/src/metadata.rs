//! The step metadata on the device: one device buffer per metadata buffer (target set,
//! draft set, shared per-token buffers), allocated once at the configured maxima so the
//! addresses never change (CUDA graphs capture them). Each step the bound set is brought
//! up to date on the compute stream, stream-ordered after the previous step's kernels
//! (which read the same buffers) and before this step's forward, by **one** host-to-device
//! copy of pinned staging into a device area and **one** kernel
//! (`apply_metadata_upload`) that copies each buffer's part from the area into place.
//! The staging is double-buffered, so the host fills one half while the other may still
//! be in flight.
//!
//! The two page tables are **persistent**: only the cells the host wrote since the last
//! upload travel, as `(cell, value)` pairs (the host's change log,
//! [`StepMetadata::mirror_changes`]). A step whose rows kept their stamps moves a few
//! dozen cells, not the batch's `rows × columns`. When the log gave up (more than a
//! quarter of a table written) the used part is copied as before. Every other buffer
//! holds per-token or per-request values and is copied up to its extent.
//!
//! Staging (and device area) layout: `MAX_SEGMENTS` segment records of 16 bytes
//! (destination address, source offset, 4-byte words), then each segment's bytes at
//! 16-byte aligned offsets, then the pairs.

use std::collections::HashMap;

use cudarc::driver::{sys, CudaEvent};

use super::{check, driver_error, CudaError, DeviceBuffer, Gpu, PinnedHost};
use dsa_kv_core::metadata::mirror::{MetaRef, MirrorChanges};
use dsa_kv_core::metadata::StepMetadata;

/// Device copies of every metadata buffer. See the module docs.
pub struct DeviceMetadata {
    /// Device buffer of each metadata buffer, how many leading elements of it may
    /// differ from padding (what the last upload covered), and whether it must be
    /// copied whole (an upload failed after the host's change logs were taken: the
    /// device may hold anything).
    bufs: HashMap<MetaRef, (DeviceBuffer, usize, bool)>,
    staging: [PinnedHost; 2],
    /// Where each upload lands on the device (the staging's layout).
    area: DeviceBuffer,
    /// Pairs one upload can carry (a quarter of the two largest tables: a change log
    /// gives up past a quarter of its table).
    pairs_cap: usize,
    /// Recorded after the upload from each staging half (created once: an event per
    /// step would cost a create and a destroy each), and whether it was.
    staged: [CudaEvent; 2],
    armed: [bool; 2],
    next: usize,
    /// Bytes and page-table cells moved by the last call, and the tables it copied by
    /// their used part (reports, tests, benches).
    last_bytes: usize,
    last_cells: usize,
    last_table_copies: usize,
}

/// Segment data offsets are aligned to this.
const ALIGN: usize = 16;

/// Segment records at the start of an upload (an upload names at most 12 buffers).
const MAX_SEGMENTS: usize = 16;

/// Bytes of one segment record and of one `(cell, value)` pair.
const SEGMENT: usize = 16;
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
            // The copy holds the current contents: their extent, not 0.
            bufs.insert(r, (b, meta.mirror_extent(r), false));
        }
        // One upload moves one set and the shared buffers.
        let shared: usize = [MetaRef::ReqIdx, MetaRef::Ks, MetaRef::Ke]
            .iter()
            .map(|&r| meta.mirror_bytes(r).len().next_multiple_of(ALIGN))
            .sum();
        let data = (largest_set[0].max(largest_set[1]) + shared).min(total);
        let pairs_cap = (tables[0].max(tables[1]) / 4 + 1).min(1 << 20);
        let bytes = MAX_SEGMENTS * SEGMENT + data + pairs_cap * PAIR;
        if bytes > i32::MAX as usize {
            return Err(CudaError::Invalid {
                device: gpu.ordinal(),
                what: format!(
                    "step metadata of {bytes} B per upload is past the upload kernel's 2 GiB \
                     offsets; lower max_num_sequences, max_blocks_per_seq or max_num_tokens"
                ),
            });
        }
        let staging = [
            PinnedHost::zeroed(gpu, bytes, "metadata staging")?,
            PinnedHost::zeroed(gpu, bytes, "metadata staging")?,
        ];
        let area = DeviceBuffer::zeroed(gpu, bytes, "metadata upload area")?;
        let event = || {
            gpu.context()
                .new_event(None)
                .map_err(|e| driver_error(gpu.ordinal(), "cuEventCreate", e))
        };
        let staged = [event()?, event()?];
        gpu.synchronize()?;
        Ok(DeviceMetadata {
            bufs,
            staging,
            area,
            pairs_cap,
            staged,
            armed: [false; 2],
            next: 0,
            last_bytes: 0,
            last_cells: 0,
            last_table_copies: 0,
        })
    }

    /// Device address of a buffer.
    pub fn addr(&self, r: MetaRef) -> u64 {
        self.bufs.get(&r).map_or(0, |(b, _, _)| b.ptr())
    }

    /// Bytes the last [`upload`](Self::upload) copied to the device (segment records
    /// and pairs included).
    pub fn last_bytes(&self) -> usize {
        self.last_bytes
    }

    /// Page-table cells the last [`upload`](Self::upload) sent as pairs (0 when the
    /// tables were copied by their used part or nothing changed).
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
    /// differ from padding now or did at the last upload; one copy and one kernel.
    /// Takes the tables' change logs (this must be the metadata's only mirror).
    pub fn upload(&mut self, gpu: &Gpu, meta: &mut StepMetadata) -> Result<(), CudaError> {
        let r = self.upload_inner(gpu, meta);
        if r.is_err() {
            // The change logs may be taken and nothing sent: the next uploads copy every
            // buffer whole, once.
            for v in self.bufs.values_mut() {
                v.2 = true;
            }
        }
        r
    }

    fn upload_inner(&mut self, gpu: &Gpu, meta: &mut StepMetadata) -> Result<(), CudaError> {
        let dev = gpu.ordinal();
        let k = self.next;
        self.next ^= 1;
        if std::mem::take(&mut self.armed[k]) {
            // The copy out of this half (two uploads ago) must be done before it is
            // overwritten; normally it long is.
            self.staged[k]
                .synchronize()
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
        // Which tables travel as pairs: those whose log names cells that fit.
        let mut by_pairs = [false; 2];
        let mut cells = 0usize;
        for (which, &t) in tables.iter().enumerate() {
            if self.bufs.get(&t).is_some_and(|v| v.2) {
                continue;
            }
            if let MirrorChanges::Ranges(ranges) = meta.mirror_changes(t) {
                let n: usize = ranges.iter().map(|&(s, e)| (e - s) as usize).sum();
                if cells + n <= self.pairs_cap {
                    by_pairs[which] = true;
                    cells += n;
                }
            }
        }
        let stage = self.staging[k].as_mut_slice();
        let (records, data) = stage.split_at_mut(MAX_SEGMENTS * SEGMENT);
        let (mut off, mut segments, mut copies, mut widest) = (0usize, 0usize, 0usize, cells);
        for r in all {
            let Some((buf, dev_extent, stale)) = self.bufs.get_mut(&r) else {
                continue;
            };
            let host_extent = meta.mirror_extent(r);
            let table = tables.iter().position(|&t| t == r);
            if table.is_some_and(|w| by_pairs[w]) {
                *dev_extent = host_extent;
                continue;
            }
            let eb = meta.mirror_elem_bytes(r);
            let bytes = if std::mem::take(stale) {
                meta.mirror_bytes(r).len()
            } else {
                host_extent.max(*dev_extent) * eb
            };
            *dev_extent = host_extent;
            if table.is_some() {
                // The copy below brings the whole table up to date.
                meta.mirror_take_changes(r);
                copies += 1;
            }
            if bytes == 0 {
                continue;
            }
            let room = data.len();
            let dst = data
                .get_mut(off..off + bytes)
                .ok_or_else(|| CudaError::Invalid {
                    device: dev,
                    what: format!(
                        "metadata staging of {room} B is too small for {} B",
                        off + bytes
                    ),
                })?;
            dst.copy_from_slice(&meta.mirror_bytes(r)[..bytes]);
            let rec = &mut records[segments * SEGMENT..(segments + 1) * SEGMENT];
            let src = (MAX_SEGMENTS * SEGMENT + off) as u32;
            rec[..8].copy_from_slice(&buf.ptr().to_ne_bytes());
            rec[8..12].copy_from_slice(&src.to_ne_bytes());
            rec[12..].copy_from_slice(&((bytes / 4) as u32).to_ne_bytes());
            segments += 1;
            widest = widest.max(bytes / 4);
            off = (off + bytes).next_multiple_of(ALIGN);
        }
        // The pairs follow the data.
        let pairs_off = MAX_SEGMENTS * SEGMENT + off;
        let mut out = data
            .get_mut(off..off + cells * PAIR)
            .ok_or_else(|| CudaError::Invalid {
                device: dev,
                what: format!("metadata staging too small for {cells} page-table cells"),
            })?
            .chunks_exact_mut(PAIR);
        for (which, &t) in tables.iter().enumerate() {
            if !by_pairs[which] {
                continue;
            }
            let MirrorChanges::Ranges(ranges) = meta.mirror_changes(t) else {
                unreachable!("chosen above from its ranges")
            };
            let host = meta.mirror_bytes(t);
            let tag = if which == 1 { SECOND_TABLE } else { 0 };
            for &(s, e) in ranges {
                for c in s..e {
                    let p = out.next().expect("invariant: sized by the same ranges");
                    p[..4].copy_from_slice(&(c | tag).to_ne_bytes());
                    p[4..].copy_from_slice(&host[c as usize * 4..c as usize * 4 + 4]);
                }
            }
            meta.mirror_take_changes(t);
        }
        let used = pairs_off + cells * PAIR;
        if segments + cells > 0 {
            gpu.bind()?;
            let stream = gpu.compute().cu_stream();
            let from = self.staging[k].as_mut_slice().as_ptr();
            // SAFETY: the area holds the whole staging (≥ `used`); the source is pinned
            // staging not written again before the event recorded below.
            check(dev, "cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(self.area.ptr(), from.cast(), used, stream)
            })?;
            // Behind the copy: this half is not written again before it completes.
            if let Err(e) = self.staged[k].record(gpu.compute()) {
                // Without the event, wait for the copy here rather than let the next
                // upload overwrite its source.
                let _ = gpu.compute().synchronize();
                return Err(driver_error(dev, "cuEventRecord", e));
            }
            self.armed[k] = true;
            let t = (self.addr(tables[0]), self.addr(tables[1]));
            // SAFETY: every record names a buffer of ours with at least its words, its
            // source lies in the area; every cell was logged inside its table (the host
            // buffers have the device buffers' lengths); the copy above precedes the
            // kernel on this stream.
            unsafe {
                gpu.kernels().apply_metadata_upload(
                    gpu.compute(),
                    dev,
                    self.area.ptr(),
                    segments,
                    pairs_off,
                    cells,
                    widest,
                    t,
                )?
            };
        }
        self.last_bytes = if segments + cells > 0 { used } else { 0 };
        self.last_cells = cells;
        self.last_table_copies = copies;
        Ok(())
    }
}
