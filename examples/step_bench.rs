//! Our whole 256-request MTP decode step through the actors, timed per step, as JSON
//! lines: the variant `actors_one_device_engine_task_commit_and_step` of
//! `benches/runtime.rs` (same requests, drafts, outcomes, config and no-op device:
//! `benches/common/step256.rs`), on its own so that `benches/vllm_step/run.py` can run it
//! interleaved with vLLM's per-step allocation loop (`benches/vllm_step/vllm_alloc.py`).
//!
//! One step = one `KvCacheHandle::commit_and_step` call made by the engine loop, a task of
//! a 2-worker tokio runtime: commit of the step in flight (1 draft accepted + 1 sampled
//! token per request), scheduling of the next (256 requests × (1 + 3 drafts), pages
//! for them and the MTP lookahead, the plan with its block tables), the plan to the
//! device actor and its acknowledgement back, the report to the caller. Inputs (the
//! drafts map, the outcomes) are built before the clock starts.
//!
//! Each round starts a fresh runtime, settles 256 decoding requests (untimed) and times
//! `--steps` steps, rebuilding the state (untimed) every 100 steps as the bench does:
//!
//! ```text
//! cargo run --release --example step_bench -- --steps 100 --rounds 5
//! ```
//!
//! With `--serve` it stays up, prints `{"ready":true}` and answers each line of stdin with
//! one JSON line: `build` starts a fresh state (untimed), `steps N` times N more steps on
//! it (`run.py` alternates small chunks of steps with vLLM's side this way).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use dsa_kv::actors::{KvCacheBuilder, KvCacheHandle, StepReport, StepTiming};
use dsa_kv::device::DeviceBackend;
use dsa_kv::ids::{RequestId, TokenId};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

#[path = "../benches/common/step256.rs"]
mod step256;
use step256::{config, drafts, outcomes, settle, NullDevice, REBUILD, SEQS};

#[derive(Parser)]
#[command(about = "Per-step time of the 256-request MTP step through the actors, as JSON")]
struct Args {
    /// Timed steps per round.
    #[arg(long, default_value_t = 100)]
    steps: u64,
    /// Rounds, each from a fresh runtime.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Worker threads of the tokio runtime (the bench uses 2).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// `KvCacheBuilder::idle_spin` in µs (0, the default: off; the bench's `_spin`
    /// variants use 500).
    #[arg(long, default_value_t = 0)]
    idle_spin_us: u64,
    /// Stay up: run `--rounds` rounds (one JSON line) for every line read on stdin, until
    /// it closes (how `run.py` interleaves the two sides without a process start a round).
    #[arg(long)]
    serve: bool,
}

/// A runtime on the no-op device with the 256 requests decoding, and the step in flight.
struct Engine {
    kv: KvCacheHandle,
    rep: StepReport,
    drafts: std::collections::HashMap<RequestId, Vec<TokenId>>,
}

impl Engine {
    async fn start(spin: Duration) -> Self {
        let kv = KvCacheBuilder::new()
            .idle_spin(spin)
            .config(config())
            .backend(Arc::new(|i, _| {
                Ok(Box::new(NullDevice(i)) as Box<dyn DeviceBackend>)
            }))
            .start()
            .await
            .unwrap();
        let kv = settle(kv).await;
        let drafts = drafts();
        let rep = kv.step(drafts.clone()).await.unwrap();
        Self { kv, rep, drafts }
    }

    /// `n` timed `commit_and_step` calls: each step's wall time (ns) and timing.
    async fn steps(&mut self, n: u64, walls: &mut Vec<u64>, timings: &mut Vec<StepTiming>) {
        for _ in 0..n {
            let drafts = self.drafts.clone();
            let outs = outcomes(self.rep.scheduled.iter().map(|r| (r.id, r.num_drafts)));
            let t = Instant::now();
            let r = self.kv.commit_and_step(outs, drafts).await.unwrap();
            walls.push(t.elapsed().as_nanos() as u64);
            self.rep = r.step.unwrap();
            assert_eq!(self.rep.scheduled.len(), SEQS as usize);
            timings.push(self.rep.timing);
        }
    }
}

/// `steps` timed steps from a fresh state, rebuilt (untimed) every `REBUILD` steps.
async fn round(steps: u64, spin: Duration) -> (Vec<u64>, Vec<StepTiming>) {
    let (mut walls, mut timings) = (vec![], vec![]);
    let mut e = Engine::start(spin).await;
    let mut done = 0;
    while done < steps {
        if done > 0 && done % REBUILD == 0 {
            e.kv.shutdown().await;
            e = Engine::start(spin).await;
        }
        let n = (steps - done).min(REBUILD - done % REBUILD);
        e.steps(n, &mut walls, &mut timings).await;
        done += n;
    }
    e.kv.shutdown().await;
    (walls, timings)
}

