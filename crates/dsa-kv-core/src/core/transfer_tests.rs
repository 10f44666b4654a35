//! Exact-value tests of export and import on the tiny layout of `tests.rs` (T = 4).

use super::tests::{cache, mgr, mgr_with, start, toks};
use super::*;
use crate::ids::{RequestId, SlotId, Tier, TokenId};

const X: RequestId = RequestId(900);

/// What a step does for the manager: runs the planned copies, completes their fences.
fn step(m: &mut KvCacheManager) {
    m.take_copy_plans();
    let f = m.issued_fence();
    m.complete_fences(f).unwrap();
}

fn slots(blocks: &[BlockLoc]) -> Vec<(Tier, u32)> {
    blocks
        .iter()
        .map(|b| (b.pages[0].tier, b.pages[0].slot.get()))
        .collect()
}

#[test]
fn export_pins_the_cached_full_blocks_where_they_are() {
    // 4 GPU slots, 4 host slots. Cache 3 blocks + a partial one of a 14-token prompt.
    let mut m = mgr(4, 4);
    let p = toks(0..14);
    cache(&mut m, 1, &p, 35);
    let keys = m.block_keys(ReuseScope::SHARED, &p[..12]);
    let (mut lease, blocks) = m.export_blocks(X, ReuseScope::SHARED, &p[..12]).unwrap();
    assert_eq!(blocks.iter().map(|b| b.key).collect::<Vec<_>>(), keys);
    assert_eq!(
        slots(&blocks),
        [(Tier::Gpu, 0), (Tier::Gpu, 1), (Tier::Gpu, 2)]
    );
    m.check_invariants();
    // A 16-token request needs all 4 GPU slots: the pinned blocks cannot be offloaded
    // (held pages otherwise can), so there is no room.
    let h = start(&mut m, 2, &toks(100..116), 35);
    assert!(!m.resize(&h, 16, 0).unwrap());
    // Asking for more blocks than are cached exports the cached prefix only.
    let (mut lease2, b2) = m
        .export_blocks(RequestId(901), ReuseScope::SHARED, &toks(0..16))
        .unwrap();
    assert_eq!(b2.len(), 3);
    m.close(&mut lease2).unwrap();
    // Released: the same request now fits, the blocks go to the host tier.
    m.close(&mut lease).unwrap();
    assert!(m.resize(&h, 16, 0).unwrap());
    m.check_invariants();
    let on_host: Vec<_> = m
        .cached_blocks()
        .iter()
        .filter(|c| c.tier == Tier::Host)
        .map(|c| c.key)
        .collect();
    assert_eq!(on_host.len(), 4, "3 full blocks and the partial one");
}

#[test]
fn a_resume_over_a_pinned_host_page_waits_for_the_release() {
    let mut m = mgr(4, 4);
    let p = toks(0..9);
    cache(&mut m, 1, &p, 35);
    // Offload the prefix: a 16-token request takes the whole GPU.
    let mut h = start(&mut m, 2, &toks(100..116), 35);
    assert!(m.resize(&h, 16, 0).unwrap());
    m.close(&mut h).unwrap();
    // The offload copies are planned, not run: no block's bytes are on the host yet.
    let (mut early, none) = m.export_blocks(X, ReuseScope::SHARED, &p[..8]).unwrap();
    assert!(none.is_empty());
    m.close(&mut early).unwrap();
    step(&mut m);
    let (mut lease, blocks) = m.export_blocks(X, ReuseScope::SHARED, &p[..8]).unwrap();
    assert_eq!(blocks.len(), 2);
    assert!(blocks.iter().all(|b| b.pages[0].tier == Tier::Host));
    let c = m
        .create(RequestId(3), ReuseScope::SHARED, &p, SeqOptions::default())
        .unwrap();
    assert_eq!(c.reused_tokens, 8);
    let before = m.fingerprint();
    assert!(
        !m.resume(&c.handle).unwrap(),
        "the pinned pages cannot move yet"
    );
    assert_eq!(m.fingerprint(), before, "a refused resume changes nothing");
    m.close(&mut lease).unwrap();
    assert!(m.resume(&c.handle).unwrap());
    m.check_invariants();
}

