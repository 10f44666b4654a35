use std::collections::HashMap;

use super::*;
use crate::config::V4Spec;
use crate::core::reuse_key::KeyHasher;
use crate::core::window::{WindowError, WindowSpec};
use crate::ids::Fence;
use crate::metadata::v4 as meta;

const T: u64 = 256;

use crate::rng::SplitMix64 as Rng;

/// The settings of a windowed cache in these tests.
#[derive(Clone, Debug)]
struct Opts {
    blocks: ManagerOptions,
    tail_interval: u32,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            blocks: ManagerOptions {
                enable_partial_reuse: false,
                ..ManagerOptions::default()
            },
            tail_interval: 16,
        }
    }
}

/// What a create served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Hit {
    reused_tokens: u64,
    backed_off_blocks: u64,
}

/// The tests' way in: a windowed [`ModelCache`] driven by request id ([`CacheById`]).
struct Harness {
    m: CacheById,
}

impl Harness {
    fn new(plan: V4Plan, slots: WindowedSlots, opts: Opts) -> Result<Self, KvError> {
        let c = ModelCache::windowed(&plan, slots, opts.blocks, opts.tail_interval)?;
        Ok(Harness {
            m: CacheById::new(c),
        })
    }

    fn c(&self) -> &ModelCache {
        self.m.cache()
    }

    fn handle(&self, id: RequestId) -> Result<&SeqHandle, KvError> {
        self.m.handle(id)
    }

    fn create(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        prompt: &[TokenId],
        opts: SeqOptions,
    ) -> Result<Hit, KvError> {
        let before = self.stats().backed_off_blocks;
        let reused_tokens = self.m.create(id, scope, prompt, opts)?;
        Ok(Hit {
            reused_tokens,
            backed_off_blocks: self.stats().backed_off_blocks - before,
        })
    }

    fn resume(&mut self, id: RequestId) -> Result<bool, KvError> {
        self.m.resume(id)
    }

    fn suspend(&mut self, id: RequestId) -> Result<(), KvError> {
        self.m.suspend(id)
    }

    fn resize(&mut self, id: RequestId, capacity: u64, history: u64) -> Result<bool, KvError> {
        self.m.resize(id, capacity, history)
    }

    fn commit(&mut self, id: RequestId, tokens: &[TokenId]) -> Result<(), KvError> {
        self.m.commit(id, tokens)
    }

    fn close(&mut self, id: RequestId) -> Result<(), KvError> {
        self.m.close(id)
    }

    fn committed(&self, id: RequestId) -> Result<u64, KvError> {
        self.m.committed(id)
    }

    fn block_slots(&self, id: RequestId) -> Result<Vec<SlotId>, KvError> {
        self.m.block_slots(id)
    }

    fn window_table(&self, id: RequestId, lc: usize) -> Result<(u64, Vec<SlotId>), KvError> {
        self.m.window_table(id, lc)
    }

    fn windows(&self) -> &WindowCache {
        self.c().windows().expect("a windowed cache")
    }

    fn windows_mut(&mut self) -> &mut WindowCache {
        &mut self
            .m
            .cache_mut()
            .window
            .as_mut()
            .expect("a windowed cache")
            .cache
    }

    fn blocks(&self) -> &KvCacheManager {
        self.c().blocks()
    }

    fn stats(&self) -> WindowKindStats {
        self.c().window_stats().expect("a windowed cache")
    }

    fn window_stats(&self) -> crate::core::WindowStats {
        self.stats().windows
    }

    fn issue_fence(&mut self) -> Fence {
        self.m.cache_mut().issue_fence()
    }

    fn complete_fences(&mut self, f: Fence) -> Result<(), KvError> {
        self.m.cache_mut().complete_fences(f)
    }

    fn take_copy_plans(&mut self) -> Vec<crate::ops::CopyPlan> {
        self.m.cache_mut().take_copy_plans()
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        self.m.cache_mut().take_events()
    }

    fn reset_prefix_cache(&mut self) -> Result<ResetReport, KvError> {
        self.m.cache_mut().reset_prefix_cache()
    }

    fn check_invariants(&self) {
        let c = self.c();
        c.check_invariants();
        assert_eq!(
            self.m.len(),
            c.num_sequences() - c.window.as_ref().map_or(0, |w| w.transfers.len()),
            "the harness holds every sequence's handle"
        );
    }

    fn export(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
    ) -> Result<Option<PrefixPages>, KvError> {
        self.m.cache_mut().export_prefix(id, scope, tokens)
    }

    fn close_export(&mut self, id: RequestId) -> Result<(), KvError> {
        self.m.cache_mut().close_prefix_export(id)
    }

    fn begin_import(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
    ) -> Result<Option<PrefixPages>, KvError> {
        self.m.cache_mut().begin_prefix_import(id, scope, tokens)
    }

