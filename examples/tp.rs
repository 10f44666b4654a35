//! Tensor parallelism: one coordinator, one device actor per GPU. Every rank receives the
//! same step plan, so every GPU must hold identical page tables and identical cache
//! bytes for the replicated MLA latent and indexer K caches. This example runs a DSA
//! workload (DeepSeek-V3.2 preset, shared prefixes, MTP drafts with a separate draft
//! cache, offload and preemption), checks the per-step metadata digests of all ranks,
//! compares SHA-256 digests of every rank's pools at the end, and reports per-GPU
//! timings.
//!
//! ```text
//! cargo run --release --example tp -- [--backend cuda|host] [--gpus 0,1] [--devices N]
//!     [--requests N] [--seed N] [--json]
//! ```
//!
//! `--help` lists every flag with its default; `--flag=value` works as well as
//! `--flag value`.
//!
//! Exits 0 only when every rank agreed on every step and on the final cache bytes and
//! verification found no mismatch.

mod common;

use std::collections::HashMap;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use common::Backend;
use dsa_kv::actors::{Drafts, KvCacheBuilder};
use dsa_kv::config::{EngineConfig, SpecMode};
use dsa_kv::core::scheduler::{RequestOutcome, SubmitRequest};
use dsa_kv::core::ReuseScope;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::rng::SplitMix64;
use serde_json::json;

/// Tensor parallelism: one device actor per GPU, every rank given the same step plan; checks
/// that every rank holds identical page tables and identical cache bytes.
///
/// Exit status: 0 when every rank agreed on every step and on the final cache bytes and
/// verification found no mismatch, 1 otherwise, 2 for a bad command line.
#[derive(Parser)]
#[command(name = "tp")]
struct Cli {
    /// Where the ranks run
    #[arg(long, value_enum, default_value_t = Backend::Cuda)]
    backend: Backend,
    /// GPU ordinals, one rank each [default: 0,1]
    #[arg(long, value_name = "0,1", value_parser = common::gpu_ordinals,
          overrides_with = "devices")]
    gpus: Option<::std::vec::Vec<usize>>,
    /// Ranks, on GPUs (or host devices) 0..N: --gpus 0,..,N-1 (of --gpus and --devices, the
    /// later one counts) [default: 2]
    #[arg(long, value_name = "N", overrides_with = "gpus")]
    devices: Option<u64>,
    /// Requests in the workload (at least 1)
    #[arg(long, value_name = "N", default_value_t = 48)]
    requests: u64,
    /// Seed of the workload
    #[arg(long, value_name = "N", default_value_t = 7)]
    seed: u64,
    /// No progress line on stderr (the report is JSON on stdout either way)
    #[arg(long)]
    json: bool,
}

struct Args {
    cuda: bool,
    gpus: Vec<usize>,
    requests: u64,
    seed: u64,
    json: bool,
}

fn parse() -> Args {
    let c = Cli::parse();
    let gpus = match (c.gpus, c.devices) {
        (Some(g), _) => g,
        (None, Some(n)) => (0..n.max(1) as usize).collect(),
        (None, None) => vec![0, 1],
    };
    if gpus.is_empty() {
        common::usage_error::<Cli>("at least one device is needed");
    }
    Args {
        cuda: c.backend == Backend::Cuda,
        gpus,
        requests: c.requests.max(1),
        seed: c.seed,
        json: c.json,
    }
}

/// The crate's generator, with the workload's draws.
struct Rng(SplitMix64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.0.range(lo, hi)
    }
    fn tokens(&mut self, n: u64) -> Vec<TokenId> {
        (0..n)
            .map(|_| TokenId((self.next() % 129_280) as u32))
            .collect()
    }
}

