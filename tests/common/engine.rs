//! Driving the runtime as an engine loop does, for the runtime tests.

use std::collections::HashMap;

use dsa_kv::actors::{KvCacheHandle, RuntimeError};
use dsa_kv::core::scheduler::SchedError;
use dsa_kv::ids::TokenId;

/// Runs every submitted request to its end (step, commit with a token that depends on
/// the request and its position, repeat), calling `each` after every step and commit.
pub(crate) async fn run_to_end(kv: &KvCacheHandle, mut each: impl FnMut()) {
    for _ in 0..20_000 {
        let report = kv.step(HashMap::new()).await.unwrap();
        each();
        let outs =
            report.outcomes(|s| TokenId((s.id.0 * 31 + u64::from(s.num_cached)) as u32 % 1000));
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
