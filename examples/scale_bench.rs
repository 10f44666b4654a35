//! The step at production shape, through the real runtime: DeepSeek-V3.2 (61 layers and
//! its MTP layer in one cache, `LayerSet::TargetAndMtp`, FP8 `fp8_ds_mla` rows and FP8
//! indexer keys, V2, 64-token blocks), pools sized from `--pool-gb` (default 100 GB on
//! CUDA), up to 1,024 concurrent requests with 3 MTP drafts (1 accepted + 1 sampled token
//! per step, as `benches/common/step256.rs`), contexts up to 128K, and churn: requests
//! finish and new ones arrive with a prefix hit on a long shared prefix and a short
//! unique suffix prefilled in 512-token chunks, some arrivals open a new prefix (whose
//! prompt is prefilled whole), and stale prefixes from a fill phase and from earlier
//! points keep the GPU pool full, so allocations evict cached blocks to the host tier
//! (offloads) and prefix hits on offloaded blocks bring them back (onboards).
//!
//! Two sweeps (issue: "per-step CPU time stays flat as the context grows"): context
//! length at a fixed batch (`--contexts` at `--fixed-batch`), and batch at a fixed
//! context (`--batches` at `--fixed-context`). Each point warms up, then times
//! `--steps` steps; one JSON line per point on stdout, progress on stderr, and with
//! `--svg PATH` a two-panel plot (per-step µs against context and against batch).
//!
//! **One timed step** is one `KvCacheHandle::commit_and_step` call from an engine-loop
//! task of a multi-thread tokio runtime (`--workers`, default 2): the commit of the step in
//! flight (each decode accepts 1 of its 3 drafts and adds a sampled token; finished
//! requests are closed), the schedule of the next (decodes with their drafts, prefill
//! chunks, pages, evictions and offload / onboard copy plans, preemptions), the plan to
//! the device actor, the device actor's step, and the report back. The wall time of the
//! call is `step_us`; the report's `StepTiming` splits it (`timing_us`: to_coordinator,
//! commit, schedule, enqueue, to_device, device, from_device, overlapped, finish,
//! to_caller) and `cpu_us` sums the intervals that are work rather than wake-ups
//! (commit + schedule + enqueue + device + overlapped + finish). Outcomes and the drafts
//! map are built before the clock starts; arrivals (`submit`) run after it stops.
//! `steady_step_us` and `churn_step_us` split the steps: a churn step admitted a request
//! (its first chunk: the prefix lookup over its whole prompt) or finished one (its blocks
//! released to the prefix cache), work that grows with the context by nature; the steady
//! steps are the decodes and later prefill chunks alone.
//!
//! **What the device does per step** (its handler is `device` in `timing_us`): the copy
//! plans (offload GPU → host, onboard host → GPU, copy-on-resume; on CUDA batched-copy
//! kernels on the copy stream, on the host `memcpy`), the step metadata built on the host
//! with the rows' stamps (page tables, slot mappings, draft set), and then, by `--forward`:
//! * `kernels` (CUDA, the default there): the metadata uploaded into the device buffers
//!   (pinned staging, double-buffered), then for each of the 62 layers three launches of
//!   our kernels on the compute stream: `quantize_indexer` and `indexer_k_scatter` (the
//!   indexer keys), `mla_scatter` (the 656-byte `fp8_ds_mla` rows) at the step's slot
//!   mappings. The BF16 input is a fixed seeded buffer uploaded once, so no KV is
//!   generated on the host: this is the device work of a model's cache writes without the
//!   model. Nothing waits for the GPU (the step is enqueued, not synchronized).
//! * `synthetic`: the backend's synthetic writer (`CudaSyntheticWriter` on CUDA, the
//!   host `SyntheticWriter` on the host): every new token's BF16 KV generated on the host
//!   from the synthetic source for every layer (704 values × 62 layers per token) and
//!   uploaded, then the same kernels (with their host-side range checks). That host
//!   generation is milliseconds per step at these batch sizes: it measures the writer, not
//!   the cache manager; run it on a small point only (`--fill 0`).
//! * `none` (the host default): a forward that does nothing; on CUDA the metadata is
//!   still uploaded (that happens before the forward).
//!
//! ```text
//! cargo run --release --example scale_bench -- --backend host --quick
//! scale_bench --backend cuda [--gpu 0] [--pool-gb 100] [--host-gb 32] [--steps 300]
//!     [--svg scale.svg] > scale.jsonl
//! ```
//!
//! Exit status: 0 when every point ran, 1 on a runtime error, 2 on a bad command line.

mod common;

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use dsa_kv::actors::{Drafts, KvCacheBuilder, KvCacheHandle, StepReport, StepTiming};
use dsa_kv::config::{EngineConfig, SpecMode};
use dsa_kv::core::scheduler::{RequestKind, RequestOutcome, SubmitRequest};
use dsa_kv::device::forward::{
    Batch, Forward, ForwardError, ForwardFactory, ForwardSetup, Sampling,
};
use dsa_kv::device::Verification;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::rng::SplitMix64;
use serde_json::{json, Value};

use common::Backend;

/// What the device actors run as the model's forward (`--forward`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum ForwardKind {
    /// Nothing (the metadata is still built, and uploaded on CUDA).
    None,
    /// CUDA only: our quantize and scatter kernels write every new token's KV on every
    /// layer from a fixed device buffer (no host generation).
    Kernels,
    /// The backend's synthetic writer: KV generated on the host for every layer.
    Synthetic,
}

impl ForwardKind {
    fn name(self) -> &'static str {
        match self {
            ForwardKind::None => "none",
            ForwardKind::Kernels => "kernels",
            ForwardKind::Synthetic => "synthetic",
        }
    }
}

