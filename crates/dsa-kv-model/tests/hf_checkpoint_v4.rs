//! transformers' `DeepseekV4ForCausalLM` as the oracle of our V4 checkpoint model: the
//! tiny checkpoint of `tests/fixtures/hf/deepseek_v4` (layers window-only, ratio 4 with
//! its indexer, ratio 128; hyper-connections, hash-routed and top-k experts, the compress
//! RoPE with YaRN; made by `make_v4_fixture.py` with transformers 5.17.0 / torch 2.11.0,
//! `MANIFEST.json`) loaded by `V4Model::from_checkpoint` under the names transformers
//! saves, and transformers' own float32 logits at every position of two prompts (90 and
//! 400 tokens).
//!
//! Two of our runs are compared. Unrounded (`V4Model::from_checkpoint_unrounded`: the
//! cache's rows read as computed, the queries unrounded) isolates the arithmetic; the
//! real one reads the cache's MODEL1 rows (E4M3 NoPE values with power-of-two scales)
//! and FP8 indexer keys, and BF16 / FP8 queries, as the kernels do.

use std::path::{Path, PathBuf};

use dsa_kv_model::v4::{V4Contiguous, V4Model};
use half::bf16;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/deepseek_v4")
}

/// The prompts and transformers' argmax at every position.
struct Prompt {
    tokens: Vec<u32>,
    argmax: Vec<u32>,
}

fn prompts() -> Vec<Prompt> {
    let text = std::fs::read_to_string(fixture().join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let nums = |p: &serde_json::Value, k: &str| -> Vec<f64> {
        p[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| Prompt {
            tokens: nums(p, "tokens").iter().map(|&x| x as u32).collect(),
            argmax: nums(p, "argmax").iter().map(|&x| x as u32).collect(),
        })
        .collect()
}

/// transformers' logits (`logits.npy`: float32 `[positions, vocab]`, prompts in order).
fn hf_logits() -> (usize, Vec<f32>) {
    npy_f32(&fixture().join("logits.npy"))
}

/// A float32 `[rows, vocab]` array: vocab and the values.
fn npy_f32(path: &Path) -> (usize, Vec<f32>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..6], b"\x93NUMPY");
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = std::str::from_utf8(&b[10..10 + hlen]).unwrap();
    assert!(header.contains("'descr': '<f4'"), "{header}");
    let shape = header.split("'shape': (").nth(1).unwrap();
    let shape = &shape[..shape.find(')').unwrap()];
    let vocab: usize = shape.split(',').nth(1).unwrap().trim().parse().unwrap();
    let data = b[10 + hlen..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (vocab, data)
}

/// Per position of every prompt (prompts in order): our logits' largest absolute
/// difference from transformers', transformers' largest absolute logit, and whether
/// our argmax is transformers'.
fn compare(m: &V4Model) -> Vec<Vec<(f32, f32, bool)>> {
    let (vocab, hf) = hf_logits();
    let mut row = 0;
    prompts()
        .iter()
        .map(|p| {
            let (_, hidden) = m
                .run_hidden(&mut V4Contiguous::new(), 0, &p.tokens)
                .unwrap();
            let out = hidden
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    let ours = m.logits(h);
                    let theirs = &hf[(row + i) * vocab..(row + i + 1) * vocab];
                    let diff = ours
                        .iter()
                        .zip(theirs)
                        .fold(0f32, |w, (a, b)| w.max((a - b).abs()));
                    let scale = theirs.iter().fold(0f32, |w, v| w.max(v.abs()));
                    (diff, scale, argmax(&ours) == p.argmax[i])
                })
                .collect();
            row += p.tokens.len();
            out
        })
        .collect()
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

/// Whether the ratio-4 layer's indexer selects every visible entry at position `q`
/// (at most `index_topk` = 64 of them): the dense regime.
fn dense(q: usize) -> bool {
    (q + 1) / 4 <= 64
}

