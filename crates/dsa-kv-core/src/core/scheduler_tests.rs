//! Scheduler tests: engine loops on a tiny layout (T = 4) under memory pressure, with and
//! without a host tier (suspend vs. recompute preemption) and with a mirrored draft cache.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::scheduler::*;
use super::*;
use crate::ids::{LayerId, RequestId, Tier, TokenId};
use crate::layout::{BufferSpec, LayerSpec, LifeCycleKey, PoolPlan, Role, RowLayout};

fn plan() -> PoolPlan {
    PoolPlan::v2(
        4,
        vec![LayerSpec {
            layer: LayerId(0),
            life_cycle: LifeCycleKey(0),
            buffers: vec![BufferSpec::new(
                Role::Key,
                RowLayout::Interleaved { row_bytes: 2 },
            )],
        }],
    )
    .unwrap()
}

fn manager(gpu: u32, host: u32) -> KvCacheManager {
    let host = if host > 0 { vec![host] } else { vec![] };
    let opts = ManagerOptions {
        max_util_for_resume: 1.0,
        ..Default::default()
    };
    KvCacheManager::new(
        plan(),
        TierSlots {
            gpu: vec![gpu],
            host,
        },
        opts,
    )
    .unwrap()
}

fn limits(draft_tokens: u32) -> SchedulerLimits {
    SchedulerLimits {
        max_num_sequences: 8,
        max_num_tokens: 16,
        max_prefill_chunk: 6,
        max_seq_len: 64,
        draft_tokens,
        livelock_steps: 50,
        max_context_kv_tokens: 256,
        transfer_lease: std::time::Duration::from_secs(30),
    }
}

fn req(id: u64, prompt: Vec<u32>, max_new: u32) -> SubmitRequest {
    SubmitRequest {
        id: RequestId(id),
        scope: ReuseScope::SHARED,
        prompt: prompt.into_iter().map(TokenId).collect(),
        max_new_tokens: max_new,
        priority: 35,
    }
}

/// Runs steps until every request finished; returns the finished requests and the
/// number of steps.
fn drive(s: &mut Scheduler, seed: u64, max_steps: usize) -> (Vec<Finished>, usize) {
    let mut rng = seed;
    let mut next = || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 33) as u32
    };
    let mut done = Vec::new();
    for step in 0..max_steps {
        if s.num_active() == 0 {
            return (done, step);
        }
        let drafts: HashMap<RequestId, Vec<TokenId>> = (1..=20)
            .map(|i| (RequestId(i), vec![TokenId(next() % 7), TokenId(next() % 7)]))
            .collect();
        let plan = s.schedule(&drafts).unwrap();
        s.complete(plan.target_fence, plan.draft_fence).unwrap();
        let outcomes: Vec<RequestOutcome> = plan
            .requests
            .iter()
            .map(|p| RequestOutcome {
                id: p.id,
                accepted_drafts: if p.num_drafts > 0 {
                    next() % (p.num_drafts + 1)
                } else {
                    0
                },
                next_token: Some(TokenId(next() % 7)),
            })
            .collect();
        if plan.requests.is_empty() {
            continue;
        }
        let finished = s.commit(&outcomes).unwrap();
        let ids: Vec<RequestId> = finished.iter().map(|f| f.id).collect();
        s.finalize(&ids).unwrap();
        done.extend(finished);
        s.target().check_invariants();
        if let Some(d) = s.draft() {
            d.check_invariants();
            assert_eq!(
                d.occupied_slots(Tier::Gpu),
                s.target().occupied_slots(Tier::Gpu),
                "draft mirrors target"
            );
        }
    }
    panic!("not finished after {max_steps} steps");
}

