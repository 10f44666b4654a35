//! Driving the runtime as an engine loop does, for the runtime tests.

use std::collections::HashMap;

use dsa_kv::actors::{KvCacheHandle, RuntimeError, ScheduledRequest, StepReport};
use dsa_kv::core::scheduler::{RequestOutcome, SchedError};
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

/// Runs every submitted request to its end (step, commit with a token that depends on
/// the request and its position, repeat), calling `each` after every step and commit.
pub async fn run_to_end(kv: &KvCacheHandle, mut each: impl FnMut()) {
    for _ in 0..20_000 {
        let report = kv.step(HashMap::new()).await.unwrap();
        each();
        let outs = outcomes(&report, |s| {
            TokenId((s.id.0 * 31 + u64::from(s.num_cached)) as u32 % 1000)
        });
        if !outs.is_empty() {
            match kv.commit(outs).await {
                Ok(_) | Err(RuntimeError::Scheduler(SchedError::NothingToCommit)) => {}
                Err(e) => panic!("commit: {e}"),
            }
            each();
        }
        if kv.counters().in_flight == 0 {
            return;
        }
    }
    panic!("the requests did not finish");
}
