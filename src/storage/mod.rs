//! Storage backends: where pool bytes live and how copy plans run. The core decides,
//! storage executes; this module never looks at sequences or policy.
//!
//! * [`HostStorage`]: pools in host memory for both tiers (the embedded default, CI,
//!   laptops); copy plans run synchronously with the host reference ops.
//! * The CUDA backend (VMM pools, streams, events) implements the same trait.

mod host;

pub use host::HostStorage;

use crate::ids::{PoolGroupId, SlotId, Tier};
use crate::ops::CopyPlan;

/// A storage failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StorageError {
    /// Memory for a pool could not be reserved.
    #[error("cannot allocate {bytes} bytes for {tier} pool {pool} of group {group}: lower the KV budget")]
    OutOfMemory {
        /// Tier.
        tier: Tier,
        /// Group.
        group: PoolGroupId,
        /// Pool.
        pool: u16,
        /// Bytes requested.
        bytes: u64,
    },
    /// A copy names a tier this storage does not have.
    #[error("copy plan uses the {tier} tier, which this storage does not have")]
    NoSuchTier {
        /// The tier.
        tier: Tier,
    },
    /// A copy names a slot outside the pool.
    #[error("slot {slot} of {tier} group {group} is outside the pool ({slots} slots)")]
    SlotOutOfRange {
        /// Tier.
        tier: Tier,
        /// Group.
        group: PoolGroupId,
        /// Slot.
        slot: SlotId,
        /// Slots in the pool.
        slots: u32,
    },
    /// The slot counts do not match the plan.
    #[error("{tier} slot counts {got:?} do not match the plan's {groups} pool groups")]
    Geometry {
        /// Tier.
        tier: Tier,
        /// Slot counts given.
        got: Vec<u32>,
        /// Pool groups in the plan.
        groups: usize,
    },
}

/// Executes the data movement the core decides.
pub trait KvStorage {
    /// Runs `plan`'s copies in order, after all work submitted before it.
    fn execute(&mut self, plan: &CopyPlan) -> Result<(), StorageError>;
}
