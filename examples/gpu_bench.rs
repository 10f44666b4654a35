//! GPU benchmark: every kernel at 4K to 4M tokens, timed with CUDA events (median of
//! repetitions), next to a device-to-device memcpy ceiling and pinned host↔device copy
//! ceilings measured in the same run. Prints one JSON document.
//!
//! ```text
//! cargo run --release --example gpu_bench -- [--gpu N] [--reps N] [--max-tokens N] [--quick]
//!     [--only KERNEL[,KERNEL...]]
//! ```
//!
//! `--help` lists every flag with its default; `--flag=value` works as well as
//! `--flag value`. `--quick` is 5 repetitions up to 64K tokens (an explicit `--reps` or
//! `--max-tokens` wins). `--only` times just the kernels whose names contain one of the
//! given strings (the ceilings are always measured), e.g. `--only mla_scatter` for the two
//! MLA scatters, `--only model1` for DeepSeek-V4's MODEL1 scatter (host-checked and
//! guarded) and gather.
//!
//! Bytes are counted as every byte read plus every byte written (mappings included),
//! the same way the memcpy ceiling counts its reads and writes; host copies count the
//! bytes crossing the bus once, like the pinned-copy ceilings they are compared to.

mod common;

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use dsa_kv::cuda::cudarc::driver::{sys, CudaEvent};
use dsa_kv::cuda::kernels::{DevRows, Guard, MlaEncoding, RecomputeTables};
use dsa_kv::cuda::v4::{check_model1, Bounds, Model1Pool, V4KernelError, V4Kernels};
use dsa_kv::cuda::{CudaError, DeviceBuffer, Gpu, PinnedHost};
use dsa_kv::layout::{IndexerPageLayout, Model1PageLayout};
use dsa_kv::metadata::MetadataLayout;
use dsa_kv::ops::topk::PrimaryPageParams;
use dsa_kv::rng::SplitMix64;
use half::bf16;
use serde_json::{json, Value};

const T: u64 = 64;

/// GPU benchmark: every kernel at 4K to 4M tokens, timed with CUDA events (median of
/// repetitions), next to memcpy and pinned host<->device copy ceilings measured in the same
/// run. Prints one JSON document.
#[derive(Parser)]
#[command(name = "gpu_bench")]
struct Cli {
    /// The GPU ordinal
    #[arg(long, value_name = "N", default_value_t = 0)]
    gpu: usize,
    /// Timed repetitions per measurement, after two warm-up runs [default: 21; --quick: 5]
    #[arg(long, value_name = "N")]
    reps: Option<u64>,
    /// The largest token count measured (of 4K, 16K, 64K, 256K, 1M, 4M) [default: 4194304;
    /// --quick: 65536]
    #[arg(long, value_name = "N")]
    max_tokens: Option<u64>,
    /// Fewer repetitions and sizes (5 reps, up to 64K tokens); --reps and --max-tokens
    /// still apply
    #[arg(long)]
    quick: bool,
    /// Time only the kernels whose names contain one of these strings (the ceilings are
    /// always measured) [default: every kernel]
    #[arg(long, value_name = "KERNEL[,KERNEL...]", value_delimiter = ',')]
    only: Vec<String>,
}

struct Args {
    gpu: usize,
    reps: usize,
    max_tokens: u64,
    sizes: Vec<u64>,
    /// Kernel-name filters (`--only`); empty times every kernel.
    only: Vec<String>,
}

impl Args {
    /// Whether `--only` selects the kernel `name`.
    fn wants(&self, name: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| name.contains(o.as_str()))
    }
}

fn parse() -> Args {
    let c = Cli::parse();
    let (reps, max_tokens) = if c.quick {
        (5, 64 << 10)
    } else {
        (21, 4 << 20)
    };
    let mut a = Args {
        gpu: c.gpu,
        reps: c.reps.unwrap_or(reps).max(1) as usize,
        max_tokens: c.max_tokens.unwrap_or(max_tokens),
        sizes: vec![4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20],
        only: c.only.into_iter().filter(|x| !x.is_empty()).collect(),
    };
    a.sizes.retain(|&n| n <= a.max_tokens);
    a
}

