//! End-to-end checks of the step metadata and the data-plane ops with a real cache
//! manager and host storage:
//! * indexer keys quantized (FP8 / FP4), scattered through the slot mappings, gathered
//!   back through the full-KV mappings (token counts across page boundaries), with reuse;
//! * every mapping non-negative and inside the layer's view;
//! * V1 and V2 give the same number of valid pages per request, values in range;
//! * indexer logits Σ_h relu(q_h · k_j) · w_h read through the paged cache equal the
//!   logits of the unpaged keys, bit for bit;
//! * sparse MLA rows read through top-k global ids equal the unpaged rows;
//! * draft replay against a separate MTP draft manager, and accepted/rejected drafts.

mod common;

use common::Rng;
use dsa_kv::config::{DsaModel, DsaModelSpec, IndexerDtype, KvDtype, LayerSet};
use dsa_kv::core::{KvCacheManager, ManagerOptions, ReuseScope, SeqHandle, SeqOptions, TierSlots};
use dsa_kv::ids::{LayerId, LifeCycleId, RequestId, Tier, TokenId};
use dsa_kv::layout::{BufferPlacement, LayoutKind, PoolPlan, Role};
use dsa_kv::metadata::{MetadataDims, MetadataLayout, RequestKind, StepMetadata, StepRequest};
use dsa_kv::ops::indexer_k::{indexer_k_gather, indexer_k_scatter, IndexerMappings};
use dsa_kv::ops::mla::{
    mla_scatter_bf16, mla_scatter_fp8_ds_mla, quantize_fp8_ds_mla_row, RowView,
};
use dsa_kv::ops::quant::{
    dequantize_fp4_token, dequantize_fp8_token, quantize_fp4_token, quantize_fp8_token, ScaleFormat,
};
use dsa_kv::ops::topk::{topk_to_global, PrimaryPageParams};
use dsa_kv::storage::HostStorage;
use half::bf16;

const T: usize = 64;
const DIM: usize = 128;

fn model(kv: KvDtype, idx: IndexerDtype) -> DsaModel {
    DsaModel::new(DsaModelSpec {
        num_layers: 3,
        num_mtp_layers: 1,
        kv_dtype: kv,
        indexer_dtype: idx,
        ..DsaModelSpec::deepseek_v32()
    })
    .unwrap()
}

/// Deterministic BF16 vector of `n` values for (token, position, layer, salt).
fn vector(token: TokenId, pos: usize, layer: LayerId, salt: u64, n: usize) -> Vec<bf16> {
    let seed = (u64::from(token.get()) * 0x9e37)
        ^ ((pos as u64) << 20)
        ^ (u64::from(layer.get()) << 44)
        ^ salt;
    let mut r = Rng(seed);
    (0..n)
        .map(|_| bf16::from_f32((r.below(20_001) as f32 - 10_000.0) / 2_000.0))
        .collect()
}

/// Quantized indexer key of one token: (payload, scale word).
fn indexer_key(
    dtype: IndexerDtype,
    token: TokenId,
    pos: usize,
    layer: LayerId,
) -> (Vec<u8>, Vec<u8>) {
    let x = vector(token, pos, layer, 1, DIM);
    let mut s = vec![0u8; 4];
    match dtype {
        IndexerDtype::Fp8 => {
            let mut v = vec![0u8; DIM];
            quantize_fp8_token(&x, ScaleFormat::Ue8m0, &mut v, &mut s);
            (v, s)
        }
        IndexerDtype::Fp4 => {
            let mut v = vec![0u8; DIM / 2];
            quantize_fp4_token(&x, &mut v, &mut s);
            (v, s)
        }
    }
}

fn dequant(dtype: IndexerDtype, v: &[u8], s: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; DIM];
    match dtype {
        IndexerDtype::Fp8 => dequantize_fp8_token(v, s, &mut out),
        IndexerDtype::Fp4 => dequantize_fp4_token(v, s, &mut out),
    }
    out
}

