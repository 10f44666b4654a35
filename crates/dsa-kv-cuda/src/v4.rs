//! DeepSeek-V4's cache kernels (`kernels/v4.cu`) and their host twins: the MODEL1
//! quantize-and-scatter and gather, the compressor-state scatter, and the maps that let
//! the V3.2 indexer scatter write V4's entry keys.
//!
//! * [`V4Kernels::model1_scatter`]: BF16 rows `[n, 512]` (448 NoPE, 64 RoPE values) →
//!   FlashMLA's 584-byte MODEL1 rows ([`quantize_model1_row`]) at kernel row indices
//!   `page × E + i` of a pool of [`Model1PageLayout`] pages; −1 skips.
//! * [`V4Kernels::model1_gather`]: rows at int32 kernel row indices → f32 `[n, 512]`
//!   ([`dequantize_model1_row`]); −1 gives zeros.
//! * [`V4Kernels::state_scatter`]: fp32 state rows of `row_bytes` at `row × row_bytes`.
//! * [`V4Kernels::extra_indices`]: the sparse decode's `extra_indices` /
//!   `extra_topk_length` from each token's selected entries through its request's
//!   block table ([`extra_indices_host`]: the `metadata::v4` reference per token).
//! * Indexer keys of compressed entries: the same bytes as the V3.2 indexer K pages
//!   (`IndexerPageLayout { 64, 128, 4 }`), so [`crate::Kernels::indexer_k_scatter`] and
//!   `indexer_k_gather` write and read them unchanged, at the byte offsets
//!   [`entry_key_maps`] derives from the entry rows.
//!
//! Every launch fails closed ([`Bounds`]): the indices are checked on the host before the
//! launch (a typed [`V4KernelError::OutOfBounds`], nothing launched), or were checked
//! already ([`Checked`]), or a guard kernel checks them on the device and sets the step's
//! fail flag (`kernels/guard.cu`), after which the kernel writes nothing. The kernels
//! themselves never touch a byte past `pool_len` either way.
//!
//! The host twins ([`model1_scatter_host`], [`model1_gather_host`],
//! [`state_scatter_host`]) apply the core references to whole pools with the same checks;
//! the GPU tests compare the kernels with them byte for byte.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig};
use cudarc::nvrtc::Ptx;
use dsa_kv_core::ids::SlotId;
use dsa_kv_core::layout::{
    IndexerPageLayout, Model1PageLayout, PageIndexConverter, MODEL1_DATA_BYTES, MODEL1_SCALE_BYTES,
};
use dsa_kv_core::metadata::v4::{extra_indices, V4MetadataError};
use dsa_kv_core::ops::model1::{
    dequantize_model1_row, quantize_model1_row, MODEL1_DATA, MODEL1_NOPE, MODEL1_ROPE,
    MODEL1_SCALES,
};
use dsa_kv_core::ops::OpError;
use half::bf16;

use crate::kernels::Guard;
use crate::{driver_error, CudaError, Gpu, KERNEL_SOURCES};

mod device;
mod pools;
#[cfg(test)]
mod tests;

pub use device::WindowedCudaDevice;
pub use pools::V4GpuPools;

/// The kernel source (`kernels/v4.cu`), compiled after `common.cuh` and `guard.cu`.
pub const V4_SOURCE: &str = include_str!("../../../kernels/v4.cu");

/// Values per MODEL1 row: 448 NoPE then 64 RoPE.
pub const MODEL1_VALUES: usize = MODEL1_NOPE + MODEL1_ROPE;

/// The kernels' entry points, as the PTX names them.
pub const V4_ENTRY_POINTS: [&str; 6] = [
    "model1_scatter",
    "model1_gather",
    "state_scatter",
    "guard_model1",
    "guard_state",
    "v4_extra_indices",
];

const BLOCK: u32 = 256;

/// A failure of a V4 kernel launch.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum V4KernelError {
    /// An index points past the pool: the batch was refused on the host before the launch
    /// and nothing was written (the error the host twin gives for the same batch).
    #[error("CUDA device {device}: {kernel} refused the batch: {error}")]
    OutOfBounds {
        /// Device ordinal.
        device: usize,
        /// The kernel.
        kernel: &'static str,
        /// The first out-of-range index, as the host reference reports it.
        error: OpError,
    },
    /// Anything else: a driver failure, or arguments the kernels cannot take.
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

