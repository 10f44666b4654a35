//! DeepSeek-V4 through the one runtime: the tiny V4 model (`[0, 4, 128]` and an MTP
//! layer) on two device actors (tensor parallel: every device runs every step and must
//! sample the same tokens) behind the same builder, coordinator and scheduler as every
//! model (`KvCacheBuilder::windowed`), with continuous batching, chunked prefill, MTP
//! drafts, prefix hits at window tails, preemption by recompute and a host tier. Every
//! request's output tokens, and every position's logits on both devices, equal the model
//! run alone on a contiguous cache, bit for bit. With a GPU, one of the two devices is
//! the model's CUDA device (pools in GPU memory, the forward in kernels), and at the end
//! its every pool byte equals the host device's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dsa_kv::core::quota::{V4Demand, WindowedCapacityPlan};
use dsa_kv::prelude::*;
use dsa_kv::v4::{
    TierSlots, V4Plan, WindowedBackendFactory, WindowedHostDevice, WindowedModel, WindowedSetup,
    WindowedSlots,
};
use dsa_kv_core::rng::SplitMix64;
use dsa_kv_device::DeviceBackend;
use dsa_kv_model::v4::{V4Contiguous, V4Model, V4ModelConfig, V4ModelForward, V4Outputs};

/// The metrics recorder is global to this test binary: the test that compares its
/// counters with `stats()` runs alone (write), every other runtime of this binary beside
/// the others (read).
static METRICS: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// The workload's model, plan and slots.
fn setup() -> (Arc<V4Model>, V4Plan, WindowedSlots) {
    let model = Arc::new(V4Model::new(V4ModelConfig::tiny(7)).unwrap());
    let plan = V4Plan::new(&model.config().spec().unwrap()).unwrap();
    let slots = WindowedSlots {
        blocks: TierSlots {
            gpu: vec![6],
            host: vec![24],
        },
        windows: vec![14, 300, 200],
    };
    (model, plan, slots)
}

/// The configuration: 3 sequences, chunks of 200, 384 tokens a step, 3 MTP drafts.
fn config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.kv_cache.max_gpu_total_bytes = Some(256 << 20);
    c.scheduler.max_num_sequences = 3;
    c.scheduler.max_prefill_chunk = 200;
    c.scheduler.max_num_tokens = 384;
    c.scheduler.max_seq_len = 4096;
    c.spec_decode.mode = SpecMode::Mtp;
    c.spec_decode.draft_tokens = 3;
    c
}

/// Host devices running `model`, recording into `outputs`.
fn host_backend(model: &Arc<V4Model>, outputs: &Arc<Mutex<V4Outputs>>) -> WindowedBackendFactory {
    let (model, outputs) = (model.clone(), outputs.clone());
    Arc::new(move |i, s: &WindowedSetup| {
        let f = V4ModelForward::new(model.clone(), outputs.clone());
        let d = WindowedHostDevice::new(i, &s.plan, &s.slots, Box::new(f))?;
        Ok(Box::new(d) as Box<dyn DeviceBackend>)
    })
}

