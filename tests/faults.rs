//! Faults through the public handle: a device actor panicking in the middle of a step,
//! client futures cancelled at every await point, and a backend that cannot allocate
//! its pools at start. After each: the invariants hold, the other requests keep running,
//! the lock-free counters add up, nothing leaks.
mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dsa_kv::actors::{DeviceFault, KvCacheBuilder, KvCacheHandle, RuntimeError, StepReport};
use dsa_kv::config::{EngineConfig, SpecMode};
use dsa_kv::core::scheduler::{RequestOutcome, SchedError, SubmitRequest};
use dsa_kv::core::ReuseScope;
use dsa_kv::device::{BackendFactory, DeviceError, HostDevice};
use dsa_kv::ids::{PoolGroupId, RequestId, Tier, TokenId};
use dsa_kv::rng::SplitMix64;
use dsa_kv::storage::StorageError;

use common::events::EventMirror;

fn config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(3);
    c.kv_cache.max_tokens = Some(4096);
    c.kv_cache.host_cache_size = Some(2048 * 3 * 708 + (8 << 20));
    c.scheduler.max_num_sequences = 16;
    c.scheduler.max_num_tokens = 512;
    c.scheduler.max_prefill_chunk = 256;
    c.scheduler.max_seq_len = 2048;
    c
}

fn request(id: u64, len: u32) -> SubmitRequest {
    SubmitRequest {
        id: RequestId(id),
        scope: ReuseScope::SHARED,
        prompt: (0..len)
            .map(|i| TokenId(if i < 100 { i } else { id as u32 * 1000 + i }))
            .collect(),
        max_new_tokens: 8,
        priority: 35,
    }
}

/// Steps and commits until `stop` (or no device is left). Returns the steps run and
/// the steps that failed.
async fn engine(kv: KvCacheHandle, stop: Arc<AtomicBool>) -> (u64, u64) {
    let (mut steps, mut failed) = (0, 0);
    while !stop.load(Ordering::Relaxed) {
        assert!(steps + failed < 50_000, "the engine did not drain");
        let r = match kv.step(HashMap::new()).await {
            Ok(r) => r,
            Err(RuntimeError::NoDevices) => break,
            // A step a device failed: its requests failed; the next step goes on.
            Err(_) => {
                failed += 1;
                continue;
            }
        };
        steps += 1;
        if r.scheduled.is_empty() {
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        }
        match kv.commit(outcomes(&r)).await {
            Ok(_) | Err(RuntimeError::Scheduler(SchedError::NothingToCommit)) => {}
            Err(e) => panic!("commit: {e}"),
        }
    }
    (steps, failed)
}

/// What the model "sampled" for a step: no draft accepted, token 7 where one is due.
fn outcomes(r: &StepReport) -> Vec<RequestOutcome> {
    r.outcomes_from(|_| TokenId(7))
}

/// A runtime on `devices` host devices.
async fn start(devices: usize) -> KvCacheHandle {
    KvCacheBuilder::new()
        .config(config())
        .host_devices(devices)
        .start()
        .await
        .unwrap()
}

