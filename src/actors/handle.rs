//! The public entry point: [`KvCacheBuilder`] → `start().await` → [`KvCacheHandle`].
//!
//! What the handle offers, by group:
//!
//! * **The engine loop**, on the handle: [`submit`](KvCacheHandle::submit),
//!   [`step`](KvCacheHandle::step) / [`commit`](KvCacheHandle::commit) (or
//!   [`commit_and_step`](KvCacheHandle::commit_and_step), one round trip),
//!   [`pending_step`](KvCacheHandle::pending_step), [`wait`](KvCacheHandle::wait),
//!   [`cancel`](KvCacheHandle::cancel), [`suspend`](KvCacheHandle::suspend) /
//!   [`resume`](KvCacheHandle::resume), [`synchronize`](KvCacheHandle::synchronize),
//!   [`shutdown`](KvCacheHandle::shutdown).
//! * **What the cache holds and how it runs**, on the handle:
//!   [`info`](KvCacheHandle::info), [`stats`](KvCacheHandle::stats),
//!   [`history`](KvCacheHandle::history), [`counters`](KvCacheHandle::counters) (no
//!   round trip), [`quota`](KvCacheHandle::quota),
//!   [`probe_reuse`](KvCacheHandle::probe_reuse),
//!   [`reset_prefix_cache`](KvCacheHandle::reset_prefix_cache).
//! * **Events**, `kv.events()` ([`Events`]): the router event stream
//!   ([`subscribe`](Events::subscribe), [`router_snapshot`](Events::router_snapshot))
//!   and the crate's own KV events ([`take`](Events::take)).
//! * **KV between engines**, `kv.transfer()` ([`Transfers`](super::Transfers)): export,
//!   import, leases.
//! * Feature `testing`: `bindings`, `check_invariants`, `cache_digests` (what tests and
//!   the examples' self-checks read); feature `fault-injection`: the fault drills.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kameo::actor::{ActorRef, Spawn};
use kameo::mailbox;
use serde::Serialize;
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::oneshot;
use tracing::field::Empty;

#[cfg(feature = "testing")]
use super::coordinator::{CacheCounts, CheckInvariants};
use super::coordinator::{
    Cancel, Commit, CommitAndStep, CommitAndStepReport, CommitReport, Coordinator, CoordinatorArgs,
    Devices, Drafts, FinishedReport, GetHistory, GetStats, Pause, PendingStep, Step, StepReport,
    Submit, TakeEvents, Watch,
};
#[cfg(feature = "testing")]
use super::device::CacheDigest;
use super::device::{DeviceActor, DeviceArgs, Synchronize};
use super::draft::DraftReplayActor;
use super::error::RuntimeError;
#[cfg(feature = "fault-injection")]
use super::faults::{DeviceFault, InjectFault};
use super::shared::{LiveCounters, RuntimeShared};
use super::stats::{HistoryChunk, RuntimeStats};
use super::transfer::Transfers;
use dsa_kv_core::config::{DsaModel, EngineConfig};
use dsa_kv_core::core::quota::{CapacityPlan, GpuBudget};
use dsa_kv_core::core::scheduler::{RequestOutcome, Scheduler, SchedulerLimits, SubmitRequest};
use dsa_kv_core::core::{KvCacheManager, KvEvent, ManagerOptions, TierSlots};
use dsa_kv_core::ids::{RequestId, TokenId};
use dsa_kv_core::layout::{LayoutKind, PoolPlan};
use dsa_kv_core::metadata::MetadataDims;
use dsa_kv_device::{
    BackendFactory, DeviceBackend, DeviceSetup, HostDevice, Verification, VerifiedLayers,
};
use dsa_kv_device::{ForwardFactory, KvSource, SyntheticKv};

/// The largest mailbox [`KvCacheBuilder`] accepts (messages).
const MAX_MAILBOX: usize = 1 << 16;

/// Builds and starts a runtime.
///
/// ```
/// use dsa_kv::actors::KvCacheBuilder;
/// use dsa_kv::config::EngineConfig;
/// use dsa_kv::core::scheduler::{RequestOutcome, SubmitRequest};
/// use dsa_kv::core::ReuseScope;
/// use dsa_kv::ids::{RequestId, TokenId};
///
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
/// # async fn main() -> Result<(), dsa_kv::actors::RuntimeError> {
/// let mut config = EngineConfig::default();
/// config.model.num_layers = Some(2); // a small DeepSeek-V3.2-shaped model
/// config.kv_cache.max_tokens = Some(4096);
/// let kv = KvCacheBuilder::new().config(config).start().await?;
///
/// let prompt: Vec<TokenId> = (0..100).map(TokenId).collect();
/// let id = RequestId(1);
/// kv.submit(SubmitRequest { id, scope: ReuseScope::SHARED, prompt, max_new_tokens: 3, priority: 35 }).await?;
/// let waiter = { let kv = kv.clone(); tokio::spawn(async move { kv.wait(id).await }) };
/// // The engine loop: schedule and run a step on every device, then commit what the model sampled.
/// for step in 0.. {
///     let report = kv.step(dsa_kv::actors::Drafts::none()).await?;
///     let outcomes = report.scheduled.iter()
///         .map(|r| RequestOutcome { id: r.id, accepted_drafts: 0, next_token: r.produces_token.then_some(TokenId(7)) })
///         .collect();
///     if kv.commit(outcomes).await?.finished.len() == 1 { break; }
///     assert!(step < 10);
/// }
/// let done = waiter.await.unwrap()?;
/// assert_eq!(done.finished.generated, 3);
/// assert!(done.mismatches.is_empty()); // every byte read back through the page tables
/// kv.shutdown().await;
/// # Ok(()) }
/// ```
pub struct KvCacheBuilder {
    backend: Option<BackendFactory>,
    pub(super) config: EngineConfig,
    model: Option<DsaModel>,
    pub(super) devices: Option<usize>,
    pub(super) windowed: Option<super::windowed::WindowedModel>,
    pub(super) windowed_backend: Option<super::windowed::WindowedBackendFactory>,
    source: Arc<dyn KvSource>,
    verify: Option<Verification>,
    forward: Option<ForwardFactory>,
    device_mailbox: usize,
    coordinator_mailbox: usize,
    event_capacity: usize,
    event_stream_capacity: usize,
    fp8_tensor_scale: f32,
    idle_spin: Duration,
}

