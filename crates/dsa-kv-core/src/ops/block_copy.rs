//! Batched block copy: the data movement of a [`CopyPlan`] (offload GPU → host,
//! onboarding host → GPU, copy-on-resume of a reused partial block). For each pool of a
//! pool group, every `(src, dst)` slot pair moves `slot_bytes` bytes.

use serde::Serialize;

use crate::ids::{Fence, PoolGroupId, SlotId, Tier};

/// Slot copies of one pool group from one tier to another.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct GroupCopy {
    /// The pool group (every pool of it is copied).
    pub pool_group: PoolGroupId,
    /// Source tier.
    pub src_tier: Tier,
    /// Destination tier.
    pub dst_tier: Tier,
    /// `(source slot, destination slot)` pairs, executed in order.
    pub pairs: Vec<(SlotId, SlotId)>,
}

/// Data movement decided by the core and executed by storage, in order, after every
/// piece of work issued before it. Completing it completes `fence`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct CopyPlan {
    /// Fence this plan completes.
    pub fence: Fence,
    /// Destination slots were last used by work up to this fence (already ordered before
    /// the plan when the device runs work in issue order; explicit for other schedules).
    pub wait_for: Fence,
    /// The copies, in order.
    pub copies: Vec<GroupCopy>,
}

impl CopyPlan {
    /// Number of slot copies.
    pub fn num_slot_copies(&self) -> usize {
        self.copies.iter().map(|c| c.pairs.len()).sum()
    }
}

/// Host reference: copies whole slots of `slot_bytes` from `src` to `dst`.
pub fn copy_slots_between(
    src: &[u8],
    dst: &mut [u8],
    slot_bytes: usize,
    pairs: &[(SlotId, SlotId)],
) {
    for &(s, d) in pairs {
        let so = s.index() * slot_bytes;
        let d0 = d.index() * slot_bytes;
        dst[d0..d0 + slot_bytes].copy_from_slice(&src[so..so + slot_bytes]);
    }
}

/// Host reference: copies whole slots inside one pool (same tier).
pub fn copy_slots_within(pool: &mut [u8], slot_bytes: usize, pairs: &[(SlotId, SlotId)]) {
    for &(s, d) in pairs {
        let so = s.index() * slot_bytes;
        pool.copy_within(so..so + slot_bytes, d.index() * slot_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_whole_slots() {
        let src: Vec<u8> = (0..32).collect();
        let mut dst = vec![0u8; 32];
        copy_slots_between(
            &src,
            &mut dst,
            8,
            &[(SlotId(3), SlotId(0)), (SlotId(1), SlotId(2))],
        );
        assert_eq!(&dst[0..8], &src[24..32]);
        assert_eq!(&dst[16..24], &src[8..16]);
        assert_eq!(&dst[8..16], &[0; 8]);
        let mut pool: Vec<u8> = (0..32).collect();
        copy_slots_within(&mut pool, 8, &[(SlotId(0), SlotId(3))]);
        assert_eq!(&pool[24..32], &[0, 1, 2, 3, 4, 5, 6, 7]);
    }
}
