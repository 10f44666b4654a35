//! Moving KV pages between engines (prefill / decode disaggregation).
//!
//! A page is the unit of transfer: one slot of every pool of its pool group, which holds
//! the block's MLA rows **and** its indexer keys (they share the life cycle), in the
//! target cache and, with a separate MTP draft cache, in the draft cache too. Nothing
//! here can move one without the other: a transfer is planned from the pools of every
//! cache, never from a list of roles.
//!
//! The pieces:
//!
//! * the runtime exports a prefix's full blocks (`KvCacheHandle::export_blocks`): they
//!   stay pinned where they are (GPU or host tier) until released, and the
//!   [`ExportedBlocks`] names their chained reuse keys, tokens and slots;
//! * the importing runtime reserves pages for the blocks it does not hold yet
//!   (`KvCacheHandle::begin_import`), the bytes arrive, and
//!   `KvCacheHandle::commit_import` links them into its reuse tree at once; an
//!   `abort_import` (or a failed transfer) frees them and
//!   leaves nothing behind;
//! * [`plan_writes`] turns the two sides' pages and pool regions into the writes, with
//!   contiguous slot runs coalesced into one descriptor per pool;
//! * a [`KvTransport`] moves the bytes: [`LocalTransport`] between runtimes of one
//!   process (tests), `NixlTransport` (feature `nixl`) between processes and hosts,
//!   `NcclTransport` (feature `nccl`) between processes with one GPU each, where NIXL
//!   is missing.
//!   The runtime never knows which one it has.
//!
//! (`KvCacheHandle` is the `dsa-kv` runtime's handle: `dsa_kv::actors::KvCacheHandle`.)

mod local;
#[cfg(feature = "nixl")]
pub mod nixl;
mod plan;

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use local::LocalTransport;
pub use plan::{
    plan_writes, BlockPages, CacheKind, ExportedBlocks, ImportTicket, PageLoc, PlanError, PoolRef,
    PoolRegion, WritePlan,
};

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

/// A connected peer (for NIXL, the remote agent's name).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PeerId(pub String);

/// What one [`KvTransport::write`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WriteReport {
    /// Descriptors posted (after coalescing; what the transport was handed).
    pub descriptors: usize,
    /// Bytes written.
    pub bytes: u64,
    /// Wall time from the first post to the last completion.
    pub elapsed: Duration,
}

impl WriteReport {
    /// Bytes per second (10⁹ bytes = 1 GB), 0 when nothing was timed.
    pub fn gb_per_s(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.bytes as f64 / s / 1e9
        } else {
            0.0
        }
    }
}

/// A transport failure. Every variant says what failed. After any error but
/// [`InFlight`](Self::InFlight) nothing is writing the peer's memory any more (what was
/// written is partial): the importer aborts the import. After `InFlight`, it must not
/// reuse the reserved pages (keep the import open, or restart the engine).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The transport's library is not available on this machine.
    #[error("{transport} is not available: {why}")]
    Unavailable {
        /// The transport.
        transport: &'static str,
        /// What is missing and how to provide it.
        why: String,
    },
    /// A segment falls outside the registered memory of its side: nothing was posted.
    #[error("segment {index} ({len} bytes, {side} address {addr:#x}) lies outside the {side} registered memory")]
    Unregistered {
        /// Index of the segment in its batch.
        index: usize,
        /// `"local"` or `"remote"`.
        side: &'static str,
        /// The address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// No peer with this id is connected.
    #[error("no connected peer {0:?}: call connect with its metadata first")]
    UnknownPeer(String),
    /// The peer's metadata could not be read.
    #[error("bad peer metadata: {0}")]
    BadMetadata(String),
    /// The write failed and some of it may still be landing in the peer's memory (a
    /// request that did not end within the timeout): the importer must not abort.
    #[error("{transport} failed and a write may still be in flight ({detail}): keep the import's pages reserved (do not abort it) or restart the importing engine")]
    InFlight {
        /// The transport.
        transport: &'static str,
        /// The first failure.
        detail: String,
    },
    /// The transport's library reported an error.
    #[error("{transport} failed in {op}: {detail}")]
    Failed {
        /// The transport.
        transport: &'static str,
        /// The operation.
        op: &'static str,
        /// The library's message.
        detail: String,
    },
}

