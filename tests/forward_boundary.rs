//! A forward the crate did not write for itself, through the public API only: it writes
//! every new token's indexer key (payload and scale word) and MLA row with its own code
//! (host) or its own kernels (GPU), through the batch's slot mappings, and reads every
//! cached token back through the block table and indexer page table, and a sample of
//! tokens through FlashMLA-style global indices (`slot × 64 + offset`). Its bytes are its
//! own: a hash of the token prefix, the position and the layer, so a page shared by two
//! requests reads back the same and a wrong page does not. The workload shares a system
//! prompt, preempts, offloads to the host tier, onboards back and replays MTP drafts
//! against the draft cache.
//!
//! GPU part (`--ignored`): the same forward eagerly and with its decode steps captured in
//! a CUDA graph (batch padded to a bucket; padding rows carry −1 mappings), bytes equal
//! step by step.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dsa_kv::core::scheduler::RequestKind;
use dsa_kv::device::forward::HostMemory;
use dsa_kv::device::{IndexerCacheView, LayerCache};
use dsa_kv::prelude::*;

// ---- the forward's own bytes ------------------------------------------------------------

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The bytes this forward stores for (prefix hash, position, layer, what).
fn fill(prefix: u64, pos: u32, layer: u32, what: u64, out: &mut [u8]) {
    let mut s = mix(prefix ^ mix(u64::from(pos) << 20 ^ u64::from(layer) << 4 ^ what));
    for chunk in out.chunks_mut(8) {
        s = mix(s.wrapping_add(0x9e37_79b9_7f4a_7c15));
        chunk.copy_from_slice(&s.to_le_bytes()[..chunk.len()]);
    }
}

/// Hash of tokens `[0, p]` for every `p`.
fn prefix_hashes(tokens: &[TokenId]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    tokens
        .iter()
        .map(|t| {
            h = mix(h ^ u64::from(t.0));
            h
        })
        .collect()
}

const VALUE: u64 = 1;
const SCALE: u64 = 2;
const ROW: u64 = 3;

/// The metadata addresses of the first step, and the full-KV buffers' own addresses
/// once seen.
type SeenAddrs = (Vec<u64>, Option<(u64, u64)>);

/// What the driver knows and what the forward found.
#[derive(Default)]
struct Shared {
    /// Every committed token of each request (prompt, accepted drafts, sampled tokens).
    history: HashMap<RequestId, Vec<TokenId>>,
    /// Metadata addresses seen first, per phase (and the full-KV buffers' own): they
    /// must never change.
    addrs: [Option<SeenAddrs>; 2],
    forwards: u64,
    draft_forwards: u64,
    written: u64,
    read_by_table: u64,
    read_by_global: u64,
    mismatches: Vec<String>,
    /// Decode steps run as a graph replay (GPU graph mode).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    graph_replays: u64,
}

/// One request's tokens at every KV position of this step (cached, then new).
fn step_tokens(sh: &Shared, r: &dsa_kv::core::scheduler::PlannedRequest) -> Vec<TokenId> {
    let hist = &sh.history[&r.id];
    let mut t: Vec<TokenId> = hist[..r.num_cached as usize].to_vec();
    t.extend_from_slice(&r.tokens);
    t
}

/// Checks that every metadata buffer is where it was on the first step, and that the
/// counts the view states are the batch's.
fn check_view(sh: &mut Shared, batch: &Batch<'_>) {
    let m = &batch.metadata;
    // Full-KV bindings alias the slot mappings or name their own buffers, by step; every
    // other buffer is the same on every step.
    let (fv, fs) = if m.full_kv_aliased {
        if (m.full_kv_value.addr, m.full_kv_scale.addr)
            != (m.slot_mapping_value.addr, m.slot_mapping_scale.addr)
        {
            sh.mismatches.push(format!(
                "step {}: aliased full-KV is not the slot mappings",
                batch.step
            ));
        }
        (None, None)
    } else {
        (Some(m.full_kv_value.addr), Some(m.full_kv_scale.addr))
    };
    let fixed: Vec<u64> = m
        .buffers()
        .iter()
        .enumerate()
        // Field order: the full-KV buffers are 5 and 6.
        .filter(|(i, _)| *i != 5 && *i != 6)
        .map(|(_, b)| b.addr)
        .collect();
    let phase = usize::from(batch.phase == Phase::Draft);
    let seen = sh.addrs[phase].get_or_insert_with(|| (fixed.clone(), None));
    if seen.0 != fixed {
        sh.mismatches
            .push(format!("step {}: metadata moved", batch.step));
    } else if let (Some(v), Some(s)) = (fv, fs) {
        let own = *seen.1.get_or_insert((v, s));
        if own != (v, s) {
            sh.mismatches
                .push(format!("step {}: full-KV buffers moved", batch.step));
        }
    }
    let n: usize = batch.requests.iter().map(|r| r.tokens.len()).sum();
    if m.slot_mapping_value.used != n
        || m.mla_slot_mapping.used != n
        || m.kv_lens.used != batch.requests.len()
        || m.counts.num_tokens != n
    {
        sh.mismatches.push(format!(
            "step {}: view counts disagree with the batch",
            batch.step
        ));
    }
}

/// Conversions the views state must agree with each other.
fn check_conversions(l: &LayerCache, slot: u32, off: u32) -> bool {
    let mut ok = true;
    if let Some(m) = l.mla {
        if let Some(c) = m.rows.pool_pages {
            let page_bytes = u64::from(m.rows.tokens_per_page) * u64::from(m.rows.row_bytes);
            let by_pool = m.rows.pool.addr
                + c.page(slot) * page_bytes
                + u64::from(off) * u64::from(m.rows.row_bytes);
            ok &= by_pool == m.rows.row_addr(slot, off);
        }
        ok &=
            m.rows.token_addr(i64::from(slot) * 64 + i64::from(off)) == m.rows.row_addr(slot, off);
    }
    if let Some(ix) = l.indexer {
        let page = u64::from(slot) * u64::from(ix.page_scale);
        ok &= ix.pool.addr + ix.pool_pages.page(slot) * ix.page_bytes == ix.value_addr(page, 0);
    }
    ok
}

