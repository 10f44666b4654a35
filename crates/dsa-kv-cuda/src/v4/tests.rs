//! The V4 kernels against their host references. Host tests (no GPU) cover the checks,
//! the host twins and the arithmetic the gather mirrors; the GPU tests
//! (`#[ignore = "needs a CUDA device"]`, run on the H200 with
//! `lib_tests --ignored --test-threads=1 v4::`) compare whole pools byte for byte with
//! the reference computed here (`quantize_model1_row` at `Model1PageLayout`'s offsets),
//! and show that mutated kernels fail the same comparison.

use std::sync::Arc;

use half::bf16;

use super::*;
use crate::kernels::{Guard, GuardFailure};
use crate::{DeviceBuffer, Plain};
use dsa_kv_core::ids::SlotId;
use dsa_kv_core::layout::PageIndexConverter;
use dsa_kv_core::metadata::v4::compressed_slot_mapping;
use dsa_kv_core::ops::indexer_k::{indexer_k_gather, IndexerMappings};
use dsa_kv_core::ops::quant::{
    block_scale, e4m3_table, quantize_fp8_token, ue8m0_byte, ScaleFormat, FP8_E4M3_MAX,
};
use dsa_kv_core::rng::SplitMix64;

const UNIT: PageIndexConverter = PageIndexConverter {
    scale: 1,
    layer_offset: 0,
    expansion: 1,
};

const fn page(entries: u32) -> Model1PageLayout {
    Model1PageLayout { entries }
}

// ---- inputs ----------------------------------------------------------------------------

fn sign(rng: &mut SplitMix64) -> f32 {
    if rng.below(2) == 0 {
        1.0
    } else {
        -1.0
    }
}

/// Uniform in [0, 1) with 24 bits.
fn unit(rng: &mut SplitMix64) -> f32 {
    (rng.next_u64() >> 40) as f32 / 16_777_216.0
}

fn p2(k: i32) -> f32 {
    2f32.powi(k)
}

/// One 64-value NoPE tile of one of the kinds the quantizer has edges at, the tile's
/// magnitude 2^k at random.
fn edge_tile(rng: &mut SplitMix64) -> Vec<bf16> {
    let k = rng.below(61) as i32 - 30;
    let f = bf16::from_f32;
    let mut t = vec![bf16::ZERO; 64];
    let pos = rng.below(64) as usize;
    match rng.below(10) {
        // Plain values at the tile's magnitude.
        0 | 1 => t
            .iter_mut()
            .for_each(|x| *x = f(sign(rng) * unit(rng) * p2(k))),
        // All zeros, of both signs: amax 0, the 1e-4 floor, scale byte 105.
        2 => t.iter_mut().for_each(|x| {
            *x = if rng.below(2) == 0 {
                bf16::ZERO
            } else {
                bf16::NEG_ZERO
            }
        }),
        // Tiny: every |x| below the 1e-4 floor (2^-14 = 6.1e-5 and smaller), BF16
        // subnormals among them.
        3 => t.iter_mut().for_each(|x| {
            *x = if rng.below(4) == 0 {
                bf16::from_bits(rng.below(0x80) as u16 | (rng.below(2) as u16) << 15)
            } else {
                f(sign(rng) * unit(rng) * p2(-14 - rng.below(12) as i32))
            }
        }),
        // The scale boundary: amax exactly 448 · 2^(k-8) = 1.75 · 2^k (the largest amax
        // of scale 2^(k-8): its values reach 448 = 0x7E), or one BF16 step above (scale
        // 2^(k-7)) or below.
        4 => {
            let base = f(1.75 * p2(k)).to_bits();
            let amax = bf16::from_bits([base - 1, base, base, base + 1][rng.below(4) as usize]);
            t.iter_mut()
                .for_each(|x| *x = f(sign(rng) * unit(rng) * amax.to_f32()));
            t[pos] = f(sign(rng) * amax.to_f32());
        }
        // Large: near the top of BF16, sometimes its largest finite value or ±inf.
        5 => {
            t.iter_mut()
                .for_each(|x| *x = f(sign(rng) * unit(rng) * p2(100 + rng.below(28) as i32)));
            t[pos] = match rng.below(3) {
                0 => bf16::MAX,
                1 => f(sign(rng) * f32::INFINITY),
                _ => t[pos],
            };
        }
        // E4M3 subnormal outputs: amax 448 · 2^k (scale 2^k), the others below 2^-6 of
        // the scale.
        6 => {
            t.iter_mut()
                .for_each(|x| *x = f(sign(rng) * unit(rng) * p2(k - 6 - rng.below(6) as i32)));
            t[pos] = f(sign(rng) * 448.0 * p2(k));
        }
        // Ties: values halfway between two E4M3 codes (normal and subnormal), which round
        // to the even code; amax 448 · 2^k.
        7 => {
            t.iter_mut().for_each(|x| {
                let v = if rng.below(4) == 0 {
                    (2 * rng.below(8) + 1) as f32 * p2(-10) // halfway between subnormals
                } else {
                    let (m, e) = (rng.below(8) as f32, rng.below(14) as i32 - 6);
                    (1.0 + (2.0 * m + 1.0) / 16.0) * p2(e)
                };
                *x = f(sign(rng) * v * p2(k));
            });
            t[pos] = f(sign(rng) * 448.0 * p2(k));
        }
        // Any bit pattern: NaN of both signs, ±inf, subnormals.
        _ => t
            .iter_mut()
            .for_each(|x| *x = bf16::from_bits(rng.next_u64() as u16)),
    }
    t
}

/// `n` rows of 512 values: seven edge tiles, then 64 RoPE values of any bit pattern.
fn edge_rows(rng: &mut SplitMix64, n: usize) -> Vec<bf16> {
    let mut v = Vec::with_capacity(n * MODEL1_VALUES);
    for _ in 0..n {
        for _ in 0..7 {
            v.extend(edge_tile(rng));
        }
        v.extend((0..MODEL1_ROPE).map(|_| bf16::from_bits(rng.next_u64() as u16)));
    }
    v
}

