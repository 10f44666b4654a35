//! The device actor: one per device, on its own OS thread (device calls block), owning
//! the device's pools, streams and metadata through a [`DeviceBackend`]. It receives one
//! message per step (the shared plan) and answers with what it did.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kameo::actor::{ActorRef, WeakActorRef};
use kameo::mailbox::{MailboxReceiver, Signal};
use kameo::message::{Context, Message};
use kameo::Actor;
use tokio::sync::mpsc::error::TryRecvError;

use super::faults::Faults;
use super::shared::RuntimeShared;
use dsa_kv_core::core::scheduler::StepPlan;
use dsa_kv_core::metadata::DraftSnapshot;
use dsa_kv_device::backend::{DeviceBackend, DeviceError, DeviceStepReport, Mismatch, VerifySpec};
use dsa_kv_device::forward::Proposals;

/// Owns one device. See the module docs.
pub(super) struct DeviceActor {
    backend: Box<dyn DeviceBackend>,
    shared: Arc<RuntimeShared>,
    /// Injected faults (drills; nothing without the `fault-injection` feature).
    faults: Faults,
    /// How long the thread polls its mailbox after a message before parking.
    idle_spin: Duration,
}

/// What a device actor starts with.
pub(super) struct DeviceArgs {
    /// The device.
    pub backend: Box<dyn DeviceBackend>,
    /// State shared with the coordinator and handles.
    pub shared: Arc<RuntimeShared>,
    /// How long the thread polls its mailbox after a message before parking
    /// ([`KvCacheBuilder::idle_spin`](super::KvCacheBuilder::idle_spin)).
    pub idle_spin: Duration,
}

impl Actor for DeviceActor {
    type Args = DeviceArgs;
    type Error = Infallible;

    async fn on_start(args: Self::Args, _: ActorRef<Self>) -> Result<Self, Self::Error> {
        tracing::debug!(device = args.backend.index(), "device actor started");
        Ok(DeviceActor {
            backend: args.backend,
            shared: args.shared,
            faults: Faults::default(),
            idle_spin: args.idle_spin,
        })
    }

    /// Polls the mailbox for up to `idle_spin` before parking the thread: a message that
    /// arrives while it polls costs its sender no wake-up and its receiver no scheduling
    /// delay.
    async fn next(
        &mut self,
        _: WeakActorRef<Self>,
        mailbox: &mut MailboxReceiver<Self>,
    ) -> Result<Option<Signal<Self>>, Self::Error> {
        if !self.idle_spin.is_zero() {
            let until = Instant::now() + self.idle_spin;
            loop {
                match mailbox.try_recv() {
                    Ok(signal) => return Ok(Some(signal)),
                    Err(TryRecvError::Disconnected) => return Ok(None),
                    Err(TryRecvError::Empty) => {}
                }
                if Instant::now() >= until {
                    break;
                }
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            }
        }
        Ok(mailbox.recv().await)
    }
}

impl DeviceActor {
    /// The device index.
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    pub(crate) fn index(&self) -> usize {
        self.backend.index()
    }

    /// The faults to inject (drills).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn faults_mut(&mut self) -> &mut Faults {
        &mut self.faults
    }

    /// Publishes the bound metadata set for concurrent readers.
    fn publish_bindings(&self) {
        if let Some(p) = self.shared.bindings.get(self.backend.index()) {
            p.publish(self.backend.bindings());
        }
    }
}

/// When a device's step handler started and finished ([`StepTiming`](super::StepTiming)).
#[derive(Clone, Copy, Debug)]
pub(super) struct DeviceStamps {
    /// The handler started.
    pub received: Instant,
    /// The handler finished (the reply is sent right after).
    pub replied: Instant,
}

/// Execute one step plan.
pub(super) struct ExecuteStep(pub Arc<StepPlan>);

impl Message<ExecuteStep> for DeviceActor {
    type Reply = Result<(DeviceStepReport, DeviceStamps), DeviceError>;

    async fn handle(
        &mut self,
        msg: ExecuteStep,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let received = Instant::now();
        self.faults.throttle();
        let _span = tracing::debug_span!(
            "device_step",
            device = self.backend.index(),
            step = msg.0.step
        )
        .entered();
        let plan = self.faults.plan(msg.0);
        let r = self.backend.execute_step(&plan);
        // After the work, before the reply and the fence: the worst moment.
        self.faults.after_step(self.backend.index(), plan.step);
        if r.is_ok() {
            // The step's work is done: publish its fence (release) for the coordinator.
            self.shared
                .fences
                .complete(self.backend.index(), plan.target_fence);
        }
        self.publish_bindings();
        r.map(|rep| {
            let replied = Instant::now();
            (rep, DeviceStamps { received, replied })
        })
    }
}

/// Rebind the metadata to the draft buffers for a plan.
pub(super) struct DraftPrepare(pub Arc<StepPlan>);

impl Message<DraftPrepare> for DeviceActor {
    type Reply = Result<DraftSnapshot, DeviceError>;

    async fn handle(
        &mut self,
        msg: DraftPrepare,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let r = self.backend.draft_prepare(&msg.0);
        self.publish_bindings();
        r
    }
}

/// Run the draft layers of a plan against the bound draft metadata.
pub(super) struct DraftForward(pub Arc<StepPlan>);

impl Message<DraftForward> for DeviceActor {
    type Reply = Result<(u64, Proposals), DeviceError>;

    async fn handle(
        &mut self,
        msg: DraftForward,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.faults.throttle();
        self.backend.draft_forward(&msg.0)
    }
}

/// Restore the target bindings.
pub(super) struct DraftRestore(pub DraftSnapshot);

impl Message<DraftRestore> for DeviceActor {
    type Reply = Result<(), DeviceError>;

    async fn handle(
        &mut self,
        msg: DraftRestore,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let r = self.backend.draft_restore(&msg.0);
        self.publish_bindings();
        r
    }
}

/// Verify whole requests.
pub(super) struct Verify(pub Arc<Vec<VerifySpec>>);

impl Message<Verify> for DeviceActor {
    type Reply = Result<(u64, Vec<Mismatch>), DeviceError>;

    async fn handle(&mut self, msg: Verify, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let specs = self.faults.specs(msg.0);
        self.backend.verify(&specs)
    }
}

/// Wait for every step enqueued on the device.
pub(super) struct Synchronize;

impl Message<Synchronize> for DeviceActor {
    type Reply = Result<(), DeviceError>;

    async fn handle(&mut self, _: Synchronize, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.backend.synchronize()
    }
}

/// The device's pools as memory regions a transport registers.
pub(super) struct PoolRegions;

impl Message<PoolRegions> for DeviceActor {
    type Reply = Vec<dsa_kv_device::transfer::PoolRegion>;

    async fn handle(&mut self, _: PoolRegions, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.backend.pool_regions()
    }
}

/// Digest of the device's cache contents.
pub(super) struct CacheDigest;

impl Message<CacheDigest> for DeviceActor {
    type Reply = Result<String, DeviceError>;

    async fn handle(&mut self, _: CacheDigest, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.backend.cache_digest()
    }
}
