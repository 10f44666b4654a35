//! Host-memory storage: one byte vector per (tier, pool group, pool). Both tiers live in
//! host memory; the "GPU" tier stands for device memory when no GPU is used.

use super::{check_plan_slots, KvStorage, StorageError};
use crate::ids::{PoolGroupId, SlotId, Tier};
use crate::layout::{BufferPlacement, PoolPlan};
use crate::ops::{copy_slots_between, copy_slots_within, CopyPlan};

/// Pools in host memory. See the module docs.
#[derive(Debug)]
pub struct HostStorage {
    tokens_per_block: u32,
    /// Bytes per slot, `[group][pool]`.
    slot_bytes: Vec<Vec<usize>>,
    /// Slots per group, `[tier][group]`.
    slots: [Vec<u32>; 2],
    /// `[tier][group][pool]`.
    data: [Vec<Vec<Vec<u8>>>; 2],
}

impl HostStorage {
    /// Zeroed pools for `plan` with the given slots per group (`host_slots` empty: no
    /// host tier).
    pub fn new(
        plan: &PoolPlan,
        gpu_slots: &[u32],
        host_slots: &[u32],
    ) -> Result<Self, StorageError> {
        let groups = plan.pool_groups().len();
        let slot_bytes: Vec<Vec<usize>> = plan
            .pool_groups()
            .iter()
            .map(|g| g.pools.iter().map(|p| p.slot_bytes as usize).collect())
            .collect();
        let mut data: [Vec<Vec<Vec<u8>>>; 2] = [Vec::new(), Vec::new()];
        for (tier, counts) in [(Tier::Gpu, gpu_slots), (Tier::Host, host_slots)] {
            if counts.is_empty() && tier == Tier::Host {
                continue;
            }
            if counts.len() != groups {
                return Err(StorageError::Geometry {
                    tier,
                    got: counts.to_vec(),
                    groups,
                });
            }
            for (g, &n) in counts.iter().enumerate() {
                let mut pools = Vec::new();
                for (p, &sb) in slot_bytes[g].iter().enumerate() {
                    let bytes = sb * n as usize;
                    let mut v = Vec::new();
                    v.try_reserve_exact(bytes)
                        .map_err(|_| StorageError::OutOfMemory {
                            tier,
                            group: PoolGroupId(g as u16),
                            pool: p as u16,
                            bytes: bytes as u64,
                        })?;
                    v.resize(bytes, 0);
                    pools.push(v);
                }
                data[tier.index()].push(pools);
            }
        }
        Ok(HostStorage {
            tokens_per_block: plan.tokens_per_block(),
            slot_bytes,
            slots: [gpu_slots.to_vec(), host_slots.to_vec()],
            data,
        })
    }

    /// Every GPU-tier pool, writable, in plan order (group, then pool).
    pub fn gpu_pools_mut(&mut self) -> impl Iterator<Item = &mut [u8]> {
        self.data[Tier::Gpu.index()]
            .iter_mut()
            .flat_map(|g| g.iter_mut().map(|p| p.as_mut_slice()))
    }

    /// Address of a pool's first byte, for registration with a transport (derived from a
    /// unique borrow: the transport may write through it).
    pub fn pool_ptr(&mut self, tier: Tier, group: PoolGroupId, pool: u16) -> *mut u8 {
        self.data[tier.index()][group.index()][pool as usize].as_mut_ptr()
    }

    /// Slots per pool group, `[tier][group]` (a tier without counts does not exist).
    pub fn slots(&self) -> &[Vec<u32>; 2] {
        &self.slots
    }

    /// The bytes of one pool.
    pub fn pool(&self, tier: Tier, group: PoolGroupId, pool: u16) -> &[u8] {
        &self.data[tier.index()][group.index()][pool as usize]
    }

    /// The bytes of one pool, writable (kernels' view of device memory).
    pub fn pool_mut(&mut self, tier: Tier, group: PoolGroupId, pool: u16) -> &mut [u8] {
        &mut self.data[tier.index()][group.index()][pool as usize]
    }

    /// Two different pools of one group, both writable (a layer's NVFP4 values and
    /// block scales).
    pub fn two_pools_mut(
        &mut self,
        tier: Tier,
        group: PoolGroupId,
        a: u16,
        b: u16,
    ) -> (&mut [u8], &mut [u8]) {
        assert_ne!(a, b, "invariant: two distinct pools");
        let pools = &mut self.data[tier.index()][group.index()];
        let (lo, hi) = (a.min(b) as usize, a.max(b) as usize);
        let (left, right) = pools.split_at_mut(hi);
        let (x, y) = (&mut left[lo][..], &mut right[0][..]);
        if a < b {
            (x, y)
        } else {
            (y, x)
        }
    }

    fn page_range(&self, p: &BufferPlacement, slot: SlotId) -> std::ops::Range<usize> {
        let start = p.page_byte_offset(slot) as usize;
        start..start + p.page_stride as usize
    }

    /// The page of buffer `p` in `slot` on `tier`.
    pub fn page(&self, tier: Tier, p: &BufferPlacement, slot: SlotId) -> &[u8] {
        let r = self.page_range(p, slot);
        &self.data[tier.index()][p.pool_group.index()][p.pool.index()][r]
    }

