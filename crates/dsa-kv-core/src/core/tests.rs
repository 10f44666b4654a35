//! Exact-value tests of the manager on a tiny layout (T = 4, one 2-byte key buffer), so
//! that every slot, reuse length and eviction victim can be written down.

use super::*;
use std::collections::BTreeMap;

use crate::ids::{Fence, LayerId, LifeCycleId, PoolGroupId, RequestId, SlotId, Tier, TokenId};
use crate::layout::{BufferSpec, LayerSpec, LifeCycleKey, PoolPlan, Role, RowLayout};
use crate::ops::{CopyPlan, GroupCopy};

const LC0: LifeCycleId = LifeCycleId(0);

pub(super) fn plan() -> PoolPlan {
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

pub(super) fn mgr_with(gpu: u32, host: u32, opts: ManagerOptions) -> KvCacheManager {
    let host = if host > 0 { vec![host] } else { vec![] };
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

pub(super) fn mgr(gpu: u32, host: u32) -> KvCacheManager {
    mgr_with(gpu, host, ManagerOptions::default())
}

pub(super) fn toks(r: std::ops::Range<u32>) -> Vec<TokenId> {
    r.map(TokenId).collect()
}

pub(super) fn start(
    m: &mut KvCacheManager,
    id: u64,
    prompt: &[TokenId],
    priority: u8,
) -> SeqHandle {
    let c = m
        .create(
            RequestId(id),
            ReuseScope::SHARED,
            prompt,
            SeqOptions { priority },
        )
        .unwrap();
    assert!(m.resume(&c.handle).unwrap());
    c.handle
}

/// Creates, fills and commits a sequence of `prompt`, then closes it.
pub(super) fn cache(m: &mut KvCacheManager, id: u64, prompt: &[TokenId], priority: u8) {
    let mut h = start(m, id, prompt, priority);
    let reused = m.info_of(&h).unwrap().committed;
    assert!(m.resize(&h, prompt.len() as u64, reused).unwrap());
    m.commit(&h, &prompt[reused as usize..]).unwrap();
    m.close(&mut h).unwrap();
}

fn table(m: &KvCacheManager, h: &SeqHandle) -> Vec<u32> {
    m.block_slots(h, LC0)
        .unwrap()
        .into_iter()
        .map(|s| s.get())
        .collect()
}

#[test]
fn sequence_life_cycle() {
    let mut m = mgr(8, 0);
    let c = m
        .create(
            RequestId(1),
            ReuseScope::SHARED,
            &toks(0..10),
            SeqOptions::default(),
        )
        .unwrap();
    assert_eq!(c.reused_tokens, 0);
    let mut h = c.handle;
    assert_eq!(
        m.sequence(RequestId(1)).unwrap().status,
        SeqStatus::Suspended
    );
    assert!(m.resume(&h).unwrap());
    assert!(
        m.resume(&h).unwrap(),
        "resume of an active sequence is a no-op"
    );
    assert!(m.resize(&h, 10, 0).unwrap());
    let info = m.info_of(&h).unwrap();
    assert_eq!(
        (info.capacity, info.history, info.committed, info.num_blocks),
        (10, 0, 0, 3)
    );
    let mut row = [7i32; 5];
    assert_eq!(m.write_block_table(&h, LC0, &mut row), Ok(3));
    assert_eq!(row, [0, 1, 2, -1, -1]);
    m.commit(&h, &toks(0..10)).unwrap();
    let info = m.info_of(&h).unwrap();
    assert_eq!(
        (info.committed, info.history),
        (10, 10),
        "history rises to committed"
    );
    assert_eq!(m.num_cached_blocks(), 2);
    m.close(&mut h).unwrap();
    assert_eq!(
        m.num_cached_blocks(),
        3,
        "the partial tail is committed at close"
    );
    assert_eq!(m.num_pages(), 3);
    assert_eq!(m.occupied_slots(Tier::Gpu), vec![3]);
    assert_eq!(m.usage(Tier::Gpu)[0].evictable, 3);
    m.close(&mut h).unwrap();
    assert_eq!(
        m.resize(&h, 12, 10),
        Err(KvError::SequenceClosed { id: RequestId(1) })
    );
    assert_eq!(
        m.sequence(RequestId(1)),
        Err(KvError::UnknownRequest { id: RequestId(1) })
    );
    let ev = m.take_events();
    let stored: Vec<u32> = ev
        .iter()
        .map(|e| match e {
            KvEvent::Stored {
                num_tokens,
                tier,
                priority,
                ..
            } => {
                assert_eq!((*tier, *priority), (Tier::Gpu, DEFAULT_PRIORITY));
                *num_tokens
            }
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(stored, vec![4, 4, 2]);
    m.check_invariants();
}

#[test]
fn reuse_lengths_are_exact() {
    let mut m = mgr(16, 0);
    cache(&mut m, 1, &toks(0..10), 35);
    // Lookups leave out the last prompt token.
    let probe =
        |m: &mut KvCacheManager, p: &[TokenId]| m.probe_reuse(ReuseScope::SHARED, p).unwrap();
    assert_eq!(
        probe(&mut m, &toks(0..10)),
        9,
        "2 full blocks + [8] of the partial [8, 9]"
    );
    assert_eq!(
        probe(&mut m, &toks(0..11)),
        10,
        "2 full blocks + the whole partial block"
    );
    assert_eq!(
        probe(&mut m, &toks(0..8)),
        7,
        "block 0 + [4, 5, 6] of block 1"
    );
    assert_eq!(probe(&mut m, &toks(0..5)), 4);
    assert_eq!(probe(&mut m, &toks(0..2)), 1);
    assert_eq!(
        probe(&mut m, &toks(0..1)),
        0,
        "a one-token prompt reuses nothing"
    );
    assert_eq!(probe(&mut m, &toks(50..60)), 0);
    let mut p = toks(0..10);
    p[5] = TokenId(99);
    assert_eq!(probe(&mut m, &p), 5, "divergence at token 5");
    // Tenant isolation: another salt or LoRA never shares.
    for scope in [
        ReuseScope {
            lora_id: None,
            salt: Some(ReuseScope::salt_from_str("tenant-b")),
        },
        ReuseScope {
            lora_id: Some(3),
            salt: None,
        },
    ] {
        assert_eq!(m.probe_reuse(scope, &toks(0..10)).unwrap(), 0);
        let c = m
            .create(RequestId(9), scope, &toks(0..10), SeqOptions::default())
            .unwrap();
        assert_eq!(c.reused_tokens, 0);
        let mut h = c.handle;
        m.close(&mut h).unwrap();
    }
    // Partial reuse off: only whole blocks.
    let mut m2 = mgr_with(
        16,
        0,
        ManagerOptions {
            enable_partial_reuse: false,
            ..Default::default()
        },
    );
    cache(&mut m2, 1, &toks(0..10), 35);
    assert_eq!(m2.probe_reuse(ReuseScope::SHARED, &toks(0..10)).unwrap(), 8);
    // Reuse off: nothing is cached.
    let mut m3 = mgr_with(
        16,
        0,
        ManagerOptions {
            enable_block_reuse: false,
            ..Default::default()
        },
    );
    cache(&mut m3, 1, &toks(0..10), 35);
    assert_eq!((m3.num_cached_blocks(), m3.num_pages()), (0, 0));
    assert_eq!(m3.probe_reuse(ReuseScope::SHARED, &toks(0..10)).unwrap(), 0);
}

#[test]
fn partial_reuse_copies_on_resume() {
    let mut m = mgr(16, 0);
    cache(&mut m, 1, &toks(0..10), 35); // slots 0, 1, 2 ([8, 9] in slot 2)
    let c = m
        .create(
            RequestId(2),
            ReuseScope::SHARED,
            &toks(0..10),
            SeqOptions::default(),
        )
        .unwrap();
    assert_eq!(c.reused_tokens, 9);
    let h = c.handle;
    let info = m.info_of(&h).unwrap();
    assert_eq!(
        (
            info.committed,
            info.history,
            info.capacity,
            info.pending_copy
        ),
        (9, 9, 9, true)
    );
    assert!(m.resume(&h).unwrap());
    assert_eq!(table(&m, &h), vec![0, 1, 3], "block 2 is a private copy");
    let plans = m.take_copy_plans();
    assert_eq!(
        plans,
        vec![CopyPlan {
            fence: Fence(1),
            wait_for: Fence::NONE,
            copies: vec![GroupCopy {
                pool_group: PoolGroupId(0),
                src_tier: Tier::Gpu,
                dst_tier: Tier::Gpu,
                pairs: vec![(SlotId(2), SlotId(3))],
            }],
        }]
    );
    let info = m.info_of(&h).unwrap();
    assert_eq!((info.pending_copy, info.ready_after), (false, Fence(1)));
    assert_eq!(m.stats().partial_copies, 1);
    assert_eq!(m.stats().reused_tokens, 9);
    // Writing token 9 goes to the private page; the shared partial page stays cached.
    assert!(m.resize(&h, 12, 9).unwrap());
    m.take_events();
    m.commit(&h, &toks(9..12)).unwrap();
    // The full block [8..12) replaces the partial [8, 9] it extends; the old partial page
    // (nobody holds it) is freed.
    assert_eq!(m.num_cached_blocks(), 3);
    assert!(matches!(
        m.take_events().as_slice(),
        [
            KvEvent::Stored { num_tokens: 4, .. },
            KvEvent::Removed { .. }
        ]
    ));
    assert_eq!(m.occupied_slots(Tier::Gpu), vec![3]);
}

#[test]
fn duplicate_commit_rebases_onto_the_tree_page() {
    let mut m = mgr(8, 0);
    let a = start(&mut m, 1, &toks(0..9), 35);
    let b = start(&mut m, 2, &toks(0..9), 35);
    assert!(m.resize(&a, 8, 0).unwrap());
    assert!(m.resize(&b, 8, 0).unwrap());
    assert_eq!((table(&m, &a), table(&m, &b)), (vec![0, 1], vec![2, 3]));
    m.commit(&a, &toks(0..8)).unwrap();
    m.commit(&b, &toks(0..8)).unwrap();
    assert_eq!(table(&m, &b), vec![0, 1], "B now reads A's committed pages");
    assert_eq!(m.occupied_slots(Tier::Gpu), vec![2]);
    assert_eq!(m.stats().rebased_blocks, 2);
    assert_eq!(m.num_cached_blocks(), 2);
    // B keeps going after the rebase: its next block links under the shared chain.
    assert!(m.resize(&b, 12, 8).unwrap());
    m.commit(&b, &toks(8..12)).unwrap();
    assert_eq!(m.num_cached_blocks(), 3);
    m.check_invariants();
}

#[test]
fn eviction_is_lowest_priority_then_lru() {
    let mut m = mgr(4, 0);
    cache(&mut m, 1, &toks(100..104), 50);
    cache(&mut m, 2, &toks(200..204), 10);
    cache(&mut m, 3, &toks(300..304), 10);
    cache(&mut m, 4, &toks(400..404), 35);
    assert_eq!(m.num_cached_blocks(), 4);
    let cached = |m: &mut KvCacheManager, base: u32| {
        m.probe_reuse(ReuseScope::SHARED, &toks(base..base + 5))
            .unwrap()
            == 4
    };
    let h = start(&mut m, 5, &toks(0..20), 35);
    let mut order = Vec::new();
    for blocks in 1..=4u64 {
        assert!(m.resize(&h, blocks * 4, 0).unwrap());
        let gone: Vec<u32> = [100, 200, 300, 400]
            .into_iter()
            .filter(|&b| !cached(&mut m, b) && !order.contains(&b))
            .collect();
        assert_eq!(gone.len(), 1);
        order.push(gone[0]);
    }
    assert_eq!(order, vec![200, 300, 400, 100]);
    assert_eq!(m.stats().dropped_pages, 4);
    // The GPU is full of locked pages: a new sequence cannot even resume.
    let other = m
        .create(
            RequestId(6),
            ReuseScope::SHARED,
            &toks(0..3),
            SeqOptions::default(),
        )
        .unwrap();
    assert!(
        !m.resume(&other.handle).unwrap(),
        "100 % utilization, nothing evictable"
    );
    let removed = m
        .take_events()
        .into_iter()
        .filter(|e| matches!(e, KvEvent::Removed { .. }))
        .count();
    assert_eq!(removed, 4);
}

#[test]
fn failed_resize_changes_nothing() {
    let mut m = mgr(3, 0);
    cache(&mut m, 1, &toks(0..4), 35); // one cached block (evictable)
    let a = start(&mut m, 2, &toks(10..20), 35);
    assert!(m.resize(&a, 8, 0).unwrap()); // evicts nothing: 2 free slots
    let b = start(&mut m, 3, &toks(20..30), 35);
    let before = m.fingerprint();
    assert!(!m.resize(&b, 8, 0).unwrap(), "needs 2, only 1 evictable");
    assert_eq!(m.fingerprint(), before);
    assert_eq!(m.stats().resize_failures, 1);
    assert_eq!(
        m.num_cached_blocks(),
        1,
        "the cached block was not evicted in vain"
    );
    assert!(m.resize(&b, 4, 0).unwrap());
    assert_eq!(m.num_cached_blocks(), 0);
}

#[test]
fn offload_onboard_and_exact_resume_rollback() {
    let opts = ManagerOptions {
        max_util_for_resume: 1.0,
        ..Default::default()
    };
    let mut m = mgr_with(2, 2, opts);
    let a = start(&mut m, 1, &toks(0..5), 35);
    assert!(m.resize(&a, 4, 0).unwrap());
    m.commit(&a, &toks(0..4)).unwrap();
    m.suspend(&a).unwrap();
    m.suspend(&a).unwrap();
    // B needs both GPU slots: A's held page moves to the host.
    let b = start(&mut m, 2, &toks(10..20), 35);
    assert!(m.resize(&b, 8, 0).unwrap());
    assert_eq!(
        m.take_copy_plans(),
        vec![CopyPlan {
            fence: Fence(1),
            wait_for: Fence::NONE,
            copies: vec![GroupCopy {
                pool_group: PoolGroupId(0),
                src_tier: Tier::Gpu,
                dst_tier: Tier::Host,
                pairs: vec![(SlotId(0), SlotId(0))],
            }],
        }]
    );
    assert_eq!(
        table(&m, &b),
        vec![1, 0],
        "B got the slot freed behind the copy"
    );
    assert_eq!(m.info_of(&b).unwrap().ready_after, Fence(1));
    assert_eq!(m.stats().offloaded_pages, 1);
    assert_eq!(m.stats().offloaded_bytes, 8);
    // A cannot come back while B holds everything: nothing changes.
    let before = m.fingerprint();
    assert!(!m.resume(&a).unwrap());
    assert_eq!(m.fingerprint(), before);
    // Once B is suspended, A comes back: B's first block goes to the host, A's returns.
    m.suspend(&b).unwrap();
    assert!(m.resume(&a).unwrap());
    assert_eq!(
        m.take_copy_plans(),
        vec![CopyPlan {
            fence: Fence(2),
            wait_for: Fence::NONE,
            copies: vec![
                GroupCopy {
                    pool_group: PoolGroupId(0),
                    src_tier: Tier::Gpu,
                    dst_tier: Tier::Host,
                    pairs: vec![(SlotId(1), SlotId(1))],
                },
                GroupCopy {
                    pool_group: PoolGroupId(0),
                    src_tier: Tier::Host,
                    dst_tier: Tier::Gpu,
                    pairs: vec![(SlotId(0), SlotId(1))],
                },
            ],
        }]
    );
    assert_eq!(table(&m, &a), vec![1]);
    assert_eq!(m.stats().onboarded_pages, 1);
    let tier_updates: Vec<(Tier, Tier)> = m
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::TierUpdated { from, to, .. } => Some((from, to)),
            _ => None,
        })
        .collect();
    assert_eq!(
        tier_updates,
        vec![(Tier::Gpu, Tier::Host), (Tier::Host, Tier::Gpu)]
    );
    m.check_invariants();
}

#[test]
fn resume_gate_is_per_pool_group_utilization() {
    let mut m = mgr(4, 4); // default max_util_for_resume 0.97
    let a = start(&mut m, 1, &toks(0..2), 35);
    m.suspend(&a).unwrap();
    let b = start(&mut m, 2, &toks(10..30), 35);
    assert!(m.resize(&b, 16, 0).unwrap());
    assert_eq!(m.usage(Tier::Gpu)[0].utilization, 1.0);
    assert!(!m.resume(&a).unwrap(), "100 % > 97 %");
    assert_eq!(m.stats().resume_refusals, 1);
    assert!(m.resize(&b, 12, 0).unwrap());
    assert_eq!(m.usage(Tier::Gpu)[0].utilization, 0.75);
    assert!(m.resume(&a).unwrap());
}

#[test]
fn released_slots_wait_for_their_last_user() {
    let opts = ManagerOptions {
        enable_block_reuse: false,
        ..Default::default()
    };
    let mut m = mgr_with(2, 0, opts);
    let mut a = start(&mut m, 1, &toks(0..4), 35);
    assert!(m.resize(&a, 4, 0).unwrap());
    assert_eq!(table(&m, &a), vec![0]);
    let step = m.issue_fence(); // a step that uses A is in flight
    m.close(&mut a).unwrap();
    // The fresh slot 1 is preferred over slot 0, still in flight.
    let b = start(&mut m, 2, &toks(0..4), 35);
    assert!(m.resize(&b, 4, 0).unwrap());
    assert_eq!(
        (table(&m, &b), m.info_of(&b).unwrap().ready_after),
        (vec![1], Fence::NONE)
    );
    // Slot 0 is handed out with the wait made explicit.
    let c = start(&mut m, 3, &toks(0..4), 35);
    assert!(m.resize(&c, 4, 0).unwrap());
    assert_eq!(
        (table(&m, &c), m.info_of(&c).unwrap().ready_after),
        (vec![0], step)
    );
    assert_eq!(
        m.complete_fences(Fence(9)),
        Err(KvError::FenceNotIssued {
            fence: Fence(9),
            issued: step
        })
    );
    m.complete_fences(step).unwrap();
    assert_eq!(m.completed_fence(), step);
}

#[test]
fn donated_page_when_the_tree_copy_is_offloaded() {
    let opts = ManagerOptions {
        max_util_for_resume: 1.0,
        ..Default::default()
    };
    let mut m = mgr_with(2, 4, opts);
    let mut a = start(&mut m, 1, &toks(0..5), 35);
    let b = start(&mut m, 2, &toks(0..5), 35);
    assert!(m.resize(&a, 4, 0).unwrap());
    assert!(m.resize(&b, 4, 0).unwrap());
    m.commit(&a, &toks(0..4)).unwrap();
    m.suspend(&a).unwrap();
    // Pressure moves A's committed page to the host.
    let c = start(&mut m, 3, &toks(50..55), 35);
    assert!(m.resize(&c, 4, 0).unwrap());
    assert_eq!(m.stats().offloaded_pages, 1);
    m.take_events();
    // B commits the same block: the tree's copy is off the GPU, so B donates its page.
    m.commit(&b, &toks(0..4)).unwrap();
    assert!(matches!(
        m.take_events().as_slice(),
        [KvEvent::TierUpdated {
            from: Tier::Host,
            to: Tier::Gpu,
            ..
        }]
    ));
    assert_eq!(table(&m, &b), vec![1]);
    assert_eq!(m.num_cached_blocks(), 1);
    // A still owns its (now private) host page; closing A frees it.
    assert_eq!(m.occupied_slots(Tier::Host), vec![1]);
    m.close(&mut a).unwrap();
    assert_eq!(m.occupied_slots(Tier::Host), vec![0]);
    assert_eq!(m.probe_reuse(ReuseScope::SHARED, &toks(0..5)).unwrap(), 4);
    m.check_invariants();
}

#[test]
fn bad_input_gets_typed_errors() {
    let mut m = mgr(4, 0);
    let mut h = start(&mut m, 1, &toks(0..8), 35);
    assert!(m.resize(&h, 8, 4).unwrap());
    assert_eq!(
        m.resize(&h, 8, 3),
        Err(KvError::HistoryBackwards {
            id: RequestId(1),
            current: 4,
            requested: 3
        })
    );
    assert_eq!(
        m.resize(&h, 5, 6),
        Err(KvError::CapacityBelowHistory {
            id: RequestId(1),
            capacity: 5,
            history: 6
        })
    );
    assert_eq!(
        m.commit(&h, &toks(0..9)),
        Err(KvError::CommitBeyondCapacity {
            id: RequestId(1),
            adding: 9,
            total: 9,
            capacity: 8
        })
    );
    assert_eq!(
        m.commit(&h, &[TokenId(1), TokenId(1 << 31)]),
        Err(KvError::TokenOutOfRange {
            index: 1,
            value: 1 << 31,
            max: TokenId::MAX
        })
    );
    assert!(matches!(
        m.create(
            RequestId(1),
            ReuseScope::SHARED,
            &toks(0..3),
            SeqOptions::default()
        ),
        Err(KvError::DuplicateRequest { .. })
    ));
    assert!(matches!(
        m.create(
            RequestId(2),
            ReuseScope::SHARED,
            &toks(0..3),
            SeqOptions { priority: 101 }
        ),
        Err(KvError::InvalidOption {
            field: "priority",
            ..
        })
    ));
    assert_eq!(
        m.resize(&h, 20, 4),
        Err(KvError::SequenceTooLong {
            id: RequestId(1),
            tokens: 20,
            blocks: 5,
            group: PoolGroupId(0),
            capacity: 4,
            capacity_tokens: 16
        })
    );
    m.suspend(&h).unwrap();
    assert!(matches!(
        m.resize(&h, 8, 4),
        Err(KvError::NotActive {
            status: SeqStatus::Suspended,
            ..
        })
    ));
    assert!(matches!(
        m.write_block_table(&h, LC0, &mut [0; 4]),
        Err(KvError::NotActive { .. })
    ));
    assert!(m.resume(&h).unwrap());
    assert!(matches!(
        m.write_block_table(&h, LC0, &mut [0; 1]),
        Err(KvError::InvalidOption { .. })
    ));
    m.commit(&h, &toks(0..6)).unwrap();
    m.stop_committing(&h).unwrap();
    m.stop_committing(&h).unwrap();
    assert_eq!(
        m.commit(&h, &toks(6..7)),
        Err(KvError::CommitAfterStop { id: RequestId(1) })
    );
    let mut other = mgr(4, 0);
    assert_eq!(
        other.resize(&h, 8, 4),
        Err(KvError::WrongManager { id: RequestId(1) })
    );
    assert_eq!(
        other.close(&mut h),
        Err(KvError::WrongManager { id: RequestId(1) })
    );
    m.close(&mut h).unwrap();
    assert_eq!(
        m.commit(&h, &toks(0..1)),
        Err(KvError::SequenceClosed { id: RequestId(1) })
    );
    assert_eq!(
        m.suspend(&h),
        Err(KvError::SequenceClosed { id: RequestId(1) })
    );
    assert!(matches!(
        KvCacheManager::new(
            plan(),
            TierSlots {
                gpu: vec![0],
                host: vec![]
            },
            ManagerOptions::default()
        ),
        Err(KvError::InvalidOption {
            field: "gpu_slots",
            ..
        })
    ));
    assert!(matches!(
        KvCacheManager::new(
            plan(),
            TierSlots {
                gpu: vec![4],
                host: vec![]
            },
            ManagerOptions {
                max_util_for_resume: 0.0,
                ..Default::default()
            }
        ),
        Err(KvError::InvalidOption {
            field: "max_util_for_resume",
            ..
        })
    ));
    let msg = KvError::HistoryBackwards {
        id: RequestId(3),
        current: 9,
        requested: 2,
    }
    .to_string();
    assert_eq!(msg, "request 3: history may not go backwards (9 → 2)");
}

#[test]
fn rejected_draft_tokens_shrink_capacity_and_never_enter_the_cache() {
    let mut m = mgr(8, 0);
    let mut h = start(&mut m, 1, &toks(0..4), 35);
    // Prompt of 4 processed, then one decode step with 3 draft tokens (capacity 4+1+3).
    assert!(m.resize(&h, 8, 0).unwrap());
    m.commit(&h, &toks(0..4)).unwrap();
    assert!(m.resize(&h, 4 + 1 + 3 + 1, 4).unwrap());
    assert_eq!(m.info_of(&h).unwrap().num_blocks, 3);
    // One draft accepted: the target token and the draft are committed, the rest rolled back.
    m.commit(&h, &[TokenId(40), TokenId(41)]).unwrap();
    assert!(m.resize(&h, 6, 6).unwrap());
    assert_eq!(m.info_of(&h).unwrap().num_blocks, 2);
    assert_eq!(m.occupied_slots(Tier::Gpu), vec![2]);
    m.close(&mut h).unwrap();
    let mut p = toks(0..4);
    p.extend([TokenId(40), TokenId(41), TokenId(0)]);
    assert_eq!(m.probe_reuse(ReuseScope::SHARED, &p).unwrap(), 6);
}

/// Fault drill: GPU room is refused at random points (as if the storage could not supply
/// memory) while a workload creates, grows, commits, suspends, resumes and closes
/// sequences with reuse and host offload. Every refused `resize` / `resume` must leave
/// every structure exactly as it was (fingerprint), and the manager must stay
/// consistent and keep serving.
#[test]
fn injected_room_failures_roll_back_exactly() {
    let mut m = mgr(6, 4);
    m.inject_room_failures(0xfa17, 30);
    let mut rng = 0x5eed_u64;
    let mut next = || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        rng >> 33
    };
    let mut live: Vec<(SeqHandle, u64, bool)> = Vec::new(); // (handle, capacity, active)
    let (mut refused, mut id) = (0u64, 0u64);
    for _ in 0..3000 {
        match next() % 6 {
            0 if live.len() < 5 => {
                id += 1;
                let prompt = toks((next() % 3) as u32 * 4..(next() % 3) as u32 * 4 + 6);
                let c = m
                    .create(
                        RequestId(id),
                        ReuseScope::SHARED,
                        &prompt,
                        SeqOptions::default(),
                    )
                    .unwrap();
                live.push((c.handle, 0, false));
            }
            1 | 2 if !live.is_empty() => {
                let i = (next() as usize) % live.len();
                let (h, cap, active) = &mut live[i];
                let before = m.fingerprint();
                let ok = if *active {
                    let info = m.info_of(h).unwrap();
                    let want = (info.capacity + 1 + next() % 6).min(16);
                    let r = m.resize(h, want, info.history).unwrap();
                    if r {
                        *cap = want;
                    }
                    r
                } else {
                    let r = m.resume(h).unwrap();
                    *active |= r;
                    r
                };
                if !ok {
                    refused += 1;
                    assert_eq!(m.fingerprint(), before, "a refused call changed state");
                }
            }
            3 if !live.is_empty() => {
                let i = (next() as usize) % live.len();
                let (h, _, active) = &live[i];
                if *active {
                    let info = m.info_of(h).unwrap();
                    let toks: Vec<TokenId> = (info.committed..info.capacity)
                        .map(|t| TokenId(t as u32 % 7))
                        .collect();
                    m.resize(h, info.capacity, info.capacity).unwrap();
                    m.commit(h, &toks).unwrap();
                }
            }
            4 if !live.is_empty() => {
                let i = (next() as usize) % live.len();
                if live[i].2 {
                    m.suspend(&live[i].0).unwrap();
                    live[i].2 = false;
                }
            }
            _ if !live.is_empty() => {
                let i = (next() as usize) % live.len();
                let (mut h, _, _) = live.swap_remove(i);
                m.close(&mut h).unwrap();
            }
            _ => {}
        }
        let _ = m.take_copy_plans();
        let f = m.issue_fence();
        m.complete_fences(f).unwrap();
        m.check_invariants();
    }
    eprintln!(
        "{} injected refusals, {refused} refused calls checked by fingerprint",
        m.injected_room_failures()
    );
    assert!(m.injected_room_failures() > 100);
    assert!(refused >= m.injected_room_failures());
    for (mut h, _, _) in live {
        m.close(&mut h).unwrap();
    }
    m.inject_room_failures(0, 0);
    m.check_invariants();
}

/// How a test ends a sequence.
#[derive(Clone, Copy, Debug, PartialEq)]
enum End {
    /// `close` through the handle.
    Close,
    /// The handle is dropped without `close`.
    Drop,
    /// The handle is dropped while a panic unwinds the stack that owns it.
    Panic,
}

/// Two sequences, one active with 3 blocks (10 committed tokens), one suspended holding
/// 2 reused blocks and a reused partial block; both are ended `how`. Returns the manager
/// and every event since creation.
fn end_two_sequences(how: End) -> (KvCacheManager, Vec<KvEvent>) {
    let mut m = mgr(8, 4);
    cache(&mut m, 1, &toks(0..10), 35);
    let mut events = m.take_events();
    let run = |m: &mut KvCacheManager| {
        let a = start(m, 2, &toks(20..30), 35);
        assert!(m.resize(&a, 12, 0).unwrap());
        m.commit(&a, &toks(20..30)).unwrap();
        let b = m
            .create(
                RequestId(3),
                ReuseScope::SHARED,
                &toks(0..11),
                SeqOptions::default(),
            )
            .unwrap();
        assert_eq!(b.reused_tokens, 10);
        (a, b.handle)
    };
    match how {
        End::Close => {
            let (mut a, mut b) = run(&mut m);
            m.close(&mut b).unwrap();
            m.close(&mut a).unwrap();
        }
        End::Drop => {
            let (a, b) = run(&mut m);
            drop(b);
            drop(a);
        }
        End::Panic => {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // Unwinding drops `_b`, then `_a` (reverse declaration order).
                let (_a, _b) = run(&mut m);
                panic!("the engine loop failed while it owned both handles");
            }));
            assert!(r.is_err());
        }
    }
    // Any `&mut self` call closes the sequences of dropped handles first.
    events.extend(m.take_events());
    (m, events)
}

