//! Exact-value tests of the host reference ops. Golden bytes were computed independently
//! with Python's `ml_dtypes` (float8_e4m3fn, float4_e2m1fn, bfloat16) following the
//! algorithm in `quant.rs`.

use half::bf16;

use super::indexer_k::{indexer_k_gather, indexer_k_scatter, IndexerMappings};
use super::mla::{
    mla_gather, mla_scatter_bf16, mla_scatter_fp8_ds_mla, quantize_fp8_ds_mla_row, RowView,
};
use super::quant::*;
use super::topk::{dense_topk, topk_to_global, PrimaryPageParams};
use super::OpError;
use crate::layout::IndexerPageLayout;

fn maps<'a>(value: &'a [i64], scale: &'a [i64]) -> IndexerMappings<'a> {
    IndexerMappings { value, scale }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// The five fixed input vectors (128 BF16 values each).
fn golden_vector(k: usize) -> Vec<bf16> {
    let f: Vec<f32> = match k {
        0 => vec![0.0; 128],
        1 => (0..128)
            .map(|i| ((i as f64 - 64.0) * 0.37) as f32)
            .collect(),
        2 => {
            let m = bf16::MAX.to_f32();
            let mut v = vec![m, -m];
            v.extend((0..126).map(|i| (((i % 7) as f64 - 3.0) * 1e30) as f32));
            v
        }
        3 => {
            let mut v = vec![448.0];
            v.extend((0..127).map(|j| j as f32 * 2f32.powi(-12)));
            v
        }
        _ => {
            let mut st: u64 = 0x1234;
            (0..128)
                .map(|_| {
                    st = st
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (((st >> 40) as f64 / 16_777_216.0 - 0.5) * 20.0) as f32
                })
                .collect()
        }
    };
    f.into_iter().map(bf16::from_f32).collect()
}

/// (FP8 with f32 scale, FP8 with UE8M0 scale, FP4): 128 + 4, 128 + 4, 64 + 4 bytes.
const GOLDEN: [(&str, &str, &str); 5] = [
    ("0000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000adac6f34",
     "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000008034",
     "0000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000070707070"),
    ("fefefefdfdfdfdfdfcfcfcfcfbfbfbfbfbfafafafaf9f9f9f9f9f8f8f8f7f7f6f6f6f5f5f4f4f3f3f3f2f2f1f1f0f0efeeedecebebeae9e8e6e4e3e1dedbd6ce004e565b5e6163646668696a6b6b6c6d6e6f70707171727273737374747575767676777778787879797979797a7a7a7a7b7b7b7b7b7c7c7c7c7d7d7d7d7d7e7e0000583d",
     "fcfcfcfbfbfbfbfbfafafafafaf9f9f9f9f9f8f8f8f8f8f7f7f6f6f6f5f5f5f4f4f4f3f3f2f2f2f1f1f0f0f0efeeededecebeaeae9e8e7e5e4e2e1dfdcd9d4cc004c54595c5f616264656768696a6a6b6c6d6d6e6f707070717172727273737474747575757676767777787878787879797979797a7a7a7a7a7b7b7b7b7b7c7c0000803d",
     "ffffffffffeeeeeeeeeeeeeeeededdddffffefeeeeeeeeddddcdccbcbbaa9989001121323344445555656666666677775555556666666666666666767777777781808081"),
    ("7efe808080000000008080800000000080808000000000808080000000008080800000000080808000000000808080000000008080800000000080808000000000808080000000008080800000000080808000000000808080000000008080800000000080808000000000808080000000008080800000000080808000000000dbb6117b",
     "78f88080800000000080808000000000808080000000008080800000000080808000000000808080000000008080800000000080808000000000808080000000008080800000000080808000000000808080000000008080800000000080808000000000808080000000008080800000000080808000000000808080000000000000807b",
     "e68808008088000088080080880000880b53e6bd3065de0b53e6bd3065de0b53e6bd3065de0b53e6bd3065de0b53e6bd3065de0b53e6bd3065de0b53e6bd3065fde2e2e2"),
    ("7e000000000001010101010101020202020202020202030303030303030404040404040404040505050505050506060606060606060607070707070707080808080808080808090909090909090a0a0a0a0a0a0a0a0a0b0b0b0b0b0b0b0c0c0c0c0c0c0c0c0c0d0d0d0d0d0d0d0e0e0e0e0e0e0e0e0e0f0f0f0f0f0f0f1010100000803f",
     "7e000000000001010101010101020202020202020202030303030303030404040404040404040505050505050506060606060606060607070707070707080808080808080808090909090909090a0a0a0a0a0a0a0a0a0b0b0b0b0b0b0b0c0c0c0c0c0c0c0c0c0d0d0d0d0d0d0d0e0e0e0e0e0e0e0e0e0f0f0f0f0f0f0f1010100000803f",
     "0600000000000000000000000000000044444444445555555555555565666666666666666666666666777777777777775555555555555555656666666666666686777778"),
    ("78fefa7bdcf177f178fb74f9f0fbf660f8fd68785b797366fc757d76fe795c707cfbfcfa53f177747879f6766b787cebfe7df46d7af9f87371fce278fafbf4fc6adb77726bfb7ef4f9f363fb7c75ef60d47e5f46fcf5f0f6fafc74eae1f46aeff67cf9ec796258fcfdfa72fb60f67dfa707b2750fbf6f5f3fa7ddbf67afc79f0b76db33c",
     "73faf677d8ed73ec74f770f4ecf8f25bf3f9647457746f62f9717972fa74596c78f8f8f650ec72717474f272677478e7fa79f06977f4f3706df9df73f6f8f1f866d7726d68f87af0f5ef5ff87971ea5bd07a5b42f9f1ebf2f5f971e6ddf066eaf278f4e8745e54f8f9f76ef85bf279f66c77224bf7f2f1eff679d7f276f875eb0000003d",
     "e56db9b5e5d4eb1ded5150144e465e31e6deb045555c52a66e2cd64de359edec8235e2c6cde1461b6801cecbeda4c9b26dad15e0eee3c1d66300cecc6dd8e5b580808080"),
];

const GOLDEN_FP8_DS_MLA: [&str; 2] = [
    "fefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c70717374767879797a7b7c7c7d7efefdfcfcfbfaf9f9f8f6f4f3f1f0ece9e4dc005c64696c7071737476787979b76d033bb76d833bdbb6c53bb76d033c9abe94be8fbe8abe85be80be76be6cbe61be57be4dbe43be38be2ebe24be1abe0fbe05bef6bde1bdcdbdb8bda4bd8fbd76bd4dbd24bdf6bca4bc24bc0000243ca43cf63c243d4d3d763d8f3da43db83dcd3de13df63d053e0f3e1a3e243e2e3e383e433e4d3e573e613e6c3e763e803e853e8a3e8f3e943e9a3e9f3ea43ea93e",
    "f6f6f5f4f3f2f2f1f0eeedebeae8e5e2ddd500555d6265686a6b6d6e707172727374757676f6f6f5f4f3f2f2f1f0eeedebeae8e5e2ddd500555d6265686a6b6d6e707172727374757676f6f6f5f4f3f2f2f1f0eeedebeae8e5e2ddd500555d6265686a6b6d6e707172727374757676f6f6f5f4f3f2f2f1f0eeedebeae8e5e2ddd500555d6265686a6b6d6e707172727374757676f6f6f5f4f3f2f2f1f0eeedebeae8e5e2ddd500555d6265686a6b6d6e707172727374757676f6f6f5f4f3f2f2f1f0eeedebeae8e5e2ddd500555d6265686a6b6d6e707172727374757676f6f6f5f4f3f2f2f1f0eeedebeae8e5e2ddd500555d6265686a6b6d6e7071727273747a7a7bfbfafaf9f8f8f6f5f4f3f2f0eeeceae6e2da005a62666a6c6e7072737475767878797a7a7bfbfafaf9f8f8f6f5f4f3f2f0eeeceae6e2da005a62666a6c6e7072737475767878797a7a7bfbfafaf9f8f8f6f5f4f3f2f0eeeceae6e2da005a62666a6c6e7072737475767878797a7a7bfbfafaf9f8f8f6f5f4f3f2f0eeece5e2ddd500555d6265686a6b6d6e707172727374757676f6f6f5f4f3f2f2f1f0eeedebeae8e5e2ddd500555d6265686a6b6d6e707172727374757676f6f6f5f4f3f2f2f1f0eeedebeae8e5e2ddd500555d6265686a6b6d6e707172727374757676f6f6f5f4f3f2f2f1f0eeedebeae8e5e2ddd500555d6265686a6b6d6e7071720000803b0000003c0000003c0000803c9abe94be8fbe8abe85be80be76be6cbe61be57be4dbe43be38be2ebe24be1abe0fbe05bef6bde1bdcdbdb8bda4bd8fbd76bd4dbd24bdf6bca4bc24bc0000243ca43cf63c243d4d3d763d8f3da43db83dcd3de13df63d053e0f3e1a3e243e2e3e383e433e4d3e573e613e6c3e763e803e853e8a3e8f3e943e9a3e9f3ea43ea93e",
];

#[test]
fn indexer_quantization_golden_bytes() {
    for (k, (f32s, ue8m0, fp4)) in GOLDEN.iter().enumerate() {
        let x = golden_vector(k);
        for (fmt, want) in [(ScaleFormat::F32, f32s), (ScaleFormat::Ue8m0, ue8m0)] {
            let mut v = [0u8; 128];
            let mut s = [0u8; 4];
            quantize_fp8_token(&x, fmt, &mut v, &mut s);
            let got: Vec<u8> = v.iter().chain(&s).copied().collect();
            assert_eq!(got, hex(want), "vector {k} fp8 {fmt:?}");
        }
        let mut v = [0u8; 64];
        let mut s = [0u8; 4];
        quantize_fp4_token(&x, &mut v, &mut s);
        let got: Vec<u8> = v.iter().chain(&s).copied().collect();
        assert_eq!(got, hex(fp4), "vector {k} fp4");
    }
}

#[test]
fn quantization_special_cases() {
    // Zero vector: the 1e-4 floor keeps the scale finite; every code is +0.
    let zero = golden_vector(0);
    let (mut v, mut s) = ([0u8; 128], [0u8; 4]);
    quantize_fp8_token(&zero, ScaleFormat::Ue8m0, &mut v, &mut s);
    assert!(v.iter().all(|&b| b == 0));
    assert_eq!(f32::from_le_bytes(s), 2f32.powi(-22));
    // Max magnitude: ±bf16::MAX map to ±448 exactly with an f32 scale.
    let big = golden_vector(2);
    quantize_fp8_token(&big, ScaleFormat::F32, &mut v, &mut s);
    assert_eq!((v[0], v[1]), (0x7E, 0xFE));
    // Subnormal outputs: amax 448 gives scale 1; 2^-9 is the smallest subnormal.
    let sub = golden_vector(3);
    quantize_fp8_token(&sub, ScaleFormat::Ue8m0, &mut v, &mut s);
    assert_eq!(f32::from_le_bytes(s), 1.0);
    // j·2^-12: j ≤ 4 round to 0 (2^-10 ties to even), j = 5..=8 to 2^-9, j = 12 is
    // 1.5·2^-9, a tie that goes to 2·2^-9.
    assert_eq!(&v[..10], &[0x7E, 0, 0, 0, 0, 0, 1, 1, 1, 1]);
    assert_eq!(v[13], 0x02);
    // Dequantization inverts within the format's precision.
    let x = golden_vector(4);
    let mut out = [0f32; 128];
    quantize_fp8_token(&x, ScaleFormat::F32, &mut v, &mut s);
    dequantize_fp8_token(&v, &s, &mut out);
    for (a, b) in x.iter().zip(&out) {
        assert!((a.to_f32() - b).abs() <= 10.0 / 16.0, "{a} vs {b}");
    }
    let (mut v4, mut s4) = ([0u8; 64], [0u8; 4]);
    quantize_fp4_token(&x, &mut v4, &mut s4);
    dequantize_fp4_token(&v4, &s4, &mut out);
    for (a, b) in x.iter().zip(&out) {
        assert!((a.to_f32() - b).abs() <= 2.0, "{a} vs {b}");
    }
}

fn golden_mla_row() -> Vec<bf16> {
    (0..512)
        .map(|i| (((i % 37) as f64 - 18.0) * 0.05 * (1 + i / 128) as f64) as f32)
        .chain((0..64).map(|j| (j as f64 * 0.01 - 0.3) as f32))
        .map(bf16::from_f32)
        .collect()
}

#[test]
fn fp8_ds_mla_row_golden_bytes_and_layout() {
    let row = golden_mla_row();
    for (fmt, want) in [
        (ScaleFormat::F32, GOLDEN_FP8_DS_MLA[0]),
        (ScaleFormat::Ue8m0, GOLDEN_FP8_DS_MLA[1]),
    ] {
        let mut out = [0u8; 656];
        quantize_fp8_ds_mla_row(&row, fmt, &mut out);
        assert_eq!(out.to_vec(), hex(want), "{fmt:?}");
        // Rope values are the input BF16 bits at [528, 656).
        for j in 0..64 {
            assert_eq!(
                u16::from_le_bytes([out[528 + 2 * j], out[529 + 2 * j]]),
                row[512 + j].to_bits()
            );
        }
    }
}

/// A random page table: request blocks map to distinct, shuffled pages.
fn page_table(rng: &mut u64, blocks: usize, pages: usize) -> Vec<u64> {
    let mut all: Vec<u64> = (0..pages as u64).collect();
    for i in (1..all.len()).rev() {
        *rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        all.swap(i, (*rng >> 33) as usize % (i + 1));
    }
    all.truncate(blocks);
    all
}

#[test]
fn indexer_scatter_gather_round_trips_across_page_boundaries() {
    for width in [128usize, 64] {
        for n in [63usize, 64, 65, 127, 128, 129] {
            let layout = IndexerPageLayout {
                tokens_per_block: 64,
                data_bytes: width as u32,
                scale_bytes: 4,
            };
            let pages = 8;
            let mut rng = n as u64 * 7 + width as u64;
            let table = page_table(&mut rng, n.div_ceil(64), pages);
            let vm: Vec<i64> = (0..n)
                .map(|g| layout.value_offset(table[g / 64], (g % 64) as u32) as i64)
                .collect();
            let sm: Vec<i64> = (0..n)
                .map(|g| layout.scale_offset(table[g / 64], (g % 64) as u32) as i64)
                .collect();
            assert!(vm
                .iter()
                .chain(&sm)
                .all(|&o| o >= 0 && (o as u64) < pages as u64 * layout.page_bytes()));
            let values: Vec<u8> = (0..n * width).map(|i| (i * 31 + n) as u8).collect();
            let scales: Vec<u8> = (0..n * 4).map(|i| (i * 17 + 3) as u8).collect();
            let mut cache = vec![0u8; pages * layout.page_bytes() as usize];
            indexer_k_scatter(
                &mut cache,
                &values,
                &scales,
                IndexerMappings {
                    value: &vm,
                    scale: &sm,
                },
                width,
            )
            .unwrap();
            // Token 62 at its exact offsets: values plane, then scales plane of page 0.
            let p = table[0] as usize * layout.page_bytes() as usize;
            assert_eq!(
                &cache[p + 62 * width..p + 63 * width],
                &values[62 * width..63 * width]
            );
            assert_eq!(
                &cache[p + 64 * width + 62 * 4..p + 64 * width + 63 * 4],
                &scales[62 * 4..63 * 4]
            );
            let (mut gv, mut gs) = (vec![0u8; n * width], vec![0u8; n * 4]);
            indexer_k_gather(
                &cache,
                IndexerMappings {
                    value: &vm,
                    scale: &sm,
                },
                0,
                n,
                width,
                &mut gv,
                &mut gs,
            )
            .unwrap();
            assert_eq!(
                (gv, gs),
                (values.clone(), scales.clone()),
                "width {width} n {n}"
            );
            // A sub-range (as a prefill chunk reads it).
            let (mut gv, mut gs) = (vec![0u8; 10 * width], vec![0u8; 40]);
            indexer_k_gather(
                &cache,
                IndexerMappings {
                    value: &vm,
                    scale: &sm,
                },
                n - 10,
                10,
                width,
                &mut gv,
                &mut gs,
            )
            .unwrap();
            assert_eq!(gv, values[(n - 10) * width..].to_vec());
        }
    }
}

#[test]
fn negative_mappings_leave_the_cache_untouched() {
    let layout = IndexerPageLayout {
        tokens_per_block: 64,
        data_bytes: 128,
        scale_bytes: 4,
    };
    let mut cache = vec![0xABu8; 2 * layout.page_bytes() as usize];
    let vm = [-1i64, layout.value_offset(1, 3) as i64, -1];
    let sm = [-1i64, layout.scale_offset(1, 3) as i64, -5];
    indexer_k_scatter(&mut cache, &[1u8; 384], &[2u8; 12], maps(&vm, &sm), 128).unwrap();
    let written: usize = cache.iter().filter(|&&b| b != 0xAB).count();
    assert_eq!(written, 128 + 4);
    // Out of bounds: an error and no byte written.
    let before = cache.clone();
    let bad = [0i64, cache.len() as i64 - 100];
    let err = indexer_k_scatter(&mut cache, &[9u8; 256], &[9u8; 8], maps(&bad, &[0, 0]), 128)
        .unwrap_err();
    assert!(
        matches!(err, OpError::OutOfBounds { token: 1, .. }),
        "{err}"
    );
    assert_eq!(cache, before);
    assert_eq!(
        indexer_k_scatter(&mut cache, &[0u8; 96], &[0u8; 4], maps(&[0], &[0]), 96),
        Err(OpError::PayloadWidth { got: 96 })
    );
    assert!(matches!(
        indexer_k_scatter(&mut cache, &[0u8; 100], &[0u8; 4], maps(&[0], &[0]), 128),
        Err(OpError::Length { what: "values", .. })
    ));
}

#[test]
fn mla_rows_scatter_through_strided_views() {
    // Layer 1 of a 3-layer V2 key pool: base = 1 page, stride = 3 pages.
    let view = RowView {
        base: 64 * 1152,
        block_stride: 3 * 64 * 1152,
        tokens_per_block: 64,
        row_bytes: 1152,
    };
    let mut cache = vec![0u8; 4 * 3 * 64 * 1152];
    let rows: Vec<bf16> = (0..2 * 576).map(|i| bf16::from_f32(i as f32)).collect();
    mla_scatter_bf16(&mut cache, &view, &rows, &[2 * 64 + 5, -1]).unwrap();
    let off = (64 * 1152 + 2 * 3 * 64 * 1152 + 5 * 1152) as usize;
    assert_eq!(view.offset(2 * 64 + 5), off as u64);
    assert_eq!(
        u16::from_le_bytes([cache[off + 2], cache[off + 3]]),
        bf16::from_f32(1.0).to_bits()
    );
    let mut back = vec![0u8; 1152];
    mla_gather(&cache, &view, &[2 * 64 + 5], &mut back).unwrap();
    assert_eq!(back, cache[off..off + 1152].to_vec());
    let ds = RowView {
        row_bytes: 656,
        base: 0,
        block_stride: 64 * 656,
        tokens_per_block: 64,
    };
    let mut cache = vec![0u8; 2 * 64 * 656];
    let row = golden_mla_row();
    mla_scatter_fp8_ds_mla(&mut cache, &ds, &row, &[64 + 1], ScaleFormat::F32).unwrap();
    assert_eq!(
        cache[(65 * 656)..(66 * 656)].to_vec(),
        hex(GOLDEN_FP8_DS_MLA[0])
    );
    assert!(matches!(
        mla_scatter_fp8_ds_mla(&mut cache, &view, &row, &[0], ScaleFormat::F32),
        Err(OpError::Length { .. })
    ));
}

#[test]
fn topk_to_global_matches_brute_force() {
    let (t, blocks_per_req, max_blocks, reqs, k) = (64u32, 6usize, 8usize, 5usize, 96usize);
    for (scale, offset) in [(61u32, 0u32), (61, 17), (61, 60), (1, 0)] {
        let mut rng = u64::from(scale * 100 + offset);
        let mut table = vec![-1i32; reqs * max_blocks];
        let slots = page_table(&mut rng, reqs * blocks_per_req, 200);
        for r in 0..reqs {
            for b in 0..blocks_per_req {
                table[r * max_blocks + b] = slots[r * blocks_per_req + b] as i32;
            }
        }
        let rows = 2 * reqs;
        let row_request: Vec<i32> = (0..rows).map(|i| (i % reqs) as i32).collect();
        let topk: Vec<i32> = (0..rows * k)
            .map(|_| {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1);
                let v = (rng >> 33) % (max_blocks as u64 * 64 + 64);
                if v.is_multiple_of(9) {
                    -1
                } else {
                    v as i32
                }
            })
            .collect();
        let params = PrimaryPageParams {
            tokens_per_block: t,
            scale,
            layer_offset: offset,
        };
        let mut out = vec![0i32; rows * k];
        topk_to_global(&topk, k, &row_request, &table, max_blocks, params, &mut out).unwrap();
        for row in 0..rows {
            let r = row_request[row] as usize;
            for j in 0..k {
                let p = topk[row * k + j];
                // Brute force: the flat row id whose (slot, page, pos) holds position p.
                let want = if p < 0
                    || p as usize / 64 >= max_blocks
                    || table[r * max_blocks + p as usize / 64] < 0
                {
                    -1
                } else {
                    let slot = table[r * max_blocks + p as usize / 64] as i64;
                    let page = slot * i64::from(scale) + i64::from(offset);
                    (page * 64 + i64::from(p) % 64) as i32
                };
                assert_eq!(out[row * k + j], want, "row {row} p {p}");
            }
        }
    }
    let mut out = vec![0i32; 8];
    dense_topk(&[3, 0], 4, &mut out).unwrap();
    assert_eq!(out, vec![0, 1, 2, -1, -1, -1, -1, -1]);
    assert!(matches!(
        dense_topk(&[5], 4, &mut out[..4]),
        Err(OpError::Length { .. })
    ));
    let params = PrimaryPageParams {
        tokens_per_block: 64,
        scale: 61,
        layer_offset: 0,
    };
    let huge = [i32::MAX / 100];
    assert!(matches!(
        topk_to_global(&[1], 1, &[0], &huge, 1, params, &mut [0]),
        Err(OpError::Int32Overflow { .. })
    ));
}