    /// The page of buffer `p` in `slot` on `tier`, writable.
    pub fn page_mut(&mut self, tier: Tier, p: &BufferPlacement, slot: SlotId) -> &mut [u8] {
        let r = self.page_range(p, slot);
        &mut self.data[tier.index()][p.pool_group.index()][p.pool.index()][r]
    }

    /// Writes token `pos` (inside the page) of buffer `p` in `slot`: `value` is the
    /// payload (the whole row for interleaved layouts), `scale` the scale word of a
    /// values-then-scales page.
    pub fn write_token(
        &mut self,
        tier: Tier,
        p: &BufferPlacement,
        slot: SlotId,
        pos: u32,
        value: &[u8],
        scale: &[u8],
    ) {
        let ranges = p.row.token_ranges(self.tokens_per_block, pos);
        let page = self.page_mut(tier, p, slot);
        let (vo, vl) = ranges.value;
        page[vo as usize..vo as usize + vl as usize].copy_from_slice(value);
        if let Some((so, sl)) = ranges.scale {
            page[so as usize..so as usize + sl as usize].copy_from_slice(scale);
        }
    }

    /// Reads token `pos` of buffer `p` in `slot`: `(payload, scale)` (`scale` empty for
    /// interleaved layouts).
    pub fn read_token(
        &self,
        tier: Tier,
        p: &BufferPlacement,
        slot: SlotId,
        pos: u32,
    ) -> (&[u8], &[u8]) {
        let ranges = p.row.token_ranges(self.tokens_per_block, pos);
        let page = self.page(tier, p, slot);
        let (vo, vl) = ranges.value;
        let value = &page[vo as usize..vo as usize + vl as usize];
        let scale = match ranges.scale {
            Some((so, sl)) => &page[so as usize..so as usize + sl as usize],
            None => &[],
        };
        (value, scale)
    }
}

impl KvStorage for HostStorage {
    fn execute(&mut self, plan: &CopyPlan) -> Result<(), StorageError> {
        check_plan_slots(&self.slots, plan)?;
        for c in &plan.copies {
            let g = c.pool_group.index();
            for (pool, &sb) in self.slot_bytes[g].iter().enumerate() {
                if c.src_tier == c.dst_tier {
                    copy_slots_within(&mut self.data[c.src_tier.index()][g][pool], sb, &c.pairs);
                } else {
                    let [gpu, host] = &mut self.data;
                    let (src, dst) = match c.src_tier {
                        Tier::Gpu => (&gpu[g][pool], &mut host[g][pool]),
                        Tier::Host => (&host[g][pool], &mut gpu[g][pool]),
                    };
                    copy_slots_between(src, dst, sb, &c.pairs);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DsaModel, LayerSet};
    use crate::ids::{Fence, LayerId};
    use crate::layout::{LayoutKind, Role};
    use crate::ops::GroupCopy;

    #[test]
    fn tokens_land_at_contract_offsets_and_copies_move_slots() {
        let model = DsaModel::new(crate::config::DsaModelSpec {
            num_layers: 2,
            ..crate::config::DsaModelSpec::deepseek_v32()
        })
        .unwrap();
        let plan = PoolPlan::for_model(&model, LayerSet::Target, LayoutKind::V2, 64).unwrap();
        let mut st = HostStorage::new(&plan, &[3], &[2]).unwrap();
        let idx = *plan.placement(LayerId(1), Role::IndexKey).unwrap();
        st.write_token(Tier::Gpu, &idx, SlotId(2), 5, &[7u8; 128], &[9, 9, 9, 9]);
        // Layer 1's index page of slot 2 is page 2·2+1 = 5 of the 8448-byte pages.
        let pool = st.pool(Tier::Gpu, PoolGroupId(0), 1);
        assert_eq!(&pool[5 * 8448 + 5 * 128..5 * 8448 + 6 * 128], &[7u8; 128]);
        assert_eq!(
            &pool[5 * 8448 + 8192 + 20..5 * 8448 + 8192 + 24],
            &[9, 9, 9, 9]
        );
        st.execute(&CopyPlan {
            fence: Fence(1),
            wait_for: Fence::NONE,
            copies: vec![GroupCopy {
                pool_group: PoolGroupId(0),
                src_tier: Tier::Gpu,
                dst_tier: Tier::Host,
                pairs: vec![(SlotId(2), SlotId(1))],
            }],
        })
        .unwrap();
        assert_eq!(
            st.read_token(Tier::Host, &idx, SlotId(1), 5),
            (&[7u8; 128][..], &[9u8, 9, 9, 9][..])
        );
        let bad = CopyPlan {
            fence: Fence(2),
            wait_for: Fence::NONE,
            copies: vec![GroupCopy {
                pool_group: PoolGroupId(0),
                src_tier: Tier::Host,
                dst_tier: Tier::Gpu,
                pairs: vec![(SlotId(2), SlotId(0))],
            }],
        };
        assert!(matches!(
            st.execute(&bad),
            Err(StorageError::SlotOutOfRange {
                slot: SlotId(2),
                ..
            })
        ));
        let mut no_host = HostStorage::new(&plan, &[3], &[]).unwrap();
        assert_eq!(
            no_host.execute(&bad),
            Err(StorageError::NoSuchTier { tier: Tier::Host })
        );
    }
}
