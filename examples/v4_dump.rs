//! DeepSeek-V4 pools for FlashMLA's MODEL1 sparse decode (`benches/oracles/v4_flashmla.py`
//! on the H200), laid out by the V4 cache manager. Two sources (`--source`):
//!
//! * **`model`** (the default): the tiny V4 reference model (`V4ModelConfig::tiny`, layers
//!   of ratio 0, 4 and 128 and an MTP layer, 2 heads, top-64; weights from `--seed`)
//!   runs two requests through `ModelCache` (by id: `CacheById`) + `V4Pools`, prompts in chunks of 256,
//!   then greedy single-token steps. Request 0: a 700-token prompt and 61 decoded (its
//!   last position 760). Request 1: request 0's first 560 tokens and 40 of its own, so
//!   it **resumes at request 0's window tail at 512** (`tails_adopted: 1`), then 20
//!   decoded (its last position 619, whose window 492..=619 reads 20 rows of that tail
//!   in place). Each request's last step is traced (`V4Model::run_traced`) in layers 0
//!   (window only), 1 (ratio 4: the indexer's top-64 of the visible entries) and 2
//!   (ratio 128: every visible entry), and is left uncommitted, as the kernel sees it
//!   inside the step: nothing the step reads is freed while the other request runs.
//!   Dumped per trace: the window positions and entries the model read, the kernel's
//!   `indices` / `topk_length` and `extra_indices` / `extra_topk_length` computed from
//!   them by `metadata::v4` (through the tables at the traced step, checked again
//!   against the tables and the pools' bytes at the end), the softmax scale, the sinks,
//!   and per head the bf16 query (RoPE applied) and the f32 output (before the inverse
//!   RoPE), all as bit patterns.
//! * **`random`**: a small V4 model (layer 0 of ratio 4, layer 1 of ratio 128, one MTP
//!   layer), each a 700-token prompt in chunks of 256 and then single-token steps, the
//!   second resuming at the first's tail; every position each writes gets seeded random
//!   rows in the window of every layer and in the compressed caches at each group's end,
//!   encoded as MODEL1 rows into pools laid out as `V4Plan` says; then each request's
//!   last position queries both layers (a seeded stand-in for the top-k).
//!
//! Writes into `--out DIR`: `window.bin` (the window pool: every slot, every layer's
//! page), `c4.bin` and `c128.bin` (the compressed pools), and `meta.json` (`source`,
//! geometry, per request and layer the batch's `indices` / `topk_length`,
//! `extra_indices` / `extra_topk_length` as `metadata::v4` computes them, plus rows our
//! codec decodes, for the script's own decoder to agree with).
//!
//! ```text
//! cargo run --release --example v4_dump -- --out .gpu/v4m                  # the model
//! cargo run --release --example v4_dump -- --source random --out .gpu/v4   # seeded rows
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use dsa_kv::config::V4Spec;
use dsa_kv::core::{
    CacheById, ManagerOptions, ModelCache, ReuseScope, SeqOptions, TierSlots, WindowedSlots,
};
use dsa_kv::ids::{LayerId, RequestId, SlotId, Tier, TokenId};
use dsa_kv::layout::{
    Model1PageLayout, Retention, Role, V4Buffer, V4LifeCycleKind, V4PageFormat, V4Plan,
};
use dsa_kv::metadata::v4::{self as meta, PageTable};
use dsa_kv::ops::model1::{dequantize_model1_row, quantize_model1_row, MODEL1_DATA, MODEL1_SCALES};
use dsa_kv::rng::SplitMix64;
use dsa_kv_model::v4::{V4Model, V4ModelConfig, V4Paged, V4Pools, V4Trace};
use half::bf16;
use serde_json::{json, Value};

/// What fills the pools.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Source {
    /// The tiny V4 reference model: its rows, its queries, its attention outputs.
    Model,
    /// Seeded random rows and queries over a seeded stand-in top-k.
    Random,
}

