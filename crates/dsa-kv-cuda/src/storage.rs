//! [`CudaStorage`]: the pools of one device. GPU-tier pools are [`VmmPool`]s, host-tier
//! pools are [`PinnedHost`] buffers mapped into the device address space, so one
//! batched-copy kernel moves slots in every direction (GPU↔GPU, GPU↔host).
//!
//! A copy plan runs on the copy stream after everything already queued on the compute
//! stream (an event orders them), and the compute stream waits for the copies before its
//! next work; the plan's fence is the event recorded after the copies.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent};

use super::{check, driver_error, CudaError, DeviceBuffer, Gpu, PinnedHost, VmmPool};
use dsa_kv_core::ids::{Fence, PoolGroupId, SlotId, Tier};
use dsa_kv_core::layout::PoolPlan;
use dsa_kv_core::ops::CopyPlan;
use dsa_kv_core::storage::{check_plan_slots, HostStorage, KvStorage, StorageError};

/// Events kept for fence queries (older ones are dropped).
const FENCE_HISTORY: usize = 64;

/// The pools of one device. See the module docs.
pub struct CudaStorage {
    gpu: Arc<Gpu>,
    /// Bytes per slot, `[group][pool]`.
    slot_bytes: Vec<Vec<u64>>,
    /// Slots per group, `[tier][group]`.
    slots: [Vec<u32>; 2],
    gpu_pools: Vec<Vec<VmmPool>>,
    host_pools: Vec<Vec<PinnedHost>>,
    tasks: Option<DeviceBuffer>,
    fences: VecDeque<(Fence, CudaEvent)>,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStorage")
            .field("device", &self.gpu.ordinal())
            .field("slots", &self.slots)
            .finish()
    }
}

/// How a device's GPU pools are allocated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GpuPoolAlloc {
    /// VMM (`cuMemCreate` chunks mapped into a reserved range): pools can grow in place
    /// and be shared with peer devices. The default.
    #[default]
    Vmm,
    /// `cuMemAlloc`, fixed size: exportable by legacy CUDA IPC, so a KV transport
    /// between processes on one host maps the pools directly (UCX's `cuda_ipc` under
    /// NIXL) instead of staging the bytes through host memory. No growth, no peer
    /// sharing.
    Ipc,
}