impl Default for KvCacheBuilder {
    fn default() -> Self {
        Self::new()
    }
}

/// What a started runtime looks like.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RuntimeInfo {
    /// Model name.
    pub model: String,
    /// V1 or V2.
    pub layout: LayoutKind,
    /// Bytes per token of the target manager (MLA + indexer, all its layers).
    pub bytes_per_token: u64,
    /// The GPU budget and slots per pool group.
    pub budget: GpuBudget,
    /// Host slots per pool group (0: no host tier).
    pub host_slots: u64,
    /// Devices (tensor-parallel ranks).
    pub devices: usize,
    /// A separate draft cache with draft replay.
    pub draft_cache: bool,
    /// Draft tokens per decode step.
    pub draft_tokens: u32,
    /// Layers verification reads in each cache (a finished request is read back on
    /// these layers at every position, on every device).
    pub verified_layers: VerifiedLayers,
    /// Slots per window life cycle of a model with sliding windows (empty otherwise).
    pub window_slots: Vec<u32>,
    /// Configuration warnings.
    pub warnings: Vec<String>,
}

impl KvCacheBuilder {
    /// Defaults: `EngineConfig::default()`, devices = `parallel.tp_size`, the synthetic
    /// KV source, sampled verification, device mailboxes of 4 steps, a coordinator
    /// mailbox of 64 messages.
    pub fn new() -> Self {
        KvCacheBuilder {
            backend: None,
            config: EngineConfig::default(),
            model: None,
            devices: None,
            windowed: None,
            windowed_backend: None,
            source: Arc::new(SyntheticKv { seed: 0 }),
            verify: None,
            forward: None,
            device_mailbox: 4,
            coordinator_mailbox: 64,
            event_capacity: super::coordinator::EVENT_CAPACITY,
            event_stream_capacity: super::event_stream::EVENT_STREAM_CAPACITY,
            fp8_tensor_scale: 1.0 / 32.0,
            idle_spin: Duration::ZERO,
        }
    }

    /// The engine configuration.
    pub fn config(mut self, config: EngineConfig) -> Self {
        self.config = config;
        self
    }

    /// A model built in code (overrides `config.model`).
    pub fn model(mut self, model: DsaModel) -> Self {
        self.model = Some(model);
        self
    }

    /// Host-backend devices (tensor-parallel ranks); default `parallel.tp_size`.
    pub fn host_devices(mut self, n: usize) -> Self {
        self.devices = Some(n);
        self
    }

    /// Where the synthetic writer's KV comes from (default [`SyntheticKv`] with seed 0).
    pub fn kv_source(mut self, source: Arc<dyn KvSource>) -> Self {
        self.source = source;
        self
    }

    /// Whether, and on which layers, cached KV is read back and checked (default:
    /// [`Verification::Sample`] with the synthetic writer, [`Verification::Off`] with a
    /// framework forward, which cannot be verified).
    pub fn verification(mut self, v: Verification) -> Self {
        self.verify = Some(v);
        self
    }

    /// The framework's model: each device builds its [`Forward`](dsa_kv_device::Forward)
    /// with `factory` and runs it once per step (default: the synthetic writer,
    /// each backend's own: [`SyntheticWriter`](dsa_kv_device::synthetic::SyntheticWriter) on the
    /// host).
    pub fn forward(mut self, factory: ForwardFactory) -> Self {
        self.forward = Some(factory);
        self
    }

    /// How device backends are built (default: [`HostDevice`]). The CUDA backend, or a
    /// test double, plugs in here.
    pub fn backend(mut self, factory: BackendFactory) -> Self {
        self.backend = Some(factory);
        self
    }

    /// Mailbox capacity of each device actor, in steps (backpressure).
    pub fn device_mailbox(mut self, n: usize) -> Self {
        self.device_mailbox = n.max(1);
        self
    }

    /// Batches the router event stream keeps for a slow subscriber (default 8,192,
    /// rounded up to a power of two); one that falls further behind gets
    /// [`StreamItem::Lost`](super::StreamItem::Lost).
    pub fn event_stream_capacity(mut self, n: usize) -> Self {
        self.event_stream_capacity = n.max(1);
        self
    }

    /// Untaken KV events the runtime keeps (default 65,536); older ones are dropped and
    /// counted (`stats().events.lost`, `EventSnapshot::lost`).
    pub fn event_capacity(mut self, n: usize) -> Self {
        self.event_capacity = n.max(1);
        self
    }

    /// Mailbox capacity of the coordinator.
    pub fn coordinator_mailbox(mut self, n: usize) -> Self {
        self.coordinator_mailbox = n.max(1);
        self
    }

