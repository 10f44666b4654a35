//! DeepSeek-V4 through the runtime: the tiny V4 model (`[0, 4, 128]` and an MTP layer) on
//! two device actors (tensor parallel: every device runs every step and must return the
//! same tokens) behind the V4 coordinator, with continuous batching, chunked prefill,
//! MTP drafts, prefix hits at window tails, preemption by recompute and a host tier.
//! Every request's output tokens, and every position's logits on both devices, equal
//! the model run alone on a contiguous cache, bit for bit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::v4::{
    ManagerOptions, TierSlots, V4CacheManager, V4HostDevice, V4Limits, V4Options, V4Plan,
    V4Runtime, V4Scheduler, V4Slots,
};
use dsa_kv_core::rng::SplitMix64;
use dsa_kv_model::v4::{V4Model, V4ModelConfig, V4ModelForward, V4Outputs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v4_runtime_is_bit_exact_against_the_unpaged_model() {
    let model = Arc::new(V4Model::new(V4ModelConfig::tiny(7)).unwrap());
    let plan = V4Plan::new(&model.config().spec().unwrap()).unwrap();
    let slots = V4Slots {
        blocks: TierSlots {
            gpu: vec![6],
            host: vec![24],
        },
        windows: vec![14, 300, 200],
    };
    let m = V4CacheManager::new(
        plan.clone(),
        slots.clone(),
        V4Options {
            blocks: ManagerOptions {
                enable_partial_reuse: false,
                ..ManagerOptions::default()
            },
            ..V4Options::default()
        },
    )
    .unwrap();
    let limits = V4Limits {
        max_num_sequences: 3,
        max_num_tokens: 384,
        max_prefill_chunk: 200,
        max_seq_len: 4096,
        draft_tokens: 3,
        livelock_steps: 8,
    };
    let sched = V4Scheduler::new(m, limits).unwrap();
    let outputs = Arc::new(Mutex::new(V4Outputs::default()));
    let devices = (0..2)
        .map(|i| {
            let f = V4ModelForward::new(model.clone(), outputs.clone());
            V4HostDevice::new(i, &plan, &slots, Box::new(f)).unwrap()
        })
        .collect();
    let rt = V4Runtime::start(sched, devices).await.unwrap();

    let mut rng = SplitMix64(3);
    let systems: Vec<Vec<u32>> = (0..2)
        .map(|_| (0..520).map(|_| rng.below(256) as u32).collect())
        .collect();
    let mut prompts: HashMap<RequestId, (Vec<u32>, usize)> = HashMap::new();
    let mut outputs_of: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let (mut preempted, mut copies, mut accepted, mut first_reuse) = (0, 0, 0u64, 0u64);
    // Two waves: fresh conversations, then each one's next turn (its history and new
    // tokens), which resumes at the tails its first turn left.
    for wave in 0..2u64 {
        let mut ids = Vec::new();
        for c in 0..4u64 {
            let id = RequestId(wave * 10 + c);
            let mut prompt = if wave == 0 {
                systems[(c % 2) as usize].clone()
            } else {
                let first = RequestId(c);
                let mut h = prompts[&first].0.clone();
                h.extend(&outputs_of[&first]);
                h
            };
            prompt.extend((0..20 + rng.below(120)).map(|_| rng.below(256) as u32));
            let max_new = 10 + rng.below(50) as usize;
            prompts.insert(id, (prompt.clone(), max_new));
            let toks = prompt.iter().map(|&t| TokenId(t)).collect();
            rt.submit(SubmitRequest::new(id, toks, max_new as u32))
                .await
                .unwrap();
            ids.push(id);
        }
        while let Some(rep) = rt.step().await.unwrap() {
            assert!(rep.failed.is_empty(), "{:?}", rep.failed);
            preempted += rep.preempted.len();
            copies += rep.slot_copies;
            accepted += rep
                .outcomes
                .iter()
                .map(|o| u64::from(o.accepted_drafts))
                .sum::<u64>();
            for f in rep.finished {
                first_reuse += f.reused_tokens;
                outputs_of.insert(f.id, f.output.iter().map(|t| t.0).collect());
            }
        }
        for id in ids {
            assert!(outputs_of.contains_key(&id), "{id} finished");
        }
    }
    let stats = rt.stats().await.unwrap();
    rt.stop().await;
    let out = outputs.lock().unwrap();
    assert!(out.conflicts.is_empty(), "{:?}", out.conflicts);
    let mut positions = 0;
    for (id, (prompt, max_new)) in &prompts {
        let g = model.generate(prompt, *max_new as u32).unwrap();
        let (gen, outs) = (g.tokens, g.outputs);
        assert_eq!(&outputs_of[id], &gen, "request {id}: tokens");
        for device in 0..2 {
            let got = &out.tokens[&(device, *id)];
            for (&pos, o) in got {
                assert_eq!(
                    *o, outs[pos as usize],
                    "request {id}, device {device}, position {pos}"
                );
                positions += 1;
            }
        }
    }
    eprintln!(
        "positions checked {positions}, preempted {preempted}, slot copies {copies}, \
         drafts accepted {accepted}, {stats:?}"
    );
    // First admissions only (re-admissions after a preemption are not prefix hits).
    assert!(
        first_reuse >= 4 * 512,
        "prefix hits: {first_reuse}, {stats:?}"
    );
    assert!(accepted > 0, "MTP drafts accepted");
    assert!(
        stats.sched.drafts > stats.sched.accepted_drafts,
        "and rejected"
    );
    assert!(preempted > 0, "preemption by recompute: {stats:?}");
    assert!(copies > 0, "offload or onboarding");
    assert_eq!(stats.unfinished, 0);
}
