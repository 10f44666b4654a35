//! Core benchmarks (criterion): slot allocation, prefix matching, and the per-step work
//! of a decode batch with draft tokens. Results and the command are in BENCHMARKS.md.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use dsa_kv::config::{DsaModel, LayerSet};
use dsa_kv::core::{
    KvCacheManager, ManagerOptions, ReuseScope, SeqHandle, SeqOptions, SlotAllocator, TierSlots,
};
use dsa_kv::ids::{Fence, LifeCycleId, RequestId, TokenId};
use dsa_kv::layout::{LayoutKind, PoolPlan};

fn v32_manager(gpu_slots: u32) -> KvCacheManager {
    let plan = PoolPlan::for_model(
        &DsaModel::deepseek_v32(),
        LayerSet::Target,
        LayoutKind::V2,
        64,
    )
    .unwrap();
    KvCacheManager::new(
        plan,
        TierSlots {
            gpu: vec![gpu_slots],
            host: vec![],
        },
        ManagerOptions::default(),
    )
    .unwrap()
}

fn alloc_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("slot_allocator");
    g.throughput(Throughput::Elements(64));
    g.bench_function("alloc_free_64", |b| {
        let mut a = SlotAllocator::new(100_000);
        let mut out = Vec::with_capacity(64);
        b.iter(|| {
            out.clear();
            a.allocate_many(64, Fence::NONE, &mut out).unwrap();
            for g in &out {
                a.release(g.slot, Fence::NONE).unwrap();
            }
            black_box(&out);
        })
    });
    g.finish();
}

fn prefix_match(c: &mut Criterion) {
    let mut m = v32_manager(1024);
    let prompt: Vec<TokenId> = (0..32_768u32)
        .map(|i| TokenId(i.wrapping_mul(2_654_435_761) % 150_000))
        .collect();
    let mut h = m
        .create(
            RequestId(1),
            ReuseScope::SHARED,
            &prompt,
            SeqOptions::default(),
        )
        .unwrap()
        .handle;
    assert!(m.resume(&h).unwrap());
    assert!(m.resize(&h, prompt.len() as u64, 0).unwrap());
    m.commit(&h, &prompt).unwrap();
    m.close(&mut h).unwrap();
    let mut query = prompt.clone();
    query.push(TokenId(7));
    assert_eq!(m.probe_reuse(ReuseScope::SHARED, &query).unwrap(), 32_768);
    let mut g = c.benchmark_group("prefix");
    g.throughput(Throughput::Elements(32_768));
    g.bench_function("probe_32k_tokens", |b| {
        b.iter(|| {
            black_box(
                m.probe_reuse(ReuseScope::SHARED, black_box(&query))
                    .unwrap(),
            )
        })
    });
    // Creation holds the 512 matched pages; closing releases them (both timed).
    g.bench_function("create_close_32k_tokens", |b| {
        b.iter(|| {
            let mut c = m
                .create(
                    RequestId(2),
                    ReuseScope::SHARED,
                    &query,
                    SeqOptions::default(),
                )
                .unwrap();
            m.close(&mut c.handle).unwrap();
        })
    });
    g.finish();
}

struct Batch {
    m: KvCacheManager,
    seqs: Vec<(SeqHandle, u64)>,
    table: Vec<i32>,
    max_blocks: usize,
}

fn decode_batch() -> Batch {
    let mut m = v32_manager(16_384);
    let mut seqs = Vec::new();
    let mut x = 12345u64;
    for i in 0..256u64 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        let len = 1000 + (x >> 33) % 2000;
        let h = m
            .create(
                RequestId(i),
                ReuseScope::SHARED,
                &[TokenId(i as u32)],
                SeqOptions::default(),
            )
            .unwrap()
            .handle;
        assert!(m.resume(&h).unwrap());
        assert!(m.resize(&h, len, len).unwrap());
        seqs.push((h, len));
    }
    let max_blocks = 3100usize.div_ceil(64).next_multiple_of(4);
    Batch {
        m,
        seqs,
        table: vec![0; 256 * max_blocks],
        max_blocks,
    }
}

/// One decode step: every sequence grows by its target token plus 3 draft tokens,
/// the block table of the batch is built, then the drafts are rejected (capacity back).
fn decode_step(b: &mut Batch) {
    for (h, len) in &b.seqs {
        assert!(b.m.resize(h, len + 4, *len).unwrap());
    }
    for (i, (h, _)) in b.seqs.iter().enumerate() {
        let row = &mut b.table[i * b.max_blocks..(i + 1) * b.max_blocks];
        b.m.write_block_table(h, LifeCycleId(0), row).unwrap();
    }
    for (h, len) in &b.seqs {
        assert!(b.m.resize(h, *len, *len).unwrap());
    }
    black_box(&b.table);
}

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_step");
    g.throughput(Throughput::Elements(256));
    let mut batch = decode_batch();
    g.bench_function("256_seqs_3_drafts", |b| b.iter(|| decode_step(&mut batch)));
    g.bench_function("256_seqs_3_drafts_fresh_state", |b| {
        b.iter_batched_ref(decode_batch, decode_step, BatchSize::LargeInput)
    });
    g.finish();
}

criterion_group!(benches, alloc_free, prefix_match, decode);
criterion_main!(benches);
