use super::*;
use crate::config::V4Spec;
use crate::core::{ManagerOptions, ReuseScope, TierSlots, V4Options, V4Slots};
use crate::layout::V4Plan;
use crate::rng::SplitMix64 as Rng;

fn manager(blocks: u32, windows: [u32; 3]) -> V4CacheManager {
    let spec = V4Spec {
        compress_ratios: vec![0, 4, 128],
        ..V4Spec::flash()
    };
    V4CacheManager::new(
        V4Plan::new(&spec).unwrap(),
        V4Slots {
            blocks: TierSlots {
                gpu: vec![blocks],
                host: vec![],
            },
            windows: windows.to_vec(),
        },
        V4Options {
            blocks: ManagerOptions {
                enable_partial_reuse: false,
                ..ManagerOptions::default()
            },
            ..V4Options::default()
        },
    )
    .unwrap()
}

/// The token a request's "model" puts at position `p` (outputs only).
fn truth(id: RequestId, p: u64) -> TokenId {
    let mut x = id.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ p.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    TokenId((x % 5000) as u32 + 1000)
}

/// A fake forward: drafts are accepted while they equal the truth; the sampled token is
/// the truth after the last kept one; proposals are the truth with probability 0.6 each.
fn outcomes(plan: &V4StepPlan, rng: &mut Rng) -> Vec<V4Outcome> {
    plan.requests
        .iter()
        .map(|p| {
            let mut accepted = 0;
            if p.work == V4Work::Decode {
                for i in 1..p.tokens.len() {
                    if p.tokens[i] != truth(p.id, p.first + i as u64) {
                        break;
                    }
                    accepted += 1;
                }
            }
            let after = p.first + 1 + accepted as u64;
            let after = if p.work == V4Work::Context {
                p.first + p.tokens.len() as u64
            } else {
                after
            };
            let drafts = (0..p.next_drafts as u64)
                .map(|i| {
                    let t = truth(p.id, after + 1 + i);
                    if rng.below(10) < 6 {
                        t
                    } else {
                        TokenId(t.0 + 1)
                    }
                })
                .collect();
            V4Outcome {
                id: p.id,
                accepted_drafts: accepted,
                next_token: p.sample.then(|| truth(p.id, after)),
                drafts: if p.sample { drafts } else { Vec::new() },
            }
        })
        .collect()
}

/// Outcomes that accept no draft, propose none, and sample token 1 where the step
/// samples.
fn no_drafts(plan: &V4StepPlan) -> Vec<V4Outcome> {
    plan.requests
        .iter()
        .map(|p| V4Outcome {
            id: p.id,
            accepted_drafts: 0,
            next_token: p.sample.then_some(TokenId(1)),
            drafts: vec![],
        })
        .collect()
}

/// Every planned request's tokens and tables are what its positions need.
fn check_plan(plan: &V4StepPlan, limits: V4Limits, known: &HashMap<RequestId, Vec<TokenId>>) {
    let total: usize = plan.requests.iter().map(|p| p.tokens.len()).sum();
    assert!(total <= limits.max_num_tokens as usize, "token budget");
    assert!(plan.requests.len() <= limits.max_num_sequences as usize);
    for p in &plan.requests {
        let k = &known[&p.id];
        let first = p.first as usize;
        match p.work {
            V4Work::Context => {
                assert!(p.tokens.len() <= limits.max_prefill_chunk as usize);
                assert_eq!(p.tokens[..], k[first..first + p.tokens.len()], "{}", p.id);
            }
            V4Work::Decode => {
                assert_eq!(p.tokens[0], k[first], "{}: the sampled token", p.id);
                assert_eq!(
                    k.len(),
                    first + 1,
                    "{}: decodes after the last sample",
                    p.id
                );
            }
        }
        let end = p.first + p.tokens.len() as u64;
        assert!(
            p.blocks.len() as u64 >= end.div_ceil(256),
            "{}: blocks",
            p.id
        );
        for (lc, (start, slots)) in p.windows.iter().enumerate() {
            let page = [64u64, 4, 8][lc];
            assert!(*start <= p.first, "{}: ring {lc} starts at {start}", p.id);
            assert!(
                start + slots.len() as u64 * page >= end,
                "{}: ring {lc} ends",
                p.id
            );
        }
    }
}

