//! Errors of the metadata builders.

use super::step::MetadataDims;
use crate::layout::LayoutError;

/// A step the persistent buffers cannot describe, or a misused draft replay.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// Zero-sized or inconsistent buffer dimensions.
    #[error(
        "metadata dims {dims:?} are invalid: every size must be non-zero, and a draft set must \
         have the target's max_num_sequences and max_num_tokens"
    )]
    BadDims {
        /// The dims.
        dims: MetadataDims,
    },
    /// More requests than table rows.
    #[error("{got} requests in one step, but the buffers hold {max}: raise max_num_sequences")]
    TooManyRequests {
        /// Requests given.
        got: usize,
        /// Rows.
        max: usize,
    },
    /// More new tokens than the mapping buffers hold.
    #[error("{got} new tokens in one step, but the buffers hold {max}: raise max_num_tokens or chunk the prefill")]
    TooManyTokens {
        /// Tokens given.
        got: usize,
        /// Capacity.
        max: usize,
    },
    /// A request with more blocks than a table row.
    #[error("request {request} holds {blocks} blocks, but a table row has {max}: raise max_blocks_per_seq")]
    TooManyBlocks {
        /// Request index in the step.
        request: usize,
        /// Blocks it holds.
        blocks: usize,
        /// Row width.
        max: usize,
    },
    /// A request whose KV does not fit the blocks it holds.
    #[error(
        "request {request}: {kv_len} KV tokens need {needed} blocks but it holds {given}; resize \
         the sequence before building the step"
    )]
    BlocksShort {
        /// Request index.
        request: usize,
        /// KV length after the step.
        kv_len: u64,
        /// Blocks needed.
        needed: usize,
        /// Blocks held.
        given: usize,
    },
    /// Context requests must come first.
    #[error("request {index} is a context request after a generation request: put context requests first")]
    ContextAfterGeneration {
        /// Its index.
        index: usize,
    },
    /// Full-KV mappings larger than their buffers.
    #[error("context requests hold {got} KV tokens, but the full-KV buffers hold {max}: raise max_context_kv_tokens")]
    ContextKvOverflow {
        /// Tokens needed.
        got: usize,
        /// Capacity.
        max: usize,
    },
    /// A per-request array of the wrong length.
    #[error("{got} per-request values given for a step of {expected} requests")]
    RequestCount {
        /// Given.
        got: usize,
        /// Requests in the step.
        expected: usize,
    },
    /// Draft replay without draft buffers.
    #[error("no draft buffers: create the metadata with draft dims to replay drafts against a separate draft cache")]
    NoDraftBuffers,
    /// A second prepare, or a target prepare, during a replay.
    #[error("a draft replay is active: restore it first")]
    ReplayActive,
    /// A restore with no replay active.
    #[error("no draft replay is active: nothing to restore")]
    NotInReplay,
    /// A snapshot from another replay.
    #[error("stale draft snapshot (replay {snapshot}, active replay {current}): restore with the snapshot of the active replay")]
    StaleSnapshot {
        /// The snapshot's replay.
        snapshot: u64,
        /// The active replay.
        current: u64,
    },
    /// The draft batch is not the target batch.
    #[error("draft request {index} differs from the target step (kind, cached or new tokens): the draft replays the same batch")]
    DraftBatchMismatch {
        /// Request index.
        index: usize,
    },
    /// A layout query failed.
    #[error(transparent)]
    Layout(#[from] LayoutError),
}
