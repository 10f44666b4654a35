//! Exact-value tests of the step metadata and the draft-replay mechanics, on hand-made
//! slots (T = 64, indexer page scale 3, FP8 indexer pages of 8448 B).

use super::*;
use crate::layout::IndexerPageLayout;

const PAGE: i64 = 8448;

fn layout(scale: u32) -> MetadataLayout {
    MetadataLayout {
        tokens_per_block: 64,
        indexer_page_scale: scale,
        indexer: Some(IndexerPageLayout {
            tokens_per_block: 64,
            data_bytes: 128,
            scale_bytes: 4,
        }),
    }
}

fn dims(blocks: usize) -> MetadataDims {
    MetadataDims {
        max_num_sequences: 4,
        max_blocks_per_seq: blocks,
        max_num_tokens: 600,
        max_context_kv_tokens: 1024,
    }
}

fn req(kind: RequestKind, slots: &[i32], cached: u32, new: u32) -> StepRequest<'_> {
    StepRequest {
        kind,
        block_slots: slots,
        row: crate::core::RowStamp::UNKNOWN,
        num_cached: cached,
        num_new: new,
        helix_inactive: false,
    }
}

use RequestKind::{Context, Generation};

#[test]
fn step_metadata_exact_values() {
    let mut m = StepMetadata::new(layout(3), dims(4), None, true).unwrap();
    let reqs = [req(Context, &[5, 2], 60, 10), req(Generation, &[7], 63, 1)];
    let c = m.prepare(&layout(3), &reqs).unwrap();
    assert_eq!(
        c,
        StepCounts {
            num_requests: 2,
            num_context_requests: 1,
            num_tokens: 11,
            num_context_tokens: 10,
            num_full_kv_tokens: 70
        }
    );
    assert_eq!(&m.indexer_page_table()[..8], &[15, 6, 0, 0, 21, 0, 0, 0]);
    assert!(m.indexer_page_table()[8..].iter().all(|&p| p == 0));
    assert_eq!(&m.block_table()[..8], &[5, 2, -1, -1, 7, -1, -1, -1]);
    let v = m.slot_mapping_value();
    let s = m.slot_mapping_scale();
    assert_eq!(
        (v[0], s[0]),
        (15 * PAGE + 60 * 128, 15 * PAGE + 8192 + 60 * 4)
    );
    assert_eq!(
        (v[3], s[3]),
        (15 * PAGE + 63 * 128, 15 * PAGE + 8192 + 63 * 4)
    );
    assert_eq!((v[4], s[4]), (6 * PAGE, 6 * PAGE + 8192));
    assert_eq!(
        (v[10], s[10]),
        (21 * PAGE + 63 * 128, 21 * PAGE + 8192 + 63 * 4)
    );
    assert!(
        v[11..].iter().chain(&s[11..]).all(|&o| o == -1),
        "padding is −1"
    );
    assert_eq!(
        &m.mla_slot_mapping()[..5],
        &[5 * 64 + 60, 5 * 64 + 61, 5 * 64 + 62, 5 * 64 + 63, 2 * 64]
    );
    assert_eq!(m.mla_slot_mapping()[10], 7 * 64 + 63);
    assert_eq!(
        &m.req_idx_per_token()[..12],
        &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]
    );
    assert_eq!(&m.cu_seqlen_ks()[..11], &[0; 11]);
    assert_eq!(
        &m.cu_seqlen_ke()[..11],
        &[61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 0]
    );
    assert_eq!(&m.kv_lens()[..3], &[70, 64, 0]);
    assert_eq!(&m.num_cached()[..3], &[60, 63, 0]);
    // Cached context tokens: own full-KV mappings of all 70 KV tokens.
    assert!(!m.bindings().full_kv_aliased());
    let fv = m.full_kv_value();
    assert_eq!(
        (fv[0], fv[63], fv[64], fv[69], fv[70]),
        (
            15 * PAGE,
            15 * PAGE + 63 * 128,
            6 * PAGE,
            6 * PAGE + 5 * 128,
            -1
        )
    );
    assert_eq!(m.full_kv_scale()[69], 6 * PAGE + 8192 + 5 * 4);
}

#[test]
fn context_windows_span_several_context_requests() {
    let mut m = StepMetadata::new(layout(1), dims(4), None, true).unwrap();
    let reqs = [
        req(Context, &[0], 0, 3),
        req(Context, &[1, 2], 62, 2),
        req(Generation, &[3], 10, 1),
    ];
    m.prepare(&layout(1), &reqs).unwrap();
    // Request 1 starts after request 0's 3 KV tokens.
    assert_eq!(&m.cu_seqlen_ks()[..6], &[0, 0, 0, 3, 3, 0]);
    assert_eq!(&m.cu_seqlen_ke()[..6], &[1, 2, 3, 3 + 63, 3 + 64, 0]);
    assert_eq!(m.counts().num_full_kv_tokens, 3 + 64);
    // Full-KV entries are request-major: request 1's first token comes after 3 entries.
    assert_eq!(m.full_kv_value()[3], PAGE);
    assert_eq!(
        m.full_kv_value()[3 + 64 - 1],
        PAGE + 63 * 128,
        "g = 63 is still in block 0"
    );
}

