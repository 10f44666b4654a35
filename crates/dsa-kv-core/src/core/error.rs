//! Errors of the core manager. Every message names the value and what to do.

use super::window::WindowError;
use crate::ids::{Fence, PoolGroupId, RequestId};
use crate::layout::LayoutError;

/// What a sequence is doing.
#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SeqStatus {
    /// Pages locked on the GPU; kernels may read and write it.
    Active,
    /// Pages held (may be offloaded); must be resumed before use.
    Suspended,
}

/// Errors of [`KvCacheManager`](super::KvCacheManager) operations.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// No live sequence has this id.
    #[error("unknown request {id}: it was never created here or has been closed")]
    UnknownRequest {
        /// The id.
        id: RequestId,
    },
    /// A live sequence already has this id.
    #[error("request {id} already exists: close it first or use another id")]
    DuplicateRequest {
        /// The id.
        id: RequestId,
    },
    /// The handle belongs to another manager.
    #[error("the handle of request {id} belongs to another cache manager")]
    WrongManager {
        /// The id.
        id: RequestId,
    },
    /// The handle's sequence was closed.
    #[error("request {id} is closed: create a new sequence to continue")]
    SequenceClosed {
        /// The id.
        id: RequestId,
    },
    /// The operation needs an active sequence.
    #[error("request {id} is {status:?}: resume it before {op}")]
    NotActive {
        /// The id.
        id: RequestId,
        /// Its status.
        status: SeqStatus,
        /// The operation attempted.
        op: &'static str,
    },
    /// History may only grow.
    #[error("request {id}: history may not go backwards ({current} → {requested})")]
    HistoryBackwards {
        /// The id.
        id: RequestId,
        /// Current history length.
        current: u64,
        /// Requested history length.
        requested: u64,
    },
    /// Capacity below history.
    #[error("request {id}: capacity {capacity} is below history {history}; capacity must cover every token already processed")]
    CapacityBelowHistory {
        /// The id.
        id: RequestId,
        /// Requested capacity.
        capacity: u64,
        /// Requested history.
        history: u64,
    },
    /// Commit after `stop_committing` or close.
    #[error("request {id}: commit after stop_committing; the sequence no longer adds blocks to the cache")]
    CommitAfterStop {
        /// The id.
        id: RequestId,
    },
    /// Committing tokens whose KV has no room.
    #[error(
        "request {id}: committing {adding} tokens would make {total} committed tokens, above \
         capacity {capacity}; resize first (only tokens whose KV was written can be committed)"
    )]
    CommitBeyondCapacity {
        /// The id.
        id: RequestId,
        /// Tokens being committed.
        adding: u64,
        /// Committed after the call.
        total: u64,
        /// Capacity.
        capacity: u64,
    },
    /// A token id the reuse-key encoding cannot hold.
    #[error("token {index} has id {value}, above the largest supported id {max} (ids are encoded as 31-bit values)")]
    TokenOutOfRange {
        /// Position in the given slice.
        index: usize,
        /// The id.
        value: u32,
        /// The largest accepted id.
        max: u32,
    },
    /// A sequence longer than a whole pool.
    #[error(
        "request {id} needs {blocks} blocks ({tokens} tokens) but pool group {group} holds only \
         {capacity} blocks ({capacity_tokens} tokens) on the GPU: raise the KV budget or shorten the request"
    )]
    SequenceTooLong {
        /// The id.
        id: RequestId,
        /// Tokens requested.
        tokens: u64,
        /// Blocks requested.
        blocks: u64,
        /// The pool group.
        group: PoolGroupId,
        /// Its GPU capacity in blocks.
        capacity: u32,
        /// Its GPU capacity in tokens.
        capacity_tokens: u64,
    },
    /// A bad manager option.
    #[error("{field} = {value} is invalid: {why}")]
    InvalidOption {
        /// The option.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is required.
        why: &'static str,
    },
    /// A completion for work never issued.
    #[error("fence {fence:?} completed but only {issued:?} was issued")]
    FenceNotIssued {
        /// Reported fence.
        fence: Fence,
        /// Last issued fence.
        issued: Fence,
    },
    /// `reset_prefix_cache` while sequences hold pages.
    #[error(
        "cannot reset the prefix cache: {sequences} sequence(s) still hold pages; finish or \
         close them first (nothing was changed)"
    )]
    PrefixCacheInUse {
        /// Live sequences (active or suspended) holding at least one page.
        sequences: usize,
    },
    /// An export or import of blocks was refused (nothing was changed).
    #[error("transfer {id}: {why}")]
    Transfer {
        /// The export's or import's id.
        id: RequestId,
        /// What was wrong and what to do.
        why: String,
    },
    /// A layout query failed.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The sliding-window kind refused (see [`WindowError`]).
    #[error(transparent)]
    Window(#[from] WindowError),
    /// A suspend of a sequence whose model has sliding windows.
    #[error(
        "request {id}: a sequence with sliding windows cannot be suspended (its windows live \
         on the GPU only); preempt it by recompute: close it and create it again"
    )]
    NoSuspend {
        /// The request.
        id: RequestId,
    },
}
