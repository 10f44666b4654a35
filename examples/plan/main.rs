//! Capacity planner: bytes per token and per page of each cache component, the pool
//! groups of the chosen layout, and how many tokens fit in a GPU budget.
//!
//! ```text
//! cargo run --release --example plan -- --model deepseek-v3.2 [--kv-dtype bf16|fp8|fp8_ds_mla|nvfp4]
//!     [--indexer-dtype fp8|fp4] [--gpu-mem-gib N] [--fraction F] [--layout v1|v2]
//!     [--layers N] [--tokens-per-block T] [--with-mtp [--mtp-in-target]]
//!     [--max-gpu-total-bytes B] [--json]
//! cargo run --release --example plan -- --model deepseek-v4-flash|deepseek-v4-pro
//!     [--indexer-dtype fp8|fp4] [--gpu-mem-gib N] [--fraction F] [--max-gpu-total-bytes B]
//!     [--max-sequences S] [--max-batched-tokens B] [--drafts D] [--tail-boundaries N] [--json]
//! ```
//!
//! DeepSeek-V4 models print their life cycles (compressed blocks, raw window, two
//! compressor states, and with an MTP input width the MTP layer's target input), the bytes a block and a decoding request cost, and the budget split
//! into window slots (sized for `--max-sequences`, `--max-batched-tokens`, `--drafts` and
//! `--tail-boundaries`) and blocks (`plan/v4.rs`), from the configuration these flags
//! make (`model.preset`, `scheduler.max_num_sequences` / `max_num_tokens`,
//! `spec_decode`) through `WindowedCapacityPlan`: the sizing `KvCacheBuilder` gives the
//! runtime.
//!
//! `--help` lists every flag with its default; `--flag=value` works as well as
//! `--flag value`. `--gpu-mem-gib` is the free GPU memory (after weights and activations); the KV budget
//! is `fraction` (default 0.9) of it, or exactly `--max-gpu-total-bytes`. MTP layers are
//! reported in their own fields; `--with-mtp` plans MTP speculative decoding as the engine
//! does by default: a separate draft cache with the same slot count, paid from the same
//! budget (`--mtp-in-target`: the MTP layers in the target manager instead). The figures
//! come from `CapacityPlan`, the computation the runtime sizes its pools with.

#[path = "../common/mod.rs"]
mod common;
mod v4;

use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use dsa_kv::config::{
    DsaModel, EngineConfig, IndexerDtype, KvDtype, LayerSet, ModelPreset, SpecMode, V2Choice,
    V4Preset,
};
use dsa_kv::core::quota::CapacityPlan;
use dsa_kv::core::quota::{V4Demand, WindowedCapacityPlan};
use dsa_kv::layout::V4Plan;
use dsa_kv::layout::{PoolPlan, Role};
use serde_json::json;

const GIB: f64 = (1u64 << 30) as f64;