/// Runs the workload on two devices from `backend` through the runtime and checks every
/// request's tokens and every recorded position's output on both devices against the
/// unpaged model; returns the positions checked, the runtime's last counters and the
/// room requests refused by the drill (`room_faults` percent of them, feature
/// `fault-injection`).
async fn workload(
    model: &V4Model,
    slots: WindowedSlots,
    backend: WindowedBackendFactory,
    outputs: &Mutex<V4Outputs>,
    room_faults: u8,
) -> (usize, RuntimeStats, u64) {
    let mut w = WindowedModel::new(model.config().spec().unwrap(), backend);
    w.slots = Some(slots);
    let kv = KvCacheBuilder::new()
        .config(config())
        .host_devices(2)
        .windowed(w)
        .start()
        .await
        .unwrap();
    #[cfg(feature = "fault-injection")]
    kv.inject_room_failures(0xd1e, room_faults).await.unwrap();
    #[cfg(not(feature = "fault-injection"))]
    assert_eq!(
        room_faults, 0,
        "room faults need the fault-injection feature"
    );
    let mut rng = SplitMix64(3);
    let systems: Vec<Vec<u32>> = (0..2)
        .map(|_| (0..520).map(|_| rng.below(256) as u32).collect())
        .collect();
    let mut prompts: HashMap<RequestId, (Vec<u32>, usize)> = HashMap::new();
    let mut outputs_of: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let (mut preempted, mut copies, mut accepted, mut first_reuse) = (0, 0, 0u64, 0u64);
    // Two waves: fresh conversations, then each one's next turn (its history and new
    // tokens), which resumes at the tails its first turn left.
    for wave in 0..2u64 {
        let mut ids = Vec::new();
        for c in 0..4u64 {
            let id = RequestId(wave * 10 + c);
            let mut prompt = if wave == 0 {
                systems[(c % 2) as usize].clone()
            } else {
                let first = RequestId(c);
                let mut h = prompts[&first].0.clone();
                h.extend(&outputs_of[&first]);
                h
            };
            prompt.extend((0..20 + rng.below(120)).map(|_| rng.below(256) as u32));
            let max_new = 10 + rng.below(50) as usize;
            prompts.insert(id, (prompt.clone(), max_new));
            let toks = prompt.iter().map(|&t| TokenId(t)).collect();
            kv.submit(SubmitRequest::new(id, toks, max_new as u32))
                .await
                .unwrap();
            ids.push(id);
        }
        let mut steps = 0;
        while ids.iter().any(|id| !outputs_of.contains_key(id)) {
            steps += 1;
            assert!(steps < 5_000, "wave {wave} does not finish");
            let rep = kv.step(Drafts::none()).await.unwrap();
            assert!(rep.failed.is_empty(), "{:?}", rep.failed);
            preempted += rep.preempted.len();
            copies += rep.devices[0].slot_copies;
            accepted += rep
                .outcomes
                .iter()
                .map(|o| u64::from(o.accepted_drafts))
                .sum::<u64>();
            let Some(done) = rep.committed else {
                assert!(rep.scheduled.is_empty(), "a sampled step is committed");
                continue;
            };
            for f in done.finished {
                let f = f.finished;
                first_reuse += f.reused_tokens;
                outputs_of.insert(f.id, f.output().iter().map(|t| t.0).collect());
            }
        }
    }
    // One more (empty) step publishes the state after the last commit.
    kv.step(Drafts::none()).await.unwrap();
    let stats = kv.stats().await.unwrap();
    #[cfg(feature = "fault-injection")]
    let refused = kv.inject_room_failures(0, 0).await.unwrap();
    #[cfg(not(feature = "fault-injection"))]
    let refused = 0;
    kv.shutdown().await;
    let out = outputs.lock().unwrap();
    assert!(out.conflicts.is_empty(), "{:?}", out.conflicts);
    let mut positions = 0;
    for (id, (prompt, max_new)) in &prompts {
        let g = model.generate(prompt, *max_new as u32).unwrap();
        let (gen, outs) = (g.tokens, g.outputs);
        assert_eq!(&outputs_of[id], &gen, "request {id}: tokens");
        for device in 0..2 {
            let got = &out.tokens[&(device, *id)];
            for (&pos, o) in got {
                assert_eq!(
                    *o, outs[pos as usize],
                    "request {id}, device {device}, position {pos}"
                );
                positions += 1;
            }
        }
    }
    let w = stats.windows.expect("a windowed model's counters");
    eprintln!(
        "positions checked {positions}, preempted {preempted}, slot copies {copies}, \
         drafts accepted {accepted}, {:?}, {w:?}",
        stats.scheduler
    );
    // First admissions only (re-admissions after a preemption are not prefix hits).
    assert!(first_reuse >= 4 * 512, "prefix hits: {first_reuse}, {w:?}");
    assert!(w.windows.tails_adopted > 0 && w.windows.tails_linked > 0);
    assert!(accepted > 0, "MTP drafts accepted");
    assert!(
        stats.scheduler.drafts_proposed > stats.scheduler.drafts_accepted,
        "and rejected"
    );
    assert!(preempted > 0, "preemption by recompute");
    assert!(copies > 0, "offload or onboarding");
    assert_eq!(stats.scheduler.finished, 8);
    assert!(stats.events.stored > 0, "KV events: {:?}", stats.events);
    (positions, stats, refused)
}

/// The host workload; the metrics an embedder's recorder sees for the windowed model
/// (every model's, and the window kind's tails and back-off) equal `stats()`; then the
/// room-fault drill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v4_runtime_is_bit_exact_against_the_unpaged_model() {
    let _alone = METRICS.write().await;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");
    let (model, _, slots) = setup();
    let outputs = Arc::new(Mutex::new(V4Outputs::default()));
    let backend = host_backend(&model, &outputs);
    let (_, st, _) = workload(&model, slots, backend, &outputs, 0).await;
    let mut counters = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let k = key.key();
        let labels: Vec<String> = k.labels().map(|l| l.value().to_string()).collect();
        if let DebugValue::Counter(v) = value {
            counters.insert(format!("{}{:?}", k.name(), labels), v);
        }
    }
    let w = st.windows.unwrap();
    for (name, want) in [
        (
            "dsa_kv_window_tails_total[\"linked\"]",
            w.windows.tails_linked,
        ),
        (
            "dsa_kv_window_tails_total[\"adopted\"]",
            w.windows.tails_adopted,
        ),
        (
            "dsa_kv_window_tails_total[\"evicted\"]",
            w.windows.tails_evicted,
        ),
        ("dsa_kv_window_tails_total[\"demoted\"]", w.tails_demoted),
        (
            "dsa_kv_window_backed_off_blocks_total[]",
            w.backed_off_blocks,
        ),
        ("dsa_kv_steps_total[]", st.scheduler.steps),
        ("dsa_kv_prefix_reused_tokens_total[]", w.reused_tokens),
        ("dsa_kv_prefix_lookup_tokens_total[]", w.lookup_tokens),
        ("dsa_kv_kv_events_total[\"stored\"]", st.events.stored),
    ] {
        assert_eq!(counters.get(name), Some(&want), "{name}: {counters:?}");
    }
    // Then (after the counters: one recorder per test binary) the fault drill on the
    // windowed model: a fifth of the GPU-room requests refused as storage failures while
    // the workload runs; no step fails, every request finishes with the unpaged model's
    // tokens and outputs on both devices.
    #[cfg(feature = "fault-injection")]
    {
        let outputs = Arc::new(Mutex::new(V4Outputs::default()));
        let backend = host_backend(&model, &outputs);
        let (_, _, slots) = setup();
        let (positions, st, refused) = workload(&model, slots, backend, &outputs, 20).await;
        eprintln!("room requests refused {refused}, positions checked {positions}");
        assert!(refused > 0, "the drill refused nothing: {:?}", st.scheduler);
    }
}

