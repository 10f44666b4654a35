//! `dsa-kv-dynamo`: a Dynamo worker serving the reference DSA model from the dsa-kv
//! runtime. Start Dynamo's frontend (`python -m dynamo.frontend`) and one or more of
//! these with the same discovery settings; see the README next to this crate.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use dsa_kv::v4::V4Preset;
use dsa_kv_dynamo::engine::{DsaKvEngine, Settings};
use dsa_kv_dynamo::fixture;
use dynamo_backend_common::{CommonArgs, WorkerConfig};

/// A Dynamo worker serving the reference DSA model from the dsa-kv runtime.
#[derive(Parser, Debug)]
#[command(name = "dsa-kv-dynamo", version)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// The model directory: the worker writes its tokenizer, `config.json` and chat
    /// template here (identical each time, replaced atomically) and registers it with
    /// Dynamo, whose frontend reads it. Created private (`0700`) if missing; refused if it
    /// is a symbolic link, another user's, or writable by its group or others. The
    /// default is this user's own under the temporary directory.
    #[arg(long, default_value_os_t = fixture::default_dir())]
    model_dir: PathBuf,
    /// The model name clients ask for.
    #[arg(long, default_value = "dsa-kv-reference")]
    served_model_name: String,
    /// GPU-tier tokens of the cache (a multiple of 64).
    #[arg(long, default_value_t = 65_536)]
    kv_tokens: u64,
    /// Requests a step may hold.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: u32,
    /// Tokens a step may hold.
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: u32,
    /// Prompt tokens of one request per step at most.
    #[arg(long, default_value_t = 512)]
    max_prefill_chunk: u32,
    /// Prompt plus generated tokens of a request at most.
    #[arg(long, default_value_t = 4096)]
    context_length: u32,
    /// Do not check requests against the unpaged model.
    #[arg(long)]
    no_verify: bool,
    /// Write a JSON report (counts, verification) here at shutdown.
    #[arg(long)]
    report: Option<PathBuf>,
    /// The host the KV event publisher binds.
    #[arg(long, default_value = "127.0.0.1")]
    events_host: String,
    /// Requests held at most, running and waiting; more are refused with an error.
    #[arg(long, default_value_t = 4096)]
    max_live_requests: usize,
    /// The model: `dsa` (the DSA reference model, DeepSeek-V3.2's cache), or
    /// `deepseek-v4-flash` / `deepseek-v4-pro` (the DeepSeek-V4 reference model with
    /// that preset's layer structure and tiny widths, 256-token blocks)
    #[arg(long, default_value = "dsa", value_parser = model)]
    model: Served,
}

/// `--model`: the DSA reference model or a DeepSeek-V4 preset's.
#[derive(Clone, Copy, Debug)]
struct Served(Option<V4Preset>);

fn model(s: &str) -> Result<Served, String> {
    if s == "dsa" {
        return Ok(Served(None));
    }
    V4Preset::parse(s).map(|p| Served(Some(p))).ok_or_else(|| {
        format!("unknown model {s:?}: expected dsa, deepseek-v4-flash or deepseek-v4-pro")
    })
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let settings = Settings {
        served_model_name: a.served_model_name.clone(),
        kv_tokens: a.kv_tokens,
        max_num_seqs: a.max_num_seqs,
        max_num_batched_tokens: a.max_num_batched_tokens,
        max_prefill_chunk: a.max_prefill_chunk,
        context_length: a.context_length,
        verify: !a.no_verify,
        report: a.report,
        events_host: a.events_host,
        max_live: a.max_live_requests,
        v4: a.model.0,
    };
    let block = u64::from(settings.block_tokens());
    if a.kv_tokens == 0 || a.kv_tokens % block != 0 {
        anyhow::bail!(
            "--kv-tokens {} is not a positive multiple of {block} (the model's block)",
            a.kv_tokens
        );
    }
    // Its errors name the directory and what to do.
    fixture::write(&a.model_dir, a.context_length)?;
    let engine = DsaKvEngine::new(settings);
    let c = a.common;
    let config = WorkerConfig {
        namespace: c.namespace,
        component: c.component,
        endpoint: c.endpoint,
        endpoint_types: c.endpoint_types,
        custom_jinja_template: c.custom_jinja_template,
        disaggregation_mode: c.disaggregation_mode,
        exclude_tools_when_tool_choice_none: c.exclude_tools_when_tool_choice_none,
        model_name: a.model_dir.display().to_string(),
        served_model_name: Some(a.served_model_name),
        runtime: c.runtime,
        ..Default::default()
    };
    dynamo_backend_common::run(Arc::new(engine), config)
}