async fn wait_all(kv: &KvCacheHandle, ids: impl Iterator<Item = u64>) -> (u64, u64) {
    let (mut ok, mut failed) = (0, 0);
    for id in ids {
        match tokio::time::timeout(Duration::from_secs(60), kv.wait(RequestId(id))).await {
            Ok(Ok(_)) => ok += 1,
            Ok(Err(_)) => failed += 1,
            Err(_) => panic!("request {id} never resolved"),
        }
    }
    (ok, failed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_device_panicking_mid_step_fails_its_requests_and_service_continues() {
    let kv = start(2).await;
    for id in 1..=6 {
        kv.submit(request(id, 300)).await.unwrap();
    }
    // A few steps with both devices, then device 1 dies inside the next step.
    for _ in 0..2 {
        let r = kv.step(HashMap::new()).await.unwrap();
        kv.commit(outcomes(&r)).await.unwrap();
    }
    kv.inject_fault(1, DeviceFault::PanicInNextStep)
        .await
        .unwrap();
    let failed_step = kv.step(HashMap::new()).await;
    assert!(
        failed_step.is_err(),
        "the step a device died in is reported"
    );
    // Every request in flight on the lost device resolves (as failed), none hangs.
    let (ok, failed) = wait_all(&kv, 1..=6).await;
    assert_eq!(ok + failed, 6);
    assert!(failed > 0);
    // Service continues on device 0 with new requests.
    let stop = Arc::new(AtomicBool::new(false));
    let eng = tokio::spawn(engine(kv.clone(), stop.clone()));
    for id in 10..=14 {
        kv.submit(request(id, 200)).await.unwrap();
    }
    let (ok, failed) = wait_all(&kv, 10..=14).await;
    stop.store(true, Ordering::Relaxed);
    eng.await.unwrap();
    assert_eq!(
        (ok, failed),
        (5, 0),
        "the surviving device serves new requests"
    );
    let stats = kv.stats().await.unwrap();
    assert_eq!(stats.devices_alive, 1);
    let counts = kv.check_invariants().await.unwrap();
    assert_eq!(counts.live_sequences, 0, "no sequence leaked");
    let c = kv.counters();
    assert_eq!(c.in_flight, 0);
    assert_eq!(c.submitted, c.finished + c.failed);
    kv.shutdown().await;
}

/// What the engine that drops its own futures saw.
#[derive(Debug, Default)]
struct Dropped {
    steps_dropped: u64,
    reports_recovered: u64,
    commits_dropped: u64,
    commits_retried: u64,
}

/// Like [`engine`], but every third `step` and `commit` future is dropped after a
/// random 0–400 µs (often before the reply). A lost step report is fetched again with
/// `pending_step` and committed; a dropped commit is retried only when `pending_step`
/// says it did not land.
async fn engine_dropping_futures(kv: KvCacheHandle, stop: Arc<AtomicBool>) -> Dropped {
    let mut rng = SplitMix64(0x2545_F491_4F6C_DD1D);
    let mut draw = move |n: u64| rng.below(n);
    let mut seen = Dropped::default();
    let mut steps = 0u64;
    while !stop.load(Ordering::Relaxed) {
        steps += 1;
        assert!(steps < 50_000, "the engine did not drain");
        let step = if draw(3) == 0 {
            let budget = Duration::from_micros(draw(400));
            match tokio::time::timeout(budget, kv.step(HashMap::new())).await {
                Ok(r) => r,
                Err(_) => {
                    seen.steps_dropped += 1;
                    match kv.pending_step().await.unwrap() {
                        Some(r) => {
                            seen.reports_recovered += 1;
                            Ok(r)
                        }
                        // The step never reached the coordinator, or scheduled nothing.
                        None => continue,
                    }
                }
            }
        } else {
            kv.step(HashMap::new()).await
        };
        let r = match step {
            Ok(r) => r,
            Err(RuntimeError::NoDevices) => break,
            Err(e) => panic!("step: {e}"),
        };
        if r.scheduled.is_empty() {
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        }
        let outcomes = outcomes(&r);
        if draw(3) == 0 {
            let budget = Duration::from_micros(draw(400));
            match tokio::time::timeout(budget, kv.commit(outcomes.clone())).await {
                Ok(c) => {
                    c.expect("commit");
                    continue;
                }
                Err(_) => seen.commits_dropped += 1,
            }
            match kv.pending_step().await.unwrap() {
                Some(p) => {
                    assert_eq!(p.step, r.step, "no other step can have been scheduled");
                    seen.commits_retried += 1;
                }
                None => continue,
            }
        }
        kv.commit(outcomes).await.expect("commit");
    }
    seen
}

/// The engine's own `step` and `commit` futures dropped at random moments while
/// clients submit and wait: no step report is lost (each is recovered and committed),
/// no commit lands twice, every request finishes and nothing leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_step_and_commit_futures_lose_no_report() {
    let kv = start(2).await;
    let stop = Arc::new(AtomicBool::new(false));
    let eng = tokio::spawn(engine_dropping_futures(kv.clone(), stop.clone()));
    for id in 1..=60 {
        kv.submit(request(id, 120 + (id as u32 * 53) % 400))
            .await
            .unwrap();
    }
    let (ok, failed) = wait_all(&kv, 1..=60).await;
    stop.store(true, Ordering::Relaxed);
    let seen = eng.await.unwrap();
    eprintln!("{seen:?}");
    assert_eq!((ok, failed), (60, 0), "every request finishes");
    assert!(
        seen.reports_recovered > 0 && seen.commits_dropped > 0,
        "the drill dropped nothing that mattered: {seen:?}"
    );
    assert_eq!(kv.pending_step().await.unwrap(), None);
    let stats = kv.stats().await.unwrap();
    assert_eq!(stats.mismatches, 0);
    let counts = kv.check_invariants().await.unwrap();
    assert_eq!((counts.live_sequences, counts.active_requests), (0, 0));
    let c = kv.counters();
    assert_eq!(
        (c.submitted, c.finished, c.failed, c.in_flight),
        (60, 60, 0, 0)
    );
    kv.shutdown().await;
}

/// Client futures dropped at every await point: submits, waits, cancels and stats
/// calls are each wrapped in a timeout that fires at a random moment (often before the
/// reply). Afterwards every request that was admitted resolves, the counters add up and
/// nothing leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_futures_cancelled_anywhere_lose_nothing() {
    let kv = start(1).await;
    let stop = Arc::new(AtomicBool::new(false));
    let eng = tokio::spawn(engine(kv.clone(), stop.clone()));
    let mut clients = Vec::new();
    for c in 0..24u64 {
        let kv = kv.clone();
        clients.push(tokio::spawn(async move {
            let mut rng = SplitMix64(c);
            let mut draw = move |n: u64| rng.below(n);
            let mut cancelled = 0u32;
            for k in 0..6u64 {
                let id = c * 100 + k + 1;
                let budget = Duration::from_micros(draw(3000));
                let sub =
                    tokio::time::timeout(budget, kv.submit(request(id, 150 + draw(200) as u32)));
                if sub.await.is_err() {
                    cancelled += 1;
                }
                match draw(4) {
                    0 => {
                        let w = tokio::time::timeout(
                            Duration::from_micros(draw(5000)),
                            kv.wait(RequestId(id)),
                        );
                        cancelled += u32::from(w.await.is_err());
                    }
                    1 => {
                        let cl = tokio::time::timeout(
                            Duration::from_micros(draw(500)),
                            kv.cancel(RequestId(id)),
                        );
                        cancelled += u32::from(cl.await.is_err());
                    }
                    2 => {
                        let st = tokio::time::timeout(Duration::from_micros(draw(500)), kv.stats());
                        cancelled += u32::from(st.await.is_err());
                    }
                    _ => {}
                }
            }
            cancelled
        }));
    }
    let mut cancelled = 0;
    for c in clients {
        cancelled += c.await.unwrap();
    }
    assert!(
        cancelled > 0,
        "no future was cancelled: the test tests nothing"
    );
    // Let everything admitted drain.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let c = kv.counters();
        if c.in_flight == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "requests never drained: {c:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Relaxed);
    eng.await.unwrap();
    let c = kv.counters();
    let stats = kv.stats().await.unwrap();
    assert_eq!(c.submitted, c.finished + c.failed);
    assert_eq!(
        (c.submitted, c.finished, c.failed),
        (
            stats.scheduler.submitted,
            stats.scheduler.finished,
            stats.scheduler.failed
        )
    );
    let counts = kv.check_invariants().await.unwrap();
    assert_eq!(counts.live_sequences, 0, "no sequence leaked");
    assert_eq!(counts.active_requests, 0);
    eprintln!("{cancelled} client futures cancelled; {c:?}");
    kv.shutdown().await;
}

