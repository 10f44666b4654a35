//! Quantization of indexer keys and MLA rows (host reference; the CUDA kernels must
//! produce the same bytes).
//!
//! * **FP8 E4M3** (OCP `e4m3fn`: bias 7, max 448, no infinities): round to nearest,
//!   ties to even, saturating to ±448; NaN → 0x7F (sign kept).
//! * **FP4 E2M1** (bias 1: 0, 0.5, 1, 1.5, 2, 3, 4, 6): round to nearest, ties to even,
//!   saturating to ±6. Two codes per byte, the even element in the low nibble.
//! * **Indexer FP8** (per token, quant block 128): `amax = max(max|x|, 1e-4)`,
//!   `scale = amax / 448` (f32 division), rounded up to a power of two when the scale
//!   format is UE8M0; `q = e4m3(x / scale)`; the 4-byte scale word is the f32 scale,
//!   little-endian.
//! * **Indexer FP4** (per token, 32-element blocks): `scale_b = 2^ceil(log2(max(amax_b,
//!   1e-4) / 6))`; `q = e2m1(x / scale_b)`; scale word byte `b` = UE8M0 exponent of
//!   block `b` (`e + 127`).
//!
//! The 1e-4 floor keeps an all-zero vector finite (DeepGEMM's reference helper clamps
//! the same way).

use half::bf16;

/// Largest finite FP8 E4M3 value.
pub const FP8_E4M3_MAX: f32 = 448.0;
/// Largest FP4 E2M1 value.
pub const FP4_E2M1_MAX: f32 = 6.0;
/// Floor of `max|x|` before computing a scale.
pub const AMAX_FLOOR: f32 = 1e-4;
/// Elements per FP4 scale block.
pub const FP4_BLOCK: usize = 32;

/// How a per-token (or per-tile) scale is stored.
#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleFormat {
    /// Any f32 (`amax / max`).
    F32,
    /// Rounded up to a power of two (DeepSeek's `scale_fmt: ue8m0`).
    Ue8m0,
}

/// `v >> s` rounded to nearest, ties to even (`1 ≤ s < 32`).
#[inline]
fn rne_shift(v: u32, s: u32) -> u32 {
    let q = v >> s;
    let rem = v & ((1 << s) - 1);
    let half = 1 << (s - 1);
    if rem > half || (rem == half && q & 1 == 1) {
        q + 1
    } else {
        q
    }
}

/// f32 → FP8 E4M3 (RNE, saturating). Integer-only: the CUDA kernels can mirror it bit
/// for bit.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        // NaN → the positive NaN code whatever the input's sign bit: GPUs produce the
        // canonical (positive) NaN from arithmetic, CPUs keep the operand's sign.
        return 0x7F;
    }
    if abs >= 0x43E0_0000 {
        return sign | 0x7E; // ≥ 448 (and ±inf) saturate
    }
    let exp = (abs >> 23) as i32 - 127;
    if exp < -6 {
        // E4M3 subnormals: multiples of 2^-9. Below 2^-10 everything rounds to 0 (2^-10
        // itself is a tie that goes to the even 0).
        if exp < -10 {
            return sign;
        }
        let sig = (abs & 0x7F_FFFF) | 0x80_0000;
        return sign | rne_shift(sig, (14 - exp) as u32) as u8; // 8 becomes the smallest normal
    }
    let mut e = exp + 7;
    let mut m = rne_shift(abs & 0x7F_FFFF, 20);
    if m == 8 {
        m = 0;
        e += 1;
    }
    if e > 15 || (e == 15 && m == 7) {
        return sign | 0x7E;
    }
    sign | ((e as u8) << 3) | m as u8
}

/// FP8 E4M3 → f32 (a table of [`e4m3_decode`]'s 256 values, built once: decoding is
/// the inner loop of every reference attention).
pub fn e4m3_to_f32(b: u8) -> f32 {
    e4m3_table()[usize::from(b)]
}

