//! A real (small) DSA model through the cache gives, bit for bit, what it gives on a
//! contiguous per-request cache with no paging and no reuse: every position's logits
//! and every generated token, while the runtime shares prefixes (full blocks and a
//! partial block copied on resume), chunks prefills, offloads to the host tier and
//! onboards back, preempts (suspend and recompute) and runs two device actors. A
//! one-slot error in a block table (the `fault-injection` drill) must change the
//! result: the comparison can fail. With MTP speculation, the draft layer's proposals
//! (computed in the draft replay on the separate draft cache) are accepted while they
//! equal the target's greedy tokens and the rest rolled back: the committed tokens must
//! still be the plain greedy generation's, and every proposal must equal the draft
//! layer's on the contiguous reference.
mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dsa_kv::actors::{KvCacheBuilder, RuntimeStats};
use dsa_kv::config::{EngineConfig, KvDtype, SpecMode};
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::core::ReuseScope;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::ops::quant::ScaleFormat;
use dsa_kv_model::paged::{ForwardOptions, ModelForward, Outputs};
use dsa_kv_model::unpaged::{draft_reference, generate};
use dsa_kv_model::{CacheFormat, Model, ModelConfig};

const REQUESTS: u64 = 12;

fn config(kv_dtype: KvDtype, drafts: usize) -> EngineConfig {
    let mut c = EngineConfig::default();
    if drafts > 0 {
        // The MTP layer in a separate draft cache, replayed after each target step.
        c.spec_decode.mode = SpecMode::Mtp;
        c.spec_decode.draft_tokens = drafts as u32;
    }
    c.model.num_layers = Some(2);
    c.model.kv_dtype = Some(kv_dtype);
    // Room for 1,024 tokens on the GPU: the workload needs more, so requests are
    // preempted and blocks offloaded to the host tier and onboarded back.
    c.kv_cache.max_tokens = Some(768);
    c.kv_cache.host_cache_size = Some(64 << 20);
    c.scheduler.max_num_sequences = 12;
    c.scheduler.max_num_tokens = 256;
    // Chunks that do not line up with the 64-token blocks.
    c.scheduler.max_prefill_chunk = 48;
    c.scheduler.max_seq_len = 1024;
    c
}

/// A 100-token system prompt shared by all (one full block and a partial one), then
/// the request's own 20–90 tokens.
fn prompt(i: u64) -> Vec<u32> {
    let own = 20 + (i as u32 * 37) % 71;
    (0..100)
        .map(|t| 1000 + t)
        .chain((0..own).map(|k| (i as u32 * 7919 + k * 31) % 5000))
        .collect()
}

fn max_new(i: u64) -> u32 {
    24 + (i as u32 * 5) % 17
}

fn format(kv_dtype: KvDtype) -> CacheFormat {
    CacheFormat {
        kv_dtype,
        scale_format: ScaleFormat::Ue8m0,
        indexer: vec![true, true],
    }
}

/// Where the forward runs.
#[derive(Clone, Debug)]
enum Backend {
    /// Two host device actors running `ModelForward`.
    Host,
    /// One device actor per listed GPU running the GPU model (`graphs`: decode steps as
    /// CUDA graphs).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Cuda { gpus: Vec<usize>, graphs: bool },
}

impl Backend {
    fn devices(&self) -> usize {
        match self {
            Backend::Host => 2,
            Backend::Cuda { gpus, .. } => gpus.len(),
        }
    }
}

struct Run {
    outputs: Outputs,
    /// Every request's committed output tokens (accepted drafts and sampled tokens).
    generated: HashMap<RequestId, Vec<u32>>,
    /// Every draft proposal: request, the position it follows, the tokens.
    proposals: Vec<(RequestId, u32, Vec<u32>)>,
    stats: RuntimeStats,
    devices: usize,
    /// The step that failed (the misdirection drill: devices that sampled differently).
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    step_error: Option<String>,
    /// Steps run as a CUDA graph.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    graph_steps: u64,
}

/// The workload through the runtime (2 host devices, `drafts` MTP draft tokens per
/// step); `misdirect`: from the step where request 3 first produces a token, device 0
/// reads and writes its block 1 in slot 0.
async fn run(
    model: Arc<Model>,
    kv_dtype: KvDtype,
    drafts: usize,
    misdirect: bool,
    backend: &Backend,
) -> Run {
    run_with(model, config(kv_dtype, drafts), drafts, misdirect, backend).await
}