#[test]
fn full_kv_alias_state_and_recompute() {
    // No cached tokens in any context request: the full-KV mappings alias the slot mappings.
    let mut m = StepMetadata::new(layout(3), dims(6), None, true).unwrap();
    let slots_a = [1, 2, 3, 4, 5];
    let slots_b = [6, 7, 8, 9, 10];
    m.prepare(
        &layout(3),
        &[
            req(Context, &slots_a, 0, 130),
            req(Context, &slots_b, 0, 131),
        ],
    )
    .unwrap();
    let b = m.bindings();
    assert!(b.full_kv_aliased());
    assert_eq!(
        (b.full_kv_value, b.full_kv_scale),
        (b.slot_mapping_value, b.slot_mapping_scale)
    );
    assert_eq!(m.full_kv_value().as_ptr(), m.slot_mapping_value().as_ptr());
    assert_eq!(m.counts().num_full_kv_tokens, 0);
    m.recompute_slot_mappings(&[0, 0]).unwrap();
    assert_eq!(m.bindings(), b, "the alias survives a recompute");

    // Cached 127 / 129 with new 130 / 131: separate full-KV buffers.
    let reqs = [
        req(Context, &slots_a, 127, 130),
        req(Context, &slots_b, 129, 131),
    ];
    m.prepare(&layout(3), &reqs).unwrap();
    let b = m.bindings();
    assert!(!b.full_kv_aliased());
    assert_ne!(m.full_kv_value().as_ptr(), m.slot_mapping_value().as_ptr());
    assert_eq!(m.counts().num_full_kv_tokens, 257 + 260);
    let full_v = m.full_kv_value().to_vec();
    let full_s = m.full_kv_scale().to_vec();
    // Entry 257 is request 1's token 0: slot 6 → page 18.
    assert_eq!(full_v[257], 18 * PAGE);
    // Slot mappings of new tokens start at the cached position.
    // g = 127: block 1 (slot 2, page 6), position 63.
    assert_eq!(m.slot_mapping_value()[0], (2 * 3) * PAGE + 63 * 128);
    // A recompute with corrected lengths moves the slot mappings, not the full-KV ones.
    m.recompute_slot_mappings(&[120, 129]).unwrap();
    assert_eq!(m.bindings(), b);
    assert_eq!(m.full_kv_value(), full_v.as_slice());
    assert_eq!(m.full_kv_scale(), full_s.as_slice());
    assert_eq!(m.slot_mapping_value()[0], (2 * 3) * PAGE + 56 * 128);
    assert_eq!(&m.num_cached()[..2], &[120, 129]);
    assert_eq!(&m.kv_lens()[..2], &[250, 260]);
    // The recompute equals a fresh prepare with those lengths.
    let mut fresh = StepMetadata::new(layout(3), dims(6), None, true).unwrap();
    fresh
        .prepare(
            &layout(3),
            &[
                req(Context, &slots_a, 120, 130),
                req(Context, &slots_b, 129, 131),
            ],
        )
        .unwrap();
    assert_eq!(m.slot_mapping_value(), fresh.slot_mapping_value());
    assert_eq!(m.slot_mapping_scale(), fresh.slot_mapping_scale());
    assert_eq!(m.mla_slot_mapping(), fresh.mla_slot_mapping());
    // A generation-only step leaves the full-KV mappings (and alias state) as they were.
    m.prepare(&layout(3), &[req(Generation, &slots_a, 200, 1)])
        .unwrap();
    assert!(!m.bindings().full_kv_aliased());
    assert_eq!(m.full_kv_value(), full_v.as_slice());
    // Recompute past the blocks held is refused.
    assert!(matches!(
        m.recompute_slot_mappings(&[400]),
        Err(MetadataError::BlocksShort { request: 0, .. })
    ));
    assert!(matches!(
        m.recompute_slot_mappings(&[1, 2]),
        Err(MetadataError::RequestCount { .. })
    ));
}

#[test]
fn helix_inactive_ranks_add_no_tokens() {
    let mut m = StepMetadata::new(layout(1), dims(4), None, true).unwrap();
    let mut inactive = req(Generation, &[4, 9], 64, 1);
    inactive.helix_inactive = true;
    let reqs = [
        req(Generation, &[3], 10, 1),
        inactive,
        req(Generation, &[5], 0, 2),
    ];
    let c = m.prepare(&layout(1), &reqs).unwrap();
    assert_eq!(c.num_tokens, 3);
    assert_eq!(&m.kv_lens()[..3], &[11, 64, 2]);
    assert_eq!(&m.req_idx_per_token()[..3], &[0, 2, 2]);
    assert_eq!(
        &m.block_table()[4..8],
        &[4, -1, -1, -1],
        "kv 64: one valid block"
    );
}