/// The 256 values of [`e4m3_decode`], by code (built once).
pub fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|i| e4m3_decode(i as u8)))
}

/// FP8 E4M3 → f32, computed from the bit fields.
pub fn e4m3_decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xF);
    let m = f32::from(b & 7);
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m * pow2(-9)
    } else {
        sign * (1.0 + m / 8.0) * pow2(e - 7)
    }
}

/// f32 → FP4 E2M1 code (low 4 bits; RNE, saturating to ±6, NaN → +6). Integer-only.
pub fn f32_to_e2m1(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 28) & 0x8) as u8;
    let abs = bits & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        return 0x7; // NaN → +6 (sign dropped, as for E4M3)
    }
    if abs >= 0x40C0_0000 {
        return sign | 0x7; // ≥ 6 and ±inf saturate
    }
    let exp = (abs >> 23) as i32 - 127;
    if exp < 0 {
        // Subnormal: multiples of 0.5; below 0.25 everything rounds to 0.
        if exp < -2 {
            return sign;
        }
        let sig = (abs & 0x7F_FFFF) | 0x80_0000;
        return sign | rne_shift(sig, (22 - exp) as u32) as u8; // 2 becomes 1.0 (code 2)
    }
    let mut e = exp + 1;
    let mut m = rne_shift(abs & 0x7F_FFFF, 22);
    if m == 2 {
        m = 0;
        e += 1;
    }
    if e > 3 {
        return sign | 0x7;
    }
    sign | ((e as u8) << 1) | m as u8
}

/// FP4 E2M1 code → f32.
pub fn e2m1_to_f32(c: u8) -> f32 {
    const V: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let v = V[usize::from(c & 7)];
    if c & 8 != 0 {
        -v
    } else {
        v
    }
}

/// `2^e` as f32 (exact, subnormal results included).
fn pow2(e: i32) -> f32 {
    2f64.powi(e) as f32
}

/// The smallest power of two ≥ `s` (`s` > 0, finite).
pub fn pow2_ceil(s: f32) -> f32 {
    let bits = s.to_bits();
    let exp = ((bits >> 23) & 0xFF) as i32;
    let mant = bits & 0x7F_FFFF;
    if exp == 0 {
        // An f32 subnormal: find the power in f64, where it is exact.
        return pow2(f64::from(s).log2().ceil() as i32);
    }
    pow2(exp - 127 + i32::from(mant != 0))
}

/// UE8M0 exponent byte of a power of two (`e + 127`, clamped to 0..=254).
pub fn ue8m0_byte(pow2: f32) -> u8 {
    let e = ((pow2.to_bits() >> 23) & 0xFF) as i32;
    e.clamp(0, 254) as u8
}

fn amax(xs: &[bf16]) -> f32 {
    xs.iter()
        .fold(0f32, |m, x| m.max(x.to_f32().abs()))
        .max(AMAX_FLOOR)
}

/// The scale for a block whose `max|x|` is `amax` and whose format's largest value is
/// `max`.
pub fn block_scale(amax: f32, max: f32, fmt: ScaleFormat) -> f32 {
    let s = amax.max(AMAX_FLOOR) / max;
    match fmt {
        ScaleFormat::F32 => s,
        ScaleFormat::Ue8m0 => pow2_ceil(s),
    }
}

/// Quantizes one token's key (`dim` BF16 values, `dim` a multiple of 128 handled as
/// one block) to FP8: writes `dim` value bytes and the 4-byte f32 scale.
pub fn quantize_fp8_token(x: &[bf16], fmt: ScaleFormat, values: &mut [u8], scale_word: &mut [u8]) {
    let scale = block_scale(amax(x), FP8_E4M3_MAX, fmt);
    for (v, &e) in values.iter_mut().zip(x) {
        *v = f32_to_e4m3(e.to_f32() / scale);
    }
    scale_word.copy_from_slice(&scale.to_le_bytes());
}

