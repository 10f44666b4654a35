//! [`WindowedCudaDevice`]: the CUDA backend's device for a model with sliding windows
//! (DeepSeek-V4), the GPU twin of the host's
//! [`WindowedHostDevice`](dsa_kv_device::windowed::WindowedHostDevice). It owns the
//! plan's pools on one GPU ([`V4GpuPools`]), runs the manager's copy plans on them, and
//! hands each step to the one [`Forward`] contract: a CUDA [`Batch`] whose
//! [`CacheView::windowed`] names every GPU pool, on the GPU's compute stream. The forward
//! is the model's (e.g. `dsa_kv_model::v4::cuda::V4CudaForward`), never built into the
//! device.

use std::sync::Arc;
use std::time::Instant;

use dsa_kv_core::core::scheduler::StepPlan;
use dsa_kv_core::core::WindowedSlots;
use dsa_kv_core::layout::V4Plan;
use dsa_kv_core::metadata::StepMetadata;
use dsa_kv_device::forward::{Batch, CacheView, Forward, MetadataView, Phase, Region};
use dsa_kv_device::windowed::{windowed_cache_view, windowed_step_metadata, PoolError};
use dsa_kv_device::{DeviceBackend, DeviceError, DeviceStepReport, Mismatch, VerifySpec};

use super::V4GpuPools;
use crate::metadata::DeviceMetadata;
use crate::Gpu;
use dsa_kv_core::storage::BackendError;

/// A windowed model's device on one GPU. See the module docs.
pub struct WindowedCudaDevice {
    index: usize,
    gpu: Arc<Gpu>,
    pools: V4GpuPools,
    view: CacheView,
    meta: StepMetadata,
    meta_dev: DeviceMetadata,
    forward: Box<dyn Forward>,
}

impl Drop for WindowedCudaDevice {
    /// Waits for the work queued on the GPU before the forward (its scratch) and the
    /// pools are freed.
    fn drop(&mut self) {
        if let Err(e) = self.gpu.synchronize() {
            tracing::error!(device = self.index, "synchronize before freeing: {e}");
        }
    }
}

impl WindowedCudaDevice {
    /// Device `index` on `gpu`: zeroed pools for `plan` and `slots` (as the cache was
    /// built with), each step run by `forward`, which must launch on `gpu`'s compute
    /// stream.
    pub fn new(
        index: usize,
        gpu: Arc<Gpu>,
        plan: &V4Plan,
        slots: &WindowedSlots,
        forward: Box<dyn Forward>,
    ) -> Result<Self, DeviceError> {
        let pools_err = |source| DeviceError::Pools {
            device: index,
            source,
        };
        let backend = |e: crate::CudaError| DeviceError::Backend {
            device: index,
            source: BackendError::new(e),
        };
        gpu.bind().map_err(backend)?;
        let pools = V4GpuPools::new(gpu.clone(), plan, slots).map_err(pools_err)?;
        let regions = (0..plan.life_cycles().len())
            .map(|lc| {
                (0..plan.life_cycles()[lc].pools.len())
                    .map(|pool| {
                        let (addr, bytes) = pools.device_pool(lc, pool).unwrap_or((0, 0));
                        Region { addr, bytes }
                    })
                    .collect()
            })
            .collect();
        let view = windowed_cache_view(plan, regions);
        let meta = windowed_step_metadata(plan).map_err(pools_err)?;
        let meta_dev = DeviceMetadata::new(&gpu, &meta).map_err(backend)?;
        Ok(WindowedCudaDevice {
            index,
            gpu,
            pools,
            view,
            meta,
            meta_dev,
            forward,
        })
    }

    /// The pools (a check or a dump downloads them).
    pub fn pools(&self) -> &V4GpuPools {
        &self.pools
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl DeviceBackend for WindowedCudaDevice {
    fn index(&self) -> usize {
        self.index
    }

    fn execute_step(&mut self, plan: &StepPlan) -> Result<DeviceStepReport, DeviceError> {
        let start = Instant::now();
        let device = self.index;
        if !plan.draft_copies.is_empty() {
            return Err(DeviceError::NoDraftCache { device });
        }
        self.gpu.bind().map_err(|e| DeviceError::Backend {
            device,
            source: BackendError::new(e),
        })?;
        let copies = self
            .pools
            .apply(&plan.copies)
            .map_err(|source: PoolError| DeviceError::Pools { device, source })?;
        let (meta, meta_dev) = (&self.meta, &self.meta_dev);
        let mut batch = Batch::on_cuda(
            plan.step,
            device,
            Phase::Target,
            &plan.requests,
            &self.view,
            MetadataView::of(meta, |r| meta_dev.addr(r)),
            meta,
            (self.gpu.ordinal(), self.gpu.compute()),
            Some(&self.gpu),
        );
        let sampling = batch
            .run(&mut *self.forward)
            .map_err(|e| DeviceError::forward(device, e))?;
        let mut r = DeviceStepReport::new(device, plan);
        r.tokens_written = plan.requests.iter().map(|p| p.tokens.len() as u64).sum();
        r.slot_copies = copies;
        r.sampling = sampling;
        r.elapsed_us = start.elapsed().as_micros() as u64;
        Ok(r)
    }

    /// Verification is off for a windowed model (no synthetic writer to predict its
    /// bytes; its cache is checked against its unpaged run): nothing is read back.
    fn verify(&mut self, _: &[VerifySpec]) -> Result<(u64, Vec<Mismatch>), DeviceError> {
        Ok((0, Vec::new()))
    }

    fn synchronize(&mut self) -> Result<(), DeviceError> {
        let device = self.index;
        let backend = |e| DeviceError::Backend {
            device,
            source: BackendError::new(e),
        };
        self.gpu.bind().map_err(backend)?;
        self.gpu.synchronize().map_err(backend)?;
        self.forward
            .after_synchronize()
            .map_err(|e| DeviceError::forward(device, e))
    }

    fn pool_regions(&mut self) -> Vec<dsa_kv_device::transfer::PoolRegion> {
        self.pools.regions(self.index)
    }

    fn cache_digest(&mut self) -> Result<String, DeviceError> {
        self.pools.digest().map_err(|source| DeviceError::Pools {
            device: self.index,
            source,
        })
    }
}
