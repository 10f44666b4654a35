//! Driving the runtime as an engine loop does, for the runtime tests.

use dsa_kv::actors::{ScheduledRequest, StepReport};
use dsa_kv::core::scheduler::RequestOutcome;
use dsa_kv::ids::TokenId;

/// The outcome of every scheduled request with no draft accepted, and `next(r)` as the
/// sampled token where the step produces one.
pub fn outcomes(
    r: &StepReport,
    next: impl Fn(&ScheduledRequest) -> TokenId,
) -> Vec<RequestOutcome> {
    r.scheduled
        .iter()
        .map(|s| RequestOutcome {
            id: s.id,
            accepted_drafts: 0,
            next_token: s.produces_token.then(|| next(s)),
        })
        .collect()
}
