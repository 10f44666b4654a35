//! The main job: a seeded multi-turn chat workload (conversations over a few shared
//! system prompts, arriving as a Poisson process) through the actor runtime, with
//! continuous batching, chunked prefill, prefix reuse, host offload and preemption. What
//! runs on the device actors is chosen by `--source`:
//!
//! * `model` (the default): the crate's small DeepSeek-V3.2-style reference model
//!   (`dsa_kv_model`: 2 layers, MLA rows in `fp8_ds_mla` or BF16 (`--kv-dtype`), FP8
//!   indexer keys, the lightning indexer's top-64 and sparse MLA; random weights from a
//!   fixed seed) runs as the framework forward on every device actor (`--devices N`).
//!   Each step's sampled token is the model's greedy token (every device must compute
//!   the same one, or the run stops with an error), and a conversation's next turn is
//!   its previous prompt and generated tokens plus new user tokens (token ids modulo the
//!   model's 256-token vocabulary). After the run, the exactness check: every request is
//!   run again alone on a contiguous cache with no paging and no reuse
//!   (`model::unpaged::generate`, the prompt being the whole token history it was
//!   submitted with); its generated tokens, and the logits of every position the runtime
//!   computed on every device, must be equal bit for bit (`exact_requests` of
//!   `checked_requests`, `"exact"`).
//! * `synthetic`: the synthetic writer on the DeepSeek-V3.2 preset (61 layers, MTP with
//!   random draft acceptance, random tokens). Every new token's indexer key and MLA row
//!   is generated from its whole prefix (scope and tokens), position and layer, written
//!   through the ops, and read back through the block tables after reuse, offload and
//!   onboarding, and once more when a request finishes: every position of the request,
//!   on the verified layers (`--verify sample`, the default: the first, middle and last
//!   layer of each cache; `--verify all`: every layer; `--verify off`: no read-backs).
//!   The report states which (`verified_layers`) and the count of position × layer
//!   reads (`tokens_verified`); CI's verification drills run on this source.
//!
//! ```text
//! cargo run --release --example serve -- [--source model|synthetic] [--quick] [--json]
//!     [--seed N] [--devices N] [--conversations N] [--turns N] [--kv-dtype DTYPE]
//!     [--verify sample|all|off] [--config FILE.toml|.json|.yaml] [--out DIR]
//!     [--backend host|cuda] [--gpus 0,1,..] [--cuda-graphs] [--room-faults PCT]
//!     [--metrics-addr ADDR]
//! ```
//!
//! `--metrics-addr 127.0.0.1:9091` serves the runtime's metrics (`metrics` facade,
//! exported with `metrics-exporter-prometheus`) as Prometheus text at `/metrics` while
//! the run lasts, and writes the last scrape to `DIR/metrics.prom`.
//!
//! `--help` lists every flag with its default; `--flag=value` works as well as
//! `--flag value`. While it runs, a progress bar on stderr, only when stderr is a
//! terminal (nothing is redrawn into a log or a pipe).
//!
//! The report (a table, or one JSON object with `--json`) gives requests, generated and
//! processed tokens and their rates, step latency (the wall time of `kv.step`:
//! scheduling, copies and the forward on every device; median and p99 of the steps whose
//! requests all decode, `decode_step_ms`, and of all steps with work, `step_ms`), the
//! prefix hit rate, preemptions, offload and onboarding, and with the model the
//! exactness result. `"integrity_ok"` is true iff no request failed and, with the model,
//! every request is exact; with the synthetic writer, every byte read back matched. The
//! exit status is non-zero otherwise.
//!
//! `--room-faults PCT` (built with `--features fault-injection`) is a fault drill: that
//! share of GPU-room requests is refused as if the storage could not supply the memory;
//! the run must still finish every request, with every byte it reads back matching (or,
//! with the model, every request exact).
//!
//! `--backend cuda` runs each device actor on a GPU (`--gpus`, default `0..devices`):
//! pools in GPU memory (VMM), the host tier in pinned memory, every write through our
//! CUDA kernels, and verification reads the GPU bytes back (`--source synthetic`). With
//! the model, its GPU forward (`dsa_kv_model::cuda`) computes every layer on the GPU
//! from the device pools and metadata; `--cuda-graphs` runs decode-only steps as one
//! CUDA graph. The exactness check compares the GPU's tokens and logits with the host
//! reference, bit for bit.
//!
//! Writes `DIR/serve_report.json` (the report and the per-step `history`, from
//! `KvCacheHandle::history`) and `DIR/serve_report.svg` (GPU and host utilization and
//! the rolling prefix hit rate per step, a line at every step that preempted; drawn with
//! `plotters`), in `DIR` (default `target/serve`).

// The report's `json!` object has more keys than the macro's default recursion allows.
#![recursion_limit = "256"]
// Under `cargo test` only the plot's unit tests run: `main` and what only it reaches are unused.
#![cfg_attr(test, allow(dead_code, unused_imports))]

mod args;
#[path = "../common/mod.rs"]
mod common;
mod plot;
mod v4;

