//! One scheduling step of 256 decoding sequences (1 + 3 draft tokens each) through the
//! actor runtime, against the same step on the bare scheduler: the price of the actors.
//! Devices are a no-op backend so that only the runtime's own work is measured. Both
//! sides get the same inputs prepared outside the timed region. The runtime is driven
//! from a thread outside tokio (`block_on`) and from a task of the runtime, each with
//! `step` + `commit` and with `commit_and_step`.
//! Results and the command: BENCHMARKS.md.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use dsa_kv::actors::{KvCacheBuilder, KvCacheHandle, StepTiming};
use dsa_kv::config::{DsaModel, LayerSet};
use dsa_kv::core::scheduler::{Scheduler, SchedulerLimits};
use dsa_kv::core::{KvCacheManager, ManagerOptions, TierSlots};
use dsa_kv::device::{Batch, DeviceBackend, Forward, ForwardError, ForwardSetup, Sampling};
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::layout::{LayoutKind, PoolPlan};

// The requests, drafts, outcomes, engine config and no-op device, shared with
// `examples/step_bench.rs` (the side-by-side run against vLLM, benches/vllm_step/).
#[path = "common/step256.rs"]
mod step256;
use step256::{config, drafts, outcomes, requests, settle, NullDevice, REBUILD, SEQS};

fn bare() -> Scheduler {
    let plan = PoolPlan::for_model(
        &DsaModel::deepseek_v32(),
        LayerSet::TargetAndMtp,
        LayoutKind::V2,
        64,
    )
    .unwrap();
    let m = KvCacheManager::new(
        plan,
        TierSlots {
            gpu: vec![190_000],
            host: vec![],
        },
        ManagerOptions::default(),
    )
    .unwrap();
    let mut s = Scheduler::new(
        m,
        None,
        SchedulerLimits {
            max_num_sequences: 256,
            max_num_tokens: 8192,
            max_prefill_chunk: 8192,
            max_seq_len: 1_000_000,
            draft_tokens: 3,
            livelock_steps: 1000,
            max_context_kv_tokens: 1 << 20,
            transfer_lease: std::time::Duration::from_secs(30),
        },
    );
    for r in requests() {
        s.submit(r).unwrap();
    }
    // Prefill everything.
    while s.stats().prefill_tokens
        < requests()
            .iter()
            .map(|r| r.prompt.len() as u64)
            .sum::<u64>()
    {
        let p = s.schedule(&HashMap::new()).unwrap();
        s.complete(p.target_fence, p.draft_fence).unwrap();
        s.commit(&outcomes(p.requests.iter().map(|r| (r.id, r.num_drafts))))
            .unwrap();
    }
    s
}

/// The device behind the runtime.
#[derive(Clone, Copy)]
enum Dev {
    /// A backend that only acknowledges: the runtime's own cost.
    Null,
    /// The same with `idle_spin`: device thread and coordinator poll instead of parking.
    NullSpin,
    /// The host backend with a forward that does nothing: adds what a device does for
    /// any forward (copies, the step metadata for 256 requests, the batch view). One
    /// target layer (+ MTP) so the pools stay small; the metadata does not depend on it.
    HostNoopForward,
    /// The same with `idle_spin`.
    HostNoopForwardSpin,
}

/// `idle_spin` of the spinning variants: above the host time between two steps.
const SPIN: Duration = Duration::from_micros(500);

struct NoopForward;

impl Forward for NoopForward {
    fn forward(&mut self, _: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        Ok(Sampling::ByEngine)
    }
}

