//! Launch wrappers of the kernels in `kernels/*.cu`. Each kernel's host reference is
//! named on its wrapper; the GPU tests prove byte equality on random inputs.
//!
//! Launch geometry is chosen for bandwidth: a warp per token for the row kernels (16-byte
//! vector moves, 8 tokens per 256-thread block), `width / 16` lanes per token for the
//! indexer kernels, 16 lanes per token and 4 tokens per warp for the FP8 indexer
//! quantizer, and a `(chunks, tasks)` grid of 64 KiB chunks for the batched copy,
//! so a handful of large copies still fills every SM.
//!
//! The wrappers take raw device addresses (pools are VMM mappings, not `CudaSlice`s), so
//! they are `unsafe`: the caller guarantees every address is valid for the sizes given.
//! Kernels never write outside `cache_len` / `pool_len`.

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};

use super::CudaError;
use dsa_kv_core::config::KvDtype;
use dsa_kv_device::forward::{MlaCacheView, RowsView};

/// Launches a kernel: `launch!(stream, function, config, device, "what"; &arg, …)` pushes
/// the arguments in order onto a launch of `function` on `stream` with `config`, and
/// evaluates to `Result<(), CudaError>` (a driver error becomes [`CudaError::Driver`]
/// naming `device` and `what`). Every hand-written launch of the workspace goes through
/// it, the reference model's too.
///
/// Each argument is a reference to a value of the type its parameter in the kernel's
/// `.cu` signature has (`&u64` for a device pointer or a `uint64_t`, `&i32` for an `int`,
/// …): the macro checks neither their number nor their types against the kernel, and the
/// `.cu` signatures are the contract. The launch itself is `unsafe`
/// (`cudarc::driver::LaunchArgs::launch`): write the macro inside an `unsafe` block whose
/// `// SAFETY:` says why every address is valid for what the kernel reads and writes (the
/// macro opens no `unsafe` block of its own, so outside one it does not compile).
///
/// ```no_run
/// use dsa_kv_cuda::cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};
/// use dsa_kv_cuda::CudaError;
///
/// /// Runs `fill(int* out, int n)` over `n` elements at `out` on device 0.
/// fn fill(stream: &CudaStream, f: &CudaFunction, out: u64, n: i32) -> Result<(), CudaError> {
///     let cfg = LaunchConfig::for_num_elems(n as u32);
///     // SAFETY: `out` holds `n` i32 on the stream's device.
///     unsafe { dsa_kv_cuda::launch!(stream, f, cfg, 0, "fill"; &out, &n) }
/// }
/// ```
#[macro_export]
macro_rules! launch {
    ($stream:expr, $func:expr, $cfg:expr, $device:expr, $what:expr; $($arg:expr),+ $(,)?) => {{
        use $crate::cudarc::driver::PushKernelArg as _;
        let mut args = $stream.launch_builder($func);
        $(args.arg($arg);)+
        args.launch($cfg)
            .map(|_| ())
            .map_err(|e| $crate::driver_error($device, $what, e))
    }};
}

const BLOCK: u32 = 256;
/// Bytes one CTA of the batched copy moves.
pub const COPY_CHUNK: u64 = 64 << 10;

/// The loaded kernel functions of one device.
pub struct Kernels {
    quantize_indexer_fp8: CudaFunction,
    quantize_indexer_fp4: CudaFunction,
    indexer_k_scatter: CudaFunction,
    indexer_k_gather: CudaFunction,
    guard_offsets: CudaFunction,
    guard_rows: CudaFunction,
    mla_scatter_bf16: CudaFunction,
    mla_scatter_fp8: CudaFunction,
    mla_scatter_fp8_ds_mla: CudaFunction,
    mla_scatter_nvfp4: CudaFunction,
    topk_to_global: CudaFunction,
    dense_topk: CudaFunction,
    recompute_slot_mappings: CudaFunction,
    apply_metadata_upload: CudaFunction,
    batched_copy: CudaFunction,
    selfcheck_e4m3: CudaFunction,
}