/// MODEL1 pools for the FlashMLA oracle.
#[derive(Parser)]
#[command(name = "v4_dump")]
struct Args {
    /// Output folder
    #[arg(long)]
    out: PathBuf,
    /// What fills the pools
    #[arg(long, value_enum, default_value_t = Source::Model)]
    source: Source,
    /// Seed of the rows and token ids (`random`), of the weights and token ids (`model`)
    #[arg(long, default_value_t = 4)]
    seed: u64,
}

/// A pool's bytes and the geometry of its pages.
struct Pool {
    bytes: Vec<u8>,
    page: Model1PageLayout,
}

impl Pool {
    fn new(slots: u32, buffer: &V4Buffer) -> Pool {
        let page = match buffer.format {
            V4PageFormat::Model1 { page, .. } => page,
            _ => unreachable!("a MODEL1 buffer"),
        };
        let pages = u64::from(slots) * u64::from(buffer.converter.scale);
        Pool {
            bytes: vec![0; (pages * page.page_bytes()) as usize],
            page,
        }
    }

    /// Writes `row` as row `row_index` (a kernel row: page × entries + i).
    fn write(&mut self, row_index: i64, row: &[bf16]) {
        let e = u64::from(self.page.entries);
        let (page, i) = (row_index as u64 / e, (row_index as u64 % e) as u32);
        let mut data = [0u8; MODEL1_DATA];
        let mut scales = [0u8; MODEL1_SCALES];
        quantize_model1_row(row, &mut data, &mut scales);
        let d = self.page.data_offset(page, i) as usize;
        self.bytes[d..d + MODEL1_DATA].copy_from_slice(&data);
        let s = self.page.scale_offset(page, i) as usize;
        self.bytes[s..s + MODEL1_SCALES].copy_from_slice(&scales);
    }

    fn read(&self, row_index: i64) -> Vec<f32> {
        let e = u64::from(self.page.entries);
        let (page, i) = (row_index as u64 / e, (row_index as u64 % e) as u32);
        let d = self.page.data_offset(page, i) as usize;
        let s = self.page.scale_offset(page, i) as usize;
        let data: [u8; MODEL1_DATA] = self.bytes[d..d + MODEL1_DATA].try_into().unwrap();
        let scales: [u8; MODEL1_SCALES] = self.bytes[s..s + MODEL1_SCALES].try_into().unwrap();
        dequantize_model1_row(&data, &scales).to_vec()
    }
}

/// A row of seeded values: per 64-value tile a magnitude between 2^-3 and 1 (so the
/// scales differ; at most 1, the scale of FlashMLA's own test data, which its tolerances
/// are for), RoPE values in [-1, 1].
fn row(rng: &mut SplitMix64) -> Vec<bf16> {
    let mut out = Vec::with_capacity(512);
    for tile in 0..8 {
        let mag = (2f64).powi(rng.range(0, 3) as i32 - 3);
        for _ in 0..64 {
            let x = (rng.uniform() * 2.0 - 1.0) * if tile < 7 { mag } else { 1.0 };
            out.push(bf16::from_f64(x));
        }
    }
    out
}

/// A windowed cache over `plan` with `slots`, no tail kept beyond a sequence's last two
/// boundaries, driven by request id.
fn windowed(plan: &V4Plan, slots: WindowedSlots) -> Result<CacheById, String> {
    let opts = ManagerOptions {
        enable_partial_reuse: false,
        ..ManagerOptions::default()
    };
    let c = ModelCache::windowed(plan, slots, opts, 0).map_err(|e| e.to_string())?;
    Ok(CacheById::new(c))
}

/// `id`'s block table and its raw window's page table (first position, slots).
fn tables(m: &CacheById, id: RequestId) -> Result<(Vec<SlotId>, u64, Vec<SlotId>), String> {
    let blocks = m.block_slots(id).map_err(|e| e.to_string())?;
    let (start, slots) = m.window_table(id, 0).map_err(|e| e.to_string())?;
    Ok((blocks, start, slots))
}

