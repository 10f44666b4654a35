//! Errors of the host reference ops: bad shapes and out-of-bounds mappings are reported,
//! never written past.

/// A rejected op.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OpError {
    /// The indexer kernels move 128-byte (FP8) or 64-byte (FP4) payloads.
    #[error("indexer payload width {got} B is not supported: use 128 (FP8) or 64 (FP4)")]
    PayloadWidth {
        /// The width given.
        got: usize,
    },
    /// Scale words are 4 bytes.
    #[error("indexer scale size {got} B is not supported: the scale word is 4 bytes")]
    ScaleSize {
        /// The size given.
        got: usize,
    },
    /// Inputs of different lengths.
    #[error("{what}: expected {expected} elements, got {got}")]
    Length {
        /// Which input.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// A mapping points outside the cache.
    #[error("token {token}: bytes [{offset}, {end}) are outside the cache ({cache_len} B)")]
    OutOfBounds {
        /// Token index.
        token: usize,
        /// Start offset.
        offset: i64,
        /// End offset.
        end: i64,
        /// Cache size.
        cache_len: usize,
    },
    /// A value that does not fit the int32 kernels take.
    #[error("{what} {value} does not fit in int32")]
    Int32Overflow {
        /// What overflowed.
        what: &'static str,
        /// The value.
        value: i64,
    },
}