    fn commit_import(&mut self, id: RequestId, tokens: &[TokenId]) -> Result<(), KvError> {
        self.m.cache_mut().commit_prefix_import(id, tokens)
    }

    fn abort_import(&mut self, id: RequestId) -> Result<(), KvError> {
        self.m.cache_mut().abort_prefix_import(id)
    }
}

fn manager(blocks: u32, windows: [u32; 3], opts: Opts) -> Harness {
    Harness::new(
        V4Plan::new(&V4Spec::flash()).unwrap(),
        WindowedSlots {
            blocks: TierSlots {
                gpu: vec![blocks],
                host: vec![],
            },
            windows: windows.to_vec(),
        },
        opts,
    )
    .unwrap()
}

/// Creates `id` for `prompt` in the shared scope (every test's way in).
fn create(m: &mut Harness, id: RequestId, prompt: &[TokenId]) -> Hit {
    m.create(id, ReuseScope::SHARED, prompt, SeqOptions::default())
        .unwrap()
}

fn toks(range: impl IntoIterator<Item = u32>) -> Vec<TokenId> {
    range.into_iter().map(TokenId).collect()
}

/// Runs `id` from its reused prefix through its prompt (chunks of `chunk`), then
/// `generate` tokens in MTP steps (1 token + `drafts` drafts written, a seeded number
/// accepted), completing every step's fence. Returns every committed token.
fn run(
    m: &mut Harness,
    id: RequestId,
    prompt: &[TokenId],
    generate: u64,
    drafts: u64,
    rng: &mut Rng,
) -> Vec<TokenId> {
    assert!(m.resume(id).unwrap());
    let mut done = m.committed(id).unwrap() as usize;
    let mut tokens = prompt[..done].to_vec();
    let chunk = 300;
    while done < prompt.len() {
        let n = (prompt.len() - done).min(chunk);
        assert!(
            m.resize(id, (done + n) as u64, done as u64).unwrap(),
            "room for the prompt"
        );
        let f = m.issue_fence();
        m.commit(id, &prompt[done..done + n]).unwrap();
        m.complete_fences(f).unwrap();
        tokens.extend_from_slice(&prompt[done..done + n]);
        done += n;
        m.check_invariants();
    }
    let end = prompt.len() as u64 + generate;
    while (tokens.len() as u64) < end {
        let c = tokens.len() as u64;
        assert!(m.resize(id, c + 1 + drafts, c).unwrap(), "room to decode");
        let f = m.issue_fence();
        let accepted = (1 + rng.below(drafts + 1)).min(end - c);
        let new = toks((0..accepted).map(|_| 50_000 + rng.below(1000) as u32));
        m.commit(id, &new).unwrap();
        assert!(m.resize(id, c + accepted, c + accepted).unwrap());
        m.complete_fences(f).unwrap();
        tokens.extend(new);
    }
    m.check_invariants();
    tokens
}

#[test]
fn partial_reuse_window_only_models_and_suspends_are_refused() {
    let plan = V4Plan::new(&V4Spec::flash()).unwrap();
    let slots = WindowedSlots {
        blocks: TierSlots {
            gpu: vec![8],
            host: vec![],
        },
        windows: vec![8, 200, 100],
    };
    let partial = Opts {
        blocks: ManagerOptions::default(),
        ..Opts::default()
    };
    assert!(matches!(
        Harness::new(plan.clone(), slots.clone(), partial),
        Err(KvError::InvalidOption {
            field: "enable_partial_reuse",
            ..
        })
    ));
    let window_only = V4Spec {
        compress_ratios: vec![0, 0],
        ..V4Spec::flash()
    };
    assert!(matches!(
        Harness::new(
            V4Plan::new(&window_only).unwrap(),
            slots.clone(),
            Opts::default()
        ),
        Err(KvError::InvalidOption { field: "model", .. })
    ));
    let mut m = Harness::new(plan, slots, Opts::default()).unwrap();
    let id = RequestId(1);
    assert!(matches!(
        m.create(id, ReuseScope::SHARED, &[], SeqOptions::default()),
        Err(KvError::InvalidOption {
            field: "prompt",
            ..
        })
    ));
    create(&mut m, id, &toks(0..10));
    assert!(matches!(m.suspend(id), Err(KvError::NoSuspend { .. })));
    assert!(matches!(
        m.create(id, ReuseScope::SHARED, &toks(0..10), SeqOptions::default()),
        Err(KvError::DuplicateRequest { .. })
    ));
    m.close(id).unwrap();
    m.check_invariants();
}

