//! The one scheduler over a model with sliding windows (DeepSeek-V4's cache: compressed
//! blocks + window rings with tails): admission at the deepest tail, chunked prefill,
//! MTP drafts capped by what is left to generate, preemption by recompute (a windowed
//! sequence cannot be suspended), and the page tables every plan carries.

use std::collections::HashMap;
use std::time::Duration;

use super::scheduler::*;
use super::*;
use crate::config::V4Spec;
use crate::ids::{RequestId, TokenId};
use crate::layout::V4Plan;
use crate::rng::SplitMix64 as Rng;

fn cache(blocks: u32, windows: [u32; 3], host: u32) -> ModelCache {
    let spec = V4Spec {
        compress_ratios: vec![0, 4, 128],
        ..V4Spec::flash()
    };
    ModelCache::windowed(
        &V4Plan::new(&spec).unwrap(),
        WindowedSlots {
            blocks: TierSlots {
                gpu: vec![blocks],
                host: if host > 0 { vec![host] } else { vec![] },
            },
            windows: windows.to_vec(),
        },
        ManagerOptions {
            enable_partial_reuse: false,
            ..ManagerOptions::default()
        },
        16,
    )
    .unwrap()
}

fn limits(seqs: u32, tokens: u32, chunk: u32, drafts: u32) -> SchedulerLimits {
    SchedulerLimits {
        max_num_sequences: seqs,
        max_num_tokens: tokens,
        max_prefill_chunk: chunk,
        max_seq_len: 4096,
        draft_tokens: drafts,
        livelock_steps: 4,
        max_context_kv_tokens: 1 << 20,
        transfer_lease: Duration::from_secs(60),
    }
}

/// The token a request's "model" puts at position `p` (outputs only).
fn truth(id: RequestId, p: u64) -> TokenId {
    let mut x = id.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ p.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    TokenId((x % 5000) as u32 + 1000)
}

/// A fake forward: drafts are accepted while they equal the truth; the sampled token is
/// the truth after the last kept one; proposals (at most `next_drafts`) are the truth
/// with probability 0.6 each.
fn forward(
    plan: &StepPlan,
    rng: &mut Rng,
) -> (Vec<RequestOutcome>, HashMap<RequestId, Vec<TokenId>>) {
    let mut proposals = HashMap::new();
    let outcomes = plan
        .requests
        .iter()
        .map(|p| {
            let first = u64::from(p.num_cached);
            let mut accepted = 0;
            if p.kind == RequestKind::Generation {
                for i in 1..p.tokens.len() {
                    if p.tokens[i] != truth(p.id, first + i as u64) {
                        break;
                    }
                    accepted += 1;
                }
            }
            let after = match p.kind {
                RequestKind::Context => first + p.tokens.len() as u64,
                RequestKind::Generation => first + 1 + accepted as u64,
            };
            if p.produces_token {
                let drafts: Vec<TokenId> = (0..u64::from(p.next_drafts))
                    .map(|i| {
                        let t = truth(p.id, after + 1 + i);
                        if rng.below(10) < 6 {
                            t
                        } else {
                            TokenId(t.0 + 1)
                        }
                    })
                    .collect();
                proposals.insert(p.id, drafts);
            }
            RequestOutcome {
                id: p.id,
                accepted_drafts: accepted,
                next_token: p.produces_token.then(|| truth(p.id, after)),
            }
        })
        .collect();
    (outcomes, proposals)
}

/// Every planned request's tokens and tables are what its positions need.
fn check_plan(plan: &StepPlan, l: SchedulerLimits, known: &HashMap<RequestId, Vec<TokenId>>) {
    let total: usize = plan.requests.iter().map(|p| p.tokens.len()).sum();
    assert!(total <= l.max_num_tokens as usize, "token budget");
    assert!(plan.requests.len() <= l.max_num_sequences as usize);
    for p in &plan.requests {
        let k = &known[&p.id];
        let first = p.num_cached as usize;
        match p.kind {
            RequestKind::Context => {
                assert!(p.tokens.len() <= l.max_prefill_chunk as usize);
                assert_eq!(p.tokens[..], k[first..first + p.tokens.len()], "{}", p.id);
            }
            RequestKind::Generation => {
                assert_eq!(p.tokens[0], k[first], "{}: the sampled token", p.id);
                assert_eq!(
                    k.len(),
                    first + 1,
                    "{}: decodes after the last sample",
                    p.id
                );
            }
        }
        let end = first as u64 + p.tokens.len() as u64;
        assert!(
            p.block_slots.len() as u64 >= end.div_ceil(256),
            "{}: blocks",
            p.id
        );
        assert_eq!(p.window_tables.len(), 3, "{}: one table per ring", p.id);
        for (lc, (start, slots)) in p.window_tables.iter().enumerate() {
            let page = [64u64, 4, 8][lc];
            assert!(
                *start <= first as u64,
                "{}: ring {lc} starts at {start}",
                p.id
            );
            assert!(
                start + slots.len() as u64 * page >= end,
                "{}: ring {lc} ends",
                p.id
            );
        }
    }
}

