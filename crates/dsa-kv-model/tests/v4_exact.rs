//! The V4 exactness test on the host: the tiny V4 model (`[0, 4, 128]` and an MTP layer)
//! run through the model cache's tables over the pools its plan lays out must give
//! the bits of the same model run on a contiguous cache, one request alone, with prefix
//! hits resumed at a window tail, prefill chunks of every size (straddling the 4- and
//! 128-token groups and the 256-token blocks), MTP steps with 3 drafts accepted and
//! rejected, preemption by recompute, and compressed blocks offloaded to the host tier
//! and brought back.

use std::collections::HashMap;

use dsa_kv_core::core::{
    CacheById, KvError, ManagerOptions, ModelCache, PrefixPages, ReuseScope, SeqHandle, SeqOptions,
    TierSlots, WindowedSlots,
};
use dsa_kv_core::ids::{LayerId, RequestId, Tier, TokenId};
use dsa_kv_core::layout::{Retention, Role, V4PageFormat, V4Plan};
use dsa_kv_core::metadata::v4::entry_row;
use dsa_kv_core::ops::CopyPlan;
use dsa_kv_core::rng::SplitMix64;
use dsa_kv_model::v4::{V4Contiguous, V4Model, V4ModelConfig, V4Paged, V4Pools, V4Store};
use dsa_kv_model::TokenOut;

/// A windowed [`ModelCache`] driven by request id ([`CacheById`]) and its plan.
struct Cache {
    m: CacheById,
    plan: V4Plan,
}

impl Cache {
    fn new(plan: V4Plan, slots: WindowedSlots) -> Cache {
        let opts = ManagerOptions {
            enable_partial_reuse: false,
            ..ManagerOptions::default()
        };
        Cache {
            m: CacheById::new(ModelCache::windowed(&plan, slots, opts, 16).unwrap()),
            plan,
        }
    }

    fn c(&self) -> &ModelCache {
        self.m.cache()
    }

    fn c_mut(&mut self) -> &mut ModelCache {
        self.m.cache_mut()
    }

    fn handle(&self, id: RequestId) -> &SeqHandle {
        self.m.handle(id).unwrap()
    }

    fn plan(&self) -> &V4Plan {
        &self.plan
    }

    fn create(&mut self, id: RequestId, prompt: &[TokenId]) -> u64 {
        self.m
            .create(id, ReuseScope::SHARED, prompt, SeqOptions::default())
            .unwrap()
    }

    fn resume(&mut self, id: RequestId) -> Result<bool, KvError> {
        self.m.resume(id)
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

    fn block_slots(&self, id: RequestId) -> Result<Vec<dsa_kv_core::ids::SlotId>, KvError> {
        self.m.block_slots(id)
    }

    fn take_copy_plans(&mut self) -> Vec<CopyPlan> {
        self.c_mut().take_copy_plans()
    }

    fn issue_fence(&mut self) -> dsa_kv_core::ids::Fence {
        self.c_mut().issue_fence()
    }

    fn complete_fences(&mut self, f: dsa_kv_core::ids::Fence) -> Result<(), KvError> {
        self.c_mut().complete_fences(f)
    }

    fn check_invariants(&self) {
        self.c().check_invariants();
    }

    fn stats(&self) -> dsa_kv_core::core::WindowKindStats {
        self.c().window_stats().unwrap()
    }

    fn export(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
    ) -> Result<Option<PrefixPages>, KvError> {
        self.c_mut().export_prefix(id, scope, tokens)
    }

    fn close_export(&mut self, id: RequestId) -> Result<(), KvError> {
        self.c_mut().close_prefix_export(id)
    }

    fn begin_import(
        &mut self,
        id: RequestId,
        scope: ReuseScope,
        tokens: &[TokenId],
    ) -> Result<Option<PrefixPages>, KvError> {
        self.c_mut().begin_prefix_import(id, scope, tokens)
    }

    fn commit_import(&mut self, id: RequestId, tokens: &[TokenId]) -> Result<(), KvError> {
        self.c_mut().commit_prefix_import(id, tokens)
    }
}

const DRAFTS: usize = 3;

/// One request run alone on a contiguous cache: its tokens (the prompt, then greedy
/// tokens), every position's output and final hidden state, and the cache (the MTP
/// layer's rows included) for the draft proposals.
struct Reference {
    tokens: Vec<u32>,
    outs: Vec<TokenOut>,
    hidden: Vec<Vec<f32>>,
    kv: V4Contiguous,
}

impl Reference {
    fn new(model: &V4Model, prompt: &[u32], len: usize) -> Reference {
        let mut kv = V4Contiguous::new();
        let (mut outs, mut hidden) = model.run_hidden(&mut kv, 0, prompt).unwrap();
        let mut tokens = prompt.to_vec();
        while tokens.len() < len {
            let t = outs.last().unwrap().greedy;
            let p = tokens.len() as u32;
            tokens.push(t);
            let (o, h) = model.run_hidden(&mut kv, p, &[t]).unwrap();
            outs.extend(o);
            hidden.extend(h);
        }
        model.draft_write(&mut kv, 0, &tokens, &hidden).unwrap();
        Reference {
            tokens,
            outs,
            hidden,
            kv,
        }
    }