/// A pool of MODEL1 pages on the device: page `p` at `pool + p × page.page_bytes()`.
#[derive(Clone, Copy, Debug)]
pub struct Model1Pool {
    /// Device address of page 0 (16-byte aligned).
    pub pool: u64,
    /// Bytes of the pool: no row's data or scale bytes are touched past it.
    pub pool_len: u64,
    /// The page geometry (`entries` rows per page).
    pub page: Model1PageLayout,
}

/// A pool of state rows on the device: row `r` at `pool + r × row_bytes`.
#[derive(Clone, Copy, Debug)]
pub struct StatePool {
    /// Device address of row 0.
    pub pool: u64,
    /// Bytes of the pool.
    pub pool_len: u64,
    /// Bytes per row (a multiple of 4).
    pub row_bytes: u32,
}

/// Proof that a batch's indices were checked on the host against a pool's geometry:
/// made only by [`check_model1`] and [`check_state`], and accepted by a launch only for
/// the same number of indices and the same pool size and geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checked {
    n: usize,
    pool_len: u64,
    geometry: (u32, u64),
}

/// How a launch makes sure no index points past its pool.
#[derive(Clone, Copy, Debug)]
pub enum Bounds<'a, T> {
    /// The indices as host data (the values the device copy holds): checked before the
    /// launch; the first out-of-range one refuses the batch with
    /// [`V4KernelError::OutOfBounds`].
    Host(&'a [T]),
    /// Checked on the host already ([`check_model1`], [`check_state`]).
    Checked(Checked),
    /// Checked on the device: a guard kernel sets the step's fail flag for the first
    /// out-of-range index (`which` 0: a data row, 1: only the scale row), and the kernel
    /// does nothing once the flag is set (nor does any later guarded op of the step).
    Guard(Guard),
}

// ---- host twins and checks -------------------------------------------------------------

/// Where row `r` of a MODEL1 pool lies: `Ok(None)` for a negative index, `Ok(Some((data,
/// scale)))` byte offsets, or `Err(which, offset, end)` for the first range past the pool
/// (0: the data row, 1: the scale row). Mirrors `model1_place` in `kernels/v4.cu`.
fn model1_place(
    page: Model1PageLayout,
    pool_len: u64,
    r: i64,
) -> Result<Option<(u64, u64)>, (u32, i64, i64)> {
    if r < 0 {
        return Ok(None);
    }
    let (e, pb) = (u64::from(page.entries), page.page_bytes());
    let (p, i) = (r as u64 / e, (r as u64 % e) as u32);
    let data = (p.checked_mul(pb)).and_then(|b| b.checked_add(u64::from(i) * 576));
    let clamp = |x: Option<u64>| x.map_or(i64::MAX, |v| v.min(i64::MAX as u64) as i64);
    let data_end = data.and_then(|d| d.checked_add(u64::from(MODEL1_DATA_BYTES)));
    if p > pool_len / pb || data_end.is_none_or(|end| end > pool_len) {
        return Err((0, clamp(data), clamp(data_end)));
    }
    // In the pool's pages here: no overflow below.
    let (d, s) = (page.data_offset(p, i), page.scale_offset(p, i));
    let scale_end = s + u64::from(MODEL1_SCALE_BYTES);
    if scale_end > pool_len {
        return Err((1, s as i64, scale_end as i64));
    }
    Ok(Some((d, s)))
}

fn out_of_bounds(token: usize, offset: i64, end: i64, pool_len: u64) -> OpError {
    OpError::OutOfBounds {
        token,
        offset,
        end,
        cache_len: pool_len as usize,
    }
}

/// Checks every index of a MODEL1 batch against a pool of `pool_len` bytes: the first
/// index whose data row (or, failing only that, scale row) ends past the pool gives
/// [`OpError::OutOfBounds`] with that row's byte range; negative indices are skipped.
pub fn check_model1<T: Copy + Into<i64>>(
    idx: &[T],
    page: Model1PageLayout,
    pool_len: u64,
) -> Result<Checked, OpError> {
    if page.entries == 0 {
        return Err(OpError::Length {
            what: "MODEL1 rows per page",
            expected: 1,
            got: 0,
        });
    }
    for (t, &r) in idx.iter().enumerate() {
        if let Err((_, offset, end)) = model1_place(page, pool_len, r.into()) {
            return Err(out_of_bounds(t, offset, end, pool_len));
        }
    }
    Ok(Checked {
        n: idx.len(),
        pool_len,
        geometry: (page.entries, page.page_bytes()),
    })
}

