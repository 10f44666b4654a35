//! The verifier can fail. A deliberately wrong page-table entry on the device
//! (`DeviceFault::Misdirect`) makes one request read one of its blocks from another
//! page: any wrong slot, a page holding the same tokens after another prefix, a page
//! holding the same tokens in another tenant's scope, or a slot past the pool. Every
//! such request must finish with mismatches at exactly the misdirected block's
//! positions, on every layer, and a request without the fault with none.
//!
//! The same drill with a prefix-blind source (KV from token and position only, as the
//! synthetic source was before) shows what the prefix dependence buys: there the
//! same-token pages of another prefix or tenant pass.
//!
//! The GPU variants (ignored without a device) run the drills on the CUDA backend.
mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use half::bf16;

use dsa_kv::actors::{DeviceFault, FinishedReport, KvCacheBuilder, KvCacheHandle, Misdirect};
use dsa_kv::config::EngineConfig;
use dsa_kv::core::scheduler::{PlannedRequest, SubmitRequest};
use dsa_kv::core::ReuseScope;
use dsa_kv::device::{BackendFactory, KvPosition, KvSource, SyntheticKv, Verification};
use dsa_kv::ids::{LayerId, RequestId, TokenId};
use dsa_kv::rng::SplitMix64;

const T: usize = 64;
const LAYERS: u32 = 3;

/// KV from (token, position, layer) only: blind to the prefix and the scope.
struct PrefixBlind(SyntheticKv);

impl KvSource for PrefixBlind {
    fn indexer_key(&self, at: KvPosition, layer: LayerId, out: &mut [bf16]) {
        let blind = KvPosition {
            prefix: dsa_kv::core::PrefixHash(u64::from(at.token.get())),
            ..at
        };
        self.0.indexer_key(blind, layer, out);
    }
    fn mla_row(&self, at: KvPosition, layer: LayerId, out: &mut [bf16]) {
        let blind = KvPosition {
            prefix: dsa_kv::core::PrefixHash(u64::from(at.token.get())),
            ..at
        };
        self.0.mla_row(blind, layer, out);
    }
}

async fn start(source: Arc<dyn KvSource>, backend: Option<BackendFactory>) -> KvCacheHandle {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(LAYERS);
    c.kv_cache.max_tokens = Some(16_384);
    c.scheduler.max_num_sequences = 8;
    c.scheduler.max_seq_len = 1024;
    let mut b = KvCacheBuilder::new()
        .config(c)
        .kv_source(source)
        .verification(Verification::All);
    if let Some(f) = backend {
        b = b.backend(f);
    }
    b.start().await.expect("start")
}

fn toks(base: u32, n: usize) -> Vec<TokenId> {
    (0..n as u32).map(|i| TokenId(base + i)).collect()
}

fn submit(id: u64, scope: ReuseScope, prompt: Vec<TokenId>, max_new: u32) -> SubmitRequest {
    SubmitRequest {
        id: RequestId(id),
        scope,
        prompt,
        max_new_tokens: max_new,
        priority: 35,
    }
}