    /// The MTP layer's proposals once `tokens[last + 1]` is sampled after `last`.
    fn proposals(&self, model: &V4Model, last: usize) -> Vec<u32> {
        model
            .propose(
                &self.kv,
                last as u32,
                &self.hidden[last],
                self.tokens[last + 1],
                DRAFTS,
            )
            .unwrap()
    }
}

/// A request in flight.
struct Live {
    id: RequestId,
    reference: Reference,
    /// Tokens a prefill must cover before decoding (the prompt, or everything committed
    /// when it was preempted).
    prefill: usize,
    committed: usize,
    /// The token sampled after the last committed one, and the drafts after it.
    next: u32,
    drafts: Vec<u32>,
    /// Preempt (close, create again) once this many tokens are committed.
    preempt_at: Option<usize>,
}

#[derive(Default, Debug)]
struct Counts {
    positions_checked: u64,
    drafts_accepted: u64,
    drafts_rejected: u64,
    proposals_checked: u64,
    preemptions: u64,
    reused_tokens: u64,
    offloaded: u64,
    onboarded: u64,
    chunks_straddling_a_group: u64,
}

struct Engine {
    model: V4Model,
    m: Cache,
    pools: V4Pools,
    rng: SplitMix64,
    counts: Counts,
}

impl Engine {
    fn new(seed: u64) -> Engine {
        let model = V4Model::new(V4ModelConfig::tiny(seed)).unwrap();
        let plan = V4Plan::new(&model.config().spec().unwrap()).unwrap();
        let slots = WindowedSlots {
            blocks: TierSlots {
                gpu: vec![12],
                host: vec![40],
            },
            windows: vec![64, 600, 300],
        };
        let pools = V4Pools::new(&plan, &slots).unwrap();
        let m = Cache::new(plan, slots);
        Engine {
            model,
            m,
            pools,
            rng: SplitMix64(seed ^ 0x5eed),
            counts: Counts::default(),
        }
    }

    /// Runs the manager's copy plans on the pools.
    fn copies(&mut self) {
        let plans = self.m.take_copy_plans();
        for c in plans.iter().flat_map(|p| &p.copies) {
            let n = c.pairs.len() as u64;
            match (c.src_tier, c.dst_tier) {
                (Tier::Gpu, Tier::Host) => self.counts.offloaded += n,
                (Tier::Host, Tier::Gpu) => self.counts.onboarded += n,
                _ => {}
            }
        }
        self.pools.apply(&plans).unwrap();
        let f = self.m.issue_fence();
        self.m.complete_fences(f).unwrap();
    }

    /// Creates `id` for `tokens[..prefill]` (a hit resumes at a tail).
    fn create(&mut self, id: RequestId, tokens: &[u32]) -> usize {
        let prompt: Vec<TokenId> = tokens.iter().map(|&t| TokenId(t)).collect();
        let reused = self.m.create(id, &prompt);
        assert!(self.m.resume(id).unwrap(), "room to resume {id}");
        self.copies();
        self.counts.reused_tokens += reused;
        reused as usize
    }