#[test]
fn a_dropped_handle_closes_its_sequence() {
    let (closed, closed_events) = end_two_sequences(End::Close);
    for how in [End::Drop, End::Panic] {
        let (mut m, events) = end_two_sequences(how);
        assert_eq!(m.num_sequences(), 0, "{how:?}: the sequences were closed");
        // Exactly as `close`: 3 + 3 cached blocks (the partial tails were committed), all
        // evictable; the other 2 GPU slots free; nothing on the host.
        assert_eq!(m.num_cached_blocks(), 6, "{how:?}");
        assert_eq!(m.occupied_slots(Tier::Gpu), vec![6], "{how:?}");
        assert_eq!(m.occupied_slots(Tier::Host), vec![0], "{how:?}");
        let u = m.usage(Tier::Gpu)[0];
        assert_eq!((u.free, u.evictable, u.utilization), (2, 6, 0.0), "{how:?}");
        assert_eq!(m.fingerprint(), closed.fingerprint(), "{how:?}");
        assert_eq!(events, closed_events, "{how:?}");
        assert_eq!(
            m.sequence(RequestId(2)),
            Err(KvError::UnknownRequest { id: RequestId(2) }),
            "{how:?}: the id is retired"
        );
        m.check_invariants();
        // The ids can be used again and the blocks are reused as after `close`.
        let c = m
            .create(
                RequestId(2),
                ReuseScope::SHARED,
                &toks(20..31),
                SeqOptions::default(),
            )
            .unwrap();
        assert_eq!(c.reused_tokens, 10, "{how:?}");
    }
}

