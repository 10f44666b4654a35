//! GPU pools built with CUDA virtual memory management: the virtual address range is
//! reserved once for the pool's maximum size; physical memory is created and mapped in
//! granularity-sized chunks (2 MiB on H200) at the end of the mapped prefix. Growing
//! and shrinking never move the base address, so page tables holding addresses and
//! captured CUDA graphs stay valid. Peers get access with `cuMemSetAccess`, per chunk.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::{check, CudaError, Gpu};

/// One pool's reserved range and mapped chunks.
pub struct VmmPool {
    device: usize,
    ctx: Arc<CudaContext>,
    base: u64,
    reserved: usize,
    granularity: usize,
    /// `(handle, size)` of each mapped chunk, in address order.
    chunks: Vec<(sys::CUmemGenericAllocationHandle, usize)>,
    mapped: usize,
    /// Devices with read/write access (this device first).
    access: Vec<i32>,
    /// A plain `cuMemAlloc` allocation of fixed size ([`VmmPool::ipc`]) instead of
    /// reserved and mapped chunks.
    legacy: bool,
}

// SAFETY: the handles and addresses are plain values owned by this pool.
unsafe impl Send for VmmPool {}
// SAFETY: shared access only reads plain values.
unsafe impl Sync for VmmPool {}

impl std::fmt::Debug for VmmPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmPool")
            .field("device", &self.device)
            .field("base", &format_args!("{:#x}", self.base))
            .field("reserved", &self.reserved)
            .field("mapped", &self.mapped)
            .finish()
    }
}

fn location(device: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    }
}

fn prop(device: i32) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is the documented default.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = location(device);
    p
}