    /// How long a device actor's thread keeps polling its mailbox after a message, and
    /// the coordinator keeps polling for the devices' replies, before parking (default:
    /// zero, park at once). Polling trades CPU for latency: a step that arrives while the
    /// device thread polls costs no futex wake-up on either side, which is most of the
    /// runtime's per-step cost on a many-core host (`BENCHMARKS.md`). Each device thread
    /// then keeps a core busy for up to this long after every step, and the coordinator's
    /// worker for up to this long per step; worth it only with a core per device to
    /// spare. Set it a little above the host time between two steps (scheduling and
    /// commit: ~150 µs for 256 decoding sequences) for the whole benefit.
    pub fn idle_spin(mut self, spin: Duration) -> Self {
        self.idle_spin = spin;
        self
    }

    /// Validates everything (the configuration, and the builder's own sizes against
    /// [`config::limits`](dsa_kv_core::config::limits) and a mailbox limit of 65,536), sizes the
    /// pools, spawns the actors.
    #[tracing::instrument(name = "start", level = "info", skip_all)]
    pub async fn start(self) -> Result<KvCacheHandle, RuntimeError> {
        let rt = Handle::try_current().map_err(|_| RuntimeError::NoTokioRuntime)?;
        if matches!(rt.runtime_flavor(), RuntimeFlavor::CurrentThread) {
            return Err(RuntimeError::CurrentThreadRuntime);
        }
        if let Some(model) = self.windowed.clone() {
            return self.start_windowed(model).await;
        }
        if let Some(spec) = self.config.model.windowed_spec()? {
            let backend = match (&self.windowed_backend, &self.backend, &self.forward) {
                (Some(b), _, _) => b.clone(),
                // The host backend's default, as the synthetic writer is for DSA models:
                // host devices whose forward writes nothing (the engine samples).
                (None, None, None) => super::windowed::host_windowed_backend(),
                (None, _, _) => {
                    return Err(RuntimeError::Config(
                        dsa_kv_core::config::ConfigError::Invalid {
                            field: "model.preset",
                            value: self.config.model.preset.name().into(),
                            why: "a model with sliding windows runs on windowed devices, not on \
                                  a DSA backend or forward: give them with \
                                  KvCacheBuilder::windowed_backend"
                                .into(),
                        },
                    ))
                }
            };
            return self
                .start_windowed(super::windowed::WindowedModel::new(spec, backend))
                .await;
        }
        let verify = match (&self.forward, self.verify) {
            (Some(_), Some(v)) if v.is_on() => {
                return Err(RuntimeError::VerifyNeedsSyntheticWriter { verify: v })
            }
            (Some(_), _) => Verification::Off,
            (None, v) => v.unwrap_or(Verification::Sample),
        };
        // `None`: every backend builds its own synthetic writer of `source`.
        let forward = self.forward.clone();
        let resolved = match self.model.clone() {
            Some(m) => self.config.resolve_with(m)?,
            None => self.config.resolve()?,
        };
        let c = &self.config;
        let devices = self.devices.unwrap_or(c.parallel.tp_size as usize);
        if devices == 0 {
            return Err(RuntimeError::NoDevices);
        }
        // The builder's own sizes, bounded like the configuration's before anything is
        // allocated from them.
        for (setting, value, max) in [
            (
                "host_devices",
                devices,
                dsa_kv_core::config::limits::MAX_DEVICES as usize,
            ),
            ("device_mailbox", self.device_mailbox, MAX_MAILBOX),
            ("coordinator_mailbox", self.coordinator_mailbox, MAX_MAILBOX),
            ("event_stream_capacity", self.event_stream_capacity, 1 << 20),
            ("event_capacity", self.event_capacity, 1 << 24),
        ] {
            if value > max {
                return Err(RuntimeError::BadSetting {
                    setting,
                    value: value as u64,
                    max: max as u64,
                });
            }
        }
        let t = c.kv_cache.tokens_per_block;
        // One budget pays for the target and the separate draft cache (same slot counts);
        // the host backend has no device memory to measure.
        let capacity = CapacityPlan::new(&resolved, None)?;
        let budget = capacity.gpu;
        let CapacityPlan {
            target: target_plan,
            draft: draft_plan,
            ..
        } = capacity;
        let groups = target_plan.pool_groups().len();
        let gpu = u32::try_from(budget.slots).map_err(|_| RuntimeError::TooManySlots {
            slots: budget.slots,
            max: u64::from(u32::MAX),
        })?;
        let host = u32::try_from(capacity.host_slots).map_err(|_| RuntimeError::TooManySlots {
            slots: capacity.host_slots,
            max: u64::from(u32::MAX),
        })?;
        let slots = TierSlots {
            gpu: vec![gpu; groups],
            host: if host > 0 { vec![host; groups] } else { vec![] },
        };
        let opts = ManagerOptions {
            enable_block_reuse: resolved.enable_block_reuse,
            enable_partial_reuse: c.kv_cache.enable_partial_reuse,
            max_util_for_resume: c.kv_cache.max_util_for_resume,
            record_events: true,
        };
        let target = KvCacheManager::new(target_plan.clone(), slots.clone(), opts.clone())?;
        // The draft cache mirrors the target's decisions: same slot counts per group.
        let draft = match &draft_plan {
            Some(p) => {
                let dg = p.pool_groups().len();
                let ds = TierSlots {
                    gpu: vec![gpu; dg],
                    host: if host > 0 { vec![host; dg] } else { vec![] },
                };
                Some(KvCacheManager::new(p.clone(), ds, opts)?)
            }
            None => None,
        };
        let s = &c.scheduler;
        let max_context_kv = u32::try_from(
            (u64::from(s.max_num_sequences) * u64::from(s.max_seq_len))
                .min(u64::from(s.max_num_tokens).max(2 * u64::from(s.max_seq_len))),
        )
        .expect("invariant: resolve bounds max_num_tokens and max_seq_len well below 2^31");
        let limits = SchedulerLimits {
            max_num_sequences: s.max_num_sequences,
            max_num_tokens: s.max_num_tokens,
            max_prefill_chunk: s.max_prefill_chunk,
            max_seq_len: s.max_seq_len,
            draft_tokens: resolved.draft_tokens,
            livelock_steps: 10_000,
            max_context_kv_tokens: max_context_kv,
            transfer_lease: Duration::from_millis(c.transfer.lease_ms),
        };
        let sched = Scheduler::new(target, draft, limits);
        let blocks = (s.max_seq_len + resolved.draft_tokens + 1).div_ceil(t) as usize;
        let dims = MetadataDims {
            max_num_sequences: s.max_num_sequences as usize,
            max_blocks_per_seq: blocks.next_multiple_of(4),
            max_num_tokens: s.max_num_tokens as usize,
            max_context_kv_tokens: max_context_kv as usize,
        };
        // Each device holds the target pools and the draft pools: both count against
        // max_gpu_total_bytes when it is set.
        let quota_cap = c.kv_cache.max_gpu_total_bytes.unwrap_or(u64::MAX);
        let shared = Arc::new(RuntimeShared::new(devices, quota_cap));
        shared
            .quota
            .try_reserve("the target cache", budget.target_bytes)?;
        if draft_plan.is_some() {
            shared
                .quota
                .try_reserve("the separate draft cache", budget.draft_bytes)?;
        }
        // Every backend is built (pools allocated) before any actor starts: a failure
        // leaves nothing running.
        let mut backends = Vec::with_capacity(devices);
        for i in 0..devices {
            let setup = DeviceSetup {
                model: resolved.model.clone(),
                target_plan: target_plan.clone(),
                target_slots: (slots.gpu.clone(), slots.host.clone()),
                draft_plan: draft_plan.clone(),
                dims: (dims, draft_plan.as_ref().map(|_| dims)),
                source: self.source.clone(),
                verify,
                forward: forward.clone(),
                fp8_tensor_scale: self.fp8_tensor_scale,
            };
            let dev: Box<dyn DeviceBackend> = match &self.backend {
                Some(f) => f(i, setup)?,
                None => Box::new(HostDevice::new(i, setup)?),
            };
            backends.push(dev);
        }
        let (coordinator, draft_actor) = self
            .spawn_actors(sched, backends, shared.clone(), draft_plan.is_some(), None)
            .await?;
        let count = |p: &PoolPlan| {
            let all: Vec<_> = p.layer_ids().collect();
            (verify.select(&all).len(), all.len())
        };
        let verified_layers = VerifiedLayers {
            target: count(&target_plan),
            draft: draft_plan.as_ref().map(count),
        };
        let info = RuntimeInfo {
            model: resolved.model.spec().name.clone(),
            layout: resolved.layout,
            bytes_per_token: target_plan.cache_bytes_per_token(),
            budget,
            host_slots: u64::from(host),
            devices,
            draft_cache: draft_plan.is_some(),
            draft_tokens: resolved.draft_tokens,
            verified_layers,
            window_slots: Vec::new(),
            warnings: resolved.warnings,
        };
        tracing::info!(?info, "dsa-kv runtime started");
        Ok(KvCacheHandle::from_parts(
            coordinator,
            draft_actor,
            info,
            shared,
        ))
    }

