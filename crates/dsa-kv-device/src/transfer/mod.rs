//! Moving KV pages between engines (prefill / decode disaggregation).
//!
//! A page is the unit of transfer: one slot of every pool of its pool group, which holds
//! the block's MLA rows **and** its indexer keys (they share the life cycle), in the
//! target cache and, with a separate MTP draft cache, in the draft cache too. Nothing
//! here can move one without the other: a transfer is planned from the pools of every
//! cache, never from a list of roles. A model with sliding windows (DeepSeek-V4) moves
//! its compressed life cycle's blocks the same way (the target cache) and, at their last
//! boundary, the tail of each window life cycle ([`WindowTail`]: raw-window rows and
//! compressor state, pages of [`CacheKind::Window`]).
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
mod memory;
#[cfg(feature = "nixl")]
pub mod nixl;
mod plan;
mod push;
mod transport;
mod window;

pub use local::LocalTransport;
pub use memory::{check_segments, MemKind, MemRegion, Segment, WriteBatch};
pub use plan::{
    block_pages, plan_writes, transfer_units, BlockPages, CacheKind, ExportedBlocks, ImportTicket,
    PageLoc, PlanError, PoolRef, PoolRegion, WindowTail, WritePlan, MAX_POOLS, MAX_POOL_ROLES,
    MAX_REGIONS, MAX_TAIL_SLOTS, MAX_TAIL_WINDOWS, MAX_TRANSFER_BLOCKS, MAX_TRANSFER_TOKENS,
};
pub use push::{push, push_plan, PushError, TransferReport};
pub use transport::{
    KvTransport, PeerId, TransportError, WriteReport, MAX_NOTIFICATION, MAX_PENDING_NOTIFICATIONS,
};
pub use window::{prune_expired, window_for, Window};
