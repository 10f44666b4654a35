//! [`V4GpuPools`]: a V4 plan's pools on one GPU, the CUDA twin of the host backend's
//! [`V4Pools`](dsa_kv_device::windowed::V4Pools): per life cycle, per pool, one device
//! allocation of `slots × slot bytes` (the GPU tier), and for the compressed life cycle a
//! host tier in host memory. The manager's copy plans (offload, onboarding) move whole
//! slots of every pool of the compressed life cycle; every pair is checked before the
//! first byte moves, so a bad plan changes nothing.

use std::sync::Arc;

use dsa_kv_core::core::WindowedSlots;
use dsa_kv_core::ids::{SlotId, Tier};
use dsa_kv_core::layout::{Retention, V4Plan};
use dsa_kv_core::ops::CopyPlan;
use dsa_kv_device::windowed::{v4_pool_slots, PoolError};

use crate::buffers::PinnedHost;
use crate::{CudaError, DeviceBuffer, Gpu};

/// A V4 plan's pools on one GPU (and the compressed life cycle's host tier). See the
/// module docs.
pub struct V4GpuPools {
    gpu: Arc<Gpu>,
    plan: V4Plan,
    /// Per life cycle (plan order): per pool: the GPU tier.
    device: Vec<Vec<DeviceBuffer>>,
    /// Per life cycle: per pool: the host tier, pinned and device-mapped (a transport
    /// moves it; empty pools for a window life cycle).
    host: Vec<Vec<PinnedHost>>,
    /// Per life cycle: its index among the window life cycles, if it is one.
    window_index: Vec<Option<usize>>,
}

fn setup(e: CudaError) -> PoolError {
    PoolError::Setup(e.to_string())
}

fn copy_err(e: CudaError) -> PoolError {
    PoolError::Copy(e.to_string())
}

