//! The main job: a seeded synthetic serving workload on the DeepSeek-V3.2 preset through
//! the actor runtime, with the KV read back and checked byte for byte.
//!
//! Multi-turn chats over a few shared system prompts arrive as a Poisson process; the
//! engine loop runs continuous batching with chunked prefill and MTP decoding (random
//! draft acceptance); the pools are small enough that eviction, host offload and
//! preemption happen. Every new token's indexer key and MLA row is generated from its
//! whole prefix (scope and tokens), position and layer, written through the ops, and
//! read back through the block tables after reuse, offload and onboarding, and once
//! more when a request finishes: every position of the request, on the verified layers
//! (`--verify sample`, the default: the first, middle and last layer of each cache;
//! `--verify all`: every layer; `--verify off`: no read-backs, as a framework runs). The report states which (`verified_layers`) and the
//! count of position × layer reads (`tokens_verified`).
//!
//! ```text
//! cargo run --release --example serve -- [--quick] [--json] [--seed N] [--devices N]
//!     [--conversations N] [--turns N] [--verify sample|all|off] [--config FILE.toml|.json|.yaml]
//!     [--out DIR] [--backend host|cuda] [--gpus 0,1,..] [--room-faults PCT]
//! ```
//!
//! `--room-faults PCT` (built with `--features fault-injection`) is a fault drill: that
//! share of GPU-room requests is refused as if the storage could not supply the memory;
//! the run must still finish every request with every byte it reads back matching.
//!
//! `--backend cuda` runs each device actor on a GPU (`--gpus`, default `0..devices`):
//! pools in GPU memory (VMM), the host tier in pinned memory, every write through our
//! CUDA kernels, and verification reads the GPU bytes back.
//!
//! Writes `DIR/serve_report.json` and `DIR/serve_report.svg` (default `target/serve`).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use dsa_kv::actors::{KvCacheBuilder, RuntimeStats};
use dsa_kv::config::{EngineConfig, SpecMode};
use dsa_kv::core::scheduler::{RequestOutcome, SubmitRequest};
use dsa_kv::core::ReuseScope;
use dsa_kv::device::Verification;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::rng::SplitMix64;
use serde_json::json;

const VOCAB: u64 = 129_280;

struct Args {
    quick: bool,
    json: bool,
    seed: u64,
    devices: usize,
    conversations: Option<usize>,
    turns: Option<usize>,
    verify: Verification,
    config: Option<PathBuf>,
    out: PathBuf,
    cuda: bool,
    gpus: Option<Vec<usize>>,
    room_faults: u8,
}

const USAGE: &str =
    "usage: serve [--quick] [--json] [--seed N] [--devices N] [--conversations N] [--turns N] \
[--verify sample|all|off] [--config FILE.toml|.json|.yaml] [--out DIR] [--backend host|cuda] [--gpus 0,1,..] [--room-faults PCT]";

