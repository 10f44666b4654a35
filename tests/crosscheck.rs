//! Cross-checks of the reference model against the DSA kernels' published semantics,
//! recomputed here in f64 with this file's own decoding of E4M3, of the scale words and
//! of the `fp8_ds_mla` / BF16 rows (no crate dequantizer, no model code).
//!
//! A small workload runs through the runtime (host backend, one device, `ModelForward`
//! with prefix reuse and prefills chunked at 48 tokens); a sample of (step, token,
//! layer) points is traced (`model::trace`), and after each step's forward this file's
//! own `Forward` wrapper copies the traced layers' raw cache views out of the pools
//! through the public `Batch` (the indexer K cache from its base, the MLA rows page by
//! page) with the requests' rows of the indexer page table and the block table. Each
//! point is then checked against:
//!
//! * **Index logits** (DeepGEMM `fp8_paged_mqa_logits`): key `j` read through the
//!   indexer page table (page `ipt[j / 64]`, value bytes at `128 · (j % 64)`, scale
//!   word at `64 · 128 + 4 · (j % 64)`), `Σ_h w_h · relu(q_h · k_j) · scale_j` in f64
//!   from the traced FP8 queries and weights. Tolerance: `|trace − f64| ≤ 1e-5 · M_j`,
//!   `M_j = scale_j · Σ_h |w_h| Σ_i |q_hi k_ji|` (the sum of the magnitudes: a relative
//!   tolerance that stays meaningful under cancellation; an f32 sum of 128 products errs
//!   by at most ~128 · 2⁻²⁴ ≈ 7.6e-6 of it, typically far less).
//! * **Top-k**: exactly the top-k of the traced f32 logits (ties to the earlier
//!   position), and the top-k of the f64 logits except between logits within the
//!   tolerance: `min over selected (f_s + τ_s) ≥ max over the rest (f_u − τ_u)`.
//! * **Global indices** (`convert_req_index_to_global`): `block_table[p / 64] · 64 +
//!   p % 64` for every selected position.
//! * **Sparse attention** (FlashMLA sparse decode, absorbed form): the rows read at the
//!   traced global indices (what the kernel is handed), decoded here, scores
//!   `(q_lat · lat + q_pe · rope) · softmax_scale`, softmax and `Σ p_j lat_j` in f64.
//!   Tolerance: `|o_trace − o_f64| ≤ 1e-5 · max |lat|` over the gathered rows, per
//!   element of every head.
//!
//! Mutations prove the checker can fail: a corrupted byte of the most-attended row, a
//! shifted global index, a perturbed logit and a swapped selection are each reported.
//! A dump (`model::dump`) is written, read back with this file's own `.npy` parser,
//! compared with a trace of the contiguous reference, and its tokens pass the same
//! checker.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use dsa_kv::actors::{KvCacheBuilder, RuntimeStats};
use dsa_kv::config::{EngineConfig, KvDtype};
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::core::ReuseScope;
use dsa_kv::device::forward::{
    Batch, Forward, ForwardError, ForwardFactory, ForwardSetup, Sampling,
};
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::ops::quant::ScaleFormat;
use dsa_kv_model::dump::{Dump, DumpSpec};
use dsa_kv_model::paged::{ForwardOptions, ModelForward};
use dsa_kv_model::trace::{TracePoint, Tracer};
use dsa_kv_model::unpaged::{generate, Contiguous};
use dsa_kv_model::{CacheFormat, Model, ModelConfig};

const REQUESTS: u64 = 5;
const T: usize = 64;
const INDEX_VALUE: usize = 128;
const LATENT: usize = 512;
const ROPE: usize = 64;
/// Relative tolerance of the index logits (of `M_j`, see the module docs).
const LOGIT_TOL: f64 = 1e-5;
/// Tolerance of the attention output, relative to the largest latent value gathered.
const ATTN_TOL: f64 = 1e-5;

// ---------------------------------------------------------------------------------
// This file's own decoding.

/// FP8 E4M3 (bias 7, no infinities, `S.1111.111` is NaN) in f64.
fn e4m3(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 3) & 0xF), f64::from(b & 7));
    if e == 15 && m == 7.0 {
        return f64::NAN;
    }
    if e == 0 {
        sign * m / 8.0 * 2f64.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f64.powi(e - 7)
    }
}

/// BF16 (the high half of an f32) from two little-endian bytes.
fn bf16(b: &[u8]) -> f64 {
    f64::from(f32::from_bits(
        u32::from(u16::from_le_bytes([b[0], b[1]])) << 16,
    ))
}

