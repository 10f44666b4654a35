//! Every kind of invalid input to the public API and the config loader, with the exact
//! error it gets. Each row runs inside `catch_unwind`: a panic fails the table with the
//! row's name, so "none panics" is checked row by row.
//!
//! The runtime rows (unknown request ids through the handle, oversized requests,
//! commits that do not match the step) are at the end, on a live runtime.

use std::panic::{catch_unwind, AssertUnwindSafe};

use dsa_kv::actors::KvCacheBuilder;
use dsa_kv::config::{DsaModel, EngineConfig, LayerSet, ModelPreset, V4Spec};
use dsa_kv::core::scheduler::{RequestOutcome, SubmitRequest};
use dsa_kv::core::{
    quota, KvCacheManager, ManagerOptions, ModelCache, ReuseScope, SeqHandle, SeqOptions,
    SlotAllocator, TierSlots, WindowedSlots,
};
use dsa_kv::ids::{Fence, RequestId, SlotId, TokenId};
use dsa_kv::ids::{PoolGroupId, Tier};
use dsa_kv::layout::{IndexerPageLayout, LayoutKind, PageIndexConverter, PoolPlan, V4Plan};
use dsa_kv::metadata::v4::PageTable;
use dsa_kv::metadata::{MetadataDims, MetadataLayout, RequestKind, StepMetadata, StepRequest};
use dsa_kv::ops::indexer_k::{indexer_k_scatter, IndexerMappings};
use dsa_kv::ops::{CopyPlan, GroupCopy};
use dsa_kv::sync::QuotaLedger;
use dsa_kv::v4::{V4Pools, WindowedBackendFactory, WindowedModel};

type Row = (&'static str, Box<dyn FnOnce() -> String>, &'static str);

/// The error of a call that must fail.
fn err<T: std::fmt::Debug, E: std::fmt::Display>(r: Result<T, E>) -> String {
    match r {
        Ok(v) => format!("<accepted: {v:?}>"),
        Err(e) => e.to_string(),
    }
}

fn manager() -> KvCacheManager {
    let model = DsaModel::deepseek_v32();
    let plan = PoolPlan::for_model(&model, LayerSet::Target, LayoutKind::V2, 64).unwrap();
    let slots = quota::slots_for_budget(&plan, 64 << 20) as u32;
    KvCacheManager::new(
        plan,
        TierSlots {
            gpu: vec![slots],
            host: vec![],
        },
        ManagerOptions::default(),
    )
    .unwrap()
}

fn toks(n: u32) -> Vec<TokenId> {
    (0..n).map(TokenId).collect()
}

fn layout() -> MetadataLayout {
    MetadataLayout {
        tokens_per_block: 64,
        indexer_page_scale: 1,
        indexer: Some(IndexerPageLayout {
            tokens_per_block: 64,
            data_bytes: 128,
            scale_bytes: 4,
        }),
    }
}

fn dims() -> MetadataDims {
    MetadataDims {
        max_num_sequences: 2,
        max_blocks_per_seq: 2,
        max_num_tokens: 16,
        max_context_kv_tokens: 128,
    }
}