#[test]
fn bad_steps_are_refused_and_change_nothing() {
    let mut m = StepMetadata::new(layout(1), dims(2), None, true).unwrap();
    m.prepare(&layout(1), &[req(Context, &[1], 0, 5)]).unwrap();
    let before = (
        m.slot_mapping_value().to_vec(),
        m.indexer_page_table().to_vec(),
        m.counts(),
    );
    let cases: Vec<(Vec<StepRequest>, MetadataError)> = vec![
        (
            vec![req(Generation, &[1], 3, 1), req(Context, &[2], 0, 1)],
            MetadataError::ContextAfterGeneration { index: 1 },
        ),
        (
            vec![req(Context, &[1], 60, 10)],
            MetadataError::BlocksShort {
                request: 0,
                kv_len: 70,
                needed: 2,
                given: 1,
            },
        ),
        (
            vec![req(Context, &[1, -1], 60, 10)],
            MetadataError::BlocksShort {
                request: 0,
                kv_len: 70,
                needed: 2,
                given: 1,
            },
        ),
        (
            vec![req(Context, &[1, 2, 3], 0, 1)],
            MetadataError::TooManyBlocks {
                request: 0,
                blocks: 3,
                max: 2,
            },
        ),
        (
            vec![req(Generation, &[1], 0, 1); 5],
            MetadataError::TooManyRequests { got: 5, max: 4 },
        ),
    ];
    for (reqs, err) in cases {
        assert_eq!(m.prepare(&layout(1), &reqs), Err(err));
        assert_eq!(
            (
                m.slot_mapping_value().to_vec(),
                m.indexer_page_table().to_vec(),
                m.counts()
            ),
            before
        );
    }
    let mut wide = StepMetadata::new(layout(1), dims(12), None, true).unwrap();
    let slots: Vec<i32> = (0..10).collect();
    assert_eq!(
        wide.prepare(&layout(1), &[req(Context, &slots, 0, 601)]),
        Err(MetadataError::TooManyTokens { got: 601, max: 600 })
    );
    let small = MetadataDims {
        max_context_kv_tokens: 10,
        ..dims(2)
    };
    let mut m = StepMetadata::new(layout(1), small, None, true).unwrap();
    assert_eq!(
        m.prepare(&layout(1), &[req(Context, &[1], 10, 5)]),
        Err(MetadataError::ContextKvOverflow { got: 15, max: 10 })
    );
    // Without full-KV support the same step aliases and needs no full-KV room.
    let mut m = StepMetadata::new(layout(1), small, None, false).unwrap();
    m.prepare(&layout(1), &[req(Context, &[1], 10, 5)]).unwrap();
    assert!(m.bindings().full_kv_aliased());
    assert!(matches!(
        StepMetadata::new(
            layout(1),
            MetadataDims {
                max_num_tokens: 0,
                ..dims(2)
            },
            None,
            true
        ),
        Err(MetadataError::BadDims { .. })
    ));
}

/// Everything a draft replay must leave identical: bindings, counts, layout and every
/// buffer's contents and address.
fn state(m: &StepMetadata) -> (Bindings, StepCounts, MetadataLayout, Vec<(usize, Vec<i64>)>) {
    let bufs = m
        .buffers
        .iter()
        .map(|b| {
            let v = match &b.data {
                super::buffers::Data::I32(v) => v.iter().map(|&x| i64::from(x)).collect(),
                super::buffers::Data::I64(v) => v.clone(),
            };
            (b.addr(), v)
        })
        .collect();
    (m.bindings(), m.counts(), m.layout(), bufs)
}

fn draft_dims() -> MetadataDims {
    MetadataDims {
        max_blocks_per_seq: 8,
        ..dims(6)
    }
}

