//! One GPU budget for the target cache and a separate draft cache: the runtime starts
//! across a sweep of budgets, what it reserves stays within the budget, and the plan
//! the `plan` example prints (`CapacityPlan`) is exactly what the pools were sized to.
//!
//! The expected pool sizes are recomputed here from the pool plans' slot sizes (each
//! pool `slots × slot_bytes` rounded up to 2 MiB), not with the crate's quota code.
mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dsa_kv::actors::{KvCacheBuilder, RuntimeError};
use dsa_kv::config::{EngineConfig, SpecMode};
use dsa_kv::core::quota::{BudgetSource, CapacityPlan, QuotaError};
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::core::ReuseScope;
use dsa_kv::device::{
    DeviceBackend, DeviceError, DeviceSetup, DeviceStepReport, Mismatch, VerifySpec,
};
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::layout::PoolPlan;
use dsa_kv::metadata::DraftSnapshot;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Bytes of `plan`'s pools with `slots` slots per group, each pool rounded to 2 MiB.
fn pool_bytes(plan: &PoolPlan, slots: u64) -> u64 {
    plan.pool_groups()
        .iter()
        .flat_map(|g| g.pools.iter())
        .map(|p| (slots * p.slot_bytes).div_ceil(2 * MIB) * 2 * MIB)
        .sum()
}

fn config(layers: u32, mtp: Option<bool>) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(layers);
    if let Some(separate) = mtp {
        c.spec_decode.mode = SpecMode::Mtp;
        c.spec_decode.draft_tokens = 2;
        c.spec_decode.separate_draft_cache = separate;
    }
    c
}

/// What a backend was asked to allocate.
#[derive(Clone, Debug, PartialEq)]
struct Sized {
    target_gpu: Vec<u32>,
    target_host: Vec<u32>,
    target_bytes: u64,
    draft_bytes: u64,
}

/// A backend that allocates nothing and records its setup, so budgets of tens of GiB
/// can be started on a small machine.
struct Recorder;

impl DeviceBackend for Recorder {
    fn index(&self) -> usize {
        0
    }
    fn execute_step(
        &mut self,
        _: &dsa_kv::core::scheduler::StepPlan,
    ) -> Result<DeviceStepReport, DeviceError> {
        unreachable!("the budget sweep runs no step")
    }
    fn draft_prepare(
        &mut self,
        _: &dsa_kv::core::scheduler::StepPlan,
    ) -> Result<DraftSnapshot, DeviceError> {
        unreachable!("the budget sweep runs no step")
    }
    fn draft_forward(
        &mut self,
        _: &dsa_kv::core::scheduler::StepPlan,
    ) -> Result<(u64, dsa_kv::device::Proposals), DeviceError> {
        unreachable!("the budget sweep runs no step")
    }
    fn draft_restore(&mut self, _: &DraftSnapshot) -> Result<(), DeviceError> {
        unreachable!("the budget sweep runs no step")
    }
    fn verify(&mut self, _: &[VerifySpec]) -> Result<(u64, Vec<Mismatch>), DeviceError> {
        Ok((0, vec![]))
    }
    fn cache_digest(&mut self) -> Result<String, DeviceError> {
        Ok(String::new())
    }
}

async fn start_recorded(
    c: EngineConfig,
) -> Result<(dsa_kv::actors::KvCacheHandle, Sized), RuntimeError> {
    let seen: Arc<Mutex<Option<Sized>>> = Arc::default();
    let s = seen.clone();
    let kv = KvCacheBuilder::new()
        .config(c)
        .backend(Arc::new(move |_, setup: DeviceSetup| {
            let (gpu, host) = setup.target_slots.clone();
            let slots = u64::from(gpu[0]);
            *s.lock().unwrap() = Some(Sized {
                target_gpu: gpu,
                target_host: host,
                target_bytes: pool_bytes(&setup.target_plan, slots),
                draft_bytes: setup
                    .draft_plan
                    .as_ref()
                    .map_or(0, |d| pool_bytes(d, slots)),
            });
            Ok(Box::new(Recorder))
        }))
        .start()
        .await?;
    let sized = seen.lock().unwrap().clone().expect("the factory ran");
    Ok((kv, sized))
}