use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use args::{check, verify_name, Args, Source};
use clap::Parser;
use common::Backend;
use dsa_kv::actors::{KvCacheBuilder, RuntimeStats, StepReport};
use dsa_kv::config::{EngineConfig, IndexerLayers, KvDtype, LayerSet, SpecMode};
use dsa_kv::core::scheduler::{RequestKind, RequestOutcome, SubmitRequest};
use dsa_kv::core::ReuseScope;
use dsa_kv::device::forward::ForwardFactory;
use dsa_kv::device::Verification;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::rng::SplitMix64;
use dsa_kv_model::checkpoint::HfConfig;
use dsa_kv_model::paged::{ForwardOptions, ModelForward, Outputs};
use dsa_kv_model::unpaged::generate;
use dsa_kv_model::{CacheFormat, Model, ModelConfig};
use serde_json::json;

/// DeepSeek-V3.2's vocabulary: the synthetic source's token ids.
const SYNTHETIC_VOCAB: u64 = 129_280;
/// The reference model's weight seed (`--seed` varies the workload, not the model).
const MODEL_SEED: u64 = 7;

/// The crate's generator, with the workload's draws.
struct Rng {
    g: SplitMix64,
    /// Token ids are drawn below this.
    vocab: u64,
}

impl Rng {
    fn next(&mut self) -> u64 {
        self.g.next_u64()
    }
    fn uniform(&mut self) -> f64 {
        self.g.uniform()
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.g.range(lo, hi)
    }
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.uniform()).ln()
    }
    fn token(&mut self) -> TokenId {
        TokenId((self.next() % self.vocab) as u32)
    }
    fn tokens(&mut self, n: u64) -> Vec<TokenId> {
        (0..n).map(|_| self.token()).collect()
    }
}

struct Workload {
    conversations: usize,
    turns: usize,
    system_prompts: Vec<Vec<TokenId>>,
    user_tokens: (u64, u64),
    output_tokens: (u64, u64),
    mean_arrival_steps: f64,
    mean_think_steps: f64,
}

impl Workload {
    /// The synthetic source's workload: 61 layers of KV per token on the host, so long
    /// prompts; the model's: every token runs the model here and once more in the
    /// exactness check, sized so the default host run takes about half a minute on two
    /// cores (`--quick`: a few seconds).
    fn new(a: &Args, rng: &mut Rng) -> Workload {
        fn pick_for<T>(quick: bool, if_quick: T, full: T) -> T {
            if quick {
                if_quick
            } else {
                full
            }
        }
        let q = a.quick;
        match a.source {
            Source::Synthetic => Workload {
                conversations: a.conversations.unwrap_or(pick_for(q, 20, 64)),
                turns: a.turns.unwrap_or(pick_for(q, 2, 3)),
                system_prompts: (0..3)
                    .map(|i| rng.tokens(pick_for(q, 300, 600) + 200 * i))
                    .collect(),
                user_tokens: pick_for(q, (40, 200), (60, 400)),
                output_tokens: pick_for(q, (16, 64), (32, 160)),
                mean_arrival_steps: pick_for(q, 1.0, 4.0),
                mean_think_steps: 6.0,
            },
            Source::Model => Workload {
                conversations: a.conversations.unwrap_or(pick_for(q, 6, 12)),
                turns: a.turns.unwrap_or(pick_for(q, 2, 3)),
                system_prompts: (0..3)
                    .map(|i| rng.tokens(pick_for(q, 64, 96) + 32 * i))
                    .collect(),
                user_tokens: pick_for(q, (8, 32), (16, 64)),
                output_tokens: pick_for(q, (8, 16), (16, 40)),
                mean_arrival_steps: pick_for(q, 1.0, 3.0),
                mean_think_steps: 4.0,
            },
        }
    }
}

struct Conversation {
    system: usize,
    history: Vec<TokenId>,
    turn: usize,
    next_at: u64,
    in_flight: Option<RequestId>,
}

/// The configuration of `--checkpoint`'s model.
fn checkpoint_config(a: &Args) -> Result<Option<HfConfig>, String> {
    let Some(dir) = &a.checkpoint else {
        return Ok(None);
    };
    if a.source != Source::Model {
        return Err("--checkpoint runs a model: drop --source synthetic".into());
    }
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("--checkpoint: {}: {e}", path.display()))?;
    Ok(Some(
        HfConfig::parse(&text).map_err(|e| format!("--checkpoint: {e}"))?,
    ))
}

