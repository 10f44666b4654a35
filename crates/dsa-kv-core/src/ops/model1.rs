//! DeepSeek-V4's 584-byte cache row (FlashMLA's "MODEL1" format, the one its SM90 sparse
//! decode reads on H100/H200): 448 "nope" values in FP8 E4M3 and the 64 RoPE values in
//! BF16 (576 data bytes), then 7 UE8M0 scale bytes, one per 64 nope values, and a zero
//! pad byte (8 scale bytes). A page does not interleave tokens: its E rows' data come
//! first (row `i` at `576·i`), then their scale rows (at `576·E + 8·i`), and the page is
//! padded to a multiple of 576 bytes. The quantization rule: per tile of 64, scale
//! `2^e` with `e = ceil(log2(max(amax, 1e-4) / 448))` (the crate's UE8M0
//! [`block_scale`]), value `e4m3(x / 2^e)`, scale byte `e + 127`.
//! The page geometry is [`crate::layout::Model1PageLayout`]. (DeepSeek-V4 support is
//! planned in ARCHITECTURE.md; this is its row codec.)

use half::bf16;

use super::quant::{block_scale, e4m3_table, f32_to_e4m3, ue8m0_byte, ScaleFormat, FP8_E4M3_MAX};
use crate::layout::{MODEL1_DATA_BYTES, MODEL1_SCALE_BYTES};

/// NoPE values per row (FP8).
pub const MODEL1_NOPE: usize = 448;
/// RoPE values per row (BF16).
pub const MODEL1_ROPE: usize = 64;
/// NoPE values per scale.
pub const MODEL1_TILE: usize = 64;
/// Data bytes of a row ([`crate::layout::MODEL1_DATA_BYTES`]).
pub const MODEL1_DATA: usize = MODEL1_DATA_BYTES as usize;
/// Scale bytes of a row ([`crate::layout::MODEL1_SCALE_BYTES`]).
pub const MODEL1_SCALES: usize = MODEL1_SCALE_BYTES as usize;

/// Quantizes one row (`row`: 448 nope then 64 RoPE values) into its data bytes and its
/// scale bytes.
pub fn quantize_model1_row(
    row: &[bf16],
    data: &mut [u8; MODEL1_DATA],
    scales: &mut [u8; MODEL1_SCALES],
) {
    debug_assert_eq!(row.len(), MODEL1_NOPE + MODEL1_ROPE);
    let (nope, rope) = row.split_at(MODEL1_NOPE);
    for (t, tile) in nope.chunks_exact(MODEL1_TILE).enumerate() {
        let amax = tile.iter().fold(0f32, |m, x| m.max(x.to_f32().abs()));
        let scale = block_scale(amax, FP8_E4M3_MAX, ScaleFormat::Ue8m0);
        for (j, x) in tile.iter().enumerate() {
            data[t * MODEL1_TILE + j] = f32_to_e4m3(x.to_f32() / scale);
        }
        scales[t] = ue8m0_byte(scale);
    }
    scales[MODEL1_NOPE / MODEL1_TILE] = 0;
    for (j, x) in rope.iter().enumerate() {
        let o = MODEL1_NOPE + 2 * j;
        data[o..o + 2].copy_from_slice(&x.to_bits().to_le_bytes());
    }
}

