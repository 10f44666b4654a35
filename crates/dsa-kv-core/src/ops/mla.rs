//! MLA latent-row writes (host reference): BF16 rows, FP8 rows with a per-tensor scale,
//! and `fp8_ds_mla` quantize-and-scatter (656-byte rows: 512 FP8 "nope" values in 4
//! tiles of 128 with one f32 scale each at bytes 512..528, then 64 BF16 rope values).
//!
//! Rows are addressed by **token slots** `block_slot × T + pos` through a [`RowView`] of
//! one layer's key buffer: `byte = base + (slot / T) × block_stride + (slot mod T) ×
//! row_bytes`. A negative slot is skipped. With the V1-compatible primary-pool view the
//! same bytes are row `global` of `[blocks × L × T, row]` (see `topk`).

use half::bf16;

use super::quant::{
    block_scale, e4m3_to_f32, f32_to_e2m1, f32_to_e4m3, ScaleFormat, FP4_E2M1_MAX, FP8_E4M3_MAX,
};
use super::OpError;
use crate::layout::{
    BufferPlacement, FP8_DS_MLA_NOPE_BYTES, FP8_DS_MLA_ROPE_OFFSET, FP8_DS_MLA_ROW_BYTES,
    FP8_DS_MLA_SCALE_OFFSET, FP8_DS_MLA_TILE,
};

/// A strided view of one layer's rows inside a pool.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RowView {
    /// Byte offset of the layer's first page inside a slot.
    pub base: u64,
    /// Bytes between the same page of consecutive slots (the pool's slot size).
    pub block_stride: u64,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// Bytes per row.
    pub row_bytes: u32,
}

impl RowView {
    /// The view of buffer `p` in a pool with `slot_bytes` per slot.
    pub fn of(p: &BufferPlacement, slot_bytes: u64) -> RowView {
        RowView {
            base: p.offset_in_slot,
            block_stride: slot_bytes,
            tokens_per_block: p.tokens_per_page(),
            row_bytes: p.row.bytes_per_token(),
        }
    }

    /// Byte offset of token slot `slot` (non-negative).
    pub fn offset(&self, slot: i64) -> u64 {
        let t = u64::from(self.tokens_per_block);
        let s = slot as u64;
        self.base + s / t * self.block_stride + s % t * u64::from(self.row_bytes)
    }

    fn range(
        &self,
        cache_len: usize,
        token: usize,
        slot: i64,
    ) -> Result<Option<std::ops::Range<usize>>, OpError> {
        if slot < 0 {
            return Ok(None);
        }
        let off = self.offset(slot);
        let end = off + u64::from(self.row_bytes);
        if end > cache_len as u64 {
            return Err(OpError::OutOfBounds {
                token,
                offset: off as i64,
                end: end as i64,
                cache_len,
            });
        }
        Ok(Some(off as usize..end as usize))
    }
}

fn check_rows(n_rows: usize, elems: usize, slots: usize) -> Result<(), OpError> {
    if n_rows != slots * elems {
        return Err(OpError::Length {
            what: "row elements",
            expected: slots * elems,
            got: n_rows,
        });
    }
    Ok(())
}

/// Checks every destination before anything is written, then writes `encode(i)`.
fn scatter_rows(
    cache: &mut [u8],
    view: &RowView,
    slots: &[i64],
    mut encode: impl FnMut(usize, &mut [u8]),
) -> Result<(), OpError> {
    for (i, &s) in slots.iter().enumerate() {
        view.range(cache.len(), i, s)?;
    }
    for (i, &s) in slots.iter().enumerate() {
        if let Some(r) = view.range(cache.len(), i, s)? {
            encode(i, &mut cache[r]);
        }
    }
    Ok(())
}

/// Writes BF16 rows (`row_bytes / 2` elements each, little-endian).
pub fn mla_scatter_bf16(
    cache: &mut [u8],
    view: &RowView,
    rows: &[bf16],
    slots: &[i64],
) -> Result<(), OpError> {
    let elems = view.row_bytes as usize / 2;
    check_rows(rows.len(), elems, slots.len())?;
    scatter_rows(cache, view, slots, |i, dst| {
        for (d, v) in dst
            .chunks_exact_mut(2)
            .zip(&rows[i * elems..(i + 1) * elems])
        {
            d.copy_from_slice(&v.to_bits().to_le_bytes());
        }
    })
}

/// Writes FP8 rows quantized with one per-tensor scale kept outside the cache:
/// `q = e4m3(x / tensor_scale)`.
pub fn mla_scatter_fp8(
    cache: &mut [u8],
    view: &RowView,
    rows: &[bf16],
    slots: &[i64],
    tensor_scale: f32,
) -> Result<(), OpError> {
    let elems = view.row_bytes as usize;
    check_rows(rows.len(), elems, slots.len())?;
    scatter_rows(cache, view, slots, |i, dst| {
        for (d, v) in dst.iter_mut().zip(&rows[i * elems..(i + 1) * elems]) {
            *d = f32_to_e4m3(v.to_f32() / tensor_scale);
        }
    })
}