#[test]
fn draft_replay_rebinds_and_restores_exactly() {
    for cached in [0u32, 70] {
        let mut m = StepMetadata::new(layout(3), dims(6), Some(draft_dims()), true).unwrap();
        let target_slots = [[10, 11, 12], [20, 21, 22]];
        let reqs = [
            req(Context, &target_slots[0], cached, 60),
            req(Generation, &target_slots[1], 100, 4),
        ];
        m.prepare(&layout(3), &reqs).unwrap();
        let aliased = m.bindings().full_kv_aliased();
        assert_eq!(aliased, cached == 0);
        let before = state(&m);
        let target_ids = m.set_buffers(false).unwrap();
        let target_contents: Vec<_> = target_ids.iter().map(|&id| state_of(&m, id)).collect();

        // Draft manager: one MTP layer, scale 1, its own slots.
        let draft_layout = layout(1);
        let draft_slots = [[3, 4, 5], [6, 7, 8]];
        let dreqs = [
            req(Context, &draft_slots[0], cached, 60),
            req(Generation, &draft_slots[1], 100, 4),
        ];
        let snap = m.prepare_draft(&draft_layout, &dreqs).unwrap();
        assert!(m.in_draft_replay());
        let draft_ids = m.set_buffers(true).unwrap();
        let b = m.bindings();
        assert_eq!(b.indexer_page_table, draft_ids[0]);
        assert_eq!(b.block_table, draft_ids[1]);
        assert_eq!(
            b.full_kv_aliased(),
            aliased,
            "the draft set gets the same alias decision"
        );
        assert_eq!(
            &m.indexer_page_table()[..3],
            &[3, 4, 5],
            "draft page ids (scale 1)"
        );
        assert_eq!(m.max_blocks_per_seq(), 8);
        // First new token: g = cached → draft slot 3 (g = 0) or 4 (g = 70, position 6).
        let want = if cached == 0 {
            3 * PAGE
        } else {
            4 * PAGE + 6 * 128
        };
        assert_eq!(m.slot_mapping_value()[0], want);
        // Target buffers were not written.
        for (id, c) in target_ids.iter().zip(&target_contents) {
            assert_eq!(
                &state_of(&m, *id),
                c,
                "target buffer {id:?} written during replay"
            );
        }
        // A second prepare or a target prepare during the replay is refused.
        assert_eq!(
            m.prepare_draft(&draft_layout, &dreqs),
            Err(MetadataError::ReplayActive)
        );
        assert_eq!(
            m.prepare(&layout(3), &reqs),
            Err(MetadataError::ReplayActive)
        );
        // The draft forward may recompute its slot mappings (draft buffers only).
        m.recompute_slot_mappings(&[cached, 101]).unwrap();
        for (id, c) in target_ids.iter().zip(&target_contents) {
            assert_eq!(&state_of(&m, *id), c);
        }
        m.restore(&snap).unwrap();
        assert!(!m.in_draft_replay());
        assert_eq!(
            m.bindings(),
            before.0,
            "same buffers (identity), same alias state"
        );
        assert_eq!(state(&m).0, before.0);
        assert_eq!((state(&m).1, state(&m).2), (before.1, before.2));
        for (id, c) in target_ids.iter().zip(&target_contents) {
            assert_eq!(&state_of(&m, *id), c);
        }
        // Stale snapshots and restores outside a replay are refused.
        assert_eq!(m.restore(&snap), Err(MetadataError::NotInReplay));
        let snap2 = m.prepare_draft(&draft_layout, &dreqs).unwrap();
        assert!(matches!(
            m.restore(&snap),
            Err(MetadataError::StaleSnapshot { .. })
        ));
        m.restore(&snap2).unwrap();
    }
}

fn state_of(m: &StepMetadata, id: BufferId) -> (usize, Vec<i64>) {
    let v = match m.buffer_i32(id) {
        Some(v) => v.iter().map(|&x| i64::from(x)).collect(),
        None => m.buffer_i64(id).unwrap().to_vec(),
    };
    (m.buffer_addr(id), v)
}

#[test]
fn prepare_then_restore_is_a_no_op() {
    let mut m = StepMetadata::new(layout(3), dims(6), Some(draft_dims()), true).unwrap();
    let s = [1, 2];
    m.prepare(&layout(3), &[req(Context, &s, 64, 10)]).unwrap();
    let before = state(&m);
    let d = [7, 8];
    let snap = m
        .prepare_draft(&layout(1), &[req(Context, &d, 64, 10)])
        .unwrap();
    assert_eq!(snap.bindings(), before.0);
    m.restore(&snap).unwrap();
    // Target buffers, bindings, counts, layout: identical. (Draft buffers now hold the
    // draft step, which only the draft set ever reads.)
    let after = state(&m);
    assert_eq!((after.0, after.1, after.2), (before.0, before.1, before.2));
    for id in m.set_buffers(false).unwrap() {
        let i = id.0 as usize;
        assert_eq!(after.3[i], before.3[i]);
    }
}

#[test]
fn guard_restores_on_drop_error_and_panic() {
    let mut m = StepMetadata::new(layout(3), dims(6), Some(draft_dims()), true).unwrap();
    let s = [1, 2];
    m.prepare(&layout(3), &[req(Context, &s, 64, 10)]).unwrap();
    let target = m.bindings();
    let d = [7, 8];
    let dreqs = [req(Context, &d, 64, 10)];
    {
        let g = m.draft_replay(&layout(1), &dreqs).unwrap();
        assert_ne!(g.bindings(), target);
    }
    assert_eq!(m.bindings(), target, "restored on drop");
    let failing = |m: &mut StepMetadata| -> Result<(), MetadataError> {
        let mut g = m.draft_replay(&layout(1), &dreqs)?;
        g.recompute_slot_mappings(&[9999])?; // fails: the guard restores on the way out
        Ok(())
    };
    assert!(matches!(
        failing(&mut m),
        Err(MetadataError::BlocksShort { .. })
    ));
    assert_eq!(m.bindings(), target, "restored on error");
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _g = m.draft_replay(&layout(1), &dreqs).unwrap();
        panic!("draft forward failed");
    }));
    assert!(r.is_err());
    assert_eq!(m.bindings(), target, "restored on panic");
    assert!(!m.in_draft_replay());
    let g = m.draft_replay(&layout(1), &dreqs).unwrap();
    g.finish().unwrap();
    assert_eq!(m.bindings(), target);
    // Mismatched draft batches and missing draft buffers are refused.
    assert_eq!(
        m.prepare_draft(&layout(1), &[req(Context, &d, 63, 10)]),
        Err(MetadataError::DraftBatchMismatch { index: 0 })
    );
    let mut no_draft = StepMetadata::new(layout(3), dims(6), None, true).unwrap();
    assert_eq!(
        no_draft.prepare_draft(&layout(1), &[]),
        Err(MetadataError::NoDraftBuffers)
    );
    let snap = m.prepare_draft(&layout(1), &dreqs).unwrap();
    assert_eq!(m.restore(&snap), Ok(()));
}

