//! Metadata and host-op benchmarks (criterion). Results and the command: BENCHMARKS.md.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use dsa_kv::config::{DsaModel, LayerSet};
use dsa_kv::layout::{IndexerPageLayout, LayoutKind, PoolPlan};
use dsa_kv::metadata::{MetadataDims, MetadataLayout, RequestKind, StepMetadata, StepRequest};
use dsa_kv::ops::indexer_k::{indexer_k_scatter, IndexerMappings};
use dsa_kv::ops::quant::{quantize_fp8_token, ScaleFormat};
use half::bf16;

/// 4 context requests (512 new tokens each, the first two with 1,000 cached tokens) and
/// 256 generation requests of 1,000–3,000 tokens with 1 + 3 draft tokens each.
/// (kind, cached, new) of one request.
type Shape = (RequestKind, u32, u32);

fn batch() -> (Vec<Vec<i32>>, Vec<Shape>) {
    let mut next_slot = 0i32;
    let mut rows = Vec::new();
    let mut shape = Vec::new();
    let mut x = 99u64;
    for i in 0..260u32 {
        let (kind, cached, new) = if i < 4 {
            (RequestKind::Context, if i < 2 { 1000 } else { 0 }, 512)
        } else {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            (RequestKind::Generation, 1000 + ((x >> 33) % 2000) as u32, 4)
        };
        let blocks = (cached + new).div_ceil(64) as usize;
        rows.push((0..blocks).map(|b| next_slot + b as i32).collect());
        next_slot += blocks as i32;
        shape.push((kind, cached, new));
    }
    (rows, shape)
}

fn metadata(c: &mut Criterion) {
    let plan = PoolPlan::for_model(
        &DsaModel::deepseek_v32(),
        LayerSet::Target,
        LayoutKind::V2,
        64,
    )
    .unwrap();
    let layout = MetadataLayout::from_plan(&plan).unwrap();
    let dims = MetadataDims {
        max_num_sequences: 272,
        max_blocks_per_seq: 52,
        max_num_tokens: 4096,
        max_context_kv_tokens: 8192,
    };
    let (rows, shape) = batch();
    let reqs: Vec<StepRequest> = rows
        .iter()
        .zip(&shape)
        .map(|(r, &(kind, num_cached, num_new))| StepRequest {
            kind,
            block_slots: r,
            row: dsa_kv::core::RowStamp::UNKNOWN,
            num_cached,
            num_new,
            helix_inactive: false,
        })
        .collect();
    let mut meta = StepMetadata::new(layout, dims, None, true).unwrap();
    let mut g = c.benchmark_group("metadata");
    g.throughput(Throughput::Elements(260));
    g.bench_function("prepare_256_gen_4_ctx", |b| {
        b.iter(|| black_box(meta.prepare(&layout, &reqs).unwrap()))
    });
    let cached: Vec<u32> = shape.iter().map(|s| s.1).collect();
    g.bench_function("recompute_slot_mappings_260", |b| {
        b.iter(|| meta.recompute_slot_mappings(black_box(&cached)).unwrap())
    });
    g.finish();
}

fn scatter(c: &mut Criterion) {
    const N: usize = 65_536;
    let ix = IndexerPageLayout {
        tokens_per_block: 64,
        data_bytes: 128,
        scale_bytes: 4,
    };
    let pages = N / 64;
    let mut cache = vec![0u8; pages * ix.page_bytes() as usize];
    // Pages in a shuffled order, as a real page table has them.
    let mut order: Vec<u64> = (0..pages as u64).collect();
    let mut x = 7u64;
    for i in (1..order.len()).rev() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        order.swap(i, (x >> 33) as usize % (i + 1));
    }
    let vm: Vec<i64> = (0..N)
        .map(|g| ix.value_offset(order[g / 64], (g % 64) as u32) as i64)
        .collect();
    let sm: Vec<i64> = (0..N)
        .map(|g| ix.scale_offset(order[g / 64], (g % 64) as u32) as i64)
        .collect();
    let values: Vec<u8> = (0..N * 128).map(|i| i as u8).collect();
    let scales: Vec<u8> = (0..N * 4).map(|i| i as u8).collect();
    let mut g = c.benchmark_group("host_ops");
    g.throughput(Throughput::Bytes((N * 132) as u64));
    g.bench_function("indexer_scatter_64k_tokens_132B", |b| {
        b.iter(|| {
            indexer_k_scatter(
                &mut cache,
                &values,
                &scales,
                IndexerMappings {
                    value: &vm,
                    scale: &sm,
                },
                128,
            )
            .unwrap()
        })
    });
    let keys: Vec<bf16> = (0..4096 * 128)
        .map(|i| bf16::from_f32((i % 251) as f32 * 0.01 - 1.2))
        .collect();
    let mut qv = vec![0u8; 4096 * 128];
    let mut qs = vec![0u8; 4096 * 4];
    g.throughput(Throughput::Elements(4096));
    g.bench_function("quantize_fp8_4k_tokens", |b| {
        b.iter(|| {
            for t in 0..4096 {
                quantize_fp8_token(
                    &keys[t * 128..(t + 1) * 128],
                    ScaleFormat::Ue8m0,
                    &mut qv[t * 128..(t + 1) * 128],
                    &mut qs[t * 4..(t + 1) * 4],
                );
            }
        })
    });
    g.finish();
}

criterion_group!(benches, metadata, scatter);
criterion_main!(benches);