#[test]
fn import_reserves_fresh_pages_then_links_them_atomically() {
    let mut m = mgr(8, 0);
    let p = toks(0..12);
    let mut imp = m
        .begin_import(X, ReuseScope::SHARED, &p)
        .unwrap()
        .expect("room");
    assert_eq!(imp.skipped, 0);
    assert_eq!(
        slots(&imp.blocks),
        [(Tier::Gpu, 0), (Tier::Gpu, 1), (Tier::Gpu, 2)]
    );
    assert_eq!(
        imp.blocks.iter().map(|b| b.key).collect::<Vec<_>>(),
        m.block_keys(ReuseScope::SHARED, &p)
    );
    // Nothing is reachable before the commit.
    let mut q = p.clone();
    q.push(TokenId(77));
    assert_eq!(m.probe_reuse(ReuseScope::SHARED, &q).unwrap(), 0);
    m.check_invariants();
    // Fewer tokens than begin_import's are refused, and as many other ones (the blocks
    // would enter the tree under another prefix's keys).
    assert!(matches!(
        m.commit_import(&mut imp.handle, &toks(0..8)),
        Err(KvError::Transfer { .. })
    ));
    let mut other = p.clone();
    other[5] = TokenId(9_999);
    assert!(matches!(
        m.commit_import(&mut imp.handle, &other),
        Err(KvError::Transfer { .. })
    ));
    m.commit_import(&mut imp.handle, &p).unwrap();
    assert_eq!(m.probe_reuse(ReuseScope::SHARED, &q).unwrap(), 12);
    assert_eq!(m.num_sequences(), 0);
    assert_eq!(m.usage(Tier::Gpu)[0].evictable, 3);
    m.check_invariants();
    // A second import of a longer prefix skips the three cached blocks.
    let p2 = toks(0..20);
    let mut imp2 = m
        .begin_import(RequestId(901), ReuseScope::SHARED, &p2)
        .unwrap()
        .unwrap();
    assert_eq!(imp2.skipped, 3);
    assert_eq!(slots(&imp2.blocks), [(Tier::Gpu, 3), (Tier::Gpu, 4)]);
    m.commit_import(&mut imp2.handle, &p2).unwrap();
    q = p2.clone();
    q.push(TokenId(5));
    assert_eq!(m.probe_reuse(ReuseScope::SHARED, &q).unwrap(), 20);
    m.check_invariants();
}

#[test]
fn an_aborted_or_refused_import_leaves_nothing_behind() {
    let mut m = mgr(4, 0);
    cache(&mut m, 1, &toks(0..5), 35);
    let before = m.cached_blocks();
    let usage = m.usage(Tier::Gpu);
    // Abort: the fresh pages are freed, the skipped block is released.
    let mut imp = m
        .begin_import(X, ReuseScope::SHARED, &toks(0..12))
        .unwrap()
        .unwrap();
    assert_eq!(imp.skipped, 1);
    m.close(&mut imp.handle).unwrap();
    assert_eq!(m.cached_blocks(), before);
    assert_eq!(m.usage(Tier::Gpu), usage);
    m.check_invariants();
    // More blocks than the pool has: a typed error, nothing left open.
    assert!(matches!(
        m.begin_import(X, ReuseScope::SHARED, &toks(0..20)),
        Err(KvError::SequenceTooLong { .. })
    ));
    assert_eq!(m.num_sequences(), 0);
    assert_eq!(m.cached_blocks(), before);
    // No room now (an active request holds 3 of the 4 slots): refused, nothing changed.
    let h = start(&mut m, 2, &toks(100..112), 35);
    assert!(m.resize(&h, 12, 0).unwrap());
    let (cached, usage) = (m.cached_blocks(), m.usage(Tier::Gpu));
    assert!(m
        .begin_import(X, ReuseScope::SHARED, &toks(0..12))
        .unwrap()
        .is_none());
    assert_eq!(m.num_sequences(), 1);
    assert_eq!((m.cached_blocks(), m.usage(Tier::Gpu)), (cached, usage));
    m.check_invariants();
}

