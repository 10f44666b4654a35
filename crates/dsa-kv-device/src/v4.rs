//! DeepSeek-V4 on a device: [`V4Pools`], the byte pools a [`V4Plan`] lays out (per life
//! cycle, per tier, per pool: the host backend's device memory), the forward boundary
//! a V4 model plugs into ([`V4Forward`]: it reads and writes the pools through each
//! planned request's tables and returns what it sampled), and [`V4HostDevice`], which
//! runs a step: the plan's copies (offload, onboarding) first, then the forward.

use dsa_kv_core::core::{V4Outcome, V4Slots, V4StepPlan};
use dsa_kv_core::ids::{SlotId, Tier};
use dsa_kv_core::layout::{Retention, V4Plan};
use dsa_kv_core::ops::CopyPlan;

/// A V4 device's failure.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum V4DeviceError {
    /// Pools that cannot be built for the plan and slots.
    #[error("V4 pools: {0}")]
    Setup(String),
    /// A copy outside the pools.
    #[error("V4 copy: {0}")]
    Copy(String),
    /// The forward failed.
    #[error("device {device}: V4 forward: {what}")]
    Forward {
        /// The device.
        device: usize,
        /// What failed.
        what: String,
    },
}

/// The forward of a V4 model on one device: for every planned request, read and write
/// its caches through its tables ([`V4StepPlan::requests`]), and return one outcome per
/// planned request (drafts accepted, the token sampled, the next step's proposals).
pub trait V4Forward: Send + 'static {
    /// Runs one step.
    fn forward(
        &mut self,
        device: usize,
        pools: &mut V4Pools,
        plan: &V4StepPlan,
    ) -> Result<Vec<V4Outcome>, V4DeviceError>;
}

/// A V4 device as the runtime drives it: each step's copies, then its forward, on
/// the device's own pools (host memory for [`V4HostDevice`], GPU memory for a CUDA one).
pub trait V4Device: Send + 'static {
    /// The device index.
    fn index(&self) -> usize;

    /// Runs a step: its copies, then the forward; one outcome per planned request.
    fn execute(&mut self, plan: &V4StepPlan) -> Result<Vec<V4Outcome>, V4DeviceError>;
}

impl V4Device for Box<dyn V4Device> {
    fn index(&self) -> usize {
        (**self).index()
    }

    fn execute(&mut self, plan: &V4StepPlan) -> Result<Vec<V4Outcome>, V4DeviceError> {
        (**self).execute(plan)
    }
}

/// One device of the host backend for V4: pools and a forward.
pub struct V4HostDevice {
    index: usize,
    pools: V4Pools,
    forward: Box<dyn V4Forward>,
}

impl V4HostDevice {
    /// Device `index` with zeroed pools for `plan` and `slots`.
    pub fn new(
        index: usize,
        plan: &V4Plan,
        slots: &V4Slots,
        forward: Box<dyn V4Forward>,
    ) -> Result<Self, V4DeviceError> {
        Ok(V4HostDevice {
            index,
            pools: V4Pools::new(plan, slots)?,
            forward,
        })
    }

    /// The device index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The pools.
    pub fn pools(&self) -> &V4Pools {
        &self.pools
    }

    /// Runs a step: its copies, then the forward.
    pub fn execute(&mut self, plan: &V4StepPlan) -> Result<Vec<V4Outcome>, V4DeviceError> {
        self.pools.apply(&plan.copies)?;
        self.forward.forward(self.index, &mut self.pools, plan)
    }
}

impl V4Device for V4HostDevice {
    fn index(&self) -> usize {
        self.index
    }

    fn execute(&mut self, plan: &V4StepPlan) -> Result<Vec<V4Outcome>, V4DeviceError> {
        V4HostDevice::execute(self, plan)
    }
}

/// The slots of one life cycle's pools on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct V4PoolSlots {
    /// Slots on the GPU tier.
    pub gpu: u32,
    /// Slots on the host tier (0 for a window life cycle).
    pub host: u32,
    /// Its index among the window life cycles (the manager's `lc`), if it is one.
    pub window: Option<usize>,
}

/// Per life cycle of `plan` (plan order), the slots a device's pools hold for `slots`
/// (as the manager was built with): the compressed life cycle on the GPU and the host
/// tier, each window life cycle on the GPU. A missing count is a typed error.
pub fn v4_pool_slots(plan: &V4Plan, slots: &V4Slots) -> Result<Vec<V4PoolSlots>, V4DeviceError> {
    let mut windows = 0;
    plan.life_cycles()
        .iter()
        .map(|lc| {
            let (gpu, host, window) = match lc.retention {
                Retention::Full => (
                    slots.blocks.gpu.first().copied(),
                    slots.blocks.host.first().copied().unwrap_or(0),
                    None,
                ),
                Retention::Window { .. } => {
                    windows += 1;
                    (
                        slots.windows.get(windows - 1).copied(),
                        0,
                        Some(windows - 1),
                    )
                }
            };
            let gpu = gpu.ok_or_else(|| {
                V4DeviceError::Setup(format!(
                    "no slot count for the {} life cycle: give V4Slots one per life cycle",
                    lc.kind.name()
                ))
            })?;
            Ok(V4PoolSlots { gpu, host, window })
        })
        .collect()
}