/// [`run`] with engine configuration `cfg`.
async fn run_with(
    model: Arc<Model>,
    cfg: EngineConfig,
    drafts: usize,
    misdirect: bool,
    backend: &Backend,
) -> Run {
    let outputs = Arc::new(Mutex::new(Outputs::default()));
    let graph_steps = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let opts = ForwardOptions::default()
        .drafts(drafts)
        .record(outputs.clone());
    let builder = KvCacheBuilder::new().config(cfg);
    let builder = match backend {
        Backend::Host => builder
            .host_devices(2)
            .forward(ModelForward::factory(model, opts)),
        #[cfg(feature = "cuda")]
        Backend::Cuda { gpus, graphs } => builder
            .backend(dsa_kv::cuda::CudaDevice::factory(gpus.clone()))
            .host_devices(gpus.len())
            .forward(dsa_kv_model::cuda::CudaModelForward::factory(
                model,
                opts,
                *graphs,
                graph_steps.clone(),
            )),
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda { .. } => unreachable!("CUDA tests need the cuda feature"),
    };
    let kv = builder.start().await.unwrap();
    let devices = backend.devices();
    for i in 0..REQUESTS {
        kv.submit(SubmitRequest {
            id: RequestId(i),
            scope: ReuseScope::SHARED,
            prompt: prompt(i).into_iter().map(TokenId).collect(),
            max_new_tokens: max_new(i),
            priority: [10, 35, 60][i as usize % 3],
        })
        .await
        .unwrap();
    }
    let mut generated: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut proposals = Vec::new();
    let mut done = 0;
    let mut step_error = None;
    #[cfg_attr(not(feature = "fault-injection"), allow(unused_mut))]
    let mut injected = !misdirect;
    for _ in 0..5000 {
        // The forward samples and proposes; the runtime commits and feeds each
        // request's proposals into its next step.
        let rep = match kv.step(HashMap::new()).await {
            Ok(rep) => rep,
            Err(e) => {
                // Only the drill may fail a step: device 0's misdirected read makes
                // it sample another token than device 1.
                assert!(misdirect, "{e}");
                step_error = Some(e.to_string());
                break;
            }
        };
        let c = rep.committed.as_ref().expect("the forward samples");
        assert_eq!(rep.outcomes.len(), rep.scheduled.len());
        let mut proposed: HashMap<RequestId, &Vec<TokenId>> = rep.devices[0]
            .sampled()
            .map(|s| s.drafts.iter().map(|(id, d)| (*id, d)).collect())
            .unwrap_or_default();
        if let Some(d) = &rep.draft {
            proposed.extend(d.proposals.iter().map(|(id, d)| (*id, d)));
        }
        for (r, o) in rep.scheduled.iter().zip(&rep.outcomes) {
            assert_eq!(r.id, o.id, "outcomes in the plan's order");
            if !r.produces_token {
                assert_eq!((o.accepted_drafts, o.next_token), (0, None));
                continue;
            }
            let g = generated.entry(r.id).or_default();
            let used = &r.tokens[r.tokens.len() - r.num_drafts as usize..];
            assert!(o.accepted_drafts <= r.num_drafts);
            g.extend(used[..o.accepted_drafts as usize].iter().map(|t| t.0));
            g.push(o.next_token.expect("a sampled token").0);
            if drafts > 0 {
                let d = proposed.get(&r.id).expect("the draft layer proposed");
                // The chain starts after the last accepted position: the sampled
                // token is at `last + 1`.
                let last = (prompt(r.id.0).len() + g.len() - 2) as u32;
                proposals.push((r.id, last, d.iter().map(|t| t.0).collect()));
            }
        }
        done += c.finished.len();
        #[cfg(feature = "fault-injection")]
        if !injected && generated.contains_key(&RequestId(3)) {
            injected = true;
            kv.inject_fault(
                0,
                dsa_kv::actors::DeviceFault::Misdirect(dsa_kv::actors::Misdirect {
                    request: RequestId(3),
                    block: 1,
                    slot: 0,
                }),
            )
            .await
            .unwrap();
        }
        if done as u64 == REQUESTS {
            break;
        }
    }
    assert!(injected, "the fault needs the fault-injection feature");
    if step_error.is_none() {
        assert_eq!(done as u64, REQUESTS, "every request finishes");
    }
    let stats = kv.stats().await.unwrap();
    kv.shutdown().await;
    let outputs = std::mem::take(&mut *outputs.lock().unwrap());
    Run {
        outputs,
        generated,
        proposals,
        stats,
        devices,
        step_error,
        graph_steps: graph_steps.load(std::sync::atomic::Ordering::Relaxed),
    }
}

