//! The scheduler's step against the bare core decode step, and the host's page-table
//! fill from the plans' row stamps against a full rewrite, side by side in one run at
//! two context lengths (issue 27's first and third targets).
//!
//! 256 decoding requests of DeepSeek-V3.2 (V2 layout, 64-token blocks, 3 MTP drafts,
//! one accepted per step). Per context length, each round runs `STEPS` steps of every
//! variant one after the other (slow drifts of the host hit all alike):
//!
//! * `core_decode_step`: the bare core work of a decode step, as `benches/core.rs`
//!   measures it: every sequence grows by 1 + 3 tokens, the batch's block table is
//!   written (`write_block_table`, the whole row), the drafts are rolled back;
//! * `schedule_commit`: the scheduler's `schedule` (drafts given) + `complete` +
//!   `commit` (1 draft accepted, a sampled token) + `recycle`;
//! * `metadata_stamped`: `StepMetadata::prepare` for that step's plan with the rows'
//!   stamps (what a device does each step; the rows keep their batch index);
//! * `metadata_full`: the same plan with unknown stamps (every row rewritten, what
//!   every step did before the stamps).
//!
//! With `--cuda` (feature `cuda`, a GPU), two more variants time the host work of the
//! CUDA backend's step metadata, what its device actor does before each forward:
//!
//! * `metadata_stamped_cuda`: `prepare` with the stamps + `DeviceMetadata::upload`
//!   (staging, the copies and the page-table cell pairs enqueued; the GPU is synchronized
//!   after the clock stops, so the queue does not build up);
//! * `metadata_full_cuda`: the same with unknown stamps (every row rewritten, and the
//!   change log giving up: the tables' used parts are copied, as every step did before).
//!
//! Prints one JSON object per variant and context (median and mean ns per step over
//! all rounds, and the median against `core_decode_step`). Run:
//! `cargo bench --bench step -- [--rounds N] [--steps N] [--contexts 3000,131072]
//! [--only core_decode_step,metadata_full] [--cuda]` (the scheduler always runs: it
//! makes the plans).

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Instant;

use dsa_kv::config::{DsaModel, LayerSet};
use dsa_kv::core::scheduler::{RequestOutcome, Scheduler, SchedulerLimits, SubmitRequest};
use dsa_kv::core::{
    KvCacheManager, ManagerOptions, ReuseScope, RowStamp, SeqHandle, SeqOptions, TierSlots,
};
use dsa_kv::ids::{LifeCycleId, RequestId, TokenId};
use dsa_kv::layout::{LayoutKind, PoolPlan};
use dsa_kv::metadata::{MetadataDims, MetadataLayout, StepMetadata, StepRequest};

const SEQS: u64 = 256;
const T: u64 = 64;

fn plan() -> PoolPlan {
    PoolPlan::for_model(
        &DsaModel::deepseek_v32(),
        LayerSet::TargetAndMtp,
        LayoutKind::V2,
        T as u32,
    )
    .expect("DeepSeek-V3.2's plan")
}

fn manager(slots: u32) -> KvCacheManager {
    KvCacheManager::new(
        plan(),
        TierSlots {
            gpu: vec![slots],
            host: vec![],
        },
        ManagerOptions::default(),
    )
    .expect("a manager")
}

/// Prompt length of request `i` at context `ctx`: spread over [ctx/2, ctx].
fn prompt_len(i: u64, ctx: u64) -> u64 {
    ctx / 2 + (i * 7919) % (ctx / 2 + 1)
}

struct Core {
    m: KvCacheManager,
    seqs: Vec<(SeqHandle, u64)>,
    table: Vec<i32>,
    cols: usize,
}

impl Core {
    fn new(ctx: u64, cols: usize) -> Core {
        let mut m = manager((SEQS * (ctx / T + 4)) as u32);
        let mut seqs = Vec::new();
        for i in 0..SEQS {
            let len = prompt_len(i, ctx);
            let h = m
                .create(
                    RequestId(i),
                    ReuseScope::SHARED,
                    &[TokenId(i as u32)],
                    SeqOptions::default(),
                )
                .expect("create")
                .handle;
            assert!(m.resume(&h).expect("resume"));
            assert!(m.resize(&h, len, len).expect("resize"));
            seqs.push((h, len));
        }
        Core {
            m,
            seqs,
            table: vec![0; SEQS as usize * cols],
            cols,
        }
    }

    fn step(&mut self) {
        for (h, len) in &self.seqs {
            assert!(self.m.resize(h, len + 4, *len).expect("resize"));
        }
        for (i, (h, _)) in self.seqs.iter().enumerate() {
            let row = &mut self.table[i * self.cols..(i + 1) * self.cols];
            self.m
                .write_block_table(h, LifeCycleId(0), row)
                .expect("table");
        }
        for (h, len) in &self.seqs {
            assert!(self.m.resize(h, *len, *len).expect("resize"));
        }
        black_box(&self.table);
    }
}