/// Seeded runs: requests with shared prefixes, chunked prompts, MTP drafts accepted and
/// rejected, a cache small enough to preempt (by recompute: a host tier is there, but
/// windowed sequences cannot be suspended); every request finishes with exactly the
/// tokens its "model" would give it alone (never more than it asked for), and the
/// bookkeeping holds after every step.
#[test]
fn seeded_runs_finish_with_the_tokens_each_request_would_get_alone() {
    let (mut preemptions, mut reused, mut recomputed) = (0, 0, 0);
    for seed in 0..8u64 {
        let mut rng = Rng(seed);
        let l = limits(
            1 + rng.below(4) as u32,
            128 + rng.below(400) as u32,
            32 + rng.below(300) as u32,
            rng.below(4) as u32,
        );
        let host = if seed % 2 == 0 { 0 } else { 16 };
        let mut s = Scheduler::new(cache(10, [12, 120, 120], host), None, l);
        let systems: Vec<Vec<TokenId>> = (0..3)
            .map(|k| (0..600).map(|i| TokenId(k * 10_000 + i)).collect())
            .collect();
        let mut known = HashMap::new();
        let mut expect = HashMap::new();
        let mut prompts = HashMap::new();
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
            prompts.insert(id, prompt.len());
            s.submit(SubmitRequest::new(id, prompt, max_new)).unwrap();
        }
        let mut done = 0;
        let mut drafts = HashMap::new();
        let mut steps = 0;
        while s.num_active() > 0 {
            steps += 1;
            assert!(steps < 10_000, "seed {seed}: no progress");
            let plan = s.schedule(&drafts).unwrap();
            check_plan(&plan, l, &known);
            preemptions += plan.preempted.len();
            if plan.requests.is_empty() {
                continue;
            }
            s.complete(plan.target_fence, plan.draft_fence).unwrap();
            let (outs, proposals) = forward(&plan, &mut rng);
            for (p, o) in plan.requests.iter().zip(&outs) {
                let k = known.get_mut(&p.id).unwrap();
                if p.kind == RequestKind::Generation {
                    k.extend_from_slice(&p.tokens[1..1 + o.accepted_drafts as usize]);
                }
                if let Some(t) = o.next_token {
                    k.push(t);
                }
            }
            drafts = proposals;
            let finished = s.commit(&outs).unwrap();
            for f in &finished {
                let out = &known[&f.id][prompts[&f.id]..];
                assert_eq!(out, expect[&f.id], "seed {seed}, request {}", f.id);
                assert_eq!(f.generated as usize, out.len());
                reused += f.reused_tokens;
                done += 1;
            }
            let ids: Vec<RequestId> = finished.iter().map(|f| f.id).collect();
            s.finalize(&ids).unwrap();
            s.target().check_invariants();
        }
        assert_eq!(done, 12, "seed {seed}");
        let st = s.stats();
        let prompt_tokens: u64 = prompts.values().map(|&n| n as u64).sum();
        recomputed += st.prefill_tokens.saturating_sub(prompt_tokens);
        // A finished request leaves its tails behind for the next.
        assert!(s.target().windows().unwrap().num_tails() > 0);
    }
    assert!(
        preemptions > 0 && reused > 0 && recomputed > 0,
        "{preemptions} {reused} {recomputed}"
    );
}