struct Bench {
    gpu: Arc<Gpu>,
    reps: usize,
    start: CudaEvent,
    end: CudaEvent,
    rng: SplitMix64,
}

type R<T> = Result<T, String>;

fn e(err: CudaError) -> String {
    err.to_string()
}

impl Bench {
    fn new(gpu: Arc<Gpu>, reps: usize) -> R<Self> {
        let ev = || {
            gpu.context()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|x| format!("{x:?}"))
        };
        Ok(Bench {
            start: ev()?,
            end: ev()?,
            gpu: gpu.clone(),
            reps,
            rng: SplitMix64(0x5eed),
        })
    }

    fn next(&mut self) -> u64 {
        self.rng.next_u64()
    }

    /// Median device time of `f` in microseconds (two warm-up runs first).
    fn time(&self, mut f: impl FnMut() -> Result<(), CudaError>) -> R<f64> {
        let s = self.gpu.compute();
        let mut v = Vec::with_capacity(self.reps);
        for i in 0..self.reps + 2 {
            self.start.record(s).map_err(|x| format!("{x:?}"))?;
            f().map_err(e)?;
            self.end.record(s).map_err(|x| format!("{x:?}"))?;
            let ms = self
                .start
                .elapsed_ms(&self.end)
                .map_err(|x| format!("{x:?}"))?;
            if i >= 2 {
                v.push(f64::from(ms) * 1000.0);
            }
        }
        v.sort_by(f64::total_cmp);
        Ok(v[v.len() / 2])
    }

    fn zeroed(&self, bytes: u64) -> R<DeviceBuffer> {
        DeviceBuffer::zeroed(&self.gpu, bytes as usize, "benchmark").map_err(e)
    }

    /// A device buffer of `elems` values: a random host chunk replicated on the device.
    fn random<T: dsa_kv::cuda::Plain>(
        &mut self,
        elems: usize,
        gen: impl Fn(u64) -> T,
    ) -> R<DeviceBuffer> {
        let size = std::mem::size_of::<T>();
        let b = self.zeroed((elems * size) as u64)?;
        let chunk = elems.min(1 << 22);
        let host: Vec<T> = (0..chunk).map(|_| gen(self.next())).collect();
        self.gpu.upload(&b, &host).map_err(e)?;
        let mut have = chunk * size;
        while have < b.len() {
            let n = have.min(b.len() - have);
            self.memcpy_dtod(b.ptr() + have as u64, b.ptr(), n)?;
            have += n;
        }
        self.gpu.synchronize().map_err(e)?;
        Ok(b)
    }

    fn memcpy_dtod(&self, dst: u64, src: u64, bytes: usize) -> R<()> {
        // SAFETY: callers pass ranges inside their own buffers.
        let r =
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.gpu.compute().cu_stream()) };
        r.result().map_err(|x| format!("cuMemcpyDtoD: {x:?}"))
    }

    fn upload<T: dsa_kv::cuda::Plain>(&self, v: &[T]) -> R<DeviceBuffer> {
        DeviceBuffer::from_slice(&self.gpu, v, "benchmark").map_err(e)
    }

    /// A random permutation of `0..n`.
    fn perm(&mut self, n: u64) -> Vec<u64> {
        let mut p: Vec<u64> = (0..n).collect();
        for i in (1..p.len()).rev() {
            p.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
        p
    }
}

fn row(name: &str, tokens: u64, bytes: u64, us: f64, ceiling_gbps: f64, ceiling: &str) -> Value {
    let gbps = bytes as f64 / us / 1000.0;
    json!({
        "kernel": name,
        "tokens": tokens,
        "bytes": bytes,
        "median_us": (us * 100.0).round() / 100.0,
        "gb_per_s": (gbps * 10.0).round() / 10.0,
        "ceiling": ceiling,
        "pct_of_ceiling": (gbps / ceiling_gbps * 1000.0).round() / 10.0,
    })
}