fn rows() -> Vec<Row> {
    vec![
        // ---- model specs and layouts -------------------------------------------------
        (
            "model: zero kv_lora_rank",
            Box::new(|| {
                let mut s = DsaModel::deepseek_v32().spec().clone();
                s.kv_lora_rank = 0;
                err(DsaModel::new(s))
            }),
            "kv_lora_rank = 0 is invalid: must be a positive multiple of 128 (FP8 tiles of 128 values)",
        ),
        (
            "model: index_head_dim not 128",
            Box::new(|| {
                let mut s = DsaModel::deepseek_v32().spec().clone();
                s.index_head_dim = 96;
                err(DsaModel::new(s))
            }),
            "index_head_dim = 96 is invalid: the indexer scatter/gather kernels take 128-dim keys (128 B FP8 or 64 B FP4 payload plus a 4-byte scale)",
        ),
        (
            "layout: tokens_per_block 32 for DSA",
            Box::new(|| {
                err(PoolPlan::for_model(
                    &DsaModel::deepseek_v32(),
                    LayerSet::Target,
                    LayoutKind::V2,
                    32,
                ))
            }),
            "tokens_per_block must be 64 for DSA (got 32): the DeepGEMM paged indexer-logits kernel and FlashMLA read 64-token pages, and the MLA and indexer caches share one block table; set tokens_per_block: 64",
        ),
        // ---- config loader ------------------------------------------------------------
        (
            "config: malformed TOML",
            Box::new(|| err(EngineConfig::from_toml_str("[kv_cache\nmax_tokens = 1"))),
            "invalid config <toml>: TOML parse error at line 1, column 10",
        ),
        (
            "config: unknown field",
            Box::new(|| err(EngineConfig::from_toml_str("[kv_cache]\nmax_tokenz = 1\n"))),
            "invalid config <toml>: TOML parse error at line 2, column 1",
        ),
        (
            "config: wrong type",
            Box::new(|| err(EngineConfig::from_toml_str("[kv_cache]\nmax_tokens = \"lots\"\n"))),
            "invalid config <toml>: TOML parse error at line 2, column 14",
        ),
        (
            "config: malformed JSON",
            Box::new(|| err(EngineConfig::from_json_str("{\"kv_cache\": {"))),
            "invalid config <json>: kv_cache: EOF while parsing an object at line 1 column 14",
        ),
        (
            "config: unknown field (JSON)",
            Box::new(|| err(EngineConfig::from_json_str("{\"kv_cache\": {\"max_tokenz\": 1}}"))),
            "invalid config <json>: kv_cache.max_tokenz: unknown field `max_tokenz`, expected one of `tokens_per_block`, `use_kv_cache_manager_v2`, `free_gpu_memory_fraction`, `max_tokens`, `max_gpu_total_bytes`, `host_cache_size`, `enable_block_reuse`, `enable_partial_reuse`, `max_util_for_resume` at line 1 column 26",
        ),
        (
            "config: wrong type (JSON)",
            Box::new(|| {
                err(EngineConfig::from_json_str(
                    "{\"kv_cache\": {\"max_tokens\": \"lots\"}}",
                ))
            }),
            "invalid config <json>: kv_cache.max_tokens: invalid type: string \"lots\", expected u64 at line 1 column 34",
        ),
        (
            "config: YAML nested 100,000 deep",
            Box::new(|| err(EngineConfig::from_yaml_str(&"[".repeat(100_000)))),
            "invalid config <yaml>: nested too deeply at line 1: indentation, entries and brackets count 100000, past the limit of 64 (an engine configuration is three levels deep)",
        ),
        (
            "config: a file that is a character device",
            Box::new(|| err(EngineConfig::from_file("/dev/zero"))),
            "cannot read config file /dev/zero: not a regular file (a character device): name the file itself",
        ),
        (
            "config: malformed YAML",
            Box::new(|| err(EngineConfig::from_yaml_str("kv_cache: {max_tokens: 1"))),
            "invalid config <yaml>: did not find expected ',' or '}' at line 2 column 1, while parsing a flow mapping at line 1 column 11",
        ),
        (
            "config: unknown field (YAML)",
            Box::new(|| err(EngineConfig::from_yaml_str("kv_cache:\n  max_tokenz: 1\n"))),
            "invalid config <yaml>: kv_cache: unknown field `max_tokenz`, expected one of `tokens_per_block`, `use_kv_cache_manager_v2`, `free_gpu_memory_fraction`, `max_tokens`, `max_gpu_total_bytes`, `host_cache_size`, `enable_block_reuse`, `enable_partial_reuse`, `max_util_for_resume` at line 2 column 3",
        ),
        (
            "config: wrong type (YAML)",
            Box::new(|| err(EngineConfig::from_yaml_str("kv_cache:\n  max_tokens: lots\n"))),
            "invalid config <yaml>: kv_cache.max_tokens: invalid type: string \"lots\", expected u64 at line 2 column 15",
        ),
        (
            "config: tokens_per_block 16",
            Box::new(|| {
                let c = EngineConfig::from_toml_str("[kv_cache]\ntokens_per_block = 16\n").unwrap();
                err(c.resolve())
            }),
            "kv_cache.tokens_per_block = 16 is invalid: must be 64 for DSA: the DeepGEMM paged indexer-logits kernel and FlashMLA read 64-token pages",
        ),
        (
            "config: missing file",
            Box::new(|| err(EngineConfig::from_file("/nonexistent/dsa-kv.toml"))),
            "cannot read config file /nonexistent/dsa-kv.toml: No such file or directory (os error 2)",
        ),
        // ---- cache manager ------------------------------------------------------------
        (
            "manager: unknown request id",
            Box::new(|| err(manager().sequence(RequestId(404)))),
            "unknown request 404: it was never created here or has been closed",
        ),
        (
            "manager: duplicate request id",
            Box::new(|| {
                let mut m = manager();
                // Held: a dropped handle closes its sequence, and the id is free again.
                let _first = m
                    .create(RequestId(1), ReuseScope::SHARED, &toks(8), SeqOptions::default())
                    .unwrap();
                err(m.create(RequestId(1), ReuseScope::SHARED, &toks(8), SeqOptions::default()))
            }),
            "request 1 already exists: close it first or use another id",
        ),
        (
            "manager: out-of-range token id",
            Box::new(|| {
                let mut p = toks(4);
                p[2] = TokenId(u32::MAX);
                err(manager().create(RequestId(1), ReuseScope::SHARED, &p, SeqOptions::default()))
            }),
            "token 2 has id 4294967295, above the largest supported id 2147483647 (ids are encoded as 31-bit values)",
        ),
        (
            "manager: priority above 100",
            Box::new(|| {
                err(manager().create(
                    RequestId(1),
                    ReuseScope::SHARED,
                    &toks(4),
                    SeqOptions { priority: 101 },
                ))
            }),
            "priority = 101 is invalid: eviction priorities are 0..=100",
        ),
        (
            "manager: history going backwards",
            Box::new(|| {
                let mut m = manager();
                let s = m
                    .create(RequestId(1), ReuseScope::SHARED, &toks(8), SeqOptions::default())
                    .unwrap()
                    .handle;
                m.resume(&s).unwrap();
                m.resize(&s, 100, 50).unwrap();
                err(m.resize(&s, 100, 40))
            }),
            "request 1: history may not go backwards (50 → 40)",
        ),
        (
            "manager: capacity below history",
            Box::new(|| {
                let mut m = manager();
                let s = m
                    .create(RequestId(1), ReuseScope::SHARED, &toks(8), SeqOptions::default())
                    .unwrap()
                    .handle;
                m.resume(&s).unwrap();
                err(m.resize(&s, 10, 20))
            }),
            "request 1: capacity 10 is below history 20; capacity must cover every token already processed",
        ),
        (
            "manager: resize while suspended",
            Box::new(|| {
                let mut m = manager();
                let s = m
                    .create(RequestId(1), ReuseScope::SHARED, &toks(8), SeqOptions::default())
                    .unwrap()
                    .handle;
                err(m.resize(&s, 64, 0))
            }),
            "request 1 is Suspended: resume it before resizing",
        ),
        (
            "manager: commit beyond capacity",
            Box::new(|| {
                let mut m = manager();
                let s = m
                    .create(RequestId(1), ReuseScope::SHARED, &toks(8), SeqOptions::default())
                    .unwrap()
                    .handle;
                m.resume(&s).unwrap();
                m.resize(&s, 4, 0).unwrap();
                err(m.commit(&s, &toks(8)))
            }),
            "request 1: committing 8 tokens would make 8 committed tokens, above capacity 4; resize first (only tokens whose KV was written can be committed)",
        ),
        (
            "manager: request longer than the whole cache",
            Box::new(|| {
                let mut m = manager();
                let s = m
                    .create(RequestId(1), ReuseScope::SHARED, &toks(8), SeqOptions::default())
                    .unwrap()
                    .handle;
                m.resume(&s).unwrap();
                err(m.resize(&s, 10_000_000, 0))
            }),
            "request 1 needs 156250 blocks (10000000 tokens) but pool group 0 holds only 24 blocks (1536 tokens) on the GPU: raise the KV budget or shorten the request",
        ),
        (
            "manager: completing a fence never issued",
            Box::new(|| err(manager().complete_fences(Fence(99)))),
            "fence Fence(99) completed but only Fence(0) was issued",
        ),
        (
            "manager: a handle used on another manager",
            Box::new(|| {
                let mut a = manager();
                let mut b = manager();
                let s = a
                    .create(RequestId(1), ReuseScope::SHARED, &toks(8), SeqOptions::default())
                    .unwrap()
                    .handle;
                b.create(RequestId(1), ReuseScope::SHARED, &toks(8), SeqOptions::default())
                    .unwrap();
                err(b.resume(&s))
            }),
            "the handle of request 1 belongs to another cache manager",
        ),
        // ---- slots, quota --------------------------------------------------------------
        (
            "slots: double release",
            Box::new(|| {
                let mut a = SlotAllocator::new(4);
                let s = a.allocate(Fence::NONE).unwrap().slot;
                a.release(s, Fence::NONE).unwrap();
                err(a.release(s, Fence::NONE))
            }),
            "slot 0 is not in use: it was released twice or never allocated",
        ),
        (
            "slots: release of a slot outside the pool",
            Box::new(|| err(SlotAllocator::new(4).release(SlotId(9), Fence::NONE))),
            "slot 9 is out of range (capacity 4)",
        ),
        (
            "quota: over-commit",
            Box::new(|| {
                let q = QuotaLedger::new(100);
                q.try_reserve("target", 80).unwrap();
                err(q.try_reserve("draft", 30))
            }),
            "draft needs 30 bytes but only 20 of the 100-byte KV budget are left: lower max_tokens or the draft cache size, or raise the budget",
        ),
        (
            "quota: double release",
            Box::new(|| {
                let q = QuotaLedger::new(100);
                q.try_reserve("target", 80).unwrap();
                q.release(80).unwrap();
                err(q.release(80))
            }),
            "releasing 80 bytes but only 0 are reserved (released twice?)",
        ),
        // ---- metadata and ops -------------------------------------------------------------
        (
            "metadata: more requests than max_num_sequences",
            Box::new(|| {
                let mut m = StepMetadata::new(layout(), dims(), None, true).unwrap();
                let slots = [1];
                let r = StepRequest {
                    kind: RequestKind::Generation,
                    block_slots: &slots,
                    row: dsa_kv::core::RowStamp::UNKNOWN,
                    num_cached: 3,
                    num_new: 1,
                    helix_inactive: false,
                };
                err(m.prepare(&layout(), &[r, r, r]))
            }),
            "3 requests in one step, but the buffers hold 2: raise max_num_sequences",
        ),
        (
            "metadata: stale draft snapshot",
            Box::new(|| {
                let mut m = StepMetadata::new(layout(), dims(), Some(dims()), true).unwrap();
                let slots = [1];
                let r = [StepRequest {
                    kind: RequestKind::Generation,
                    block_slots: &slots,
                    row: dsa_kv::core::RowStamp::UNKNOWN,
                    num_cached: 3,
                    num_new: 1,
                    helix_inactive: false,
                }];
                m.prepare(&layout(), &r).unwrap();
                let old = m.prepare_draft(&layout(), &r).unwrap();
                m.restore(&old).unwrap();
                m.prepare_draft(&layout(), &r).unwrap();
                err(m.restore(&old))
            }),
            "stale draft snapshot (replay 1, active replay 3): restore with the snapshot of the active replay",
        ),
        (
            "metadata: restore outside a replay",
            Box::new(|| {
                let mut m = StepMetadata::new(layout(), dims(), Some(dims()), true).unwrap();
                let slots = [1];
                let r = [StepRequest {
                    kind: RequestKind::Generation,
                    block_slots: &slots,
                    row: dsa_kv::core::RowStamp::UNKNOWN,
                    num_cached: 3,
                    num_new: 1,
                    helix_inactive: false,
                }];
                m.prepare(&layout(), &r).unwrap();
                let snap = m.prepare_draft(&layout(), &r).unwrap();
                m.restore(&snap).unwrap();
                err(m.restore(&snap))
            }),
            "no draft replay is active: nothing to restore",
        ),
        (
            "ops: mapping past the cache",
            Box::new(|| {
                let mut cache = vec![0u8; 8448];
                let maps = IndexerMappings {
                    value: &[8400],
                    scale: &[0],
                };
                err(indexer_k_scatter(&mut cache, &[0; 128], &[0; 4], maps, 128))
            }),
            "token 0: bytes [8400, 8528) are outside the cache (8448 B)",
        ),
        (
            "ops: unsupported payload width",
            Box::new(|| {
                let mut cache = vec![0u8; 8448];
                let maps = IndexerMappings {
                    value: &[0],
                    scale: &[0],
                };
                err(indexer_k_scatter(&mut cache, &[0; 96], &[0; 4], maps, 96))
            }),
            "indexer payload width 96 B is not supported: use 128 (FP8) or 64 (FP4)",
        ),
        (
            "v4: a budget the windows alone exceed",
            Box::new(|| {
                let plan = V4Plan::new(&V4Spec::flash()).unwrap();
                let demand = quota::V4Demand {
                    max_sequences: 256,
                    drafts: 1,
                    max_batched_tokens: 8192,
                    tail_boundaries: 512,
                };
                err(quota::v4_capacity(&plan, 1 << 30, &demand))
            }),
            "the budget of 1073741824 B cannot hold the sliding windows and compressor states for max_sequences = 256 and max_batched_tokens = 8192 (10359930880 B) plus one 256-token block (6291456 B): raise the budget or lower max_sequences or max_batched_tokens",
        ),
        (
            "v4: an impossible layer structure",
            Box::new(|| {
                let spec = V4Spec {
                    compress_ratios: vec![4, 3],
                    ..V4Spec::flash()
                };
                err(V4Plan::new(&spec))
            }),
            "compress_ratios[1] = 3: DeepSeek-V4 layers have ratio 0, 4 or 128",
        ),
        (
            "v4: partial-block reuse asked for",
            Box::new(|| {
                err(ModelCache::windowed(
                    &V4Plan::new(&V4Spec::flash()).unwrap(),
                    v4_slots(vec![8, 200, 100]),
                    ManagerOptions::default(),
                    16,
                )
                .map(|_| ()))
            }),
            "enable_partial_reuse = true is invalid: a model with sliding windows hits only at whole-block boundaries, where every compression group is whole: turn partial reuse off",
        ),
        (
            "v4: window slots for two of three life cycles",
            Box::new(|| {
                err(ModelCache::windowed(
                    &V4Plan::new(&V4Spec::flash()).unwrap(),
                    v4_slots(vec![8, 200]),
                    v4_opts(),
                    16,
                )
                .map(|_| ()))
            }),
            "window slots [8, 200]: give one non-zero count per window life cycle (3 of them)",
        ),
        (
            "v4: an empty prompt",
            Box::new(|| {
                let mut m = v4_cache();
                err(m
                    .create(RequestId(1), ReuseScope::SHARED, &[], SeqOptions::default())
                    .map(|_| ()))
            }),
            "prompt = [] is invalid: a sequence needs at least one prompt token",
        ),
        (
            "v4: suspend",
            Box::new(|| {
                let (mut m, h) = v4_with_request_1();
                err(m.suspend(&h))
            }),
            "request 1: a sequence with sliding windows cannot be suspended (its windows live on the GPU only); preempt it by recompute: close it and create it again",
        ),
        (
            "v4: a commit beyond the capacity",
            Box::new(|| {
                let (mut m, h) = v4_with_request_1();
                m.resume(&h).unwrap();
                err(m.commit(&h, &toks(10)))
            }),
            "request 1: committing 10 tokens would make 10 committed tokens, above capacity 0; resize first (only tokens whose KV was written can be committed)",
        ),
        (
            "v4: a window life cycle past the specs",
            Box::new(|| {
                let (m, _h) = v4_with_request_1();
                err(m.windows().unwrap().page_table(RequestId(1), 7))
            }),
            "window life cycle 7 does not exist: there are 3",
        ),
        (
            "v4: a prefix transfer on a model without windows",
            Box::new(|| {
                let mut m = ModelCache::new(manager());
                err(m.export_prefix(RequestId(1), ReuseScope::SHARED, &toks(300)))
            }),
            "transfer 1: prefix transfers with window tails need a model with sliding windows: move blocks through the scheduler's transfers",
        ),
        (
            "v4 metadata: a position the table does not hold",
            Box::new(|| {
                let slots = [SlotId(3)];
                let table = PageTable {
                    start: 128,
                    slots: &slots,
                    page: 64,
                };
                let unit = PageIndexConverter {
                    scale: 1,
                    layer_offset: 0,
                    expansion: 1,
                };
                err(table.row(unit, 100))
            }),
            "position 100 is not held by the table (it holds [128, 192)): the rings were not extended for this step, or the position lies behind the window",
        ),
        (
            "v4 scheduler: a prompt longer than the GPU blocks hold",
            Box::new(|| {
                let mut s = v4_scheduler();
                err(s.submit(SubmitRequest::new(RequestId(1), toks(3000), 1)))
            }),
            "request 1: the prompt's 3000 tokens exceed the 2048 tokens the GPU blocks hold even with nothing else running: give the cache more GPU memory or send a shorter prompt",
        ),
        (
            "v4 scheduler: an outcome for a request the step did not run",
            Box::new(|| {
                let mut s = v4_scheduler();
                s.submit(SubmitRequest::new(RequestId(1), toks(10), 2)).unwrap();
                s.schedule(&Default::default()).unwrap();
                err(s.commit(&[RequestOutcome {
                    id: RequestId(5),
                    accepted_drafts: 0,
                    next_token: Some(TokenId(1)),
                }]))
            }),
            "request 5 was not part of step 1",
        ),
        (
            "v4 runtime: drafts at least the token budget",
            Box::new(|| {
                let mut c = EngineConfig::default();
                c.kv_cache.max_gpu_total_bytes = Some(64 << 20);
                c.scheduler.max_num_tokens = 4;
                c.spec_decode.mode = dsa_kv::config::SpecMode::Mtp;
                c.spec_decode.draft_tokens = 4;
                err(start_v4(c, None))
            }),
            "spec_decode.draft_tokens = 4 is invalid: a decode step carries 1 + drafts tokens: keep drafts below scheduler.max_num_tokens",
        ),
        (
            "v4 runtime: a V4 preset in the configuration with a DSA forward",
            Box::new(|| {
                let mut c = EngineConfig::from_toml_str("[model]\npreset = \"deepseek-v4-flash\"\n").unwrap();
                c.kv_cache.max_gpu_total_bytes = Some(64 << 20);
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .build()
                    .unwrap();
                use dsa_kv::device::forward::{Forward, ForwardError, ForwardSetup};
                let dsa: dsa_kv::device::forward::ForwardFactory = std::sync::Arc::new(
                    |_: &ForwardSetup<'_>| -> Result<Box<dyn Forward>, ForwardError> {
                        unreachable!("refused before any device is built")
                    },
                );
                err(rt.block_on(KvCacheBuilder::new().config(c).forward(dsa).start()).map(|_| ()))
            }),
            "model.preset = deepseek-v4-flash is invalid: a model with sliding windows runs on windowed devices, not on a DSA backend or forward: give them with KvCacheBuilder::windowed_backend",
        ),
        (
            "v4 runtime: no budget",
            Box::new(|| err(start_v4(EngineConfig::default(), None))),
            "no GPU budget: set max_gpu_total_bytes or max_tokens, or provide the free GPU memory so that free_gpu_memory_fraction can apply",
        ),
        (
            "v4 runtime: no devices",
            Box::new(|| {
                let mut c = EngineConfig::default();
                c.kv_cache.max_gpu_total_bytes = Some(64 << 20);
                err(start_v4(c, Some(0)))
            }),
            "no device is left: restart the runtime",
        ),
        (
            "v4 device: a copy past the pools",
            Box::new(|| {
                let plan = V4Plan::new(&V4Spec::flash()).unwrap();
                let mut p = V4Pools::new(&plan, &v4_slots(vec![8, 200, 100])).unwrap();
                err(p.apply(&[CopyPlan {
                    fence: Fence(1),
                    wait_for: Fence(0),
                    copies: vec![GroupCopy {
                        pool_group: PoolGroupId(0),
                        src_tier: Tier::Gpu,
                        dst_tier: Tier::Gpu,
                        pairs: vec![(SlotId(0), SlotId(8))],
                    }],
                }]))
            }),
            "windowed pool copy: copy SlotId(0) → SlotId(8) (Gpu → Gpu) is past the pools",
        ),
        (
            "v4 device: pools without a slot count for a window life cycle",
            Box::new(|| {
                let plan = V4Plan::new(&V4Spec::flash()).unwrap();
                err(V4Pools::new(&plan, &v4_slots(vec![8])).map(|_| ()))
            }),
            "windowed pools: no slot count for the state4 life cycle: give WindowedSlots one per window life cycle",
        ),
        (
            "config: DSA dimensions of a DeepSeek-V4 preset",
            Box::new(|| err(ModelPreset::DeepSeekV4Pro.spec(None))),
            "deepseek-v4-pro is a DeepSeek-V4 model (sliding windows, compressed caches): it has no DSA dimensions; its structure is `ModelConfig::windowed_spec` / `V4Preset::spec`, and the runtime serves it with `KvCacheBuilder::windowed_backend` (`plan --model deepseek-v4-pro`, `serve --model deepseek-v4-pro`)",
        ),
    ]
}