    /// Spawns one device actor per backend (own thread), the draft-replay actor when
    /// there is a separate draft cache, and the coordinator over `sched`; waits for the
    /// coordinator to start.
    #[allow(clippy::type_complexity)]
    pub(super) async fn spawn_actors(
        &self,
        sched: Scheduler,
        backends: Vec<Box<dyn DeviceBackend>>,
        shared: Arc<RuntimeShared>,
        draft_cache: bool,
        windowed: Option<dsa_kv_core::layout::V4Plan>,
    ) -> Result<(ActorRef<Coordinator>, Option<ActorRef<DraftReplayActor>>), RuntimeError> {
        let refs: Vec<_> = backends
            .into_iter()
            .map(|backend| {
                DeviceActor::spawn_in_thread_with_mailbox(
                    DeviceArgs {
                        backend,
                        shared: shared.clone(),
                        idle_spin: self.idle_spin,
                    },
                    mailbox::bounded(self.device_mailbox),
                )
            })
            .collect();
        let draft_actor = draft_cache.then(|| DraftReplayActor::spawn(refs.clone()));
        let coordinator = Coordinator::spawn_with_mailbox(
            CoordinatorArgs {
                sched,
                devices: refs,
                draft: draft_actor.clone(),
                windowed,
                shared,
                event_capacity: self.event_capacity,
                event_stream_capacity: self.event_stream_capacity,
                idle_spin: self.idle_spin,
            },
            mailbox::bounded(self.coordinator_mailbox),
        );
        coordinator
            .wait_for_startup_result()
            .await
            .map_err(|e| RuntimeError::StartFailed {
                actor: "coordinator",
                reason: format!("{e:?}"),
            })?;
        Ok((coordinator, draft_actor))
    }
}

/// A cheap-to-clone handle to a running runtime.
#[derive(Clone)]
pub struct KvCacheHandle {
    pub(super) coordinator: ActorRef<Coordinator>,
    draft: Option<ActorRef<DraftReplayActor>>,
    info: Arc<RuntimeInfo>,
    shared: Arc<RuntimeShared>,
}

impl KvCacheHandle {
    pub(super) fn from_parts(
        coordinator: ActorRef<Coordinator>,
        draft: Option<ActorRef<DraftReplayActor>>,
        info: RuntimeInfo,
        shared: Arc<RuntimeShared>,
    ) -> Self {
        KvCacheHandle {
            coordinator,
            draft,
            info: Arc::new(info),
            shared,
        }
    }