/// f32 sums in another order than torch's, over at most a few thousand terms: relative
/// differences of order n · 2⁻²⁴ ≈ 1e-4 at worst.
const F32_ORDER: f32 = 1e-4;

/// The unit roundoff of E4M3 (4 significant bits): the relative error of a MODEL1 row's
/// NoPE element.
const E4M3_U: f32 = 1.0 / 16.0;

/// The tolerance of a logit read through the cache in the dense regime: each of the 3
/// layers reads its rows twice (scores and values), each element off by at most
/// `E4M3_U` relative, and the attention's share of a logit is at most the logit's scale.
fn cache_tolerance(scale: f32) -> f32 {
    2.0 * 3.0 * E4M3_U * scale
}

#[test]
fn the_v4_checkpoint_loads_under_the_names_transformers_saves() {
    let m = V4Model::from_checkpoint(&fixture()).unwrap();
    let c = m.config();
    assert_eq!(c.ratios, vec![0, 4, 128]);
    assert_eq!(
        (c.hidden, c.heads, c.index_heads, c.topk, c.window, c.vocab),
        (32, 2, 2, 64, 128, 256)
    );
    assert!(m.is_checkpoint() && !c.mtp);
}

/// Where the indexer selects every visible entry, our arithmetic is transformers': the
/// unrounded run's logits are within f32 summation order of its float32 ones at every
/// position. Through the cache (MODEL1 rows, FP8 keys, BF16 queries) they move by the
/// formats' rounding, within [`cache_tolerance`] (a loose bound), and the greedy token is
/// still transformers' at ≥ 90 % of
/// these positions (the unrounded run's at all of them); the difference is the cache's
/// (at least 100 times the unrounded run's).
#[test]
fn dense_regime_logits_match_transformers_and_the_difference_is_the_caches_rounding() {
    let exact = compare(&V4Model::from_checkpoint_unrounded(&fixture()).unwrap());
    let cached = compare(&V4Model::from_checkpoint(&fixture()).unwrap());
    let ps = prompts();
    let (mut worst_exact, mut worst_cached, mut n, mut same_cached) = (0f32, 0f32, 0, 0);
    for (pi, p) in ps.iter().enumerate() {
        for q in (0..p.tokens.len()).filter(|&q| dense(q)) {
            let (d, scale, same) = exact[pi][q];
            assert!(
                d <= F32_ORDER * scale && same,
                "prompt {pi} position {q}: |Δlogit| {d} unrounded (greedy token: {same})"
            );
            worst_exact = worst_exact.max(d / scale);
            let (d, scale, same) = cached[pi][q];
            let tol = cache_tolerance(scale);
            assert!(
                d <= tol,
                "prompt {pi} position {q}: |Δlogit| {d} over {tol}"
            );
            n += 1;
            same_cached += usize::from(same);
            worst_cached = worst_cached.max(d / scale);
        }
    }
    eprintln!(
        "dense regime: max |Δlogit| / max |logit| {worst_exact:.2e} unrounded, \
         {worst_cached:.2e} through the cache; greedy token transformers' through the cache \
         at {same_cached} of {n} positions"
    );
    assert!(same_cached as f64 >= 0.9 * n as f64, "{same_cached} of {n}");
    assert!(
        worst_cached >= 100.0 * worst_exact,
        "{worst_cached} vs {worst_exact}"
    );
}

/// transformers' indexer picks (`topk.npy`: int16 `[positions, 64]`, ascending, −1
/// past the picks), one row per position of the prompts in order.
fn hf_selections() -> Vec<Vec<u32>> {
    let b = std::fs::read(fixture().join("topk.npy")).unwrap();
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = std::str::from_utf8(&b[10..10 + hlen]).unwrap();
    assert!(
        header.contains("'descr': '<i2'") && header.contains(", 64)"),
        "{header}"
    );
    b[10 + hlen..]
        .chunks_exact(2 * 64)
        .map(|row| {
            row.chunks_exact(2)
                .map(|c| i16::from_le_bytes([c[0], c[1]]))
                .filter(|&v| v >= 0)
                .map(|v| v as u32)
                .collect()
        })
        .collect()
}