/// Asserts that no recomputed position changed and that nothing differs from the
/// unpaged reference ([`compare`]).
fn assert_exact(model: &Model, kv_dtype: KvDtype, drafts: usize, run: &Run, what: &str) {
    assert!(
        run.outputs.conflicts.is_empty(),
        "{what}: {:?}",
        run.outputs.conflicts
    );
    let bad = compare(model, kv_dtype, drafts, run);
    assert!(bad.is_empty(), "{what}: {bad:#?}");
}

/// Requests whose tokens, logits or draft proposals differ from the unpaged reference.
fn compare(model: &Model, kv_dtype: KvDtype, drafts: usize, run: &Run) -> Vec<String> {
    let mut bad = Vec::new();
    let mut reference = HashMap::new();
    for i in 0..REQUESTS {
        let id = RequestId(i);
        let p = prompt(i);
        let got = &run.generated[&id];
        // Accepted drafts may overshoot max_new_tokens by up to `drafts` tokens.
        assert!((max_new(i)..=max_new(i) + drafts as u32).contains(&(got.len() as u32)));
        let want = generate(model, &format(kv_dtype), &p, got.len() as u32).unwrap();
        if *got != want.tokens {
            bad.push(format!(
                "request {i}: tokens {got:?}, reference {:?}",
                want.tokens
            ));
        }
        for dev in 0..run.devices {
            // Positions served from the prefix cache never ran for this request; every
            // position that ran must match, and every position that samples must have run.
            let ran = &run.outputs.tokens[&(dev, id)];
            let sampled = p.len() as u32 - 1..(p.len() + got.len()) as u32 - 1;
            assert!(
                sampled.clone().all(|pos| ran.contains_key(&pos)),
                "every sampling position ran"
            );
            if let Some(o) = ran
                .values()
                .find(|o| want.outputs.get(o.pos as usize) != Some(*o))
            {
                bad.push(format!("request {i} device {dev} position {}", o.pos));
            }
        }
        if drafts > 0 {
            let all: Vec<u32> = p.iter().chain(&want.tokens).copied().collect();
            let d = draft_reference(model, &format(kv_dtype), true, &all, drafts).unwrap();
            reference.insert(id, d);
        }
    }
    for (id, last, d) in &run.proposals {
        if reference[id].get(*last as usize) != Some(d) {
            bad.push(format!(
                "request {id}: proposal after position {last}: {d:?}"
            ));
        }
    }
    bad
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paging_reuse_offload_and_preemption_change_no_bit() {
    for kv_dtype in [KvDtype::Fp8DsMla, KvDtype::Bf16] {
        let model = Arc::new(Model::new(ModelConfig::tiny(7), format(kv_dtype)).unwrap());
        let run = run(model.clone(), kv_dtype, 0, false, &Backend::Host).await;
        let s = &run.stats;
        assert!(s.scheduler.preemptions > 0, "the workload preempts");
        assert!(
            s.offload_bytes > 0 && s.onboard_bytes > 0,
            "offload and onboard"
        );
        assert!(s.prefix_hit_rate > 0.0, "prefixes are reused");
        assert_exact(&model, kv_dtype, 0, &run, &format!("{kv_dtype:?}"));
    }
}

/// MTP speculation (2 drafts per step, a separate draft cache replayed after each
/// target step): drafts accepted by the target's greedy tokens and rolled back
/// otherwise leave every committed token and every computed position's logits equal to
/// plain greedy decoding on the unpaged cache, and every proposal equal to the draft
/// layer's on the contiguous reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtp_drafts_with_rollback_change_no_bit() {
    let kv_dtype = KvDtype::Fp8DsMla;
    let model = Arc::new(Model::new(ModelConfig::tiny(7), format(kv_dtype)).unwrap());
    let run = run(model.clone(), kv_dtype, 2, false, &Backend::Host).await;
    let s = &run.stats;
    eprintln!(
        "drafts proposed {}, accepted {} ({:.1} %), preemptions {}, draft replays {}",
        s.scheduler.drafts_proposed,
        s.scheduler.drafts_accepted,
        100.0 * s.scheduler.drafts_accepted as f64 / s.scheduler.drafts_proposed.max(1) as f64,
        s.scheduler.preemptions,
        s.draft_replays
    );
    assert!(s.scheduler.drafts_accepted > 0, "some drafts are accepted");
    assert!(
        s.scheduler.drafts_accepted < s.scheduler.drafts_proposed,
        "some are rolled back"
    );
    assert!(s.scheduler.preemptions > 0, "the workload preempts");
    assert!(s.draft_replays > 0);
    assert_exact(&model, kv_dtype, 2, &run, "");
}

