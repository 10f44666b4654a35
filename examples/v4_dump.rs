//! DeepSeek-V4 pools for FlashMLA's MODEL1 sparse decode (`benches/oracles/v4_flashmla.py`
//! on the H200): the V4 cache manager serves two requests of a small V4 model (layer 0 of
//! ratio 4, layer 1 of ratio 128, one MTP layer), each a 700-token prompt in chunks of
//! 256 and then single-token steps, the second resuming at the first's tail; every position each writes gets seeded random rows in the window of every layer
//! and in the compressed caches at each group's end, encoded as MODEL1 rows into pools
//! laid out as `V4Plan` says; then each request's last position queries both layers.
//!
//! Writes into `--out DIR`: `window.bin` (the window pool: every slot, every layer's
//! page), `c4.bin` and `c128.bin` (the compressed pools), and `meta.json` (geometry,
//! and per layer the batch's `indices` / `topk_length`, `extra_indices` /
//! `extra_topk_length`, as `metadata::v4` computes them, plus the rows our codec decodes
//! at the first request's indices, for the script's own decoder to agree with).
//!
//! ```text
//! cargo run --release --example v4_dump -- --out .gpu/v4
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use dsa_kv::config::V4Spec;
use dsa_kv::core::{
    ManagerOptions, ReuseScope, SeqOptions, TierSlots, V4CacheManager, V4Options, V4Slots,
};
use dsa_kv::ids::{LayerId, RequestId, SlotId, TokenId};
use dsa_kv::layout::{Model1PageLayout, Role, V4Buffer, V4Plan};
use dsa_kv::metadata::v4::{self as meta, PageTable};
use dsa_kv::ops::model1::{dequantize_model1_row, quantize_model1_row, MODEL1_DATA, MODEL1_SCALES};
use dsa_kv::rng::SplitMix64;
use half::bf16;
use serde_json::json;

/// MODEL1 pools for the FlashMLA oracle.
#[derive(Parser)]
#[command(name = "v4_dump")]
struct Args {
    /// Output folder
    #[arg(long)]
    out: PathBuf,
    /// Seed of the rows and token ids
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
            dsa_kv::layout::V4PageFormat::Model1 { page, .. } => page,
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

/// `id`'s block table and its raw window's page table (first position, slots).
fn tables(m: &V4CacheManager, id: RequestId) -> Result<(Vec<SlotId>, u64, Vec<SlotId>), String> {
    let blocks = m.block_slots(id).map_err(|e| e.to_string())?;
    let (start, slots) = m.window_table(id, 0).map_err(|e| e.to_string())?;
    Ok((blocks, start, slots))
}

fn run(a: Args) -> Result<(), String> {
    let spec = V4Spec {
        name: "V4 oracle (ratio 4, ratio 128, 1 MTP layer)".into(),
        compress_ratios: vec![4, 128],
        ..V4Spec::flash()
    };
    let plan = V4Plan::new(&spec).map_err(|e| e.to_string())?;
    let (block_slots, window_slots) = (16u32, [24u32, 400, 200]);
    let mut m = V4CacheManager::new(
        plan.clone(),
        V4Slots {
            blocks: TierSlots {
                gpu: vec![block_slots],
                host: vec![],
            },
            windows: window_slots.to_vec(),
        },
        V4Options {
            blocks: ManagerOptions {
                enable_partial_reuse: false,
                ..ManagerOptions::default()
            },
            tail_interval: 0,
        },
    )
    .map_err(|e| e.to_string())?;
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
        let created = m
            .create(id, ReuseScope::SHARED, tokens, SeqOptions::default())
            .map_err(|e| e.to_string())?;
        eprintln!(
            "request {r}: {} tokens, {} reused",
            tokens.len(),
            created.reused_tokens
        );
        if !m.resume(id).map_err(|e| e.to_string())? {
            return Err("no room to resume".into());
        }
        let mut c = created.reused_tokens as usize;
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
        "model": spec.name,
        "window": pool_json(&window_pool),
        "c4": pool_json(&c4_pool),
        "c128": pool_json(&c128_pool),
        "queries": queries,
        "expect_window_rows": expect_window,
        "expect_c4_rows": expect_c4,
        "window_stats": format!("{:?}", m.window_stats()),
    });
    write("meta.json", report.to_string().as_bytes())?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