/// Preparing batch after batch (rows growing and shrinking, fewer and more requests)
/// leaves every buffer exactly as one fresh prepare of the last batch: the per-row
/// re-padding forgets nothing a longer earlier row wrote.
#[test]
fn a_sequence_of_steps_leaves_what_a_fresh_prepare_gives() {
    let mut rng = crate::rng::SplitMix64(7);
    let mut m = StepMetadata::new(layout(3), dims(8), Some(dims(8)), true).unwrap();
    for round in 0..300 {
        let n = 1 + (rng.next_u64() % 4) as usize;
        let slots: Vec<Vec<i32>> = (0..n)
            .map(|_| {
                let blocks = 1 + (rng.next_u64() % 8) as usize;
                (0..blocks).map(|_| (rng.next_u64() % 50) as i32).collect()
            })
            .collect();
        let reqs: Vec<StepRequest> = slots
            .iter()
            .map(|s| {
                let cap = s.len() as u32 * 64;
                let new = 1 + (rng.next_u64() % 20) as u32;
                let cached = (rng.next_u64() % u64::from(cap)) as u32;
                let cached = cached.min(cap - new.min(cap));
                req(Generation, s, cached, new.min(cap - cached))
            })
            .collect();
        // Every round a target prepare; every other one a draft replay too (whose set
        // is then compared as well).
        let draft = round % 2 == 1;
        let mut fresh = StepMetadata::new(layout(3), dims(8), Some(dims(8)), true).unwrap();
        for meta in [&mut m, &mut fresh] {
            meta.prepare(&layout(3), &reqs).unwrap();
            if draft {
                let snap = meta.prepare_draft(&layout(3), &reqs).unwrap();
                meta.restore(&snap).unwrap();
            }
        }
        let sets = [m.set_buffers(false).unwrap(), m.set_buffers(true).unwrap()];
        for id in sets[..1 + usize::from(draft)].iter().flatten().copied() {
            assert_eq!(
                (m.buffer_i32(id), m.buffer_i64(id)),
                (fresh.buffer_i32(id), fresh.buffer_i64(id)),
                "round {round}: buffer {:?}",
                m.buffer_role(id)
            );
        }
    }
}

// ---- page tables updated by the changed columns -----------------------------------

mod incremental {
    use std::collections::HashMap;

    use super::super::mirror::{MetaRef, MirrorChanges};
    use super::super::*;
    use crate::core::scheduler::{
        RequestOutcome, Scheduler, SchedulerLimits, StepPlan, SubmitRequest,
    };
    use crate::core::{KvCacheManager, ManagerOptions, RowStamp, TierSlots};
    use crate::ids::{LayerId, RequestId, TokenId};
    use crate::layout::{
        BufferSpec, IndexerPageLayout, LayerSpec, LifeCycleKey, PoolPlan, Role, RowLayout,
    };

    fn scheduler(t: u32, gpu: u32, host: u32, limits: SchedulerLimits) -> Scheduler {
        let plan = PoolPlan::v2(
            t,
            vec![LayerSpec {
                layer: LayerId(0),
                life_cycle: LifeCycleKey(0),
                buffers: vec![BufferSpec::new(
                    Role::Key,
                    RowLayout::Interleaved { row_bytes: 2 },
                )],
            }],
        )
        .unwrap();
        let opts = ManagerOptions {
            max_util_for_resume: 1.0,
            ..Default::default()
        };
        let host = if host > 0 { vec![host] } else { vec![] };
        let m = KvCacheManager::new(
            plan,
            TierSlots {
                gpu: vec![gpu],
                host,
            },
            opts,
        )
        .unwrap();
        Scheduler::new(m, None, limits)
    }

    fn layout(t: u32) -> MetadataLayout {
        MetadataLayout {
            tokens_per_block: t,
            indexer_page_scale: 1,
            indexer: Some(IndexerPageLayout {
                tokens_per_block: t,
                data_bytes: 128,
                scale_bytes: 4,
            }),
        }
    }