/// The allocation granularity of `gpu` (2 MiB on Hopper).
pub(crate) fn granularity(gpu: &Gpu) -> Result<usize, CudaError> {
    gpu.bind()?;
    let mut g = 0usize;
    let p = prop(gpu.ordinal() as i32);
    // SAFETY: valid out-pointer and property struct.
    check(gpu.ordinal(), "cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &p,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    })?;
    Ok(g.max(1))
}

impl VmmPool {
    /// `bytes` zeroed bytes from `cuMemAlloc` (at least one granule): a fixed-size pool
    /// that legacy CUDA IPC can export, so that a transport between processes (UCX's
    /// `cuda_ipc` under NIXL) maps it instead of staging the bytes through the host.
    /// It cannot grow or be shared with peer devices.
    pub fn ipc(gpu: &Gpu, bytes: usize) -> Result<Self, CudaError> {
        let granularity = granularity(gpu)?;
        let size = bytes.max(1).next_multiple_of(granularity);
        let mut base = 0;
        // SAFETY: valid out-pointer; the context is current (granularity bound it).
        let r = unsafe { sys::cuMemAlloc_v2(&mut base, size) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(CudaError::OutOfMemory {
                device: gpu.ordinal(),
                bytes: size as u64,
                what: "an IPC-capable pool",
            });
        }
        check(gpu.ordinal(), "cuMemAlloc", r)?;
        let pool = VmmPool {
            device: gpu.ordinal(),
            ctx: gpu.context().clone(),
            base,
            reserved: size,
            granularity,
            chunks: Vec::new(),
            mapped: size,
            access: vec![gpu.ordinal() as i32],
            legacy: true,
        };
        // Fresh memory is not guaranteed to be zero; the memset may run on the legacy
        // stream, which our streams do not wait for. (Dropped on failure: freed.)
        // SAFETY: `size` bytes allocated above.
        check(pool.device, "cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(base, 0, size)
        })?;
        pool.ctx
            .synchronize()
            .map_err(|e| super::driver_error(pool.device, "cuCtxSynchronize", e))?;
        Ok(pool)
    }

    /// Reserves `max_bytes` of address space on `gpu` and maps `initial_bytes`.
    pub fn new(gpu: &Gpu, max_bytes: usize, initial_bytes: usize) -> Result<Self, CudaError> {
        let granularity = granularity(gpu)?;
        let reserved = max_bytes.max(1).next_multiple_of(granularity);
        let mut base = 0;
        // SAFETY: valid out-pointer; the context is current (granularity bound it).
        check(gpu.ordinal(), "cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, reserved, granularity, 0, 0)
        })?;
        let mut pool = VmmPool {
            device: gpu.ordinal(),
            ctx: gpu.context().clone(),
            base,
            reserved,
            granularity,
            chunks: Vec::new(),
            mapped: 0,
            access: vec![gpu.ordinal() as i32],
            legacy: false,
        };
        pool.grow_to(initial_bytes)?;
        Ok(pool)
    }

    /// The fixed base address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Bytes mapped (usable from `base`).
    pub fn mapped(&self) -> usize {
        self.mapped
    }

    /// Bytes of address space reserved.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// Mapping granularity.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// Size of the physical chunks growth maps: the granularity, or a multiple of it
    /// for very large pools so that a pool has at most ~1024 chunks (shrinking releases
    /// whole chunks).
    pub fn chunk_bytes(&self) -> usize {
        self.granularity * (self.reserved / (self.granularity * 1024)).max(1)
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| super::driver_error(self.device, "cuCtxSetCurrent", e))
    }

    fn set_access(&self, ptr: u64, size: usize, devices: &[i32]) -> Result<(), CudaError> {
        let descs: Vec<sys::CUmemAccessDesc> = devices
            .iter()
            .map(|&d| sys::CUmemAccessDesc {
                location: location(d),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        // SAFETY: `ptr .. ptr + size` is mapped; the descriptors are valid.
        check(self.device, "cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len())
        })
    }

    /// Maps physical memory until at least `bytes` are usable. All-or-nothing: on
    /// failure the pool is unchanged.
    pub fn grow_to(&mut self, bytes: usize) -> Result<(), CudaError> {
        if bytes <= self.mapped {
            return Ok(());
        }
        if bytes > self.reserved || self.legacy {
            return Err(CudaError::Invalid {
                device: self.device,
                what: if self.legacy {
                    format!(
                        "an IPC-capable pool has a fixed size ({} bytes): it cannot grow to {bytes}",
                        self.reserved
                    )
                } else {
                    format!(
                        "pool growth to {bytes} bytes exceeds its reserved range of {} bytes",
                        self.reserved
                    )
                },
            });
        }
        self.bind()?;
        let (old_chunks, old_mapped) = (self.chunks.len(), self.mapped);
        let target = bytes.next_multiple_of(self.granularity).min(self.reserved);
        let chunk = self.chunk_bytes();
        while self.mapped < target {
            let size = chunk.min(target - self.mapped);
            if let Err(e) = self.map_chunk(size) {
                // Roll back to the size before this call.
                let _ = self.shrink_chunks(old_chunks);
                debug_assert_eq!(self.mapped, old_mapped);
                return Err(e);
            }
        }
        Ok(())
    }

    fn map_chunk(&mut self, size: usize) -> Result<(), CudaError> {
        let mut handle = 0;
        let p = prop(self.device as i32);
        // SAFETY: valid out-pointer and property struct.
        let r = unsafe { sys::cuMemCreate(&mut handle, size, &p, 0) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(CudaError::OutOfMemory {
                device: self.device,
                bytes: size as u64,
                what: "a VMM pool chunk",
            });
        }
        check(self.device, "cuMemCreate", r)?;
        let at = self.base + self.mapped as u64;
        // SAFETY: `at .. at + size` lies inside the reserved, unmapped range.
        let mapped = check(self.device, "cuMemMap", unsafe {
            sys::cuMemMap(at, size, 0, handle, 0)
        })
        .and_then(|()| self.set_access(at, size, &self.access))
        // Fresh physical memory is not guaranteed to be zero.
        // SAFETY: mapped with read/write access for this device.
        .and_then(|()| {
            check(self.device, "cuMemsetD8", unsafe {
                sys::cuMemsetD8_v2(at, 0, size)
            })
        })
        // The memset may run on the legacy stream, which our streams do not wait for.
        .and_then(|()| {
            self.ctx
                .synchronize()
                .map_err(|e| super::driver_error(self.device, "cuCtxSynchronize", e))
        });
        if let Err(e) = mapped {
            // SAFETY: undo what succeeded; the handle is ours.
            unsafe {
                let _ = sys::cuMemUnmap(at, size);
                let _ = sys::cuMemRelease(handle);
            }
            return Err(e);
        }
        self.chunks.push((handle, size));
        self.mapped += size;
        Ok(())
    }

    /// Unmaps chunks from the end until `keep` chunks remain.
    fn shrink_chunks(&mut self, keep: usize) -> Result<(), CudaError> {
        while self.chunks.len() > keep {
            let (handle, size) = *self.chunks.last().expect("invariant: len > keep");
            let at = self.base + (self.mapped - size) as u64;
            // SAFETY: this chunk is mapped at `at`.
            check(self.device, "cuMemUnmap", unsafe {
                sys::cuMemUnmap(at, size)
            })?;
            // SAFETY: unmapped above; the handle is ours.
            check(self.device, "cuMemRelease", unsafe {
                sys::cuMemRelease(handle)
            })?;
            self.chunks.pop();
            self.mapped -= size;
        }
        Ok(())
    }

    /// Unmaps whole chunks from the end while at least `bytes` stay mapped. The caller
    /// guarantees no queued work touches the released range.
    pub fn shrink_to(&mut self, bytes: usize) -> Result<(), CudaError> {
        if self.legacy {
            // A fixed allocation keeps its size.
            return Ok(());
        }
        self.bind()?;
        let mut keep = self.chunks.len();
        let mut mapped = self.mapped;
        while keep > 0 && mapped - self.chunks[keep - 1].1 >= bytes {
            mapped -= self.chunks[keep - 1].1;
            keep -= 1;
        }
        self.shrink_chunks(keep)
    }

    /// Gives device `peer` read/write access to the pool (now and after growth).
    pub fn grant_peer(&mut self, peer: usize) -> Result<(), CudaError> {
        let p = peer as i32;
        if self.access.contains(&p) {
            return Ok(());
        }
        if self.legacy {
            return Err(CudaError::Invalid {
                device: self.device,
                what: format!(
                    "an IPC-capable pool cannot be shared with device {peer}: use VMM pools for tensor parallelism"
                ),
            });
        }
        self.bind()?;
        let mut at = self.base;
        for &(_, size) in &self.chunks {
            self.set_access(at, size, &[p])?;
            at += size as u64;
        }
        self.access.push(p);
        Ok(())
    }
}

impl Drop for VmmPool {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        // Work still queued on this GPU may read or write the pool (a copy plan, the
        // kernels of a step whose forward failed midway, a shutdown right after a step),
        // and `cuMemUnmap` does not wait for it (nor is `cuMemFree` documented to): unmap
        // only after it has run, or those kernels fault on freed addresses and the error
        // sticks to the context for everything after. `cuCtxSynchronize` waits for every
        // stream of the context, whoever queued the work. An error (the context already
        // broken) leaves nothing to wait for.
        let _ = self.ctx.synchronize();
        if self.legacy {
            // SAFETY: allocated by `ipc` and not freed before.
            let _ = unsafe { sys::cuMemFree_v2(self.base) };
            return;
        }
        // SAFETY: every chunk was mapped by this pool; the range was reserved by it.
        unsafe {
            let mut at = self.base;
            for &(handle, size) in &self.chunks {
                let _ = sys::cuMemUnmap(at, size);
                let _ = sys::cuMemRelease(handle);
                at += size as u64;
            }
            let _ = sys::cuMemAddressFree(self.base, self.reserved);
        }
    }
}