/// A little-endian f32 scale word.
fn f32_word(b: &[u8]) -> f64 {
    f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// A decoded MLA row: latent (512) and RoPE part (64).
type Row = (Vec<f64>, Vec<f64>);

/// An MLA row as (latent 512, rope 64): `fp8_ds_mla` is 512 E4M3 bytes in four
/// 128-wide tiles, four f32 tile scales at 512, 64 BF16 at 528; BF16 is 576 BF16.
fn decode_row(kv_dtype: KvDtype, r: &[u8]) -> Row {
    match kv_dtype {
        KvDtype::Fp8DsMla => {
            assert_eq!(r.len(), 656);
            let lat = (0..LATENT)
                .map(|i| e4m3(r[i]) * f32_word(&r[512 + 4 * (i / 128)..]))
                .collect();
            let pe = (0..ROPE).map(|i| bf16(&r[528 + 2 * i..])).collect();
            (lat, pe)
        }
        _ => {
            assert_eq!(r.len(), 1152);
            let lat = (0..LATENT).map(|i| bf16(&r[2 * i..])).collect();
            let pe = (0..ROPE).map(|i| bf16(&r[2 * (LATENT + i)..])).collect();
            (lat, pe)
        }
    }
}

#[test]
fn own_decoders_match_the_formats() {
    assert_eq!(e4m3(0x38), 1.0);
    assert_eq!(e4m3(0xB8), -1.0);
    assert_eq!(e4m3(0x7E), 448.0);
    assert_eq!(e4m3(0x01), 2f64.powi(-9));
    assert_eq!(e4m3(0x08), 2f64.powi(-6));
    assert_eq!(e4m3(0x3C), 1.5);
    assert!(e4m3(0x7F).is_nan() && e4m3(0xFF).is_nan());
    assert_eq!(bf16(&[0x80, 0x3F]), 1.0);
    assert_eq!(bf16(&[0xC0, 0xC0]), -6.0);
    assert_eq!(f32_word(&0.25f32.to_le_bytes()), 0.25);
}

// ---------------------------------------------------------------------------------
// What one traced point is checked from.

/// One (token, layer): the model's traced values and the raw cache it read.
#[derive(Clone)]
struct Point {
    label: String,
    kv_dtype: KvDtype,
    topk: usize,
    pos: u32,
    /// Per index head: FP8 query bytes and scale word.
    q_fp8: Vec<Vec<u8>>,
    q_scale: Vec<[u8; 4]>,
    weights: Vec<f32>,
    /// The traced index logits of positions `0..=pos`.
    logits: Vec<f32>,
    /// The layer's indexer K cache from its base (pages of `T × (128 + 4)` bytes).
    index_cache: Arc<Vec<u8>>,
    /// The request's row of the indexer page table.
    page_row: Vec<i32>,
    selected: Vec<u32>,
    global: Vec<i64>,
    /// The request's row of the block table.
    block_row: Vec<i32>,
    /// The layer's MLA rows, page after page (global index `g` is row `g`).
    mla_cache: Arc<Vec<u8>>,
    row_bytes: usize,
    softmax_scale: f32,
    /// Per MLA head: `q_lat`, `q_pe`, `o_lat`.
    heads: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
}

/// What the checker found.
#[derive(Debug, Default)]
struct Report {
    problems: Vec<String>,
    /// Largest logit error, in units of `M_j`.
    logit_err: f64,
    /// Largest attention error, in units of the largest latent value.
    attn_err: f64,
    /// The indexer selected (context above top-k).
    sparse: bool,
}

const PAGE_BYTES: usize = T * (INDEX_VALUE + 4);

/// Key `j` through the indexer page table: value bytes and scale.
fn key(p: &Point, j: u32) -> Option<(&[u8], f64)> {
    let page = usize::try_from(*p.page_row.get(j as usize / T)?).ok()?;
    let o = j as usize % T;
    let base = page * PAGE_BYTES;
    let values = p
        .index_cache
        .get(base + o * INDEX_VALUE..)?
        .get(..INDEX_VALUE)?;
    let scale = p
        .index_cache
        .get(base + T * INDEX_VALUE + 4 * o..)?
        .get(..4)?;
    Some((values, f32_word(scale)))
}

/// The f64 logit of `j` and its magnitude `M_j`.
fn logit64(p: &Point, j: u32) -> Option<(f64, f64)> {
    let (k, ks) = key(p, j)?;
    let (mut s, mut m) = (0.0, 0.0);
    for ((q, qs), &w) in p.q_fp8.iter().zip(&p.q_scale).zip(&p.weights) {
        let qs = f32_word(qs);
        let (mut dot, mut mag) = (0.0, 0.0);
        for (&a, &b) in q.iter().zip(k) {
            let x = e4m3(a) * qs * e4m3(b);
            dot += x;
            mag += x.abs();
        }
        s += f64::from(w) * dot.max(0.0);
        m += f64::from(w).abs() * mag;
    }
    Some((s * ks, m * ks.abs()))
}

/// The rows at the traced global indices, decoded, or the first index out of the view.
fn gathered(p: &Point) -> Result<Vec<Row>, i64> {
    p.global
        .iter()
        .map(|&g| {
            let at = usize::try_from(g).map_err(|_| g)? * p.row_bytes;
            let r = p.mla_cache.get(at..at + p.row_bytes).ok_or(g)?;
            Ok(decode_row(p.kv_dtype, r))
        })
        .collect()
}

/// Head `h`'s softmax weights over `rows` and its output, in f64.
fn attend64(p: &Point, h: usize, rows: &[Row]) -> (Vec<f64>, Vec<f64>) {
    let (q_lat, q_pe, _) = &p.heads[h];
    let scale = f64::from(p.softmax_scale);
    let scores: Vec<f64> = rows
        .iter()
        .map(|(lat, pe)| {
            let a: f64 = q_lat.iter().zip(lat).map(|(&q, &v)| f64::from(q) * v).sum();
            let b: f64 = q_pe.iter().zip(pe).map(|(&q, &v)| f64::from(q) * v).sum();
            (a + b) * scale
        })
        .collect();
    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
    let sum: f64 = e.iter().sum();
    let w: Vec<f64> = e.iter().map(|x| x / sum).collect();
    let mut o = vec![0.0; LATENT];
    for ((lat, _), &pj) in rows.iter().zip(&w) {
        for (oi, &v) in o.iter_mut().zip(lat) {
            *oi += pj * v;
        }
    }
    (w, o)
}

/// Recomputes `p` in f64 and reports every disagreement.
fn check(p: &Point, cfg: &ModelConfig) -> Report {
    let mut r = Report::default();
    macro_rules! bad {
        ($($t:tt)*) => {
            r.problems.push(format!("{}: {}", p.label, format!($($t)*)))
        };
    }
    let n = p.pos as usize + 1;
    let want_scale = 1.0 / ((cfg.nope_dim + ROPE) as f64).sqrt();
    if (f64::from(p.softmax_scale) - want_scale).abs() > 1e-7 * want_scale {
        bad!("softmax scale {} ≠ 1/√96", p.softmax_scale);
    }

    // Index logits.
    if p.logits.len() != n || p.q_fp8.len() != cfg.index_heads || p.weights.len() != p.q_fp8.len() {
        bad!(
            "{} logits, {} query heads, {} weights",
            p.logits.len(),
            p.q_fp8.len(),
            p.weights.len()
        );
        return r;
    }
    let mut f64s = Vec::with_capacity(n);
    let mut logit_err = 0f64;
    for j in 0..n as u32 {
        let Some((f, m)) = logit64(p, j) else {
            bad!("key {j} is not in the indexer view");
            return r;
        };
        let tau = LOGIT_TOL * m;
        let d = (f64::from(p.logits[j as usize]) - f).abs();
        logit_err = logit_err.max(if m > 0.0 { d / m } else { d });
        if d > tau {
            bad!(
                "index logit of position {j}: trace {}, f64 {f} (tolerance {tau:e})",
                p.logits[j as usize]
            );
        }
        f64s.push((f, tau));
    }
    r.logit_err = logit_err;

    // Selection.
    let k = p.topk.min(n);
    r.sparse = n > p.topk;
    if p.selected.len() != k
        || p.selected.windows(2).any(|w| w[0] >= w[1])
        || p.selected.iter().any(|&s| s as usize >= n)
    {
        bad!("selection {:?} is not {k} ascending positions", p.selected);
        return r;
    }
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (p.logits[a as usize], p.logits[b as usize]);
        y.total_cmp(&x).then(a.cmp(&b))
    });
    let mut top = order[..k].to_vec();
    top.sort_unstable();
    if top != p.selected {
        bad!("the selection is not the top-k of the traced logits");
    }
    let mut chosen = vec![false; n];
    for &s in &p.selected {
        chosen[s as usize] = true;
    }
    let lowest_in = (0..n)
        .filter(|&j| chosen[j])
        .map(|j| f64s[j].0 + f64s[j].1)
        .fold(f64::INFINITY, f64::min);
    let highest_out = (0..n)
        .filter(|&j| !chosen[j])
        .map(|j| f64s[j].0 - f64s[j].1)
        .fold(f64::NEG_INFINITY, f64::max);
    if lowest_in < highest_out {
        bad!(
            "the selection is not the top-k of the f64 logits: a selected logit {lowest_in} \
             is below an unselected {highest_out} beyond the tolerance"
        );
    }

    // Global indices through the block table.
    for (&s, &g) in p.selected.iter().zip(&p.global) {
        let want = p
            .block_row
            .get(s as usize / T)
            .map(|&b| i64::from(b) * T as i64 + i64::from(s) % T as i64);
        if want != Some(g) {
            bad!("global index of position {s}: trace {g}, block table {want:?}");
        }
    }
    if p.global.len() != p.selected.len() {
        bad!("{} global indices", p.global.len());
    }

    // Sparse attention over the rows at the traced global indices.
    let rows = match gathered(p) {
        Ok(rows) => rows,
        Err(g) => {
            bad!("global index {g} is outside the MLA view");
            return r;
        }
    };
    let lat_max = rows
        .iter()
        .flat_map(|(l, _)| l.iter())
        .fold(0f64, |m, v| m.max(v.abs()));
    if p.heads.len() != cfg.heads {
        bad!("{} heads", p.heads.len());
    }
    for h in 0..p.heads.len() {
        let (_, o) = attend64(p, h, &rows);
        let got = &p.heads[h].2;
        let err = got
            .iter()
            .zip(&o)
            .map(|(&a, &b)| (f64::from(a) - b).abs())
            .fold(0f64, f64::max);
        r.attn_err = r.attn_err.max(err / lat_max);
        if got.len() != LATENT || err > ATTN_TOL * lat_max {
            bad!(
                "attention output of head {h}: off by {err:e} (tolerance {:e})",
                ATTN_TOL * lat_max
            );
        }
    }
    r
}