    fn start(&mut self, id: u64, prompt: &[u32], len: usize, preempt_at: Option<usize>) -> Live {
        let reference = Reference::new(&self.model, prompt, len);
        let id = RequestId(id);
        let committed = self.create(id, prompt);
        Live {
            id,
            reference,
            prefill: prompt.len(),
            committed,
            next: 0,
            drafts: Vec::new(),
            preempt_at,
        }
    }

    fn check(&mut self, r: &Live, first: usize, outs: &[TokenOut]) {
        for (i, o) in outs.iter().enumerate() {
            assert_eq!(
                *o,
                r.reference.outs[first + i],
                "request {}, position {}: paged and unpaged differ",
                r.id,
                first + i
            );
        }
        self.counts.positions_checked += outs.len() as u64;
    }

    /// One step of `r`: a prefill chunk or an MTP decode step. Returns whether `r` is
    /// done (closed).
    fn step(&mut self, r: &mut Live) -> bool {
        let c = r.committed;
        let len = r.reference.tokens.len();
        if c == len {
            self.m.close(r.id).unwrap();
            self.copies();
            return true;
        }
        if r.preempt_at.is_some_and(|p| c >= p) && c >= r.prefill {
            // Preemption by recompute: close, create again with everything committed as
            // the prompt, and prefill from the hit.
            r.preempt_at = None;
            self.m.close(r.id).unwrap();
            self.copies();
            r.committed = self.create(r.id, &r.reference.tokens[..c]);
            r.prefill = c;
            self.counts.preemptions += 1;
            return false;
        }
        let tokens: Vec<u32> = if c < r.prefill {
            let n = (1 + self.rng.below(300) as usize).min(r.prefill - c);
            if (c / 4 != (c + n - 1) / 4) && (c % 128 + n > 128) {
                self.counts.chunks_straddling_a_group += 1;
            }
            r.reference.tokens[c..c + n].to_vec()
        } else {
            let mut t = vec![r.next];
            t.extend(&r.drafts);
            t.truncate(len - c);
            t
        };
        let n = tokens.len();
        assert!(
            self.m.resize(r.id, (c + n) as u64, c as u64).unwrap(),
            "room for request {} at {c}",
            r.id
        );
        self.copies();
        let mut kv = V4Paged::from_cache(&mut self.pools, self.m.c(), self.m.handle(r.id)).unwrap();
        let (outs, hidden) = self.model.run_hidden(&mut kv, c as u32, &tokens).unwrap();
        // Drafts accepted: each that the target's greedy token before it agrees with.
        let accepted = if c < r.prefill {
            n - 1
        } else {
            let a = (1..n)
                .take_while(|&i| tokens[i] == outs[i - 1].greedy)
                .count();
            self.counts.drafts_accepted += a as u64;
            self.counts.drafts_rejected += (n - 1 - a) as u64;
            a
        };
        let kept = &tokens[..=accepted];
        assert_eq!(kept, &r.reference.tokens[c..=c + accepted]);
        self.model
            .draft_write(&mut kv, c as u32, kept, &hidden[..=accepted])
            .unwrap();
        drop(kv);
        self.check(r, c, &outs[..=accepted]);
        let ids: Vec<TokenId> = kept.iter().map(|&t| TokenId(t)).collect();
        self.m.commit(r.id, &ids).unwrap();
        let done = c + accepted + 1;
        assert!(self.m.resize(r.id, done as u64, done as u64).unwrap());
        self.copies();
        self.m.check_invariants();
        r.committed = done;
        if done >= r.prefill && done < len {
            r.next = outs[accepted].greedy;
            let kv = V4Paged::from_cache(&mut self.pools, self.m.c(), self.m.handle(r.id)).unwrap();
            r.drafts = self
                .model
                .propose(&kv, (done - 1) as u32, &hidden[accepted], r.next, DRAFTS)
                .unwrap();
            assert_eq!(r.drafts, r.reference.proposals(&self.model, done - 1));
            self.counts.proposals_checked += 1;
        }
        false
    }