#[test]
fn dropped_handles_are_closed_at_the_next_mutation_and_only_forget_leaks() {
    let mut m = mgr(8, 0);
    let a = start(&mut m, 1, &toks(0..6), 35);
    assert!(m.resize(&a, 6, 0).unwrap());
    drop(a);
    // Read-only queries still see it; the next `&mut self` call (here `close_dropped`)
    // closes it.
    assert_eq!(
        (m.num_sequences(), m.occupied_slots(Tier::Gpu)),
        (1, vec![2])
    );
    m.check_invariants();
    assert_eq!(m.close_dropped(), 1);
    assert_eq!(m.close_dropped(), 0, "each dropped handle is closed once");
    assert_eq!(
        (m.num_sequences(), m.occupied_slots(Tier::Gpu)),
        (0, vec![0])
    );
    // A closed handle reports nothing when dropped.
    let mut b = start(&mut m, 2, &toks(0..6), 35);
    m.close(&mut b).unwrap();
    drop(b);
    assert_eq!(m.close_dropped(), 0);
    // `mem::forget` is the one way to leak: the sequence keeps its pages (a consistent
    // state) until the manager goes.
    let c = start(&mut m, 3, &toks(0..6), 35);
    assert!(m.resize(&c, 6, 0).unwrap());
    std::mem::forget(c);
    assert_eq!(m.close_dropped(), 0);
    assert_eq!(
        (m.num_sequences(), m.occupied_slots(Tier::Gpu)),
        (1, vec![2])
    );
    m.check_invariants();
    // A handle that outlives its manager reports to nobody.
    let d = start(&mut m, 4, &toks(0..6), 35);
    drop(m);
    drop(d);
}