fn engine_config(a: &Args) -> Result<EngineConfig, String> {
    let mut c = match (&a.config, a.source) {
        (Some(p), _) => EngineConfig::from_file(p).map_err(|e| e.to_string())?,
        (None, Source::Synthetic) => {
            let mut c = EngineConfig::default();
            c.spec_decode.mode = SpecMode::Mtp;
            c.spec_decode.draft_tokens = 3;
            c.spec_decode.separate_draft_cache = true;
            c.scheduler.max_num_sequences = 32;
            c.scheduler.max_num_tokens = 2048;
            c.scheduler.max_prefill_chunk = 1024;
            c.scheduler.max_seq_len = 8192;
            c
        }
        (None, Source::Model) => {
            let mut c = EngineConfig::default();
            c.model.num_layers = Some(ModelConfig::tiny(MODEL_SEED).layers as u32);
            c.model.kv_dtype = Some(KvDtype::Fp8DsMla);
            c.scheduler.max_num_sequences = 8;
            c.scheduler.max_num_tokens = 256;
            // Chunks that do not line up with the 64-token blocks.
            c.scheduler.max_prefill_chunk = 96;
            c.scheduler.max_seq_len = 2048;
            c
        }
    };
    if let Some(d) = a.kv_dtype {
        c.model.kv_dtype = Some(d);
    }
    if let Some(hf) = checkpoint_config(a)? {
        // The cache holds the checkpoint's layers (no MTP layer: it has none to run).
        c.model.num_layers = Some(hf.layers as u32);
        c.model.indexer_layers = Some(IndexerLayers::Mask(hf.indexer.clone()));
        c.model.num_mtp_layers = Some(0);
    }
    if a.config.is_none() {
        // Small enough that eviction, offload and preemption happen.
        let (gpu_tokens, host_tokens) = match (a.source, a.quick) {
            (Source::Synthetic, true) => (2_304u64, 2_048u64),
            (Source::Synthetic, false) => (6_144, 4_096),
            (Source::Model, true) => (1_024, 8_192),
            (Source::Model, false) => (1_024, 8_192),
        };
        let per_token = c
            .model
            .build()
            .map_err(|e| e.to_string())?
            .bytes_per_token(LayerSet::Target)
            .total();
        c.kv_cache.max_tokens = Some(gpu_tokens);
        c.kv_cache.host_cache_size = Some(host_tokens * per_token);
    }
    if a.source == Source::Model && c.spec_decode.mode != SpecMode::None {
        return Err(
            "serve runs the reference model without speculation (its MTP drafts are \
             exercised by tests/exactness.rs): set spec_decode.mode = \"none\" in the \
             configuration, or add --source synthetic"
                .into(),
        );
    }
    c.parallel.tp_size = a.devices as u32;
    Ok(c)
}

fn draft_acceptance(rng: &mut Rng, drafts: u32) -> u32 {
    // Each draft is accepted with probability 0.7, until the first rejection.
    (0..drafts).take_while(|_| rng.uniform() < 0.7).count() as u32
}

/// What `serve` can fail with: the runtime's typed errors, or a message of its own
/// (configuration file, report files, devices that disagree).
type ServeError = Box<dyn std::error::Error + Send + Sync>;

/// Wall time of `kv.step` (scheduling, copies, and the forward on every device; not the
/// commit, which with the synthetic writer includes reading finished requests back), in
/// milliseconds, of the steps that scheduled work.
#[derive(Default)]
struct StepLatency {
    all: Vec<f64>,
    /// Iterations whose scheduled requests all decode.
    decode_only: Vec<f64>,
    /// Of those, the device actor's handler (step copies, metadata, the forward with its
    /// read-back), slowest device.
    decode_device: Vec<f64>,
}

impl StepLatency {
    fn record(&mut self, report: &StepReport, took: Duration) {
        let ms = took.as_secs_f64() * 1e3;
        self.all.push(ms);
        if report
            .scheduled
            .iter()
            .all(|r| r.kind == RequestKind::Generation)
        {
            self.decode_only.push(ms);
            self.decode_device
                .push(report.timing.device_ns as f64 / 1e6);
        }
    }

    /// `{steps, median, p99}` (nearest rank; `null`s when there were none).
    fn summary(samples: &[f64]) -> serde_json::Value {
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        let rank = |q: f64| {
            let i = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len().max(1)) - 1;
            s.get(i).copied()
        };
        json!({ "steps": s.len(), "median": rank(0.5), "p99": rank(0.99) })
    }
}

