//! The memory a transfer reads and writes: regions of registered host or device memory,
//! the descriptors (segments) between two of them, and the batches a transport posts
//! (one memory kind per side, as NIXL's descriptor lists want).

use serde::{Deserialize, Serialize};

use super::TransportError;

/// What kind of memory a region is, or a batch's pools and metadata (the one memory
/// vocabulary: [`crate::forward::MemKind`] is this type).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemKind {
    /// Host memory (the host backend's pools, the CUDA backend's pinned host tier).
    Host,
    /// GPU memory of one device (CUDA ordinal).
    Device {
        /// The CUDA device ordinal.
        ordinal: u32,
    },
}

/// A contiguous range of registered memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemRegion {
    /// First byte (a host or device pointer).
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// Host or device memory.
    pub mem: MemKind,
}

impl MemRegion {
    /// A sort key for the memory kind (host first, then devices by ordinal).
    pub(crate) fn mem_key(&self) -> (u8, u32) {
        match self.mem {
            MemKind::Host => (0, 0),
            MemKind::Device { ordinal } => (1, ordinal),
        }
    }

    /// Whether `[addr, addr + len)` lies inside this region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let end = self.addr.checked_add(self.len);
        addr >= self.addr
            && addr
                .checked_add(len)
                .zip(end)
                .is_some_and(|(e, end)| e <= end)
    }
}

/// One descriptor: `len` bytes from local `src` to remote `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// Local source address.
    pub src: u64,
    /// Remote destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// Segments whose sources share one memory kind and whose destinations share one (a
/// NIXL descriptor list has one memory type per side).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteBatch {
    /// Memory of every source.
    pub src_mem: MemKind,
    /// Memory of every destination.
    pub dst_mem: MemKind,
    /// The descriptors, in order.
    pub segments: Vec<Segment>,
}

impl WriteBatch {
    /// Bytes of every segment.
    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }
}

/// Checks every segment's source (`side` `"local"`) or destination (`"remote"`) against
/// `regions` of the batch's memory kind; the first one outside is the error.
pub fn check_segments(
    batches: &[WriteBatch],
    regions: &[MemRegion],
    side: &'static str,
) -> Result<(), TransportError> {
    for b in batches {
        let mem = if side == "local" {
            b.src_mem
        } else {
            b.dst_mem
        };
        for (index, s) in b.segments.iter().enumerate() {
            let addr = if side == "local" { s.src } else { s.dst };
            if !regions
                .iter()
                .any(|r| r.mem == mem && r.contains(addr, s.len))
            {
                return Err(TransportError::Unregistered {
                    index,
                    side,
                    addr,
                    len: s.len,
                });
            }
        }
    }
    Ok(())
}