/// The guard's verdict for a MODEL1 batch, computed on the host: the first out-of-range
/// index and which of its rows (0: data, 1: scale) ends past the pool, as the guard
/// kernel leaves it in the fail flag (with the op's number).
pub fn model1_guard_failure<T: Copy + Into<i64>>(
    idx: &[T],
    page: Model1PageLayout,
    pool_len: u64,
) -> Option<(usize, u32)> {
    idx.iter().enumerate().find_map(|(t, &r)| {
        model1_place(page, pool_len, r.into())
            .err()
            .map(|(which, ..)| (t, which))
    })
}

/// Checks every index of a state batch: row `r` must end inside the pool
/// (`(r + 1) × row_bytes ≤ pool_len`); negative indices are skipped.
pub fn check_state(idx: &[i64], row_bytes: u32, pool_len: u64) -> Result<Checked, OpError> {
    if row_bytes == 0 || !row_bytes.is_multiple_of(4) {
        return Err(OpError::Length {
            what: "state row bytes (a positive multiple of 4)",
            expected: row_bytes.max(1).next_multiple_of(4) as usize,
            got: row_bytes as usize,
        });
    }
    let rb = u64::from(row_bytes);
    for (t, &r) in idx.iter().enumerate() {
        if r >= 0 && r as u64 >= pool_len / rb {
            let off = (r as u64).checked_mul(rb);
            let clamp = |x: Option<u64>| x.map_or(i64::MAX, |v| v.min(i64::MAX as u64) as i64);
            let end = off.and_then(|o| o.checked_add(rb));
            return Err(out_of_bounds(t, clamp(off), clamp(end), pool_len));
        }
    }
    Ok(Checked {
        n: idx.len(),
        pool_len,
        geometry: (row_bytes, 0),
    })
}

/// Host twin of [`V4Kernels::model1_scatter`]: quantizes row `t` of `rows` (512 values
/// each) with [`quantize_model1_row`] and writes its data and scale bytes at
/// [`Model1PageLayout::data_offset`] / [`Model1PageLayout::scale_offset`] of page
/// `idx[t] / E`, row `idx[t] mod E`; negative indices are skipped. Every index is checked
/// ([`check_model1`]) before anything is written.
pub fn model1_scatter_host(
    pool: &mut [u8],
    page: Model1PageLayout,
    rows: &[bf16],
    idx: &[i64],
) -> Result<(), OpError> {
    if rows.len() != idx.len() * MODEL1_VALUES {
        return Err(OpError::Length {
            what: "MODEL1 row values",
            expected: idx.len() * MODEL1_VALUES,
            got: rows.len(),
        });
    }
    check_model1(idx, page, pool.len() as u64)?;
    let (mut data, mut scales) = ([0u8; MODEL1_DATA], [0u8; MODEL1_SCALES]);
    for (t, &r) in idx.iter().enumerate() {
        if let Ok(Some((d, s))) = model1_place(page, pool.len() as u64, r) {
            let row = &rows[t * MODEL1_VALUES..(t + 1) * MODEL1_VALUES];
            quantize_model1_row(row, &mut data, &mut scales);
            pool[d as usize..d as usize + MODEL1_DATA].copy_from_slice(&data);
            pool[s as usize..s as usize + MODEL1_SCALES].copy_from_slice(&scales);
        }
    }
    Ok(())
}

/// Host twin of [`V4Kernels::model1_gather`]: row `t` of `out` (512 values) is
/// [`dequantize_model1_row`] of the row at `idx[t]`, zeros for a negative index. Every
/// index is checked before anything is written.
pub fn model1_gather_host(
    pool: &[u8],
    page: Model1PageLayout,
    idx: &[i32],
    out: &mut [f32],
) -> Result<(), OpError> {
    if out.len() != idx.len() * MODEL1_VALUES {
        return Err(OpError::Length {
            what: "MODEL1 gather output values",
            expected: idx.len() * MODEL1_VALUES,
            got: out.len(),
        });
    }
    check_model1(idx, page, pool.len() as u64)?;
    for (t, &r) in idx.iter().enumerate() {
        let o = &mut out[t * MODEL1_VALUES..(t + 1) * MODEL1_VALUES];
        match model1_place(page, pool.len() as u64, r.into()) {
            Ok(Some((d, s))) => {
                let (d, s) = (d as usize, s as usize);
                let data = pool[d..d + MODEL1_DATA].try_into().expect("576 bytes");
                let scales = pool[s..s + MODEL1_SCALES].try_into().expect("8 bytes");
                o.copy_from_slice(&dequantize_model1_row(data, scales));
            }
            _ => o.fill(0.0),
        }
    }
    Ok(())
}