    /// Live counters, read without a round trip through the coordinator's mailbox (a
    /// consistent snapshot: `submitted = finished + failed + in_flight`).
    pub fn counters(&self) -> LiveCounters {
        use super::shared::counter::*;
        let c = self.shared.counters.snapshot();
        LiveCounters {
            submitted: c[SUBMITTED],
            finished: c[FINISHED],
            failed: c[FAILED],
            in_flight: c[SUBMITTED].saturating_sub(c[FINISHED] + c[FAILED]),
            steps: c[STEPS],
            completed_fence: self.shared.fences.all_completed(),
        }
    }

    /// The metadata set device `index` has bound now (target, or draft during a
    /// replay), as its kernel launcher sees it; `None` before its first step.
    #[cfg(feature = "testing")]
    pub fn bindings(&self, index: usize) -> Option<dsa_kv_core::metadata::Bindings> {
        self.shared.bindings.get(index).and_then(|p| *p.load())
    }

    /// GPU bytes per device reserved by the target and draft caches, and the budget
    /// (`u64::MAX` when `max_gpu_total_bytes` is not set).
    pub fn quota(&self) -> (u64, u64) {
        (self.shared.quota.used(), self.shared.quota.capacity())
    }

    /// What the runtime was started with.
    pub fn info(&self) -> &RuntimeInfo {
        &self.info
    }