async fn runtime(dev: Dev) -> KvCacheHandle {
    let b = KvCacheBuilder::new();
    let b = match dev {
        Dev::NullSpin | Dev::HostNoopForwardSpin => b.idle_spin(SPIN),
        Dev::Null | Dev::HostNoopForward => b,
    };
    let b = match dev {
        Dev::Null | Dev::NullSpin => b.config(config()).backend(Arc::new(|i, _| {
            Ok(Box::new(NullDevice(i)) as Box<dyn DeviceBackend>)
        })),
        Dev::HostNoopForward | Dev::HostNoopForwardSpin => {
            let mut c = config();
            c.model.num_layers = Some(1);
            c.kv_cache.max_tokens = Some(1_000_000);
            b.config(c).forward(Arc::new(|_: &ForwardSetup<'_>| {
                Ok(Box::new(NoopForward) as Box<dyn Forward>)
            }))
        }
    };
    settle(b.start().await.unwrap()).await
}

/// `iters` steps through the handle, timed as the bare scheduler is: inputs (the drafts
/// map, which `step` takes by value) are prepared before the clock starts, and the
/// report is dropped after it stops.
async fn actor_steps(iters: u64, d: HashMap<RequestId, Vec<TokenId>>, dev: Dev) -> Duration {
    let mut total = Duration::ZERO;
    let mut kv = runtime(dev).await;
    for i in 0..iters {
        if i > 0 && i % REBUILD == 0 {
            kv.shutdown().await;
            kv = runtime(dev).await;
        }
        let drafts = d.clone();
        let t = Instant::now();
        let rep = kv.step(drafts).await.unwrap();
        kv.commit(outcomes(rep.scheduled.iter().map(|r| (r.id, r.num_drafts))))
            .await
            .unwrap();
        total += t.elapsed();
        assert_eq!(rep.scheduled.len(), SEQS as usize);
    }
    kv.shutdown().await;
    total
}

/// The same steps through `commit_and_step`: each timed call commits the step in flight
/// and runs the next one (one round trip instead of two).
async fn actor_steps_combined(
    iters: u64,
    d: HashMap<RequestId, Vec<TokenId>>,
    dev: Dev,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut kv = runtime(dev).await;
    let mut rep = kv.step(d.clone()).await.unwrap();
    for i in 0..iters {
        if i > 0 && i % REBUILD == 0 {
            kv.shutdown().await;
            kv = runtime(dev).await;
            rep = kv.step(d.clone()).await.unwrap();
        }
        let drafts = d.clone();
        let t = Instant::now();
        let r = kv
            .commit_and_step(
                outcomes(rep.scheduled.iter().map(|r| (r.id, r.num_drafts))),
                drafts,
            )
            .await
            .unwrap();
        total += t.elapsed();
        rep = r.step.unwrap();
        assert_eq!(rep.scheduled.len(), SEQS as usize);
    }
    kv.shutdown().await;
    total
}

