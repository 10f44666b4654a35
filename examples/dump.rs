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
//! `--help` lists every flag with its default; `--flag=value` works as well as
//! `--flag value`.
//!
//! The workload runs on the host backend (one device): five requests share a 100-token
//! prompt and add 20–60 tokens of their own, prefills are chunked at 48 tokens, each
//! request generates 8 tokens greedily. Steps count from 1: steps 1–5 run the prefills
//! (chunks, from step 4 on beside the decode tokens of the requests done with theirs),
//! step 6 (the default) to 12 are decode steps, one token per request, as DeepGEMM's
//! paged decode logits kernel takes them. With `--drafts N` the model's MTP layer
//! proposes N tokens per request after each step and a decode step verifies them: 1 + N
//! tokens per request (the kernels' `next_n`), fewer steps in all. The manifest is printed on stdout, a one-line summary on stderr.

mod common;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use dsa_kv::actors::{Drafts, KvCacheBuilder};
use dsa_kv::config::{EngineConfig, KvDtype, SpecMode};
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::core::ReuseScope;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::ops::quant::ScaleFormat;
use dsa_kv_model::dump::{Dump, DumpSpec};
use dsa_kv_model::paged::ForwardOptions;
use dsa_kv_model::{CacheFormat, Model, ModelConfig};

/// Dumps one layer of one step of the reference model as `.npy` files for external
/// kernels: the caches as the kernels read them, the page tables, the inputs and the
/// model's outputs. The manifest goes to stdout.
#[derive(Parser)]
#[command(name = "dump")]
struct Args {
    /// The folder the `.npy` files and the manifest are written to
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// The step to dump, from 1: 1-5 prefill, 6-12 decode
    #[arg(long, value_name = "N", default_value_t = 6)]
    step: u64,
    /// The model layer to dump
    #[arg(long, value_name = "L", default_value_t = 1)]
    layer: usize,
    /// Storage of the MLA rows
    #[arg(long, value_name = "DTYPE", default_value = "fp8_ds_mla",
          value_parser = common::named(&[KvDtype::Fp8DsMla, KvDtype::Bf16], KvDtype::name))]
    kv_dtype: KvDtype,
    /// Seed of the model's weights
    #[arg(long, value_name = "S", default_value_t = 11)]
    seed: u64,
    /// MTP draft tokens per step (0: none): decode steps then verify 1 + N tokens per
    /// request (the sparse kernels' `next_n`)
    #[arg(long, value_name = "N", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=7))]
    drafts: u32,
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
    if a.drafts > 0 {
        c.spec_decode.mode = SpecMode::Mtp;
        c.spec_decode.draft_tokens = a.drafts;
    }
    let kv = KvCacheBuilder::new()
        .config(c)
        .host_devices(1)
        .forward(dump.factory(model, ForwardOptions::default().drafts(a.drafts as usize)))
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
    // The model samples and proposes in its forward; the runtime commits each step.
    let mut done = 0;
    while done < requests as usize {
        let rep = kv.step(Drafts::none()).await.map_err(|e| e.to_string())?;
        done += rep.committed.map_or(0, |c| c.finished.len());
    }
    kv.shutdown().await;
    dump.result().map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    common::quiet_on_closed_stdout();
    let args = Args::parse();
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
