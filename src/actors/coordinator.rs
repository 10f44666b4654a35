//! The coordinator actor: owns the [`Scheduler`] (and through it the cache managers),
//! decides each step once and broadcasts the plan to every device (tensor parallelism:
//! identical page tables everywhere), waits for their completion fences before any slot
//! they used can be handed out again, commits outcomes, verifies finished requests, and
//! keeps statistics and KV events. It survives panics (`on_panic` continues) and device
//! deaths (the affected requests fail; the rest of the service goes on).

use std::collections::{HashMap, VecDeque};
use std::future::IntoFuture;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use kameo::actor::{ActorId, ActorRef, WeakActorRef};
use kameo::error::{ActorStopReason, PanicError};
use kameo::message::{Context, Message};
use kameo::reply::DelegatedReply;
use kameo::Actor;
use serde::Serialize;
use tokio::sync::oneshot;
use tracing::Instrument;

use super::device::{DeviceActor, ExecuteStep, Verify};
use super::draft::{DraftReplayActor, DraftReport, DraftStep, SetDevices};
use super::error::RuntimeError;
use super::event_stream::{EventStream, EventSubscriber, RouterSnapshot};
use super::shared::{spin_then_await, RuntimeShared};
use super::stats::{
    ratio, EventCounts, History, HistoryChunk, Rolling, RuntimeStats, StepSample, TierUsage,
    HISTORY,
};
use dsa_kv_core::core::scheduler::{
    Finished, PlannedRequest, RequestOutcome, Scheduler, StepPlan, SubmitRequest,
};
use dsa_kv_core::core::{KvEvent, ManagerStats};
use dsa_kv_core::ids::{Fence, RequestId, Tier, TokenId};
use dsa_kv_device::backend::{DeviceStepReport, Mismatch, VerifySpec};
use dsa_kv_device::forward::{Sampled, Sampling};

/// A finished request with the result of its final verification.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FinishedReport {
    /// The request.
    pub finished: Finished,
    /// Token positions verified on every device (× layers).
    pub tokens_verified: u64,
    /// Byte mismatches found.
    pub mismatches: Vec<Mismatch>,
}

/// The requests a step scheduled (context first), as the devices ran them: the plan's
/// own [`PlannedRequest`]s, shared with the devices (no copy per step). It derefs to a
/// slice: `report.scheduled.iter()`, `.len()`, `[i]`; each request says its `kind`,
/// `num_cached`, `tokens` (drafts included, the last `num_drafts`) and whether its
/// outcome needs a sampled token (`produces_token`).
#[derive(Clone, Debug, PartialEq)]
pub struct Scheduled(Arc<StepPlan>);

impl std::ops::Deref for Scheduled {
    type Target = [PlannedRequest];

    fn deref(&self) -> &[PlannedRequest] {
        &self.0.requests
    }
}

impl<'a> IntoIterator for &'a Scheduled {
    type Item = &'a PlannedRequest;
    type IntoIter = std::slice::Iter<'a, PlannedRequest>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.requests.iter()
    }
}

impl Serialize for Scheduled {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.requests.serialize(s)
    }
}

/// What one step did.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepReport {
    /// Step number.
    pub step: u64,
    /// Scheduled requests (context first).
    pub scheduled: Scheduled,
    /// Requests preempted to make room.
    pub preempted: Vec<RequestId>,
    /// Requests resumed.
    pub resumed: Vec<RequestId>,
    /// Requests failed while scheduling, with the reason.
    pub failed: Vec<(RequestId, String)>,
    /// Each device's report.
    pub devices: Vec<DeviceStepReport>,
    /// The draft replay, when the step had one.
    pub draft: Option<DraftReport>,
    /// What the devices' forward sampled for each scheduled request (every device
    /// sampled the same), in the plan's order; empty when the engine samples.
    pub outcomes: Vec<RequestOutcome>,
    /// The step's commit, when the forward sampled: the coordinator committed the
    /// outcomes itself (no `commit` call follows). `None` when the engine samples: it
    /// commits with [`KvCacheHandle::commit`](super::KvCacheHandle::commit) or
    /// [`commit_and_step`](super::KvCacheHandle::commit_and_step).
    pub committed: Option<CommitReport>,
    /// Coordinator time for scheduling, microseconds.
    pub manager_us: u64,
    /// Where the step's time went on its way through the runtime.
    pub timing: StepTiming,
}

impl StepReport {
    /// For an engine that samples itself ([`Sampling::ByEngine`](crate::device::forward::Sampling::ByEngine)): the outcome of every
    /// scheduled request with no draft accepted, `next(r)` the token the engine sampled
    /// for `r` where the step produces one (the last chunk of a prompt, a decode), none
    /// elsewhere, to pass to [`commit`](super::KvCacheHandle::commit). An engine with
    /// drafts sets `accepted_drafts` on the result.
    pub fn outcomes_from(
        &self,
        mut next: impl FnMut(&PlannedRequest) -> TokenId,
    ) -> Vec<RequestOutcome> {
        self.scheduled
            .iter()
            .map(|r| RequestOutcome {
                id: r.id,
                accepted_drafts: 0,
                next_token: r.produces_token.then(|| next(r)),
            })
            .collect()
    }
}

/// Each decoding request's draft tokens for one step (MTP speculative decoding):
/// [`Drafts::none`] without drafts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Drafts(pub(crate) HashMap<RequestId, Vec<TokenId>>);

impl Drafts {
    /// No drafts.
    pub fn none() -> Self {
        Drafts::default()
    }

    /// These drafts and `tokens` for request `id` (replacing any it had).
    pub fn with(mut self, id: RequestId, tokens: Vec<TokenId>) -> Self {
        self.0.insert(id, tokens);
        self
    }

    /// Requests with drafts.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no request has drafts.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<HashMap<RequestId, Vec<TokenId>>> for Drafts {
    fn from(map: HashMap<RequestId, Vec<TokenId>>) -> Self {
        Drafts(map)
    }
}

impl FromIterator<(RequestId, Vec<TokenId>)> for Drafts {
    fn from_iter<I: IntoIterator<Item = (RequestId, Vec<TokenId>)>>(iter: I) -> Self {
        Drafts(iter.into_iter().collect())
    }
}