/// Capacity planner: bytes per token and per page of each cache component of a DSA
/// model, the pool groups of the chosen layout, and how many tokens fit in a GPU budget.
#[derive(Parser)]
#[command(name = "plan")]
struct Args {
    /// The model preset
    #[arg(long = "model", value_name = "MODEL", value_parser = model_names())]
    model: PlanModel,
    /// Storage of the MLA latent rows [default: the preset's]
    #[arg(long, value_name = "DTYPE", value_parser = common::named(&KvDtype::ALL, KvDtype::name))]
    kv_dtype: Option<KvDtype>,
    /// Storage of the lightning-indexer keys [default: the preset's]
    #[arg(long, value_name = "DTYPE",
          value_parser = common::named(&IndexerDtype::ALL, IndexerDtype::name))]
    indexer_dtype: Option<IndexerDtype>,
    /// Free GPU memory after weights and activations, in GiB
    #[arg(long, value_name = "N", default_value_t = 80.0, value_parser = positive_gib)]
    gpu_mem_gib: f64,
    /// The share of the free GPU memory the KV cache gets, in (0, 1]
    #[arg(long, value_name = "F", default_value_t = 0.9, value_parser = fraction)]
    fraction: f64,
    /// Pool layout [default: the engine configuration's choice for the model]
    #[arg(long, value_enum)]
    layout: Option<Layout>,
    /// Target layers [default: the preset's]
    #[arg(long, value_name = "N")]
    layers: Option<u32>,
    /// Tokens per KV block (page)
    #[arg(long, value_name = "T", default_value_t = 64)]
    tokens_per_block: u32,
    /// Plan MTP speculative decoding: a separate draft cache with the same slot count,
    /// paid from the same budget
    #[arg(long)]
    with_mtp: bool,
    /// With --with-mtp: the MTP layers in the target manager instead of a draft cache
    #[arg(long)]
    mtp_in_target: bool,
    /// The KV budget in bytes, instead of --fraction of --gpu-mem-gib
    #[arg(long, value_name = "B")]
    max_gpu_total_bytes: Option<u64>,
    /// DeepSeek-V4: sequences scheduled at once (sizes the window life cycles)
    #[arg(long, value_name = "S", default_value_t = 256)]
    max_sequences: u32,
    /// DeepSeek-V4: positions written per step, all sequences together
    #[arg(long, value_name = "B", default_value_t = 8192)]
    max_batched_tokens: u32,
    /// DeepSeek-V4: draft positions kept per sequence [default: 1 with --with-mtp, else 0]
    #[arg(long, value_name = "D")]
    drafts: Option<u32>,
    /// DeepSeek-V4: block boundaries whose window tails are kept for prefix reuse
    /// [default: 2 × --max-sequences]
    #[arg(long, value_name = "N")]
    tail_boundaries: Option<u32>,
    /// One JSON object on stdout instead of the tables
    #[arg(long)]
    json: bool,
}

/// `--model`: a DSA preset or a DeepSeek-V4 one.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum PlanModel {
    Dsa(ModelPreset),
    V4(V4Preset),
}

impl PlanModel {
    fn all() -> Vec<PlanModel> {
        ModelPreset::ALL
            .into_iter()
            .map(PlanModel::Dsa)
            .chain(V4Preset::ALL.into_iter().map(PlanModel::V4))
            .collect()
    }

    fn name(self) -> &'static str {
        match self {
            PlanModel::Dsa(p) => p.name(),
            PlanModel::V4(p) => p.name(),
        }
    }
}

fn model_names() -> impl clap::builder::TypedValueParser<Value = PlanModel> {
    common::named(&PlanModel::all(), PlanModel::name)
}

/// `--layout`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Layout {
    V1,
    V2,
}

fn positive_gib(v: &str) -> Result<f64, String> {
    v.parse()
        .ok()
        .filter(|g: &f64| g.is_finite() && *g > 0.0)
        .ok_or_else(|| "must be a positive number of GiB".into())
}

fn fraction(v: &str) -> Result<f64, String> {
    v.parse()
        .ok()
        .filter(|f: &f64| *f > 0.0 && *f <= 1.0)
        .ok_or_else(|| "must be in (0, 1]".into())
}

