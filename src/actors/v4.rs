//! DeepSeek-V4 through actors: [`V4Runtime`], a cheap-to-clone async handle in front of
//! a coordinator actor that owns the [`V4Scheduler`] (and through it the V4 cache
//! manager), and one device actor per device (own OS thread) that owns a [`V4Device`]
//! (pools and the model's forward: a `V4HostDevice` on the host backend, the model's
//! CUDA device on a GPU; the two can serve one runtime side by side). A step is: the coordinator
//! schedules, sends the one plan to every device (tensor parallelism: every device runs
//! the same decision), checks that every device returned the same outcomes (sampled
//! tokens, drafts accepted, proposals), and commits them.
//!
//! The V3.2 runtime ([`KvCacheHandle`](super::KvCacheHandle)) is untouched; V4 has its
//! own scheduler and step plan (windows, compressed blocks, recompute-only preemption).

use std::convert::Infallible;
use std::sync::Arc;

use futures::future::join_all;
use kameo::actor::{ActorRef, Spawn};
use kameo::message::{Context, Message};
use kameo::Actor;
use serde::Serialize;

use dsa_kv_core::core::scheduler::SubmitRequest;
use dsa_kv_core::core::WindowStats;
use dsa_kv_core::core::{
    V4Failed, V4Finished, V4Outcome, V4SchedError, V4SchedStats, V4Scheduler, V4Stats, V4StepPlan,
};
use dsa_kv_core::ids::RequestId;
use dsa_kv_device::v4::{V4Device, V4DeviceError};

/// What the V4 runtime refuses or fails with.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum V4RuntimeError {
    /// The scheduler refused (a bad request or outcome, no room ever).
    #[error(transparent)]
    Sched(#[from] V4SchedError),
    /// A device failed the step (the step stays uncommitted: the runtime stops
    /// scheduling).
    #[error(transparent)]
    Device(#[from] V4DeviceError),
    /// Devices returned different outcomes for one step.
    #[error(
        "step {step}: device {device} returned other outcomes than device 0 (every device \
         must compute the same tokens)"
    )]
    Disagree {
        /// The step.
        step: u64,
        /// The first device that disagreed.
        device: usize,
    },
    /// No devices.
    #[error("a V4 runtime needs at least one device")]
    NoDevices,
    /// An actor is gone.
    #[error("the V4 runtime is not running: {0}")]
    NotRunning(String),
}

impl<M, E: Into<V4RuntimeError>> From<kameo::error::SendError<M, E>> for V4RuntimeError {
    fn from(e: kameo::error::SendError<M, E>) -> Self {
        use kameo::error::SendError as S;
        match e {
            S::HandlerError(e) => e.into(),
            S::ActorNotRunning(_) | S::ActorStopped => {
                V4RuntimeError::NotRunning("an actor has stopped".into())
            }
            S::ActorRestarting(_) => V4RuntimeError::NotRunning("an actor is restarting".into()),
            S::MailboxFull(_) => V4RuntimeError::NotRunning("a mailbox is full".into()),
            S::Timeout(_) => V4RuntimeError::NotRunning("timed out".into()),
        }
    }
}

impl From<kameo::error::Infallible> for V4RuntimeError {
    fn from(e: kameo::error::Infallible) -> Self {
        match e {}
    }
}

impl From<Infallible> for V4RuntimeError {
    fn from(e: Infallible) -> Self {
        match e {}
    }
}

/// What one step did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct V4StepReport {
    /// Step number.
    pub step: u64,
    /// Requests that ran.
    pub requests: usize,
    /// Tokens computed (chunks, sampled tokens and drafts).
    pub tokens: usize,
    /// Slot copies run before the forward (offload and onboarding).
    pub slot_copies: usize,
    /// Device 0's outcomes (every device's were equal).
    pub outcomes: Vec<V4Outcome>,
    /// Requests finished by the step.
    pub finished: Vec<V4Finished>,
    /// Requests preempted by the step (they recompute when admitted again).
    pub preempted: Vec<RequestId>,
    /// Requests ended because the cache can never hold them.
    pub failed: Vec<V4Failed>,
}

/// The runtime's counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, kameo::Reply)]
pub struct V4RuntimeStats {
    /// The scheduler's.
    pub sched: V4SchedStats,
    /// The cache manager's.
    #[serde(skip)]
    pub cache: V4Stats,
    /// The window life cycles'.
    #[serde(skip)]
    pub windows: WindowStats,
    /// Requests not finished.
    pub unfinished: usize,
}

struct V4DeviceActor {
    dev: Box<dyn V4Device>,
}

impl Actor for V4DeviceActor {
    type Args = Box<dyn V4Device>;
    type Error = Infallible;

    async fn on_start(dev: Self::Args, _: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(V4DeviceActor { dev })
    }
}

struct RunStep(Arc<V4StepPlan>);

impl Message<RunStep> for V4DeviceActor {
    type Reply = Result<Vec<V4Outcome>, V4DeviceError>;

    async fn handle(&mut self, msg: RunStep, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let _span = tracing::debug_span!(
            "v4_device_step",
            device = self.dev.index(),
            step = msg.0.step
        )
        .entered();
        self.dev.execute(&msg.0)
    }
}