/// `--source random`: seeded rows written as the positions go, queries over a seeded
/// stand-in top-k.
fn run_random(a: &Args) -> Result<(), String> {
    let spec = V4Spec {
        name: "V4 oracle (ratio 4, ratio 128, 1 MTP layer)".into(),
        compress_ratios: vec![4, 128],
        ..V4Spec::flash()
    };
    let plan = V4Plan::new(&spec).map_err(|e| e.to_string())?;
    let (block_slots, window_slots) = (16u32, [24u32, 400, 200]);
    let mut m = windowed(
        &plan,
        WindowedSlots {
            blocks: TierSlots {
                gpu: vec![block_slots],
                host: vec![],
            },
            windows: window_slots.to_vec(),
        },
    )?;
    let buf = |l: u32, role| *plan.buffer(LayerId(l), role).expect("planned");
    let windows: Vec<V4Buffer> = (0..3).map(|l| buf(l, Role::WindowKey)).collect();
    let (c4, c128) = (buf(0, Role::CompressedKey), buf(1, Role::CompressedKey));
    let mut window_pool = Pool::new(window_slots[0], &windows[0]);
    let mut c4_pool = Pool::new(block_slots, &c4);
    let mut c128_pool = Pool::new(block_slots, &c128);
    let mut rng = SplitMix64(a.seed);
    // A: 700 prompt tokens and 61 decoded; B: A's first 600 tokens, 100 prompt tokens
    // of its own and 50 decoded (it resumes at A's boundary 512).
    let a_tokens: Vec<TokenId> = (0..761).map(|i| TokenId(100 + i)).collect();
    let mut b_tokens = a_tokens[..600].to_vec();
    b_tokens.extend((0..150).map(|i| TokenId(5_000 + i)));
    let mut queries = Vec::new();
    for (r, tokens) in [(0u64, &a_tokens), (1, &b_tokens)] {
        let id = RequestId(r);
        let reused = m
            .create(id, ReuseScope::SHARED, tokens, SeqOptions::default())
            .map_err(|e| e.to_string())?;
        eprintln!("request {r}: {} tokens, {reused} reused", tokens.len());
        if !m.resume(id).map_err(|e| e.to_string())? {
            return Err("no room to resume".into());
        }
        let mut c = reused as usize;
        while c < tokens.len() {
            // The prompt (700 tokens) in chunks of 256, then one token a step.
            let n = if c < 700 { (700 - c).min(256) } else { 1 };
            if !m
                .resize(id, (c + n) as u64, c as u64)
                .map_err(|e| e.to_string())?
            {
                return Err(format!("no room at {c}"));
            }
            let (blocks, start, slots) = tables(&m, id)?;
            let table = PageTable {
                start,
                slots: &slots,
                page: 64,
            };
            for p in c..c + n {
                for w in &windows {
                    let ri = table
                        .row(w.converter, p as u64)
                        .map_err(|e| e.to_string())?;
                    window_pool.write(ri, &row(&mut rng));
                }
                for (b, pool, ratio) in [(&c4, &mut c4_pool, 4u64), (&c128, &mut c128_pool, 128)] {
                    if (p as u64 + 1).is_multiple_of(ratio) {
                        let ri = meta::entry_row(&blocks, b.converter, ratio, p as u64 / ratio)
                            .map_err(|e| e.to_string())?;
                        pool.write(ri, &row(&mut rng));
                    }
                }
            }
            m.commit(id, &tokens[c..c + n]).map_err(|e| e.to_string())?;
            c += n;
        }
        let q = c as u64 - 1;
        let (blocks, start, slots) = tables(&m, id)?;
        let table = PageTable {
            start,
            slots: &slots,
            page: 64,
        };
        let mut per_layer = Vec::new();
        for (layer, extra, ratio, width) in [(0usize, &c4, 4u64, 512usize), (1, &c128, 128, 128)] {
            let (idx, len) = meta::window_indices(&table, windows[layer].converter, q, 128, 128)
                .map_err(|e| e.to_string())?;
            // Ratio 4: a seeded "top-k" of the visible entries in shuffled order; ratio
            // 128: every visible entry.
            let visible = meta::visible_entries(q, ratio);
            let mut entries: Vec<u64> = (0..visible).collect();
            if ratio == 4 {
                for i in (1..entries.len()).rev() {
                    entries.swap(i, rng.below(i as u64 + 1) as usize);
                }
                entries.truncate(150);
            }
            let (extra_idx, extra_len) =
                meta::extra_indices(&blocks, extra.converter, ratio, entries, width)
                    .map_err(|e| e.to_string())?;
            per_layer.push(json!({
                "layer": layer, "ratio": ratio, "q": q,
                "indices": idx, "topk_length": len,
                "extra_indices": extra_idx, "extra_topk_length": extra_len,
            }));
        }
        queries.push(per_layer);
    }
    // What our codec decodes at request 0's indices, for the script's decoder.
    let q0 = &queries[0][0];
    let expect_window: Vec<Vec<f32>> = q0["indices"]
        .as_array()
        .unwrap()
        .iter()
        .take(4)
        .map(|i| window_pool.read(i.as_i64().unwrap()))
        .collect();
    let expect_c4: Vec<Vec<f32>> = q0["extra_indices"]
        .as_array()
        .unwrap()
        .iter()
        .take(4)
        .map(|i| c4_pool.read(i.as_i64().unwrap()))
        .collect();
    std::fs::create_dir_all(&a.out).map_err(|e| e.to_string())?;
    let write = |name: &str, bytes: &[u8]| {
        std::fs::write(a.out.join(name), bytes).map_err(|e| format!("{name}: {e}"))
    };
    write("window.bin", &window_pool.bytes)?;
    write("c4.bin", &c4_pool.bytes)?;
    write("c128.bin", &c128_pool.bytes)?;
    let pool_json = |p: &Pool| {
        json!({"entries": p.page.entries, "page_bytes": p.page.page_bytes(),
               "pages": p.bytes.len() as u64 / p.page.page_bytes()})
    };
    let report = json!({
        "source": "random",
        "model": spec.name,
        "window": pool_json(&window_pool),
        "c4": pool_json(&c4_pool),
        "c128": pool_json(&c128_pool),
        "queries": queries,
        "expect_window_rows": expect_window,
        "expect_c4_rows": expect_c4,
        "window_stats": format!("{:?}", m.cache().window_stats()),
    });
    write("meta.json", report.to_string().as_bytes())?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// A MODEL1 buffer's pool in [`V4Pools`]: which one (life cycle, pool) and its pages.
#[derive(Clone, Copy)]
struct PoolRef {
    lc: usize,
    pool: usize,
    page: Model1PageLayout,
}

impl PoolRef {
    fn of(plan: &V4Plan, layer: usize, role: Role) -> Result<(V4Buffer, PoolRef), String> {
        let b = *plan
            .buffer(LayerId(layer as u32), role)
            .ok_or_else(|| format!("layer {layer} has no {role:?} buffer"))?;
        let V4PageFormat::Model1 { page, .. } = b.format else {
            return Err(format!("layer {layer}: {role:?} is not a MODEL1 buffer"));
        };
        let at = PoolRef {
            lc: b.life_cycle.index(),
            pool: b.pool.index(),
            page,
        };
        Ok((b, at))
    }

    fn bytes<'a>(&self, pools: &'a V4Pools) -> &'a [u8] {
        pools.pool(self.lc, Tier::Gpu, self.pool)
    }

    /// Kernel row `row`'s data bytes, then its scale bytes.
    fn row_bytes(&self, pools: &V4Pools, row: i32) -> Result<Vec<u8>, String> {
        let e = u64::from(self.page.entries);
        let row = u64::try_from(row).map_err(|_| format!("row {row} is not a row"))?;
        let (page, i) = (row / e, (row % e) as u32);
        let d = self.page.data_offset(page, i) as usize;
        let s = self.page.scale_offset(page, i) as usize;
        let b = self.bytes(pools);
        match (b.get(d..d + MODEL1_DATA), b.get(s..s + MODEL1_SCALES)) {
            (Some(data), Some(scales)) => Ok([data, scales].concat()),
            _ => Err(format!("row {row} lies past the pool ({} B)", b.len())),
        }
    }

    /// Kernel row `row` as our codec decodes it.
    fn decode(&self, pools: &V4Pools, row: i32) -> Result<Vec<f32>, String> {
        let r = self.row_bytes(pools, row)?;
        let (data, scales) = r.split_at(MODEL1_DATA);
        Ok(dequantize_model1_row(
            data.try_into().map_err(err)?,
            scales.try_into().map_err(err)?,
        )
        .to_vec())
    }

    fn geometry(&self, pools: &V4Pools) -> Value {
        let (len, pb) = (self.bytes(pools).len() as u64, self.page.page_bytes());
        json!({"entries": self.page.entries, "page_bytes": pb, "pages": len / pb})
    }
}