#[test]
fn reset_prefix_cache_drops_every_block_on_every_tier() {
    let mut m = mgr(4, 4);
    cache(&mut m, 1, &toks(0..8), 35); // GPU slots 0, 1
    cache(&mut m, 2, &toks(20..28), 35); // GPU slots 2, 3
    cache(&mut m, 3, &toks(40..48), 35); // offloads request 1's blocks to the host
    assert_eq!(m.num_cached_blocks(), 6);
    assert_eq!(m.occupied_slots(Tier::Gpu), vec![4]);
    assert_eq!(m.occupied_slots(Tier::Host), vec![2]);
    let offload = m.take_copy_plans();
    assert_eq!(offload.len(), 1, "the offload is decided, not run yet");
    m.take_events();
    let issued = m.issued_fence();
    assert_eq!(
        m.reset_prefix_cache(),
        Ok(ResetReport {
            blocks: 6,
            gpu_pages: 4,
            host_pages: 2
        })
    );
    assert_eq!(
        m.take_events(),
        vec![KvEvent::AllBlocksCleared],
        "one event, no Removed per block"
    );
    assert_eq!((m.num_cached_blocks(), m.num_pages()), (0, 0));
    assert_eq!(m.tree.num_roots(), 0, "scope roots go too");
    assert_eq!(m.occupied_slots(Tier::Gpu), vec![0]);
    assert_eq!(m.occupied_slots(Tier::Host), vec![0]);
    for tier in Tier::ALL {
        let u = m.usage(tier)[0];
        assert_eq!((u.free, u.evictable, u.utilization), (4, 0, 0.0), "{tier}");
    }
    m.check_invariants();
    assert_eq!(m.probe_reuse(ReuseScope::SHARED, &toks(0..9)).unwrap(), 0);
    assert_eq!(m.probe_reuse(ReuseScope::SHARED, &toks(40..49)).unwrap(), 0);
    // An empty cache resets again: nothing dropped, the event again (a router that missed
    // the first one converges).
    assert_eq!(m.reset_prefix_cache(), Ok(ResetReport::default()));
    assert_eq!(m.take_events(), vec![KvEvent::AllBlocksCleared]);
    // Freed slots wait for the work issued before the reset (the offload above): a new
    // owner of all four GPU slots is told to wait for it.
    let mut a = start(&mut m, 4, &toks(40..56), 35);
    assert_eq!(m.info_of(&a).unwrap().reused_tokens, 0);
    assert!(m.resize(&a, 16, 0).unwrap());
    assert_eq!(m.info_of(&a).unwrap().ready_after, issued);
    // The tree grows again from nothing.
    m.commit(&a, &toks(40..56)).unwrap();
    m.close(&mut a).unwrap();
    assert_eq!(m.num_cached_blocks(), 4);
    assert_eq!(m.probe_reuse(ReuseScope::SHARED, &toks(40..49)).unwrap(), 8);
    m.check_invariants();
}