/// The production-scale step bench: per-step CPU time against context length and batch.
#[derive(Parser, Debug)]
#[command(name = "scale_bench")]
struct Args {
    /// Where the device actor runs
    #[arg(long, value_enum, default_value_t = Backend::Host)]
    backend: Backend,
    /// GPU ordinal (with --backend cuda)
    #[arg(long, value_name = "N", default_value_t = 0)]
    gpu: usize,
    /// The device's forward [default: kernels on CUDA, none on the host]
    #[arg(long, value_enum)]
    forward: Option<ForwardKind>,
    /// GPU pool budget in GB (10^9 bytes) [default: 100 on CUDA, 2 on the host]
    #[arg(long, value_name = "GB")]
    pool_gb: Option<f64>,
    /// Host (offload) tier in GB; pinned memory on CUDA [default: 32 on CUDA, 1 on the
    /// host]
    #[arg(long, value_name = "GB")]
    host_gb: Option<f64>,
    /// Context lengths of the context sweep (tokens, each at least 4096)
    /// [default: 4096,16384,32768,65536,131072; --quick: 4096,16384]
    #[arg(long, value_name = "N,N,..", value_parser = list_u32)]
    contexts: Option<::std::vec::Vec<u32>>,
    /// Batch of the context sweep [default: 256; --quick: 16]
    #[arg(long, value_name = "N")]
    fixed_batch: Option<u32>,
    /// Concurrent requests of the batch sweep (each 1..=1024)
    /// [default: 64,256,512,1024; --quick: 16,64]
    #[arg(long, value_name = "N,N,..", value_parser = list_u32)]
    batches: Option<::std::vec::Vec<u32>>,
    /// Context of the batch sweep [default: 32768; --quick: 4096]
    #[arg(long, value_name = "N")]
    fixed_context: Option<u32>,
    /// Timed steps per point [default: 300; --quick: 30]
    #[arg(long, value_name = "N")]
    steps: Option<u32>,
    /// Untimed steps per point once the batch is decoding [default: 50; --quick: 10]
    #[arg(long, value_name = "N")]
    warmup: Option<u32>,
    /// Percentage of the GPU pool filled with stale cached prefixes before the first
    /// point (pool pressure from the start)
    #[arg(long, value_name = "PCT", default_value_t = 90,
          value_parser = clap::value_parser!(u32).range(0..=100))]
    fill: u32,
    /// Percentage of arrivals that open a new shared prefix, prefilled whole (the prefix
    /// it replaces goes stale; half of them revive a stale one, onboarding what was
    /// offloaded)
    #[arg(long, value_name = "PCT", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(0..=100))]
    new_prefix_pct: u64,
    /// A small, fast run (seconds on the host backend)
    #[arg(long)]
    quick: bool,
    /// Seed of the workload
    #[arg(long, value_name = "N", default_value_t = 42)]
    seed: u64,
    /// Worker threads of the tokio runtime
    #[arg(long, value_name = "N", default_value_t = 2)]
    workers: usize,
    /// `KvCacheBuilder::idle_spin` in µs (0: off)
    #[arg(long, value_name = "US", default_value_t = 0)]
    idle_spin_us: u64,
    /// Tokens each request generates, `MIN,MAX` (uniform) [default: 256,768; --quick:
    /// 32,96]. Fewer finishes and arrivals per step with longer generations: at
    /// 900,1000 no request admitted before the warm-up finishes within 350 steps (a
    /// decode-only window). MAX plus the longest suffix must leave room for the drafts
    /// in the 2,048 tokens above the shared prefix.
    #[arg(long, value_name = "MIN,MAX", value_parser = list_u32)]
    generate: Option<::std::vec::Vec<u32>>,
    /// Only the context sweep, or only the batch sweep
    #[arg(long, value_enum)]
    only: Option<Sweep>,
    /// Write a two-panel SVG plot of the points here
    #[arg(long, value_name = "PATH")]
    svg: Option<std::path::PathBuf>,
}

/// Which sweep a point belongs to.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Sweep {
    /// Context length at a fixed batch.
    Context,
    /// Batch at a fixed context.
    Batch,
}

fn list_u32(s: &str) -> Result<Vec<u32>, String> {
    s.split(',')
        .map(|x| x.trim().parse::<u32>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| "takes comma-separated positive integers like 4096,16384".to_string())
}

/// Tokens of a request's unique suffix (uniform), of its generation (uniform), and the
/// prefill chunk. A step's prefill chunks may read at most `max_context_kv_tokens` of
/// context (`max(max_num_tokens, 2 × max_seq_len)`: about two chunks of 128K-context
/// arrivals per step), so arrivals come slowly enough (B / 256 a step) for their
/// 1–2 chunks each to keep up at 128K.
const SUFFIX: (u64, u64) = (64, 1024);
const GENERATE: (u64, u64) = (256, 768);
const QUICK_SUFFIX: (u64, u64) = (64, 256);
const QUICK_GENERATE: (u64, u64) = (32, 96);
const PREFILL_CHUNK: u32 = 512;
/// Room a request's context keeps above its shared prefix: suffix + generation + drafts.
const HEADROOM: u32 = 2048;
/// Largest batch (the scheduler's `max_num_sequences`).
const MAX_BATCH: u32 = 1024;
/// Largest context.
const MAX_CONTEXT: u32 = 1 << 17;
const DRAFTS: u32 = 3;
const GB: f64 = 1e9;

/// The run, with every default resolved.
#[derive(Clone, Debug)]
struct Plan {
    backend: Backend,
    gpu: usize,
    forward: ForwardKind,
    pool_bytes: u64,
    host_bytes: u64,
    points: Vec<(Sweep, u32, u32)>,
    steps: u32,
    warmup: u32,
    fill: u32,
    new_prefix_pct: u64,
    suffix: (u64, u64),
    generate: (u64, u64),
    seed: u64,
    workers: usize,
    idle_spin_us: u64,
    svg: Option<std::path::PathBuf>,
}

fn err(m: String) -> ! {
    common::usage_error::<Args>(m)
}