/// A device the test keeps a handle on while the runtime drives it.
#[cfg(feature = "cuda")]
struct Shared<D>(Arc<Mutex<D>>);

#[cfg(feature = "cuda")]
impl<D: DeviceBackend> DeviceBackend for Shared<D> {
    fn index(&self) -> usize {
        self.0.lock().unwrap().index()
    }

    fn execute_step(
        &mut self,
        plan: &dsa_kv::core::scheduler::StepPlan,
    ) -> Result<dsa_kv_device::DeviceStepReport, dsa_kv_device::DeviceError> {
        self.0.lock().unwrap().execute_step(plan)
    }

    fn draft_prepare(
        &mut self,
        plan: &dsa_kv::core::scheduler::StepPlan,
    ) -> Result<dsa_kv::metadata::DraftSnapshot, dsa_kv_device::DeviceError> {
        self.0.lock().unwrap().draft_prepare(plan)
    }

    fn draft_forward(
        &mut self,
        plan: &dsa_kv::core::scheduler::StepPlan,
    ) -> Result<(u64, dsa_kv_device::Proposals), dsa_kv_device::DeviceError> {
        self.0.lock().unwrap().draft_forward(plan)
    }

    fn draft_restore(
        &mut self,
        s: &dsa_kv::metadata::DraftSnapshot,
    ) -> Result<(), dsa_kv_device::DeviceError> {
        self.0.lock().unwrap().draft_restore(s)
    }

    fn verify(
        &mut self,
        specs: &[dsa_kv_device::VerifySpec],
    ) -> Result<(u64, Vec<dsa_kv_device::Mismatch>), dsa_kv_device::DeviceError> {
        self.0.lock().unwrap().verify(specs)
    }

    fn cache_digest(&mut self) -> Result<String, dsa_kv_device::DeviceError> {
        self.0.lock().unwrap().cache_digest()
    }
}

/// The workload with device 1 the model's CUDA device: the coordinator checks every
/// step that both devices sampled the same (tokens, drafts accepted, proposals), both
/// record the unpaged model's outputs bit for bit, and at the end every byte of every
/// pool (each life cycle's GPU tier, the compressed one's host tier) of the CUDA device
/// equals the host device's.
#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device"]
async fn v4_cuda_device_is_bit_exact_against_the_host_device_and_the_unpaged_model() {
    let _beside = METRICS.read().await;
    use dsa_kv::ids::Tier;
    use dsa_kv_model::v4::cuda::v4_cuda_device;

    let (model, plan, slots) = setup();
    let outputs = Arc::new(Mutex::new(V4Outputs::default()));
    let f = V4ModelForward::new(model.clone(), outputs.clone());
    let host = Arc::new(Mutex::new(
        WindowedHostDevice::new(0, &plan, &slots, Box::new(f)).unwrap(),
    ));
    let gpu = dsa_kv::cuda::Gpu::open(0).expect("a CUDA device");
    let cuda = Arc::new(Mutex::new(
        v4_cuda_device(
            1,
            gpu,
            &plan,
            &slots,
            model.clone(),
            outputs.clone(),
            4096 + 64,
        )
        .unwrap(),
    ));
    let (h, c) = (host.clone(), cuda.clone());
    // The devices are built here; the factory hands them to the runtime once.
    let taken = Mutex::new(vec![
        Some(Box::new(Shared(h)) as Box<dyn DeviceBackend>),
        Some(Box::new(Shared(c)) as Box<dyn DeviceBackend>),
    ]);
    let backend: WindowedBackendFactory = Arc::new(move |i, _: &WindowedSetup| {
        Ok(taken.lock().unwrap()[i]
            .take()
            .expect("each device is built once"))
    });
    let start = std::time::Instant::now();
    let (positions, _, _) = workload(&model, slots, backend, &outputs, 0).await;
    let (host, cuda) = (host.lock().unwrap(), cuda.lock().unwrap());
    let mut bytes = 0usize;
    for (lc, l) in plan.life_cycles().iter().enumerate() {
        for pool in 0..l.pools.len() {
            for tier in [Tier::Gpu, Tier::Host] {
                let want = host.pools().pool(lc, tier, pool);
                let got = cuda.pools().download(lc, tier, pool).unwrap();
                assert_eq!(
                    got.len(),
                    want.len(),
                    "life cycle {lc}, pool {pool}, {tier:?}"
                );
                if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
                    panic!("life cycle {lc}, pool {pool}, {tier:?}: byte {i} differs");
                }
                bytes += got.len();
            }
        }
    }
    assert!(bytes > 0);
    eprintln!(
        "V4 CUDA device: {positions} positions exact on both devices, {bytes} pool bytes \
         equal, {:.1} s",
        start.elapsed().as_secs_f64()
    );
}

