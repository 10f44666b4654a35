//! Prefill / decode disaggregation with the reference model: the engine loop, the two
//! sides of the protocol, and the checks. Used by `examples/disagg/main.rs` (two processes,
//! or two threads) and `tests/disagg.rs` (two threads, the local transport).
//!
//! Protocol (length-prefixed JSON frames over one TCP connection, blocking):
//! 1. both sides send `Hello` (transport metadata, pool regions, layout);
//! 2. per request, the prefill side prefills it (one token), exports the prompt's full
//!    blocks and sends `Export`;
//! 3. the decode side reserves pages for the request it will serve (its own prompt and
//!    scope: `begin_import_with`, which also opens the transport window for exactly
//!    those pages until the ticket's deadline) and answers `Ticket`;
//! 4. the prefill side writes the pages with the transport (notification
//!    `req-<id>`), releases the export and sends `Written` (the report, the digests of
//!    the blocks it wrote, the first token), or `Failed`;
//! 5. the decode side waits for the notification, checks the digests (host memory),
//!    commits the import (or aborts it on a failure or when a digest differs), decodes
//!    the request from the prompt plus the first token, and sends `Decoded` (tokens,
//!    reuse, checks).
//!
//! The metadata channel is trusted as it is (first connection wins): bind it to
//! loopback (the default) or to an address only the two engines reach.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsa_kv::actors::{KvCacheBuilder, KvCacheHandle};
use dsa_kv::config::{EngineConfig, KvDtype, SpecMode, DSA_TOKENS_PER_BLOCK};
use dsa_kv::core::scheduler::{RequestOutcome, SubmitRequest};
use dsa_kv::core::ReuseScope;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::layout::Role;
use dsa_kv::ops::quant::ScaleFormat;
use dsa_kv::transfer::{
    plan_writes, push_plan, BlockPages, CacheKind, ExportedBlocks, ImportTicket, KvTransport,
    MemKind, PeerId, PoolRegion, TransferReport,
};
use dsa_kv_model::paged::{ModelForward, Outputs};
use dsa_kv_model::unpaged::{draft_reference, generate};
use dsa_kv_model::{CacheFormat, Model, ModelConfig, TokenOut};
use serde::{Deserialize, Serialize};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The reuse scope of every request.
pub(crate) const SCOPE: ReuseScope = ReuseScope::SHARED;

/// What a run is made of.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Setup {
    /// Requests.
    pub requests: u64,
    /// Draft tokens per step (MTP in a separate draft cache); 0: no speculation.
    pub drafts: u32,
    /// Tokens to generate per request (the first on the prefill engine).
    pub max_new: u32,
    /// Model layers.
    pub layers: usize,
    /// `host` or `cuda`.
    pub backend: String,
    /// Mutation drill: the prefill side leaves out the pools holding this role
    /// (`index_key`) or this cache (`draft`); the checks must then fail.
    pub drop: Option<String>,
    /// Blocks of the system prompt every request shares.
    pub system_blocks: u32,
    /// Measure instead (two processes): move this many blocks of synthetic KV
    /// (DeepSeek-V3.2 page sizes with `layers` layers, MTP draft cache) after a one-block
    /// warm-up, and report the transfer ([`BenchReport`]).
    #[serde(default)]
    pub bench_blocks: Option<usize>,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            requests: 3,
            drafts: 2,
            max_new: 12,
            layers: 2,
            backend: "host".into(),
            drop: None,
            system_blocks: 3,
            bench_blocks: None,
        }
    }
}

pub(crate) fn format(layers: usize) -> CacheFormat {
    CacheFormat {
        kv_dtype: KvDtype::Fp8DsMla,
        scale_format: ScaleFormat::Ue8m0,
        indexer: vec![true; layers],
    }
}

pub(crate) fn model(layers: usize) -> Result<Arc<Model>, BoxError> {
    let cfg = ModelConfig {
        layers,
        ..ModelConfig::tiny(7)
    };
    Ok(Arc::new(Model::new(cfg, format(layers))?))
}

/// The engine configuration both sides run (they must agree: the layouts are checked).
pub(crate) fn config(s: &Setup) -> EngineConfig {
    let mut c = EngineConfig::default();
    if s.drafts > 0 {
        c.spec_decode.mode = SpecMode::Mtp;
        c.spec_decode.draft_tokens = s.drafts;
    }
    c.model.num_layers = Some(s.layers as u32);
    c.model.kv_dtype = Some(KvDtype::Fp8DsMla);
    c.kv_cache.max_tokens = Some(u64::from(s.system_blocks) * 64 * 2 + 4096);
    c.kv_cache.host_cache_size = Some(16 << 20);
    c.scheduler.max_num_sequences = 8;
    c.scheduler.max_num_tokens = 512;
    c.scheduler.max_seq_len = s.system_blocks * 64 + 2048;
    c
}

/// Request `i`'s prompt with the default setup.
pub(crate) fn prompt(i: u64) -> Vec<u32> {
    Setup::default().prompt(i)
}

impl Setup {
    /// Request `i`'s prompt: the system prompt every request shares (`system_blocks` full
    /// blocks), then 70–130 tokens of its own (so each prompt is longer than the
    /// indexer's top-64: the sparse selection matters).
    pub(crate) fn prompt(&self, i: u64) -> Vec<u32> {
        let own = 70 + (i as u32 * 29) % 61;
        (0..self.system_blocks * 64)
            .map(|t| 1000 + t % 3000)
            .chain((0..own).map(|k| (i as u32 * 7919 + k * 31) % 5000))
            .collect()
    }
}

/// One engine: the runtime with the reference model as its forward.
pub(crate) struct Engine {
    pub kv: KvCacheHandle,
    outputs: Arc<Mutex<Outputs>>,
    drafts: usize,
}

/// What one request produced on one engine.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Gen {
    /// Committed output tokens (accepted drafts and sampled tokens).
    pub tokens: Vec<u32>,
    /// Draft proposals: the position they follow and the tokens.
    pub proposals: Vec<(u32, Vec<u32>)>,
    /// Every position the forward ran (device 0): its greedy token and logits digest.
    pub outputs: Vec<TokenOut>,
    /// Prompt tokens served from the cache.
    pub reused: u64,
}