/// Resolves defaults and checks what clap cannot: exit status 2 with the message.
fn plan(a: Args) -> Plan {
    let cuda = a.backend == Backend::Cuda;
    let forward = a.forward.unwrap_or(if cuda {
        ForwardKind::Kernels
    } else {
        ForwardKind::None
    });
    if forward == ForwardKind::Kernels && !cuda {
        err("--forward kernels launches our CUDA kernels: it needs --backend cuda".into());
    }
    let pool_gb = a.pool_gb.unwrap_or(if cuda { 100.0 } else { 2.0 });
    let host_gb = a.host_gb.unwrap_or(if cuda { 32.0 } else { 1.0 });
    if !(pool_gb.is_finite() && pool_gb > 0.0 && pool_gb <= 1000.0) {
        err(format!("--pool-gb must be in (0, 1000] (got {pool_gb})"));
    }
    if !(host_gb.is_finite() && (0.0..=1000.0).contains(&host_gb)) {
        err(format!("--host-gb must be in [0, 1000] (got {host_gb})"));
    }
    let q = a.quick;
    let contexts = a.contexts.unwrap_or(if q {
        vec![4096, 16384]
    } else {
        vec![4096, 16384, 32768, 65536, 131072]
    });
    let batches = a.batches.unwrap_or(if q {
        vec![16, 64]
    } else {
        vec![64, 256, 512, 1024]
    });
    let fixed_batch = a.fixed_batch.unwrap_or(if q { 16 } else { 256 });
    let fixed_context = a.fixed_context.unwrap_or(if q { 4096 } else { 32768 });
    for &c in contexts.iter().chain([&fixed_context]) {
        if !(4096..=MAX_CONTEXT).contains(&c) {
            err(format!(
                "a context must be in [4096, {MAX_CONTEXT}] tokens (got {c}): the shared prefix is the context less {HEADROOM} tokens"
            ));
        }
    }
    for &b in batches.iter().chain([&fixed_batch]) {
        if !(1..=MAX_BATCH).contains(&b) {
            err(format!("a batch must be in [1, {MAX_BATCH}] (got {b})"));
        }
    }
    if a.workers == 0 || a.workers > 64 {
        err(format!("--workers must be in [1, 64] (got {})", a.workers));
    }
    let mut points = Vec::new();
    if a.only != Some(Sweep::Batch) {
        points.extend(contexts.iter().map(|&c| (Sweep::Context, c, fixed_batch)));
    }
    if a.only != Some(Sweep::Context) {
        points.extend(batches.iter().map(|&b| (Sweep::Batch, fixed_context, b)));
    }
    let steps = a.steps.unwrap_or(if q { 30 } else { 300 });
    if steps == 0 {
        err("--steps must be at least 1".into());
    }
    let suffix = if q { QUICK_SUFFIX } else { SUFFIX };
    let generate = match a.generate.as_deref() {
        None => {
            if q {
                QUICK_GENERATE
            } else {
                GENERATE
            }
        }
        Some(&[lo, hi])
            if lo >= 1
                && lo <= hi
                && u64::from(hi) + suffix.1 + u64::from(DRAFTS) < u64::from(HEADROOM) =>
        {
            (u64::from(lo), u64::from(hi))
        }
        Some(_) => err(format!(
            "--generate takes MIN,MAX with 1 <= MIN <= MAX and MAX <= {} (the room above \
             the shared prefix less the longest suffix and the drafts)",
            u64::from(HEADROOM) - suffix.1 - u64::from(DRAFTS) - 1
        )),
    };
    Plan {
        backend: a.backend,
        gpu: a.gpu,
        forward,
        pool_bytes: (pool_gb * GB) as u64,
        host_bytes: (host_gb * GB) as u64,
        points,
        steps,
        warmup: a.warmup.unwrap_or(if q { 10 } else { 50 }),
        fill: a.fill,
        new_prefix_pct: a.new_prefix_pct,
        suffix,
        generate,
        seed: a.seed,
        workers: a.workers,
        idle_spin_us: a.idle_spin_us,
        svg: a.svg,
    }
}

type BenchError = Box<dyn std::error::Error + Send + Sync>;

/// DeepSeek-V3.2 with MTP (3 drafts) in one cache, pools from the byte budgets.
fn config(p: &Plan) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.kv_cache.max_gpu_total_bytes = Some(p.pool_bytes);
    c.kv_cache.host_cache_size = (p.host_bytes > 0).then_some(p.host_bytes);
    let max_batch = p.points.iter().map(|x| x.2).max().unwrap_or(1);
    let max_context = p.points.iter().map(|x| x.1).max().unwrap_or(4096);
    c.scheduler.max_num_sequences = max_batch;
    // Every decode (1 + 3 drafts) plus prefill chunks.
    c.scheduler.max_num_tokens = (4 * max_batch).max(4096) + 4096;
    c.scheduler.max_prefill_chunk = PREFILL_CHUNK;
    c.scheduler.max_seq_len = max_context + HEADROOM;
    c.spec_decode.mode = SpecMode::Mtp;
    c.spec_decode.draft_tokens = DRAFTS;
    c.spec_decode.separate_draft_cache = false;
    c
}

/// A forward that does nothing.
struct NoopForward;

impl Forward for NoopForward {
    fn forward(&mut self, _: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        Ok(Sampling::ByEngine)
    }
}

#[cfg(feature = "cuda")]
mod kernel_writer {
    //! `--forward kernels`: the cache writes of a model's forward, without the model.

    use std::sync::Arc;

    use dsa_kv::config::IndexerDtype;
    use dsa_kv::cuda::kernels::{DevRows, MlaEncoding};
    use dsa_kv::cuda::{DeviceBuffer, Gpu};
    use dsa_kv::device::forward::{Batch, Forward, ForwardError, ForwardSetup, Sampling};
    use dsa_kv::rng::SplitMix64;
    use half::bf16;

    /// Writes every new token's indexer key and MLA row on every layer with our kernels,
    /// from BF16 inputs uploaded once (seeded): three launches per layer per step.
    pub(crate) struct KernelWriter {
        gpu: Arc<Gpu>,
        rows: DeviceBuffer,
        keys: DeviceBuffer,
        values: DeviceBuffer,
        scales: DeviceBuffer,
        max_tokens: usize,
    }

    fn framework(e: dsa_kv::cuda::CudaError) -> ForwardError {
        ForwardError::framework(e)
    }

