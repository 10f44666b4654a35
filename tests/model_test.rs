//! Seeded randomized model test of the core manager: ≥ 100,000 random operations
//! (create with reuse, resume, suspend, resize up and down, commit, stop, close, fence
//! completion, probes) under constant eviction pressure, against a simple reference
//! model. After every operation: the manager's invariants, every sequence's lengths and
//! status against the reference, reuse bounded by what was really committed, and the
//! KV bytes of a random active sequence read back through its page table.
//!
//! Replay one case with `DSA_KV_MODEL_SEED=<seed>` (and `DSA_KV_MODEL_OPS=<n>`).

mod common;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use common::*;
use dsa_kv::core::{
    KvCacheManager, KvError, ManagerOptions, ReuseScope, SeqHandle, SeqOptions, SeqStatus,
    TierSlots,
};
use dsa_kv::ids::{LayerId, RequestId, TokenId};
use dsa_kv::layout::{BufferSpec, LayerSpec, LifeCycleKey, PoolPlan, Role, RowLayout};
use dsa_kv::storage::HostStorage;

const T: u32 = 4;

struct Config {
    name: &'static str,
    specs: Vec<LayerSpec>,
    gpu: Vec<u32>,
    host: Vec<u32>,
    opts: ManagerOptions,
}

fn layer(l: u32, lc: u32, indexer: bool) -> LayerSpec {
    let mut buffers = vec![BufferSpec::new(
        Role::Key,
        RowLayout::Interleaved { row_bytes: 6 },
    )];
    if indexer {
        buffers.push(BufferSpec::new(
            Role::IndexKey,
            RowLayout::ValuesThenScales {
                data_bytes: 4,
                scale_bytes: 2,
            },
        ));
    }
    LayerSpec {
        layer: LayerId(l),
        life_cycle: LifeCycleKey(lc),
        buffers,
    }
}

fn configs() -> Vec<Config> {
    vec![
        Config {
            name: "one life cycle, host tier",
            specs: vec![layer(0, 0, true), layer(1, 0, false), layer(2, 0, true)],
            gpu: vec![14],
            host: vec![8],
            opts: ManagerOptions {
                max_util_for_resume: 1.0,
                ..Default::default()
            },
        },
        Config {
            name: "two pool groups, no host tier",
            specs: vec![layer(0, 0, true), layer(1, 1, false)],
            gpu: vec![12, 16],
            host: vec![],
            opts: ManagerOptions::default(),
        },
        Config {
            name: "two pool groups, host tier",
            specs: vec![layer(0, 0, false), layer(1, 1, true), layer(2, 1, true)],
            gpu: vec![12, 10],
            host: vec![6, 5],
            opts: ManagerOptions::default(),
        },
        Config {
            name: "two life cycles sharing a group, whole-block reuse",
            specs: vec![layer(0, 0, true), layer(1, 1, true)],
            gpu: vec![24],
            host: vec![10],
            opts: ManagerOptions {
                enable_partial_reuse: false,
                ..Default::default()
            },
        },
        Config {
            name: "reuse disabled",
            specs: vec![layer(0, 0, true)],
            gpu: vec![10],
            host: vec![4],
            opts: ManagerOptions {
                enable_block_reuse: false,
                max_util_for_resume: 0.9,
                ..Default::default()
            },
        },
    ]
}

/// Token-level trie of every prefix ever committed, per scope: an upper bound on reuse.
#[derive(Default)]
struct CommittedTrie {
    next: HashMap<(u32, u32), u32>,
    nodes: u32,
}

impl CommittedTrie {
    fn new(roots: u32) -> Self {
        CommittedTrie {
            next: HashMap::new(),
            nodes: roots,
        }
    }

    fn insert(&mut self, root: u32, tokens: &[TokenId]) {
        let mut cur = root;
        for t in tokens {
            cur = match self.next.get(&(cur, t.get())) {
                Some(&n) => n,
                None => {
                    self.nodes += 1;
                    self.next.insert((cur, t.get()), self.nodes);
                    self.nodes
                }
            };
        }
    }

    fn lcp(&self, root: u32, tokens: &[TokenId]) -> usize {
        let mut cur = root;
        for (i, t) in tokens.iter().enumerate() {
            match self.next.get(&(cur, t.get())) {
                Some(&n) => cur = n,
                None => return i,
            }
        }
        tokens.len()
    }
}