/// Seeded runs: requests with shared prefixes, chunked prompts, MTP drafts accepted and
/// rejected, a cache small enough to preempt; every request finishes with exactly the
/// tokens its "model" would give it alone, and the bookkeeping holds after every step.
#[test]
fn seeded_runs_finish_with_the_tokens_each_request_would_get_alone() {
    let (mut preemptions, mut reused, mut recomputed) = (0, 0, 0);
    for seed in 0..8u64 {
        let mut rng = Rng(seed);
        let limits = V4Limits {
            max_num_sequences: 1 + rng.below(4) as u32,
            max_num_tokens: 128 + rng.below(400) as u32,
            max_prefill_chunk: 32 + rng.below(300) as u32,
            max_seq_len: 4096,
            draft_tokens: rng.below(4) as u32,
            livelock_steps: 4,
        };
        let mut s = V4Scheduler::new(manager(10, [12, 120, 120]), limits).unwrap();
        let systems: Vec<Vec<TokenId>> = (0..3)
            .map(|k| (0..600).map(|i| TokenId(k * 10_000 + i)).collect())
            .collect();
        let mut known = HashMap::new();
        let mut expect = HashMap::new();
        for r in 0..12u64 {
            let id = RequestId(r);
            let mut prompt = systems[rng.below(3) as usize][..rng.below(600) as usize].to_vec();
            prompt.extend(
                (0..1 + rng.below(400)).map(|i| TokenId(50_000 + 1_000 * r as u32 + i as u32)),
            );
            let max_new = 1 + rng.below(150) as u32;
            let p = prompt.len() as u64;
            expect.insert(
                id,
                (0..u64::from(max_new))
                    .map(|k| truth(id, p + k))
                    .collect::<Vec<_>>(),
            );
            known.insert(id, prompt.clone());
            s.submit(SubmitRequest::new(id, prompt, max_new)).unwrap();
        }
        let mut done = 0;
        while let Some(plan) = s.schedule().unwrap() {
            check_plan(&plan, limits, &known);
            let outs = outcomes(&plan, &mut rng);
            for (p, o) in plan.requests.iter().zip(&outs) {
                let k = known.get_mut(&p.id).unwrap();
                if p.work == V4Work::Decode {
                    k.extend_from_slice(&p.tokens[1..1 + o.accepted_drafts as usize]);
                }
                if p.sample {
                    k.push(o.next_token.unwrap());
                }
            }
            for f in s.commit(&outs).unwrap() {
                assert_eq!(f.output, expect[&f.id], "seed {seed}, request {}", f.id);
                done += 1;
            }
            s.check_invariants();
        }
        assert_eq!(done, 12, "seed {seed}");
        assert_eq!(s.num_unfinished(), 0);
        let st = s.stats();
        preemptions += st.preemptions;
        reused += st.reused_tokens;
        recomputed += st.recomputed_tokens;
    }
    assert!(
        preemptions > 0 && reused > 0 && recomputed > 0,
        "{preemptions} {reused} {recomputed}"
    );
}

