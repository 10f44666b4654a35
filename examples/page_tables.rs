//! Block tables as the allocator hands them out after churn, for kernel benchmarks at
//! production shape (`benches/oracles/kernels.py`): the cache manager (DeepSeek-V3.2
//! preset cut to one layer, V2 layout) with room for `--requests` requests of
//! `--context` tokens plus a tenth, first serves a stream of requests of random lengths
//! that arrive, grow and finish in random order until the cache has turned over a few
//! times, then admits the measured requests; their block tables (one slot per 64-token
//! block) are what a paged kernel reads. Prints JSON: `{"requests", "context",
//! "slots", "churned", "tables": [[slot, …], …], "runs": …}` (`runs`: the number of
//! maximal runs of consecutive slots, a measure of how scattered the tables are).
//!
//! ```text
//! cargo run --release --example page_tables -- --requests 64 --context 32768 > tables.json
//! ```

use std::process::ExitCode;

use clap::Parser;
use dsa_kv::config::{DsaModel, LayerSet};
use dsa_kv::core::{KvCacheManager, ManagerOptions, ReuseScope, SeqHandle, SeqOptions, TierSlots};
use dsa_kv::ids::{LifeCycleId, RequestId, TokenId};
use dsa_kv::layout::{LayoutKind, PoolPlan};
use dsa_kv::rng::SplitMix64;

/// Block tables after churn, as JSON on stdout.
#[derive(Parser)]
#[command(name = "page_tables")]
struct Args {
    /// Measured requests
    #[arg(long, default_value_t = 64)]
    requests: u32,
    /// Tokens of each measured request (a multiple of 64)
    #[arg(long, default_value_t = 32768)]
    context: u32,
    /// Requests served before the measured ones (the churn)
    #[arg(long, default_value_t = 2000)]
    churn: u32,
    /// Seed of the churn
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

fn run(a: &Args) -> Result<serde_json::Value, String> {
    if a.context == 0 || !a.context.is_multiple_of(64) || a.requests == 0 {
        return Err("--context must be a positive multiple of 64 and --requests positive".into());
    }
    let blocks = u64::from(a.context / 64);
    let slots = u32::try_from(u64::from(a.requests) * blocks * 11 / 10)
        .map_err(|_| "too many slots for one pool group".to_string())?;
    let model = DsaModel::preset(dsa_kv::config::ModelPreset::DeepSeekV32, Some(1))
        .map_err(|e| e.to_string())?;
    let plan = PoolPlan::for_model(&model, LayerSet::Target, LayoutKind::V2, 64)
        .map_err(|e| e.to_string())?;
    let groups = plan.pool_groups().len();
    let mut m = KvCacheManager::new(
        plan,
        TierSlots {
            gpu: vec![slots; groups],
            host: Vec::new(),
        },
        ManagerOptions {
            max_util_for_resume: 1.0,
            ..ManagerOptions::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let mut rng = SplitMix64(a.seed);
    let mut next_token = 0u32;
    let mut tokens = |n: u64| -> Vec<TokenId> {
        (0..n)
            .map(|_| {
                next_token = next_token.wrapping_add(1);
                TokenId(next_token)
            })
            .collect()
    };
    let mut live: Vec<(SeqHandle, u64)> = Vec::new();
    let mut id = 0u64;
    let mut served = 0u32;
    // Arrivals of 1–`context` tokens; a finish picks a random live request. The cache
    // turns over: each request is committed (its blocks cached) and closed, so later
    // requests take slots freed in between.
    while served < a.churn {
        if live.len() < 48 && rng.below(3) > 0 {
            let n = 1 + rng.below(u64::from(a.context));
            let t = tokens(n);
            id += 1;
            let c = m
                .create(RequestId(id), ReuseScope::SHARED, &t, SeqOptions::default())
                .map_err(|e| e.to_string())?;
            let h = c.handle;
            if !m.resume(&h).map_err(|e| e.to_string())?
                || !m.resize(&h, n, 0).map_err(|e| e.to_string())?
            {
                let mut h = h;
                m.close(&mut h).map_err(|e| e.to_string())?;
                continue;
            }
            m.commit(&h, &t).map_err(|e| e.to_string())?;
            live.push((h, n));
        } else if !live.is_empty() {
            let i = rng.below(live.len() as u64) as usize;
            let (mut h, _) = live.swap_remove(i);
            m.close(&mut h).map_err(|e| e.to_string())?;
            served += 1;
        }
    }
    for (mut h, _) in live.drain(..) {
        m.close(&mut h).map_err(|e| e.to_string())?;
    }
    // The measured requests: whole contexts, admitted one after another (evicting the
    // cached blocks of the churn as they need room).
    let mut tables = Vec::new();
    let mut runs = 0usize;
    let mut held = Vec::new();
    for r in 0..a.requests {
        let t = tokens(u64::from(a.context));
        let c = m
            .create(
                RequestId(1_000_000 + u64::from(r)),
                ReuseScope::SHARED,
                &t,
                SeqOptions::default(),
            )
            .map_err(|e| e.to_string())?;
        let h = c.handle;
        let ok = m.resume(&h).map_err(|e| e.to_string())?
            && m.resize(&h, u64::from(a.context), 0)
                .map_err(|e| e.to_string())?;
        if !ok {
            return Err(format!("no room for measured request {r}"));
        }
        let table: Vec<u32> = m
            .block_slots(&h, LifeCycleId(0))
            .map_err(|e| e.to_string())?
            .iter()
            .map(|s| s.0)
            .collect();
        runs += 1 + table.windows(2).filter(|w| w[1] != w[0] + 1).count();
        tables.push(table);
        held.push(h);
    }
    Ok(serde_json::json!({
        "requests": a.requests,
        "context": a.context,
        "slots": slots,
        "churned": served,
        "runs": runs,
        "tables": tables,
    }))
}

fn main() -> ExitCode {
    let a = Args::parse();
    match run(&a) {
        Ok(v) => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("page_tables: {e}");
            ExitCode::FAILURE
        }
    }
}
