//! Exact-value tests of the router events on the tiny layout of `tests.rs` (T = 4, one
//! life cycle): what each operation emits, that replaying them gives
//! [`KvCacheManager::router_blocks`], and that the replay check catches a doctored
//! stream.

use super::reuse_key::KeyHasher;
use super::tests::{cache, mgr, mgr_with, start, toks};
use super::*;
use crate::ids::{RequestId, Tier, TokenId};

fn key_chain(scope: ReuseScope, blocks: &[std::ops::Range<u32>]) -> Vec<BlockKey> {
    let mut h = KeyHasher::default();
    let mut parent = scope.root_key();
    blocks
        .iter()
        .map(|r| {
            parent = h.block_key(&parent, &toks(r.clone()));
            parent
        })
        .collect()
}

fn stored(
    key: BlockKey,
    parent: Option<BlockKey>,
    tokens: std::ops::Range<u32>,
    medium: Medium,
) -> RouterEvent {
    RouterEvent::BlockStored {
        block_hashes: vec![key.hash64()],
        parent_block_hash: parent.map(|p| p.hash64()),
        token_ids: tokens.collect(),
        block_size: 4,
        medium,
        lora_id: None,
        lora_name: None,
    }
}

fn removed(key: BlockKey, medium: Medium) -> RouterEvent {
    RouterEvent::BlockRemoved {
        block_hashes: vec![key.hash64()],
        medium,
    }
}

fn block(key: BlockKey, medium: Medium) -> RouterBlock {
    RouterBlock {
        hash: key.hash64(),
        medium,
    }
}

fn sorted(mut v: Vec<RouterBlock>) -> Vec<RouterBlock> {
    v.sort_unstable();
    v
}

/// Replays `events` from `start` and compares with `expected`: the check a router
/// consumer must pass.
fn replay_check(
    start: &[RouterBlock],
    events: &[RouterEvent],
    expected: &[RouterBlock],
) -> Result<(), String> {
    let mut view = RouterView::from_blocks(start.iter().copied());
    for (i, e) in events.iter().enumerate() {
        view.apply(e).map_err(|err| format!("event {i}: {err}"))?;
    }
    let got = view.blocks();
    if got != expected {
        return Err(format!("replayed {got:?}, the cache has {expected:?}"));
    }
    Ok(())
}

#[test]
fn router_events_are_off_by_default() {
    let mut m = mgr(8, 0);
    cache(&mut m, 1, &toks(0..8), 35);
    assert_eq!(m.take_router_events(), vec![]);
    assert_eq!(
        m.take_events().len(),
        2,
        "the crate's own events are still made"
    );
}

#[test]
fn full_blocks_are_stored_with_tokens_and_parents() {
    let mut m = mgr(8, 0);
    m.set_record_router_events(true);
    cache(&mut m, 1, &toks(0..10), 35);
    let k = key_chain(ReuseScope::SHARED, &[0..4, 4..8]);
    // Golden (Python's hashlib): the first 8 bytes, little-endian, of the key
    // `7b894451a88bc030…` = SHA-256(shared root ∥ 0, 1, 2, 3 as 4-byte LE).
    assert_eq!(k[0].hash64(), 0x30c0_8ba8_5144_897b);
    // The partial third block (tokens 8, 9) is cached but not announced.
    assert_eq!(m.num_cached_blocks(), 3);
    assert_eq!(
        m.take_router_events(),
        vec![
            stored(k[0], None, 0..4, Medium::Gpu),
            stored(k[1], Some(k[0]), 4..8, Medium::Gpu),
        ]
    );
    assert_eq!(
        m.router_blocks(),
        sorted(vec![block(k[0], Medium::Gpu), block(k[1], Medium::Gpu)])
    );
    // A second request reusing the prefix announces only its new full block.
    cache(&mut m, 2, &toks(0..13), 35);
    let k3 = key_chain(ReuseScope::SHARED, &[0..4, 4..8, 8..12])[2];
    assert_eq!(
        m.take_router_events(),
        vec![stored(k3, Some(k[1]), 8..12, Medium::Gpu)]
    );
}