/// A bad request or outcome is a typed error and changes nothing.
#[test]
fn bad_requests_and_outcomes_are_refused() {
    let limits = V4Limits {
        draft_tokens: 2,
        ..V4Limits::default()
    };
    let mut s = V4Scheduler::new(manager(10, [12, 120, 120]), limits).unwrap();
    let t = |n: u32| (0..n).map(TokenId).collect::<Vec<_>>();
    let err = |s: &mut V4Scheduler, r| s.submit(r).unwrap_err().to_string();
    assert!(err(&mut s, SubmitRequest::new(RequestId(1), vec![], 4)).contains("empty"));
    assert!(err(&mut s, SubmitRequest::new(RequestId(1), t(4), 0)).contains("at least 1"));
    assert!(err(&mut s, SubmitRequest::new(RequestId(1), t(65_536), 1)).contains("max_seq_len"));
    s.submit(SubmitRequest::new(RequestId(1), t(300), 4))
        .unwrap();
    assert!(err(&mut s, SubmitRequest::new(RequestId(1), t(3), 4)).contains("not finished"));
    assert!(matches!(s.commit(&[]), Err(V4SchedError::NothingToCommit)));
    let plan = s.schedule().unwrap().unwrap();
    assert!(matches!(
        s.schedule(),
        Err(V4SchedError::StepNotCommitted { step: 0 })
    ));
    let good = V4Outcome {
        id: RequestId(1),
        accepted_drafts: 0,
        next_token: Some(TokenId(7)),
        drafts: vec![],
    };
    let bad = [
        vec![],
        vec![V4Outcome {
            id: RequestId(9),
            ..good.clone()
        }],
        vec![V4Outcome {
            accepted_drafts: 1,
            ..good.clone()
        }],
        vec![good.clone(), good.clone()],
    ];
    for b in &bad {
        assert!(
            matches!(s.commit(b), Err(V4SchedError::BadOutcome { .. })),
            "{b:?}"
        );
        assert_eq!(s.pending(), Some(&plan), "nothing committed");
    }
    // The prompt's only chunk samples: no token is refused.
    let none = [V4Outcome {
        next_token: None,
        ..good.clone()
    }];
    assert!(matches!(
        s.commit(&none),
        Err(V4SchedError::BadOutcome { .. })
    ));
    assert!(s.commit(&[good]).unwrap().is_empty());
    s.check_invariants();
    assert!(s.cancel(RequestId(1)).unwrap());
    assert!(!s.cancel(RequestId(1)).unwrap());
    assert_eq!(s.schedule().unwrap(), None);
    s.check_invariants();
    assert!(matches!(
        V4Scheduler::new(
            manager(10, [12, 120, 120]),
            V4Limits {
                draft_tokens: 2048,
                ..limits
            }
        ),
        Err(V4SchedError::Limits(_))
    ));
}

/// A request the cache can never hold, even alone, fails with a reason instead of
/// being preempted and recomputed forever; one whose reused blocks cannot come back to
/// the GPU is reported as a livelock.
#[test]
fn a_request_the_cache_can_never_hold_fails_with_a_reason() {
    let limits = V4Limits {
        livelock_steps: 3,
        max_prefill_chunk: 4096,
        max_num_tokens: 4096,
        ..V4Limits::default()
    };
    // Two window pages: a query past position 128 reads three.
    let mut s = V4Scheduler::new(manager(8, [2, 120, 120]), limits).unwrap();
    // Longer than the 8 GPU blocks hold: refused at once.
    let e = s
        .submit(SubmitRequest::new(
            RequestId(9),
            (0..2100).map(TokenId).collect(),
            1,
        ))
        .unwrap_err();
    assert!(e.to_string().contains("more block slots"), "{e}");
    s.submit(SubmitRequest::new(
        RequestId(1),
        (0..300).map(TokenId).collect(),
        1,
    ))
    .unwrap();
    s.submit(SubmitRequest::new(
        RequestId(2),
        (0..100).map(TokenId).collect(),
        1,
    ))
    .unwrap();
    let mut failed = Vec::new();
    let mut finished = Vec::new();
    for _ in 0..100 {
        let Some(p) = s.schedule().unwrap() else {
            break;
        };
        failed.extend(p.failed.iter().map(|f| (f.id, f.reason.clone())));
        let outs = no_drafts(&p);
        finished.extend(s.commit(&outs).unwrap().into_iter().map(|f| f.id));
        s.check_invariants();
    }
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, RequestId(1));
    assert!(
        failed[0].1.contains("more block or window slots"),
        "{}",
        failed[0].1
    );
    assert_eq!(finished, vec![RequestId(2)], "the other request is served");
    assert_eq!(s.stats().failed, 1);
}