#[test]
fn bad_transfers_are_typed_errors() {
    let mut m = mgr(4, 0);
    for t in [toks(0..6), Vec::new()] {
        assert!(matches!(
            m.begin_import(X, ReuseScope::SHARED, &t),
            Err(KvError::Transfer { .. })
        ));
        assert!(matches!(
            m.export_blocks(X, ReuseScope::SHARED, &t),
            Err(KvError::Transfer { .. })
        ));
    }
    // An export or an import is driven only through its own calls.
    cache(&mut m, 1, &toks(0..4), 35);
    let (mut lease, _) = m
        .export_blocks(RequestId(801), ReuseScope::SHARED, &toks(0..4))
        .unwrap();
    assert!(matches!(m.resume(&lease), Err(KvError::Transfer { .. })));
    assert!(matches!(
        m.commit(&lease, &[]),
        Err(KvError::Transfer { .. })
    ));
    m.close(&mut lease).unwrap();
    let mut imp = m
        .begin_import(RequestId(802), ReuseScope::SHARED, &toks(50..54))
        .unwrap()
        .unwrap();
    assert!(matches!(
        m.suspend(&imp.handle),
        Err(KvError::Transfer { .. })
    ));
    assert!(matches!(
        m.resize(&imp.handle, 8, 0),
        Err(KvError::Transfer { .. })
    ));
    assert!(matches!(
        m.commit(&imp.handle, &toks(50..54)),
        Err(KvError::Transfer { .. })
    ));
    m.close(&mut imp.handle).unwrap();
    m.check_invariants();
    let _h = start(&mut m, 900, &toks(0..3), 35);
    assert!(matches!(
        m.begin_import(X, ReuseScope::SHARED, &toks(0..4)),
        Err(KvError::DuplicateRequest { .. })
    ));
    let mut off = mgr_with(
        4,
        0,
        ManagerOptions {
            enable_block_reuse: false,
            ..ManagerOptions::default()
        },
    );
    assert!(matches!(
        off.export_blocks(X, ReuseScope::SHARED, &toks(0..4)),
        Err(KvError::Transfer { .. })
    ));
    assert_eq!(SlotId(0).get(), 0);
}

/// Seeded random exports, imports (committed or aborted) and requests on one manager
/// under eviction pressure: after every operation the invariants hold, every live
/// export's pages sit exactly where they were exported, a committed import is served
/// from the cache, and an aborted one leaves the cached blocks as they were.
#[test]
fn random_exports_and_imports_keep_every_rule() {
    use crate::rng::SplitMix64;
    let mut done = [0u32; 3]; // exports with blocks, commits, aborts (all seeds)
    for seed in 0..24u64 {
        let mut rng = SplitMix64(seed);
        let mut m = mgr(12, if seed % 2 == 0 { 8 } else { 0 });
        // Prompts: one of 3 shared 8-token prefixes, then 0–3 blocks of a small family.
        let prompt = |rng: &mut SplitMix64, extra: u64| -> Vec<TokenId> {
            let p = rng.below(3) as u32;
            let mut t = toks(p * 100..p * 100 + 8);
            for _ in 0..rng.below(4) + extra {
                let b = rng.below(4) as u32;
                t.extend(toks(1000 + b * 10..1000 + b * 10 + 4));
            }
            t
        };
        let mut leases: Vec<(SeqHandle, Vec<(Tier, SlotId)>)> = Vec::new();

        let mut imports: Vec<(Import, Vec<TokenId>)> = Vec::new();
        let mut next_id = 0u64;
        for op in 0..400 {
            next_id += 1;
            let id = RequestId(next_id);
            if rng.chance(30) {
                step(&mut m);
            }
            match rng.below(6) {
                0 | 1 => {
                    // A request runs to its end (or does not fit and is closed).
                    let p = prompt(&mut rng, 0);
                    let mut h = m
                        .create(id, ReuseScope::SHARED, &p, SeqOptions::default())
                        .unwrap()
                        .handle;
                    if m.resume(&h).unwrap() {
                        let have = m.info_of(&h).unwrap().committed;
                        if m.resize(&h, p.len() as u64, have).unwrap() {
                            m.commit(&h, &p[have as usize..]).unwrap();
                        }
                    }
                    m.close(&mut h).unwrap();
                }
                2 => {
                    let p = prompt(&mut rng, 0);
                    let (h, blocks) = m.export_blocks(id, ReuseScope::SHARED, &p).unwrap();
                    assert_eq!(
                        blocks.iter().map(|b| b.key).collect::<Vec<_>>(),
                        m.block_keys(ReuseScope::SHARED, &p)[..blocks.len()]
                    );
                    done[0] += u32::from(!blocks.is_empty());
                    let at = m.seq_page_slots(&h);
                    leases.push((h, at));
                }
                3 if !leases.is_empty() => {
                    let (mut h, _) = leases.swap_remove(rng.below(leases.len() as u64) as usize);
                    m.close(&mut h).unwrap();
                }
                4 => {
                    let p = prompt(&mut rng, 1);
                    match m.begin_import(id, ReuseScope::SHARED, &p) {
                        Ok(Some(i)) => {
                            assert_eq!(
                                i.skipped as usize + i.blocks.len(),
                                p.len() / 4,
                                "seed {seed} op {op}"
                            );
                            assert!(i.blocks.iter().all(|b| b.pages[0].tier == Tier::Gpu));
                            imports.push((i, p));
                        }
                        Ok(None) | Err(KvError::SequenceTooLong { .. }) => {}
                        Err(e) => panic!("seed {seed} op {op}: {e}"),
                    }
                }
                _ if !imports.is_empty() => {
                    let (mut i, p) = imports.swap_remove(rng.below(imports.len() as u64) as usize);
                    if rng.chance(70) {
                        done[1] += 1;
                        m.commit_import(&mut i.handle, &p).unwrap();
                        let mut q = p.clone();
                        q.push(TokenId(9999));
                        assert_eq!(
                            m.probe_reuse(ReuseScope::SHARED, &q).unwrap(),
                            p.len() as u64,
                            "seed {seed} op {op}: a committed import is served"
                        );
                    } else {
                        done[2] += 1;
                        let before = m.cached_blocks();
                        m.close(&mut i.handle).unwrap();
                        assert_eq!(m.cached_blocks(), before, "seed {seed} op {op}");
                    }
                }
                _ => {}
            }
            m.check_invariants();
            for (h, at) in &leases {
                assert_eq!(
                    &m.seq_page_slots(h),
                    at,
                    "seed {seed} op {op}: a pinned page moved"
                );
            }
        }
        for (mut h, _) in leases {
            m.close(&mut h).unwrap();
        }
        for (mut i, _) in imports {
            m.close(&mut i.handle).unwrap();
        }
        assert_eq!(m.num_sequences(), 0);
        m.check_invariants();
    }
    assert!(
        done[0] > 500 && done[1] > 100 && done[2] > 40,
        "too few transfers: {done:?}"
    );
}