/// A windowed request is paused by recompute (its sequence closed, its blocks and tails
/// cached), resumes from its deepest tail, and finishes with the same tokens.
#[test]
fn a_paused_windowed_request_recomputes_from_its_tail() {
    let l = limits(4, 512, 256, 0);
    let mut s = Scheduler::new(cache(16, [12, 120, 120], 16), None, l);
    let id = RequestId(1);
    let prompt: Vec<TokenId> = (0..700).map(TokenId).collect();
    s.submit(SubmitRequest::new(id, prompt.clone(), 8)).unwrap();
    let mut out = Vec::new();
    let mut paused = false;
    let no = HashMap::new();
    while s.num_active() > 0 {
        let plan = s.schedule(&no).unwrap();
        s.complete(plan.target_fence, plan.draft_fence).unwrap();
        let outs = plan.requests.iter().map(|p| {
            let after = u64::from(p.num_cached) + p.tokens.len() as u64;
            RequestOutcome {
                id: p.id,
                accepted_drafts: 0,
                next_token: p.produces_token.then(|| truth(p.id, after)),
            }
        });
        let outs: Vec<_> = outs.collect();
        out.extend(outs.iter().filter_map(|o| o.next_token));
        let fin = s.commit(&outs).unwrap();
        let ids: Vec<_> = fin.iter().map(|f| f.id).collect();
        s.finalize(&ids).unwrap();
        if !paused && out.len() == 3 {
            s.pause(id).unwrap();
            assert_eq!(s.status(id), Some(SeqStatus::Suspended));
            assert_eq!(s.target().num_sequences(), 0, "closed for a recompute");
            assert!(s.target().windows().unwrap().num_tails() > 0);
            s.resume(id).unwrap();
            paused = true;
        }
    }
    let expect: Vec<TokenId> = (0..8).map(|k| truth(id, 700 + k)).collect();
    assert_eq!(out, expect);
    assert_eq!(s.stats().preemptions, 1);
}

/// Bad outcomes are typed errors that change nothing; a step that samples needs a
/// token; draft proposals past the configured count or the request's end are cut.
#[test]
fn bad_outcomes_are_refused_and_drafts_never_pass_the_request_end() {
    let l = limits(4, 2048, 512, 3);
    let mut s = Scheduler::new(cache(10, [12, 200, 120], 0), None, l);
    s.submit(SubmitRequest::new(
        RequestId(1),
        (0..300).map(TokenId).collect(),
        3,
    ))
    .unwrap();
    assert!(matches!(s.commit(&[]), Err(SchedError::NothingToCommit)));
    let plan = s.schedule(&HashMap::new()).unwrap();
    assert_eq!(
        plan.requests[0].next_drafts, 1,
        "3 new tokens: 1 now, 1 + 1 draft next"
    );
    assert!(matches!(
        s.schedule(&HashMap::new()),
        Err(SchedError::StepNotCommitted { .. })
    ));
    let good = RequestOutcome {
        id: RequestId(1),
        accepted_drafts: 0,
        next_token: Some(TokenId(7)),
    };
    for bad in [
        vec![RequestOutcome {
            id: RequestId(9),
            ..good.clone()
        }],
        vec![RequestOutcome {
            accepted_drafts: 1,
            ..good.clone()
        }],
        vec![good.clone(), good.clone()],
        vec![RequestOutcome {
            next_token: None,
            ..good.clone()
        }],
    ] {
        assert!(s.commit(&bad).is_err(), "{bad:?}");
        assert_eq!(s.pending_step(), Some(plan.step), "nothing committed");
    }
    s.complete(plan.target_fence, None).unwrap();
    assert!(s.commit(&[good]).unwrap().is_empty());
    // Five drafts offered: one fits before the request's third token.
    let drafts = HashMap::from([(RequestId(1), (0..5).map(TokenId).collect::<Vec<_>>())]);
    let plan = s.schedule(&drafts).unwrap();
    assert_eq!(plan.requests[0].num_drafts, 1);
    assert_eq!(plan.requests[0].tokens.len(), 2);
    assert_eq!(plan.requests[0].next_drafts, 0, "the last token comes next");
    s.target().check_invariants();
}

/// `ReuseScope` keeps tenants apart, and the windows' hits follow the tails: a repeat
/// of a 600-token prompt resumes at its last whole block (512).
#[test]
fn scopes_are_kept_apart_and_repeats_resume_at_the_tail() {
    // The ratio-4 ring (4-token pages) holds a 512-token chunk.
    let mut s = Scheduler::new(cache(10, [12, 200, 120], 0), None, limits(4, 2048, 512, 0));
    let prompt: Vec<TokenId> = (0..600).map(TokenId).collect();
    let mut reused = Vec::new();
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
        reused.extend(run_to_end(&mut s));
    }
    assert_eq!(reused, [0, 0, 512], "only the third request reuses");
    let w = s.target().window_stats().unwrap();
    assert_eq!((w.lookups, w.reused_tokens), (3, 512));
    // The cache's counters say what the prompts asked for, not only the hits the block
    // manager was offered.
    let m = s.target().stats();
    assert_eq!((m.lookup_tokens, m.reused_tokens), (1800, 512));
}