/// Where one step's time went on its way through the runtime, in nanoseconds: each
/// interval is stamped on the thread where it starts and ends (the monotonic clock is
/// shared by all threads). With one device the intervals follow each other, so their sum
/// is the time the caller waited. Timings are measurements: they never make two reports
/// of the same step unequal (`==` ignores them), and a report returned again by
/// [`pending_step`](super::KvCacheHandle::pending_step) has `to_caller_ns` = 0.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct StepTiming {
    /// The handle's call sent → the coordinator's handler running (the message and the
    /// wake-up of the coordinator's task).
    pub to_coordinator_ns: u64,
    /// Committing: the step before ([`commit_and_step`](super::KvCacheHandle::commit_and_step)),
    /// or this step when its forward sampled; verification of finished requests included.
    pub commit_ns: u64,
    /// `Scheduler::schedule`.
    pub schedule_ns: u64,
    /// Handing the plan to every device (the sends, waking a parked device thread).
    pub enqueue_ns: u64,
    /// The plan enqueued → the slowest device's handler running (the device thread's
    /// wake-up).
    pub to_device_ns: u64,
    /// The slowest device's handler (its backend's step: metadata, copies, forward).
    pub device_ns: u64,
    /// The last device reply sent → the coordinator holding every reply (the wake-up of
    /// the coordinator's task, or the overlapped work below when it takes longer).
    pub from_device_ns: u64,
    /// Coordinator work done while the devices ran (the report's request list, failed
    /// requests).
    pub overlapped_ns: u64,
    /// Every reply in hand → the coordinator's reply sent (fences, counters, the report;
    /// the draft replay when there is one).
    pub finish_ns: u64,
    /// The coordinator's reply sent → the handle returning it (the caller's wake-up).
    pub to_caller_ns: u64,
    /// When the coordinator sent its reply (the handle computes `to_caller_ns` from it).
    #[serde(skip)]
    pub(crate) replied: Option<Instant>,
}

