//! `serve --model deepseek-v4-flash|deepseek-v4-pro`: the DeepSeek-V4 main job, on the
//! host backend or (`--backend cuda`, `--gpus`) with each device actor the model's CUDA
//! device (`dsa_kv::cuda::v4::WindowedCudaDevice`, the CUDA backend's windowed device:
//! pools in GPU memory, running the model's `V4CudaForward` through the one `Forward`
//! contract, in kernels, bit-exact with the host). The V4 reference model (`dsa_kv_model::v4`) with
//! the preset's layer structure (its ratio list: window-only, ratio-4 and ratio-128
//! layers, and the MTP layer) and tiny widths elsewhere (hidden 64, 2 heads, top-64) runs
//! through the one runtime (`KvCacheBuilder::windowed`: the scheduler over the model's
//! cache, the coordinator, one device actor per `--devices`) on a multi-turn chat
//! workload over shared system prompts: chunked prefill, MTP decode with 3 drafts,
//! prefix hits at window tails, preemption by recompute and a host tier for the
//! compressed blocks, with the KV events and counters every model has. The pools are
//! sized by `core::quota::v4_capacity` from `--budget-mib`. After the run every request
//! is run again alone on a contiguous cache: its output tokens, and the logits of every
//! position every device computed, must be equal bit for bit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use dsa_kv::prelude::*;
use dsa_kv::rng::SplitMix64;
use dsa_kv::v4::{
    DeviceBackend, V4Preset, WindowedBackendFactory, WindowedHostDevice, WindowedModel,
    WindowedSetup,
};
use dsa_kv_model::v4::{V4Model, V4ModelConfig, V4ModelForward, V4Outputs};
use serde_json::json;

use super::{Args, Backend, ServeError, MODEL_SEED};

/// A conversation: its system prompt and everything said so far.
struct Conversation {
    history: Vec<u32>,
    turn: usize,
}

/// What one request was.
struct Sent {
    prompt: Vec<u32>,
    max_new: u32,
}

/// Which V4 model runs.
pub(crate) enum V4Source {
    /// The reference model with the preset's layer structure and tiny widths.
    Preset(V4Preset),
    /// A transformers `deepseek_v4` checkpoint (`V4Model::from_checkpoint`), with its
    /// published MTP layer when it has one.
    Checkpoint(std::path::PathBuf),
}