/// One traced query: what the model computed and what the kernel is handed.
struct Traced {
    request: u64,
    trace: V4Trace,
    indices: Vec<i32>,
    topk_length: u32,
    extra_indices: Vec<i32>,
    extra_topk_length: u32,
    /// The bytes of every row read at the traced step (window rows, then entries).
    snapshot: Vec<Vec<u8>>,
}

/// A compressed layer's extra cache: its buffer, pool, ratio, the kernel's width, and
/// the dump's name for the pool.
struct Extra {
    buffer: V4Buffer,
    at: PoolRef,
    ratio: u64,
    width: usize,
    name: &'static str,
}

/// The tiny V4 model served by the V4 manager over the pools its plan lays out.
struct ModelRun {
    model: V4Model,
    m: CacheById,
    pools: V4Pools,
    /// Per traced layer (0, 1, 2): its window buffer, pool, and extra cache.
    window: Vec<(V4Buffer, PoolRef)>,
    extra: Vec<Option<Extra>>,
    /// The window life cycle's index among the windowed ones (the manager's `lc`).
    window_lc: usize,
    page: u64,
}

/// The layers traced: 0 (window only), 1 (ratio 4), 2 (ratio 128).
const TRACED_LAYERS: [usize; 3] = [0, 1, 2];

fn token_ids(tokens: &[u32]) -> Vec<TokenId> {
    tokens.iter().map(|&t| TokenId(t)).collect()
}

