//! `serve`'s command line: the flags (parsed by `clap`) and the checks between them that
//! clap does not express.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use dsa_kv::config::KvDtype;
use dsa_kv::device::Verification;
use dsa_kv::v4::V4Preset;

use crate::common::{self, Backend};

/// What runs on the device actors.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
pub(crate) enum Source {
    /// The reference model; its greedy tokens are sampled and checked for exactness.
    Model,
    /// The synthetic writer; random tokens, KV read back and checked.
    Synthetic,
}

/// Serves a seeded multi-turn chat workload through the dsa-kv runtime and checks it: the
/// reference model bit-exact against its unpaged run, or the synthetic writer's KV read
/// back.
///
/// Writes DIR/serve_report.json and DIR/serve_report.svg (--out). Exit status: 0 when the
/// run is intact (`integrity_ok`), 1 when a check failed or the run stopped with an error,
/// 2 for a bad command line.
#[derive(Parser)]
#[command(name = "serve")]
pub(crate) struct Args {
    /// What runs on the device actors
    #[arg(long, value_enum, default_value_t = Source::Model)]
    pub(crate) source: Source,
    /// A short run (a few seconds): fewer and shorter conversations, smaller caches
    #[arg(long)]
    pub(crate) quick: bool,
    /// The report as one JSON object on stdout (no table, no progress)
    #[arg(long)]
    pub(crate) json: bool,
    /// Seed of the workload (arrivals, prompts, lengths; not the model's weights)
    #[arg(long, value_name = "N", default_value_t = 42)]
    pub(crate) seed: u64,
    /// Device actors (tensor-parallel ranks); with --gpus, one per GPU listed
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = at_least_one)]
    pub(crate) devices: usize,
    /// Conversations [default: 12 with the model, 64 synthetic; --quick: 6, 20]
    #[arg(long, value_name = "N")]
    pub(crate) conversations: Option<usize>,
    /// Turns per conversation [default: 3; --quick: 2]
    #[arg(long, value_name = "N")]
    pub(crate) turns: Option<usize>,
    /// Storage of the MLA rows; the model writes bf16 or fp8_ds_mla [default: fp8_ds_mla
    /// with the model, fp8 (the preset's) synthetic; with --config, the file's]
    #[arg(long, value_name = "DTYPE", value_parser = common::named(&KvDtype::ALL, KvDtype::name))]
    pub(crate) kv_dtype: Option<KvDtype>,
    /// Which layers the synthetic writer's KV is read back on: the first, middle and last
    /// of each cache, every layer, or none [default: sample synthetic, off with the model]
    #[arg(long, value_name = "LAYERS", value_parser = common::named(&VERIFY, verify_str))]
    pub(crate) verify: Option<Verification>,
    /// Engine configuration file (.toml, .json or .yaml) instead of the built-in one
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Run this Hugging Face checkpoint's model instead of the built-in one (a folder with
    /// config.json and safetensors of DeepseekV32ForCausalLM or GlmMoeDsaForCausalLM, e.g.
    /// tests/fixtures/hf/deepseek_v32; host backend): the cache takes its layers and
    /// indexer layers, the workload its vocabulary. A DeepseekV4ForCausalLM checkpoint
    /// (e.g. tests/fixtures/hf/deepseek_v4_mtp, with the published MTP layer) runs
    /// through the V4 runtime as --model does, sized by --budget-mib
    #[arg(long, value_name = "DIR")]
    pub(crate) checkpoint: Option<PathBuf>,
    /// Where the report files go
    #[arg(long, value_name = "DIR", default_value = "target/serve")]
    pub(crate) out: PathBuf,
    /// Where the device actors run
    #[arg(long, value_enum, default_value_t = Backend::Host)]
    pub(crate) backend: Backend,
    /// GPU ordinals, one device actor each (needs --backend cuda) [default: 0..devices]
    #[arg(long, value_name = "0,1,..", value_parser = common::gpu_ordinals)]
    pub(crate) gpus: Option<::std::vec::Vec<usize>>,
    /// Decode-only steps of the GPU model as one CUDA graph
    #[arg(long)]
    pub(crate) cuda_graphs: bool,
    /// Serve the runtime's metrics as Prometheus text at http://ADDR/metrics while the
    /// run lasts (e.g. 127.0.0.1:9091); the last scrape is also written to
    /// DIR/metrics.prom
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,
    /// Fault drill: this percentage of GPU-room requests is refused (needs the
    /// fault-injection feature)
    #[arg(long, value_name = "PCT", default_value_t = 0,
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) room_faults: u8,
    /// A DeepSeek-V4 preset: run the V4 reference model with its layer structure through
    /// the V4 runtime instead (the other models come with --config)
    #[arg(long, value_name = "NAME", value_parser = common::named(&V4Preset::ALL, V4Preset::name))]
    pub(crate) model: Option<V4Preset>,
    /// Cache budget of the V4 run in MiB per device (the pools are sized from it)
    /// [default: 400 for deepseek-v4-flash, 640 for deepseek-v4-pro]
    #[arg(long, value_name = "MIB")]
    pub(crate) budget_mib: Option<u64>,
    /// Cap the V4 run's GPU tier at this many compressed blocks (pressure: preemption by
    /// recompute and host-tier traffic with a model whose blocks are small) [default: as
    /// many as the budget holds]
    #[arg(long, value_name = "N")]
    pub(crate) gpu_blocks: Option<u32>,
    /// Whether `--checkpoint` is a DeepSeek-V4 checkpoint (set by [`check`]).
    #[arg(skip)]
    pub(crate) v4_checkpoint: bool,
}

