//! GPU tests: every kernel against its host reference, byte for byte, on random inputs
//! (page boundaries, negative mappings, out-of-range mappings, empty batches), plus VMM
//! pools and copy plans. They need an H100/H200 and run with
//! `cargo test --release -- --ignored` on the GPU machine, one test at a time (without a
//! GPU on the build machine: `bash benches/build_gpu.sh` builds the test binaries and
//! `bash benches/gpu_session.sh` runs them there; README.md, "On a GPU"; results in
//! `benches/results/`). The no-driver test runs everywhere.

use std::sync::Arc;

use half::bf16;

use super::kernels::{DevRows, Guard, GuardFailure, MlaEncoding, RecomputeTables};
use super::*;
use dsa_kv_core::config::{DsaModel, LayerSet};
use dsa_kv_core::ids::{Fence, PoolGroupId, SlotId, Tier};
use dsa_kv_core::layout::{IndexerPageLayout, LayoutKind, PoolPlan};
use dsa_kv_core::metadata::{MetadataDims, MetadataLayout, RequestKind, StepMetadata, StepRequest};
use dsa_kv_core::ops::indexer_k::{indexer_k_gather, indexer_k_scatter, IndexerMappings};
use dsa_kv_core::ops::mla::{
    mla_scatter_bf16, mla_scatter_fp8, mla_scatter_fp8_ds_mla, mla_scatter_nvfp4, RowView,
};
use dsa_kv_core::ops::quant::{quantize_fp4_token, quantize_fp8_token, ScaleFormat};
use dsa_kv_core::ops::topk::{dense_topk, topk_to_global, PrimaryPageParams};
use dsa_kv_core::ops::{CopyPlan, GroupCopy, OpError};
use dsa_kv_core::rng::SplitMix64;
use dsa_kv_core::storage::{HostStorage, KvStorage};