    impl KernelWriter {
        pub(crate) fn new(setup: &ForwardSetup<'_>) -> Result<Self, ForwardError> {
            let gpu = setup
                .extension::<Arc<Gpu>>()
                .ok_or_else(|| ForwardError::Unsupported {
                    what: "--forward kernels needs the CUDA backend's Gpu".into(),
                })?
                .clone();
            let n = setup.max_num_tokens.max(1);
            let elems = setup.model.mla_row_elems() as usize;
            let key = setup.model.spec().index_head_dim as usize;
            let mut rng = SplitMix64(0x5ca1e);
            // Values in [-1, 1): quantization sees ordinary magnitudes.
            let mut seeded = |len: usize| -> Vec<bf16> {
                (0..len)
                    .map(|_| bf16::from_f64(rng.uniform() * 2.0 - 1.0))
                    .collect()
            };
            let rows = DeviceBuffer::from_slice(&gpu, &seeded(n * elems), "MLA input rows")
                .map_err(framework)?;
            let keys = DeviceBuffer::from_slice(&gpu, &seeded(n * key), "indexer input keys")
                .map_err(framework)?;
            let values =
                DeviceBuffer::zeroed(&gpu, n * 128, "quantized keys").map_err(framework)?;
            let scales = DeviceBuffer::zeroed(&gpu, n * 4, "key scales").map_err(framework)?;
            Ok(KernelWriter {
                gpu,
                rows,
                keys,
                values,
                scales,
                max_tokens: n,
            })
        }
    }

    impl Forward for KernelWriter {
        fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
            let n = batch.host_metadata().counts().num_tokens;
            if n == 0 {
                return Ok(Sampling::ByEngine);
            }
            if n > self.max_tokens {
                return Err(ForwardError::Memory {
                    what: format!("{n} new tokens, inputs for {}", self.max_tokens),
                });
            }
            let stream = batch
                .cuda_stream()
                .ok_or_else(|| ForwardError::Unsupported {
                    what: "--forward kernels needs the batch's CUDA stream".into(),
                })?;
            let gpu = &*self.gpu;
            let dev = gpu.ordinal();
            let k = gpu.kernels();
            let md = &batch.metadata;
            let (vmap, smap, mla) = (
                md.slot_mapping_value.addr,
                md.slot_mapping_scale.addr,
                md.mla_slot_mapping.addr,
            );
            for l in &batch.cache.layers {
                if let Some(ix) = l.indexer {
                    let cache_len = ix.pool.addr + ix.pool.bytes - ix.base;
                    let fp4 = ix.dtype == IndexerDtype::Fp4;
                    let (values, scales) = (self.values.ptr(), self.scales.ptr());
                    // SAFETY: the inputs and scratch hold `max_tokens ≥ n` keys, payloads
                    // and scales; the cache view is this layer's pages to the end of its
                    // pool, and the kernel skips offsets past `cache_len`; the mappings
                    // are the runtime's metadata for this batch (n entries each).
                    unsafe {
                        k.quantize_indexer(
                            stream,
                            dev,
                            self.keys.ptr(),
                            values,
                            scales,
                            n,
                            fp4,
                            true,
                        )
                        .map_err(framework)?;
                        k.indexer_k_scatter(
                            stream,
                            dev,
                            ix.base,
                            cache_len,
                            values,
                            scales,
                            vmap,
                            smap,
                            n,
                            ix.value_bytes as usize,
                            None,
                        )
                        .map_err(framework)?;
                    }
                }
                if let Some(m) = l.mla {
                    let enc = MlaEncoding::of(&m).map_err(|what| ForwardError::Unsupported {
                        what: format!("layer {}: {what}", l.layer.get()),
                    })?;
                    // SAFETY: `rows` holds `max_tokens ≥ n` rows of 576 BF16; the view is
                    // this layer's rows in the pool (rows past the pool are skipped); the
                    // mapping is the batch's (n entries).
                    unsafe {
                        k.mla_scatter(
                            stream,
                            dev,
                            DevRows::of(&m.rows),
                            enc,
                            self.rows.ptr(),
                            mla,
                            n,
                            None,
                        )
                        .map_err(framework)?
                    };
                }
            }
            Ok(Sampling::ByEngine)
        }
    }
}

/// The forward factory of `--forward` (`None`: the backend's synthetic writer).
fn forward_factory(kind: ForwardKind) -> Result<Option<ForwardFactory>, BenchError> {
    match kind {
        ForwardKind::None => Ok(Some(Arc::new(|_: &ForwardSetup<'_>| {
            Ok(Box::new(NoopForward) as Box<dyn Forward>)
        }))),
        ForwardKind::Synthetic => Ok(None),
        #[cfg(feature = "cuda")]
        ForwardKind::Kernels => Ok(Some(Arc::new(|s: &ForwardSetup<'_>| {
            Ok(Box::new(kernel_writer::KernelWriter::new(s)?) as Box<dyn Forward>)
        }))),
        #[cfg(not(feature = "cuda"))]
        ForwardKind::Kernels => {
            Err("this build has no CUDA backend: build with the `cuda` feature".into())
        }
    }
}

/// A shared prefix that arrivals hit.
struct Group {
    tokens: Vec<TokenId>,
    /// Its first request has been prefilled: arrivals now hit it.
    ready: bool,
    leader: Option<RequestId>,
}

/// A request in flight.
struct Live {
    group: usize,
    seen: bool,
}

/// What happened in the timed window.
#[derive(Default)]
struct Window {
    walls: Vec<u64>,
    timings: Vec<StepTiming>,
    /// Per step: whether it admitted a request (its first chunk) or finished one.
    churn: Vec<bool>,
    scheduled: u64,
    decodes: u64,
    tokens: u64,
    prefill_tokens: u64,
    context_sum: u64,
    max_context: u64,
    arrivals: u64,
    finished: u64,
    failed: u64,
    hits: u64,
    hit_tokens: u64,
    new_prefixes: u64,
    preemptions: u64,
    slot_copies: u64,
}