#[test]
fn a_lora_scope_names_its_adapter() {
    let mut m = mgr(8, 0);
    m.set_record_router_events(true);
    let scope = ReuseScope {
        lora_id: Some(5),
        salt: Some(7),
    };
    let mut h = m
        .create(RequestId(1), scope, &toks(0..4), SeqOptions::default())
        .unwrap()
        .handle;
    assert!(m.resume(&h).unwrap());
    assert!(m.resize(&h, 4, 0).unwrap());
    m.commit(&h, &toks(0..4)).unwrap();
    m.close(&mut h).unwrap();
    let k = key_chain(scope, &[0..4, 4..8])[0];
    assert_eq!(
        m.take_router_events(),
        vec![RouterEvent::BlockStored {
            block_hashes: vec![k.hash64()],
            parent_block_hash: None,
            token_ids: vec![0, 1, 2, 3],
            block_size: 4,
            medium: Medium::Gpu,
            lora_id: Some(5),
            lora_name: None,
        }]
    );
}

#[test]
fn dropping_a_block_removes_it_and_its_descendants() {
    let mut m = mgr(2, 0);
    m.set_record_router_events(true);
    cache(&mut m, 1, &toks(0..8), 35);
    let k = key_chain(ReuseScope::SHARED, &[0..4, 4..8]);
    m.take_router_events();
    let h = start(&mut m, 2, &toks(50..58), 35);
    assert!(m.resize(&h, 8, 0).unwrap());
    // The least recently used page is the leaf's; dropping the root block then takes
    // nothing else (its child is gone).
    assert_eq!(
        m.take_router_events(),
        vec![removed(k[1], Medium::Gpu), removed(k[0], Medium::Gpu)]
    );
    assert_eq!(m.router_blocks(), vec![]);
}

/// Offloading a block is a removal from the GPU and a store on the host; onboarding it
/// again the reverse. Replaying every event gives the cache's blocks at each point.
#[test]
fn tier_moves_are_a_removal_and_a_store() {
    let opts = ManagerOptions {
        max_util_for_resume: 1.0,
        ..Default::default()
    };
    let mut m = mgr_with(4, 8, opts);
    m.set_record_router_events(true);
    let mut all = Vec::new();
    cache(&mut m, 1, &toks(0..8), 35);
    let k = key_chain(ReuseScope::SHARED, &[0..4, 4..8]);
    all.extend(m.take_router_events());
    // X takes all four GPU slots: both cached blocks go to the host.
    let mut x = start(&mut m, 3, &toks(100..117), 35);
    assert!(m.resize(&x, 16, 0).unwrap());
    let offload = m.take_router_events();
    assert_eq!(
        offload,
        vec![
            removed(k[1], Medium::Gpu),
            stored(k[1], Some(k[0]), 4..8, Medium::CpuPinned),
            removed(k[0], Medium::Gpu),
            stored(k[0], None, 0..4, Medium::CpuPinned),
        ]
    );
    all.extend(offload);
    assert_eq!(
        m.router_blocks(),
        sorted(vec![
            block(k[0], Medium::CpuPinned),
            block(k[1], Medium::CpuPinned)
        ])
    );
    replay_check(&[], &all, &m.router_blocks()).unwrap();
    // X leaves; a request reusing the prefix onboards both blocks when it resumes.
    m.close(&mut x).unwrap();
    all.extend(m.take_router_events());
    let c = m
        .create(
            RequestId(4),
            ReuseScope::SHARED,
            &toks(0..9),
            SeqOptions::default(),
        )
        .unwrap();
    assert_eq!(c.reused_tokens, 8);
    assert!(m.resume(&c.handle).unwrap());
    let onboard = m.take_router_events();
    assert_eq!(
        onboard,
        vec![
            removed(k[0], Medium::CpuPinned),
            stored(k[0], None, 0..4, Medium::Gpu),
            removed(k[1], Medium::CpuPinned),
            stored(k[1], Some(k[0]), 4..8, Medium::Gpu),
        ]
    );
    all.extend(onboard);
    replay_check(&[], &all, &m.router_blocks()).unwrap();
    assert_eq!(
        m.router_blocks(),
        sorted(vec![block(k[0], Medium::Gpu), block(k[1], Medium::Gpu)])
    );
    drop(c);
}