/// Steps until every request in `ids` finished; `inject` is applied once, right after
/// the first step in which its request produced a token (its prompt is in the cache),
/// and lifted at the end.
async fn run(
    kv: &KvCacheHandle,
    ids: &[RequestId],
    inject: Option<(usize, Misdirect)>,
) -> HashMap<RequestId, FinishedReport> {
    let mut done = HashMap::new();
    let mut injected = false;
    for _ in 0..10_000 {
        let report = kv.step(HashMap::new()).await.expect("step");
        let next = |r: &PlannedRequest| TokenId(5000 + r.num_cached);
        let commit = kv.commit(report.outcomes_from(next)).await.expect("commit");
        for f in commit.finished {
            done.insert(f.finished.id, f);
        }
        if let Some((dev, m)) = inject.filter(|_| !injected) {
            if report
                .scheduled
                .iter()
                .any(|r| r.id == m.request && r.produces_token)
            {
                injected = true;
                kv.inject_fault(dev, DeviceFault::Misdirect(m))
                    .await
                    .expect("inject");
            }
        }
        if ids.iter().all(|id| done.contains_key(id)) {
            kv.inject_fault(0, DeviceFault::NoMisdirect)
                .await
                .expect("heal");
            return done;
        }
    }
    panic!("requests {ids:?} did not finish");
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Mutation {
    /// A slot holding other tokens.
    WrongSlot,
    /// The same tokens, after another prefix.
    OtherPrefix,
    /// The same tokens and prefix, in another tenant's scope.
    OtherTenant,
    /// A slot past the pool for an early block (read back only: the block is not written
    /// again).
    PastThePool,
}

const MUTATIONS: [Mutation; 4] = [
    Mutation::WrongSlot,
    Mutation::OtherPrefix,
    Mutation::OtherTenant,
    Mutation::PastThePool,
];

/// Result of one drill: per mutation, how many rounds were caught (mismatches at exactly
/// the misdirected block) out of how many.
async fn drill(
    source: Arc<dyn KvSource>,
    backend: Option<BackendFactory>,
    rounds: u64,
) -> HashMap<Mutation, (u64, u64)> {
    let kv = start(source, backend).await;
    let tenant = ReuseScope {
        lora_id: None,
        salt: Some(ReuseScope::salt_from_str("tenant-b")),
    };
    // A's prompt: X (block 0), Y (block 1), then a tail. B: Z, Y (same tokens as A's block
    // 1 after another prefix). C: X, Y in another tenant's scope.
    let (x, y, z) = (toks(100, T), toks(300, T), toks(700, T));
    let b_prompt: Vec<TokenId> = [z.clone(), y.clone(), toks(900, 10)].concat();
    let c_prompt: Vec<TokenId> = [x.clone(), y.clone(), toks(950, 10)].concat();
    kv.submit(submit(1, ReuseScope::SHARED, b_prompt, 2))
        .await
        .unwrap();
    kv.submit(submit(2, tenant, c_prompt, 2)).await.unwrap();
    let first = run(&kv, &[RequestId(1), RequestId(2)], None).await;
    for f in first.values() {
        assert!(f.mismatches.is_empty(), "{:?}", f.mismatches);
    }
    let b_slots = first[&RequestId(1)].finished.block_slots.clone();
    let c_slots = first[&RequestId(2)].finished.block_slots.clone();
    let mut rng = SplitMix64(0x5eed);
    let mut caught: HashMap<Mutation, (u64, u64)> = HashMap::new();
    let mut id = 10;
    for round in 0..rounds {
        for mutation in std::iter::once(None).chain(MUTATIONS.map(Some)) {
            id += 1;
            // A fresh tail each round, so A's tail blocks are its own.
            let tail = toks(2000 + 100 * id as u32, 5 + (rng.next_u64() % 50) as usize);
            let prompt: Vec<TokenId> = [x.clone(), y.clone(), tail].concat();
            kv.submit(submit(id, ReuseScope::SHARED, prompt, 3))
                .await
                .unwrap();
            let (block, slot) = match mutation {
                None => (0, 0),
                // B's block 0 holds Z, not X.
                Some(Mutation::WrongSlot) => (0, b_slots[0]),
                Some(Mutation::OtherPrefix) => (1, b_slots[1]),
                // C's block with the same tokens as A's block, in another scope.
                Some(Mutation::OtherTenant) => {
                    let b = (rng.next_u64() % 2) as usize;
                    (b, c_slots[b])
                }
                Some(Mutation::PastThePool) => (
                    (rng.next_u64() % 2) as usize,
                    kv.info().budget.slots as i32 + 3,
                ),
            };
            let m = Misdirect {
                request: RequestId(id),
                block,
                slot,
            };
            let done = run(&kv, &[RequestId(id)], mutation.map(|_| (0, m))).await;
            let f = &done[&RequestId(id)];
            let bad: BTreeSet<(u32, u32)> = f
                .mismatches
                .iter()
                .map(|m| (m.position, m.layer.get()))
                .collect();
            match mutation {
                None => assert!(
                    bad.is_empty(),
                    "round {round}: clean request mismatched: {bad:?}"
                ),
                Some(kind) => {
                    let want: BTreeSet<(u32, u32)> = (block * T..(block + 1) * T)
                        .flat_map(|p| (0..LAYERS).map(move |l| (p as u32, l)))
                        .collect();
                    let e = caught.entry(kind).or_default();
                    e.1 += 1;
                    if bad == want {
                        e.0 += 1;
                    } else {
                        assert!(
                            bad.is_empty(),
                            "round {round} {kind:?}: mismatches outside block {block}: {bad:?}"
                        );
                    }
                }
            }
        }
    }
    kv.shutdown().await;
    caught
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_misdirected_block_is_caught() {
    let caught = drill(Arc::new(SyntheticKv { seed: 11 }), None, 4).await;
    for kind in MUTATIONS {
        assert_eq!(caught[&kind], (4, 4), "{kind:?}");
    }
}

/// The checker's own mutation test: with KV blind to the prefix (the old synthetic
/// source), a same-token page of another prefix or tenant goes unnoticed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_blind_source_misses_same_token_pages() {
    let caught = drill(Arc::new(PrefixBlind(SyntheticKv { seed: 11 })), None, 2).await;
    assert_eq!(caught[&Mutation::WrongSlot], (2, 2));
    assert_eq!(caught[&Mutation::OtherPrefix], (0, 2));
    assert_eq!(caught[&Mutation::OtherTenant], (0, 2));
    assert_eq!(caught[&Mutation::PastThePool], (2, 2));
}

#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device"]
async fn every_misdirected_block_is_caught_on_the_gpu() {
    let caught = drill(
        Arc::new(SyntheticKv { seed: 11 }),
        Some(dsa_kv::cuda::CudaDevice::factory(vec![0])),
        4,
    )
    .await;
    for kind in MUTATIONS {
        assert_eq!(caught[&kind], (4, 4), "{kind:?}");
    }
}

/// A page-table entry past the pool: the step's write must be refused whole with the
/// host reference's typed error (never skipped), on every backend. Returns the error.
async fn out_of_range_write(backend: Option<BackendFactory>) -> String {
    let kv = start(Arc::new(SyntheticKv { seed: 3 }), backend).await;
    // 100 prompt tokens: decoding writes into block 1.
    kv.submit(submit(1, ReuseScope::SHARED, toks(100, 100), 20))
        .await
        .unwrap();
    let past_the_pool = kv.info().budget.slots as i32 + 5;
    let mut injected = false;
    for _ in 0..100 {
        let report = match kv.step(HashMap::new()).await {
            Ok(r) => r,
            Err(e) => {
                assert!(injected, "a step failed before the fault: {e}");
                kv.shutdown().await;
                return e.to_string();
            }
        };
        kv.commit(report.outcomes_from(|_| TokenId(7)))
            .await
            .unwrap();
        if !injected {
            injected = true;
            let m = Misdirect {
                request: RequestId(1),
                block: 1,
                slot: past_the_pool,
            };
            kv.inject_fault(0, DeviceFault::Misdirect(m)).await.unwrap();
        }
    }
    panic!("the out-of-range write was not refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_out_of_range_write_fails_the_step() {
    let e = out_of_range_write(None).await;
    assert!(
        e.starts_with("device 0: op: token 0: bytes [") && e.contains("are outside the cache"),
        "{e}"
    );
}

/// The CUDA backend refuses the same write with the same error (it used to skip it).
#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device"]
async fn an_out_of_range_write_fails_the_step_on_the_gpu_like_on_the_host() {
    let host = out_of_range_write(None).await;
    let gpu = out_of_range_write(Some(dsa_kv::cuda::CudaDevice::factory(vec![0]))).await;
    assert_eq!(gpu, host);
}

/// Verification through a block table with no page (−1) and a slot past the pool:
/// every position of both blocks mismatches on every layer and buffer, and nothing
/// panics (`DeviceBackend::verify` is public). Returns the mismatch count.
fn verify_missing_and_foreign_pages(
    make: impl FnOnce(dsa_kv::device::DeviceSetup) -> Box<dyn dsa_kv::device::DeviceBackend>,
) -> (u64, usize) {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(LAYERS);
    let r = c.resolve().unwrap();
    let plan =
        dsa_kv::layout::PoolPlan::for_model(&r.model, r.target_layers, r.layout, T as u32).unwrap();
    let dims = dsa_kv::metadata::MetadataDims {
        max_num_sequences: 4,
        max_blocks_per_seq: 8,
        max_num_tokens: 256,
        max_context_kv_tokens: 512,
    };
    let setup = dsa_kv::device::DeviceSetup {
        model: r.model.clone(),
        target_plan: plan,
        target_slots: (vec![4], vec![]),
        draft_plan: None,
        dims: (dims, None),
        source: Arc::new(SyntheticKv { seed: 1 }),
        verify: Verification::All,
        forward: None,
        fp8_tensor_scale: 1.0,
    };
    let mut dev = make(setup);
    let spec = dsa_kv::device::VerifySpec {
        id: RequestId(1),
        tokens: toks(0, 2 * T),
        scope: ReuseScope::SHARED,
        block_slots: vec![-1, 1000],
        draft_block_slots: None,
    };
    let (n, mismatches) = dev.verify(&[spec]).unwrap();
    (n, mismatches.len())
}

#[test]
fn missing_and_foreign_pages_mismatch_without_a_panic() {
    let got = verify_missing_and_foreign_pages(|s| {
        Box::new(dsa_kv::device::HostDevice::new(0, s).unwrap())
    });
    // 128 positions × 3 layers read; each mismatches in its MLA row and indexer key.
    assert_eq!(got, (128 * 3, 128 * 3 * 2));
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn missing_and_foreign_pages_mismatch_on_the_gpu_like_on_the_host() {
    let host = verify_missing_and_foreign_pages(|s| {
        Box::new(dsa_kv::device::HostDevice::new(0, s).unwrap())
    });
    let gpu = verify_missing_and_foreign_pages(|s| {
        Box::new(dsa_kv::cuda::CudaDevice::new(0, 0, s).unwrap())
    });
    assert_eq!(gpu, host);
}

/// The runtime on a GPU asked for more KV than the GPU holds: `start` returns the
/// out-of-memory error (no panic, no actor left running), every byte it mapped is
/// released, and a runtime of a sensible size then starts and serves on the same GPU.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn a_runtime_larger_than_the_gpu_fails_to_start_and_frees_everything() {
    use dsa_kv::cuda::{CudaDevice, Gpu};
    let g = Gpu::open(0).expect("GPU 0");
    let (free_before, total) = g.mem_info().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let config = |tokens: u64| {
        let mut c = EngineConfig::default();
        c.model.num_layers = Some(3);
        c.kv_cache.max_tokens = Some(tokens);
        c
    };
    // Three layers of DeepSeek-V3.2 FP8 take 2,124 bytes per token (`plan --layers 3`):
    // `total / 1024` tokens is about twice the GPU's memory.
    let too_many = total as u64 / 1024;
    let err = rt
        .block_on(
            KvCacheBuilder::new()
                .config(config(too_many))
                .backend(CudaDevice::factory(vec![0]))
                .start(),
        )
        .err()
        .expect("a pool larger than the GPU cannot start");
    let text = err.to_string();
    assert!(text.contains("out of memory"), "{text}");
    let (free_after, _) = g.mem_info().unwrap();
    assert!(
        free_after + (512 << 20) >= free_before,
        "the failed start released its memory: {free_before} -> {free_after} bytes free"
    );
    let kv = rt
        .block_on(
            KvCacheBuilder::new()
                .config(config(65_536))
                .backend(CudaDevice::factory(vec![0]))
                .start(),
        )
        .expect("a sensible size starts after the failure");
    let counts = rt.block_on(kv.check_invariants()).unwrap();
    assert_eq!(counts.live_sequences, 0);
    rt.block_on(kv.shutdown());
    eprintln!("{too_many} tokens refused with: {text}");
}
