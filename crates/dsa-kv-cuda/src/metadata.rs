//! The step metadata on the device: one device buffer per metadata buffer (target set,
//! draft set, shared per-token buffers), allocated once at the configured maxima so the
//! addresses never change (CUDA graphs capture them). Each step the bound set is copied
//! from pinned staging on the compute stream, stream-ordered after the previous step's
//! kernels (which read the same buffers) and before this step's forward; the staging is
//! double-buffered, so the host fills one half while the other may still be in flight.

use std::collections::HashMap;

use cudarc::driver::{sys, CudaEvent};

use super::{check, driver_error, CudaError, DeviceBuffer, Gpu, PinnedHost};
use dsa_kv_core::metadata::mirror::MetaRef;
use dsa_kv_core::metadata::StepMetadata;

/// Device copies of every metadata buffer. See the module docs.
pub(crate) struct DeviceMetadata {
    /// Device buffer of each metadata buffer, and how many leading elements of it may
    /// differ from padding (what the last upload covered).
    bufs: HashMap<MetaRef, (DeviceBuffer, usize)>,
    staging: [PinnedHost; 2],
    /// Recorded after the uploads from each staging half.
    staged: [Option<CudaEvent>; 2],
    next: usize,
    /// Bytes uploaded by the last call (reports, tests).
    last_bytes: usize,
}

/// Staging offsets are aligned to this.
const ALIGN: usize = 256;

impl DeviceMetadata {
    /// Allocates the buffers and uploads their initial contents (the padding values).
    pub(crate) fn new(gpu: &Gpu, meta: &StepMetadata) -> Result<Self, CudaError> {
        let mut bufs = HashMap::new();
        let (mut total, mut largest_set) = (0usize, [0usize; 2]);
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
        let staging = [
            PinnedHost::zeroed(gpu, stage, "metadata staging")?,
            PinnedHost::zeroed(gpu, stage, "metadata staging")?,
        ];
        gpu.synchronize()?;
        Ok(DeviceMetadata {
            bufs,
            staging,
            staged: [None, None],
            next: 0,
            last_bytes: 0,
        })
    }

    /// Device address of a buffer.
    pub(crate) fn addr(&self, r: MetaRef) -> u64 {
        self.bufs.get(&r).map_or(0, |(b, _)| b.ptr())
    }

    /// Bytes the last [`upload`](Self::upload) copied.
    pub(crate) fn last_bytes(&self) -> usize {
        self.last_bytes
    }

    /// Enqueues on the compute stream the copies that make the device buffers of the
    /// bound set and the shared buffers equal to `meta`'s: for each, the elements that
    /// differ from padding now or did at the last upload.
    pub(crate) fn upload(&mut self, gpu: &Gpu, meta: &StepMetadata) -> Result<(), CudaError> {
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
        let stage = &mut self.staging[k];
        let mut off = 0usize;
        for r in all {
            let Some((buf, dev_extent)) = self.bufs.get_mut(&r) else {
                continue;
            };
            let eb = meta.mirror_elem_bytes(r);
            let host_extent = meta.mirror_extent(r);
            let bytes = host_extent.max(*dev_extent) * eb;
            *dev_extent = host_extent;
            if bytes == 0 {
                continue;
            }
            let src = &meta.mirror_bytes(r)[..bytes];
            let dst = stage
                .as_mut_slice()
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
        self.last_bytes = off;
        self.staged[k] = Some(
            gpu.compute()
                .record_event(None)
                .map_err(|e| driver_error(dev, "cuEventRecord", e))?,
        );
        Ok(())
    }
}
