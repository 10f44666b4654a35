//! Step metadata: everything the DSA kernels read from the cache manager each step
//! (indexer page table, block table, slot mappings, request indices, causal windows,
//! full-KV mappings), kept in persistent buffers whose addresses never change, and the
//! draft-replay rebinding for speculative decoding. Host-built; the device path must
//! produce the same values.

mod buffers;
mod draft;
mod error;
pub mod mirror;
mod step;
pub mod v4;

/// A request's step kind: the scheduler's (one type, re-exported here for the builder's
/// callers).
pub use crate::core::scheduler::RequestKind;
pub use buffers::{Bindings, BufferId, BufferRole};
pub use draft::{DraftReplay, DraftSnapshot};
pub use error::MetadataError;
pub use step::{MetadataDims, MetadataLayout, StepCounts, StepMetadata, StepRequest};

#[cfg(test)]
mod tests;