#[test]
fn nvfp4_rows_round_trip_within_precision() {
    use super::mla::{mla_scatter_nvfp4, quantize_nvfp4_row, NVFP4_BLOCK};
    let row: Vec<bf16> = (0..576)
        .map(|i| bf16::from_f32(((i % 23) as f32 - 11.0) * 0.25))
        .collect();
    let (mut data, mut scales) = (vec![0u8; 288], vec![0u8; 36]);
    quantize_nvfp4_row(&row, &mut data, &mut scales);
    // Block 0 holds -11..=4 × 0.25: amax 2.75, scale e4m3(2.75 / 6) = 0.46875 (0x2F).
    assert_eq!(scales[0], f32_to_e4m3(2.75 / 6.0));
    assert_eq!(e4m3_to_f32(scales[0]), 0.46875);
    for (b, block) in row.chunks_exact(NVFP4_BLOCK).enumerate() {
        let s = e4m3_to_f32(scales[b]);
        for (j, x) in block.iter().enumerate() {
            let byte = data[b * 8 + j / 2];
            let code = if j % 2 == 0 { byte & 0xF } else { byte >> 4 };
            let y = e2m1_to_f32(code) * s;
            assert!((x.to_f32() - y).abs() <= s, "{x} vs {y}");
        }
    }
    let dv = RowView {
        base: 0,
        block_stride: 64 * 288,
        tokens_per_block: 64,
        row_bytes: 288,
    };
    let sv = RowView {
        base: 0,
        block_stride: 64 * 36,
        tokens_per_block: 64,
        row_bytes: 36,
    };
    let (mut dc, mut sc) = (vec![0u8; 2 * 64 * 288], vec![0u8; 2 * 64 * 36]);
    mla_scatter_nvfp4(&mut dc, &dv, &mut sc, &sv, &row, &[70]).unwrap();
    assert_eq!(&dc[70 * 288..71 * 288], &data[..]);
    assert_eq!(&sc[70 * 36..71 * 36], &scales[..]);
    assert!(matches!(
        mla_scatter_nvfp4(&mut dc, &dv, &mut sc, &sv, &row, &[128]),
        Err(OpError::OutOfBounds { .. })
    ));
}