impl Engine {
    /// Starts an engine on `backend` (`host`, or `cuda` on GPU `gpu`).
    pub(crate) async fn start(
        model: Arc<Model>,
        s: &Setup,
        gpu: usize,
    ) -> Result<Engine, BoxError> {
        let outputs = Arc::new(Mutex::new(Outputs::default()));
        let drafts = s.drafts as usize;
        if let Some(blocks) = s.bench_blocks {
            return Ok(Engine {
                kv: bench_engine(s.layers, blocks, &s.backend, gpu, 1).await?,
                outputs,
                drafts,
            });
        }
        let b = KvCacheBuilder::new().config(config(s));
        let b = match s.backend.as_str() {
            "host" => {
                b.host_devices(1)
                    .forward(ModelForward::speculative(model, outputs.clone(), drafts))
            }
            #[cfg(feature = "cuda")]
            "cuda" | "cuda-ipc" => b
                .backend(dsa_kv::cuda::CudaDevice::factory_with(
                    vec![gpu],
                    pool_alloc(&s.backend),
                ))
                .host_devices(1)
                .forward(dsa_kv_model::cuda::CudaModelForward::speculative(
                    model,
                    outputs.clone(),
                    false,
                    Arc::default(),
                    drafts,
                )),
            other => {
                let _ = gpu;
                return Err(format!("unknown or unavailable backend {other:?}").into());
            }
        };
        Ok(Engine {
            kv: b.start().await?,
            outputs,
            drafts,
        })
    }

    /// Runs one request to the end (greedy, MTP drafts accepted while they match).
    pub(crate) async fn generate(
        &self,
        id: RequestId,
        prompt: &[u32],
        max_new: u32,
    ) -> Result<Gen, BoxError> {
        self.kv
            .submit(SubmitRequest {
                id,
                scope: SCOPE,
                prompt: prompt.iter().map(|&t| TokenId(t)).collect(),
                max_new_tokens: max_new,
                priority: 35,
            })
            .await?;
        let mut g = Gen::default();
        let mut drafts: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
        for _ in 0..10_000 {
            let rep = self.kv.step(drafts.clone()).await?;
            let mut outs = Vec::new();
            {
                let mut o = self.outputs.lock().unwrap();
                let nexts = std::mem::take(&mut o.next);
                let accepts = std::mem::take(&mut o.accepted);
                let props = std::mem::take(&mut o.drafts);
                drafts.clear();
                for r in &rep.scheduled {
                    if !r.produces_token {
                        outs.push(RequestOutcome {
                            id: r.id,
                            accepted_drafts: 0,
                            next_token: None,
                        });
                        continue;
                    }
                    let next = nexts[&(0, r.id)];
                    let accepted = accepts.get(&(0, r.id)).copied().unwrap_or(0);
                    let used = step_drafts(r.num_drafts, &g.proposals);
                    g.tokens.extend(&used[..accepted as usize]);
                    g.tokens.push(next);
                    outs.push(RequestOutcome {
                        id: r.id,
                        accepted_drafts: accepted,
                        next_token: Some(TokenId(next)),
                    });
                    if self.drafts > 0 {
                        if let Some((last, d)) = props.get(&(0, r.id)).cloned() {
                            drafts.insert(r.id, d.iter().map(|&t| TokenId(t)).collect());
                            g.proposals.push((last, d));
                        }
                    }
                }
            }
            let c = self.kv.commit(outs).await?;
            if let Some(f) = c.finished.iter().find(|f| f.finished.id == id) {
                g.reused = f.finished.reused_tokens;
                let mut o = self.outputs.lock().unwrap();
                if let Some(m) = o.tokens.remove(&(0, id)) {
                    g.outputs = m.into_values().collect();
                }
                return Ok(g);
            }
        }
        Err(format!("request {id} did not finish in 10,000 steps").into())
    }
}

/// The drafts the last step verified: the tokens of the latest proposal (truncated to
/// what the step took).
fn step_drafts(n: u32, proposals: &[(u32, Vec<u32>)]) -> Vec<u32> {
    match proposals.last() {
        Some((_, d)) if n > 0 => d[..(n as usize).min(d.len())].to_vec(),
        _ => Vec::new(),
    }
}

/// SHA-256 of each block's bytes in every pool of every page (host memory only): read
/// straight from the registered pools, independent of the transfer plan.
///
/// # Safety
///
/// `regions` must be live pools of this process (an engine's `transfer_regions`, the
/// engine running) and nothing may write the blocks' pages during the call (pinned by an
/// export, or reserved by an import whose bytes have landed).
pub(crate) unsafe fn block_digests(
    regions: &[PoolRegion],
    blocks: &[BlockPages],
) -> Result<Vec<String>, BoxError> {
    use sha2::{Digest, Sha256};
    let mut out = Vec::new();
    for b in blocks {
        let mut h = Sha256::new();
        let pages = b
            .target
            .iter()
            .map(|p| (CacheKind::Target, p))
            .chain(b.draft.iter().map(|p| (CacheKind::Draft, p)));
        for (cache, p) in pages {
            let mut pools: Vec<&PoolRegion> = regions
                .iter()
                .filter(|r| (r.cache, r.tier, r.group) == (cache, p.tier, p.group))
                .collect();
            pools.sort_by_key(|r| (r.device, r.pool));
            if pools.is_empty() {
                return Err(format!("no region for page {p:?} of the {cache:?} cache").into());
            }
            for r in pools {
                if r.region.mem != MemKind::Host {
                    return Err("block digests read host memory only (host backend)".into());
                }
                let off = u64::from(p.slot.0) * r.slot_bytes;
                if off + r.slot_bytes > r.region.len {
                    return Err(format!("slot {} outside its pool", p.slot).into());
                }
                // SAFETY: inside a pool region the runtime reported (checked above); the
                // pools live as long as the runtime, and these pages are pinned (export)
                // or reserved (import): nothing writes them during the read.
                let bytes = unsafe {
                    std::slice::from_raw_parts(
                        (r.region.addr + off) as *const u8,
                        r.slot_bytes as usize,
                    )
                };
                h.update(bytes);
            }
        }
        out.push(format!("{:x}", h.finalize()));
    }
    Ok(out)
}