/// The selections of a batch for [`V4Kernels::extra_indices`] and its host twin: token
/// `t` selected `nsel[t]` compressed entries `sel[t × ms ..]` (entry numbers); its
/// request's block table is row `row_of[t]` of `table` (`cols` slots each, −1 past the
/// request's blocks).
#[derive(Clone, Copy, Debug)]
pub struct Selections<'a> {
    /// Entry numbers, `ms` per token.
    pub sel: &'a [i32],
    /// Entries selected per token.
    pub nsel: &'a [i32],
    /// Row stride of `sel`.
    pub ms: usize,
    /// Each token's block-table row.
    pub row_of: &'a [i32],
    /// The block tables, `cols` slots per row.
    pub table: &'a [i32],
    /// Columns of `table`.
    pub cols: usize,
}

/// Host twin of [`V4Kernels::extra_indices`]: per token,
/// [`extra_indices`] of its selected entries
/// through its block-table row (the slots up to the first −1) for the compressed buffer
/// with `conv` and `ratio`, padded with −1 to `width`: `[n × width]` rows and the
/// lengths. The first token whose entries the tables do not hold (or whose selection is
/// longer than `ms` or than `sel` holds) fails with its index and the reference's error.
pub fn extra_indices_host(
    s: &Selections<'_>,
    conv: PageIndexConverter,
    ratio: u64,
    width: usize,
) -> Result<(Vec<i32>, Vec<i32>), (usize, V4MetadataError)> {
    let (mut out, mut len) = (Vec::new(), Vec::new());
    for (t, (&ns, &row)) in s.nsel.iter().zip(s.row_of).enumerate() {
        let cols = s
            .table
            .get(row.max(0) as usize * s.cols..(row.max(0) as usize + 1) * s.cols)
            .unwrap_or(&[]);
        let blocks: Vec<SlotId> = cols
            .iter()
            .take_while(|&&b| b >= 0)
            .map(|&b| SlotId(b as u32))
            .collect();
        let ns = ns.max(0) as usize;
        let Some(picked) = s.sel.get(t * s.ms..t * s.ms + ns).filter(|_| ns <= s.ms) else {
            return Err((
                t,
                V4MetadataError::TooMany {
                    got: ns,
                    width: s.ms,
                },
            ));
        };
        let entries = picked.iter().map(|&w| u64::from(w as u32));
        let (rows, n) = extra_indices(&blocks, conv, ratio, entries, width).map_err(|e| (t, e))?;
        out.extend(rows);
        len.push(n as i32);
    }
    Ok((out, len))
}

/// Host twin of [`V4Kernels::state_scatter`]: row `t` of `rows` (`row_bytes` bytes each)
/// copied to `idx[t] × row_bytes`; negative indices are skipped; every index is checked
/// ([`check_state`]) before anything is written.
pub fn state_scatter_host(
    pool: &mut [u8],
    row_bytes: u32,
    rows: &[u8],
    idx: &[i64],
) -> Result<(), OpError> {
    let rb = row_bytes as usize;
    if rows.len() != idx.len() * rb {
        return Err(OpError::Length {
            what: "state row bytes",
            expected: idx.len() * rb,
            got: rows.len(),
        });
    }
    check_state(idx, row_bytes, pool.len() as u64)?;
    for (t, &r) in idx.iter().enumerate() {
        if r >= 0 {
            let o = r as usize * rb;
            pool[o..o + rb].copy_from_slice(&rows[t * rb..(t + 1) * rb]);
        }
    }
    Ok(())
}