impl TransportError {
    /// Whether some of the write may still land ([`InFlight`](Self::InFlight)): keep
    /// the import's pages reserved then.
    pub fn in_flight(&self) -> bool {
        matches!(self, TransportError::InFlight { .. })
    }
}

/// Moves bytes between registered memory of two engines. Blocking: [`write`](Self::write)
/// returns once every byte is written (or failed). Implementations: [`LocalTransport`]
/// (one process), `nixl::NixlTransport` (feature `nixl`), `nccl::NcclTransport`
/// (feature `nccl`).
pub trait KvTransport: Send {
    /// A short name for reports (`"local"`, `"nixl/UCX"`).
    fn name(&self) -> &str;

    /// Registers memory the peer may write to or this side reads from (every pool of every
    /// cache: [`PoolRegion::region`]). Call before [`local_metadata`](Self::local_metadata).
    ///
    /// # Safety
    ///
    /// Every region must be memory of this process (or device memory of a GPU it uses)
    /// that stays allocated while the transport lives, and that nothing but the transfer
    /// protocol writes while a peer may write it: the runtime's pools
    /// (`KvCacheHandle::transfer_regions`)
    /// with the runtime alive longer than the transport, written only into pages an import
    /// reserved.
    unsafe fn register(&mut self, regions: &[MemRegion]) -> Result<(), TransportError>;

    /// This side's metadata (registered memory, connection addresses), sent to the peer
    /// over any channel.
    fn local_metadata(&mut self) -> Result<Vec<u8>, TransportError>;

    /// Loads a peer's metadata; returns its id.
    ///
    /// # Safety
    ///
    /// The metadata must come from the peer transport's
    /// [`local_metadata`](Self::local_metadata), and the regions it registered must stay
    /// valid (its own `register` contract) while this side writes to them: a forged
    /// region list lets [`write`](Self::write) reach memory nobody registered.
    unsafe fn connect(&mut self, remote_metadata: &[u8]) -> Result<PeerId, TransportError>;

    /// Writes every batch into the peer's registered memory, then delivers
    /// `notification` to it: the peer sees the notification only after every byte has
    /// landed. A segment outside either side's registered memory fails the call before
    /// anything is posted.
    fn write(
        &mut self,
        peer: &PeerId,
        batches: &[WriteBatch],
        notification: &[u8],
    ) -> Result<WriteReport, TransportError>;

    /// Notifications received since the last call, with the peer that sent each.
    fn take_notifications(&mut self) -> Result<Vec<(PeerId, Vec<u8>)>, TransportError>;

    /// Opens window `window` (the import's id, by convention): `peer` may write into
    /// `ranges` until [`close_window`](Self::close_window) or `deadline`. Every write a
    /// peer makes into this side's memory must lie in one open, unexpired window of that
    /// peer, or it is refused before any of its bytes land (the local and the NCCL
    /// transports check on the receiving side; NIXL's one-sided writes cannot be checked
    /// by their target: see the NIXL transport's docs). A write accepted before
    /// the deadline that has not landed by then is stopped (NCCL) or was a single
    /// synchronous copy (local).
    ///
    /// # Safety
    ///
    /// `ranges` must be registered memory that only the transfer writes until the window
    /// closes: the pages an open import reserved,
    /// [`ImportTicket::write_ranges`] of its ticket.
    unsafe fn open_window(
        &mut self,
        peer: &PeerId,
        window: u64,
        ranges: &[MemRegion],
        deadline: Instant,
    ) -> Result<(), TransportError>;

    /// Closes `window` (an unknown one is `Ok`): returns once no write into it can land
    /// any more, or [`TransportError::InFlight`] when that cannot be established (keep
    /// the import's pages reserved then). Close it before aborting the import.
    fn close_window(&mut self, window: u64) -> Result<(), TransportError>;
}

