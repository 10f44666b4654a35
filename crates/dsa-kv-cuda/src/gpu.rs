//! One device ([`Gpu`]: context, streams, the compiled kernels), the kernel sources and
//! their compilation, the driver checks, and [`CudaError`].

use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use crate::buffers::{DeviceBuffer, Plain};
use crate::kernels::Kernels;

/// The architecture the kernels are compiled for (H100 / H200).
pub const ARCH: &str = "sm_90a";

/// The kernel sources, in compilation order.
pub const KERNEL_SOURCES: [(&str, &str); 8] = [
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
    ("quant.cu", include_str!("../../../kernels/quant.cu")),
    ("guard.cu", include_str!("../../../kernels/guard.cu")),
    ("indexer.cu", include_str!("../../../kernels/indexer.cu")),
    ("mla.cu", include_str!("../../../kernels/mla.cu")),
    ("topk.cu", include_str!("../../../kernels/topk.cu")),
    ("slots.cu", include_str!("../../../kernels/slots.cu")),
    ("copy.cu", include_str!("../../../kernels/copy.cu")),
];

/// A CUDA failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// No usable CUDA device (no driver library, no device, or the wrong architecture).
    #[error("no CUDA device: {reason}")]
    NoDevice {
        /// Why.
        reason: String,
    },
    /// A driver call failed.
    #[error("CUDA device {device}: {what} failed: {code}")]
    Driver {
        /// Device ordinal.
        device: usize,
        /// The call.
        what: &'static str,
        /// The driver's error name.
        code: String,
    },
    /// Device memory ran out.
    #[error("CUDA device {device}: out of memory allocating {bytes} bytes for {what}: lower the KV budget")]
    OutOfMemory {
        /// Device ordinal.
        device: usize,
        /// Bytes requested.
        bytes: u64,
        /// What the memory was for.
        what: &'static str,
    },
    /// NVRTC rejected the kernels.
    #[error("NVRTC could not compile the kernels for {arch}: {log}")]
    Compile {
        /// Target architecture.
        arch: &'static str,
        /// Compiler log.
        log: String,
    },
    /// A request the backend cannot serve (sizes, alignment, ranges).
    #[error("CUDA device {device}: {what}")]
    Invalid {
        /// Device ordinal.
        device: usize,
        /// What was wrong and what to do.
        what: String,
    },
}

impl From<CudaError> for dsa_kv_core::storage::BackendError {
    fn from(e: CudaError) -> Self {
        dsa_kv_core::storage::BackendError::new(e)
    }
}

impl From<CudaError> for dsa_kv_core::storage::StorageError {
    fn from(e: CudaError) -> Self {
        dsa_kv_core::storage::StorageError::Backend(e.into())
    }
}

/// Whether the CUDA driver and NVRTC libraries can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only probes whether the shared libraries can be opened.
    unsafe { sys::is_culib_present() && cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles the kernels with NVRTC (needs only the NVRTC library, no GPU) and returns
/// the PTX text. Devices compile once per process; this is for checks and tools.
pub fn compile_kernels() -> Result<String, CudaError> {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoDevice {
            reason: "the NVRTC library cannot be loaded on this machine".into(),
        });
    }
    Ok(ptx()?.to_src())
}

fn require_driver() -> Result<(), CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDevice {
            reason: "the CUDA driver library (libcuda) or NVRTC cannot be loaded on this machine; \
                     use the host backend"
                .into(),
        });
    }
    Ok(())
}

/// Number of CUDA devices (0 when there is no driver).
pub fn device_count() -> Result<usize, CudaError> {
    require_driver()?;
    let drv = |what| {
        move |e: cudarc::driver::DriverError| CudaError::NoDevice {
            reason: format!("{what}: {e:?}"),
        }
    };
    cudarc::driver::result::init().map_err(drv("cuInit"))?;
    let n = CudaContext::device_count().map_err(drv("cuDeviceGetCount"))?;
    Ok(n.max(0) as usize)
}

/// Checks a raw driver result.
pub(crate) fn check(device: usize, what: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    r.result().map_err(|e| driver_error(device, what, e))
}

pub fn driver_error(
    device: usize,
    what: &'static str,
    e: cudarc::driver::DriverError,
) -> CudaError {
    CudaError::Driver {
        device,
        what,
        code: format!("{e:?}"),
    }
}

/// The PTX of all kernels, compiled once per process.
fn ptx() -> Result<Ptx, CudaError> {
    static PTX: OnceLock<Result<Ptx, CudaError>> = OnceLock::new();
    PTX.get_or_init(|| {
        let src: String = KERNEL_SOURCES
            .iter()
            .map(|(name, text)| format!("// ---- {name}\n{text}\n"))
            .collect();
        compile(src)
    })
    .clone()
}

/// Compiles `src` (which may use `kernels/common.cuh`'s helpers: prepend
/// [`KERNEL_SOURCES`]`[0]`) for [`ARCH`] with the exact-IEEE options of the crate's kernels.
pub fn compile(src: String) -> Result<Ptx, CudaError> {
    let opts = CompileOptions {
        arch: Some(ARCH),
        // Exact IEEE arithmetic: the kernels must match the host reference bit for bit.
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        ..Default::default()
    };
    compile_ptx_with_opts(src, opts).map_err(|e| CudaError::Compile {
        arch: ARCH,
        log: format!("{e:?}"),
    })
}

