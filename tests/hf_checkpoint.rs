//! A published implementation as the oracle of our model: the tiny `transformers`
//! checkpoints of `tests/fixtures/hf` (DeepseekV32ForCausalLM with YaRN and a MoE
//! layer; GlmMoeDsaForCausalLM with attention biases, a tied head and a layer that
//! shares the previous layer's top-k; made by `make_fixtures.py` with transformers
//! 5.17.0 / torch 2.11.0, MANIFEST.json) loaded by `Model::from_checkpoint`, and HF's own
//! float32 forward on fixed prompts (`reference.json`, `logits_dense.npy`, `topk.npy`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use dsa_kv::actors::{Drafts, KvCacheBuilder};
use dsa_kv::config::{EngineConfig, IndexerLayers, KvDtype, SpecMode};
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::ops::quant::ScaleFormat;
use dsa_kv_model::checkpoint::Family;
use dsa_kv_model::paged::{ForwardOptions, ModelForward, Outputs};
use dsa_kv_model::trace::TracePoint;
use dsa_kv_model::unpaged::Contiguous;
use dsa_kv_model::{CacheFormat, Model};
use serde::Deserialize;

const VARIANTS: [&str; 2] = ["deepseek_v32", "glm_moe_dsa"];

fn dir(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(variant)
}

#[derive(Deserialize)]
struct Reference {
    index_topk: usize,
    indexer_layers: Vec<usize>,
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct Prompt {
    kind: String,
    tokens: Vec<u32>,
    generated: Vec<u32>,
    generated_margins: Vec<f32>,
    argmax: Vec<u32>,
    margins: Vec<f32>,
}

fn reference(variant: &str) -> Reference {
    let text = std::fs::read_to_string(dir(variant).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A little-endian NPY v1 array: its shape and raw data (`descr` checked).
fn npy(path: &Path, descr: &str) -> (Vec<usize>, Vec<u8>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..6], b"\x93NUMPY", "{}", path.display());
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = std::str::from_utf8(&b[10..10 + hlen]).unwrap();
    assert!(header.contains(&format!("'descr': '{descr}'")), "{header}");
    assert!(header.contains("'fortran_order': False"), "{header}");
    let shape = header.split("'shape': (").nth(1).unwrap();
    let shape: Vec<usize> = shape[..shape.find(')').unwrap()]
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().unwrap())
        .collect();
    (shape, b[10 + hlen..].to_vec())
}

fn format(variant: &str, kv_dtype: KvDtype) -> CacheFormat {
    let indexer = match variant {
        "glm_moe_dsa" => vec![true, false],
        _ => vec![true, true],
    };
    CacheFormat {
        kv_dtype,
        scale_format: ScaleFormat::Ue8m0,
        indexer,
    }
}

fn model(variant: &str) -> Model {
    model_in(variant, KvDtype::Bf16)
}

fn model_in(variant: &str, kv_dtype: KvDtype) -> Model {
    Model::from_checkpoint(&dir(variant), format(variant, kv_dtype)).unwrap()
}

/// The logits of every position of `tokens`, our model unpaged.
fn our_logits(m: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut kv = Contiguous::new(m.format());
    let (_, hidden) = m.run_hidden(&mut kv, 0, tokens).unwrap();
    hidden.iter().map(|h| m.logits(h)).collect()
}

#[test]
fn the_checkpoints_load_under_their_published_names() {
    let v = model("deepseek_v32");
    let c = v.checkpoint().unwrap();
    assert_eq!(c.family, Family::DeepseekV32);
    assert_eq!((c.layers, c.hidden, c.heads, c.q_lora), (2, 64, 2, 32));
    assert_eq!(c.indexer, vec![true, true]);
    let y = c.rope.yarn.as_ref().expect("yarn");
    assert_eq!(
        (y.factor, y.mscale, y.mscale_all_dim, y.original_max),
        (4.0, 1.0, 0.8, 64.0)
    );
    let g = model("glm_moe_dsa");
    let c = g.checkpoint().unwrap();
    assert_eq!(c.family, Family::GlmMoeDsa);
    assert_eq!(c.indexer, vec![true, false]);
    assert!(c.attention_bias && c.tie_embeddings && c.rope.yarn.is_none());
    assert_eq!(c.rope.theta, 1e6);
}

/// HF's logits of the dense prompts (every position of each, prompts in order).
fn hf_dense_logits(variant: &str) -> (usize, Vec<f32>) {
    let (shape, data) = npy(&dir(variant).join("logits_dense.npy"), "<f4");
    let v = data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (shape[1], v)
}