/// Quantizes one token's key to FP4: `dim / 2` value bytes (even element in the low
/// nibble) and four UE8M0 exponents (one per 32-element block) in the scale word.
pub fn quantize_fp4_token(x: &[bf16], values: &mut [u8], scale_word: &mut [u8]) {
    debug_assert_eq!(x.len(), FP4_BLOCK * scale_word.len());
    for (b, block) in x.chunks_exact(FP4_BLOCK).enumerate() {
        let scale = block_scale(amax(block), FP4_E2M1_MAX, ScaleFormat::Ue8m0);
        scale_word[b] = ue8m0_byte(scale);
        for (i, pair) in block.chunks_exact(2).enumerate() {
            let lo = f32_to_e2m1(pair[0].to_f32() / scale);
            let hi = f32_to_e2m1(pair[1].to_f32() / scale);
            values[b * FP4_BLOCK / 2 + i] = lo | (hi << 4);
        }
    }
}

/// Dequantizes one FP8 token (value bytes + f32 scale word).
pub fn dequantize_fp8_token(values: &[u8], scale_word: &[u8], out: &mut [f32]) {
    let scale = f32::from_le_bytes(scale_word.try_into().expect("invariant: 4-byte scale word"));
    for (o, &v) in out.iter_mut().zip(values) {
        *o = e4m3_to_f32(v) * scale;
    }
}