// ---------------------------------------------------------------------------------
// The workload through the runtime.

fn format(kv_dtype: KvDtype) -> CacheFormat {
    CacheFormat {
        kv_dtype,
        scale_format: ScaleFormat::Ue8m0,
        indexer: vec![true, true],
    }
}

fn model(kv_dtype: KvDtype) -> Arc<Model> {
    Arc::new(Model::new(ModelConfig::tiny(11), format(kv_dtype)).unwrap())
}

/// A 100-token prompt shared by all, then the request's own 20–60 tokens.
fn prompt(i: u64) -> Vec<u32> {
    let own = 20 + (i as u32 * 23) % 41;
    (0..100)
        .map(|t| 1000 + t)
        .chain((0..own).map(|k| (i as u32 * 7919 + k * 31) % 5000))
        .collect()
}

const MAX_NEW: u32 = 8;

fn config(kv_dtype: KvDtype) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(2);
    c.model.kv_dtype = Some(kv_dtype);
    c.kv_cache.max_tokens = Some(2048);
    c.scheduler.max_num_sequences = 8;
    c.scheduler.max_num_tokens = 128;
    // Chunks that do not line up with the 64-token blocks.
    c.scheduler.max_prefill_chunk = 48;
    c.scheduler.max_seq_len = 512;
    c
}