/// The byte-offset mappings of the indexer scatter and gather
/// ([`crate::Kernels::indexer_k_scatter`], [`dsa_kv_core::ops::indexer_k`]) for V4 entry
/// keys at kernel row indices `rows` (`page × T + i`, T = `page.tokens_per_block` entries
/// per page; negative: −1, skipped): value at [`IndexerPageLayout::value_offset`], scale
/// word at [`IndexerPageLayout::scale_offset`] of page `row / T`, entry `row mod T`.
/// Where the offsets would not fit an i64, `i64::MAX` (refused as out of range).
pub fn entry_key_maps(rows: &[i64], page: IndexerPageLayout) -> (Vec<i64>, Vec<i64>) {
    let t = u64::from(page.tokens_per_block.max(1));
    let pb = page.page_bytes();
    let at = |r: i64, plane: u64, width: u32| -> i64 {
        if r < 0 {
            return -1;
        }
        let (p, i) = (r as u64 / t, r as u64 % t);
        p.checked_mul(pb)
            .and_then(|b| b.checked_add(plane + i * u64::from(width)))
            .map_or(i64::MAX, |o| o.min(i64::MAX as u64) as i64)
    };
    let plane = t * u64::from(page.data_bytes);
    rows.iter()
        .map(|&r| (at(r, 0, page.data_bytes), at(r, plane, page.scale_bytes)))
        .unzip()
}

// ---- the kernels -----------------------------------------------------------------------

/// The loaded V4 kernels of one device (their own module: `common.cuh`, `guard.cu`,
/// `v4.cu`, compiled by NVRTC once per process).
pub struct V4Kernels {
    model1_scatter: CudaFunction,
    model1_gather: CudaFunction,
    state_scatter: CudaFunction,
    guard_model1: CudaFunction,
    guard_state: CudaFunction,
    extra_indices: CudaFunction,
    ordinal: usize,
    _module: Arc<CudaModule>,
}

impl std::fmt::Debug for V4Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("V4Kernels")
            .field("device", &self.ordinal)
            .finish()
    }
}

/// The full source the module compiles: `common.cuh`, `guard.cu`, then `v4.cu`.
pub fn v4_source() -> String {
    let part = |name: &str| {
        KERNEL_SOURCES
            .iter()
            .find(|(n, _)| *n == name)
            .map_or("", |(_, text)| *text)
    };
    format!(
        "// ---- common.cuh\n{}\n// ---- guard.cu\n{}\n// ---- v4.cu\n{}\n",
        part("common.cuh"),
        part("guard.cu"),
        V4_SOURCE
    )
}

fn v4_ptx() -> Result<Ptx, CudaError> {
    static PTX: OnceLock<Result<Ptx, CudaError>> = OnceLock::new();
    PTX.get_or_init(|| crate::compile(v4_source())).clone()
}

/// Compiles the V4 kernels with NVRTC (no GPU needed) and returns the PTX text.
pub fn compile_v4_kernels() -> Result<String, CudaError> {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoDevice {
            reason: "the NVRTC library cannot be loaded on this machine".into(),
        });
    }
    Ok(v4_ptx()?.to_src())
}