fn step(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduling_step_256_seqs_3_drafts");
    g.throughput(Throughput::Elements(SEQS));
    let d = drafts();
    g.bench_function("bare_scheduler", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut s = bare();
            for i in 0..iters {
                if i > 0 && i % REBUILD == 0 {
                    s = bare();
                }
                let t = Instant::now();
                let p = s.schedule(&d).unwrap();
                s.complete(p.target_fence, p.draft_fence).unwrap();
                s.commit(&outcomes(p.requests.iter().map(|r| (r.id, r.num_drafts))))
                    .unwrap();
                let n = p.requests.len();
                // The plan's buffers serve the next step (as the coordinator does).
                s.recycle(p);
                total += t.elapsed();
                assert_eq!(n, SEQS as usize);
            }
            total
        })
    });
    // The same loop owning its input as the runtime does: the drafts map is cloned
    // before the clock starts (as for the actors) and freed inside it (the coordinator
    // frees it within the step).
    g.bench_function("bare_scheduler_owning_drafts", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut s = bare();
            for i in 0..iters {
                if i > 0 && i % REBUILD == 0 {
                    s = bare();
                }
                let drafts = d.clone();
                let t = Instant::now();
                let p = s.schedule(&drafts).unwrap();
                drop(drafts);
                s.complete(p.target_fence, p.draft_fence).unwrap();
                s.commit(&outcomes(p.requests.iter().map(|r| (r.id, r.num_drafts))))
                    .unwrap();
                let n = p.requests.len();
                s.recycle(p);
                total += t.elapsed();
                assert_eq!(n, SEQS as usize);
            }
            total
        })
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The engine loop calls the handle from a thread outside the runtime (`block_on`):
    // every message to the coordinator and every reply crosses threads.
    g.bench_function("actors_one_device", |b| {
        b.iter_custom(|iters| rt.block_on(actor_steps(iters, d.clone(), Dev::Null)))
    });
    g.bench_function("actors_one_device_commit_and_step", |b| {
        b.iter_custom(|iters| rt.block_on(actor_steps_combined(iters, d.clone(), Dev::Null)))
    });
    // The engine loop is a task of the runtime: the coordinator runs on the caller's
    // worker, so only the device actor's thread is crossed. The `_spin` variants set
    // `idle_spin`: the device thread and the coordinator poll instead of parking. The host
    // backend with a no-op forward adds a device's own work per step (step metadata for
    // 256 requests × 4 tokens, the batch view).
    for (name, combined, dev) in [
        ("actors_one_device_engine_task", false, Dev::Null),
        (
            "actors_one_device_engine_task_commit_and_step",
            true,
            Dev::Null,
        ),
        ("actors_one_device_engine_task_spin", false, Dev::NullSpin),
        (
            "actors_one_device_engine_task_commit_and_step_spin",
            true,
            Dev::NullSpin,
        ),
        (
            "host_device_noop_forward_engine_task_commit_and_step",
            true,
            Dev::HostNoopForward,
        ),
        (
            "host_device_noop_forward_engine_task_commit_and_step_spin",
            true,
            Dev::HostNoopForwardSpin,
        ),
    ] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let d = d.clone();
                    tokio::spawn(async move {
                        if combined {
                            actor_steps_combined(iters, d, dev).await
                        } else {
                            actor_steps(iters, d, dev).await
                        }
                    })
                    .await
                    .unwrap()
                })
            })
        });
    }
    g.finish();
}

/// Median of `v` (sorted in place).
fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// Where a step's time goes, robust to a noisy host: `ROUNDS` rounds, each running
/// `REBUILD` steps of every variant from a fresh state one after the other (so slow
/// drifts of the host hit all variants alike), all from a task of the same runtime.
/// Prints each variant's median and mean step and, through the runtime, the medians of
/// [`StepTiming`]'s intervals. Printed, not a criterion measurement.
fn breakdown(_: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let variants: [(&str, Option<Dev>); 7] = [
        ("bare_scheduler", None),
        ("bare_scheduler_owning_drafts", None),
        ("bare_scheduler_on_a_runtime_task", None),
        (
            "actors_one_device_engine_task_commit_and_step",
            Some(Dev::Null),
        ),
        (
            "actors_one_device_engine_task_commit_and_step_spin",
            Some(Dev::NullSpin),
        ),
        (
            "host_device_noop_forward_engine_task_commit_and_step",
            Some(Dev::HostNoopForward),
        ),
        (
            "host_device_noop_forward_engine_task_commit_and_step_spin",
            Some(Dev::HostNoopForwardSpin),
        ),
    ];
    // The host-device variants allocate and free their pools every round, which evicts
    // everything from the caches: they are interleaved among themselves, after the rest.
    let (light, heavy) = variants.split_at(5);
    interleave(&rt, light);
    interleave(&rt, heavy);
}