fn run(a: &Args) -> R<Value> {
    let gpu = Gpu::open(a.gpu).map_err(e)?;
    let dev = gpu.ordinal();
    let mut b = Bench::new(gpu.clone(), a.reps)?;
    let k = gpu.kernels();
    let s = gpu.compute().clone();
    let mut driver = 0;
    // SAFETY: valid out-pointer.
    unsafe { sys::cuDriverGetVersion(&mut driver) }
        .result()
        .map_err(|x| format!("{x:?}"))?;

    // ---- ceilings ------------------------------------------------------------------
    let big: u64 = 1 << 30;
    let (x, y) = (b.zeroed(big)?, b.zeroed(big)?);
    let d2d_us = b.time(|| {
        b.memcpy_dtod(y.ptr(), x.ptr(), big as usize)
            .map_err(|w| CudaError::Invalid {
                device: dev,
                what: w,
            })
    })?;
    let d2d = 2.0 * big as f64 / d2d_us / 1000.0;
    let pinned_bytes: u64 = 512 << 20;
    let mut pinned = PinnedHost::zeroed(&gpu, pinned_bytes as usize, "benchmark").map_err(e)?;
    pinned.as_mut_slice().fill(7);
    let h2d_us = b.time(|| {
        // SAFETY: both buffers hold `pinned_bytes`.
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                x.ptr(),
                pinned.as_slice().as_ptr().cast(),
                pinned_bytes as usize,
                s.cu_stream(),
            )
        };
        r.result().map_err(|x| CudaError::Invalid {
            device: dev,
            what: format!("{x:?}"),
        })
    })?;
    let d2h_us = b.time(|| {
        // SAFETY: as above.
        let r = unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                pinned.as_slice().as_ptr() as *mut _,
                x.ptr(),
                pinned_bytes as usize,
                s.cu_stream(),
            )
        };
        r.result().map_err(|x| CudaError::Invalid {
            device: dev,
            what: format!("{x:?}"),
        })
    })?;
    let (h2d, d2h) = (
        pinned_bytes as f64 / h2d_us / 1000.0,
        pinned_bytes as f64 / d2h_us / 1000.0,
    );
    drop((x, y));
    eprintln!("ceilings: D2D {d2d:.0} GB/s (read+write), H2D {h2d:.1} GB/s, D2H {d2h:.1} GB/s");

    let mut rows = Vec::new();
    for &n in &a.sizes {
        let pages = n.div_ceil(T);
        eprintln!("{n} tokens ...");
        // Token i goes to page perm[i / 64], position i % 64 (a prefill's layout).
        let perm = b.perm(pages);
        let ix = IndexerPageLayout {
            tokens_per_block: T as u32,
            data_bytes: 128,
            scale_bytes: 4,
        };
        let (mut vm, mut sm, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..n {
            let (p, pos) = (perm[(i / T) as usize], (i % T) as u32);
            vm.push(ix.value_offset(p, pos) as i64);
            sm.push(ix.scale_offset(p, pos) as i64);
            slots.push((p * T + u64::from(pos)) as i64);
        }
        let (vmb, smb, slb) = (b.upload(&vm)?, b.upload(&sm)?, b.upload(&slots)?);
        drop((vm, sm));
        let nu = n as usize;

        // Indexer: quantize, scatter, gather (FP8: 128 + 4 bytes per token).
        if [
            "quantize_indexer_fp8",
            "indexer_k_scatter_fp8",
            "indexer_k_gather_fp8",
        ]
        .iter()
        .any(|k| a.wants(k))
        {
            let keys = b.random(nu * 128, |r| {
                bf16::from_f32(((r >> 40) as f32 / 16_777_216.0 - 0.5) * 8.0)
            })?;
            let (vals, scs) = (b.zeroed(n * 128)?, b.zeroed(n * 4)?);
            let us = b.time(|| unsafe {
                k.quantize_indexer(&s, dev, keys.ptr(), vals.ptr(), scs.ptr(), nu, false, true)
            })?;
            rows.push(row(
                "quantize_indexer_fp8",
                n,
                n * (256 + 132),
                us,
                d2d,
                "d2d",
            ));
            drop(keys);
            let cache_len = pages * T * 132;
            let cache = b.zeroed(cache_len)?;
            let us = b.time(|| unsafe {
                k.indexer_k_scatter(
                    &s,
                    dev,
                    cache.ptr(),
                    cache_len,
                    vals.ptr(),
                    scs.ptr(),
                    vmb.ptr(),
                    smb.ptr(),
                    nu,
                    128,
                    None,
                )
            })?;
            rows.push(row(
                "indexer_k_scatter_fp8",
                n,
                n * (132 * 2 + 16),
                us,
                d2d,
                "d2d",
            ));
            let us = b.time(|| unsafe {
                k.indexer_k_gather(
                    &s,
                    dev,
                    cache.ptr(),
                    cache_len,
                    vmb.ptr(),
                    smb.ptr(),
                    0,
                    nu,
                    128,
                    vals.ptr(),
                    scs.ptr(),
                )
            })?;
            rows.push(row(
                "indexer_k_gather_fp8",
                n,
                n * (132 * 2 + 16),
                us,
                d2d,
                "d2d",
            ));
            drop((cache, vals, scs, vmb, smb));
        }

        // MLA: BF16 scatter and fp8_ds_mla quantize-and-scatter (one layer's view).
        let input = if a.wants("mla_scatter_bf16") || a.wants("mla_scatter_fp8_ds_mla") {
            b.random(nu * 576, |r| {
                bf16::from_f32(((r >> 40) as f32 / 16_777_216.0 - 0.5) * 4.0)
            })?
        } else {
            b.zeroed(0)?
        };
        for (name, enc, row_bytes) in [
            ("mla_scatter_bf16", MlaEncoding::Bf16, 1152u64),
            (
                "mla_scatter_fp8_ds_mla",
                MlaEncoding::Fp8DsMla { ue8m0: true },
                656,
            ),
        ] {
            if !a.wants(name) {
                continue;
            }
            let pool = b.zeroed(pages * T * row_bytes)?;
            let view = DevRows {
                pool: pool.ptr(),
                pool_len: pool.len() as u64,
                base: 0,
                block_stride: T * row_bytes,
                tokens_per_block: T as u32,
            };
            let us = b.time(|| unsafe {
                k.mla_scatter(&s, dev, view, enc, input.ptr(), slb.ptr(), nu, None)
            })?;
            rows.push(row(name, n, n * (1152 + 8 + row_bytes), us, d2d, "d2d"));
        }
        drop((input, slb));

        // DeepSeek-V4 MODEL1: quantize-and-scatter of n BF16 rows [n, 512] into 64-row
        // pages (37,440 B) at kernel row indices page × 64 + i, pages in random order; the
        // indices checked on the host once (`Bounds::Checked`), or by the guard kernel in
        // the timed launch (`_guarded`); and the gather of the same rows back to f32.
        if ["model1_scatter", "model1_scatter_guarded", "model1_gather"]
            .iter()
            .any(|k| a.wants(k))
        {
            let v4k = V4Kernels::load(&gpu).map_err(e)?;
            let layout = Model1PageLayout { entries: T as u32 };
            let pool_len = pages * layout.page_bytes();
            let pool = b.zeroed(pool_len)?;
            let m1 = Model1Pool {
                pool: pool.ptr(),
                pool_len,
                page: layout,
            };
            let idx: Vec<i64> = (0..n)
                .map(|i| (perm[(i / T) as usize] * T + i % T) as i64)
                .collect();
            let checked = check_model1(&idx, layout, pool_len).map_err(|x| x.to_string())?;
            let ib = b.upload(&idx)?;
            let flag = b.upload(&[u64::MAX])?;
            let input = b.random(nu * 512, |r| {
                bf16::from_f32(((r >> 40) as f32 / 16_777_216.0 - 0.5) * 4.0)
            })?;
            let v4 = |x: V4KernelError| match x {
                V4KernelError::Cuda(c) => c,
                other => CudaError::Invalid {
                    device: dev,
                    what: other.to_string(),
                },
            };
            let us = b.time(|| unsafe {
                v4k.model1_scatter(
                    &s,
                    dev,
                    m1,
                    input.ptr(),
                    ib.ptr(),
                    nu,
                    Bounds::Checked(checked),
                )
                .map_err(v4)
            })?;
            rows.push(row(
                "model1_scatter",
                n,
                n * (1024 + 8 + 584),
                us,
                d2d,
                "d2d",
            ));
            let us = b.time(|| unsafe {
                v4k.model1_scatter(
                    &s,
                    dev,
                    m1,
                    input.ptr(),
                    ib.ptr(),
                    nu,
                    Bounds::Guard(Guard {
                        flag: flag.ptr(),
                        op: 0,
                    }),
                )
                .map_err(v4)
            })?;
            rows.push(row(
                "model1_scatter_guarded",
                n,
                n * (1024 + 16 + 584),
                us,
                d2d,
                "d2d",
            ));
            drop(input);
            if a.wants("model1_gather") {
                let gidx: Vec<i32> = idx.iter().map(|&r| r as i32).collect();
                let gchecked = check_model1(&gidx, layout, pool_len).map_err(|x| x.to_string())?;
                let gib = b.upload(&gidx)?;
                let out = b.zeroed(n * 2048)?;
                let us = b.time(|| unsafe {
                    v4k.model1_gather(
                        &s,
                        dev,
                        m1,
                        gib.ptr(),
                        nu,
                        out.ptr(),
                        Bounds::Checked(gchecked),
                    )
                    .map_err(v4)
                })?;
                rows.push(row(
                    "model1_gather",
                    n,
                    n * (4 + 584 + 2048),
                    us,
                    d2d,
                    "d2d",
                ));
            }
        }

        // Block copy: n / 64 tasks of one 64-token fp8_ds_mla page (41,984 B).
        if ["batched_copy_d2d", "offload_d2h", "onboard_h2d"]
            .iter()
            .any(|k| a.wants(k))
        {
            let page = T * 656;
            let (src, dst) = (b.zeroed(pages * page)?, b.zeroed(pages * page)?);
            let p2 = b.perm(pages);
            let mut addrs: Vec<u64> = (0..pages)
                .map(|i| dst.ptr() + p2[i as usize] * page)
                .collect();
            addrs.extend((0..pages).map(|i| src.ptr() + perm[i as usize] * page));
            let tasks = b.upload(&addrs)?;
            let t8 = pages * 8;
            let us = b.time(|| unsafe {
                k.batched_copy(&s, dev, tasks.ptr(), tasks.ptr() + t8, pages as usize, page)
            })?;
            rows.push(row("batched_copy_d2d", n, 2 * pages * page, us, d2d, "d2d"));
            drop(dst);

            // Offload / onboard through mapped pinned memory (up to 1M tokens).
            if n <= 1 << 20 {
                let host =
                    PinnedHost::zeroed(&gpu, (pages * page) as usize, "benchmark").map_err(e)?;
                let mut off: Vec<u64> = (0..pages).map(|i| host.dev_ptr() + i * page).collect();
                off.extend((0..pages).map(|i| src.ptr() + perm[i as usize] * page));
                let ot = b.upload(&off)?;
                let us = b.time(|| unsafe {
                    k.batched_copy(&s, dev, ot.ptr(), ot.ptr() + t8, pages as usize, page)
                })?;
                rows.push(row("offload_d2h", n, pages * page, us, d2h, "pinned_d2h"));
                let mut on: Vec<u64> = (0..pages)
                    .map(|i| src.ptr() + perm[i as usize] * page)
                    .collect();
                on.extend((0..pages).map(|i| host.dev_ptr() + i * page));
                let nt = b.upload(&on)?;
                let us = b.time(|| unsafe {
                    k.batched_copy(&s, dev, nt.ptr(), nt.ptr() + t8, pages as usize, page)
                })?;
                rows.push(row("onboard_h2d", n, pages * page, us, h2d, "pinned_h2d"));
            }
            drop(src);
        }

        // Top-k → global ids: n / 64 rows of k = 2048 over 64-block tables.
        if a.wants("topk_to_global") {
            let (topk_k, nrows, mb) = (2048u64, (n / T).max(1), 64u64);
            let reqs = 256u64;
            let topk = b.random((nrows * topk_k) as usize, |r| (r % (mb * T)) as i32)?;
            let rr: Vec<i32> = (0..nrows).map(|i| (i % reqs) as i32).collect();
            let table: Vec<i32> = (0..reqs * mb).map(|i| (i * 7 % 100_000) as i32).collect();
            let (rrb, tb, out) = (
                b.upload(&rr)?,
                b.upload(&table)?,
                b.zeroed(nrows * topk_k * 4)?,
            );
            let params = PrimaryPageParams {
                tokens_per_block: T as u32,
                scale: 61,
                layer_offset: 3,
            };
            let us = b.time(|| unsafe {
                k.topk_to_global(
                    &s,
                    dev,
                    topk.ptr(),
                    topk_k as usize,
                    rrb.ptr(),
                    nrows as usize,
                    tb.ptr(),
                    reqs as usize,
                    mb as usize,
                    params,
                    out.ptr(),
                )
            })?;
            rows.push(row(
                "topk_to_global",
                nrows * topk_k,
                nrows * topk_k * 8,
                us,
                d2d,
                "d2d",
            ));
            drop((topk, out));
        }

        // Slot-mapping recompute for n new tokens over 256 requests.
        if a.wants("recompute_slot_mappings") {
            let reqs = 256u64;
            let per = n.div_ceil(reqs);
            let req_idx: Vec<i32> = (0..n).map(|i| (i / per) as i32).collect();
            let starts: Vec<i32> = (0..reqs).map(|r| (r * per) as i32).collect();
            let cached: Vec<i32> = vec![0; reqs as usize];
            let mbr = per.div_ceil(T) + 1;
            let itab: Vec<i32> = (0..reqs * mbr).map(|i| (i % 50_000) as i32).collect();
            let (rb, sb, cb, ib) = (
                b.upload(&req_idx)?,
                b.upload(&starts)?,
                b.upload(&cached)?,
                b.upload(&itab)?,
            );
            let outm = b.zeroed(n * 24)?;
            let layout = MetadataLayout {
                tokens_per_block: T as u32,
                indexer_page_scale: 1,
                indexer: Some(ix),
            };
            let tables = RecomputeTables {
                indexer_table: ib.ptr(),
                max_blocks: mbr as usize,
                num_cached: cb.ptr(),
                req_idx: rb.ptr(),
                token_start: sb.ptr(),
            };
            let us = b.time(|| unsafe {
                k.recompute_slot_mappings(
                    &s,
                    dev,
                    tables,
                    &layout,
                    nu,
                    outm.ptr(),
                    outm.ptr() + n * 8,
                    outm.ptr() + n * 16,
                )
            })?;
            rows.push(row(
                "recompute_slot_mappings",
                n,
                n * (4 + 4 + 24),
                us,
                d2d,
                "d2d",
            ));
        }
    }
    // A section runs whole when any of its kernels is selected; report only those.
    rows.retain(|r| r["kernel"].as_str().is_some_and(|k| a.wants(k)));
    Ok(json!({
        "gpu": gpu.name(),
        "driver_version": driver,
        "arch": dsa_kv::cuda::ARCH,
        "reps": a.reps,
        "only": a.only,
        "ceilings_gb_per_s": {
            "d2d_read_plus_write": (d2d * 10.0).round() / 10.0,
            "pinned_h2d": (h2d * 10.0).round() / 10.0,
            "pinned_d2h": (d2h * 10.0).round() / 10.0,
        },
        "results": rows,
    }))
}

fn main() -> ExitCode {
    common::quiet_on_closed_stdout();
    let a = parse();
    match run(&a) {
        Ok(v) => {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(m) => {
            eprintln!("error: {m}");
            ExitCode::FAILURE
        }
    }
}