async fn run(a: Args) -> Result<serde_json::Value, ServeError> {
    if let Some(preset) = a.model {
        return v4::run(a, v4::V4Source::Preset(preset)).await;
    }
    if a.v4_checkpoint {
        let dir = a.checkpoint.clone().expect("checked: a V4 checkpoint");
        return v4::run(a, v4::V4Source::Checkpoint(dir)).await;
    }
    let config = engine_config(&a)?;
    // The embedder's choice of exporter: here Prometheus text over HTTP.
    let prometheus = match a.metrics_addr {
        Some(addr) => {
            let (recorder, exporter) = metrics_exporter_prometheus::PrometheusBuilder::new()
                .with_http_listener(addr)
                .build()
                .map_err(|e| format!("--metrics-addr {addr}: {e}"))?;
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder)?;
            tokio::spawn(exporter);
            Some(handle)
        }
        None => None,
    };
    let vocab = match (a.source, checkpoint_config(&a)?) {
        (Source::Synthetic, _) => SYNTHETIC_VOCAB,
        (Source::Model, Some(hf)) => hf.vocab as u64,
        (Source::Model, None) => ModelConfig::tiny(MODEL_SEED).vocab as u64,
    };
    let mut rng = Rng {
        g: SplitMix64(a.seed),
        vocab,
    };
    let w = Workload::new(&a, &mut rng);
    let mut model = match a.source {
        Source::Model => Some(ModelSource::new(
            &config,
            a.devices,
            a.checkpoint.as_deref(),
        )?),
        Source::Synthetic => None,
    };
    let mut builder = KvCacheBuilder::new()
        .config(config.clone())
        .host_devices(a.devices);
    builder = match &model {
        Some(m) => builder.forward(m.forward(a.backend, a.cuda_graphs)?),
        None => builder.verification(a.verify.unwrap_or(Verification::Sample)),
    };
    if a.backend == Backend::Cuda {
        let gpus = a.gpus.clone().unwrap_or_else(|| (0..a.devices).collect());
        builder = builder.backend(common::cuda_backend(gpus)?);
    }
    let kv = builder.start().await?;
    #[cfg(feature = "fault-injection")]
    if a.room_faults > 0 {
        kv.inject_room_failures(a.seed ^ 0xfa17, a.room_faults)
            .await?;
    }
    let info = kv.info().clone();
    if !a.json {
        let what = match &model {
            Some(m) => format!("the reference model ({})", m.describe()),
            None => "the synthetic writer".into(),
        };
        eprintln!(
            "dsa-kv serve: {what} through a {} cache ({} B/token), layout {:?}, {} GPU slots ({} tokens), {} host slots, {} device(s){}",
            info.model,
            info.bytes_per_token,
            info.layout,
            info.budget.slots,
            info.budget.tokens,
            info.host_slots,
            info.devices,
            match (info.draft_tokens, info.draft_cache) {
                (0, _) => String::new(),
                (n, true) => format!(", MTP {n} draft tokens (separate draft cache)"),
                (n, false) => format!(", MTP {n} draft tokens"),
            }
        );
    }
    let mut convs: Vec<Conversation> = Vec::new();
    let mut t = 0.0;
    for _ in 0..w.conversations {
        t += rng.exp(w.mean_arrival_steps);
        convs.push(Conversation {
            system: (rng.next() % w.system_prompts.len() as u64) as usize,
            history: Vec::new(),
            turn: 0,
            next_at: t as u64,
            in_flight: None,
        });
    }
    let total_turns = w.conversations * w.turns;
    let mut req_conv: HashMap<RequestId, usize> = HashMap::new();
    let mut next_id = 1u64;
    let mut turns_done = 0usize;
    let mut failed = Vec::new();
    let mut outputs = 0u64;
    let mut mismatches = 0u64;
    let mut latency = StepLatency::default();
    let started = Instant::now();
    let mut step = 0u64;
    // indicatif draws only when stderr is a terminal (never into a log or a pipe).
    let bar = if a.json {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(total_turns as u64)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("[{bar:30}] {percent:>3}% | {msg}")
            .expect("invariant: a valid template")
            .progress_chars("#>-"),
    );
    while turns_done + failed.len() < total_turns {
        // Arrivals due now.
        for (ci, c) in convs.iter_mut().enumerate() {
            if c.in_flight.is_none() && c.turn < w.turns && c.next_at <= step {
                let mut prompt = if c.turn == 0 {
                    w.system_prompts[c.system].clone()
                } else {
                    c.history.clone()
                };
                let n = rng.range(w.user_tokens.0, w.user_tokens.1);
                prompt.extend(rng.tokens(n));
                let id = RequestId(next_id);
                next_id += 1;
                let max_new = rng.range(w.output_tokens.0, w.output_tokens.1) as u32;
                if let Some(m) = &mut model {
                    m.submitted(id, ci, c.turn, &prompt, max_new);
                }
                kv.submit(SubmitRequest {
                    id,
                    scope: ReuseScope::SHARED,
                    prompt,
                    max_new_tokens: max_new,
                    priority: 35,
                })
                .await?;
                c.in_flight = Some(id);
                req_conv.insert(id, ci);
            }
        }
        let mut drafts = HashMap::new();
        if model.is_none() {
            for &id in req_conv.keys() {
                drafts.insert(id, rng.tokens(u64::from(info.draft_tokens)));
            }
        }
        let step_started = Instant::now();
        let mut report = kv.step(drafts).await?;
        let step_took = step_started.elapsed();
        step += 1;
        for (id, why) in &report.failed {
            failed.push((*id, why.clone()));
            if let Some(ci) = req_conv.remove(id) {
                convs[ci].in_flight = None;
                convs[ci].turn = w.turns;
            }
        }
        if !report.scheduled.is_empty() {
            latency.record(&report, step_took);
            // The model samples in its forward and the runtime commits the step; the
            // synthetic writer samples nothing: its tokens are drawn here and committed.
            let commit = match (&mut model, report.committed.take()) {
                (Some(m), Some(commit)) => {
                    m.sampled(&report);
                    commit
                }
                (Some(_), None) => {
                    return Err(format!(
                        "step {}: the model's forward sampled nothing",
                        report.step
                    )
                    .into())
                }
                (None, _) => {
                    let outcomes = report
                        .scheduled
                        .iter()
                        .map(|r| RequestOutcome {
                            id: r.id,
                            accepted_drafts: draft_acceptance(&mut rng, r.num_drafts),
                            next_token: r.produces_token.then(|| rng.token()),
                        })
                        .collect();
                    kv.commit(outcomes).await?
                }
            };
            for f in commit.finished {
                mismatches += f.mismatches.len() as u64;
                outputs += u64::from(f.finished.generated);
                if let Some(ci) = req_conv.remove(&f.finished.id) {
                    let c = &mut convs[ci];
                    // The model's next turn continues what it generated; the synthetic
                    // source's tokens mean nothing, so its history is what has KV.
                    c.history = match &model {
                        Some(m) => m.history(f.finished.id),
                        None => f.finished.tokens,
                    };
                    c.turn += 1;
                    c.in_flight = None;
                    c.next_at = step + rng.exp(w.mean_think_steps) as u64;
                    turns_done += 1;
                }
            }
        }
        bar.set_position((turns_done + failed.len()) as u64);
        bar.set_message(format!(
            "step {step:>6} | turns {turns_done}/{total_turns} | running {:>3} | preempted {:>3}",
            report.scheduled.len(),
            report.preempted.len()
        ));
    }
    let elapsed = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let st = kv.stats().await?;
    // Every step the runtime kept (the last `HISTORY`), for the report and the plot.
    let history = kv.history(0).await?;
    let counts = kv.check_invariants().await?;
    #[cfg(feature = "fault-injection")]
    let room_refusals = kv.inject_room_failures(0, 0).await?;
    #[cfg(not(feature = "fault-injection"))]
    let room_refusals = 0u64;
    kv.shutdown().await;
    let graph_steps = model.as_ref().map_or(0, |m| {
        m.graph_steps.load(std::sync::atomic::Ordering::Relaxed)
    });
    let exactness = match model {
        Some(m) => {
            let failed = failed.clone();
            let progress = !a.json;
            Some(tokio::task::spawn_blocking(move || m.check(&failed, progress)).await?)
        }
        None => None,
    };
    let verify = a.verify.unwrap_or(match a.source {
        Source::Synthetic => Verification::Sample,
        Source::Model => Verification::Off,
    });
    let verified = verify.is_on();
    let integrity_ok = st.mismatches == 0
        && mismatches == 0
        && (st.tokens_verified > 0 || !verified)
        && failed.is_empty()
        && counts.live_sequences == 0
        && exactness.as_ref().is_none_or(|e| e.is_exact());
    let processed = st.scheduler.prefill_tokens + st.scheduler.decode_tokens;
    let mut report = json!({
        "integrity_ok": integrity_ok,
        "source": format!("{:?}", a.source).to_lowercase(),
        "backend": format!("{:?}", a.backend).to_lowercase(),
        "requests": next_id - 1,
        "requests_finished": st.scheduler.finished,
        "requests_failed": failed.len(),
        "conversations": w.conversations,
        "turns": w.turns,
        "steps": st.scheduler.steps,
        "elapsed_s": elapsed,
        "steps_per_s": st.scheduler.steps as f64 / elapsed,
        "generated_tokens": outputs,
        "generated_tokens_per_s": outputs as f64 / elapsed,
        "processed_tokens": processed,
        "processed_tokens_per_s": processed as f64 / elapsed,
        "prefill_tokens": st.scheduler.prefill_tokens,
        "decode_tokens": st.scheduler.decode_tokens,
        "step_latency_note": "ms of kv.step (schedule, copies, forward on every device), steps with work",
        "cuda_graphs": a.cuda_graphs,
        "graph_steps": graph_steps,
        "decode_step_ms": StepLatency::summary(&latency.decode_only),
        "decode_device_ms": StepLatency::summary(&latency.decode_device),
        "step_ms": StepLatency::summary(&latency.all),
        "prefix_hit_rate": st.prefix_hit_rate,
        "rolling_hit_rate": st.rolling_hit_rate,
        "offload_bytes": st.offload_bytes,
        "onboard_bytes": st.onboard_bytes,
        "preemptions": st.scheduler.preemptions,
        "draft_acceptance_rate": st.draft_acceptance_rate,
        "drafts_proposed": st.scheduler.drafts_proposed,
        "drafts_accepted": st.scheduler.drafts_accepted,
        "draft_replays": st.draft_replays,
        "manager_overhead_us_per_step": st.manager_us as f64 / st.scheduler.steps.max(1) as f64,
        "device_us_per_step": st.device_us as f64 / st.scheduler.steps.max(1) as f64,
        "tokens_verified": st.tokens_verified,
        "verified_layers": info.verified_layers,
        "mismatches": st.mismatches,
        "room_faults_percent": a.room_faults,
        "room_refusals_injected": room_refusals,
        "kv_events": st.events,
        "cache_at_end": counts,
        "runtime": info,
        "seed": a.seed,
        "quick": a.quick,
        "verify": verify_name(verify),
    });
    if let Some(e) = &exactness {
        e.add_to(&mut report);
    }
    std::fs::create_dir_all(&a.out)
        .map_err(|e| format!("cannot create {}: {e}", a.out.display()))?;
    let json_path = a.out.join("serve_report.json");
    let mut full = report.clone();
    full["history"] = serde_json::to_value(&history.samples).unwrap_or_default();
    if history.dropped > 0 {
        full["history_dropped"] = json!(history.dropped);
    }
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&full).unwrap_or_default(),
    )
    .map_err(|e| format!("cannot write {}: {e}", json_path.display()))?;
    let svg_path = a.out.join("serve_report.svg");
    std::fs::write(&svg_path, plot::plot(&history.samples, history.dropped)?)
        .map_err(|e| format!("cannot write {}: {e}", svg_path.display()))?;
    if let Some(handle) = &prometheus {
        let path = a.out.join("metrics.prom");
        std::fs::write(&path, handle.render())
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if !a.json {
        summary(&report, &st, exactness.as_ref(), &json_path, &svg_path);
    }
    Ok(report)
}