/// Where the indexer selects every position (context ≤ index_topk), the logits agree
/// with HF's float32 forward within the tolerance the cache's BF16 rounding gives
/// ([`tolerance`]), at every position of every dense prompt, and the greedy token is
/// HF's wherever HF's own margin exceeds twice that. The same comparison with
/// `fp8_ds_mla` rows (E4M3: a 16 times coarser unit roundoff than BF16) moves the logits
/// several times more: the difference is the cache's rounding, not the arithmetic.
#[test]
fn dense_logits_match_hf_within_the_caches_rounding() {
    for variant in VARIANTS {
        let r = reference(variant);
        let (vocab, hf) = hf_dense_logits(variant);
        let mut worst = [0f32; 2];
        for (k, dt) in [KvDtype::Bf16, KvDtype::Fp8DsMla].into_iter().enumerate() {
            let m = model_in(variant, dt);
            let layers = m.checkpoint().unwrap().layers;
            let mut row = 0;
            for (pi, p) in r
                .prompts
                .iter()
                .enumerate()
                .filter(|(_, p)| p.kind == "dense")
            {
                for (i, l) in our_logits(&m, &p.tokens).iter().enumerate() {
                    let h = &hf[(row + i) * vocab..(row + i + 1) * vocab];
                    let d = l.iter().zip(h).fold(0f32, |w, (a, b)| w.max((a - b).abs()));
                    worst[k] = worst[k].max(d);
                    if dt == KvDtype::Bf16 {
                        let tol = tolerance(layers, h);
                        assert!(
                            d <= tol,
                            "{variant} prompt {pi} position {i}: |Δlogit| {d} over {tol}"
                        );
                        let ours = argmax(l);
                        if p.margins[i] > 2.0 * tol {
                            assert_eq!(ours, p.argmax[i], "{variant} prompt {pi} position {i}");
                        }
                    }
                }
                row += p.tokens.len();
            }
        }
        eprintln!(
            "{variant}: max |Δlogit| against HF: {:.3e} with BF16 rows, {:.3e} with fp8_ds_mla rows",
            worst[0], worst[1]
        );
        assert!(
            worst[1] >= 4.0 * worst[0],
            "{variant}: the difference does not follow the cache's rounding: {worst:?}"
        );
    }
}

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (k, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = k;
        }
    }
    best as u32
}

/// The prompts' full sequences: prompt then HF's continuation but its last token (the
/// positions whose outputs HF's greedy steps read).
fn full(p: &Prompt) -> Vec<u32> {
    let mut s = p.tokens.clone();
    s.extend(&p.generated[..p.generated.len() - 1]);
    s
}

/// HF's selections (`topk.npy`): per indexer layer, the rows of the sparse prompts'
/// full sequences, prompts in order.
fn hf_selections(variant: &str) -> (Vec<usize>, Vec<i16>) {
    let (shape, data) = npy(&dir(variant).join("topk.npy"), "<i2");
    let v = data
        .chunks_exact(2)
        .map(|c| i16::from_le_bytes([c[0], c[1]]))
        .collect();
    (shape, v)
}

/// Positions `index_topk..seq.len()` at which our indexer's selection (any indexer
/// layer) differs from HF's, for `seq` a prefix of prompt `prompt`'s full sequence.
fn differing_selections(m: &Model, r: &Reference, prompt: usize, seq: &[u32]) -> usize {
    let variant = match m.checkpoint().unwrap().family {
        Family::DeepseekV32 => "deepseek_v32",
        Family::GlmMoeDsa => "glm_moe_dsa",
    };
    let (shape, hf) = hf_selections(variant);
    let (rows, k) = (shape[1], shape[2]);
    let row0: usize = r.prompts[..prompt]
        .iter()
        .filter(|p| p.kind == "sparse")
        .map(|p| full(p).len())
        .sum();
    let points: Vec<TracePoint> = r
        .indexer_layers
        .iter()
        .flat_map(|&layer| (k as u32..seq.len() as u32).map(move |pos| TracePoint { layer, pos }))
        .collect();
    let run = m
        .run_traced(&mut Contiguous::new(m.format()), 0, seq, &points)
        .unwrap();
    let mut differ = std::collections::BTreeSet::new();
    for t in &run.traces {
        let li = r.indexer_layers.iter().position(|&l| l == t.layer).unwrap();
        let theirs: Vec<u32> = hf[(li * rows + row0 + t.pos as usize) * k..][..k]
            .iter()
            .map(|&v| v as u32)
            .collect();
        if t.selected != theirs {
            differ.insert(t.pos);
        }
    }
    differ.len()
}