/// The ratio-4 layer.
const C4: usize = 1;

/// Past 64 visible entries the indexer selects. Our unrounded run's selection is
/// transformers' except where scores tie exactly at the 64th place: every entry one
/// side picks and the other does not scores exactly the 64th best score (with two
/// indexer heads the ReLU zeroes both at about a quarter of the entries, and torch's
/// top-k breaks ties in another order than ours, the earlier entry). Handed
/// transformers' selections, the unrounded run's logits are within f32 order of its
/// float32 ones at every one of these positions.
#[test]
fn sparse_regime_selections_differ_only_at_exact_ties_and_the_rest_is_exact() {
    let ps = prompts();
    let hf = hf_selections();
    let m = V4Model::from_checkpoint_unrounded(&fixture()).unwrap();
    let (mut n, mut differ, mut row) = (0, 0, 0);
    for p in &ps {
        m.run_hidden(&mut V4Contiguous::new(), 0, &p.tokens)
            .unwrap();
        for q in (0..p.tokens.len()).filter(|&q| !dense(q)) {
            let (ours, scores) = m.unrounded_selection(C4, q as u32).expect("a selection");
            let theirs = &hf[row + q];
            assert_eq!(theirs.len(), 64, "position {q}");
            n += 1;
            if ours == *theirs {
                continue;
            }
            differ += 1;
            let mut sorted = scores.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let boundary = sorted[63];
            for w in ours
                .iter()
                .filter(|w| !theirs.contains(w))
                .chain(theirs.iter().filter(|w| !ours.contains(w)))
            {
                assert_eq!(
                    scores[*w as usize].to_bits(),
                    boundary.to_bits(),
                    "position {q}: entry {w} is picked by one side only and is no tie at the boundary"
                );
            }
        }
        row += p.tokens.len();
    }
    assert!(n > 100);
    // Handed transformers' selections, every sparse position is exact up to f32 order.
    let forced = V4Model::from_checkpoint_unrounded(&fixture()).unwrap();
    let mut row = 0;
    for p in &ps {
        for q in (0..p.tokens.len()).filter(|&q| !dense(q)) {
            assert!(forced.force_unrounded_selection(C4, q as u32, hf[row + q].clone()));
        }
        row += p.tokens.len();
    }
    let exact = compare(&forced);
    let mut worst = 0f32;
    for (pi, rows) in exact.iter().enumerate() {
        for (q, &(d, scale, same)) in rows.iter().enumerate().filter(|(q, _)| !dense(*q)) {
            assert!(
                d <= F32_ORDER * scale,
                "prompt {pi} position {q}: |Δlogit| {d}"
            );
            assert!(same, "prompt {pi} position {q}: greedy token");
            worst = worst.max(d / scale);
        }
    }
    eprintln!(
        "sparse regime: {n} positions, our selection transformers' at {}, the rest differing \
         only at exact ties; with its selections max |Δlogit| / max |logit| {worst:.2e}",
        n - differ
    );
}

/// Writes `dir/model.safetensors`: the checkpoint of `src` with its BF16 tensor `target`
/// scaled by 1.05 (the mutation tests' changed weight).
fn write_scaled(src: &Path, dir: &Path, target: &str) {
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            let mut data = v.data().to_vec();
            if name == target {
                assert_eq!(v.dtype(), safetensors::Dtype::BF16);
                for c in data.chunks_exact_mut(2) {
                    let x = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32() * 1.05;
                    c.copy_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes());
                }
            }
            (name, v.dtype(), v.shape().to_vec(), data)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, t, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*t, s.clone(), d).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
}