#[test]
fn reset_prefix_cache_is_refused_while_sequences_hold_pages() {
    let mut m = mgr(8, 4);
    cache(&mut m, 1, &toks(0..8), 35);
    m.take_events();
    // Active, then suspended (holding, not locking): refused either way, nothing changes.
    let a = start(&mut m, 2, &toks(0..6), 35);
    assert_eq!(m.info_of(&a).unwrap().reused_tokens, 5);
    // A sequence that holds no page does not count.
    let mut idle = m
        .create(
            RequestId(3),
            ReuseScope::SHARED,
            &toks(50..51),
            SeqOptions::default(),
        )
        .unwrap()
        .handle;
    for suspend in [false, true] {
        if suspend {
            m.suspend(&a).unwrap();
        }
        let before = m.fingerprint();
        let err = m.reset_prefix_cache().unwrap_err();
        assert_eq!(err, KvError::PrefixCacheInUse { sequences: 1 });
        assert_eq!(
            err.to_string(),
            "cannot reset the prefix cache: 1 sequence(s) still hold pages; finish or close \
             them first (nothing was changed)"
        );
        assert_eq!(m.fingerprint(), before, "suspended: {suspend}");
        assert_eq!(m.take_events(), vec![], "no event for a refusal");
    }
    // Its handle dropped, the sequence is closed first and the reset goes through.
    drop(a);
    assert_eq!(
        m.reset_prefix_cache(),
        Ok(ResetReport {
            blocks: 2,
            gpu_pages: 2,
            host_pages: 0
        })
    );
    // The idle sequence survived and works on the empty cache.
    assert!(m.resume(&idle).unwrap());
    assert!(m.resize(&idle, 4, 0).unwrap());
    m.commit(&idle, &toks(50..54)).unwrap();
    m.close(&mut idle).unwrap();
    assert_eq!(m.num_cached_blocks(), 1);
}

