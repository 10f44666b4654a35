//! The V4 model's arithmetic on the GPU (feature `cuda`), the first bricks of its GPU
//! forward (ARCHITECTURE.md, the V4 plan's item 5): `kernels/v4_model.cu`'s
//! `v4_matvec8` and `v4_rmsnorm8` reproduce the host's `Mat::apply8` and `rmsnorm8`
//! bit for bit (the 8-lane `dot8` order, exact IEEE, no FMA contraction).

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule};
use dsa_kv_cuda::{CudaError, DeviceBuffer, Gpu};

use crate::cuda::{grid, load_module};

/// The V4 model's kernels on one GPU.
pub struct V4GpuMath {
    gpu: Arc<Gpu>,
    matvec8: CudaFunction,
    rmsnorm8: CudaFunction,
    _module: Arc<CudaModule>,
}

fn as_i32(gpu: &Gpu, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Invalid {
        device: gpu.ordinal(),
        what: format!("{what} = {v} does not fit the kernels' int"),
    })
}

impl V4GpuMath {
    /// Compiles and loads the kernels on `gpu`.
    pub fn new(gpu: Arc<Gpu>) -> Result<Self, CudaError> {
        gpu.bind()?;
        let module = load_module(&gpu, include_str!("../../../../kernels/v4_model.cu"))?;
        let ordinal = gpu.ordinal();
        let drv = |what: &'static str| move |e| dsa_kv_cuda::driver_error(ordinal, what, e);
        Ok(V4GpuMath {
            matvec8: module
                .load_function("v4_matvec8")
                .map_err(drv("v4_matvec8"))?,
            rmsnorm8: module
                .load_function("v4_rmsnorm8")
                .map_err(drv("v4_rmsnorm8"))?,
            _module: module,
            gpu,
        })
    }

    /// `W · x` for each of the vectors in `xs` (`cols` wide), `W` row-major `[rows,
    /// cols]`: the vectors' outputs, one after the other.
    pub fn matvec8(
        &self,
        w: &[f32],
        rows: usize,
        cols: usize,
        xs: &[f32],
    ) -> Result<Vec<f32>, CudaError> {
        let g = &self.gpu;
        if cols == 0 || w.len() != rows * cols || !xs.len().is_multiple_of(cols) {
            return Err(CudaError::Invalid {
                device: g.ordinal(),
                what: format!(
                    "matvec8: {} weights for [{rows}, {cols}], {} inputs",
                    w.len(),
                    xs.len()
                ),
            });
        }
        let n = xs.len() / cols;
        let out = DeviceBuffer::zeroed(g, 4 * n * rows, "v4 matvec8 out")?;
        let (wd, xd) = (
            DeviceBuffer::from_slice(g, w, "v4 weights")?,
            DeviceBuffer::from_slice(g, xs, "v4 inputs")?,
        );
        let (o, wp, xp) = (out.ptr(), wd.ptr(), xd.ptr());
        let (r32, c32, n32) = (
            as_i32(g, "rows", rows)?,
            as_i32(g, "cols", cols)?,
            as_i32(g, "vectors", n)?,
        );
        // SAFETY: `out` holds `n × rows` floats, `w` `rows × cols`, `x` `n × cols`.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.matvec8, grid(n * rows), g.ordinal(), "v4_matvec8";
                &o, &wp, &xp, &r32, &c32, &n32,
            )?;
        }
        let mut host = vec![0f32; n * rows];
        g.synchronize()?;
        g.download(&out, &mut host)?;
        Ok(host)
    }

    /// The RMS norm of each `width`-wide vector in `xs`.
    pub fn rmsnorm8(&self, xs: &[f32], width: usize) -> Result<Vec<f32>, CudaError> {
        let g = &self.gpu;
        if width == 0 || !xs.len().is_multiple_of(width) {
            return Err(CudaError::Invalid {
                device: g.ordinal(),
                what: format!("rmsnorm8: {} values are not vectors of {width}", xs.len()),
            });
        }
        let n = xs.len() / width;
        let out = DeviceBuffer::zeroed(g, 4 * xs.len(), "v4 rmsnorm8 out")?;
        let xd = DeviceBuffer::from_slice(g, xs, "v4 inputs")?;
        let (o, xp) = (out.ptr(), xd.ptr());
        let (n32, w32) = (as_i32(g, "vectors", n)?, as_i32(g, "width", width)?);
        // SAFETY: both buffers hold `n × width` floats.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.rmsnorm8, grid(n), g.ordinal(), "v4_rmsnorm8";
                &o, &xp, &n32, &w32,
            )?;
        }
        let mut host = vec![0f32; xs.len()];
        g.synchronize()?;
        g.download(&out, &mut host)?;
        Ok(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::math::{rmsnorm, rmsnorm8, Mat};
    use dsa_kv_core::rng::SplitMix64;

    /// The host's order matters: the sequential dot product gives other bits than
    /// `dot8` on these inputs, so a kernel in another order would be caught below.
    fn shapes() -> Vec<(usize, usize)> {
        vec![
            (512, 64),
            (1024, 64),
            (64, 1024),
            (7, 67),
            (256, 128),
            (3, 5),
        ]
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn v4_matvec8_and_rmsnorm8_equal_the_host_bit_for_bit() {
        let gpu = Gpu::open(0).expect("a CUDA device");
        let k = V4GpuMath::new(gpu).unwrap();
        let mut rng = SplitMix64(11);
        let mut orders_differ = false;
        for (rows, cols) in shapes() {
            let w = Mat::random(&mut rng, rows, cols);
            let xs: Vec<f32> = Mat::random(&mut rng, 9, cols)
                .w
                .iter()
                .map(|v| v * 3.0)
                .collect();
            let got = k.matvec8(&w.w, rows, cols, &xs).unwrap();
            let want: Vec<f32> = xs.chunks_exact(cols).flat_map(|x| w.apply8(x)).collect();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "matvec8 [{rows}, {cols}]");
            let seq: Vec<f32> = xs.chunks_exact(cols).flat_map(|x| w.apply(x)).collect();
            orders_differ |= bits(&seq) != bits(&want);
            let got = k.rmsnorm8(&xs, cols).unwrap();
            let want: Vec<f32> = xs.chunks_exact(cols).flat_map(rmsnorm8).collect();
            assert_eq!(bits(&got), bits(&want), "rmsnorm8 width {cols}");
            let seq: Vec<f32> = xs.chunks_exact(cols).flat_map(rmsnorm).collect();
            orders_differ |= bits(&seq) != bits(&want);
        }
        assert!(
            orders_differ,
            "the test can tell the 8-lane order from the sequential one"
        );
    }
}