#[test]
fn an_import_waits_for_the_copies_that_free_its_slots() {
    // 4 GPU slots, all cached; importing 2 blocks offloads 2 of them: their copies are
    // planned for the next step, so the freed slots cannot be written yet.
    let mut m = mgr(4, 4);
    cache(&mut m, 1, &toks(0..16), 35);
    step(&mut m);
    let before = m.cached_blocks();
    assert!(m
        .begin_import(X, ReuseScope::SHARED, &toks(100..108))
        .unwrap()
        .is_none());
    assert_eq!(m.num_sequences(), 0);
    assert_eq!(
        m.cached_blocks().len(),
        before.len(),
        "the offloads stand, no block is lost"
    );
    m.check_invariants();
    step(&mut m);
    let mut imp = m
        .begin_import(X, ReuseScope::SHARED, &toks(100..108))
        .unwrap()
        .expect("the copies ran: room now");
    assert_eq!(imp.blocks.len(), 2);
    m.commit_import(&mut imp.handle, &toks(100..108)).unwrap();
    m.check_invariants();
}

#[test]
fn imported_blocks_get_their_slots_in_ascending_order() {
    // Two requests take slots 0–1 and 2–3 and are closed uncommitted: the allocator hands
    // the slots back last-freed first (2, 3, 0, 1). The import lays them out 0, 1, 2, 3
    // so the four blocks are one run.
    let mut m = mgr(8, 0);
    let mut a = start(&mut m, 1, &toks(0..8), 35);
    assert!(m.resize(&a, 8, 0).unwrap());
    let mut b = start(&mut m, 2, &toks(100..108), 35);
    assert!(m.resize(&b, 8, 0).unwrap());
    m.close(&mut a).unwrap();
    m.close(&mut b).unwrap();
    let mut imp = m
        .begin_import(X, ReuseScope::SHARED, &toks(500..516))
        .unwrap()
        .unwrap();
    assert_eq!(
        slots(&imp.blocks),
        [
            (Tier::Gpu, 0),
            (Tier::Gpu, 1),
            (Tier::Gpu, 2),
            (Tier::Gpu, 3)
        ]
    );
    m.check_invariants();
    m.commit_import(&mut imp.handle, &toks(500..516)).unwrap();
    m.check_invariants();
}