    /// The router event stream and the crate's own KV events:
    /// `kv.events().subscribe()`, `kv.events().take()`, … ([`Events`]).
    pub fn events(&self) -> Events<'_> {
        Events { kv: self }
    }

    /// KV pages between engines: `kv.transfer().export(…)`, `kv.transfer().begin_import(…)`,
    /// … ([`Transfers`]).
    pub fn transfer(&self) -> Transfers<'_> {
        Transfers { kv: self }
    }

    /// Admits a request; returns the prompt tokens a probe finds cached now.
    #[tracing::instrument(level = "debug", skip_all, fields(request = %r.id, prompt_tokens = r.prompt.len(), max_new_tokens = r.max_new_tokens))]
    pub async fn submit(&self, r: SubmitRequest) -> Result<u64, RuntimeError> {
        Ok(self.coordinator.ask(Submit(r)).await?)
    }

    /// Plans one step and runs it on every device (`drafts`: each decoding request's
    /// draft tokens, [`Drafts::none`] without).
    #[tracing::instrument(level = "debug", skip_all, fields(drafts = Empty, step = Empty, scheduled = Empty))]
    pub async fn step(&self, drafts: impl Into<Drafts>) -> Result<StepReport, RuntimeError> {
        let drafts = drafts.into();
        tracing::Span::current().record("drafts", drafts.len());
        let mut rep = self
            .coordinator
            .ask(Step {
                drafts: drafts.0,
                sent: Instant::now(),
            })
            .await?;
        rep.timing.arrived();
        let span = tracing::Span::current();
        span.record("step", rep.step);
        span.record("scheduled", rep.scheduled.len());
        Ok(rep)
    }

    /// The report of the step scheduled and not committed yet (`None` when there is
    /// none). Messages are handled in order, so called after a `step` or `commit`
    /// future was dropped, it says whether that step ran (and what it scheduled) and
    /// whether that commit landed: an engine that lost a report commits it from here.
    #[tracing::instrument(level = "debug", skip_all)]
    pub async fn pending_step(&self) -> Result<Option<StepReport>, RuntimeError> {
        Ok(self.coordinator.ask(PendingStep).await?)
    }

    /// Commits what the model sampled for the last step.
    #[tracing::instrument(level = "debug", skip_all, fields(outcomes = outcomes.len(), finished = Empty))]
    pub async fn commit(
        &self,
        outcomes: Vec<RequestOutcome>,
    ) -> Result<CommitReport, RuntimeError> {
        let rep = self.coordinator.ask(Commit(outcomes)).await?;
        tracing::Span::current().record("finished", rep.finished.len());
        Ok(rep)
    }

    /// Commits what the model sampled for the step in flight, then plans and runs the
    /// next step: exactly [`commit`](Self::commit) followed by [`step`](Self::step), in
    /// one round trip through the coordinator instead of two. An engine loop that calls
    /// the handle from a thread outside the tokio runtime (`block_on`, a foreign-language
    /// binding) saves two cross-thread wake-ups per step; from a task of the runtime the
    /// two calls cost about the same.
    ///
    /// A commit that fails returns its error; nothing was committed and no step ran (the
    /// step in flight is still [`pending_step`](Self::pending_step)). Once the commit
    /// landed its report is returned even if the next step fails: the step's error is in
    /// [`CommitAndStepReport::step`].
    ///
    /// ```
    /// # use dsa_kv::actors::KvCacheBuilder;
    /// # use dsa_kv::config::EngineConfig;
    /// # use dsa_kv::core::scheduler::{RequestOutcome, SubmitRequest};
    /// # use dsa_kv::core::ReuseScope;
    /// # use dsa_kv::ids::{RequestId, TokenId};
    /// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
    /// # async fn main() -> Result<(), dsa_kv::actors::RuntimeError> {
    /// # let mut config = EngineConfig::default();
    /// # config.model.num_layers = Some(2);
    /// # config.kv_cache.max_tokens = Some(4096);
    /// # let kv = KvCacheBuilder::new().config(config).start().await?;
    /// # let prompt: Vec<TokenId> = (0..100).map(TokenId).collect();
    /// # kv.submit(SubmitRequest { id: RequestId(1), scope: ReuseScope::SHARED, prompt, max_new_tokens: 3, priority: 35 }).await?;
    /// let mut report = kv.step(dsa_kv::actors::Drafts::none()).await?;
    /// let mut finished = 0;
    /// while !report.scheduled.is_empty() {
    ///     let outcomes = report.scheduled.iter()
    ///         .map(|r| RequestOutcome { id: r.id, accepted_drafts: 0, next_token: r.produces_token.then_some(TokenId(7)) })
    ///         .collect();
    ///     let done = kv.commit_and_step(outcomes, dsa_kv::actors::Drafts::none()).await?;
    ///     finished += done.commit.finished.len();
    ///     report = done.step?;
    /// }
    /// assert_eq!(finished, 1);
    /// # kv.shutdown().await;
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(level = "debug", skip_all, fields(outcomes = outcomes.len(), drafts = Empty, finished = Empty, step = Empty, scheduled = Empty))]
    pub async fn commit_and_step(
        &self,
        outcomes: Vec<RequestOutcome>,
        drafts: impl Into<Drafts>,
    ) -> Result<CommitAndStepReport, RuntimeError> {
        let drafts = drafts.into();
        tracing::Span::current().record("drafts", drafts.len());
        let mut rep = self
            .coordinator
            .ask(CommitAndStep {
                outcomes,
                drafts: drafts.0,
                sent: Instant::now(),
            })
            .await?;
        let span = tracing::Span::current();
        span.record("finished", rep.commit.finished.len());
        if let Ok(step) = &mut rep.step {
            step.timing.arrived();
            span.record("step", step.step);
            span.record("scheduled", step.scheduled.len());
        }
        Ok(rep)
    }

    /// Waits until a request finishes (or fails). A request that finished before the
    /// call is answered from the runtime's store of unwaited results, which keeps the
    /// newest 1,024 of them (at most 16 MiB of their tokens and block tables); an older
    /// one is an unknown request.
    #[tracing::instrument(level = "debug", skip_all, fields(request = %id))]
    pub async fn wait(&self, id: RequestId) -> Result<FinishedReport, RuntimeError> {
        let (tx, rx) = oneshot::channel();
        self.coordinator.tell(Watch(id, tx)).await?;
        rx.await.map_err(|_| {
            RuntimeError::NotRunning("the coordinator stopped before the request finished".into())
        })?
    }

    /// Cancels a request that is not part of the step in flight.
    #[tracing::instrument(level = "debug", skip_all, fields(request = %id))]
    pub async fn cancel(&self, id: RequestId) -> Result<(), RuntimeError> {
        Ok(self.coordinator.ask(Cancel(id)).await?)
    }

    /// Suspends a request until [`resume`](Self::resume): its pages are held (and may be
    /// offloaded) and it is not scheduled.
    #[tracing::instrument(level = "debug", skip_all, fields(request = %id))]
    pub async fn suspend(&self, id: RequestId) -> Result<(), RuntimeError> {
        Ok(self.coordinator.ask(Pause(id, true)).await?)
    }

    /// Lets a suspended request run again (as soon as there is room).
    #[tracing::instrument(level = "debug", skip_all, fields(request = %id))]
    pub async fn resume(&self, id: RequestId) -> Result<(), RuntimeError> {
        Ok(self.coordinator.ask(Pause(id, false)).await?)
    }

    /// The counters, rates and current utilization: a small fixed-size read, fine to
    /// call every step. The per-step history is read with [`history`](Self::history).
    #[tracing::instrument(level = "debug", skip_all)]
    pub async fn stats(&self) -> Result<RuntimeStats, RuntimeError> {
        Ok(self.coordinator.ask(GetStats).await?)
    }

    /// The per-step history (utilization, rolling hit rate, scheduled and preempted
    /// requests, coordinator time) of the steps numbered `since_step` and later that the
    /// runtime still keeps: it keeps the last [`HISTORY`](super::HISTORY) steps, and
    /// [`HistoryChunk::gap`] says when some steps at or after `since_step` are gone.
    /// Steps are numbered from 1; `history(0)` returns all that is kept. To follow the
    /// run, pass the chunk's [`next_since`](HistoryChunk::next_since) to the next call:
    /// each call copies only the new samples. The newest sample's `manager_us` still
    /// grows when its step is committed.
    ///
    /// ```
    /// # use dsa_kv::actors::KvCacheBuilder;
    /// # use dsa_kv::config::EngineConfig;
    /// # use dsa_kv::core::scheduler::{RequestOutcome, SubmitRequest};
    /// # use dsa_kv::core::ReuseScope;
    /// # use dsa_kv::ids::{RequestId, TokenId};
    /// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
    /// # async fn main() -> Result<(), dsa_kv::actors::RuntimeError> {
    /// # let mut config = EngineConfig::default();
    /// # config.model.num_layers = Some(2);
    /// # config.kv_cache.max_tokens = Some(4096);
    /// # let kv = KvCacheBuilder::new().config(config).start().await?;
    /// # let prompt: Vec<TokenId> = (0..100).map(TokenId).collect();
    /// # kv.submit(SubmitRequest { id: RequestId(1), scope: ReuseScope::SHARED, prompt, max_new_tokens: 3, priority: 35 }).await?;
    /// let mut since = 0;
    /// for _ in 0..2 {
    ///     let report = kv.step(dsa_kv::actors::Drafts::none()).await?;
    ///     let chunk = kv.history(since).await?;
    ///     assert_eq!(chunk.samples.len(), 1); // only the step just run
    ///     assert!(!chunk.gap);
    ///     since = chunk.next_since;
    ///     let outcomes = report.scheduled.iter()
    ///         .map(|r| RequestOutcome { id: r.id, accepted_drafts: 0, next_token: r.produces_token.then_some(TokenId(7)) })
    ///         .collect();
    ///     kv.commit(outcomes).await?;
    /// }
    /// assert_eq!(since, 3);
    /// # kv.shutdown().await;
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(level = "debug", skip_all, fields(since = since_step, samples = Empty))]
    pub async fn history(&self, since_step: u64) -> Result<HistoryChunk, RuntimeError> {
        let chunk = self
            .coordinator
            .ask(GetHistory { since: since_step })
            .await?;
        tracing::Span::current().record("samples", chunk.samples.len());
        Ok(chunk)
    }

    /// Tokens of `prompt` the target cache would serve if the request were submitted now
    /// (its longest cached prefix, on the GPU or the host tier; never the last token,
    /// whose logits are needed), without holding anything. `tokens / 64` is the number
    /// of whole blocks a KV-aware router's overlap score for this cache should give
    /// for the same tokens without the last one.
    pub async fn probe_reuse(
        &self,
        scope: dsa_kv_core::core::ReuseScope,
        prompt: &[TokenId],
    ) -> Result<u64, RuntimeError> {
        self.coordinator
            .ask(super::coordinator::ProbeReuse {
                scope,
                prompt: prompt.to_vec(),
            })
            .await
            .map_err(RuntimeError::from)
    }

    /// Drops every cached block of the target and the draft cache on every tier, e.g.
    /// after a weight update (vLLM's and SGLang's `reset_prefix_cache`); the next request
    /// reuses nothing. Routers get one `AllBlocksCleared` on the
    /// [event stream](Events::subscribe) (and one [`KvEvent::AllBlocksCleared`]
    /// through [`Events::take`]), again on every successful call. Refused with
    /// [`RuntimeError::PrefixCacheInUse`], changing nothing, while any request holds KV
    /// pages (running, in a step not committed yet, or suspended): let them finish or
    /// cancel them first. Requests submitted and not started yet do not block it.
    #[tracing::instrument(level = "info", skip_all)]
    pub async fn reset_prefix_cache(&self) -> Result<dsa_kv_core::core::ResetReport, RuntimeError> {
        Ok(self
            .coordinator
            .ask(super::coordinator::ResetPrefixCache)
            .await?)
    }

    /// Checks the cache managers' invariants; returns the cache occupancy.
    #[tracing::instrument(level = "debug", skip_all)]
    #[cfg(feature = "testing")]
    pub async fn check_invariants(&self) -> Result<CacheCounts, RuntimeError> {
        self.coordinator
            .ask(CheckInvariants)
            .await
            .map_err(|e| match e {
                kameo::error::SendError::HandlerError(why) => {
                    RuntimeError::InvariantViolated(why.to_string())
                }
                other => RuntimeError::NotRunning(format!("{other:?}")),
            })
    }

    /// SHA-256 of every device's GPU-tier cache bytes (index order; `None` for a device
    /// that is gone). Tensor-parallel ranks with replicated KV must agree.
    #[tracing::instrument(level = "debug", skip_all)]
    #[cfg(feature = "testing")]
    pub async fn cache_digests(&self) -> Result<Vec<Option<String>>, RuntimeError> {
        let devices = self.coordinator.ask(Devices).await?;
        let mut out = Vec::with_capacity(devices.len());
        for d in devices {
            out.push(match d {
                Some(d) => Some(d.ask(CacheDigest).await.map_err(|e| match e {
                    kameo::error::SendError::HandlerError(err) => RuntimeError::from(err),
                    other => RuntimeError::NotRunning(format!("{other:?}")),
                })?),
                None => None,
            });
        }
        Ok(out)
    }

    /// Waits until every step enqueued so far has completed on every device, and reports
    /// a failure found only on a device (e.g. a guard kernel that refused a write). Steps
    /// on a GPU return once their work is enqueued; call this before reading the cache
    /// from outside the runtime's stream order. The host backend returns at once.
    #[tracing::instrument(level = "debug", skip_all)]
    pub async fn synchronize(&self) -> Result<(), RuntimeError> {
        let devices = self.coordinator.ask(Devices).await?;
        for d in devices.into_iter().flatten() {
            d.ask(Synchronize).await.map_err(|e| match e {
                kameo::error::SendError::HandlerError(err) => RuntimeError::from(err),
                other => RuntimeError::NotRunning(format!("{other:?}")),
            })?;
        }
        Ok(())
    }

    /// Stops every actor. Pending requests are dropped.
    #[tracing::instrument(level = "info", skip_all)]
    pub async fn shutdown(self) {
        let devices = self.coordinator.ask(Devices).await.unwrap_or_default();
        let _ = self.coordinator.stop_gracefully().await;
        self.coordinator.wait_for_shutdown().await;
        if let Some(d) = &self.draft {
            let _ = d.stop_gracefully().await;
            d.wait_for_shutdown().await;
        }
        for d in devices.into_iter().flatten() {
            let _ = d.stop_gracefully().await;
            d.wait_for_shutdown().await;
        }
    }
}