/// Without a host tier every preemption is a recompute (the request's sequences are
/// closed, its committed blocks stay cached, and it prefills again from what is still
/// cached), with MTP drafts whose layer lives in the target's cache (no separate draft
/// cache: the target forward writes it and proposes): still every bit of the unpaged
/// reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recompute_preemption_with_mtp_in_the_target_cache_changes_no_bit() {
    let kv_dtype = KvDtype::Fp8DsMla;
    let model = Arc::new(Model::new(ModelConfig::tiny(7), format(kv_dtype)).unwrap());
    let mut cfg = config(kv_dtype, 2);
    cfg.kv_cache.host_cache_size = None;
    cfg.spec_decode.separate_draft_cache = false;
    let run = run_with(model.clone(), cfg, 2, false, &Backend::Host).await;
    let s = &run.stats;
    eprintln!(
        "no host tier: preemptions (all recomputes) {}, drafts accepted {} of {}",
        s.scheduler.preemptions, s.scheduler.drafts_accepted, s.scheduler.drafts_proposed
    );
    assert!(s.scheduler.preemptions > 0, "the workload preempts");
    assert_eq!(s.offload_bytes, 0, "no host tier: nothing is suspended");
    assert_eq!(s.draft_replays, 0, "no separate draft cache: no replay");
    assert!(s.scheduler.drafts_accepted > 0);
    assert_exact(&model, kv_dtype, 2, &run, "");
}

/// A cache the model cannot read is refused with a typed error at start-up, not read
/// wrongly: FP4 indexer keys, and a cache with more target layers than the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_the_model_cannot_read_is_refused() {
    let kv_dtype = KvDtype::Fp8DsMla;
    let model = Arc::new(Model::new(ModelConfig::tiny(7), format(kv_dtype)).unwrap());
    let start = |cfg: EngineConfig| {
        let model = model.clone();
        async move {
            match KvCacheBuilder::new()
                .config(cfg)
                .forward(ModelForward::factory(model, ForwardOptions::default()))
                .start()
                .await
            {
                Ok(kv) => {
                    kv.shutdown().await;
                    "started".to_string()
                }
                Err(e) => e.to_string(),
            }
        }
    };
    let mut fp4 = config(kv_dtype, 0);
    fp4.model.indexer_dtype = Some(dsa_kv::config::IndexerDtype::Fp4);
    let e = start(fp4).await;
    assert!(e.contains("set indexer_dtype = fp8"), "{e}");
    let mut three = config(kv_dtype, 0);
    three.model.num_layers = Some(3);
    let e = start(three).await;
    assert!(e.contains("set model.num_layers = 2"), "{e}");
    assert_eq!(start(config(kv_dtype, 0)).await, "started");
}

/// The comparison can fail: one wrong block-table entry of one request (its second
/// block, from the step it first samples) changes its logits. (The engine samples
/// device 0's token, so device 1 then runs the wrong tokens too; and slot 0 belongs to
/// other requests, whose KV the misdirected writes overwrite on device 0.)
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_slot_block_table_error_changes_the_result() {
    let kv_dtype = KvDtype::Fp8DsMla;
    let model = Arc::new(Model::new(ModelConfig::tiny(7), format(kv_dtype)).unwrap());
    let run = run(model.clone(), kv_dtype, 0, true, &Backend::Host).await;
    assert_drill_caught(&model, kv_dtype, &run);
}

/// The misdirection drill was caught: by the runtime (device 0 sampled another token
/// than device 1: the step failed) or by the comparison (request 3's outputs on device
/// 0 differ from the reference).
#[cfg(feature = "fault-injection")]
fn assert_drill_caught(model: &Model, kv_dtype: KvDtype, run: &Run) {
    if let Some(e) = &run.step_error {
        assert!(
            e.contains("returned other sampled outcomes than device 0"),
            "{e}"
        );
        return;
    }
    let bad = compare(model, kv_dtype, 0, run);
    assert!(
        bad.iter().any(|b| b.starts_with("request 3 device 0")),
        "the misdirected request must differ on device 0: {bad:#?}"
    );
}