/// Runs the workload (one host device) with `forward`, which samples the greedy tokens
/// (the runtime commits each step itself); returns the runtime's statistics.
async fn drive(kv_dtype: KvDtype, forward: ForwardFactory) -> RuntimeStats {
    let kv = KvCacheBuilder::new()
        .config(config(kv_dtype))
        .host_devices(1)
        .forward(forward)
        .start()
        .await
        .unwrap();
    // The first request alone first: the others find its prefix cached.
    for i in 0..REQUESTS {
        kv.submit(SubmitRequest {
            id: RequestId(i),
            scope: ReuseScope::SHARED,
            prompt: prompt(i).into_iter().map(TokenId).collect(),
            max_new_tokens: MAX_NEW,
            priority: 35,
        })
        .await
        .unwrap();
        if i == 0 {
            for _ in 0..3 {
                let rep = kv.step(HashMap::new()).await.unwrap();
                assert!(rep.committed.is_some(), "the forward samples");
            }
        }
    }
    let mut done = 0;
    for _ in 0..1000 {
        let rep = kv.step(HashMap::new()).await.unwrap();
        done += rep.committed.expect("the forward samples").finished.len();
        if done as u64 == REQUESTS {
            break;
        }
    }
    assert_eq!(done as u64, REQUESTS, "every request finishes");
    let stats = kv.stats().await.unwrap();
    kv.shutdown().await;
    stats
}

/// A layer's copied views: the indexer K cache, the MLA rows, the row size.
type LayerViews = (Arc<Vec<u8>>, Arc<Vec<u8>>, usize);

/// The model's forward, then a copy of the raw cache views of every traced point.
struct Capture {
    inner: Box<dyn Forward>,
    tracer: Tracer,
    topk: usize,
    kv_dtype: KvDtype,
    points: Arc<Mutex<Vec<Point>>>,
}