/// The runtime, the step in flight and the workload's requests.
struct Engine {
    kv: KvCacheHandle,
    rep: StepReport,
    /// Whether `rep`'s step is in flight (uncommitted).
    in_flight: bool,
    drafts: HashMap<RequestId, Vec<TokenId>>,
    live: HashMap<RequestId, Live>,
    groups: Vec<Group>,
    /// Prefixes replaced by new ones (their blocks go stale, offloaded under pressure);
    /// half of the new prefixes revive one of them (a hit on the host tier: onboard).
    retired: Vec<Vec<TokenId>>,
    next_id: u64,
    rng: SplitMix64,
    /// Requests to keep in flight.
    batch: usize,
    /// Tokens of a shared prefix.
    prefix_len: u32,
    /// Arrivals of the filler phase: unique prompts of this length, one token out.
    filler_len: Option<u32>,
    plan: Plan,
}

fn random_tokens(rng: &mut SplitMix64, n: u64) -> impl Iterator<Item = TokenId> + '_ {
    (0..n).map(move |_| TokenId(rng.below(u64::from(TokenId::MAX)) as u32))
}

impl Engine {
    fn new_group(&mut self, at: Option<usize>) -> usize {
        let revive = at.is_some() && !self.retired.is_empty() && self.rng.chance(50);
        let tokens = if revive {
            let i = self.rng.below(self.retired.len() as u64) as usize;
            self.retired.swap_remove(i)
        } else {
            random_tokens(&mut self.rng, u64::from(self.prefix_len)).collect()
        };
        let g = Group {
            tokens,
            ready: false,
            leader: None,
        };
        match at {
            Some(i) => {
                let old = std::mem::replace(&mut self.groups[i], g);
                self.retired.push(old.tokens);
                i
            }
            None => {
                self.groups.push(g);
                self.groups.len() - 1
            }
        }
    }

    async fn submit(&mut self, group: usize, w: &mut Window) -> Result<(), BenchError> {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let p = &self.plan;
        let (prompt, max_new) = match self.filler_len {
            Some(n) => (random_tokens(&mut self.rng, u64::from(n)).collect(), 1),
            None => {
                let suffix = self.rng.range(p.suffix.0, p.suffix.1 + 1);
                let max_new = self.rng.range(p.generate.0, p.generate.1 + 1) as u32;
                let mut prompt = Vec::with_capacity(self.prefix_len as usize + suffix as usize);
                prompt.extend_from_slice(&self.groups[group].tokens);
                prompt.extend(random_tokens(&mut self.rng, suffix));
                (prompt, max_new)
            }
        };
        self.kv
            .submit(SubmitRequest::new(id, prompt, max_new))
            .await?;
        if self.filler_len.is_none() && self.groups[group].leader.is_none() {
            self.groups[group].leader = Some(id);
        }
        self.live.insert(id, Live { group, seen: false });
        self.drafts
            .insert(id, vec![TokenId(1), TokenId(2), TokenId(3)]);
        w.arrivals += 1;
        Ok(())
    }

    /// Tops the requests in flight up to the batch: new requests hit a ready prefix (or,
    /// `new_prefix_pct` of them, open a new one replacing a prefix that goes stale).
    async fn arrivals(&mut self, w: &mut Window) -> Result<(), BenchError> {
        while self.live.len() < self.batch {
            if self.filler_len.is_some() {
                self.submit(0, w).await?;
                continue;
            }
            let ready: Vec<usize> = (0..self.groups.len())
                .filter(|&g| self.groups[g].ready)
                .collect();
            if ready.is_empty() {
                return Ok(()); // the leaders are still prefilling
            }
            // A new prefix replaces a ready one, never the last one ready (arrivals would
            // wait for its whole prefill).
            let g = if ready.len() >= 2 && self.rng.chance(self.plan.new_prefix_pct) {
                let g = ready[self.rng.below(ready.len() as u64) as usize];
                w.new_prefixes += 1;
                self.new_group(Some(g))
            } else {
                ready[self.rng.below(ready.len() as u64) as usize]
            };
            self.submit(g, w).await?;
        }
        Ok(())
    }

    /// The step in flight's outcomes: one draft accepted where there were drafts, a
    /// sampled token where the step produces one.
    fn outcomes(&self) -> Vec<RequestOutcome> {
        self.rep
            .scheduled
            .iter()
            .map(|r| RequestOutcome {
                id: r.id,
                accepted_drafts: r.num_drafts.min(1),
                next_token: r.produces_token.then_some(TokenId(9)),
            })
            .collect()
    }

    /// One `commit_and_step`, timed into `w`, then the window's counts and arrivals.
    async fn step(&mut self, w: &mut Window) -> Result<(), BenchError> {
        let outcomes = self.outcomes();
        let drafts = Drafts::from(self.drafts.clone());
        // A step that scheduled nothing left nothing to commit: a plain `step` then.
        let idle = !self.in_flight || self.rep.scheduled.is_empty();
        let t = Instant::now();
        let (finished, next) = if idle {
            (Vec::new(), self.kv.step(drafts).await)
        } else {
            let r = self.kv.commit_and_step(outcomes, drafts).await?;
            (r.commit.finished, r.step)
        };
        w.walls.push(t.elapsed().as_nanos() as u64);
        self.rep = next?;
        self.in_flight = true;
        let rep = &self.rep;
        w.timings.push(rep.timing);
        let mut gone: Vec<RequestId> = finished.iter().map(|f| f.finished.id).collect();
        let mut churn = !gone.is_empty();
        w.finished += gone.len() as u64;
        w.failed += rep.failed.len() as u64;
        gone.extend(rep.failed.iter().map(|f| f.0));
        w.preemptions += rep.preempted.len() as u64;
        w.slot_copies += rep.devices.iter().map(|d| d.slot_copies).max().unwrap_or(0);
        w.scheduled += rep.scheduled.len() as u64;
        for p in &rep.scheduled {
            let n = p.tokens.len() as u64;
            w.tokens += n;
            let context = u64::from(p.num_cached) + n;
            match p.kind {
                RequestKind::Generation => {
                    w.decodes += 1;
                    w.context_sum += context;
                    w.max_context = w.max_context.max(context);
                }
                RequestKind::Context => w.prefill_tokens += n,
            }
            if let Some(l) = self.live.get_mut(&p.id) {
                if !l.seen {
                    l.seen = true;
                    churn = true;
                    if p.num_cached > 0 {
                        w.hits += 1;
                        w.hit_tokens += u64::from(p.num_cached);
                    }
                }
                if let Some(g) = self.groups.get_mut(l.group) {
                    if g.leader == Some(p.id) && p.kind == RequestKind::Generation {
                        g.ready = true;
                    }
                }
            }
        }
        w.churn.push(churn);
        for id in gone {
            if let Some(l) = self.live.remove(&id) {
                if let Some(g) = self.groups.get_mut(l.group) {
                    if g.leader == Some(id) {
                        g.ready = true;
                    }
                }
            }
            self.drafts.remove(&id);
        }
        self.arrivals(w).await
    }