/// One request of the model source, as submitted and as served.
struct ModelRequest {
    conversation: usize,
    turn: usize,
    /// The whole token history it was submitted with.
    prompt: Vec<u32>,
    max_new: u32,
    /// The tokens the engine sampled for it (device 0's, which every device matched).
    generated: Vec<u32>,
}

/// The reference model on the device actors: it builds their forward (which samples
/// each step's greedy tokens; the runtime commits them), keeps what each request
/// generated, and checks every request, and every position's output the forward
/// recorded, against the model run alone on a contiguous cache.
struct ModelSource {
    model: Arc<Model>,
    format: CacheFormat,
    outputs: Arc<Mutex<Outputs>>,
    devices: usize,
    requests: BTreeMap<RequestId, ModelRequest>,
    /// Steps the GPU model ran as a CUDA graph.
    graph_steps: Arc<std::sync::atomic::AtomicU64>,
}

impl ModelSource {
    /// The model for the target cache `config` describes (its layer count must be the
    /// model's: `Model::new` says which to set otherwise).
    fn new(
        config: &EngineConfig,
        devices: usize,
        checkpoint: Option<&std::path::Path>,
    ) -> Result<Self, ServeError> {
        // As `model::paged::cache_format` reads it from the devices' cache views.
        let format = CacheFormat::of(&config.model.build()?);
        let model = match checkpoint {
            Some(dir) => Model::from_checkpoint(dir, format.clone())?,
            None => Model::new(ModelConfig::tiny(MODEL_SEED), format.clone())?,
        };
        Ok(ModelSource {
            model: Arc::new(model),
            format,
            outputs: Arc::new(Mutex::new(Outputs::default())),
            devices,
            requests: BTreeMap::new(),
            graph_steps: Arc::default(),
        })
    }