fn tier_index(t: Tier) -> usize {
    match t {
        Tier::Gpu => 0,
        Tier::Host => 1,
    }
}

/// The pools of every life cycle of a plan: the compressed one on the GPU and (with a
/// host tier) on the host, the window ones on the GPU.
pub struct V4Pools {
    plan: V4Plan,
    /// Per life cycle (plan order): per tier (GPU, host): per pool: its bytes.
    bytes: Vec<[Vec<Vec<u8>>; 2]>,
    /// Per life cycle: its index among the window life cycles (the manager's `lc`).
    window_index: Vec<Option<usize>>,
}

impl V4Pools {
    /// Zeroed pools for `plan` with `slots` (as the manager was built with).
    pub fn new(plan: &V4Plan, slots: &V4Slots) -> Result<V4Pools, V4DeviceError> {
        let sizes = v4_pool_slots(plan, slots)?;
        let bytes = plan
            .life_cycles()
            .iter()
            .zip(&sizes)
            .map(|(lc, s)| {
                let tier = |n: u32| -> Vec<Vec<u8>> {
                    lc.pools
                        .iter()
                        .map(|p| vec![0u8; (u64::from(n) * p.slot_bytes()) as usize])
                        .collect()
                };
                [tier(s.gpu), tier(s.host)]
            })
            .collect();
        Ok(V4Pools {
            plan: plan.clone(),
            bytes,
            window_index: sizes.iter().map(|s| s.window).collect(),
        })
    }

    /// The plan.
    pub fn plan(&self) -> &V4Plan {
        &self.plan
    }

    /// Window life cycles (the manager's `lc` counts them).
    pub fn window_life_cycles(&self) -> usize {
        self.window_index.iter().flatten().count()
    }

    /// The index among the window life cycles of life cycle `lc` (plan order), if it is
    /// one.
    pub fn window_index(&self, lc: usize) -> Option<usize> {
        self.window_index.get(lc).copied().flatten()
    }

    /// The bytes of pool `pool` of life cycle `lc` (plan order) on `tier` (empty for a
    /// tier the life cycle does not have): what a kernel or a dump reads.
    pub fn pool(&self, lc: usize, tier: Tier, pool: usize) -> &[u8] {
        self.bytes
            .get(lc)
            .and_then(|t| t[tier_index(tier)].get(pool))
            .map_or(&[], Vec::as_slice)
    }

    /// [`pool`](Self::pool), writable (a transfer landing, a fault injected in a test).
    pub fn pool_mut(&mut self, lc: usize, tier: Tier, pool: usize) -> &mut [u8] {
        self.bytes
            .get_mut(lc)
            .and_then(|t| t[tier_index(tier)].get_mut(pool))
            .map_or(&mut [], Vec::as_mut_slice)
    }

    /// Copies whole slots of every pool of life cycle `lc` from `src`'s `src_tier` (another
    /// device's pools of the same plan) into this device's GPU tier (`(source slot,
    /// destination slot)` pairs, in order): an in-process transport, what a P/D
    /// transfer's wire carries.
    pub fn copy_slots_from(
        &mut self,
        src: &V4Pools,
        src_tier: Tier,
        lc: usize,
        pairs: &[(SlotId, SlotId)],
    ) -> Result<(), V4DeviceError> {
        let (Some(from), Some(to)) = (
            src.plan.life_cycles().get(lc),
            self.plan.life_cycles().get(lc),
        ) else {
            return Err(V4DeviceError::Copy(format!("no life cycle {lc}")));
        };
        if from.pools != to.pools {
            return Err(V4DeviceError::Copy(format!(
                "life cycle {lc}: the two devices' pools differ (not the same plan)"
            )));
        }
        for (pool, p) in to.pools.iter().enumerate() {
            let n = p.slot_bytes() as usize;
            for &(s, d) in pairs {
                let (a, b) = (s.index() * n, d.index() * n);
                let from = src.bytes[lc][tier_index(src_tier)][pool].get(a..a + n);
                let to = self.bytes[lc][0][pool].get_mut(b..b + n);
                match (from, to) {
                    (Some(f), Some(t)) => t.copy_from_slice(f),
                    _ => {
                        return Err(V4DeviceError::Copy(format!(
                            "life cycle {lc}: slot {s:?} → {d:?} is past the pools"
                        )))
                    }
                }
            }
        }
        Ok(())
    }