    /// Ends every request: commits the step in flight alone (no next step), so that no
    /// request is part of a step, then cancels them all.
    async fn drain(&mut self) -> Result<(), BenchError> {
        self.batch = 0;
        if self.in_flight && !self.rep.scheduled.is_empty() {
            self.kv.commit(self.outcomes()).await?;
            self.in_flight = false;
        }
        let ids: Vec<RequestId> = self.live.keys().copied().collect();
        for id in ids {
            // One that finished with that commit: nothing to cancel.
            let _ = self.kv.cancel(id).await;
        }
        self.live.clear();
        self.drafts.clear();
        // Nothing is left to schedule; a step proves it.
        let mut w = Window::default();
        self.step(&mut w).await?;
        if self.rep.scheduled.is_empty() {
            return Ok(());
        }
        let left: Vec<RequestId> = self.rep.scheduled.iter().map(|r| r.id).collect();
        Err(format!("requests {left:?} were still scheduled after cancelling every request").into())
    }
}

fn percentile(v: &[u64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_unstable();
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i] as f64
}

fn stat_us(v: &[u64]) -> Value {
    json!({
        "median": percentile(v, 0.5) / 1e3,
        "p99": percentile(v, 0.99) / 1e3,
        "mean": v.iter().sum::<u64>() as f64 / v.len().max(1) as f64 / 1e3,
    })
}

/// The work intervals of a step (not its wake-ups and messages).
fn cpu_ns(t: &StepTiming) -> u64 {
    t.commit_ns + t.schedule_ns + t.enqueue_ns + t.device_ns + t.overlapped_ns + t.finish_ns
}