/// The fault drills (feature `fault-injection`): reliability tests inject device faults,
/// GPU-room refusals and device deaths through these.
#[cfg(feature = "fault-injection")]
impl KvCacheHandle {
    /// Injects a fault into device `index` (reliability tests and drills).
    #[tracing::instrument(level = "info", skip_all, fields(device = index, fault = ?fault))]
    pub async fn inject_fault(&self, index: usize, fault: DeviceFault) -> Result<(), RuntimeError> {
        let dev = self.device(index).await?;
        dev.tell(InjectFault(fault)).await?;
        Ok(())
    }

    /// Fault drill: from now on each request for GPU room (admission, growth, resume)
    /// is refused with probability `percent` (seeded), as if the storage could not
    /// supply the memory; the scheduler sees memory pressure and must lose nothing.
    /// Returns the refusals injected so far; `percent = 0` turns the drill off.
    #[tracing::instrument(level = "info", skip_all, fields(seed, percent))]
    pub async fn inject_room_failures(&self, seed: u64, percent: u8) -> Result<u64, RuntimeError> {
        Ok(self
            .coordinator
            .ask(super::coordinator::InjectRoomFailures { seed, percent })
            .await?)
    }

    /// Kills device `index` (its requests fail; the runtime keeps serving).
    #[tracing::instrument(level = "info", skip_all, fields(device = index))]
    pub async fn kill_device(&self, index: usize) -> Result<(), RuntimeError> {
        let dev = self.device(index).await?;
        dev.kill();
        dev.wait_for_shutdown().await;
        Ok(())
    }