#[test]
fn everything_finishes_under_pressure_with_suspension() {
    let mut s = Scheduler::new(manager(10, 16), None, limits(0));
    let sys: Vec<u32> = (100..108).collect();
    let prompt = |i: u64| {
        let mut p = sys.clone();
        p.extend([i as u32, 1, 2]);
        p
    };
    // A first request caches the system prompt; the next seven reuse it.
    s.submit(req(1, prompt(1), 6)).unwrap();
    let (mut done, _) = drive(&mut s, 1, 100);
    for i in 2..=8u64 {
        assert_eq!(
            s.submit(req(i, prompt(i), 5 + i as u32)).unwrap(),
            8,
            "probe sees the cached prompt"
        );
    }
    let (more, steps) = drive(&mut s, 1, 500);
    done.extend(more);
    assert_eq!(done.len(), 8);
    for f in &done {
        assert_eq!(f.generated, 5 + f.id.get() as u32);
        // Prompt + every committed output: generated − 1 (the last sampled token has no KV).
        assert_eq!(f.tokens.len() as u32, 11 + f.generated - 1);
    }
    let st = s.stats();
    assert_eq!((st.submitted, st.finished, st.failed), (8, 8, 0));
    assert!(
        st.preemptions > 0,
        "10 GPU blocks for 8 requests must preempt"
    );
    assert!(s.target().stats().offloaded_pages > 0);
    assert!(
        s.target().stats().reused_tokens > 0,
        "the shared system prompt is reused"
    );
    assert!(steps > 0);
    // Nothing leaks: only cached blocks hold pages, nothing is locked or held.
    let m = s.target();
    assert_eq!(m.num_sequences(), 0);
    assert_eq!(m.num_pages(), m.num_cached_blocks());
}

#[test]
fn recompute_preemption_without_a_host_tier() {
    let mut s = Scheduler::new(manager(9, 0), None, limits(0));
    for i in 1..=6u64 {
        s.submit(req(i, vec![i as u32 * 10, 1, 2, 3, 4, 5, 6], 9))
            .unwrap();
    }
    let (done, _) = drive(&mut s, 2, 1000);
    assert_eq!(done.len(), 6);
    assert!(s.stats().preemptions > 0);
    assert_eq!(s.target().stats().offloaded_pages, 0);
    let m = s.target();
    assert_eq!(m.num_pages(), m.num_cached_blocks());
    for f in done {
        assert_eq!(f.generated, 9);
    }
}

#[test]
fn draft_cache_mirrors_and_rejected_drafts_roll_back() {
    let mut s = Scheduler::new(manager(16, 16), Some(manager(16, 16)), limits(2));
    for i in 1..=5u64 {
        s.submit(req(i, (0..7).map(|t| t + i as u32).collect(), 12))
            .unwrap();
    }
    let (done, _) = drive(&mut s, 3, 500);
    assert_eq!(done.len(), 5);
    let st = s.stats();
    assert!(st.drafts_proposed > 0 && st.drafts_accepted < st.drafts_proposed);
    for f in &done {
        // Rejected drafts never became tokens: only the committed ones did.
        assert!(f.generated >= 12);
        assert_eq!(
            f.draft_block_slots.as_ref().map(Vec::len),
            Some(f.block_slots.len())
        );
    }
}

#[test]
fn protocol_errors_change_nothing() {
    let mut s = Scheduler::new(manager(16, 0), None, limits(0));
    assert!(matches!(
        s.submit(req(1, vec![], 3)),
        Err(SchedError::EmptyPrompt { .. })
    ));
    assert!(matches!(
        s.submit(req(1, vec![1], 0)),
        Err(SchedError::NoOutput { .. })
    ));
    assert!(matches!(
        s.submit(req(1, vec![1; 60], 10)),
        Err(SchedError::TooLong { .. })
    ));
    s.submit(req(1, vec![1, 2, 3], 2)).unwrap();
    assert!(matches!(
        s.submit(req(1, vec![1], 1)),
        Err(SchedError::Kv(KvError::DuplicateRequest { .. }))
    ));
    assert!(matches!(
        s.submit(SubmitRequest {
            priority: 101,
            ..req(2, vec![1], 1)
        }),
        Err(SchedError::Kv(KvError::InvalidOption {
            field: "priority",
            ..
        }))
    ));
    assert_eq!(s.commit(&[]), Err(SchedError::NothingToCommit));
    let plan = s.schedule(&HashMap::new()).unwrap();
    assert_eq!(plan.requests.len(), 1);
    assert_eq!(plan.requests[0].tokens.len(), 3);
    assert!(matches!(
        s.schedule(&HashMap::new()),
        Err(SchedError::StepNotCommitted { .. })
    ));
    // The last prefill chunk produces a token: it is required.
    assert!(matches!(s.commit(&[]), Err(SchedError::BadOutcome { .. })));
    assert!(matches!(
        s.commit(&[RequestOutcome {
            id: RequestId(9),
            accepted_drafts: 0,
            next_token: None
        }]),
        Err(SchedError::NotInStep { .. })
    ));
    assert!(matches!(
        s.cancel(RequestId(1)),
        Err(SchedError::BadOutcome { .. })
    ));
    s.commit(&[RequestOutcome {
        id: RequestId(1),
        accepted_drafts: 0,
        next_token: Some(TokenId(4)),
    }])
    .unwrap();
    s.cancel(RequestId(1)).unwrap();
    assert_eq!(s.stats().failed, 1);
    assert!(matches!(
        s.cancel(RequestId(1)),
        Err(SchedError::Kv(KvError::UnknownRequest { .. }))
    ));
}