/// A scheduler with 256 requests of up to `ctx` tokens, prefilled and decoding; its
/// pool has `cols` blocks per request, room for every step the run takes (no request
/// is ever preempted: a preemption would be a different workload).
fn scheduler(ctx: u64, cols: usize) -> Scheduler {
    let limits = SchedulerLimits {
        max_num_sequences: SEQS as u32,
        max_num_tokens: 1 << 26,
        max_prefill_chunk: 1 << 26,
        max_seq_len: 1 << 24,
        draft_tokens: 3,
        livelock_steps: 1000,
        max_context_kv_tokens: 1 << 26,
        transfer_lease: std::time::Duration::from_secs(30),
    };
    let mut s = Scheduler::new(manager((SEQS * cols as u64) as u32), None, limits);
    for i in 0..SEQS {
        let prompt = (0..prompt_len(i, ctx)).map(|t| TokenId((t as u32 % 60_000) + i as u32));
        s.submit(SubmitRequest::new(RequestId(i), prompt.collect(), 1 << 20))
            .expect("submit");
    }
    // Prefill everything, then one decode step so that every request decodes.
    for _ in 0..3 {
        let p = s.schedule(&HashMap::new()).expect("schedule");
        s.complete(p.target_fence, p.draft_fence).expect("complete");
        let ids: Vec<(RequestId, u32)> = p.requests.iter().map(|r| (r.id, r.num_drafts)).collect();
        s.commit(&outcomes(&ids)).expect("commit");
        s.recycle(p);
    }
    s
}

/// A sampled token each, and one draft accepted where there were drafts.
fn outcomes(ids: &[(RequestId, u32)]) -> Vec<RequestOutcome> {
    ids.iter()
        .map(|&(id, drafts)| RequestOutcome {
            id,
            accepted_drafts: drafts.min(1),
            next_token: Some(TokenId(9)),
        })
        .collect()
}