/// The reproduction: MTP with a separate draft cache and an explicit byte
/// budget used to fail whatever the budget ("only 0 of the 67108864-byte KV budget are
/// left"). It must start, and serve a request to the end on the host backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtp_with_a_byte_budget_starts_and_serves() {
    let mut c = config(3, Some(true));
    c.kv_cache.max_gpu_total_bytes = Some(64 << 20);
    let kv = KvCacheBuilder::new().config(c).start().await.unwrap();
    let info = kv.info().clone();
    assert!(info.draft_cache);
    let (reserved, cap) = kv.quota();
    assert_eq!(cap, 64 << 20);
    assert_eq!(reserved, info.budget.allocated_bytes);
    assert!(reserved <= cap);
    assert!(info.budget.draft_bytes > 0 && info.budget.target_bytes > 0);
    // `.ci/run` checks that `plan --model deepseek-v3.2 --layers 3 --with-mtp
    // --max-gpu-total-bytes 67108864 --json` prints the same 341 blocks.
    assert_eq!(info.budget.slots, 341);
    let prompt: Vec<TokenId> = (0..300).map(TokenId).collect();
    kv.submit(SubmitRequest {
        id: RequestId(1),
        scope: ReuseScope::SHARED,
        prompt,
        max_new_tokens: 8,
        priority: 35,
    })
    .await
    .unwrap();
    let mut finished = false;
    for _ in 0..100 {
        let report = kv.step(HashMap::new()).await.unwrap();
        let commit = kv
            .commit(report.outcomes_from(|_| TokenId(7)))
            .await
            .unwrap();
        if !commit.finished.is_empty() {
            assert!(commit
                .finished
                .iter()
                .all(|f| f.mismatches.is_empty() && f.tokens_verified > 0));
            finished = true;
            break;
        }
    }
    assert!(finished, "the request never finished");
    kv.shutdown().await;
}