impl PartialEq for StepTiming {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl StepTiming {
    /// Called where the reply arrives: the last interval.
    pub(crate) fn arrived(&mut self) {
        if let Some(r) = self.replied.take() {
            self.to_caller_ns = nanos(r.elapsed());
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Nanoseconds from `a` to `b` (0 if `b` is earlier).
fn between(a: Instant, b: Instant) -> u64 {
    nanos(b.saturating_duration_since(a))
}

/// What a commit did.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CommitReport {
    /// Requests that finished.
    pub finished: Vec<FinishedReport>,
    /// Coordinator time, microseconds (device verification excluded).
    pub manager_us: u64,
}

type Waiter = oneshot::Sender<Result<FinishedReport, RuntimeError>>;

/// Results of finished requests nobody waited for yet, kept for a later
/// [`wait`](super::KvCacheHandle::wait): the newest [`DONE_CAPACITY`], at most
/// [`DONE_BYTES`] of their token lists and block tables (an engine loop that never calls
/// `wait` must not accumulate every request it ever served).
pub(super) const DONE_CAPACITY: usize = 1024;
/// See [`DONE_CAPACITY`].
pub(super) const DONE_BYTES: usize = 16 << 20;

/// The bounded store of unwaited results (see [`DONE_CAPACITY`]).
#[derive(Default)]
struct Done {
    results: HashMap<RequestId, (u64, usize, Result<FinishedReport, RuntimeError>)>,
    /// (id, insertion number), oldest first; entries whose result was taken are skipped.
    order: VecDeque<(RequestId, u64)>,
    next: u64,
    bytes: usize,
}

impl Done {
    fn size(r: &Result<FinishedReport, RuntimeError>) -> usize {
        match r {
            Ok(f) => {
                256 + 4
                    * (f.finished.tokens.len()
                        + f.finished.block_slots.len()
                        + f.finished.draft_block_slots.as_ref().map_or(0, Vec::len))
                    + 64 * f.mismatches.len()
            }
            Err(e) => 256 + e.to_string().len(),
        }
    }

    fn insert(&mut self, id: RequestId, r: Result<FinishedReport, RuntimeError>) {
        self.take(id);
        let n = Self::size(&r);
        self.next += 1;
        self.results.insert(id, (self.next, n, r));
        self.order.push_back((id, self.next));
        self.bytes += n;
        while self.results.len() > DONE_CAPACITY || self.bytes > DONE_BYTES {
            let Some((old, k)) = self.order.pop_front() else {
                break;
            };
            if self.results.get(&old).is_some_and(|e| e.0 == k) {
                self.take(old);
            }
        }
        // Taken results leave their ids in `order`: compact now and then.
        if self.order.len() > 2 * DONE_CAPACITY {
            let results = &self.results;
            self.order
                .retain(|(id, k)| results.get(id).is_some_and(|e| e.0 == *k));
        }
    }

    fn take(&mut self, id: RequestId) -> Option<Result<FinishedReport, RuntimeError>> {
        let (_, n, r) = self.results.remove(&id)?;
        self.bytes -= n;
        Some(r)
    }
}
/// Default number of untaken KV events the coordinator keeps.
pub(super) const EVENT_CAPACITY: usize = 1 << 16;

/// The coordinator. See the module docs.
pub(super) struct Coordinator {
    pub(super) sched: Scheduler,
    /// A model with sliding windows: its cache plan (the window pools a transfer covers).
    pub(super) windowed: Option<dsa_kv_core::layout::V4Plan>,
    devices: Vec<Option<ActorRef<DeviceActor>>>,
    draft: Option<ActorRef<DraftReplayActor>>,
    watchers: HashMap<RequestId, Vec<Waiter>>,
    done: Done,
    events: VecDeque<KvEvent>,
    event_counts: EventCounts,
    /// Events dropped from the full buffer since the last take.
    events_lost_since_take: u64,
    event_capacity: usize,
    /// The router event stream (batches with sequence numbers).
    stream: EventStream,
    rolling: Rolling,
    last_mgr: ManagerStats,
    stats: RuntimeStats,
    history: History,
    /// Each admitted request's `request` span, from its submission until it finishes,
    /// fails or is cancelled ([`resolve`](Self::resolve) drops it, which closes it).
    request_spans: HashMap<RequestId, RequestTrace>,
    pending_manager_us: u64,
    /// The step scheduled and not committed yet: a client whose `step` future was
    /// dropped gets its report again (the step ran; its report must not be lost).
    pending: Option<PendingReport>,
    /// Committed plans a caller's `StepReport` still shared at the commit, oldest first
    /// (at most [`RETIRED`]): recycled once the report is dropped.
    retired: VecDeque<Arc<StepPlan>>,
    plans_recycled: u64,
    /// How long the coordinator polls for the devices' replies before yielding.
    idle_spin: Duration,
    shared: Arc<RuntimeShared>,
    /// Drafts the forward proposed at the last step it sampled, for the next step of
    /// each request (an engine's own drafts for a request win).
    proposed: HashMap<RequestId, Vec<TokenId>>,
}

/// Committed plans kept for recycling while callers still hold their reports.
const RETIRED: usize = 4;

/// A request's `request` span and whether a step has activated it yet.
struct RequestTrace {
    span: tracing::Span,
    started: bool,
}

/// What the report of the step in flight is rebuilt from when
/// [`PendingStep`] asks for it: the shared plan, not a copy of the report (the hot
/// path pays no clone for a report that is almost never asked for again).
struct PendingReport {
    plan: Arc<StepPlan>,
    devices: Vec<DeviceStepReport>,
    draft: Option<DraftReport>,
    manager_us: u64,
    timing: StepTiming,
}

impl PendingReport {
    fn report(&self) -> StepReport {
        StepReport {
            step: self.plan.step,
            scheduled: Scheduled(self.plan.clone()),
            preempted: self.plan.preempted.clone(),
            resumed: self.plan.resumed.clone(),
            failed: self.plan.failed.clone(),
            devices: self.devices.clone(),
            draft: self.draft.clone(),
            outcomes: match self.devices.first().map(|d| &d.sampling) {
                Some(Sampling::Sampled(s)) => s.outcomes.clone(),
                _ => Vec::new(),
            },
            committed: None,
            manager_us: self.manager_us,
            timing: self.timing,
        }
    }
}

/// What every device's forward said about a step: all sampled the same (`Some`), or
/// all leave sampling to the engine (`None`); anything else is an error.
fn agreed_sampling(
    step: u64,
    reports: &[DeviceStepReport],
) -> Result<Option<&Sampled>, RuntimeError> {
    let Some(first) = reports.first() else {
        return Ok(None);
    };
    for (device, r) in reports.iter().enumerate().skip(1) {
        let what = match (&first.sampling, &r.sampling) {
            (Sampling::Sampled(a), Sampling::Sampled(b)) if a == b => continue,
            (Sampling::ByEngine, Sampling::ByEngine) => continue,
            (Sampling::Sampled(_), Sampling::Sampled(_)) => "sampled outcomes",
            _ => "sampling (some devices sampled, some left it to the engine)",
        };
        return Err(RuntimeError::DevicesDisagree { step, device, what });
    }
    Ok(match &first.sampling {
        Sampling::Sampled(s) => Some(s),
        _ => None,
    })
}

/// What the coordinator starts with.
pub(super) struct CoordinatorArgs {
    /// The scheduler with its managers.
    pub sched: Scheduler,
    /// One device actor per device.
    pub devices: Vec<ActorRef<DeviceActor>>,
    /// The draft-replay actor (separate draft cache).
    pub draft: Option<ActorRef<DraftReplayActor>>,
    /// A model with sliding windows: its cache plan.
    pub windowed: Option<dsa_kv_core::layout::V4Plan>,
    /// State shared with the devices and handles.
    pub shared: Arc<RuntimeShared>,
    /// Untaken KV events kept (older ones are dropped and counted).
    pub event_capacity: usize,
    /// Batches the router event stream keeps for slow subscribers.
    pub event_stream_capacity: usize,
    /// How long the coordinator polls for the devices' replies before yielding
    /// ([`KvCacheBuilder::idle_spin`](super::KvCacheBuilder::idle_spin)).
    pub idle_spin: Duration,
}

impl Actor for Coordinator {
    type Args = CoordinatorArgs;
    type Error = RuntimeError;

    async fn on_start(args: Self::Args, me: ActorRef<Self>) -> Result<Self, Self::Error> {
        for d in &args.devices {
            me.link(d).await;
        }
        let stats = RuntimeStats {
            devices_alive: args.devices.len(),
            ..Default::default()
        };
        let mut sched = args.sched;
        sched.set_record_router_events(true);
        super::transfer::spawn_lease_timer(&me, sched.transfer_lease());
        Ok(Coordinator {
            sched,
            windowed: args.windowed,
            devices: args.devices.into_iter().map(Some).collect(),
            draft: args.draft,
            watchers: HashMap::new(),
            done: Done::default(),
            events: VecDeque::new(),
            event_counts: EventCounts::default(),
            events_lost_since_take: 0,
            event_capacity: args.event_capacity.max(1),
            stream: EventStream::new(args.event_stream_capacity),
            rolling: Rolling::default(),
            last_mgr: ManagerStats::default(),
            stats,
            history: History::new(HISTORY),
            request_spans: HashMap::new(),
            pending_manager_us: 0,
            pending: None,
            retired: VecDeque::new(),
            plans_recycled: 0,
            idle_spin: args.idle_spin,
            shared: args.shared,
            proposed: HashMap::new(),
        })
    }

    async fn on_panic(
        &mut self,
        _: WeakActorRef<Self>,
        err: PanicError,
    ) -> Result<ControlFlow<ActorStopReason>, Self::Error> {
        tracing::error!(
            ?err,
            "a coordinator message panicked; the coordinator keeps serving"
        );
        Ok(ControlFlow::Continue(()))
    }

    async fn on_link_died(
        &mut self,
        _: WeakActorRef<Self>,
        id: ActorId,
        reason: ActorStopReason,
    ) -> Result<ControlFlow<ActorStopReason>, Self::Error> {
        let Some(index) = self
            .devices
            .iter()
            .position(|d| d.as_ref().is_some_and(|d| d.id() == id))
        else {
            return Ok(ControlFlow::Continue(()));
        };
        if matches!(reason, ActorStopReason::Normal) {
            self.devices[index] = None;
            return Ok(ControlFlow::Continue(()));
        }
        tracing::error!(device = index, ?reason, "device actor died");
        self.device_lost(index, format!("{reason:?}")).await;
        Ok(ControlFlow::Continue(()))
    }
}

impl Coordinator {
    /// Publishes the live counters for lock-free readers (one consistent update).
    fn publish_counters(&self) {
        use super::shared::counter::*;
        let st = self.sched.stats();
        self.shared.counters.update(|c| {
            c[SUBMITTED] = st.submitted;
            c[FINISHED] = st.finished;
            c[FAILED] = st.failed;
            c[STEPS] = st.steps;
        });
    }

    fn alive(&self) -> Vec<ActorRef<DeviceActor>> {
        self.devices.iter().flatten().cloned().collect()
    }

    /// Every request holds pages on every device (tensor parallelism): all of them fail.
    async fn device_lost(&mut self, index: usize, reason: String) {
        self.devices[index] = None;
        // A dead device holds back no fence.
        self.shared.fences.complete(index, Fence(u64::MAX));
        self.stats.devices_alive = self.devices.iter().flatten().count();
        let failed = self
            .sched
            .fail_all(&format!("device {index} died"))
            .unwrap_or_default();
        let err = RuntimeError::DeviceLost {
            device: index,
            reason,
            failed: failed.len(),
        };
        for id in failed {
            self.resolve(
                id,
                Err(RuntimeError::RequestFailed {
                    id,
                    reason: err.to_string(),
                }),
            );
        }
        self.publish_counters();
        if let Some(d) = &self.draft {
            let _ = d.tell(SetDevices(self.alive())).await;
        }
    }

    fn resolve(&mut self, id: RequestId, result: Result<FinishedReport, RuntimeError>) {
        if let Some(RequestTrace { span, .. }) = self.request_spans.remove(&id) {
            match &result {
                Ok(r) => tracing::debug!(
                    parent: &span,
                    generated = r.finished.generated,
                    reused_tokens = r.finished.reused_tokens,
                    preemptions = r.finished.preemptions,
                    mismatches = r.mismatches.len(),
                    "finished"
                ),
                Err(e) => tracing::debug!(parent: &span, error = %e, "failed"),
            }
            // Dropping the last handle closes the span.
            drop(span);
        }
        if let Some(ws) = self.watchers.remove(&id) {
            for w in ws {
                let _ = w.send(result.clone());
            }
        } else {
            self.done.insert(id, result);
        }
    }

    /// Devices of the engine (alive or not).
    pub(super) fn num_devices(&self) -> usize {
        self.devices.len()
    }

    pub(super) fn drain_events(&mut self) {
        for e in self.sched.take_events() {
            match e {
                KvEvent::Stored { .. } => self.event_counts.stored += 1,
                KvEvent::Removed { .. } => self.event_counts.removed += 1,
                KvEvent::TierUpdated { .. } => self.event_counts.tier_updated += 1,
                KvEvent::AllBlocksCleared => self.event_counts.cleared += 1,
            }
            if self.events.len() >= self.event_capacity {
                self.events.pop_front();
                self.event_counts.lost += 1;
                self.events_lost_since_take += 1;
            }
            self.events.push_back(e);
        }
        self.stream.publish(self.sched.take_router_events());
    }

    /// Occupancy of every pool group of the target cache on every tier.
    fn tier_usage(&self) -> Vec<TierUsage> {
        let t = self.sched.target();
        Tier::ALL
            .iter()
            .flat_map(|&tier| {
                t.usage(tier)
                    .into_iter()
                    .map(move |usage| TierUsage { tier, usage })
            })
            .collect()
    }

    /// The step's metrics (see [`super::metrics`]).
    fn publish_metrics(&self, pending: &PendingReport) {
        let t = self.sched.target();
        let m = t.stats();
        let usage = self.tier_usage();
        super::metrics::publish(&super::metrics::Sample {
            sched: self.sched.stats(),
            manager: m,
            usage: &usage,
            events: self.event_counts,
            hit_rate: ratio(m.reused_tokens, m.lookup_tokens),
            rolling_hit_rate: self.rolling.rate(),
            waiting: self.sched.num_waiting(),
            manager_us: pending.manager_us,
            timing: &pending.timing,
            windows: t.window_stats(),
        });
    }

    fn sample(&mut self, plan: &StepPlan, manager_us: u64) {
        let m = self.sched.target().stats();
        let d_lookup = m.lookup_tokens - self.last_mgr.lookup_tokens;
        let d_reused = m.reused_tokens - self.last_mgr.reused_tokens;
        self.rolling.push(d_lookup, d_reused);
        self.last_mgr = m;
        let gpu = self.sched.target().usage(Tier::Gpu);
        let host = self.sched.target().usage(Tier::Host);
        self.history.push(StepSample {
            step: plan.step,
            gpu_utilization: gpu.first().map_or(0.0, |u| u.utilization),
            host_utilization: host.first().map_or(0.0, |u| u.utilization),
            rolling_hit_rate: self.rolling.rate(),
            scheduled: plan.requests.len() as u32,
            preempted: plan.preempted.len() as u32,
            waiting: self.sched.num_waiting() as u32,
            manager_us,
        });
    }

    fn snapshot(&self) -> RuntimeStats {
        let s = self.sched.stats();
        let m = self.sched.target().stats();
        let utilization = self.tier_usage();
        RuntimeStats {
            scheduler: s,
            draft_acceptance_rate: ratio(s.drafts_accepted, s.drafts_proposed),
            prefix_hit_rate: ratio(m.reused_tokens, m.lookup_tokens),
            rolling_hit_rate: self.rolling.rate(),
            offload_bytes: m.offloaded_bytes,
            onboard_bytes: m.onboarded_bytes,
            utilization,
            events: self.event_counts,
            history_dropped: self.history.dropped(),
            plans_recycled: self.plans_recycled,
            windows: self.sched.target().window_stats(),
            transfers: self.sched.transfer_stats(),
            ..self.stats.clone()
        }
    }

    async fn verify(
        &mut self,
        specs: Vec<VerifySpec>,
    ) -> Result<(u64, Vec<Mismatch>), RuntimeError> {
        let specs = Arc::new(specs);
        let results = join_all(self.alive().into_iter().map(|d| {
            let specs = specs.clone();
            async move { d.ask(Verify(specs)).await }
        }))
        .await;
        let mut n = 0;
        let mut mismatches = Vec::new();
        for r in results {
            let (k, m) = r?;
            n += k;
            mismatches.extend(m);
        }
        self.stats.tokens_verified += n;
        self.stats.mismatches += mismatches.len() as u64;
        Ok((n, mismatches))
    }
}

/// Admit a request.
pub(super) struct Submit(pub SubmitRequest);

impl Message<Submit> for Coordinator {
    type Reply = Result<u64, RuntimeError>;

    async fn handle(&mut self, msg: Submit, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        if self.devices.iter().flatten().next().is_none() {
            return Err(RuntimeError::NoDevices);
        }
        let id = msg.0.id;
        // A root span: the request outlives the `submit` call that admits it.
        let span = tracing::info_span!(
            parent: None,
            "request",
            id = %id,
            prompt_tokens = msg.0.prompt.len(),
            max_new_tokens = msg.0.max_new_tokens,
            reused = tracing::field::Empty,
        );
        self.done.take(id);
        let r = self.sched.submit(msg.0)?;
        self.publish_counters();
        span.record("reused", r);
        tracing::debug!(parent: &span, reused = r, "submitted");
        self.request_spans.insert(
            id,
            RequestTrace {
                span,
                started: false,
            },
        );
        Ok(r)
    }
}

/// Plan and run one step.
pub(super) struct Step {
    /// Each decoding request's draft tokens.
    pub drafts: HashMap<RequestId, Vec<TokenId>>,
    /// When the caller sent it ([`StepTiming::to_coordinator_ns`]).
    pub sent: Instant,
}

impl Message<Step> for Coordinator {
    type Reply = DelegatedReply<Result<StepReport, RuntimeError>>;

    async fn handle(&mut self, msg: Step, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let mut timing = StepTiming {
            to_coordinator_ns: between(msg.sent, Instant::now()),
            ..StepTiming::default()
        };
        match self.run_step(msg.drafts, &mut timing).await {
            Ok((mut report, pending)) => {
                // The caller goes on (samples, builds the next inputs) while the
                // bookkeeping no caller waits for is done; messages are handled in
                // order, so everything read through the mailbox still sees it done.
                report.timing.replied = Some(Instant::now());
                let committed = report.committed.as_ref().map(|c| c.manager_us);
                let reply = ctx.reply(Ok(report));
                self.after_step(pending);
                if let Some(manager_us) = committed {
                    self.after_commit(manager_us);
                }
                reply
            }
            Err(e) => ctx.reply(Err(e)),
        }
    }
}

impl Coordinator {
    /// Schedules a step, runs it on every device and completes its fences: everything
    /// the step's caller waits for. The caller's report, and what
    /// [`PendingStep`] rebuilds it from.
    async fn run_step(
        &mut self,
        mut drafts: HashMap<RequestId, Vec<TokenId>>,
        timing: &mut StepTiming,
    ) -> Result<(StepReport, PendingReport), RuntimeError> {
        let devices = self.alive();
        if devices.is_empty() {
            return Err(RuntimeError::NoDevices);
        }
        let t0 = Instant::now();
        // The forward's proposals from the step before, where the engine gave none.
        for (id, d) in self.proposed.drain() {
            drafts.entry(id).or_insert(d);
        }
        self.recycle_retired();
        let plan = Arc::new(self.sched.schedule(&drafts)?);
        let scheduled_at = Instant::now();
        timing.schedule_ns = between(t0, scheduled_at);
        let mut manager_us = t0.elapsed().as_micros() as u64;
        let span = tracing::info_span!("step", step = plan.step, requests = plan.requests.len());
        // One message per step per device; every device gets the same plan. Every
        // device is handed its message before anything else is done, so that the work
        // below overlaps the devices' wake-up and execution.
        let mut sent = Vec::with_capacity(devices.len());
        for d in &devices {
            sent.push(
                d.ask(ExecuteStep(plan.clone()))
                    .enqueue()
                    .instrument(span.clone())
                    .await,
            );
        }
        let t1 = Instant::now();
        timing.enqueue_ns = between(scheduled_at, t1);
        // Freed while the devices work. (Here, on the thread that allocated most of it,
        // rather than on an idle device thread: cross-thread frees left the scheduler's
        // allocations colder, schedule and commit ran up to 20 µs slower per step.)
        drop(drafts);
        for (id, why) in &plan.failed {
            let id = *id;
            self.resolve(
                id,
                Err(RuntimeError::RequestFailed {
                    id,
                    reason: why.clone(),
                }),
            );
        }
        timing.overlapped_ns = nanos(t1.elapsed());
        manager_us += t1.elapsed().as_micros() as u64;
        let replies = join_all(sent.into_iter().map(|sent| async move {
            match sent {
                Ok(reply) => reply.await.map_err(|e| {
                    // A device that stopped (panicked) mid-step is lost now, not when its
                    // link notification arrives: by then new requests may be running
                    // and must not be failed for it.
                    let stopped = !matches!(e, kameo::error::SendError::HandlerError(_));
                    (RuntimeError::from(e), stopped)
                }),
                Err(e) => Err((RuntimeError::from(e), true)),
            }
        }));
        let results = spin_then_await(std::pin::pin!(replies), self.idle_spin)
            .instrument(span.clone())
            .await;
        let all_replies = Instant::now();
        let mut reports = Vec::with_capacity(results.len());
        let mut first_err = None;
        let mut dead = Vec::new();
        let (mut received, mut replied) = (t1, t1);
        for (r, d) in results.into_iter().zip(&devices) {
            match r {
                Ok((rep, stamps)) => {
                    timing.device_ns = timing
                        .device_ns
                        .max(between(stamps.received, stamps.replied));
                    received = received.max(stamps.received);
                    replied = replied.max(stamps.replied);
                    reports.push(rep)
                }
                Err((e, stopped)) => {
                    if stopped {
                        dead.push(d.id());
                    }
                    first_err.get_or_insert(e);
                }
            }
        }
        for id in dead {
            if let Some(i) = self
                .devices
                .iter()
                .position(|d| d.as_ref().is_some_and(|d| d.id() == id))
            {
                tracing::error!(device = i, step = plan.step, "device stopped during a step");
                self.devices[i] = None;
                self.shared.fences.complete(i, Fence(u64::MAX));
                self.stats.devices_alive = self.devices.iter().flatten().count();
            }
        }
        let draft = match (
            &self.draft,
            first_err.is_none() && plan.draft_fence.is_some() && !plan.requests.is_empty(),
        ) {
            (Some(d), true) => match d
                .ask(DraftStep(plan.clone()))
                .into_future()
                .instrument(span)
                .await
            {
                Ok(r) => Some(r),
                Err(e) => {
                    first_err.get_or_insert(RuntimeError::from(e));
                    None
                }
            },
            _ => None,
        };
        // What the devices sampled, checked once: a disagreement fails the step below.
        let mut sampled = None;
        if first_err.is_none() {
            match agreed_sampling(plan.step, &reports) {
                Ok(s) => sampled = s.cloned(),
                Err(e) => first_err = Some(e),
            }
        }
        if let Some(e) = first_err {
            // Devices disagree about what happened: nothing of this step can be trusted.
            let failed = self
                .sched
                .fail_all(&format!("step {} failed on a device: {e}", plan.step))?;
            for id in failed {
                self.resolve(
                    id,
                    Err(RuntimeError::RequestFailed {
                        id,
                        reason: e.to_string(),
                    }),
                );
            }
            self.publish_counters();
            return Err(e);
        }
        let t2 = Instant::now();
        // The fence every device published completes the step's target fence (slots it
        // released become ready only then); the draft fence completes with the replay.
        let done = self.shared.fences.all_completed().min(plan.target_fence);
        self.sched.complete(done, plan.draft_fence)?;
        self.publish_counters();
        let device_us = reports.iter().map(|r| r.elapsed_us).max().unwrap_or(0);
        self.stats.device_us += device_us;
        let verified: u64 = reports.iter().map(|r| r.tokens_verified).sum();
        let mismatches: usize = reports.iter().map(|r| r.mismatches.len()).sum();
        self.stats.tokens_verified += verified;
        self.stats.mismatches += mismatches as u64;
        if let Some(d) = &draft {
            self.stats.draft_replays = d.replays;
        }
        if mismatches > 0 {
            tracing::error!(step = plan.step, mismatches, "cached KV did not verify");
        }
        let manager_us = manager_us + t2.elapsed().as_micros() as u64;
        self.pending_manager_us = manager_us;
        timing.to_device_ns = between(t1, received);
        timing.from_device_ns = between(replied, all_replies);
        timing.finish_ns = between(all_replies, Instant::now());
        let mut pending = PendingReport {
            plan,
            devices: reports,
            draft,
            manager_us,
            timing: *timing,
        };
        let mut report = pending.report();
        // A forward that sampled: the step is committed here, its proposals kept for
        // the next step.
        // A step that scheduled nothing leaves nothing to commit.
        let to_commit = self.sched.pending_step() == Some(pending.plan.step);
        if let Some(sampled) = sampled.filter(|_| to_commit) {
            let t3 = Instant::now();
            let replay = pending.draft.as_ref().map(|d| d.proposals.clone());
            self.proposed = sampled
                .drafts
                .into_iter()
                .chain(replay.into_iter().flatten())
                .collect();
            let commit = self.run_commit(&sampled.outcomes).await?;
            timing.commit_ns = between(t3, Instant::now());
            timing.finish_ns = between(all_replies, Instant::now());
            pending.timing = *timing;
            report.timing = *timing;
            report.committed = Some(commit);
        }
        Ok((report, pending))
    }

    /// The step's events in the span of each request it touched. Nothing is looked up
    /// when no subscriber wants them (this runs every step, for every request).
    fn request_events(&mut self, plan: &StepPlan) {
        // A new request waits until its first step activates it: the scheduler reports
        // that as a resume, its trace as its start.
        for id in &plan.resumed {
            if let Some(t) = self.request_spans.get_mut(id) {
                if t.started {
                    tracing::debug!(parent: &t.span, step = plan.step, "resumed");
                } else {
                    t.started = true;
                    tracing::debug!(parent: &t.span, step = plan.step, "started");
                }
            }
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            for id in &plan.preempted {
                if let Some(t) = self.request_spans.get(id) {
                    tracing::debug!(parent: &t.span, step = plan.step, "preempted");
                }
            }
        }
        if tracing::enabled!(tracing::Level::TRACE) {
            for p in &plan.requests {
                if let Some(t) = self.request_spans.get(&p.id) {
                    tracing::trace!(
                        parent: &t.span,
                        step = plan.step,
                        kind = ?p.kind,
                        num_cached = p.num_cached,
                        num_tokens = p.tokens.len(),
                        num_drafts = p.num_drafts,
                        "scheduled"
                    );
                }
            }
        }
    }

    /// A step's bookkeeping that its caller does not wait for (after the reply).
    fn after_step(&mut self, pending: PendingReport) {
        let t = Instant::now();
        self.request_events(&pending.plan);
        self.drain_events();
        self.sample(&pending.plan, pending.manager_us);
        self.publish_metrics(&pending);
        self.pending = Some(pending);
        self.pending_manager_us += t.elapsed().as_micros() as u64;
    }
}

#[cfg(feature = "fault-injection")]
/// Fault drill: refuse GPU-room requests with a probability (see
/// [`Scheduler::inject_room_failures`](dsa_kv_core::core::scheduler::Scheduler::inject_room_failures)).
pub(super) struct InjectRoomFailures {
    /// Seed of the refusals.
    pub seed: u64,
    /// Probability in percent; 0 turns the drill off.
    pub percent: u8,
}

#[cfg(feature = "fault-injection")]
impl Message<InjectRoomFailures> for Coordinator {
    type Reply = u64;

    async fn handle(
        &mut self,
        msg: InjectRoomFailures,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.sched.inject_room_failures(msg.seed, msg.percent)
    }
}

/// The report of the step scheduled and not committed yet.
pub(super) struct PendingStep;

impl Message<PendingStep> for Coordinator {
    type Reply = Option<StepReport>;

    async fn handle(&mut self, _: PendingStep, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        // The scheduler is the authority: a commit, or a device failure that abandoned
        // the step, ends it.
        match (self.sched.pending_step(), &self.pending) {
            (Some(step), Some(p)) if p.plan.step == step => Some(p.report()),
            _ => None,
        }
    }
}

/// Commit the outcome of the last step.
pub(super) struct Commit(pub Vec<RequestOutcome>);

impl Message<Commit> for Coordinator {
    type Reply = DelegatedReply<Result<CommitReport, RuntimeError>>;

    async fn handle(&mut self, msg: Commit, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        match self.run_commit(&msg.0).await {
            Ok(report) => {
                let manager_us = report.manager_us;
                // As for a step: the caller goes on while the bookkeeping is done.
                let reply = ctx.reply(Ok(report));
                self.after_commit(manager_us);
                reply
            }
            Err(e) => ctx.reply(Err(e)),
        }
    }
}

impl Coordinator {
    /// Commits the step's outcomes and verifies the requests that finished: everything
    /// the commit's caller waits for.
    async fn run_commit(
        &mut self,
        outcomes: &[RequestOutcome],
    ) -> Result<CommitReport, RuntimeError> {
        let t0 = Instant::now();
        let finished = self.sched.commit(outcomes)?;
        let mut manager_us = t0.elapsed().as_micros() as u64;
        let mut reports = Vec::with_capacity(finished.len());
        if !finished.is_empty() {
            // Every byte of every finished request is read back before it is closed.
            let specs: Vec<VerifySpec> = finished
                .iter()
                .map(|f| VerifySpec {
                    id: f.id,
                    tokens: f.tokens.clone(),
                    scope: f.scope,
                    block_slots: f.block_slots.clone(),
                    draft_block_slots: f.draft_block_slots.clone(),
                })
                .collect();
            let mut per_request: HashMap<RequestId, Vec<Mismatch>> = HashMap::new();
            let (n, mismatches) = self.verify(specs).await?;
            for m in mismatches {
                per_request.entry(m.id).or_default().push(m);
            }
            let t1 = Instant::now();
            let ids: Vec<RequestId> = finished.iter().map(|f| f.id).collect();
            self.sched.finalize(&ids)?;
            let per = n / finished.len() as u64;
            for f in finished {
                let report = FinishedReport {
                    mismatches: per_request.remove(&f.id).unwrap_or_default(),
                    tokens_verified: per,
                    finished: f,
                };
                self.resolve(report.finished.id, Ok(report.clone()));
                reports.push(report);
            }
            manager_us += t1.elapsed().as_micros() as u64;
        }
        self.publish_counters();
        Ok(CommitReport {
            finished: reports,
            manager_us,
        })
    }

    /// Gives the retired plans nobody shares any more back to the scheduler; keeps the
    /// others (the newest [`RETIRED`]; an older one is freed when its report goes).
    fn recycle_retired(&mut self) {
        let mut kept = VecDeque::with_capacity(self.retired.len());
        while let Some(p) = self.retired.pop_front() {
            match Arc::try_unwrap(p) {
                Ok(plan) => {
                    self.sched.recycle(plan);
                    self.plans_recycled += 1;
                }
                Err(p) => kept.push_back(p),
            }
        }
        while kept.len() > RETIRED {
            kept.pop_front();
        }
        self.retired = kept;
    }

    /// A commit's bookkeeping that its caller does not wait for (after the reply).
    fn after_commit(&mut self, manager_us: u64) {
        let t = Instant::now();
        self.drain_events();
        // The committed step's plan goes back to the scheduler, whose next plans reuse
        // its buffers; while the caller's report still shares it (an engine loop holds
        // the report until its next step), it waits among the retired plans.
        if let Some(p) = self.pending.take() {
            self.retired.push_back(p.plan);
            self.recycle_retired();
        }
        let deferred_us = t.elapsed().as_micros() as u64;
        self.stats.manager_us += self.pending_manager_us + manager_us + deferred_us;
        self.pending_manager_us = 0;
        if let Some(last) = self.history.last_mut() {
            last.manager_us += manager_us;
        }
    }
}

/// Commit the outcome of the step in flight, then plan and run the next step: one
/// message (one round trip for the caller) for what [`Commit`] and [`Step`] do.
pub(super) struct CommitAndStep {
    /// The outcomes of the step in flight.
    pub outcomes: Vec<RequestOutcome>,
    /// The next step's draft tokens per decoding request.
    pub drafts: HashMap<RequestId, Vec<TokenId>>,
    /// When the caller sent it ([`StepTiming::to_coordinator_ns`]).
    pub sent: Instant,
}

/// What [`KvCacheHandle::commit_and_step`](super::KvCacheHandle::commit_and_step) did.
#[derive(Clone, Debug, PartialEq)]
pub struct CommitAndStepReport {
    /// The commit of the step that was in flight.
    pub commit: CommitReport,
    /// The next step, or why it could not run (the commit stands either way).
    pub step: Result<StepReport, RuntimeError>,
}

impl Message<CommitAndStep> for Coordinator {
    type Reply = DelegatedReply<Result<CommitAndStepReport, RuntimeError>>;

    async fn handle(
        &mut self,
        msg: CommitAndStep,
        ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let CommitAndStep {
            outcomes,
            drafts,
            sent,
        } = msg;
        let t0 = Instant::now();
        let mut timing = StepTiming {
            to_coordinator_ns: between(sent, t0),
            ..StepTiming::default()
        };
        let commit = match self.run_commit(&outcomes).await {
            Ok(commit) => commit,
            // Nothing was committed and no step runs: the step in flight stays pending.
            Err(e) => return ctx.reply(Err(e)),
        };
        // Exactly what a `Commit` then a `Step` would do, in that order.
        self.after_commit(commit.manager_us);
        timing.commit_ns = between(t0, Instant::now());
        match self.run_step(drafts, &mut timing).await {
            Ok((mut step, pending)) => {
                step.timing.replied = Some(Instant::now());
                let reply = ctx.reply(Ok(CommitAndStepReport {
                    commit,
                    step: Ok(step),
                }));
                self.after_step(pending);
                reply
            }
            Err(e) => ctx.reply(Ok(CommitAndStepReport {
                commit,
                step: Err(e),
            })),
        }
    }
}

/// Register interest in a request's completion.
pub(super) struct Watch(pub RequestId, pub Waiter);

impl Message<Watch> for Coordinator {
    type Reply = ();

    async fn handle(&mut self, msg: Watch, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let Watch(id, tx) = msg;
        if let Some(result) = self.done.take(id) {
            let _ = tx.send(result);
        } else if self.sched.status(id).is_some() {
            self.watchers.entry(id).or_default().push(tx);
        } else {
            let _ = tx.send(Err(RuntimeError::Kv(
                dsa_kv_core::core::KvError::UnknownRequest { id },
            )));
        }
    }
}

/// Cancel a request.
pub(super) struct Cancel(pub RequestId);

impl Message<Cancel> for Coordinator {
    type Reply = Result<(), RuntimeError>;

    async fn handle(&mut self, msg: Cancel, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.sched.cancel(msg.0)?;
        self.publish_counters();
        self.resolve(
            msg.0,
            Err(RuntimeError::RequestFailed {
                id: msg.0,
                reason: "cancelled".into(),
            }),
        );
        Ok(())
    }
}

/// Pause (`true`) or resume (`false`) a request.
pub(super) struct Pause(pub RequestId, pub bool);

impl Message<Pause> for Coordinator {
    type Reply = Result<(), RuntimeError>;

    async fn handle(&mut self, msg: Pause, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        if msg.1 {
            self.sched.pause(msg.0)?;
        } else {
            self.sched.resume(msg.0)?;
        }
        Ok(())
    }
}

/// Read the statistics.
pub(super) struct GetStats;

impl Message<GetStats> for Coordinator {
    type Reply = RuntimeStats;

    async fn handle(&mut self, _: GetStats, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.snapshot()
    }
}

/// Read the per-step history from a step on.
pub(super) struct GetHistory {
    /// The first step wanted.
    pub since: u64,
}

impl Message<GetHistory> for Coordinator {
    type Reply = HistoryChunk;

    async fn handle(&mut self, m: GetHistory, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.history.since(m.since)
    }
}

/// Take the KV events recorded since the last call (at most the last 65,536).
pub(super) struct TakeEvents;

impl Message<TakeEvents> for Coordinator {
    type Reply = Vec<KvEvent>;

    async fn handle(&mut self, _: TakeEvents, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.drain_events();
        self.events_lost_since_take = 0;
        self.events.drain(..).collect()
    }
}

/// The KV events not taken yet and the target cache's reuse tree they lead to, read in
/// one message (nothing runs in between).
pub(super) struct TakeEventsWithSnapshot;

/// What [`Events::take_with_snapshot`](super::Events::take_with_snapshot)
/// returns.
#[derive(Clone, Debug, PartialEq, Serialize, kameo::Reply)]
pub struct EventSnapshot {
    /// The events not taken yet, oldest first.
    pub events: Vec<KvEvent>,
    /// Events dropped untaken since the last take (the buffer keeps the newest
    /// [`KvCacheBuilder::event_capacity`](super::KvCacheBuilder::event_capacity), 65,536 by default):
    /// when non-zero, `events` does not lead from the consumer's view to `blocks`, and
    /// the consumer must replace its view with `blocks`.
    pub lost: u64,
    /// Every page of every block of the target cache's reuse tree, after `events`.
    pub blocks: Vec<dsa_kv_core::core::CachedPage>,
}

impl Message<TakeEventsWithSnapshot> for Coordinator {
    type Reply = EventSnapshot;

    async fn handle(
        &mut self,
        _: TakeEventsWithSnapshot,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.drain_events();
        EventSnapshot {
            events: self.events.drain(..).collect(),
            lost: std::mem::take(&mut self.events_lost_since_take),
            blocks: self.sched.target().cached_blocks(),
        }
    }
}

/// Subscribe to the router event stream; with `snapshot`, also the target cache's full
/// blocks as of the subscription point (read in the same message).
pub(super) struct SubscribeEvents {
    pub snapshot: bool,
}

impl Message<SubscribeEvents> for Coordinator {
    type Reply = (EventSubscriber, Option<RouterSnapshot>);

    async fn handle(
        &mut self,
        m: SubscribeEvents,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        // Events recorded so far go out first, so the subscriber starts after them.
        self.drain_events();
        let sub = self.stream.subscribe();
        let snap = m.snapshot.then(|| self.router_snapshot());
        (sub, snap)
    }
}

/// The target cache's full blocks and the stream position they are consistent with.
pub(super) struct GetRouterSnapshot;

impl Message<GetRouterSnapshot> for Coordinator {
    type Reply = RouterSnapshot;

    async fn handle(
        &mut self,
        _: GetRouterSnapshot,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.drain_events();
        self.router_snapshot()
    }
}

/// Tokens of a prompt the target cache would serve now.
pub(super) struct ProbeReuse {
    pub scope: dsa_kv_core::core::ReuseScope,
    pub prompt: Vec<TokenId>,
}

impl Message<ProbeReuse> for Coordinator {
    type Reply = Result<u64, RuntimeError>;

    async fn handle(&mut self, m: ProbeReuse, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(self.sched.probe_reuse(m.scope, &m.prompt)?)
    }
}

impl Coordinator {
    /// Call right after `drain_events`: nothing is pending, so the tree is exactly the
    /// state after every published batch.
    fn router_snapshot(&self) -> RouterSnapshot {
        RouterSnapshot {
            next_seq: self.stream.next_seq(),
            blocks: self.sched.target().router_blocks(),
        }
    }
}

/// The device actors (for fault injection and shutdown).
pub(super) struct Devices;

impl Message<Devices> for Coordinator {
    type Reply = Vec<Option<ActorRef<DeviceActor>>>;

    async fn handle(&mut self, _: Devices, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.devices.clone()
    }
}

/// Check the managers' invariants (tests, drills): `Err` describes the first violation.
pub(super) struct CheckInvariants;

impl Message<CheckInvariants> for Coordinator {
    type Reply = Result<CacheCounts, String>;

    async fn handle(
        &mut self,
        _: CheckInvariants,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let check = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.sched.target().check_invariants();
            if let Some(d) = self.sched.draft() {
                d.check_invariants();
            }
        }));
        match check {
            Ok(()) => {
                let t = self.sched.target();
                Ok(CacheCounts {
                    active_requests: self.sched.num_active(),
                    live_sequences: t.num_sequences(),
                    pages: t.num_pages(),
                    cached_blocks: t.num_cached_blocks(),
                    gpu_slots_used: t.occupied_slots(Tier::Gpu).iter().sum(),
                    host_slots_used: t.occupied_slots(Tier::Host).iter().sum(),
                })
            }
            Err(p) => Err(p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "invariant violated".into())),
        }
    }
}

