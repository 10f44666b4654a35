//! What a session call can fail with.

use dsa_kv_core::ids::RequestId;
use dsa_kv_device::transfer::{PlanError, PushError, TransportError};

use super::WireError;
use crate::actors::RuntimeError;

/// A failed session call. Each says what failed; [`in_flight`](Self::in_flight) says
/// whether a write may still be landing in the importer's pages.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// The wire failed (closed, timed out, a frame too large or undecodable).
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The runtime refused (an export, an import, a commit).
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The transport failed (registering, connecting, a window, notifications).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The ticket does not fit the export (the importer's pages, pools or layout).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The write failed.
    #[error(transparent)]
    Push(#[from] PushError),
    /// The peer speaks another version of the protocol.
    #[error(
        "the peer speaks session protocol {theirs}, this side {ours}: run the same dsa-kv \
         version on both engines"
    )]
    Version {
        /// Ours.
        ours: u32,
        /// The peer's.
        theirs: u32,
    },
    /// The two sides' settings disagree (transport, digests).
    #[error("the two sides disagree: {0}")]
    Mismatch(String),
    /// A frame the protocol does not allow here, or one about another transfer.
    #[error("expected {expected} from the peer, got {got}")]
    Unexpected {
        /// What this side waited for.
        expected: &'static str,
        /// What came (the frame's kind and, where it names one, its transfer).
        got: String,
    },
    /// The peer reported that transfer `export` failed on its side.
    #[error("the peer failed transfer {export}: {why}")]
    PeerFailed {
        /// The export.
        export: RequestId,
        /// Its message.
        why: String,
        /// A write may still be landing.
        in_flight: bool,
    },
    /// Page digests could not be taken (device memory, a page outside its pool).
    #[error("page digests: {0}")]
    Digests(String),
}

impl SessionError {
    /// Whether a write may still be landing in the importer's reserved pages: the
    /// import must then stay open (its lease frees it), and the export stay pinned.
    pub fn in_flight(&self) -> bool {
        match self {
            SessionError::Transport(e) => e.in_flight(),
            SessionError::Push(PushError::Transport(e)) => e.in_flight(),
            SessionError::Runtime(RuntimeError::Transport(e)) => e.in_flight(),
            SessionError::PeerFailed { in_flight, .. } => *in_flight,
            _ => false,
        }
    }
}