fn bytes(rng: &mut SplitMix64, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

fn shuffle<T>(rng: &mut SplitMix64, v: &mut [T]) {
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
}

/// Up to `n` distinct row indices of a pool of `pages` pages of `entries` rows, from a
/// sparse set of pages (about a third, the last page always), in random order, with −1
/// at random places (about one in seven).
fn sparse_rows(rng: &mut SplitMix64, entries: u32, pages: u64, n: usize) -> Vec<i64> {
    let e = u64::from(entries);
    let mut rows: Vec<i64> = (0..pages)
        .filter(|&p| p + 1 == pages || rng.below(3) == 0)
        .flat_map(|p| (p * e..(p + 1) * e).map(|r| r as i64))
        .collect();
    shuffle(rng, &mut rows);
    rows.truncate(n);
    for r in rows.iter_mut() {
        if rng.below(7) == 0 {
            *r = -1;
        }
    }
    rows
}

/// The compressed write mapping of positions `[from, to)` of ratio `ratio` through a
/// block table of `blocks` random distinct pages of `pages` (−1 between group ends).
fn compressed_rows(rng: &mut SplitMix64, ratio: u64, pages: u32, from: u64, to: u64) -> Vec<i64> {
    let mut slots: Vec<SlotId> = (0..pages).map(SlotId).collect();
    shuffle(rng, &mut slots);
    slots.truncate(to.div_ceil(256) as usize);
    compressed_slot_mapping(&slots, UNIT, ratio, from, to).unwrap()
}

/// The whole pool the reference gives, computed here: for each non-negative index, the
/// row's `quantize_model1_row` bytes at `data_offset` / `scale_offset` of page `r / E`,
/// row `r mod E`; every other byte as it was.
fn expected_pool(init: &[u8], layout: Model1PageLayout, rows: &[bf16], idx: &[i64]) -> Vec<u8> {
    let mut pool = init.to_vec();
    let e = i64::from(layout.entries);
    for (t, &r) in idx.iter().enumerate() {
        if r < 0 {
            continue;
        }
        let (mut data, mut scales) = ([0u8; MODEL1_DATA], [0u8; MODEL1_SCALES]);
        quantize_model1_row(&rows[t * 512..(t + 1) * 512], &mut data, &mut scales);
        let (p, i) = ((r / e) as u64, (r % e) as u32);
        let d = layout.data_offset(p, i) as usize;
        let s = layout.scale_offset(p, i) as usize;
        pool[d..d + MODEL1_DATA].copy_from_slice(&data);
        pool[s..s + MODEL1_SCALES].copy_from_slice(&scales);
    }
    pool
}

/// Where byte `at` of a MODEL1 pool lies, for failure messages.
fn describe(layout: Model1PageLayout, at: usize) -> String {
    let pb = layout.page_bytes() as usize;
    let (p, o) = (at / pb, at % pb);
    let e = layout.entries as usize;
    if o < e * MODEL1_DATA {
        format!(
            "page {p}, row {}, data byte {}",
            o / MODEL1_DATA,
            o % MODEL1_DATA
        )
    } else if o < e * (MODEL1_DATA + MODEL1_SCALES) {
        let s = o - e * MODEL1_DATA;
        format!("page {p}, row {}, scale byte {}", s / 8, s % 8)
    } else {
        format!("page {p}, padding byte {o}")
    }
}

fn first_difference(layout: Model1PageLayout, got: &[u8], want: &[u8]) -> Option<String> {
    let diffs = got.iter().zip(want).filter(|(a, b)| a != b).count();
    let at = got.iter().zip(want).position(|(a, b)| a != b)?;
    Some(format!(
        "{diffs} bytes differ, the first at {at} ({}): device {:#04x}, reference {:#04x}",
        describe(layout, at),
        got[at],
        want[at]
    ))
}

// ---- host tests ------------------------------------------------------------------------

#[test]
fn model1_checks_refuse_the_first_row_past_the_pool() {
    let l = page(64);
    let pb = l.page_bytes();
    assert_eq!(pb, 37_440);
    let len = 3 * pb;
    // The last row of the last page fits; the first row past it does not (data row).
    assert!(check_model1(&[0i64, -1, 191, -7], l, len).is_ok());
    assert_eq!(
        check_model1(&[0i64, 5, -1, 192, 1_000], l, len),
        Err(OpError::OutOfBounds {
            token: 3,
            offset: (3 * pb) as i64,
            end: (3 * pb + 576) as i64,
            cache_len: len as usize,
        })
    );
    assert_eq!(
        model1_guard_failure(&[0i64, 5, -1, 192, 1_000], l, len),
        Some((3, 0))
    );
    // A pool that ends inside page 3's scale rows: row 192's data row fits, its scale
    // row does not (which = 1).
    let short = 3 * pb + 64 * 576 + 4;
    assert_eq!(
        check_model1(&[7i64, 192], l, short),
        Err(OpError::OutOfBounds {
            token: 1,
            offset: (3 * pb + 64 * 576) as i64,
            end: (3 * pb + 64 * 576 + 8) as i64,
            cache_len: short as usize,
        })
    );
    assert_eq!(model1_guard_failure(&[7i64, 192], l, short), Some((1, 1)));
    // Indices whose byte offsets overflow are refused, not wrapped.
    for huge in [i64::MAX, i64::MAX / 64 * 64, 1 << 60] {
        let e = check_model1(&[1i64, huge], l, len).unwrap_err();
        assert!(
            matches!(e, OpError::OutOfBounds { token: 1, .. }),
            "{huge}: {e:?}"
        );
        assert_eq!(model1_guard_failure(&[1i64, huge], l, len), Some((1, 0)));
    }
    // int32 index lists (the gather) are checked the same way.
    assert!(check_model1(&[191i32, -1], l, len).is_ok());
    assert!(check_model1(&[i32::MAX], l, len).is_err());
    // A page of no rows holds nothing.
    assert!(check_model1(&[0i64], page(0), len).is_err());
    // Any E: E = 3 rows per page, 2,304 B pages (3 · 584 = 1,752 padded to 4 · 576).
    let l3 = page(3);
    assert_eq!(l3.page_bytes(), 2_304);
    assert_eq!(
        model1_place(l3, 2 * 2_304, 5),
        Ok(Some((2_304 + 2 * 576, 2_304 + 3 * 576 + 16)))
    );
    assert!(model1_place(l3, 2 * 2_304, 6).is_err());
}

#[test]
fn model1_scatter_host_writes_the_reference_rows_at_the_page_offsets() {
    let mut rng = SplitMix64(11);
    for entries in [2u32, 64, 3] {
        let l = page(entries);
        let pages = 4u64;
        let init = bytes(&mut rng, (pages * l.page_bytes()) as usize);
        let idx = sparse_rows(&mut rng, entries, pages, 40);
        let rows = edge_rows(&mut rng, idx.len());
        let mut pool = init.clone();
        model1_scatter_host(&mut pool, l, &rows, &idx).unwrap();
        assert!(
            pool == expected_pool(&init, l, &rows, &idx),
            "E = {entries}"
        );
        // One placed row by hand: data at p · page_bytes + 576 i, scale bytes at
        // p · page_bytes + 576 E + 8 i.
        if let Some((t, &r)) = idx.iter().enumerate().find(|(_, &r)| r >= 0) {
            let (p, i) = (
                r as u64 / u64::from(entries),
                (r as u64 % u64::from(entries)) as u32,
            );
            let d = (p * l.page_bytes() + u64::from(i) * 576) as usize;
            let s = (p * l.page_bytes() + u64::from(entries) * 576 + u64::from(i) * 8) as usize;
            let (mut data, mut scales) = ([0u8; MODEL1_DATA], [0u8; MODEL1_SCALES]);
            quantize_model1_row(&rows[t * 512..(t + 1) * 512], &mut data, &mut scales);
            assert_eq!(&pool[d..d + 576], &data[..]);
            assert_eq!(&pool[s..s + 8], &scales[..]);
            assert_eq!(pool[s + 7], 0, "the pad byte");
        }
        // A batch with one index past the pool writes nothing.
        let mut bad = idx.clone();
        bad.push((pages * u64::from(entries)) as i64);
        let mut more = rows.clone();
        more.extend(edge_rows(&mut rng, 1));
        let mut refused = init.clone();
        let err = model1_scatter_host(&mut refused, l, &more, &bad).unwrap_err();
        assert!(matches!(err, OpError::OutOfBounds { token, .. } if token == idx.len()));
        assert!(refused == init);
        // Rows that do not match the indices are refused too.
        assert!(matches!(
            model1_scatter_host(&mut refused, l, &rows[..rows.len() - 512], &idx),
            Err(OpError::Length { .. })
        ));
    }
}

/// The gather decodes with two multiplies and bit fields, not the reference's table and
/// `exp2`; this is that arithmetic in Rust, equal to the reference on every code and
/// every scale byte (f32 arithmetic is IEEE on both sides; NaN codes are special-cased to
/// the reference's NaN bits in the kernel).
#[test]
fn the_gathers_decode_arithmetic_equals_the_reference_on_every_byte() {
    let table = e4m3_table();
    let two_120 = f32::from_bits(0x7b80_0000);
    assert_eq!(two_120, 2f32.powi(120));
    let scale = |s: u32| {
        if s == 0 {
            f32::from_bits(0x0040_0000)
        } else {
            f32::from_bits(s << 23)
        }
    };
    for s in 0..256u32 {
        let reference = ((s as i32 - 127) as f32).exp2();
        assert_eq!(scale(s).to_bits(), reference.to_bits(), "scale byte {s}");
    }
    for b in 0..256u32 {
        if b & 0x7f == 0x7f {
            assert!(table[b as usize].is_nan());
            assert_eq!(
                (table[b as usize] * scale(200)).to_bits(),
                0x7fc0_0000,
                "the reference's NaN bits, which the kernel writes"
            );
            continue;
        }
        let x = f32::from_bits(((b & 0x80) << 24) | ((b & 0x7f) << 20)) * two_120;
        assert_eq!(x.to_bits(), table[b as usize].to_bits(), "code {b:#04x}");
        for s in 0..256u32 {
            assert_eq!(
                (x * scale(s)).to_bits(),
                (table[b as usize] * ((s as i32 - 127) as f32).exp2()).to_bits()
            );
        }
    }
    // RoPE values: `m1_bf16_quiet` (the shift, plus the quiet bit of a NaN) is the
    // reference's BF16 → f32 on every pattern.
    for b in 0..=u16::MAX {
        let quiet = if b & 0x7fff > 0x7f80 { 0x40 } else { 0 };
        let dev = f32::from_bits(u32::from(b | quiet) << 16);
        assert_eq!(
            dev.to_bits(),
            bf16::from_bits(b).to_f32().to_bits(),
            "{b:#06x}"
        );
    }
    // The scatter's scale byte: the biased exponent of the UE8M0 scale, inf clamped to
    // 254 like `ue8m0_byte`.
    for amax in [0.0f32, 1e-4, 1.0, 448.0, 449.0, 3.0e38, f32::INFINITY] {
        let s = block_scale(amax, FP8_E4M3_MAX, ScaleFormat::Ue8m0);
        assert_eq!(ue8m0_byte(s), (s.to_bits() >> 23).min(254) as u8);
    }
}

#[test]
fn model1_gather_host_decodes_what_the_scatter_wrote() {
    let mut rng = SplitMix64(12);
    let l = page(2);
    let pages = 8u64;
    let mut pool = bytes(&mut rng, (pages * l.page_bytes()) as usize);
    let idx = sparse_rows(&mut rng, 2, pages, 12);
    let rows = edge_rows(&mut rng, idx.len());
    model1_scatter_host(&mut pool, l, &rows, &idx).unwrap();
    let gidx: Vec<i32> = idx.iter().map(|&r| r as i32).collect();
    let mut out = vec![f32::NAN; gidx.len() * 512];
    model1_gather_host(&pool, l, &gidx, &mut out).unwrap();
    for (t, &r) in gidx.iter().enumerate() {
        let o = &out[t * 512..(t + 1) * 512];
        if r < 0 {
            assert!(o.iter().all(|&x| x.to_bits() == 0));
            continue;
        }
        let (mut data, mut scales) = ([0u8; MODEL1_DATA], [0u8; MODEL1_SCALES]);
        quantize_model1_row(&rows[t * 512..(t + 1) * 512], &mut data, &mut scales);
        let want = dequantize_model1_row(&data, &scales);
        assert!(o.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    let before = out.clone();
    let err = model1_gather_host(&pool, l, &[0, 16], &mut out[..1024]).unwrap_err();
    assert!(matches!(err, OpError::OutOfBounds { token: 1, .. }));
    assert!(out
        .iter()
        .zip(&before)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn state_checks_and_host_scatter() {
    let mut rng = SplitMix64(13);
    let rb = 36u32;
    let len = 10 * 36 + 20; // a partial row at the end: row 10 does not fit
    let init = bytes(&mut rng, len);
    let idx = vec![3i64, -1, 9, 0];
    let rows = bytes(&mut rng, idx.len() * 36);
    let mut pool = init.clone();
    state_scatter_host(&mut pool, rb, &rows, &idx).unwrap();
    for (t, &r) in idx.iter().enumerate() {
        if r >= 0 {
            let o = r as usize * 36;
            assert_eq!(&pool[o..o + 36], &rows[t * 36..(t + 1) * 36]);
        }
    }
    assert_eq!(&pool[360..], &init[360..]);
    assert_eq!(
        check_state(&[1, 10], rb, len as u64),
        Err(OpError::OutOfBounds {
            token: 1,
            offset: 360,
            end: 396,
            cache_len: len
        })
    );
    assert!(check_state(&[i64::MAX], rb, len as u64).is_err());
    assert!(check_state(&[0], 6, len as u64).is_err(), "not fp32 rows");
    let mut refused = init.clone();
    let err = state_scatter_host(&mut refused, rb, &rows[..72], &[2, 11]).unwrap_err();
    assert!(matches!(err, OpError::OutOfBounds { token: 1, .. }));
    assert!(refused == init);
}

#[test]
fn entry_key_maps_follow_the_indexer_page_layout() {
    let ix = IndexerPageLayout {
        tokens_per_block: 64,
        data_bytes: 128,
        scale_bytes: 4,
    };
    let rows = [0i64, 63, 64, -1, 130, 1 << 62];
    let (v, s) = entry_key_maps(&rows, ix);
    assert_eq!(&v[..5], &[0, 63 * 128, 8_448, -1, 2 * 8_448 + 2 * 128]);
    assert_eq!(
        &s[..5],
        &[
            8_192,
            8_192 + 63 * 4,
            8_448 + 8_192,
            -1,
            2 * 8_448 + 8_192 + 8
        ]
    );
    assert_eq!(
        (v[5], s[5]),
        (i64::MAX, i64::MAX),
        "overflow: refused later"
    );
    // A V4 ratio-4 mapping: −1 between group ends, each group end its entry's offsets.
    let mut rng = SplitMix64(14);
    let m = compressed_rows(&mut rng, 4, 20, 250, 1_300);
    let (v, s) = entry_key_maps(&m, ix);
    for ((&r, &vo), &so) in m.iter().zip(&v).zip(&s) {
        if r < 0 {
            assert_eq!((vo, so), (-1, -1));
        } else {
            let (p, i) = (r as u64 / 64, (r % 64) as u32);
            assert_eq!(
                (vo, so),
                (ix.value_offset(p, i) as i64, ix.scale_offset(p, i) as i64)
            );
        }
    }
}

/// Runs wherever NVRTC can be loaded (no GPU needed).
#[test]
fn v4_kernels_compile_with_nvrtc_when_available() {
    match compile_v4_kernels() {
        Err(CudaError::NoDevice { .. }) => {} // no NVRTC here (CI); the GPU run covers it
        Err(e) => panic!("{e}"),
        Ok(ptx) => {
            for name in V4_ENTRY_POINTS {
                assert!(ptx.contains(&format!(".entry {name}(")), "{name} missing");
            }
        }
    }
}

// ---- GPU tests -------------------------------------------------------------------------

fn gpu() -> Arc<Gpu> {
    Gpu::open(0).expect("GPU 0")
}

fn buf<T: Plain>(g: &Gpu, v: &[T]) -> DeviceBuffer {
    DeviceBuffer::from_slice(g, v, "test").unwrap()
}

fn read<T: Plain>(g: &Gpu, b: &DeviceBuffer, n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    g.download(b, &mut v).unwrap();
    v
}

fn m1pool(b: &DeviceBuffer, l: Model1PageLayout) -> Model1Pool {
    Model1Pool {
        pool: b.ptr(),
        pool_len: b.len() as u64,
        page: l,
    }
}

/// How a case bounds its indices.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Host,
    Checked,
    Guard,
}

/// Scatters `rows` at `idx` into a pool of random bytes on the device and compares the
/// whole pool with [`expected_pool`]; `Err` says where they differ.
fn scatter_case(
    k: &V4Kernels,
    g: &Gpu,
    rng: &mut SplitMix64,
    l: Model1PageLayout,
    pages: u64,
    idx: &[i64],
    mode: Mode,
) -> Result<(Vec<u8>, DeviceBuffer), String> {
    let init = bytes(rng, (pages * l.page_bytes()) as usize);
    let rows = edge_rows(rng, idx.len());
    let want = expected_pool(&init, l, &rows, idx);
    let mut twin = init.clone();
    model1_scatter_host(&mut twin, l, &rows, idx).unwrap();
    assert!(twin == want, "the host twin is the reference");
    let (pool, rb, ib) = (buf(g, &init), buf(g, &rows), buf(g, idx));
    let flag = buf(g, &[u64::MAX]);
    let bounds = match mode {
        Mode::Host => Bounds::Host(idx),
        Mode::Checked => Bounds::Checked(check_model1(idx, l, init.len() as u64).unwrap()),
        Mode::Guard => Bounds::Guard(Guard {
            flag: flag.ptr(),
            op: 2,
        }),
    };
    // SAFETY: the buffers hold what the kernel reads and writes.
    unsafe {
        k.model1_scatter(
            g.compute(),
            0,
            m1pool(&pool, l),
            rb.ptr(),
            ib.ptr(),
            idx.len(),
            bounds,
        )
    }
    .unwrap();
    g.synchronize().unwrap();
    if let Some(f) = GuardFailure::decode(read::<u64>(g, &flag, 1)[0]) {
        return Err(format!(
            "E = {}: the guard refused an index in range: {f:?}",
            l.entries
        ));
    }
    let got: Vec<u8> = read(g, &pool, init.len());
    match first_difference(l, &got, &want) {
        None => Ok((want, pool)),
        Some(d) => Err(format!(
            "E = {}, {} rows ({mode:?}): {d}",
            l.entries,
            idx.len()
        )),
    }
}

/// The scatter cases: random sparse pages in random order with −1, and the compressed
/// caches' own write mappings (ratio 4 → E = 64, ratio 128 → E = 2), for E = 64, 2 and
/// a non-power-of-two E; `Err` at the first case that differs.
fn scatter_cases(k: &V4Kernels, g: &Gpu, seed: u64) -> Result<usize, String> {
    let mut rng = SplitMix64(seed);
    let mut cases = 0;
    for (entries, pages, n) in [
        (64u32, 40u64, 1usize),
        (64, 40, 900),
        (2, 600, 500),
        (3, 100, 200),
        (64, 3, 0),
    ] {
        for mode in [Mode::Host, Mode::Checked, Mode::Guard] {
            let idx = sparse_rows(&mut rng, entries, pages, n);
            scatter_case(k, g, &mut rng, page(entries), pages, &idx, mode)?;
            cases += 1;
        }
    }
    for (ratio, entries) in [(4u64, 64u32), (128, 2)] {
        let pages = 24u32;
        let from = 256 * rng.below(3) + rng.below(256);
        let to = (from + 1_000 + rng.below(3_000)).min(u64::from(pages) * 256);
        let idx = compressed_rows(&mut rng, ratio, pages, from, to);
        assert!(idx.iter().any(|&r| r < 0) && idx.iter().any(|&r| r >= 0));
        scatter_case(
            k,
            g,
            &mut rng,
            page(entries),
            u64::from(pages),
            &idx,
            Mode::Host,
        )?;
        cases += 1;
    }
    Ok(cases)
}

#[test]
#[ignore = "needs a CUDA device"]
fn v4_model1_scatter_matches_the_reference_byte_for_byte() {
    let g = gpu();
    let k = V4Kernels::load(&g).unwrap();
    let cases = scatter_cases(&k, &g, 21).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{cases} scatter cases byte-identical");
}

/// Flipping the rounding (of the values or of the scale) or the page offset in the kernel
/// makes the comparison fail: the tests see what they are meant to see.
#[test]
#[ignore = "needs a CUDA device"]
fn v4_mutated_kernels_fail_the_comparison() {
    let g = gpu();
    let mutants = [
        (
            "value rounding: to nearest even -> toward zero",
            "y[i] = div_pow2(x, inv);",
            "y[i] = __uint_as_float(__float_as_uint(div_pow2(x, inv)) & 0xfff00000u);",
        ),
        (
            "scale rounding at amax = 448 * 2^e: up instead of exact",
            "(m & 0x7fffffu) > 0x600000u ? 1u : 0u",
            "(m & 0x7fffffu) >= 0x600000u ? 1u : 0u",
        ),
        (
            "page offset without the 576-byte padding",
            "u64 base = page * page_bytes;",
            "u64 base = page * ((u64)entries * 584u);",
        ),
        (
            "scale rows at the end of the data rows of a 64-row page, whatever E",
            "*scale = base + (u64)entries * M1_DATA + (u64)i * M1_SCALES;",
            "*scale = base + 64u * M1_DATA + (u64)i * M1_SCALES;",
        ),
    ];
    for (what, from, to) in mutants {
        let src = v4_source();
        assert_eq!(src.matches(from).count(), 1, "{what}: {from}");
        let k = V4Kernels::from_source(&g, src.replace(from, to)).unwrap();
        match scatter_cases(&k, &g, 21) {
            Ok(n) => panic!("mutant '{what}' passed all {n} cases"),
            Err(e) => eprintln!("mutant '{what}' caught: {e}"),
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn v4_model1_gather_matches_the_reference_bit_for_bit() {
    let g = gpu();
    let k = V4Kernels::load(&g).unwrap();
    let mut rng = SplitMix64(22);
    for (entries, pages, n) in [(64u32, 30u64, 700usize), (2, 400, 300), (5, 50, 120)] {
        let l = page(entries);
        let written = sparse_rows(&mut rng, entries, pages, n);
        let (pool_bytes, pool) =
            scatter_case(&k, &g, &mut rng, l, pages, &written, Mode::Host).unwrap();
        let total = pages * u64::from(entries);
        // (a) The rows the scatter wrote (some twice, shuffled) and −1: equal bits.
        // (b) Any row of the pool of random bytes (every code, every scale byte):
        //     equal bits, but where a zero code meets scale byte 255 (2^128 = inf), which
        //     no writer produces (`ue8m0_byte` clamps to 254): 0 · inf is a NaN whose
        //     bits the CPU and the GPU choose differently.
        for any in [false, true] {
            let mut idx: Vec<i32> = if any {
                (0..n).map(|_| rng.below(total) as i32).collect()
            } else {
                written
                    .iter()
                    .chain(written.iter().take(n / 3))
                    .map(|&r| r as i32)
                    .collect()
            };
            shuffle(&mut rng, &mut idx);
            idx.iter_mut()
                .filter(|_| rng.below(9) == 0)
                .for_each(|r| *r = -1);
            let mut want = vec![0f32; idx.len() * 512];
            model1_gather_host(&pool_bytes, l, &idx, &mut want).unwrap();
            let out = buf(&g, &vec![0xABu8; want.len() * 4]);
            let ib = buf(&g, &idx);
            let bounds = if any {
                Bounds::Checked(check_model1(&idx, l, pool_bytes.len() as u64).unwrap())
            } else {
                Bounds::Host(&idx[..])
            };
            // SAFETY: the buffers hold what the kernel reads and writes.
            unsafe {
                k.model1_gather(
                    g.compute(),
                    0,
                    m1pool(&pool, l),
                    ib.ptr(),
                    idx.len(),
                    out.ptr(),
                    bounds,
                )
            }
            .unwrap();
            let got: Vec<f32> = read(&g, &out, want.len());
            let mut nan_pairs = 0;
            for (j, (a, b)) in got.iter().zip(&want).enumerate() {
                if a.to_bits() == b.to_bits() {
                    continue;
                }
                let (t, v) = (j / 512, j % 512);
                let scale_byte = (idx[t] >= 0 && v < 448).then(|| {
                    let (r, e) = (idx[t] as u64, u64::from(entries));
                    pool_bytes[l.scale_offset(r / e, (r % e) as u32) as usize + v / 64]
                });
                assert!(
                    any && a.is_nan() && b.is_nan() && scale_byte == Some(255),
                    "E = {entries}, row {t} (index {}), value {v}: device {a} ({:#010x}), \
                     reference {b} ({:#010x})",
                    idx[t],
                    a.to_bits(),
                    b.to_bits()
                );
                nan_pairs += 1;
            }
            eprintln!(
                "E = {entries}, {} rows (any rows: {any}): equal bits ({nan_pairs} NaN pairs \
                 of 0 · inf)",
                idx.len()
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn v4_state_scatter_matches_the_reference() {
    let g = gpu();
    let k = V4Kernels::load(&g).unwrap();
    let mut rng = SplitMix64(23);
    // The V4 state rows (8,192 / 2,048 / 4,096 B) and a row the 16-byte path cannot take.
    for (rb, rows_in_pool, n) in [
        (8192u32, 300u64, 200usize),
        (2048, 500, 400),
        (4096, 64, 64),
        (36, 1000, 700),
    ] {
        for mode in [Mode::Host, Mode::Guard] {
            let len = rows_in_pool * u64::from(rb) + 12; // a partial row at the end
            let init = bytes(&mut rng, len as usize);
            let mut idx: Vec<i64> = (0..rows_in_pool as i64).collect();
            shuffle(&mut rng, &mut idx);
            idx.truncate(n);
            idx.iter_mut()
                .filter(|_| rng.below(8) == 0)
                .for_each(|r| *r = -1);
            let rows = bytes(&mut rng, n * rb as usize);
            let mut want = init.clone();
            state_scatter_host(&mut want, rb, &rows, &idx).unwrap();
            let (pool, rbuf, ib, flag) = (
                buf(&g, &init),
                buf(&g, &rows),
                buf(&g, &idx),
                buf(&g, &[u64::MAX]),
            );
            let bounds = match mode {
                Mode::Guard => Bounds::Guard(Guard {
                    flag: flag.ptr(),
                    op: 0,
                }),
                _ => Bounds::Host(&idx[..]),
            };
            let sp = StatePool {
                pool: pool.ptr(),
                pool_len: len,
                row_bytes: rb,
            };
            // SAFETY: the buffers hold what the kernel reads and writes.
            unsafe { k.state_scatter(g.compute(), 0, sp, rbuf.ptr(), ib.ptr(), n, bounds) }
                .unwrap();
            g.synchronize().unwrap();
            assert_eq!(read::<u64>(&g, &flag, 1), [u64::MAX]);
            assert!(
                read::<u8>(&g, &pool, init.len()) == want,
                "row_bytes {rb} {mode:?}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn v4_out_of_range_indices_fail_closed() {
    let g = gpu();
    let k = V4Kernels::load(&g).unwrap();
    let mut rng = SplitMix64(24);
    let l = page(64);
    let pb = l.page_bytes();
    // Four pages, the last cut inside its scale rows: row 3 · 64 + 5's data row fits,
    // its scale row does not.
    let len = 3 * pb + 64 * 576 + 8;
    let init = bytes(&mut rng, len as usize);
    let n = 40;
    let rows = edge_rows(&mut rng, n);
    let cases: [(usize, i64); 3] = [(7, 3 * 64 + 5), (9, 10 * 64), (3, i64::MAX)];
    for (token, bad) in cases {
        let mut idx: Vec<i64> = (0..n as i64).map(|i| i * 3).collect();
        idx[token] = bad;
        idx[token + 5] = 50 * 64; // a later one too: the first one is named
        let mut host = init.clone();
        let reference = model1_scatter_host(&mut host, l, &rows, &idx).unwrap_err();
        assert!(host == init);
        let (pool, rb, ib, flag) = (
            buf(&g, &init),
            buf(&g, &rows),
            buf(&g, &idx),
            buf(&g, &[u64::MAX]),
        );
        let mp = Model1Pool {
            pool: pool.ptr(),
            pool_len: len,
            page: l,
        };
        // Host indices: refused before the launch with the reference's error.
        // SAFETY (every launch below): the buffers hold what the kernels read and write.
        let err = unsafe {
            k.model1_scatter(
                g.compute(),
                0,
                mp,
                rb.ptr(),
                ib.ptr(),
                n,
                Bounds::Host(&idx),
            )
        }
        .unwrap_err();
        assert_eq!(
            err,
            V4KernelError::OutOfBounds {
                device: 0,
                kernel: "model1_scatter",
                error: reference.clone()
            }
        );
        assert!(matches!(reference, OpError::OutOfBounds { token: t, .. } if t == token));
        // A proof for other indices or another pool is refused.
        let other = check_model1(&[0i64], l, len).unwrap();
        let err = unsafe {
            k.model1_scatter(
                g.compute(),
                0,
                mp,
                rb.ptr(),
                ib.ptr(),
                n,
                Bounds::Checked(other),
            )
        }
        .unwrap_err();
        assert!(
            matches!(err, V4KernelError::Cuda(CudaError::Invalid { .. })),
            "{err}"
        );
        // The device guard: nothing written, the flag names the token and its row.
        unsafe {
            k.model1_scatter(
                g.compute(),
                0,
                mp,
                rb.ptr(),
                ib.ptr(),
                n,
                Bounds::Guard(Guard {
                    flag: flag.ptr(),
                    op: 4,
                }),
            )
        }
        .unwrap();
        g.synchronize().unwrap();
        let (t, which) = model1_guard_failure(&idx, l, len).unwrap();
        assert_eq!(t, token);
        assert_eq!(
            GuardFailure::decode(read::<u64>(&g, &flag, 1)[0]),
            Some(GuardFailure {
                op: 4,
                token,
                which
            })
        );
        assert!(
            read::<u8>(&g, &pool, init.len()) == init,
            "the pool is unchanged"
        );
        // The gather: host indices refused; under the set flag nothing is written.
        let gidx: Vec<i32> = idx
            .iter()
            .map(|&r| r.clamp(-1, i64::from(i32::MAX)) as i32)
            .collect();
        let gib = buf(&g, &gidx);
        let out = buf(&g, &vec![0xABu8; n * 2048]);
        let err = unsafe {
            k.model1_gather(
                g.compute(),
                0,
                mp,
                gib.ptr(),
                n,
                out.ptr(),
                Bounds::Host(&gidx),
            )
        }
        .unwrap_err();
        let refused = match err {
            V4KernelError::OutOfBounds {
                kernel: "model1_gather",
                error: OpError::OutOfBounds { token: t, .. },
                ..
            } => t,
            other => panic!("{other}"),
        };
        assert_eq!(refused, token);
        unsafe {
            k.model1_gather(
                g.compute(),
                0,
                mp,
                gib.ptr(),
                n,
                out.ptr(),
                Bounds::Guard(Guard {
                    flag: flag.ptr(),
                    op: 5,
                }),
            )
        }
        .unwrap();
        g.synchronize().unwrap();
        assert!(
            read::<u8>(&g, &out, n * 2048).iter().all(|&b| b == 0xAB),
            "the output is unchanged"
        );
        assert_eq!(
            GuardFailure::decode(read::<u64>(&g, &flag, 1)[0]).map(|f| f.op),
            Some(4)
        );
        // A later guarded op of the step (a state scatter, all in range) writes nothing.
        let sp = StatePool {
            pool: pool.ptr(),
            pool_len: len,
            row_bytes: 64,
        };
        let sidx: Vec<i64> = (0..n as i64).collect();
        let (sib, srows) = (buf(&g, &sidx), buf(&g, &bytes(&mut rng, n * 64)));
        unsafe {
            k.state_scatter(
                g.compute(),
                0,
                sp,
                srows.ptr(),
                sib.ptr(),
                n,
                Bounds::Guard(Guard {
                    flag: flag.ptr(),
                    op: 6,
                }),
            )
        }
        .unwrap();
        g.synchronize().unwrap();
        assert!(
            read::<u8>(&g, &pool, init.len()) == init,
            "later guarded ops write nothing"
        );
    }
    // State rows: host refusal, guard refusal, the last row accepted.
    let rb = 2048u32;
    let len = 10 * 2048 + 100;
    let init = bytes(&mut rng, len);
    let idx = vec![0i64, 9, -1, 10, 4];
    let rows = bytes(&mut rng, idx.len() * 2048);
    let reference = state_scatter_host(&mut init.clone(), rb, &rows, &idx).unwrap_err();
    let (pool, rbuf, ib, flag) = (
        buf(&g, &init),
        buf(&g, &rows),
        buf(&g, &idx),
        buf(&g, &[u64::MAX]),
    );
    let sp = StatePool {
        pool: pool.ptr(),
        pool_len: len as u64,
        row_bytes: rb,
    };
    let err = unsafe {
        k.state_scatter(
            g.compute(),
            0,
            sp,
            rbuf.ptr(),
            ib.ptr(),
            idx.len(),
            Bounds::Host(&idx),
        )
    }
    .unwrap_err();
    assert_eq!(
        err,
        V4KernelError::OutOfBounds {
            device: 0,
            kernel: "state_scatter",
            error: reference
        }
    );
    unsafe {
        k.state_scatter(
            g.compute(),
            0,
            sp,
            rbuf.ptr(),
            ib.ptr(),
            idx.len(),
            Bounds::Guard(Guard {
                flag: flag.ptr(),
                op: 1,
            }),
        )
    }
    .unwrap();
    g.synchronize().unwrap();
    assert_eq!(
        GuardFailure::decode(read::<u64>(&g, &flag, 1)[0]),
        Some(GuardFailure {
            op: 1,
            token: 3,
            which: 0
        })
    );
    assert!(read::<u8>(&g, &pool, len) == init);
}

/// V4's indexer keys of compressed entries are V3.2's indexer K pages (128 E4M3 values and
/// a 4-byte scale word per entry, 64 entries' values then their scale words): the
/// existing quantizer and `indexer_k_scatter` / `_gather` write and read them at the
/// byte offsets `entry_key_maps` derives from the compressed write mapping's rows.
#[test]
#[ignore = "needs a CUDA device"]
fn v4_entry_keys_go_through_the_indexer_kernels() {
    let g = gpu();
    let mut rng = SplitMix64(25);
    let ix = IndexerPageLayout {
        tokens_per_block: 64,
        data_bytes: 128,
        scale_bytes: 4,
    };
    let pages = 30u32;
    let rows = compressed_rows(&mut rng, 4, pages, 300, 5_000);
    let n = rows.len();
    let keys: Vec<bf16> = (0..n)
        .flat_map(|_| edge_tile(&mut rng).into_iter().chain(edge_tile(&mut rng)))
        .collect();
    let len = u64::from(pages) * ix.page_bytes();
    let init = bytes(&mut rng, len as usize);
    // The reference: the V4 model's key quantization (UE8M0 FP8) at the entry's offsets.
    let mut want = init.clone();
    for (t, &r) in rows.iter().enumerate() {
        if r >= 0 {
            let (p, i) = (r as u64 / 64, (r % 64) as u32);
            let (v, s) = (
                ix.value_offset(p, i) as usize,
                ix.scale_offset(p, i) as usize,
            );
            let (vals, rest) = want.split_at_mut(s);
            quantize_fp8_token(
                &keys[t * 128..(t + 1) * 128],
                ScaleFormat::Ue8m0,
                &mut vals[v..v + 128],
                &mut rest[..4],
            );
        }
    }
    let (vm, sm) = entry_key_maps(&rows, ix);
    let (kb, vals, scs) = (
        buf(&g, &keys),
        DeviceBuffer::zeroed(&g, n * 128, "v").unwrap(),
        DeviceBuffer::zeroed(&g, n * 4, "s").unwrap(),
    );
    let (cache, vmb, smb, flag) = (
        buf(&g, &init),
        buf(&g, &vm),
        buf(&g, &sm),
        buf(&g, &[u64::MAX]),
    );
    let kern = g.kernels();
    // SAFETY (every launch): the buffers hold what the kernels read and write.
    unsafe {
        kern.quantize_indexer(
            g.compute(),
            0,
            kb.ptr(),
            vals.ptr(),
            scs.ptr(),
            n,
            false,
            true,
        )
        .unwrap();
        kern.indexer_k_scatter(
            g.compute(),
            0,
            cache.ptr(),
            len,
            vals.ptr(),
            scs.ptr(),
            vmb.ptr(),
            smb.ptr(),
            n,
            128,
            Some(Guard {
                flag: flag.ptr(),
                op: 0,
            }),
        )
        .unwrap();
    }
    g.synchronize().unwrap();
    assert_eq!(read::<u64>(&g, &flag, 1), [u64::MAX]);
    assert!(
        read::<u8>(&g, &cache, init.len()) == want,
        "entry keys differ"
    );
    // And read back through the same maps.
    let (mut hv, mut hs) = (vec![0u8; n * 128], vec![0u8; n * 4]);
    let maps = IndexerMappings {
        value: &vm,
        scale: &sm,
    };
    indexer_k_gather(&want, maps, 0, n, 128, &mut hv, &mut hs).unwrap();
    let (ov, os) = (
        DeviceBuffer::zeroed(&g, n * 128, "v").unwrap(),
        DeviceBuffer::zeroed(&g, n * 4, "s").unwrap(),
    );
    unsafe {
        kern.indexer_k_gather(
            g.compute(),
            0,
            cache.ptr(),
            len,
            vmb.ptr(),
            smb.ptr(),
            0,
            n,
            128,
            ov.ptr(),
            os.ptr(),
        )
        .unwrap()
    };
    assert!(read::<u8>(&g, &ov, n * 128) == hv && read::<u8>(&g, &os, n * 4) == hs);
    // An entry row past the pool is refused whole by the indexer's guard.
    let mut bad = rows.clone();
    let last = bad.iter().rposition(|&r| r >= 0).unwrap();
    bad[last] = i64::from(pages) * 64;
    let (bv, bs) = entry_key_maps(&bad, ix);
    let (bvb, bsb, flag2) = (buf(&g, &bv), buf(&g, &bs), buf(&g, &[u64::MAX]));
    let fresh = buf(&g, &init);
    unsafe {
        kern.indexer_k_scatter(
            g.compute(),
            0,
            fresh.ptr(),
            len,
            vals.ptr(),
            scs.ptr(),
            bvb.ptr(),
            bsb.ptr(),
            n,
            128,
            Some(Guard {
                flag: flag2.ptr(),
                op: 0,
            }),
        )
        .unwrap()
    };
    g.synchronize().unwrap();
    assert_eq!(
        GuardFailure::decode(read::<u64>(&g, &flag2, 1)[0]),
        Some(GuardFailure {
            op: 0,
            token: last,
            which: 0
        })
    );
    assert!(read::<u8>(&g, &fresh, init.len()) == init);
}

/// Random selections over random block tables: `(sel, nsel, row_of, table)` for `n`
/// tokens of `reqs` requests, `ms` entries at most per token, entries below what each
/// request's table holds; with `past`, token `past` selects one entry past its table.
fn selections(
    rng: &mut SplitMix64,
    per_block: u64,
    n: usize,
    ms: usize,
    cols: usize,
    past: Option<usize>,
) -> (Vec<i32>, Vec<i32>, Vec<i32>, Vec<i32>) {
    let reqs = 3;
    let mut table = vec![-1i32; reqs * cols];
    let mut held = Vec::new();
    for r in 0..reqs {
        let b = 1 + rng.below(cols as u64) as usize;
        for c in 0..b {
            table[r * cols + c] = rng.below(5000) as i32;
        }
        held.push(b as u64 * per_block);
    }
    let (mut sel, mut nsel, mut row_of) = (vec![-7i32; n * ms], Vec::new(), Vec::new());
    for t in 0..n {
        let r = rng.below(reqs as u64) as usize;
        let k = rng.below(ms as u64 + 1) as usize;
        let mut picked: Vec<i32> = (0..k).map(|_| rng.below(held[r]) as i32).collect();
        picked.sort_unstable();
        if past == Some(t) && k > 0 {
            picked[k - 1] = held[r] as i32 + rng.below(3) as i32;
        }
        sel[t * ms..t * ms + k].copy_from_slice(&picked);
        nsel.push(k as i32);
        row_of.push(r as i32);
    }
    (sel, nsel, row_of, table)
}

/// Runs `k.extra_indices` on the inputs; `(indices, lengths, fail flag)`.
#[allow(clippy::too_many_arguments)]
fn extra_case(
    k: &V4Kernels,
    g: &Gpu,
    (sel, nsel, row_of, table): &(Vec<i32>, Vec<i32>, Vec<i32>, Vec<i32>),
    ms: usize,
    cols: usize,
    conv: PageIndexConverter,
    ratio: u64,
    width: usize,
) -> (Vec<i32>, Vec<i32>, u64) {
    let n = nsel.len();
    let (sb, nb, rb, tb) = (buf(g, sel), buf(g, nsel), buf(g, row_of), buf(g, table));
    let out = buf(g, &vec![0x55i32; n * width]);
    let len = buf(g, &vec![0x55i32; n]);
    let flag = buf(g, &[u64::MAX]);
    // SAFETY: the buffers hold what the kernel reads and writes.
    unsafe {
        k.extra_indices(
            g.compute(),
            0,
            (sb.ptr(), nb.ptr(), ms, rb.ptr(), tb.ptr(), cols),
            conv,
            ratio,
            width,
            n,
            (out.ptr(), len.ptr()),
            Guard {
                flag: flag.ptr(),
                op: 3,
            },
        )
    }
    .unwrap();
    g.synchronize().unwrap();
    (
        read(g, &out, n * width),
        read(g, &len, n),
        read::<u64>(g, &flag, 1)[0],
    )
}

/// `v4_extra_indices` equals its host twin (the reference `extra_indices` per token) on
/// random selections and tables, for both ratios, two converters and padded widths; a
/// selection past its table sets the flag for the token the host twin names; a mutated
/// kernel (rows within a block taken modulo 64 whatever the ratio) fails the comparison.
#[test]
#[ignore = "needs a CUDA device"]
fn v4_extra_indices_match_the_reference() {
    let g = gpu();
    let mut rng = SplitMix64(31);
    let convs = [
        UNIT,
        PageIndexConverter {
            scale: 3,
            layer_offset: 2,
            expansion: 1,
        },
    ];
    let run = |k: &V4Kernels, rng: &mut SplitMix64| -> Result<usize, String> {
        let mut cases = 0;
        for ratio in [4u64, 128] {
            for conv in convs {
                for (n, ms, cols, extra) in [(40usize, 64usize, 6usize, 0usize), (7, 2, 30, 5)] {
                    let per_block = 256 / ratio;
                    let input = selections(rng, per_block, n, ms, cols, None);
                    let s = Selections {
                        sel: &input.0,
                        nsel: &input.1,
                        ms,
                        row_of: &input.2,
                        table: &input.3,
                        cols,
                    };
                    let width = ms + extra;
                    let (want, want_len) = extra_indices_host(&s, conv, ratio, width).unwrap();
                    let (got, got_len, flag) =
                        extra_case(k, &g, &input, ms, cols, conv, ratio, width);
                    if flag != u64::MAX || got != want || got_len != want_len {
                        return Err(format!(
                            "ratio {ratio}, {conv:?}, n {n}, ms {ms}: flag {flag:#x}, \
                             first difference at {:?}",
                            got.iter().zip(&want).position(|(a, b)| a != b)
                        ));
                    }
                    cases += 1;
                }
            }
        }
        Ok(cases)
    };
    let k = V4Kernels::load(&g).unwrap();
    let cases = run(&k, &mut rng).unwrap_or_else(|e| panic!("{e}"));
    // A selection past the table: the host twin's token, `which` 0.
    for past in [0usize, 17, 39] {
        let input = selections(&mut rng, 64, 40, 64, 6, Some(past));
        let s = Selections {
            sel: &input.0,
            nsel: &input.1,
            ms: 64,
            row_of: &input.2,
            table: &input.3,
            cols: 6,
        };
        let host = extra_indices_host(&s, UNIT, 4, 64);
        let (_, _, flag) = extra_case(&k, &g, &input, 64, 6, UNIT, 4, 64);
        match (host, GuardFailure::decode(flag)) {
            (Err((t, V4MetadataError::NoBlock { .. })), Some(f)) => {
                assert_eq!((f.op, f.token, f.which), (3, t, 0), "past {past}");
            }
            (Ok(_), None) => {} // the token selected nothing
            (h, f) => panic!("past {past}: host {h:?}, device {f:?}"),
        }
    }
    // More selected entries than the width: the host twin's `TooMany` token, `which` 0.
    let input = selections(&mut rng, 64, 40, 64, 6, None);
    let s = Selections {
        sel: &input.0,
        nsel: &input.1,
        ms: 64,
        row_of: &input.2,
        table: &input.3,
        cols: 6,
    };
    let (_, _, flag) = extra_case(&k, &g, &input, 64, 6, UNIT, 4, 10);
    match (
        extra_indices_host(&s, UNIT, 4, 10),
        GuardFailure::decode(flag),
    ) {
        (Err((t, V4MetadataError::TooMany { .. })), Some(f)) => {
            assert_eq!((f.op, f.token, f.which), (3, t, 0));
        }
        (h, f) => panic!("width 10: host {h:?}, device {f:?}"),
    }
    let src = v4_source();
    let from = "* per_block + w % per_block;";
    assert_eq!(src.matches(from).count(), 1);
    let mutant = V4Kernels::from_source(&g, src.replace(from, "* per_block + w % 64u;")).unwrap();
    match run(&mutant, &mut SplitMix64(31)) {
        Ok(n) => panic!("the mutant passed all {n} cases"),
        Err(e) => eprintln!("{cases} cases equal; the mutant is caught: {e}"),
    }
}
