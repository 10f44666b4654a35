//! The core: plain synchronous state the coordinator actor owns (`&mut self`, no async,
//! no CUDA). Slot allocation with ready fences, sequences, the prefix-reuse radix tree,
//! eviction across tiers, quota. Every byte that must move leaves as a
//! [`CopyPlan`](crate::ops::CopyPlan).

mod cached_blocks;
mod error;
mod events;
mod eviction;
mod fence;
mod invariants;
mod manager;
mod pages;
pub mod quota;
mod radix;
mod reset;
mod residency;
mod reuse_key;
mod router_events;
pub mod scheduler;
mod sequence_ops;
mod slot_allocator;
mod transfer;

pub use cached_blocks::CachedPage;
pub use error::{KvError, SeqStatus};
pub use events::KvEvent;
pub use eviction::{DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY};
pub use fence::FenceClock;
pub use manager::{
    Created, GroupUsage, KvCacheManager, ManagerOptions, ManagerStats, SeqHandle, SeqOptions,
    SequenceInfo, TierSlots,
};
pub use pages::PageStatus;
pub use reset::ResetReport;
pub use reuse_key::{BlockKey, PrefixHash, ReuseScope};
pub use router_events::{Medium, ReplayError, RouterBlock, RouterEvent, RouterView};
pub use slot_allocator::{SlotAllocator, SlotError, SlotGrant};
pub use transfer::{BlockLoc, Import, PageLoc};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod router_events_tests;

#[cfg(test)]
mod scheduler_tests;

#[cfg(test)]
mod transfer_tests;