// ---- the host forward ---------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Mutation {
    None,
    /// Writes each request's first new MLA row where its second one belongs (and the
    /// reverse): the read-back must see it.
    SwapRows,
}

struct TestForward {
    shared: Arc<Mutex<Shared>>,
    mutation: Mutation,
    #[cfg(feature = "cuda")]
    gpu: Option<gpu::GpuPart>,
}

impl TestForward {
    fn factory(shared: Arc<Mutex<Shared>>, mutation: Mutation, graphs: bool) -> ForwardFactory {
        Arc::new(move |setup: &ForwardSetup<'_>| {
            let _ = (graphs, setup);
            Ok(Box::new(TestForward {
                shared: shared.clone(),
                mutation,
                #[cfg(feature = "cuda")]
                gpu: match setup.memory {
                    MemKind::Device { .. } => Some(gpu::GpuPart::new(setup, graphs)?),
                    _ => None,
                },
            }) as Box<dyn Forward>)
        })
    }

    fn run(&mut self, batch: &mut Batch<'_>) -> Result<(), ForwardError> {
        let shared = self.shared.clone();
        let mut sh = shared.lock().unwrap();
        check_view(&mut sh, batch);
        if batch.phase == Phase::Draft {
            sh.draft_forwards += 1;
        } else {
            sh.forwards += 1;
        }
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu.as_mut() {
            return g.run(&mut sh, batch);
        }
        let host_meta = batch.host_metadata();
        let (cache, requests, step) = (batch.cache, batch.requests, batch.step);
        let metadata = batch.metadata;
        let host = batch.host().expect("host batch");
        // Write the new tokens through the slot mappings (read through the view's
        // addresses, not the host copies).
        let vmap = host.i64s(&metadata.slot_mapping_value)?;
        let smap = host.i64s(&metadata.slot_mapping_scale)?;
        let rmap = host.i64s(&metadata.mla_slot_mapping)?;
        assert_eq!(vmap.as_ptr(), host_meta.slot_mapping_value().as_ptr());
        let mut i = 0;
        for r in requests {
            let toks = step_tokens(&sh, r);
            let hashes = prefix_hashes(&toks);
            for j in 0..r.tokens.len() {
                let pos = r.num_cached + j as u32;
                let row_token = match (self.mutation, j) {
                    (Mutation::SwapRows, 0) if r.tokens.len() > 1 => i + 1,
                    (Mutation::SwapRows, 1) => i - 1,
                    _ => i,
                };
                for l in &cache.layers {
                    if let Some(ix) = l.indexer {
                        write_key(
                            host,
                            &ix,
                            vmap[i],
                            smap[i],
                            hashes[pos as usize],
                            pos,
                            l.layer.get(),
                        )?;
                    }
                    if let Some(m) = l.mla {
                        if rmap[row_token] >= 0 {
                            let a = m.rows.token_addr(rmap[row_token]);
                            let b = host.bytes_mut(a, u64::from(m.rows.row_bytes))?;
                            fill(hashes[pos as usize], pos, l.layer.get(), ROW, b);
                        }
                    }
                }
                sh.written += 1;
                i += 1;
            }
        }
        // Read every KV token back through the tables, and a sample through global
        // token indices.
        let table = host.i32s(&metadata.block_table)?;
        let pages = host.i32s(&metadata.indexer_page_table)?;
        let mb = metadata.max_blocks_per_seq;
        for (ri, r) in requests.iter().enumerate() {
            let toks = step_tokens(&sh, r);
            let hashes = prefix_hashes(&toks);
            for pos in 0..toks.len() as u32 {
                let (blk, off) = ((pos / 64) as usize, pos % 64);
                let slot = table[ri * mb + blk];
                let page = pages[ri * mb + blk];
                if slot < 0 {
                    sh.mismatches
                        .push(format!("step {step}: {} pos {pos}: no page", r.id));
                    continue;
                }
                for l in &cache.layers {
                    let layer = l.layer.get();
                    let h = hashes[pos as usize];
                    if !check_conversions(l, slot as u32, off) {
                        sh.mismatches
                            .push(format!("layer {layer}: view conversions disagree"));
                    }
                    if let Some(ix) = l.indexer {
                        let mut v = vec![0u8; ix.value_bytes as usize];
                        let mut s = [0u8; 4];
                        fill(h, pos, layer, VALUE, &mut v);
                        fill(h, pos, layer, SCALE, &mut s);
                        let got_v = host.bytes(ix.value_addr(page as u64, off), v.len() as u64)?;
                        let got_s = host.bytes(ix.scale_addr(page as u64, off), 4)?;
                        if got_v != &v[..] || got_s != &s[..] {
                            sh.mismatches.push(format!(
                                "step {step}: {} pos {pos} layer {layer}: indexer",
                                r.id
                            ));
                        }
                    }
                    if let Some(m) = l.mla {
                        let mut want = vec![0u8; m.rows.row_bytes as usize];
                        fill(h, pos, layer, ROW, &mut want);
                        let got =
                            host.bytes(m.rows.row_addr(slot as u32, off), want.len() as u64)?;
                        if got != &want[..] {
                            sh.mismatches.push(format!(
                                "step {step}: {} pos {pos} layer {layer}: MLA row",
                                r.id
                            ));
                        }
                        // Top-k style: a sample of tokens by global index.
                        if pos % 7 == (step % 7) as u32 {
                            let global = i64::from(slot) * 64 + i64::from(off);
                            let got = host.bytes(m.rows.token_addr(global), want.len() as u64)?;
                            if got != &want[..] {
                                sh.mismatches.push(format!(
                                    "step {step}: {} pos {pos} layer {layer}: global index",
                                    r.id
                                ));
                            }
                            sh.read_by_global += 1;
                        }
                    }
                }
                sh.read_by_table += 1;
            }
        }
        Ok(())
    }
}