/// What a router learns from the events: (block key, life cycle) → tier.
type TierMirror = BTreeMap<(BlockKey, LifeCycleId), Tier>;

/// Replays KV events into `mirror`, checking that each event agrees with what the mirror
/// already knows.
fn replay_events(m: &mut KvCacheManager, mirror: &mut TierMirror) -> Vec<KvEvent> {
    let events = m.take_events();
    let n_lc = m.plan().num_life_cycles();
    for e in &events {
        match *e {
            KvEvent::Stored { key, tier, .. } => {
                for lc in 0..n_lc {
                    let lc = LifeCycleId(lc as u16);
                    assert_eq!(mirror.insert((key, lc), tier), None, "{e:?}: stored twice");
                }
            }
            KvEvent::Removed { key } => mirror.retain(|k, _| k.0 != key),
            KvEvent::TierUpdated {
                key,
                life_cycle,
                from,
                to,
            } => {
                let t = mirror
                    .get_mut(&(key, life_cycle))
                    .unwrap_or_else(|| panic!("{e:?}: unknown block"));
                assert_eq!(*t, from, "{e:?}: the mirror has it on {t}");
                *t = to;
            }
            KvEvent::AllBlocksCleared => mirror.clear(),
        }
    }
    events
}

fn mirror_matches(m: &KvCacheManager, mirror: &TierMirror) {
    let real: Vec<(BlockKey, LifeCycleId, Tier)> = m
        .cached_blocks()
        .into_iter()
        .map(|p| (p.key, p.life_cycle, p.tier))
        .collect();
    let mirrored: Vec<(BlockKey, LifeCycleId, Tier)> =
        mirror.iter().map(|(k, &t)| (k.0, k.1, t)).collect();
    assert_eq!(mirrored, real, "the events describe another cache");
}

