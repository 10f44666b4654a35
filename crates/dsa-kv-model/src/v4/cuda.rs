//! The V4 model on the GPU (feature `cuda`): [`V4CudaForward`], the one [`Forward`]
//! contract run by the CUDA backend's windowed device ([`WindowedCudaDevice`], its pools in
//! GPU memory; [`v4_cuda_device`] builds one with this forward). It computes the host
//! model's forward with `kernels/v4_model.cu` (after `kernels/model.cu`, whose embedding, RoPE,
//! BF16, ReLU, add and top-k kernels it shares) and written and read by the crate's own
//! cache kernels (`model1_scatter`, `model1_gather`, `state_scatter`,
//! `quantize_indexer` + `indexer_k_scatter`). Every output is one thread's loop in the
//! host model's order (the 8-lane `dot8`, softmax sums in row order, the fixed `exp`
//! polynomial), compiled with exact IEEE (no FMA contraction), so the bits are the
//! host's: logits, sampled tokens, drafts and every pool byte. [`V4GpuMath`] exposes the
//! mat-vec and RMSNorm on their own for their unit test.
//!
//! A step, per planned request in plan order (one request at a time on the compute
//! stream; nothing depends on the batch): the addressing is computed on the host from
//! the request's tables (the `metadata::v4` references, the same calls as
//! [`V4Paged`](super::V4Paged)), every index checked against its pool before its launch
//! (a typed error, as the host store's, and that launch writes nothing); then per layer the
//! window rows, the state rows, the entries their groups close and the indexer keys are
//! written, the window rows gathered back, the indexer's top-k taken and turned into
//! the sparse decode's `extra_indices` on the device (`v4_extra_indices`, through the
//! request's block table; every visible entry was checked on the host, and a guard
//! flag read back with the logits checks again), the rows they name gathered per token,
//! and attention with the sink, the output projection and the MLP run; the
//! logits come back for sampling and the verdict on the drafts. Then the MTP layer's rows
//! of the kept tokens are written and its proposals chained, each proposal's own row
//! quantized into an overlay page and read back from it, as the host's overlay store
//! does.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig};
use dsa_kv_core::core::scheduler::PlannedRequest;
use dsa_kv_core::core::WindowedSlots;
use dsa_kv_core::ids::LayerId;
use dsa_kv_core::layout::{Role, V4Buffer, V4PageFormat, V4Plan};
use dsa_kv_core::metadata::v4::{entry_row, PageTable};
use dsa_kv_core::ops::model1::MODEL1_NOPE;
use dsa_kv_cuda::kernels::{Guard, GuardFailure};
use dsa_kv_cuda::v4::{
    check_model1, check_state, entry_key_maps, Bounds, Model1Pool, StatePool, V4KernelError,
    V4Kernels, WindowedCudaDevice,
};
use dsa_kv_cuda::{CudaError, DeviceBuffer, Gpu, Plain};
use dsa_kv_device::forward::{Batch, Forward, MemKind};
use dsa_kv_device::windowed::WindowedView;
use dsa_kv_device::{DeviceError, ForwardError, Proposals, Sampled, Sampling};

use super::forward::{outcome, verdict, V4Outputs};
use super::model::{Compressor, V4Layer, V4Model};
use crate::cuda::{grid, load_module};
use crate::math::{rope_cos_sin, Mat};
use crate::model::output_of;
use crate::{TokenOut, INDEX_DIM, LATENT, ROPE};

/// The V4 model's kernels on one GPU.
pub struct V4GpuMath {
    gpu: Arc<Gpu>,
    matvec8: CudaFunction,
    rmsnorm8: CudaFunction,
    _module: Arc<CudaModule>,
}