/// A block is on the GPU for a router only when every block before it in its prefix is:
/// offloading a parent whose child stays on the GPU re-announces the child on the host
/// (after its parent), and onboarding the parent brings the child back to the GPU. A
/// tiered router (a device tree, then host tiers continuing it) then counts the whole
/// prefix, as the cache does.
#[test]
fn a_child_follows_its_parent_off_the_gpu_and_back() {
    let opts = ManagerOptions {
        max_util_for_resume: 1.0,
        ..Default::default()
    };
    let mut m = mgr_with(4, 8, opts);
    m.set_record_router_events(true);
    let mut all = Vec::new();
    // The first block at a low priority, its child at a high one: the parent is
    // evicted first.
    cache(&mut m, 1, &toks(0..4), 10);
    cache(&mut m, 2, &toks(0..8), 90);
    let k = key_chain(ReuseScope::SHARED, &[0..4, 4..8]);
    all.extend(m.take_router_events());
    let mut x = start(&mut m, 3, &toks(100..109), 35);
    assert!(m.resize(&x, 12, 0).unwrap());
    let tiers: Vec<Tier> = m.cached_blocks().iter().map(|p| p.tier).collect();
    let k0_first = k[0] < k[1];
    let expected_tiers = if k0_first {
        vec![Tier::Host, Tier::Gpu]
    } else {
        vec![Tier::Gpu, Tier::Host]
    };
    assert_eq!(
        tiers, expected_tiers,
        "only the parent's page was offloaded"
    );
    let offload = m.take_router_events();
    // Removals children first, stores parents first.
    assert_eq!(
        offload,
        vec![
            removed(k[1], Medium::Gpu),
            removed(k[0], Medium::Gpu),
            stored(k[0], None, 0..4, Medium::CpuPinned),
            stored(k[1], Some(k[0]), 4..8, Medium::CpuPinned),
        ]
    );
    all.extend(offload);
    replay_check(&[], &all, &m.router_blocks()).unwrap();
    assert_eq!(
        m.router_blocks(),
        sorted(vec![
            block(k[0], Medium::CpuPinned),
            block(k[1], Medium::CpuPinned)
        ])
    );
    m.check_invariants();
    // Onboarding the parent: the child (its page never left) is back on the GPU too.
    m.close(&mut x).unwrap();
    all.extend(m.take_router_events());
    let c = m
        .create(
            RequestId(4),
            ReuseScope::SHARED,
            &toks(0..9),
            SeqOptions::default(),
        )
        .unwrap();
    assert_eq!(c.reused_tokens, 8);
    assert!(m.resume(&c.handle).unwrap());
    let onboard = m.take_router_events();
    assert_eq!(
        onboard,
        vec![
            removed(k[1], Medium::CpuPinned),
            removed(k[0], Medium::CpuPinned),
            stored(k[0], None, 0..4, Medium::Gpu),
            stored(k[1], Some(k[0]), 4..8, Medium::Gpu),
        ]
    );
    all.extend(onboard);
    replay_check(&[], &all, &m.router_blocks()).unwrap();
    m.check_invariants();
    drop(c);
}

#[test]
fn reset_clears_everything_in_one_event() {
    let mut m = mgr(8, 4);
    m.set_record_router_events(true);
    cache(&mut m, 1, &toks(0..8), 35);
    m.take_router_events();
    m.reset_prefix_cache().unwrap();
    assert_eq!(m.take_router_events(), vec![RouterEvent::AllBlocksCleared]);
    assert_eq!(m.router_blocks(), vec![]);
}

/// The events of a workload with reuse, offload, onboard, drops and a reset, for the
/// mutation checks below.
fn workload() -> (Vec<RouterEvent>, Vec<RouterBlock>) {
    let opts = ManagerOptions {
        max_util_for_resume: 1.0,
        ..Default::default()
    };
    let mut m = mgr_with(4, 2, opts);
    m.set_record_router_events(true);
    cache(&mut m, 1, &toks(0..8), 35);
    cache(&mut m, 2, &toks(0..12), 35);
    let mut x = start(&mut m, 3, &toks(100..113), 35);
    assert!(m.resize(&x, 13, 0).unwrap());
    m.close(&mut x).unwrap();
    cache(&mut m, 4, &toks(0..9), 35);
    cache(&mut m, 5, &toks(200..208), 35);
    let events = m.take_router_events();
    m.check_invariants();
    (events, m.router_blocks())
}

