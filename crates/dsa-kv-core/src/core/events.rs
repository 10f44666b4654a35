//! KV events for KV-aware routers: blocks stored in the reuse tree, removed from it,
//! moved between tiers, and the whole tree cleared. Replayed in order, they describe
//! exactly the tree's blocks and the tier of each of their pages
//! ([`KvCacheManager::cached_blocks`](super::KvCacheManager::cached_blocks)).
//! These are the crate's own events (256-bit keys, per life cycle, partial blocks
//! included); routers consume [`RouterEvent`](super::RouterEvent)s instead (vLLM /
//! Dynamo format, full blocks, one event per block).

use serde::Serialize;

use super::reuse_key::BlockKey;
use crate::ids::{LifeCycleId, Tier};

/// A change to the reusable contents of the cache.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum KvEvent {
    /// A block became reusable.
    Stored {
        /// The block's chained key.
        key: BlockKey,
        /// Its parent's key (the scope root key for a first block).
        parent: BlockKey,
        /// Tokens in the block (fewer than a block for a partial last block).
        num_tokens: u32,
        /// Where the page of life cycle 0 is. A life cycle whose page is on another tier
        /// (possible for a block committed by a suspended sequence) follows at once as a
        /// [`KvEvent::TierUpdated`] from this tier.
        tier: Tier,
        /// Eviction priority.
        priority: u8,
    },
    /// A block is no longer reusable.
    Removed {
        /// The block's key.
        key: BlockKey,
    },
    /// A block's page of one life cycle moved between tiers.
    TierUpdated {
        /// The block's key.
        key: BlockKey,
        /// The life cycle.
        life_cycle: LifeCycleId,
        /// Old tier.
        from: Tier,
        /// New tier.
        to: Tier,
    },
    /// Every block was removed ([`reset_prefix_cache`](super::KvCacheManager::reset_prefix_cache),
    /// e.g. after a weight update): forget everything this cache stored. No `Removed`
    /// event is sent for those blocks (vLLM's and SGLang's `AllBlocksCleared`).
    AllBlocksCleared,
}