fn group_digits(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn run(a: Args) -> Result<(), String> {
    let preset = match a.model {
        PlanModel::Dsa(p) => p,
        PlanModel::V4(preset) => return run_v4(a, preset),
    };
    let mut spec = preset.spec(a.layers).map_err(|e| e.to_string())?;
    if let Some(d) = a.kv_dtype {
        spec.kv_dtype = d;
    }
    if let Some(d) = a.indexer_dtype {
        spec.indexer_dtype = d;
    }
    let model = DsaModel::new(spec).map_err(|e| e.to_string())?;
    // The same configuration path as the runtime: resolve, then plan the pools.
    let mut config = EngineConfig::default();
    config.kv_cache.tokens_per_block = a.tokens_per_block;
    config.kv_cache.free_gpu_memory_fraction = a.fraction;
    config.kv_cache.max_gpu_total_bytes = a.max_gpu_total_bytes;
    if let Some(kind) = a.layout {
        config.kv_cache.use_kv_cache_manager_v2 = V2Choice::Explicit(kind == Layout::V2);
    }
    if a.with_mtp {
        config.spec_decode.mode = SpecMode::Mtp;
        config.spec_decode.draft_tokens = 1;
        config.spec_decode.separate_draft_cache = !a.mtp_in_target;
    }
    let resolved = config
        .resolve_with(model.clone())
        .map_err(|e| e.to_string())?;
    let free = (a.gpu_mem_gib * GIB) as u64;
    let capacity = CapacityPlan::new(&resolved, Some(free)).map_err(|e| e.to_string())?;
    let (kind, set, plan, budget) = (
        resolved.layout,
        resolved.target_layers,
        &capacity.target,
        capacity.gpu,
    );
    let target = model.bytes_per_token(LayerSet::Target);
    let mtp = model.bytes_per_token(LayerSet::MtpOnly);
    let s = model.spec();
    let num_idx = model.num_indexer_layers();
    assert_eq!(
        plan.cache_bytes_per_token(),
        model.bytes_per_token(set).total(),
        "invariant: the plan's Role::All accounting equals the model's"
    );
    let t = u64::from(a.tokens_per_block);
    let groups: Vec<_> = plan
        .pool_groups()
        .iter()
        .map(|g| {
            json!({
                "id": g.id.get(),
                "life_cycles": g.life_cycles.iter().map(|l| l.get()).collect::<Vec<_>>(),
                "slot_bytes": g.slot_bytes(),
                "pools": g.pools.iter().map(|p| {
                    let roles: Vec<String> = plan.placements().iter()
                        .filter(|pl| pl.pool_group == g.id && pl.pool == p.id)
                        .map(|pl| pl.role.to_string()).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
                    let buffers = plan.placements().iter().filter(|pl| pl.pool_group == g.id && pl.pool == p.id).count();
                    json!({"id": p.id.get(), "slot_bytes": p.slot_bytes, "roles": roles, "buffers": buffers})
                }).collect::<Vec<_>>(),
            })
        })
        .collect();
    let report = json!({
        "model": s.name,
        "preset": preset.name(),
        "num_layers": s.num_layers,
        "indexer_layers": num_idx,
        "kv_dtype": s.kv_dtype.name(),
        "indexer_dtype": s.indexer_dtype.name(),
        "layout": format!("{kind:?}").to_lowercase(),
        "tokens_per_block": a.tokens_per_block,
        "mla_row_bytes": model.mla_row_bytes(),
        "indexer_row_bytes": model.indexer_row_bytes(),
        "bytes_per_token": target.total(),
        "mla_bytes_per_token": target.mla,
        "indexer_bytes_per_token": target.indexer,
        "indexer_share": target.indexer as f64 / target.total() as f64,
        "mla_bytes_per_page_per_layer": u64::from(model.mla_row_bytes()) * t,
        "indexer_bytes_per_page_per_layer": u64::from(model.indexer_row_bytes()) * t,
        "mtp_layers": s.num_mtp_layers,
        "mtp_bytes_per_token": mtp.total(),
        "mtp_mla_bytes_per_token": mtp.mla,
        "mtp_indexer_bytes_per_token": mtp.indexer,
        "mtp_in_manager": set == LayerSet::TargetAndMtp,
        "separate_draft_cache": capacity.draft.is_some(),
        "manager_bytes_per_token": plan.cache_bytes_per_token(),
        "draft_cache_bytes_per_token": capacity.draft.as_ref().map_or(0, PoolPlan::cache_bytes_per_token),
        "bytes_per_block": plan.bytes_per_block(),
        "pool_groups": groups,
        "gpu_mem_gib": a.gpu_mem_gib,
        "free_gpu_memory_fraction": a.fraction,
        "budget_bytes": budget.bytes,
        "budget_source": budget.source,
        "target_allocated_bytes": budget.target_bytes,
        "draft_allocated_bytes": budget.draft_bytes,
        "allocated_bytes": budget.allocated_bytes,
        "blocks": budget.slots,
        "tokens_that_fit": budget.tokens,
    });
    if a.json {
        println!("{report}");
        return Ok(());
    }
    println!(
        "{} ({} target layers, {} with an indexer, {} MTP) | kv_dtype {} | indexer {} | layout {:?} | {} tokens/block",
        s.name, s.num_layers, num_idx, s.num_mtp_layers, s.kv_dtype, s.indexer_dtype, kind, t
    );
    println!();
    println!("bytes per token, one rank, target layers:");
    println!(
        "  {:<22}{:>10}{:>8}{:>14}{:>18}",
        "component", "B/layer", "layers", "B/token", "B/page/layer"
    );
    let mla_page = u64::from(model.mla_row_bytes()) * t;
    let idx_page = u64::from(model.indexer_row_bytes()) * t;
    println!(
        "  {:<22}{:>10}{:>8}{:>14}{:>18}",
        format!("MLA latent ({})", s.kv_dtype),
        model.mla_row_bytes(),
        s.num_layers,
        group_digits(target.mla),
        group_digits(mla_page)
    );
    println!(
        "  {:<22}{:>10}{:>8}{:>14}{:>18}",
        format!("indexer K ({})", s.indexer_dtype),
        model.indexer_row_bytes(),
        num_idx,
        group_digits(target.indexer),
        group_digits(idx_page)
    );
    println!(
        "  {:<22}{:>10}{:>8}{:>14}",
        "total",
        "",
        "",
        group_digits(target.total())
    );
    println!(
        "  indexer share {:.2} %",
        100.0 * target.indexer as f64 / target.total() as f64
    );
    if s.num_mtp_layers > 0 {
        println!(
            "  MTP: {} layer(s), {} B/token ({} MLA + {} indexer){}",
            s.num_mtp_layers,
            group_digits(mtp.total()),
            mtp.mla,
            mtp.indexer,
            match (set, &capacity.draft) {
                (LayerSet::TargetAndMtp, _) => ", in this manager",
                (_, Some(_)) => ", in a separate draft cache with the same slot count",
                _ => ", not planned (add --with-mtp)",
            }
        );
    }
    println!();
    println!("pool groups ({kind:?}):");
    for g in plan.pool_groups() {
        println!(
            "  group {}: life cycles {:?}, {} B per slot, {} pool(s)",
            g.id,
            g.life_cycles.iter().map(|l| l.get()).collect::<Vec<_>>(),
            group_digits(g.slot_bytes()),
            g.pools.len()
        );
        let shown = if g.pools.len() > 6 { 3 } else { g.pools.len() };
        for p in &g.pools[..shown] {
            let pls: Vec<_> = plan
                .placements()
                .iter()
                .filter(|pl| pl.pool_group == g.id && pl.pool == p.id)
                .collect();
            let role = pls.first().map_or(Role::Key, |pl| pl.role);
            println!(
                "    pool {}: {} B per slot = {} × {} ({} page of {} B)",
                p.id,
                group_digits(p.slot_bytes),
                pls.len(),
                role,
                if pls.len() == 1 { "one" } else { "per-layer" },
                group_digits(pls.first().map_or(0, |pl| pl.page_stride))
            );
        }
        if shown < g.pools.len() {
            println!(
                "    … {} more pools of the same kind",
                g.pools.len() - shown
            );
        }
    }
    println!();
    let source = match a.max_gpu_total_bytes {
        Some(b) => format!("max_gpu_total_bytes {b}"),
        None => format!("{:.1} GiB free × {}", a.gpu_mem_gib, a.fraction),
    };
    println!(
        "capacity: {source} = {:.2} GiB budget → {} blocks = {} tokens ({:.2} GiB allocated in 2 MiB chunks)",
        budget.bytes as f64 / GIB,
        group_digits(budget.slots),
        group_digits(budget.tokens),
        budget.allocated_bytes as f64 / GIB
    );
    if capacity.draft.is_some() {
        println!(
            "  target cache {:.2} GiB + draft cache {:.2} GiB (same {} slots per pool group)",
            budget.target_bytes as f64 / GIB,
            budget.draft_bytes as f64 / GIB,
            group_digits(budget.slots),
        );
    }
    Ok(())
}

/// The flags a DeepSeek-V4 plan has no use for, if given.
fn v4_unused_flag(a: &Args) -> Option<&'static str> {
    [
        (a.kv_dtype.is_some(), "--kv-dtype (V4 rows are MODEL1)"),
        (a.layout.is_some(), "--layout (V4 has its own life cycles)"),
        (a.layers.is_some(), "--layers"),
        (
            a.tokens_per_block != 64,
            "--tokens-per-block (V4 blocks are 256 tokens)",
        ),
        (a.mtp_in_target, "--mtp-in-target"),
    ]
    .into_iter()
    .find_map(|(given, flag)| given.then_some(flag))
}