/// The MLA row of one token as stored (BF16 bytes or the 656-byte fp8_ds_mla row).
fn mla_row(kv: KvDtype, token: TokenId, pos: usize, layer: LayerId) -> (Vec<bf16>, Vec<u8>) {
    let x = vector(token, pos, layer, 2, 576);
    let bytes = match kv {
        KvDtype::Bf16 => x.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        KvDtype::Fp8DsMla => {
            let mut out = vec![0u8; 656];
            quantize_fp8_ds_mla_row(&x, ScaleFormat::Ue8m0, &mut out);
            out
        }
        other => unreachable!("{other} is not used here"),
    };
    (x, bytes)
}

struct Seq {
    h: SeqHandle,
    tokens: Vec<TokenId>,
}

struct Harness {
    model: DsaModel,
    plan: PoolPlan,
    m: KvCacheManager,
    st: HostStorage,
    layout: MetadataLayout,
    meta: StepMetadata,
}

fn harness(
    model: DsaModel,
    set: LayerSet,
    kind: LayoutKind,
    slots: u32,
    draft: Option<MetadataDims>,
) -> Harness {
    let plan = PoolPlan::for_model(&model, set, kind, T as u32).unwrap();
    let m = KvCacheManager::new(
        plan.clone(),
        TierSlots {
            gpu: vec![slots],
            host: vec![],
        },
        ManagerOptions::default(),
    )
    .unwrap();
    let st = HostStorage::new(&plan, &[slots], &[]).unwrap();
    let layout = MetadataLayout::from_plan(&plan).unwrap();
    let dims = MetadataDims {
        max_num_sequences: 8,
        max_blocks_per_seq: 8,
        max_num_tokens: 1024,
        max_context_kv_tokens: 2048,
    };
    let meta = StepMetadata::new(layout, dims, draft, true).unwrap();
    Harness {
        model,
        plan,
        m,
        st,
        layout,
        meta,
    }
}

/// The layer's view of a pool: bytes from the buffer's offset inside slot 0.
fn view<'a>(st: &'a mut HostStorage, p: &BufferPlacement) -> &'a mut [u8] {
    let pool = st.pool_mut(Tier::Gpu, p.pool_group, p.pool.get());
    &mut pool[p.offset_in_slot as usize..]
}

impl Harness {
    fn tables(&self, seqs: &[&Seq]) -> Vec<Vec<i32>> {
        seqs.iter()
            .map(|s| {
                let mut row = vec![-1i32; 8];
                let n = self
                    .m
                    .write_block_table(&s.h, LifeCycleId(0), &mut row)
                    .unwrap();
                row.truncate(n);
                row
            })
            .collect()
    }