struct RefSeq {
    handle: SeqHandle,
    scope: usize,
    stream: Vec<TokenId>,
    hashes: Vec<u64>,
    committed: u64,
    history: u64,
    capacity: u64,
    status: SeqStatus,
    stopped: bool,
}

const SCOPES: [ReuseScope; 2] = [
    ReuseScope::SHARED,
    ReuseScope {
        lora_id: None,
        salt: Some(0x5a17),
    },
];

fn scope_seed(scope: usize) -> u64 {
    0xD5A0_0000 + scope as u64
}

/// Where the workload's choices come from: a seeded generator, or a tape of choices that
/// proptest generates and shrinks (an exhausted tape answers 0).
enum Dice {
    Seeded(Rng),
    Tape(Vec<u64>, usize),
}

impl Dice {
    fn next_u64(&mut self) -> u64 {
        match self {
            Dice::Seeded(r) => r.next_u64(),
            Dice::Tape(t, i) => {
                let v = t.get(*i).copied().unwrap_or(0);
                *i += 1;
                v
            }
        }
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

struct World {
    m: KvCacheManager,
    st: HostStorage,
    rng: Dice,
    seqs: Vec<RefSeq>,
    trie: CommittedTrie,
    system_prompts: Vec<Vec<TokenId>>,
    next_id: u64,
    max_tokens: u64,
    reuse: bool,
    log: Vec<String>,
}

impl World {
    fn token(&mut self) -> TokenId {
        TokenId(self.rng.below(5) as u32)
    }

    fn extend_stream(&mut self, i: usize, upto: u64) {
        while (self.seqs[i].stream.len() as u64) < upto {
            let t = self.token();
            let s = &mut self.seqs[i];
            let h = extend_prefix_hash(*s.hashes.last().unwrap_or(&scope_seed(s.scope)), t);
            s.stream.push(t);
            s.hashes.push(h);
        }
    }

    fn pick(&mut self, status: Option<SeqStatus>) -> Option<usize> {
        let cands: Vec<usize> = (0..self.seqs.len())
            .filter(|&i| status.is_none_or(|s| self.seqs[i].status == s))
            .collect();
        if cands.is_empty() {
            None
        } else {
            Some(cands[self.rng.below(cands.len() as u64) as usize])
        }
    }

    fn verify(&self, i: usize) {
        let s = &self.seqs[i];
        if let Err((pos, layer, role)) = verify_positions(
            &self.m,
            &self.st,
            &s.handle,
            &s.hashes,
            0..s.history as usize,
        ) {
            panic!(
                "KV mismatch for request {} at position {pos} (layer {layer}, {role}); history {}",
                s.handle.id(),
                s.history
            );
        }
    }

    fn check(&self) {
        self.m.check_invariants();
        assert_eq!(self.m.num_sequences(), self.seqs.len());
        for s in &self.seqs {
            let info = self.m.sequence(s.handle.id()).unwrap();
            assert_eq!(
                (info.status, info.committed, info.history, info.capacity),
                (s.status, s.committed, s.history, s.capacity),
                "request {} diverged from the reference",
                s.handle.id()
            );
            assert_eq!(
                self.m.committed_tokens(&s.handle).unwrap(),
                &s.stream[..s.committed as usize]
            );
        }
    }

    fn op(&mut self) {
        let dice = self.rng.below(100);
        match dice {
            0..=11 if self.seqs.len() < 10 => self.create(),
            12..=21 => self.resume(),
            22..=27 => {
                if let Some(i) = self.pick(Some(SeqStatus::Active)) {
                    self.log
                        .push(format!("suspend {}", self.seqs[i].handle.id()));
                    self.m.suspend(&self.seqs[i].handle).unwrap();
                    self.seqs[i].status = SeqStatus::Suspended;
                }
            }
            28..=49 => self.step(),
            50..=64 => self.accept(),
            65..=70 => self.rollback(),
            71..=77 => self.close(),
            78..=80 => {
                if let Some(i) = self.pick(None) {
                    self.log.push(format!("stop {}", self.seqs[i].handle.id()));
                    self.m.stop_committing(&self.seqs[i].handle).unwrap();
                    let s = &mut self.seqs[i];
                    if !s.stopped {
                        s.stopped = true;
                        let root = s.scope as u32;
                        let c = s.committed as usize;
                        self.trie.insert(root, &self.seqs[i].stream[..c]);
                    }
                }
            }
            81..=85 => {
                self.log.push("fence".into());
                if self.rng.chance(50) {
                    self.m.issue_fence();
                } else {
                    let f = self.m.issued_fence();
                    self.m.complete_fences(f).unwrap();
                }
            }
            86..=90 => self.probe(),
            _ => {
                if let Some(i) = self.pick(Some(SeqStatus::Active)) {
                    self.verify(i);
                }
            }
        }
    }

    fn new_prompt(&mut self, scope: usize) -> Vec<TokenId> {
        // Sometimes the same tokens another live request is still producing: both will
        // commit the same blocks (rebasing, donation).
        let live: Vec<usize> = (0..self.seqs.len())
            .filter(|&i| self.seqs[i].scope == scope)
            .collect();
        if !live.is_empty() && self.rng.chance(25) {
            let s = &self.seqs[live[self.rng.below(live.len() as u64) as usize]];
            let mut p = s.stream.clone();
            let t = self.token();
            p.push(t);
            return p;
        }
        let sp = self.rng.below(self.system_prompts.len() as u64) as usize;
        let mut p = if self.rng.chance(80) {
            let sys = &self.system_prompts[sp];
            let cut = self.rng.below(sys.len() as u64 + 1) as usize;
            sys[..cut].to_vec()
        } else {
            Vec::new()
        };
        let extra = 1 + self.rng.below(14);
        for _ in 0..extra {
            let t = self.token();
            p.push(t);
        }
        // Keep scopes apart in token space too, so a cross-tenant hit would be visible
        // even if hashing ignored the scope.
        if scope == 1 && self.rng.chance(50) {
            p.reverse();
        }
        p
    }

    fn create(&mut self) {
        let scope = self.rng.below(2) as usize;
        let prompt = self.new_prompt(scope);
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let priority = [10u8, 35, 60][self.rng.below(3) as usize];
        self.log.push(format!(
            "create {id} scope {scope} prompt {} prio {priority}",
            prompt.len()
        ));
        let probe = self.m.probe_reuse(SCOPES[scope], &prompt).unwrap();
        let c = self
            .m
            .create(id, SCOPES[scope], &prompt, SeqOptions { priority })
            .unwrap();
        let reused = c.reused_tokens;
        assert_eq!(reused, probe, "probe_reuse and create disagree");
        let lookup = &prompt[..prompt.len().saturating_sub(1)];
        let bound = self.trie.lcp(scope as u32, lookup) as u64;
        assert!(
            reused <= bound,
            "reused {reused} tokens but only {bound} were ever committed"
        );
        if !self.reuse {
            assert_eq!(reused, 0);
        }
        let hashes = prefix_hashes(scope_seed(scope), &prompt);
        self.seqs.push(RefSeq {
            handle: c.handle,
            scope,
            stream: prompt,
            hashes,
            committed: reused,
            history: reused,
            capacity: reused,
            status: SeqStatus::Suspended,
            stopped: false,
        });
        if self.rng.chance(70) {
            let i = self.seqs.len() - 1;
            self.resume_idx(i);
        }
    }

    fn resume(&mut self) {
        if let Some(i) = self.pick(Some(SeqStatus::Suspended)) {
            self.resume_idx(i);
        }
    }

    fn resume_idx(&mut self, i: usize) {
        self.log
            .push(format!("resume {}", self.seqs[i].handle.id()));
        if self.m.resume(&self.seqs[i].handle).unwrap() {
            self.seqs[i].status = SeqStatus::Active;
            run_copy_plans(&mut self.m, &mut self.st);
            self.verify(i);
        } else {
            assert!(
                self.m.take_copy_plans().is_empty(),
                "a refused resume planned copies"
            );
        }
    }

    /// A scheduler step: capacity grows to history + inputs (prefill chunk or decode with
    /// draft tokens); the new positions' KV is written.
    fn step(&mut self) {
        let Some(i) = self.pick(Some(SeqStatus::Active)) else {
            return;
        };
        let s = &self.seqs[i];
        let cap = (s.history + 1 + self.rng.below(7)).min(self.max_tokens);
        if cap < s.history {
            return;
        }
        let (history, id) = (s.history, s.handle.id());
        self.log.push(format!("step {id} capacity {cap}"));
        match self.m.resize(&self.seqs[i].handle, cap, history) {
            Ok(true) => {
                run_copy_plans(&mut self.m, &mut self.st);
                self.extend_stream(i, cap);
                let s = &mut self.seqs[i];
                s.capacity = cap;
                let s = &self.seqs[i];
                write_positions(
                    &self.m,
                    &mut self.st,
                    &s.handle,
                    &s.hashes,
                    history as usize..cap as usize,
                );
            }
            Ok(false) => assert!(
                self.m.take_copy_plans().is_empty(),
                "a failed resize planned copies"
            ),
            Err(KvError::SequenceTooLong { .. }) => {}
            Err(e) => panic!("resize: {e}"),
        }
    }

    /// Accepts some of the step's tokens: history advances and (usually) they are
    /// committed.
    fn accept(&mut self) {
        let Some(i) = self.pick(Some(SeqStatus::Active)) else {
            return;
        };
        let s = &self.seqs[i];
        let k = self.rng.below(s.capacity - s.history + 1);
        let history = s.history + k;
        let capacity = s.capacity;
        self.log
            .push(format!("accept {} history {history}", s.handle.id()));
        assert!(self
            .m
            .resize(&self.seqs[i].handle, capacity, history)
            .unwrap());
        self.seqs[i].history = history;
        if self.rng.chance(80) && !self.seqs[i].stopped {
            let s = &self.seqs[i];
            let toks = s.stream[s.committed as usize..history as usize].to_vec();
            self.m.commit(&s.handle, &toks).unwrap();
            let s = &mut self.seqs[i];
            s.committed = history;
            let root = s.scope as u32;
            self.trie
                .insert(root, &self.seqs[i].stream[..history as usize]);
        }
    }

    /// Rejected draft tokens: capacity shrinks back towards history.
    fn rollback(&mut self) {
        let Some(i) = self.pick(Some(SeqStatus::Active)) else {
            return;
        };
        let s = &self.seqs[i];
        let cap = s.history + self.rng.below(s.capacity - s.history + 1);
        self.log
            .push(format!("rollback {} capacity {cap}", s.handle.id()));
        assert!(self.m.resize(&s.handle, cap, s.history).unwrap());
        self.seqs[i].capacity = cap;
        // Rolled-back tokens are redrawn: a rejected draft never reappears as committed.
        let s = &mut self.seqs[i];
        s.stream.truncate(cap as usize);
        s.hashes.truncate(cap as usize);
    }

    fn close(&mut self) {
        let Some(i) = self.pick(None) else { return };
        let mut s = self.seqs.swap_remove(i);
        self.log.push(format!("close {}", s.handle.id()));
        self.m.close(&mut s.handle).unwrap();
        self.m.close(&mut s.handle).unwrap();
        assert!(self.m.sequence(s.handle.id()).is_err());
        if !s.stopped {
            self.trie
                .insert(s.scope as u32, &s.stream[..s.committed as usize]);
        }
    }

    fn probe(&mut self) {
        let scope = self.rng.below(2) as usize;
        let p = self.new_prompt(scope);
        let got = self.m.probe_reuse(SCOPES[scope], &p).unwrap();
        let bound = self.trie.lcp(scope as u32, &p[..p.len() - 1]) as u64;
        assert!(got <= bound, "probe {got} > committed bound {bound}");
    }
}

fn run(seed: u64, cfg: &Config, ops: usize) -> usize {
    run_with(Dice::Seeded(Rng(seed)), seed, cfg, ops, true, 0)
}

/// Runs `ops` operations from `rng`; `expect_traffic` asserts the workload exercised
/// reuse, eviction and tier traffic (long seeded runs only).
/// `faults`: percent of GPU-room requests refused by injection (storage failures).
fn run_with(
    mut rng: Dice,
    seed: u64,
    cfg: &Config,
    ops: usize,
    expect_traffic: bool,
    faults: u8,
) -> usize {
    let plan = PoolPlan::v2(T, cfg.specs.clone()).unwrap();
    let m = KvCacheManager::new(
        plan.clone(),
        TierSlots {
            gpu: cfg.gpu.clone(),
            host: cfg.host.clone(),
        },
        cfg.opts.clone(),
    )
    .unwrap();
    let mut m = m;
    m.inject_room_failures(seed ^ 0xfa17, faults);
    let st = HostStorage::new(&plan, &cfg.gpu, &cfg.host).unwrap();
    let system_prompts = (0..3)
        .map(|_| {
            let n = 4 + rng.below(16);
            (0..n).map(|_| TokenId(rng.below(5) as u32)).collect()
        })
        .collect();
    let max_tokens = u64::from(*cfg.gpu.iter().min().unwrap()) / 2 * u64::from(T);
    let mut w = World {
        m,
        st,
        rng,
        seqs: Vec::new(),
        trie: CommittedTrie::new(SCOPES.len() as u32),
        system_prompts,
        next_id: 1,
        max_tokens,
        reuse: cfg.opts.enable_block_reuse,
        log: Vec::new(),
    };
    let result = catch_unwind(AssertUnwindSafe(|| {
        for n in 0..ops {
            w.op();
            w.check();
            if w.log.len() > 64 {
                w.log.drain(..32);
            }
            let _ = n;
        }
    }));
    if let Err(e) = result {
        eprintln!(
            "\nmodel test FAILED: seed {seed} ({:#x}), config {:?}\nreplay: DSA_KV_MODEL_SEED={seed} cargo test --release --test model_test\nlast operations:\n  {}",
            seed,
            cfg.name,
            w.log.join("\n  ")
        );
        std::panic::resume_unwind(e);
    }
    if faults > 0 {
        assert!(w.m.injected_room_failures() > 0, "no fault was injected");
        eprintln!(
            "seed {seed} {:?}: {} injected storage refusals, all rolled back",
            cfg.name,
            w.m.injected_room_failures()
        );
        return ops;
    }
    let stats = w.m.stats();
    eprintln!(
        "seed {seed} {:?}: {ops} ops, reused {} tokens, partial copies {}, rebased {}, offloaded {}, onboarded {}, dropped {}, resize failures {}, resume refusals {}",
        cfg.name,
        stats.reused_tokens,
        stats.partial_copies,
        stats.rebased_blocks,
        stats.offloaded_pages,
        stats.onboarded_pages,
        stats.dropped_pages,
        stats.resize_failures,
        stats.resume_refusals
    );
    if !expect_traffic {
        return ops;
    }
    if cfg.opts.enable_block_reuse {
        assert!(
            stats.reused_tokens > 0,
            "the workload never reused a prefix"
        );
        assert!(stats.dropped_pages > 0, "the workload never evicted");
    }
    if !cfg.host.is_empty() {
        assert!(
            stats.offloaded_pages > 0 && stats.onboarded_pages > 0,
            "no tier traffic"
        );
    }
    ops
}

#[test]
fn randomized_against_reference_model() {
    let ops: usize = std::env::var("DSA_KV_MODEL_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6_400);
    let seeds: Vec<u64> = match std::env::var("DSA_KV_MODEL_SEED") {
        Ok(s) => vec![s.parse().expect("DSA_KV_MODEL_SEED must be an integer")],
        Err(_) => vec![1, 2, 3, 4],
    };
    let cfgs = configs();
    let mut total = 0;
    for seed in &seeds {
        for cfg in &cfgs {
            total += run(*seed, cfg, ops);
        }
    }
    if seeds.len() > 1 {
        assert!(total >= 100_000, "ran {total} operations");
    }
}

#[test]
fn randomized_with_injected_storage_failures() {
    for seed in [11, 12] {
        for cfg in &configs() {
            run_with(Dice::Seeded(Rng(seed)), seed, cfg, 3_200, false, 20);
        }
    }
}

mod properties {
    //! The same reference model driven by proptest: the workload's choices are a tape of
    //! integers that proptest generates and, on failure, shrinks to a minimal sequence of
    //! operations.
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 48,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn core_matches_the_reference_model(
            cfg in 0..5usize,
            tape in proptest::collection::vec(any::<u64>(), 0..1200),
        ) {
            let cfgs = configs();
            let ops = tape.len() / 4 + 1;
            run_with(Dice::Tape(tape, 0), 0, &cfgs[cfg], ops, false, 0);
        }
    }
}
