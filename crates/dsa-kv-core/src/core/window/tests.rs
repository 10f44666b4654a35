use std::collections::HashMap;

use super::*;
use crate::config::V4Spec;

const BLOCK: u64 = 256;

use crate::rng::SplitMix64 as Rng;

fn mix(h: u64, x: u64) -> u64 {
    let mut z = (h ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z ^= z >> 29;
    z.wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

/// Chained hashes of a token list's prefixes: `h[p]` names `tokens[..=p]`.
fn prefix_hashes(tokens: &[u64]) -> Vec<u64> {
    let mut h = 1u64;
    tokens
        .iter()
        .map(|&t| {
            h = mix(h, t);
            h
        })
        .collect()
}

/// What a row at position `p` holds: a function of the tokens up to `p` (the prefix,
/// named by its chained hash) and the life cycle, as the model's KV and compressor state
/// are.
fn content(prefix: &[u64], p: usize, lc: usize) -> u64 {
    mix(prefix[p], lc as u64 + 11)
}

fn key_of(tokens: &[u64]) -> BlockKey {
    let h = tokens.iter().fold(7, |h, &t| mix(h, t));
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&h.to_le_bytes());
    k[8..16].copy_from_slice(&(tokens.len() as u64).to_le_bytes());
    BlockKey(k)
}

fn flash_specs() -> Vec<WindowSpec> {
    WindowSpec::of_plan(&V4Plan::new(&V4Spec::flash()).unwrap())
}

struct Seq {
    id: RequestId,
    /// Committed tokens.
    tokens: Vec<u64>,
    /// Prompt tokens not yet committed.
    rest: Vec<u64>,
}

/// The device memory of the window pools: per (life cycle, slot), one value per position
/// of the page.
#[derive(Default)]
struct Memory(HashMap<(usize, u32), Vec<Option<u64>>>);

impl Memory {
    fn write(&mut self, lc: usize, slot: SlotId, i: usize, page: usize, v: u64) {
        self.0
            .entry((lc, slot.get()))
            .or_insert_with(|| vec![None; page])[i] = Some(v);
    }

    fn read(&self, lc: usize, slot: SlotId, i: usize) -> Option<u64> {
        self.0.get(&(lc, slot.get())).and_then(|p| p[i])
    }
}

#[test]
fn the_flash_window_specs() {
    let s = flash_specs();
    let geometry: Vec<(u16, u32, u32, u32)> = s
        .iter()
        .map(|w| {
            (
                w.life_cycle.get(),
                w.tokens_per_page,
                w.retain,
                w.tail_tokens,
            )
        })
        .collect();
    assert_eq!(geometry, [(1, 64, 128, 127), (2, 4, 8, 4), (3, 8, 128, 0)]);
}

/// A decoding sequence holds at most the pages its window spans, and frees the rest.
#[test]
fn a_decoding_sequence_frees_behind_its_window() {
    let mut w = WindowCache::new(flash_specs(), vec![8, 16, 40]).unwrap();
    let id = RequestId(1);
    assert_eq!(w.open(id, None).unwrap(), 0);
    let mut issued = Fence::NONE;
    for c in 0..2_000u64 {
        assert!(w.ensure(id, c + 1, issued, issued).unwrap(), "position {c}");
        issued = Fence(issued.0 + 1);
        w.commit(id, c + 1, &[], BLOCK, issued).unwrap();
        w.check_invariants();
        // The next query at c + 1 reads [c + 1 − 127, c + 1]: the window holds the pages
        // from the one holding c − 126 to the one holding c (the next is added by the
        // next ensure).
        let used = w.used_slots();
        let low = (c + 1).saturating_sub(127);
        assert_eq!(u64::from(used[0]), c / 64 - low / 64 + 1, "window at {c}");
        let low4 = ((c + 1) / 4 * 4).saturating_sub(4);
        assert_eq!(u64::from(used[1]), c / 4 - low4 / 4 + 1, "state4 at {c}");
        assert!(used[0] <= 3 && used[1] <= 3 && used[2] <= 17);
    }
    assert!(w.stats().pages_freed_behind() > 0);
    w.close(id, issued).unwrap();
    assert_eq!(w.used_slots(), [0, 0, 0]);
    w.check_invariants();
}

/// A sequence resuming at a tail reads the tail's pages in place and writes fresh pages;
/// the tail outlives the sequence that linked it.
#[test]
fn a_tail_serves_a_resume_in_place() {
    let mut w = WindowCache::new(flash_specs(), vec![16, 200, 100]).unwrap();
    let f = Fence::NONE;
    let a = RequestId(1);
    w.open(a, None).unwrap();
    assert!(w.ensure(a, 300, f, f).unwrap());
    let key = BlockKey([3; 32]);
    // Past the committed positions, not a block boundary: refused, nothing changed.
    assert!(matches!(
        w.commit(a, 200, &[(256, key)], BLOCK, f),
        Err(WindowError::BadTail { .. })
    ));
    assert!(matches!(
        w.commit(a, 300, &[(128, key)], BLOCK, f),
        Err(WindowError::BadTail { .. })
    ));
    assert_eq!(w.used_slots(), [5, 75, 38]);
    // A boundary committed by an earlier call: its pages are gone.
    let mut late = WindowCache::new(flash_specs(), vec![16, 200, 100]).unwrap();
    late.open(a, None).unwrap();
    assert!(late.ensure(a, 600, f, f).unwrap());
    late.commit(a, 600, &[], BLOCK, f).unwrap();
    assert!(matches!(
        late.commit(a, 600, &[(256, key)], BLOCK, f),
        Err(WindowError::BadTail { .. })
    ));
    assert!(matches!(
        late.commit(a, 599, &[], BLOCK, f),
        Err(WindowError::BadTail { .. })
    ));
    let (_, window_a) = w.page_table(a, 0).unwrap();
    let (start4, state4_a) = w.page_table(a, 1).unwrap();
    assert_eq!((window_a.len(), start4, state4_a.len()), (5, 0, 75));
    w.commit(a, 300, &[(256, key)], BLOCK, f).unwrap();
    w.check_invariants();
    w.close(a, f).unwrap();
    // The tail keeps 2 window pages ([128, 256)) and 1 state4 page ([252, 256)).
    assert_eq!(w.used_slots(), [2, 1, 0]);
    let b = RequestId(2);
    assert_eq!(w.open(b, Some(&key)).unwrap(), 256);
    let (start, window_b) = w.page_table(b, 0).unwrap();
    assert_eq!((start, &window_b[..]), (128, &window_a[2..4]));
    assert_eq!(w.page_table(b, 1).unwrap(), (252, vec![state4_a[63]]));
    assert_eq!(w.page_table(b, 2).unwrap(), (256, vec![]));
    assert!(!w.writable(b, 0, 255).unwrap());
    assert!(w.ensure(b, 257, f, f).unwrap());
    assert!(w.writable(b, 0, 256).unwrap());
    assert!(w.writable(b, 1, 256).unwrap());
    assert!(w.writable(b, 2, 256).unwrap());
    assert_eq!(w.stats().tails_adopted, 1);
    assert!(matches!(
        w.open(RequestId(3), Some(&BlockKey([9; 32]))),
        Err(WindowError::NoTail { .. })
    ));
    assert!(matches!(
        w.open(b, None),
        Err(WindowError::DuplicateRequest { .. })
    ));
    w.check_invariants();
}

/// When rings need room, tails are evicted least recently used first, but only when that
/// makes the room suffice; otherwise nothing changes.
#[test]
fn tails_make_room_only_when_that_suffices() {
    let f = Fence::NONE;
    let mut w = WindowCache::new(flash_specs(), vec![7, 200, 100]).unwrap();
    let keys: Vec<BlockKey> = (0..2).map(|i| BlockKey([i + 1; 32])).collect();
    for (i, key) in keys.iter().enumerate() {
        let id = RequestId(i as u64);
        w.open(id, None).unwrap();
        assert!(w.ensure(id, 257, f, f).unwrap());
        w.commit(id, 257, &[(256, *key)], BLOCK, f).unwrap();
        w.close(id, f).unwrap();
    }
    assert_eq!(w.used_slots(), [4, 2, 0]);
    let c = RequestId(9);
    w.open(c, None).unwrap();
    // 8 window pages: more than all 7 slots even with both tails gone: refused untouched.
    assert!(!w.ensure(c, 8 * 64, f, f).unwrap());
    assert_eq!((w.num_tails(), w.used_slots()), (2, vec![4, 2, 0]));
    // 4 window pages, 3 free: one tail (the older) must go.
    assert!(w.ensure(c, 4 * 64, f, f).unwrap());
    assert!(!w.has_tail(&keys[0]) && w.has_tail(&keys[1]));
    assert_eq!(w.stats().tails_evicted, 1);
    w.check_invariants();
    // A demoted tail goes before an older one that is not.
    w.close(c, f).unwrap();
    let d = RequestId(10);
    w.open(d, None).unwrap();
    assert!(w.ensure(d, 257, f, f).unwrap());
    let newer = BlockKey([7; 32]);
    w.commit(d, 257, &[(256, newer)], BLOCK, f).unwrap();
    w.close(d, f).unwrap();
    assert!(w.demote(&newer) && w.is_demoted(&newer) && !w.is_demoted(&keys[1]));
    let e = RequestId(11);
    w.open(e, None).unwrap();
    assert!(w.ensure(e, 4 * 64, f, f).unwrap());
    assert!(!w.has_tail(&newer) && w.has_tail(&keys[1]));
    assert!(!w.demote(&newer));
    assert!(w.drop_tail(&keys[1], f));
    assert!(!w.drop_tail(&keys[1], f));
    w.check_invariants();
}

/// The model test: random sequences (shared prefixes, prefill chunks, decode steps with
/// drafts rolled back, resumes at tails, closes, tails dropped as blocks leave the tree,
/// room made by eviction) against a memory of what each position's row must hold. Every
/// query reads every position of its window in every life cycle, through the page
/// tables, and must find its own prefix's row there.
#[test]
fn windows_read_exactly_what_their_prefix_wrote() {
    for seed in 0..12u64 {
        run_model(seed);
    }
}

fn run_model(seed: u64) {
    let specs = flash_specs();
    let mut rng = Rng(seed);
    let slots = vec![
        10 + rng.below(30) as u32,
        110 + rng.below(200) as u32,
        60 + rng.below(100) as u32,
    ];
    let mut w = WindowCache::new(specs.clone(), slots).unwrap();
    let mut mem = Memory::default();
    // Three shared bases for prompts (prefix hits).
    let bases: Vec<Vec<u64>> = (0..3)
        .map(|b| (0..1_400).map(|i| mix(b, i) % 1000).collect())
        .collect();
    let mut seqs: Vec<Seq> = Vec::new();
    let mut next_id = 0u64;
    let mut issued = Fence::NONE;
    let mut linked: Vec<BlockKey> = Vec::new();
    let (mut hits, mut steps, mut refused) = (0, 0, 0);
    for _ in 0..1_500 {
        match rng.below(10) {
            0 | 1 if seqs.len() < 4 => {
                let base = &bases[rng.below(3) as usize];
                let shared = rng.below(1_300) as usize;
                let mut prompt = base[..shared].to_vec();
                prompt.extend((0..1 + rng.below(300)).map(|_| rng.below(1000) + 2000));
                // The deepest boundary before the last prompt token with a tail.
                let mut resume = None;
                let mut e = (prompt.len() as u64 - 1) / BLOCK * BLOCK;
                while e > 0 {
                    let k = key_of(&prompt[..e as usize]);
                    if w.has_tail(&k) {
                        resume = Some((e, k));
                        break;
                    }
                    e -= BLOCK;
                }
                let id = RequestId(next_id);
                next_id += 1;
                let at = w.open(id, resume.as_ref().map(|(_, k)| k)).unwrap();
                assert_eq!(at, resume.map_or(0, |(e, _)| e));
                hits += u32::from(at > 0);
                seqs.push(Seq {
                    id,
                    tokens: prompt[..at as usize].to_vec(),
                    rest: prompt[at as usize..].to_vec(),
                });
            }
            2 if !seqs.is_empty() => {
                let s = seqs.swap_remove(rng.below(seqs.len() as u64) as usize);
                w.close(s.id, issued).unwrap();
            }
            3 if !linked.is_empty() => {
                // A block left the prefix tree.
                let k = linked.swap_remove(rng.below(linked.len() as u64) as usize);
                w.drop_tail(&k, issued);
            }
            _ if !seqs.is_empty() => {
                let i = rng.below(seqs.len() as u64) as usize;
                if step(
                    &mut w,
                    &mut mem,
                    &specs,
                    &mut seqs[i],
                    &mut rng,
                    &mut issued,
                    &mut linked,
                ) {
                    steps += 1;
                } else {
                    refused += 1;
                    // No room: give it back by closing the sequence (a preemption).
                    let s = seqs.swap_remove(i);
                    w.close(s.id, issued).unwrap();
                }
            }
            _ => {}
        }
        w.check_invariants();
    }
    for s in seqs.drain(..) {
        w.close(s.id, issued).unwrap();
    }
    w.drop_all_tails(issued);
    assert_eq!(
        w.used_slots(),
        [0, 0, 0],
        "seed {seed}: everything returned"
    );
    w.check_invariants();
    assert!(
        steps > 300 && hits > 5,
        "seed {seed}: {steps} steps, {hits} hits, {refused} refused"
    );
}

/// What a query at `q` reads, written out per life cycle from the compressor's
/// definition (independently of `WindowSpec::reads_from`): the raw window the 128
/// positions up to `q`; a ratio-4 state the rows of the current group and the one before
/// (the overlapping entry pools both); a ratio-128 state the current group's rows.
fn reads_from(spec: &WindowSpec, q: u64) -> u64 {
    match (spec.tokens_per_page, spec.retain) {
        (64, 128) => q.saturating_sub(127),
        (4, 8) => (q / 4 * 4).saturating_sub(4),
        (8, 128) => q / 128 * 128,
        other => panic!("no read rule for {other:?}"),
    }
}

/// One step of `s`: write its next positions (a prefill chunk or a decode token with
/// drafts), read every query's window, accept some, link the tails of the blocks it
/// completed, advance. `false` when the rings had no room (nothing changed).
fn step(
    w: &mut WindowCache,
    mem: &mut Memory,
    specs: &[WindowSpec],
    s: &mut Seq,
    rng: &mut Rng,
    issued: &mut Fence,
    linked: &mut Vec<BlockKey>,
) -> bool {
    let c = s.tokens.len();
    let n = if s.rest.is_empty() {
        1 + rng.below(4) as usize
    } else {
        s.rest.len().min(1 + rng.below(400) as usize)
    };
    let completed = *issued;
    if !w.ensure(s.id, (c + n) as u64, completed, *issued).unwrap() {
        return false;
    }
    *issued = Fence(issued.0 + 1);
    let mut tokens = s.tokens.clone();
    for j in 0..n {
        tokens.push(match s.rest.get(j) {
            Some(&t) => t,
            None => rng.below(1000) + 5000,
        });
    }
    let prefix = prefix_hashes(&tokens);
    for (lc, spec) in specs.iter().enumerate() {
        let page = spec.tokens_per_page as usize;
        for p in c..c + n {
            assert!(
                w.writable(s.id, lc, p as u64).unwrap(),
                "lc {lc} pos {p} writable"
            );
            let slot = w.slot_of(s.id, lc, p as u64).unwrap().expect("ensured");
            mem.write(lc, slot, p % page, page, content(&prefix, p, lc));
        }
        // Every query of the step reads a subset of [reads_from(c), c + n) (reads_from
        // never decreases): check that range once.
        let low = reads_from(spec, c as u64) as usize;
        for r in low..c + n {
            let slot = w
                .slot_of(s.id, lc, r as u64)
                .unwrap()
                .unwrap_or_else(|| panic!("lc {lc}: the step from {c} finds no page for {r}"));
            assert_eq!(
                mem.read(lc, slot, r % page),
                Some(content(&prefix, r, lc)),
                "lc {lc}: the step from {c} reads position {r}"
            );
        }
    }
    // Prefill positions are all accepted; of a decode step, a prefix (drafts rejected).
    let accepted = if s.rest.is_empty() {
        1 + rng.below(n as u64) as usize
    } else {
        n
    };
    tokens.truncate(c + accepted);
    s.rest.drain(..accepted.min(s.rest.len()));
    s.tokens = tokens;
    let committed = s.tokens.len() as u64;
    let mut tails = Vec::new();
    for e in (c as u64 / BLOCK + 1)..=(committed / BLOCK) {
        let key = key_of(&s.tokens[..(e * BLOCK) as usize]);
        if !w.has_tail(&key) {
            linked.push(key);
        }
        tails.push((e * BLOCK, key));
    }
    w.commit(s.id, committed, &tails, BLOCK, *issued).unwrap();
    if rng.below(4) == 0 {
        w.truncate(s.id, committed, *issued).unwrap();
    }
    true
}

/// Found by review: a custom window whose tail is longer than the first block wrapped
/// below position 0 (a release build stored an empty tail). Now a typed refusal.
#[test]
fn a_tail_reaching_before_position_zero_is_refused() {
    let spec = WindowSpec {
        life_cycle: LifeCycleId(1),
        tokens_per_page: 64,
        retain: 320,
        tail_tokens: 319,
    };
    let mut w = WindowCache::new(vec![spec], vec![16]).unwrap();
    let id = RequestId(1);
    w.open(id, None).unwrap();
    assert!(w.ensure(id, 300, Fence::NONE, Fence::NONE).unwrap());
    assert!(matches!(
        w.commit(id, 300, &[(256, BlockKey([1; 32]))], BLOCK, Fence::NONE),
        Err(WindowError::BadTail { .. })
    ));
    assert_eq!(w.num_tails(), 0);
    assert!(matches!(
        w.page_table(id, 1),
        Err(WindowError::NoLifeCycle { lc: 1, count: 1 })
    ));
    w.check_invariants();
}