/// Where a layer's rows sit in a pool: `pool + base + (slot / T) × block_stride +
/// (slot mod T) × row_bytes` (see [`dsa_kv_core::ops::mla::RowView`]).
#[derive(Clone, Copy, Debug)]
pub struct DevRows {
    /// Pool base address.
    pub pool: u64,
    /// Pool size in bytes (rows past it are skipped).
    pub pool_len: u64,
    /// Byte offset of the layer's first page in a slot.
    pub base: u64,
    /// Slot size in bytes.
    pub block_stride: u64,
    /// Tokens per block.
    pub tokens_per_block: u32,
}

impl DevRows {
    /// A cache view's rows as the kernels address them.
    pub fn of(r: &RowsView) -> DevRows {
        DevRows {
            pool: r.pool.addr,
            pool_len: r.pool.bytes,
            base: r.base - r.pool.addr,
            block_stride: r.page_stride,
            tokens_per_block: r.tokens_per_page,
        }
    }
}

/// A step's fail flag (`kernels/guard.cu`): a guarded scatter first checks every mapping
/// of its batch and refuses the whole batch, and every later guarded op, once one is out
/// of range. `op` numbers the guarded ops of a step in launch order.
#[derive(Clone, Copy, Debug)]
pub struct Guard {
    /// Device address of the step's 64-bit flag (all ones: nothing failed).
    pub flag: u64,
    /// This op's number in the step.
    pub op: u32,
}

/// What a set fail flag says: the first out-of-range token of the first failing op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuardFailure {
    /// The op's number ([`Guard::op`]).
    pub op: u32,
    /// The token (index in the op's batch).
    pub token: usize,
    /// 0: the value / data row, 1: the scale word / scale row.
    pub which: u32,
}

impl GuardFailure {
    /// Decodes a flag read back from the device (`None`: nothing failed).
    pub fn decode(flag: u64) -> Option<GuardFailure> {
        (flag != u64::MAX).then_some(GuardFailure {
            op: (flag >> 32) as u32,
            token: ((flag as u32) >> 1) as usize,
            which: flag as u32 & 1,
        })
    }
}

/// An MLA row encoding to write.
#[derive(Clone, Copy, Debug)]
pub enum MlaEncoding {
    /// 1152-byte BF16 rows.
    Bf16,
    /// 576-byte FP8 rows with a per-tensor scale.
    Fp8 {
        /// The scale.
        tensor_scale: f32,
    },
    /// 656-byte `fp8_ds_mla` rows.
    Fp8DsMla {
        /// Power-of-two (UE8M0) tile scales.
        ue8m0: bool,
    },
    /// 288-byte NVFP4 rows plus 36-byte block-scale rows in a second view.
    Nvfp4 {
        /// The block-scale view.
        scales: DevRows,
    },
}

impl MlaEncoding {
    /// The encoding the kernels write a layer's MLA cache in (`fp8_ds_mla` with UE8M0
    /// tile scales), checked against the view's row size. The error says what is missing
    /// or different.
    pub fn of(m: &MlaCacheView) -> Result<MlaEncoding, String> {
        let enc = match m.encoding {
            KvDtype::Bf16 => MlaEncoding::Bf16,
            KvDtype::Fp8 => MlaEncoding::Fp8 {
                tensor_scale: m.fp8_tensor_scale,
            },
            KvDtype::Fp8DsMla => MlaEncoding::Fp8DsMla { ue8m0: true },
            KvDtype::Nvfp4 => MlaEncoding::Nvfp4 {
                scales: DevRows::of(
                    m.block_scales
                        .as_ref()
                        .ok_or("an NVFP4 cache without its block-scale buffer")?,
                ),
            },
        };
        if enc.row_bytes() != m.rows.row_bytes {
            return Err(format!(
                "rows of {} B; the kernels write {} B for {:?}",
                m.rows.row_bytes,
                enc.row_bytes(),
                m.encoding
            ));
        }
        Ok(enc)
    }