    fn step_requests(plan: &StepPlan, stamped: bool) -> Vec<StepRequest<'_>> {
        plan.requests
            .iter()
            .map(|r| StepRequest {
                row: if stamped {
                    r.block_slots.stamp()
                } else {
                    RowStamp::UNKNOWN
                },
                ..StepRequest::planned(r, false)
            })
            .collect()
    }

    fn bytes(m: &StepMetadata) -> Vec<(MetaRef, Vec<u8>)> {
        m.mirror_refs()
            .into_iter()
            .map(|r| (r, m.mirror_bytes(r).to_vec()))
            .collect()
    }

    /// A mirror of the metadata kept as a device keeps it: a copy of every buffer
    /// brought up to date only by what [`StepMetadata::mirror_changes`] names (the
    /// logged ranges, or the extent), counting the page-table cells it copied.
    struct Mirror {
        bufs: Vec<(MetaRef, Vec<u8>, usize)>,
        table_cells: usize,
    }

    impl Mirror {
        fn new(m: &StepMetadata) -> Mirror {
            let bufs = m.mirror_refs().into_iter();
            Mirror {
                bufs: bufs.map(|r| (r, m.mirror_bytes(r).to_vec(), 0)).collect(),
                table_cells: 0,
            }
        }

        fn sync(&mut self, m: &mut StepMetadata) {
            for (r, copy, extent) in &mut self.bufs {
                let eb = m.mirror_elem_bytes(*r);
                let host = m.mirror_bytes(*r);
                match m.mirror_changes(*r) {
                    MirrorChanges::Ranges(ranges) => {
                        for &(s, e) in ranges {
                            let b = s as usize * eb..e as usize * eb;
                            copy[b.clone()].copy_from_slice(&host[b]);
                            self.table_cells += (e - s) as usize;
                        }
                    }
                    MirrorChanges::Extent => {
                        let n = (*extent).max(m.mirror_extent(*r)) * eb;
                        copy[..n].copy_from_slice(&host[..n]);
                    }
                }
                *extent = m.mirror_extent(*r);
                m.mirror_take_changes(*r);
            }
        }

        fn bytes(&self) -> Vec<(MetaRef, Vec<u8>)> {
            self.bufs.iter().map(|(r, b, _)| (*r, b.clone())).collect()
        }
    }

    /// Outcomes with `next() % (drafts + 1)` drafts accepted.
    fn outcomes(plan: &StepPlan, next: &mut impl FnMut() -> u32) -> Vec<RequestOutcome> {
        plan.requests
            .iter()
            .map(|p| RequestOutcome {
                id: p.id,
                accepted_drafts: next() % (p.num_drafts + 1),
                next_token: Some(TokenId(next() % 5)),
            })
            .collect()
    }

    /// Metadata filled from the plans' stamps equals, byte for byte in every buffer,
    /// metadata that rewrites every row each step (unknown stamps): through prefill
    /// chunks, decode steps with random draft acceptance, requests finishing and
    /// arriving (batch indices shift), preemption by suspension and by recompute.
    #[test]
    fn stamped_fills_equal_full_rewrites() {
        for host in [16, 0] {
            let limits = SchedulerLimits {
                max_num_sequences: 8,
                max_num_tokens: 16,
                max_prefill_chunk: 6,
                max_seq_len: 64,
                draft_tokens: 2,
                livelock_steps: 50,
                max_context_kv_tokens: 256,
                transfer_lease: std::time::Duration::from_secs(30),
            };
            let mut s = scheduler(4, 12, host, limits);
            let dims = MetadataDims {
                max_num_sequences: 8,
                max_blocks_per_seq: 20,
                max_num_tokens: 16,
                max_context_kv_tokens: 256,
            };
            let mut inc = StepMetadata::new(layout(4), dims, None, true).unwrap();
            let mut full = StepMetadata::new(layout(4), dims, None, true).unwrap();
            let (mut inc_mirror, mut full_mirror) = (Mirror::new(&inc), Mirror::new(&full));
            let mut rng = 3u64;
            let mut next = || {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (rng >> 33) as u32
            };
            let mut id = 0u64;
            let (mut steps, mut wrote, mut rewrote) = (0, 0usize, 0usize);
            while steps < 300 {
                steps += 1;
                if s.num_active() + s.num_waiting() < 7 && next() % 3 == 0 {
                    id += 1;
                    let prompt = (0..3 + next() % 12).map(|t| TokenId(t * 3 + id as u32));
                    s.submit(SubmitRequest::new(
                        RequestId(id),
                        prompt.collect(),
                        6 + next() % 12,
                    ))
                    .unwrap();
                }
                let drafts: HashMap<RequestId, Vec<TokenId>> = (1..=id)
                    .map(|i| (RequestId(i), vec![TokenId(next() % 5), TokenId(next() % 5)]))
                    .collect();
                let plan = s.schedule(&drafts).unwrap();
                s.complete(plan.target_fence, plan.draft_fence).unwrap();
                if plan.requests.is_empty() {
                    continue;
                }
                inc.prepare(&layout(4), &step_requests(&plan, true))
                    .unwrap();
                full.prepare(&layout(4), &step_requests(&plan, false))
                    .unwrap();
                assert!(bytes(&inc) == bytes(&full), "host {host}, step {steps}");
                // Mirrors kept by the logged changes are the buffers, every few steps
                // (changes pile up between syncs) and at the end.
                if next() % 3 == 0 || steps == 300 {
                    inc_mirror.sync(&mut inc);
                    full_mirror.sync(&mut full);
                    assert!(
                        inc_mirror.bytes() == bytes(&inc),
                        "host {host}, step {steps}"
                    );
                    assert!(
                        full_mirror.bytes() == bytes(&full),
                        "host {host}, step {steps}"
                    );
                }
                wrote += inc.last_table_writes();
                rewrote += full.last_table_writes();
                let done = s.commit(&outcomes(&plan, &mut next)).unwrap();
                let ids: Vec<RequestId> = done.iter().map(|f| f.id).collect();
                s.finalize(&ids).unwrap();
                s.recycle(plan);
            }
            assert!(
                s.stats().preemptions > 0,
                "host {host}: the pressure preempted"
            );
            assert!(
                s.stats().finished > 5,
                "host {host}: requests came and went"
            );
            assert!(wrote < rewrote, "host {host}: {wrote} vs {rewrote} cells");
            assert!(
                inc_mirror.table_cells <= wrote && inc_mirror.table_cells > 0,
                "host {host}: the mirror copied {} logged cells of {wrote} written",
                inc_mirror.table_cells
            );
        }
    }

    /// A steady decode batch (3 drafts, random acceptance) writes the same number of
    /// page-table cells per step whether its requests hold 2K or 64K tokens: the
    /// columns that changed (a new block every few steps, the draft blocks taken and
    /// dropped), not the context.
    #[test]
    fn page_table_work_does_not_grow_with_the_context() {
        const SEQS: u64 = 16;
        let mut per_step = Vec::new();
        for context in [2_048u32, 65_536] {
            let limits = SchedulerLimits {
                max_num_sequences: SEQS as u32,
                max_num_tokens: 1 << 20,
                max_prefill_chunk: 1 << 20,
                max_seq_len: 1 << 20,
                draft_tokens: 3,
                livelock_steps: 50,
                max_context_kv_tokens: 1 << 24,
                transfer_lease: std::time::Duration::from_secs(30),
            };
            let blocks = context / 64 + 8;
            let mut s = scheduler(64, SEQS as u32 * blocks, 0, limits);
            for i in 0..SEQS {
                let prompt = (0..context).map(|t| TokenId(t % 50_000 + i as u32 * 7));
                s.submit(SubmitRequest::new(RequestId(i), prompt.collect(), 10_000))
                    .unwrap();
            }
            let dims = MetadataDims {
                max_num_sequences: SEQS as usize,
                max_blocks_per_seq: blocks as usize,
                max_num_tokens: 1 << 20,
                max_context_kv_tokens: 1 << 24,
            };
            let mut m = StepMetadata::new(layout(64), dims, None, false).unwrap();
            let mut mirror = Mirror::new(&m);
            let mut rng = 5u64;
            let mut next = || {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (rng >> 33) as u32
            };
            let drafts: HashMap<RequestId, Vec<TokenId>> = (0..SEQS)
                .map(|i| (RequestId(i), vec![TokenId(1), TokenId(2), TokenId(3)]))
                .collect();
            let mut writes = Vec::new();
            for step in 0..80 {
                let plan = s.schedule(&drafts).unwrap();
                s.complete(plan.target_fence, plan.draft_fence).unwrap();
                m.prepare(&layout(64), &step_requests(&plan, true)).unwrap();
                // After the prefill step and the first decode step (which writes every
                // row once: the batch changed kind).
                let before = mirror.table_cells;
                mirror.sync(&mut m);
                if step >= 2 {
                    writes.push(m.last_table_writes());
                    // The mirror copies what the fill wrote, not the batch's rows.
                    assert_eq!(mirror.table_cells - before, m.last_table_writes());
                }
                s.commit(&outcomes(&plan, &mut next)).unwrap();
                s.recycle(plan);
            }
            assert!(mirror.bytes() == bytes(&m), "context {context}");
            let total: usize = writes.iter().sum();
            let max = *writes.iter().max().unwrap();
            per_step.push((context, total, max));
            // Far below one row per request per step.
            assert!(
                max < (SEQS * u64::from(context / 64)) as usize / 4,
                "{per_step:?}"
            );
        }
        let (short, long) = (per_step[0], per_step[1]);
        assert!(
            long.1 <= short.1 * 2 && long.2 <= short.2 * 2,
            "work grew with the context: {per_step:?}"
        );
    }
}