fn write_key(
    host: &mut HostMemory<'_>,
    ix: &IndexerCacheView,
    v: i64,
    s: i64,
    h: u64,
    pos: u32,
    layer: u32,
) -> Result<(), ForwardError> {
    if v >= 0 {
        let b = host.bytes_mut(ix.base + v as u64, u64::from(ix.value_bytes))?;
        fill(h, pos, layer, VALUE, b);
    }
    if s >= 0 {
        let b = host.bytes_mut(ix.base + s as u64, 4)?;
        fill(h, pos, layer, SCALE, b);
    }
    Ok(())
}

/// Writes KV and samples nothing: the test samples and commits.
impl Forward for TestForward {
    fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        self.run(batch)?;
        Ok(Sampling::ByEngine)
    }

    fn draft_forward(&mut self, batch: &mut Batch<'_>) -> Result<Proposals, ForwardError> {
        self.run(batch)?;
        Ok(Proposals::new())
    }
}

// ---- the driver -----------------------------------------------------------------------------

fn config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(3);
    c.kv_cache.max_tokens = Some(1024);
    c.kv_cache.host_cache_size = Some(2048 * 3 * 708 + (8 << 20));
    c.scheduler.max_num_sequences = 16;
    c.scheduler.max_num_tokens = 512;
    c.scheduler.max_prefill_chunk = 192;
    c.scheduler.max_seq_len = 2048;
    c.spec_decode.mode = SpecMode::Mtp;
    c.spec_decode.draft_tokens = 2;
    c
}

fn prompt(i: u64) -> Vec<TokenId> {
    // A 100-token system prompt shared by all, then the request's own text.
    let own = 60 + (i as u32 * 53) % 240;
    (0..100)
        .map(TokenId)
        .chain((0..own).map(|k| TokenId(10_000 + i as u32 * 1000 + k)))
        .collect()
}

struct Run {
    shared: Arc<Mutex<Shared>>,
    stats: RuntimeStats,
    /// Cache digests after every step (GPU runs).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    digests: Vec<Vec<Option<String>>>,
}

