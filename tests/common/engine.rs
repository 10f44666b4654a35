//! Driving the runtime as an engine loop does: the one step/commit loop that the runtime
//! tests and the `route` example share (the example includes this file with `#[path]`).

use std::collections::HashMap;

use dsa_kv::actors::{KvCacheHandle, RuntimeError};
use dsa_kv::core::scheduler::SchedError;
use dsa_kv::ids::TokenId;

/// Runs every submitted request to its end (step, commit with a token that depends on
/// the request and its position, repeat), calling `each` after every step and commit.
/// The first error of a step or a commit is returned; so is a run that does not finish
/// within 100,000 steps.
pub(crate) async fn try_run_to_end(
    kv: &KvCacheHandle,
    mut each: impl FnMut(),
) -> Result<(), String> {
    for _ in 0..100_000 {
        if !step_with(kv, &mut each).await? {
            return Ok(());
        }
    }
    Err("the requests did not finish".into())
}

/// One step and its commit (the token of [`try_run_to_end`]); whether requests are
/// still in flight after it.
#[allow(dead_code)] // The `route` example runs whole loops only.
pub(crate) async fn step_once(kv: &KvCacheHandle) -> Result<bool, String> {
    step_with(kv, &mut || {}).await
}

async fn step_with(kv: &KvCacheHandle, each: &mut impl FnMut()) -> Result<bool, String> {
    let report = kv
        .step(HashMap::new())
        .await
        .map_err(|e| format!("step: {e}"))?;
    each();
    let outs =
        report.outcomes_from(|s| TokenId((s.id.0 * 31 + u64::from(s.num_cached)) as u32 % 1000));
    if !outs.is_empty() {
        match kv.commit(outs).await {
            Ok(_) | Err(RuntimeError::Scheduler(SchedError::NothingToCommit)) => {}
            Err(e) => return Err(format!("commit: {e}")),
        }
        each();
    }
    Ok(kv.counters().in_flight > 0)
}

/// [`try_run_to_end`], panicking on its error (for tests).
#[allow(dead_code)] // The `route` example returns the error instead.
pub(crate) async fn run_to_end(kv: &KvCacheHandle, each: impl FnMut()) {
    if let Err(e) = try_run_to_end(kv, each).await {
        panic!("{e}");
    }
}