#[test]
fn a_request_that_can_never_fit_is_refused_at_submit_and_the_rest_go_on() {
    let mut l = limits(0);
    l.max_prefill_chunk = 64;
    l.max_num_tokens = 64;
    let mut s = Scheduler::new(manager(4, 0), None, l);
    let e = s.submit(req(1, (0..30).collect(), 2)).unwrap_err(); // 8 blocks > 4
    assert!(
        matches!(
            e,
            SchedError::ExceedsCache {
                capacity: 16,
                prompt: 30,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(s.num_active(), 0, "nothing was admitted");
    s.submit(req(2, vec![5, 6], 2)).unwrap();
    let plan = s.schedule(&HashMap::new()).unwrap();
    assert!(plan.failed.is_empty());
    assert_eq!(plan.requests.len(), 1);
}

#[test]
fn livelock_is_reported() {
    // A decode step needs 1 + 2 draft tokens but the step budget is 1 token: after the
    // prompt is prefilled one token per step, nothing can ever be scheduled.
    let mut l = limits(2);
    l.max_num_tokens = 1;
    l.livelock_steps = 5;
    let mut s = Scheduler::new(manager(8, 0), None, l);
    s.submit(req(1, vec![1, 2, 3], 4)).unwrap();
    let drafts: HashMap<RequestId, Vec<TokenId>> =
        [(RequestId(1), vec![TokenId(5), TokenId(6)])].into();
    let mut stalled = 0;
    let err = loop {
        match s.schedule(&drafts) {
            Ok(p) if p.requests.is_empty() => stalled += 1,
            Ok(p) => {
                assert_eq!(p.requests[0].tokens.len(), 1);
                let o = RequestOutcome {
                    id: RequestId(1),
                    accepted_drafts: 0,
                    next_token: Some(TokenId(9)),
                };
                s.commit(&[o]).unwrap();
            }
            Err(e) => break e,
        }
    };
    assert_eq!(stalled, 4);
    assert_eq!(
        err,
        SchedError::Livelock {
            steps: 5,
            waiting: 1,
            smallest_blocks: 1,
            capacity: 8
        }
    );
    assert!(err
        .to_string()
        .contains("no request could be scheduled for 5 consecutive steps"));
}

#[test]
fn paused_requests_wait_until_resumed() {
    let mut s = Scheduler::new(manager(16, 16), None, limits(0));
    s.submit(req(1, vec![1, 2, 3], 3)).unwrap();
    s.submit(req(2, vec![4, 5, 6], 3)).unwrap();
    s.pause(RequestId(2)).unwrap();
    let p = s.schedule(&HashMap::new()).unwrap();
    assert_eq!(
        p.requests.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![RequestId(1)]
    );
    s.commit(&[RequestOutcome {
        id: RequestId(1),
        accepted_drafts: 0,
        next_token: Some(TokenId(1)),
    }])
    .unwrap();
    // Pausing a running request suspends it; its pages stay held.
    s.pause(RequestId(1)).unwrap();
    assert_eq!(s.status(RequestId(1)), Some(SeqStatus::Suspended));
    assert!(s.schedule(&HashMap::new()).unwrap().requests.is_empty());
    s.resume(RequestId(1)).unwrap();
    s.resume(RequestId(2)).unwrap();
    let p = s.schedule(&HashMap::new()).unwrap();
    assert_eq!(p.requests.len(), 2);
    assert!(p.resumed.contains(&RequestId(1)));
    assert!(matches!(
        s.pause(RequestId(1)),
        Err(SchedError::BadOutcome { .. })
    ));
    assert!(matches!(
        s.pause(RequestId(9)),
        Err(SchedError::Kv(KvError::UnknownRequest { .. }))
    ));
}

#[test]
fn reset_prefix_cache_clears_both_caches_and_is_refused_while_requests_hold_pages() {
    let mut s = Scheduler::new(manager(16, 16), Some(manager(16, 16)), limits(0));
    let prompt: Vec<u32> = (0..9).collect();
    s.submit(req(1, prompt.clone(), 3)).unwrap();
    let (done, _) = drive(&mut s, 4, 100);
    assert_eq!(done[0].reused_tokens, 0);
    // Prompt + 2 committed outputs = 11 tokens: 2 full blocks + a partial one.
    assert_eq!(s.target().num_cached_blocks(), 3);
    assert_eq!(s.draft().unwrap().num_cached_blocks(), 3);
    s.take_events();
    // A request in the step in flight holds pages: refused, neither cache changes.
    assert_eq!(s.submit(req(2, prompt.clone(), 3)).unwrap(), 8);
    let plan = s.schedule(&HashMap::new()).unwrap();
    assert_eq!(plan.requests[0].num_cached, 8);
    let before = (s.target().fingerprint(), s.draft().unwrap().fingerprint());
    let err = s.reset_prefix_cache().unwrap_err();
    assert_eq!(err, SchedError::PrefixCacheInUse { requests: 1 });
    assert!(err.to_string().starts_with(
        "cannot reset the prefix cache: 1 request(s) hold KV pages (running, in the step in flight"
    ));
    assert_eq!(
        (s.target().fingerprint(), s.draft().unwrap().fingerprint()),
        before
    );
    s.complete(plan.target_fence, plan.draft_fence).unwrap();
    s.commit(&[RequestOutcome {
        id: RequestId(2),
        accepted_drafts: 0,
        next_token: Some(TokenId(3)),
    }])
    .unwrap();
    let (done, _) = drive(&mut s, 5, 100);
    assert_eq!(done[0].reused_tokens, 8);
    // Request 2's partial tail differs from request 1's: 2 full blocks + 2 partial ones.
    assert_eq!(s.target().num_cached_blocks(), 4);
    s.take_events();
    // A request waiting without pages does not block the reset.
    s.submit(req(3, prompt.clone(), 3)).unwrap();
    assert_eq!(
        s.reset_prefix_cache(),
        Ok(ResetReport {
            blocks: 4,
            gpu_pages: 4,
            host_pages: 0
        })
    );
    assert_eq!(s.take_events(), vec![KvEvent::AllBlocksCleared]);
    for m in [s.target(), s.draft().unwrap()] {
        assert_eq!((m.num_cached_blocks(), m.num_pages()), (0, 0));
        assert_eq!(m.occupied_slots(Tier::Gpu), vec![0]);
        assert_eq!(m.occupied_slots(Tier::Host), vec![0]);
        m.check_invariants();
    }
    // The waiting request prefills from nothing.
    let (done, _) = drive(&mut s, 6, 100);
    assert_eq!((done[0].id, done[0].reused_tokens), (RequestId(3), 0));
}

#[test]
fn reset_prefix_cache_changes_neither_cache_when_one_refuses() {
    // The draft cache holds pages of a sequence the scheduler does not own (a stand-in
    // for any divergence): the target must not be reset alone.
    let mut target = manager(16, 0);
    let mut draft = manager(16, 0);
    for m in [&mut target, &mut draft] {
        let mut h = m
            .create(
                RequestId(1),
                ReuseScope::SHARED,
                &[TokenId(1); 8],
                SeqOptions::default(),
            )
            .unwrap()
            .handle;
        assert!(m.resume(&h).unwrap());
        assert!(m.resize(&h, 8, 0).unwrap());
        m.commit(&h, &[TokenId(1); 8]).unwrap();
        m.close(&mut h).unwrap();
    }
    let stray = draft
        .create(
            RequestId(2),
            ReuseScope::SHARED,
            &[TokenId(1); 5],
            SeqOptions::default(),
        )
        .unwrap()
        .handle;
    std::mem::forget(stray);
    let mut s = Scheduler::new(target, Some(draft), limits(0));
    s.take_events();
    let before = (s.target().fingerprint(), s.draft().unwrap().fingerprint());
    assert_eq!(
        s.reset_prefix_cache(),
        Err(SchedError::Kv(KvError::PrefixCacheInUse { sequences: 1 }))
    );
    assert_eq!(
        (s.target().fingerprint(), s.draft().unwrap().fingerprint()),
        before
    );
    assert_eq!(s.target().num_cached_blocks(), 2);
    assert_eq!(s.take_events(), vec![]);
}

/// A scheduler that takes each plan back ([`Scheduler::recycle`]) plans exactly what one
/// that drops them plans: prefill chunks, decode steps with drafts, preemption and
/// resumption under pressure, the mirrored draft cache.
#[test]
fn recycled_plans_change_nothing() {
    let build = || {
        let mut s = Scheduler::new(manager(12, 16), Some(manager(12, 16)), limits(2));
        for i in 1..=7u64 {
            s.submit(req(i, (0..9).map(|t| t * 3 + i as u32).collect(), 10))
                .unwrap();
        }
        s
    };
    let (mut plain, mut recycling) = (build(), build());
    let mut rng = 7u64;
    let mut next = || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 33) as u32
    };
    let mut steps = 0;
    while plain.num_active() > 0 {
        steps += 1;
        assert!(steps < 1000, "not finished");
        let drafts: HashMap<RequestId, Vec<TokenId>> = (1..=7)
            .map(|i| (RequestId(i), vec![TokenId(next() % 5), TokenId(next() % 5)]))
            .collect();
        let a = plain.schedule(&drafts).unwrap();
        let b = recycling.schedule(&drafts).unwrap();
        assert_eq!(a, b, "step {steps}");
        for s in [&mut plain, &mut recycling] {
            s.complete(a.target_fence, a.draft_fence).unwrap();
        }
        let outcomes: Vec<RequestOutcome> = a
            .requests
            .iter()
            .map(|p| RequestOutcome {
                id: p.id,
                accepted_drafts: next() % (p.num_drafts + 1),
                next_token: Some(TokenId(next() % 5)),
            })
            .collect();
        if a.requests.is_empty() {
            continue;
        }
        let fa = plain.commit(&outcomes).unwrap();
        let fb = recycling.commit(&outcomes).unwrap();
        assert_eq!(fa, fb);
        let ids: Vec<RequestId> = fa.iter().map(|f| f.id).collect();
        plain.finalize(&ids).unwrap();
        recycling.finalize(&ids).unwrap();
        drop(a);
        recycling.recycle(b);
        let (tokens, cap) = recycling.spare_counts();
        assert!(tokens <= cap);
    }
    assert_eq!(recycling.num_active(), 0);
    assert!(plain.stats().preemptions > 0, "the pressure preempted");
    assert_eq!(plain.stats(), recycling.stats());
    let (tokens, _) = recycling.spare_counts();
    assert!(tokens > 0, "buffers were kept for reuse");
}

/// Imports and exports with a separate draft cache under memory pressure: the draft
/// cache mirrors every decision (refusals included), and the two caches stay equal.
#[test]
fn transfers_keep_the_draft_cache_in_lockstep() {
    let mirror = |s: &Scheduler| {
        let d = s.draft().expect("draft");
        s.target().check_invariants();
        d.check_invariants();
        assert_eq!(
            d.occupied_slots(Tier::Gpu),
            s.target().occupied_slots(Tier::Gpu)
        );
        assert_eq!(
            d.occupied_slots(Tier::Host),
            s.target().occupied_slots(Tier::Host)
        );
        assert_eq!(d.cached_blocks().len(), s.target().cached_blocks().len());
    };
    let mut s = Scheduler::new(manager(8, 8), Some(manager(8, 8)), limits(0));
    // Fill the GPU with cached blocks (two 16-token requests = 8 blocks).
    for i in 0..2 {
        s.submit(req(i, (i as u32 * 100..i as u32 * 100 + 16).collect(), 1))
            .unwrap();
    }
    drive(&mut s, 1, 100);
    mirror(&s);
    let toks = |r: std::ops::Range<u32>| r.map(TokenId).collect::<Vec<_>>();
    let keys = s.block_keys(ReuseScope::SHARED, &toks(500..508));
    // Room needs offloads whose copies no step has run: both caches refuse, both keep
    // the offloads they planned.
    let r = s
        .begin_import(
            RequestId(50),
            ReuseScope::SHARED,
            &toks(500..508),
            &keys,
            Instant::now(),
        )
        .unwrap();
    assert!(r.is_none());
    mirror(&s);
    // A step runs the copies; now both reserve the same slots.
    let plan = s.schedule(&HashMap::new()).unwrap();
    s.complete(plan.target_fence, plan.draft_fence).unwrap();
    let r = s
        .begin_import(
            RequestId(50),
            ReuseScope::SHARED,
            &toks(500..508),
            &keys,
            Instant::now(),
        )
        .unwrap()
        .expect("room after the copies ran");
    assert_eq!(r.blocks.len(), 2);
    for b in &r.blocks {
        assert_eq!(b.target[0].slot, b.draft[0].slot);
    }
    mirror(&s);
    // The id is taken while the import lives.
    assert!(s.submit(req(50, vec![1, 2, 3], 1)).is_err());
    assert_eq!(s.commit_import(RequestId(50), Instant::now()).unwrap(), 2);
    mirror(&s);
    let exported = s
        .export_blocks(
            RequestId(51),
            ReuseScope::SHARED,
            &toks(500..508),
            Instant::now(),
        )
        .unwrap();
    assert_eq!(exported.len(), 2);
    assert!(exported.iter().all(|b| b.draft.len() == 1));
    s.close_transfer(RequestId(51)).unwrap();
    assert!(s.close_transfer(RequestId(51)).is_err());
    assert_eq!(s.num_transfers(), 0);
    mirror(&s);
}

/// Leases: an export and an import left alone are closed when their lease ends (the
/// export's pins released, the import's pages freed, nothing of it in the tree), their
/// ids answer `TransferExpired`, a renewal moves the end, and the counts are reported.
#[test]
fn transfers_expire_at_the_end_of_their_lease() {
    let lease = Duration::from_secs(30);
    let mut s = Scheduler::new(manager(8, 8), Some(manager(8, 8)), limits(0));
    assert_eq!(s.transfer_lease(), lease);
    s.submit(req(1, (0..16).collect(), 1)).unwrap();
    drive(&mut s, 1, 100);
    let toks = |r: std::ops::Range<u32>| r.map(TokenId).collect::<Vec<_>>();
    let t0 = Instant::now();
    let used0 = s.target().occupied_slots(Tier::Gpu)[0];
    let exported = s
        .export_blocks(RequestId(10), ReuseScope::SHARED, &toks(0..16), t0)
        .unwrap();
    assert_eq!(exported.len(), 4, "16 tokens in 4-token blocks");
    let keys = s.block_keys(ReuseScope::SHARED, &toks(500..508));
    let r = s
        .begin_import(
            RequestId(11),
            ReuseScope::SHARED,
            &toks(500..508),
            &keys,
            t0,
        )
        .unwrap()
        .expect("room");
    assert_eq!(
        (r.expires, r.write_by),
        (t0 + lease, t0 + lease - TRANSFER_DRAIN)
    );
    assert_eq!(s.target().occupied_slots(Tier::Gpu)[0], used0 + 2);
    // Renewing the export at t0 + 20 s moves its end to t0 + 50 s.
    let later = t0 + Duration::from_secs(20);
    assert_eq!(
        s.renew_transfer(RequestId(10), later).unwrap(),
        later + lease
    );
    assert_eq!(
        s.transfer_stats(),
        TransferStats {
            open_exports: 1,
            open_imports: 1,
            expired_exports: 0,
            expired_imports: 0
        }
    );
    // Just before the import's end nothing expires; at it, the import goes.
    let e = s
        .expire_transfers(t0 + lease - Duration::from_millis(1))
        .unwrap();
    assert_eq!(e, ExpiredTransfers::default());
    let e = s.expire_transfers(t0 + lease).unwrap();
    assert_eq!((e.exports, e.imports), (vec![], vec![RequestId(11)]));
    assert_eq!(
        s.target().occupied_slots(Tier::Gpu)[0],
        used0,
        "the import's pages are free"
    );
    assert_eq!(
        s.probe_reuse(ReuseScope::SHARED, &toks(500..509)).unwrap(),
        0
    );
    assert_eq!(
        s.commit_import(RequestId(11), t0 + lease),
        Err(SchedError::TransferExpired { id: RequestId(11) })
    );
    assert_eq!(
        s.close_transfer(RequestId(11)),
        Err(SchedError::TransferExpired { id: RequestId(11) })
    );
    // A commit that comes after its end expires it then and is refused the same way.
    let r = s
        .begin_import(
            RequestId(12),
            ReuseScope::SHARED,
            &toks(500..508),
            &keys,
            t0,
        )
        .unwrap()
        .expect("room");
    assert_eq!(r.blocks.len(), 2);
    assert_eq!(
        s.commit_import(RequestId(12), t0 + lease + Duration::from_secs(1)),
        Err(SchedError::TransferExpired { id: RequestId(12) })
    );
    // The renewed export outlives them, then goes at its new end.
    let e = s.expire_transfers(later + lease).unwrap();
    assert_eq!(e.exports, vec![RequestId(10)]);
    assert_eq!(
        s.renew_transfer(RequestId(10), later + lease),
        Err(SchedError::TransferExpired { id: RequestId(10) })
    );
    assert_eq!(
        s.transfer_stats(),
        TransferStats {
            open_exports: 0,
            open_imports: 0,
            expired_exports: 1,
            expired_imports: 2
        }
    );
    assert_eq!(s.num_transfers(), 0);
    s.target().check_invariants();
    s.draft().unwrap().check_invariants();
    // An expired id is free again.
    s.export_blocks(
        RequestId(10),
        ReuseScope::SHARED,
        &toks(0..16),
        later + lease,
    )
    .unwrap();
    s.close_transfer(RequestId(10)).unwrap();
}

/// The rows a plan carries are the managers' block tables, and their stamps are true: a
/// consumer that keeps each request's row and rewrites only from
/// [`RowStamp::rewrite_from`] holds exactly the plan's row after every step. Under
/// pressure (suspend with a host tier, recompute without), with drafts of random
/// acceptance and a mirrored draft cache, while plans are recycled at once, one step
/// later, or two (both of a request's buffers shared).
#[test]
fn plan_rows_are_the_tables_and_their_stamps_replay_them() {
    for (host, with_draft) in [(16, true), (0, false), (16, false)] {
        let mut s = Scheduler::new(
            manager(12, host),
            with_draft.then(|| manager(12, host)),
            limits(2),
        );
        for i in 1..=7u64 {
            s.submit(req(i, (0..9).map(|t| t * 3 + i as u32).collect(), 14))
                .unwrap();
        }
        let mut rng = 11u64;
        let mut next = || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (rng >> 33) as u32
        };
        // Per request and row kind: the version held and the row.
        let mut held: HashMap<(RequestId, bool), (u64, Vec<i32>)> = HashMap::new();
        let mut kept: Vec<(u32, StepPlan)> = Vec::new();
        let (mut rewritten, mut columns, mut steps) = (0usize, 0usize, 0);
        while s.num_active() > 0 {
            steps += 1;
            assert!(steps < 2000, "not finished");
            let drafts: HashMap<RequestId, Vec<TokenId>> = (1..=7)
                .map(|i| (RequestId(i), vec![TokenId(next() % 5), TokenId(next() % 5)]))
                .collect();
            let plan = s.schedule(&drafts).unwrap();
            s.complete(plan.target_fence, plan.draft_fence).unwrap();
            for p in &plan.requests {
                let (target, draft) = s.tables_of(p.id);
                assert_eq!(p.block_slots, target, "step {steps}: {:?}", p.id);
                assert_eq!(p.draft_block_slots.as_ref().map(|r| r.to_vec()), draft);
                let rows = std::iter::once((false, &p.block_slots))
                    .chain(p.draft_block_slots.as_ref().map(|r| (true, r)));
                for (is_draft, row) in rows {
                    let (version, copy) = held.entry((p.id, is_draft)).or_default();
                    let st = row.stamp();
                    assert_ne!(st.version, 0, "the scheduler's rows are versioned");
                    let from = st.rewrite_from(*version, row.len());
                    assert!(from <= copy.len() || from == 0, "step {steps}");
                    copy.truncate(from);
                    copy.extend_from_slice(&row[from..]);
                    assert_eq!(
                        copy[..],
                        row[..],
                        "step {steps}: {:?} draft {is_draft}",
                        p.id
                    );
                    rewritten += row.len() - from;
                    columns += row.len();
                    *version = st.version;
                }
            }
            let outcomes: Vec<RequestOutcome> = plan
                .requests
                .iter()
                .map(|p| RequestOutcome {
                    id: p.id,
                    accepted_drafts: next() % (p.num_drafts + 1),
                    next_token: Some(TokenId(next() % 5)),
                })
                .collect();
            if !plan.requests.is_empty() {
                let done = s.commit(&outcomes).unwrap();
                let ids: Vec<RequestId> = done.iter().map(|f| f.id).collect();
                s.finalize(&ids).unwrap();
            }
            // Plans go back now, after one more step, or after two.
            kept.push((next() % 3, plan));
            let (due, wait): (Vec<_>, Vec<_>) = kept.drain(..).partition(|(n, _)| *n == 0);
            kept = wait.into_iter().map(|(n, p)| (n - 1, p)).collect();
            for (_, p) in due {
                s.recycle(p);
            }
        }
        assert!(s.stats().preemptions > 0, "the pressure preempted");
        // Most of each row was already held: only changed columns were rewritten.
        assert!(
            rewritten * 2 < columns,
            "host {host}: rewrote {rewritten} of {columns} columns"
        );
    }
}

