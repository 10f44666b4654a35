//! [`SyncLoop`]: the coordinator's step on one thread, for tests and tools that drive a
//! [`Scheduler`] and device backends without the actors: schedule, every device runs
//! the plan, the devices must sample the same, the scheduler commits, finished requests
//! are finalized, and the forward's proposals become the next step's drafts. The actor
//! runtime (`dsa_kv::KvCacheHandle`) does the same asynchronously with everything a
//! product needs around it; this is its plain twin.

use std::collections::HashMap;

use dsa_kv_core::core::scheduler::{Finished, Scheduler, StepPlan};
use dsa_kv_core::ids::{RequestId, TokenId};

use crate::backend::DeviceBackend;
use crate::forward::Sampling;

/// What one [`SyncLoop::step`] did (a finished request's tokens:
/// [`Finished::output`]).
#[derive(Debug)]
pub struct SyncStep {
    /// The plan every device ran.
    pub plan: StepPlan,
    /// Requests finished by the step.
    pub finished: Vec<Finished>,
}

/// The coordinator's step on one thread. See the module docs.
#[derive(Debug, Default)]
pub struct SyncLoop {
    drafts: HashMap<RequestId, Vec<TokenId>>,
}

impl SyncLoop {
    /// A loop with no drafts yet.
    pub fn new() -> Self {
        SyncLoop::default()
    }

    /// Runs one step on every device (`Ok(None)` when no request is left). The devices'
    /// forward must sample (an engine-sampling forward has nothing to commit here).
    pub fn step(
        &mut self,
        s: &mut Scheduler,
        devices: &mut [&mut dyn DeviceBackend],
    ) -> Result<Option<SyncStep>, String> {
        if devices.is_empty() {
            return Err("a step needs at least one device".into());
        }
        if s.num_active() == 0 {
            return Ok(None);
        }
        let plan = s.schedule(&self.drafts).map_err(|e| e.to_string())?;
        let mut sampled = None;
        for d in devices.iter_mut() {
            let r = d.execute_step(&plan).map_err(|e| e.to_string())?;
            let Sampling::Sampled(got) = r.sampling else {
                return Err(format!("device {}: the forward did not sample", d.index()));
            };
            match &sampled {
                None => sampled = Some(got),
                Some(first) if *first != got => {
                    return Err(format!(
                        "step {}: device {} sampled other tokens than the first device",
                        plan.step,
                        d.index()
                    ))
                }
                Some(_) => {}
            }
        }
        s.complete(plan.target_fence, plan.draft_fence)
            .map_err(|e| e.to_string())?;
        let finished = match sampled {
            Some(got) if !plan.requests.is_empty() => {
                let finished = s.commit(&got.outcomes).map_err(|e| e.to_string())?;
                self.drafts = got.drafts.into_iter().collect();
                let ids: Vec<RequestId> = finished.iter().map(|f| f.id).collect();
                s.finalize(&ids).map_err(|e| e.to_string())?;
                finished
            }
            _ => Vec::new(),
        };
        Ok(Some(SyncStep { plan, finished }))
    }
}