#[test]
fn sparse_selections_agree_with_hf_except_near_ties() {
    for variant in VARIANTS {
        let m = model(variant);
        let r = reference(variant);
        let (shape, data) = npy(&dir(variant).join("topk.npy"), "<i2");
        let hf: Vec<i16> = data
            .chunks_exact(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]))
            .collect();
        let (layers, rows, k) = (shape[0], shape[1], shape[2]);
        assert_eq!((layers, k), (r.indexer_layers.len(), r.index_topk));
        let (mut row, mut sets, mut same, mut shared, mut near) = (0, 0, 0, 0usize, 0);
        for p in r.prompts.iter().filter(|p| p.kind == "sparse") {
            let seq = full(p);
            let points: Vec<TracePoint> = r
                .indexer_layers
                .iter()
                .flat_map(|&layer| {
                    (k as u32..seq.len() as u32).map(move |pos| TracePoint { layer, pos })
                })
                .collect();
            let mut kv = Contiguous::new(m.format());
            let run = m.run_traced(&mut kv, 0, &seq, &points).unwrap();
            for t in &run.traces {
                let li = r.indexer_layers.iter().position(|&l| l == t.layer).unwrap();
                let theirs: Vec<u32> = hf[(li * rows + row + t.pos as usize) * k..][..k]
                    .iter()
                    .map(|&v| v as u32)
                    .collect();
                let common = t.selected.iter().filter(|p| theirs.contains(p)).count();
                sets += 1;
                shared += common;
                if common == k {
                    same += 1;
                } else {
                    // Our own scores at the boundary: the k-th best and the best left out.
                    let mut s = t.index.as_ref().unwrap().logits.clone();
                    s.sort_by(|a, b| b.total_cmp(a));
                    let gap = (s[k - 1] - s[k]) / s[0].abs().max(f32::MIN_POSITIVE);
                    // FP8 keys and queries (3 mantissa bits): a score moves by up to a
                    // few percent of the scale it is computed at.
                    if gap < 0.05 {
                        near += 1;
                    }
                }
            }
            row += seq.len();
        }
        assert_eq!(row, rows, "{variant}: every position of the fixture read");
        let rate = shared as f64 / (sets * k) as f64;
        eprintln!(
            "{variant}: {sets} selections past the top-{k}: {same} identical to HF's, {:.2} % of \
             the selected positions shared; of the {} that differ, {near} sit at a near-tie of our \
             scores (gap under 5 %)",
            100.0 * rate,
            sets - same
        );
        assert!(rate > 0.9, "{variant}: {rate}");
    }
}

/// The unit roundoff of BF16 (8 significant bits): the relative error of a cache row's
/// element.
const BF16_U: f32 = 1.0 / 256.0;

/// The tolerance of a logit in the dense regime, derived from the cache's rounding: each
/// of the `layers` layers reads its BF16 rows twice (in the scores and in the values),
/// each read off by at most `BF16_U` relative, and the attention's share of a logit is
/// at most the logit's scale; so `2 · layers · BF16_U · max |logit|` per position.
fn tolerance(layers: usize, logits: &[f32]) -> f32 {
    let scale = logits.iter().fold(0f32, |m, v| m.max(v.abs()));
    2.0 * layers as f32 * BF16_U * scale
}