/// A prompt longer than the whole GPU pool (even with nothing else running) is refused at
/// submit with a typed error naming what the blocks hold; a request whose outputs would
/// outgrow the pool is admitted (it could stop early) and fails with a typed reason in
/// the plan, once, when it grows past it; the next steps go on without it and the
/// others finish.
#[test]
fn a_request_longer_than_the_pool_is_refused_or_fails_once_and_leaves() {
    // 5 GPU blocks of 4 tokens: 20 tokens at most.
    let mut s = Scheduler::new(manager(5, 0), None, limits(0));
    let e = s.submit(req(9, (0..30).collect(), 2)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "request 9: the prompt's 30 tokens exceed the 20 tokens the GPU blocks hold even \
         with nothing else running: give the cache more GPU memory or send a shorter prompt"
    );
    // 18 prompt tokens fit; 18 + 12 outputs do not.
    s.submit(req(1, (0..18).collect(), 12)).unwrap();
    s.submit(req(2, (100..106).collect(), 3)).unwrap();
    let mut failed = Vec::new();
    for _ in 0..80 {
        let plan = s.schedule(&HashMap::new()).unwrap();
        failed.extend(plan.failed.iter().map(|f| f.0));
        if plan.requests.is_empty() {
            if s.num_active() == 0 {
                break;
            }
            continue;
        }
        s.complete(plan.target_fence, plan.draft_fence).unwrap();
        let done = s.commit(&sampled_one_each(&plan)).unwrap();
        let ids: Vec<RequestId> = done.iter().map(|f| f.id).collect();
        s.finalize(&ids).unwrap();
    }
    assert_eq!(failed, vec![RequestId(1)]);
    assert_eq!(s.num_active(), 0, "request 2 finished");
    assert_eq!(s.status(RequestId(1)), None, "the failed request is gone");
    assert_eq!(
        s.status(RequestId(9)),
        None,
        "the refused request was never admitted"
    );
}