type Field = (&'static str, fn(&StepTiming) -> u64);

const FIELDS: [Field; 10] = [
    ("to_coordinator", |t| t.to_coordinator_ns),
    ("commit", |t| t.commit_ns),
    ("schedule", |t| t.schedule_ns),
    ("enqueue", |t| t.enqueue_ns),
    ("to_device", |t| t.to_device_ns),
    ("device", |t| t.device_ns),
    ("from_device", |t| t.from_device_ns),
    ("overlapped", |t| t.overlapped_ns),
    ("finish", |t| t.finish_ns),
    ("to_caller", |t| t.to_caller_ns),
];

/// Runs one point: new prefixes, leaders prefilled, the batch decoding, warm-up, then
/// the timed window.
async fn point(
    e: &mut Engine,
    (sweep, context, batch): (Sweep, u32, u32),
    pool_tokens: u64,
) -> Result<Value, BenchError> {
    let started = Instant::now();
    let p = e.plan.clone();
    e.prefix_len = context - HEADROOM;
    e.batch = batch as usize;
    // A quarter of the pool for the shared prefixes, 1 to 32 of them, at most one per
    // request.
    let groups = ((pool_tokens / 4) / u64::from(context))
        .clamp(1, 32)
        .min(u64::from(batch)) as usize;
    e.groups.clear();
    e.retired.clear();
    for _ in 0..groups {
        e.new_group(None);
    }
    let mut scratch = Window::default();
    // The leaders: one request per prefix, prefilled whole.
    for g in 0..groups {
        e.submit(g, &mut scratch).await?;
    }
    let mut steps = 0u64;
    let mut last = Instant::now();
    let progress = |phase: &str, steps: u64, e: &Engine, last: &mut Instant| {
        if last.elapsed().as_secs() >= 5 {
            *last = Instant::now();
            eprintln!(
                "  {phase}: {steps} steps, {} requests in flight, {} scheduled",
                e.live.len(),
                e.rep.scheduled.len()
            );
        }
    };
    while !e.groups.iter().all(|g| g.ready) {
        e.step(&mut scratch).await?;
        steps += 1;
        progress("prefixes", steps, e, &mut last);
    }
    // The batch arrives and settles: most of it decoding, then the warm-up.
    // A point whose prefills cannot keep up is timed anyway after this many steps.
    let settle_cap = 1_000;
    let mut settle = 0;
    loop {
        e.step(&mut scratch).await?;
        settle += 1;
        progress("settle", settle, e, &mut last);
        let decoding = e
            .rep
            .scheduled
            .iter()
            .filter(|r| r.kind == RequestKind::Generation)
            .count();
        if decoding * 100 >= e.batch * 85 || settle >= settle_cap {
            break;
        }
    }
    for _ in 0..p.warmup {
        e.step(&mut scratch).await?;
    }
    let before = e.kv.stats().await?;
    let mut w = Window::default();
    for i in 0..p.steps {
        e.step(&mut w).await?;
        progress("timed", u64::from(i + 1), e, &mut last);
    }
    let after = e.kv.stats().await?;
    let n = w.walls.len().max(1) as f64;
    let mut timing = serde_json::Map::new();
    for (name, f) in FIELDS {
        let v: Vec<u64> = w.timings.iter().map(f).collect();
        timing.insert(name.into(), stat_us(&v));
    }
    let cpu: Vec<u64> = w.timings.iter().map(cpu_ns).collect();
    let coord: Vec<u64> = w
        .timings
        .iter()
        .map(|t| t.commit_ns + t.schedule_ns)
        .collect();
    let split = |churn: bool| -> Vec<u64> {
        w.walls
            .iter()
            .zip(&w.churn)
            .filter(|x| *x.1 == churn)
            .map(|x| *x.0)
            .collect()
    };
    let (steady, churning) = (split(false), split(true));
    let out = json!({
        "sweep": match sweep { Sweep::Context => "context", Sweep::Batch => "batch" },
        "context": context,
        "batch": batch,
        "backend": match p.backend { Backend::Host => "host", Backend::Cuda => "cuda" },
        "forward": p.forward.name(),
        "shared_prefix_tokens": e.prefix_len,
        "shared_prefixes": groups,
        "generate": [p.generate.0, p.generate.1],
        "steps": p.steps,
        "warmup_steps": p.warmup,
        "settle_steps": settle + steps,
        "step_us": stat_us(&w.walls),
        "steady_steps": steady.len(),
        "steady_step_us": stat_us(&steady),
        "churn_step_us": stat_us(&churning),
        "cpu_us": stat_us(&cpu),
        "commit_schedule_us": stat_us(&coord),
        "timing_us": timing,
        "window": {
            "scheduled_per_step": w.scheduled as f64 / n,
            "decodes_per_step": w.decodes as f64 / n,
            "tokens": w.tokens,
            "prefill_tokens": w.prefill_tokens,
            "mean_decode_context": w.context_sum as f64 / w.decodes.max(1) as f64,
            "max_decode_context": w.max_context,
            "arrivals": w.arrivals,
            "finished": w.finished,
            "failed": w.failed,
            "prefix_hits": w.hits,
            "prefix_hit_tokens": w.hit_tokens,
            "new_prefixes": w.new_prefixes,
            "preemptions": w.preemptions,
            "slot_copies": w.slot_copies,
            "offload_bytes": after.offload_bytes - before.offload_bytes,
            "onboard_bytes": after.onboard_bytes - before.onboard_bytes,
            "gpu_utilization": after.utilization.iter().map(|u| serde_json::to_value(u).unwrap_or(Value::Null)).collect::<Vec<_>>(),
        },
        "point_seconds": started.elapsed().as_secs_f64(),
    });
    e.drain().await?;
    Ok(out)
}

/// Fills `pct` % of the GPU pool with cached blocks of unique prompts that nobody asks
/// for again: stale prefixes that later allocations evict (offload).
async fn fill(e: &mut Engine, pool_tokens: u64, pct: u32) -> Result<(), BenchError> {
    let total = pool_tokens * u64::from(pct) / 100;
    if total == 0 {
        return Ok(());
    }
    let len = (e.plan.points.iter().map(|x| x.1).max().unwrap_or(4096)).min(32768);
    let count = total.div_ceil(u64::from(len));
    e.filler_len = Some(len);
    e.batch = count as usize;
    let mut w = Window::default();
    e.arrivals(&mut w).await?;
    e.batch = 0;
    let t = Instant::now();
    let mut steps = 0u64;
    let mut last = Instant::now();
    while !e.live.is_empty() {
        e.step(&mut w).await?;
        steps += 1;
        if last.elapsed().as_secs() >= 5 {
            last = Instant::now();
            eprintln!("  fill: {steps} steps, {} fillers left", e.live.len());
        }
    }
    e.filler_len = None;
    eprintln!(
        "fill: {count} prompts of {len} tokens ({total} tokens) in {steps} steps, {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn run(p: Plan) -> Result<Vec<Value>, BenchError> {
    let t = Instant::now();
    let mut b = KvCacheBuilder::new()
        .config(config(&p))
        .idle_spin(std::time::Duration::from_micros(p.idle_spin_us));
    b = match forward_factory(p.forward)? {
        Some(f) => b.forward(f),
        None => b.verification(Verification::Off),
    };
    if p.backend == Backend::Cuda {
        b = b.backend(common::cuda_backend(vec![p.gpu])?);
    }
    let kv = b.start().await?;
    let info = kv.info().clone();
    let pool_tokens = info.budget.tokens;
    eprintln!(
        "started in {:.1} s: {} ({} B/token), GPU pool {:.1} GB = {} tokens ({} blocks), host tier {} blocks, forward {}",
        t.elapsed().as_secs_f64(),
        info.model,
        info.bytes_per_token,
        info.budget.bytes as f64 / GB,
        pool_tokens,
        info.budget.slots,
        info.host_slots,
        p.forward.name(),
    );
    let rep = kv.step(Drafts::none()).await?;
    let mut e = Engine {
        kv,
        rep,
        in_flight: true,
        drafts: HashMap::new(),
        live: HashMap::new(),
        groups: Vec::new(),
        retired: Vec::new(),
        next_id: 0,
        rng: SplitMix64(p.seed),
        batch: 0,
        prefix_len: 0,
        filler_len: None,
        plan: p.clone(),
    };
    fill(&mut e, pool_tokens, p.fill).await?;
    let mut out = Vec::new();
    for (i, &pt) in p.points.iter().enumerate() {
        eprintln!(
            "point {}/{}: {:?} sweep, context {}, batch {}",
            i + 1,
            p.points.len(),
            pt.0,
            pt.1,
            pt.2
        );
        let v = point(&mut e, pt, pool_tokens).await?;
        eprintln!(
            "  step median {:.1} µs (p99 {:.1}), cpu {:.1} µs, commit+schedule {:.1} µs, device {:.1} µs; {:.1} s",
            v["step_us"]["median"].as_f64().unwrap_or(0.0),
            v["step_us"]["p99"].as_f64().unwrap_or(0.0),
            v["cpu_us"]["median"].as_f64().unwrap_or(0.0),
            v["commit_schedule_us"]["median"].as_f64().unwrap_or(0.0),
            v["timing_us"]["device"]["median"].as_f64().unwrap_or(0.0),
            v["point_seconds"].as_f64().unwrap_or(0.0),
        );
        println!("{v}");
        out.push(v);
        // After every point, so a run stopped early (a timeout) still has its plot.
        if let Some(path) = &p.svg {
            std::fs::write(path, svg(&out))
                .map_err(|e| format!("writing {}: {e}", path.display()))?;
        }
    }
    e.kv.shutdown().await;
    Ok(out)
}

/// A plotted line: its name, its colour, and its value at a point.
type Series = (&'static str, &'static str, fn(&Value) -> f64);

/// The plot: per-step µs (medians) against context (left) and batch (right), log2 x.
fn svg(points: &[Value]) -> String {
    const W: f64 = 920.0;
    const H: f64 = 380.0;
    let series: [Series; 5] = [
        ("commit_and_step (median)", "#1f77b4", |v| {
            v["step_us"]["median"].as_f64().unwrap_or(0.0)
        }),
        ("CPU work (median)", "#d62728", |v| {
            v["cpu_us"]["median"].as_f64().unwrap_or(0.0)
        }),
        ("commit + schedule", "#2ca02c", |v| {
            v["commit_schedule_us"]["median"].as_f64().unwrap_or(0.0)
        }),
        ("device handler", "#ff7f0e", |v| {
            v["timing_us"]["device"]["median"].as_f64().unwrap_or(0.0)
        }),
        ("steps without churn", "#9467bd", |v| {
            v["steady_step_us"]["median"].as_f64().unwrap_or(0.0)
        }),
    ];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (k, (sweep, xkey, title)) in [
        ("context", "context", "per-step µs vs context (tokens)"),
        ("batch", "batch", "per-step µs vs batch (requests)"),
    ]
    .into_iter()
    .enumerate()
    {
        let pts: Vec<&Value> = points.iter().filter(|v| v["sweep"] == sweep).collect();
        let (x0, y0, pw, ph) = (60.0 + k as f64 * 450.0, 40.0, 380.0, 260.0);
        s += &format!(
            "<text x=\"{}\" y=\"24\" font-size=\"13\">{title}</text>\n",
            x0
        );
        s += &format!(
            "<rect x=\"{x0}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#888\"/>\n"
        );
        if pts.is_empty() {
            continue;
        }
        let xs: Vec<f64> = pts
            .iter()
            .map(|v| v[xkey].as_f64().unwrap_or(1.0).log2())
            .collect();
        let (xmin, xmax) = xs
            .iter()
            .fold((f64::MAX, f64::MIN), |a, &x| (a.0.min(x), a.1.max(x)));
        let ymax = pts
            .iter()
            .flat_map(|v| series.iter().map(move |s| s.2(v)))
            .fold(1.0f64, f64::max)
            * 1.1;
        let sx = |x: f64| {
            x0 + if xmax > xmin {
                (x - xmin) / (xmax - xmin) * pw
            } else {
                pw / 2.0
            }
        };
        let sy = |y: f64| y0 + ph - y / ymax * ph;
        for i in 0..=4 {
            let y = ymax * i as f64 / 4.0;
            s += &format!(
                "<line x1=\"{x0}\" y1=\"{0:.1}\" x2=\"{1}\" y2=\"{0:.1}\" stroke=\"#eee\"/><text x=\"{2}\" y=\"{3:.1}\" text-anchor=\"end\">{y:.0}</text>\n",
                sy(y), x0 + pw, x0 - 4.0, sy(y) + 4.0
            );
        }
        for (v, &x) in pts.iter().zip(&xs) {
            s += &format!(
                "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                sx(x),
                y0 + ph + 16.0,
                v[xkey]
            );
        }
        for (name, color, f) in &series {
            let path: Vec<String> = pts
                .iter()
                .zip(&xs)
                .map(|(v, &x)| format!("{:.1},{:.1}", sx(x), sy(f(v))))
                .collect();
            s += &format!(
                "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"><title>{name}</title></polyline>\n",
                path.join(" ")
            );
            for pt in &path {
                let (cx, cy) = pt.split_once(',').unwrap_or(("0", "0"));
                s += &format!("<circle cx=\"{cx}\" cy=\"{cy}\" r=\"3\" fill=\"{color}\"/>\n");
            }
        }
    }
    for (i, (name, color, _)) in series.iter().enumerate() {
        let x = 60.0 + i as f64 * 170.0;
        s += &format!(
            "<rect x=\"{x}\" y=\"{0}\" width=\"12\" height=\"12\" fill=\"{color}\"/><text x=\"{1}\" y=\"{2}\">{name}</text>\n",
            H - 40.0,
            x + 16.0,
            H - 30.0
        );
    }
    s += "</svg>\n";
    s
}

fn main() -> ExitCode {
    common::quiet_on_closed_stdout();
    let p = plan(Args::parse());
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(p.workers)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("scale_bench: error: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The engine loop is a task of the runtime, as an engine's would be.
    let result = rt.block_on(async move {
        match tokio::spawn(run(p)).await {
            Ok(r) => r,
            Err(e) => Err(format!("the engine loop panicked: {e}").into()),
        }
    });
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scale_bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_nearest_rank() {
        let v: Vec<u64> = (1..=100).rev().collect();
        assert_eq!(percentile(&v, 0.5), 51.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(stat_us(&[1000, 3000])["mean"], 2.0);
    }

    #[test]
    fn quick_plan_has_both_sweeps_within_the_limits() {
        let p = plan(Args::parse_from(["scale_bench", "--quick"]));
        assert_eq!(
            p.points,
            vec![
                (Sweep::Context, 4096, 16),
                (Sweep::Context, 16384, 16),
                (Sweep::Batch, 4096, 16),
                (Sweep::Batch, 4096, 64)
            ]
        );
        assert_eq!(
            (p.forward, p.pool_bytes, p.steps),
            (ForwardKind::None, 2_000_000_000, 30)
        );
        let c = config(&p);
        assert_eq!(c.scheduler.max_num_sequences, 64);
        assert_eq!(c.scheduler.max_seq_len, 16384 + HEADROOM);
    }

    #[test]
    fn the_plot_has_a_line_per_series_in_each_panel() {
        let point = |sweep: &str, context: u32, batch: u32, us: f64| {
            json!({
                "sweep": sweep, "context": context, "batch": batch,
                "step_us": {"median": us}, "cpu_us": {"median": us / 2.0},
                "commit_schedule_us": {"median": us / 4.0},
                "timing_us": {"device": {"median": us / 8.0}},
                "steady_step_us": {"median": us / 2.0},
            })
        };
        let s = svg(&[
            point("context", 4096, 256, 100.0),
            point("context", 131072, 256, 120.0),
            point("batch", 32768, 64, 50.0),
        ]);
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert_eq!(s.matches("<polyline").count(), 10);
        assert_eq!(s.matches("<circle").count(), 15);
        assert!(s.contains(">131072<"));
    }
}