    /// The model's forward for the device actors of `backend` (`graphs`: decode-only
    /// steps of the GPU model as a CUDA graph).
    fn forward(&self, backend: Backend, graphs: bool) -> Result<ForwardFactory, ServeError> {
        match backend {
            Backend::Host => Ok(ModelForward::factory(
                self.model.clone(),
                ForwardOptions::default().record(self.outputs.clone()),
            )),
            #[cfg(feature = "cuda")]
            Backend::Cuda => Ok(dsa_kv_model::cuda::CudaModelForward::factory(
                self.model.clone(),
                ForwardOptions::default().record(self.outputs.clone()),
                graphs,
                self.graph_steps.clone(),
            )),
            #[cfg(not(feature = "cuda"))]
            Backend::Cuda => {
                let _ = graphs;
                Err("this build has no CUDA backend: build with the `cuda` feature".into())
            }
        }
    }

    fn describe(&self) -> String {
        let c = self.model.config();
        let what = match self.model.checkpoint() {
            Some(hf) => format!("{:?} checkpoint, ", hf.family),
            None => String::new(),
        };
        format!(
            "{what}{} layers, hidden {}, top-{}, vocabulary {}, {} rows",
            c.layers,
            c.hidden,
            c.topk,
            c.vocab,
            self.format.kv_dtype.name()
        )
    }

    fn submitted(
        &mut self,
        id: RequestId,
        conversation: usize,
        turn: usize,
        prompt: &[TokenId],
        max_new: u32,
    ) {
        self.requests.insert(
            id,
            ModelRequest {
                conversation,
                turn,
                prompt: prompt.iter().map(|t| t.0).collect(),
                max_new,
                generated: Vec::new(),
            },
        );
    }

    /// Keeps the token the step sampled for each request that produced one (every
    /// device sampled the same: the runtime checked).
    fn sampled(&mut self, report: &StepReport) {
        for o in &report.outcomes {
            if let (Some(t), Some(req)) = (o.next_token, self.requests.get_mut(&o.id)) {
                req.generated.push(t.0);
            }
        }
    }

    /// A finished request's prompt and generated tokens: what its conversation's next
    /// turn continues.
    fn history(&self, id: RequestId) -> Vec<TokenId> {
        self.requests.get(&id).map_or_else(Vec::new, |r| {
            r.prompt
                .iter()
                .chain(&r.generated)
                .map(|&t| TokenId(t))
                .collect()
        })
    }