/// The scheduler over the workload's cache, for the step-by-step GPU tests below.
#[cfg(feature = "cuda")]
fn scheduler(slots: &WindowedSlots, plan: &V4Plan) -> dsa_kv::core::scheduler::Scheduler {
    let c = config();
    let s = &c.scheduler;
    let opts = dsa_kv::core::ManagerOptions {
        enable_partial_reuse: false,
        ..Default::default()
    };
    let cache = dsa_kv::core::ModelCache::windowed(plan, slots.clone(), opts, 16).unwrap();
    let limits = dsa_kv::core::scheduler::SchedulerLimits {
        max_num_sequences: s.max_num_sequences,
        max_num_tokens: s.max_num_tokens,
        max_prefill_chunk: s.max_prefill_chunk,
        max_seq_len: s.max_seq_len,
        draft_tokens: c.spec_decode.draft_tokens,
        livelock_steps: 8,
        max_context_kv_tokens: u32::MAX,
        transfer_lease: std::time::Duration::from_secs(60),
    };
    dsa_kv::core::scheduler::Scheduler::new(cache, None, limits)
}

/// The check above can fail: a CUDA device compiled from altered kernels, driven step by
/// step beside a host device, gives other outcomes or outputs. Two mutations: the
/// softmax's running maximum started at 0 instead of the sink (the same math, other
/// rounding: the check sees bits), and the ratio-4 entry pooling only the second halves
/// of its slots (the overlap dropped).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn v4_cuda_device_mutations_are_caught() {
    use dsa_kv::cuda::v4::WindowedCudaDevice;
    use dsa_kv_model::v4::cuda::{V4CudaForward, V4_MODEL_SOURCE};

    let mutations = [
        ("float m = sink[h];", "float m = 0.0f;"),
        ("int h = shalf[(long)e * S + s];", "int h = coff - 1;"),
    ];
    for (from, to) in mutations {
        assert_eq!(V4_MODEL_SOURCE.matches(from).count(), 1, "{from}");
        let src = V4_MODEL_SOURCE.replace(from, to);
        let (model, plan, slots) = setup();
        let mut sched = scheduler(&slots, &plan);
        let outputs = Arc::new(Mutex::new(V4Outputs::default()));
        let f = V4ModelForward::new(model.clone(), outputs.clone());
        let mut host = WindowedHostDevice::new(0, &plan, &slots, Box::new(f)).unwrap();
        let gpu = dsa_kv::cuda::Gpu::open(0).expect("a CUDA device");
        let forward = V4CudaForward::with_source(
            gpu.clone(),
            model.clone(),
            Some(outputs.clone()),
            4096 + 64,
            &src,
        )
        .unwrap();
        let mut cuda = WindowedCudaDevice::new(1, gpu, &plan, &slots, Box::new(forward)).unwrap();
        let mut rng = SplitMix64(5);
        for i in 0..3u64 {
            let prompt = (0..300 + rng.below(200)).map(|_| TokenId(rng.below(256) as u32));
            sched
                .submit(SubmitRequest::new(RequestId(i), prompt.collect(), 40))
                .unwrap();
        }
        let mut caught = None;
        let mut steps = 0;
        let mut drafts = HashMap::new();
        while sched.num_active() > 0 {
            steps += 1;
            let plan = sched.schedule(&drafts).unwrap();
            let a = host.execute_step(&plan).unwrap().sampling;
            let b = cuda.execute_step(&plan).map(|r| r.sampling);
            let o = outputs.lock().unwrap();
            let differs = o
                .tokens
                .iter()
                .any(|((d, id), m)| *d == 0 && o.tokens.get(&(1, *id)).is_some_and(|g| g != m));
            if b.as_ref() != Ok(&a) || differs {
                caught = Some(steps);
                break;
            }
            drop(o);
            let dsa_kv_device::Sampling::Sampled(a) = a else {
                panic!("the V4 forward samples")
            };
            sched.complete(plan.target_fence, None).unwrap();
            let fin = sched.commit(&a.outcomes).unwrap();
            drafts = a.drafts.into_iter().collect();
            let ids: Vec<_> = fin.iter().map(|f| f.id).collect();
            sched.finalize(&ids).unwrap();
        }
        let steps = caught.unwrap_or_else(|| panic!("mutation `{to}` not caught in {steps} steps"));
        eprintln!("mutation `{to}`: caught at step {steps}");
    }
}