impl CudaStorage {
    /// Zeroed pools for `plan` on `gpu` (`host_slots` empty: no host tier). With
    /// [`GpuPoolAlloc::Vmm`] each GPU pool reserves `reserve_factor ×` its initial size
    /// of address space so it can grow in place.
    pub fn new(
        gpu: Arc<Gpu>,
        plan: &PoolPlan,
        gpu_slots: &[u32],
        host_slots: &[u32],
        reserve_factor: usize,
        alloc: GpuPoolAlloc,
    ) -> Result<Self, StorageError> {
        let groups = plan.pool_groups().len();
        let slot_bytes: Vec<Vec<u64>> = plan
            .pool_groups()
            .iter()
            .map(|g| g.pools.iter().map(|p| p.slot_bytes).collect())
            .collect();
        for (tier, counts) in [(Tier::Gpu, gpu_slots), (Tier::Host, host_slots)] {
            if counts.len() != groups && !(tier == Tier::Host && counts.is_empty()) {
                return Err(StorageError::Geometry {
                    tier,
                    got: counts.to_vec(),
                    groups,
                });
            }
        }
        let mut gpu_pools = Vec::with_capacity(groups);
        let mut host_pools = Vec::new();
        for (g, sizes) in slot_bytes.iter().enumerate() {
            let mut pools = Vec::with_capacity(sizes.len());
            for &sb in sizes {
                let bytes = (sb * u64::from(gpu_slots[g])) as usize;
                pools.push(match alloc {
                    GpuPoolAlloc::Vmm => VmmPool::new(&gpu, bytes * reserve_factor.max(1), bytes)?,
                    GpuPoolAlloc::Ipc => VmmPool::ipc(&gpu, bytes)?,
                });
            }
            gpu_pools.push(pools);
            if !host_slots.is_empty() {
                let mut pools = Vec::with_capacity(sizes.len());
                for &sb in sizes {
                    let bytes = (sb * u64::from(host_slots[g])) as usize;
                    pools.push(PinnedHost::zeroed(&gpu, bytes, "the host tier")?);
                }
                host_pools.push(pools);
            }
        }
        Ok(CudaStorage {
            gpu,
            slot_bytes,
            slots: [gpu_slots.to_vec(), host_slots.to_vec()],
            gpu_pools,
            host_pools,
            tasks: None,
            fences: VecDeque::new(),
        })
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Device address of a pool's first byte (host tier: its device mapping).
    pub fn pool_ptr(&self, tier: Tier, group: PoolGroupId, pool: u16) -> u64 {
        match tier {
            Tier::Gpu => self.gpu_pools[group.index()][pool as usize].base(),
            Tier::Host => self.host_pools[group.index()][pool as usize].dev_ptr(),
        }
    }

    /// Slots per pool group, `[tier][group]` (a tier without counts does not exist).
    pub fn slots(&self) -> &[Vec<u32>; 2] {
        &self.slots
    }

    /// Host address of a host-tier pool (for registration with a transport).
    pub fn host_pool_ptr(&self, group: PoolGroupId, pool: u16) -> u64 {
        self.host_pools[group.index()][pool as usize].host_ptr()
    }

    /// Bytes of a pool in use (slots × slot size).
    pub fn pool_len(&self, tier: Tier, group: PoolGroupId, pool: u16) -> u64 {
        self.slot_bytes[group.index()][pool as usize]
            * u64::from(
                self.slots[tier.index()]
                    .get(group.index())
                    .copied()
                    .unwrap_or(0),
            )
    }

    /// A GPU pool (to grow, shrink or share with peers).
    pub fn gpu_pool_mut(&mut self, group: PoolGroupId, pool: u16) -> &mut VmmPool {
        &mut self.gpu_pools[group.index()][pool as usize]
    }

    /// Gives device `peer` access to every GPU pool.
    pub fn grant_peer(&mut self, peer: usize) -> Result<(), CudaError> {
        for p in self.gpu_pools.iter_mut().flatten() {
            p.grant_peer(peer)?;
        }
        Ok(())
    }

    /// Whether the copies of the plan with `fence` have completed (fences older than the
    /// kept history count as complete).
    pub fn fence_complete(&self, fence: Fence) -> bool {
        self.fences
            .iter()
            .find(|(f, _)| *f == fence)
            .is_none_or(|(_, e)| e.is_complete())
    }

    /// Copies the GPU-tier bytes of `slots` (every pool of `group`) into the same
    /// offsets of `mirror`, a host copy with the same geometry, and waits.
    pub fn read_slots_into(
        &self,
        group: PoolGroupId,
        slots: &[(SlotId, SlotId)],
        mirror: &mut HostStorage,
    ) -> Result<(), CudaError> {
        for (p, &sb) in self.slot_bytes[group.index()].iter().enumerate() {
            let base = self.gpu_pools[group.index()][p].base();
            let dst = mirror.pool_mut(Tier::Gpu, group, p as u16);
            for &(s, into) in slots {
                if s.get() >= self.slots[Tier::Gpu.index()][group.index()] {
                    return Err(CudaError::Invalid {
                        device: self.gpu.ordinal(),
                        what: format!("slot {s} is outside pool group {group}"),
                    });
                }
                let off = s.index() * sb as usize;
                let at = into.index() * sb as usize;
                let Some(chunk) = dst.get_mut(at..at + sb as usize) else {
                    return Err(CudaError::Invalid {
                        device: self.gpu.ordinal(),
                        what: format!("mirror slot {into} is outside the read-back mirror"),
                    });
                };
                self.gpu.bind()?;
                // SAFETY: the slot lies inside the mapped pool (slot counts match).
                check(self.gpu.ordinal(), "cuMemcpyDtoHAsync", unsafe {
                    sys::cuMemcpyDtoHAsync_v2(
                        chunk.as_mut_ptr().cast(),
                        base + off as u64,
                        sb as usize,
                        self.gpu.compute().cu_stream(),
                    )
                })?;
            }
        }
        self.gpu
            .compute()
            .synchronize()
            .map_err(|e| driver_error(self.gpu.ordinal(), "cuStreamSynchronize", e))
    }

    /// Reads a whole pool back in pieces of at most `piece` bytes, handing each to `f`
    /// in order (waits for queued work; host memory stays at one piece).
    pub fn read_pool_pieces(
        &self,
        tier: Tier,
        group: PoolGroupId,
        pool: u16,
        piece: usize,
        mut f: impl FnMut(&[u8]),
    ) -> Result<(), CudaError> {
        let len = self.pool_len(tier, group, pool) as usize;
        self.gpu.synchronize()?;
        match tier {
            Tier::Host => {
                let bytes = &self.host_pools[group.index()][pool as usize].as_slice()[..len];
                bytes.chunks(piece.max(1)).for_each(f);
            }
            Tier::Gpu => {
                let base = self.pool_ptr(tier, group, pool);
                let mut buf = vec![0u8; piece.max(1).min(len)];
                let mut at = 0;
                while at < len {
                    let n = buf.len().min(len - at);
                    // SAFETY: `at + n <= len` bytes are mapped from the pool's base.
                    unsafe { self.gpu.download_raw(base + at as u64, &mut buf[..n])? };
                    f(&buf[..n]);
                    at += n;
                }
            }
        }
        Ok(())
    }

    /// The bytes of a whole pool, read back (waits for queued work).
    pub fn read_pool(
        &self,
        tier: Tier,
        group: PoolGroupId,
        pool: u16,
    ) -> Result<Vec<u8>, CudaError> {
        let mut out = Vec::with_capacity(self.pool_len(tier, group, pool) as usize);
        self.read_pool_pieces(tier, group, pool, 64 << 20, |b| out.extend_from_slice(b))?;
        Ok(out)
    }

    /// Queues the copies of `plan` on the copy stream (see the module docs).
    fn run(&mut self, plan: &CopyPlan) -> Result<(), CudaError> {
        let dev = self.gpu.ordinal();
        // Split each group copy into waves of independent pairs: within one launch the
        // tasks run concurrently, so a pair that reads or writes a slot an earlier pair
        // of the wave writes (or writes what it reads) starts a new wave.
        struct Launch {
            group: usize,
            pool: usize,
            first: usize,
            tasks: usize,
        }
        let mut addrs: Vec<u64> = Vec::new(); // dst[0..n] then src[0..n] per launch
        let mut launches = Vec::new();
        for c in &plan.copies {
            let g = c.pool_group.index();
            let mut waves: Vec<Vec<(SlotId, SlotId)>> = Vec::new();
            let (mut reads, mut writes) = (HashSet::new(), HashSet::new());
            for &(s, d) in &c.pairs {
                let (rs, wd) = ((c.src_tier, s), (c.dst_tier, d));
                let conflict = writes.contains(&rs) || writes.contains(&wd) || reads.contains(&wd);
                if conflict || waves.is_empty() {
                    waves.push(Vec::new());
                    reads.clear();
                    writes.clear();
                }
                reads.insert(rs);
                writes.insert(wd);
                waves
                    .last_mut()
                    .expect("invariant: a wave exists")
                    .push((s, d));
            }
            for wave in &waves {
                for (p, &sb) in self.slot_bytes[g].iter().enumerate() {
                    let src = self.pool_ptr(c.src_tier, c.pool_group, p as u16);
                    let dst = self.pool_ptr(c.dst_tier, c.pool_group, p as u16);
                    let first = addrs.len();
                    addrs.extend(wave.iter().map(|&(_, d)| dst + d.index() as u64 * sb));
                    addrs.extend(wave.iter().map(|&(s, _)| src + s.index() as u64 * sb));
                    launches.push(Launch {
                        group: g,
                        pool: p,
                        first,
                        tasks: wave.len(),
                    });
                }
            }
        }
        if launches.is_empty() {
            return Ok(());
        }
        DeviceBuffer::ensure(&mut self.tasks, &self.gpu, addrs.len() * 8, "copy tasks")?;
        let tasks = self.tasks.as_ref().expect("invariant: ensured above").ptr();
        let copy = self.gpu.copy_stream();
        let drv = |what| move |e| driver_error(dev, what, e);
        // Copies start after the work already queued on the compute stream.
        let ready = self
            .gpu
            .compute()
            .record_event(None)
            .map_err(drv("cuEventRecord"))?;
        copy.wait(&ready).map_err(drv("cuStreamWaitEvent"))?;
        self.gpu.bind()?;
        // SAFETY: the task buffer holds `addrs.len()` u64; pageable source is staged.
        check(dev, "cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                tasks,
                addrs.as_ptr().cast(),
                addrs.len() * 8,
                copy.cu_stream(),
            )
        })?;
        for l in &launches {
            let sb = self.slot_bytes[l.group][l.pool];
            let d = tasks + l.first as u64 * 8;
            let s = d + l.tasks as u64 * 8;
            // SAFETY: every address is a slot of a pool of this storage (slots checked
            // by the caller); destinations within a wave are distinct and never sources.
            unsafe {
                self.gpu
                    .kernels()
                    .batched_copy(copy, dev, d, s, l.tasks, sb)?
            };
        }
        let done = copy.record_event(None).map_err(drv("cuEventRecord"))?;
        self.gpu
            .compute()
            .wait(&done)
            .map_err(drv("cuStreamWaitEvent"))?;
        self.fences.push_back((plan.fence, done));
        while self.fences.len() > FENCE_HISTORY {
            self.fences.pop_front();
        }
        Ok(())
    }
}

impl KvStorage for CudaStorage {
    fn execute(&mut self, plan: &CopyPlan) -> Result<(), StorageError> {
        check_plan_slots(&self.slots, plan)?;
        Ok(self.run(plan)?)
    }
}