/// When the windows have no room, the blocks do not grow either.
#[test]
fn a_resize_grows_both_halves_or_neither() {
    let mut m = manager(64, [4, 200, 100], Opts::default());
    let id = RequestId(1);
    create(&mut m, id, &toks(0..1000));
    assert!(m.resume(id).unwrap());
    // 300 positions need 5 window pages of 64: only 4 exist.
    assert!(!m.resize(id, 300, 0).unwrap());
    assert_eq!(
        m.blocks().info_of(m.handle(id).unwrap()).unwrap().capacity,
        0
    );
    assert_eq!(m.windows().used_slots(), [0, 0, 0]);
    assert!(m.resize(id, 250, 0).unwrap());
    assert_eq!(m.windows().used_slots(), [4, 63, 32]);
    assert_eq!(m.block_slots(id).unwrap().len(), 1);
    m.check_invariants();
    m.close(id).unwrap();
}

/// The issue's MTP case (vLLM #51441: with MTP, a prompt whose length is not a multiple
/// of 256 missed the prefix cache completely): a prompt is run, its answer decoded in MTP
/// steps (3 drafts, seeded acceptance), the request closed; then the same prompt comes
/// again (the lookup leaves its last token out), and the whole conversation comes back
/// as the next turn. Measured: blocks lost against the deepest cached boundary the
/// lookup can use. Ours: none, at every length.
#[test]
fn mtp_prefix_hits_lose_no_block_at_any_prompt_length() {
    let mut rng = Rng(0x51441);
    let lengths = [257u32, 300, 511, 700, 1000, 1025, 1500, 2049, 3000, 4095];
    let mut report = Vec::new();
    let mut evicted = 0;
    for (i, &len) in lengths.iter().enumerate() {
        // 14 window slots: a 300-token chunk's ring takes up to 7, each tail 2, so the
        // boundaries a long answer crosses evict tails; the retention policy decides
        // which.
        let mut m = manager(256, [14, 2_000, 1_000], Opts::default());
        let base = 1_000 * i as u32;
        let prompt = toks(base * 10..base * 10 + len);
        let a = RequestId(1);
        create(&mut m, a, &prompt);
        let conversation = run(&mut m, a, &prompt, 1_500, 3, &mut rng);
        m.close(a).unwrap();
        // The same prompt again.
        let b = RequestId(2);
        let hit = create(&mut m, b, &prompt);
        let deepest = (u64::from(len) - 1) / T * T;
        assert_eq!(
            (hit.reused_tokens, hit.backed_off_blocks),
            (deepest, 0),
            "prompt of {len}"
        );
        m.close(b).unwrap();
        // The next turn: the whole conversation and a new message.
        let mut next = conversation.clone();
        next.extend(toks(90_000..90_050));
        let c = RequestId(3);
        let turn = create(&mut m, c, &next);
        let last = conversation.len() as u64 / T * T;
        assert_eq!(
            (turn.reused_tokens, turn.backed_off_blocks),
            (last, 0),
            "next turn after a prompt of {len}"
        );
        m.close(c).unwrap();
        m.check_invariants();
        report.push((len, hit.reused_tokens, deepest, turn.reused_tokens, last));
        evicted += m.window_stats().tails_evicted;
    }
    assert!(
        evicted > 20,
        "the windows were under pressure: {evicted} tails evicted"
    );
    // The table ARCHITECTURE.md quotes.
    for (len, hit, deepest, turn, last) in report {
        eprintln!(
            "prompt {len}: same prompt reuses {hit} of {deepest}; next turn {turn} of {last}"
        );
    }
}

/// A tail dropped (its block evicted, or demoted and evicted for room) makes the next hit
/// back off to the deepest boundary that still has one, never further.
#[test]
fn hits_back_off_to_the_deepest_boundary_with_a_tail() {
    let mut rng = Rng(7);
    let opts = Opts {
        tail_interval: 2,
        ..Opts::default()
    };
    let mut m = manager(256, [32, 2_000, 1_000], opts);
    let prompt = toks(0..2_000);
    let a = RequestId(1);
    create(&mut m, a, &prompt);
    run(&mut m, a, &prompt, 0, 0, &mut rng);
    m.close(a).unwrap();
    // Kept: the prompt's last two boundaries (1536, 1792) and every second one (512, 1024,
    // 1536); the others (256, 768, 1280) demoted but still usable while there is room.
    assert_eq!(m.stats().tails_demoted, 3);
    let b = RequestId(2);
    let hit = create(&mut m, b, &toks(0..1_300));
    assert_eq!((hit.reused_tokens, hit.backed_off_blocks), (1_280, 0));
    m.close(b).unwrap();
    // The tail at 1280 goes (as when its block is evicted): back off one block, to 1024.
    let key = |n: u32| {
        let mut k = ReuseScope::SHARED.root_key();
        for b in toks(0..n).chunks(256) {
            k = KeyHasher::default().block_key(&k, b);
        }
        k
    };
    let f = m.blocks().issued_fence();
    assert!(m.windows_mut().drop_tail(&key(1_280), f));
    let c = RequestId(3);
    let hit = create(&mut m, c, &toks(0..1_300));
    assert_eq!((hit.reused_tokens, hit.backed_off_blocks), (1_024, 1));
    assert_eq!(m.stats().backed_off_blocks, 1);
    m.close(c).unwrap();
    m.check_invariants();
}