/// A backend that cannot allocate its pools (device 1 of 2): start fails with the
/// storage error; backends are all built before any actor starts, so none is left
/// running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_allocation_failure_at_start_is_a_typed_error() {
    let factory: BackendFactory = Arc::new(|i, setup| {
        if i == 1 {
            return Err(DeviceError::Storage {
                device: i,
                source: StorageError::OutOfMemory {
                    tier: Tier::Gpu,
                    group: PoolGroupId(0),
                    pool: 0,
                    bytes: 1 << 40,
                },
            });
        }
        Ok(Box::new(HostDevice::new(i, setup)?) as Box<_>)
    });
    let r = KvCacheBuilder::new()
        .config(config())
        .host_devices(2)
        .backend(factory)
        .start()
        .await;
    let e = r.err().expect("start must fail");
    assert_eq!(
        e.to_string(),
        "device 1: storage: cannot allocate 1099511627776 bytes for gpu pool 0 of group 0: lower the KV budget"
    );
}

/// Shutdown with requests in flight: every waiter resolves (with a "not running" error,
/// none hangs), and handles cloned before the shutdown get the same error afterwards
/// instead of panicking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_requests_in_flight_resolves_every_waiter() {
    let kv = start(2).await;
    for id in 1..=4 {
        kv.submit(request(id, 200)).await.unwrap();
    }
    let waiters: Vec<_> = (1..=4)
        .map(|id| {
            let kv = kv.clone();
            tokio::spawn(async move { kv.wait(RequestId(id)).await })
        })
        .collect();
    let r = kv.step(HashMap::new()).await.unwrap();
    assert!(!r.scheduled.is_empty());
    let later = kv.clone();
    tokio::time::timeout(Duration::from_secs(30), kv.shutdown())
        .await
        .expect("shutdown does not wait for the uncommitted step");
    for w in waiters {
        let got = tokio::time::timeout(Duration::from_secs(30), w)
            .await
            .expect("a waiter hung after shutdown")
            .unwrap();
        assert!(matches!(got, Err(RuntimeError::NotRunning(_))), "{got:?}");
    }
    let err = later.submit(request(9, 100)).await.unwrap_err();
    assert!(matches!(err, RuntimeError::NotRunning(_)), "{err}");
    assert!(later.stats().await.is_err());
    let c = later.counters();
    assert_eq!(c.submitted, 4, "the lock-free counters stay readable");
}