fn v4_slots(windows: Vec<u32>) -> WindowedSlots {
    WindowedSlots {
        blocks: TierSlots {
            gpu: vec![8],
            host: vec![],
        },
        windows,
    }
}

fn v4_opts() -> ManagerOptions {
    ManagerOptions {
        enable_partial_reuse: false,
        ..ManagerOptions::default()
    }
}

fn v4_cache() -> ModelCache {
    ModelCache::windowed(
        &V4Plan::new(&V4Spec::flash()).unwrap(),
        v4_slots(vec![8, 200, 100]),
        v4_opts(),
        16,
    )
    .unwrap()
}

/// A windowed cache holding request 1 (10 prompt tokens, not resumed).
fn v4_with_request_1() -> (ModelCache, SeqHandle) {
    let mut m = v4_cache();
    let c = m
        .create(
            RequestId(1),
            ReuseScope::SHARED,
            &toks(10),
            SeqOptions::default(),
        )
        .unwrap();
    (m, c.handle)
}

fn v4_scheduler() -> dsa_kv::core::scheduler::Scheduler {
    let limits = dsa_kv::core::scheduler::SchedulerLimits {
        max_num_sequences: 4,
        max_num_tokens: 512,
        max_prefill_chunk: 256,
        max_seq_len: 8192,
        draft_tokens: 0,
        livelock_steps: 8,
        max_context_kv_tokens: 1 << 20,
        transfer_lease: std::time::Duration::from_secs(60),
    };
    dsa_kv::core::scheduler::Scheduler::new(v4_cache(), None, limits)
}