pub(crate) async fn run(a: Args, source: V4Source) -> Result<serde_json::Value, ServeError> {
    let (model, name, widths, default_mib) = match &source {
        V4Source::Preset(preset) => {
            let spec = preset.spec();
            let cfg = V4ModelConfig {
                ratios: spec.compress_ratios.clone(),
                mtp: spec.num_mtp_layers > 0,
                ..V4ModelConfig::tiny(MODEL_SEED)
            };
            let mib = match preset {
                V4Preset::Flash => 400,
                V4Preset::Pro => 640,
            };
            let widths = "latent 512 (MODEL1 rows), indexer 128; hidden 64, 2 heads, top-64";
            (
                V4Model::new(cfg)?,
                preset.name().to_string(),
                widths.to_string(),
                mib,
            )
        }
        V4Source::Checkpoint(dir) => {
            let m = V4Model::from_checkpoint(dir)?;
            let c = m.config();
            let widths = format!(
                "latent 512 (MODEL1 rows), indexer 128; hidden {}, {} heads, top-{}, \
                 MTP input {} values",
                c.hidden, c.heads, c.topk, c.mtp_input
            );
            let name = format!("deepseek_v4 checkpoint {}", dir.display());
            (m, name, widths, 400)
        }
    };
    let model = Arc::new(model);
    let spec = model.config().spec()?;
    let draft_tokens = if model.config().mtp { 3 } else { 0 };
    let budget = a.budget_mib.unwrap_or(default_mib) << 20;
    let mut config = EngineConfig::default();
    config.kv_cache.max_gpu_total_bytes = Some(budget);
    config.scheduler.max_num_sequences = 4;
    config.scheduler.max_num_tokens = 512;
    config.scheduler.max_prefill_chunk = 256;
    config.scheduler.max_seq_len = 8192;
    if draft_tokens > 0 {
        config.spec_decode.mode = SpecMode::Mtp;
    }
    config.spec_decode.draft_tokens = draft_tokens;
    config.spec_decode.separate_draft_cache = false;
    config.kv_cache.enable_partial_reuse = false;
    let outputs = Arc::new(Mutex::new(V4Outputs::default()));
    let backend: WindowedBackendFactory = {
        let (model, outputs, backend) = (model.clone(), outputs.clone(), a.backend);
        let gpus = a.gpus.clone();
        Arc::new(move |i, s: &WindowedSetup| match backend {
            Backend::Host => {
                let f = V4ModelForward::new(model.clone(), outputs.clone());
                let d = WindowedHostDevice::new(i, &s.plan, &s.slots, Box::new(f))?;
                Ok(Box::new(d) as Box<dyn DeviceBackend>)
            }
            Backend::Cuda => cuda_device(gpus.as_deref(), i, s, &model, &outputs),
        })
    };
    let mut windowed = WindowedModel::new(model.config().spec()?, backend);
    let mut slots = v4_slots(&model, &config)?;
    if let Some(cap) = a.gpu_blocks {
        slots.blocks.gpu[0] = slots.blocks.gpu[0].min(cap);
    }
    windowed.slots = Some(slots);
    let rt = KvCacheBuilder::new()
        .config(config)
        .host_devices(a.devices)
        .windowed(windowed)
        .start()
        .await?;
    let info = rt.info().clone();

    let (conversations, turns) = match a.quick {
        true => (a.conversations.unwrap_or(3), a.turns.unwrap_or(2)),
        false => (a.conversations.unwrap_or(6), a.turns.unwrap_or(3)),
    };
    let vocab = model.config().vocab as u64;
    let mut rng = SplitMix64(a.seed);
    let systems: Vec<Vec<u32>> = (0..2)
        .map(|_| {
            let n = 300 + rng.below(300);
            (0..n).map(|_| rng.below(vocab) as u32).collect()
        })
        .collect();
    let mut convs: Vec<Conversation> = (0..conversations)
        .map(|c| Conversation {
            history: systems[c % systems.len()].clone(),
            turn: 0,
        })
        .collect();
    let mut sent: HashMap<RequestId, Sent> = HashMap::new();
    let mut owner: HashMap<RequestId, usize> = HashMap::new();
    let mut next_id = 0u64;
    let mut submit = |c: usize, convs: &mut Vec<Conversation>, rng: &mut SplitMix64| {
        let conv = &mut convs[c];
        let n = 20 + rng.below(100);
        conv.history.extend((0..n).map(|_| rng.below(vocab) as u32));
        conv.turn += 1;
        let id = RequestId(next_id);
        next_id += 1;
        let max_new = 16 + rng.below(48) as u32;
        let prompt = conv.history.clone();
        (id, prompt, max_new)
    };
    for c in 0..conversations {
        let (id, prompt, max_new) = submit(c, &mut convs, &mut rng);
        let toks = prompt.iter().map(|&t| TokenId(t)).collect();
        rt.submit(SubmitRequest::new(id, toks, max_new)).await?;
        owner.insert(id, c);
        sent.insert(id, Sent { prompt, max_new });
    }
    let started = Instant::now();
    let mut step_ms = Vec::new();
    let mut finished: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let (mut failed, mut preempted, mut copies, mut tokens) = (Vec::new(), 0usize, 0u64, 0usize);
    // Prompt tokens served from the cache at each request's first admission.
    let mut first_reuse = 0u64;
    while finished.len() + failed.len() < sent.len() {
        let t = Instant::now();
        let rep = rt.step(Drafts::none()).await?;
        if rep.scheduled.is_empty() && rep.failed.is_empty() {
            continue;
        }
        step_ms.push(t.elapsed().as_secs_f64() * 1e3);
        preempted += rep.preempted.len();
        copies += rep.devices.first().map_or(0, |d| d.slot_copies);
        tokens += rep.scheduled.iter().map(|p| p.tokens.len()).sum::<usize>();
        failed.extend(rep.failed.iter().map(|(id, why)| format!("{id}: {why}")));
        let done = rep.committed.map(|c| c.finished).unwrap_or_default();
        for f in done {
            let f = f.finished;
            first_reuse += f.reused_tokens;
            let out: Vec<u32> = f.output().iter().map(|t| t.0).collect();
            let c = owner[&f.id];
            convs[c].history.extend(&out);
            finished.insert(f.id, out);
            if convs[c].turn < turns {
                let (id, prompt, max_new) = submit(c, &mut convs, &mut rng);
                let toks = prompt.iter().map(|&t| TokenId(t)).collect();
                rt.submit(SubmitRequest::new(id, toks, max_new)).await?;
                owner.insert(id, c);
                sent.insert(id, Sent { prompt, max_new });
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let stats = rt.stats().await?;
    rt.shutdown().await;
    let windows = stats.windows.unwrap_or_default();

    // The exactness check: every request alone, unpaged.
    let out = outputs.lock().unwrap_or_else(|e| e.into_inner());
    let mut exact = 0usize;
    let mut differences = Vec::new();
    let mut positions = 0u64;
    let mut ids: Vec<&RequestId> = sent.keys().collect();
    ids.sort();
    for id in ids {
        let s = &sent[id];
        let Some(got) = finished.get(id) else {
            continue;
        };
        let g = model.generate(&s.prompt, s.max_new)?;
        let (gen, outs) = (g.tokens, g.outputs);
        let mut ok = *got == gen;
        if !ok {
            differences.push(format!("request {id}: tokens differ"));
        }
        for device in 0..a.devices {
            for (&pos, o) in out.tokens.get(&(device, *id)).into_iter().flatten() {
                positions += 1;
                if outs.get(pos as usize) != Some(o) {
                    ok = false;
                    differences.push(format!("request {id}, device {device}, position {pos}"));
                }
            }
        }
        exact += usize::from(ok);
    }
    differences.extend(out.conflicts.iter().cloned());
    let checked = finished.len();
    let all_exact = exact == checked && out.conflicts.is_empty();
    let prompt_tokens: usize = sent.values().map(|s| s.prompt.len()).sum();
    let generated: usize = finished.values().map(Vec::len).sum();
    step_ms.sort_by(f64::total_cmp);
    let rank = |q: f64| {
        let i = ((q * step_ms.len() as f64).ceil() as usize).clamp(1, step_ms.len().max(1)) - 1;
        step_ms.get(i).copied()
    };
    let (window, c4, c128) = spec.layer_counts();
    let report = json!({
        "model": name,
        "structure": {
            "layers": spec.compress_ratios.len(), "window_only": window, "ratio_4": c4,
            "ratio_128": c128, "mtp_layers": spec.num_mtp_layers,
            "widths": widths,
        },
        "devices": a.devices,
        "backend": format!("{:?}", a.backend).to_lowercase(),
        "budget_bytes": budget,
        "gpu_blocks": info.budget.slots,
        "host_blocks": info.host_slots,
        "window_slots": info.window_slots,
        "bytes_per_block": info.bytes_per_token * 256,
        "requests": sent.len(),
        "requests_finished": checked,
        "requests_failed": failed.len(),
        "failures": failed,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "processed_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens as f64 / wall.max(1e-9),
        "step_ms": {"steps": step_ms.len(), "median": rank(0.5), "p99": rank(0.99)},
        "reused_tokens": first_reuse,
        "prefix_hit_rate": first_reuse as f64 / prompt_tokens.max(1) as f64,
        "reused_tokens_with_readmissions": windows.reused_tokens,
        "preemptions": preempted,
        "prefill_tokens": stats.scheduler.prefill_tokens,
        "slot_copies": copies,
        "drafts": stats.scheduler.drafts_proposed,
        "accepted_drafts": stats.scheduler.drafts_accepted,
        // Every admission, re-admissions after a preemption included.
        "tails_adopted": windows.windows.tails_adopted,
        "tails_linked": windows.windows.tails_linked,
        "tails_evicted": windows.windows.tails_evicted,
        "backed_off_blocks": windows.backed_off_blocks,
        "kv_events": stats.events,
        "checked_requests": checked,
        "exact_requests": exact,
        "positions_checked": positions,
        "exact": all_exact,
        "exactness_differences": differences.iter().take(20).collect::<Vec<_>>(),
        "integrity_ok": all_exact && failed.is_empty() && checked == sent.len(),
    });
    std::fs::create_dir_all(&a.out)
        .and_then(|()| std::fs::write(a.out.join("serve_v4_report.json"), report.to_string()))
        .map_err(|e| format!("--out {}: {e}", a.out.display()))?;
    if !a.json {
        let r = &report;
        println!(
            "model                {} ({} layers + {} MTP, tiny widths)",
            name,
            spec.compress_ratios.len(),
            spec.num_mtp_layers
        );
        println!(
            "requests             {} finished of {}, {} failed",
            r["requests_finished"], r["requests"], r["requests_failed"]
        );
        println!(
            "tokens               {} prompt, {} generated, {} processed ({:.0}/s)",
            r["prompt_tokens"],
            r["generated_tokens"],
            r["processed_tokens"],
            r["tokens_per_s"].as_f64().unwrap_or(0.0)
        );
        println!(
            "step ms              median {:.2}, p99 {:.2} over {} steps",
            r["step_ms"]["median"].as_f64().unwrap_or(0.0),
            r["step_ms"]["p99"].as_f64().unwrap_or(0.0),
            r["step_ms"]["steps"]
        );
        println!(
            "prefix hit rate      {:.3} ({} tokens at window tails, {} tails adopted)",
            r["prefix_hit_rate"].as_f64().unwrap_or(0.0),
            r["reused_tokens"],
            r["tails_adopted"]
        );
        println!(
            "preemptions          {} ({} prefill tokens in all)",
            r["preemptions"], r["prefill_tokens"]
        );
        println!(
            "KV events            {} stored, {} removed",
            stats.events.stored, stats.events.removed
        );
        println!(
            "slot copies          {} (offload and onboarding)",
            r["slot_copies"]
        );
        println!(
            "MTP drafts           {} accepted of {}",
            r["accepted_drafts"], r["drafts"]
        );
        println!(
            "exact                {} of {} requests ({} positions on {} device(s))",
            r["exact_requests"], r["checked_requests"], r["positions_checked"], a.devices
        );
        println!(
            "report               {}",
            a.out.join("serve_v4_report.json").display()
        );
    }
    Ok(report)
}

/// The pools' slots for `config`'s budget and scheduler, as the builder would size them,
/// with the host tier holding as many compressed blocks as the GPU.
fn v4_slots(
    model: &V4Model,
    config: &EngineConfig,
) -> Result<dsa_kv::v4::WindowedSlots, ServeError> {
    use dsa_kv::core::quota::{v4_capacity, V4Demand};
    use dsa_kv::layout::Retention;
    let plan = dsa_kv::v4::V4Plan::new(&model.config().spec()?)?;
    let s = &config.scheduler;
    let demand = V4Demand {
        max_sequences: s.max_num_sequences,
        drafts: config.spec_decode.draft_tokens,
        max_batched_tokens: s.max_num_tokens,
        tail_boundaries: 16,
    };
    let budget = config.kv_cache.max_gpu_total_bytes.unwrap_or(0);
    let cap = v4_capacity(&plan, budget, &demand)?;
    let windows = plan
        .life_cycles()
        .iter()
        .filter(|lc| lc.retention != Retention::Full)
        .map(|lc| cap.slots[lc.id.index()] as u32)
        .collect();
    let blocks = cap.blocks as u32;
    Ok(dsa_kv::v4::WindowedSlots {
        blocks: dsa_kv::v4::TierSlots {
            gpu: vec![blocks],
            host: vec![blocks],
        },
        windows,
    })
}

/// Device `i` on its GPU (`gpus`, default `0..devices`), or why this build has none.
fn cuda_device(
    gpus: Option<&[usize]>,
    i: usize,
    s: &WindowedSetup,
    model: &Arc<V4Model>,
    outputs: &Arc<Mutex<V4Outputs>>,
) -> Result<Box<dyn DeviceBackend>, dsa_kv::device::DeviceError> {
    #[cfg(feature = "cuda")]
    {
        let ordinal = gpus.map_or(i, |g| g[i]);
        let gpu =
            dsa_kv::cuda::Gpu::open(ordinal).map_err(|e| dsa_kv::device::DeviceError::Backend {
                device: i,
                source: dsa_kv::storage::BackendError::new(e),
            })?;
        let d = dsa_kv_model::v4::cuda::v4_cuda_device(
            i,
            gpu,
            &s.plan,
            &s.slots,
            model.clone(),
            outputs.clone(),
            s.max_positions,
        )?;
        Ok(Box::new(d))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (gpus, s, model, outputs);
        Err(dsa_kv::device::DeviceError::Forward {
            device: i,
            source: dsa_kv::device::ForwardError::Unsupported {
                what: "this build has no CUDA backend: build with the `cuda` feature".into(),
            },
        })
    }
}
