//! Fault injection into device actors, for the reliability drills: a slow device, a
//! device that panics, and a corrupted page-table entry (the verifier's mutation drill).
//! Compiled only with the `fault-injection` feature; without it a device actor carries a
//! zero-sized [`Faults`] whose hooks do nothing, and the handle has no drill methods.

#[cfg(not(feature = "fault-injection"))]
use {dsa_kv_core::core::scheduler::StepPlan, dsa_kv_device::VerifySpec, std::sync::Arc};

#[cfg(feature = "fault-injection")]
pub(crate) use enabled::InjectFault;
#[cfg(feature = "fault-injection")]
pub use enabled::{DeviceFault, Misdirect};

/// The faults a device actor has been told to inject.
#[derive(Default)]
pub(crate) struct Faults {
    #[cfg(feature = "fault-injection")]
    delay: Option<std::time::Duration>,
    #[cfg(feature = "fault-injection")]
    panic_in_step: bool,
    #[cfg(feature = "fault-injection")]
    misdirect: Option<Misdirect>,
}

#[cfg(not(feature = "fault-injection"))]
impl Faults {
    #[inline]
    pub(crate) fn throttle(&self) {}

    #[inline]
    pub(crate) fn plan(&self, plan: Arc<StepPlan>) -> Arc<StepPlan> {
        plan
    }

    #[inline]
    pub(crate) fn specs(&self, specs: Arc<Vec<VerifySpec>>) -> Arc<Vec<VerifySpec>> {
        specs
    }

    #[inline]
    pub(crate) fn after_step(&self, _device: usize, _step: u64) {}
}

#[cfg(feature = "fault-injection")]
mod enabled {
    use std::sync::Arc;
    use std::time::Duration;

    use kameo::message::{Context, Message};

    use super::Faults;
    use crate::actors::device::DeviceActor;
    use dsa_kv_core::core::scheduler::StepPlan;
    use dsa_kv_core::ids::RequestId;
    use dsa_kv_device::VerifySpec;

    /// A fault to inject into a device actor.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[non_exhaustive]
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
        pub request: RequestId,
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

    impl Faults {
        pub(crate) fn throttle(&self) {
            if let Some(d) = self.delay {
                // Own thread: blocking here stalls only this device, as a slow GPU would.
                std::thread::sleep(d);
            }
        }

        /// The plan as this device sees it (a copy only while a misdirection applies).
        pub(crate) fn plan(&self, plan: Arc<StepPlan>) -> Arc<StepPlan> {
            match self.misdirect {
                Some(m) if plan.requests.iter().any(|r| r.id == m.request) => {
                    let mut p = (*plan).clone();
                    for r in p.requests.iter_mut().filter(|r| r.id == m.request) {
                        m.apply(r.block_slots.make_mut());
                    }
                    Arc::new(p)
                }
                _ => plan,
            }
        }

        /// The verification specs as this device sees them.
        pub(crate) fn specs(&self, specs: Arc<Vec<VerifySpec>>) -> Arc<Vec<VerifySpec>> {
            match self.misdirect {
                Some(m) if specs.iter().any(|s| s.id == m.request) => {
                    let mut v = (*specs).clone();
                    for s in v.iter_mut().filter(|s| s.id == m.request) {
                        m.apply(&mut s.block_slots);
                    }
                    Arc::new(v)
                }
                _ => specs,
            }
        }

        /// After a step's work, before its reply and fence.
        pub(crate) fn after_step(&self, device: usize, step: u64) {
            if self.panic_in_step {
                panic!("device {device}: injected fault in step {step}");
            }
        }
    }

    /// Apply a fault.
    pub(crate) struct InjectFault(pub DeviceFault);

    impl Message<InjectFault> for DeviceActor {
        type Reply = ();

        async fn handle(
            &mut self,
            msg: InjectFault,
            _: &mut Context<Self, Self::Reply>,
        ) -> Self::Reply {
            let f = self.faults_mut();
            match msg.0 {
                DeviceFault::Delay(d) => f.delay = Some(d),
                DeviceFault::NoDelay => f.delay = None,
                DeviceFault::Panic => panic!("device {}: injected fault", self.index()),
                DeviceFault::PanicInNextStep => f.panic_in_step = true,
                DeviceFault::Misdirect(m) => f.misdirect = Some(m),
                DeviceFault::NoMisdirect => f.misdirect = None,
            }
        }
    }
}