/// Runs `ROUNDS` rounds of `REBUILD` steps of every variant, one after the other, and
/// prints the medians (against the first variant's) and means.
fn interleave(rt: &tokio::runtime::Runtime, variants: &[(&str, Option<Dev>)]) {
    const ROUNDS: usize = 30;
    let mut walls: Vec<Vec<u64>> = vec![vec![]; variants.len()];
    let mut timings: Vec<Vec<StepTiming>> = vec![vec![]; variants.len()];
    let d = drafts();
    for _ in 0..ROUNDS {
        for (v, (name, dev)) in variants.iter().enumerate() {
            let d = d.clone();
            let dev = *dev;
            let owning = name.ends_with("owning_drafts");
            // The bare scheduler runs on the bench's thread (as in `bare_scheduler`)
            // unless named otherwise; the runtime's engine loop is a task.
            let (w, t) = if dev.is_none() && !name.ends_with("on_a_runtime_task") {
                rt.block_on(round(dev, d, owning))
            } else {
                rt.block_on(async move {
                    tokio::spawn(async move { round(dev, d, owning).await })
                        .await
                        .unwrap()
                })
            };
            walls[v].extend(w);
            timings[v].extend(t);
        }
    }
    let base = median(&mut walls[0].clone());
    for (v, (name, _)) in variants.iter().enumerate() {
        let w = &mut walls[v];
        let mean = w.iter().sum::<u64>() as f64 / w.len().max(1) as f64 / 1e3;
        let med = median(w);
        print!(
            "breakdown {name}: median {:.1} µs ({:+.1} µs), mean {mean:.1} µs",
            med as f64 / 1e3,
            (med as f64 - base as f64) / 1e3
        );
        let t = &timings[v];
        if t.is_empty() {
            println!();
            continue;
        }
        let field = |f: fn(&StepTiming) -> u64| {
            let mut x: Vec<u64> = t.iter().map(f).collect();
            median(&mut x) as f64 / 1e3
        };
        println!(
            "; medians: to_coordinator {:.1}, commit {:.1}, schedule {:.1}, enqueue {:.1}, \
             to_device {:.1}, device {:.1}, from_device {:.1} (overlapped {:.1}), finish {:.1}, \
             to_caller {:.1}",
            field(|t| t.to_coordinator_ns),
            field(|t| t.commit_ns),
            field(|t| t.schedule_ns),
            field(|t| t.enqueue_ns),
            field(|t| t.to_device_ns),
            field(|t| t.device_ns),
            field(|t| t.from_device_ns),
            field(|t| t.overlapped_ns),
            field(|t| t.finish_ns),
            field(|t| t.to_caller_ns),
        );
    }
}

/// `REBUILD` steps of one variant from a fresh state (`None`: the bare scheduler, timed
/// as in `bare_scheduler`, or with `owning` as in `bare_scheduler_owning_drafts`); each
/// step's wall time and, through the runtime, its timing.
async fn round(
    dev: Option<Dev>,
    d: HashMap<RequestId, Vec<TokenId>>,
    owning: bool,
) -> (Vec<u64>, Vec<StepTiming>) {
    let (mut walls, mut timings) = (vec![], vec![]);
    let Some(dev) = dev else {
        let mut s = bare();
        for _ in 0..REBUILD {
            let drafts = owning.then(|| d.clone());
            let t = Instant::now();
            let p = s.schedule(drafts.as_ref().unwrap_or(&d)).unwrap();
            drop(drafts);
            s.complete(p.target_fence, p.draft_fence).unwrap();
            s.commit(&outcomes(p.requests.iter().map(|r| (r.id, r.num_drafts))))
                .unwrap();
            s.recycle(p);
            walls.push(t.elapsed().as_nanos() as u64);
        }
        return (walls, timings);
    };
    let kv = runtime(dev).await;
    let mut rep = kv.step(d.clone()).await.unwrap();
    for _ in 0..REBUILD {
        let drafts = d.clone();
        let t = Instant::now();
        let r = kv
            .commit_and_step(
                outcomes(rep.scheduled.iter().map(|r| (r.id, r.num_drafts))),
                drafts,
            )
            .await
            .unwrap();
        walls.push(t.elapsed().as_nanos() as u64);
        rep = r.step.unwrap();
        timings.push(rep.timing);
    }
    kv.shutdown().await;
    (walls, timings)
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = step, breakdown
}
criterion_main!(benches);
