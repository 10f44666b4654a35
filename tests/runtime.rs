//! The runtime through its public handle: many concurrent clients with nothing lost,
//! supervision (a device dies mid-run), backpressure, prefix-cache reset, start-up
//! validation, `commit_and_step` against `commit` then `step`, step timings and the
//! polling (`idle_spin`) runtime. The supervision and
//! backpressure tests inject faults (feature `fault-injection`).
mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

#[cfg(feature = "fault-injection")]
use dsa_kv::actors::DeviceFault;
use dsa_kv::actors::{FinishedReport, KvCacheBuilder, KvCacheHandle, RuntimeError};
use dsa_kv::config::{ConfigError, EngineConfig, SpecMode};
use dsa_kv::core::scheduler::{RequestOutcome, SubmitRequest};
use dsa_kv::core::{KvEvent, ReuseScope};
use dsa_kv::ids::{RequestId, TokenId};

fn config(max_tokens: u64, host: bool, mtp: bool) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(3);
    c.kv_cache.max_tokens = Some(max_tokens);
    if host {
        // The same bytes as 2,048 tokens.
        c.kv_cache.host_cache_size = Some(2048 * 3 * 708 + (8 << 20));
    }
    c.scheduler.max_num_sequences = 16;
    c.scheduler.max_num_tokens = 512;
    c.scheduler.max_prefill_chunk = 256;
    c.scheduler.max_seq_len = 2048;
    if mtp {
        c.spec_decode.mode = SpecMode::Mtp;
        c.spec_decode.draft_tokens = 2;
    }
    c
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// Runs the engine loop until `stop` is set: step, sample (random draft acceptance),
/// commit. Returns the number of steps.
async fn engine(kv: KvCacheHandle, stop: Arc<AtomicBool>, seed: u64) -> Result<u64, RuntimeError> {
    let mut rng = Rng(seed);
    let mut steps = 0;
    while !stop.load(Ordering::Relaxed) {
        let drafts: HashMap<RequestId, Vec<TokenId>> = (0..64)
            .map(|i| {
                (
                    RequestId(i),
                    vec![
                        TokenId(rng.next() as u32 % 1000),
                        TokenId(rng.next() as u32 % 1000),
                    ],
                )
            })
            .collect();
        let report = match kv.step(drafts).await {
            Ok(r) => r,
            Err(RuntimeError::NoDevices) => return Ok(steps),
            Err(e) => return Err(e),
        };
        steps += 1;
        if report.scheduled.is_empty() {
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        }
        let outcomes = report
            .scheduled
            .iter()
            .map(|r| RequestOutcome {
                id: r.id,
                accepted_drafts: if r.num_drafts > 0 {
                    (rng.next() % u64::from(r.num_drafts + 1)) as u32
                } else {
                    0
                },
                next_token: r.produces_token.then(|| TokenId(rng.next() as u32 % 1000)),
            })
            .collect();
        match kv.commit(outcomes).await {
            Ok(_) => {}
            Err(RuntimeError::Scheduler(dsa_kv::core::scheduler::SchedError::NothingToCommit)) => {}
            Err(e) => return Err(e),
        }
        assert!(steps < 20_000, "the engine did not drain");
    }
    Ok(steps)
}