impl Forward for Capture {
    fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        let sampled = self.inner.forward(batch)?;
        let traces = self.tracer.take();
        if traces.is_empty() {
            return Ok(sampled);
        }
        let (m, cache, step) = (batch.metadata, batch.cache.clone(), batch.step);
        let host = batch.host().expect("the host backend");
        let cols = m.max_blocks_per_seq;
        let page_table = host.i32s(&m.indexer_page_table)?;
        let block_table = host.i32s(&m.block_table)?;
        // Per layer: the indexer view from its base, and the MLA rows page by page.
        let mut views: HashMap<usize, LayerViews> = HashMap::new();
        let mut out = Vec::new();
        for st in &traces {
            let row = st.site.row;
            for tr in &st.traces {
                let (index_cache, mla_cache, row_bytes) = match views.get(&tr.layer) {
                    Some(v) => v.clone(),
                    None => {
                        let l = &cache.layers[tr.layer];
                        let (ix, mla) = (l.indexer.unwrap(), l.mla.unwrap());
                        assert_eq!(ix.page_bytes, PAGE_BYTES as u64);
                        let index = host.bytes(ix.base, ix.pages * ix.page_bytes)?.to_vec();
                        let (rb, rows) = (mla.rows.row_bytes as u64, mla.rows.tokens_per_page);
                        let mut mla_bytes = Vec::new();
                        for p in 0..u64::from(mla.rows.pages) {
                            let addr = mla.rows.base + p * mla.rows.page_stride;
                            mla_bytes.extend_from_slice(host.bytes(addr, u64::from(rows) * rb)?);
                        }
                        let v = (Arc::new(index), Arc::new(mla_bytes), rb as usize);
                        views.insert(tr.layer, v.clone());
                        v
                    }
                };
                let ix = tr.index.as_ref().expect("every layer has an indexer");
                out.push(Point {
                    label: format!(
                        "step {step} request {} position {} layer {}",
                        st.site.request, tr.pos, tr.layer
                    ),
                    kv_dtype: self.kv_dtype,
                    topk: self.topk,
                    pos: tr.pos,
                    q_fp8: ix.q_fp8.iter().map(|q| q.to_vec()).collect(),
                    q_scale: ix.q_scale.clone(),
                    weights: ix.weights.clone(),
                    logits: ix.logits.clone(),
                    index_cache,
                    page_row: page_table[row * cols..(row + 1) * cols].to_vec(),
                    selected: tr.selected.clone(),
                    global: tr.global.clone(),
                    block_row: block_table[row * cols..(row + 1) * cols].to_vec(),
                    mla_cache,
                    row_bytes,
                    softmax_scale: tr.softmax_scale,
                    heads: tr
                        .heads
                        .iter()
                        .map(|h| (h.q_lat.clone(), h.q_pe.clone(), h.o_lat.clone()))
                        .collect(),
                });
            }
        }
        self.points.lock().unwrap().extend(out);
        Ok(sampled)
    }
}

/// The sample, per request and step: a decode token at both layers; a prefill chunk's
/// last token at both layers, its first token at layer `(step + row) % 2` and its
/// middle token at the other layer.
fn sample(s: &dsa_kv_model::trace::TraceSite) -> Vec<TracePoint> {
    let layer = (s.step as usize + s.row) % 2;
    let last = s.first + s.tokens as u32 - 1;
    let mut v = vec![
        TracePoint {
            layer: 0,
            pos: last,
        },
        TracePoint {
            layer: 1,
            pos: last,
        },
    ];
    if s.tokens > 2 {
        v.push(TracePoint {
            layer,
            pos: s.first,
        });
        v.push(TracePoint {
            layer: 1 - layer,
            pos: s.first + s.tokens as u32 / 2,
        });
    }
    v
}

struct Captured {
    points: Vec<Point>,
    stats: RuntimeStats,
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn capture(kv_dtype: KvDtype) -> Captured {
    let model = model(kv_dtype);
    let tracer = Tracer::new(sample);
    let inner = ModelForward::factory(
        model.clone(),
        ForwardOptions::default().tracer(tracer.clone()),
    );
    let points = Arc::new(Mutex::new(Vec::new()));
    let sink = points.clone();
    let topk = model.config().topk;
    let forward: ForwardFactory = Arc::new(move |setup: &ForwardSetup<'_>| {
        Ok(Box::new(Capture {
            inner: inner(setup)?,
            tracer: tracer.clone(),
            topk,
            kv_dtype,
            points: sink.clone(),
        }) as Box<dyn Forward>)
    });
    let stats = runtime().block_on(drive(kv_dtype, forward));
    let points = std::mem::take(&mut *points.lock().unwrap());
    Captured { points, stats }
}