impl V4GpuPools {
    /// Zeroed pools for `plan` with `slots` (as the manager was built with) on `gpu`.
    pub fn new(gpu: Arc<Gpu>, plan: &V4Plan, slots: &WindowedSlots) -> Result<Self, PoolError> {
        let sizes = v4_pool_slots(plan, slots)?;
        let mut device = Vec::new();
        let mut host = Vec::new();
        for (lc, s) in plan.life_cycles().iter().zip(&sizes) {
            let mut d = Vec::new();
            let mut h = Vec::new();
            for p in &lc.pools {
                let bytes = |n: u32| {
                    usize::try_from(u64::from(n) * p.slot_bytes()).map_err(|_| {
                        PoolError::Setup(format!("{n} slots of {} bytes", p.slot_bytes()))
                    })
                };
                d.push(DeviceBuffer::zeroed(&gpu, bytes(s.gpu)?, "V4 pool").map_err(setup)?);
                h.push(PinnedHost::zeroed(&gpu, bytes(s.host)?, "V4 host pool").map_err(setup)?);
            }
            device.push(d);
            host.push(h);
        }
        Ok(V4GpuPools {
            gpu,
            plan: plan.clone(),
            device,
            host,
            window_index: sizes.iter().map(|s| s.window).collect(),
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
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

    /// The device address and byte length of pool `pool` of life cycle `lc` on the GPU
    /// tier (`None`: no such pool).
    pub fn device_pool(&self, lc: usize, pool: usize) -> Option<(u64, u64)> {
        let b = self.device.get(lc)?.get(pool)?;
        Some((b.ptr(), b.len() as u64))
    }

    /// Every pool as memory a transport registers, for device `index`: the GPU tier
    /// as this GPU's memory, the compressed life cycle's host tier as host memory (see
    /// [`windowed_regions`](dsa_kv_device::windowed::windowed_regions)).
    pub fn regions(&self, index: usize) -> Vec<dsa_kv_device::transfer::PoolRegion> {
        use dsa_kv_device::transfer::{MemKind, MemRegion};
        let ordinal = self.gpu.ordinal() as u32;
        dsa_kv_device::windowed::windowed_regions(index, &self.plan, |lc, tier, pool| {
            let slot = self
                .plan
                .life_cycles()
                .get(lc)?
                .pools
                .get(pool)?
                .slot_bytes();
            let (region, len) = match tier {
                Tier::Gpu => {
                    let (addr, len) = self.device_pool(lc, pool)?;
                    let mem = MemKind::Device { ordinal };
                    (MemRegion { addr, len, mem }, len)
                }
                Tier::Host => {
                    let b = self.host.get(lc)?.get(pool)?;
                    let len = b.len() as u64;
                    let mem = MemKind::Host;
                    (
                        MemRegion {
                            addr: b.host_ptr(),
                            len,
                            mem,
                        },
                        len,
                    )
                }
            };
            Some((region, (len / slot.max(1)) as u32))
        })
    }

    /// [`digest_pools`](dsa_kv_device::backend::digest_pools) of every GPU-tier pool, in
    /// plan order (what the host device's digest covers). Waits for the GPU.
    pub fn digest(&self) -> Result<String, PoolError> {
        let mut pools = Vec::new();
        for (lc, p) in self.device.iter().enumerate() {
            for pool in 0..p.len() {
                pools.push(self.download(lc, Tier::Gpu, pool)?);
            }
        }
        Ok(dsa_kv_device::backend::digest_pools(
            pools.iter().map(Vec::as_slice),
        ))
    }

    /// A copy of pool `pool` of life cycle `lc` on `tier` (empty for a pool or tier the
    /// plan does not have): what a check or a dump reads. Waits for the GPU.
    pub fn download(&self, lc: usize, tier: Tier, pool: usize) -> Result<Vec<u8>, PoolError> {
        match tier {
            Tier::Gpu => {
                let Some(b) = self.device.get(lc).and_then(|d| d.get(pool)) else {
                    return Ok(Vec::new());
                };
                let mut out = vec![0u8; b.len()];
                self.gpu.synchronize().map_err(copy_err)?;
                self.gpu.download(b, &mut out).map_err(copy_err)?;
                Ok(out)
            }
            Tier::Host => Ok(self
                .host
                .get(lc)
                .and_then(|h| h.get(pool))
                .map(|h| h.as_slice().to_vec())
                .unwrap_or_default()),
        }
    }

    /// Executes the manager's copy plans (offload, onboarding) in order, on the compute
    /// stream: every pool of the compressed life cycle, slot by slot. Every pair is
    /// checked first; a pair past the pools, or a copy of another pool group, refuses
    /// the whole batch and nothing moves.
    pub fn apply(&mut self, plans: &[CopyPlan]) -> Result<u64, PoolError> {
        let mut copied = 0u64;
        let lc = self
            .plan
            .life_cycles()
            .iter()
            .position(|lc| lc.retention == Retention::Full)
            .ok_or_else(|| PoolError::Setup("the plan has no compressed life cycle".into()))?;
        let slot_bytes: Vec<u64> = self.plan.life_cycles()[lc]
            .pools
            .iter()
            .map(|p| p.slot_bytes())
            .collect();
        let len = |t: Tier, pool: usize| -> u64 {
            match t {
                Tier::Gpu => self.device[lc][pool].len() as u64,
                Tier::Host => self.host[lc][pool].len() as u64,
            }
        };
        for copy in plans.iter().flat_map(|p| &p.copies) {
            if copy.pool_group.index() != 0 {
                return Err(PoolError::Copy(format!(
                    "a copy of pool group {}: V4 blocks have one",
                    copy.pool_group.index()
                )));
            }
            for (pool, &n) in slot_bytes.iter().enumerate() {
                for &(s, d) in &copy.pairs {
                    let past = |slot: SlotId, t: Tier| (slot.index() as u64 + 1) * n > len(t, pool);
                    if past(s, copy.src_tier) || past(d, copy.dst_tier) {
                        return Err(PoolError::Copy(format!(
                            "copy {s:?} → {d:?} ({:?} → {:?}) is past the pools",
                            copy.src_tier, copy.dst_tier
                        )));
                    }
                }
            }
        }
        for copy in plans.iter().flat_map(|p| &p.copies) {
            for (pool, &n) in slot_bytes.iter().enumerate() {
                let n = n as usize;
                for &(s, d) in &copy.pairs {
                    let (a, b) = (s.index() * n, d.index() * n);
                    let dev = &self.device[lc][pool];
                    // SAFETY (every branch): the ranges were checked against the pools
                    // above; a slot is never copied onto itself within one tier.
                    match (copy.src_tier, copy.dst_tier) {
                        (Tier::Gpu, Tier::Host) => unsafe {
                            self.gpu.download_raw(
                                dev.ptr() + a as u64,
                                &mut self.host[lc][pool].as_mut_slice()[b..b + n],
                            )
                        }
                        .map_err(copy_err)?,
                        (Tier::Host, Tier::Gpu) => unsafe {
                            self.gpu.upload_raw(
                                dev.ptr() + b as u64,
                                &self.host[lc][pool].as_slice()[a..a + n],
                            )
                        }
                        .map_err(copy_err)?,
                        (Tier::Gpu, Tier::Gpu) if a != b => unsafe {
                            self.gpu
                                .copy_raw(dev.ptr() + b as u64, dev.ptr() + a as u64, n)
                        }
                        .map_err(copy_err)?,
                        (Tier::Host, Tier::Host) if a != b => {
                            self.host[lc][pool].as_mut_slice().copy_within(a..a + n, b);
                        }
                        _ => {}
                    }
                }
            }
            copied += copy.pairs.len() as u64;
        }
        Ok(copied)
    }
}