#[test]
fn replay_of_the_workload_matches_and_every_doctored_stream_is_caught() {
    let (events, truth) = workload();
    replay_check(&[], &events, &truth).unwrap();
    let count = |f: fn(&RouterEvent) -> bool| events.iter().filter(|e| f(e)).count();
    assert!(
        count(|e| matches!(
            e,
            RouterEvent::BlockRemoved {
                medium: Medium::Gpu,
                ..
            }
        )) > 0
    );
    assert!(
        count(|e| matches!(
            e,
            RouterEvent::BlockRemoved {
                medium: Medium::CpuPinned,
                ..
            }
        )) > 0
    );
    assert!(
        count(|e| matches!(
            e,
            RouterEvent::BlockStored {
                medium: Medium::CpuPinned,
                ..
            }
        )) > 0
    );
    // A broken emitter: leave out any one event, or state the wrong medium.
    for i in 0..events.len() {
        let mut doctored = events.clone();
        doctored.remove(i);
        assert!(
            replay_check(&[], &doctored, &truth).is_err(),
            "without event {i} ({:?}) the replay still matched",
            events[i]
        );
        let mut doctored = events.clone();
        match &mut doctored[i] {
            RouterEvent::BlockStored { medium, .. } | RouterEvent::BlockRemoved { medium, .. } => {
                *medium = match *medium {
                    Medium::Gpu => Medium::CpuPinned,
                    Medium::CpuPinned => Medium::Gpu,
                }
            }
            _ => continue,
        }
        assert!(
            replay_check(&[], &doctored, &truth).is_err(),
            "medium of event {i}"
        );
    }
    // Children before parents.
    let k = key_chain(ReuseScope::SHARED, &[0..4, 4..8]);
    assert_eq!(
        replay_check(&[], &[stored(k[1], Some(k[0]), 4..8, Medium::Gpu)], &[]),
        Err(format!(
            "event 0: block {:#018x} stored before its parent {:#018x}",
            k[1].hash64(),
            k[0].hash64()
        ))
    );
}

#[test]
fn events_round_trip_through_serde() {
    let k = key_chain(ReuseScope::SHARED, &[0..4, 4..8]);
    let all = vec![
        stored(k[0], None, 0..4, Medium::Gpu),
        RouterEvent::BlockStored {
            block_hashes: vec![7],
            parent_block_hash: Some(u64::MAX),
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            medium: Medium::CpuPinned,
            lora_id: Some(3),
            lora_name: Some("adapter".into()),
        },
        removed(k[0], Medium::CpuPinned),
        RouterEvent::AllBlocksCleared,
    ];
    for e in &all {
        let json = serde_json::to_string(e).unwrap();
        assert_eq!(
            &serde_json::from_str::<RouterEvent>(&json).unwrap(),
            e,
            "{json}"
        );
    }
    assert_eq!(
        serde_json::to_string(&all[1]).unwrap(),
        r#"{"type":"BlockStored","block_hashes":[7],"parent_block_hash":18446744073709551615,"token_ids":[1,2,3,4],"block_size":4,"medium":"CPU_PINNED","lora_id":3,"lora_name":"adapter"}"#
    );
    assert_eq!(
        serde_json::to_string(&removed(BlockKey([0; 32]), Medium::Gpu)).unwrap(),
        r#"{"type":"BlockRemoved","block_hashes":[0],"medium":"GPU"}"#
    );
    assert_eq!(
        serde_json::to_string(&RouterEvent::AllBlocksCleared).unwrap(),
        r#"{"type":"AllBlocksCleared"}"#
    );
    let b = RouterBlock {
        hash: 9,
        medium: Medium::CpuPinned,
    };
    let json = serde_json::to_string(&b).unwrap();
    assert_eq!(serde_json::from_str::<RouterBlock>(&json).unwrap(), b);
    let _ = TokenId(0);
}