fn captured(kv_dtype: KvDtype) -> &'static Captured {
    static FP8: OnceLock<Captured> = OnceLock::new();
    static BF16: OnceLock<Captured> = OnceLock::new();
    match kv_dtype {
        KvDtype::Fp8DsMla => FP8.get_or_init(|| capture(kv_dtype)),
        _ => BF16.get_or_init(|| capture(kv_dtype)),
    }
}

fn cfg() -> ModelConfig {
    ModelConfig::tiny(11)
}

#[test]
fn traces_agree_with_an_independent_f64_recomputation() {
    for kv_dtype in [KvDtype::Fp8DsMla, KvDtype::Bf16] {
        let c = captured(kv_dtype);
        assert!(c.stats.prefix_hit_rate > 0.0, "prefixes are reused");
        let reports: Vec<Report> = c.points.iter().map(|p| check(p, &cfg())).collect();
        let problems: Vec<&String> = reports.iter().flat_map(|r| &r.problems).collect();
        assert!(problems.is_empty(), "{kv_dtype:?}: {problems:#?}");
        let sparse = reports.iter().filter(|r| r.sparse).count();
        let layers: Vec<usize> = (0..2)
            .map(|l| {
                c.points
                    .iter()
                    .filter(|p| p.label.ends_with(&format!("layer {l}")))
                    .count()
            })
            .collect();
        let logit = reports.iter().map(|r| r.logit_err).fold(0f64, f64::max);
        let attn = reports.iter().map(|r| r.attn_err).fold(0f64, f64::max);
        eprintln!(
            "{kv_dtype:?}: {} points ({sparse} with a top-k selection; layer 0: {}, layer 1: \
             {}), {} steps; largest errors: logits {logit:.2e} of M_j (tolerance \
             {LOGIT_TOL:e}), attention {attn:.2e} of max |lat| (tolerance {ATTN_TOL:e})",
            c.points.len(),
            layers[0],
            layers[1],
            c.stats.scheduler.steps
        );
        assert!(c.points.len() >= 40, "{} points", c.points.len());
        assert!(sparse >= 20 && layers.iter().all(|&n| n >= 15));
    }
}

/// A sparse point of the FP8 run, and its head 0's most-attended selected row.
fn victim() -> (Point, usize) {
    let c = captured(KvDtype::Fp8DsMla);
    let p = c
        .points
        .iter()
        .rev()
        .find(|p| p.pos as usize >= p.topk)
        .expect("a sparse point")
        .clone();
    let (w, _) = attend64(&p, 0, &gathered(&p).unwrap());
    let i = (0..w.len()).max_by(|&a, &b| w[a].total_cmp(&w[b])).unwrap();
    assert!(check(&p, &cfg()).problems.is_empty());
    (p, i)
}

#[test]
fn a_corrupted_row_byte_is_caught() {
    let (mut p, i) = victim();
    let g = p.global[i] as usize;
    let row = &p.mla_cache[g * p.row_bytes..][..p.row_bytes];
    // The row's largest latent value: flip its E4M3 exponent's top bit.
    let big = (0..LATENT).max_by(|&a, &b| e4m3(row[a]).abs().total_cmp(&e4m3(row[b]).abs()));
    let at = g * p.row_bytes + big.unwrap();
    Arc::make_mut(&mut p.mla_cache)[at] ^= 0x40;
    let r = check(&p, &cfg());
    assert!(
        r.problems
            .iter()
            .any(|s| s.contains("attention output of head 0")),
        "{:?}",
        r.problems
    );
}

#[test]
fn a_shifted_global_index_is_caught() {
    let (mut p, i) = victim();
    p.global[i] += 1;
    let r = check(&p, &cfg());
    let pos = p.selected[i];
    assert!(
        r.problems
            .iter()
            .any(|s| s.contains(&format!("global index of position {pos}:"))),
        "{:?}",
        r.problems
    );
    assert!(
        r.problems.iter().any(|s| s.contains("attention output")),
        "the row read at the shifted index changes the attention: {:?}",
        r.problems
    );
}

#[test]
fn a_perturbed_logit_and_a_swapped_selection_are_caught() {
    let (p, _) = victim();
    let mut q = p.clone();
    // Ten times the tolerance.
    let j = q.pos as usize / 2;
    let (_, m) = logit64(&q, j as u32).unwrap();
    q.logits[j] += (10.0 * LOGIT_TOL * m) as f32;
    let r = check(&q, &cfg());
    assert!(
        r.problems
            .iter()
            .any(|s| s.contains(&format!("index logit of position {j}:"))),
        "{:?}",
        r.problems
    );
    // Swap the highest-scoring selected position for the lowest-scoring unselected one.
    let mut q = p.clone();
    let best = *q
        .selected
        .iter()
        .max_by(|&&a, &&b| q.logits[a as usize].total_cmp(&q.logits[b as usize]))
        .unwrap();
    let worst = (0..=q.pos)
        .filter(|j| !q.selected.contains(j))
        .min_by(|&a, &b| q.logits[a as usize].total_cmp(&q.logits[b as usize]))
        .unwrap();
    q.selected.retain(|&s| s != best);
    q.selected.push(worst);
    q.selected.sort_unstable();
    let r = check(&q, &cfg());
    assert!(
        r.problems
            .iter()
            .any(|s| s.contains("top-k of the f64 logits")),
        "{:?}",
        r.problems
    );
}