/// Compiles and loads `common.cuh`, `kernels/model.cu` (whose embedding, RoPE, BF16,
/// ReLU, add, top-k and `exp` the V4 kernels share) and `v4_source`.
fn load_v4_module(gpu: &Gpu, v4_source: &str) -> Result<Arc<CudaModule>, CudaError> {
    load_module(
        gpu,
        &format!(
            "{}\n{v4_source}",
            include_str!("../../../../kernels/model.cu")
        ),
    )
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
        let module = load_v4_module(&gpu, V4_MODEL_SOURCE)?;
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
        if cols == 0 || Some(w.len()) != rows.checked_mul(cols) || !xs.len().is_multiple_of(cols) {
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
        let (r32, c32, n32, zero) = (
            as_i32(g, "rows", rows)?,
            as_i32(g, "cols", cols)?,
            as_i32(g, "vectors", n)?,
            0i32,
        );
        // SAFETY: `out` holds `n × rows` floats, `w` `rows × cols`, `x` `n × cols`.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.matvec8, grid(n * rows), g.ordinal(), "v4_matvec8";
                &o, &r32, &zero, &wp, &r32, &c32, &xp, &c32, &zero, &n32,
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

// ---- the V4 model as a CUDA device ---------------------------------------------------

/// Scratch buffers of a step, grown to the largest request seen (see [`Arena`]).
mod slot {
    pub(super) const TOK: usize = 0;
    pub(super) const POS: usize = 1;
    pub(super) const X: usize = 2;
    pub(super) const XN: usize = 3;
    pub(super) const MN: usize = 4;
    pub(super) const C: usize = 5;
    pub(super) const CBF: usize = 6;
    pub(super) const WIDX: usize = 7;
    pub(super) const ST: usize = 8;
    pub(super) const SIDX: usize = 9;
    pub(super) const SROW: usize = 10;
    pub(super) const SHALF: usize = 11;
    pub(super) const NSLOT: usize = 12;
    pub(super) const E: usize = 13;
    pub(super) const EPOS: usize = 14;
    pub(super) const EBF: usize = 15;
    pub(super) const EIDX: usize = 16;
    pub(super) const KV: usize = 17;
    pub(super) const KS: usize = 18;
    pub(super) const VMAP: usize = 19;
    pub(super) const SMAP: usize = 20;
    pub(super) const GW: usize = 21;
    pub(super) const GWIDX: usize = 22;
    pub(super) const GE: usize = 23;
    pub(super) const BT: usize = 24;
    pub(super) const WB: usize = 25;
    pub(super) const NW: usize = 26;
    pub(super) const SEL: usize = 27;
    pub(super) const NSEL: usize = 28;
    pub(super) const RANK: usize = 29;
    pub(super) const SCORES: usize = 30;
    pub(super) const NVIS: usize = 31;
    pub(super) const NVM1: usize = 32;
    pub(super) const IQ: usize = 33;
    pub(super) const IQBF: usize = 34;
    pub(super) const IQV: usize = 35;
    pub(super) const IQS: usize = 36;
    pub(super) const IQD: usize = 37;
    pub(super) const IW: usize = 38;
    pub(super) const VOFF: usize = 39;
    pub(super) const SOFF: usize = 40;
    pub(super) const Q: usize = 41;
    pub(super) const O: usize = 42;
    pub(super) const ATT: usize = 43;
    pub(super) const HM: usize = 44;
    pub(super) const EBUF: usize = 45;
    pub(super) const LOGITS: usize = 46;
    pub(super) const OVL: usize = 47;
    pub(super) const HCH: usize = 48;
    pub(super) const CX: usize = 49;
    pub(super) const CXN: usize = 50;
    pub(super) const CTOK: usize = 51;
    pub(super) const CPOS: usize = 52;
    pub(super) const CGIDX: usize = 53;
    pub(super) const CWB: usize = 54;
    pub(super) const CNW: usize = 55;
    pub(super) const ROWOF: usize = 56;
    pub(super) const EXTRA: usize = 57;
    pub(super) const ELEN: usize = 58;
    pub(super) const FLAG: usize = 59;
    pub(super) const COUNT: usize = 60;
}

/// Device scratch, one growable buffer per [`slot`]. Growing a buffer waits for the GPU
/// first (its old bytes may still be read); a request sizes its working buffers before
/// its first launch, so no buffer holding live values is ever regrown.
struct Arena {
    gpu: Arc<Gpu>,
    bufs: Vec<Option<DeviceBuffer>>,
}

impl Arena {
    fn ensure(&mut self, slot: usize, bytes: usize) -> Result<u64, CudaError> {
        DeviceBuffer::ensure(
            &mut self.bufs[slot],
            &self.gpu,
            bytes.max(4),
            "V4 model scratch",
        )?;
        Ok(self.ptr(slot))
    }

    fn ptr(&self, slot: usize) -> u64 {
        self.bufs[slot].as_ref().map_or(0, DeviceBuffer::ptr)
    }

    /// Uploads `data` into `slot` (stream-ordered after the work queued so far).
    fn put<T: Plain>(&mut self, slot: usize, data: &[T]) -> Result<u64, CudaError> {
        let p = self.ensure(slot, std::mem::size_of_val(data))?;
        if let Some(b) = &self.bufs[slot] {
            self.gpu.upload(b, data)?;
        }
        Ok(p)
    }
}

/// A compressor's weights on the device.
struct DevComp {
    ratio: u32,
    width: usize,
    coff: usize,
    w_kv: DeviceBuffer,
    w_score: DeviceBuffer,
    ape: DeviceBuffer,
}

/// A ratio-4 layer's indexer on the device (the heads' query matrices stacked).
struct DevIndex {
    comp: DevComp,
    w_q: DeviceBuffer,
    w_w: DeviceBuffer,
}

/// One layer's weights on the device (the heads' query matrices stacked: one mat-vec
/// gives every head's query, each output the host's `dot8` of its row).
struct DevLayer {
    w_kv: DeviceBuffer,
    w_q: DeviceBuffer,
    sink: DeviceBuffer,
    w_o: DeviceBuffer,
    w_1: DeviceBuffer,
    w_2: DeviceBuffer,
    comp: Option<DevComp>,
    index: Option<DevIndex>,
}

fn up(gpu: &Gpu, v: &[f32]) -> Result<DeviceBuffer, CudaError> {
    DeviceBuffer::from_slice(gpu, v, "V4 model weights")
}

fn stacked(gpu: &Gpu, ms: &[Mat]) -> Result<DeviceBuffer, CudaError> {
    let all: Vec<f32> = ms.iter().flat_map(|m| m.w.iter().copied()).collect();
    up(gpu, &all)
}

impl DevComp {
    fn new(gpu: &Gpu, c: &Compressor) -> Result<Self, CudaError> {
        Ok(DevComp {
            ratio: c.ratio,
            width: c.width,
            coff: c.coff,
            w_kv: up(gpu, &c.w_kv.w)?,
            w_score: up(gpu, &c.w_score.w)?,
            ape: up(gpu, &c.ape.w)?,
        })
    }
}

impl DevLayer {
    fn new(gpu: &Gpu, l: &V4Layer) -> Result<Self, CudaError> {
        Ok(DevLayer {
            w_kv: up(gpu, &l.w_kv.w)?,
            w_q: stacked(gpu, &l.w_q)?,
            sink: up(gpu, &l.sink)?,
            w_o: up(gpu, &l.w_o.w)?,
            w_1: up(gpu, &l.w_1.w)?,
            w_2: up(gpu, &l.w_2.w)?,
            comp: l.comp.as_ref().map(|c| DevComp::new(gpu, c)).transpose()?,
            index: l
                .index
                .as_ref()
                .map(|ix| -> Result<DevIndex, CudaError> {
                    Ok(DevIndex {
                        comp: DevComp::new(gpu, &ix.comp)?,
                        w_q: stacked(gpu, &ix.w_q)?,
                        w_w: up(gpu, &ix.w_w.w)?,
                    })
                })
                .transpose()?,
        })
    }
}

/// The model's kernels (one module: `common.cuh`, `model.cu`, `v4_model.cu`).
struct Funcs {
    embed: CudaFunction,
    rope: CudaFunction,
    rope_inv: CudaFunction,
    to_bf16: CudaFunction,
    round_bf16: CudaFunction,
    add: CudaFunction,
    relu: CudaFunction,
    topk: CudaFunction,
    matvec8: CudaFunction,
    rmsnorm8: CudaFunction,
    add_ape: CudaFunction,
    entry: CudaFunction,
    dequant_fp8: CudaFunction,
    index_scores: CudaFunction,
    attend: CudaFunction,
    _module: Arc<CudaModule>,
}

/// A failure inside a request's forward (the device wraps it with the request).
type Fail = String;

fn s<E: std::fmt::Display>(e: E) -> Fail {
    e.to_string()
}

/// An index past the device's pool means the device was built with fewer slots than
/// the manager hands out (the host store's message).
fn past_pool<E: std::fmt::Display>(e: E) -> Fail {
    format!(
        "{e}: a row past the device's pool: the device has fewer slots than the manager hands out"
    )
}

/// A cache-kernel launch's failure: a refused batch is [`past_pool`], anything else is
/// the driver's.
fn past(e: V4KernelError) -> Fail {
    match e {
        V4KernelError::OutOfBounds { .. } => past_pool(e),
        e => e.to_string(),
    }
}

fn blocks(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn to_i32s(v: &[i64]) -> Result<Vec<i32>, Fail> {
    v.iter()
        .map(|&r| i32::try_from(r).map_err(|_| format!("row {r} does not fit the kernels' int32")))
        .collect()
}

/// One request's tables, as [`V4Paged`](super::V4Paged) reads them: kernel row indices
/// of window and state positions through its ring page tables, of compressed entries
/// through its block table, and the device pools they index.
struct Tables<'a> {
    pools: &'a WindowedView,
    p: &'a PlannedRequest,
    /// The request's block table, as slots.
    blocks: Vec<dsa_kv_core::ids::SlotId>,
}

impl Tables<'_> {
    fn buffer(&self, layer: usize, role: Role) -> Result<V4Buffer, Fail> {
        self.pools
            .plan
            .buffer(LayerId(layer as u32), role)
            .copied()
            .ok_or_else(|| format!("layer {layer} has no {role:?} buffer in the plan"))
    }

    fn device_pool(&self, b: &V4Buffer) -> Result<(u64, u64), Fail> {
        self.pools
            .pools
            .get(b.life_cycle.index())
            .and_then(|lc| lc.get(b.pool.index()))
            .map(|r| (r.addr, r.bytes))
            .ok_or_else(|| format!("no device pool for {:?} of layer {}", b.role, b.layer.get()))
    }

    /// Kernel rows of `positions` in a windowed buffer.
    fn ring(&self, b: &V4Buffer, positions: impl Iterator<Item = u32>) -> Result<Vec<i64>, Fail> {
        let lc = b.life_cycle.index();
        let w = self
            .pools
            .window_index(lc)
            .ok_or_else(|| format!("{:?} of layer {} is not windowed", b.role, b.layer.get()))?;
        let (start, slots) = &self.p.window_tables[w];
        let table = PageTable {
            start: *start,
            slots,
            page: u64::from(self.pools.plan.life_cycles()[lc].tokens_per_page),
        };
        positions
            .map(|pos| {
                table
                    .row(b.converter, u64::from(pos))
                    .map_err(|e| format!("layer {}: {e}", b.layer.get()))
            })
            .collect()
    }

    /// Kernel rows of compressed entries `ws`.
    fn entries(&self, b: &V4Buffer, ws: impl Iterator<Item = u32>) -> Result<Vec<i64>, Fail> {
        let ratio = u64::from(b.format.tokens_per_entry());
        ws.map(|w| {
            entry_row(&self.blocks, b.converter, ratio, u64::from(w))
                .map_err(|e| format!("layer {}: {e}", b.layer.get()))
        })
        .collect()
    }

    fn model1(&self, b: &V4Buffer) -> Result<Model1Pool, Fail> {
        let V4PageFormat::Model1 { page, .. } = b.format else {
            return Err(format!(
                "{:?} of layer {} is not MODEL1",
                b.role,
                b.layer.get()
            ));
        };
        let (pool, pool_len) = self.device_pool(b)?;
        Ok(Model1Pool {
            pool,
            pool_len,
            page,
        })
    }

    fn state(&self, b: &V4Buffer) -> Result<StatePool, Fail> {
        let V4PageFormat::State { row_bytes, .. } = b.format else {
            return Err(format!(
                "{:?} of layer {} is not a state buffer",
                b.role,
                b.layer.get()
            ));
        };
        let (pool, pool_len) = self.device_pool(b)?;
        Ok(StatePool {
            pool,
            pool_len,
            row_bytes,
        })
    }

    /// The indexer key byte offsets of entry rows `rows`, each key's bytes checked to lie
    /// inside the pool: `(pool, value offsets, scale offsets)`.
    fn keys(&self, b: &V4Buffer, rows: &[i64]) -> Result<(u64, u64, Vec<i64>, Vec<i64>), Fail> {
        let V4PageFormat::IndexKeys { page, .. } = b.format else {
            return Err(format!(
                "{:?} of layer {} holds no indexer keys",
                b.role,
                b.layer.get()
            ));
        };
        let (pool, len) = self.device_pool(b)?;
        let (v, sc) = entry_key_maps(rows, page);
        for (&a, &z) in v.iter().zip(&sc) {
            let fits =
                |off: i64, n: u32| off >= 0 && (off as u64).saturating_add(u64::from(n)) <= len;
            if !fits(a, page.data_bytes) || !fits(z, page.scale_bytes) {
                return Err(format!(
                    "an indexer key at bytes {a} / {z} is past the device's {len}-byte pool of \
                     layer {}: the device has fewer slots than the manager hands out",
                    b.layer.get()
                ));
            }
        }
        Ok((pool, len, v, sc))
    }
}

/// `kernels/v4_model.cu`, compiled after `common.cuh` and `kernels/model.cu`.
pub const V4_MODEL_SOURCE: &str = include_str!("../../../../kernels/v4_model.cu");

/// What a step only reads: the weights, the kernels, the RoPE table.
struct Weights {
    model: Arc<V4Model>,
    gpu: Arc<Gpu>,
    f: Funcs,
    cache: V4Kernels,
    layers: Vec<DevLayer>,
    draft: DevLayer,
    embed: DeviceBuffer,
    w_out: DeviceBuffer,
    rope: DeviceBuffer,
    max_positions: u32,
}

/// The V4 model's forward on one GPU: the one [`Forward`] contract, run by the CUDA
/// backend's windowed device ([`WindowedCudaDevice`]) over the pools its batch's
/// [`WindowedView`] names. See the module docs.
pub struct V4CudaForward {
    outputs: Option<Arc<Mutex<V4Outputs>>>,
    w: Weights,
    arena: Arena,
}

/// A windowed CUDA device on `gpu` running the V4 model's forward: zeroed pools for
/// `plan` and `slots` (as the cache was built with), `model`'s weights uploaded, the
/// kernels compiled, positions below `max_positions`, every kept position's output
/// recorded into `outputs`.
pub fn v4_cuda_device(
    index: usize,
    gpu: Arc<Gpu>,
    plan: &V4Plan,
    slots: &WindowedSlots,
    model: Arc<V4Model>,
    outputs: Arc<Mutex<V4Outputs>>,
    max_positions: u32,
) -> Result<WindowedCudaDevice, DeviceError> {
    let forward = V4CudaForward::new(gpu.clone(), model, Some(outputs), max_positions)
        .map_err(|e| DeviceError::forward(index, e))?;
    WindowedCudaDevice::new(index, gpu, plan, slots, Box::new(forward))
}

impl V4CudaForward {
    /// `model`'s forward on `gpu`: its weights uploaded, the kernels compiled; positions
    /// below `max_positions` (the RoPE table's rows; a step that would reach past it is
    /// a typed error). Every kept position's output is recorded into `outputs`, if given.
    pub fn new(
        gpu: Arc<Gpu>,
        model: Arc<V4Model>,
        outputs: Option<Arc<Mutex<V4Outputs>>>,
        max_positions: u32,
    ) -> Result<Self, ForwardError> {
        Self::with_source(gpu, model, outputs, max_positions, V4_MODEL_SOURCE)
    }

    /// [`new`](Self::new) with `v4_model_source` in place of `kernels/v4_model.cu`: the
    /// mutation tests compile altered kernels to show that the exactness checks catch
    /// them.
    #[doc(hidden)]
    pub fn with_source(
        gpu: Arc<Gpu>,
        model: Arc<V4Model>,
        outputs: Option<Arc<Mutex<V4Outputs>>>,
        max_positions: u32,
        v4_model_source: &str,
    ) -> Result<Self, ForwardError> {
        let setup =
            |e: CudaError| ForwardError::framework(crate::ModelError::Access(e.to_string()));
        let unsupported = |what: String| ForwardError::Unsupported { what };
        if max_positions == 0 || max_positions > i32::MAX as u32 / 2 {
            return Err(unsupported(format!(
                "max_positions {max_positions}: give 1 ..= {}",
                i32::MAX as u32 / 2
            )));
        }
        if model.is_checkpoint() {
            return Err(unsupported(
                "the V4 GPU forward runs the built-in V4 model only: run a checkpoint's model \
                 on the host backend"
                    .into(),
            ));
        }
        gpu.bind().map_err(setup)?;
        let module = load_v4_module(&gpu, v4_model_source).map_err(setup)?;
        let ordinal = gpu.ordinal();
        let f = |n: &'static str| {
            module
                .load_function(n)
                .map_err(|e| setup(dsa_kv_cuda::driver_error(ordinal, n, e)))
        };
        let funcs = Funcs {
            embed: f("m_embed")?,
            rope: f("m_rope")?,
            rope_inv: f("v4_rope_inv")?,
            to_bf16: f("m_to_bf16")?,
            round_bf16: f("v4_round_bf16")?,
            add: f("m_add")?,
            relu: f("m_relu")?,
            topk: f("m_topk")?,
            matvec8: f("v4_matvec8")?,
            rmsnorm8: f("v4_rmsnorm8")?,
            add_ape: f("v4_add_ape")?,
            entry: f("v4_entry")?,
            dequant_fp8: f("v4_dequant_fp8")?,
            index_scores: f("v4_index_scores")?,
            attend: f("v4_attend")?,
            _module: module.clone(),
        };
        let layers = model
            .layers
            .iter()
            .map(|l| DevLayer::new(&gpu, l))
            .collect::<Result<Vec<_>, _>>()
            .map_err(setup)?;
        let draft = DevLayer::new(&gpu, &model.draft).map_err(setup)?;
        let table: Vec<f32> = (0..max_positions)
            .flat_map(|p| {
                (0..ROPE / 2).flat_map(move |i| {
                    let (c, s) = rope_cos_sin(p, i, ROPE);
                    [c, s]
                })
            })
            .collect();
        Ok(V4CudaForward {
            outputs,
            w: Weights {
                cache: V4Kernels::load(&gpu).map_err(setup)?,
                embed: up(&gpu, &model.embed.w).map_err(setup)?,
                w_out: up(&gpu, &model.w_out.w).map_err(setup)?,
                rope: up(&gpu, &table).map_err(setup)?,
                layers,
                draft,
                f: funcs,
                model,
                max_positions,
                gpu: gpu.clone(),
            },
            arena: Arena {
                gpu,
                bufs: (0..slot::COUNT).map(|_| None).collect(),
            },
        })
    }
}