fn cfg(threads: u64) -> LaunchConfig {
    let blocks = threads.div_ceil(u64::from(BLOCK)).max(1);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn invalid(device: usize, what: String) -> V4KernelError {
    V4KernelError::Cuda(CudaError::Invalid { device, what })
}

fn as_i32(device: usize, what: &str, v: usize) -> Result<i32, V4KernelError> {
    i32::try_from(v).map_err(|_| {
        invalid(
            device,
            format!("{what} = {v} does not fit the kernels' int32 argument; split the batch"),
        )
    })
}

fn aligned(device: usize, what: &str, addr: u64, to: u64) -> Result<(), V4KernelError> {
    if !addr.is_multiple_of(to) {
        return Err(invalid(
            device,
            format!("{what} at {addr:#x} is not {to}-byte aligned"),
        ));
    }
    Ok(())
}

impl V4Kernels {
    /// Loads the V4 kernels onto `gpu` (compiling them on first use in the process).
    pub fn load(gpu: &Gpu) -> Result<Self, CudaError> {
        Self::from_ptx(gpu, v4_ptx()?)
    }

    /// Loads kernels compiled from `src` (a variant of [`v4_source`]; the tests compile
    /// mutated kernels to show that the comparisons catch them).
    pub fn from_source(gpu: &Gpu, src: String) -> Result<Self, CudaError> {
        Self::from_ptx(gpu, crate::compile(src)?)
    }

    fn from_ptx(gpu: &Gpu, ptx: Ptx) -> Result<Self, CudaError> {
        gpu.bind()?;
        let ordinal = gpu.ordinal();
        let module = gpu
            .context()
            .load_module(ptx)
            .map_err(|e| driver_error(ordinal, "cuModuleLoadData", e))?;
        let f = |name: &'static str| {
            module
                .load_function(name)
                .map_err(|e| driver_error(ordinal, name, e))
        };
        Ok(V4Kernels {
            model1_scatter: f("model1_scatter")?,
            model1_gather: f("model1_gather")?,
            state_scatter: f("state_scatter")?,
            guard_model1: f("guard_model1")?,
            guard_state: f("guard_state")?,
            extra_indices: f("v4_extra_indices")?,
            ordinal,
            _module: module,
        })
    }

    /// Resolves `bounds` for a MODEL1 launch: `Ok(flag)` (0 or the guard's flag, the guard
    /// kernel enqueued), or the refusal.
    ///
    /// # Safety
    /// With a guard, `idx` holds `n` indices of the width `wide` says and `g.flag` is the
    /// step's flag on this device.
    #[allow(clippy::too_many_arguments)]
    unsafe fn model1_bounds<T: Copy + Into<i64>>(
        &self,
        stream: &CudaStream,
        device: usize,
        kernel: &'static str,
        pool: Model1Pool,
        idx: u64,
        n: usize,
        wide: bool,
        bounds: Bounds<'_, T>,
    ) -> Result<u64, V4KernelError> {
        let geometry = (pool.page.entries, pool.page.page_bytes());
        match bounds {
            Bounds::Host(h) => {
                if h.len() != n {
                    return Err(invalid(
                        device,
                        format!("{kernel}: {} host indices for a batch of {n}", h.len()),
                    ));
                }
                check_model1(h, pool.page, pool.pool_len).map_err(|error| {
                    V4KernelError::OutOfBounds {
                        device,
                        kernel,
                        error,
                    }
                })?;
                Ok(0)
            }
            Bounds::Checked(c) => {
                let want = Checked {
                    n,
                    pool_len: pool.pool_len,
                    geometry,
                };
                if c != want {
                    return Err(invalid(
                        device,
                        format!("{kernel}: {c:?} was checked for another batch than {want:?}"),
                    ));
                }
                Ok(0)
            }
            Bounds::Guard(g) => {
                let (n32, w) = (n as i32, i32::from(wide));
                let (e, pb, max_page, len) = (
                    pool.page.entries,
                    geometry.1,
                    pool.pool_len / geometry.1,
                    pool.pool_len,
                );
                // SAFETY: the guard reads the `n` indices and writes the step's flag (the
                // caller's contract).
                unsafe {
                    crate::launch!(
                        stream, &self.guard_model1, cfg(n as u64), device, "guard_model1";
                        &idx, &w, &n32, &e, &pb, &max_page, &len, &g.op, &g.flag,
                    )
                }?;
                Ok(g.flag)
            }
        }
    }

    fn model1_geometry(
        &self,
        device: usize,
        pool: Model1Pool,
        n: usize,
    ) -> Result<i32, V4KernelError> {
        if pool.page.entries == 0 {
            return Err(invalid(device, "a MODEL1 page of 0 rows".into()));
        }
        aligned(device, "the MODEL1 pool", pool.pool, 16)?;
        as_i32(device, "MODEL1 rows", n)
    }

    /// Quantizes `n` BF16 rows of 512 values (`rows`: 448 NoPE then 64 RoPE each) to
    /// MODEL1 and writes row `t` at kernel row index `idx[t]` (i64, negative: skip) of
    /// `pool`. Reference: [`model1_scatter_host`] ([`quantize_model1_row`] at
    /// [`Model1PageLayout`]'s offsets), byte for byte.
    ///
    /// # Safety
    /// `rows` holds `n × 1024` bytes (16-byte aligned), `idx` `n` i64 (8-byte aligned) on
    /// this device, and `pool .. pool + pool_len` is device memory of this device; with
    /// [`Bounds::Host`] the slice holds the values at `idx`, and with [`Bounds::Checked`]
    /// the checked indices are those at `idx`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn model1_scatter(
        &self,
        stream: &CudaStream,
        device: usize,
        pool: Model1Pool,
        rows: u64,
        idx: u64,
        n: usize,
        bounds: Bounds<'_, i64>,
    ) -> Result<(), V4KernelError> {
        let n32 = self.model1_geometry(device, pool, n)?;
        aligned(device, "the MODEL1 input rows", rows, 16)?;
        aligned(device, "the row indices", idx, 8)?;
        if n == 0 {
            return Ok(());
        }
        const K: &str = "model1_scatter";
        // SAFETY: the caller's contract (above).
        let fail = unsafe { self.model1_bounds(stream, device, K, pool, idx, n, true, bounds) }?;
        let (e, pb) = (pool.page.entries, pool.page.page_bytes());
        let (max_page, len, p) = (pool.pool_len / pb, pool.pool_len, pool.pool);
        // SAFETY: the caller's contract (above) covers every address; the kernel writes
        // only rows whose bytes end inside the pool. A warp per two rows.
        unsafe {
            crate::launch!(
                stream, &self.model1_scatter, cfg(n.div_ceil(2) as u64 * 32), device, K;
                &p, &rows, &idx, &n32, &e, &pb, &max_page, &len, &fail,
            )
        }?;
        Ok(())
    }

    /// Decodes the rows at kernel row indices `idx[0..n)` (int32, negative: a row of
    /// zeros) of `pool` into f32 `[n, 512]` at `out`. Reference: [`model1_gather_host`]
    /// ([`dequantize_model1_row`]), bit for bit. With a guard whose flag is set, nothing
    /// is written.
    ///
    /// # Safety
    /// `idx` holds `n` i32 and `out` `n × 2048` bytes (16-byte aligned) on this device,
    /// and `pool .. pool + pool_len` is device memory of this device; [`Bounds`] as for
    /// [`Self::model1_scatter`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn model1_gather(
        &self,
        stream: &CudaStream,
        device: usize,
        pool: Model1Pool,
        idx: u64,
        n: usize,
        out: u64,
        bounds: Bounds<'_, i32>,
    ) -> Result<(), V4KernelError> {
        let n32 = self.model1_geometry(device, pool, n)?;
        aligned(device, "the gather output", out, 16)?;
        aligned(device, "the row indices", idx, 4)?;
        if n == 0 {
            return Ok(());
        }
        const K: &str = "model1_gather";
        // SAFETY: the caller's contract (above).
        let fail = unsafe { self.model1_bounds(stream, device, K, pool, idx, n, false, bounds) }?;
        let (e, pb) = (pool.page.entries, pool.page.page_bytes());
        let (max_page, len, p) = (pool.pool_len / pb, pool.pool_len, pool.pool);
        // SAFETY: the caller's contract (above) covers every address; the kernel reads
        // only rows whose bytes end inside the pool.
        unsafe {
            crate::launch!(
                stream, &self.model1_gather, cfg(n as u64 * 32), device, K;
                &p, &idx, &n32, &e, &pb, &max_page, &len, &out, &fail,
            )
        }?;
        Ok(())
    }

    /// Copies `n` state rows of `pool.row_bytes` bytes (`rows`) to row indices `idx` (i64,
    /// negative: skip) of `pool`. Reference: [`state_scatter_host`].
    ///
    /// # Safety
    /// `rows` holds `n × row_bytes` bytes and `idx` `n` i64 (8-byte aligned) on this
    /// device, and `pool .. pool + pool_len` is device memory of this device; [`Bounds`]
    /// as for [`Self::model1_scatter`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn state_scatter(
        &self,
        stream: &CudaStream,
        device: usize,
        pool: StatePool,
        rows: u64,
        idx: u64,
        n: usize,
        bounds: Bounds<'_, i64>,
    ) -> Result<(), V4KernelError> {
        let rb = pool.row_bytes;
        if rb == 0 || !rb.is_multiple_of(4) {
            return Err(invalid(
                device,
                format!("state rows of {rb} bytes: use a positive multiple of 4"),
            ));
        }
        aligned(device, "the state pool", pool.pool, 4)?;
        aligned(device, "the state input rows", rows, 4)?;
        aligned(device, "the row indices", idx, 8)?;
        let n32 = as_i32(device, "state rows", n)?;
        if n == 0 {
            return Ok(());
        }
        let vec: u32 =
            if rb.is_multiple_of(16) && pool.pool.is_multiple_of(16) && rows.is_multiple_of(16) {
                16
            } else {
                4
            };
        let threads = n as u64 * u64::from(rb / vec);
        if threads >= 1 << 40 {
            return Err(invalid(device, format!("{n} state rows of {rb} bytes")));
        }
        const K: &str = "state_scatter";
        let max_rows = pool.pool_len / u64::from(rb);
        let fail = match bounds {
            Bounds::Host(h) => {
                if h.len() != n {
                    return Err(invalid(
                        device,
                        format!("{K}: {} host indices for a batch of {n}", h.len()),
                    ));
                }
                check_state(h, rb, pool.pool_len).map_err(|error| V4KernelError::OutOfBounds {
                    device,
                    kernel: K,
                    error,
                })?;
                0
            }
            Bounds::Checked(c) => {
                let want = Checked {
                    n,
                    pool_len: pool.pool_len,
                    geometry: (rb, 0),
                };
                if c != want {
                    return Err(invalid(
                        device,
                        format!("{K}: {c:?} was checked for another batch than {want:?}"),
                    ));
                }
                0
            }
            Bounds::Guard(g) => {
                // SAFETY: the guard reads the `n` indices and writes the step's flag.
                unsafe {
                    crate::launch!(
                        stream, &self.guard_state, cfg(n as u64), device, "guard_state";
                        &idx, &n32, &max_rows, &g.op, &g.flag,
                    )
                }?;
                g.flag
            }
        };
        let p = pool.pool;
        // SAFETY: the caller's contract (above) covers every address; the kernel writes
        // only rows that end inside the pool.
        unsafe {
            crate::launch!(
                stream, &self.state_scatter, cfg(threads), device, K;
                &p, &rows, &idx, &n32, &rb, &vec, &max_rows, &fail,
            )
        }?;
        Ok(())
    }

    /// The sparse decode's `extra_indices` `[n × width]` (i32, −1 padding) and
    /// `extra_topk_length` `[n]` from each token's selected entries (device arrays laid
    /// out as [`Selections`] describes: `sel`, `nsel`, `row_of`, `table`) for the
    /// compressed buffer with `conv` and `ratio`. Reference: [`extra_indices_host`], byte
    /// for byte. A token whose entry has no block, or whose row passes int32, marks the
    /// guard's fail flag (`which` 0 and 1) and gets −1 there, as the host twin refuses
    /// it; a token that selected more than `width` entries marks `which` 0 and gets −1
    /// throughout (the host twin's `TooMany`).
    ///
    /// # Safety
    /// On this device: `sel` holds `n × ms` i32 (`nsel[t] ≤ ms`), `nsel` and `row_of` `n`, `table` the
    /// rows `row_of` names × `cols`, `out` `n × width` i32, `len` `n`; `guard.flag` is the
    /// step's flag.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn extra_indices(
        &self,
        stream: &CudaStream,
        device: usize,
        (sel, nsel, ms, row_of, table, cols): (u64, u64, usize, u64, u64, usize),
        conv: PageIndexConverter,
        ratio: u64,
        width: usize,
        n: usize,
        (out, len): (u64, u64),
        guard: Guard,
    ) -> Result<(), V4KernelError> {
        if !matches!(ratio, 4 | 128) {
            return Err(invalid(
                device,
                format!("compression ratio {ratio}: V4 compresses by 4 or 128"),
            ));
        }
        let (ms32, cols32, w32, n32) = (
            as_i32(device, "selection width", ms)?,
            as_i32(device, "block-table columns", cols)?,
            as_i32(device, "index width", width)?,
            as_i32(device, "tokens", n)?,
        );
        if n == 0 || width == 0 {
            return Ok(());
        }
        let per_block = (256 / ratio) as u32;
        let (sc, off, ex) = (conv.scale, conv.layer_offset, conv.expansion);
        // SAFETY: the caller's contract (above) covers every address.
        unsafe {
            crate::launch!(
                stream, &self.extra_indices, cfg(n as u64 * width as u64), device,
                "v4_extra_indices";
                &out, &len, &sel, &nsel, &ms32, &row_of, &table, &cols32, &sc, &off, &ex,
                &per_block, &w32, &n32, &guard.op, &guard.flag,
            )
        }?;
        Ok(())
    }
}