    /// Bytes of one row in the main view.
    pub fn row_bytes(&self) -> u32 {
        match self {
            MlaEncoding::Bf16 => 1152,
            MlaEncoding::Fp8 { .. } => 576,
            MlaEncoding::Fp8DsMla { .. } => 656,
            MlaEncoding::Nvfp4 { .. } => 288,
        }
    }
}

fn cfg(threads: u64) -> LaunchConfig {
    let blocks = threads.div_ceil(u64::from(BLOCK)).max(1);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Tokens one warp of `quantize_indexer_fp8` quantizes (`2 * FP8_PAIRS` in quant.cu).
const QUANT_FP8_TOKENS_PER_WARP: u64 = 4;

/// Vectors each thread of the indexer kernels moves (`VEC_PER_THREAD` in indexer.cu).
const INDEXER_VEC_PER_THREAD: u64 = 2;

/// Below this many vectors a thread moves one (more threads for small batches).
const INDEXER_ONE_VEC_BELOW: u64 = 1 << 20;

fn indexer_cfg(device: usize, n: usize, width: usize) -> Result<LaunchConfig, CudaError> {
    let vectors = n as u64 * (width as u64 / 16);
    as_i32(
        device,
        "indexer vectors (tokens x width / 16)",
        vectors as usize,
    )?;
    let per_thread = if vectors < INDEXER_ONE_VEC_BELOW {
        1
    } else {
        INDEXER_VEC_PER_THREAD
    };
    Ok(cfg(vectors.div_ceil(per_thread)))
}

fn as_i32(device: usize, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Invalid {
        device,
        what: format!("{what} = {v} does not fit the kernels' int32 argument; split the batch"),
    })
}

impl Kernels {
    pub(super) fn load(
        load: impl Fn(&'static str) -> Result<CudaFunction, CudaError>,
    ) -> Result<Self, CudaError> {
        Ok(Kernels {
            quantize_indexer_fp8: load("quantize_indexer_fp8")?,
            quantize_indexer_fp4: load("quantize_indexer_fp4")?,
            indexer_k_scatter: load("indexer_k_scatter")?,
            guard_offsets: load("guard_offsets")?,
            guard_rows: load("guard_rows")?,
            indexer_k_gather: load("indexer_k_gather")?,
            mla_scatter_bf16: load("mla_scatter_bf16")?,
            mla_scatter_fp8: load("mla_scatter_fp8")?,
            mla_scatter_fp8_ds_mla: load("mla_scatter_fp8_ds_mla")?,
            mla_scatter_nvfp4: load("mla_scatter_nvfp4")?,
            topk_to_global: load("topk_to_global")?,
            dense_topk: load("dense_topk")?,
            recompute_slot_mappings: load("recompute_slot_mappings")?,
            apply_metadata_upload: load("apply_metadata_upload")?,
            batched_copy: load("batched_copy")?,
            selfcheck_e4m3: load("selfcheck_e4m3")?,
        })
    }

    /// Quantizes `n` indexer keys (128 BF16 each at `keys`) to FP8 (`fp4 = false`, 128
    /// value bytes and a 4-byte f32 scale per token; `ue8m0`: power-of-two scales) or
    /// FP4 (64 value bytes and four UE8M0 exponents). Reference:
    /// [`dsa_kv_core::ops::quant::quantize_fp8_token`], [`dsa_kv_core::ops::quant::quantize_fp4_token`].
    ///
    /// # Safety
    /// `keys` holds `n × 256` bytes, `values` `n × width`, `scales` `n × 4`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn quantize_indexer(
        &self,
        stream: &CudaStream,
        device: usize,
        keys: u64,
        values: u64,
        scales: u64,
        n: usize,
        fp4: bool,
        ue8m0: bool,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        let n32 = as_i32(device, "tokens", n)?;
        let what = "quantize_indexer";
        // SAFETY (both branches): the caller's contract (above) covers every address.
        if fp4 {
            let (f, c) = (&self.quantize_indexer_fp4, cfg(n as u64 * 32));
            unsafe { crate::launch!(stream, f, c, device, what; &keys, &values, &scales, &n32) }
        } else {
            let c = cfg((n as u64).div_ceil(QUANT_FP8_TOKENS_PER_WARP) * 32);
            let (f, ue) = (&self.quantize_indexer_fp8, i32::from(ue8m0));
            unsafe {
                crate::launch!(stream, f, c, device, what; &keys, &values, &scales, &n32, &ue)
            }
        }
    }