    /// Executes the manager's copy plans (offload, onboarding) in order: every pool of
    /// the compressed life cycle, slot by slot.
    pub fn apply(&mut self, plans: &[CopyPlan]) -> Result<(), V4DeviceError> {
        let lc = self
            .plan
            .life_cycles()
            .iter()
            .position(|lc| lc.retention == Retention::Full)
            .ok_or_else(|| V4DeviceError::Setup("the plan has no compressed life cycle".into()))?;
        let slot_bytes: Vec<usize> = self.plan.life_cycles()[lc]
            .pools
            .iter()
            .map(|p| p.slot_bytes() as usize)
            .collect();
        for copy in plans.iter().flat_map(|p| &p.copies) {
            if copy.pool_group.index() != 0 {
                return Err(V4DeviceError::Copy(format!(
                    "a copy of pool group {}: V4 blocks have one",
                    copy.pool_group.index()
                )));
            }
            let (src, dst) = (tier_index(copy.src_tier), tier_index(copy.dst_tier));
            for (pool, &n) in slot_bytes.iter().enumerate() {
                for &(s, d) in &copy.pairs {
                    let range = |slot: SlotId, t: usize| {
                        let at = slot.index() * n;
                        (at + n <= self.bytes[lc][t][pool].len()).then_some(at..at + n)
                    };
                    let (Some(from), Some(to)) = (range(s, src), range(d, dst)) else {
                        return Err(V4DeviceError::Copy(format!(
                            "copy {s:?} → {d:?} ({:?} → {:?}) is past the pools",
                            copy.src_tier, copy.dst_tier
                        )));
                    };
                    let data = self.bytes[lc][src][pool][from].to_vec();
                    self.bytes[lc][dst][pool][to].copy_from_slice(&data);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsa_kv_core::config::V4Spec;
    use dsa_kv_core::core::TierSlots;
    use dsa_kv_core::ids::{Fence, PoolGroupId};
    use dsa_kv_core::ops::GroupCopy;

    fn pools() -> V4Pools {
        let plan = V4Plan::new(&V4Spec {
            compress_ratios: vec![4, 128],
            ..V4Spec::flash()
        })
        .unwrap();
        let slots = V4Slots {
            blocks: TierSlots {
                gpu: vec![4],
                host: vec![3],
            },
            windows: vec![2, 5, 6],
        };
        V4Pools::new(&plan, &slots).unwrap()
    }

    fn copy(src: Tier, dst: Tier, pairs: Vec<(SlotId, SlotId)>) -> CopyPlan {
        CopyPlan {
            fence: Fence(1),
            wait_for: Fence(0),
            copies: vec![GroupCopy {
                pool_group: PoolGroupId(0),
                src_tier: src,
                dst_tier: dst,
                pairs,
            }],
        }
    }

    /// Pools have the plan's bytes per slot; copies move whole slots of every pool of
    /// the compressed life cycle between the tiers, pair by pair in order; a pair past
    /// the pools is refused (the pairs before it have moved).
    #[test]
    fn pools_are_sized_by_the_plan_and_copies_move_whole_slots() {
        let mut p = pools();
        let lcs = p.plan().life_cycles().to_vec();
        for (i, lc) in lcs.iter().enumerate() {
            let slots = match lc.retention {
                Retention::Full => 4,
                Retention::Window { .. } => [2, 5, 6][i - 1],
            };
            for (j, pool) in lc.pools.iter().enumerate() {
                assert_eq!(
                    p.pool(i, Tier::Gpu, j).len() as u64,
                    slots * pool.slot_bytes()
                );
            }
        }
        let n = lcs[0].pools[0].slot_bytes() as usize;
        p.pool_mut(0, Tier::Gpu, 0)[2 * n + 5] = 7;
        p.apply(&[copy(Tier::Gpu, Tier::Host, vec![(SlotId(2), SlotId(1))])])
            .unwrap();
        assert_eq!(p.pool(0, Tier::Host, 0)[n + 5], 7);
        p.apply(&[copy(Tier::Host, Tier::Gpu, vec![(SlotId(1), SlotId(0))])])
            .unwrap();
        assert_eq!(p.pool(0, Tier::Gpu, 0)[5], 7);
        let e = p
            .apply(&[copy(Tier::Gpu, Tier::Host, vec![(SlotId(0), SlotId(3))])])
            .unwrap_err();
        assert!(matches!(e, V4DeviceError::Copy(_)), "{e}");
        assert!(p.pool(9, Tier::Gpu, 0).is_empty());
    }
}