impl ModelRun {
    fn new(seed: u64) -> Result<ModelRun, String> {
        let model = V4Model::new(V4ModelConfig::tiny(seed)).map_err(err)?;
        if model.config().ratios != [0, 4, 128] {
            return Err(format!(
                "expected layers [0, 4, 128], got {:?}",
                model.config().ratios
            ));
        }
        let plan = V4Plan::new(&model.config().spec().map_err(err)?).map_err(err)?;
        // Windows: 32 slots of the raw window (a slot: one 64-token page of each of the
        // 4 layers), the compressor states' rings.
        let slots = WindowedSlots {
            blocks: TierSlots {
                gpu: vec![8],
                host: vec![],
            },
            windows: vec![32, 400, 200],
        };
        let pools = V4Pools::new(&plan, &slots).map_err(err)?;
        let m = windowed(&plan, slots)?;
        let window = TRACED_LAYERS
            .iter()
            .map(|&l| PoolRef::of(&plan, l, Role::WindowKey))
            .collect::<Result<Vec<_>, _>>()?;
        let (w0, w) = (window[0].1, &window);
        if w.iter().any(|(_, p)| (p.lc, p.pool) != (w0.lc, w0.pool)) {
            return Err("the layers' window rows are not in one pool".into());
        }
        let mut extra = vec![None];
        for (l, ratio, width, name) in [(1usize, 4u64, 512usize, "c4"), (2, 128, 128, "c128")] {
            let (buffer, at) = PoolRef::of(&plan, l, Role::CompressedKey)?;
            extra.push(Some(Extra {
                buffer,
                at,
                ratio,
                width,
                name,
            }));
        }
        let lcs = plan.life_cycles();
        let window_lc = lcs
            .iter()
            .filter(|lc| lc.retention != Retention::Full)
            .position(|lc| lc.kind == V4LifeCycleKind::Window)
            .ok_or("no window life cycle")?;
        let page = u64::from(lcs[w0.lc].tokens_per_page);
        Ok(ModelRun {
            model,
            m,
            pools,
            window,
            extra,
            window_lc,
            page,
        })
    }

