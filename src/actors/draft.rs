//! The draft-replay actor: for each speculative step with a separate draft cache, asks
//! every device for a metadata snapshot and the rebinding to its draft buffers, runs the
//! draft layers, and asks for the exact restore. Devices replay concurrently; each
//! device's prepare → draft → restore is in order. A failed draft still restores.

use std::convert::Infallible;
use std::sync::Arc;

use futures::future::join_all;
use kameo::actor::ActorRef;
use kameo::message::{Context, Message};
use kameo::Actor;
use serde::Serialize;
use tracing::Instrument;

use super::device::{DeviceActor, DraftForward, DraftPrepare, DraftRestore};
use super::error::RuntimeError;
use dsa_kv_core::core::scheduler::StepPlan;
use dsa_kv_device::forward::Proposals;

/// Replays drafts. See the module docs.
pub(super) struct DraftReplayActor {
    devices: Vec<ActorRef<DeviceActor>>,
    replays: u64,
}

impl Actor for DraftReplayActor {
    type Args = Vec<ActorRef<DeviceActor>>;
    type Error = Infallible;

    async fn on_start(devices: Self::Args, _: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(DraftReplayActor {
            devices,
            replays: 0,
        })
    }
}

/// What one replay did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DraftReport {
    /// Devices that replayed.
    pub devices: usize,
    /// Draft tokens written per device.
    pub tokens: u64,
    /// Replays so far.
    pub replays: u64,
    /// The drafts the draft layers proposed for the requests' next steps (every device
    /// proposed the same).
    pub proposals: Proposals,
}

/// Replay the draft of one step on every device.
pub(super) struct DraftStep(pub Arc<StepPlan>);

async fn replay(
    dev: ActorRef<DeviceActor>,
    plan: Arc<StepPlan>,
) -> Result<(u64, Proposals), RuntimeError> {
    let snapshot = dev.ask(DraftPrepare(plan.clone())).await?;
    let drafted = dev.ask(DraftForward(plan)).await;
    // Restore whatever the draft did: the target bindings must come back.
    dev.ask(DraftRestore(snapshot)).await?;
    Ok(drafted?)
}

impl Message<DraftStep> for DraftReplayActor {
    type Reply = Result<DraftReport, RuntimeError>;

    async fn handle(&mut self, msg: DraftStep, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let span = tracing::debug_span!("draft_replay", step = msg.0.step);
        let results = join_all(
            self.devices
                .iter()
                .map(|d| replay(d.clone(), msg.0.clone())),
        )
        .instrument(span)
        .await;
        let mut tokens = 0;
        let mut proposals: Option<Proposals> = None;
        for (device, r) in results.into_iter().enumerate() {
            let (n, p) = r?;
            tokens = n;
            match &proposals {
                None => proposals = Some(p),
                Some(first) if *first != p => {
                    return Err(RuntimeError::DevicesDisagree {
                        step: msg.0.step,
                        device,
                        what: "draft proposals",
                    })
                }
                Some(_) => {}
            }
        }
        self.replays += 1;
        Ok(DraftReport {
            devices: self.devices.len(),
            tokens,
            replays: self.replays,
            proposals: proposals.unwrap_or_default(),
        })
    }
}

/// Replace the device list (after a device died).
pub(super) struct SetDevices(pub Vec<ActorRef<DeviceActor>>);

impl Message<SetDevices> for DraftReplayActor {
    type Reply = ();

    async fn handle(&mut self, msg: SetDevices, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.devices = msg.0;
    }
}