/// A CUDA device built with fewer window slots than the manager hands out fails the step
/// with the host device's typed error, and it fails closed: every index is checked on
/// the host before its launch, so the failing launch writes nothing; here it is the
/// first layer's window rows, the step's first write, so not one pool byte was written.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn v4_cuda_device_with_fewer_slots_fails_closed_like_the_host() {
    use dsa_kv::ids::Tier;
    use dsa_kv_model::v4::cuda::v4_cuda_device;

    let (model, plan, slots) = setup();
    let mut sched = scheduler(&slots, &plan);
    let small = WindowedSlots {
        windows: vec![1, 300, 200],
        ..slots
    };
    let outputs = Arc::new(Mutex::new(V4Outputs::default()));
    let f = V4ModelForward::new(model.clone(), outputs.clone());
    let mut host = WindowedHostDevice::new(0, &plan, &small, Box::new(f)).unwrap();
    let gpu = dsa_kv::cuda::Gpu::open(0).expect("a CUDA device");
    let mut cuda =
        v4_cuda_device(1, gpu, &plan, &small, model.clone(), outputs, 4096 + 64).unwrap();
    let prompt = (0..200).map(TokenId).collect();
    sched
        .submit(SubmitRequest::new(RequestId(1), prompt, 2))
        .unwrap();
    let p = sched.schedule(&HashMap::new()).unwrap();
    let want = host.execute_step(&p).unwrap_err().to_string();
    let got = cuda.execute_step(&p).unwrap_err().to_string();
    for e in [&want, &got] {
        assert!(e.contains("fewer slots than the manager"), "{e}");
    }
    for (lc, l) in plan.life_cycles().iter().enumerate() {
        for pool in 0..l.pools.len() {
            let bytes = cuda.pools().download(lc, Tier::Gpu, pool).unwrap();
            assert!(
                bytes.iter().all(|&b| b == 0),
                "life cycle {lc}, pool {pool} written"
            );
        }
    }
    eprintln!("host: {want}\nCUDA: {got}");
}

/// A forward that reads nothing and samples token 1 (the configuration path's test).
struct Ones;

impl dsa_kv_device::Forward for Ones {
    fn forward(
        &mut self,
        batch: &mut dsa_kv_device::Batch<'_>,
    ) -> Result<dsa_kv_device::Sampling, dsa_kv_device::ForwardError> {
        assert!(batch.cache.windowed.is_some(), "a windowed batch");
        let outcomes = batch
            .requests
            .iter()
            .map(|p| RequestOutcome {
                id: p.id,
                accepted_drafts: 0,
                next_token: p.produces_token.then_some(TokenId(1)),
            })
            .collect();
        Ok(dsa_kv_device::Sampling::Sampled(
            dsa_kv_device::Sampled::new(outcomes),
        ))
    }
}

/// `preset = "deepseek-v4-flash"` in a configuration file starts the one runtime with
/// Flash's cache (43 layers' compressed blocks, window and state rings sized from the
/// budget), on the devices `windowed_backend` builds; a repeated prompt is served from
/// its tail, and the blocks it stored are KV events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v4_preset_in_the_configuration_starts_the_one_runtime() {
    let _beside = METRICS.read().await;
    let config = EngineConfig::from_toml_str(
        "[model]\npreset = \"deepseek-v4-flash\"\n\
         [kv_cache]\nmax_gpu_total_bytes = 1073741824\n\
         [scheduler]\nmax_num_sequences = 2\nmax_num_tokens = 512\nmax_prefill_chunk = 512\n\
         max_seq_len = 4096\n",
    )
    .unwrap();
    let backend: WindowedBackendFactory = Arc::new(|i, s: &WindowedSetup| {
        let d = WindowedHostDevice::new(i, &s.plan, &s.slots, Box::new(Ones))?;
        Ok(Box::new(d) as Box<dyn DeviceBackend>)
    });
    let kv = KvCacheBuilder::new()
        .config(config.clone())
        .host_devices(1)
        .windowed_backend(backend)
        .start()
        .await
        .unwrap();
    let info = kv.info().clone();
    assert_eq!(info.model, "DeepSeek-V4-Flash");
    assert_eq!(info.window_slots.len(), 3, "window, state4, state128 rings");
    assert!(info.budget.slots > 0 && info.budget.allocated_bytes <= 1 << 30);
    // The runtime's pools are what the planner (`plan --model deepseek-v4-flash`)
    // computes for the same configuration.
    let spec = config.model.windowed_spec().unwrap().unwrap();
    let planned = WindowedCapacityPlan::new(
        V4Plan::new(&spec).unwrap(),
        V4Demand::of_config(&config, &spec, 16).unwrap(),
        &config.kv_cache,
        None,
    )
    .unwrap();
    assert_eq!(info.budget, planned.gpu);
    let rings: Vec<u64> = info.window_slots.iter().map(|&n| u64::from(n)).collect();
    assert_eq!(rings, planned.capacity.slots[1..]);
    let prompt: Vec<TokenId> = (0..600).map(TokenId).collect();
    let mut reused = Vec::new();
    for id in [1, 2] {
        kv.submit(SubmitRequest::new(RequestId(id), prompt.clone(), 2))
            .await
            .unwrap();
        loop {
            let rep = kv.step(Drafts::none()).await.unwrap();
            let done = rep.committed.map(|c| c.finished).unwrap_or_default();
            if let Some(f) = done.first() {
                assert_eq!(f.finished.output(), vec![TokenId(1); 2]);
                reused.push(f.finished.reused_tokens);
                break;
            }
        }
    }
    assert_eq!(
        reused,
        [0, 512],
        "the repeat resumes at its last whole block"
    );
    let st = kv.stats().await.unwrap();
    assert!(st.events.stored >= 2, "{:?}", st.events);
    kv.shutdown().await;
}