/// Storage refusals through the whole stack: 20 % of GPU-room requests (admission,
/// growth, resume) are refused as if the memory could not be supplied, while 40
/// requests run on two devices with a mirrored draft cache (which follows the target's
/// decisions in lockstep). The
/// scheduler sees memory pressure and preempts or waits; every request finishes, every
/// byte verifies, nothing leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn injected_room_failures_through_the_runtime_lose_nothing() {
    let mut c = config();
    c.kv_cache.max_tokens = Some(2048);
    c.spec_decode.mode = SpecMode::Mtp;
    c.spec_decode.draft_tokens = 2;
    let kv = KvCacheBuilder::new()
        .config(c)
        .host_devices(2)
        .start()
        .await
        .unwrap();
    assert!(kv.info().draft_cache);
    assert_eq!(kv.inject_room_failures(0xd1e, 20).await.unwrap(), 0);
    for id in 1..=40 {
        kv.submit(request(id, 120 + (id as u32 * 71) % 400))
            .await
            .unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let eng = tokio::spawn(engine(kv.clone(), stop.clone()));
    // A router's view: every KV event replayed, checked against the target cache's tree
    // (read atomically with the events) while the engine runs.
    let router = tokio::spawn({
        let (kv, stop) = (kv.clone(), stop.clone());
        async move {
            let mut mirror = EventMirror::new(1);
            let mut checks = 0u64;
            loop {
                let done = stop.load(Ordering::Relaxed);
                let snap = kv.events().take_with_snapshot().await.unwrap();
                assert_eq!(snap.lost, 0, "events were dropped untaken");
                mirror.apply(&snap.events);
                let truth: Vec<_> = snap
                    .blocks
                    .iter()
                    .map(|p| (p.key, p.life_cycle, p.tier))
                    .collect();
                assert_eq!(mirror.pages(), truth, "the events describe another cache");
                checks += 1;
                if done {
                    return (checks, truth.len());
                }
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        }
    });
    let (ok, failed) = wait_all(&kv, 1..=40).await;
    stop.store(true, Ordering::Relaxed);
    let (_, failed_steps) = eng.await.unwrap();
    let (checks, cached) = router.await.unwrap();
    eprintln!("{checks} event-mirror checks, {cached} cached pages at the end");
    assert!(checks > 10 && cached > 0, "the mirror was hardly checked");
    let injected = kv.inject_room_failures(0, 0).await.unwrap();
    eprintln!("{injected} room requests refused");
    assert_eq!(
        failed_steps, 0,
        "a refusal is memory pressure, not a failed step"
    );
    assert_eq!((ok, failed), (40, 0), "every request finishes");
    assert!(injected > 0, "the drill refused nothing");
    let st = kv.stats().await.unwrap();
    assert_eq!(st.mismatches, 0);
    assert!(st.tokens_verified > 0);
    let counts = kv.check_invariants().await.unwrap();
    assert_eq!((counts.live_sequences, counts.active_requests), (0, 0));
    assert_eq!(counts.pages, counts.cached_blocks, "no slot leaked");
    let c = kv.counters();
    assert_eq!((c.submitted, c.finished, c.failed), (40, 40, 0));
    kv.shutdown().await;
}