impl Forward for V4CudaForward {
    fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        let fail = |what: String| ForwardError::framework(crate::ModelError::Access(what));
        let ordinal = self.w.gpu.ordinal() as u32;
        if batch.memory() != (MemKind::Device { ordinal }) {
            return Err(ForwardError::Unsupported {
                what: format!(
                    "the V4 GPU forward runs on GPU {ordinal}'s windowed device, not over {:?}",
                    batch.memory()
                ),
            });
        }
        let view = batch
            .cache
            .windowed
            .as_ref()
            .ok_or_else(|| ForwardError::Unsupported {
                what: "the V4 GPU forward needs a batch over a windowed cache".into(),
            })?;
        self.w.gpu.bind().map_err(|e| fail(e.to_string()))?;
        let device = batch.device;
        let mut outcomes = Vec::with_capacity(batch.requests.len());
        let mut proposals = Proposals::new();
        for p in batch.requests {
            let mut step = Step {
                w: &self.w,
                arena: &mut self.arena,
            };
            let (outs, accepted, kept, drafts) = step
                .request(view, p)
                .map_err(|e| fail(format!("request {}: {e}", p.id)))?;
            outcomes.push(outcome(
                self.outputs.as_deref(),
                device,
                p,
                &outs,
                (accepted, kept),
                drafts.into_iter().map(|t| (t, Vec::new())).collect(),
                &mut proposals,
            ));
        }
        Ok(Sampling::Sampled(
            Sampled::new(outcomes).with_drafts(proposals),
        ))
    }
}