/// A request finalized while its step is in flight leaves the plan with a hole: the
/// commit of the others' outcomes (in plan order, and out of it) goes through, and an
/// outcome for the finalized one is a typed error, not a panic.
#[test]
fn a_request_finalized_mid_step_leaves_a_hole_the_commit_skips() {
    for reversed in [false, true] {
        let mut s = Scheduler::new(manager(32, 0), None, limits(0));
        for i in 1..=3u64 {
            s.submit(req(i, (0..5).map(|t| t + 10 * i as u32).collect(), 6))
                .unwrap();
        }
        let plan = s.schedule(&HashMap::new()).unwrap();
        assert_eq!(plan.requests.len(), 3);
        s.complete(plan.target_fence, plan.draft_fence).unwrap();
        let gone = plan.requests[1].id;
        s.finalize(&[gone]).unwrap();
        let mut outcomes = sampled_one_each(&plan);
        if reversed {
            outcomes.reverse();
        }
        assert!(matches!(
            s.commit(&outcomes),
            Err(SchedError::NotInStep { id, .. }) if id == gone
        ));
        outcomes.retain(|o| o.id != gone);
        s.commit(&outcomes).unwrap();
        assert_eq!(s.status(gone), None);
        assert_eq!(s.num_active(), 2);
    }
}

/// Every planned request's outcome: no draft accepted, token 1 sampled.
fn sampled_one_each(plan: &StepPlan) -> Vec<RequestOutcome> {
    plan.requests
        .iter()
        .map(|p| RequestOutcome {
            id: p.id,
            accepted_drafts: 0,
            next_token: Some(TokenId(1)),
        })
        .collect()
}
