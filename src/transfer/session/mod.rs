//! The transfer session: the protocol two engines speak to move a request's prefix
//! (every layer's MLA rows and indexer keys, target and draft caches, every device)
//! from the engine that prefilled it to the engine that decodes it, over a
//! [`KvTransport`](crate::transfer::KvTransport) for the bytes and a [`Wire`] for the
//! protocol's frames (any async byte stream: a TCP connection between the engines).
//!
//! ```text
//! exporter (prefill engine)                     importer (decode engine)
//!   open ─────────────── Hello ◄──────────────► Hello ─── open
//!   Transfers::export (pins the blocks)
//!   offer ──────────────► Offer ──────────────► next_offer
//!                                                begin (the importer's own request:
//!                                                  pages reserved, window opened)
//!   wait_ticket ◄──────── Ticket ◄────────────── reply
//!   push (transport write + notification,
//!         digests) ─────► Written ────────────► wait_written
//!                                                complete (notification, digests,
//!                                                  commit or abort)
//!   wait_outcome ◄─────── Outcome ◄──────────── (sent by complete)
//!   Transfers::release_export
//!   close ──────────────► Bye ────────────────► next_offer → None
//! ```
//!
//! [`TransferSession::hand_over`] is the exporter's column in one call,
//! [`TransferSession::finish`] the importer's after `begin`; the steps are public for
//! engines that interleave their own work (and for the kill tests). An application
//! may send its own frames on the session's [`wire`](TransferSession::wire) between the
//! protocol's (the `disagg` example sends each request's prompt before its offer).
//!
//! What the session guarantees, whatever the peer sends: every frame is bounded
//! ([`MAX_FRAME`], checked before anything is allocated) and every reply has a deadline
//! ([`SessionOptions::reply_timeout`], the ticket's own for the write); the importer
//! reserves pages only for its own request (the offer's keys must be the ones it
//! computes), a peer writes only into an open import's window, and an import is
//! committed only after the transport's notification and after its window is closed
//! and, with [`SessionOptions::digests`] (host memory), only when every page's SHA-256
//! equals the exporter's (checked after the close: what is checked is what is
//! committed); the exporter renews the export's lease before it writes, so its pages
//! stay pinned through the write; a failed transfer frees the importer's pages and the
//! exporter's pins, except while a write may still be landing, when the leases end
//! them. The handshake sends and receives at once (`Wire::exchange`): no `Hello` is too
//! large for the connection's buffers.

mod digests;
mod error;
mod exporter;
mod importer;
mod messages;
mod open;
mod wire;

#[cfg(not(feature = "testing"))]
use digests::host_block_digests;
#[cfg(feature = "testing")]
pub use digests::host_block_digests;
pub use digests::BlockDigest;
pub use error::SessionError;
pub use exporter::HandOver;
pub use importer::Written;
pub use messages::{AbortReason, ImportOutcome, SessionMsg, MAX_METADATA, PROTOCOL_VERSION};
#[cfg(feature = "testing")]
pub use open::link_pair;
pub use open::{SessionOptions, TransferSession};
pub use wire::{Wire, WireError, MAX_FRAME, MAX_STRING};