/// A stamped row kept at its batch index is rewritten whole when the indexer page
/// scale changes (its kept cells hold `slot × old scale`).
#[test]
fn a_new_indexer_page_scale_rewrites_kept_rows() {
    let mut m = StepMetadata::new(layout(3), dims(4), None, false).unwrap();
    let stamp = crate::core::RowStamp {
        version: 77,
        base: 0,
        from: 0,
    };
    let mut r = req(Generation, &[5, 2], 100, 1);
    r.row = stamp;
    m.prepare(&layout(3), &[r]).unwrap();
    assert_eq!(&m.indexer_page_table()[..2], &[15, 6]);
    // The same version again: nothing to write with the same scale...
    m.prepare(&layout(3), &[r]).unwrap();
    assert_eq!(m.last_table_writes(), 0);
    // ...but a new scale rewrites the row.
    m.prepare(&layout(2), &[r]).unwrap();
    assert_eq!(&m.indexer_page_table()[..2], &[10, 4]);
}

/// A change log is bounded: past a quarter of its buffer's cells, or past its range
/// limit, it keeps nothing and says "copy the extent" until a mirror takes it.
#[test]
fn a_change_log_gives_up_instead_of_growing() {
    use super::buffers::ChangeLog;
    let mut m = super::buffers::MetaBuffer::i32(BufferRole::BlockTable, 1 << 20, -1);
    let log = &mut m.log;
    log.record(10, 12, 1 << 20);
    log.record(12, 15, 1 << 20);
    log.record(3, 4, 1 << 20);
    assert_eq!(log.ranges(), Some(&[(10, 15), (3, 4)][..]));
    for i in 0..ChangeLog::MAX_RANGES {
        log.record(2 * i + 100, 2 * i + 101, 1 << 20);
    }
    assert_eq!(log.ranges(), None, "past the range limit");
    log.clear();
    assert_eq!(log.ranges(), Some(&[][..]));
    log.record(0, (1 << 18) + 1, 1 << 20);
    assert_eq!(log.ranges(), None, "more than a quarter of the cells");
    log.clear();
    // Buffers other than the page tables are not logged: always the extent.
    let mut lens = super::buffers::MetaBuffer::i32(BufferRole::KvLens, 8, 0);
    lens.log.record(0, 1, 8);
    assert_eq!(lens.log.ranges(), None);
}