    /// Runs `live` round-robin to the end.
    fn run(&mut self, mut live: Vec<Live>) {
        while !live.is_empty() {
            let mut i = 0;
            while i < live.len() {
                if self.step(&mut live[i]) {
                    live.remove(i);
                } else {
                    i += 1;
                }
            }
        }
    }
}

fn random_tokens(rng: &mut SplitMix64, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(256) as u32).collect()
}

/// Three phases over one manager (12 GPU blocks, 40 host blocks):
/// 1. A (700-token prompt, 60 decoded) beside D (400, 700 decoded, preempted at 800);
/// 2. B (A's first 600 tokens and 150 of its own) beside C (a fresh 1,200 prompt): A's
///    and D's cached blocks are offloaded;
/// 3. A's whole conversation and 40 more tokens as the next turn, D's again: served
///    from the host tier.
#[test]
fn v4_paged_equals_unpaged_with_reuse_chunks_mtp_preemption_and_offload() {
    let mut e = Engine::new(7);
    let mut rng = SplitMix64(11);
    let a = random_tokens(&mut rng, 700);
    let d = random_tokens(&mut rng, 400);
    let la = e.start(1, &a, 760, None);
    let ld = e.start(4, &d, 1_100, Some(800));
    let (a_conv, d_conv) = (la.reference.tokens.clone(), ld.reference.tokens.clone());
    e.run(vec![la, ld]);

    let mut b = a[..600].to_vec();
    b.extend(random_tokens(&mut rng, 150));
    let c = random_tokens(&mut rng, 1_200);
    let lb = e.start(2, &b, 780, None);
    let lc = e.start(3, &c, 1_220, None);
    e.run(vec![lb, lc]);

    let mut a2 = a_conv.clone();
    a2.extend(random_tokens(&mut rng, 40));
    let la2 = e.start(5, &a2, 820, None);
    let ld2 = e.start(6, &d_conv, 1_110, None);
    e.run(vec![la2, ld2]);

    let k = &e.counts;
    eprintln!("{k:?}\n{:?}", e.m.stats());
    // Every mechanism the test names was exercised.
    assert!(k.reused_tokens >= 512 + 512 + 768, "prefix hits: {k:?}");
    assert!(k.drafts_accepted > 0 && k.drafts_rejected > 0, "{k:?}");
    assert_eq!(k.preemptions, 1);
    assert!(
        k.offloaded > 0 && k.onboarded > 0,
        "offload and onboarding: {k:?}"
    );
    assert!(k.chunks_straddling_a_group > 5, "{k:?}");
    assert!(k.proposals_checked > 100, "{k:?}");
}