/// Evicting a block from the prefix tree drops its tail (the invariant check asserts no
/// tail outlives its block), and clearing the prefix cache drops them all.
#[test]
fn tails_follow_their_blocks_out_of_the_tree() {
    let mut rng = Rng(3);
    // 12 blocks: a second long prompt must evict the first one's blocks.
    let mut m = manager(12, [40, 2_000, 1_000], Opts::default());
    for (i, start) in [0u32, 100_000].into_iter().enumerate() {
        let prompt = toks(start..start + 2_600);
        let id = RequestId(i as u64);
        create(&mut m, id, &prompt);
        run(&mut m, id, &prompt, 0, 0, &mut rng);
        m.close(id).unwrap();
        m.check_invariants();
    }
    let events = m.take_events();
    assert!(events.iter().any(|e| matches!(e, KvEvent::Removed { .. })));
    assert!(m.windows().num_tails() > 0);
    m.reset_prefix_cache().unwrap();
    assert_eq!(m.windows().num_tails(), 0);
    assert_eq!(m.windows().used_slots(), [0, 0, 0]);
    m.check_invariants();
}

/// Many sequences at once, sharing prefixes, with chunked prefill, MTP decoding, closes
/// and recompute preemption when room runs out: the block table and window tables of
/// every sequence give, for every position a step reads, the row its own prefix wrote
/// (compressed entries through the blocks, raw rows and states through the windows).
#[test]
fn blocks_and_windows_read_what_their_prefix_wrote() {
    for seed in 0..6 {
        model(seed);
    }
}

