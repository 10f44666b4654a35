//! The device actor: one per device, on its own OS thread (device calls block), owning
//! the device's pools, streams and metadata through a [`DeviceBackend`]. It receives one
//! message per step (the shared plan) and answers with what it did.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use kameo::actor::ActorRef;
use kameo::message::{Context, Message};
use kameo::Actor;

use super::backend::{DeviceBackend, DeviceError, DeviceStepReport, Mismatch, VerifySpec};
use super::shared::RuntimeShared;
use crate::core::scheduler::StepPlan;
use crate::metadata::DraftSnapshot;

/// Owns one device. See the module docs.
pub struct DeviceActor {
    backend: Box<dyn DeviceBackend>,
    shared: Arc<RuntimeShared>,
    delay: Option<Duration>,
    panic_in_step: bool,
    /// A deliberately wrong page-table entry (verifier drill).
    misdirect: Option<Misdirect>,
}

/// What a device actor starts with.
pub struct DeviceArgs {
    /// The device.
    pub backend: Box<dyn DeviceBackend>,
    /// State shared with the coordinator and handles.
    pub shared: Arc<RuntimeShared>,
}

impl Actor for DeviceActor {
    type Args = DeviceArgs;
    type Error = Infallible;

    async fn on_start(args: Self::Args, _: ActorRef<Self>) -> Result<Self, Self::Error> {
        tracing::debug!(device = args.backend.index(), "device actor started");
        Ok(DeviceActor {
            backend: args.backend,
            shared: args.shared,
            delay: None,
            panic_in_step: false,
            misdirect: None,
        })
    }
}

impl DeviceActor {
    /// Publishes the bound metadata set for concurrent readers.
    fn publish_bindings(&self) {
        if let Some(p) = self.shared.bindings.get(self.backend.index()) {
            p.publish(self.backend.bindings());
        }
    }

    fn throttle(&self) {
        if let Some(d) = self.delay {
            // Own thread: blocking here stalls only this device, as a slow GPU would.
            std::thread::sleep(d);
        }
    }
}

/// Execute one step plan.
pub struct ExecuteStep(pub Arc<StepPlan>);

impl Message<ExecuteStep> for DeviceActor {
    type Reply = Result<DeviceStepReport, DeviceError>;

    async fn handle(
        &mut self,
        msg: ExecuteStep,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.throttle();
        let _span = tracing::debug_span!(
            "device_step",
            device = self.backend.index(),
            step = msg.0.step
        )
        .entered();
        let plan = match self.misdirect {
            Some(m) if msg.0.requests.iter().any(|r| r.id == m.request) => {
                let mut p = (*msg.0).clone();
                for r in p.requests.iter_mut().filter(|r| r.id == m.request) {
                    m.apply(&mut r.block_slots);
                }
                Arc::new(p)
            }
            _ => msg.0,
        };
        let r = self.backend.execute_step(&plan);
        if self.panic_in_step {
            // After the work, before the reply and the fence: the worst moment.
            panic!(
                "device {}: injected fault in step {}",
                self.backend.index(),
                plan.step
            );
        }
        if r.is_ok() {
            // The step's work is done: publish its fence (release) for the coordinator.
            self.shared
                .fences
                .complete(self.backend.index(), plan.target_fence);
        }
        self.publish_bindings();
        r
    }
}

/// Rebind the metadata to the draft buffers for a plan.
pub struct DraftPrepare(pub Arc<StepPlan>);

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
pub struct DraftForward(pub Arc<StepPlan>);

impl Message<DraftForward> for DeviceActor {
    type Reply = Result<u64, DeviceError>;

    async fn handle(
        &mut self,
        msg: DraftForward,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.throttle();
        self.backend.draft_forward(&msg.0)
    }
}

/// Restore the target bindings.
pub struct DraftRestore(pub DraftSnapshot);

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
pub struct Verify(pub Arc<Vec<VerifySpec>>);

impl Message<Verify> for DeviceActor {
    type Reply = Result<(u64, Vec<Mismatch>), DeviceError>;

    async fn handle(&mut self, msg: Verify, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        match self.misdirect {
            Some(m) if msg.0.iter().any(|s| s.id == m.request) => {
                let mut specs = (*msg.0).clone();
                for s in specs.iter_mut().filter(|s| s.id == m.request) {
                    m.apply(&mut s.block_slots);
                }
                self.backend.verify(&specs)
            }
            _ => self.backend.verify(&msg.0),
        }
    }
}

/// Digest of the device's cache contents.
pub struct CacheDigest;

impl Message<CacheDigest> for DeviceActor {
    type Reply = Result<String, DeviceError>;

    async fn handle(&mut self, _: CacheDigest, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.backend.cache_digest()
    }
}

/// Fault injection for reliability tests and drills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceFault {
    /// Every following message waits this long first (a slow device).
    Delay(Duration),
    /// Back to full speed.
    NoDelay,
    /// Panic while handling this message (a crashed device).
    Panic,
    /// Panic in the middle of the next step, while the coordinator awaits it.
    PanicInNextStep,
    /// From now on this device addresses one block of one request in a wrong slot, in
    /// steps and in verification alike: a corrupted page-table entry, for proving that
    /// verification catches a request reading another page (another prefix's, another
    /// tenant's, or any wrong slot). `block` past the request's table changes nothing.
    Misdirect(Misdirect),
    /// Back to the correct page tables.
    NoMisdirect,
}

/// One wrong block-table entry (see [`DeviceFault::Misdirect`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Misdirect {
    /// The request.
    pub request: crate::ids::RequestId,
    /// Its block (ordinal in its block table).
    pub block: usize,
    /// The slot the device uses instead.
    pub slot: i32,
}

impl Misdirect {
    fn apply(&self, block_slots: &mut [i32]) {
        if let Some(s) = block_slots.get_mut(self.block) {
            *s = self.slot;
        }
    }
}

/// Apply a fault.
pub struct InjectFault(pub DeviceFault);

impl Message<InjectFault> for DeviceActor {
    type Reply = ();

    async fn handle(
        &mut self,
        msg: InjectFault,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        match msg.0 {
            DeviceFault::Delay(d) => self.delay = Some(d),
            DeviceFault::NoDelay => self.delay = None,
            DeviceFault::Panic => panic!("device {}: injected fault", self.backend.index()),
            DeviceFault::PanicInNextStep => self.panic_in_step = true,
            DeviceFault::Misdirect(m) => self.misdirect = Some(m),
            DeviceFault::NoMisdirect => self.misdirect = None,
        }
    }
}