    /// Writes `n` indexer tokens into one layer's cache view (`cache`, `cache_len`
    /// bytes) at the byte offsets `vmap` / `smap` (negative: skip). Reference:
    /// [`dsa_kv_core::ops::indexer_k::indexer_k_scatter`]. With a `guard`, a batch with an
    /// out-of-range mapping writes nothing and sets the step's fail flag.
    ///
    /// # Safety
    /// `values` holds `n × width` bytes, `scales` `n × 4`, the maps `n` i64 each, and
    /// `cache .. cache + cache_len` is device memory.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn indexer_k_scatter(
        &self,
        stream: &CudaStream,
        device: usize,
        cache: u64,
        cache_len: u64,
        values: u64,
        scales: u64,
        vmap: u64,
        smap: u64,
        n: usize,
        width: usize,
        guard: Option<Guard>,
    ) -> Result<(), CudaError> {
        check_width(device, width)?;
        if n == 0 {
            return Ok(());
        }
        let (n32, w32) = (as_i32(device, "tokens", n)?, width as i32);
        if let Some(g) = guard {
            for (map, bytes, which) in [(vmap, width as u32, 0u32), (smap, 4, 1)] {
                // SAFETY: the guard reads the `n` mappings and writes the step's flag.
                unsafe {
                    crate::launch!(
                        stream, &self.guard_offsets, cfg(n as u64), device, "guard_offsets";
                        &map, &n32, &bytes, &cache_len, &g.op, &which, &g.flag,
                    )
                }?;
            }
        }
        let fail = guard.map_or(0u64, |g| g.flag);
        let c = indexer_cfg(device, n, width)?;
        // SAFETY: the caller's contract (above) covers every address.
        unsafe {
            crate::launch!(
                stream, &self.indexer_k_scatter, c, device, "indexer_k_scatter";
                &cache, &values, &scales, &vmap, &smap, &n32, &w32, &cache_len, &fail,
            )
        }
    }

    /// Reads tokens `[start, start + n)` of the mappings into contiguous `values` /
    /// `scales` (negative mapping: zeros). Reference:
    /// [`dsa_kv_core::ops::indexer_k::indexer_k_gather`].
    ///
    /// # Safety
    /// As for the scatter; the maps hold at least `start + n` entries.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn indexer_k_gather(
        &self,
        stream: &CudaStream,
        device: usize,
        cache: u64,
        cache_len: u64,
        vmap: u64,
        smap: u64,
        start: usize,
        n: usize,
        width: usize,
        values: u64,
        scales: u64,
    ) -> Result<(), CudaError> {
        check_width(device, width)?;
        if n == 0 {
            return Ok(());
        }
        let (n32, w32, s64) = (as_i32(device, "tokens", n)?, width as i32, start as i64);
        let c = indexer_cfg(device, n, width)?;
        // SAFETY: the caller's contract (above) covers every address.
        unsafe {
            crate::launch!(
                stream, &self.indexer_k_gather, c, device, "indexer_k_gather";
                &cache, &vmap, &smap, &s64, &n32, &w32, &cache_len, &values, &scales,
            )
        }
    }

    /// Encodes `n` 576-element BF16 rows (`rows`) and writes them at token slots `slots`
    /// (i64, negative: skip). Reference: [`dsa_kv_core::ops::mla`]. With a `guard`, a batch
    /// with a row past its pool writes nothing and sets the step's fail flag.
    ///
    /// # Safety
    /// `rows` holds `n × 1152` bytes, `slots` `n` i64, and the views describe device
    /// memory.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn mla_scatter(
        &self,
        stream: &CudaStream,
        device: usize,
        view: DevRows,
        enc: MlaEncoding,
        rows: u64,
        slots: u64,
        n: usize,
        guard: Option<Guard>,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        let n32 = as_i32(device, "tokens", n)?;
        let c = cfg(n as u64 * 32);
        let (pool, len, base, stride, tpb) = (
            view.pool,
            view.pool_len,
            view.base,
            view.block_stride,
            view.tokens_per_block,
        );
        if let Some(g) = guard {
            let mut views = vec![(view, enc.row_bytes(), 0u32)];
            if let MlaEncoding::Nvfp4 { scales } = enc {
                views.push((scales, 36, 1));
            }
            for (v, row_bytes, which) in views {
                // SAFETY: the guard reads the `n` slots and writes the step's flag.
                unsafe {
                    crate::launch!(
                        stream, &self.guard_rows, cfg(n as u64), device, "guard_rows";
                        &slots, &n32, &v.base, &v.block_stride, &v.tokens_per_block,
                        &row_bytes, &v.pool_len, &g.op, &which, &g.flag,
                    )
                }?;
            }
        }
        let fail = guard.map_or(0u64, |g| g.flag);
        let what = "mla_scatter";
        // SAFETY (every arm): the caller's contract (above) covers every address.
        match enc {
            MlaEncoding::Bf16 => unsafe {
                crate::launch!(
                    stream, &self.mla_scatter_bf16, c, device, what;
                    &pool, &rows, &slots, &n32, &base, &stride, &tpb, &len, &fail,
                )
            },
            MlaEncoding::Fp8 { tensor_scale } => unsafe {
                crate::launch!(
                    stream, &self.mla_scatter_fp8, c, device, what;
                    &pool, &rows, &slots, &n32, &base, &stride, &tpb, &len, &tensor_scale,
                    &fail,
                )
            },
            MlaEncoding::Fp8DsMla { ue8m0 } => {
                let ue = i32::from(ue8m0);
                unsafe {
                    crate::launch!(
                        stream, &self.mla_scatter_fp8_ds_mla, c, device, what;
                        &pool, &rows, &slots, &n32, &base, &stride, &tpb, &len, &ue, &fail,
                    )
                }
            }
            MlaEncoding::Nvfp4 { scales } => unsafe {
                crate::launch!(
                    stream, &self.mla_scatter_nvfp4, c, device, what;
                    &pool, &scales.pool, &rows, &slots, &n32, &base, &stride, &scales.base,
                    &scales.block_stride, &tpb, &len, &scales.pool_len, &fail,
                )
            },
        }
    }

    /// Top-k → global row ids. Reference: [`dsa_kv_core::ops::topk::topk_to_global`] (a
    /// `row_request` outside the table gives −1 here instead of an error).
    ///
    /// # Safety
    /// `topk` and `out` hold `rows × k` i32, `row_request` `rows` i32, `block_table`
    /// `table_rows × max_blocks` i32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn topk_to_global(
        &self,
        stream: &CudaStream,
        device: usize,
        topk: u64,
        k: usize,
        row_request: u64,
        rows: usize,
        block_table: u64,
        table_rows: usize,
        max_blocks: usize,
        params: dsa_kv_core::ops::topk::PrimaryPageParams,
        out: u64,
    ) -> Result<(), CudaError> {
        if rows == 0 || k == 0 {
            return Ok(());
        }
        let total = rows as u64 * k as u64;
        as_i32(device, "top-k entries", total as usize)?;
        let (k32, r32, tr32, mb32) = (
            k as i32,
            rows as i32,
            as_i32(device, "table rows", table_rows)?,
            as_i32(device, "max blocks", max_blocks)?,
        );
        let (t, s, o) = (
            params.tokens_per_block as i32,
            params.scale as i32,
            params.layer_offset as i32,
        );
        // SAFETY: the caller's contract (above) covers every address.
        unsafe {
            crate::launch!(
                stream, &self.topk_to_global, cfg(total), device, "topk_to_global";
                &topk, &k32, &row_request, &r32, &block_table, &tr32, &mb32, &t, &s, &o, &out,
            )
        }
    }

    /// Dense short-sequence top-k. Reference: [`dsa_kv_core::ops::topk::dense_topk`].
    ///
    /// # Safety
    /// `kv_lens` holds `rows` i32, `out` `rows × k` i32.
    pub unsafe fn dense_topk(
        &self,
        stream: &CudaStream,
        device: usize,
        kv_lens: u64,
        rows: usize,
        k: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        if rows == 0 || k == 0 {
            return Ok(());
        }
        let total = rows as u64 * k as u64;
        as_i32(device, "top-k entries", total as usize)?;
        let (r32, k32) = (rows as i32, k as i32);
        // SAFETY: the caller's contract (above) covers every address.
        unsafe {
            crate::launch!(
                stream, &self.dense_topk, cfg(total), device, "dense_topk";
                &kv_lens, &r32, &k32, &out,
            )
        }
    }

    /// Recomputes the slot mappings of `n` new tokens from per-request cached lengths on
    /// the device. Reference: [`dsa_kv_core::metadata::StepMetadata::recompute_slot_mappings`].
    ///
    /// # Safety
    /// Every address holds the entries its role needs (see `kernels/slots.cu`).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn recompute_slot_mappings(
        &self,
        stream: &CudaStream,
        device: usize,
        tables: RecomputeTables,
        layout: &dsa_kv_core::metadata::MetadataLayout,
        n: usize,
        out_value: u64,
        out_scale: u64,
        out_mla: u64,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        let n32 = as_i32(device, "tokens", n)?;
        let mb = as_i32(device, "max blocks", tables.max_blocks)?;
        let tpb = layout.tokens_per_block as i32;
        let scale = layout.indexer_page_scale as i32;
        let (page_bytes, data, sc, has) = match layout.indexer {
            Some(ix) => (
                i64::from(ix.tokens_per_block) * i64::from(ix.data_bytes + ix.scale_bytes),
                ix.data_bytes as i32,
                ix.scale_bytes as i32,
                1i32,
            ),
            None => (0, 0, 0, 0),
        };
        let f = &self.recompute_slot_mappings;
        // SAFETY: the caller's contract (above) covers every address.
        unsafe {
            crate::launch!(
                stream, f, cfg(n as u64), device, "recompute_slot_mappings";
                &tables.indexer_table, &mb, &tables.num_cached, &tables.req_idx,
                &tables.token_start, &n32, &tpb, &scale, &page_bytes, &data, &sc, &has,
                &out_value, &out_scale, &out_mla,
            )
        }
    }

    /// Applies one step-metadata upload from `area` (device memory holding what the
    /// host staged): `segments` copies laid out at the area's start (16 bytes each:
    /// destination address, source offset in the area, 4-byte words), then `pairs`
    /// page-table cells `(cell, value)` at `pairs_off` (bit 31 of the cell picks table
    /// `b` over `a`). `widest` is the most words (or pairs) of any one of them. Reference:
    /// the host buffers (`DeviceMetadata::upload` makes the device's equal to them).
    ///
    /// # Safety
    /// `area` holds the segments, their sources and the pairs; every destination holds
    /// its words; every pair's index is inside its table.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn apply_metadata_upload(
        &self,
        stream: &CudaStream,
        device: usize,
        area: u64,
        segments: usize,
        pairs_off: usize,
        pairs: usize,
        widest: usize,
        tables: (u64, u64),
    ) -> Result<(), CudaError> {
        let rows = segments + usize::from(pairs > 0);
        if rows == 0 {
            return Ok(());
        }
        let nseg = as_i32(device, "metadata segments", segments)?;
        let off = as_i32(device, "metadata pair offset", pairs_off)?;
        let n = as_i32(device, "page-table cells", pairs)?;
        let blocks = (widest as u64).div_ceil(u64::from(BLOCK)).clamp(1, 128) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, rows as u32, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = &self.apply_metadata_upload;
        // SAFETY: the caller's contract (above) covers every address.
        unsafe {
            crate::launch!(
                stream, f, cfg, device, "apply_metadata_upload";
                &area, &nseg, &off, &n, &tables.0, &tables.1,
            )
        }
    }

    /// Runs `tasks` copies of `bytes` bytes each (a multiple of 16): task `i` moves
    /// `src[i]` → `dst[i]`, where `dst` / `src` are device arrays of u64 addresses (any
    /// mix of this GPU's memory, a peer's, and mapped pinned host memory). Reference:
    /// [`dsa_kv_core::ops::copy_slots_between`].
    ///
    /// # Safety
    /// Every address range is valid; destinations do not overlap each other or any
    /// source of the same launch.
    pub unsafe fn batched_copy(
        &self,
        stream: &CudaStream,
        device: usize,
        dst: u64,
        src: u64,
        tasks: usize,
        bytes: u64,
    ) -> Result<(), CudaError> {
        if !bytes.is_multiple_of(16) {
            return Err(CudaError::Invalid {
                device,
                what: format!("batched copy of {bytes} bytes per task: must be a multiple of 16"),
            });
        }
        if tasks == 0 || bytes == 0 {
            return Ok(());
        }
        let chunks = bytes.div_ceil(COPY_CHUNK).clamp(1, 1 << 16) as i32;
        let bytes64 = bytes as i64;
        let mut at = 0;
        // grid.y is limited to 65535 tasks per launch.
        while at < tasks {
            let now = (tasks - at).min(65_535);
            let (d, s) = (dst + at as u64 * 8, src + at as u64 * 8);
            let c = LaunchConfig {
                grid_dim: (chunks as u32, now as u32, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the caller's contract (above) covers every address.
            unsafe {
                crate::launch!(
                    stream, &self.batched_copy, c, device, "batched_copy";
                    &d, &s, &bytes64, &chunks,
                )
            }?;
            at += now;
        }
        Ok(())
    }
}

impl Kernels {
    /// Compares the fast paths the kernels use with their references on all 2^32 f32 bit
    /// patterns `x`: the hardware E4M3 conversion with the integer `f32_to_e4m3` (in
    /// common.cuh, mirrored by [`dsa_kv_core::ops::quant::f32_to_e4m3`]), and the closed-form
    /// UE8M0 tile scale of `fp8_ds_mla` and its reciprocal, for the amax `|x|`, with
    /// `block_scale` (mirrored by [`dsa_kv_core::ops::quant::block_scale`]) and `__frcp_rn`;
    /// returns `(mismatches, one mismatching pattern)`.
    pub fn selfcheck_e4m3(&self, gpu: &super::Gpu) -> Result<(u64, u32), CudaError> {
        let dev = gpu.ordinal();
        let out = super::DeviceBuffer::zeroed(gpu, 16, "self-check counters")?;
        let stream = gpu.compute();
        for half in 0..2u32 {
            let (base, count) = (half << 31, 1u32 << 31);
            let (m, ex) = (out.ptr(), out.ptr() + 8);
            // SAFETY: the counters buffer holds a u64 and a u32.
            unsafe {
                crate::launch!(
                    stream, &self.selfcheck_e4m3, cfg(u64::from(count)), dev, "selfcheck_e4m3";
                    &base, &count, &m, &ex,
                )
            }?;
        }
        let mut v = [0u64; 2];
        gpu.download(&out, &mut v)?;
        Ok((v[0], v[1] as u32))
    }
}

/// Device inputs of [`Kernels::recompute_slot_mappings`].
#[derive(Clone, Copy, Debug)]
pub struct RecomputeTables {
    /// Indexer page table, `[requests × max_blocks]` i32.
    pub indexer_table: u64,
    /// Columns of the table.
    pub max_blocks: usize,
    /// Cached length per request (i32).
    pub num_cached: u64,
    /// Request of each new token (i32).
    pub req_idx: u64,
    /// First new-token index of each request (i32).
    pub token_start: u64,
}

fn check_width(device: usize, width: usize) -> Result<(), CudaError> {
    if width != 128 && width != 64 {
        return Err(CudaError::Invalid {
            device,
            what: format!("indexer payload width {width} B: use 128 (FP8) or 64 (FP4)"),
        });
    }
    Ok(())
}