/// `--serve`'s requests: `None` for `build`, `Some(n)` for `steps n`.
type Request = (Option<u64>, oneshot::Sender<Value>);

/// The engine loop of `--serve`: one task of the runtime owns the state across requests.
async fn serve(mut rx: mpsc::Receiver<Request>, spin: Duration) {
    let mut engine: Option<Engine> = None;
    while let Some((cmd, reply)) = rx.recv().await {
        let out = match cmd {
            None => {
                if let Some(e) = engine.take() {
                    e.kv.shutdown().await;
                }
                engine = Some(Engine::start(spin).await);
                json!({ "built": true })
            }
            Some(n) => {
                let e = engine.as_mut().expect("`build` before `steps`");
                let (mut walls, mut timings) = (vec![], vec![]);
                e.steps(n, &mut walls, &mut timings).await;
                json!({
                    "step_ns": walls,
                    "timing_ns": timings.iter().map(timing_ns).collect::<Vec<_>>(),
                })
            }
        };
        let _ = reply.send(out);
    }
    if let Some(e) = engine {
        e.kv.shutdown().await;
    }
}

/// A step's intervals, by name (ns).
fn timing_ns(t: &StepTiming) -> Value {
    json!({
        "to_coordinator": t.to_coordinator_ns,
        "commit": t.commit_ns,
        "schedule": t.schedule_ns,
        "enqueue": t.enqueue_ns,
        "to_device": t.to_device_ns,
        "device": t.device_ns,
        "from_device": t.from_device_ns,
        "overlapped": t.overlapped_ns,
        "finish": t.finish_ns,
        "to_caller": t.to_caller_ns,
    })
}

fn median(v: &[u64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0) as f64
}

fn mean(v: &[u64]) -> f64 {
    v.iter().sum::<u64>() as f64 / v.len().max(1) as f64
}

/// One round's JSON: its steps' wall times and the medians of their timings.
fn round_json(walls: &[u64], timings: &[StepTiming]) -> Value {
    let field =
        |f: fn(&StepTiming) -> u64| median(&timings.iter().map(f).collect::<Vec<_>>()) / 1e3;
    json!({
        "median_us": median(walls) / 1e3,
        "mean_us": mean(walls) / 1e3,
        "step_ns": walls,
        "timing_medians_us": {
            "to_coordinator": field(|t| t.to_coordinator_ns),
            "commit": field(|t| t.commit_ns),
            "schedule": field(|t| t.schedule_ns),
            "enqueue": field(|t| t.enqueue_ns),
            "to_device": field(|t| t.to_device_ns),
            "device": field(|t| t.device_ns),
            "from_device": field(|t| t.from_device_ns),
            "overlapped": field(|t| t.overlapped_ns),
            "finish": field(|t| t.finish_ns),
            "to_caller": field(|t| t.to_caller_ns),
        },
    })
}

/// `rounds` rounds of `steps` steps, as one JSON line.
fn run(rt: &tokio::runtime::Runtime, steps: u64, rounds: usize, spin: Duration) -> Value {
    let mut out = vec![];
    let mut all = vec![];
    for _ in 0..rounds {
        // The engine loop is a task of the runtime, as in the bench's variant.
        let (walls, timings) = rt.block_on(async move {
            tokio::spawn(async move { round(steps, spin).await })
                .await
                .unwrap()
        });
        out.push(round_json(&walls, &timings));
        all.extend(walls);
    }
    json!({
        "side": "dsa-kv",
        "what": "KvCacheHandle::commit_and_step from an engine-loop task, no-op device",
        "idle_spin_us": spin.as_micros() as u64,
        "requests": SEQS,
        "drafts": 3,
        "steps": steps,
        "rounds": out,
        "median_us": median(&all) / 1e3,
        "mean_us": mean(&all) / 1e3,
    })
}

fn main() {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.workers)
        .enable_all()
        .build()
        .unwrap();
    let spin = Duration::from_micros(args.idle_spin_us);
    if !args.serve {
        println!("{}", run(&rt, args.steps, args.rounds, spin));
        return;
    }
    let (tx, rx) = mpsc::channel::<Request>(1);
    let engine_loop = rt.spawn(serve(rx, spin));
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", json!({ "ready": true })).unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lines() {
        let line = line.unwrap();
        let cmd = match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["build"] => None,
            ["steps", n] => Some(n.parse().expect("steps N")),
            _ => panic!("unknown request {line:?}: `build` or `steps N`"),
        };
        let (reply, answer) = oneshot::channel();
        let value = rt.block_on(async {
            tx.send((cmd, reply)).await.unwrap();
            answer.await.unwrap()
        });
        writeln!(out, "{value}").unwrap();
        out.flush().unwrap();
    }
    drop(tx);
    rt.block_on(engine_loop).unwrap();
}