fn parse() -> Result<Args, String> {
    let mut a = Args {
        quick: false,
        json: false,
        seed: 42,
        devices: 1,
        conversations: None,
        turns: None,
        verify: Verification::Sample,
        config: None,
        out: PathBuf::from("target/serve"),
        cuda: false,
        gpus: None,
        room_faults: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(f) = it.next() {
        let mut val = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        let num = |name: &str, v: String| -> Result<u64, String> {
            v.parse()
                .map_err(|_| format!("{name} must be a non-negative integer (got {v:?})"))
        };
        match f.as_str() {
            "--quick" => a.quick = true,
            "--json" => a.json = true,
            "--seed" => a.seed = num("--seed", val("--seed")?)?,
            "--devices" => {
                a.devices = num("--devices", val("--devices")?)? as usize;
                if a.devices == 0 {
                    return Err("--devices must be at least 1".into());
                }
            }
            "--conversations" => {
                a.conversations =
                    Some(num("--conversations", val("--conversations")?)?.max(1) as usize)
            }
            "--turns" => a.turns = Some(num("--turns", val("--turns")?)?.max(1) as usize),
            "--verify" => {
                a.verify = match val("--verify")?.as_str() {
                    "sample" => Verification::Sample,
                    "all" => Verification::All,
                    "off" => Verification::Off,
                    other => {
                        return Err(format!(
                            "--verify must be sample, all or off (got {other:?})"
                        ))
                    }
                }
            }
            "--config" => a.config = Some(PathBuf::from(val("--config")?)),
            "--out" => a.out = PathBuf::from(val("--out")?),
            "--backend" => match val("--backend")?.as_str() {
                "host" => a.cuda = false,
                "cuda" => a.cuda = true,
                other => return Err(format!("--backend must be host or cuda (got {other:?})")),
            },
            "--gpus" => {
                let v = val("--gpus")?;
                let ids: Result<Vec<usize>, _> = v.split(',').map(|x| x.trim().parse()).collect();
                a.gpus = Some(ids.map_err(|_| {
                    format!("--gpus takes comma-separated GPU ordinals like 0,1 (got {v:?})")
                })?);
            }
            "--room-faults" => {
                let v = num("--room-faults", val("--room-faults")?)?;
                if v > 100 {
                    return Err(format!("--room-faults is a percentage, 0 to 100 (got {v})"));
                }
                if !cfg!(feature = "fault-injection") && v > 0 {
                    return Err(
                        "--room-faults needs the fault drills: run with --features fault-injection"
                            .into(),
                    );
                }
                a.room_faults = v as u8;
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if let Some(g) = &a.gpus {
        if !a.cuda {
            return Err("--gpus needs --backend cuda".into());
        }
        a.devices = g.len().max(1);
    }
    Ok(a)
}

/// The crate's generator, with the workload's draws.
struct Rng(SplitMix64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn uniform(&mut self) -> f64 {
        self.0.uniform()
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.0.range(lo, hi)
    }
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.uniform()).ln()
    }
    fn tokens(&mut self, n: u64) -> Vec<TokenId> {
        (0..n)
            .map(|_| TokenId((self.next() % VOCAB) as u32))
            .collect()
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

struct Conversation {
    system: usize,
    history: Vec<TokenId>,
    turn: usize,
    next_at: u64,
    in_flight: Option<RequestId>,
}

fn engine_config(a: &Args) -> Result<EngineConfig, String> {
    let mut c = match &a.config {
        Some(p) => EngineConfig::from_file(p).map_err(|e| e.to_string())?,
        None => {
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
    };
    if a.config.is_none() {
        // Small enough that eviction, offload and preemption happen.
        let (gpu_tokens, host_tokens) = if a.quick {
            (2_304u64, 2_048u64)
        } else {
            (6_144, 4_096)
        };
        c.kv_cache.max_tokens = Some(gpu_tokens);
        c.kv_cache.host_cache_size = Some(host_tokens / 64 * 2_764_032);
    }
    c.parallel.tp_size = a.devices as u32;
    Ok(c)
}

fn draft_acceptance(rng: &mut Rng, drafts: u32) -> u32 {
    // Each draft is accepted with probability 0.7, until the first rejection.
    (0..drafts).take_while(|_| rng.uniform() < 0.7).count() as u32
}

/// What `serve` can fail with: the runtime's typed errors, or a message of its own
/// (configuration file, report files).
type ServeError = Box<dyn std::error::Error + Send + Sync>;

async fn run(a: Args) -> Result<serde_json::Value, ServeError> {
    let config = engine_config(&a)?;
    let mut rng = Rng(SplitMix64(a.seed));
    let w = Workload {
        conversations: a.conversations.unwrap_or(if a.quick { 20 } else { 64 }),
        turns: a.turns.unwrap_or(if a.quick { 2 } else { 3 }),
        system_prompts: (0..3)
            .map(|i| rng.tokens(if a.quick { 300 } else { 600 } + 200 * i))
            .collect(),
        user_tokens: if a.quick { (40, 200) } else { (60, 400) },
        output_tokens: if a.quick { (16, 64) } else { (32, 160) },
        mean_arrival_steps: if a.quick { 1.0 } else { 4.0 },
        mean_think_steps: 6.0,
    };
    let mut builder = KvCacheBuilder::new()
        .config(config.clone())
        .host_devices(a.devices)
        .verification(a.verify);
    if a.cuda {
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
        eprintln!(
            "dsa-kv serve: {} ({} B/token), layout {:?}, {} GPU slots ({} tokens), {} host slots, {} device(s), MTP {} draft tokens{}",
            info.model,
            info.bytes_per_token,
            info.layout,
            info.budget.slots,
            info.budget.tokens,
            info.host_slots,
            info.devices,
            info.draft_tokens,
            if info.draft_cache { " (separate draft cache)" } else { "" }
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
    let started = Instant::now();
    let mut step = 0u64;
    let mut last_progress = Instant::now();
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
        for &id in req_conv.keys() {
            drafts.insert(id, rng.tokens(u64::from(info.draft_tokens)));
        }
        let report = kv.step(drafts).await?;
        step += 1;
        for (id, why) in &report.failed {
            failed.push((*id, why.clone()));
            if let Some(ci) = req_conv.remove(id) {
                convs[ci].in_flight = None;
                convs[ci].turn = w.turns;
            }
        }
        if !report.scheduled.is_empty() {
            let outcomes = report
                .scheduled
                .iter()
                .map(|r| RequestOutcome {
                    id: r.id,
                    accepted_drafts: draft_acceptance(&mut rng, r.num_drafts),
                    next_token: r
                        .produces_token
                        .then(|| TokenId((rng.next() % VOCAB) as u32)),
                })
                .collect();
            let commit = kv.commit(outcomes).await?;
            for f in commit.finished {
                mismatches += f.mismatches.len() as u64;
                outputs += u64::from(f.finished.generated);
                if let Some(ci) = req_conv.remove(&f.finished.id) {
                    let c = &mut convs[ci];
                    c.history = f.finished.tokens;
                    c.turn += 1;
                    c.in_flight = None;
                    c.next_at = step + rng.exp(w.mean_think_steps) as u64;
                    turns_done += 1;
                }
            }
        }
        if !a.json && (last_progress.elapsed().as_millis() >= 250 || turns_done == total_turns) {
            last_progress = Instant::now();
            let done = (turns_done + failed.len()) as f64 / total_turns as f64;
            let bar = (done * 30.0) as usize;
            eprint!(
                "\r[{}{}] {:>5.1}% | step {:>6} | turns {}/{} | running {:>3} | preempted {:>3}   ",
                "#".repeat(bar),
                " ".repeat(30 - bar),
                100.0 * done,
                step,
                turns_done,
                total_turns,
                report.scheduled.len(),
                report.preempted.len()
            );
            let _ = std::io::stderr().flush();
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    if !a.json {
        eprintln!();
    }
    let st = kv.stats().await?;
    let counts = kv.check_invariants().await?;
    #[cfg(feature = "fault-injection")]
    let room_refusals = kv.inject_room_failures(0, 0).await?;
    #[cfg(not(feature = "fault-injection"))]
    let room_refusals = 0u64;
    kv.shutdown().await;
    let verified = a.verify != Verification::Off;
    let integrity_ok = st.mismatches == 0
        && mismatches == 0
        && (st.tokens_verified > 0 || !verified)
        && failed.is_empty()
        && counts.live_sequences == 0;
    let report = json!({
        "integrity_ok": integrity_ok,
        "backend": if a.cuda { "cuda" } else { "host" },
        "requests_finished": st.finished,
        "requests_failed": failed.len(),
        "conversations": w.conversations,
        "turns": w.turns,
        "steps": st.steps,
        "elapsed_s": elapsed,
        "steps_per_s": st.steps as f64 / elapsed,
        "prefill_tokens": st.prefill_tokens,
        "decode_tokens": st.decode_tokens,
        "output_tokens": outputs,
        "prefix_hit_rate": st.prefix_hit_rate,
        "rolling_hit_rate": st.rolling_hit_rate,
        "offload_bytes": st.offload_bytes,
        "onboard_bytes": st.onboard_bytes,
        "preemptions": st.preemptions,
        "draft_acceptance_rate": st.draft_acceptance_rate,
        "drafts_proposed": st.drafts_proposed,
        "drafts_accepted": st.drafts_accepted,
        "draft_replays": st.draft_replays,
        "manager_overhead_us_per_step": st.manager_us as f64 / st.steps.max(1) as f64,
        "device_us_per_step": st.device_us as f64 / st.steps.max(1) as f64,
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
        "verify": format!("{:?}", a.verify).to_lowercase(),
    });
    std::fs::create_dir_all(&a.out)
        .map_err(|e| format!("cannot create {}: {e}", a.out.display()))?;
    let json_path = a.out.join("serve_report.json");
    let mut full = report.clone();
    full["history"] = serde_json::to_value(&st.history).unwrap_or_default();
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&full).unwrap_or_default(),
    )
    .map_err(|e| format!("cannot write {}: {e}", json_path.display()))?;
    let svg_path = a.out.join("serve_report.svg");
    std::fs::write(&svg_path, plot(&st))
        .map_err(|e| format!("cannot write {}: {e}", svg_path.display()))?;
    if !a.json {
        summary(&report, &st, &json_path, &svg_path);
    }
    Ok(report)
}

fn summary(
    r: &serde_json::Value,
    st: &RuntimeStats,
    json_path: &std::path::Path,
    svg_path: &std::path::Path,
) {
    let rows: BTreeMap<usize, (&str, String)> = [
        (
            "requests finished / failed",
            format!("{} / {}", r["requests_finished"], r["requests_failed"]),
        ),
        (
            "steps",
            format!(
                "{} ({:.1} steps/s)",
                r["steps"],
                r["steps_per_s"].as_f64().unwrap_or(0.0)
            ),
        ),
        (
            "tokens prefilled / decoded",
            format!("{} / {}", st.prefill_tokens, st.decode_tokens),
        ),
        (
            "manager overhead per step",
            format!(
                "{:.1} µs",
                r["manager_overhead_us_per_step"].as_f64().unwrap_or(0.0)
            ),
        ),
        (
            "device time per step",
            format!("{:.1} µs", r["device_us_per_step"].as_f64().unwrap_or(0.0)),
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
        ("preemptions", st.preemptions.to_string()),
        (
            "draft acceptance",
            format!(
                "{:.1} % of {}",
                100.0 * st.draft_acceptance_rate,
                st.drafts_proposed
            ),
        ),
        (
            "KV events stored / removed / moved",
            format!(
                "{} / {} / {}",
                st.events.stored, st.events.removed, st.events.tier_updated
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
        (
            "room requests refused (fault drill)",
            format!(
                "{} ({} %)",
                r["room_refusals_injected"], r["room_faults_percent"]
            ),
        ),
        (
            "integrity",
            if r["integrity_ok"].as_bool() == Some(true) && r["verify"] == "off" {
                "OK: no request failed (bytes not read back: --verify off)".into()
            } else if r["integrity_ok"].as_bool() == Some(true) {
                "OK: every byte read back matched".into()
            } else {
                format!("FAILED: {} mismatches", st.mismatches)
            },
        ),
    ]
    .into_iter()
    .enumerate()
    .collect();
    println!("┌{:─<38}┬{:─<40}┐", "", "");
    for (_, (k, v)) in rows {
        println!("│ {k:<36} │ {v:<38} │");
    }
    println!("└{:─<38}┴{:─<40}┘", "", "");
    println!(
        "report: {}   plot: {}",
        json_path.display(),
        svg_path.display()
    );
}

/// An SVG of GPU utilization and the rolling prefix hit rate over steps.
fn plot(st: &RuntimeStats) -> String {
    let (w, h, pad) = (900.0, 320.0, 40.0);
    let n = st.history.len().max(2) as f64;
    let x = |i: usize| pad + (w - 2.0 * pad) * i as f64 / (n - 1.0);
    let y = |v: f64| h - pad - (h - 2.0 * pad) * v.clamp(0.0, 1.0);
    let line = |f: &dyn Fn(usize) -> f64| -> String {
        st.history
            .iter()
            .enumerate()
            .map(|(i, _)| format!("{:.1},{:.1}", x(i), y(f(i))))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let util = line(&|i| st.history[i].gpu_utilization);
    let host = line(&|i| st.history[i].host_utilization);
    let hit = line(&|i| st.history[i].rolling_hit_rate);
    format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{pad}" y="20">dsa-kv serve: GPU / host utilization and rolling prefix hit rate over {steps} steps</text>
<line x1="{pad}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{b}" stroke="black"/>
<text x="8" y="{t}">1.0</text><text x="8" y="{b}">0.0</text><text x="{r}" y="{lb}" text-anchor="end">step</text>
<polyline fill="none" stroke="#d62728" stroke-width="1.2" points="{util}"/>
<polyline fill="none" stroke="#ff7f0e" stroke-width="1" stroke-dasharray="4 2" points="{host}"/>
<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{hit}"/>
<text x="{l1}" y="36" fill="#d62728">GPU utilization</text><text x="{l2}" y="36" fill="#ff7f0e">host utilization</text><text x="{l3}" y="36" fill="#1f77b4">rolling hit rate</text>
</svg>
"##,
        steps = st.history.len(),
        b = h - pad,
        r = w - pad,
        t = pad + 4.0,
        lb = h - 10.0,
        l1 = pad + 10.0,
        l2 = pad + 150.0,
        l3 = pad + 290.0,
    )
}

fn main() -> ExitCode {
    common::quiet_on_closed_stdout();
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
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