/// The values a row holds (448 nope dequantized, then 64 RoPE).
pub fn dequantize_model1_row(
    data: &[u8; MODEL1_DATA],
    scales: &[u8; MODEL1_SCALES],
) -> [f32; MODEL1_NOPE + MODEL1_ROPE] {
    let mut out = [0f32; MODEL1_NOPE + MODEL1_ROPE];
    let table = e4m3_table();
    for (t, tile) in out[..MODEL1_NOPE].chunks_exact_mut(MODEL1_TILE).enumerate() {
        let scale = ((i32::from(scales[t]) - 127) as f32).exp2();
        for (o, &b) in tile.iter_mut().zip(&data[t * MODEL1_TILE..]) {
            *o = table[usize::from(b)] * scale;
        }
    }
    for (j, o) in out[MODEL1_NOPE..].iter_mut().enumerate() {
        let b = MODEL1_NOPE + 2 * j;
        *o = bf16::from_bits(u16::from_le_bytes([data[b], data[b + 1]])).to_f32();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_data_rows_then_scale_rows_padded_to_576() {
        use crate::layout::{Model1PageLayout, MODEL1_ROW_BYTES};
        let p = |entries| Model1PageLayout { entries };
        // 64 rows: 37,376 bytes, padded to 65 · 576; 2 rows (a ratio-128 page of a
        // 256-token block): 1,168 → 1,728; 4 rows: 2,336 → 2,880.
        assert_eq!(p(64).page_bytes(), 37_440);
        assert_eq!(p(2).page_bytes(), 1_728);
        assert_eq!(p(4).page_bytes(), 2_880);
        assert_eq!(p(0).page_bytes(), 0);
        assert_eq!(p(64).data_offset(0, 3), 1_728);
        assert_eq!(p(64).data_offset(2, 0), 74_880);
        assert_eq!(p(64).scale_offset(0, 0), 36_864);
        assert_eq!(p(64).scale_offset(1, 63), 37_440 + 36_864 + 504);
        assert_eq!(p(2).scale_offset(0, 1), 1_160);
        assert_eq!(
            (MODEL1_ROW_BYTES, MODEL1_DATA, MODEL1_SCALES),
            (584, 576, 8)
        );
    }

    /// Golden bytes, worked by hand: a tile of 1.0s has amax 1, 1/448 = 2^-8.81, so
    /// e = −8: scale byte 119 (0x77), each value 1.0 · 2^8 = 256 = E4M3 0x78 (exponent 15,
    /// mantissa 0). A tile of −3.5s: 3.5/448 = 2^-7, e = −7, byte 120, value −448 =
    /// 0xFE. A zero tile: the floor 1e-4/448 = 2^-22.09, e = −22, byte 105, values 0.
    /// A tile of 0.75 with one 100: amax 100, 100/448 = 2^-2.16, e = −2, byte 125,
    /// values 3.0 (0x44) and 400, halfway between E4M3's 384 and 416: to even, 384
    /// (0x7C), so it reads back as 96. The pad byte is 0; RoPE values are their BF16
    /// bits.
    #[test]
    fn rows_quantize_to_golden_bytes() {
        let mut row = vec![bf16::from_f32(0.0); MODEL1_NOPE + MODEL1_ROPE];
        for x in &mut row[..64] {
            *x = bf16::from_f32(1.0);
        }
        for x in &mut row[64..128] {
            *x = bf16::from_f32(-3.5);
        }
        for x in &mut row[192..256] {
            *x = bf16::from_f32(0.75);
        }
        row[200] = bf16::from_f32(100.0);
        row[MODEL1_NOPE] = bf16::from_f32(1.5);
        row[MODEL1_NOPE + 63] = bf16::from_f32(-2.0);
        let (mut data, mut scales) = ([0u8; MODEL1_DATA], [0xAAu8; MODEL1_SCALES]);
        quantize_model1_row(&row, &mut data, &mut scales);
        assert_eq!(scales, [119, 120, 105, 125, 105, 105, 105, 0]);
        assert!(data[..64].iter().all(|&b| b == 0x78));
        assert!(data[64..128].iter().all(|&b| b == 0xFE));
        assert!(data[128..192].iter().all(|&b| b == 0));
        assert_eq!((data[192], data[200]), (0x44, 0x7C));
        assert_eq!(&data[MODEL1_NOPE..MODEL1_NOPE + 2], &[0xC0, 0x3F]);
        assert_eq!(&data[MODEL1_DATA - 2..], &[0x00, 0xC0]);
        let back = dequantize_model1_row(&data, &scales);
        assert_eq!(
            (back[0], back[64], back[192], back[200]),
            (1.0, -3.5, 0.75, 96.0)
        );
        assert_eq!((back[MODEL1_NOPE], back[MODEL1_NOPE + 63]), (1.5, -2.0));
    }

    /// Every value comes back within E4M3's half-ulp of its tile's scale; RoPE values
    /// exactly.
    #[test]
    fn rows_round_trip_within_e4m3_precision() {
        let mut rng = crate::rng::SplitMix64(4);
        for _ in 0..200 {
            let row: Vec<bf16> = (0..MODEL1_NOPE + MODEL1_ROPE)
                .map(|_| bf16::from_f32((rng.uniform() as f32 - 0.5) * 20.0))
                .collect();
            let (mut data, mut scales) = ([0u8; MODEL1_DATA], [0u8; MODEL1_SCALES]);
            quantize_model1_row(&row, &mut data, &mut scales);
            let back = dequantize_model1_row(&data, &scales);
            for (i, (x, y)) in row.iter().zip(back).enumerate() {
                let x = x.to_f32();
                if i >= MODEL1_NOPE {
                    assert_eq!(x, y);
                } else {
                    let scale = (f32::from(scales[i / MODEL1_TILE]) - 127.0).exp2();
                    // E4M3 has 3 mantissa bits: within 1/16 relative, or half the
                    // smallest subnormal (2^-10 · scale) near zero.
                    let tol = (x.abs() / 16.0).max(scale * 2f32.powi(-10));
                    assert!((x - y).abs() <= tol, "element {i}: {x} → {y}");
                }
            }
        }
    }
}