fn mix(h: u64, x: u64) -> u64 {
    let mut z = (h ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z ^= z >> 29;
    z.wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

struct Live {
    id: RequestId,
    tokens: Vec<TokenId>,
    prompt: Vec<TokenId>,
    end: usize,
}

/// Memory of every pool: (cache, slot) → values by index in the page. Caches: 0–2 the
/// window life cycles, 3 the ratio-4 entries, 4 the ratio-128 entries.
type Memory = HashMap<(usize, u32), HashMap<u64, u64>>;

fn model(seed: u64) {
    let mut rng = Rng(seed);
    let mut m = manager(
        24 + rng.below(40) as u32,
        [12 + rng.below(20) as u32, 300, 200],
        Opts {
            tail_interval: rng.below(4) as u32,
            ..Opts::default()
        },
    );
    let specs: Vec<WindowSpec> = m.windows().specs().to_vec();
    let bases: Vec<Vec<TokenId>> = (0..2)
        .map(|b| toks((0..1_800).map(|i| (mix(b, i) % 5_000) as u32)))
        .collect();
    let mut mem: Memory = HashMap::new();
    let mut live: Vec<Live> = Vec::new();
    let (mut next, mut hits, mut steps) = (0u64, 0u64, 0u64);
    // A router following the cache's router events (only blocks a hit can reach).
    m.m.cache_mut().set_record_router_events(true);
    let mut router = crate::core::RouterView::default();
    let mut router_exact = 0u64;
    for _ in 0..800 {
        if live.len() < 3 && rng.below(3) == 0 {
            let mut prompt = bases[rng.below(2) as usize][..rng.below(1_700) as usize].to_vec();
            prompt.extend(toks(
                (0..1 + rng.below(200)).map(|_| 9_000 + rng.below(500) as u32),
            ));
            let id = RequestId(next);
            next += 1;
            // The router's overlap score (leading blocks it holds) never falls short of
            // the hit, and equals it when it ends at a block with a tail.
            let c = m.m.cache_mut();
            let probe = c.probe_reuse(ReuseScope::SHARED, &prompt).unwrap();
            let keys = c.block_keys(ReuseScope::SHARED, &prompt[..prompt.len() - 1]);
            let j = keys
                .iter()
                .take_while(|k| router.contains(k.hash64()))
                .count();
            assert!(
                j as u64 * T >= probe,
                "seed {seed}: router {j} blocks, hit {probe}"
            );
            if j == 0 || m.windows().has_tail(&keys[j - 1]) {
                assert_eq!(j as u64 * T, probe, "seed {seed}: router ends at a tail");
                router_exact += u64::from(probe > 0);
            }
            let c = create(&mut m, id, &prompt);
            assert_eq!(c.reused_tokens, probe, "seed {seed}: the probe is the hit");
            hits += u64::from(c.reused_tokens > 0);
            if !m.resume(id).unwrap() {
                m.close(id).unwrap();
                continue;
            }
            let end = prompt.len() + rng.below(60) as usize;
            live.push(Live {
                id,
                tokens: prompt[..c.reused_tokens as usize].to_vec(),
                prompt,
                end,
            });
        } else if !live.is_empty() {
            let i = rng.below(live.len() as u64) as usize;
            let done = live[i].tokens.len() >= live[i].end;
            if done || !step(&mut m, &mut mem, &specs, &mut live[i], &mut rng) {
                // Finished, or no room: closed (a preemption is a close and a later
                // re-create).
                let s = live.swap_remove(i);
                m.close(s.id).unwrap();
            } else {
                steps += 1;
            }
        }
        m.check_invariants();
        for e in m.m.cache_mut().take_router_events() {
            router
                .apply(&e)
                .unwrap_or_else(|err| panic!("seed {seed}: {err}"));
        }
        assert_eq!(router.blocks(), m.c().router_blocks(), "seed {seed}");
    }
    for s in live {
        m.close(s.id).unwrap();
    }
    m.check_invariants();
    assert!(
        steps > 100 && hits > 3 && router_exact > 0,
        "seed {seed}: {steps} steps, {hits} hits, {router_exact} exact router hits"
    );
}

fn step(
    m: &mut Harness,
    mem: &mut Memory,
    specs: &[WindowSpec],
    s: &mut Live,
    rng: &mut Rng,
) -> bool {
    let c = s.tokens.len();
    let prefill = c < s.prompt.len();
    let n = if prefill {
        (s.prompt.len() - c).min(1 + rng.below(300) as usize)
    } else {
        1 + rng.below(4) as usize
    };
    if !m.resize(s.id, (c + n) as u64, c as u64).unwrap() {
        return false;
    }
    let f = m.issue_fence();
    let mut tokens = s.tokens.clone();
    for j in 0..n {
        tokens.push(if prefill {
            s.prompt[c + j]
        } else {
            TokenId(20_000 + rng.below(100) as u32)
        });
    }
    let mut prefix = Vec::with_capacity(tokens.len());
    let mut h = 1u64;
    for t in &tokens {
        h = mix(h, u64::from(t.get()));
        prefix.push(h);
    }
    let blocks = m.block_slots(s.id).unwrap();
    // Writes: every window row; a compressed entry at the last token of its group.
    for p in c..c + n {
        for (lc, spec) in specs.iter().enumerate() {
            let (start, slots) = m.window_table(s.id, lc).unwrap();
            let page = u64::from(spec.tokens_per_page);
            let slot = slots[((p as u64 - start) / page) as usize];
            mem.entry((lc, slot.get()))
                .or_default()
                .insert(p as u64 % page, mix(prefix[p], lc as u64));
        }
        for (cache, r) in [(3usize, 4u64), (4, 128)] {
            if (p as u64 + 1).is_multiple_of(r) {
                let slot = blocks[p / T as usize];
                mem.entry((cache, slot.get()))
                    .or_default()
                    .insert((p as u64 % T) / r, mix(prefix[p], r));
            }
        }
    }
    // The metadata references (`metadata::v4`) address the same rows as the arithmetic
    // above: the write mappings of every cache, and the window indices of the step's last
    // query.
    let unit = crate::layout::PageIndexConverter {
        scale: 1,
        layer_offset: 0,
        expansion: 1,
    };
    for (lc, spec) in specs.iter().enumerate() {
        let (start, slots) = m.window_table(s.id, lc).unwrap();
        let page = u64::from(spec.tokens_per_page);
        let table = meta::PageTable {
            start,
            slots: &slots,
            page,
        };
        let want: Vec<i64> = (c..c + n)
            .map(|p| {
                i64::from(slots[((p as u64 - start) / page) as usize].get()) * page as i64
                    + (p as u64 % page) as i64
            })
            .collect();
        assert_eq!(
            table.slot_mapping(unit, c as u64, (c + n) as u64).unwrap(),
            want
        );
        if lc == 0 {
            let q = (c + n - 1) as u64;
            let (idx, len) = meta::window_indices(&table, unit, q, 128, 128).unwrap();
            let low = (q + 1).saturating_sub(128);
            assert_eq!(u64::from(len), q + 1 - low);
            for (i, r) in (low..=q).enumerate() {
                let slot = slots[((r - start) / page) as usize];
                assert_eq!(
                    i64::from(idx[i]),
                    i64::from(slot.get()) * 64 + (r % 64) as i64
                );
            }
        }
    }
    for r in [4u64, 128] {
        let got =
            meta::compressed_slot_mapping(&blocks, unit, r, c as u64, (c + n) as u64).unwrap();
        for (j, p) in (c..c + n).enumerate() {
            let want = if (p as u64 + 1).is_multiple_of(r) {
                i64::from(blocks[p / T as usize].get()) * (T / r) as i64
                    + ((p as u64 % T) / r) as i64
            } else {
                -1
            };
            assert_eq!(got[j], want, "ratio {r} position {p}");
        }
    }
    // Reads of the step: every window row its queries read, and every visible compressed
    // entry (sampled for long contexts).
    for (lc, spec) in specs.iter().enumerate() {
        let (start, slots) = m.window_table(s.id, lc).unwrap();
        let page = u64::from(spec.tokens_per_page);
        let low = match lc {
            0 => (c as u64).saturating_sub(127),
            1 => (c as u64 / 4 * 4).saturating_sub(4),
            _ => c as u64 / 128 * 128,
        };
        for r in low..(c + n) as u64 {
            assert!(
                r >= start,
                "lc {lc}: position {r} before the ring's {start}"
            );
            let slot = slots[((r - start) / page) as usize];
            assert_eq!(
                mem.get(&(lc, slot.get())).and_then(|v| v.get(&(r % page))),
                Some(&mix(prefix[r as usize], lc as u64)),
                "lc {lc}: position {r}"
            );
        }
    }
    for (cache, r) in [(3usize, 4u64), (4, 128)] {
        let visible = (c + n) as u64 / r;
        for _ in 0..32.min(visible) {
            let w = rng.below(visible);
            let last = (w * r + r - 1) as usize;
            let slot = blocks[last / T as usize];
            assert_eq!(
                mem.get(&(cache, slot.get()))
                    .and_then(|v| v.get(&((last as u64 % T) / r))),
                Some(&mix(prefix[last], r)),
                "ratio {r}: entry {w}"
            );
        }
    }
    let accepted = if prefill {
        n
    } else {
        1 + rng.below(n as u64) as usize
    };
    m.commit(s.id, &tokens[c..c + accepted]).unwrap();
    let k = (c + accepted) as u64;
    assert!(m.resize(s.id, k, k).unwrap());
    m.complete_fences(f).unwrap();
    tokens.truncate(c + accepted);
    s.tokens = tokens;
    true
}

/// With a host tier, a cached prompt's compressed blocks are offloaded when the GPU needs
/// room and come back (copy plans) when the prompt is served again; its window tail stays
/// on the GPU the whole time, and the hit is whole.
#[test]
fn offloaded_blocks_come_back_with_their_tail_in_place() {
    let mut rng = Rng(11);
    let mut m = Harness::new(
        V4Plan::new(&V4Spec::flash()).unwrap(),
        WindowedSlots {
            blocks: TierSlots {
                gpu: vec![8],
                host: vec![16],
            },
            windows: vec![32, 2_000, 1_000],
        },
        Opts::default(),
    )
    .unwrap();
    let first = toks(0..1_100);
    let a = RequestId(1);
    create(&mut m, a, &first);
    run(&mut m, a, &first, 0, 0, &mut rng);
    m.close(a).unwrap();
    let tails = m.windows().num_tails();
    let _ = m.take_copy_plans();
    // Another prompt needs all 8 GPU blocks: the first prompt's 4 go to the host.
    let other = toks(50_000..51_900);
    let b = RequestId(2);
    create(&mut m, b, &other);
    run(&mut m, b, &other, 0, 0, &mut rng);
    m.close(b).unwrap();
    let offloads = m.take_copy_plans();
    assert!(
        !offloads.is_empty(),
        "the first prompt's blocks were offloaded"
    );
    assert!(
        m.windows().num_tails() >= tails,
        "tails stay while their blocks are cached"
    );
    m.check_invariants();
    // The first prompt again: served whole from the host, its tail read in place.
    let c = RequestId(3);
    let hit = create(&mut m, c, &first);
    assert_eq!((hit.reused_tokens, hit.backed_off_blocks), (1_024, 0));
    assert!(m.resume(c).unwrap());
    let onloads = m.take_copy_plans();
    assert!(
        onloads.iter().map(|p| p.num_slot_copies()).sum::<usize>() >= 4,
        "the reused blocks were copied back to the GPU"
    );
    let (start, slots) = m.window_table(c, 0).unwrap();
    assert_eq!((start, slots.len()), (1_024 - 128, 2));
    m.check_invariants();
    m.close(c).unwrap();
}

/// Found by review: a resize the windows cannot hold, with a raised history, returned an
/// error after the blocks had grown (the rollback lowered history, which the block
/// manager refuses), and the next commit failed halfway. Now: `Ok(false)`, nothing
/// changed, and a commit the windows would refuse changes nothing either.
#[test]
fn a_refused_resize_with_a_raised_history_changes_nothing() {
    let mut m = manager(64, [4, 200, 100], Opts::default());
    let id = RequestId(1);
    create(&mut m, id, &toks(0..1000));
    assert!(m.resume(id).unwrap());
    assert!(!m.resize(id, 300, 10).unwrap());
    let info = m.blocks().info_of(m.handle(id).unwrap()).unwrap();
    assert_eq!((info.capacity, info.history), (0, 0));
    assert_eq!(m.windows().used_slots(), [0, 0, 0]);
    // Beyond the capacity: the block manager refuses, nothing committed anywhere.
    assert!(m.commit(id, &toks(0..260)).is_err());
    assert_eq!(m.committed(id).unwrap(), 0);
    assert_eq!(
        m.blocks().info_of(m.handle(id).unwrap()).unwrap().committed,
        0
    );
    m.check_invariants();
}

/// Found by review: a resize the windows then refused had already let the block manager
/// evict cached blocks (and, through their events, their tails). Now the windows are
/// asked first.
#[test]
fn a_resize_the_windows_refuse_evicts_nothing() {
    let mut rng = Rng(1);
    let mut m = manager(4, [8, 200, 100], Opts::default());
    let a = RequestId(1);
    let prompt = toks(0..600);
    create(&mut m, a, &prompt);
    run(&mut m, a, &prompt, 0, 0, &mut rng);
    m.close(a).unwrap();
    let before = (m.blocks().cached_blocks().len(), m.windows().num_tails());
    let b = RequestId(2);
    create(&mut m, b, &toks(5_000..6_000));
    assert!(m.resume(b).unwrap());
    assert!(!m.resize(b, 1_000, 0).unwrap());
    let after = (m.blocks().cached_blocks().len(), m.windows().num_tails());
    assert_eq!(after, before, "a refused resize changed the cache");
    m.check_invariants();
}

/// Found by review: with block reuse off no block enters the tree, yet tails were linked
/// and never dropped. Now only blocks in the tree get a tail.
#[test]
fn without_reuse_no_tail_is_kept() {
    let mut rng = Rng(2);
    let opts = Opts {
        blocks: ManagerOptions {
            enable_block_reuse: false,
            enable_partial_reuse: false,
            ..ManagerOptions::default()
        },
        ..Opts::default()
    };
    let mut m = manager(64, [40, 200, 100], opts);
    let a = RequestId(1);
    let prompt = toks(0..1_000);
    create(&mut m, a, &prompt);
    run(&mut m, a, &prompt, 0, 0, &mut rng);
    assert_eq!(m.windows().num_tails(), 0);
    m.close(a).unwrap();
    assert_eq!(m.windows().used_slots(), [0, 0, 0]);
    m.check_invariants();
}

/// Found by review: a window life cycle index past the specs panicked.
#[test]
fn a_window_index_past_the_specs_is_a_typed_error() {
    let mut m = manager(64, [40, 200, 100], Opts::default());
    let a = RequestId(1);
    create(&mut m, a, &toks(0..10));
    assert!(matches!(
        m.window_table(a, 3),
        Err(KvError::Window(WindowError::NoLifeCycle {
            lc: 3,
            count: 3
        }))
    ));
}

/// Export and import by role: what is offered (blocks to the deepest boundary with a
/// tail, the tail's pages), what is reserved (fresh blocks and tail pages, or none of the
/// windows when a tail is kept there already), pins held until closed, and every refusal
/// typed with nothing changed.
#[test]
fn export_and_import_move_blocks_and_the_tail_at_their_boundary() {
    let mut rng = Rng(5);
    let mut pre = manager(16, [24, 200, 100], Opts::default());
    let mut dec = manager(16, [24, 200, 100], Opts::default());
    let prompt = toks(0..700);
    let id = RequestId(1);
    create(&mut pre, id, &prompt);
    run(&mut pre, id, &prompt, 10, 3, &mut rng);
    pre.close(id).unwrap();
    let s = ReuseScope::SHARED;
    // Fewer than 256 tokens, or nothing cached: nothing is offered or pinned.
    assert_eq!(pre.export(RequestId(7), s, &prompt[..200]).unwrap(), None);
    assert_eq!(
        pre.export(RequestId(7), s, &toks(5000..5600)).unwrap(),
        None
    );
    pre.check_invariants();
    let out = pre.export(RequestId(7), s, &prompt).unwrap().unwrap();
    assert_eq!((out.boundary, out.blocks.len(), out.skipped), (512, 2, 0));
    let spans: Vec<(u64, usize)> = out.tails.iter().map(|(a, v)| (*a, v.len())).collect();
    assert_eq!(spans, vec![(384, 2), (508, 1), (512, 0)]);
    assert!(matches!(
        pre.export(RequestId(7), s, &prompt),
        Err(KvError::DuplicateRequest { .. })
    ));
    assert!(
        pre.abort_import(RequestId(7)).is_err(),
        "an export is closed by close_export"
    );
    pre.check_invariants();
    // The decode side: fresh pages for both blocks and the tail.
    let y = RequestId(8);
    let inp = dec.begin_import(y, s, &prompt[..512]).unwrap().unwrap();
    assert_eq!((inp.skipped, inp.blocks.len(), inp.boundary), (0, 2, 512));
    let spans: Vec<(u64, usize)> = inp.tails.iter().map(|(a, v)| (*a, v.len())).collect();
    assert_eq!(spans, vec![(384, 2), (508, 1), (512, 0)]);
    dec.check_invariants();
    let used = dec.windows().used_slots();
    // Wrong tokens: refused, the import still open.
    assert!(dec.commit_import(y, &prompt[1..513]).is_err());
    dec.check_invariants();
    dec.commit_import(y, &prompt[..512]).unwrap();
    pre.close_export(RequestId(7)).unwrap();
    pre.check_invariants();
    dec.check_invariants();
    assert_eq!(
        dec.windows().used_slots(),
        used,
        "the tail pages stay, as the tail"
    );
    assert_eq!(dec.windows().stats().tails_linked, 1);
    // A request for the prompt resumes at the imported tail.
    assert_eq!(create(&mut dec, RequestId(9), &prompt).reused_tokens, 512);
    dec.close(RequestId(9)).unwrap();
    // Imported again: the blocks are skipped and the tail is held, nothing moves.
    let again = dec
        .begin_import(RequestId(10), s, &prompt[..512])
        .unwrap()
        .unwrap();
    assert_eq!(
        (again.skipped, again.blocks.len(), again.tails.len()),
        (2, 0, 0)
    );
    dec.abort_import(RequestId(10)).unwrap();
    dec.check_invariants();
    // An aborted fresh import gives every page back.
    let mut other = manager(16, [24, 200, 100], Opts::default());
    let before = other.windows().used_slots();
    other
        .begin_import(RequestId(11), s, &prompt[..256])
        .unwrap()
        .unwrap();
    other.abort_import(RequestId(11)).unwrap();
    assert_eq!(other.windows().used_slots(), before);
    assert_eq!(create(&mut other, RequestId(12), &prompt).reused_tokens, 0);
    other.check_invariants();
}

/// Regression (review): fresh tail pages an import would get while a step in flight may
/// still read their slots (released behind an uncompleted fence) are refused, as the
/// block half refuses them: the import fits after that step completed.
#[test]
fn an_import_refuses_tail_pages_a_step_in_flight_may_read() {
    let mut m = manager(16, [4, 60, 40], Opts::default());
    let a = RequestId(1);
    create(&mut m, a, &toks(0..200));
    assert!(m.resume(a).unwrap());
    assert!(m.resize(a, 200, 0).unwrap());
    let f = m.issue_fence(); // the step writing and reading A's rows: in flight
    m.commit(a, &toks(0..200)).unwrap();
    m.close(a).unwrap(); // A's 4 raw-window pages released behind f
    assert!(m.blocks().completed_fence() < f);
    let y = RequestId(2);
    assert_eq!(
        m.begin_import(y, ReuseScope::SHARED, &toks(1000..1256))
            .unwrap(),
        None,
        "a transport would write tail pages that step {f:?} still reads"
    );
    m.check_invariants();
    m.complete_fences(f).unwrap();
    let inp = m
        .begin_import(y, ReuseScope::SHARED, &toks(1000..1256))
        .unwrap()
        .expect("room once the step completed");
    assert!(m.windows().wait_for(y).unwrap() <= m.blocks().completed_fence());
    assert_eq!(inp.tails[0].1.len(), 2);
    m.abort_import(y).unwrap();
    m.check_invariants();
}

/// Regression (review): an import holding a kept tail links it again at commit if the
/// window LRU evicted it in between (the import's ring held its pages).
#[test]
fn an_import_holding_a_tail_links_it_again_if_it_was_evicted() {
    let mut rng = Rng(3);
    let mut m = manager(16, [24, 400, 200], Opts::default());
    let s = ReuseScope::SHARED;
    let p = toks(0..700);
    create(&mut m, RequestId(1), &p);
    run(&mut m, RequestId(1), &p, 0, 0, &mut rng);
    m.close(RequestId(1)).unwrap();
    let key = m.m.cache_mut().block_keys(s, &p[..512])[1];
    assert!(m.windows().has_tail(&key));
    let y = RequestId(2);
    let inp = m.begin_import(y, s, &p[..512]).unwrap().unwrap();
    assert!(inp.tails.is_empty(), "a kept tail is held, nothing moves");
    let q = toks(5000..5600);
    create(&mut m, RequestId(3), &q);
    run(&mut m, RequestId(3), &q, 0, 0, &mut rng);
    m.close(RequestId(3)).unwrap();
    let r4 = RequestId(4);
    create(&mut m, r4, &toks(9000..10216));
    assert!(m.resume(r4).unwrap());
    assert!(m.resize(r4, 1216, 0).unwrap());
    m.close(r4).unwrap();
    m.commit_import(y, &p[..512]).unwrap();
    m.check_invariants();
    let reused = create(&mut m, RequestId(5), &p).reused_tokens;
    assert_eq!(reused, 512);
    assert!(
        m.windows().has_tail(&key),
        "commit_import links the tail at the boundary"
    );
}
