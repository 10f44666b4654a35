//! Storage backends: where pool bytes live and how copy plans run. The core decides,
//! storage executes; this module never looks at sequences or policy, and never names a
//! backend (their failures travel as [`BackendError`]).
//!
//! * [`HostStorage`]: pools in host memory for both tiers (the embedded default, CI,
//!   laptops); copy plans run synchronously with the host reference ops.
//! * `cuda::CudaStorage` (feature `cuda`): VMM pools on the GPU and a pinned host tier; copy
//!   plans run as batched-copy kernels on the copy stream.

mod backend_error;
mod host;

pub use backend_error::BackendError;
pub use host::HostStorage;

use crate::ids::{PoolGroupId, SlotId, Tier};
use crate::ops::CopyPlan;

/// A storage failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
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
    /// The backend failed a storage operation (for the CUDA backend, a
    /// `cuda::CudaError`: see [`BackendError::downcast_ref`]).
    #[error("{0}")]
    Backend(BackendError),
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

/// Checks every slot of `plan` against the slot counts `[tier][group]` (a tier with no
/// counts does not exist) before anything moves.
pub fn check_plan_slots(slots: &[Vec<u32>; 2], plan: &CopyPlan) -> Result<(), StorageError> {
    let check = |tier: Tier, group: PoolGroupId, slot: SlotId| {
        let counts = &slots[tier.index()];
        if counts.is_empty() {
            return Err(StorageError::NoSuchTier { tier });
        }
        let n = counts.get(group.index()).copied().unwrap_or(0);
        if slot.get() >= n {
            return Err(StorageError::SlotOutOfRange {
                tier,
                group,
                slot,
                slots: n,
            });
        }
        Ok(())
    };
    for c in &plan.copies {
        for &(s, d) in &c.pairs {
            check(c.src_tier, c.pool_group, s)?;
            check(c.dst_tier, c.pool_group, d)?;
        }
    }
    Ok(())
}