/// Budgets from the smallest that holds one block in every pool of both caches up to
/// 64 GiB, with and without a draft cache: start succeeds, target + draft ≤ budget, the
/// slots are the largest count that fits, and the capacity plan equals what the
/// backends were asked to allocate and what the quota ledger reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_sweep_with_and_without_a_draft_cache() {
    for (layers, mtp) in [
        (3, None),
        (3, Some(true)),
        (61, Some(true)),
        (61, Some(false)),
    ] {
        let base = config(layers, mtp);
        let resolved = base.resolve().unwrap();
        let one = CapacityPlan::new(
            &{
                let mut r = resolved.clone();
                r.config.kv_cache.max_tokens = Some(1);
                r
            },
            None,
        )
        .unwrap();
        // The smallest budget: one slot in every pool of both caches.
        let smallest =
            pool_bytes(&one.target, 1) + one.draft.as_ref().map_or(0, |d| pool_bytes(d, 1));
        let mut budgets = vec![smallest, smallest + 1, 3 * smallest - 1, 256 * MIB];
        budgets.extend([GIB, 7 * GIB + 12345, 24 * GIB, 64 * GIB]);
        for budget in budgets {
            let mut c = base.clone();
            c.kv_cache.max_gpu_total_bytes = Some(budget);
            let what = format!("{layers} layers, mtp {mtp:?}, budget {budget}");
            let (kv, sized) = start_recorded(c.clone()).await.expect(&what);
            let info = kv.info().clone();
            let slots = info.budget.slots;
            assert!(slots >= 1, "{what}");
            assert_eq!(info.draft_cache, mtp == Some(true), "{what}");
            // Independently recomputed sizes: the backend was sized to the plan.
            assert!(
                sized.target_gpu.iter().all(|&s| u64::from(s) == slots),
                "{what}"
            );
            assert!(sized.target_host.is_empty(), "{what}");
            assert_eq!(sized.target_bytes, info.budget.target_bytes, "{what}");
            assert_eq!(sized.draft_bytes, info.budget.draft_bytes, "{what}");
            assert_eq!(sized.draft_bytes > 0, mtp == Some(true), "{what}");
            let total = sized.target_bytes + sized.draft_bytes;
            assert!(total <= budget, "{what}: {total} > {budget}");
            // The largest slot count that fits: one more slot would not.
            let next = pool_bytes(&one.target, slots + 1)
                + one.draft.as_ref().map_or(0, |d| pool_bytes(d, slots + 1));
            assert!(next > budget, "{what}: {} slots would fit", slots + 1);
            // What the ledger reserved is what was allocated.
            assert_eq!(kv.quota(), (total, budget), "{what}");
            // The plan printed by `plan` is this plan.
            let planned = CapacityPlan::new(&c.resolve().unwrap(), None).unwrap();
            assert_eq!(planned.gpu, info.budget, "{what}");
            assert_eq!(planned.gpu.source, BudgetSource::Explicit, "{what}");
            kv.shutdown().await;
        }
        // One byte below the smallest budget: a typed error naming what fits.
        let mut c = base.clone();
        c.kv_cache.max_gpu_total_bytes = Some(smallest - 1);
        match start_recorded(c).await {
            Err(RuntimeError::Quota(QuotaError::DoesNotFit {
                needed: 64, fit: 0, ..
            })) => {}
            Err(e) => panic!("{layers} layers, mtp {mtp:?}: unexpected error {e}"),
            Ok(_) => panic!("{layers} layers, mtp {mtp:?}: started below the smallest budget"),
        }
    }
}

/// `max_tokens` alone, and `max_tokens` capping a byte budget, with and without a draft
/// cache: at least `max_tokens` tokens fit in both caches, and the draft cache gets the
/// same slots as the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_with_and_without_a_draft_cache() {
    for mtp in [None, Some(true), Some(false)] {
        for budget in [None, Some(64 * GIB)] {
            let c = kv_config(mtp, budget);
            let what = format!("mtp {mtp:?}, budget {budget:?}");
            let (kv, sized) = start_recorded(c.clone()).await.expect(&what);
            let info = kv.info().clone();
            assert_eq!(info.budget.source, BudgetSource::MaxTokens, "{what}");
            assert!(info.budget.tokens >= 100_000, "{what}");
            // The cap is max_tokens / max_util_for_resume in both caches: not much more.
            assert!(info.budget.tokens < 100_000 * 105 / 100, "{what}");
            assert_eq!(info.budget.tokens, info.budget.slots * 64, "{what}");
            assert_eq!(sized.draft_bytes, info.budget.draft_bytes, "{what}");
            assert!(info.budget.allocated_bytes <= info.budget.bytes, "{what}");
            // The host tier is split the same way: both caches' host pools fit in 4 GiB.
            let host = u64::from(sized.target_host[0]);
            assert_eq!(host, info.host_slots, "{what}");
            let plan = CapacityPlan::new(&c.resolve().unwrap(), None).unwrap();
            let host_bytes = pool_bytes(&plan.target, host)
                + plan.draft.as_ref().map_or(0, |d| pool_bytes(d, host));
            assert!(host_bytes <= 4 * GIB, "{what}: host {host_bytes}");
            assert_eq!(host_bytes, plan.host_bytes, "{what}");
            kv.shutdown().await;
        }
    }
}

fn kv_config(mtp: Option<bool>, budget: Option<u64>) -> EngineConfig {
    let mut c = config(61, mtp);
    c.kv_cache.max_tokens = Some(100_000);
    c.kv_cache.max_gpu_total_bytes = budget;
    c.kv_cache.host_cache_size = Some(4 * GIB);
    c
}
