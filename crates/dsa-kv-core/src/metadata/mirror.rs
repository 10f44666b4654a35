//! Read access for a backend that mirrors the metadata into memory of its own (the CUDA
//! backend uploads it each step): every buffer of the arena and the three shared
//! per-token buffers, as bytes, with how far each holds non-padding values, and for the
//! page tables the element ranges written since the mirror last took them (so a mirror
//! is brought up to date by the cells that changed, not the batch's whole rows).
//!
//! A [`StepMetadata`] has at most one mirror that takes changes: taking them
//! ([`mirror_take_changes`](StepMetadata::mirror_take_changes)) forgets them for anyone
//! else.

use super::buffers::{BufferId, Data};
use super::step::StepMetadata;

/// What a mirror must copy of a buffer to catch up with it
/// ([`StepMetadata::mirror_changes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MirrorChanges<'a> {
    /// Only these element ranges `[start, end)` were written since the mirror last took
    /// the changes (in write order; they may overlap; the values to copy are the
    /// buffer's current ones).
    Ranges(&'a [(u32, u32)]),
    /// Copy the first `max(old extent, extent)` elements (see
    /// [`mirror_extent`](StepMetadata::mirror_extent)): the buffer is not logged, or
    /// more was written than its log keeps.
    Extent,
}

/// One buffer of the metadata: a buffer of a set, or a shared per-token buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MetaRef {
    /// A buffer of the target or draft set.
    Set(BufferId),
    /// Request index per token.
    ReqIdx,
    /// Causal window starts.
    Ks,
    /// Causal window ends.
    Ke,
}

fn i32_bytes(v: &[i32]) -> &[u8] {
    // SAFETY: i32 has no padding and every byte of it is initialized.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn i64_bytes(v: &[i64]) -> &[u8] {
    // SAFETY: as above.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

impl StepMetadata {
    /// Every buffer, in a fixed order (the arena's buffers, then the shared ones).
    pub fn mirror_refs(&self) -> Vec<MetaRef> {
        (0..self.buffers.len() as u32)
            .map(|i| MetaRef::Set(BufferId(i)))
            .chain([MetaRef::ReqIdx, MetaRef::Ks, MetaRef::Ke])
            .collect()
    }

    /// The whole buffer as bytes.
    pub fn mirror_bytes(&self, r: MetaRef) -> &[u8] {
        match r {
            MetaRef::Set(id) => match &self.buffers[id.0 as usize].data {
                Data::I32(v) => i32_bytes(v),
                Data::I64(v) => i64_bytes(v),
            },
            MetaRef::ReqIdx => i32_bytes(&self.req_idx_per_token),
            MetaRef::Ks => i32_bytes(&self.cu_seqlen_ks),
            MetaRef::Ke => i32_bytes(&self.cu_seqlen_ke),
        }
    }

    /// Bytes per element of a buffer.
    pub fn mirror_elem_bytes(&self, r: MetaRef) -> usize {
        match r {
            MetaRef::Set(id) => match &self.buffers[id.0 as usize].data {
                Data::I32(_) => 4,
                Data::I64(_) => 8,
            },
            _ => 4,
        }
    }

    /// Elements at the front of a buffer that may differ from its padding: everything
    /// past them is padding (so a mirror that held `old` such elements is brought up to
    /// date by copying `max(old, extent)` elements).
    pub fn mirror_extent(&self, r: MetaRef) -> usize {
        match r {
            MetaRef::Set(id) => self.buffers[id.0 as usize].dirty,
            _ => self.counts.num_tokens,
        }
    }

    /// What a mirror that was equal to this buffer when it last called
    /// [`mirror_take_changes`](Self::mirror_take_changes) for it (or when it copied it
    /// whole) must copy now to be equal again.
    pub fn mirror_changes(&self, r: MetaRef) -> MirrorChanges<'_> {
        match r {
            MetaRef::Set(id) => match self.buffers[id.0 as usize].log.ranges() {
                Some(ranges) => MirrorChanges::Ranges(ranges),
                None => MirrorChanges::Extent,
            },
            _ => MirrorChanges::Extent,
        }
    }

    /// The mirror copied what [`mirror_changes`](Self::mirror_changes) named: the log
    /// of `r` starts afresh.
    pub fn mirror_take_changes(&mut self, r: MetaRef) {
        if let MetaRef::Set(id) = r {
            self.buffers[id.0 as usize].log.clear();
        }
    }
}