/// A checkpoint model's run through the paged runtime on one host device.
struct CheckpointRun {
    prompts: HashMap<RequestId, Vec<u32>>,
    got: HashMap<RequestId, Vec<u32>>,
    /// Per request: tokens reused at its admission.
    reused: HashMap<RequestId, u64>,
    preempted: usize,
    copies: u64,
    accepted: u64,
    outputs: Arc<Mutex<V4Outputs>>,
    stats: RuntimeStats,
}

/// Runs `waves` of prompts (each wave after the one before has finished; request ids
/// `10 · wave + i`) through the paged runtime with `max_new` tokens each: chunks of
/// `chunk`, `drafts` MTP drafts (0: off), a GPU tier of `gpu_blocks` and a host tier.
async fn run_checkpoint(
    model: &Arc<V4Model>,
    waves: Vec<Vec<Vec<u32>>>,
    max_new: u32,
    chunk: u32,
    drafts: u32,
    gpu_blocks: u32,
) -> CheckpointRun {
    let outputs = Arc::new(Mutex::new(V4Outputs::default()));
    let spec = model.config().spec().unwrap();
    let mut w = WindowedModel::new(spec.clone(), host_backend(model, &outputs));
    let mut windows = vec![14, 300, 200];
    if spec.mtp_input_width > 0 {
        // 1-token pages: each sequence's step writes up to a chunk's positions.
        windows.push(4 * (chunk + drafts + 2));
    }
    w.slots = Some(WindowedSlots {
        blocks: TierSlots {
            gpu: vec![gpu_blocks],
            host: vec![24],
        },
        windows,
    });
    let mut c = EngineConfig::default();
    c.kv_cache.max_gpu_total_bytes = Some(256 << 20);
    c.scheduler.max_num_sequences = 3;
    c.scheduler.max_prefill_chunk = chunk;
    c.scheduler.max_num_tokens = 2 * chunk + 6;
    c.scheduler.max_seq_len = 8192;
    if drafts > 0 {
        c.spec_decode.mode = SpecMode::Mtp;
        c.spec_decode.draft_tokens = drafts;
    }
    let kv = KvCacheBuilder::new()
        .config(c)
        .host_devices(1)
        .windowed(w)
        .start()
        .await
        .unwrap();
    let mut run = CheckpointRun {
        prompts: HashMap::new(),
        got: HashMap::new(),
        reused: HashMap::new(),
        preempted: 0,
        copies: 0,
        accepted: 0,
        outputs: outputs.clone(),
        stats: RuntimeStats::default(),
    };
    for (wi, wave) in waves.into_iter().enumerate() {
        let mut ids = Vec::new();
        for (i, p) in wave.into_iter().enumerate() {
            let id = RequestId(wi as u64 * 10 + i as u64);
            let toks = p.iter().map(|&t| TokenId(t)).collect();
            kv.submit(SubmitRequest::new(id, toks, max_new))
                .await
                .unwrap();
            run.prompts.insert(id, p);
            ids.push(id);
        }
        let mut steps = 0;
        while ids.iter().any(|id| !run.got.contains_key(id)) {
            steps += 1;
            assert!(steps < 5_000, "wave {wi} does not finish");
            let rep = kv.step(Drafts::none()).await.unwrap();
            assert!(rep.failed.is_empty(), "{:?}", rep.failed);
            run.preempted += rep.preempted.len();
            run.copies += rep.devices[0].slot_copies;
            run.accepted += rep
                .outcomes
                .iter()
                .map(|o| u64::from(o.accepted_drafts))
                .sum::<u64>();
            let Some(done) = rep.committed else { continue };
            for f in done.finished {
                let f = f.finished;
                run.reused.insert(f.id, f.reused_tokens);
                run.got
                    .insert(f.id, f.output().iter().map(|t| t.0).collect());
            }
        }
    }
    kv.step(Drafts::none()).await.unwrap();
    run.stats = kv.stats().await.unwrap();
    kv.shutdown().await;
    run
}

