//! Raw device buffers and pinned host memory. Kernels take plain 64-bit device
//! addresses, so these types own memory and hand out addresses; they free it on drop.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use half::bf16;

use super::{check, CudaError, Gpu};

/// Plain data that can be copied to and from the device byte for byte.
///
/// # Safety
/// Implementors have no padding, no pointers and every bit pattern is valid.
pub unsafe trait Plain: Copy + Default + 'static {}

// SAFETY: primitive types without padding.
unsafe impl Plain for u8 {}
// SAFETY: as above.
unsafe impl Plain for u16 {}
// SAFETY: as above.
unsafe impl Plain for i32 {}
// SAFETY: as above.
unsafe impl Plain for u32 {}
// SAFETY: as above.
unsafe impl Plain for i64 {}
// SAFETY: as above.
unsafe impl Plain for u64 {}
// SAFETY: as above.
unsafe impl Plain for f32 {}
// SAFETY: a transparent u16.
unsafe impl Plain for bf16 {}

/// Device memory from `cuMemAlloc` (scratch and metadata mirrors).
pub struct DeviceBuffer {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} B)", self.ptr, self.bytes)
    }
}

impl DeviceBuffer {
    /// `bytes` zeroed bytes on `gpu` (an empty buffer has address 0).
    pub fn zeroed(gpu: &Gpu, bytes: usize, what: &'static str) -> Result<Self, CudaError> {
        gpu.bind()?;
        let mut ptr = 0;
        if bytes > 0 {
            // SAFETY: valid out-pointer; the context is current.
            let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) };
            if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(CudaError::OutOfMemory {
                    device: gpu.ordinal(),
                    bytes: bytes as u64,
                    what,
                });
            }
            check(gpu.ordinal(), "cuMemAlloc", r)?;
            // SAFETY: just allocated `bytes` bytes. The memset may run asynchronously on
            // the legacy stream, which our non-blocking streams do not wait for: wait here.
            check(gpu.ordinal(), "cuMemsetD8", unsafe {
                sys::cuMemsetD8_v2(ptr, 0, bytes)
            })?;
            gpu.context()
                .synchronize()
                .map_err(|e| super::driver_error(gpu.ordinal(), "cuCtxSynchronize", e))?;
        }
        Ok(DeviceBuffer {
            ptr,
            bytes,
            ctx: gpu.context().clone(),
        })
    }

    /// A buffer with `src` copied in (synchronously staged on the compute stream).
    pub fn from_slice<T: super::Plain>(
        gpu: &Gpu,
        src: &[T],
        what: &'static str,
    ) -> Result<Self, CudaError> {
        let b = Self::zeroed(gpu, std::mem::size_of_val(src), what)?;
        gpu.upload(&b, src)?;
        Ok(b)
    }

    /// Grows `slot` to at least `bytes` (contents are not kept).
    pub fn ensure(
        slot: &mut Option<DeviceBuffer>,
        gpu: &Gpu,
        bytes: usize,
        what: &'static str,
    ) -> Result<(), CudaError> {
        if slot.as_ref().is_none_or(|b| b.bytes < bytes) {
            // Work queued on the old buffer must finish before it is freed.
            gpu.synchronize()?;
            *slot = None;
            *slot = Some(Self::zeroed(gpu, bytes.next_power_of_two().max(256), what)?);
        }
        Ok(())
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr != 0 && self.ctx.bind_to_thread().is_ok() {
            // Kernels still queued may use the buffer, and `cuMemFree` only "may perform
            // implicit synchronization" (the driver API's words): wait for the context
            // first, as `VmmPool`'s drop does. Buffers are allocated at setup, so this
            // runs at teardown, not per step.
            let _ = self.ctx.synchronize();
            // SAFETY: allocated by cuMemAlloc in this context and not freed before.
            // Errors (a context already torn down) leave nothing to recover.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Page-locked host memory, mapped into the device address space and readable by the
/// CPU at full speed (allocated without the write-combined flag).
pub struct PinnedHost {
    host: *mut u8,
    dev: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the memory is owned exclusively by this value; access goes through &/&mut.
unsafe impl Send for PinnedHost {}
// SAFETY: shared access is read-only.
unsafe impl Sync for PinnedHost {}

impl std::fmt::Debug for PinnedHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedHost({:#x}, {} B)", self.dev, self.bytes)
    }
}

impl PinnedHost {
    /// `bytes` zeroed bytes of pinned, device-mapped host memory.
    pub fn zeroed(gpu: &Gpu, bytes: usize, what: &'static str) -> Result<Self, CudaError> {
        gpu.bind()?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut dev = 0;
        if bytes > 0 {
            let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
            // SAFETY: valid out-pointer; the context is current.
            let r = unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) };
            if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(CudaError::OutOfMemory {
                    device: gpu.ordinal(),
                    bytes: bytes as u64,
                    what,
                });
            }
            check(gpu.ordinal(), "cuMemHostAlloc", r)?;
            // SAFETY: `host` points to `bytes` writable bytes.
            unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, bytes) };
            // SAFETY: `host` was allocated with DEVICEMAP.
            check(gpu.ordinal(), "cuMemHostGetDevicePointer", unsafe {
                sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0)
            })?;
        }
        Ok(PinnedHost {
            host: host.cast(),
            dev,
            bytes,
            ctx: gpu.context().clone(),
        })
    }

    /// The device address of the mapping.
    pub fn dev_ptr(&self) -> u64 {
        self.dev
    }

    /// The host address.
    pub fn host_ptr(&self) -> u64 {
        self.host as u64
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The bytes (callers synchronize with device work that writes them first).
    pub fn as_slice(&self) -> &[u8] {
        if self.bytes == 0 {
            return &[];
        }
        // SAFETY: `host` points to `bytes` initialized bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.host, self.bytes) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.bytes == 0 {
            return &mut [];
        }
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.host, self.bytes) }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if !self.host.is_null() && self.ctx.bind_to_thread().is_ok() {
            // Copies and kernels still queued may read or write the mapped memory (the
            // offload tier, read-back staging), and `cuMemFreeHost` does not promise to
            // wait for them: wait for the context first.
            let _ = self.ctx.synchronize();
            // SAFETY: allocated by cuMemHostAlloc and not freed before.
            let _ = unsafe { sys::cuMemFreeHost(self.host.cast()) };
        }
    }
}