/// The checks of one decoded request against the unpaged reference: the tokens, every
/// position's output the decode engine ran, and every draft proposal.
pub(crate) fn check(model: &Model, s: &Setup, p: &[u32], first: u32, d: &Gen) -> Vec<String> {
    let mut bad = Vec::new();
    let mut got = vec![first];
    got.extend(&d.tokens);
    let want = match generate(model, &format(s.layers), p, got.len() as u32) {
        Ok(w) => w,
        Err(e) => return vec![format!("reference failed: {e}")],
    };
    if got != want.tokens {
        bad.push(format!("tokens {got:?}, reference {:?}", want.tokens));
    }
    if let Some(o) = d
        .outputs
        .iter()
        .find(|o| want.outputs.get(o.pos as usize) != Some(*o))
    {
        bad.push(format!("the output after position {} differs", o.pos));
    }
    if s.drafts > 0 {
        let all: Vec<u32> = p.iter().chain(&want.tokens).copied().collect();
        match draft_reference(model, &format(s.layers), true, &all, s.drafts as usize) {
            Ok(r) => {
                if let Some((last, prop)) = d
                    .proposals
                    .iter()
                    .find(|(l, pr)| r.get(*l as usize) != Some(pr))
                {
                    bad.push(format!(
                        "the draft proposal after position {last} is {prop:?}"
                    ));
                }
            }
            Err(e) => bad.push(format!("draft reference failed: {e}")),
        }
    }
    bad
}

/// Whether `e` is a transport failure after which bytes may still land in the peer's
/// pages (the importer must keep them reserved).
pub(crate) fn in_flight(e: &BoxError) -> bool {
    use dsa_kv::transfer::{PushError, TransportError};
    matches!(
        e.downcast_ref::<PushError>(),
        Some(PushError::Transport(TransportError::InFlight { .. }))
    ) || matches!(
        e.downcast_ref::<TransportError>(),
        Some(TransportError::InFlight { .. })
    )
}

/// The frames of the protocol.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Msg {
    Hello {
        metadata: Vec<u8>,
        regions: Vec<PoolRegion>,
        setup: Setup,
    },
    Export {
        export: ExportedBlocks,
        prompt: Vec<u32>,
        first: u32,
    },
    Ticket(Option<ImportTicket>),
    Written {
        report: TransferReport,
        digests: Vec<String>,
    },
    Failed {
        why: String,
        /// A write may still be landing: the importer must not free its pages.
        in_flight: bool,
    },
    Decoded {
        gen: Gen,
        imported: u32,
        digests_match: bool,
        bad: Vec<String>,
    },
    Bye,
}

/// Length-prefixed JSON frames on a blocking TCP stream.
pub(crate) struct Wire(pub TcpStream);

impl Wire {
    pub(crate) fn send(&mut self, m: &Msg) -> Result<(), BoxError> {
        let b = serde_json::to_vec(m)?;
        self.0.write_all(&(b.len() as u64).to_le_bytes())?;
        self.0.write_all(&b)?;
        Ok(())
    }

    pub(crate) fn recv(&mut self) -> Result<Msg, BoxError> {
        let mut n = [0u8; 8];
        self.0.read_exact(&mut n).map_err(|e| -> BoxError {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "the other side closed the connection (its error says why)".into()
            } else {
                e.into()
            }
        })?;
        let n = u64::from_le_bytes(n);
        if n > 64 << 20 {
            return Err(format!("frame of {n} bytes: not our protocol").into());
        }
        // Grown as the bytes arrive: a peer claiming 64 MiB and sending nothing costs
        // nothing.
        let mut b = Vec::new();
        (&mut self.0).take(n).read_to_end(&mut b)?;
        if (b.len() as u64) < n {
            return Err("the other side closed the connection mid-frame".into());
        }
        Ok(serde_json::from_slice(&b)?)
    }
}

/// One request's record on the prefill side.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct RequestRecord {
    pub id: u64,
    pub prompt_tokens: usize,
    pub exported_blocks: usize,
    pub transfer: TransferReport,
    pub gb_per_s: f64,
    /// Host memcpy of the same bytes in this process (the ceiling a host transfer can
    /// reach), GB/s.
    pub memcpy_gb_per_s: f64,
    pub imported_blocks: u32,
    pub decode_reused_tokens: u64,
    pub digests_match: bool,
    pub exact: bool,
    pub problems: Vec<String>,
}

/// Everything the prefill side saw.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct RunReport {
    pub transport: String,
    pub backend: String,
    pub requests: Vec<RequestRecord>,
    /// Every request exact, every digest equal, every import used.
    pub exact: bool,
}