/// The DSA-only flags for V4 parameters, if given with a DSA model.
fn dsa_unused_flag(a: &Args) -> Option<&'static str> {
    [
        (a.drafts.is_some(), "--drafts"),
        (a.tail_boundaries.is_some(), "--tail-boundaries"),
        (a.max_sequences != 256, "--max-sequences"),
        (a.max_batched_tokens != 8192, "--max-batched-tokens"),
    ]
    .into_iter()
    .find_map(|(given, flag)| given.then_some(flag))
}

/// A DeepSeek-V4 plan through the runtime's path: the configuration the flags make, its
/// model structure and demand, then `WindowedCapacityPlan` (what
/// `KvCacheBuilder::windowed` sizes the pools with).
fn run_v4(a: Args, preset: V4Preset) -> Result<(), String> {
    let mut config = EngineConfig::default();
    config.model.preset = [ModelPreset::DeepSeekV4Flash, ModelPreset::DeepSeekV4Pro]
        .into_iter()
        .find(|m| m.windowed() == Some(preset))
        .ok_or_else(|| format!("{} is not a configuration preset", preset.name()))?;
    config.model.indexer_dtype = a.indexer_dtype;
    config.kv_cache.free_gpu_memory_fraction = a.fraction;
    config.kv_cache.max_gpu_total_bytes = a.max_gpu_total_bytes;
    config.scheduler.max_num_sequences = a.max_sequences;
    config.scheduler.max_num_tokens = a.max_batched_tokens;
    let drafts = a.drafts.unwrap_or(u32::from(a.with_mtp));
    if drafts > 0 {
        config.spec_decode.mode = SpecMode::Mtp;
        config.spec_decode.draft_tokens = drafts;
    }
    let spec = config
        .model
        .windowed_spec()
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("{} has no sliding windows", preset.name()))?;
    let tail_boundaries = a
        .tail_boundaries
        .unwrap_or(a.max_sequences.saturating_mul(2));
    let demand = V4Demand::of_config(&config, &spec, tail_boundaries).map_err(|e| e.to_string())?;
    let plan = V4Plan::new(&spec).map_err(|e| e.to_string())?;
    let free = (a.gpu_mem_gib * GIB) as u64;
    let capacity = WindowedCapacityPlan::new(plan, demand, &config.kv_cache, Some(free))
        .map_err(|e| e.to_string())?;
    let budget_source = match a.max_gpu_total_bytes {
        Some(b) => format!("max_gpu_total_bytes {b}"),
        None => format!("{:.1} GiB free × {}", a.gpu_mem_gib, a.fraction),
    };
    v4::run(v4::V4Args {
        preset,
        spec,
        capacity,
        budget_source,
        json: a.json,
    })
}

fn main() -> ExitCode {
    common::quiet_on_closed_stdout();
    let args = Args::parse();
    if args.mtp_in_target && !args.with_mtp {
        common::usage_error::<Args>("--mtp-in-target needs --with-mtp");
    }
    match args.model {
        PlanModel::V4(p) => {
            if let Some(flag) = v4_unused_flag(&args) {
                common::usage_error::<Args>(&format!("{flag} does not apply to {}", p.name()));
            }
        }
        PlanModel::Dsa(p) => {
            if let Some(flag) = dsa_unused_flag(&args) {
                common::usage_error::<Args>(&format!(
                    "{flag} applies to the DeepSeek-V4 models only, not to {}",
                    p.name()
                ));
            }
        }
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