/// Issue: a suspended sequence whose duplicate block is on the host used to "donate" its
/// own host page and announce `Host → Gpu`, and resuming it announced `Host → Gpu` a
/// second time. Every event must state the true tier.
#[test]
fn duplicate_commit_of_an_offloaded_suspended_block_states_the_true_tier() {
    let opts = ManagerOptions {
        max_util_for_resume: 1.0,
        ..Default::default()
    };
    let mut m = mgr_with(4, 8, opts);
    let mut mirror = TierMirror::new();
    // B writes a block and one token, and is suspended before committing.
    let b = start(&mut m, 2, &toks(0..6), 35);
    assert!(m.resize(&b, 5, 5).unwrap());
    m.suspend(&b).unwrap();
    // A commits the same first block and closes: it stays cached on the GPU.
    cache(&mut m, 1, &toks(0..4), 35);
    replay_events(&mut m, &mut mirror);
    mirror_matches(&m, &mirror);
    // X takes all four GPU slots: B's pages and A's cached block go to the host.
    let mut x = start(&mut m, 3, &toks(100..117), 35);
    assert!(m.resize(&x, 16, 0).unwrap());
    assert_eq!(m.occupied_slots(Tier::Host), vec![3]);
    replay_events(&mut m, &mut mirror);
    mirror_matches(&m, &mirror);
    // B commits while suspended: the block it duplicates is on the host, and so is B's.
    m.commit(&b, &toks(0..5)).unwrap();
    let events = replay_events(&mut m, &mut mirror);
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, KvEvent::TierUpdated { .. })),
        "nothing moved, yet: {events:?}"
    );
    mirror_matches(&m, &mirror);
    assert_eq!(
        m.cached_blocks().iter().map(|p| p.tier).collect::<Vec<_>>(),
        vec![Tier::Host]
    );
    // X leaves; B resumes: its block comes back to the GPU, announced once.
    m.close(&mut x).unwrap();
    replay_events(&mut m, &mut mirror);
    assert!(m.resume(&b).unwrap());
    let events = replay_events(&mut m, &mut mirror);
    let moves: Vec<(Tier, Tier)> = events
        .iter()
        .filter_map(|e| match *e {
            KvEvent::TierUpdated { from, to, .. } => Some((from, to)),
            _ => None,
        })
        .collect();
    assert_eq!(moves, vec![(Tier::Host, Tier::Gpu)]);
    mirror_matches(&m, &mirror);
    m.check_invariants();
}