    /// Prepares a step and writes the new tokens' indexer keys and MLA rows through the
    /// slot mappings, every layer.
    fn step(&mut self, seqs: &[&Seq], kinds: &[RequestKind], cached: &[u32], new: &[u32]) {
        let tables = self.tables(seqs);
        let reqs: Vec<StepRequest> = (0..seqs.len())
            .map(|i| StepRequest {
                kind: kinds[i],
                block_slots: &tables[i],
                row: dsa_kv::core::RowStamp::UNKNOWN,
                num_cached: cached[i],
                num_new: new[i],
                helix_inactive: false,
            })
            .collect();
        let c = self.meta.prepare(&self.layout, &reqs).unwrap();
        let n = c.num_tokens;
        let spec = self.model.spec().clone();
        let placements: Vec<BufferPlacement> = self.plan.placements().to_vec();
        let slot_bytes: Vec<u64> = self.plan.pool_groups()[0]
            .pools
            .iter()
            .map(|p| p.slot_bytes)
            .collect();
        let mut tok_pos = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            for j in 0..new[i] as usize {
                let p = cached[i] as usize + j;
                tok_pos.push((s.tokens[p], p));
            }
        }
        let vm = self.meta.slot_mapping_value()[..n].to_vec();
        let sm = self.meta.slot_mapping_scale()[..n].to_vec();
        let mla = self.meta.mla_slot_mapping()[..n].to_vec();
        for pl in &placements {
            match pl.role {
                Role::IndexKey => {
                    let (mut vals, mut scales) = (Vec::new(), Vec::new());
                    for &(t, p) in &tok_pos {
                        let (v, s) = indexer_key(spec.indexer_dtype, t, p, pl.layer);
                        vals.extend(v);
                        scales.extend(s);
                    }
                    let width = vals.len() / n.max(1);
                    let cache = view(&mut self.st, pl);
                    // Every mapping of a real token is non-negative and inside the view.
                    for i in 0..n {
                        assert!(vm[i] >= 0 && vm[i] as usize + width <= cache.len());
                        assert!(sm[i] >= 0 && sm[i] as usize + 4 <= cache.len());
                    }
                    indexer_k_scatter(
                        cache,
                        &vals,
                        &scales,
                        IndexerMappings {
                            value: &vm,
                            scale: &sm,
                        },
                        width,
                    )
                    .unwrap();
                }
                Role::Key => {
                    let rows: Vec<bf16> = tok_pos
                        .iter()
                        .flat_map(|&(t, p)| mla_row(spec.kv_dtype, t, p, pl.layer).0)
                        .collect();
                    let rv = RowView::of(pl, slot_bytes[pl.pool.index()]);
                    let pool = self.st.pool_mut(Tier::Gpu, pl.pool_group, pl.pool.get());
                    match spec.kv_dtype {
                        KvDtype::Bf16 => mla_scatter_bf16(pool, &rv, &rows, &mla).unwrap(),
                        KvDtype::Fp8DsMla => {
                            mla_scatter_fp8_ds_mla(pool, &rv, &rows, &mla, ScaleFormat::Ue8m0)
                                .unwrap()
                        }
                        _ => unreachable!(),
                    }
                }
                _ => {}
            }
        }
    }

    fn start(&mut self, id: u64, tokens: Vec<TokenId>, cap: u64) -> (Seq, u64) {
        let c = self
            .m
            .create(
                RequestId(id),
                ReuseScope::SHARED,
                &tokens,
                SeqOptions::default(),
            )
            .unwrap();
        assert!(self.m.resume(&c.handle).unwrap());
        let reused = c.reused_tokens;
        assert!(self.m.resize(&c.handle, cap, reused).unwrap());
        common::run_copy_plans(&mut self.m, &mut self.st);
        (
            Seq {
                h: c.handle,
                tokens,
            },
            reused,
        )
    }
}

fn tokens(seed: u64, n: usize) -> Vec<TokenId> {
    let mut r = Rng(seed);
    (0..n).map(|_| TokenId(r.below(100_000) as u32)).collect()
}