/// Tokens each request generates: HF's 8 for the compared ones; the copies of wave 1
/// (ids 100..200) generate 80, so that together they outgrow the GPU tier.
fn max_new(id: RequestId) -> u32 {
    if (100..200).contains(&id.0) {
        80
    } else {
        8
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_tokens_through_the_paged_runtime_agree_with_hf_where_no_near_tie_decides() {
    for variant in VARIANTS {
        let m = Arc::new(model(variant));
        let r = reference(variant);
        let c = m.checkpoint().unwrap().clone();
        let mut cfg = EngineConfig::default();
        cfg.model.num_layers = Some(c.layers as u32);
        cfg.model.num_mtp_layers = Some(0);
        cfg.model.kv_dtype = Some(KvDtype::Bf16);
        cfg.model.indexer_layers = Some(IndexerLayers::Mask(c.indexer.clone()));
        cfg.spec_decode.mode = SpecMode::None;
        // Small: prefills chunked, requests preempted and blocks offloaded and reused (two
        // sparse prompts share 70 tokens).
        cfg.kv_cache.max_tokens = Some(320);
        cfg.kv_cache.host_cache_size = Some(4 << 20);
        cfg.scheduler.max_num_sequences = 16;
        cfg.scheduler.max_num_tokens = 48;
        cfg.scheduler.max_prefill_chunk = 24;
        cfg.scheduler.max_seq_len = 256;
        let outputs = Arc::new(Mutex::new(Outputs::default()));
        let kv = KvCacheBuilder::new()
            .config(cfg)
            .host_devices(1)
            .forward(ModelForward::factory(
                m.clone(),
                ForwardOptions::default().record(outputs.clone()),
            ))
            .start()
            .await
            .unwrap();
        // Wave 1: every prompt twice at once (more than the GPU tier holds: requests are
        // preempted); wave 2: every prompt again, after wave 1 finished (its full blocks
        // are reused).
        let mut generated: HashMap<RequestId, Vec<u32>> = HashMap::new();
        let mut reused = 0;
        for wave in [vec![0, 100], vec![200]] {
            let mut want = 0;
            for base in wave {
                for (i, p) in r.prompts.iter().enumerate() {
                    let prompt = p.tokens.iter().map(|&t| TokenId(t)).collect();
                    let id = RequestId(base + i as u64);
                    kv.submit(SubmitRequest::new(id, prompt, max_new(id)))
                        .await
                        .unwrap();
                    want += 1;
                }
            }
            let mut finished = 0;
            for _ in 0..10_000 {
                // The forward samples; the runtime commits.
                let rep = kv.step(Drafts::none()).await.unwrap();
                for o in &rep.outcomes {
                    if let Some(t) = o.next_token {
                        generated.entry(o.id).or_default().push(t.0);
                    }
                }
                let done = rep.committed.expect("the forward samples");
                finished += done.finished.len();
                reused += done
                    .finished
                    .iter()
                    .map(|f| f.finished.reused_tokens)
                    .sum::<u64>();
                if finished == want {
                    break;
                }
            }
            assert_eq!(finished, want, "{variant}: the wave finished");
        }
        let st = kv.stats().await.unwrap();
        kv.shutdown().await;
        assert!(
            st.scheduler.preemptions > 0,
            "{variant}: no preemption: {st:?}"
        );
        assert!(reused > 0, "{variant}: no prefix reuse");
        // Paged equals unpaged, bit for bit (every position's logits digest).
        let o = outputs.lock().unwrap();
        assert!(o.conflicts.is_empty(), "{:?}", o.conflicts);
        let (mut agree, mut near_tie) = (0, 0);
        for (i, p) in r.prompts.iter().enumerate() {
            for copy in [i as u64, 100 + i as u64, 200 + i as u64].map(RequestId) {
                let n = max_new(copy);
                let want = dsa_kv_model::unpaged::generate(&m, m.format(), &p.tokens, n).unwrap();
                assert_eq!(
                    generated[&copy], want.tokens,
                    "{variant} {copy}: paged vs unpaged"
                );
                // Every position the runtime computed (a reused prefix is not).
                let paged: Vec<_> = o.tokens[&(0, copy)].values().copied().collect();
                let want: Vec<_> = want.outputs[want.outputs.len() - paged.len()..].to_vec();
                assert_eq!(paged, want, "{variant} {copy}: outputs, paged vs unpaged");
            }
            let ours = &generated[&RequestId(i as u64)];
            match ours.iter().zip(&p.generated).position(|(a, b)| a != b) {
                None => agree += 1,
                Some(s) => {
                    // The first divergence must be a near-tie of HF's own logits: its
                    // margin within twice our tolerance (both logits may move by it).
                    let seq: Vec<u32> = p.tokens.iter().chain(&ours[..s]).copied().collect();
                    let logits = our_logits(&m, &seq);
                    let tol = tolerance(c.layers, logits.last().unwrap());
                    let margin = p.generated_margins[s];
                    eprintln!(
                        "{variant} request {i} ({}): diverges at token {s}: ours {}, HF's {} \
                         (HF's margin {margin:.4}, tolerance {tol:.4})",
                        p.kind, ours[s], p.generated[s]
                    );
                    if margin > 2.0 * tol {
                        // Not a near-tie of the logits: the sequence so far (the same
                        // tokens on both sides) must hold a position where our indexer
                        // selected other positions than HF's (FP8 against float).
                        assert_eq!(p.kind, "sparse", "{variant} request {i}: a dense prompt");
                        let differ = differing_selections(&m, &r, i, &seq);
                        eprintln!("  {differ} of its positions select differently from HF");
                        assert!(differ > 0, "{variant} request {i}: no selection differs");
                    }
                    near_tie += usize::from(margin <= 2.0 * tol);
                }
            }
        }
        eprintln!(
            "{variant}: {agree} of {} requests generate HF's greedy tokens exactly; {near_tie} \
             diverge at a near-tie; {} preemptions, {reused} prompt tokens reused",
            r.prompts.len(),
            st.scheduler.preemptions
        );
    }
}