/// The comparison can fail: the same checkpoint with one hyper-connection scale of one
/// layer moved by 5 % (a copy in a temporary folder) gives logits outside f32 order in
/// the dense regime.
#[test]
fn a_changed_weight_is_caught() {
    let dir = std::env::temp_dir().join(format!("dsa-kv-hf-v4-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in [
        "config.json",
        "generation_config.json",
        "logits.npy",
        "reference.json",
    ] {
        std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
    }
    let target = "model.layers.0.hc_attn_scale";
    write_scaled(&fixture(), &dir, target);
    let m = V4Model::from_checkpoint_unrounded(&dir).unwrap();
    let ps = prompts();
    let mut worst = 0f32;
    let (vocab, hf) = hf_logits();
    let mut row = 0;
    for p in &ps {
        let (_, hidden) = m
            .run_hidden(&mut V4Contiguous::new(), 0, &p.tokens)
            .unwrap();
        for (q, h) in hidden.iter().enumerate().filter(|(q, _)| dense(*q)) {
            let theirs = &hf[(row + q) * vocab..(row + q + 1) * vocab];
            let scale = theirs.iter().fold(0f32, |w, v| w.max(v.abs()));
            let d = m
                .logits(h)
                .iter()
                .zip(theirs)
                .fold(0f32, |w, (a, b)| w.max((a - b).abs()));
            worst = worst.max(d / scale);
        }
        row += p.tokens.len();
    }
    std::fs::remove_dir_all(&dir).unwrap();
    eprintln!("a 5 % change of {target}: max |Δlogit| / max |logit| {worst:.2e}");
    assert!(worst > 10.0 * F32_ORDER, "the change went unseen: {worst}");
}

// ---------------------------------------------------------------------------------------
// The Flash-pattern checkpoint with the published MTP layer
// ---------------------------------------------------------------------------------------

/// `tests/fixtures/hf/deepseek_v4_mtp` (`make_v4_fixture.py --variant deepseek_v4_mtp`):
/// layers `[0, 0, 4, 128, 4]`, the first three hash-routed, 4 hyper-connection streams,
/// YaRN, and an MTP layer under the published names (`mtp.0.*`), run by the fixture
/// script from transformers' own decoder-layer and hyper-head modules as vLLM's
/// `deepseek_v4_mtp.py` composes them (transformers itself builds no MTP layer).
fn mtp_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/deepseek_v4_mtp")
}

struct MtpPrompt {
    tokens: Vec<u32>,
    argmax: Vec<u32>,
    mtp_argmax: Vec<u32>,
    /// `(position, first draft, second draft)`.
    chain: Vec<(u32, u32, u32)>,
}