    /// Runs the manager's copy plans on the pools and completes their fence.
    fn copies(&mut self) -> Result<(), String> {
        let plans = self.m.cache_mut().take_copy_plans();
        self.pools.apply(&plans).map_err(err)?;
        let f = self.m.cache_mut().issue_fence();
        self.m.cache_mut().complete_fences(f).map_err(err)
    }

    /// The kernel's indices for `t` through request `id`'s tables now: the window rows
    /// (`window_indices`, checked against the trace's positions) and the entries' rows.
    fn indices(&self, id: u64, t: &V4Trace) -> Result<(Vec<i32>, u32, Vec<i32>, u32), String> {
        let rid = RequestId(id);
        let (start, slots) = self.m.window_table(rid, self.window_lc).map_err(err)?;
        let table = PageTable {
            start,
            slots: &slots,
            page: self.page,
        };
        let conv = self.window[t.layer].0.converter;
        let window = u64::from(self.model.config().window);
        let (idx, len) =
            meta::window_indices(&table, conv, u64::from(t.pos), window, window as usize)
                .map_err(err)?;
        let from_trace = t
            .window
            .iter()
            .map(|&p| table.row(conv, u64::from(p)).map(|r| r as i32))
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        if idx[..len as usize] != from_trace[..] {
            return Err(format!(
                "layer {} at {}: window_indices disagree with the trace's positions",
                t.layer, t.pos
            ));
        }
        let (xi, xl) = match &self.extra[t.layer] {
            Some(x) => {
                let blocks = self.m.block_slots(rid).map_err(err)?;
                meta::extra_indices(
                    &blocks,
                    x.buffer.converter,
                    x.ratio,
                    t.entries.iter().map(|&w| u64::from(w)),
                    x.width,
                )
                .map_err(err)?
            }
            None if t.entries.is_empty() => (Vec::new(), 0),
            None => return Err(format!("layer {}: entries on a window-only layer", t.layer)),
        };
        Ok((idx, len, xi, xl))
    }

    /// The bytes of every row `t`'s indices read.
    fn snapshot(&self, t: &Traced) -> Result<Vec<Vec<u8>>, String> {
        let w = self.window[t.trace.layer].1;
        let mut rows = t.indices[..t.topk_length as usize]
            .iter()
            .map(|&r| w.row_bytes(&self.pools, r))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(x) = &self.extra[t.trace.layer] {
            for &r in &t.extra_indices[..t.extra_topk_length as usize] {
                rows.push(x.at.row_bytes(&self.pools, r)?);
            }
        }
        Ok(rows)
    }