/// Occupancy of the target cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, kameo::Reply)]
pub struct CacheCounts {
    /// Requests admitted and not finished.
    pub active_requests: usize,
    /// Open sequences.
    pub live_sequences: usize,
    /// Pages alive (in use or cached).
    pub pages: usize,
    /// Blocks cached for reuse.
    pub cached_blocks: usize,
    /// GPU slots in use.
    pub gpu_slots_used: u32,
    /// Host slots in use.
    pub host_slots_used: u32,
}

/// Drop every cached block (after a weight update); refused while requests hold pages.
pub(super) struct ResetPrefixCache;

impl Message<ResetPrefixCache> for Coordinator {
    type Reply = Result<dsa_kv_core::core::ResetReport, RuntimeError>;

    async fn handle(
        &mut self,
        _: ResetPrefixCache,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        use dsa_kv_core::core::scheduler::SchedError;
        let report = self.sched.reset_prefix_cache().map_err(|e| match e {
            SchedError::PrefixCacheInUse { requests } => {
                RuntimeError::PrefixCacheInUse { requests }
            }
            other => other.into(),
        })?;
        // The clear event joins the stream (and the counts) in order with the others.
        self.drain_events();
        tracing::info!(?report, "prefix cache reset");
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsa_kv_core::core::scheduler::Finished;

    fn report(id: u64, tokens: usize) -> Result<FinishedReport, RuntimeError> {
        Ok(FinishedReport {
            finished: Finished {
                id: RequestId(id),
                generated: 1,
                reused_tokens: 0,
                preemptions: 0,
                tokens: vec![dsa_kv_core::ids::TokenId(1); tokens],
                prompt_len: 1,
                last_token: dsa_kv_core::ids::TokenId(1),
                scope: Default::default(),
                block_slots: vec![0; tokens / 64],
                draft_block_slots: None,
            },
            tokens_verified: 0,
            mismatches: Vec::new(),
        })
    }

    /// The store of unwaited results keeps the newest `DONE_CAPACITY`, at most
    /// `DONE_BYTES`, forgets what was taken, and its byte count returns to zero.
    #[test]
    fn unwaited_results_are_bounded_in_count_and_bytes() {
        let mut d = Done::default();
        for id in 0..DONE_CAPACITY as u64 + 100 {
            d.insert(RequestId(id), report(id, 64));
        }
        assert_eq!(d.results.len(), DONE_CAPACITY);
        assert!(d.take(RequestId(99)).is_none(), "the oldest went first");
        assert!(d.take(RequestId(100)).is_some());
        assert!(d.take(RequestId(100)).is_none(), "taken once");
        // Re-inserting an id keeps one entry, the newest.
        d.insert(RequestId(500), report(500, 128));
        let n = d.results.len();
        d.insert(RequestId(500), report(500, 64));
        assert_eq!(d.results.len(), n);
        assert!(d.order.len() <= 2 * DONE_CAPACITY + 1);
        // Four-megabyte results: at most four fit in 16 MiB.
        let big = (4 << 20) / 4;
        for id in 0..8 {
            d.insert(RequestId(10_000 + id), report(10_000 + id, big));
        }
        assert!(d.bytes <= DONE_BYTES, "{}", d.bytes);
        assert!(d.take(RequestId(10_007)).is_some(), "the newest stays");
        assert!(d.take(RequestId(10_000)).is_none());
        let ids: Vec<RequestId> = d.results.keys().copied().collect();
        for id in ids {
            d.take(id);
        }
        assert_eq!((d.results.len(), d.bytes), (0, 0));
    }
}