/// The comparison reads the pools: a flipped bit in a cached compressed entry that a
/// later hit reads changes that request's outputs, and a window write behind the
/// committed length is refused.
#[test]
fn a_corrupted_pool_is_caught_and_shared_rows_are_not_written() {
    let mut e = Engine::new(3);
    let mut rng = SplitMix64(5);
    let a = random_tokens(&mut rng, 600);
    let la = e.start(1, &a, 620, None);
    e.run(vec![la]);
    // The same prompt again hits its first two blocks (512 tokens).
    let r = RequestId(2);
    assert_eq!(e.create(r, &a), 512);
    let reference = Reference::new(&e.model, &a, 600);
    // A window write at a reused (committed) position is refused.
    {
        let mut kv = V4Paged::from_cache(&mut e.pools, e.m.c(), e.m.handle(r)).unwrap();
        let row = kv.window(0, 500).unwrap();
        let err = kv.write_window(0, 500, &row).unwrap_err().to_string();
        assert!(err.contains("not writable"), "{err}");
    }
    // Flip one bit of entry 0 of the ratio-128 layer (layer 2) in the pool.
    {
        let mut kv = V4Paged::from_cache(&mut e.pools, e.m.c(), e.m.handle(r)).unwrap();
        let mut row = kv.entry(2, 0).unwrap();
        row.data[3] ^= 0x10;
        // Written through the pools' bytes, as a fault would: not through the store,
        // which refuses committed entries.
        assert!(kv.write_entry(2, 0, &row).is_err());
        drop(kv);
        let b = *e
            .pools
            .plan()
            .buffer(LayerId(2), Role::CompressedKey)
            .unwrap();
        let V4PageFormat::Model1 { page, .. } = b.format else {
            panic!("a MODEL1 buffer")
        };
        let blocks = e.m.block_slots(r).unwrap();
        let at = entry_row(&blocks, b.converter, 128, 0).unwrap() as u64;
        let off = page.data_offset(at / 2, (at % 2) as u32) as usize + 3;
        e.pools
            .pool_mut(b.life_cycle.index(), Tier::Gpu, b.pool.index())[off] ^= 0x10;
    }
    assert!(e.m.resize(r, 600, 512).unwrap());
    e.copies();
    let mut kv = V4Paged::from_cache(&mut e.pools, e.m.c(), e.m.handle(r)).unwrap();
    let outs = e.model.run(&mut kv, 512, &a[512..]).unwrap();
    assert_ne!(
        outs[..],
        reference.outs[512..600],
        "a corrupted compressed entry must change the outputs"
    );
}

/// Moves the prefix of `tokens` that `pre` can export into `dec` (blocks and, at their
/// last boundary, the windows' tail), copying the bytes unless told not to. Returns the
/// boundary.
fn transfer(pre: &mut Engine, dec: &mut Engine, tokens: &[u32], blocks: bool, tail: bool) -> u64 {
    let toks: Vec<TokenId> = tokens.iter().map(|&t| TokenId(t)).collect();
    let (x, y) = (RequestId(900), RequestId(901));
    let out = pre
        .m
        .export(x, ReuseScope::SHARED, &toks)
        .unwrap()
        .expect("the prefill engine keeps a tail");
    let e = out.boundary;
    let inp = dec
        .m
        .begin_import(y, ReuseScope::SHARED, &toks[..e as usize])
        .unwrap()
        .expect("room to import");
    assert_eq!((inp.skipped, inp.blocks.len()), (0, out.blocks.len()));
    let lcs = pre.m.plan().life_cycles().to_vec();
    let full = lcs
        .iter()
        .position(|l| l.retention == Retention::Full)
        .unwrap();
    if blocks {
        for (a, b) in out.blocks.iter().zip(&inp.blocks) {
            assert_eq!(a.key, b.key, "the same chained keys on both engines");
            let (pa, pb) = (a.pages[0], b.pages[0]);
            assert_eq!(pb.tier, Tier::Gpu);
            dec.pools
                .copy_slots_from(&pre.pools, pa.tier, full, &[(pa.slot, pb.slot)])
                .unwrap();
        }
    }
    let windows: Vec<usize> = (0..lcs.len()).filter(|&i| i != full).collect();
    assert_eq!(
        inp.tails.len(),
        windows.len(),
        "fresh tail pages on the decode engine"
    );
    for ((lc, (sa, a)), (sb, b)) in windows.iter().zip(&out.tails).zip(&inp.tails) {
        assert_eq!((sa, a.len()), (sb, b.len()), "the same tail span");
        if tail {
            let pairs: Vec<_> = a.iter().copied().zip(b.iter().copied()).collect();
            dec.pools
                .copy_slots_from(&pre.pools, Tier::Gpu, *lc, &pairs)
                .unwrap();
        }
    }
    dec.m.commit_import(y, &toks[..e as usize]).unwrap();
    pre.m.close_export(x).unwrap();
    pre.m.check_invariants();
    dec.m.check_invariants();
    e
}

