//! The core: plain synchronous state the coordinator actor owns (`&mut self`, no async,
//! no CUDA). Slot allocation with ready fences, sequences, the prefix-reuse radix tree,
//! eviction across tiers, quota. Every byte that must move leaves as a
//! [`CopyPlan`](crate::ops::CopyPlan).

mod block_row;
mod cached_blocks;
mod error;
mod events;
mod eviction;
// `pub` for feature `testing` (re-exported below); only the manager uses it otherwise.
#[cfg_attr(not(any(test, feature = "testing")), allow(unreachable_pub, dead_code))]
mod fence;
mod invariants;
mod manager;
mod model_cache;
mod pages;
pub mod quota;
mod radix;
mod reset;
mod residency;
mod reuse_key;
mod router_events;
#[cfg(any(test, feature = "testing"))]
mod router_view;
pub mod scheduler;
mod sequence_ops;
// `pub` for feature `testing` (re-exported below); only the manager uses it otherwise.
#[cfg_attr(not(any(test, feature = "testing")), allow(unreachable_pub, dead_code))]
mod slot_allocator;
mod transfer;
mod window;

pub use block_row::{BlockRow, RowStamp};
pub use cached_blocks::CachedPage;
pub use error::{KvError, SeqStatus};
pub use events::KvEvent;
pub use eviction::{DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY};
pub use manager::{
    Created, GroupUsage, KvCacheManager, ManagerOptions, ManagerStats, SeqHandle, SeqOptions,
    SequenceInfo, TierSlots,
};
pub use model_cache::{CacheById, ModelCache, PrefixPages, WindowKindStats, WindowedSlots};
pub use pages::PageStatus;
pub use reset::ResetReport;
pub use reuse_key::{BlockKey, PrefixHash, ReuseScope};
pub use router_events::{Medium, RouterBlock, RouterEvent};
pub use transfer::{BlockLoc, Import, PageLoc, MAX_BLOCK_PAGES};
pub use window::{WindowCache, WindowError, WindowSpec, WindowStats};

// Feature `testing`: the raw allocator and fence clock the manager is built from, and the
// reference replay of router events that tests check streams against.
#[cfg(any(test, feature = "testing"))]
pub use fence::FenceClock;
#[cfg(any(test, feature = "testing"))]
pub use router_view::{ReplayError, RouterView};
#[cfg(any(test, feature = "testing"))]
pub use slot_allocator::{SlotAllocator, SlotError, SlotGrant};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod router_events_tests;

#[cfg(test)]
mod scheduler_tests;

#[cfg(test)]
mod scheduler_window_tests;

#[cfg(test)]
mod transfer_tests;