/// Quantizes one 576-element latent row (512 nope + 64 rope) into the 656-byte
/// `fp8_ds_mla` row: per 128-value tile `scale = max(max|x|, 1e-4) / 448` (power of two
/// for UE8M0), FP8 values `e4m3(x / scale)`, the 4 f32 scales, then the rope values as
/// BF16.
pub fn quantize_fp8_ds_mla_row(row: &[bf16], fmt: ScaleFormat, out: &mut [u8]) {
    debug_assert_eq!(row.len(), FP8_DS_MLA_NOPE_BYTES + 64);
    debug_assert_eq!(out.len(), FP8_DS_MLA_ROW_BYTES);
    let (nope, rope) = row.split_at(FP8_DS_MLA_NOPE_BYTES);
    for (t, tile) in nope.chunks_exact(FP8_DS_MLA_TILE).enumerate() {
        let amax = tile.iter().fold(0f32, |m, x| m.max(x.to_f32().abs()));
        let scale = block_scale(amax, FP8_E4M3_MAX, fmt);
        for (j, x) in tile.iter().enumerate() {
            out[t * FP8_DS_MLA_TILE + j] = f32_to_e4m3(x.to_f32() / scale);
        }
        let so = FP8_DS_MLA_SCALE_OFFSET + 4 * t;
        out[so..so + 4].copy_from_slice(&scale.to_le_bytes());
    }
    for (j, x) in rope.iter().enumerate() {
        let o = FP8_DS_MLA_ROPE_OFFSET + 2 * j;
        out[o..o + 2].copy_from_slice(&x.to_bits().to_le_bytes());
    }
}

/// Quantizes 576-element rows to `fp8_ds_mla` and writes them (656-byte rows).
pub fn mla_scatter_fp8_ds_mla(
    cache: &mut [u8],
    view: &RowView,
    rows: &[bf16],
    slots: &[i64],
    fmt: ScaleFormat,
) -> Result<(), OpError> {
    const ELEMS: usize = FP8_DS_MLA_NOPE_BYTES + 64;
    if view.row_bytes as usize != FP8_DS_MLA_ROW_BYTES {
        return Err(OpError::Length {
            what: "fp8_ds_mla row bytes",
            expected: FP8_DS_MLA_ROW_BYTES,
            got: view.row_bytes as usize,
        });
    }
    check_rows(rows.len(), ELEMS, slots.len())?;
    scatter_rows(cache, view, slots, |i, dst| {
        quantize_fp8_ds_mla_row(&rows[i * ELEMS..(i + 1) * ELEMS], fmt, dst)
    })
}

/// Elements per NVFP4 scale block.
pub const NVFP4_BLOCK: usize = 16;

/// Quantizes one row to NVFP4: per 16-element block `s = e4m3(max(amax, 1e-4) / 6)`,
/// values `e2m1(x / s)` two per byte (even element in the low nibble) into `data`
/// (`elems / 2` bytes), the FP8 scale codes into `scales` (`elems / 16` bytes).
pub fn quantize_nvfp4_row(row: &[bf16], data: &mut [u8], scales: &mut [u8]) {
    for (b, block) in row.chunks_exact(NVFP4_BLOCK).enumerate() {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.to_f32().abs()));
        let code = f32_to_e4m3(block_scale(amax, FP4_E2M1_MAX, ScaleFormat::F32));
        scales[b] = code;
        let s = e4m3_to_f32(code);
        for (i, pair) in block.chunks_exact(2).enumerate() {
            let lo = f32_to_e2m1(pair[0].to_f32() / s);
            let hi = f32_to_e2m1(pair[1].to_f32() / s);
            data[b * NVFP4_BLOCK / 2 + i] = lo | (hi << 4);
        }
    }
}

/// Quantizes rows to NVFP4 and writes them into two buffers of the layer: the packed
/// values (`data_view`, `elems / 2` bytes per row) and the block scales (`scale_view`,
/// `elems / 16` bytes per row), both addressed by the same token slots.
pub fn mla_scatter_nvfp4(
    data_cache: &mut [u8],
    data_view: &RowView,
    scale_cache: &mut [u8],
    scale_view: &RowView,
    rows: &[bf16],
    slots: &[i64],
) -> Result<(), OpError> {
    let elems = data_view.row_bytes as usize * 2;
    if scale_view.row_bytes as usize * NVFP4_BLOCK != elems {
        return Err(OpError::Length {
            what: "NVFP4 block-scale bytes per row",
            expected: elems / NVFP4_BLOCK,
            got: scale_view.row_bytes as usize,
        });
    }
    check_rows(rows.len(), elems, slots.len())?;
    for (i, &s) in slots.iter().enumerate() {
        data_view.range(data_cache.len(), i, s)?;
        scale_view.range(scale_cache.len(), i, s)?;
    }
    let mut scales = vec![0u8; elems / NVFP4_BLOCK];
    for (i, &s) in slots.iter().enumerate() {
        let (Some(dr), Some(sr)) = (
            data_view.range(data_cache.len(), i, s)?,
            scale_view.range(scale_cache.len(), i, s)?,
        ) else {
            continue;
        };
        quantize_nvfp4_row(
            &rows[i * elems..(i + 1) * elems],
            &mut data_cache[dr],
            &mut scales,
        );
        scale_cache[sr].copy_from_slice(&scales);
    }
    Ok(())
}

/// Reads rows (raw bytes) of token slots into `out` (`row_bytes` each); a negative slot
/// reads zeros.
pub fn mla_gather(
    cache: &[u8],
    view: &RowView,
    slots: &[i64],
    out: &mut [u8],
) -> Result<(), OpError> {
    let rb = view.row_bytes as usize;
    check_rows(out.len(), rb, slots.len())?;
    for (i, &s) in slots.iter().enumerate() {
        let dst = &mut out[i * rb..(i + 1) * rb];
        match view.range(cache.len(), i, s)? {
            Some(r) => dst.copy_from_slice(&cache[r]),
            None => dst.fill(0),
        }
    }
    Ok(())
}