// ---------------------------------------------------------------------------------
// The dump.

/// An `.npy` file read with this file's own parser: descr, shape, data bytes.
fn read_npy(path: &Path) -> (String, Vec<usize>, Vec<u8>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"\x93NUMPY\x01\x00", "{path:?}: NPY v1.0");
    let len = usize::from(u16::from_le_bytes([b[8], b[9]]));
    assert_eq!((10 + len) % 64, 0, "the header is padded to 64 bytes");
    let h = std::str::from_utf8(&b[10..10 + len]).unwrap();
    assert!(h.ends_with('\n') && h.contains("'fortran_order': False"));
    let field = |k: &str| {
        let at = h.find(&format!("'{k}': ")).unwrap() + k.len() + 4;
        h[at..].to_string()
    };
    let descr = field("descr")[1..].split('\'').next().unwrap().to_string();
    let shape_text = field("shape");
    let inner = &shape_text[1..shape_text.find(')').unwrap()];
    let shape: Vec<usize> = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    (descr, shape, b[10 + len..].to_vec())
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The dump of one layer of one mixed step (decode tokens and a prefill chunk): every
/// file reads back with the manifest's shape and dtype, a decode token's values equal
/// the contiguous reference's trace bit for bit, and every dumped token passes the f64
/// checker from the dumped caches and tables alone.
#[test]
fn a_dump_reads_back_and_recomputes() {
    let kv_dtype = KvDtype::Fp8DsMla;
    let (step, layer) = (6, 1);
    let dir = std::env::temp_dir().join(format!("dsa-kv-dump-{}", std::process::id()));
    let model = model(kv_dtype);
    let dump = Dump::new(DumpSpec {
        step,
        layer,
        device: 0,
        dir: dir.clone(),
    });
    runtime().block_on(drive(
        kv_dtype,
        dump.factory(model.clone(), ForwardOptions::default()),
    ));
    let manifest = dump.result().unwrap();
    let on_disk: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(on_disk, manifest);
    assert_eq!(
        (manifest["step"].as_u64(), manifest["layer"].as_u64()),
        (Some(6), Some(1))
    );

    let mut arrays = HashMap::new();
    for (name, f) in manifest["files"].as_object().unwrap() {
        let (descr, shape, data) = read_npy(&dir.join(f["file"].as_str().unwrap()));
        let want: Vec<usize> = f["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(shape, want, "{name}");
        let size = match f["dtype"].as_str().unwrap() {
            "uint8" => 1,
            "bfloat16 bits as uint16" => 2,
            _ => 4,
        };
        assert_eq!(data.len(), shape.iter().product::<usize>() * size, "{name}");
        let d = match size {
            1 => "|u1",
            2 => "<u2",
            _ if f["dtype"] == "int32" => "<i4",
            _ => "<f4",
        };
        assert_eq!(descr, d, "{name}");
        arrays.insert(name.clone(), (shape, data));
    }
    let names = [
        "index_k_cache",
        "index_page_table",
        "block_table",
        "kv_lens",
        "positions",
        "token_row",
        "context_lens",
        "index_q_fp8",
        "index_q_scale",
        "index_weights",
        "index_logits",
        "topk_positions",
        "topk_global",
        "mla_cache",
        "q_absorbed",
        "attn_lat",
        "attn_out",
    ];
    assert_eq!(arrays.len(), names.len());
    let a = |n: &str| &arrays[n];
    let n = a("positions").0[0];
    let (cols, rows) = (a("block_table").0[1], a("block_table").0[0]);
    let (ih, h, topk) = (2, 2, 64);
    assert_eq!(a("index_k_cache").0[1..], [64, 1, 132]);
    assert_eq!(a("mla_cache").0[1..], [64, 656]);
    assert_eq!(a("q_absorbed").0, [n, h, 576]);
    assert_eq!(a("attn_lat").0, [n, h, 512]);
    assert_eq!(a("index_q_fp8").0, [n, ih, 128]);
    assert_eq!(a("topk_global").0, [n, topk]);
    let positions = i32s(&a("positions").1);
    let token_row = i32s(&a("token_row").1);
    let ctx = a("index_logits").0[1];
    let logits = f32s(&a("index_logits").1);
    let q_abs = f32s(&a("q_absorbed").1);
    let o_lat = f32s(&a("attn_lat").1);
    let weights = f32s(&a("index_weights").1);
    let q_scale = f32s(&a("index_q_scale").1);
    let topk_pos = i32s(&a("topk_positions").1);
    let topk_global = i32s(&a("topk_global").1);
    let page_table = i32s(&a("index_page_table").1);
    let block_table = i32s(&a("block_table").1);
    let ids: Vec<u64> = manifest["request_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), rows);
    let mut per_row = vec![0; rows];
    for &r in &token_row {
        per_row[r as usize] += 1;
    }
    assert!(
        per_row.contains(&1) && per_row.iter().any(|&c| c > 1),
        "a mixed step (tokens per row {per_row:?})"
    );

    // One sparse token against the contiguous reference's trace, bit for bit.
    let t = (0..n).rev().find(|&t| positions[t] >= 64).unwrap();
    let (pos, id) = (positions[t] as u32, ids[token_row[t] as usize]);
    let p = prompt(id);
    let g = generate(&model, &format(kv_dtype), &p, MAX_NEW).unwrap();
    let seq: Vec<u32> = p.iter().chain(&g.tokens).copied().collect();
    let mut kv = Contiguous::new(&format(kv_dtype));
    let point = TracePoint { layer, pos };
    let tr = model
        .run_traced(&mut kv, 0, &seq[..=pos as usize], &[point])
        .unwrap()
        .traces;
    let ix = tr[0].index.as_ref().unwrap();
    assert_eq!(logits[t * ctx..][..=pos as usize], ix.logits[..]);
    assert!(logits[t * ctx + pos as usize + 1..(t + 1) * ctx]
        .iter()
        .all(|&v| v == f32::NEG_INFINITY));
    assert_eq!(o_lat[(t * h + 1) * 512..][..512], tr[0].heads[1].o_lat[..]);
    assert_eq!(q_abs[t * h * 576..][..512], tr[0].heads[0].q_lat[..]);
    assert_eq!(weights[t * ih..][..ih], ix.weights[..]);
    let sel: Vec<i32> = tr[0].selected.iter().map(|&s| s as i32).collect();
    assert_eq!(topk_pos[t * topk..][..topk], sel[..]);

    // Every dumped token passes the checker from the dumped arrays alone.
    let index_cache = Arc::new(a("index_k_cache").1.clone());
    let mla_cache = Arc::new(a("mla_cache").1.clone());
    let q8 = &a("index_q_fp8").1;
    let mut sparse = 0;
    for t in 0..n {
        let pos = positions[t] as u32;
        let row = token_row[t] as usize;
        let sel: Vec<(u32, i64)> = (0..topk)
            .map(|k| (topk_pos[t * topk + k], topk_global[t * topk + k]))
            .take_while(|&(p, _)| p >= 0)
            .map(|(p, g)| (p as u32, i64::from(g)))
            .collect();
        let pt = Point {
            label: format!("dump token {t} (row {row}, position {pos})"),
            kv_dtype,
            topk,
            pos,
            q_fp8: (0..ih)
                .map(|hh| q8[(t * ih + hh) * 128..][..128].to_vec())
                .collect(),
            q_scale: (0..ih)
                .map(|hh| q_scale[t * ih + hh].to_le_bytes())
                .collect(),
            weights: weights[t * ih..][..ih].to_vec(),
            logits: logits[t * ctx..][..=pos as usize].to_vec(),
            index_cache: index_cache.clone(),
            page_row: page_table[row * cols..][..cols].to_vec(),
            selected: sel.iter().map(|s| s.0).collect(),
            global: sel.iter().map(|s| s.1).collect(),
            block_row: block_table[row * cols..][..cols].to_vec(),
            mla_cache: mla_cache.clone(),
            row_bytes: 656,
            softmax_scale: manifest["softmax_scale"].as_f64().unwrap() as f32,
            heads: (0..h)
                .map(|hh| {
                    let q = &q_abs[(t * h + hh) * 576..][..576];
                    let o = &o_lat[(t * h + hh) * 512..][..512];
                    (q[..512].to_vec(), q[512..].to_vec(), o.to_vec())
                })
                .collect(),
        };
        let r = check(&pt, &cfg());
        assert!(r.problems.is_empty(), "{:#?}", r.problems);
        sparse += usize::from(r.sparse);
    }
    assert!(sparse > 0);
    eprintln!("dump of step {step}, layer {layer}: {n} tokens ({sparse} sparse), {rows} rows");
    std::fs::remove_dir_all(&dir).unwrap();
}