    /// Runs every request alone through `unpaged::generate` (on every core) and compares
    /// its generated tokens, and the output of every position the devices computed.
    fn check(self, failed: &[(RequestId, String)], progress: bool) -> Exactness {
        let started = Instant::now();
        let outputs = std::mem::take(&mut *self.outputs.lock().unwrap_or_else(|e| e.into_inner()));
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, ids.len().max(1));
        if progress {
            eprintln!(
                "exactness: running {} requests alone on an unpaged cache ({threads} threads) ...",
                ids.len()
            );
        }
        let next = AtomicUsize::new(0);
        let verdicts = Mutex::new(BTreeMap::new());
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    while let Some(&id) = ids.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let v = self.check_one(id, &outputs, failed);
                        verdicts
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(id, v);
                    }
                });
            }
        });
        let verdicts = verdicts.into_inner().unwrap_or_else(|e| e.into_inner());
        let sample = self
            .requests
            .iter()
            .filter(|(_, r)| r.conversation == 0)
            .map(|(id, r)| {
                json!({
                    "request": id.0,
                    "turn": r.turn + 1,
                    "prompt_tokens": r.prompt.len(),
                    "generated": r.generated,
                })
            })
            .collect();
        Exactness {
            checked: verdicts.len(),
            exact: verdicts.values().filter(|v| v.is_ok()).count(),
            positions_compared: verdicts.values().filter_map(|v| v.as_ref().ok()).sum(),
            differences: verdicts.into_values().filter_map(Result::err).collect(),
            conflicts: outputs.conflicts,
            threads,
            elapsed_s: started.elapsed().as_secs_f64(),
            sample,
        }
    }

    /// Positions compared, or the first difference.
    fn check_one(
        &self,
        id: RequestId,
        outputs: &Outputs,
        failed: &[(RequestId, String)],
    ) -> Result<u64, String> {
        let r = &self.requests[&id];
        let who = format!(
            "request {id} (conversation {}, turn {})",
            r.conversation,
            r.turn + 1
        );
        if let Some((_, why)) = failed.iter().find(|(f, _)| *f == id) {
            return Err(format!("{who} failed: {why}"));
        }
        let want = generate(&self.model, &self.format, &r.prompt, r.max_new)
            .map_err(|e| format!("{who}: the unpaged run failed: {e}"))?;
        if r.generated != want.tokens {
            let i = r
                .generated
                .iter()
                .zip(&want.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            return Err(format!(
                "{who}: generated token {i} is {:?}, alone on an unpaged cache {:?} ({} \
                 tokens generated, {} wanted)",
                r.generated.get(i),
                want.tokens.get(i),
                r.generated.len(),
                r.max_new
            ));
        }
        // Positions served from the prefix cache never ran for this request; every
        // position that ran, on every device, must give the reference's logits.
        let mut compared = 0;
        for d in 0..self.devices {
            for o in outputs
                .tokens
                .get(&(d, id))
                .into_iter()
                .flat_map(|m| m.values())
            {
                compared += 1;
                if want.outputs.get(o.pos as usize) != Some(o) {
                    return Err(format!(
                        "{who}: device {d}, position {}: {o:?}, alone on an unpaged cache {:?}",
                        o.pos,
                        want.outputs.get(o.pos as usize)
                    ));
                }
            }
        }
        Ok(compared)
    }
}

/// The model run against the model run alone, request by request.
struct Exactness {
    /// Requests compared (every request submitted).
    checked: usize,
    /// Requests whose tokens and logits were all equal.
    exact: usize,
    /// (device, position) outputs compared.
    positions_compared: u64,
    /// One line per request that differs (or failed).
    differences: Vec<String>,
    /// Positions computed twice (after preemption) with different outputs.
    conflicts: Vec<String>,
    threads: usize,
    elapsed_s: f64,
    /// The first conversation's turns.
    sample: Vec<serde_json::Value>,
}

impl Exactness {
    fn is_exact(&self) -> bool {
        self.exact == self.checked && self.conflicts.is_empty()
    }

    fn add_to(&self, report: &mut serde_json::Value) {
        const SHOWN: usize = 10;
        report["exact"] = json!(self.is_exact());
        report["exact_requests"] = json!(self.exact);
        report["checked_requests"] = json!(self.checked);
        report["positions_compared"] = json!(self.positions_compared);
        report["exactness_differences"] =
            json!(&self.differences[..self.differences.len().min(SHOWN)]);
        report["recompute_conflicts"] = json!(&self.conflicts[..self.conflicts.len().min(SHOWN)]);
        report["exactness_check_s"] = json!(self.elapsed_s);
        report["exactness_threads"] = json!(self.threads);
        report["sample"] = json!(self.sample);
    }
}