/// The most notifications a transport keeps untaken; a write that would file one more is
/// refused before any byte moves (the importer is not reading its notifications).
pub const MAX_PENDING_NOTIFICATIONS: usize = 4096;

/// The largest notification a write may carry.
pub const MAX_NOTIFICATION: usize = 64 << 10;

/// An import's window as the receiving side keeps it (for [`KvTransport`]
/// implementations: a receiver checks every incoming write against its open windows
/// with [`window_for`]).
#[derive(Clone, Debug)]
pub struct Window {
    /// Who may write it.
    pub peer: String,
    /// Where, sorted by (memory, address).
    pub ranges: Vec<MemRegion>,
    /// Until when.
    pub deadline: Instant,
}

impl Window {
    /// Checks `ranges` lie in `registered` memory and builds the window.
    pub fn new(
        peer: &PeerId,
        ranges: &[MemRegion],
        deadline: Instant,
        registered: &[MemRegion],
    ) -> Result<Window, TransportError> {
        if let Some((index, r)) = ranges.iter().enumerate().find(|(_, r)| {
            !registered
                .iter()
                .any(|g| g.mem == r.mem && g.contains(r.addr, r.len))
        }) {
            return Err(TransportError::Unregistered {
                index,
                side: "window",
                addr: r.addr,
                len: r.len,
            });
        }
        let mut sorted = ranges.to_vec();
        sorted.sort_by_key(|m| (m.mem_key(), m.addr));
        // Overlapping and adjacent ranges merged: the search in `covers` is then exact.
        let mut ranges: Vec<MemRegion> = Vec::with_capacity(sorted.len());
        for m in sorted {
            match ranges.last_mut() {
                Some(l) if l.mem == m.mem && m.addr <= l.addr + l.len => {
                    l.len = l.len.max(m.addr + m.len - l.addr);
                }
                _ => ranges.push(m),
            }
        }
        Ok(Window {
            peer: peer.0.clone(),
            ranges,
            deadline,
        })
    }

    /// Whether `len` bytes of `mem` at `addr` lie inside one of the window's ranges.
    pub fn covers(&self, mem: MemKind, addr: u64, len: u64) -> bool {
        // The last range starting at or before `addr` is the only candidate.
        let key = (MemRegion { addr, len, mem }.mem_key(), addr);
        let i = self
            .ranges
            .partition_point(|m| (m.mem_key(), m.addr) <= key);
        i > 0 && self.ranges[i - 1].mem == mem && self.ranges[i - 1].contains(addr, len)
    }
}

/// Finds the window of `peer` that covers every destination of `dsts` (`(memory,
/// address, length)`), open at `now`: its id, or why the write is refused.
pub fn window_for<'w>(
    windows: impl IntoIterator<Item = (&'w u64, &'w Window)>,
    peer: &str,
    dsts: impl Iterator<Item = (MemKind, u64, u64)> + Clone,
    now: Instant,
) -> Result<u64, String> {
    let mut expired = false;
    for (&id, w) in windows {
        if w.peer != peer {
            continue;
        }
        if dsts.clone().all(|(m, a, l)| w.covers(m, a, l)) {
            if now < w.deadline {
                return Ok(id);
            }
            expired = true;
        }
    }
    Err(if expired {
        "the import's window has passed its deadline".into()
    } else {
        let first = dsts.clone().next();
        format!(
            "no open window of this peer covers the write (first destination {first:?}): only pages an import reserved for it may be written"
        )
    })
}

/// What [`push`] moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TransferReport {
    /// Blocks written (the exported blocks the importer did not hold).
    pub blocks: usize,
    /// Leading blocks the importer already held (not written).
    pub skipped: u32,
    /// Pages written (blocks × life cycles × caches × devices).
    pub pages: u64,
    /// Descriptors before coalescing (one per page per pool).
    pub uncoalesced: usize,
    /// What the transport did (descriptors posted, bytes, time).
    pub write: WriteReport,
}