/// The same workload on the GPU: the GPU model (its own kernels on the device pools and
/// metadata) gives every bit of the unpaged host reference, eager and with decode steps
/// as CUDA graphs. `DSA_KV_GPUS` lists the GPUs (default `0`; one device actor each;
/// `0,0` puts two device actors on one GPU).
#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device"]
async fn on_the_gpu_paging_changes_no_bit() {
    let gpus: Vec<usize> = std::env::var("DSA_KV_GPUS")
        .unwrap_or_else(|_| "0".into())
        .split(',')
        .map(|g| {
            g.trim()
                .parse()
                .expect("DSA_KV_GPUS: comma-separated ordinals")
        })
        .collect();
    for kv_dtype in [KvDtype::Fp8DsMla, KvDtype::Bf16] {
        for graphs in [false, true] {
            let model = Arc::new(Model::new(ModelConfig::tiny(7), format(kv_dtype)).unwrap());
            let backend = Backend::Cuda {
                gpus: gpus.clone(),
                graphs,
            };
            let t = std::time::Instant::now();
            let run = run(model.clone(), kv_dtype, 0, false, &backend).await;
            let s = &run.stats;
            eprintln!(
                "{kv_dtype:?} graphs {graphs}: {:.2} s, {} graph steps, preemptions {}, \
                 offload {} B, hit rate {:.3}",
                t.elapsed().as_secs_f64(),
                run.graph_steps,
                s.scheduler.preemptions,
                s.offload_bytes,
                s.prefix_hit_rate
            );
            assert!(s.scheduler.preemptions > 0 && s.offload_bytes > 0 && s.prefix_hit_rate > 0.0);
            assert_eq!(graphs, run.graph_steps > 0);
            assert_exact(
                &model,
                kv_dtype,
                0,
                &run,
                &format!("{kv_dtype:?} graphs {graphs}"),
            );
        }
    }
}

/// MTP speculation on the GPU (draft KV and draft chains computed there, decode steps
/// as CUDA graphs): the same committed tokens, logits and proposals as the host reference.
#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device"]
async fn on_the_gpu_mtp_drafts_with_rollback_change_no_bit() {
    let kv_dtype = KvDtype::Fp8DsMla;
    let model = Arc::new(Model::new(ModelConfig::tiny(7), format(kv_dtype)).unwrap());
    // Separate draft cache eager and with graphs; the MTP layer in the target's cache
    // without a host tier (recompute preemption).
    for (graphs, separate) in [(false, true), (true, true), (false, false)] {
        let backend = Backend::Cuda {
            gpus: vec![0],
            graphs,
        };
        let mut cfg = config(kv_dtype, 2);
        if !separate {
            cfg.spec_decode.separate_draft_cache = false;
            cfg.kv_cache.host_cache_size = None;
        }
        let run = run_with(model.clone(), cfg, 2, false, &backend).await;
        let s = &run.stats;
        eprintln!(
            "GPU graphs {graphs} separate {separate}: drafts proposed {}, accepted {}, \
             draft replays {}, preemptions {}, graph steps {}",
            s.scheduler.drafts_proposed,
            s.scheduler.drafts_accepted,
            s.draft_replays,
            s.scheduler.preemptions,
            run.graph_steps
        );
        assert!(
            s.scheduler.drafts_accepted > 0
                && s.scheduler.drafts_accepted < s.scheduler.drafts_proposed
        );
        assert_eq!(graphs, run.graph_steps > 0);
        assert_eq!(separate, s.draft_replays > 0);
        let what = format!("graphs {graphs} separate {separate}");
        assert_exact(&model, kv_dtype, 2, &run, &what);
    }
}

/// The GPU comparison can fail: the one-slot block-table error of
/// `a_one_slot_block_table_error_changes_the_result`, on the GPU.
#[cfg(all(feature = "cuda", feature = "fault-injection"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device"]
async fn on_the_gpu_a_one_slot_block_table_error_changes_the_result() {
    let kv_dtype = KvDtype::Fp8DsMla;
    let model = Arc::new(Model::new(ModelConfig::tiny(7), format(kv_dtype)).unwrap());
    let backend = Backend::Cuda {
        gpus: vec![0],
        graphs: false,
    };
    let run = run(model.clone(), kv_dtype, 0, true, &backend).await;
    assert_drill_caught(&model, kv_dtype, &run);
}