/// The crate's generator with the test inputs built on it.
struct Rng(SplitMix64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }
    /// BF16 values: mostly normal numbers at a per-call magnitude, some arbitrary bit
    /// patterns (subnormals, huge values, ±inf, NaN of both signs).
    fn bf16s(&mut self, n: usize) -> Vec<bf16> {
        let mag = 2f32.powi(self.below(40) as i32 - 20);
        (0..n)
            .map(|_| match self.below(16) {
                0 => bf16::from_bits(self.next() as u16),
                _ => {
                    let u = (self.next() >> 40) as f32 / 16_777_216.0 - 0.5;
                    bf16::from_f32(u * mag)
                }
            })
            .collect()
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn gpu() -> Arc<Gpu> {
    Gpu::open(0).expect("GPU 0")
}

fn buf<T: Plain>(g: &Gpu, v: &[T]) -> DeviceBuffer {
    DeviceBuffer::from_slice(g, v, "test").unwrap()
}

/// Copies `bytes` from device address `src` to `dst` with the batched-copy kernel and
/// waits.
fn device_copy(g: &Gpu, dst: u64, src: u64, bytes: usize) {
    let tasks = buf(g, &[dst, src]);
    // SAFETY: the callers pass mapped ranges of at least `bytes` bytes.
    unsafe {
        g.kernels()
            .batched_copy(
                g.compute(),
                0,
                tasks.ptr(),
                tasks.ptr() + 8,
                1,
                bytes as u64,
            )
            .unwrap();
    }
    g.synchronize().unwrap();
}

fn read<T: Plain>(g: &Gpu, b: &DeviceBuffer, n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    g.download(b, &mut v).unwrap();
    v
}

#[test]
fn without_a_driver_every_entry_point_says_no_cuda_device() {
    if driver_present() {
        return; // covered by the GPU tests on a GPU machine
    }
    assert!(matches!(Gpu::open(0), Err(CudaError::NoDevice { .. })));
    assert!(matches!(device_count(), Err(CudaError::NoDevice { .. })));
    let err = Gpu::open(0).unwrap_err().to_string();
    assert!(err.starts_with("no CUDA device"), "{err}");
}

/// Runs wherever NVRTC can be loaded (no GPU needed): the kernels compile for sm_90a and
/// export every entry point the wrappers load.
#[test]
fn kernels_compile_with_nvrtc_when_available() {
    match compile_kernels() {
        Err(CudaError::NoDevice { .. }) => {} // no NVRTC here (CI); the GPU run covers it
        Err(e) => panic!("{e}"),
        Ok(ptx) => {
            eprintln!("NVRTC compiled {} bytes of PTX", ptx.len());
            for name in [
                "quantize_indexer_fp8",
                "quantize_indexer_fp4",
                "indexer_k_scatter",
                "indexer_k_gather",
                "mla_scatter_bf16",
                "mla_scatter_fp8",
                "mla_scatter_fp8_ds_mla",
                "mla_scatter_nvfp4",
                "topk_to_global",
                "dense_topk",
                "recompute_slot_mappings",
                "apply_metadata_upload",
                "batched_copy",
                "selfcheck_e4m3",
            ] {
                assert!(
                    ptx.contains(&format!(".entry {name}(")),
                    "{name} missing from the PTX"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn hardware_e4m3_conversion_equals_the_reference_on_every_f32() {
    let g = gpu();
    let (mismatches, example) = g.kernels().selfcheck_e4m3(&g).unwrap();
    assert_eq!(
        mismatches,
        0,
        "e.g. {example:#010x} ({}) converts differently, or as an amax scales differently",
        f32::from_bits(example)
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn quantize_indexer_matches_host() {
    let g = gpu();
    let mut rng = Rng(SplitMix64(1));
    for &n in &[0usize, 1, 7, 1000, 4097] {
        let keys = rng.bf16s(n * 128);
        let kb = buf(&g, &keys);
        for (fp4, ue8m0) in [(false, true), (false, false), (true, true)] {
            let width = if fp4 { 64 } else { 128 };
            let (vb, sb) = (
                DeviceBuffer::zeroed(&g, n * width, "v").unwrap(),
                DeviceBuffer::zeroed(&g, n * 4, "s").unwrap(),
            );
            unsafe {
                g.kernels()
                    .quantize_indexer(g.compute(), 0, kb.ptr(), vb.ptr(), sb.ptr(), n, fp4, ue8m0)
                    .unwrap()
            };
            let (v, s): (Vec<u8>, Vec<u8>) = (read(&g, &vb, n * width), read(&g, &sb, n * 4));
            let (mut hv, mut hs) = (vec![0u8; n * width], vec![0u8; n * 4]);
            for t in 0..n {
                let x = &keys[t * 128..(t + 1) * 128];
                let (ov, os) = (
                    &mut hv[t * width..(t + 1) * width],
                    &mut hs[t * 4..t * 4 + 4],
                );
                if fp4 {
                    quantize_fp4_token(x, ov, os);
                } else {
                    let f = if ue8m0 {
                        ScaleFormat::Ue8m0
                    } else {
                        ScaleFormat::F32
                    };
                    quantize_fp8_token(x, f, ov, os);
                }
            }
            assert!(v == hv, "values differ: n={n} fp4={fp4} ue8m0={ue8m0}");
            assert!(s == hs, "scales differ: n={n} fp4={fp4} ue8m0={ue8m0}");
        }
    }
}

/// FP8 indexer keys for the quantizer's edge cases, token by token: normal values at a
/// per-token magnitude (2^-40 .. 2^40: E4M3 subnormal codes, saturation-free), all zeros,
/// a few arbitrary bit patterns (NaN, ±inf, subnormals, huge), all NaN, BF16 subnormals
/// only (amax below the 1e-4 floor), and an amax of exactly 448 · 2^e or one BF16 step
/// above it (where the UE8M0 scale rounds up), at a random position.
fn fp8_keys(rng: &mut Rng, n: usize) -> Vec<bf16> {
    let mut keys = Vec::with_capacity(n * 128);
    for _ in 0..n {
        let kind = rng.below(8);
        // Kinds 5 and 6 plant their amax below; the other values stay under half of it.
        let top = 448.0 * 2f32.powi(rng.below(40) as i32 - 30);
        let mag = if kind >= 5 {
            top
        } else {
            2f32.powi(rng.below(81) as i32 - 40)
        };
        let start = keys.len();
        for _ in 0..128 {
            let u = (rng.next() >> 40) as f32 / 16_777_216.0 - 0.5;
            keys.push(match kind {
                1 => bf16::ZERO,
                2 if rng.below(8) == 0 => bf16::from_bits(rng.next() as u16),
                3 => bf16::from_bits(0x7fc0 | (rng.next() as u16 & 0x8000)),
                4 => bf16::from_bits((rng.next() as u16) & 0x807f),
                _ => bf16::from_f32(u * mag),
            });
        }
        if kind >= 5 {
            let bits = bf16::from_f32(top).to_bits() + u16::from(kind == 6);
            let sign = if rng.below(2) == 0 { 0 } else { 0x8000 };
            keys[start + rng.below(128) as usize] = bf16::from_bits(bits | sign);
        }
    }
    keys
}

/// Runs `k`'s FP8 quantizer over [`fp8_keys`] at sizes with every remainder modulo the
/// tokens of a warp (and a block), into outputs filled with a sentinel and 256 bytes
/// longer, and compares every byte (the sentinel past the end included) with
/// `quantize_fp8_token`. `Err` names the first difference.
fn fp8_quantize_cases(k: &Kernels, g: &Gpu) -> Result<usize, String> {
    let mut rng = Rng(SplitMix64(11));
    let mut cases = 0;
    for &n in &[
        1usize, 2, 3, 4, 5, 6, 7, 8, 9, 63, 64, 65, 66, 67, 1000, 4099,
    ] {
        let keys = fp8_keys(&mut rng, n);
        let kb = buf(g, &keys);
        for fmt in [ScaleFormat::Ue8m0, ScaleFormat::F32] {
            let mut want = (vec![0xA5u8; n * 128 + 256], vec![0xA5u8; n * 4 + 256]);
            for t in 0..n {
                quantize_fp8_token(
                    &keys[t * 128..(t + 1) * 128],
                    fmt,
                    &mut want.0[t * 128..(t + 1) * 128],
                    &mut want.1[t * 4..t * 4 + 4],
                );
            }
            let (vb, sb) = (
                buf(g, &vec![0xA5u8; want.0.len()]),
                buf(g, &vec![0xA5u8; want.1.len()]),
            );
            let ue8m0 = fmt == ScaleFormat::Ue8m0;
            // SAFETY: the buffers hold n keys, n values and n scale words (and more).
            unsafe {
                k.quantize_indexer(
                    g.compute(),
                    0,
                    kb.ptr(),
                    vb.ptr(),
                    sb.ptr(),
                    n,
                    false,
                    ue8m0,
                )
            }
            .map_err(|e| e.to_string())?;
            let got: (Vec<u8>, Vec<u8>) = (read(g, &vb, want.0.len()), read(g, &sb, want.1.len()));
            for (what, got, want, width) in [
                ("value", &got.0, &want.0, 128),
                ("scale", &got.1, &want.1, 4),
            ] {
                if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                    return Err(format!(
                        "n={n} {fmt:?}: {what} byte {i} (token {}) is {:#04x}, want {:#04x}",
                        i / width,
                        got[i],
                        want[i]
                    ));
                }
            }
            cases += 1;
        }
    }
    Ok(cases)
}

/// The crate's kernels compiled from `KERNEL_SOURCES` with `from` replaced by `to` in
/// `file` (exactly one occurrence).
fn mutated_kernels(g: &Gpu, file: &str, from: &str, to: &str) -> Kernels {
    let src: String = KERNEL_SOURCES
        .iter()
        .map(|(name, text)| {
            let text = if *name == file {
                assert_eq!(text.matches(from).count(), 1, "{file}: {from}");
                text.replace(from, to)
            } else {
                text.to_string()
            };
            format!("// ---- {name}\n{text}\n")
        })
        .collect();
    g.bind().unwrap();
    let module = g.context().load_module(compile(src).unwrap()).unwrap();
    Kernels::load(|name| {
        module
            .load_function(name)
            .map_err(|e| driver_error(0, name, e))
    })
    .unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn quantize_indexer_fp8_edge_cases_match_host() {
    let g = gpu();
    let cases = fp8_quantize_cases(g.kernels(), &g).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{cases} FP8 quantizer cases byte-identical");
}

/// Mutations of the FP8 quantizer (rounding, the amax reduction's width, the last token
/// of a batch, one half-warp's scale word) fail `fp8_quantize_cases`: it can see them.
#[test]
#[ignore = "needs a CUDA device"]
fn quantize_indexer_fp8_mutants_fail_the_comparison() {
    let g = gpu();
    let mutants = [
        (
            "value rounding: to nearest even -> toward zero",
            "y[i] = UE8M0 ? div_pow2(x, inv) : x / scale;",
            "y[i] = __uint_as_float(__float_as_uint(UE8M0 ? div_pow2(x, inv) : x / scale) & 0xfff00000u);",
        ),
        (
            "amax over 8 lanes instead of the token's 16",
            "for (int o = 8; o > 0; o >>= 1) m =",
            "for (int o = 4; o > 0; o >>= 1) m =",
        ),
        (
            "the batch's last token not written",
            "if (t < (u64)n) {",
            "if (t + 1 < (u64)n) {",
        ),
        (
            "only the first half-warp's tokens get a scale word",
            "if (part == 0) *reinterpret_cast<float*>",
            "if (lane == 0) *reinterpret_cast<float*>",
        ),
    ];
    for (what, from, to) in mutants {
        let k = mutated_kernels(&g, "quant.cu", from, to);
        match fp8_quantize_cases(&k, &g) {
            Ok(n) => panic!("mutant '{what}' passed all {n} cases"),
            Err(e) => eprintln!("mutant '{what}' caught: {e}"),
        }
    }
}

/// Mappings for `n` tokens over `pages` indexer pages: random distinct positions, some
/// −1, the first and last position of pages included.
fn indexer_maps(rng: &mut Rng, n: usize, pages: u64, width: u32) -> (Vec<i64>, Vec<i64>) {
    let ix = IndexerPageLayout {
        tokens_per_block: 64,
        data_bytes: width,
        scale_bytes: 4,
    };
    let total = pages * 64;
    let mut pos: Vec<u64> = (0..total).collect();
    for i in (1..pos.len()).rev() {
        pos.swap(i, rng.below(i as u64 + 1) as usize);
    }
    // Put the last token of page 0 and the first of page 1 first (swaps keep the
    // positions distinct).
    for (i, want) in [63u64, 64].into_iter().enumerate() {
        if let Some(j) = pos.iter().position(|&p| p == want) {
            pos.swap(i, j);
        }
    }
    pos.truncate(n);
    let mut v = Vec::with_capacity(n);
    let mut s = Vec::with_capacity(n);
    for &p in &pos {
        if rng.below(10) == 0 {
            v.push(-1);
            s.push(-1);
        } else {
            v.push(ix.value_offset(p / 64, (p % 64) as u32) as i64);
            s.push(ix.scale_offset(p / 64, (p % 64) as u32) as i64);
        }
    }
    (v, s)
}

#[test]
#[ignore = "needs a CUDA device"]
fn indexer_scatter_and_gather_match_host() {
    let g = gpu();
    let mut rng = Rng(SplitMix64(2));
    for &width in &[128u32, 64] {
        for &n in &[0usize, 1, 100, 3000] {
            let pages = (n as u64).div_ceil(64) + 2;
            let page_bytes = 64 * (width as usize + 4);
            let init = rng.bytes(pages as usize * page_bytes);
            let (vm, sm) = indexer_maps(&mut rng, n, pages, width);
            let values = rng.bytes(n * width as usize);
            let scales = rng.bytes(n * 4);
            let mut host = init.clone();
            let maps = IndexerMappings {
                value: &vm,
                scale: &sm,
            };
            indexer_k_scatter(&mut host, &values, &scales, maps, width as usize).unwrap();
            let cache = buf(&g, &init);
            let (vb, sb, vmb, smb) = (
                buf(&g, &values),
                buf(&g, &scales),
                buf(&g, &vm),
                buf(&g, &sm),
            );
            unsafe {
                g.kernels()
                    .indexer_k_scatter(
                        g.compute(),
                        0,
                        cache.ptr(),
                        init.len() as u64,
                        vb.ptr(),
                        sb.ptr(),
                        vmb.ptr(),
                        smb.ptr(),
                        n,
                        width as usize,
                        None,
                    )
                    .unwrap()
            };
            let dev: Vec<u8> = read(&g, &cache, init.len());
            assert!(dev == host, "scatter differs: width={width} n={n}");

            // Gather a window that starts mid-way.
            let start = n / 3;
            let m = n - start;
            let (mut hv, mut hs) = (vec![0u8; m * width as usize], vec![0u8; m * 4]);
            indexer_k_gather(&host, maps, start, m, width as usize, &mut hv, &mut hs).unwrap();
            let (ov, os) = (
                DeviceBuffer::zeroed(&g, m * width as usize, "v").unwrap(),
                DeviceBuffer::zeroed(&g, m * 4, "s").unwrap(),
            );
            unsafe {
                g.kernels()
                    .indexer_k_gather(
                        g.compute(),
                        0,
                        cache.ptr(),
                        init.len() as u64,
                        vmb.ptr(),
                        smb.ptr(),
                        start,
                        m,
                        width as usize,
                        ov.ptr(),
                        os.ptr(),
                    )
                    .unwrap()
            };
            assert!(
                read::<u8>(&g, &ov, hv.len()) == hv,
                "gather values: width={width} n={n}"
            );
            assert!(
                read::<u8>(&g, &os, hs.len()) == hs,
                "gather scales: width={width} n={n}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn out_of_range_mappings_fail_closed_on_the_device() {
    let g = gpu();
    let mut rng = Rng(SplitMix64(3));
    let n = 200;
    let pages = 5;
    let init = rng.bytes(pages * 64 * 132);
    let (mut vm, mut sm) = indexer_maps(&mut rng, n, pages as u64, 128);
    let values = rng.bytes(n * 128);
    let scales = rng.bytes(n * 4);
    // Tokens 5 (scale word) and 9 (payload) point past the cache: the host reference
    // refuses the batch, naming token 5, and writes nothing.
    sm[5] = init.len() as i64;
    vm[9] = init.len() as i64 - 64;
    let maps = IndexerMappings {
        value: &vm,
        scale: &sm,
    };
    let mut host = init.clone();
    let err = indexer_k_scatter(&mut host, &values, &scales, maps, 128).unwrap_err();
    assert_eq!(
        err,
        OpError::OutOfBounds {
            token: 5,
            offset: init.len() as i64,
            end: init.len() as i64 + 4,
            cache_len: init.len(),
        }
    );
    assert_eq!(host, init, "the host reference wrote nothing");
    let cache = buf(&g, &init);
    let flag = buf(&g, &[u64::MAX]);
    let (vb, sb, vmb, smb) = (
        buf(&g, &values),
        buf(&g, &scales),
        buf(&g, &vm),
        buf(&g, &sm),
    );
    let scatter = |guard: Option<Guard>| unsafe {
        g.kernels()
            .indexer_k_scatter(
                g.compute(),
                0,
                cache.ptr(),
                init.len() as u64,
                vb.ptr(),
                sb.ptr(),
                vmb.ptr(),
                smb.ptr(),
                n,
                128,
                guard,
            )
            .unwrap()
    };
    // Guarded (op 3 of a step): nothing written, the flag names token 5's scale word.
    scatter(Some(Guard {
        flag: flag.ptr(),
        op: 3,
    }));
    g.synchronize().unwrap();
    assert!(
        read::<u8>(&g, &cache, init.len()) == init,
        "the device wrote nothing"
    );
    let f = GuardFailure::decode(read::<u64>(&g, &flag, 1)[0]);
    assert_eq!(
        f,
        Some(GuardFailure {
            op: 3,
            token: 5,
            which: 1
        })
    );
    // A later guarded op of the same step writes nothing either (the host returned at
    // its first error), and leaves the flag naming the first failure.
    (vm[9], sm[5]) = (-1, -1);
    let good = buf(&g, &vm);
    let good_s = buf(&g, &sm);
    unsafe {
        g.kernels()
            .indexer_k_scatter(
                g.compute(),
                0,
                cache.ptr(),
                init.len() as u64,
                vb.ptr(),
                sb.ptr(),
                good.ptr(),
                good_s.ptr(),
                n,
                128,
                Some(Guard {
                    flag: flag.ptr(),
                    op: 4,
                }),
            )
            .unwrap()
    };
    g.synchronize().unwrap();
    assert!(
        read::<u8>(&g, &cache, init.len()) == init,
        "later ops wrote nothing"
    );
    assert_eq!(
        GuardFailure::decode(read::<u64>(&g, &flag, 1)[0]).map(|f| f.op),
        Some(3)
    );
    // Unguarded, the kernel only never writes out of range (the old, fail-open mode):
    // the other tokens land.
    scatter(None);
    g.synchronize().unwrap();
    let maps = IndexerMappings {
        value: &vm,
        scale: &sm,
    };
    let mut expect = init.clone();
    indexer_k_scatter(&mut expect, &values, &scales, maps, 128).unwrap();
    assert!(read::<u8>(&g, &cache, init.len()) == expect);
}

#[test]
#[ignore = "needs a CUDA device"]
fn out_of_range_rows_fail_closed_on_the_device() {
    let g = gpu();
    let mut rng = Rng(SplitMix64(6));
    let n = 100;
    let blocks = 3u64;
    let rows = rng.bf16s(n * 576);
    let rv = RowView {
        base: 0,
        block_stride: 64 * 656,
        tokens_per_block: 64,
        row_bytes: 656,
    };
    let init = rng.bytes((blocks * rv.block_stride) as usize);
    let mut slots: Vec<i64> = (0..n as i64)
        .map(|i| (i * 7) % (blocks as i64 * 64))
        .collect();
    slots[40] = blocks as i64 * 64 + 1;
    let mut host = init.clone();
    let err =
        mla_scatter_fp8_ds_mla(&mut host, &rv, &rows, &slots, ScaleFormat::Ue8m0).unwrap_err();
    assert!(
        matches!(err, OpError::OutOfBounds { token: 40, .. }),
        "{err:?}"
    );
    assert_eq!(host, init);
    let pool = buf(&g, &init);
    let flag = buf(&g, &[u64::MAX]);
    let (rb, slb) = (buf(&g, &rows), buf(&g, &slots));
    unsafe {
        g.kernels()
            .mla_scatter(
                g.compute(),
                0,
                DevRows {
                    pool: pool.ptr(),
                    pool_len: init.len() as u64,
                    base: 0,
                    block_stride: rv.block_stride,
                    tokens_per_block: 64,
                },
                MlaEncoding::Fp8DsMla { ue8m0: true },
                rb.ptr(),
                slb.ptr(),
                n,
                Some(Guard {
                    flag: flag.ptr(),
                    op: 0,
                }),
            )
            .unwrap()
    };
    g.synchronize().unwrap();
    assert!(
        read::<u8>(&g, &pool, init.len()) == init,
        "the device wrote nothing"
    );
    assert_eq!(
        GuardFailure::decode(read::<u64>(&g, &flag, 1)[0]),
        Some(GuardFailure {
            op: 0,
            token: 40,
            which: 0
        })
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn mla_scatters_match_host() {
    let g = gpu();
    let mut rng = Rng(SplitMix64(4));
    for &n in &[0usize, 1, 63, 64, 65, 2000] {
        let blocks = (n as u64).div_ceil(64) + 3;
        let rows = rng.bf16s(n * 576);
        // Distinct token slots over `blocks` blocks, some −1.
        let mut all: Vec<i64> = (0..blocks as i64 * 64).collect();
        for i in (1..all.len()).rev() {
            all.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let slots: Vec<i64> = all[..n]
            .iter()
            .map(|&s| if rng.below(12) == 0 { -1 } else { s })
            .collect();
        let (rb, slb) = (buf(&g, &rows), buf(&g, &slots));
        // Views with a layer offset inside a 3-layer slot: base = 1 page.
        let view = |row_bytes: u32| RowView {
            base: 64 * u64::from(row_bytes),
            block_stride: 3 * 64 * u64::from(row_bytes),
            tokens_per_block: 64,
            row_bytes,
        };
        let dev_rows = |v: &RowView, pool: &DeviceBuffer| DevRows {
            pool: pool.ptr(),
            pool_len: pool.len() as u64,
            base: v.base,
            block_stride: v.block_stride,
            tokens_per_block: 64,
        };
        // Kinds: BF16, FP8, fp8_ds_mla with UE8M0 scales, NVFP4, fp8_ds_mla with f32 scales.
        for kind in 0..5 {
            let rv = view([1152, 576, 656, 288, 656][kind]);
            let len = (blocks * rv.block_stride) as usize;
            let init = rng.bytes(len);
            let mut host = init.clone();
            let pool = buf(&g, &init);
            let (enc, extra) = match kind {
                0 => {
                    mla_scatter_bf16(&mut host, &rv, &rows, &slots).unwrap();
                    (MlaEncoding::Bf16, None)
                }
                1 => {
                    mla_scatter_fp8(&mut host, &rv, &rows, &slots, 0.75).unwrap();
                    (MlaEncoding::Fp8 { tensor_scale: 0.75 }, None)
                }
                2 | 4 => {
                    let ue8m0 = kind == 2;
                    let fmt = if ue8m0 {
                        ScaleFormat::Ue8m0
                    } else {
                        ScaleFormat::F32
                    };
                    mla_scatter_fp8_ds_mla(&mut host, &rv, &rows, &slots, fmt).unwrap();
                    (MlaEncoding::Fp8DsMla { ue8m0 }, None)
                }
                _ => {
                    let sv = view(36);
                    let sinit = rng.bytes((blocks * sv.block_stride) as usize);
                    let mut shost = sinit.clone();
                    mla_scatter_nvfp4(&mut host, &rv, &mut shost, &sv, &rows, &slots).unwrap();
                    let spool = buf(&g, &sinit);
                    let enc = MlaEncoding::Nvfp4 {
                        scales: dev_rows(&sv, &spool),
                    };
                    (enc, Some((spool, shost)))
                }
            };
            unsafe {
                g.kernels()
                    .mla_scatter(
                        g.compute(),
                        0,
                        dev_rows(&rv, &pool),
                        enc,
                        rb.ptr(),
                        slb.ptr(),
                        n,
                        None,
                    )
                    .unwrap()
            };
            assert!(read::<u8>(&g, &pool, len) == host, "MLA kind {kind}, n={n}");
            if let Some((spool, shost)) = extra {
                assert!(
                    read::<u8>(&g, &spool, shost.len()) == shost,
                    "NVFP4 scales, n={n}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn topk_kernels_match_host() {
    let g = gpu();
    let mut rng = Rng(SplitMix64(5));
    let (reqs, max_blocks, k, rows) = (6usize, 9usize, 2048usize, 17usize);
    let table: Vec<i32> = (0..reqs * max_blocks)
        .map(|_| {
            if rng.below(8) == 0 {
                -1
            } else {
                rng.below(500) as i32
            }
        })
        .collect();
    let row_request: Vec<i32> = (0..rows).map(|_| rng.below(reqs as u64) as i32).collect();
    let topk: Vec<i32> = (0..rows * k)
        .map(|_| match rng.below(10) {
            0 => -1,
            1 => (max_blocks * 64 + rng.below(100) as usize) as i32, // past the table
            _ => rng.below((max_blocks * 64) as u64) as i32,
        })
        .collect();
    let params = PrimaryPageParams {
        tokens_per_block: 64,
        scale: 61,
        layer_offset: 17,
    };
    let mut host = vec![0i32; rows * k];
    topk_to_global(
        &topk,
        k,
        &row_request,
        &table,
        max_blocks,
        params,
        &mut host,
    )
    .unwrap();
    let out = DeviceBuffer::zeroed(&g, host.len() * 4, "out").unwrap();
    unsafe {
        g.kernels()
            .topk_to_global(
                g.compute(),
                0,
                buf(&g, &topk).ptr(),
                k,
                buf(&g, &row_request).ptr(),
                rows,
                buf(&g, &table).ptr(),
                reqs,
                max_blocks,
                params,
                out.ptr(),
            )
            .unwrap()
    };
    assert_eq!(read::<i32>(&g, &out, host.len()), host);

    let kv_lens: Vec<i32> = (0..rows).map(|_| rng.below(k as u64 + 1) as i32).collect();
    let mut host = vec![0i32; rows * k];
    dense_topk(&kv_lens, k, &mut host).unwrap();
    let out = DeviceBuffer::zeroed(&g, host.len() * 4, "out").unwrap();
    unsafe {
        g.kernels()
            .dense_topk(g.compute(), 0, buf(&g, &kv_lens).ptr(), rows, k, out.ptr())
            .unwrap()
    };
    assert_eq!(read::<i32>(&g, &out, host.len()), host);
}

#[test]
#[ignore = "needs a CUDA device"]
fn slot_mapping_recompute_matches_host() {
    let g = gpu();
    let mut rng = Rng(SplitMix64(6));
    for scale in [1u32, 3] {
        let layout = MetadataLayout {
            tokens_per_block: 64,
            indexer_page_scale: scale,
            indexer: Some(IndexerPageLayout {
                tokens_per_block: 64,
                data_bytes: 128,
                scale_bytes: 4,
            }),
        };
        let dims = MetadataDims {
            max_num_sequences: 8,
            max_blocks_per_seq: 12,
            max_num_tokens: 2048,
            max_context_kv_tokens: 8192,
        };
        let mut m = StepMetadata::new(layout, dims, None, true).unwrap();
        let slots: Vec<Vec<i32>> = (0..8)
            .map(|_| (0..12).map(|_| rng.below(1000) as i32).collect())
            .collect();
        let mut reqs = Vec::new();
        let mut news = Vec::new();
        for (r, s) in slots.iter().enumerate() {
            let new = if r < 3 {
                50 + rng.below(150) as u32
            } else {
                1 + rng.below(4) as u32
            };
            let cached = rng.below(400) as u32;
            news.push(new);
            reqs.push(StepRequest {
                kind: if r < 3 {
                    RequestKind::Context
                } else {
                    RequestKind::Generation
                },
                block_slots: s,
                row: dsa_kv_core::core::RowStamp::UNKNOWN,
                num_cached: cached,
                num_new: new,
                helix_inactive: false,
            });
        }
        m.prepare(&layout, &reqs).unwrap();
        let corrected: Vec<u32> = reqs
            .iter()
            .map(|r| r.num_cached.saturating_sub(rng.below(8) as u32))
            .collect();
        let n = m.counts().num_tokens;
        let table = m.indexer_page_table()[..8 * 12].to_vec();
        let req_idx = m.req_idx_per_token()[..n].to_vec();
        let mut starts = Vec::new();
        let mut at = 0i32;
        for &k in &news {
            starts.push(at);
            at += k as i32;
        }
        m.recompute_slot_mappings(&corrected).unwrap();
        let cached: Vec<i32> = corrected.iter().map(|&c| c as i32).collect();
        let (tb, cb, rb, sb) = (
            buf(&g, &table),
            buf(&g, &cached),
            buf(&g, &req_idx),
            buf(&g, &starts),
        );
        let out = DeviceBuffer::zeroed(&g, n * 24, "maps").unwrap();
        let tables = RecomputeTables {
            indexer_table: tb.ptr(),
            max_blocks: 12,
            num_cached: cb.ptr(),
            req_idx: rb.ptr(),
            token_start: sb.ptr(),
        };
        unsafe {
            g.kernels()
                .recompute_slot_mappings(
                    g.compute(),
                    0,
                    tables,
                    &layout,
                    n,
                    out.ptr(),
                    out.ptr() + n as u64 * 8,
                    out.ptr() + n as u64 * 16,
                )
                .unwrap()
        };
        let dev: Vec<i64> = read(&g, &out, 3 * n);
        assert_eq!(&dev[..n], &m.slot_mapping_value()[..n], "scale {scale}");
        assert_eq!(
            &dev[n..2 * n],
            &m.slot_mapping_scale()[..n],
            "scale {scale}"
        );
        assert_eq!(&dev[2 * n..], &m.mla_slot_mapping()[..n], "scale {scale}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn ipc_pools_are_zeroed_fixed_and_exportable() {
    let g = gpu();
    let mut pool = VmmPool::ipc(&g, 3 << 20).unwrap();
    let base = pool.base();
    assert_eq!(pool.mapped(), 4 << 20, "rounded up to whole granules");
    let mut back = vec![1u8; pool.mapped()];
    unsafe { g.download_raw(base, &mut back).unwrap() };
    assert!(back.iter().all(|&b| b == 0), "zeroed");
    let pattern: Vec<u8> = (0..pool.mapped()).map(|i| (i * 7 % 251) as u8).collect();
    let staging = buf(&g, &pattern);
    device_copy(&g, base, staging.ptr(), pattern.len());
    assert!(pool.grow_to(8 << 20).is_err(), "a fixed pool does not grow");
    pool.shrink_to(1 << 20).unwrap();
    assert_eq!((pool.base(), pool.mapped()), (base, 4 << 20), "nor shrink");
    assert!(pool.grant_peer(g.ordinal() + 1).is_err(), "nor share");
    unsafe { g.download_raw(base, &mut back).unwrap() };
    assert!(back == pattern, "the contents stay");
    // What makes it worth having: legacy CUDA IPC can export it (VMM pools cannot).
    g.bind().unwrap();
    let mut handle = cudarc::driver::sys::CUipcMemHandle { reserved: [0; 64] };
    let r = unsafe { cudarc::driver::sys::cuIpcGetMemHandle(&mut handle, base) };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    let vmm = VmmPool::new(&g, 4 << 20, 4 << 20).unwrap();
    let r = unsafe { cudarc::driver::sys::cuIpcGetMemHandle(&mut handle, vmm.base()) };
    assert_ne!(
        r,
        cudarc::driver::sys::CUresult::CUDA_SUCCESS,
        "VMM memory is not IPC-exportable"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn vmm_pools_grow_and_shrink_in_place() {
    let g = gpu();
    let mut pool = VmmPool::new(&g, 64 << 20, 3 << 20).unwrap();
    let base = pool.base();
    assert_eq!(pool.granularity(), 2 << 20, "H200 maps 2 MiB chunks");
    assert_eq!(pool.mapped(), 4 << 20);
    let pattern: Vec<u8> = (0..pool.mapped()).map(|i| (i * 7 % 251) as u8).collect();
    let staging = buf(&g, &pattern);
    device_copy(&g, base, staging.ptr(), pattern.len());
    pool.grow_to(40 << 20).unwrap();
    assert_eq!(pool.base(), base, "growth keeps the base address");
    assert!(pool.mapped() >= 40 << 20);
    let mut back = vec![0u8; pattern.len()];
    unsafe { g.download_raw(base, &mut back).unwrap() };
    assert!(back == pattern, "growth keeps the contents");
    let mut tail = vec![1u8; 1 << 20];
    unsafe { g.download_raw(base + (39 << 20), &mut tail).unwrap() };
    assert!(tail.iter().all(|&b| b == 0), "new chunks are zeroed");
    pool.shrink_to(5 << 20).unwrap();
    assert_eq!(pool.base(), base);
    assert_eq!(pool.mapped(), 6 << 20, "whole 2 MiB chunks are released");
    unsafe { g.download_raw(base, &mut back).unwrap() };
    assert!(back == pattern, "shrinking keeps the surviving prefix");
    assert!(
        pool.grow_to(65 << 20).is_err(),
        "growth past the reservation is refused"
    );
    assert_eq!(pool.base(), base);
}

/// A real driver failure, not an injected one: growing a pool past the GPU's physical
/// memory makes `cuMemCreate` fail part-way; the growth rolls back to the size before
/// the call (contents, base address and the device's free memory as they were) and the
/// pool keeps working.
#[test]
#[ignore = "needs a CUDA device"]
fn vmm_growth_past_physical_memory_rolls_back() {
    let g = gpu();
    let (_, total) = g.mem_info().unwrap();
    let mut pool = VmmPool::new(&g, total + (16 << 30), 8 << 20).unwrap();
    let base = pool.base();
    let before = pool.mapped();
    let pattern: Vec<u8> = (0..before).map(|i| (i * 13 % 239) as u8).collect();
    let staging = buf(&g, &pattern);
    device_copy(&g, base, staging.ptr(), before);
    let (free_before, _) = g.mem_info().unwrap();
    let err = pool.grow_to(total + (8 << 30)).unwrap_err();
    assert!(
        matches!(err, CudaError::OutOfMemory { .. }),
        "the driver ran out: {err}"
    );
    assert_eq!(
        (pool.base(), pool.mapped()),
        (base, before),
        "rolled back exactly"
    );
    let (free_after, _) = g.mem_info().unwrap();
    assert!(
        free_after.abs_diff(free_before) <= 64 << 20,
        "every chunk mapped on the way was released: {free_before} -> {free_after} bytes free"
    );
    let mut back = vec![0u8; before];
    unsafe { g.download_raw(base, &mut back).unwrap() };
    assert!(back == pattern, "the contents survive the failed growth");
    pool.grow_to(before + (64 << 20)).unwrap();
    assert_eq!(pool.base(), base);
    eprintln!(
        "growth to {} GiB failed with: {err}; free memory {free_before} -> {free_after}",
        (total + (8 << 30)) >> 30
    );
}

/// Dropping a pool with work still queued on it waits for that work: `cuMemUnmap` does
/// not, and a kernel writing to an unmapped range faults (a sticky
/// `CUDA_ERROR_ILLEGAL_ADDRESS` for the rest of the process; found on the H200 when a
/// device was dropped right after a step whose forward failed midway). Both kinds of pool:
/// VMM chunks and the fixed `cuMemAlloc` pool that IPC exports.
#[test]
#[ignore = "needs a CUDA device"]
fn a_pool_dropped_with_work_queued_waits_for_it() {
    let g = gpu();
    let bytes = 512usize << 20;
    let src = DeviceBuffer::zeroed(&g, bytes, "test").unwrap();
    for ipc in [false, true] {
        let pool = if ipc {
            VmmPool::ipc(&g, bytes)
        } else {
            VmmPool::new(&g, bytes, bytes)
        }
        .unwrap();
        let tasks = buf(&g, &[pool.base(), src.ptr()]);
        // Tens of milliseconds of copies into the pool: still running when it is dropped.
        for _ in 0..40 {
            // SAFETY: both ranges hold `bytes` bytes (the pool until it is dropped, which
            // is what the test is about).
            unsafe {
                g.kernels().batched_copy(
                    g.compute(),
                    0,
                    tasks.ptr(),
                    tasks.ptr() + 8,
                    1,
                    bytes as u64,
                )
            }
            .unwrap();
        }
        drop(pool);
        g.synchronize().unwrap_or_else(|e| {
            panic!("the copies into the dropped pool (ipc: {ipc}) faulted: {e}")
        });
    }
    let after = buf(&g, &[7u64, 8]);
    assert_eq!(
        read::<u64>(&g, &after, 2),
        [7, 8],
        "the context still works"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn copy_plans_match_host_storage() {
    let g = gpu();
    let mut rng = Rng(SplitMix64(7));
    let model = DsaModel::glm52();
    let plan = PoolPlan::for_model(&model, LayerSet::Target, LayoutKind::V2, 64).unwrap();
    let groups = plan.pool_groups().len();
    let (gs, hs) = (vec![24u32; groups], vec![16u32; groups]);
    let mut host = HostStorage::new(&plan, &gs, &hs).unwrap();
    let mut dev = CudaStorage::new(g.clone(), &plan, &gs, &hs, 2, GpuPoolAlloc::Vmm).unwrap();
    // Same random contents on both.
    for gi in 0..groups {
        for p in 0..plan.pool_groups()[gi].pools.len() {
            let grp = PoolGroupId(gi as u16);
            let bytes = rng.bytes(host.pool(Tier::Gpu, grp, p as u16).len());
            host.pool_mut(Tier::Gpu, grp, p as u16)
                .copy_from_slice(&bytes);
            let stage = buf(&g, &bytes);
            device_copy(
                &g,
                dev.pool_ptr(Tier::Gpu, grp, p as u16),
                stage.ptr(),
                bytes.len(),
            );
        }
    }
    let s = |i: u32| SlotId(i);
    let grp = PoolGroupId(0);
    let plans = [
        // Offload, onboard, copy-on-resume, and a chain that must run in order.
        vec![GroupCopy {
            pool_group: grp,
            src_tier: Tier::Gpu,
            dst_tier: Tier::Host,
            pairs: vec![(s(3), s(0)), (s(4), s(1)), (s(23), s(15))],
        }],
        vec![GroupCopy {
            pool_group: grp,
            src_tier: Tier::Host,
            dst_tier: Tier::Gpu,
            pairs: vec![(s(0), s(10)), (s(15), s(11)), (s(1), s(0))],
        }],
        vec![GroupCopy {
            pool_group: grp,
            src_tier: Tier::Gpu,
            dst_tier: Tier::Gpu,
            pairs: vec![(s(5), s(6)), (s(6), s(7)), (s(7), s(5)), (s(8), s(9))],
        }],
    ];
    for (i, copies) in plans.into_iter().enumerate() {
        let cp = CopyPlan {
            fence: Fence(i as u64 + 1),
            wait_for: Fence(0),
            copies,
        };
        host.execute(&cp).unwrap();
        dev.execute(&cp).unwrap();
        g.synchronize().unwrap();
        assert!(dev.fence_complete(cp.fence));
    }
    for gi in 0..groups {
        for p in 0..plan.pool_groups()[gi].pools.len() {
            let grp = PoolGroupId(gi as u16);
            for tier in [Tier::Gpu, Tier::Host] {
                let d = dev.read_pool(tier, grp, p as u16).unwrap();
                assert!(
                    d == host.pool(tier, grp, p as u16),
                    "{tier} group {gi} pool {p}"
                );
            }
        }
    }
    // A bad slot is refused before anything moves.
    let bad = CopyPlan {
        fence: Fence(9),
        wait_for: Fence(0),
        copies: vec![GroupCopy {
            pool_group: grp,
            src_tier: Tier::Gpu,
            dst_tier: Tier::Host,
            pairs: vec![(s(1), s(2)), (s(24), s(3))],
        }],
    };
    assert!(dev.execute(&bad).is_err());
}

#[test]
#[ignore = "needs a CUDA device"]
fn peer_gpus_read_each_others_pools() {
    let Ok(n) = device_count() else { return };
    if n < 2 {
        eprintln!("skipped: one GPU");
        return;
    }
    let (a, b) = (Gpu::open(0).unwrap(), Gpu::open(1).unwrap());
    assert!(a.can_access_peer(&b).unwrap());
    let mut pa = VmmPool::new(&a, 8 << 20, 4 << 20).unwrap();
    let pb = VmmPool::new(&b, 8 << 20, 4 << 20).unwrap();
    pa.grant_peer(1).unwrap();
    let pattern: Vec<u8> = (0..4 << 20).map(|i: usize| (i % 253) as u8).collect();
    let stage = buf(&a, &pattern);
    unsafe {
        let t = buf(&a, &[pa.base(), stage.ptr()]);
        a.kernels()
            .batched_copy(
                a.compute(),
                0,
                t.ptr(),
                t.ptr() + 8,
                1,
                pattern.len() as u64,
            )
            .unwrap();
        a.synchronize().unwrap();
        // GPU 1 pulls GPU 0's pool over NVLink.
        let t = buf(&b, &[pb.base(), pa.base()]);
        b.kernels()
            .batched_copy(
                b.compute(),
                1,
                t.ptr(),
                t.ptr() + 8,
                1,
                pattern.len() as u64,
            )
            .unwrap();
        b.synchronize().unwrap();
        let mut back = vec![0u8; pattern.len()];
        b.download_raw(pb.base(), &mut back).unwrap();
        assert!(back == pattern);
    }
}

/// The persistent device page tables follow the host's step metadata through the
/// logged cells: random batches whose rows grow, change a column, keep their version or
/// are replaced, requests leaving (batch indices shift) and arriving, a draft replay
/// on the draft set now and then. After every upload the bound set's buffers and the
/// shared ones read back equal to the host's, byte for byte; both the cell pairs and
/// the extent copies are taken.
#[test]
#[ignore = "needs a CUDA device"]
fn device_metadata_follows_the_logged_cells() {
    use dsa_kv_core::core::RowStamp;
    use dsa_kv_core::metadata::mirror::MetaRef;
    let g = gpu();
    let mut rng = Rng(SplitMix64(27));
    let layout = MetadataLayout {
        tokens_per_block: 4,
        indexer_page_scale: 2,
        indexer: Some(IndexerPageLayout {
            tokens_per_block: 4,
            data_bytes: 128,
            scale_bytes: 4,
        }),
    };
    let dims = MetadataDims {
        max_num_sequences: 16,
        max_blocks_per_seq: 40,
        max_num_tokens: 256,
        max_context_kv_tokens: 2048,
    };
    let mut m = StepMetadata::new(layout, dims, Some(dims), true).unwrap();
    let mut dm = DeviceMetadata::new(&g, &m).unwrap();
    // Each request: its row, the row's stamp, its cached length.
    let mut live: Vec<(Vec<i32>, RowStamp, u32)> = Vec::new();
    let mut version = 1u64;
    let (mut pair_steps, mut extent_steps) = (0, 0);
    for step in 0..400 {
        if live.len() > 1 && rng.below(6) == 0 {
            live.remove(rng.below(live.len() as u64) as usize);
        }
        while live.len() < 16 && rng.below(3) == 0 {
            version += 1;
            let cached = rng.below(100) as u32;
            let row = (0..(cached + 4).div_ceil(4) + 1)
                .map(|_| rng.below(5000) as i32)
                .collect();
            let stamp = RowStamp {
                version,
                base: 0,
                from: 0,
            };
            live.push((row, stamp, cached));
        }
        for (row, stamp, cached) in &mut live {
            *cached = (*cached + 1).min(39 * 4 - 8);
            // Blocks for the cached tokens and the step's 4, and one more now and then.
            let need = (*cached as usize + 4).div_ceil(4) + usize::from(rng.below(4) == 0);
            let before = *stamp;
            let old_len = row.len();
            if row.len() < need {
                row.resize(need.min(40), rng.below(5000) as i32);
            }
            let changed = match rng.below(4) {
                0 => {
                    let c = rng.below(row.len() as u64) as usize;
                    row[c] = rng.below(5000) as i32;
                    Some(c.min(old_len))
                }
                _ if row.len() != old_len => Some(old_len),
                _ => None,
            };
            if let Some(from) = changed {
                version += 1;
                *stamp = RowStamp {
                    version,
                    base: before.version,
                    from: from as u32,
                };
            }
        }
        if live.is_empty() {
            continue;
        }
        let reqs: Vec<StepRequest> = live
            .iter()
            .map(|(row, stamp, cached)| StepRequest {
                kind: RequestKind::Generation,
                block_slots: row,
                row: *stamp,
                num_cached: *cached,
                num_new: 4,
                helix_inactive: false,
            })
            .collect();
        let draft = step % 7 == 3;
        m.prepare(&layout, &reqs).unwrap();
        let mut check = |m: &mut StepMetadata, dm: &mut DeviceMetadata, what: &str| {
            dm.upload(&g, m).unwrap();
            pair_steps += usize::from(dm.last_cells() > 0);
            extent_steps += dm.last_table_copies();
            g.synchronize().unwrap();
            let b = m.bindings();
            let bound = [
                b.indexer_page_table,
                b.block_table,
                b.slot_mapping_value,
                b.slot_mapping_scale,
                b.mla_slot_mapping,
                b.kv_lens,
                b.num_cached,
            ];
            let refs = bound.into_iter().map(MetaRef::Set).chain([
                MetaRef::ReqIdx,
                MetaRef::Ks,
                MetaRef::Ke,
            ]);
            for r in refs {
                let host = m.mirror_bytes(r);
                let mut back = vec![0u8; host.len()];
                unsafe { g.download_raw(dm.addr(r), &mut back).unwrap() };
                assert!(back == host, "step {step} ({what}): {r:?} differs");
            }
        };
        check(&mut m, &mut dm, "target");
        if draft {
            let snap = m.prepare_draft(&layout, &reqs).unwrap();
            check(&mut m, &mut dm, "draft");
            m.restore(&snap).unwrap();
            check(&mut m, &mut dm, "restored");
        }
    }
    assert!(
        pair_steps > 100 && extent_steps > 0,
        "{pair_steps} uploads by pairs, {extent_steps} by extent"
    );
}