/// A failed [`push`]: nothing is committed on either side; the importer must abort.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    /// The two sides cannot be paired.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// The exporter's half of a transfer: pairs the exported blocks with the importer's
/// ticket and pool regions ([`plan_writes`]) and writes them through `transport`, which
/// then delivers `notification` to the importer. The importer commits after the
/// notification (or aborts when told the push failed). Renew the export's lease
/// (`KvCacheHandle::renew_transfer`)
/// first when the push may outlast what is left of it.
pub fn push(
    transport: &mut dyn KvTransport,
    peer: &PeerId,
    export: &ExportedBlocks,
    local: &[PoolRegion],
    ticket: &ImportTicket,
    remote: &[PoolRegion],
    notification: &[u8],
) -> Result<TransferReport, PushError> {
    let plan = plan_writes(export, local, ticket, remote)?;
    push_plan(transport, peer, ticket, &plan, notification)
}

/// [`push`] of a plan already made (e.g. altered by [`WritePlan::without_pools`] in a
/// mutation drill).
pub fn push_plan(
    transport: &mut dyn KvTransport,
    peer: &PeerId,
    ticket: &ImportTicket,
    plan: &WritePlan,
    notification: &[u8],
) -> Result<TransferReport, PushError> {
    let write = transport.write(peer, &plan.batches, notification)?;
    Ok(TransferReport {
        blocks: ticket.blocks.len(),
        skipped: ticket.skipped,
        pages: plan.pages,
        uncoalesced: plan.uncoalesced,
        write,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    use std::collections::HashMap;

    /// `Window::covers` (a binary search) against a plain scan, and `window_for`'s
    /// rules, on random windows and writes.
    #[test]
    fn windows_cover_exactly_their_ranges() {
        let range = (0u64..4, 0u64..4096, 1u64..512);
        let input = (
            proptest::collection::vec(range.clone(), 0..8),
            proptest::collection::vec(range, 1..6),
        );
        let mut runner = TestRunner::new_with_rng(
            Config::with_cases(512),
            TestRng::from_seed(RngAlgorithm::ChaCha, &[31; 32]),
        );
        let mem = |k: u64| {
            if k == 0 {
                MemKind::Host
            } else {
                MemKind::Device { ordinal: k as u32 }
            }
        };
        runner
            .run(&input, |(ranges, writes)| {
                let ranges: Vec<MemRegion> = ranges
                    .iter()
                    .map(|&(m, addr, len)| MemRegion {
                        addr,
                        len,
                        mem: mem(m),
                    })
                    .collect();
                let registered: Vec<MemRegion> = (0..4)
                    .map(|m| MemRegion {
                        addr: 0,
                        len: 1 << 20,
                        mem: mem(m),
                    })
                    .collect();
                let now = Instant::now();
                let w = Window::new(&PeerId("p".into()), &ranges, now, &registered).unwrap();
                for &(m, addr, len) in &writes {
                    // A plain scan over the union of the ranges, byte by byte.
                    let plain = (addr..addr + len)
                        .all(|b| ranges.iter().any(|r| r.mem == mem(m) && r.contains(b, 1)));
                    prop_assert_eq!(w.covers(mem(m), addr, len), plain);
                }
                let windows: HashMap<u64, Window> = [(1, w.clone())].into_iter().collect();
                let dsts = writes.iter().map(|&(m, a, l)| (mem(m), a, l));
                let later = now + Duration::from_secs(1);
                let open = Window {
                    deadline: later,
                    ..w.clone()
                };
                let open: HashMap<u64, Window> = [(1, open)].into_iter().collect();
                let all = dsts.clone().all(|(m, a, l)| w.covers(m, a, l));
                prop_assert_eq!(window_for(&open, "p", dsts.clone(), now).is_ok(), all);
                prop_assert!(window_for(&open, "q", dsts.clone(), now).is_err());
                prop_assert!(
                    window_for(&windows, "p", dsts, now).is_err(),
                    "past its deadline"
                );
                Ok(())
            })
            .unwrap();
    }
}