    async fn device(&self, index: usize) -> Result<ActorRef<DeviceActor>, RuntimeError> {
        let devices = self.coordinator.ask(Devices).await?;
        devices
            .get(index)
            .cloned()
            .flatten()
            .ok_or(RuntimeError::NoSuchDevice {
                index,
                devices: self.info.devices,
            })
    }
}

/// The handle's event methods ([`KvCacheHandle::events`]): the router event stream
/// (vLLM / Dynamo events, any number of subscribers) and the crate's own KV events (one
/// consumer).
#[derive(Clone, Copy)]
pub struct Events<'a> {
    pub(super) kv: &'a KvCacheHandle,
}

impl Events<'_> {
    /// Subscribes to the router event stream: [`EventBatch`](super::EventBatch)es of
    /// [`RouterEvent`](dsa_kv_core::core::RouterEvent)s (vLLM / Dynamo `BlockStored`,
    /// `BlockRemoved`, `AllBlocksCleared`: full blocks only, parents before children, a
    /// tier move as a removal on one medium and a store on the other), numbered 0, 1, 2,
    /// … without gaps, one per step or commit that changed the cache. **This is the way
    /// for routers**; any number of subscribers each see every batch from the
    /// subscription on. Events recorded before the call are published first and not
    /// delivered: a subscriber made before the first request sees everything from an
    /// empty cache, a later one starts from
    /// [`subscribe_with_snapshot`](Self::subscribe_with_snapshot). A
    /// subscriber more than [`event_stream_capacity`](super::KvCacheBuilder::event_stream_capacity)
    /// batches behind gets [`StreamItem::Lost`](super::StreamItem::Lost) with the lost
    /// range and resynchronizes from [`router_snapshot`](Self::router_snapshot).
    #[tracing::instrument(level = "debug", skip_all)]
    pub async fn subscribe(&self) -> Result<super::EventSubscriber, RuntimeError> {
        let (sub, _) = self
            .kv
            .coordinator
            .ask(super::coordinator::SubscribeEvents { snapshot: false })
            .await?;
        Ok(sub)
    }

    /// A subscriber and the full blocks it starts from, taken at the same point: apply
    /// the snapshot, then every batch received.
    #[tracing::instrument(level = "debug", skip_all)]
    pub async fn subscribe_with_snapshot(
        &self,
    ) -> Result<(super::EventSubscriber, super::RouterSnapshot), RuntimeError> {
        let (sub, snap) = self
            .kv
            .coordinator
            .ask(super::coordinator::SubscribeEvents { snapshot: true })
            .await?;
        Ok((
            sub,
            snap.expect("invariant: a snapshot was asked for and the coordinator made one"),
        ))
    }

    /// The target cache's full blocks as a router sees them, with the sequence number of
    /// the first stream batch they do not include: a subscriber that lost batches
    /// replaces its view with `blocks` and calls
    /// [`EventSubscriber::resync`](super::EventSubscriber::resync). Walks the whole tree.
    #[tracing::instrument(level = "debug", skip_all)]
    pub async fn router_snapshot(&self) -> Result<super::RouterSnapshot, RuntimeError> {
        Ok(self
            .kv
            .coordinator
            .ask(super::coordinator::GetRouterSnapshot)
            .await?)
    }

    /// KV events since the last call (stored / removed / tier-updated blocks, whole-cache
    /// clears), oldest first. The runtime keeps the newest
    /// [`event_capacity`](super::KvCacheBuilder::event_capacity); older ones are dropped
    /// and counted in `stats().events.lost` (a consumer that falls behind resynchronizes
    /// with [`take_with_snapshot`](Self::take_with_snapshot)). These are the
    /// crate's own per-life-cycle events with 256-bit keys, for one consumer; routers use
    /// [`subscribe`](Self::subscribe).
    #[tracing::instrument(level = "debug", skip_all)]
    pub async fn take(&self) -> Result<Vec<KvEvent>, RuntimeError> {
        Ok(self.kv.coordinator.ask(TakeEvents).await?)
    }

    /// The KV events not taken yet, and a snapshot of the target cache's reuse tree that
    /// they lead to (every block's page per life cycle, with its tier), read atomically:
    /// a consumer that replays every event it took in order holds exactly the snapshot,
    /// unless events were dropped untaken (`lost > 0`: the runtime keeps the newest
    /// [`event_capacity`](super::KvCacheBuilder::event_capacity)), in which case it replaces its view with the snapshot. For a router
    /// resynchronizing its view, and for checking an event consumer. The snapshot walks
    /// the whole tree: not for every step.
    #[tracing::instrument(level = "debug", skip_all)]
    pub async fn take_with_snapshot(&self) -> Result<super::EventSnapshot, RuntimeError> {
        Ok(self
            .kv
            .coordinator
            .ask(super::coordinator::TakeEventsWithSnapshot)
            .await?)
    }
}