/// Dequantizes one FP4 token (packed codes + four UE8M0 exponents).
pub fn dequantize_fp4_token(values: &[u8], scale_word: &[u8], out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let byte = values[i / 2];
        let code = if i % 2 == 0 { byte & 0xF } else { byte >> 4 };
        let scale = f32::from_bits(u32::from(scale_word[i / FP4_BLOCK]) << 23);
        *o = e2m1_to_f32(code) * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounds a non-negative finite `a` to a minifloat with `mbits` mantissa bits whose
    /// smallest normal exponent is `min_exp`; returns `(exponent field, mantissa)` and the
    /// rounded value. Exact: every step is a power-of-two scaling in f64.
    fn round_minifloat(a: f32, mbits: u32, min_exp: i32) -> (u32, u32, f64) {
        let a = f64::from(a);
        if a == 0.0 {
            return (0, 0, 0.0);
        }
        let e = (a.log2().floor() as i32).max(min_exp);
        // log2 of a double can be off by one near powers of two; fix it exactly.
        let e = if e > min_exp && a < 2f64.powi(e) {
            e - 1
        } else {
            e
        };
        let e = if a >= 2f64.powi(e + 1) { e + 1 } else { e };
        let quantum = 2f64.powi(e - mbits as i32);
        let v = (a / quantum).round_ties_even() * quantum;
        if v == 0.0 {
            return (0, 0, 0.0);
        }
        let min_normal = 2f64.powi(min_exp);
        if v < min_normal {
            let m = (v / 2f64.powi(min_exp - mbits as i32)) as u32;
            return (0, m, v);
        }
        let mut ve = v.log2().floor() as i32;
        if v < 2f64.powi(ve) {
            ve -= 1;
        }
        if v >= 2f64.powi(ve + 1) {
            ve += 1;
        }
        let m = ((v / 2f64.powi(ve) - 1.0) * f64::from(1u32 << mbits)) as u32;
        ((ve - min_exp + 1) as u32, m, v)
    }

    /// The f64 oracle of a saturating minifloat conversion.
    fn oracle(x: f32, mbits: u32, min_exp: i32, max: f32, sign_bit: u8, sat: u8) -> u8 {
        let sign = if x.is_sign_negative() { sign_bit } else { 0 };
        let a = x.abs();
        if a.is_nan() || a >= max {
            return sign | sat;
        }
        let (e, m, v) = round_minifloat(a, mbits, min_exp);
        if v >= f64::from(max) {
            return sign | sat;
        }
        sign | ((e << mbits) | m) as u8
    }

    #[test]
    fn integer_conversions_match_the_f64_oracle() {
        let mut n = 0;
        for exp in -40i32..=12 {
            for hi in 0u32..4096 {
                for lo in [0u32, 1, 0x3FF, 0x400, 0x401, 0x7FF] {
                    let bits = (((exp + 127) as u32) << 23) | (hi << 11) | lo;
                    for x in [f32::from_bits(bits), -f32::from_bits(bits)] {
                        assert_eq!(
                            f32_to_e4m3(x),
                            oracle(x, 3, -6, FP8_E4M3_MAX, 0x80, 0x7E),
                            "e4m3 {x:e}"
                        );
                        assert_eq!(
                            f32_to_e2m1(x),
                            oracle(x, 1, 0, FP4_E2M1_MAX, 0x8, 0x7),
                            "e2m1 {x:e}"
                        );
                        n += 1;
                    }
                }
            }
        }
        for x in [
            0.0f32,
            -0.0,
            f32::MIN_POSITIVE,
            1e-45,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            assert_eq!(
                f32_to_e4m3(x),
                oracle(x, 3, -6, FP8_E4M3_MAX, 0x80, 0x7E),
                "e4m3 {x:e}"
            );
            assert_eq!(
                f32_to_e2m1(x),
                oracle(x, 1, 0, FP4_E2M1_MAX, 0x8, 0x7),
                "e2m1 {x:e}"
            );
        }
        assert!(n > 2_500_000);
    }

    #[test]
    fn e4m3_round_trip_every_code() {
        for b in 0u8..=255 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                continue;
            }
            let back = f32_to_e4m3(v);
            // ±0 both exist; everything else round-trips exactly.
            assert_eq!(back, b, "code {b:#04x} = {v}");
        }
    }

    #[test]
    fn e4m3_rounding_and_saturation() {
        assert_eq!(f32_to_e4m3(1.0625), 0x38, "tie to even mantissa 0");
        assert_eq!(f32_to_e4m3(1.1875), 0x3A, "tie to even mantissa 2");
        assert_eq!(
            f32_to_e4m3(2f32.powi(-10)),
            0x00,
            "half the smallest subnormal ties to 0"
        );
        assert_eq!(f32_to_e4m3(3.0 * 2f32.powi(-10)), 0x02);
        assert_eq!(f32_to_e4m3(2f32.powi(-9)), 0x01);
        assert_eq!(
            f32_to_e4m3(0.015625 - 2f32.powi(-12)),
            0x08,
            "rounds up into the first normal"
        );
        assert_eq!(f32_to_e4m3(500.0), 0x7E);
        assert_eq!(f32_to_e4m3(-1e9), 0xFE);
        assert_eq!(f32_to_e4m3(447.0), 0x7E);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
    }

    #[test]
    fn e2m1_every_value_and_ties() {
        for c in 0u8..16 {
            if c == 8 {
                continue; // -0
            }
            assert_eq!(f32_to_e2m1(e2m1_to_f32(c)), c);
        }
        let cases = [
            (0.25, 0),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (7.0, 7),
            (-0.3, 9),
        ];
        for (x, c) in cases {
            assert_eq!(f32_to_e2m1(x), c, "{x}");
        }
    }

    #[test]
    fn pow2_ceil_and_ue8m0() {
        assert_eq!(pow2_ceil(1.0), 1.0);
        assert_eq!(pow2_ceil(1.0001), 2.0);
        assert_eq!(pow2_ceil(0.75), 1.0);
        assert_eq!(pow2_ceil(1e-4 / 448.0), 2f32.powi(-22));
        assert_eq!(ue8m0_byte(1.0), 127);
        assert_eq!(ue8m0_byte(2f32.powi(-15)), 112);
        assert_eq!(pow2_ceil(1e-40), pow2(-132));
        assert!(pow2(-132) > 0.0);
    }
}