/// Checks every request of `run` against `model` run alone on a contiguous cache: its
/// tokens, every recorded position's output and every step's MTP proposals and their
/// logits (made again there by the unpaged model from the same hidden state and sampled
/// token), bit for bit. Returns (positions, proposals) checked.
fn check_against_unpaged(model: &V4Model, run: &CheckpointRun, max_new: u32) -> (usize, usize) {
    let out = run.outputs.lock().unwrap();
    assert!(out.conflicts.is_empty(), "{:?}", out.conflicts);
    let (mut positions, mut proposals) = (0, 0);
    for (id, p) in &run.prompts {
        let g = model.generate(p, max_new).unwrap();
        assert_eq!(run.got[id], g.tokens, "request {id}: tokens");
        for (&pos, o) in &out.tokens[&(0, *id)] {
            assert_eq!(*o, g.outputs[pos as usize], "request {id}, position {pos}");
            positions += 1;
        }
        let Some(drafts) = out.drafts.get(&(0, *id)) else {
            continue;
        };
        let seq: Vec<u32> = p.iter().chain(&g.tokens).copied().collect();
        let mut kv = V4Contiguous::new();
        let (_, hidden) = model.run_hidden(&mut kv, 0, &seq).unwrap();
        model.draft_write(&mut kv, 0, &seq, &hidden).unwrap();
        for (&last, (d, bits)) in drafts {
            let l = last as usize;
            let want = model
                .propose_logits(&kv, last, &hidden[l], seq[l + 1], d.len())
                .unwrap();
            let tokens: Vec<u32> = want.iter().map(|w| w.0).collect();
            assert_eq!(*d, tokens, "request {id}: proposals at {last}");
            let want_bits: Vec<u32> = want
                .iter()
                .flat_map(|w| w.1.iter().map(|v| v.to_bits()))
                .collect();
            assert!(
                *bits == want_bits,
                "request {id}: proposals' logits at {last}"
            );
            proposals += 1;
        }
    }
    (positions, proposals)
}

/// The transformers `DeepseekV4ForCausalLM` checkpoint of `tests/fixtures/hf/deepseek_v4`
/// (`V4Model::from_checkpoint`: window-only, ratio-4 with its indexer and ratio-128
/// layers, hyper-connections, hash-routed and top-k experts, YaRN; no MTP layer:
/// transformers builds none) through the paged runtime: chunked prefill at an odd chunk
/// (97 tokens), a GPU tier of 4 blocks and a host tier, prefix hits at window tails, a
/// preemption. Every request's tokens and every position's logits equal the checkpoint
/// model run alone on a contiguous cache, bit for bit; and at the fixture's own prompts,
/// where transformers' indexer selects every visible entry, our greedy token is
/// transformers' at ≥ 90 % of the positions (the bound and its reason are the oracle
/// test's: `crates/dsa-kv-model/tests/hf_checkpoint_v4.rs`, which also bounds the logits
/// by the cache formats' rounding; paged equal to unpaged carries that bound here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transformers_v4_checkpoint_runs_through_the_paged_runtime() {
    let _beside = METRICS.read().await;
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/deepseek_v4");
    let model = Arc::new(V4Model::from_checkpoint(&dir).unwrap());
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let list = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as u32)
            .collect()
    };
    let hf: Vec<(Vec<u32>, Vec<u32>)> = reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (list(&p["tokens"]), list(&p["argmax"])))
        .collect();
    assert_eq!(hf.iter().map(|p| p.0.len()).collect::<Vec<_>>(), [90, 400]);
    // Wave 1: the fixture's prompts and two longer ones (pressure); wave 2: the 400-token
    // prompt again and extended (hits at its tail at 256), and another long one.
    let mut rng = SplitMix64(11);
    let mut long = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.below(256) as u32).collect() };
    let extended: Vec<u32> = hf[1].0.iter().copied().chain(long(70)).collect();
    let waves = vec![
        vec![hf[0].0.clone(), hf[1].0.clone(), long(700), long(530)],
        vec![hf[1].0.clone(), extended, long(610)],
    ];
    const MAX_NEW: u32 = 6;
    let run = run_checkpoint(&model, waves, MAX_NEW, 97, 0, 4).await;
    let (positions, _) = check_against_unpaged(&model, &run, MAX_NEW);
    let out = run.outputs.lock().unwrap();
    // transformers' greedy tokens at the fixture prompts' dense positions (wave 1 runs
    // them from position 0).
    let (mut n, mut same) = (0, 0);
    for (i, (tokens, argmax)) in hf.iter().enumerate() {
        let recorded = &out.tokens[&(0, RequestId(i as u64))];
        for q in (0..tokens.len()).filter(|&q| (q + 1) / 4 <= 64) {
            let o = recorded[&(q as u32)];
            n += 1;
            same += usize::from(o.greedy == argmax[q]);
        }
    }
    let reuse_wave2: u64 = (10..13).map(|i| run.reused[&RequestId(i)]).sum();
    eprintln!(
        "checkpoint through the runtime: {positions} positions bit-exact, transformers' greedy \
         token at {same} of {n} dense positions, {} preemptions, {} slot copies, \
         {reuse_wave2} tokens reused in wave 2",
        run.preempted, run.copies
    );
    assert!(same as f64 >= 0.9 * n as f64, "{same} of {n}");
    assert!(reuse_wave2 >= 2 * 256, "hits at the tail: {reuse_wave2}");
    assert!(run.preempted > 0, "a preemption");
    assert!(run.copies > 0, "host-tier traffic");
}