fn mtp_prompts() -> Vec<MtpPrompt> {
    let text = std::fs::read_to_string(mtp_fixture().join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ints = |p: &serde_json::Value| -> Vec<u32> {
        p.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| MtpPrompt {
            tokens: ints(&p["tokens"]),
            argmax: ints(&p["argmax"]),
            mtp_argmax: ints(&p["mtp_argmax"]),
            chain: p["chain"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| {
                    let u = |k: &str| c[k].as_u64().unwrap() as u32;
                    (u("position"), u("first"), u("second"))
                })
                .collect(),
        })
        .collect()
}

/// `|Δ|` max over the row and the reference row's largest `|logit|`.
fn diff(ours: &[f32], theirs: &[f32]) -> (f32, f32) {
    let d = ours
        .iter()
        .zip(theirs)
        .fold(0f32, |w, (a, b)| w.max((a - b).abs()));
    (d, theirs.iter().fold(0f32, |w, v| w.max(v.abs())))
}

/// Per prompt: the target's logits at every position, the MTP layer's first-draft
/// logits at every position `p < len − 1` (proposing at `p` with the prompt's own token
/// at `p + 1`), and at the chain points the second draft's logits.
#[allow(clippy::type_complexity)]
fn mtp_run(
    m: &V4Model,
    p: &MtpPrompt,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<(u32, u32, Vec<f32>)>) {
    let mut kv = V4Contiguous::new();
    let (_, hidden) = m.run_hidden(&mut kv, 0, &p.tokens).unwrap();
    m.draft_write(&mut kv, 0, &p.tokens, &hidden).unwrap();
    let target = hidden.iter().map(|h| m.logits(h)).collect();
    let n = p.tokens.len();
    let first = (0..n - 1)
        .map(|q| {
            let d = m
                .propose_logits(&kv, q as u32, &hidden[q], p.tokens[q + 1], 1)
                .unwrap();
            d[0].1.clone()
        })
        .collect();
    let chain = p
        .chain
        .iter()
        .map(|&(q, _, _)| {
            let d = m
                .propose_logits(&kv, q, &hidden[q as usize], p.tokens[q as usize + 1], 2)
                .unwrap();
            (d[0].0, d[1].0, d[1].1.clone())
        })
        .collect();
    (target, first, chain)
}

#[test]
fn the_flash_pattern_checkpoint_loads_with_its_published_mtp_layer() {
    let m = V4Model::from_checkpoint(&mtp_fixture()).unwrap();
    let c = m.config();
    assert_eq!(c.ratios, vec![0, 0, 4, 128, 4]);
    assert!(m.is_checkpoint() && c.mtp);
    assert_eq!(c.mtp_input, 4 * 32, "hc_mult × hidden");
    let spec = c.spec().unwrap();
    assert_eq!((spec.num_mtp_layers, spec.mtp_input_width), (1, 128));
    // The V3-style fixture has no MTP tensors: no MTP layer, no input kept.
    let plain = V4Model::from_checkpoint(&fixture()).unwrap();
    assert_eq!((plain.config().mtp, plain.config().mtp_input), (false, 0));
}

/// Where the indexers select every visible entry (positions ≤ 258), our unrounded run
/// is transformers' up to f32 summation order: the target's logits at every position,
/// the MTP layer's first draft at every position (its row built from the target's
/// streams and the next token) and the second draft of the chain (the MTP layer on its
/// own first draft and output streams). Through the cache (MODEL1 rows, FP8 keys, BF16
/// queries, BF16 MTP input) the logits stay within [`cache_tolerance`] of the 6 layers
/// and the drafts are transformers' at ≥ 90 % of these positions.
#[test]
fn the_published_mtp_layer_matches_its_transformers_composition() {
    let exact = V4Model::from_checkpoint_unrounded(&mtp_fixture()).unwrap();
    let cached = V4Model::from_checkpoint(&mtp_fixture()).unwrap();
    let (vocab, hf_target) = npy_f32(&mtp_fixture().join("logits.npy"));
    let (_, hf_mtp) = npy_f32(&mtp_fixture().join("mtp_logits.npy"));
    let (_, hf_chain) = npy_f32(&mtp_fixture().join("chain_logits.npy"));
    let row = |all: &[f32], r: usize| all[r * vocab..(r + 1) * vocab].to_vec();
    let (mut trow, mut mrow, mut crow) = (0, 0, 0);
    let (mut worst, mut worst_cached) = (0f32, 0f32);
    let (mut n, mut same, mut chains) = (0, 0, 0);
    for p in mtp_prompts() {
        let (et, ef, ec) = mtp_run(&exact, &p);
        let (ct, cf, cc) = mtp_run(&cached, &p);
        let len = p.tokens.len();
        for q in (0..len).filter(|&q| dense(q)) {
            let theirs = row(&hf_target, trow + q);
            let (d, scale) = diff(&et[q], &theirs);
            assert!(d <= F32_ORDER * scale, "target at {q}: |Δlogit| {d}");
            assert_eq!(argmax(&et[q]), p.argmax[q], "target at {q}");
            let (d, _) = diff(&ct[q], &theirs);
            assert!(d <= 2.0 * 6.0 * E4M3_U * scale, "target at {q} cached: {d}");
            if q + 1 < len {
                let theirs = row(&hf_mtp, mrow + q);
                let (d, scale) = diff(&ef[q], &theirs);
                assert!(d <= F32_ORDER * scale, "MTP draft at {q}: |Δlogit| {d}");
                assert_eq!(argmax(&ef[q]), p.mtp_argmax[q], "MTP draft at {q}");
                worst = worst.max(d / scale);
                let (d, _) = diff(&cf[q], &theirs);
                assert!(
                    d <= 2.0 * 6.0 * E4M3_U * scale,
                    "MTP draft at {q} cached: {d}"
                );
                worst_cached = worst_cached.max(d / scale);
                n += 1;
                same += usize::from(argmax(&cf[q]) == p.mtp_argmax[q]);
            }
        }
        for (i, &(q, first, second)) in p.chain.iter().enumerate() {
            let theirs = row(&hf_chain, crow + i);
            if dense(q as usize + 1) {
                let (d1, d2, logits) = &ec[i];
                assert_eq!((*d1, *d2), (first, second), "chain at {q}");
                let (d, scale) = diff(logits, &theirs);
                assert!(d <= F32_ORDER * scale, "second draft at {q}: |Δlogit| {d}");
                let _ = &cc[i];
                chains += 1;
            }
        }
        trow += len;
        mrow += len - 1;
        crow += p.chain.len();
    }
    eprintln!(
        "MTP: {n} first drafts, max |Δlogit| / max |logit| {worst:.2e} unrounded, \
         {worst_cached:.2e} through the cache, transformers' draft at {same} of {n} through \
         the cache; {chains} second drafts exact"
    );
    assert!(chains >= 8 && n > 400);
    assert!(same as f64 >= 0.9 * n as f64, "{same} of {n}");
}

/// The MTP comparison can fail: `h_proj` scaled by 1.05 (a copy of the checkpoint)
/// moves the first drafts' logits outside f32 order.
#[test]
fn a_changed_mtp_weight_is_caught() {
    let dir = std::env::temp_dir().join(format!("dsa-kv-hf-v4-mtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(mtp_fixture().join("config.json"), dir.join("config.json")).unwrap();
    let target = "mtp.0.h_proj.weight";
    write_scaled(&mtp_fixture(), &dir, target);
    let m = V4Model::from_checkpoint_unrounded(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let (vocab, hf_mtp) = npy_f32(&mtp_fixture().join("mtp_logits.npy"));
    let p = &mtp_prompts()[0];
    let (_, first, _) = mtp_run(&m, p);
    let mut worst = 0f32;
    for (q, l) in first.iter().enumerate().filter(|(q, _)| dense(*q)) {
        let (d, scale) = diff(l, &hf_mtp[q * vocab..(q + 1) * vocab]);
        worst = worst.max(d / scale);
    }
    eprintln!("a 5 % change of {target}: max |Δlogit| / max |logit| {worst:.2e}");
    assert!(worst > 10.0 * F32_ORDER, "the change went unseen: {worst}");
}

/// An E4M3 byte's value (sign, 4 exponent bits with bias 7, 3 mantissa bits; subnormals;
/// 0x7f / 0xff are NaN), written here apart from the crate's codec.
fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
    if b & 0x7f == 0x7f {
        return f32::NAN;
    }
    sign * if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// The spacing of E4M3 values around `v` (≥ 0): 3 mantissa bits, the smallest normal
/// exponent −6 (below it the subnormals' 2⁻⁹).
fn e4m3_step(v: f32) -> f32 {
    2f32.powi(v.log2().floor().max(-6.0) as i32 - 3)
}

/// The spacing of BF16 values around `v` (7 mantissa bits).
fn bf16_step(v: f32) -> f32 {
    2f32.powi(v.abs().max(1e-30).log2().floor() as i32 - 7)
}

/// Checks our scaled-E4M3 values `ours` (tile scale `s`) against transformers' `theirs`:
/// each within one E4M3 step at the tile scale, and the scale the UE8M0 power of two
/// the tile's largest value (in BF16, as the cache takes it) asks for (amax / 448 ≤ s <
/// 2 · amax / 448). The worst
/// error in steps, or what was wrong.
fn check_tile(ours: &[f32], theirs: &[f32], s: f32) -> Result<f32, String> {
    // The cache quantizes BF16 values: the scale follows the BF16 amax.
    let amax = bf16::from_f32(theirs.iter().fold(0f32, |m, v| m.max(v.abs())))
        .to_f32()
        .max(1e-4);
    if !(s * 448.0 >= amax * 0.999 && s * 448.0 < 2.0 * amax * 1.001) {
        return Err(format!("scale {s} for a tile of amax {amax}"));
    }
    let mut worst = 0f32;
    for (a, b) in ours.iter().zip(theirs) {
        let step = s * e4m3_step(b.abs() / s);
        let d = (a - b).abs() / step;
        if d.is_nan() || d > 1.0 {
            return Err(format!("{a} vs {b}: {d} steps of {step}"));
        }
        worst = worst.max(d);
    }
    Ok(worst)
}

/// A MODEL1 row (584 bytes) against transformers' 512 values: the 448 NoPE values per
/// 64-tile as [`check_tile`], the 64 BF16 RoPE values within one BF16 step (plus f32
/// order of the part's largest value).
fn check_model1(data: &[u8], scales: &[u8], theirs: &[f32]) -> Result<f32, String> {
    let mut worst = 0f32;
    for t in 0..7 {
        let s = 2f32.powi(i32::from(scales[t]) - 127);
        let ours: Vec<f32> = data[t * 64..(t + 1) * 64]
            .iter()
            .map(|&b| e4m3(b) * s)
            .collect();
        worst = worst.max(check_tile(&ours, &theirs[t * 64..(t + 1) * 64], s)?);
    }
    // RoPE outputs are differences of products (x·cos − y·sin): the f32 order of the two
    // sides moves a small one by up to F32_ORDER of the part's largest value.
    let amax = theirs[448..].iter().fold(0f32, |m, v| m.max(v.abs()));
    for j in 0..64 {
        let o = 448 + 2 * j;
        let v = bf16::from_bits(u16::from_le_bytes([data[o], data[o + 1]])).to_f32();
        let b = theirs[448 + j];
        if (v - b).abs() > bf16_step(b) + F32_ORDER * amax {
            return Err(format!("RoPE value {j}: {v} vs {b}"));
        }
    }
    Ok(worst)
}

/// transformers' cache after a prefill (`cache.safetensors`): name → (rows, values).
fn hf_cache() -> std::collections::HashMap<String, (usize, Vec<f32>)> {
    let bytes = std::fs::read(mtp_fixture().join("cache.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .filter(|(_, v)| v.dtype() == safetensors::Dtype::F32)
        .map(|(name, v)| {
            let vals = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, (v.shape()[0], vals))
        })
        .collect()
}

/// transformers' indexer picks of ratio-4 layer `l` at every position of the first
/// prompt (`layers.{l}.topk` of `cache.safetensors`), ascending.
fn hf_cache_picks(l: usize) -> Vec<Vec<u32>> {
    let bytes = std::fs::read(mtp_fixture().join("cache.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let v = st.tensor(&format!("layers.{l}.topk")).unwrap();
    assert_eq!(v.dtype(), safetensors::Dtype::I32);
    v.data()
        .chunks_exact(4 * 64)
        .map(|row| {
            row.chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .filter(|&x| x >= 0)
                .map(|x| x as u32)
                .collect()
        })
        .collect()
}

/// After a prefill of the first prompt (300 tokens, the unrounded run), our cache holds
/// what transformers' does, within the formats: every layer's last 127 window rows, every compressed entry
/// (MODEL1 rows: E4M3 NoPE values within one E4M3 step of their tile scale, the scale
/// the UE8M0 power of two the tile's largest value asks for, BF16 RoPE values within one
/// BF16 step) and every ratio-4 indexer key (the same for its 128 values and its scale
/// word). The check can fail: the window compared one position off is refused.
#[test]
fn the_cache_after_a_prefill_holds_transformers_rows_within_one_e4m3_step() {
    use dsa_kv_model::v4::V4Store;
    // The unrounded run reads rows as computed but writes the cache's rows as always: its
    // activations are transformers' to f32 order, so what is compared is the rows'
    // formats and places, not the drift earlier layers' rounding puts into later ones.
    // Where the indexers select (past position 258) it attends transformers' picks: scores
    // tie exactly at the 64th place here and there, and torch breaks ties otherwise (see
    // `sparse_regime_selections_differ_only_at_exact_ties_and_the_rest_is_exact`).
    let m = V4Model::from_checkpoint_unrounded(&mtp_fixture()).unwrap();
    let p = &mtp_prompts()[0];
    let len = p.tokens.len() as u32;
    for (l, &ratio) in m.config().ratios.iter().enumerate() {
        if ratio == 4 {
            for (q, picks) in hf_cache_picks(l).into_iter().enumerate() {
                if !dense(q) {
                    assert!(m.force_unrounded_selection(l, q as u32, picks));
                }
            }
        }
    }
    let mut kv = V4Contiguous::new();
    m.run_hidden(&mut kv, 0, &p.tokens).unwrap();
    let hf = hf_cache();
    let (mut rows, mut worst) = (0, 0f32);
    for (l, &ratio) in m.config().ratios.iter().enumerate() {
        let (n, w) = &hf[&format!("layers.{l}.window")];
        assert_eq!(*n, 127);
        for i in 0..*n {
            let pos = len - *n as u32 + i as u32;
            let r = kv.window(l, pos).unwrap();
            let theirs = &w[i * 512..(i + 1) * 512];
            worst = worst.max(
                check_model1(&r.data, &r.scales, theirs)
                    .unwrap_or_else(|e| panic!("layer {l} window row {pos}: {e}")),
            );
            rows += 1;
            if l == 0 && i > 0 {
                // The same row against the one before it: refused.
                let prev = kv.window(l, pos - 1).unwrap();
                assert!(check_model1(&prev.data, &prev.scales, theirs).is_err());
            }
        }
        if ratio == 0 {
            continue;
        }
        let (n, e) = &hf[&format!("layers.{l}.compressor")];
        assert_eq!(*n as u32, len / ratio);
        for i in 0..*n {
            let r = kv.entry(l, i as u32).unwrap();
            worst = worst.max(
                check_model1(&r.data, &r.scales, &e[i * 512..(i + 1) * 512])
                    .unwrap_or_else(|e| panic!("layer {l} entry {i}: {e}")),
            );
            rows += 1;
        }
        if ratio == 4 {
            let (n, k) = &hf[&format!("layers.{l}.indexer")];
            for i in 0..*n {
                let key = kv.index_entry(l, i as u32).unwrap();
                let s = f32::from_le_bytes([key[128], key[129], key[130], key[131]]);
                let ours: Vec<f32> = key[..128].iter().map(|&b| e4m3(b) * s).collect();
                worst = worst.max(
                    check_tile(&ours, &k[i * 128..(i + 1) * 128], s)
                        .unwrap_or_else(|e| panic!("layer {l} indexer key {i}: {e}")),
                );
                rows += 1;
            }
        }
    }
    eprintln!("cache after a prefill: {rows} rows and keys within {worst:.2} E4M3 steps");
    assert!(rows > 700);
}