fn prompt(client: u64, len: usize) -> Vec<TokenId> {
    // Clients share a 150-token system prompt, then differ.
    (0..len)
        .map(|i| {
            TokenId(if i < 150 {
                i as u32
            } else {
                (client * 1000 + i as u64) as u32
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_concurrent_clients_lose_nothing() {
    let kv = KvCacheBuilder::new()
        .config(config(1024, true, true))
        .start()
        .await
        .unwrap();
    assert!(kv.info().draft_cache);
    let stop = Arc::new(AtomicBool::new(false));
    // Every request is in before the engine's first step, in id order, so the memory
    // pressure (and with it preemption and offload) is the same on every run and does
    // not depend on how fast this machine runs the clients against the engine. The 40
    // clients then wait concurrently while the engine steps.
    for c in 0..40u64 {
        let len = 160 + (c as usize * 37) % 300;
        kv.submit(SubmitRequest {
            id: RequestId(c),
            scope: ReuseScope::SHARED,
            prompt: prompt(c, len),
            max_new_tokens: 5 + (c as u32 % 20),
            priority: [10, 35, 60][c as usize % 3],
        })
        .await
        .unwrap();
    }
    let clients: Vec<_> = (0..40u64)
        .map(|c| {
            let kv = kv.clone();
            tokio::spawn(async move { kv.wait(RequestId(c)).await })
        })
        .collect();
    let engine_task = tokio::spawn(engine(kv.clone(), stop.clone(), 7));
    let mut finished = 0;
    for c in clients {
        let done = c.await.unwrap().expect("every request finishes");
        assert!(done.mismatches.is_empty(), "{:?}", done.mismatches);
        assert!(done.tokens_verified > 0);
        finished += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let steps = engine_task.await.unwrap().unwrap();
    assert_eq!(finished, 40);
    let st = kv.stats().await.unwrap();
    assert_eq!(
        (
            st.scheduler.submitted,
            st.scheduler.finished,
            st.scheduler.failed
        ),
        (40, 40, 0),
        "counters add up"
    );
    assert_eq!(st.mismatches, 0);
    assert!(st.tokens_verified > 0);
    assert!(
        st.scheduler.preemptions > 0,
        "a 1,024-token cache for 40 clients must preempt"
    );
    assert!(st.offload_bytes > 0 && st.onboard_bytes > 0);
    assert!(st.prefix_hit_rate > 0.0, "the system prompt is reused");
    assert!(
        st.scheduler.drafts_accepted > 0
            && st.scheduler.drafts_accepted < st.scheduler.drafts_proposed
    );
    assert!(st.draft_replays > 0);
    assert!(st.events.stored > 0 && st.events.removed > 0 && st.events.tier_updated > 0);
    assert_eq!(st.scheduler.steps, steps);
    let counts = kv.check_invariants().await.unwrap();
    assert_eq!((counts.active_requests, counts.live_sequences), (0, 0));
    assert_eq!(
        counts.pages, counts.cached_blocks,
        "only cached blocks hold pages: no slot leaked"
    );
    // The lock-free counters agree with the coordinator's stats, and the devices'
    // published fences caught up with every step.
    let live = kv.counters();
    assert_eq!(
        (
            live.submitted,
            live.finished,
            live.failed,
            live.in_flight,
            live.steps
        ),
        (
            st.scheduler.submitted,
            st.scheduler.finished,
            st.scheduler.failed,
            0,
            st.scheduler.steps
        )
    );
    assert!(live.completed_fence.0 >= st.scheduler.steps, "{live:?}");
    assert!(
        kv.bindings(0).is_some(),
        "the device published its bindings"
    );
    let events = kv.events().take().await.unwrap();
    assert!(!events.is_empty());
    kv.shutdown().await;
}

#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_device_fails_its_requests_and_service_continues() {
    let info = dead_device_drill(config(4096, false, false)).await;
    assert!(info.window_slots.is_empty());
    // DeepSeek-V4 from its preset (windowed host devices) through the same runtime.
    let mut v4 = config(4096, false, false);
    v4.model.preset = dsa_kv::config::ModelPreset::DeepSeekV4Flash;
    v4.model.num_layers = None;
    let info = dead_device_drill(v4).await;
    assert_eq!(
        (info.model.as_str(), info.window_slots.len()),
        ("DeepSeek-V4-Flash", 3)
    );
}

/// Device 1 killed after two steps of 4 requests: every request fails naming it; the
/// service goes on with device 0.
#[cfg(feature = "fault-injection")]
async fn dead_device_drill(config: EngineConfig) -> dsa_kv::actors::RuntimeInfo {
    let kv = KvCacheBuilder::new()
        .config(config)
        .host_devices(2)
        .start()
        .await
        .unwrap();
    for c in 0..4u64 {
        kv.submit(SubmitRequest {
            id: RequestId(c),
            scope: ReuseScope::SHARED,
            prompt: prompt(c, 200),
            max_new_tokens: 50,
            priority: 35,
        })
        .await
        .unwrap();
    }
    let waiters: Vec<_> = (0..4u64)
        .map(|c| {
            let kv = kv.clone();
            tokio::spawn(async move { kv.wait(RequestId(c)).await })
        })
        .collect();
    // Two steps: the prefill runs on both devices.
    for _ in 0..2 {
        let r = kv.step(HashMap::new()).await.unwrap();
        assert_eq!(r.devices.len(), 2);
        assert_eq!(
            r.devices[0].metadata_digest, r.devices[1].metadata_digest,
            "identical page tables on every rank"
        );
        kv.commit(r.outcomes_from(|_| TokenId(1))).await.unwrap();
    }
    kv.kill_device(1).await.unwrap();
    // The coordinator learns of the death and fails every request holding pages there.
    for w in waiters {
        match w.await.unwrap() {
            Err(RuntimeError::RequestFailed { reason, .. }) => {
                assert!(reason.contains("device 1"), "{reason}")
            }
            other => panic!("expected a failure, got {other:?}"),
        }
    }
    let st = kv.stats().await.unwrap();
    assert_eq!((st.scheduler.failed, st.devices_alive), (4, 1));
    // The service goes on with the remaining device.
    kv.submit(SubmitRequest {
        id: RequestId(9),
        scope: ReuseScope::SHARED,
        prompt: prompt(9, 100),
        max_new_tokens: 3,
        priority: 35,
    })
    .await
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let e = tokio::spawn(engine(kv.clone(), stop.clone(), 1));
    let done = kv.wait(RequestId(9)).await.unwrap();
    stop.store(true, Ordering::Relaxed);
    e.await.unwrap().unwrap();
    assert_eq!(done.finished.generated, 3);
    let counts = kv.check_invariants().await.unwrap();
    assert_eq!(counts.live_sequences, 0);
    let info = kv.info().clone();
    kv.shutdown().await;
    info
}

/// Steps and commits (token 7, no drafts accepted) until `n` requests finished.
async fn run_until_finished(kv: &KvCacheHandle, n: usize) -> Vec<FinishedReport> {
    let mut finished = Vec::new();
    for _ in 0..200 {
        let report = kv.step(HashMap::new()).await.unwrap();
        let outcomes = report.outcomes_from(|_| TokenId(7));
        if !outcomes.is_empty() {
            finished.extend(kv.commit(outcomes).await.unwrap().finished);
        }
        if finished.len() == n {
            return finished;
        }
    }
    panic!("{} of {n} requests finished", finished.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reset_prefix_cache_forgets_every_block_and_waits_for_requests_holding_pages() {
    // A host tier and a separate MTP draft cache: both are reset.
    let kv = KvCacheBuilder::new()
        .config(config(4096, true, true))
        .start()
        .await
        .unwrap();
    let submit = |id: u64| SubmitRequest {
        id: RequestId(id),
        scope: ReuseScope::SHARED,
        prompt: prompt(1, 200),
        max_new_tokens: 4,
        priority: 35,
    };
    assert_eq!(kv.submit(submit(1)).await.unwrap(), 0);
    let done = run_until_finished(&kv, 1).await;
    assert_eq!(done[0].finished.reused_tokens, 0);
    // 200 prompt tokens + 3 outputs with KV: 3 full blocks and a partial one of 11.
    let cached = kv.check_invariants().await.unwrap();
    assert_eq!((cached.cached_blocks, cached.pages), (4, 4));
    // The same prompt reuses everything but its last token.
    assert_eq!(kv.submit(submit(2)).await.unwrap(), 199);
    let step = kv.step(HashMap::new()).await.unwrap();
    assert_eq!(step.scheduled[0].num_cached, 199);
    kv.events().take().await.unwrap();
    // Request 2 holds pages in the step in flight: refused, nothing changes.
    let holding = kv.check_invariants().await.unwrap();
    let err = kv.reset_prefix_cache().await.unwrap_err();
    assert_eq!(err, RuntimeError::PrefixCacheInUse { requests: 1 });
    assert!(
        err.to_string().contains("let them finish or cancel them"),
        "{err}"
    );
    assert_eq!(kv.check_invariants().await.unwrap(), holding);
    assert_eq!(kv.events().take().await.unwrap(), vec![]);
    kv.commit(vec![RequestOutcome {
        id: RequestId(2),
        accepted_drafts: 0,
        next_token: Some(TokenId(7)),
    }])
    .await
    .unwrap();
    let done = run_until_finished(&kv, 1).await;
    assert_eq!(done[0].finished.reused_tokens, 199);
    assert!(done[0].mismatches.is_empty());
    // Everything finished: the reset drops every block, on the GPU and the host.
    let before = kv.check_invariants().await.unwrap();
    let report = kv.reset_prefix_cache().await.unwrap();
    assert_eq!(
        (report.blocks, report.gpu_pages + report.host_pages),
        (before.cached_blocks as u64, before.pages as u64)
    );
    assert_eq!(
        (report.gpu_pages, report.host_pages),
        (
            u64::from(before.gpu_slots_used),
            u64::from(before.host_slots_used)
        )
    );
    let after = kv.check_invariants().await.unwrap();
    assert_eq!(
        (
            after.cached_blocks,
            after.pages,
            after.gpu_slots_used,
            after.host_slots_used
        ),
        (0, 0, 0, 0)
    );
    let events = kv.events().take().await.unwrap();
    assert_eq!(events.last(), Some(&KvEvent::AllBlocksCleared));
    assert_eq!(
        events
            .iter()
            .filter(|e| **e == KvEvent::AllBlocksCleared)
            .count(),
        1
    );
    assert_eq!(kv.stats().await.unwrap().events.cleared, 1);
    // The same prompt now reuses nothing, and its KV verifies.
    assert_eq!(kv.submit(submit(3)).await.unwrap(), 0);
    let done = run_until_finished(&kv, 1).await;
    assert_eq!(done[0].finished.reused_tokens, 0);
    assert!(done[0].mismatches.is_empty() && done[0].tokens_verified > 0);
    kv.shutdown().await;
}

#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_mailbox_slows_senders_and_loses_nothing() {
    let kv = KvCacheBuilder::new()
        .config(config(4096, false, false))
        .coordinator_mailbox(1)
        .device_mailbox(1)
        .start()
        .await
        .unwrap();
    kv.inject_fault(0, DeviceFault::Delay(Duration::from_millis(100)))
        .await
        .unwrap();
    kv.submit(SubmitRequest {
        id: RequestId(1),
        scope: ReuseScope::SHARED,
        prompt: prompt(1, 64),
        max_new_tokens: 1,
        priority: 35,
    })
    .await
    .unwrap();
    // A step is in flight on the slow device; 30 clients ask for stats meanwhile. The
    // step future is polled once here, which puts the step in the coordinator's mailbox
    // before any stats ask (no sleep to hope for that).
    let mut step = {
        let kv = kv.clone();
        Box::pin(async move { kv.step(HashMap::new()).await })
    };
    assert!(futures::poll!(&mut step).is_pending());
    let t0 = Instant::now();
    let stepper = tokio::spawn(step);
    let asks: Vec<_> = (0..30)
        .map(|_| {
            let kv = kv.clone();
            tokio::spawn(async move { kv.stats().await })
        })
        .collect();
    let mut answered = 0;
    for a in asks {
        let st = a.await.unwrap().unwrap();
        assert_eq!(
            st.scheduler.steps, 1,
            "a stats ask queued behind the step sees it done"
        );
        answered += 1;
    }
    assert_eq!(answered, 30, "every queued message is answered");
    assert!(
        t0.elapsed() >= Duration::from_millis(50),
        "senders waited for the slow step"
    );
    let report = stepper.await.unwrap().unwrap();
    assert_eq!(report.scheduled.len(), 1);
    kv.inject_fault(0, DeviceFault::NoDelay).await.unwrap();
    kv.shutdown().await;
}

#[tokio::test(flavor = "current_thread")]
async fn start_refuses_a_current_thread_runtime() {
    let err = KvCacheBuilder::new()
        .config(config(4096, false, false))
        .start()
        .await
        .err()
        .unwrap();
    assert!(matches!(err, RuntimeError::CurrentThreadRuntime), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_validates_the_configuration() {
    let mut c = config(4096, false, false);
    c.parallel.cp_mode = dsa_kv::config::CpMode::Star;
    c.parallel.cp_size = 2;
    let err = KvCacheBuilder::new().config(c).start().await.err().unwrap();
    assert!(
        matches!(err, RuntimeError::Config(ConfigError::Unsupported { .. })),
        "{err}"
    );
    let mut c = config(4096, false, false);
    c.kv_cache.max_tokens = None;
    let err = KvCacheBuilder::new().config(c).start().await.err().unwrap();
    assert!(err.to_string().contains("no GPU budget"), "{err}");
    let mut c = config(4096, false, false);
    c.kv_cache.tokens_per_block = 32;
    let err = KvCacheBuilder::new().config(c).start().await.err().unwrap();
    assert!(err.to_string().contains("must be 64 for DSA"), "{err}");
    let kv = KvCacheBuilder::new()
        .config(config(4096, false, false))
        .start()
        .await
        .unwrap();
    // Bad requests are typed errors; the runtime keeps serving.
    let bad = SubmitRequest {
        id: RequestId(1),
        scope: ReuseScope::SHARED,
        prompt: vec![],
        max_new_tokens: 1,
        priority: 1,
    };
    assert!(matches!(
        kv.submit(bad).await,
        Err(RuntimeError::Scheduler(_))
    ));
    assert!(matches!(
        kv.wait(RequestId(77)).await,
        Err(RuntimeError::Kv(_))
    ));
    assert!(matches!(
        kv.commit(vec![]).await,
        Err(RuntimeError::Scheduler(_))
    ));
    assert!(matches!(
        kv.cancel(RequestId(77)).await,
        Err(RuntimeError::Scheduler(_))
    ));
    kv.shutdown().await;
}

/// A consumer that falls behind learns it: with room for 3 untaken events, the events
/// of 3 requests overflow, `lost` says how many were dropped, `stats` counts them, and
/// the snapshot is the truth the consumer resynchronizes to.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn events_dropped_untaken_are_counted_and_the_snapshot_resyncs() {
    let kv = KvCacheBuilder::new()
        .config(config(4096, false, false))
        .event_capacity(3)
        .start()
        .await
        .unwrap();
    for id in 1..=3u64 {
        kv.submit(SubmitRequest {
            id: RequestId(id),
            scope: ReuseScope::SHARED,
            prompt: prompt(id, 200),
            max_new_tokens: 1,
            priority: 35,
        })
        .await
        .unwrap();
    }
    run_until_finished(&kv, 3).await;
    let snap = kv.events().take_with_snapshot().await.unwrap();
    let counts = kv.stats().await.unwrap().events;
    let emitted = counts.stored + counts.removed + counts.tier_updated + counts.cleared;
    assert!(emitted > 3, "the workload emitted only {emitted} events");
    assert_eq!(snap.events.len(), 3, "the newest 3 are kept");
    assert_eq!(snap.lost, emitted - 3);
    assert_eq!(counts.lost, emitted - 3);
    // No host tier, nothing removed: the tree holds every stored block.
    assert_eq!(snap.blocks.len() as u64, counts.stored - counts.removed);
    // Taken: nothing is pending or lost any more.
    let again = kv.events().take_with_snapshot().await.unwrap();
    assert_eq!((again.events.len(), again.lost), (0, 0));
    assert_eq!(again.blocks, snap.blocks);
    kv.shutdown().await;
}

/// Drives every submitted request to its end with deterministic drafts and outcomes,
/// through `step` + `commit` or through `commit_and_step`; returns each step's report
/// and its commit's finished requests, timings zeroed.
async fn drive(
    kv: &KvCacheHandle,
    combined: bool,
) -> Vec<(dsa_kv::actors::StepReport, Vec<FinishedReport>)> {
    fn drafts(step: u64) -> HashMap<RequestId, Vec<TokenId>> {
        (1..=12)
            .map(|id| {
                let t = (id * 7 + step * 13) as u32 % 1000;
                (RequestId(id), vec![TokenId(t), TokenId(t + 1)])
            })
            .collect()
    }
    fn outcomes(r: &dsa_kv::actors::StepReport) -> Vec<RequestOutcome> {
        r.scheduled
            .iter()
            .map(|s| RequestOutcome {
                id: s.id,
                accepted_drafts: (s.id.0 as u32 + r.step as u32) % (s.num_drafts + 1),
                next_token: s
                    .produces_token
                    .then(|| TokenId((s.id.0 as u32 * 31 + r.step as u32) % 1000)),
            })
            .collect()
    }
    fn untimed(mut r: dsa_kv::actors::StepReport) -> dsa_kv::actors::StepReport {
        r.manager_us = 0;
        for d in &mut r.devices {
            d.elapsed_us = 0;
        }
        r
    }
    let mut log = Vec::new();
    let mut report = kv.step(drafts(0)).await.unwrap();
    for n in 1.. {
        assert!(n < 5000, "the requests did not finish");
        if report.scheduled.is_empty() {
            if kv.counters().in_flight == 0 {
                return log;
            }
            report = kv.step(drafts(n)).await.unwrap();
            continue;
        }
        let outcomes = outcomes(&report);
        let (finished, next) = if combined {
            let r = kv.commit_and_step(outcomes, drafts(n)).await.unwrap();
            (r.commit.finished, r.step.unwrap())
        } else {
            let c = kv.commit(outcomes).await.unwrap();
            (c.finished, kv.step(drafts(n)).await.unwrap())
        };
        log.push((untimed(report), finished));
        report = next;
    }
    unreachable!()
}

/// `commit_and_step` is `commit` then `step` in one message: under memory pressure
/// (preemption, host offload, a separate draft cache), the same requests get the same
/// steps, finished reports, statistics and KV events either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_and_step_does_what_commit_then_step_do() {
    let mut runs = Vec::new();
    for combined in [false, true] {
        let kv = KvCacheBuilder::new()
            .config(config(1024, true, true))
            .start()
            .await
            .unwrap();
        for id in 1..=12u64 {
            kv.submit(SubmitRequest {
                id: RequestId(id),
                scope: ReuseScope::SHARED,
                prompt: prompt(id % 4, 150 + (id as usize * 37) % 200),
                max_new_tokens: 20 + (id as u32 * 7) % 30,
                priority: 35,
            })
            .await
            .unwrap();
        }
        let log = drive(&kv, combined).await;
        let stats = kv.stats().await.unwrap();
        let history = kv.history(0).await.unwrap();
        let events = kv.events().take().await.unwrap();
        let counts = kv.check_invariants().await.unwrap();
        kv.shutdown().await;
        let sampled: Vec<(u64, u32, u32)> = history
            .samples
            .iter()
            .map(|h| (h.step, h.scheduled, h.preempted))
            .collect();
        runs.push((log, stats, events, counts, sampled));
    }
    let (b, a) = (runs.pop().unwrap(), runs.pop().unwrap());
    assert_eq!(a.0.len(), b.0.len(), "steps");
    for (x, y) in a.0.iter().zip(&b.0) {
        assert_eq!(x, y, "step {}", x.0.step);
    }
    let finished: usize = a.0.iter().map(|(_, f)| f.len()).sum();
    assert_eq!(finished, 12);
    assert!(
        a.1.scheduler.preemptions > 0,
        "no memory pressure: {:?}",
        a.1
    );
    let counters = |s: &dsa_kv::actors::RuntimeStats| {
        (
            (
                s.scheduler.steps,
                s.scheduler.submitted,
                s.scheduler.finished,
                s.scheduler.failed,
                s.scheduler.preemptions,
            ),
            (s.scheduler.prefill_tokens, s.scheduler.decode_tokens),
            (
                s.scheduler.drafts_proposed,
                s.scheduler.drafts_accepted,
                s.draft_replays,
            ),
            (s.offload_bytes, s.onboard_bytes, s.events),
            (s.tokens_verified, s.mismatches, s.history_dropped),
        )
    };
    assert_eq!(counters(&a.1), counters(&b.1));
    assert_eq!(a.1.mismatches, 0);
    assert_eq!(a.2, b.2, "KV events");
    assert_eq!(a.3, b.3, "cache occupancy");
    assert_eq!(a.4, b.4, "history: steps, scheduled and preempted requests");
    assert_eq!(a.4.len() as u64, a.1.scheduler.steps, "a sample per step");
    let preempted: u64 = a.4.iter().map(|h| u64::from(h.2)).sum();
    assert_eq!(
        preempted, a.1.scheduler.preemptions,
        "the history's preemptions"
    );
}

/// A refused commit refuses the whole call: nothing is committed, no step runs, and the
/// step in flight can still be committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_and_step_refuses_a_bad_commit_and_runs_no_step() {
    let kv = KvCacheBuilder::new()
        .config(config(4096, false, false))
        .start()
        .await
        .unwrap();
    kv.submit(SubmitRequest {
        id: RequestId(1),
        scope: ReuseScope::SHARED,
        prompt: prompt(1, 100),
        max_new_tokens: 2,
        priority: 35,
    })
    .await
    .unwrap();
    let err = |r: Result<dsa_kv::actors::CommitAndStepReport, RuntimeError>| match r {
        Ok(r) => panic!("accepted: {r:?}"),
        Err(e) => e.to_string(),
    };
    assert_eq!(
        err(kv.commit_and_step(vec![], HashMap::new()).await),
        "no step to commit"
    );
    let step = kv.step(HashMap::new()).await.unwrap();
    let bad = vec![RequestOutcome {
        id: RequestId(404),
        accepted_drafts: 0,
        next_token: Some(TokenId(1)),
    }];
    assert_eq!(
        err(kv.commit_and_step(bad, HashMap::new()).await),
        "request 404 was not part of step 1"
    );
    assert_eq!(kv.pending_step().await.unwrap(), Some(step.clone()));
    assert_eq!(kv.stats().await.unwrap().scheduler.steps, 1, "no step ran");
    // The step in flight commits, and the next one runs, in one call.
    let r = kv
        .commit_and_step(step.outcomes_from(|_| TokenId(7)), HashMap::new())
        .await
        .unwrap();
    assert!(r.commit.finished.is_empty());
    let next = r.step.unwrap();
    assert_eq!((next.step, next.scheduled.len()), (2, 1));
    assert_eq!(kv.pending_step().await.unwrap(), Some(next.clone()));
    // The last token: the request finishes in the commit, and the step after it is empty.
    let r = kv
        .commit_and_step(next.outcomes_from(|_| TokenId(7)), HashMap::new())
        .await
        .unwrap();
    assert_eq!(r.commit.finished.len(), 1);
    assert_eq!(r.commit.finished[0].finished.generated, 2);
    assert!(r.commit.finished[0].mismatches.is_empty());
    assert!(r.step.unwrap().scheduled.is_empty());
    assert_eq!(kv.pending_step().await.unwrap(), None);
    kv.shutdown().await;
}

/// Every step carries where its time went: each interval within what the caller waited,
/// the commit only in `commit_and_step`, the caller's wake-up only in the live reply; and
/// a runtime whose threads poll instead of parking (`idle_spin`) serves the same steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_report_their_timing_and_a_polling_runtime_serves_the_same_steps() {
    let mut runs = Vec::new();
    for spin in [Duration::ZERO, Duration::from_micros(200)] {
        let kv = KvCacheBuilder::new()
            .config(config(4096, false, false))
            .idle_spin(spin)
            .start()
            .await
            .unwrap();
        for id in 1..=3 {
            kv.submit(SubmitRequest {
                id: RequestId(id),
                scope: ReuseScope::SHARED,
                prompt: prompt(id, 100),
                max_new_tokens: 4,
                priority: 35,
            })
            .await
            .unwrap();
        }
        let t = Instant::now();
        let mut step = kv.step(HashMap::new()).await.unwrap();
        let waited = t.elapsed().as_nanos() as u64;
        let t = step.timing;
        assert_eq!(t.commit_ns, 0, "a plain step commits nothing");
        assert!(t.schedule_ns > 0 && t.to_caller_ns > 0, "{t:?}");
        for x in [
            t.to_coordinator_ns,
            t.schedule_ns,
            t.device_ns,
            t.to_caller_ns,
        ] {
            assert!(x <= waited, "{t:?} within {waited} ns");
        }
        let again = kv.pending_step().await.unwrap().unwrap();
        assert_eq!(again.timing.to_caller_ns, 0, "no caller waited for it");
        assert_eq!(again.timing.schedule_ns, t.schedule_ns);
        let mut scheduled = vec![step.scheduled.clone()];
        loop {
            let t0 = Instant::now();
            let r = kv
                .commit_and_step(step.outcomes_from(|_| TokenId(7)), HashMap::new())
                .await
                .unwrap();
            let waited = t0.elapsed().as_nanos() as u64;
            step = r.step.unwrap();
            if step.scheduled.is_empty() {
                break;
            }
            let t = step.timing;
            assert!(t.commit_ns > 0 && t.commit_ns <= waited, "{t:?}");
            scheduled.push(step.scheduled.clone());
        }
        kv.shutdown().await;
        runs.push(scheduled);
    }
    assert_eq!(runs[0], runs[1]);
    assert!(runs[0].len() >= 4, "prefill and decode steps");
}

/// A committed step's plan goes back to the scheduler (whose next plans reuse its
/// buffers) also when the engine loop still holds the step's report during the commit,
/// as loops do (`kv.commit(report.outcomes_from(..))`, or `commit_and_step` with the report of
/// the step being committed): it is recycled once the report is dropped. Before, it was
/// recycled only when nothing else held it at the commit: in such loops never
/// (`plans_recycled` stayed 0), and every step allocated its plan afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_are_recycled_while_engine_loops_hold_their_reports() {
    for fused in [false, true] {
        let kv = KvCacheBuilder::new()
            .config(config(4096, false, false))
            .start()
            .await
            .unwrap();
        for i in 0..8u64 {
            kv.submit(SubmitRequest::new(RequestId(i), prompt(i, 100), 40))
                .await
                .unwrap();
        }
        let mut steps = 0u64;
        let mut report = kv.step(dsa_kv::actors::Drafts::none()).await.unwrap();
        loop {
            steps += 1;
            let outs = report.outcomes_from(|s| TokenId(s.id.0 as u32 + 7));
            if fused {
                // The report of the step being committed is alive during the call.
                let next = kv
                    .commit_and_step(outs, dsa_kv::actors::Drafts::none())
                    .await
                    .unwrap();
                match next.step {
                    Ok(r) => report = r,
                    Err(RuntimeError::Scheduler(_)) => break,
                    Err(e) => panic!("{e}"),
                }
            } else {
                kv.commit(outs).await.unwrap();
                // `report` is still alive here; it is replaced (dropped) only now.
                report = kv.step(dsa_kv::actors::Drafts::none()).await.unwrap();
            }
            if kv.counters().in_flight == 0 {
                break;
            }
        }
        drop(report);
        let st = kv.stats().await.unwrap();
        assert!(steps > 30, "{steps}");
        assert!(
            st.plans_recycled + 2 >= steps,
            "fused {fused}: {} of {steps} plans recycled",
            st.plans_recycled
        );
        kv.shutdown().await;
    }
}