fn memcpy_gb_per_s(bytes: u64) -> f64 {
    let n = bytes.max(1) as usize;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    // Untimed first copy: the destination's pages are faulted in, as the pools' are.
    dst.copy_from_slice(&src);
    let reps = ((256 << 20) / n).max(3);
    let t = Instant::now();
    for _ in 0..reps {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    (n * reps) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// The GPU pool allocation of a backend name: `cuda-ipc` is the CUDA backend with
/// pools a transport between processes maps directly (`GpuPoolAlloc::Ipc`).
#[cfg(feature = "cuda")]
pub(crate) fn pool_alloc(backend: &str) -> dsa_kv::cuda::GpuPoolAlloc {
    if backend == "cuda-ipc" {
        dsa_kv::cuda::GpuPoolAlloc::Ipc
    } else {
        dsa_kv::cuda::GpuPoolAlloc::Vmm
    }
}

/// Device-to-device copy bandwidth of `bytes` on GPU `gpu` (the ceiling of a transfer
/// between two engines on one GPU), GB/s.
#[cfg(feature = "cuda")]
pub(crate) fn dtod_gb_per_s(gpu: usize, bytes: u64) -> Result<f64, BoxError> {
    use dsa_kv::cuda::cudarc::driver::sys;
    let g = dsa_kv::cuda::Gpu::open(gpu)?;
    let n = bytes.max(1) as usize;
    let a = dsa_kv::cuda::DeviceBuffer::zeroed(&g, n, "ceiling source")?;
    let b = dsa_kv::cuda::DeviceBuffer::zeroed(&g, n, "ceiling destination")?;
    g.bind()?;
    let copy = || {
        // SAFETY: both buffers hold `n` bytes and live until the end of this function.
        let r = unsafe { sys::cuMemcpyDtoD_v2(b.ptr(), a.ptr(), n) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemcpyDtoD: {r:?}"));
        }
        g.context().synchronize().map_err(|e| format!("{e:?}"))
    };
    copy()?;
    let reps = 10;
    let t = Instant::now();
    for _ in 0..reps {
        copy()?;
    }
    Ok((n * reps) as f64 / t.elapsed().as_secs_f64() / 1e9)
}

/// Notifications taken from the transport but not waited for yet (another import's).
static UNCLAIMED: Mutex<Vec<(PeerId, Vec<u8>)>> = Mutex::new(Vec::new());

/// Waits for a notification equal to `want` (at most `timeout`); others taken meanwhile
/// are kept for their own waits (at most 4,096 of them).
fn wait_notification(
    t: &mut dyn KvTransport,
    want: &[u8],
    timeout: Duration,
) -> Result<(), BoxError> {
    let until = Instant::now() + timeout;
    loop {
        let mut kept = UNCLAIMED.lock().unwrap_or_else(|e| e.into_inner());
        kept.extend(t.take_notifications()?);
        if let Some(i) = kept.iter().position(|(_, m)| m == want) {
            kept.remove(i);
            return Ok(());
        }
        let n = kept.len();
        if n > 4096 {
            kept.drain(..n - 4096);
        }
        drop(kept);
        if Instant::now() > until {
            return Err(format!(
                "no notification {:?} within {timeout:?}",
                String::from_utf8_lossy(want)
            )
            .into());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn hello(
    engine_regions: &[PoolRegion],
    t: &mut dyn KvTransport,
    s: &Setup,
) -> Result<Msg, BoxError> {
    let regions: Vec<_> = engine_regions.iter().map(|r| r.region).collect();
    // SAFETY: the engine's own pools; the engine outlives the transport (both live until
    // the side returns, the engine shut down first but its pools are only written while
    // it runs: the last write is before `Bye`), and only imports' reserved pages are
    // written.
    unsafe { t.register(&regions)? };
    Ok(Msg::Hello {
        metadata: t.local_metadata()?,
        regions: engine_regions.to_vec(),
        setup: s.clone(),
    })
}

/// One request's hand-over on the prefill side, after its export: sends it, gets the
/// ticket, writes, releases the export, tells the peer. `None`: nothing was imported
/// (the decode engine had no room, or nothing was exported); the bool says whether
/// the prefill side's digests could be taken (host backend) and sent.
#[allow(clippy::too_many_arguments)]
async fn push_one(
    kv: &KvCacheHandle,
    s: &Setup,
    transport: &mut dyn KvTransport,
    peer: &PeerId,
    wire: &mut Wire,
    regions: &[PoolRegion],
    remote: &[PoolRegion],
    export: &ExportedBlocks,
    p: &[u32],
    first: u32,
) -> Result<(Option<TransferReport>, bool), BoxError> {
    let id = export.id;
    wire.send(&Msg::Export {
        export: export.clone(),
        prompt: p.to_vec(),
        first,
    })?;
    let ticket = match wire.recv()? {
        Msg::Ticket(t) => t,
        Msg::Failed { why, .. } => {
            return Err(format!("the decode side refused request {id}: {why}").into())
        }
        other => return Err(format!("expected a Ticket, got {other:?}").into()),
    };
    let Some(ticket) = ticket else {
        // Decoded without an import (recomputed there): reported as not exact.
        kv.transfer().release_export(id).await?;
        return Ok((None, true));
    };
    let plan = plan_writes(export, regions, &ticket, remote)?;
    let plan = match s.drop.as_deref() {
        Some("index_key") => plan.without_pools(|r| r.roles.contains(&Role::IndexKey)),
        Some("draft") => plan.without_pools(|r| r.cache == CacheKind::Draft),
        _ => plan,
    };
    let note = format!("req-{}", id.0);
    let report = push_plan(transport, peer, &ticket, &plan, note.as_bytes())?;
    // The plan checked the ticket against the export, so `skipped` is in range.
    let digests = if s.backend == "host" {
        // SAFETY: the engine's pools; these pages are pinned by the export, released
        // only below.
        unsafe { block_digests(regions, &export.blocks[ticket.skipped as usize..])? }
    } else {
        Vec::new()
    };
    kv.transfer().release_export(id).await?;
    wire.send(&Msg::Written { report, digests })?;
    Ok((Some(report), true))
}

/// Registers two engines' pools (`ra` the exporter's, `rb` the importer's) with two
/// transports of one process and connects each to the other: the importer as the
/// exporter's peer, and the exporter as the importer's peer (whom the importer's windows
/// admit).
///
/// # Safety
///
/// The engines of `ra` and `rb` outlive the transports, and peers write only into the
/// windows of open imports (`register`'s and `connect`'s contracts).
pub(crate) unsafe fn connect_pair(
    ta: &mut dyn KvTransport,
    tb: &mut dyn KvTransport,
    ra: &[PoolRegion],
    rb: &[PoolRegion],
) -> Result<(PeerId, PeerId), BoxError> {
    // SAFETY: the caller's contract; each side loads the other's own metadata.
    unsafe {
        ta.register(&ra.iter().map(|r| r.region).collect::<Vec<_>>())?;
        tb.register(&rb.iter().map(|r| r.region).collect::<Vec<_>>())?;
        let exporter = tb.connect(&ta.local_metadata()?)?;
        let importer = ta.connect(&tb.local_metadata()?)?;
        Ok((importer, exporter))
    }
}

/// The prefill side's half of `Hello`: registers the engine's pools, exchanges
/// metadata, connects. Returns (our regions, the decode side's, the peer).
async fn greet(
    kv: &KvCacheHandle,
    s: &Setup,
    transport: &mut dyn KvTransport,
    wire: &mut Wire,
) -> Result<(Vec<PoolRegion>, Vec<PoolRegion>, PeerId), BoxError> {
    let regions = kv.transfer().regions().await?;
    wire.send(&hello(&regions, transport, s)?)?;
    let Msg::Hello {
        metadata,
        regions: remote,
        ..
    } = wire.recv()?
    else {
        return Err("expected Hello from the decode side".into());
    };
    // SAFETY: the decode side's transport metadata, from its Hello.
    let peer: PeerId = unsafe { transport.connect(&metadata)? };
    Ok((regions, remote, peer))
}

/// The prefill side: runs every request's prefill, pushes its blocks, collects the
/// decode side's verdicts.
///
/// The transport is dropped before the engine whatever happens: what it may still read
/// or write lies in the engine's pools.
pub(crate) async fn prefill_side(
    model: Arc<Model>,
    s: &Setup,
    gpu: usize,
    mut transport: Box<dyn KvTransport>,
    mut wire: Wire,
    progress: impl Fn(&str),
) -> Result<RunReport, BoxError> {
    let engine = Engine::start(model, s, gpu).await?;
    let report = prefill_requests(&engine, s, transport.as_mut(), &mut wire, progress).await;
    drop(transport);
    let report = report?;
    engine.kv.check_invariants().await.map_err(BoxError::from)?;
    engine.kv.shutdown().await;
    Ok(report)
}

async fn prefill_requests(
    engine: &Engine,
    s: &Setup,
    transport: &mut dyn KvTransport,
    wire: &mut Wire,
    progress: impl Fn(&str),
) -> Result<RunReport, BoxError> {
    let (regions, remote, peer) = greet(&engine.kv, s, transport, wire).await?;
    let mut records = Vec::new();
    for i in 0..s.requests {
        let id = RequestId(i);
        let p = s.prompt(i);
        let pre = engine.generate(id, &p, 1).await?;
        let first = pre.tokens[0];
        let tpb = DSA_TOKENS_PER_BLOCK as usize;
        let toks: Vec<TokenId> = p[..p.len() / tpb * tpb]
            .iter()
            .map(|&t| TokenId(t))
            .collect();
        // The export id is the request's: the request is finished, its id free again.
        let export = engine.kv.transfer().export(id, SCOPE, &toks).await?;
        let (report, digests_ok) = match push_one(
            &engine.kv, s, transport, &peer, wire, &regions, &remote, &export, &p, first,
        )
        .await
        {
            Ok(r) => r,
            Err(e) => {
                // Whatever failed, the export is released and the peer told.
                let _ = engine.kv.transfer().release_export(id).await;
                let _ = wire.send(&Msg::Failed {
                    why: e.to_string(),
                    in_flight: in_flight(&e),
                });
                return Err(e);
            }
        };
        let (gen, imported, digests_match, bad) = match wire.recv()? {
            Msg::Decoded {
                gen,
                imported,
                digests_match,
                bad,
            } => (gen, imported, digests_match, bad),
            Msg::Failed { why, .. } => {
                return Err(format!("the decode side failed on request {id}: {why}").into())
            }
            other => return Err(format!("expected Decoded, got {other:?}").into()),
        };
        let digests_match = digests_match && digests_ok;
        let report = report.unwrap_or_default();
        // Exact: the reference's tokens, outputs and proposals; the bytes; and the decode
        // engine served every exported token from the cache.
        let exact = bad.is_empty()
            && digests_match
            && !export.blocks.is_empty()
            && gen.reused >= export.tokens.len() as u64;
        progress(&format!(
            "request {i}: {} prompt tokens, {} blocks exported, {} skipped, {} written in {} descriptors ({} before coalescing), {:.3} GB/s; decode reused {} tokens; {}",
            p.len(),
            export.blocks.len(),
            report.skipped,
            report.blocks,
            report.write.descriptors,
            report.uncoalesced,
            report.write.gb_per_s(),
            gen.reused,
            if exact { "exact".to_string() } else { format!("MISMATCH {bad:?}") }
        ));
        records.push(RequestRecord {
            id: i,
            prompt_tokens: p.len(),
            exported_blocks: export.blocks.len(),
            transfer: report,
            gb_per_s: report.write.gb_per_s(),
            memcpy_gb_per_s: memcpy_gb_per_s(report.write.bytes),
            imported_blocks: imported,
            decode_reused_tokens: gen.reused,
            digests_match,
            exact,
            problems: bad,
        });
    }
    wire.send(&Msg::Bye)?;
    let exact = records.iter().all(|r| r.exact);
    Ok(RunReport {
        transport: transport.name().to_string(),
        backend: s.backend.clone(),
        requests: records,
        exact,
    })
}

/// One request's import on the decode side: reserves pages for the request it will
/// serve (its prompt, our scope) with a transport window over exactly them, answers the
/// ticket, waits for the bytes and commits, or aborts (a failure, or digests that
/// differ). `None`: nothing imported (no room, or nothing exported); else the blocks
/// imported and whether the pages' digests match the exporter's (always true off the
/// host backend, where they are not taken).
#[allow(clippy::too_many_arguments)]
async fn pull_one(
    kv: &KvCacheHandle,
    s: &Setup,
    transport: &mut dyn KvTransport,
    peer: &PeerId,
    wire: &mut Wire,
    regions: &[PoolRegion],
    export: &ExportedBlocks,
    prompt: &[u32],
) -> Result<Option<(u32, bool)>, BoxError> {
    let id = export.id;
    if export.blocks.is_empty() {
        wire.send(&Msg::Ticket(None))?;
        return Ok(None);
    }
    let tokens: Vec<TokenId> = prompt.iter().map(|&t| TokenId(t)).collect();
    // No room now: a step runs the copies that free slots (an idle engine's step only
    // moves pages), then try again.
    let mut ticket = None;
    for attempt in 0..4 {
        if attempt > 0 {
            kv.step(HashMap::new()).await?;
        }
        ticket = kv
            .transfer()
            .begin_import_with(transport, peer, regions, id, SCOPE, &tokens, export)
            .await?;
        if ticket.is_some() {
            break;
        }
    }
    wire.send(&Msg::Ticket(ticket.clone()))?;
    let Some(ticket) = ticket else {
        return Ok(None);
    };
    let digests = match wire.recv() {
        Ok(Msg::Written { digests, .. }) => digests,
        Ok(Msg::Failed { why, in_flight }) => {
            if !in_flight {
                kv.transfer().abort_import_with(transport, id).await?;
            }
            return Err(format!("the prefill side failed to push request {id}: {why}").into());
        }
        other => {
            // The peer is gone or confused: the window is closed (a write still landing
            // is stopped, where the transport can), then the import aborted.
            kv.transfer().abort_import_with(transport, id).await?;
            return Err(format!("expected Written, got {other:?}").into());
        }
    };
    let note = format!("req-{}", id.0);
    let landed =
        wait_notification(transport, note.as_bytes(), Duration::from_secs(30)).and_then(|()| {
            if s.backend != "host" {
                return Ok(true);
            }
            // SAFETY: our pools; these pages are reserved by the import, whose bytes
            // have landed (notification), and nothing else writes them.
            Ok(unsafe { block_digests(regions, &ticket.blocks)? } == digests)
        });
    match landed {
        Ok(true) => {}
        Ok(false) => {
            // Bytes that are not the exporter's never enter the cache.
            kv.transfer().abort_import_with(transport, id).await?;
            return Ok(Some((0, false)));
        }
        Err(e) => {
            kv.transfer().abort_import_with(transport, id).await?;
            return Err(e);
        }
    }
    let imported = kv.transfer().commit_import_with(transport, id).await?;
    Ok(Some((imported, true)))
}

/// The decode side: imports what the prefill side pushes and decodes each request. The
/// setup (model, drafts, backend) comes from the prefill side's `Hello`.
///
/// The transport is dropped before the engine whatever happens: a receive it may still
/// have posted lands in the engine's pools.
pub(crate) async fn decode_side_with(
    gpu: usize,
    mut transport: Box<dyn KvTransport>,
    mut wire: Wire,
) -> Result<(), BoxError> {
    let Msg::Hello {
        metadata, setup: s, ..
    } = wire.recv()?
    else {
        return Err("expected Hello from the prefill side".into());
    };
    let model = model(s.layers)?;
    let engine = Engine::start(model.clone(), &s, gpu).await?;
    let r = decode_requests(
        &engine,
        &s,
        &model,
        transport.as_mut(),
        &mut wire,
        &metadata,
    )
    .await;
    drop(transport);
    r?;
    engine.kv.check_invariants().await.map_err(BoxError::from)?;
    engine.kv.shutdown().await;
    Ok(())
}

async fn decode_requests(
    engine: &Engine,
    s: &Setup,
    model: &Model,
    transport: &mut dyn KvTransport,
    wire: &mut Wire,
    metadata: &[u8],
) -> Result<(), BoxError> {
    let s = s.clone();
    let regions = engine.kv.transfer().regions().await?;
    wire.send(&hello(&regions, transport, &s)?)?;
    // SAFETY: the prefill side's transport metadata, from its Hello.
    let peer = unsafe { transport.connect(metadata)? };
    loop {
        let (export, p, first) = match wire.recv()? {
            Msg::Export {
                export,
                prompt,
                first,
            } => (export, prompt, first),
            Msg::Bye => break,
            other => return Err(format!("unexpected {other:?}").into()),
        };
        let id = export.id;
        let imported = match pull_one(
            &engine.kv, &s, transport, &peer, wire, &regions, &export, &p,
        )
        .await
        {
            Ok(i) => i,
            Err(e) => {
                let _ = wire.send(&Msg::Failed {
                    why: e.to_string(),
                    in_flight: false,
                });
                return Err(e);
            }
        };
        if s.bench_blocks.is_some() {
            // Measuring: the import must be served from the cache; nothing is decoded.
            // The prompt goes one token past the blocks (a fully cached prompt still
            // computes its last token).
            let prompt: Vec<TokenId> = p.iter().map(|&t| TokenId(t)).collect();
            let reused = engine.kv.probe_reuse(SCOPE, &prompt).await?;
            wire.send(&Msg::Decoded {
                gen: Gen {
                    reused,
                    ..Gen::default()
                },
                imported: imported.map_or(0, |i| i.0),
                digests_match: imported.is_none_or(|i| i.1),
                bad: Vec::new(),
            })?;
            continue;
        }
        let mut p1 = p.clone();
        p1.push(first);
        let gen = engine.generate(id, &p1, s.max_new - 1).await?;
        let bad = check(model, &s, &p, first, &gen);
        wire.send(&Msg::Decoded {
            gen,
            imported: imported.map_or(0, |i| i.0),
            digests_match: imported.is_none_or(|i| i.1),
            bad,
        })?;
    }
    Ok(())
}

fn runtime() -> Result<tokio::runtime::Runtime, BoxError> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Both sides in this process, each on its own thread and tokio runtime, over the
/// local transport (host backend).
pub(crate) fn run_in_process(s: &Setup) -> Result<RunReport, BoxError> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let decode = std::thread::spawn(move || -> Result<(), String> {
        let go = || -> Result<(), BoxError> {
            let (stream, _) = listener.accept()?;
            stream.set_read_timeout(Some(Duration::from_secs(300)))?;
            let t = Box::new(dsa_kv::transfer::LocalTransport::new("decode"));
            runtime()?.block_on(async {
                // The decode side learns the setup (and so the model) from Hello.
                decode_side_with(0, t, Wire(stream)).await
            })
        };
        go().map_err(|e| e.to_string())
    });
    let stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(300)))?;
    let t = Box::new(dsa_kv::transfer::LocalTransport::new("prefill"));
    let report = runtime()?.block_on(prefill_side(
        model(s.layers)?,
        s,
        0,
        t,
        Wire(stream),
        |_| {},
    ));
    let decoded = decode.join().map_err(|_| "the decode thread panicked")?;
    let report = report?;
    decoded.map_err(|e| format!("decode side: {e}"))?;
    Ok(report)
}

/// What [`bench`] measured: one transfer of `blocks` full blocks between two engines of
/// this process (synthetic KV, the model's real page sizes).
#[derive(Clone, Debug, Serialize)]
pub(crate) struct BenchReport {
    pub transport: String,
    pub layers: usize,
    pub blocks: usize,
    pub pages: u64,
    pub bytes: u64,
    pub descriptors: usize,
    pub uncoalesced: usize,
    pub seconds: f64,
    pub gb_per_s: f64,
    /// The same bytes copied by one `memcpy` in this process.
    pub memcpy_gb_per_s: f64,
    /// The same bytes copied device to device on the prefill GPU (cuda backend).
    pub dtod_gb_per_s: Option<f64>,
    /// Every page's SHA-256 equal on both engines (host backend; `None`: not compared).
    pub digests_match: Option<bool>,
    pub decode_reuse_tokens: u64,
}

impl BenchReport {
    /// The report of one timed transfer of `blocks` blocks: the transport's numbers,
    /// and the host memcpy and (CUDA backends) device-to-device ceilings of the same
    /// bytes, measured now on `(backend, gpu)`.
    fn measured(
        transport: &str,
        layers: usize,
        blocks: usize,
        report: &TransferReport,
        (backend, gpu): (&str, usize),
        digests_match: Option<bool>,
        decode_reuse_tokens: u64,
    ) -> Result<BenchReport, BoxError> {
        let w = &report.write;
        Ok(BenchReport {
            transport: transport.to_string(),
            layers,
            blocks,
            pages: report.pages,
            bytes: w.bytes,
            descriptors: w.descriptors,
            uncoalesced: report.uncoalesced,
            seconds: w.elapsed.as_secs_f64(),
            gb_per_s: w.gb_per_s(),
            memcpy_gb_per_s: memcpy_gb_per_s(w.bytes),
            dtod_gb_per_s: dtod(backend, gpu, w.bytes)?,
            digests_match,
            decode_reuse_tokens,
        })
    }
}

fn dtod(backend: &str, gpu: usize, bytes: u64) -> Result<Option<f64>, BoxError> {
    match backend {
        #[cfg(feature = "cuda")]
        "cuda" | "cuda-ipc" => Ok(Some(dtod_gb_per_s(gpu, bytes)?)),
        _ => {
            let _ = (gpu, bytes);
            Ok(None)
        }
    }
}

async fn run_synthetic(kv: &KvCacheHandle) -> Result<(), BoxError> {
    for _ in 0..100_000 {
        if !step_synthetic(kv).await? {
            return Ok(());
        }
    }
    Err("the request did not finish".into())
}

/// One step of an engine with synthetic KV: every scheduled request that produces a
/// token gets token 7. Whether requests are still in flight after it.
pub(crate) async fn step_synthetic(kv: &KvCacheHandle) -> Result<bool, BoxError> {
    let report = kv.step(HashMap::new()).await?;
    let outs: Vec<RequestOutcome> = report
        .scheduled
        .iter()
        .map(|s| RequestOutcome {
            id: s.id,
            accepted_drafts: 0,
            next_token: s.produces_token.then_some(TokenId(7)),
        })
        .collect();
    if !outs.is_empty() {
        kv.commit(outs).await?;
    }
    Ok(kv.counters().in_flight > 0)
}

/// An engine for [`bench`]: DeepSeek-V3.2 page sizes with `layers` layers, an MTP draft
/// cache, room for `blocks` blocks and a warm-up block, synthetic KV, on `devices`
/// devices of `backend` (GPU `gpu`).
pub(crate) async fn bench_engine(
    layers: usize,
    blocks: usize,
    backend: &str,
    gpu: usize,
    devices: usize,
) -> Result<KvCacheHandle, BoxError> {
    bench_engine_with(layers, blocks, backend, gpu, devices, None).await
}

/// [`bench_engine`] with a host tier of `host_bytes` (`None`: the default).
pub(crate) async fn bench_engine_with(
    layers: usize,
    blocks: usize,
    backend: &str,
    gpu: usize,
    devices: usize,
    host_bytes: Option<u64>,
) -> Result<KvCacheHandle, BoxError> {
    bench_engine_config(
        bench_config(layers, blocks, host_bytes),
        backend,
        gpu,
        devices,
    )
    .await
}

/// The configuration of [`bench_engine_with`]: `layers` of DeepSeek-V3.2 with an MTP
/// draft cache, room for sequences of `blocks + 4` blocks, twice over.
pub(crate) fn bench_config(layers: usize, blocks: usize, host_bytes: Option<u64>) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(layers as u32);
    c.spec_decode.mode = SpecMode::Mtp;
    c.spec_decode.draft_tokens = 1;
    c.kv_cache.max_tokens = Some((blocks as u64 + 4) * 64 * 2);
    c.scheduler.max_seq_len = (blocks as u32 + 4) * 64;
    c.scheduler.max_num_tokens = 4096;
    c.kv_cache.host_cache_size = host_bytes;
    c
}

/// A synthetic-writer engine of configuration `c` on `backend`.
pub(crate) async fn bench_engine_config(
    c: EngineConfig,
    backend: &str,
    gpu: usize,
    devices: usize,
) -> Result<KvCacheHandle, BoxError> {
    let b = KvCacheBuilder::new().config(c).host_devices(devices);
    let b = match backend {
        #[cfg(feature = "cuda")]
        "cuda" | "cuda-ipc" => b.backend(dsa_kv::cuda::CudaDevice::factory_with(
            vec![gpu; devices],
            pool_alloc(backend),
        )),
        "host" => b,
        other => {
            return Err(format!("unknown or unavailable backend {other:?} (gpu {gpu})").into())
        }
    };
    Ok(b.start().await?)
}

/// Prefills [`bench`]'s request `id` (`n` full blocks and one token) on `kv` with
/// synthetic KV and exports its blocks. Returns the prompt and the export.
async fn bench_export(
    kv: &KvCacheHandle,
    id: RequestId,
    n: usize,
) -> Result<(Vec<TokenId>, ExportedBlocks), BoxError> {
    let p: Vec<TokenId> = (0..n as u32 * 64 + 1)
        .map(|t| TokenId(id.0 as u32 * 100_000 + t))
        .collect();
    kv.submit(SubmitRequest {
        id,
        scope: SCOPE,
        prompt: p.clone(),
        max_new_tokens: 1,
        priority: 35,
    })
    .await?;
    run_synthetic(kv).await?;
    let export = kv.transfer().export(id, SCOPE, &p[..n * 64]).await?;
    Ok((p, export))
}

/// [`bench`] across two processes: this side prefills and pushes over the protocol, the
/// decode side (started with the same `Setup`, `bench_blocks` set) imports, and reports
/// how much of the import it serves. Used where two transports cannot share a process
/// (NCCL: one rank per process).
pub(crate) async fn bench_prefill_side(
    s: &Setup,
    gpu: usize,
    mut transport: Box<dyn KvTransport>,
    mut wire: Wire,
) -> Result<BenchReport, BoxError> {
    let blocks = s
        .bench_blocks
        .ok_or("bench_prefill_side needs bench_blocks")?;
    let kv = bench_engine(s.layers, blocks, &s.backend, gpu, 1).await?;
    let r = bench_pushes(&kv, s, blocks, gpu, transport.as_mut(), &mut wire).await;
    // The transport goes before the engine: what it may still read lies in its pools.
    drop(transport);
    let r = r?;
    kv.check_invariants().await.map_err(BoxError::from)?;
    kv.shutdown().await;
    Ok(r)
}

async fn bench_pushes(
    kv: &KvCacheHandle,
    s: &Setup,
    blocks: usize,
    gpu: usize,
    transport: &mut dyn KvTransport,
    wire: &mut Wire,
) -> Result<BenchReport, BoxError> {
    let (regions, remote, peer) = greet(kv, s, transport, wire).await?;
    let mut out = None;
    for (id, n) in [(1u64, 1usize), (2, blocks)] {
        let id = RequestId(id);
        let (p, export) = bench_export(kv, id, n).await?;
        let words: Vec<u32> = p.iter().map(|t| t.0).collect();
        let pushed = push_one(
            kv, s, transport, &peer, wire, &regions, &remote, &export, &words, 0,
        )
        .await;
        let report = match pushed {
            Ok((Some(r), _)) => r,
            Ok((None, _)) => {
                let why = "the decode side had no room for the blocks";
                let _ = wire.send(&Msg::Failed {
                    why: why.into(),
                    in_flight: false,
                });
                return Err(why.into());
            }
            Err(e) => {
                let _ = kv.transfer().release_export(id).await;
                let _ = wire.send(&Msg::Failed {
                    why: e.to_string(),
                    in_flight: in_flight(&e),
                });
                return Err(e);
            }
        };
        let (reuse, digests_match) = match wire.recv()? {
            Msg::Decoded {
                gen, digests_match, ..
            } => (gen.reused, digests_match),
            Msg::Failed { why, .. } => return Err(format!("the decode side failed: {why}").into()),
            other => return Err(format!("expected Decoded, got {other:?}").into()),
        };
        if reuse < n as u64 * 64 {
            return Err(format!(
                "the decode side serves {reuse} of the {} imported tokens",
                n * 64
            )
            .into());
        }
        out = Some(BenchReport::measured(
            transport.name(),
            s.layers,
            n,
            &report,
            (&s.backend, gpu),
            (s.backend == "host").then_some(digests_match),
            reuse,
        )?);
    }
    wire.send(&Msg::Bye)?;
    out.ok_or_else(|| "nothing measured".into())
}

/// Prefills `blocks` blocks on engine A (DeepSeek-V3.2 page sizes with `layers` layers,
/// MTP draft cache, synthetic KV), then moves them to engine B through `ta` → `tb`:
/// a 1-block warm-up (connection setup), then the timed transfer.
pub(crate) async fn bench(
    layers: usize,
    blocks: usize,
    backend: &str,
    gpus: (usize, usize),
    devices: usize,
    mut ta: Box<dyn KvTransport>,
    mut tb: Box<dyn KvTransport>,
) -> Result<BenchReport, BoxError> {
    let (a, b) = (
        bench_engine(layers, blocks, backend, gpus.0, devices).await?,
        bench_engine(layers, blocks, backend, gpus.1, devices).await?,
    );
    let r = bench_moves(
        &a,
        &b,
        layers,
        blocks,
        backend,
        gpus,
        ta.as_mut(),
        tb.as_mut(),
    )
    .await;
    // The transports go before the engines: what they may still move lies in their pools.
    drop((ta, tb));
    let r = r?;
    a.shutdown().await;
    b.shutdown().await;
    Ok(r)
}

#[allow(clippy::too_many_arguments)]
async fn bench_moves(
    a: &KvCacheHandle,
    b: &KvCacheHandle,
    layers: usize,
    blocks: usize,
    backend: &str,
    gpus: (usize, usize),
    ta: &mut dyn KvTransport,
    tb: &mut dyn KvTransport,
) -> Result<BenchReport, BoxError> {
    let (ra, rb) = (a.transfer().regions().await?, b.transfer().regions().await?);
    // SAFETY: the engines' own pools, alive until they shut down at the end of this
    // function after the last write; writes go only into pages an import reserved; each
    // transport loads the other's own metadata.
    let (peer, peer_a) = unsafe { connect_pair(ta, tb, &ra, &rb)? };
    let mut out = None;
    for (id, n) in [(1u64, 1usize), (2, blocks)] {
        let id = RequestId(id);
        let (p, export) = bench_export(a, id, n).await?;
        // B's peer is A's agent; B serves the same prompt under the same scope.
        let ticket = b
            .transfer()
            .begin_import_with(tb, &peer_a, &rb, id, SCOPE, &p, &export)
            .await?
            .ok_or("no room on engine B")?;
        let plan = plan_writes(&export, &ra, &ticket, &rb)?;
        let note = format!("req-{}", id.0);
        let report = push_plan(ta, &peer, &ticket, &plan, note.as_bytes());
        let host = backend == "host";
        let want = if host {
            // SAFETY: engine A's pools, pinned by the export until released below.
            unsafe { block_digests(&ra, &export.blocks)? }
        } else {
            Vec::new()
        };
        a.transfer().release_export(id).await?;
        let report = match report {
            Ok(r) => r,
            Err(e) => {
                b.transfer().abort_import_with(tb, id).await?;
                return Err(e.into());
            }
        };
        wait_notification(tb, note.as_bytes(), Duration::from_secs(60))?;
        // On a GPU the pools are device memory: the bytes are not compared (the GPU model
        // run checks the tokens instead); the reuse below must hold everywhere.
        let digests_match = if host {
            // SAFETY: engine B's pools; the import's pages, whose bytes have landed.
            Some(unsafe { block_digests(&rb, &ticket.blocks)? } == want)
        } else {
            None
        };
        if digests_match == Some(false) {
            b.transfer().abort_import_with(tb, id).await?;
            return Err("the imported pages differ from the exported ones: aborted".into());
        }
        b.transfer().commit_import_with(tb, id).await?;
        let reuse = b.probe_reuse(SCOPE, &p).await?;
        if reuse < n as u64 * 64 {
            return Err(
                format!("engine B serves {reuse} of the {} imported tokens", n * 64).into(),
            );
        }
        out = Some(BenchReport::measured(
            ta.name(),
            layers,
            n,
            &report,
            (backend, gpus.0),
            digests_match,
            reuse,
        )?);
    }
    out.ok_or_else(|| "nothing measured".into())
}