    /// Serves request `id`: `prompt` in chunks of 256, then greedy steps up to `total`
    /// tokens; the last step (a decode step) is traced and left uncommitted. Returns
    /// the reused tokens and the traces.
    fn serve(
        &mut self,
        id: u64,
        prompt: &[u32],
        total: usize,
    ) -> Result<(u64, Vec<Traced>), String> {
        if total <= prompt.len() {
            return Err("the traced step must be a decode step".into());
        }
        let rid = RequestId(id);
        let reused = self
            .m
            .create(
                rid,
                ReuseScope::SHARED,
                &token_ids(prompt),
                SeqOptions::default(),
            )
            .map_err(err)?;
        if !self.m.resume(rid).map_err(err)? {
            return Err(format!("request {id}: no room to resume"));
        }
        self.copies()?;
        let mut c = reused as usize;
        let mut next = 0;
        loop {
            let chunk: Vec<u32> = if c < prompt.len() {
                prompt[c..(c + 256).min(prompt.len())].to_vec()
            } else {
                vec![next]
            };
            let n = chunk.len();
            let last = c + n == total;
            if !self.m.resize(rid, (c + n) as u64, c as u64).map_err(err)? {
                return Err(format!("request {id}: no room at {c}"));
            }
            self.copies()?;
            let points: Vec<(usize, u32)> = if last {
                TRACED_LAYERS.iter().map(|&l| (l, c as u32)).collect()
            } else {
                Vec::new()
            };
            let h = self.m.handle(rid).map_err(err)?;
            let mut kv = V4Paged::from_cache(&mut self.pools, self.m.cache(), h).map_err(err)?;
            let (outs, traces) = self
                .model
                .run_traced(&mut kv, c as u32, &chunk, &points)
                .map_err(err)?;
            if last {
                drop(kv);
                let mut out = Vec::new();
                for trace in traces {
                    let (indices, topk_length, extra_indices, extra_topk_length) =
                        self.indices(id, &trace)?;
                    let mut t = Traced {
                        request: id,
                        trace,
                        indices,
                        topk_length,
                        extra_indices,
                        extra_topk_length,
                        snapshot: Vec::new(),
                    };
                    t.snapshot = self.snapshot(&t)?;
                    out.push(t);
                }
                return Ok((reused, out));
            }
            self.model
                .draft_write(&mut kv, c as u32, &chunk, &[])
                .map_err(err)?;
            drop(kv);
            self.m.commit(rid, &token_ids(&chunk)).map_err(err)?;
            if !self
                .m
                .resize(rid, (c + n) as u64, (c + n) as u64)
                .map_err(err)?
            {
                return Err(format!("request {id}: the resize after commit failed"));
            }
            self.copies()?;
            next = outs.last().ok_or("no output")?.greedy;
            c += n;
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A trace as `meta.json` holds it.
fn trace_json(run: &ModelRun, t: &Traced) -> Result<Value, String> {
    let tr = &t.trace;
    let mut q_bits = Vec::new();
    for h in &tr.q {
        let mut head = Vec::with_capacity(h.len());
        for &v in h {
            let b = bf16::from_f32(v);
            if b.to_f32().to_bits() != v.to_bits() {
                return Err(format!(
                    "layer {}: a query value {v} is not a bf16",
                    tr.layer
                ));
            }
            head.push(b.to_bits());
        }
        q_bits.push(head);
    }
    let extra = run.extra[tr.layer].as_ref();
    Ok(json!({
        "request": t.request,
        "layer": tr.layer,
        "ratio": run.model.config().ratios[tr.layer],
        "q": tr.pos,
        "window_positions": tr.window,
        "entries": tr.entries,
        "indices": t.indices,
        "topk_length": t.topk_length,
        "extra": extra.map(|x| x.name),
        "extra_indices": t.extra_indices,
        "extra_topk_length": t.extra_topk_length,
        "softmax_scale_bits": tr.softmax_scale.to_bits(),
        "sink_bits": bits(&tr.sink),
        "q_bf16_bits": q_bits,
        "out_f32_bits": tr.out.iter().map(|h| bits(h)).collect::<Vec<_>>(),
    }))
}

/// `--source model`: the tiny V4 model's rows, queries and outputs.
fn run_model(a: &Args) -> Result<(), String> {
    let mut run = ModelRun::new(a.seed)?;
    let mut rng = SplitMix64(a.seed ^ 0x7ace);
    let vocab = run.model.config().vocab as u64;
    let mut tokens = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.below(vocab) as u32).collect() };
    // Request 0: 700 prompt tokens, 61 decoded (last position 760). Request 1: request
    // 0's first 560 tokens and 40 of its own (it resumes at 512, at request 0's tail),
    // 20 decoded (last position 619: its window reads positions 492..=511 of that tail).
    let a_prompt = tokens(700);
    let mut b_prompt = a_prompt[..560].to_vec();
    b_prompt.extend(tokens(40));
    let mut traced = Vec::new();
    let mut reused = Vec::new();
    for (id, prompt, total) in [(0u64, &a_prompt, 761usize), (1, &b_prompt, 620)] {
        let (r, t) = run.serve(id, prompt, total)?;
        eprintln!(
            "request {id}: {} prompt tokens, {r} reused, {total} in all",
            prompt.len()
        );
        reused.push(r);
        traced.push(t);
    }
    // What the kernel is handed must still be what the model read: the same tables,
    // the same bytes.
    for t in traced.iter().flatten() {
        let now = run.indices(t.request, &t.trace)?;
        if now
            != (
                t.indices.clone(),
                t.topk_length,
                t.extra_indices.clone(),
                t.extra_topk_length,
            )
        {
            return Err(format!(
                "request {}: the tables moved since the traced step",
                t.request
            ));
        }
        if run.snapshot(t)? != t.snapshot {
            return Err(format!(
                "request {} layer {}: rows read at the traced step were overwritten",
                t.request, t.trace.layer
            ));
        }
    }
    // The indexer selected (more entries visible than its top-k) and the ratio-128 layer
    // has several entries.
    let topk = run.model.config().topk as usize;
    for t in traced.iter().flatten() {
        let tr = &t.trace;
        let visible = meta::visible_entries(u64::from(tr.pos), 4);
        if tr.layer == 1 && (tr.entries.len() != topk || visible <= topk as u64) {
            return Err(format!("request {}: the indexer did not select", t.request));
        }
        if tr.layer == 2 && tr.entries.len() < 4 {
            return Err(format!("request {}: too few ratio-128 entries", t.request));
        }
    }
    // Rows our codec decodes, for the script's decoder: request 0's first rows of
    // each pool.
    let q0 = &traced[0];
    let w = run.window[0].1;
    let expect = |at: PoolRef, rows: &[i32]| -> Result<Value, String> {
        let rows = &rows[..4.min(rows.len())];
        let values = rows
            .iter()
            .map(|&r| at.decode(&run.pools, r))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(json!({"rows": rows, "values": values}))
    };
    let c4 = run.extra[1].as_ref().ok_or("no c4")?.at;
    let c128 = run.extra[2].as_ref().ok_or("no c128")?.at;
    let expect_rows = json!({
        "window": expect(w, &q0[1].indices)?,
        "c4": expect(c4, &q0[1].extra_indices)?,
        "c128": expect(c128, &q0[2].extra_indices)?,
    });
    let queries = traced
        .iter()
        .map(|ts| {
            ts.iter()
                .map(|t| trace_json(&run, t))
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let kind = run.m.cache().window_stats().unwrap_or_default();
    let stats = kind.windows;
    let cfg = run.model.config();
    let report = json!({
        "source": "model",
        "model": format!("tiny V4 {:?} + MTP, seed {}: {} heads, top-{}, window {}",
                         cfg.ratios, a.seed, cfg.heads, cfg.topk, cfg.window),
        "model_heads": cfg.heads,
        "window": w.geometry(&run.pools),
        "c4": c4.geometry(&run.pools),
        "c128": c128.geometry(&run.pools),
        "queries": queries,
        "expect_rows": expect_rows,
        "reused_tokens": reused,
        "tails_adopted": stats.tails_adopted,
        "window_stats": format!("{stats:?}"),
        "window_kind_stats": format!("{kind:?}"),
    });
    std::fs::create_dir_all(&a.out).map_err(err)?;
    let write = |name: &str, bytes: &[u8]| {
        std::fs::write(a.out.join(name), bytes).map_err(|e| format!("{name}: {e}"))
    };
    write("window.bin", w.bytes(&run.pools))?;
    write("c4.bin", c4.bytes(&run.pools))?;
    write("c128.bin", c128.bytes(&run.pools))?;
    write("meta.json", report.to_string().as_bytes())?;
    eprintln!("wrote {} ({stats:?})", a.out.display());
    Ok(())
}

fn main() -> ExitCode {
    let a = Args::parse();
    let run = match a.source {
        Source::Model => run_model(&a),
        Source::Random => run_random(&a),
    };
    match run {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