fn summary(
    r: &serde_json::Value,
    st: &RuntimeStats,
    exactness: Option<&Exactness>,
    json_path: &std::path::Path,
    svg_path: &std::path::Path,
) {
    let num = |k: &str| r[k].as_f64().unwrap_or(0.0);
    let latency = |v: &serde_json::Value| match (v["median"].as_f64(), v["p99"].as_f64()) {
        (Some(m), Some(p)) => format!("{m:.1} / {p:.1} ms ({} steps)", v["steps"]),
        _ => "none".into(),
    };
    let mut rows: Vec<(&str, String)> = vec![
        (
            "requests finished / failed",
            format!("{} / {}", r["requests_finished"], r["requests_failed"]),
        ),
        (
            "steps",
            format!("{} ({:.1} steps/s)", r["steps"], num("steps_per_s")),
        ),
        (
            "generated tokens",
            format!(
                "{} ({:.1} tokens/s)",
                r["generated_tokens"],
                num("generated_tokens_per_s")
            ),
        ),
        (
            "processed tokens (prefill + decode)",
            format!(
                "{} + {} ({:.1} tokens/s)",
                st.scheduler.prefill_tokens,
                st.scheduler.decode_tokens,
                num("processed_tokens_per_s")
            ),
        ),
        (
            "step, decode only: median / p99",
            latency(&r["decode_step_ms"]),
        ),
        ("step, all: median / p99", latency(&r["step_ms"])),
        (
            "  of a decode step, device handler",
            latency(&r["decode_device_ms"]),
        ),
        (
            "decode steps as a CUDA graph",
            format!("{}", r["graph_steps"]),
        ),
        (
            "manager overhead per step",
            format!("{:.1} µs", num("manager_overhead_us_per_step")),
        ),
        (
            "device time per step",
            format!("{:.1} ms", num("device_us_per_step") / 1e3),
        ),
        (
            "prefix hit rate",
            format!("{:.1} %", 100.0 * st.prefix_hit_rate),
        ),
        (
            "offloaded / onboarded",
            format!(
                "{:.1} MiB / {:.1} MiB",
                st.offload_bytes as f64 / 1048576.0,
                st.onboard_bytes as f64 / 1048576.0
            ),
        ),
        ("preemptions", st.scheduler.preemptions.to_string()),
        (
            "KV events stored / removed / moved",
            format!(
                "{} / {} / {}",
                st.events.stored, st.events.removed, st.events.tier_updated
            ),
        ),
    ];
    match exactness {
        Some(e) => rows.extend([
            (
                "exact vs the unpaged model",
                format!("{} of {} requests", e.exact, e.checked),
            ),
            (
                "outputs compared (device × position)",
                e.positions_compared.to_string(),
            ),
            (
                "exactness check",
                format!("{:.1} s on {} threads", e.elapsed_s, e.threads),
            ),
        ]),
        None => rows.extend([
            (
                "draft acceptance",
                format!(
                    "{:.1} % of {}",
                    100.0 * st.draft_acceptance_rate,
                    st.scheduler.drafts_proposed
                ),
            ),
            (
                "position × layer reads verified",
                st.tokens_verified.to_string(),
            ),
            (
                "layers verified",
                verified_layers_text(&r["verified_layers"]),
            ),
        ]),
    }
    rows.push((
        "room requests refused (fault drill)",
        format!(
            "{} ({} %)",
            r["room_refusals_injected"], r["room_faults_percent"]
        ),
    ));
    let ok = r["integrity_ok"].as_bool() == Some(true);
    rows.push((
        "integrity",
        match (exactness, ok) {
            (Some(_), true) => "OK: every request bit-exact".into(),
            (Some(e), false) => format!(
                "FAILED: {} of {} exact, {} failed",
                e.exact, e.checked, r["requests_failed"]
            ),
            (None, true) if r["verify"] == "off" => {
                "OK: no request failed (bytes not read back: --verify off)".into()
            }
            (None, true) => "OK: every byte read back matched".into(),
            (None, false) => format!("FAILED: {} mismatches", st.mismatches),
        },
    ));
    println!("┌{:─<38}┬{:─<40}┐", "", "");
    for (k, v) in rows {
        println!("│ {k:<36} │ {v:<38} │");
    }
    println!("└{:─<38}┴{:─<40}┘", "", "");
    if let Some(e) = exactness {
        println!("conversation 0, as the model continued it (greedy tokens):");
        for s in &e.sample {
            let tokens: Vec<String> = s["generated"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| t.to_string())
                .collect();
            println!(
                "  turn {} (request {}, {}-token prompt) → {}",
                s["turn"],
                s["request"],
                s["prompt_tokens"],
                tokens.join(" ")
            );
        }
        for d in e.differences.iter().chain(&e.conflicts).take(10) {
            println!("  differs: {d}");
        }
    }
    println!(
        "report: {}   plot: {}",
        json_path.display(),
        svg_path.display()
    );
}

fn main() -> ExitCode {
    common::quiet_on_closed_stdout();
    let args = check(Args::parse());
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let json = args.json;
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(report) => {
            if json {
                println!("{report}");
            }
            if report["integrity_ok"].as_bool() == Some(true) {
                ExitCode::SUCCESS
            } else if report["exact"].is_boolean() {
                eprintln!(
                    "exactness check FAILED: {} of {} requests exact, {} failed \
                     (exactness_differences in the report)",
                    report["exact_requests"], report["checked_requests"], report["requests_failed"]
                );
                ExitCode::FAILURE
            } else {
                eprintln!("integrity check FAILED");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// "3 of 61 target, 1 of 1 draft" (from the report's `verified_layers`).
fn verified_layers_text(v: &serde_json::Value) -> String {
    let mut s = format!("{} of {} target", v["target"][0], v["target"][1]);
    if v["draft"].is_array() {
        s += &format!(", {} of {} draft", v["draft"][0], v["draft"][1]);
    }
    s
}
