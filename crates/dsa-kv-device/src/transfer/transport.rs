//! The transport contract: [`KvTransport`] moves bytes between the registered memory of
//! two engines and delivers a notification after them; [`TransportError`] says what
//! failed, and whether a write may still be landing.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{MemRegion, WriteBatch};

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
/// returns once every byte is written (or failed). Implementations: [`LocalTransport`](super::LocalTransport)
/// (one process), `nixl::NixlTransport` (feature `nixl`), `nccl::NcclTransport`
/// (feature `nccl`).
pub trait KvTransport: Send {
    /// A short name for reports (`"local"`, `"nixl/UCX"`).
    fn name(&self) -> &str;

    /// Registers memory the peer may write to or this side reads from (every pool of every
    /// cache: [`PoolRegion::region`](super::PoolRegion::region)). Call before [`local_metadata`](Self::local_metadata).
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
    /// [`ImportTicket::write_ranges`](super::ImportTicket::write_ranges) of its ticket.
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
