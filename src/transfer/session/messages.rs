//! The frames of the session protocol, and what an import came to.

use serde::{Deserialize, Serialize};

use dsa_kv_core::ids::RequestId;
use dsa_kv_device::transfer::{
    ExportedBlocks, ImportTicket, PoolRegion, TransferReport, MAX_REGIONS, MAX_TRANSFER_BLOCKS,
};

use super::BlockDigest;

/// The protocol version in [`SessionMsg::Hello`]; both sides must speak the same.
pub const PROTOCOL_VERSION: u32 = 1;

/// The most bytes of transport metadata a peer's [`SessionMsg::Hello`] may carry (1 MiB:
/// a NIXL agent's metadata for thousands of registered pools is a few hundred KiB).
pub const MAX_METADATA: usize = 1 << 20;

/// The most digests a `Written` may carry: one per block, and one for a tail.
const MAX_DIGESTS: usize = MAX_TRANSFER_BLOCKS + 1;

/// One frame of the session protocol. Per transfer, in this order: the exporter's
/// [`Offer`](Self::Offer); the importer's [`Ticket`](Self::Ticket) (pages reserved, or
/// none); the exporter's [`Written`](Self::Written) after its write, or
/// [`Failed`](Self::Failed); after a `Written`, exactly one
/// [`Outcome`](Self::Outcome) from the importer. An application may send its own
/// frames on the same wire between these (both sides knowing when).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum SessionMsg {
    /// Both sides, first: the transport's metadata, the engine's pool regions, and
    /// whether it checks page digests.
    Hello {
        /// [`PROTOCOL_VERSION`].
        protocol: u32,
        /// The transport's name (`"local"`, `"nixl/UCX"`): both sides must run the same.
        transport: String,
        /// The transport's metadata ([`KvTransport::local_metadata`](dsa_kv_device::transfer::KvTransport::local_metadata)),
        /// at most [`MAX_METADATA`] bytes.
        #[serde(deserialize_with = "dsa_kv_core::bounded::vec::<_, _, MAX_METADATA>")]
        metadata: Vec<u8>,
        /// Every pool of the engine (`Transfers::regions`), at most
        /// [`MAX_REGIONS`](dsa_kv_device::transfer::MAX_REGIONS).
        #[serde(deserialize_with = "dsa_kv_core::bounded::vec::<_, _, MAX_REGIONS>")]
        regions: Vec<PoolRegion>,
        /// Whether this side sends and checks page digests.
        digests: bool,
    },
    /// The exporter offers a prefix's pinned blocks.
    Offer {
        /// What was exported.
        export: ExportedBlocks,
    },
    /// The importer's answer to an offer: pages reserved for the blocks it lacks, or
    /// `None` and why.
    Ticket {
        /// The offer it answers.
        export: RequestId,
        /// The reservation.
        ticket: Option<ImportTicket>,
        /// Why there is none.
        why: Option<String>,
    },
    /// The exporter wrote every page; the transport's notification follows the bytes.
    Written {
        /// The export.
        export: RequestId,
        /// The import it wrote into.
        import: RequestId,
        /// What moved.
        report: TransferReport,
        /// SHA-256 of each written block's pages, in ticket order, then of the tail's
        /// when the ticket has tail pages (when both sides check digests); at most
        /// [`MAX_TRANSFER_BLOCKS`](dsa_kv_device::transfer::MAX_TRANSFER_BLOCKS) + 1.
        #[serde(deserialize_with = "dsa_kv_core::bounded::option_vec::<_, _, MAX_DIGESTS>")]
        digests: Option<Vec<BlockDigest>>,
    },
    /// The exporter could not write.
    Failed {
        /// The export.
        export: RequestId,
        /// What failed.
        why: String,
        /// A write may still be landing: the importer must keep the pages reserved.
        in_flight: bool,
    },
    /// The importer's verdict after a `Written`.
    Outcome {
        /// The export.
        export: RequestId,
        /// The import.
        import: RequestId,
        /// What became of it.
        outcome: ImportOutcome,
    },
    /// The session ends.
    Bye,
}

impl SessionMsg {
    /// The variant's name, for errors (never the contents: a peer's frame can be large).
    pub fn kind(&self) -> &'static str {
        match self {
            SessionMsg::Hello { .. } => "Hello",
            SessionMsg::Offer { .. } => "Offer",
            SessionMsg::Ticket { .. } => "Ticket",
            SessionMsg::Written { .. } => "Written",
            SessionMsg::Failed { .. } => "Failed",
            SessionMsg::Outcome { .. } => "Outcome",
            SessionMsg::Bye => "Bye",
        }
    }
}

/// What became of an import.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ImportOutcome {
    /// The blocks are in the importer's reuse tree: a request reuses them now.
    Committed {
        /// Blocks the import brought.
        blocks: u32,
    },
    /// The import was aborted: its pages are free again and nothing of it is cached.
    Aborted {
        /// Why.
        reason: AbortReason,
    },
    /// A write may still be landing: the import stays open (its pages reserved, its
    /// window closed where the transport can close it) until its lease ends.
    LeftToLease {
        /// Why it could not be aborted now.
        why: String,
    },
}

impl ImportOutcome {
    /// The blocks committed (0 unless [`Committed`](Self::Committed)).
    pub fn committed_blocks(&self) -> u32 {
        match self {
            ImportOutcome::Committed { blocks } => *blocks,
            _ => 0,
        }
    }
}

/// Why an import was aborted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum AbortReason {
    /// The exporter reported its write failed.
    PeerFailed {
        /// Its message.
        why: String,
    },
    /// The exporter said it wrote, but the transport's notification (which follows
    /// the bytes) did not come before the ticket's deadline.
    NoNotification,
    /// Block `block` of the ticket holds other bytes than the exporter's: bytes that
    /// are not the exporter's never enter the cache.
    DigestsDiffer {
        /// The first differing block (index in the ticket; the ticket's block count:
        /// its tail).
        block: usize,
    },
    /// The exporter went silent, closed the connection or broke the protocol.
    PeerGone {
        /// What happened.
        why: String,
    },
    /// The import's lease ran out before the commit (its pages were freed then).
    Expired,
}

impl std::fmt::Display for AbortReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AbortReason::PeerFailed { why } => write!(f, "the exporter failed: {why}"),
            AbortReason::NoNotification => write!(
                f,
                "the transport's notification did not arrive before the ticket's deadline"
            ),
            AbortReason::DigestsDiffer { block } => write!(
                f,
                "unit {block} of the ticket (its blocks, then its tail) holds other bytes than the exporter's"
            ),
            AbortReason::PeerGone { why } => write!(f, "the exporter is gone: {why}"),
            AbortReason::Expired => write!(f, "the import's lease ran out"),
        }
    }
}