/// Starts a windowed runtime over DeepSeek-V4-Flash's structure with `config` (devices
/// that are never built when the start is refused first).
fn start_v4(
    config: EngineConfig,
    devices: Option<usize>,
) -> Result<(), dsa_kv::actors::RuntimeError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let backend: WindowedBackendFactory =
        std::sync::Arc::new(|_, _| panic!("no device is built for a refused start"));
    let mut b = KvCacheBuilder::new()
        .config(config)
        .windowed(WindowedModel::new(V4Spec::flash(), backend));
    if let Some(n) = devices {
        b = b.host_devices(n);
    }
    rt.block_on(async move { b.start().await.map(|_| ()) })
}

#[test]
fn every_invalid_input_gets_its_error_and_nothing_panics() {
    let mut failures = Vec::new();
    let mut n = 0;
    for (name, f, want) in rows() {
        assert!(!want.is_empty(), "{name}: no expected error");
        n += 1;
        match catch_unwind(AssertUnwindSafe(f)) {
            Err(_) => failures.push(format!("{name}: PANICKED")),
            Ok(got) if got.starts_with("<accepted") => {
                failures.push(format!("{name}: accepted ({got})"))
            }
            // Multi-line errors (parse errors quote the input) are compared on their
            // first line.
            Ok(got) if got.lines().next() != Some(want) => {
                failures.push(format!("{name}:\n    got  {got:?}\n    want {want:?}"))
            }
            Ok(got) => eprintln!("{name}: {got}"),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {n} rows:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn runtime_config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.kv_cache.max_tokens = Some(4096);
    c.scheduler.max_seq_len = 1024;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runtime_refuses_bad_requests_with_errors() {
    let kv = KvCacheBuilder::new()
        .config(runtime_config())
        .host_devices(1)
        .start()
        .await
        .unwrap();
    let submit = |id: u64, prompt: Vec<TokenId>, max_new: u32| SubmitRequest {
        id: RequestId(id),
        scope: ReuseScope::SHARED,
        prompt,
        max_new_tokens: max_new,
        priority: 35,
    };
    let mut got = Vec::new();
    got.push(err(kv.submit(submit(1, vec![], 4)).await));
    got.push(err(kv.submit(submit(2, toks(8), 0)).await));
    got.push(err(kv.submit(submit(3, toks(2000), 4)).await));
    got.push(err(kv.submit(submit(4, vec![TokenId(u32::MAX)], 4)).await));
    kv.submit(submit(5, toks(8), 4)).await.unwrap();
    got.push(err(kv.submit(submit(5, toks(8), 4)).await));
    got.push(err(kv.cancel(RequestId(404)).await));
    got.push(err(kv.suspend(RequestId(404)).await));
    got.push(err(kv.commit(vec![]).await));
    let step = kv.step(dsa_kv::actors::Drafts::none()).await.unwrap();
    assert_eq!(step.scheduled.len(), 1);
    got.push(err(kv
        .commit(vec![RequestOutcome {
            id: RequestId(404),
            accepted_drafts: 0,
            next_token: Some(TokenId(1)),
        }])
        .await));
    got.push(err(kv.step(dsa_kv::actors::Drafts::none()).await));
    // The refused step changed nothing: the pending one is still there to commit.
    assert_eq!(kv.pending_step().await.unwrap(), Some(step));
    for g in &got {
        eprintln!("{g}");
        assert!(!g.starts_with("<accepted"), "accepted: {g}");
    }
    let want = [
        "request 1 has an empty prompt",
        "request 2: max_new_tokens must be at least 1",
        "request 3: prompt 2000 + 4 new tokens exceeds max_seq_len 1024",
        "token 0 has id 4294967295, above the largest supported id 2147483647 (ids are encoded as 31-bit values)",
        "request 5 already exists: close it first or use another id",
        "unknown request 404: it was never created here or has been closed",
        "unknown request 404: it was never created here or has been closed",
        "no step to commit",
        "request 404 was not part of step 1",
        "step 1 is not committed yet: commit its outcome before scheduling the next step \
         (a client that lost the step's report gets it again from `pending_step`)",
    ];
    // One name per refusal, in the order `got` was filled.
    let names = [
        "submit: empty prompt",
        "submit: max_new_tokens 0",
        "submit: prompt past max_seq_len",
        "submit: token id past TokenId::MAX",
        "submit: duplicate id",
        "cancel: unknown request",
        "suspend: unknown request",
        "commit: no step",
        "commit: request not in the step",
        "step: previous step not committed",
    ];
    assert_eq!((got.len(), want.len()), (names.len(), names.len()));
    for ((name, got), want) in names.iter().zip(&got).zip(want) {
        assert_eq!(got, want, "{name}");
    }
    // The runtime keeps serving after every refusal.
    let counts = kv.check_invariants().await.unwrap();
    assert!(counts.live_sequences <= 1);
    kv.shutdown().await;
}

/// A commit with one bad outcome among good ones, and a step with a bad draft token, are
/// refused whole with a typed error and change nothing: the step stays pending with the
/// same report, a corrected commit then lands, and every request finishes. Before the
/// fix a `next_token` past `TokenId::MAX` was accepted and failed the *next* commit
/// halfway (earlier requests committed, the failing one's step lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_outcome_refuses_the_whole_commit_and_changes_nothing() {
    let mut c = runtime_config();
    c.spec_decode.mode = dsa_kv::config::SpecMode::Mtp;
    c.spec_decode.draft_tokens = 2;
    let kv = KvCacheBuilder::new().config(c).start().await.unwrap();
    for id in 1..=3 {
        kv.submit(SubmitRequest {
            id: RequestId(id),
            scope: ReuseScope::SHARED,
            prompt: toks(40 + id as u32),
            max_new_tokens: 3,
            priority: 35,
        })
        .await
        .unwrap();
    }
    let good = |s: &dsa_kv::actors::StepReport| -> Vec<RequestOutcome> {
        s.scheduled
            .iter()
            .map(|r| RequestOutcome {
                id: r.id,
                accepted_drafts: 0,
                next_token: r.produces_token.then_some(TokenId(5)),
            })
            .collect()
    };
    let step = kv.step(dsa_kv::actors::Drafts::none()).await.unwrap();
    assert_eq!(step.scheduled.len(), 3);
    let before = kv.stats().await.unwrap();
    let mut got = Vec::new();
    let mut bad = good(&step);
    bad[1].next_token = Some(TokenId(u32::MAX));
    got.push(err(kv.commit(bad).await));
    let mut twice = good(&step);
    twice.push(twice[0].clone());
    got.push(err(kv.commit(twice).await));
    assert_eq!(
        got,
        [
            "request 2: next_token 4294967295 is above the largest token id 2147483647",
            "request 1: two outcomes for one request",
        ]
    );
    // Nothing changed: the same step is pending, the counters did not move.
    assert_eq!(kv.pending_step().await.unwrap(), Some(step.clone()));
    let after = kv.stats().await.unwrap();
    assert_eq!(
        (
            after.scheduler.steps,
            after.scheduler.prefill_tokens,
            after.scheduler.decode_tokens,
            after.scheduler.finished
        ),
        (
            before.scheduler.steps,
            before.scheduler.prefill_tokens,
            before.scheduler.decode_tokens,
            before.scheduler.finished
        )
    );
    kv.commit(good(&step)).await.unwrap();
    // A draft token past the range: the step is refused before anything is planned.
    let drafts: dsa_kv::actors::Drafts = [(RequestId(3), vec![TokenId(9), TokenId(u32::MAX)])]
        .into_iter()
        .collect();
    assert_eq!(
        err(kv.step(drafts).await),
        "request 3: draft token 4294967295 is above the largest token id 2147483647"
    );
    assert_eq!(kv.pending_step().await.unwrap(), None);
    // And serving goes on to the end.
    for _ in 0..10 {
        let s = kv.step(dsa_kv::actors::Drafts::none()).await.unwrap();
        if s.scheduled.is_empty() {
            break;
        }
        kv.commit(good(&s)).await.unwrap();
    }
    assert_eq!(kv.counters().in_flight, 0);
    assert_eq!(kv.check_invariants().await.unwrap().live_sequences, 0);
    kv.shutdown().await;
}

/// Extreme limits — in the configuration and in the builder — are typed errors naming
/// the field, returned before anything is allocated from them. Before the fix (run in a
/// debug build, as CI now does): `max_seq_len = u32::MAX` panicked on an overflow,
/// `max_seq_len = 1e9`, `max_num_sequences = u32::MAX` and `max_num_tokens = u32::MAX`
/// aborted the process on a failed allocation of 16 GB to 8.8 TB, `max_tokens =
/// u64::MAX` panicked on an overflow, and `tp_size = 10^6` started allocating a
/// million devices' pools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_limits_are_typed_errors_before_any_allocation() {
    type Edit = Box<dyn Fn(&mut EngineConfig)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "config: max_seq_len u32::MAX",
            Box::new(|c| c.scheduler.max_seq_len = u32::MAX),
            "scheduler.max_seq_len = 4294967295 is invalid: must be at most 16777216",
        ),
        (
            "config: max_seq_len 2^24 with 256 sequences",
            Box::new(|c| c.scheduler.max_seq_len = 1 << 24),
            "scheduler.max_seq_len = 16777216 is invalid: with scheduler.max_num_sequences = 256 \
             the page tables would hold 67109120 entries each",
        ),
        (
            "config: max_seq_len 2^24 with 2^16 sequences",
            Box::new(|c| {
                c.scheduler.max_seq_len = 1 << 24;
                c.scheduler.max_num_sequences = 1 << 16;
            }),
            "scheduler.max_seq_len = 16777216 is invalid: with scheduler.max_num_sequences = \
             65536 the page tables would hold 17179934720 entries each",
        ),
        (
            "config: max_num_sequences u32::MAX",
            Box::new(|c| c.scheduler.max_num_sequences = u32::MAX),
            "scheduler.max_num_sequences = 4294967295 is invalid: must be at most 65536",
        ),
        (
            "config: max_num_tokens u32::MAX",
            Box::new(|c| c.scheduler.max_num_tokens = u32::MAX),
            "scheduler.max_num_tokens = 4294967295 is invalid: must be at most 4194304",
        ),
        (
            "config: max_prefill_chunk u32::MAX",
            Box::new(|c| c.scheduler.max_prefill_chunk = u32::MAX),
            "scheduler.max_prefill_chunk = 4294967295 is invalid: must be at most 4194304",
        ),
        (
            "config: kv_cache.max_tokens u64::MAX",
            Box::new(|c| c.kv_cache.max_tokens = Some(u64::MAX)),
            "kv_cache.max_tokens = 18446744073709551615 is invalid: must be at most \
             1099511627776 tokens",
        ),
        (
            "config: host_cache_size u64::MAX",
            Box::new(|c| c.kv_cache.host_cache_size = Some(u64::MAX)),
            "host_cache_size = 18446744073709551615 B would make",
        ),
        (
            "config: tp_size 10^6",
            Box::new(|c| c.parallel.tp_size = 1_000_000),
            "parallel.tp_size = 1000000 is invalid: must be at most 128",
        ),
        (
            "config: cp_size u32::MAX",
            Box::new(|c| c.parallel.cp_size = u32::MAX),
            "parallel.cp_size = 4294967295 is invalid: must be at most 1024",
        ),
    ];
    for (name, edit, want) in cases {
        let mut c = runtime_config();
        edit(&mut c);
        let got = match KvCacheBuilder::new().config(c).start().await {
            Ok(kv) => {
                kv.shutdown().await;
                "<started>".to_string()
            }
            Err(e) => e.to_string(),
        };
        assert!(
            got.starts_with(want),
            "{name}:\n    got  {got}\n    want {want}…"
        );
    }
    type Builder = fn() -> KvCacheBuilder;
    let builders: Vec<(&str, Builder, String)> = vec![
        (
            "builder: host_devices 2^20",
            || KvCacheBuilder::new().host_devices(1 << 20),
            "KvCacheBuilder::host_devices(1048576) is too large: at most 128".into(),
        ),
        (
            "builder: event_stream_capacity usize::MAX",
            || KvCacheBuilder::new().event_stream_capacity(usize::MAX),
            format!(
                "KvCacheBuilder::event_stream_capacity({}) is too large: at most 1048576",
                usize::MAX
            ),
        ),
        (
            "builder: device_mailbox 2^30",
            || KvCacheBuilder::new().device_mailbox(1 << 30),
            "KvCacheBuilder::device_mailbox(1073741824) is too large: at most 65536".into(),
        ),
    ];
    for (name, builder, want) in builders {
        let got = match builder().config(runtime_config()).start().await {
            Ok(kv) => {
                kv.shutdown().await;
                "<started>".to_string()
            }
            Err(e) => e.to_string(),
        };
        assert_eq!(got, want, "{name}");
    }
}