#[test]
fn scatter_then_gather_through_full_kv_mappings() {
    for idx in [IndexerDtype::Fp8, IndexerDtype::Fp4] {
        for kind in [LayoutKind::V1, LayoutKind::V2] {
            for total in [63usize, 64, 65, 127, 128, 129] {
                let mut h = harness(model(KvDtype::Bf16, idx), LayerSet::Target, kind, 32, None);
                // A writes and commits the first half; B reuses it (a partial block is
                // copied on resume) and prefills the rest as a context request with
                // cached tokens, which gets its own full-KV mappings.
                let toks = tokens(total as u64, total + 1);
                let pre = total / 2;
                let (mut a, _) = h.start(1, toks[..pre + 1].to_vec(), pre as u64);
                h.step(&[&a], &[RequestKind::Context], &[0], &[pre as u32]);
                h.m.commit(&a.h, &toks[..pre]).unwrap();
                h.m.close(&mut a.h).unwrap();
                let (b, reused) = h.start(2, toks.clone(), total as u64);
                assert_eq!(reused, pre as u64);
                let (cached, new) = (pre as u32, (total - pre) as u32);
                h.step(&[&b], &[RequestKind::Context], &[cached], &[new]);
                let c = h.meta.counts();
                let full = h.meta.bindings().full_kv_aliased();
                assert_eq!(full, cached == 0);
                let (fv, fs) = if full {
                    (
                        h.meta.slot_mapping_value().to_vec(),
                        h.meta.slot_mapping_scale().to_vec(),
                    )
                } else {
                    assert_eq!(c.num_full_kv_tokens, total);
                    (
                        h.meta.full_kv_value().to_vec(),
                        h.meta.full_kv_scale().to_vec(),
                    )
                };
                for layer in h.plan.layer_ids().collect::<Vec<_>>() {
                    let pl = *h.plan.placement(layer, Role::IndexKey).unwrap();
                    let width = pl.row.bytes_per_token() as usize - 4;
                    let cache = view(&mut h.st, &pl);
                    // Gather in chunks, as a chunked prefill reads the full-KV mappings.
                    let n = if full { new as usize } else { total };
                    for (start, len) in [(0, n / 2), (n / 2, n - n / 2)] {
                        let (mut v, mut s) = (vec![0u8; len * width], vec![0u8; len * 4]);
                        indexer_k_gather(
                            cache,
                            IndexerMappings {
                                value: &fv,
                                scale: &fs,
                            },
                            start,
                            len,
                            width,
                            &mut v,
                            &mut s,
                        )
                        .unwrap();
                        for i in 0..len {
                            let p = if full {
                                cached as usize + start + i
                            } else {
                                start + i
                            };
                            let (ev, es) = indexer_key(idx, toks[p], p, layer);
                            assert_eq!(
                                (&v[i * width..(i + 1) * width], &s[i * 4..i * 4 + 4]),
                                (&ev[..], &es[..]),
                                "{idx:?} {kind:?} total {total} token {p}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn v1_and_v2_agree_on_valid_pages() {
    let mut counts = Vec::new();
    for kind in [LayoutKind::V1, LayoutKind::V2] {
        let mut h = harness(
            model(KvDtype::Bf16, IndexerDtype::Fp8),
            LayerSet::Target,
            kind,
            40,
            None,
        );
        let lens = [1u64, 63, 64, 65, 200, 129];
        let seqs: Vec<Seq> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                h.start(i as u64 + 1, tokens(i as u64 + 100, n as usize), n)
                    .0
            })
            .collect();
        let refs: Vec<&Seq> = seqs.iter().collect();
        let kinds = vec![RequestKind::Context; seqs.len()];
        let zeros = vec![0u32; seqs.len()];
        let new: Vec<u32> = lens.iter().map(|&n| n as u32).collect();
        h.step(&refs, &kinds, &zeros, &new);
        let b = h.meta.max_blocks_per_seq();
        let scale = h.layout.indexer_page_scale as i32;
        let mut valid = Vec::new();
        for r in 0..seqs.len() {
            let row = &h.meta.block_table()[r * b..(r + 1) * b];
            let n = row.iter().filter(|&&s| s >= 0).count();
            assert!(row[..n].iter().all(|&s| (0..40).contains(&s)));
            let ix = &h.meta.indexer_page_table()[r * b..(r + 1) * b];
            assert!(ix.iter().all(|&p| p >= 0 && p < 40 * scale));
            valid.push(n);
        }
        assert_eq!(valid, vec![1, 1, 1, 2, 4, 3]);
        counts.push(valid);
    }
    assert_eq!(counts[0], counts[1]);
}

/// Σ_h relu(q_h · k) · w_h in a fixed order.
fn logit(q: &[f32], w: &[f32], k: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (h, wh) in w.iter().enumerate() {
        let dot: f32 = q[h * DIM..(h + 1) * DIM]
            .iter()
            .zip(k)
            .map(|(a, b)| a * b)
            .sum();
        acc += dot.max(0.0) * wh;
    }
    acc
}

#[test]
fn paged_logits_and_sparse_mla_rows_match_the_unpaged_reference() {
    for (kv, idx) in [
        (KvDtype::Bf16, IndexerDtype::Fp8),
        (KvDtype::Fp8DsMla, IndexerDtype::Fp4),
    ] {
        for kind in [LayoutKind::V1, LayoutKind::V2] {
            let mut h = harness(model(kv, idx), LayerSet::Target, kind, 24, None);
            let lens = [150usize, 70, 300];
            let seqs: Vec<Seq> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| h.start(i as u64 + 1, tokens(i as u64 + 50, n), n as u64).0)
                .collect();
            // Prefill everything but the last token, then one decode step for all three.
            let refs: Vec<&Seq> = seqs.iter().collect();
            let ctx = vec![RequestKind::Context; 3];
            h.step(&refs, &ctx, &[0, 0, 0], &lens.map(|n| n as u32 - 1));
            h.step(
                &refs,
                &[RequestKind::Generation; 3],
                &lens.map(|n| n as u32 - 1),
                &[1, 1, 1],
            );
            let b = h.meta.max_blocks_per_seq();
            let view_ = h.plan.primary_pool_view().unwrap();
            let heads = 4;
            let mut rng = Rng(99);
            let q: Vec<f32> = (0..heads * DIM)
                .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
                .collect();
            let w: Vec<f32> = (0..heads)
                .map(|_| rng.below(1000) as f32 / 1000.0)
                .collect();
            for layer in h.plan.layer_ids().collect::<Vec<_>>() {
                let pl = *h.plan.placement(layer, Role::IndexKey).unwrap();
                let ix = h.layout.indexer.unwrap();
                let width = ix.data_bytes as usize;
                let table = h.meta.indexer_page_table().to_vec();
                let block_table = h.meta.block_table().to_vec();
                let (scale, offset) = h.plan.primary_page_params(layer).unwrap();
                for (r, &len) in lens.iter().enumerate() {
                    // Indexer logits through the page table vs the unpaged keys.
                    let cache = view(&mut h.st, &pl).to_vec();
                    let mut paged = Vec::with_capacity(len);
                    let mut flat = Vec::with_capacity(len);
                    for j in 0..len {
                        let page = table[r * b + j / T] as u64;
                        let vo = ix.value_offset(page, (j % T) as u32) as usize;
                        let so = ix.scale_offset(page, (j % T) as u32) as usize;
                        let k = dequant(idx, &cache[vo..vo + width], &cache[so..so + 4]);
                        paged.push(logit(&q, &w, &k));
                        let (ev, es) = indexer_key(idx, seqs[r].tokens[j], j, layer);
                        flat.push(logit(&q, &w, &dequant(idx, &ev, &es)));
                    }
                    assert_eq!(
                        paged.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        flat.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "{kv} {idx:?} {kind:?} layer {layer} request {r}"
                    );
                    // Top-16 by logit (ties by position), to global rows, read the rows.
                    let mut order: Vec<usize> = (0..len).collect();
                    order.sort_by(|&a, &c| flat[c].total_cmp(&flat[a]).then(a.cmp(&c)));
                    let mut topk: Vec<i32> = order[..16].iter().map(|&p| p as i32).collect();
                    topk.push(-1);
                    let mut global = vec![0i32; topk.len()];
                    let params = PrimaryPageParams {
                        tokens_per_block: T as u32,
                        scale,
                        layer_offset: offset,
                    };
                    topk_to_global(
                        &topk,
                        topk.len(),
                        &[r as i32],
                        &block_table,
                        b,
                        params,
                        &mut global,
                    )
                    .unwrap();
                    assert_eq!(*global.last().unwrap(), -1);
                    let pool = h.st.pool(Tier::Gpu, view_.pool_group, view_.pool.get());
                    let rb = view_.row_bytes as usize;
                    for (&p, &g) in topk.iter().zip(&global).take(16) {
                        let got = &pool[g as usize * rb..(g as usize + 1) * rb];
                        let want = mla_row(kv, seqs[r].tokens[p as usize], p as usize, layer).1;
                        assert_eq!(
                            got,
                            &want[..],
                            "{kv} {kind:?} layer {layer} request {r} position {p}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn draft_replay_reads_the_draft_managers_pages() {
    let model = model(KvDtype::Bf16, IndexerDtype::Fp8);
    let draft_dims = MetadataDims {
        max_num_sequences: 8,
        max_blocks_per_seq: 8,
        max_num_tokens: 1024,
        max_context_kv_tokens: 2048,
    };
    let mut target = harness(
        model.clone(),
        LayerSet::Target,
        LayoutKind::V2,
        24,
        Some(draft_dims),
    );
    let mut draft = harness(model, LayerSet::MtpOnly, LayoutKind::V2, 12, None);
    // Make the draft manager's slots differ from the target's.
    let (_pad, _) = draft.start(99, tokens(5, 10), 128);
    let toks = tokens(3, 100);
    let (ts, _) = target.start(1, toks.clone(), 100 + 4);
    let (ds, _) = draft.start(1, toks.clone(), 100 + 4);
    let t_row = target.tables(&[&ts]).remove(0);
    let d_row = draft.tables(&[&ds]).remove(0);
    assert_ne!(t_row, d_row);
    let t_req = [StepRequest {
        kind: RequestKind::Generation,
        block_slots: &t_row,
        row: dsa_kv::core::RowStamp::UNKNOWN,
        num_cached: 100,
        num_new: 4,
        helix_inactive: false,
    }];
    target.meta.prepare(&target.layout, &t_req).unwrap();
    let target_bindings = target.meta.bindings();
    let target_table = target.meta.indexer_page_table().to_vec();
    let d_req = [StepRequest {
        block_slots: &d_row,
        row: dsa_kv::core::RowStamp::UNKNOWN,
        ..t_req[0]
    }];
    {
        let replay = target.meta.draft_replay(&draft.layout, &d_req).unwrap();
        // Draft page ids: draft slots × the draft layout's indexer page scale (1 MTP layer).
        assert_eq!(draft.layout.indexer_page_scale, 1);
        assert_eq!(&replay.indexer_page_table()[..2], &d_row[..]);
        // The slot mappings address the draft manager's indexer pool.
        let ix = draft.layout.indexer.unwrap();
        assert_eq!(
            replay.slot_mapping_value()[0],
            ix.value_offset(d_row[1] as u64, 36) as i64
        );
        assert_ne!(replay.bindings(), target_bindings);
    }
    assert_eq!(target.meta.bindings(), target_bindings);
    assert_eq!(target.meta.indexer_page_table(), target_table.as_slice());

    // Verification: the target token and 1 of 3 drafts are accepted.
    let accepted = [TokenId(7), TokenId(8)];
    target.m.commit(&ts.h, &toks).unwrap();
    let info = target.m.info_of(&ts.h).unwrap();
    assert_eq!(
        (info.committed, info.history, info.capacity),
        (100, 100, 104)
    );
    target.m.accept_tokens(&ts.h, &accepted).unwrap();
    let info = target.m.info_of(&ts.h).unwrap();
    assert_eq!(
        (info.committed, info.history, info.capacity, info.num_blocks),
        (102, 102, 102, 2)
    );
    let mut s = ts;
    target.m.close(&mut s.h).unwrap();
    let mut probe = toks.clone();
    probe.extend(accepted);
    probe.extend([TokenId(9), TokenId(10)]);
    // Only verified tokens are reusable: 102 (the 2 rejected drafts were never committed).
    assert_eq!(
        target.m.probe_reuse(ReuseScope::SHARED, &probe).unwrap(),
        102
    );
}