/// Whether `dir/config.json` says `"model_type": "deepseek_v4"` (an unreadable file is
/// the V3.2 path's to report).
fn is_v4_checkpoint(dir: &std::path::Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| v["model_type"] == "deepseek_v4")
}

fn at_least_one(v: &str) -> Result<usize, String> {
    match v.parse() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err("must be a positive integer".into()),
    }
}

/// `--verify`'s values.
pub(crate) const VERIFY: [Verification; 3] =
    [Verification::Sample, Verification::All, Verification::Off];

/// Checks between flags that clap does not express: exit status 2 with the message.
pub(crate) fn check(mut a: Args) -> Args {
    if !cfg!(feature = "fault-injection") && a.room_faults > 0 {
        common::usage_error::<Args>(
            "--room-faults needs the fault drills: run with --features fault-injection",
        );
    }
    a.v4_checkpoint = a.model.is_none() && a.checkpoint.as_deref().is_some_and(is_v4_checkpoint);
    if a.v4_checkpoint || a.model.is_some() {
        let mut clash = Vec::new();
        for (set, flag) in [
            (a.source != Source::Model, "--source synthetic"),
            (a.model.is_some() && a.checkpoint.is_some(), "--checkpoint"),
            (a.config.is_some(), "--config"),
            (a.kv_dtype.is_some(), "--kv-dtype"),
            (a.cuda_graphs, "--cuda-graphs"),
            (a.room_faults > 0, "--room-faults"),
            (a.metrics_addr.is_some(), "--metrics-addr"),
            (a.verify.is_some_and(|v| v.is_on()), "--verify"),
            (
                a.v4_checkpoint && a.backend == Backend::Cuda,
                "--backend cuda",
            ),
        ] {
            if set {
                clash.push(flag);
            }
        }
        if !clash.is_empty() {
            let what = match a.model {
                Some(p) => format!(
                    "--model {} runs the V4 reference model through the V4 runtime (host or \
                     CUDA devices)",
                    p.name()
                ),
                None => "--checkpoint with a DeepSeek-V4 checkpoint runs it through the V4 \
                         runtime on host devices (the CUDA device runs the built-in V4 model \
                         only)"
                    .into(),
            };
            common::usage_error::<Args>(format!("{what}; it does not take {}", clash.join(", ")));
        }
        if a.budget_mib == Some(0) || a.gpu_blocks == Some(0) {
            common::usage_error::<Args>("--budget-mib and --gpu-blocks must be at least 1");
        }
    } else if a.budget_mib.is_some() || a.gpu_blocks.is_some() {
        common::usage_error::<Args>(
            "--budget-mib and --gpu-blocks size a DeepSeek-V4 run: add --model deepseek-v4-flash or \
             deepseek-v4-pro, or --checkpoint with a DeepSeek-V4 checkpoint (the other models \
             are sized with --config)",
        );
    }
    a.conversations = a.conversations.map(|n| n.max(1));
    a.turns = a.turns.map(|n| n.max(1));
    if let Some(g) = &a.gpus {
        if a.backend != Backend::Cuda {
            common::usage_error::<Args>("--gpus needs --backend cuda");
        }
        a.devices = g.len().max(1);
    }
    if a.source == Source::Model {
        if let Some(v) = a.verify.filter(|v| v.is_on()) {
            common::usage_error::<Args>(format!(
                "--verify {} reads back the synthetic writer's KV, which the model does not \
                 write: add --source synthetic (the model's run is checked against its \
                 unpaged reference instead)",
                verify_name(v)
            ));
        }
        if let Some(d) = a
            .kv_dtype
            .filter(|d| !matches!(d, KvDtype::Bf16 | KvDtype::Fp8DsMla))
        {
            common::usage_error::<Args>(format!(
                "--kv-dtype {}: the reference model writes bf16 or fp8_ds_mla rows (add \
                 --source synthetic for {0})",
                d.name()
            ));
        }
    }
    a
}

pub(crate) fn verify_str(v: Verification) -> &'static str {
    match v {
        Verification::Sample => "sample",
        Verification::All => "all",
        Verification::Off => "off",
        _ => unreachable!("invariant: --verify offers only the values of VERIFY"),
    }
}

pub(crate) fn verify_name(v: Verification) -> String {
    format!("{v:?}").to_lowercase()
}