async fn run(
    a: &Args,
) -> Result<(bool, serde_json::Value), Box<dyn std::error::Error + Send + Sync>> {
    let ranks = a.gpus.len();
    let mut c = EngineConfig::default();
    c.spec_decode.mode = SpecMode::Mtp;
    c.spec_decode.draft_tokens = 3;
    c.spec_decode.separate_draft_cache = true;
    c.scheduler.max_num_sequences = 32;
    c.scheduler.max_num_tokens = 4096;
    c.scheduler.max_prefill_chunk = 2048;
    c.scheduler.max_seq_len = 8192;
    c.kv_cache.max_tokens = Some(8_192);
    c.kv_cache.host_cache_size = Some(64 * 2_764_032);
    c.parallel.tp_size = ranks as u32;
    let mut b = KvCacheBuilder::new().config(c).host_devices(ranks);
    if a.cuda {
        b = b.backend(common::cuda_backend(a.gpus.clone())?);
    }
    let kv = b.start().await?;
    let info = kv.info().clone();
    let mut rng = Rng(SplitMix64(a.seed));
    let systems: Vec<Vec<TokenId>> = (0..4).map(|i| rng.tokens(700 + 300 * i)).collect();
    for i in 0..a.requests {
        let mut prompt = systems[(rng.next() % 4) as usize].clone();
        let extra = rng.range(50, 600);
        prompt.extend(rng.tokens(extra));
        kv.submit(SubmitRequest {
            id: RequestId(i + 1),
            scope: ReuseScope::SHARED,
            prompt,
            max_new_tokens: rng.range(24, 96) as u32,
            priority: 35,
        })
        .await?;
    }
    let started = Instant::now();
    let mut per_rank_us = vec![0u64; ranks];
    let mut digest_disagreements = 0u64;
    let (mut steps, mut finished, mut mismatches) = (0u64, 0u64, 0u64);
    let mut failed = Vec::new();
    let mut live: HashMap<RequestId, ()> = (1..=a.requests).map(|i| (RequestId(i), ())).collect();
    // The progress line redraws itself with carriage returns: only at a terminal.
    let progress_shown = !a.json && std::io::stderr().is_terminal();
    while !live.is_empty() {
        let drafts: Drafts = live
            .keys()
            .map(|&id| (id, rng.tokens(u64::from(info.draft_tokens))))
            .collect();
        let r = kv.step(drafts).await?;
        steps += 1;
        for d in &r.devices {
            per_rank_us[d.device] += d.elapsed_us;
        }
        if r.devices
            .windows(2)
            .any(|w| w[0].metadata_digest != w[1].metadata_digest)
        {
            digest_disagreements += 1;
        }
        for (id, why) in &r.failed {
            failed.push(format!("{id}: {why}"));
            live.remove(id);
        }
        if r.scheduled.is_empty() {
            if steps > 100_000 {
                return Err("no progress after 100000 steps".into());
            }
            continue;
        }
        let outcomes = r
            .scheduled
            .iter()
            .map(|s| RequestOutcome {
                id: s.id,
                accepted_drafts: (0..s.num_drafts)
                    .take_while(|_| rng.next() % 10 < 7)
                    .count() as u32,
                next_token: s
                    .produces_token
                    .then(|| TokenId((rng.next() % 129_280) as u32)),
            })
            .collect();
        for f in kv.commit(outcomes).await?.finished {
            mismatches += f.mismatches.len() as u64;
            finished += 1;
            live.remove(&f.finished.id);
        }
        if progress_shown && steps % 50 == 0 {
            eprint!("\rstep {steps:>5} | finished {finished}/{}   ", a.requests);
        }
    }
    if progress_shown {
        eprintln!();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let digests = kv.cache_digests().await?;
    let stats = kv.stats().await?;
    kv.shutdown().await;
    let contents_match = digests.iter().all(|d| d.is_some() && *d == digests[0]);
    let ok = contents_match
        && digest_disagreements == 0
        && mismatches == 0
        && stats.mismatches == 0
        && failed.is_empty()
        && stats.tokens_verified > 0;
    let report = json!({
        "ok": ok,
        "backend": if a.cuda { "cuda" } else { "host" },
        "gpus": a.gpus,
        "model": info.model,
        "requests": a.requests,
        "finished": finished,
        "failed": failed,
        "steps": steps,
        "elapsed_s": elapsed,
        "prefill_tokens": stats.scheduler.prefill_tokens,
        "decode_tokens": stats.scheduler.decode_tokens,
        "preemptions": stats.scheduler.preemptions,
        "tokens_verified": stats.tokens_verified,
        "mismatches": mismatches + stats.mismatches,
        "metadata_digest_disagreements": digest_disagreements,
        "cache_digests": digests,
        "contents_match": contents_match,
        "per_gpu": per_rank_us.iter().enumerate().map(|(i, &us)| json!({
            "rank": i,
            "gpu": a.gpus[i],
            "device_ms_total": us as f64 / 1000.0,
            "device_ms_per_step": us as f64 / 1000.0 / steps.max(1) as f64,
        })).collect::<Vec<_>>(),
    });
    Ok((ok, report))
}

fn main() -> ExitCode {
    common::quiet_on_closed_stdout();
    let a = parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(&a)) {
        Ok((ok, report)) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&report).unwrap_or_default()
            );
            if ok {
                ExitCode::SUCCESS
            } else {
                eprintln!("error: the ranks disagree or verification failed (see the report)");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