/// One request's work on the device: the weights read, the scratch written.
struct Step<'a> {
    w: &'a Weights,
    arena: &'a mut Arena,
}

impl Step<'_> {
    fn g(&self) -> &Gpu {
        &self.w.gpu
    }

    fn a(&self, slot: usize) -> u64 {
        self.arena.ptr(slot)
    }

    fn put<T: Plain>(&mut self, slot: usize, data: &[T]) -> Result<u64, Fail> {
        self.arena.put(slot, data).map_err(s)
    }

    // -- kernel launches (every address below is an arena buffer sized by `request`,
    //    a weight of the dimensions the model gives, or a pool range checked on the host)

    #[allow(clippy::too_many_arguments)]
    fn matvec8(
        &self,
        out: u64,
        os: usize,
        oo: usize,
        w: &DeviceBuffer,
        rows: usize,
        cols: usize,
        x: u64,
        xs: usize,
        n: usize,
    ) -> Result<(), Fail> {
        let (wp, zero) = (w.ptr(), 0i32);
        let (os, oo, r, c, xs, n32) = (
            os as i32,
            oo as i32,
            rows as i32,
            cols as i32,
            xs as i32,
            n as i32,
        );
        let g = self.g();
        // SAFETY: `out` holds n × os floats, `w` rows × cols, `x` n × xs (module comment).
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.w.f.matvec8, grid(n * rows), g.ordinal(), "v4_matvec8";
                &out, &os, &oo, &wp, &r, &c, &x, &xs, &zero, &n32,
            )
        }
        .map_err(s)
    }

    fn rmsnorm8(&self, out: u64, x: u64, n: usize, width: usize) -> Result<(), Fail> {
        let (n32, w32) = (n as i32, width as i32);
        let g = self.g();
        // SAFETY: both hold n × width floats.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.w.f.rmsnorm8, grid(n), g.ordinal(), "v4_rmsnorm8";
                &out, &x, &n32, &w32,
            )
        }
        .map_err(s)
    }

    /// RoPE (or its inverse) on `count` 64-wide vectors per token at `buf[t × stride + off
    /// + k × kstride ..]`, token t at `pos[t]` (below the table's rows, checked by
    /// `request`).
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        buf: u64,
        stride: usize,
        off: usize,
        count: usize,
        kstride: usize,
        pos: u64,
        n: usize,
        inverse: bool,
    ) -> Result<(), Fail> {
        let (st, of, co, ks, n32) = (
            stride as i32,
            off as i32,
            count as i32,
            kstride as i32,
            n as i32,
        );
        let table = self.w.rope.ptr();
        let f = if inverse {
            &self.w.f.rope_inv
        } else {
            &self.w.f.rope
        };
        let g = self.g();
        // SAFETY: `buf` holds n × stride floats, `pos` n ints below the table's rows.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), f, grid(n * count * 32), g.ordinal(), "v4 rope";
                &buf, &st, &of, &co, &ks, &pos, &table, &n32,
            )
        }
        .map_err(s)
    }

    fn to_bf16(&self, dst: u64, src: u64, n: usize) -> Result<(), Fail> {
        let n64 = n as i64;
        let g = self.g();
        // SAFETY: `dst` holds n u16, `src` n floats.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.w.f.to_bf16, grid(n), g.ordinal(), "m_to_bf16";
                &dst, &src, &n64,
            )
        }
        .map_err(s)
    }

    fn add(&self, x: u64, y: u64, n: usize) -> Result<(), Fail> {
        let n64 = n as i64;
        let g = self.g();
        // SAFETY: both hold n floats.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.w.f.add, grid(n), g.ordinal(), "m_add"; &x, &y, &n64,
            )
        }
        .map_err(s)
    }

    fn embed(&self, x: u64, tok: u64, n: usize) -> Result<(), Fail> {
        let c = self.w.model.config();
        let (n32, h, v, e) = (
            n as i32,
            c.hidden as i32,
            c.vocab as i32,
            self.w.embed.ptr(),
        );
        let g = self.g();
        // SAFETY: `x` holds n × hidden floats, `tok` n u32; rows are taken mod vocab.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.w.f.embed, grid(n * c.hidden), g.ordinal(), "m_embed";
                &x, &tok, &e, &n32, &h, &v,
            )
        }
        .map_err(s)
    }

    /// A layer's MODEL1 rows of n tokens: `rmsnorm8(w_kv · xn)`, RoPE on its last 64 at
    /// `pos`, BF16, written at kernel rows `idx` of `pool`.
    fn write_rows(
        &mut self,
        w_kv: &DeviceBuffer,
        xn: u64,
        n: usize,
        pos: u64,
        pool: Model1Pool,
        idx: &[i64],
    ) -> Result<(), Fail> {
        let h = self.w.model.config().hidden;
        let (c, cbf) = (self.a(slot::C), self.a(slot::CBF));
        self.matvec8(c, LATENT, 0, w_kv, LATENT, h, xn, h, n)?;
        self.rmsnorm8(c, c, n, LATENT)?;
        self.rope(c, LATENT, MODEL1_NOPE, 1, 0, pos, n, false)?;
        self.to_bf16(cbf, c, n * LATENT)?;
        let ip = self.put(slot::WIDX, idx)?;
        let g = self.g();
        // SAFETY: `cbf` holds n BF16 rows, `ip` the n indices of `idx`, checked on the host.
        unsafe {
            self.w.cache.model1_scatter(
                g.compute(),
                g.ordinal(),
                pool,
                cbf,
                ip,
                n,
                Bounds::Host(idx),
            )
        }
        .map_err(past)
    }

    /// A compressor's state rows `[w_kv · xn | w_score · xn + ape]` of the n tokens at
    /// `first..`, written to its state buffer.
    #[allow(clippy::too_many_arguments)]
    fn state_rows(
        &mut self,
        t: &Tables<'_>,
        layer: usize,
        role: Role,
        c: &DevComp,
        first: u32,
        n: usize,
        pos: u64,
    ) -> Result<(), Fail> {
        let h = self.w.model.config().hidden;
        let cols = c.coff * c.width;
        let (st, xn) = (self.a(slot::ST), self.a(slot::XN));
        self.matvec8(st, 2 * cols, 0, &c.w_kv, cols, h, xn, h, n)?;
        self.matvec8(st, 2 * cols, cols, &c.w_score, cols, h, xn, h, n)?;
        let (st32, off, ape, w32, r32, n32) = (
            (2 * cols) as i32,
            cols as i32,
            c.ape.ptr(),
            cols as i32,
            c.ratio as i32,
            n as i32,
        );
        let g = self.g();
        // SAFETY: `st` holds n × 2·cols floats, `ape` ratio × cols, `pos` n ints.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.w.f.add_ape, grid(n * cols), g.ordinal(), "v4_add_ape";
                &st, &st32, &off, &ape, &w32, &pos, &r32, &n32,
            )
        }
        .map_err(s)?;
        let b = t.buffer(layer, role)?;
        let pool = t.state(&b)?;
        if pool.row_bytes as usize != 2 * cols * 4 {
            return Err(format!(
                "layer {layer}: {role:?} rows of {} bytes, the model's have {}",
                pool.row_bytes,
                2 * cols * 4
            ));
        }
        let idx = t.ring(&b, first..first + n as u32)?;
        let ip = self.put(slot::SIDX, &idx)?;
        let g = self.g();
        // SAFETY: `st` holds n rows of row_bytes, `ip` the indices of `idx`, checked.
        unsafe {
            self.w.cache.state_scatter(
                g.compute(),
                g.ordinal(),
                pool,
                st,
                ip,
                n,
                Bounds::Host(&idx),
            )
        }
        .map_err(past)
    }

    /// Compressed entries `ws` of a compressor (into `E`, `width` wide each): per channel
    /// the softmax over the group's slots, read back from the state buffer.
    fn entries(
        &mut self,
        t: &Tables<'_>,
        layer: usize,
        role: Role,
        c: &DevComp,
        ws: &[u32],
    ) -> Result<(), Fail> {
        let b = t.buffer(layer, role)?;
        let pool = t.state(&b)?;
        let r = c.ratio;
        let per = 2 * r as usize;
        let (mut rows, mut halves, mut counts) = (Vec::new(), Vec::new(), Vec::new());
        for &w in ws {
            let mut slots: Vec<(u32, i32)> = Vec::with_capacity(per);
            if c.coff == 2 && w > 0 {
                slots.extend((r * (w - 1)..r * w).map(|p| (p, 0)));
            }
            slots.extend((r * w..r * (w + 1)).map(|p| (p, c.coff as i32 - 1)));
            let got = t.ring(&b, slots.iter().map(|&(p, _)| p))?;
            counts.push(got.len() as i32);
            rows.extend(&got);
            rows.extend(std::iter::repeat_n(-1i64, per - got.len()));
            halves.extend(slots.iter().map(|&(_, h)| h));
            halves.extend(std::iter::repeat_n(0i32, per - slots.len()));
        }
        check_state(&rows, pool.row_bytes, pool.pool_len).map_err(past_pool)?;
        let (sr, sh, ns) = (
            self.put(slot::SROW, &rows)?,
            self.put(slot::SHALF, &halves)?,
            self.put(slot::NSLOT, &counts)?,
        );
        let (out, base, rb) = (self.a(slot::E), pool.pool, u64::from(pool.row_bytes));
        let (per32, d32, coff, ne) = (per as i32, c.width as i32, c.coff as i32, ws.len() as i32);
        let g = self.g();
        // SAFETY: every row index read (counts[e] of row e) was checked against the pool;
        // `out` holds ne × width floats.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.w.f.entry, grid(ws.len() * c.width), g.ordinal(), "v4_entry";
                &out, &base, &rb, &sr, &sh, &per32, &ns, &d32, &coff, &ne,
            )
        }
        .map_err(s)
    }

    /// Everything the n tokens at `first..` write in layer `l` (the host model's
    /// `write`): window rows, state rows, the entries they close and their indexer keys.
    fn write_layer(&mut self, t: &Tables<'_>, l: usize, first: u32, n: usize) -> Result<(), Fail> {
        let w = self.w;
        let dl = &w.layers[l];
        let (xn, pos) = (self.a(slot::XN), self.a(slot::POS));
        let b = t.buffer(l, Role::WindowKey)?;
        let idx = t.ring(&b, first..first + n as u32)?;
        self.write_rows(&dl.w_kv, xn, n, pos, t.model1(&b)?, &idx)?;
        let Some(c) = &dl.comp else {
            return Ok(());
        };
        self.state_rows(t, l, Role::CompressorState, c, first, n, pos)?;
        if let Some(ix) = &dl.index {
            self.state_rows(t, l, Role::IndexerCompressorState, &ix.comp, first, n, pos)?;
        }
        let r = c.ratio;
        let ws: Vec<u32> = (first..first + n as u32)
            .filter(|p| (p + 1).is_multiple_of(r))
            .map(|p| p / r)
            .collect();
        if ws.is_empty() {
            return Ok(());
        }
        let ne = ws.len();
        let (e, ebf) = (self.a(slot::E), self.a(slot::EBF));
        let epos: Vec<i32> = ws.iter().map(|&w| (r * w) as i32).collect();
        let ep = self.put(slot::EPOS, &epos)?;
        self.entries(t, l, Role::CompressorState, c, &ws)?;
        self.rmsnorm8(e, e, ne, LATENT)?;
        self.rope(e, LATENT, MODEL1_NOPE, 1, 0, ep, ne, false)?;
        self.to_bf16(ebf, e, ne * LATENT)?;
        let b = t.buffer(l, Role::CompressedKey)?;
        let rows = t.entries(&b, ws.iter().copied())?;
        let ip = self.put(slot::EIDX, &rows)?;
        let pool = t.model1(&b)?;
        let g = self.g();
        // SAFETY: `ebf` holds ne BF16 rows, `ip` the indices of `rows`, checked.
        unsafe {
            self.w.cache.model1_scatter(
                g.compute(),
                g.ordinal(),
                pool,
                ebf,
                ip,
                ne,
                Bounds::Host(&rows),
            )
        }
        .map_err(past)?;
        let Some(ix) = &dl.index else {
            return Ok(());
        };
        self.entries(t, l, Role::IndexerCompressorState, &ix.comp, &ws)?;
        self.rmsnorm8(e, e, ne, INDEX_DIM)?;
        self.rope(e, INDEX_DIM, 0, 1, 0, ep, ne, false)?;
        self.to_bf16(ebf, e, ne * INDEX_DIM)?;
        let (kv, ks) = (self.a(slot::KV), self.a(slot::KS));
        let g = self.g();
        // SAFETY: `ebf` holds ne × 128 BF16, `kv` ne × 128 bytes, `ks` ne × 4.
        unsafe {
            g.kernels()
                .quantize_indexer(g.compute(), g.ordinal(), ebf, kv, ks, ne, false, true)
        }
        .map_err(s)?;
        let b = t.buffer(l, Role::CompressedIndexKey)?;
        let rows = t.entries(&b, ws.iter().copied())?;
        let (cache, len, vmap, smap) = t.keys(&b, &rows)?;
        let (vp, sp) = (self.put(slot::VMAP, &vmap)?, self.put(slot::SMAP, &smap)?);
        let g = self.g();
        // SAFETY: every offset was checked to leave the key's bytes inside the pool.
        unsafe {
            g.kernels().indexer_k_scatter(
                g.compute(),
                g.ordinal(),
                cache,
                len,
                kv,
                ks,
                vp,
                sp,
                ne,
                INDEX_DIM,
                None,
            )
        }
        .map_err(s)
    }

    /// Gathers the MODEL1 rows at kernel rows `rows` of `pool` into f32 rows at `out`.
    fn gather(
        &mut self,
        pool: Model1Pool,
        rows: &[i64],
        idx_slot: usize,
        out: u64,
    ) -> Result<(), Fail> {
        let rows32 = to_i32s(rows)?;
        let ip = self.put(idx_slot, &rows32)?;
        let g = self.g();
        // SAFETY: `out` holds rows.len() × 512 floats, `ip` the indices, checked.
        unsafe {
            self.w.cache.model1_gather(
                g.compute(),
                g.ordinal(),
                pool,
                ip,
                rows.len(),
                out,
                Bounds::Host(&rows32),
            )
        }
        .map_err(past)
    }

    /// Attention of n tokens (queries from `xn`, positions `pos`) over window rows
    /// `gw[wb[t] .. wb[t] + nw[t]]` and the entries `ge[sel[t][..nsel[t]]]`, then the
    /// output projection and the MLP, added into `x`.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &mut self,
        dl: &DevLayer,
        n: usize,
        xn: u64,
        x: u64,
        pos: u64,
        (gw, wb, nw): (u64, u64, u64),
        (ge, ne, es): (u64, u64, usize),
        max_rows: usize,
    ) -> Result<(), Fail> {
        let c = self.w.model.config();
        let (h, heads, mlp) = (c.hidden, c.heads, c.mlp);
        let (q, o, att, hm, mn) = (
            self.a(slot::Q),
            self.a(slot::O),
            self.a(slot::ATT),
            self.a(slot::HM),
            self.a(slot::MN),
        );
        let ebuf = self
            .arena
            .ensure(slot::EBUF, 4 * n * heads * max_rows)
            .map_err(s)?;
        let qw = heads * LATENT;
        self.matvec8(q, qw, 0, &dl.w_q, qw, h, xn, h, n)?;
        self.rmsnorm8(q, q, n * heads, LATENT)?;
        self.rope(q, qw, MODEL1_NOPE, heads, LATENT, pos, n, false)?;
        let n64 = (n * qw) as i64;
        let g = self.g();
        // SAFETY: `q` holds n × heads × 512 floats.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.w.f.round_bf16, grid(n * qw), g.ordinal(), "v4_round_bf16";
                &q, &n64,
            )
        }
        .map_err(s)?;
        let scale = 1.0 / (LATENT as f32).sqrt();
        let (h32, es32, mr32, n32, sink) = (
            heads as i32,
            es as i32,
            max_rows as i32,
            n as i32,
            dl.sink.ptr(),
        );
        // SAFETY: `o`, `q` n × heads × 512 floats; window rows wb[t] + k below gw's rows
        // (built by the caller from the same counts); `ge` n × es rows, of which the
        // kernel reads at most es per token whatever ne[t] says;
        // `ebuf` n × heads × max_rows floats with nw[t] + ne[t] ≤ max_rows.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.w.f.attend, blocks(n * heads, 128), g.ordinal(), "v4_attend";
                &o, &q, &h32, &gw, &wb, &nw, &ge, &ne, &es32, &scale, &sink, &ebuf, &mr32,
                &n32,
            )
        }
        .map_err(s)?;
        self.rope(o, qw, MODEL1_NOPE, heads, LATENT, pos, n, true)?;
        self.matvec8(att, h, 0, &dl.w_o, h, qw, o, qw, n)?;
        self.add(x, att, n * h)?;
        self.rmsnorm8(mn, x, n, h)?;
        self.matvec8(hm, mlp, 0, &dl.w_1, mlp, h, mn, h, n)?;
        let nm = (n * mlp) as i64;
        let g = self.g();
        // SAFETY: `hm` holds n × mlp floats.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.w.f.relu, grid(n * mlp), g.ordinal(), "m_relu"; &hm, &nm,
            )
        }
        .map_err(s)?;
        self.matvec8(att, h, 0, &dl.w_2, h, mlp, hm, mlp, n)?;
        self.add(x, att, n * h)
    }

    /// The attention of layer `l` for the n tokens at `first..` (the host's `attend` per
    /// token), added into `X` with the MLP.
    fn attend_layer(&mut self, t: &Tables<'_>, l: usize, first: u32, n: usize) -> Result<(), Fail> {
        let w = self.w;
        let dl = &w.layers[l];
        let cfg = self.w.model.config();
        let (win, topk) = (cfg.window, cfg.topk);
        let end = first + n as u32;
        let wlo = first.saturating_sub(win - 1);
        let b = t.buffer(l, Role::WindowKey)?;
        let rows = t.ring(&b, wlo..end)?;
        let gw = self.a(slot::GW);
        self.gather(t.model1(&b)?, &rows, slot::GWIDX, gw)?;
        let low = |q: u32| (q + 1).saturating_sub(win);
        let wb: Vec<i32> = (first..end).map(|q| (low(q) - wlo) as i32).collect();
        let nw: Vec<i32> = (first..end).map(|q| (q + 1 - low(q)) as i32).collect();
        let (wbp, nwp) = (self.put(slot::WB, &wb)?, self.put(slot::NW, &nw)?);
        let ratio = dl.comp.as_ref().map(|c| c.ratio);
        let entries = match ratio.and_then(|r| Some((r, end.checked_div(r)?))) {
            None => (0, 0, 0),
            Some((ratio, nvis_end)) => {
                let ms = (nvis_end as usize).max(1);
                // Every entry the queries can see has a block and lies inside the pool:
                // the device's selections are among them (its guard checks again).
                let be = t.buffer(l, Role::CompressedKey)?;
                let pool = t.model1(&be)?;
                let erows = t.entries(&be, 0..nvis_end)?;
                check_model1(&erows, pool.page, pool.pool_len).map_err(past_pool)?;
                let nvis: Vec<i32> = (first..end).map(|q| ((q + 1) / ratio) as i32).collect();
                let nvm1: Vec<i32> = nvis.iter().map(|v| v - 1).collect();
                let np = self.put(slot::NVM1, &nvm1)?;
                let scores = self.a(slot::SCORES);
                let use_index = i32::from(dl.index.is_some());
                if let Some(ix) = &dl.index {
                    self.index_scores(t, l, ix, &nvis, nvis_end, ms)?;
                }
                let (sel, nsel, rank) = (self.a(slot::SEL), self.a(slot::NSEL), self.a(slot::RANK));
                let (ms32, k32, n32) = (ms as i32, topk as i32, n as i32);
                let g = self.g();
                // SAFETY: `sel`, `rank`, `scores` hold n × ms, `nsel` n; np[t] < ms.
                unsafe {
                    dsa_kv_cuda::launch!(
                        g.compute(), &self.w.f.topk, blocks(n, 256), g.ordinal(), "m_topk";
                        &sel, &nsel, &rank, &scores, &ms32, &np, &k32, &use_index, &n32,
                    )
                }
                .map_err(s)?;
                // The sparse decode's extra_indices from the selection, on the device, and
                // the rows they name.
                let es = if dl.index.is_some() {
                    ms.min(topk as usize)
                } else {
                    ms
                };
                let table: Vec<i32> = t.p.block_slots.to_vec();
                let tp = self.put(slot::BT, &table)?;
                let rp = self.put(slot::ROWOF, &vec![0i32; n])?;
                let (extra, elen, ge, flag) = (
                    self.a(slot::EXTRA),
                    self.a(slot::ELEN),
                    self.a(slot::GE),
                    self.a(slot::FLAG),
                );
                let op = 2 * l as u32;
                let g = self.g();
                // SAFETY: SEL n × ms, NSEL and ROWOF n, BT one row of its blocks, EXTRA
                // n × es, ELEN n (sized by `size`); FLAG the request's flag.
                unsafe {
                    self.w.cache.extra_indices(
                        g.compute(),
                        g.ordinal(),
                        (sel, nsel, ms, rp, tp, table.len()),
                        be.converter,
                        u64::from(ratio),
                        es,
                        n,
                        (extra, elen),
                        Guard { flag, op },
                    )
                }
                .map_err(past)?;
                // SAFETY: EXTRA holds the n × es indices, GE n × es rows; the guard
                // refuses an index past the pool (none is: see `erows`).
                unsafe {
                    self.w.cache.model1_gather(
                        g.compute(),
                        g.ordinal(),
                        pool,
                        extra,
                        n * es,
                        ge,
                        Bounds::<i32>::Guard(Guard { flag, op: op + 1 }),
                    )
                }
                .map_err(past)?;
                (ge, elen, es)
            }
        };
        let (xn, x, pos) = (self.a(slot::XN), self.a(slot::X), self.a(slot::POS));
        let max_rows = win as usize + entries.2.max(1);
        self.attend(dl, n, xn, x, pos, (gw, wbp, nwp), entries, max_rows)
    }

    /// The indexer's scores of the n tokens over the visible entries (`SCORES`, n × ms).
    fn index_scores(
        &mut self,
        t: &Tables<'_>,
        l: usize,
        ix: &DevIndex,
        nvis: &[i32],
        nvis_end: u32,
        ms: usize,
    ) -> Result<(), Fail> {
        let c = self.w.model.config();
        let (h, ih, n) = (c.hidden, c.index_heads, nvis.len());
        let iw_rows = ih * INDEX_DIM;
        let (iq, iqbf, iqv, iqs, iqd, iw, xn, pos) = (
            self.a(slot::IQ),
            self.a(slot::IQBF),
            self.a(slot::IQV),
            self.a(slot::IQS),
            self.a(slot::IQD),
            self.a(slot::IW),
            self.a(slot::XN),
            self.a(slot::POS),
        );
        self.matvec8(iq, iw_rows, 0, &ix.w_q, iw_rows, h, xn, h, n)?;
        self.rope(iq, iw_rows, 0, ih, INDEX_DIM, pos, n, false)?;
        self.to_bf16(iqbf, iq, n * iw_rows)?;
        let g = self.g();
        // SAFETY: `iqbf` holds n·ih × 128 BF16, `iqv` n·ih × 128 bytes, `iqs` n·ih × 4.
        unsafe {
            g.kernels().quantize_indexer(
                g.compute(),
                g.ordinal(),
                iqbf,
                iqv,
                iqs,
                n * ih,
                false,
                true,
            )
        }
        .map_err(s)?;
        let nq = (n * ih) as i64;
        // SAFETY: `iqd` holds n·ih × 128 floats.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.w.f.dequant_fp8, grid(n * iw_rows), g.ordinal(), "v4_dequant_fp8";
                &iqd, &iqv, &iqs, &nq,
            )
        }
        .map_err(s)?;
        self.matvec8(iw, ih, 0, &ix.w_w, ih, h, xn, h, n)?;
        let b = t.buffer(l, Role::CompressedIndexKey)?;
        let rows = t.entries(&b, 0..nvis_end)?;
        let (cache, _, voff, soff) = t.keys(&b, &rows)?;
        let (vp, sp) = (self.put(slot::VOFF, &voff)?, self.put(slot::SOFF, &soff)?);
        let nv = self.put(slot::NVIS, nvis)?;
        let (scores, ms32, ih32, n32) = (self.a(slot::SCORES), ms as i32, ih as i32, n as i32);
        let g = self.g();
        // SAFETY: `scores` holds n × ms floats; nvis[t] ≤ nvis_end ≤ ms keys, each
        // offset checked to lie inside the pool.
        unsafe {
            dsa_kv_cuda::launch!(
                g.compute(), &self.w.f.index_scores, grid(n * ms), g.ordinal(), "v4_index_scores";
                &scores, &ms32, &nv, &iqd, &iw, &ih32, &cache, &vp, &sp, &n32,
            )
        }
        .map_err(s)
    }

    /// The logits of the n hidden states at `x`, on the host.
    fn logits(&mut self, x: u64, n: usize) -> Result<Vec<f32>, Fail> {
        let c = self.w.model.config();
        let (h, vocab) = (c.hidden, c.vocab);
        let (mn, lg) = (self.a(slot::MN), self.a(slot::LOGITS));
        self.rmsnorm8(mn, x, n, h)?;
        let w = self.w;
        self.matvec8(lg, vocab, 0, &w.w_out, vocab, h, mn, h, n)?;
        let mut out = vec![0f32; n * vocab];
        // SAFETY: `lg` holds n × vocab floats (download waits for the stream).
        unsafe { self.g().download_raw(lg, &mut out) }.map_err(s)?;
        Ok(out)
    }

    /// Sizes every working buffer of a request of n tokens at `first` (with `k` draft
    /// proposals) before its first launch.
    fn size(&mut self, first: u32, n: usize, k: usize) -> Result<(), Fail> {
        let c = self.w.model.config().clone();
        let end = first as usize + n;
        let (h, heads, ih, win) = (c.hidden, c.heads, c.index_heads, c.window as usize);
        let ratios = c.ratios.iter().filter(|&&r| r > 0);
        let vis = ratios.map(|&r| end / r as usize).max().unwrap_or(0).max(1);
        // The widest extra_indices of a layer: the top-k on an indexer layer, every
        // visible entry on a dense one.
        let es = (self.w.layers.iter())
            .filter_map(|l| {
                let v = end / l.comp.as_ref()?.ratio as usize;
                Some(if l.index.is_some() {
                    v.min(c.topk as usize)
                } else {
                    v
                })
            })
            .max()
            .unwrap_or(0)
            .max(1);
        let ne = n / 4 + 2;
        let gw = (end - (first as usize).saturating_sub(win - 1)).max(win + k);
        let f = 4;
        for (sl, bytes) in [
            (slot::X, n * h * f),
            (slot::XN, n * h * f),
            (slot::MN, n * h * f),
            (slot::C, n * LATENT * f),
            (slot::CBF, n * LATENT * 2),
            (slot::ST, n * 4 * LATENT * f),
            (slot::E, ne * LATENT * f),
            (slot::EBF, ne * LATENT * 2),
            (slot::KV, ne * INDEX_DIM),
            (slot::KS, ne * 4),
            (slot::GW, gw * LATENT * f),
            (slot::GE, n * es * LATENT * f),
            (slot::EXTRA, n * es * 4),
            (slot::ELEN, n * 4),
            (slot::FLAG, 8),
            (slot::SEL, n * vis * 4),
            (slot::NSEL, n * 4),
            (slot::RANK, n * vis * 4),
            (slot::SCORES, n * vis * f),
            (slot::IQ, n * ih * INDEX_DIM * f),
            (slot::IQBF, n * ih * INDEX_DIM * 2),
            (slot::IQV, n * ih * INDEX_DIM),
            (slot::IQS, n * ih * 4),
            (slot::IQD, n * ih * INDEX_DIM * f),
            (slot::IW, n * ih * f),
            (slot::Q, n * heads * LATENT * f),
            (slot::O, n * heads * LATENT * f),
            (slot::ATT, n * h * f),
            (slot::HM, n * c.mlp * f),
            (slot::LOGITS, n * c.vocab * f),
            (slot::HCH, h * f),
            (slot::CX, n * h * f),
            (slot::CXN, n * h * f),
        ] {
            self.arena.ensure(sl, bytes).map_err(s)?;
        }
        Ok(())
    }

    /// One planned request: `(outputs, drafts accepted, tokens kept, proposals)`.
    fn request(
        &mut self,
        pools: &WindowedView,
        p: &PlannedRequest,
    ) -> Result<(Vec<TokenOut>, usize, usize, Vec<u32>), Fail> {
        let w = self.w;
        let model = &w.model;
        let cfg = model.config();
        let blocks = p
            .block_slots
            .iter()
            .map(|&b| u32::try_from(b).map(dsa_kv_core::ids::SlotId))
            .collect::<Result<_, _>>()
            .map_err(|_| "a negative block slot in the plan".to_string())?;
        let t = Tables { pools, p, blocks };
        if p.window_tables.len() != t.pools.window_life_cycles() {
            return Err(format!(
                "{} window tables for {} window life cycles",
                p.window_tables.len(),
                t.pools.window_life_cycles()
            ));
        }
        let tokens: Vec<u32> = p.tokens.iter().map(|t| t.0).collect();
        let n = tokens.len();
        if n == 0 {
            return Err("a planned request with no tokens".into());
        }
        let k = if p.produces_token && cfg.mtp {
            p.next_drafts as usize
        } else {
            0
        };
        let first = p.num_cached;
        let reach = u64::from(first) + n as u64 + k as u64;
        if reach > u64::from(self.w.max_positions) {
            return Err(format!(
                "positions up to {reach} (with {k} proposals) pass the device's {} (its \
                 max_positions)",
                self.w.max_positions
            ));
        }
        self.size(first, n, k)?;
        let flag = self.a(slot::FLAG);
        // SAFETY: FLAG holds 8 bytes (sized above).
        unsafe { self.g().memset_raw(flag, 8, 0xff) }.map_err(s)?;
        let pos: Vec<i32> = (first..first + n as u32).map(|q| q as i32).collect();
        let tok = self.put(slot::TOK, &tokens)?;
        let pp = self.put(slot::POS, &pos)?;
        let (x, xn) = (self.a(slot::X), self.a(slot::XN));
        let h = cfg.hidden;
        self.embed(x, tok, n)?;
        for l in 0..cfg.ratios.len() {
            self.rmsnorm8(xn, x, n, h)?;
            self.write_layer(&t, l, first, n)?;
            self.attend_layer(&t, l, first, n)?;
        }
        let logits = self.logits(x, n)?;
        let mut word = [0u64];
        // SAFETY: FLAG holds the request's 8-byte flag (the logits' download waited for
        // every op before it).
        unsafe { self.g().download_raw(flag, &mut word) }.map_err(s)?;
        if let Some(f) = GuardFailure::decode(word[0]) {
            let (layer, what) = (f.op / 2, f.op % 2);
            let at = if what == 0 {
                format!("extra_indices of position {}", first as usize + f.token)
            } else {
                format!("row {} of the entries' gather", f.token)
            };
            return Err(format!(
                "layer {layer}: the device refused {at}: a compressed entry the selection \
                 names is not in the request's block table, its row is past the pool, or \
                 the selection is wider than the index lists"
            ));
        }
        let outs: Vec<TokenOut> = logits
            .chunks_exact(cfg.vocab)
            .enumerate()
            .map(|(i, lg)| output_of(lg, first + i as u32))
            .collect();
        let (accepted, kept) = verdict(p.kind, &tokens, &outs);
        let mut drafts = Vec::new();
        if cfg.mtp {
            // The MTP layer's rows of the kept tokens (the host's `draft_write`).
            let mtp = model.mtp_layer();
            let b = t.buffer(mtp, Role::WindowKey)?;
            let idx = t.ring(&b, first..first + kept as u32)?;
            let (cx, cxn) = (self.a(slot::CX), self.a(slot::CXN));
            self.embed(cx, tok, kept)?;
            self.rmsnorm8(cxn, cx, kept, h)?;
            self.write_rows(&w.draft.w_kv, cxn, kept, pp, t.model1(&b)?, &idx)?;
            if k > 0 {
                let last = first + kept as u32 - 1;
                drafts = self.propose(&t, last, kept - 1, outs[kept - 1].greedy, k)?;
            }
        }
        Ok((outs, accepted, kept, drafts))
    }

    /// The MTP layer's `k` proposals after `last` (the host's `propose`): the chain's
    /// hidden state starts as row `row` of `X`; each proposal's own window row goes to an
    /// overlay page and is read back from there.
    fn propose(
        &mut self,
        t: &Tables<'_>,
        last: u32,
        row: usize,
        next: u32,
        k: usize,
    ) -> Result<Vec<u32>, Fail> {
        let cfg = self.w.model.config().clone();
        let (h, win) = (cfg.hidden, cfg.window);
        let w = self.w;
        let draft = &w.draft;
        let b = t.buffer(self.w.model.mtp_layer(), Role::WindowKey)?;
        let pool = t.model1(&b)?;
        if k > pool.page.entries as usize {
            return Err(format!(
                "{k} proposals: the overlay page holds {}",
                pool.page.entries
            ));
        }
        let ovl = self
            .arena
            .ensure(slot::OVL, pool.page.page_bytes() as usize)
            .map_err(s)?;
        let overlay = Model1Pool {
            pool: ovl,
            pool_len: pool.page.page_bytes(),
            page: pool.page,
        };
        let wlo = (last + 1).saturating_sub(win - 1);
        let rows = t.ring(&b, wlo..last + 1)?;
        let gw = self.a(slot::GW);
        self.gather(pool, &rows, slot::GWIDX, gw)?;
        let (hch, cx, cxn, x) = (
            self.a(slot::HCH),
            self.a(slot::CX),
            self.a(slot::CXN),
            self.a(slot::X),
        );
        // SAFETY: both are hidden-state rows of h floats inside their buffers.
        unsafe { self.g().copy_raw(hch, x + (row * h * 4) as u64, h * 4) }.map_err(s)?;
        let mn = self.a(slot::MN);
        let (mut tok, mut out) = (next, Vec::with_capacity(k));
        for i in 0..k {
            let pos = last + 1 + i as u32;
            let tp = self.put(slot::CTOK, &[tok])?;
            let pp = self.put(slot::CPOS, &[pos as i32])?;
            self.embed(cx, tp, 1)?;
            self.rmsnorm8(cxn, cx, 1, h)?;
            self.write_rows(&draft.w_kv, cxn, 1, pp, overlay, &[i as i64])?;
            self.gather(
                overlay,
                &[i as i64],
                slot::CGIDX,
                gw + ((pos - wlo) as usize * LATENT * 4) as u64,
            )?;
            self.rmsnorm8(mn, hch, 1, h)?;
            self.add(cx, mn, h)?;
            self.rmsnorm8(cxn, cx, 1, h)?;
            let low = (pos + 1).saturating_sub(win);
            let wb = self.put(slot::CWB, &[(low - wlo) as i32])?;
            let nw = self.put(slot::CNW, &[(pos + 1 - low) as i32])?;
            self.attend(draft, 1, cxn, cx, pp, (gw, wb, nw), (0, 0, 1), win as usize)?;
            let lg = self.logits(cx, 1)?;
            tok = output_of(&lg, pos).greedy;
            out.push(tok);
            // SAFETY: as above.
            unsafe { self.g().copy_raw(hch, cx, h * 4) }.map_err(s)?;
        }
        Ok(out)
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