struct V4Coordinator {
    sched: V4Scheduler,
    devices: Vec<ActorRef<V4DeviceActor>>,
}

struct CoordinatorArgs {
    sched: V4Scheduler,
    devices: Vec<ActorRef<V4DeviceActor>>,
}

impl Actor for V4Coordinator {
    type Args = CoordinatorArgs;
    type Error = Infallible;

    async fn on_start(a: Self::Args, me: ActorRef<Self>) -> Result<Self, Self::Error> {
        for d in &a.devices {
            me.link(d).await;
        }
        Ok(V4Coordinator {
            sched: a.sched,
            devices: a.devices,
        })
    }
}

struct Submit(SubmitRequest);

impl Message<Submit> for V4Coordinator {
    type Reply = Result<(), V4RuntimeError>;

    async fn handle(&mut self, msg: Submit, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(self.sched.submit(msg.0)?)
    }
}

struct Cancel(RequestId);

impl Message<Cancel> for V4Coordinator {
    type Reply = Result<bool, V4RuntimeError>;

    async fn handle(&mut self, msg: Cancel, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(self.sched.cancel(msg.0)?)
    }
}

struct Stats;

impl Message<Stats> for V4Coordinator {
    type Reply = V4RuntimeStats;

    async fn handle(&mut self, _: Stats, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        V4RuntimeStats {
            sched: self.sched.stats(),
            cache: self.sched.manager().stats(),
            windows: self.sched.manager().window_stats(),
            unfinished: self.sched.num_unfinished(),
        }
    }
}

struct Step;

impl Message<Step> for V4Coordinator {
    type Reply = Result<Option<V4StepReport>, V4RuntimeError>;

    async fn handle(&mut self, _: Step, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let Some(plan) = self.sched.schedule()? else {
            return Ok(None);
        };
        let plan = Arc::new(plan);
        let replies = join_all(self.devices.iter().map(|d| {
            let plan = plan.clone();
            async move { d.ask(RunStep(plan)).await }
        }))
        .await;
        let mut outcomes: Option<Vec<V4Outcome>> = None;
        for (device, r) in replies.into_iter().enumerate() {
            let r = r?;
            match &outcomes {
                None => outcomes = Some(r),
                Some(first) if *first != r => {
                    return Err(V4RuntimeError::Disagree {
                        step: plan.step,
                        device,
                    })
                }
                Some(_) => {}
            }
        }
        let outcomes = outcomes.expect("invariant: at least one device");
        let finished = self.sched.commit(&outcomes)?;
        Ok(Some(V4StepReport {
            step: plan.step,
            requests: plan.requests.len(),
            tokens: plan.requests.iter().map(|p| p.tokens.len()).sum(),
            slot_copies: plan.copies.iter().map(|c| c.num_slot_copies()).sum(),
            outcomes,
            finished,
            preempted: plan.preempted.clone(),
            failed: plan.failed.clone(),
        }))
    }
}

/// The V4 runtime's handle. See the module docs.
#[derive(Clone)]
pub struct V4Runtime {
    coordinator: ActorRef<V4Coordinator>,
}

impl V4Runtime {
    /// Starts the actors: the coordinator over `sched`, one device actor (own thread)
    /// per device. Needs a tokio runtime.
    pub async fn start<D: V4Device>(
        sched: V4Scheduler,
        devices: Vec<D>,
    ) -> Result<V4Runtime, V4RuntimeError> {
        if devices.is_empty() {
            return Err(V4RuntimeError::NoDevices);
        }
        // Device actors run on threads of their own, which a current-thread runtime
        // cannot give them.
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {}
            _ => {
                return Err(V4RuntimeError::NotRunning(
                    "start the V4 runtime inside a multi-threaded tokio runtime \
                     (#[tokio::main] or Runtime::new())"
                        .into(),
                ))
            }
        }
        let devices = devices
            .into_iter()
            .map(|d| V4DeviceActor::spawn_in_thread(Box::new(d) as Box<dyn V4Device>))
            .collect();
        let coordinator = V4Coordinator::spawn(CoordinatorArgs { sched, devices });
        coordinator.wait_for_startup().await;
        Ok(V4Runtime { coordinator })
    }

    /// Queues a request.
    pub async fn submit(&self, r: SubmitRequest) -> Result<(), V4RuntimeError> {
        Ok(self.coordinator.ask(Submit(r)).await?)
    }

    /// Cancels a request not in the pending step (`Ok(false)`: unknown).
    pub async fn cancel(&self, id: RequestId) -> Result<bool, V4RuntimeError> {
        Ok(self.coordinator.ask(Cancel(id)).await?)
    }

    /// Runs one step on every device; `Ok(None)` when no request is unfinished.
    pub async fn step(&self) -> Result<Option<V4StepReport>, V4RuntimeError> {
        Ok(self.coordinator.ask(Step).await?)
    }

    /// The counters.
    pub async fn stats(&self) -> Result<V4RuntimeStats, V4RuntimeError> {
        Ok(self.coordinator.ask(Stats).await?)
    }

    /// Stops the actors.
    pub async fn stop(self) {
        let _ = self.coordinator.stop_gracefully().await;
        self.coordinator.wait_for_shutdown().await;
    }
}