fn mtp_fixture() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/deepseek_v4_mtp")
}

/// The Flash-pattern checkpoint with the published MTP layer
/// (`tests/fixtures/hf/deepseek_v4_mtp`, checked against transformers' modules by
/// `crates/dsa-kv-model/tests/hf_checkpoint_v4.rs`) through the paged runtime with 3
/// MTP drafts: chunks of 97, repeats and extensions of earlier prompts that resume at
/// block tails (the MTP row after the boundary reads the target's streams kept in the
/// tail), a preemption and host-tier traffic. Every token, every position's logits and
/// every step's proposals equal the model run alone on a contiguous cache, bit for bit,
/// drafts are accepted, and the tail hits lose nothing to the MTP layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_mtp_drafts_through_the_paged_runtime_are_exact() {
    let _beside = METRICS.read().await;
    let model = Arc::new(V4Model::from_checkpoint(&mtp_fixture()).unwrap());
    assert!(model.config().mtp);
    let mut rng = SplitMix64(12);
    let mut long = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.below(256) as u32).collect() };
    let (a, b) = (long(300), long(600));
    let a_longer: Vec<u32> = a.iter().copied().chain(long(45)).collect();
    let waves = vec![
        vec![a.clone(), b.clone(), long(530)],
        vec![a.clone(), a_longer, b.clone(), long(410)],
    ];
    const MAX_NEW: u32 = 12;
    let run = run_checkpoint(&model, waves, MAX_NEW, 97, 3, 4).await;
    let (positions, proposals) = check_against_unpaged(&model, &run, MAX_NEW);
    let hits: Vec<u64> = (10..13).map(|i| run.reused[&RequestId(i)]).collect();
    eprintln!(
        "published MTP through the runtime: {positions} positions and {proposals} proposals \
         bit-exact, {} drafts accepted, reuse in wave 2 {hits:?}, {} preemptions, {} slot \
         copies",
        run.accepted, run.preempted, run.copies
    );
    // 300 → its block at 256; 345 → 256; 600 → 512: no block lost to the MTP layer.
    assert_eq!(hits, [256, 256, 512]);
    assert!(proposals > 20 && run.accepted > 0);
    assert!(run.preempted > 0, "a preemption");
    assert!(run.copies > 0, "host-tier traffic");
    let w = run.stats.windows.expect("windowed counters");
    assert!(w.windows.tails_adopted >= 3, "{w:?}");
}

/// Prefix hits with the published MTP at any prompt length (the hit-loss table of
/// `benches/results/2026-12-08-v4-mtp-hits`): a prompt of 257, 300, 511, 700 or 4,097
/// tokens, then the same prompt again, with 3 MTP drafts and without. The repeat
/// reuses every whole block below its last token in both (256 · ⌊(L − 1) / 256⌋: the
/// MTP layer costs no block), and with MTP its tokens, logits and proposals (the first
/// ones right after the hit included) equal the unpaged model's, bit for bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtp_prefix_hits_lose_no_block_at_any_prompt_length() {
    let _beside = METRICS.read().await;
    let model = Arc::new(V4Model::from_checkpoint(&mtp_fixture()).unwrap());
    let mut rng = SplitMix64(13);
    let mut rows = Vec::new();
    for len in [257usize, 300, 511, 700, 4097] {
        let prompt: Vec<u32> = (0..len).map(|_| rng.below(256) as u32).collect();
        let mut reuse = [0u64; 2];
        let mut after_hit = 0;
        for (i, drafts) in [3u32, 0].into_iter().enumerate() {
            let waves = vec![vec![prompt.clone()], vec![prompt.clone()]];
            const MAX_NEW: u32 = 8;
            let run = run_checkpoint(&model, waves, MAX_NEW, 200, drafts, 24).await;
            reuse[i] = run.reused[&RequestId(10)];
            if drafts > 0 {
                // (The run without drafts is the other tests' case.)
                check_against_unpaged(&model, &run, MAX_NEW);
                let out = run.outputs.lock().unwrap();
                let d = &out.drafts[&(0, RequestId(10))];
                // The repeat's first proposals: at its last prompt position, right after
                // the hit (checked bit for bit above).
                assert!(
                    d.contains_key(&(len as u32 - 1)),
                    "{len}: proposals after the hit"
                );
                after_hit = d.len();
            }
        }
        let want = 256 * ((len as u64 - 1) / 256);
        assert_eq!(
            reuse,
            [want, want],
            "prompt of {len}: reuse with MTP, without"
        );
        rows.push(format!(
            "| {len} | {} | {} | {} | {after_hit} |",
            reuse[0],
            reuse[1],
            reuse[1] - reuse[0]
        ));
    }
    eprintln!(
        "| prompt | reused, MTP on | reused, MTP off | lost to MTP | proposals checked on the repeat |\n|---|---|---|---|---|\n{}",
        rows.join("\n")
    );
}