async fn run(
    backend: Option<dsa_kv::device::BackendFactory>,
    mutation: Mutation,
    graphs: bool,
    digest_every_step: bool,
) -> Run {
    let shared = Arc::new(Mutex::new(Shared::default()));
    let mut b = KvCacheBuilder::new()
        .config(config())
        .forward(TestForward::factory(shared.clone(), mutation, graphs));
    if let Some(f) = backend {
        b = b.backend(f);
    }
    let kv = b.start().await.unwrap();
    assert!(kv.info().draft_cache);
    const N: u64 = 24;
    for i in 0..N {
        let p = prompt(i);
        shared
            .lock()
            .unwrap()
            .history
            .insert(RequestId(i), p.clone());
        kv.submit(SubmitRequest {
            id: RequestId(i),
            scope: ReuseScope::SHARED,
            prompt: p,
            max_new_tokens: 12 + (i as u32 % 17),
            priority: [10, 35, 60][i as usize % 3],
        })
        .await
        .unwrap();
    }
    let mut done = 0;
    let mut digests = Vec::new();
    for step in 0..2000u64 {
        // Decoding requests propose two drafts each.
        let drafts: HashMap<RequestId, Vec<TokenId>> = (0..N)
            .map(|i| (RequestId(i), vec![TokenId(7 + step as u32 % 3), TokenId(5)]))
            .collect();
        let rep = kv.step(drafts.clone()).await.unwrap();
        let mut outcomes = Vec::new();
        {
            let mut sh = shared.lock().unwrap();
            for r in &rep.scheduled {
                let accepted = if r.num_drafts > 0 {
                    (step % 3) as u32 % (r.num_drafts + 1)
                } else {
                    0
                };
                let next = r
                    .produces_token
                    .then(|| TokenId(20_000 + (step as u32 * 31 + r.id.0 as u32) % 500));
                if r.produces_token {
                    let h = sh.history.get_mut(&r.id).unwrap();
                    if r.kind == RequestKind::Generation {
                        h.extend_from_slice(&drafts[&r.id][..accepted as usize]);
                    }
                    h.extend(next);
                }
                outcomes.push(RequestOutcome {
                    id: r.id,
                    accepted_drafts: accepted,
                    next_token: next,
                });
            }
        }
        done += kv.commit(outcomes).await.unwrap().finished.len();
        if digest_every_step {
            digests.push(kv.cache_digests().await.unwrap());
        }
        if done as u64 == N {
            break;
        }
    }
    assert_eq!(done as u64, N, "every request finishes");
    kv.synchronize().await.unwrap();
    let stats = kv.stats().await.unwrap();
    kv.shutdown().await;
    Run {
        shared,
        stats,
        digests,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_framework_forward_writes_and_reads_the_cache_through_the_public_view() {
    let r = run(None, Mutation::None, false, false).await;
    let sh = r.shared.lock().unwrap();
    assert!(
        sh.mismatches.is_empty(),
        "{:#?}",
        &sh.mismatches[..sh.mismatches.len().min(10)]
    );
    assert!(sh.forwards > 0 && sh.draft_forwards > 0);
    assert!(sh.written > 0 && sh.read_by_table > sh.written && sh.read_by_global > 0);
    // Everything the cache does happened under this forward.
    let st = &r.stats;
    assert!(st.scheduler.preemptions > 0, "the workload must preempt");
    assert!(st.offload_bytes > 0 && st.onboard_bytes > 0);
    assert!(st.prefix_hit_rate > 0.0, "the system prompt is reused");
    assert!(st.scheduler.drafts_accepted > 0 && st.draft_replays > 0);
    // A framework forward is not verified: nothing was read back by the runtime.
    assert_eq!(st.tokens_verified, 0);
    println!(
        "forwards {} (+{} draft), tokens written {}, positions read through the tables {}, \
         through global indices {}",
        sh.forwards, sh.draft_forwards, sh.written, sh.read_by_table, sh.read_by_global
    );
}

/// The read-back is a real check: one misplaced row per request is seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_back_sees_a_misplaced_row() {
    let r = run(None, Mutation::SwapRows, false, false).await;
    let sh = r.shared.lock().unwrap();
    assert!(
        sh.mismatches.iter().any(|m| m.contains("MLA row")),
        "swapped rows went unnoticed"
    );
    assert!(
        !sh.mismatches.iter().any(|m| m.contains("indexer")),
        "only rows were swapped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verification_cannot_be_asked_of_a_framework_forward() {
    let shared = Arc::new(Mutex::new(Shared::default()));
    let e = KvCacheBuilder::new()
        .config(config())
        .forward(TestForward::factory(shared, Mutation::None, false))
        .verification(Verification::Sample)
        .start()
        .await
        .err()
        .expect("refused");
    assert!(e.to_string().contains("Verification::Off"), "{e}");
}

#[cfg(feature = "cuda")]
mod gpu {
    //! The same forward with its own kernels (NVRTC), on the batch's stream, reading
    //! the device metadata by address; optionally its decode steps as a CUDA graph.

    use std::sync::Arc;

    use cudarc::driver::{sys, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
    use cudarc::nvrtc::compile_ptx;
    use dsa_kv::cuda::cudarc;

    use super::*;

    const SRC: &str = r#"
extern "C" __global__ void scatter_at(unsigned long long base, const long long* map,
    const unsigned char* src, int width, int n) {
  int t = blockIdx.x; if (t >= n) return; long long o = map[t]; if (o < 0) return;
  unsigned char* d = (unsigned char*)(base + (unsigned long long)o);
  for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = src[(long long)t * width + i];
}
extern "C" __global__ void scatter_rows(unsigned long long base, unsigned long long stride,
    int row_bytes, const long long* map, const unsigned char* src, int n) {
  int t = blockIdx.x; if (t >= n) return; long long s = map[t]; if (s < 0) return;
  unsigned char* d = (unsigned char*)(base + (unsigned long long)(s / 64) * stride
      + (unsigned long long)(s % 64) * row_bytes);
  for (int i = threadIdx.x; i < row_bytes; i += blockDim.x) d[i] = src[(long long)t * row_bytes + i];
}
// Reads (request, position) through a device page table: rows (MLA) or payload + scale
// word (indexer, is_indexer != 0: `stride` is the page size, pages from `table`).
extern "C" __global__ void gather(unsigned char* out, unsigned long long base,
    unsigned long long stride, int row_bytes, int is_indexer, const int* table,
    int max_blocks, const int* req, const int* pos, int n) {
  int t = blockIdx.x; if (t >= n) return;
  int p = pos[t]; long long page = table[req[t] * max_blocks + p / 64];
  const unsigned char* s;
  if (is_indexer) {
    const unsigned char* pg = (const unsigned char*)(base + (unsigned long long)page * stride);
    for (int i = threadIdx.x; i < row_bytes; i += blockDim.x) {
      out[(long long)t * (row_bytes + 4) + i] = pg[(p % 64) * row_bytes + i];
    }
    for (int i = threadIdx.x; i < 4; i += blockDim.x) {
      out[(long long)t * (row_bytes + 4) + row_bytes + i] = pg[64 * row_bytes + (p % 64) * 4 + i];
    }
    return;
  }
  s = (const unsigned char*)(base + (unsigned long long)page * stride + (p % 64) * row_bytes);
  for (int i = threadIdx.x; i < row_bytes; i += blockDim.x) out[(long long)t * row_bytes + i] = s[i];
}
"#;

    fn err(what: &str, e: impl std::fmt::Debug) -> ForwardError {
        ForwardError::Unsupported {
            what: format!("{what}: {e:?}"),
        }
    }

    /// Device memory owned by the test: a raw allocation (no cudarc stream tracking, so
    /// nothing extra lands in a captured graph).
    struct Mem(u64);
    impl Mem {
        fn new(bytes: usize) -> Result<Mem, ForwardError> {
            let mut p = 0;
            // SAFETY: valid out-pointer; the device context is current on this thread.
            let r = unsafe { sys::cuMemAlloc_v2(&mut p, bytes.max(16)) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(err("cuMemAlloc", r));
            }
            Ok(Mem(p))
        }
    }
    impl Drop for Mem {
        fn drop(&mut self) {
            // SAFETY: allocated above, freed once.
            unsafe { sys::cuMemFree_v2(self.0) };
        }
    }

    fn htod(stream: &CudaStream, dst: u64, src: &[u8]) -> Result<(), ForwardError> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` holds at least `src.len()` bytes (sized at setup); a pageable
        // source is staged before this returns.
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream.cu_stream())
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(err("cuMemcpyHtoDAsync", r));
        }
        Ok(())
    }

    fn dtoh(stream: &CudaStream, dst: &mut [u8], src: u64) -> Result<(), ForwardError> {
        stream.synchronize().map_err(|e| err("synchronize", e))?;
        // SAFETY: `src` holds at least `dst.len()` bytes.
        let r = unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(err("cuMemcpyDtoH", r));
        }
        Ok(())
    }

    fn cfg(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.max(1) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// A captured decode step; used only on the device actor's thread.
    struct Graph(cudarc::driver::CudaGraph);
    // SAFETY: the graph is created, launched and dropped on the device actor's thread
    // only (the forward lives there).
    unsafe impl Send for Graph {}

    pub(super) struct GpuPart {
        _module: Arc<CudaModule>,
        scatter_at: CudaFunction,
        scatter_rows: CudaFunction,
        gather: CudaFunction,
        /// Per layer: `[bucket rows of indexer payload | scales | MLA rows]` inputs.
        input: Vec<(Mem, Mem, Mem)>,
        bucket: usize,
        graphs: bool,
        graph: Option<(Graph, Vec<u64>)>,
    }

    impl GpuPart {
        pub(super) fn new(setup: &ForwardSetup<'_>, graphs: bool) -> Result<Self, ForwardError> {
            let stream = setup.cuda_stream().ok_or_else(|| err("stream", "none"))?;
            let ctx = stream.context();
            ctx.bind_to_thread().map_err(|e| err("bind", e))?;
            let module = ctx
                .load_module(compile_ptx(SRC).map_err(|e| err("nvrtc", e))?)
                .map_err(|e| err("load", e))?;
            let f = |n| module.load_function(n).map_err(|e| err(n, e));
            let bucket = setup.max_num_tokens;
            let mut input = Vec::new();
            for l in setup
                .target
                .layers
                .iter()
                .chain(setup.draft.iter().flat_map(|d| d.layers.iter()))
            {
                let w = l.indexer.map_or(0, |x| x.value_bytes as usize);
                let rb = l.mla.map_or(0, |m| m.rows.row_bytes as usize);
                input.push((
                    Mem::new(bucket * w)?,
                    Mem::new(bucket * 4)?,
                    Mem::new(bucket * rb)?,
                ));
            }
            Ok(GpuPart {
                scatter_at: f("scatter_at")?,
                scatter_rows: f("scatter_rows")?,
                gather: f("gather")?,
                _module: module,
                input,
                bucket,
                graphs,
                graph: None,
            })
        }

        /// Enqueues the scatters of every layer for `n` rows (the bucket in a graph).
        fn scatters(
            &self,
            stream: &CudaStream,
            cache: &CacheView,
            first_input: usize,
            m: &MetadataView,
            n: usize,
        ) -> Result<(), ForwardError> {
            let n32 = n as i32;
            for (k, l) in cache.layers.iter().enumerate() {
                let (iv, is, ir) = &self.input[first_input + k];
                if let Some(ix) = l.indexer {
                    for (map, src, w) in [
                        (m.slot_mapping_value.addr, iv.0, ix.value_bytes as i32),
                        (m.slot_mapping_scale.addr, is.0, 4),
                    ] {
                        let mut b = stream.launch_builder(&self.scatter_at);
                        b.arg(&ix.base).arg(&map).arg(&src).arg(&w).arg(&n32);
                        // SAFETY: addresses from the batch view and our inputs, sized
                        // for `bucket ≥ n` rows; −1 mappings are skipped.
                        unsafe { b.launch(cfg(n)) }.map_err(|e| err("scatter_at", e))?;
                    }
                }
                if let Some(mla) = l.mla {
                    let rb = mla.rows.row_bytes as i32;
                    let mut b = stream.launch_builder(&self.scatter_rows);
                    b.arg(&mla.rows.base)
                        .arg(&mla.rows.page_stride)
                        .arg(&rb)
                        .arg(&m.mla_slot_mapping.addr)
                        .arg(&ir.0)
                        .arg(&n32);
                    // SAFETY: as above.
                    unsafe { b.launch(cfg(n)) }.map_err(|e| err("scatter_rows", e))?;
                }
            }
            Ok(())
        }

        pub(super) fn run(
            &mut self,
            sh: &mut Shared,
            batch: &mut Batch<'_>,
        ) -> Result<(), ForwardError> {
            let stream = batch.cuda_stream().ok_or_else(|| err("stream", "none"))?;
            let (cache, requests, m, step) =
                (batch.cache, batch.requests, batch.metadata, batch.step);
            let draft = batch.phase == Phase::Draft;
            let first_input = if draft {
                self.input.len() - cache.layers.len()
            } else {
                0
            };
            let n = m.counts.num_tokens;
            // This step's bytes, packed per layer in mapping order.
            let mut packed: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> = cache
                .layers
                .iter()
                .map(|_| (Vec::new(), Vec::new(), Vec::new()))
                .collect();
            for r in requests {
                let toks = step_tokens(sh, r);
                let hashes = prefix_hashes(&toks);
                for j in 0..r.tokens.len() {
                    let pos = r.num_cached + j as u32;
                    let h = hashes[pos as usize];
                    for (k, l) in cache.layers.iter().enumerate() {
                        let layer = l.layer.get();
                        if let Some(ix) = l.indexer {
                            let at = packed[k].0.len();
                            packed[k].0.resize(at + ix.value_bytes as usize, 0);
                            fill(h, pos, layer, VALUE, &mut packed[k].0[at..]);
                            let at = packed[k].1.len();
                            packed[k].1.resize(at + 4, 0);
                            fill(h, pos, layer, SCALE, &mut packed[k].1[at..]);
                        }
                        if let Some(mla) = l.mla {
                            let at = packed[k].2.len();
                            packed[k].2.resize(at + mla.rows.row_bytes as usize, 0);
                            fill(h, pos, layer, ROW, &mut packed[k].2[at..]);
                        }
                    }
                    sh.written += 1;
                }
            }
            for (k, (v, s, rows)) in packed.iter().enumerate() {
                let (iv, is, ir) = &self.input[first_input + k];
                htod(stream, iv.0, v)?;
                htod(stream, is.0, s)?;
                htod(stream, ir.0, rows)?;
            }
            let decode = requests.iter().all(|r| r.kind == RequestKind::Generation);
            if self.graphs && !draft && decode && n <= self.bucket {
                let addrs: Vec<u64> = m.buffers().iter().map(|b| b.addr).collect();
                if self.graph.is_none() {
                    stream
                        .begin_capture(
                            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                        )
                        .map_err(|e| err("begin_capture", e))?;
                    // Padded to the bucket: rows past `n` read −1 mappings.
                    let r = self.scatters(stream, cache, first_input, &m, self.bucket);
                    let g = stream
                        .end_capture(sys::CUgraphInstantiate_flags(0))
                        .map_err(|e| err("end_capture", e))?;
                    r?;
                    let g = g.ok_or_else(|| err("end_capture", "empty graph"))?;
                    self.graph = Some((Graph(g), addrs.clone()));
                }
                let (g, at) = self.graph.as_ref().expect("captured above");
                if *at != addrs {
                    return Err(err("graph", "the metadata moved after capture"));
                }
                g.0.launch().map_err(|e| err("graph launch", e))?;
                sh.graph_replays += 1;
            } else {
                self.scatters(stream, cache, first_input, &m, n)?;
            }
            self.read_back(sh, stream, cache, requests, &m, step)
        }

        /// Gathers every KV token of every request through the device page tables and
        /// compares on the host (a synchronize this test asks for).
        #[allow(clippy::too_many_arguments)]
        fn read_back(
            &self,
            sh: &mut Shared,
            stream: &CudaStream,
            cache: &CacheView,
            requests: &[dsa_kv::core::scheduler::PlannedRequest],
            m: &MetadataView,
            step: u64,
        ) -> Result<(), ForwardError> {
            let (mut reqs, mut poss, mut hashes) = (Vec::new(), Vec::new(), Vec::new());
            for (ri, r) in requests.iter().enumerate() {
                let toks = step_tokens(sh, r);
                for (p, h) in prefix_hashes(&toks).into_iter().enumerate() {
                    reqs.push(ri as i32);
                    poss.push(p as i32);
                    hashes.push(h);
                }
            }
            let n = reqs.len();
            if n == 0 {
                return Ok(());
            }
            let as_bytes = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            let (dreq, dpos) = (Mem::new(n * 4)?, Mem::new(n * 4)?);
            htod(stream, dreq.0, &as_bytes(&reqs))?;
            htod(stream, dpos.0, &as_bytes(&poss))?;
            let mb = m.max_blocks_per_seq as i32;
            for l in &cache.layers {
                let layer = l.layer.get();
                let mut views: Vec<(u64, u64, i32, i32, u64, u64)> = Vec::new();
                if let Some(ix) = l.indexer {
                    views.push((
                        ix.base,
                        ix.page_bytes,
                        ix.value_bytes as i32,
                        1,
                        m.indexer_page_table.addr,
                        VALUE,
                    ));
                }
                if let Some(mla) = l.mla {
                    views.push((
                        mla.rows.base,
                        mla.rows.page_stride,
                        mla.rows.row_bytes as i32,
                        0,
                        m.block_table.addr,
                        ROW,
                    ));
                }
                for (base, stride, w, is_ix, table, what) in views {
                    let per = (w + 4 * is_ix) as usize;
                    let out = Mem::new(n * per)?;
                    let n32 = n as i32;
                    let mut b = stream.launch_builder(&self.gather);
                    b.arg(&out.0)
                        .arg(&base)
                        .arg(&stride)
                        .arg(&w)
                        .arg(&is_ix)
                        .arg(&table)
                        .arg(&mb)
                        .arg(&dreq.0)
                        .arg(&dpos.0)
                        .arg(&n32);
                    // SAFETY: tables and views from the batch; every position is below
                    // its request's KV length, so its table entry is a page.
                    unsafe { b.launch(cfg(n)) }.map_err(|e| err("gather", e))?;
                    let mut got = vec![0u8; n * per];
                    dtoh(stream, &mut got, out.0)?;
                    let mut want = vec![0u8; per];
                    for t in 0..n {
                        let pos = poss[t] as u32;
                        fill(hashes[t], pos, layer, what, &mut want[..w as usize]);
                        if is_ix == 1 {
                            fill(hashes[t], pos, layer, SCALE, &mut want[w as usize..]);
                        }
                        if got[t * per..(t + 1) * per] != want[..] {
                            sh.mismatches.push(format!(
                                "step {step}: request #{} pos {pos} layer {layer}: {}",
                                reqs[t],
                                if is_ix == 1 { "indexer" } else { "MLA row" }
                            ));
                        }
                    }
                    if is_ix == 0 {
                        sh.read_by_global += n as u64;
                    }
                }
            }
            sh.read_by_table += n as u64;
            Ok(())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs a CUDA device"]
    async fn a_framework_forward_runs_on_the_gpu_eager_and_as_a_cuda_graph_with_equal_bytes() {
        let cuda = || Some(dsa_kv::cuda::CudaDevice::factory(vec![0]));
        let eager = run(cuda(), Mutation::None, false, true).await;
        let graph = run(cuda(), Mutation::None, true, true).await;
        let host = run(None, Mutation::None, false, false).await;
        for r in [&eager, &graph] {
            let sh = r.shared.lock().unwrap();
            assert!(
                sh.mismatches.is_empty(),
                "{:#?}",
                &sh.mismatches[..sh.mismatches.len().min(10)]
            );
            assert!(sh.forwards > 0 && sh.draft_forwards > 0 && sh.read_by_table > 0);
            assert!(
                r.stats.scheduler.preemptions > 0
                    && r.stats.offload_bytes > 0
                    && r.stats.onboard_bytes > 0
            );
        }
        let (ge, gg) = (eager.shared.lock().unwrap(), graph.shared.lock().unwrap());
        assert!(
            gg.graph_replays > 10,
            "decode steps replayed the graph: {}",
            gg.graph_replays
        );
        assert_eq!(ge.graph_replays, 0);
        assert_eq!(eager.digests.len(), graph.digests.len(), "same schedule");
        for (s, (a, b)) in eager.digests.iter().zip(&graph.digests).enumerate() {
            assert_eq!(a, b, "cache bytes differ after step {s}");
        }
        // The same workload as the host backend: same counts.
        assert_eq!(eager.stats.scheduler.steps, host.stats.scheduler.steps);
        assert_eq!(
            eager.stats.scheduler.preemptions,
            host.stats.scheduler.preemptions
        );
        println!(
            "eager and graph: {} steps, {} graph replays, equal cache digests after every step",
            eager.digests.len(),
            gg.graph_replays
        );
    }

    const HOLD: &str = r#"
extern "C" __global__ void hold(volatile unsigned int* gate, volatile unsigned int* done,
    long long max_cycles) {
  long long start = clock64();
  while (*gate == 0) {
    if (clock64() - start > max_cycles) { *done = 2; __threadfence_system(); return; }
  }
  *done = 1;
  __threadfence_system();
}
"#;

    /// Pinned, device-mapped host words: (host pointer, device pointer).
    struct Words(usize, u64);

    /// A forward that, on its first step, enqueues a kernel that holds the stream until
    /// the host opens a gate (or ~10 s pass) and does nothing else.
    struct HoldForward {
        words: Arc<Words>,
        held: bool,
        _module: Arc<CudaModule>,
        hold: CudaFunction,
    }

    impl Forward for HoldForward {
        fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
            if self.held {
                return Ok(Sampling::ByEngine);
            }
            self.held = true;
            let stream = batch.cuda_stream().ok_or_else(|| err("stream", "none"))?;
            let (gate, done) = (self.words.1, self.words.1 + 4);
            let max_cycles: i64 = 20_000_000_000;
            let mut b = stream.launch_builder(&self.hold);
            b.arg(&gate).arg(&done).arg(&max_cycles);
            // SAFETY: both words are mapped pinned memory that outlives the kernel.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (1, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(|e| err("hold", e))?;
            Ok(Sampling::ByEngine)
        }
    }

    fn read(words: &Words, i: usize) -> u32 {
        // SAFETY: `words.0` points to two u32 of pinned memory alive for the test.
        unsafe { std::ptr::read_volatile((words.0 as *const u32).add(i)) }
    }

    /// `step()` returns once the step is enqueued: the forward's kernel is still held
    /// when it returns (a per-step synchronize would wait ~10 s and find the kernel
    /// timed out), and `synchronize()` is what waits for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs a CUDA device"]
    async fn a_step_returns_before_its_kernels_finish() {
        let words: Arc<Mutex<Option<Arc<Words>>>> = Arc::new(Mutex::new(None));
        let w = words.clone();
        let factory: ForwardFactory = Arc::new(move |setup: &ForwardSetup<'_>| {
            let stream = setup.cuda_stream().ok_or_else(|| err("stream", "none"))?;
            let ctx = stream.context();
            ctx.bind_to_thread().map_err(|e| err("bind", e))?;
            let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
            let mut dev = 0;
            // SAFETY: valid out-pointers; the context is current.
            unsafe {
                let r = sys::cuMemHostAlloc(&mut host, 8, sys::CU_MEMHOSTALLOC_DEVICEMAP);
                assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
                std::ptr::write_bytes(host.cast::<u8>(), 0, 8);
                let r = sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0);
                assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
            }
            let words = Arc::new(Words(host as usize, dev));
            *w.lock().unwrap() = Some(words.clone());
            let module = ctx
                .load_module(compile_ptx(HOLD).map_err(|e| err("nvrtc", e))?)
                .map_err(|e| err("load", e))?;
            let hold = module.load_function("hold").map_err(|e| err("hold", e))?;
            Ok(Box::new(HoldForward {
                words,
                held: false,
                _module: module,
                hold,
            }) as Box<dyn Forward>)
        });
        let kv = KvCacheBuilder::new()
            .config(config())
            .backend(dsa_kv::cuda::CudaDevice::factory(vec![0]))
            .forward(factory)
            .start()
            .await
            .unwrap();
        kv.submit(SubmitRequest {
            id: RequestId(1),
            scope: ReuseScope::SHARED,
            prompt: prompt(1),
            max_new_tokens: 4,
            priority: 35,
        })
        .await
        .unwrap();
        let rep = kv.step(HashMap::new()).await.unwrap();
        assert_eq!(rep.scheduled.len(), 1);
        let words = words.lock().unwrap().clone().unwrap();
        assert_eq!(read(&words, 1), 0, "the step waited for its kernel");
        // Open the gate; synchronize waits for the kernel.
        // SAFETY: the gate word is pinned memory the kernel polls.
        unsafe { std::ptr::write_volatile(words.0 as *mut u32, 1) };
        kv.synchronize().await.unwrap();
        assert_eq!(
            read(&words, 1),
            1,
            "the kernel ran to the gate, not to its timeout"
        );
        kv.shutdown().await;
    }
}

// ---- the forward contract: a forward that samples is committed by the runtime -----------

/// How the sampling forward on device 1 differs from device 0's.
#[derive(Clone, Copy, PartialEq)]
enum Device1 {
    Same,
    /// Samples another token for every request from step `.0` on.
    OtherToken(u64),
    /// Leaves sampling to the engine (device 0 samples).
    ByEngine,
}

/// Samples `token(request, step)` for every request that produces a token, accepts no
/// draft, and proposes `[proposal(request, step)]` for each request's next step.
struct Sampler {
    device: usize,
    device1: Device1,
    /// The drafts each step's batch carried, per request (device 0 only).
    seen_drafts: Arc<Mutex<Vec<(u64, RequestId, u32)>>>,
}

fn token(id: RequestId, step: u64) -> TokenId {
    TokenId(1_000 + (id.0 as u32 * 7 + step as u32) % 100)
}

impl Forward for Sampler {
    fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        if self.device == 1 && self.device1 == Device1::ByEngine {
            return Ok(Sampling::ByEngine);
        }
        let other =
            matches!(self.device1, Device1::OtherToken(s) if self.device == 1 && batch.step >= s);
        if self.device == 0 {
            let mut seen = self.seen_drafts.lock().unwrap();
            seen.extend(
                batch
                    .requests
                    .iter()
                    .map(|r| (batch.step, r.id, r.num_drafts)),
            );
        }
        let outcomes = batch
            .requests
            .iter()
            .map(|r| RequestOutcome {
                id: r.id,
                accepted_drafts: 0,
                next_token: r
                    .produces_token
                    .then(|| TokenId(token(r.id, batch.step).0 + u32::from(other))),
            })
            .collect();
        let proposals = batch
            .requests
            .iter()
            .map(|r| (r.id, vec![TokenId(5)]))
            .collect();
        Ok(Sampling::Sampled(
            Sampled::new(outcomes).with_drafts(proposals),
        ))
    }
}

struct Contract {
    kv: KvCacheHandle,
    seen_drafts: Arc<Mutex<Vec<(u64, RequestId, u32)>>>,
}

async fn contract(devices: usize, device1: Device1, draft_tokens: u32) -> Contract {
    let seen_drafts = Arc::new(Mutex::new(Vec::new()));
    let seen = seen_drafts.clone();
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(2);
    c.kv_cache.max_tokens = Some(1024);
    if draft_tokens > 0 {
        // MTP with the draft layer in the target's cache: no draft replay, the forward
        // proposes.
        c.model.num_mtp_layers = Some(1);
        c.spec_decode.mode = SpecMode::Mtp;
        c.spec_decode.draft_tokens = draft_tokens;
        c.spec_decode.separate_draft_cache = false;
    }
    let kv = KvCacheBuilder::new()
        .config(c)
        .host_devices(devices)
        .forward(Arc::new(move |s: &ForwardSetup<'_>| {
            Ok(Box::new(Sampler {
                device: s.device,
                device1,
                seen_drafts: seen.clone(),
            }) as Box<dyn Forward>)
        }))
        .start()
        .await
        .unwrap();
    Contract { kv, seen_drafts }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampling_forward_is_committed_by_the_runtime_when_the_devices_agree() {
    let Contract { kv, .. } = contract(2, Device1::Same, 0).await;
    // A step with nothing scheduled commits nothing and is no error.
    let empty = kv.step(Drafts::none()).await.unwrap();
    assert!(empty.scheduled.is_empty() && empty.committed.is_none());
    kv.submit(SubmitRequest::new(
        RequestId(3),
        (0..100).map(TokenId).collect(),
        3,
    ))
    .await
    .unwrap();
    let mut generated = Vec::new();
    let mut finished = None;
    for _ in 0..10 {
        let rep = kv.step(Drafts::none()).await.unwrap();
        let commit = rep
            .committed
            .clone()
            .expect("a sampling forward's step is committed");
        assert_eq!(rep.outcomes.len(), rep.scheduled.len());
        for o in &rep.outcomes {
            assert_eq!(o.next_token, Some(token(o.id, rep.step)));
            generated.extend(o.next_token);
        }
        // Nothing is left to commit: a commit now is refused, and changes nothing.
        let e = kv
            .commit(rep.outcomes.clone())
            .await
            .expect_err("committed already");
        assert!(e.to_string().contains("no step to commit"), "{e}");
        if let Some(f) = commit.finished.first() {
            finished = Some(f.finished.clone());
            break;
        }
    }
    let f = finished.expect("the request finished");
    assert_eq!(f.generated, 3);
    assert_eq!(generated.len(), 3);
    let st = kv.stats().await.unwrap();
    assert_eq!(st.scheduler.finished, 1);
    kv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_that_sample_differently_fail_the_step_with_a_typed_error() {
    for (device1, what) in [
        (Device1::OtherToken(2), "sampled outcomes"),
        (Device1::ByEngine, "some devices sampled"),
    ] {
        let Contract { kv, .. } = contract(2, device1, 0).await;
        kv.submit(SubmitRequest::new(
            RequestId(1),
            (0..100).map(TokenId).collect(),
            8,
        ))
        .await
        .unwrap();
        let mut err = None;
        for _ in 0..5 {
            match kv.step(Drafts::none()).await {
                Ok(rep) => assert!(rep.committed.is_some()),
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        let e = err.expect("the disagreement is caught");
        assert!(
            matches!(e, RuntimeError::DevicesDisagree { device: 1, .. }),
            "{e}"
        );
        assert!(e.to_string().contains(what), "{e}");
        // Nothing of the step was committed: its request failed, no page is held.
        let st = kv.stats().await.unwrap();
        assert_eq!((st.scheduler.finished, st.scheduler.failed), (0, 1));
        kv.check_invariants().await.unwrap();
        kv.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proposals_become_the_next_steps_drafts_unless_the_engine_gives_its_own() {
    let Contract { kv, seen_drafts } = contract(1, Device1::Same, 1).await;
    kv.submit(SubmitRequest::new(
        RequestId(1),
        (0..100).map(TokenId).collect(),
        6,
    ))
    .await
    .unwrap();
    // Prefill, then a decode that carries the forward's proposal (one draft).
    kv.step(Drafts::none()).await.unwrap();
    let rep = kv.step(Drafts::none()).await.unwrap();
    assert_eq!(rep.scheduled[0].num_drafts, 1, "the proposal was used");
    // The engine's own drafts win (none: an empty list for the request).
    let own: HashMap<RequestId, Vec<TokenId>> = [(RequestId(1), vec![])].into();
    let rep = kv.step(own).await.unwrap();
    assert_eq!(rep.scheduled[0].num_drafts, 0, "the engine's drafts win");
    let seen = seen_drafts.lock().unwrap().clone();
    assert_eq!(
        seen.iter().map(|s| s.2).collect::<Vec<_>>(),
        vec![0, 1, 0],
        "{seen:?}"
    );
    kv.shutdown().await;
}