fn layout() -> MetadataLayout {
    MetadataLayout::from_plan(&plan()).expect("metadata layout")
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

/// The CUDA backend's device metadata of one `StepMetadata` (`--cuda`).
#[cfg(feature = "cuda")]
struct Cuda {
    gpu: std::sync::Arc<dsa_kv::cuda::Gpu>,
    dev: [dsa_kv::cuda::DeviceMetadata; 2],
    bytes: [Vec<u64>; 2],
}

#[cfg(feature = "cuda")]
impl Cuda {
    fn open(metas: [&StepMetadata; 2]) -> Result<Cuda, String> {
        let gpu = dsa_kv::cuda::Gpu::open(0).map_err(|e| format!("--cuda: {e}"))?;
        let dev = [
            dsa_kv::cuda::DeviceMetadata::new(&gpu, metas[0]).map_err(|e| e.to_string())?,
            dsa_kv::cuda::DeviceMetadata::new(&gpu, metas[1]).map_err(|e| e.to_string())?,
        ];
        Ok(Cuda {
            gpu,
            dev,
            bytes: [Vec::new(), Vec::new()],
        })
    }

    /// Uploads metadata `i`; returns the host time of the upload.
    fn upload(&mut self, i: usize, meta: &mut StepMetadata) -> std::time::Duration {
        let t = Instant::now();
        self.dev[i].upload(&self.gpu, meta).expect("upload");
        let took = t.elapsed();
        self.gpu.synchronize().expect("synchronize");
        self.bytes[i].push(self.dev[i].last_bytes() as u64);
        took
    }
}

#[cfg(not(feature = "cuda"))]
struct Cuda;

#[cfg(not(feature = "cuda"))]
impl Cuda {
    fn open(_: [&StepMetadata; 2]) -> Result<Cuda, String> {
        Err("--cuda needs the feature `cuda`".into())
    }

    fn upload(&mut self, _: usize, _: &mut StepMetadata) -> std::time::Duration {
        unreachable!("never opened")
    }
}

fn main() {
    let rounds: usize = arg("--rounds", "20").parse().expect("--rounds N");
    let steps: usize = arg("--steps", "50").parse().expect("--steps N");
    let contexts: Vec<u64> = arg("--contexts", "3000,131072")
        .split(',')
        .map(|c| c.parse().expect("--contexts a,b"))
        .collect();
    let only = arg("--only", "");
    let wants = |name: &str| only.is_empty() || only.split(',').any(|o| o == name);
    let layout = layout();
    for &ctx in &contexts {
        let t0 = Instant::now();
        // Room for the steps' growth: 2 tokens a step.
        let cols = ((ctx + 2 * (rounds * steps) as u64 + 8) / T + 8).next_multiple_of(4) as usize;
        let mut core = Core::new(ctx, cols);
        let mut s = scheduler(ctx, cols);
        let dims = MetadataDims {
            max_num_sequences: SEQS as usize,
            max_blocks_per_seq: cols,
            max_num_tokens: 4 * SEQS as usize,
            max_context_kv_tokens: 1,
        };
        let mut stamped = StepMetadata::new(layout, dims, None, false).expect("metadata");
        let mut full = StepMetadata::new(layout, dims, None, false).expect("metadata");
        let mut cuda = if std::env::args().any(|a| a == "--cuda") {
            match Cuda::open([&stamped, &full]) {
                Ok(c) => Some(c),
                Err(e) => {
                    eprintln!("{e}");
                    std::process::exit(2);
                }
            }
        } else {
            None
        };
        let drafts: HashMap<RequestId, Vec<TokenId>> = (0..SEQS)
            .map(|i| (RequestId(i), vec![TokenId(1), TokenId(2), TokenId(3)]))
            .collect();
        eprintln!(
            "context {ctx}: set up in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        let names = [
            "core_decode_step",
            "schedule_commit",
            "metadata_stamped",
            "metadata_full",
            "metadata_stamped_cuda",
            "metadata_full_cuda",
        ];
        let mut ns: Vec<Vec<u64>> = vec![Vec::new(); names.len()];
        let mut writes: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..rounds {
            for _ in 0..steps * usize::from(wants("core_decode_step")) {
                let t = Instant::now();
                core.step();
                ns[0].push(t.elapsed().as_nanos() as u64);
            }
            for _ in 0..steps {
                let t = Instant::now();
                let p = s.schedule(&drafts).expect("schedule");
                s.complete(p.target_fence, p.draft_fence).expect("complete");
                let scheduled = t.elapsed();
                // The outcomes are the caller's (built outside the clock).
                let ids: Vec<(RequestId, u32)> =
                    p.requests.iter().map(|r| (r.id, r.num_drafts)).collect();
                let out = outcomes(&ids);
                let t = Instant::now();
                s.commit(&out).expect("commit");
                ns[1].push((scheduled + t.elapsed()).as_nanos() as u64);
                // The device side of the same step, both ways.
                for (v, meta, keep) in [(2, &mut stamped, true), (3, &mut full, false)] {
                    if !wants(names[v]) {
                        continue;
                    }
                    let reqs: Vec<StepRequest> = p
                        .requests
                        .iter()
                        .map(|r| StepRequest {
                            row: if keep {
                                r.block_slots.stamp()
                            } else {
                                RowStamp::UNKNOWN
                            },
                            ..StepRequest::planned(r, false)
                        })
                        .collect();
                    let t = Instant::now();
                    meta.prepare(&layout, &reqs).expect("prepare");
                    let prepared = t.elapsed();
                    ns[v].push(prepared.as_nanos() as u64);
                    writes[v - 2].push(meta.last_table_writes() as u64);
                    if let Some(c) = cuda.as_mut() {
                        let up = c.upload(v - 2, meta);
                        ns[v + 2].push((prepared + up).as_nanos() as u64);
                    }
                }
                s.recycle(p);
            }
        }
        assert_eq!(s.stats().preemptions, 0, "the pool was sized for the run");
        let base = median(&mut ns[0].clone());
        for (v, name) in names.iter().enumerate() {
            let mean = ns[v].iter().sum::<u64>() as f64 / ns[v].len().max(1) as f64;
            let med = median(&mut ns[v]);
            if ns[v].is_empty() && v >= 4 {
                continue;
            }
            let extra = match v {
                #[cfg(feature = "cuda")]
                4 | 5 => match cuda.as_mut() {
                    Some(c) => format!(
                        ",\"upload_bytes_median\":{},\"upload_bytes_first_step\":{}",
                        median(&mut c.bytes[v - 4].clone()),
                        c.bytes[v - 4].first().copied().unwrap_or(0)
                    ),
                    None => String::new(),
                },
                2 | 3 => format!(
                    ",\"table_cells_median\":{},\"table_cells_first_step\":{}",
                    median(&mut writes[v - 2].clone()),
                    writes[v - 2].first().copied().unwrap_or(0)
                ),
                _ => String::new(),
            };
            println!(
                "{{\"context\":{ctx},\"variant\":\"{name}\",\"steps\":{},\"median_ns\":{med},\"mean_ns\":{mean:.0},\"vs_core_decode_step\":{}{extra}}}",
                ns[v].len(),
                if base > 0 && med > 0 {
                    format!("{:.2}", med as f64 / base as f64)
                } else {
                    "null".into()
                }
            );
        }
    }
}