/// A block whose life cycles' pages sit on different tiers when it is stored (a suspended
/// sequence, one pool group offloaded, the other not): the events must still say where
/// each page is.
#[test]
fn a_block_stored_across_tiers_reports_each_page_tier() {
    let key_layer = |layer: u32, row_bytes: u32| LayerSpec {
        layer: LayerId(layer),
        life_cycle: LifeCycleKey(layer),
        buffers: vec![BufferSpec::new(
            Role::Key,
            RowLayout::Interleaved { row_bytes },
        )],
    };
    // Different slot sizes: two pool groups, one life cycle each.
    let plan = PoolPlan::v2(4, vec![key_layer(0, 2), key_layer(1, 4)]).unwrap();
    assert_eq!(plan.pool_groups().len(), 2);
    let mut m = KvCacheManager::new(
        plan,
        TierSlots {
            gpu: vec![2, 4],
            host: vec![4, 4],
        },
        ManagerOptions::default(),
    )
    .unwrap();
    let mut mirror = TierMirror::new();
    let s = start(&mut m, 1, &toks(0..5), 35);
    assert!(m.resize(&s, 4, 4).unwrap());
    m.suspend(&s).unwrap();
    // Y needs both slots of group 0 (S's page there goes to the host) and two of the
    // four of group 1 (S's page there stays).
    let y = start(&mut m, 2, &toks(50..58), 35);
    assert!(m.resize(&y, 8, 0).unwrap());
    assert_eq!(m.occupied_slots(Tier::Host), vec![1, 0]);
    m.commit(&s, &toks(0..4)).unwrap();
    replay_events(&mut m, &mut mirror);
    mirror_matches(&m, &mirror);
    assert_eq!(
        m.cached_blocks().iter().map(|p| p.tier).collect::<Vec<_>>(),
        vec![Tier::Host, Tier::Gpu]
    );
    m.check_invariants();
}

/// `sync_block_table` against the full table: random sequences share prefixes, take
/// room for a token and drafts, later accept some (rebasing duplicate blocks onto cached
/// pages, dropping draft blocks that another sequence may then take), are suspended
/// (their pages offloaded by others' growth) and resumed; at random times each active
/// sequence's kept row, brought up to date from the returned column only, must equal
/// `write_block_table`'s row. Removing any one change mark in the manager (resize
/// shrink, rebase, resume) fails this test.
#[test]
fn incremental_block_tables_equal_the_full_table() {
    let mut rng = 0x7ab1e_u64;
    let mut next = |n: u64| {
        rng = rng
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (rng >> 33) % n
    };
    struct S {
        h: SeqHandle,
        row: Vec<i32>,
        committed: u64,
        drafts: Option<u64>,
        suspended: bool,
    }
    let (mut rewritten, mut moved) = (0usize, 0usize);
    for round in 0..60 {
        let mut m = mgr(10 + next(14) as u32, 64);
        let mut seqs: Vec<S> = Vec::new();
        let mut id = 0u64;
        for _ in 0..400 {
            match next(8) {
                0 if seqs.len() < 6 => {
                    // A prompt sharing a prefix with an earlier one: some blocks reused.
                    let base = next(3) as u32 * 100;
                    let len = 1 + next(14) as u32;
                    id += 1;
                    let c = m
                        .create(
                            RequestId(id),
                            ReuseScope::SHARED,
                            &toks(base..base + len),
                            SeqOptions::default(),
                        )
                        .unwrap();
                    let mut h = c.handle;
                    if m.resume(&h).unwrap() {
                        let committed = m.info_of(&h).unwrap().committed;
                        seqs.push(S {
                            h,
                            row: Vec::new(),
                            committed,
                            drafts: None,
                            suspended: false,
                        });
                    } else {
                        m.close(&mut h).unwrap();
                    }
                }
                1..=3 if !seqs.is_empty() => {
                    // Half a step: room for the next token and drafts, or the verdict.
                    let i = next(seqs.len() as u64) as usize;
                    let s = &mut seqs[i];
                    if s.suspended {
                        continue;
                    }
                    let have = s.committed;
                    match s.drafts.take() {
                        None => {
                            let d = next(6);
                            if m.resize(&s.h, have + 1 + d, have).unwrap() {
                                s.drafts = Some(d);
                            }
                        }
                        Some(d) => {
                            let take = 1 + next(d + 1);
                            let t: Vec<TokenId> = (0..take)
                                .map(|k| TokenId(1000 + (have + k) as u32 % 7))
                                .collect();
                            m.accept_tokens(&s.h, &t).unwrap();
                            s.committed += take;
                        }
                    }
                }
                4 if !seqs.is_empty() => {
                    let i = next(seqs.len() as u64) as usize;
                    let s = &mut seqs[i];
                    if s.drafts.is_none() {
                        m.suspend(&s.h).unwrap();
                        s.suspended = true;
                    }
                }
                5 | 6 if !seqs.is_empty() => {
                    let i = next(seqs.len() as u64) as usize;
                    let s = &mut seqs[i];
                    if s.suspended && m.resume(&s.h).unwrap() {
                        s.suspended = false;
                    }
                }
                7 if !seqs.is_empty() && next(3) == 0 => {
                    let i = next(seqs.len() as u64) as usize;
                    let mut s = seqs.swap_remove(i);
                    m.close(&mut s.h).unwrap();
                }
                _ => {}
            }
            // Read some rows now, others later: changes pile up between two reads as
            // they do between two steps of a request.
            for s in &mut seqs {
                if s.suspended {
                    assert!(m.sync_block_table(&s.h, LC0, &mut s.row).is_err());
                    continue;
                }
                if next(3) != 0 {
                    continue;
                }
                let old = s.row.clone();
                let from = m.sync_block_table(&s.h, LC0, &mut s.row).unwrap();
                assert!(
                    from <= old.len(),
                    "round {round}: wrote from {from} past the old row"
                );
                rewritten += s.row.len() - from;
                moved += (from..old.len().min(s.row.len()))
                    .filter(|&c| old[c] != s.row[c])
                    .count();
                let mut full = vec![0i32; s.row.len() + 2];
                let n = m.write_block_table(&s.h, LC0, &mut full).unwrap();
                assert_eq!(n, s.row.len(), "round {round}");
                assert_eq!(s.row[..], full[..n], "round {round}: kept row differs");
                // Unchanged since the call just made: nothing to write.
                let len = s.row.len();
                assert_eq!(m.sync_block_table(&s.h, LC0, &mut s.row).unwrap(), len);
            }
        }
    }
    // The randomized runs did rewrite kept columns in place (not only append).
    assert!(
        rewritten > 0 && moved > 0,
        "rewritten {rewritten}, moved {moved}"
    );
}