/// One GPU: its context, a compute stream and a copy stream, and the compiled kernels.
pub struct Gpu {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    kernels: Kernels,
    _module: Arc<CudaModule>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl Gpu {
    /// Opens device `ordinal`: creates the context and streams and loads the kernels
    /// (compiled by NVRTC on first use in the process).
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice {
                reason: format!(
                    "device {ordinal} was requested but {count} CUDA device(s) are present"
                ),
            });
        }
        let drv = |what| move |e| driver_error(ordinal, what, e);
        let ctx = CudaContext::new(ordinal).map_err(drv("cuCtxCreate"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("cuDeviceGetAttribute"))?;
        if (major, minor) != (9, 0) {
            return Err(CudaError::NoDevice {
                reason: format!(
                    "device {ordinal} is sm_{major}{minor}; the kernels are built for {ARCH} (H100/H200)"
                ),
            });
        }
        let compute = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        let copy = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        let module = ctx.load_module(ptx()?).map_err(drv("cuModuleLoadData"))?;
        let load = |name: &'static str| -> Result<CudaFunction, CudaError> {
            module
                .load_function(name)
                .map_err(|e| driver_error(ordinal, name, e))
        };
        let kernels = Kernels::load(load)?;
        Ok(Arc::new(Gpu {
            ordinal,
            ctx,
            compute,
            copy,
            kernels,
            _module: module,
        }))
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Device name.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown".into())
    }

    /// The compute stream (kernels, metadata uploads).
    pub fn compute(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// The copy stream (copy plans: offload, onboarding, copy-on-resume).
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// The compiled kernels.
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes this device's context current on the calling thread (needed before raw
    /// driver calls; device actors call it at the start of every message).
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error(self.ordinal, "cuCtxSetCurrent", e))
    }

    /// Waits for all work on both streams.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let e = |e| driver_error(self.ordinal, "cuStreamSynchronize", e);
        self.compute.synchronize().map_err(e)?;
        self.copy.synchronize().map_err(e)
    }

    /// Device memory `(free, total)` in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx
            .mem_get_info()
            .map_err(|e| driver_error(self.ordinal, "cuMemGetInfo", e))
    }

    /// Whether this device can map `peer`'s memory.
    pub fn can_access_peer(&self, peer: &Gpu) -> Result<bool, CudaError> {
        let mut ok = 0;
        // SAFETY: plain query with valid out-pointer and device handles.
        check(self.ordinal, "cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut ok, self.ctx.cu_device(), peer.ctx.cu_device())
        })?;
        Ok(ok != 0)
    }

    /// Copies `src` into device memory at `dst` (async on the compute stream; `src` may
    /// be reused when this returns).
    pub fn upload<T: Plain>(&self, dst: &DeviceBuffer, src: &[T]) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(src);
        if bytes > dst.len() {
            return Err(CudaError::Invalid {
                device: self.ordinal,
                what: format!("upload of {bytes} bytes into a {}-byte buffer", dst.len()),
            });
        }
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` holds at least `bytes` bytes; `src` is a live slice of plain data;
        // a copy from pageable memory returns once the source has been staged.
        check(self.ordinal, "cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.ptr(),
                src.as_ptr().cast(),
                bytes,
                self.compute.cu_stream(),
            )
        })
    }

    /// Copies `src` to device address `dst` (async on the compute stream; `src` may be
    /// reused when this returns).
    ///
    /// # Safety
    /// `dst .. dst + size_of_val(src)` must be writable device memory of this context.
    pub unsafe fn upload_raw<T: Plain>(&self, dst: u64, src: &[T]) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(src);
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller's contract; a copy from pageable memory returns once the
        // source has been staged.
        check(self.ordinal, "cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), bytes, self.compute.cu_stream())
        })
    }

    /// Copies `bytes` bytes between device addresses of this context (async on the
    /// compute stream).
    ///
    /// # Safety
    /// Both ranges must be device memory of this context and must not overlap.
    pub unsafe fn copy_raw(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller's contract.
        check(self.ordinal, "cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.compute.cu_stream())
        })
    }

    /// Copies `dst.len()` elements from device address `src` into `dst` and waits.
    ///
    /// # Safety
    /// `src .. src + size_of_val(dst)` must be readable device memory of this context.
    pub unsafe fn download_raw<T: Plain>(&self, src: u64, dst: &mut [T]) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(dst);
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        check(self.ordinal, "cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr().cast(),
                src,
                bytes,
                self.compute.cu_stream(),
            )
        })?;
        self.compute
            .synchronize()
            .map_err(|e| driver_error(self.ordinal, "cuStreamSynchronize", e))
    }

    /// Copies the first `dst.len()` elements of `src` to the host and waits for them.
    pub fn download<T: Plain>(&self, src: &DeviceBuffer, dst: &mut [T]) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(dst);
        if bytes > src.len() {
            return Err(CudaError::Invalid {
                device: self.ordinal,
                what: format!("download of {bytes} bytes from a {}-byte buffer", src.len()),
            });
        }
        // SAFETY: bounds checked above; the buffer belongs to this device.
        unsafe { self.download_raw(src.ptr(), dst) }
    }

    /// Zero-fills `bytes` bytes at device address `ptr` on the compute stream.
    ///
    /// # Safety
    /// The range must be writable device memory of this context.
    pub unsafe fn memset_raw(&self, ptr: u64, bytes: usize, value: u8) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        check(self.ordinal, "cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(ptr, value, bytes, self.compute.cu_stream())
        })
    }
}