/// The table digest follows what the fills wrote: equal for metadata filled alike,
/// different from the first cell written differently on, and later identical fills do
/// not bring it back.
#[test]
fn the_table_digest_tells_diverged_tables_apart() {
    let mut a = StepMetadata::new(layout(3), dims(4), None, false).unwrap();
    let mut b = StepMetadata::new(layout(3), dims(4), None, false).unwrap();
    assert_eq!(a.table_digest(), b.table_digest());
    let r1 = req(Generation, &[5, 2], 100, 1);
    a.prepare(&layout(3), &[r1]).unwrap();
    b.prepare(&layout(3), &[r1]).unwrap();
    assert_eq!(a.table_digest(), b.table_digest());
    let r2 = req(Generation, &[5, 3], 100, 1);
    a.prepare(&layout(3), &[r1]).unwrap();
    b.prepare(&layout(3), &[r2]).unwrap();
    assert_ne!(a.table_digest(), b.table_digest());
    let r3 = req(Generation, &[7, 7, 7], 100, 1);
    a.prepare(&layout(3), &[r3]).unwrap();
    b.prepare(&layout(3), &[r3]).unwrap();
    assert_eq!(
        a.block_table()[..3],
        b.block_table()[..3],
        "same contents now"
    );
    assert_ne!(
        a.table_digest(),
        b.table_digest(),
        "but not the same history"
    );
}

/// The shared per-token buffers are re-padded exactly where the last step wrote past
/// this one's tokens (not to the maximum), and equal a fresh metadata's after any
/// sequence of batches, draft replays included.
#[test]
fn shared_token_buffers_are_repadded_where_the_last_step_wrote() {
    let d = MetadataDims {
        max_num_sequences: 4,
        max_blocks_per_seq: 4,
        max_num_tokens: 600,
        max_context_kv_tokens: 1024,
    };
    let mut m = StepMetadata::new(layout(1), d, Some(d), true).unwrap();
    let slots = [1, 2, 3, 4];
    let big = [
        req(Context, &slots, 10, 100),
        req(Context, &slots, 0, 50),
        req(Generation, &slots, 70, 4),
    ];
    m.prepare(&layout(1), &big).unwrap();
    assert_eq!(m.counts().num_tokens, 154);
    let snap = m.prepare_draft(&layout(1), &big).unwrap();
    m.restore(&snap).unwrap();
    let small = [req(Generation, &slots, 80, 2)];
    m.prepare(&layout(1), &small).unwrap();
    let mut fresh = StepMetadata::new(layout(1), d, Some(d), true).unwrap();
    fresh.prepare(&layout(1), &small).unwrap();
    assert_eq!(m.req_idx_per_token(), fresh.req_idx_per_token());
    assert_eq!(m.cu_seqlen_ks(), fresh.cu_seqlen_ks());
    assert_eq!(m.cu_seqlen_ke(), fresh.cu_seqlen_ke());
    assert!(m.cu_seqlen_ke()[2..].iter().all(|&x| x == 0));
}
