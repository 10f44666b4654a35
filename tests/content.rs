//! Content checks with host storage: a deterministic pattern per (layer, role, token
//! prefix) is written through the page tables and verified after prefix reuse, partial
//! copy-on-resume, offload to the host tier and onboarding, for every DSA layout.

mod common;

use common::*;
use dsa_kv::config::{DsaModel, DsaModelSpec, IndexerDtype, IndexerLayers, KvDtype, LayerSet};
use dsa_kv::core::{KvCacheManager, ManagerOptions, ReuseScope, SeqOptions, TierSlots};
use dsa_kv::ids::{RequestId, Tier, TokenId};
use dsa_kv::layout::{LayoutKind, PoolPlan};
use dsa_kv::storage::HostStorage;

fn tokens(seed: u64, n: usize) -> Vec<TokenId> {
    let mut r = Rng(seed);
    (0..n).map(|_| TokenId(r.below(150_000) as u32)).collect()
}

fn scenario(spec: DsaModelSpec, kind: LayoutKind) {
    let model = DsaModel::new(spec).unwrap();
    let plan = PoolPlan::for_model(&model, LayerSet::Target, kind, 64).unwrap();
    let (gpu, host) = (vec![6u32], vec![8u32]);
    let opts = ManagerOptions {
        max_util_for_resume: 1.0,
        ..Default::default()
    };
    let mut m = KvCacheManager::new(
        plan.clone(),
        TierSlots {
            gpu: gpu.clone(),
            host: host.clone(),
        },
        opts,
    )
    .unwrap();
    let mut st = HostStorage::new(&plan, &gpu, &host).unwrap();
    let scope = ReuseScope::SHARED;
    let seed = 0xC0FFEE;
    let ctx = format!(
        "{kind:?} {:?} {:?}",
        model.spec().kv_dtype,
        model.spec().indexer_dtype
    );

    // A: 150-token prompt (2 full blocks + 22 tokens), written, committed, closed.
    let a_tokens = tokens(1, 150);
    let a_hash = prefix_hashes(seed, &a_tokens);
    let c = m
        .create(RequestId(1), scope, &a_tokens, SeqOptions::default())
        .unwrap();
    let mut a = c.handle;
    assert!(m.resume(&a).unwrap());
    assert!(m.resize(&a, 150, 0).unwrap());
    write_positions(&m, &mut st, &a, &a_hash, 0..150);
    m.commit(&a, &a_tokens).unwrap();
    verify_positions(&m, &st, &a, &a_hash, 0..150).unwrap();
    m.close(&mut a).unwrap();
    assert_eq!(m.num_cached_blocks(), 3, "{ctx}");

    // B: A's prompt + 30 new tokens. Reuses all 150 (2 blocks shared, 22 tokens copied).
    let mut b_tokens = a_tokens.clone();
    b_tokens.extend(tokens(2, 30));
    let b_hash = prefix_hashes(seed, &b_tokens);
    let c = m
        .create(RequestId(2), scope, &b_tokens, SeqOptions::default())
        .unwrap();
    assert_eq!(c.reused_tokens, 150, "{ctx}");
    let b = c.handle;
    assert!(m.resume(&b).unwrap());
    assert_eq!(
        run_copy_plans(&mut m, &mut st),
        1,
        "copy-on-resume of the partial block"
    );
    verify_positions(&m, &st, &b, &b_hash, 0..150).unwrap_or_else(|e| panic!("{ctx}: reuse {e:?}"));
    assert!(m.resize(&b, 180, 150).unwrap());
    write_positions(&m, &mut st, &b, &b_hash, 150..180);
    m.commit(&b, &b_tokens[150..]).unwrap();
    verify_positions(&m, &st, &b, &b_hash, 0..180).unwrap();
    m.suspend(&b).unwrap();

    // C: an unrelated 256-token prompt fills the GPU: B's pages go to the host.
    let c_tokens = tokens(3, 256);
    let c_hash = prefix_hashes(seed, &c_tokens);
    let cc = m
        .create(RequestId(3), scope, &c_tokens, SeqOptions::default())
        .unwrap();
    let mut cseq = cc.handle;
    assert!(m.resume(&cseq).unwrap());
    assert!(m.resize(&cseq, 256, 0).unwrap(), "{ctx}");
    assert!(run_copy_plans(&mut m, &mut st) >= 1);
    // Victims: B's private copy of the partial block (uncommitted, priority 0), then A's
    // cached partial block (least recently used); B's shared blocks stay on the GPU.
    assert_eq!(m.stats().offloaded_pages, 2, "{ctx}: {:?}", m.stats());
    let tiers: Vec<Tier> = m.cached_blocks().iter().map(|p| p.tier).collect();
    assert_eq!(
        (
            tiers.iter().filter(|&&t| t == Tier::Host).count(),
            tiers.len()
        ),
        (1, 3),
        "{ctx}: A's partial block on the host, A's full blocks on the GPU"
    );
    write_positions(&m, &mut st, &cseq, &c_hash, 0..256);
    verify_positions(&m, &st, &cseq, &c_hash, 0..256).unwrap();
    m.commit(&cseq, &c_tokens).unwrap();
    m.close(&mut cseq).unwrap();

    // B comes back from the host: every byte survived the round trip.
    assert!(m.resume(&b).unwrap(), "{ctx}");
    run_copy_plans(&mut m, &mut st);
    assert_eq!(m.stats().onboarded_pages, 1, "{ctx}");
    verify_positions(&m, &st, &b, &b_hash, 0..180)
        .unwrap_or_else(|e| panic!("{ctx}: onboarding {e:?}"));

    // D: reuses A's first 100 tokens (1 full block + 36 copied) after all that movement.
    let mut d_tokens = a_tokens[..100].to_vec();
    d_tokens.extend(tokens(4, 20));
    let d_hash = prefix_hashes(seed, &d_tokens);
    let mut bb = b;
    m.close(&mut bb).unwrap();
    let dc = m
        .create(RequestId(4), scope, &d_tokens, SeqOptions::default())
        .unwrap();
    assert_eq!(dc.reused_tokens, 100, "{ctx}");
    let d = dc.handle;
    assert!(m.resume(&d).unwrap());
    run_copy_plans(&mut m, &mut st);
    verify_positions(&m, &st, &d, &d_hash, 0..100)
        .unwrap_or_else(|e| panic!("{ctx}: reuse after movement {e:?}"));
    // On the host: C's last two blocks (C closed tail first, so they were the least
    // recently used when B and then D needed room); A's partial block there was replaced
    // by B's longer one when B closed.
    assert_eq!(
        m.occupied_slots(Tier::Host),
        vec![2],
        "{ctx}: host slots in use"
    );
    assert_eq!(m.stats().offloaded_pages, 4, "{ctx}: {:?}", m.stats());
    m.check_invariants();
}

#[test]
fn content_survives_reuse_offload_and_onboarding() {
    let small = DsaModelSpec {
        num_layers: 3,
        num_mtp_layers: 0,
        ..DsaModelSpec::deepseek_v32()
    };
    let variants = [
        small.clone(),
        DsaModelSpec {
            kv_dtype: KvDtype::Fp8DsMla,
            indexer_dtype: IndexerDtype::Fp4,
            ..small.clone()
        },
        DsaModelSpec {
            kv_dtype: KvDtype::Nvfp4,
            ..small.clone()
        },
        DsaModelSpec {
            kv_dtype: KvDtype::Bf16,
            indexer_layers: IndexerLayers::Shared {
                skip_offset: 1,
                freq: 2,
            },
            ..small
        },
    ];
    for spec in variants {
        for kind in [LayoutKind::V1, LayoutKind::V2] {
            scenario(spec.clone(), kind);
        }
    }
}
