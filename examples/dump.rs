//! Dumps one layer of one step of the reference model as `.npy` files for external
//! kernels (DeepGEMM's paged MQA logits, FlashMLA's sparse decode): the caches as the
//! kernels read them, the page tables, the inputs and the model's outputs. The format:
//! README.md, "Dumping one layer for external kernels".
//!
//! ```text
//! cargo run --release --example dump -- --out DIR [--step N] [--layer L]
//!     [--kv-dtype fp8_ds_mla|bf16] [--seed S]
//! ```
//!
//! The workload runs on the host backend (one device): five requests share a 100-token
//! prompt and add 20–60 tokens of their own, prefills are chunked at 48 tokens, each
//! request generates 8 tokens greedily. Steps count from 1: steps 1–5 run the prefills
//! (chunks, from step 4 on beside the decode tokens of the requests done with theirs),
//! step 6 (the default) to 12 are decode steps, one token per request, as DeepGEMM's
//! paged decode logits kernel takes them. The manifest is printed on stdout, a one-line summary on stderr.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use dsa_kv::actors::KvCacheBuilder;
use dsa_kv::config::{EngineConfig, KvDtype};
use dsa_kv::core::scheduler::{RequestOutcome, SubmitRequest};
use dsa_kv::core::ReuseScope;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::model::dump::{Dump, DumpSpec};
use dsa_kv::model::paged::Outputs;
use dsa_kv::model::{CacheFormat, Model, ModelConfig};
use dsa_kv::ops::quant::ScaleFormat;

const USAGE: &str = "usage: dump --out DIR [--step N] [--layer L] [--kv-dtype fp8_ds_mla|bf16] \
[--seed S]";

struct Args {
    out: PathBuf,
    step: u64,
    layer: usize,
    kv_dtype: KvDtype,
    seed: u64,
}

fn parse() -> Result<Args, String> {
    let mut out = None;
    let mut a = Args {
        out: PathBuf::new(),
        step: 6,
        layer: 1,
        kv_dtype: KvDtype::Fp8DsMla,
        seed: 11,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<u64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--out" => out = Some(PathBuf::from(value()?)),
            "--step" => a.step = number(value()?)?,
            "--layer" => a.layer = number(value()?)? as usize,
            "--seed" => a.seed = number(value()?)?,
            "--kv-dtype" => {
                a.kv_dtype = match value()?.as_str() {
                    "fp8_ds_mla" => KvDtype::Fp8DsMla,
                    "bf16" => KvDtype::Bf16,
                    v => return Err(format!("--kv-dtype {v}: fp8_ds_mla or bf16")),
                }
            }
            "-h" | "--help" => return Err(USAGE.into()),
            _ => return Err(format!("unknown argument {flag}\n{USAGE}")),
        }
    }
    a.out = out.ok_or(format!("--out is required\n{USAGE}"))?;
    Ok(a)
}

/// A 100-token prompt shared by all, then the request's own 20–60 tokens.
fn prompt(i: u64) -> Vec<TokenId> {
    let own = 20 + (i as u32 * 23) % 41;
    (0..100)
        .map(|t| 1000 + t)
        .chain((0..own).map(|k| (i as u32 * 7919 + k * 31) % 5000))
        .map(TokenId)
        .collect()
}

async fn run(a: &Args) -> Result<serde_json::Value, String> {
    let format = CacheFormat {
        kv_dtype: a.kv_dtype,
        scale_format: ScaleFormat::Ue8m0,
        indexer: vec![true, true],
    };
    let model = Arc::new(Model::new(ModelConfig::tiny(a.seed), format).map_err(|e| e.to_string())?);
    let outputs = Arc::new(Mutex::new(Outputs::default()));
    let dump = Dump::new(DumpSpec {
        step: a.step,
        layer: a.layer,
        device: 0,
        dir: a.out.clone(),
    });
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(2);
    c.model.kv_dtype = Some(a.kv_dtype);
    c.kv_cache.max_tokens = Some(2048);
    c.scheduler.max_num_sequences = 8;
    c.scheduler.max_num_tokens = 128;
    c.scheduler.max_prefill_chunk = 48;
    c.scheduler.max_seq_len = 512;
    let kv = KvCacheBuilder::new()
        .config(c)
        .host_devices(1)
        .forward(dump.factory(model, outputs.clone()))
        .start()
        .await
        .map_err(|e| e.to_string())?;
    let requests = 5;
    for i in 0..requests {
        let r = SubmitRequest {
            id: RequestId(i),
            scope: ReuseScope::SHARED,
            prompt: prompt(i),
            max_new_tokens: 8,
            priority: 35,
        };
        kv.submit(r).await.map_err(|e| e.to_string())?;
    }
    let mut done = 0;
    while done < requests as usize {
        let rep = kv.step(HashMap::new()).await.map_err(|e| e.to_string())?;
        let outcomes = {
            let o = outputs.lock().unwrap_or_else(|e| e.into_inner());
            rep.scheduled
                .iter()
                .map(|r| RequestOutcome {
                    id: r.id,
                    accepted_drafts: 0,
                    next_token: r
                        .produces_token
                        .then(|| o.next.get(&(0, r.id)).map(|&t| TokenId(t)))
                        .flatten(),
                })
                .collect()
        };
        let c = kv.commit(outcomes).await.map_err(|e| e.to_string())?;
        done += c.finished.len();
    }
    kv.shutdown().await;
    dump.result().map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    common::quiet_on_closed_stdout();
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tokio: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(&args)) {
        Ok(manifest) => {
            eprintln!(
                "step {}, layer {}: {} tokens, tokens per request row {}, in {}",
                manifest["step"],
                manifest["layer"],
                manifest["tokens"],
                manifest["tokens_per_row"],
                args.out.display()
            );
            println!(
                "{}",
                serde_json::to_string_pretty(&manifest).unwrap_or_default()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dump: {e}");
            ExitCode::FAILURE
        }
    }
}