/// Runs `s` until no request is active (token 1 sampled each time); the reused tokens of
/// the requests that finished.
fn run_to_end(s: &mut Scheduler) -> Vec<u64> {
    let mut reused = Vec::new();
    while s.num_active() > 0 {
        let plan = s.schedule(&HashMap::new()).unwrap();
        s.complete(plan.target_fence, None).unwrap();
        let outs = plan.requests.iter().map(|p| RequestOutcome {
            id: p.id,
            accepted_drafts: 0,
            next_token: p.produces_token.then_some(TokenId(1)),
        });
        let fin = s.commit(&outs.collect::<Vec<_>>()).unwrap();
        reused.extend(fin.iter().map(|f| f.reused_tokens));
        let ids: Vec<_> = fin.iter().map(|f| f.id).collect();
        s.finalize(&ids).unwrap();
    }
    reused
}

/// A windowed prefix moves between two schedulers under a lease (P/D): the exporter
/// pins the blocks to its deepest tail and that tail; the importer checks the keys,
/// reserves fresh pages, commits, and a request for the prompt then resumes at the
/// boundary; an import left uncommitted expires with its pages given back, and a late
/// commit is told so.
#[test]
fn a_windowed_prefix_moves_between_schedulers_under_a_lease() {
    use std::time::Instant;
    let l = limits(2, 1024, 512, 0);
    let now = Instant::now();
    let s = ReuseScope::SHARED;
    let prompt: Vec<TokenId> = (0..700).map(TokenId).collect();
    let mut pre = Scheduler::new(cache(10, [12, 200, 120], 0), None, l);
    pre.submit(SubmitRequest::new(RequestId(1), prompt.clone(), 1))
        .unwrap();
    run_to_end(&mut pre);
    let out = pre
        .export_prefix(RequestId(7), s, &prompt, now)
        .unwrap()
        .expect("two whole blocks with a tail at 512");
    assert_eq!((out.skipped, out.blocks.len(), out.boundary), (0, 2, 512));
    assert_eq!(pre.transfer_stats().open_exports, 1);
    assert!(
        pre.export_prefix(RequestId(7), s, &prompt, now).is_err(),
        "id in use"
    );
    // Nothing whole with a tail: nothing offered, nothing pinned.
    let other: Vec<TokenId> = (5000..5600).map(TokenId).collect();
    assert_eq!(
        pre.export_prefix(RequestId(6), s, &other, now).unwrap(),
        None
    );
    assert_eq!(pre.num_transfers(), 1);

    let mut dec = Scheduler::new(cache(10, [12, 200, 120], 0), None, l);
    let keys = pre.block_keys(s, &prompt[..512]);
    let mut wrong = keys.clone();
    wrong[1] = keys[0];
    let e = dec
        .begin_prefix_import(RequestId(8), s, &prompt[..512], &wrong, now)
        .unwrap_err();
    assert!(e.to_string().contains("block 1's key"), "{e}");
    assert_eq!(dec.num_transfers(), 0, "nothing reserved");
    let used = dec.target().windows().unwrap().used_slots();
    let (inp, write_by) = dec
        .begin_prefix_import(RequestId(8), s, &prompt[..512], &keys, now)
        .unwrap()
        .expect("room for two blocks and a tail");
    assert_eq!((inp.skipped, inp.blocks.len(), inp.boundary), (0, 2, 512));
    assert!(write_by < now + l.transfer_lease);
    assert!(
        dec.commit_import(RequestId(8), now).is_err(),
        "a prefix import is committed by commit_prefix_import"
    );
    assert_eq!(dec.commit_prefix_import(RequestId(8), now).unwrap(), 2);
    pre.close_transfer(RequestId(7)).unwrap();
    assert_eq!((pre.num_transfers(), dec.num_transfers()), (0, 0));
    pre.target().check_invariants();
    dec.target().check_invariants();
    // The prompt on the decode side resumes at the imported tail.
    dec.submit(SubmitRequest::new(RequestId(9), prompt.clone(), 1))
        .unwrap();
    assert_eq!(run_to_end(&mut dec), [512]);

    // An import nobody commits: its lease ends, its pages come back, a late commit is
    // told it expired.
    let mut late = Scheduler::new(cache(10, [12, 200, 120], 0), None, l);
    let before = late.target().windows().unwrap().used_slots();
    assert_eq!(before, used);
    late.begin_prefix_import(RequestId(8), s, &prompt[..512], &keys, now)
        .unwrap()
        .unwrap();
    assert_ne!(late.target().windows().unwrap().used_slots(), before);
    let gone = late.expire_transfers(now + 2 * l.transfer_lease).unwrap();
    assert_eq!(gone.imports, [RequestId(8)]);
    assert_eq!(late.target().windows().unwrap().used_slots(), before);
    assert!(matches!(
        late.commit_prefix_import(RequestId(8), now + 2 * l.transfer_lease),
        Err(SchedError::TransferExpired { .. })
    ));
    assert_eq!(late.transfer_stats().expired_imports, 1);
    late.target().check_invariants();
}