/// `ReuseScope` keeps tenants apart here too.
#[test]
fn scopes_are_kept_apart() {
    let mut s = V4Scheduler::new(manager(10, [12, 120, 120]), V4Limits::default()).unwrap();
    let prompt: Vec<TokenId> = (0..600).map(TokenId).collect();
    for (id, scope) in [
        (1, ReuseScope::SHARED),
        (
            2,
            ReuseScope {
                lora_id: None,
                salt: Some(9),
            },
        ),
        (3, ReuseScope::SHARED),
    ] {
        let mut r = SubmitRequest::new(RequestId(id), prompt.clone(), 1);
        r.scope = scope;
        s.submit(r).unwrap();
        while let Some(plan) = s.schedule().unwrap() {
            let outs = no_drafts(&plan);
            s.commit(&outs).unwrap();
        }
    }
    assert_eq!(
        s.stats().reused_tokens,
        512,
        "only the third request reuses"
    );
}

/// Regression (review): a prompt token past `TokenId::MAX` is refused at submit (it used
/// to wedge every later `schedule` at admission).
#[test]
fn a_prompt_token_out_of_range_is_refused_at_submit() {
    let mut s = V4Scheduler::new(manager(8, [16, 200, 100]), V4Limits::default()).unwrap();
    let mut rng = Rng(1);
    s.submit(SubmitRequest::new(
        RequestId(1),
        (0..10).map(TokenId).collect(),
        20,
    ))
    .unwrap();
    let plan = s.schedule().unwrap().unwrap();
    s.commit(&outcomes(&plan, &mut rng)).unwrap();
    let mut bad: Vec<TokenId> = (0..10).map(TokenId).collect();
    bad[3] = TokenId(u32::MAX);
    let r = s.submit(SubmitRequest::new(RequestId(2), bad, 4));
    let mut errors = 0;
    for _ in 0..20 {
        match s.schedule() {
            Ok(Some(p)) => {
                s.commit(&outcomes(&p, &mut rng)).unwrap();
            }
            Ok(None) => break,
            Err(_) => errors += 1,
        }
    }
    assert!(r
        .unwrap_err()
        .to_string()
        .contains("above the largest token id"));
    assert_eq!(errors, 0, "the others are served");
    assert_eq!(s.num_unfinished(), 0);
}

/// Regression (review): a sampled token past `TokenId::MAX` is a bad outcome, refused
/// before anything is committed (it used to fail every later commit halfway).
#[test]
fn a_sampled_token_out_of_range_is_a_bad_outcome_and_commits_nothing() {
    let mut s = V4Scheduler::new(manager(8, [16, 200, 100]), V4Limits::default()).unwrap();
    let mut rng = Rng(1);
    for id in [1, 2] {
        s.submit(SubmitRequest::new(
            RequestId(id),
            (0..10).map(TokenId).collect(),
            20,
        ))
        .unwrap();
    }
    let plan = s.schedule().unwrap().unwrap();
    let mut outs = outcomes(&plan, &mut rng);
    let i = outs.iter().position(|o| o.id == RequestId(2)).unwrap();
    outs[i].next_token = Some(TokenId(u32::MAX));
    assert!(matches!(
        s.commit(&outs),
        Err(V4SchedError::BadOutcome { .. })
    ));
    assert_eq!(s.pending(), Some(&plan), "nothing committed");
    let mut good = outs.clone();
    good[i].next_token = Some(TokenId(7));
    s.commit(&good).unwrap();
    let mut errs = 0;
    for _ in 0..30 {
        let Some(p) = s.schedule().unwrap() else {
            break;
        };
        if s.commit(&outcomes(&p, &mut rng)).is_err() {
            errs += 1;
        }
        s.check_invariants();
    }
    assert_eq!(errs, 0);
    assert_eq!(s.num_unfinished(), 0, "both requests finished");
}