/// P/D by role: a prefill engine runs a 700-token prompt; its whole blocks (compressed
/// KV and indexer keys) and the windows' tail at their last boundary (512) move to a
/// decode engine, which recomputes positions 512–699 and decodes 60 tokens with MTP:
/// every output equals the contiguous run's. Without the tail's bytes, or without the
/// blocks', the recomputed positions differ (the transfer is what they read).
#[test]
fn pd_transfer_moves_blocks_and_tail_and_decoding_stays_exact() {
    let mut rng = SplitMix64(21);
    let prompt = random_tokens(&mut rng, 700);
    let mut pre = Engine::new(9);
    let lp = pre.start(1, &prompt, 701, None);
    pre.run(vec![lp]);
    let mut dec = Engine::new(9);
    assert_eq!(transfer(&mut pre, &mut dec, &prompt, true, true), 512);
    let ld = dec.start(2, &prompt, 760, None);
    dec.run(vec![ld]);
    assert_eq!(
        dec.counts.reused_tokens, 512,
        "the decode engine resumed at the tail"
    );
    assert!(dec.counts.positions_checked >= 188 + 59);
    // Without the bytes of either role, the first recomputed position already differs.
    let reference = Reference::new(&pre.model, &prompt, 700);
    for (blocks, tail) in [(true, false), (false, true)] {
        let mut dec = Engine::new(9);
        transfer(&mut pre, &mut dec, &prompt, blocks, tail);
        let r = RequestId(3);
        assert_eq!(dec.create(r, &prompt), 512);
        assert!(dec.m.resize(r, 700, 512).unwrap());
        dec.copies();
        let mut kv = V4Paged::from_cache(&mut dec.pools, dec.m.c(), dec.m.handle(r)).unwrap();
        let outs = dec.model.run(&mut kv, 512, &prompt[512..]).unwrap();
        let differ = outs
            .iter()
            .zip(&reference.outs[512..])
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            differ > 0,
            "blocks {blocks}, tail {tail}: the outputs must depend on them"
        );
    }
}

/// Regression (review): a device built with fewer window slots than the manager hands
/// out fails the step with a typed error naming the cause, not an out-of-bounds panic.
#[test]
fn a_device_with_fewer_slots_than_the_manager_fails_typed() {
    use dsa_kv_core::core::scheduler::{Scheduler, SchedulerLimits, SubmitRequest};
    use dsa_kv_device::windowed::WindowedHostDevice;
    use dsa_kv_device::DeviceBackend;
    use dsa_kv_model::v4::{V4ModelForward, V4Outputs};
    use std::sync::{Arc, Mutex};
    let model = Arc::new(V4Model::new(V4ModelConfig::tiny(7)).unwrap());
    let plan = V4Plan::new(&model.config().spec().unwrap()).unwrap();
    let slots = WindowedSlots {
        blocks: TierSlots {
            gpu: vec![8],
            host: vec![],
        },
        windows: vec![16, 200, 100],
    };
    let opts = ManagerOptions {
        enable_partial_reuse: false,
        ..ManagerOptions::default()
    };
    let cache = ModelCache::windowed(&plan, slots.clone(), opts, 16).unwrap();
    let limits = SchedulerLimits {
        max_num_sequences: 4,
        max_num_tokens: 512,
        max_prefill_chunk: 256,
        max_seq_len: 2048,
        draft_tokens: 0,
        livelock_steps: 8,
        max_context_kv_tokens: 1 << 20,
        transfer_lease: std::time::Duration::from_secs(60),
    };
    let mut s = Scheduler::new(cache, None, limits);
    let small = WindowedSlots {
        windows: vec![1, 200, 100],
        ..slots
    };
    let outputs = Arc::new(Mutex::new(V4Outputs::default()));
    let forward = Box::new(V4ModelForward::new(model, outputs));
    let mut dev = WindowedHostDevice::new(0, &plan, &small, forward).unwrap();
    let prompt = (0..200).map(TokenId).collect();
    s.submit(SubmitRequest::new(RequestId(1), prompt, 2))
        .unwrap();
    let p = s.schedule(&HashMap::new()).unwrap();
    let e = dev.execute_step(&p).unwrap_err().to_string();
    assert!(e.contains("fewer slots than the manager"), "{e}");
}
