//! Prefill / decode disaggregation with the reference model over the library's transfer
//! session (`dsa_kv::transfer::session`): the two engines, each request's hand-over, and
//! the checks against the unpaged reference.
//!
//! On one TCP connection, the session's frames and the example's own (`AppMsg`):
//! 1. the prefill side sends `Setup` (the decode side learns the model from it); both
//!    open the session (transport metadata, pool regions, digests on the host backend);
//! 2. per request, the prefill side prefills it (one token), exports the prompt's full
//!    blocks, sends `Request` (the prompt and the first token: what a router would hand
//!    the decode engine) and hands the export over (`TransferSession::hand_over`);
//! 3. the decode side takes the offer, reserves pages for the request it serves (its
//!    own prompt: `begin`), and `finish`es the import (ticket, bytes, digests, commit
//!    or abort); then decodes the request from the prompt plus the first token and sends
//!    `Decoded` (tokens, reuse, the checks' findings);
//! 4. `Done`, and the session's `Bye`.
//!
//! The connection is trusted as it is (first connection wins): bind it to loopback
//! (the default) or to an address only the two engines reach.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsa_kv::actors::{KvCacheBuilder, KvCacheHandle};
use dsa_kv::config::{EngineConfig, KvDtype, SpecMode, DSA_TOKENS_PER_BLOCK};
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::core::ReuseScope;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::layout::Role;
use dsa_kv::ops::quant::ScaleFormat;
use dsa_kv::transfer::session::{
    AbortReason, HandOver, ImportOutcome, SessionOptions, TransferSession, Wire,
};
use dsa_kv::transfer::{CacheKind, ExportedBlocks, KvTransport, TransferReport};
use dsa_kv::v4::{
    DeviceBackend, V4Preset, WindowedBackendFactory, WindowedHostDevice, WindowedModel,
    WindowedSetup,
};
use dsa_kv_model::paged::{ForwardOptions, ModelForward, Outputs};
use dsa_kv_model::unpaged::{draft_reference, generate};
use dsa_kv_model::v4::{V4Model, V4ModelConfig, V4ModelForward, V4Outputs};
use dsa_kv_model::{CacheFormat, Model, ModelConfig, TokenOut};
use serde::{Deserialize, Serialize};

use crate::bench::{bench_engine, memcpy_gb_per_s, BenchReport};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The reuse scope of every request.
pub(crate) const SCOPE: ReuseScope = ReuseScope::SHARED;

/// The longest wait for the peer's next application frame (a prefill or decode runs
/// meanwhile).
const APP_WAIT: Duration = Duration::from_secs(600);

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
    /// `host`, `cuda` or `cuda-ipc`.
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
    /// A DeepSeek-V4 preset's name: its reference model (the preset's layer structure,
    /// tiny widths) instead of the DSA one; `None`: the DSA model.
    #[serde(default)]
    pub model: Option<String>,
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
            model: None,
        }
    }
}

impl Setup {
    /// The DeepSeek-V4 preset the run serves (`None`: the DSA model); an unknown name is
    /// an error.
    pub(crate) fn v4(&self) -> Result<Option<V4Preset>, BoxError> {
        match self.model.as_deref() {
            None | Some("dsa") => Ok(None),
            Some(name) => V4Preset::parse(name).map(Some).ok_or_else(|| {
                format!("--model {name:?}: use dsa, deepseek-v4-flash or deepseek-v4-pro").into()
            }),
        }
    }

    /// Tokens per block of the model served (the unit a transfer moves).
    pub(crate) fn tokens_per_block(&self) -> u32 {
        match self.v4() {
            Ok(Some(_)) => 256,
            _ => DSA_TOKENS_PER_BLOCK,
        }
    }

    /// Request `i`'s prompt: the system prompt every request shares (`system_blocks` full
    /// blocks), then 70–130 tokens of its own per 64 tokens of a block (so each prompt
    /// is longer than the indexer's top-64, the sparse selection matters, and with
    /// DeepSeek-V4's 256-token blocks each request brings a block of its own).
    pub(crate) fn prompt(&self, i: u64) -> Vec<u32> {
        let per = self.tokens_per_block() / 64;
        let own = (70 + (i as u32 * 29) % 61) * per;
        let vocab = if matches!(self.v4(), Ok(Some(_))) {
            256
        } else {
            5000
        };
        (0..self.system_blocks * 64 * per)
            .map(|t| (1000 + t % 3000) % vocab)
            .chain((0..own).map(|k| (i as u32 * 7919 + k * 31) % vocab))
            .collect()
    }

    /// The session's options: page digests where the pools are host memory.
    fn session_options(&self) -> SessionOptions {
        SessionOptions {
            digests: self.backend == "host",
            ..SessionOptions::default()
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

/// The model both sides run (its unpaged run is the reference).
#[derive(Clone)]
pub(crate) enum Family {
    /// The DSA reference model (DeepSeek-V3.2's cache: MLA rows and indexer keys).
    Dsa(Arc<Model>),
    /// The DeepSeek-V4 reference model with a preset's layer structure (compressed
    /// blocks, window tails, compressor state).
    V4(Arc<V4Model>),
}

/// The model of setup `s`.
pub(crate) fn family(s: &Setup) -> Result<Family, BoxError> {
    match s.v4()? {
        None => {
            let cfg = ModelConfig {
                layers: s.layers,
                ..ModelConfig::tiny(7)
            };
            Ok(Family::Dsa(Arc::new(Model::new(cfg, format(s.layers))?)))
        }
        Some(preset) => {
            let spec = preset.spec();
            let cfg = V4ModelConfig {
                ratios: spec.compress_ratios.clone(),
                mtp: spec.num_mtp_layers > 0,
                ..V4ModelConfig::tiny(7)
            };
            Ok(Family::V4(Arc::new(V4Model::new(cfg)?)))
        }
    }
}

/// The engine configuration of a DeepSeek-V4 run: MTP drafts in the target cache
/// (`s.drafts`), a budget for two sequences of 256-token steps, a host tier.
fn v4_config(s: &Setup) -> EngineConfig {
    let mut c = EngineConfig::default();
    if s.drafts > 0 {
        c.spec_decode.mode = SpecMode::Mtp;
        c.spec_decode.draft_tokens = s.drafts;
    }
    c.spec_decode.separate_draft_cache = false;
    c.kv_cache.enable_partial_reuse = false;
    c.kv_cache.max_gpu_total_bytes = Some(256 << 20);
    c.kv_cache.host_cache_size = Some(64 << 20);
    c.scheduler.max_num_sequences = 2;
    c.scheduler.max_num_tokens = 256;
    c.scheduler.max_prefill_chunk = 256;
    c.scheduler.max_seq_len = s.system_blocks * 256 + 4096;
    c
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

/// What a model's forward records: every position's output, per device and request.
enum Recorded {
    Dsa(Arc<Mutex<Outputs>>),
    V4(Arc<Mutex<V4Outputs>>),
}

impl Recorded {
    /// Device 0's outputs of request `id`, in position order (taken out).
    fn take(&self, id: RequestId) -> Vec<TokenOut> {
        let m = match self {
            Recorded::Dsa(o) => o.lock().unwrap().tokens.remove(&(0, id)),
            Recorded::V4(o) => o.lock().unwrap().tokens.remove(&(0, id)),
        };
        m.map(|m| m.into_values().collect()).unwrap_or_default()
    }

    /// Positions computed twice with different outputs (a V4 forward records them).
    fn conflicts(&self) -> Vec<String> {
        match self {
            Recorded::Dsa(_) => Vec::new(),
            Recorded::V4(o) => o.lock().unwrap().conflicts.clone(),
        }
    }
}

/// One engine: the runtime with the reference model as its forward.
pub(crate) struct Engine {
    pub kv: KvCacheHandle,
    outputs: Recorded,
    /// Draft proposals to collect (the DSA model's, checked against its reference).
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
    /// Positions the forward computed twice with different outputs (must stay empty).
    #[serde(default)]
    pub conflicts: Vec<String>,
}

impl Engine {
    /// Starts an engine on `s.backend` (`host`, or `cuda` on GPU `gpu`), or the
    /// synthetic-writer engine of a measurement (`s.bench_blocks`).
    pub(crate) async fn start(family: &Family, s: &Setup, gpu: usize) -> Result<Engine, BoxError> {
        let outputs = Arc::new(Mutex::new(Outputs::default()));
        let drafts = s.drafts as usize;
        if let Some(blocks) = s.bench_blocks {
            return Ok(Engine {
                kv: bench_engine(s.layers, blocks, &s.backend, gpu, 1).await?,
                outputs: Recorded::Dsa(outputs),
                drafts,
            });
        }
        let model = match family {
            Family::Dsa(m) => m.clone(),
            Family::V4(m) => return Self::start_v4(m, s, gpu).await,
        };
        let b = KvCacheBuilder::new().config(config(s));
        let opts = ForwardOptions::default()
            .drafts(drafts)
            .record(outputs.clone());
        let b = match s.backend.as_str() {
            "host" => b
                .host_devices(1)
                .forward(ModelForward::factory(model, opts)),
            #[cfg(feature = "cuda")]
            "cuda" | "cuda-ipc" => b
                .backend(dsa_kv::cuda::CudaDevice::factory_with(
                    vec![gpu],
                    crate::bench::pool_alloc(&s.backend),
                ))
                .host_devices(1)
                .forward(dsa_kv_model::cuda::CudaModelForward::factory(
                    model,
                    opts,
                    false,
                    Arc::default(),
                )),
            other => {
                let _ = gpu;
                return Err(format!("unknown or unavailable backend {other:?}").into());
            }
        };
        Ok(Engine {
            kv: b.start().await?,
            outputs: Recorded::Dsa(outputs),
            drafts,
        })
    }

    /// A DeepSeek-V4 engine: the V4 reference model on one device, the host backend's
    /// (pools in host memory) or, with `--backend cuda`, the CUDA backend's windowed
    /// device on GPU `gpu` (pools in GPU memory, the host tier pinned; the forward in
    /// kernels).
    async fn start_v4(model: &Arc<V4Model>, s: &Setup, gpu: usize) -> Result<Engine, BoxError> {
        let outputs = Arc::new(Mutex::new(V4Outputs::default()));
        let (m, o) = (model.clone(), outputs.clone());
        let backend: WindowedBackendFactory = match s.backend.as_str() {
            "host" => Arc::new(move |i, w: &WindowedSetup| {
                let f = V4ModelForward::new(m.clone(), o.clone());
                let d = WindowedHostDevice::new(i, &w.plan, &w.slots, Box::new(f))?;
                Ok(Box::new(d) as Box<dyn DeviceBackend>)
            }),
            #[cfg(feature = "cuda")]
            "cuda" => Arc::new(move |i, w: &WindowedSetup| {
                let g = dsa_kv::cuda::Gpu::open(gpu).map_err(|e| {
                    dsa_kv::device::DeviceError::Backend {
                        device: i,
                        source: dsa_kv::storage::BackendError::new(e),
                    }
                })?;
                let d = dsa_kv_model::v4::cuda::v4_cuda_device(
                    i,
                    g,
                    &w.plan,
                    &w.slots,
                    m.clone(),
                    o.clone(),
                    w.max_positions,
                )?;
                Ok(Box::new(d) as Box<dyn DeviceBackend>)
            }),
            other => {
                let _ = gpu;
                return Err(format!(
                    "--model {}: backend {other:?} is not available for DeepSeek-V4 (host, or \
                     cuda in a build with the `cuda` feature)",
                    s.model.as_deref().unwrap_or_default()
                )
                .into());
            }
        };
        let kv = KvCacheBuilder::new()
            .config(v4_config(s))
            .host_devices(1)
            .windowed(WindowedModel::new(model.config().spec()?, backend))
            .start()
            .await?;
        Ok(Engine {
            kv,
            outputs: Recorded::V4(outputs),
            drafts: 0,
        })
    }

    /// Runs one request to the end (greedy, MTP drafts accepted while they match).
    pub(crate) async fn generate(
        &self,
        id: RequestId,
        prompt: &[u32],
        max_new: u32,
    ) -> Result<Gen, BoxError> {
        let prompt_len = prompt.len();
        let prompt = prompt.iter().map(|&t| TokenId(t)).collect();
        let mut request = SubmitRequest::new(id, prompt, max_new);
        request.scope = SCOPE;
        self.kv.submit(request).await?;
        let mut g = Gen::default();
        for _ in 0..10_000 {
            // The forward samples (and proposes the next step's drafts); the runtime
            // commits the step.
            let rep = self.kv.step(HashMap::new()).await?;
            let c = rep
                .committed
                .as_ref()
                .ok_or("the model's forward sampled nothing")?;
            let mut proposed: HashMap<RequestId, &Vec<TokenId>> = rep
                .devices
                .first()
                .and_then(|d| d.sampled())
                .map(|s| s.drafts.iter().map(|(id, d)| (*id, d)).collect())
                .unwrap_or_default();
            if let Some(d) = &rep.draft {
                proposed.extend(d.proposals.iter().map(|(id, d)| (*id, d)));
            }
            for (r, o) in rep.scheduled.iter().zip(&rep.outcomes) {
                let Some(next) = o.next_token.filter(|_| r.produces_token) else {
                    continue;
                };
                let used = &r.tokens[r.tokens.len() - r.num_drafts as usize..];
                g.tokens
                    .extend(used[..o.accepted_drafts as usize].iter().map(|t| t.0));
                g.tokens.push(next.0);
                if self.drafts > 0 {
                    if let Some(d) = proposed.get(&r.id) {
                        // The chain follows the last accepted position; the sampled
                        // token is after it.
                        let last = (prompt_len + g.tokens.len() - 2) as u32;
                        g.proposals.push((last, d.iter().map(|t| t.0).collect()));
                    }
                }
            }
            if let Some(f) = c.finished.iter().find(|f| f.finished.id == id) {
                g.reused = f.finished.reused_tokens;
                g.outputs = self.outputs.take(id);
                g.conflicts = self.outputs.conflicts();
                return Ok(g);
            }
        }
        Err(format!("request {id} did not finish in 10,000 steps").into())
    }
}

/// The checks of one decoded request against the unpaged reference: the tokens, every
/// position's output the decode engine ran, and (DSA) every draft proposal.
pub(crate) fn check(family: &Family, s: &Setup, p: &[u32], first: u32, d: &Gen) -> Vec<String> {
    let mut bad = d.conflicts.clone();
    let mut got = vec![first];
    got.extend(&d.tokens);
    let model = match family {
        Family::Dsa(m) => m,
        Family::V4(m) => {
            let want = match m.generate(p, got.len() as u32) {
                Ok(w) => w,
                Err(e) => return vec![format!("reference failed: {e}")],
            };
            bad.extend(compare(&got, &d.outputs, &want.tokens, &want.outputs));
            return bad;
        }
    };
    let want = match generate(model, &format(s.layers), p, got.len() as u32) {
        Ok(w) => w,
        Err(e) => return vec![format!("reference failed: {e}")],
    };
    bad.extend(compare(&got, &d.outputs, &want.tokens, &want.outputs));
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

/// The tokens and every output the engine ran against the reference's.
fn compare(got: &[u32], outs: &[TokenOut], tokens: &[u32], want: &[TokenOut]) -> Vec<String> {
    let mut bad = Vec::new();
    if got != tokens {
        bad.push(format!("tokens {got:?}, reference {tokens:?}"));
    }
    if let Some(o) = outs.iter().find(|o| want.get(o.pos as usize) != Some(*o)) {
        bad.push(format!("the output after position {} differs", o.pos));
    }
    bad
}

/// The example's own frames, between the session's.
#[derive(Debug, Serialize, Deserialize)]
enum AppMsg {
    /// The run (first, before the session opens).
    Setup(Setup),
    /// The request the decode engine is to serve next; its offer follows.
    Request {
        id: RequestId,
        prompt: Vec<u32>,
        first: u32,
    },
    /// What the decode engine made of it.
    Decoded { gen: Gen, bad: Vec<String> },
    /// No more requests.
    Done,
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
    /// What the decode engine made of the import (`None`: it declined it).
    pub outcome: Option<ImportOutcome>,
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

/// The session's wire on the connection between the two sides.
fn wire(stream: std::net::TcpStream) -> Result<Wire<tokio::net::TcpStream>, BoxError> {
    stream.set_nonblocking(true)?;
    stream.set_nodelay(true)?;
    Ok(Wire::new(tokio::net::TcpStream::from_std(stream)?))
}

/// One request handed over by the prefill side: the request (for the decode engine),
/// then the session's hand-over of `export`, then the decode side's verdict.
struct Handed {
    report: TransferReport,
    outcome: Option<ImportOutcome>,
    gen: Gen,
    bad: Vec<String>,
}

async fn hand_over(
    session: &mut TransferSession<tokio::net::TcpStream>,
    export: &ExportedBlocks,
    prompt: &[u32],
    first: u32,
) -> Result<Handed, BoxError> {
    session
        .wire()
        .send(&AppMsg::Request {
            id: export.id,
            prompt: prompt.to_vec(),
            first,
        })
        .await?;
    let (report, outcome) = match session.hand_over(export).await? {
        HandOver::Declined { .. } => (TransferReport::default(), None),
        HandOver::Pushed { report, outcome } => (report, Some(outcome)),
        other => return Err(format!("unexpected hand-over {other:?}").into()),
    };
    match session.wire().recv_within(APP_WAIT).await? {
        AppMsg::Decoded { gen, bad } => Ok(Handed {
            report,
            outcome,
            gen,
            bad,
        }),
        other => Err(format!("expected Decoded, got {other:?}").into()),
    }
}

/// The prefill side: sends the setup, opens the session, runs every request's prefill
/// and hands its blocks over, collects the decode side's verdicts.
pub(crate) async fn prefill_side(
    model: Family,
    s: &Setup,
    gpu: usize,
    transport: Box<dyn KvTransport>,
    stream: std::net::TcpStream,
    progress: impl Fn(&str),
) -> Result<RunReport, BoxError> {
    let mut wire = wire(stream)?;
    wire.send(&AppMsg::Setup(s.clone())).await?;
    let engine = Engine::start(&model, s, gpu).await?;
    // SAFETY: the engine runs until after the session is dropped (at the end of this
    // function, or on an early return: `session` is declared after `engine`, so it goes
    // first); the wire is this example's own connection to the decode side.
    let mut session =
        unsafe { TransferSession::open(&engine.kv, transport, wire, s.session_options()) }.await?;
    let v4 = s.v4()?.is_some();
    match s.drop.as_deref() {
        Some("index_key") => session.edit_plans(|p| {
            p.without_pools(|r| {
                r.roles.contains(&Role::IndexKey) || r.roles.contains(&Role::CompressedIndexKey)
            })
        }),
        Some("draft") if !v4 => {
            session.edit_plans(|p| p.without_pools(|r| r.cache == CacheKind::Draft))
        }
        Some("window") if v4 => {
            session.edit_plans(|p| p.without_pools(|r| matches!(r.cache, CacheKind::Window(_))))
        }
        Some(other) => {
            return Err(format!(
                "--drop {other:?}: use index_key, or {}",
                if v4 { "window (the tails)" } else { "draft" }
            )
            .into())
        }
        None => {}
    }
    let mut records = Vec::new();
    for i in 0..s.requests {
        let id = RequestId(i);
        let p = s.prompt(i);
        let pre = engine.generate(id, &p, 1).await?;
        let first = pre.tokens[0];
        let tpb = s.tokens_per_block() as usize;
        let toks: Vec<TokenId> = p[..p.len() / tpb * tpb]
            .iter()
            .map(|&t| TokenId(t))
            .collect();
        // The export id is the request's: the request is finished, its id free again.
        let export = engine.kv.transfer().export(id, SCOPE, &toks).await?;
        let h = hand_over(&mut session, &export, &p, first).await?;
        let digests_match = !matches!(
            h.outcome,
            Some(ImportOutcome::Aborted {
                reason: AbortReason::DigestsDiffer { .. }
            })
        );
        let imported = h
            .outcome
            .as_ref()
            .map_or(0, ImportOutcome::committed_blocks);
        // Exact: the reference's tokens, outputs and proposals; the bytes; and the decode
        // engine served every exported token from the cache.
        let exact = h.bad.is_empty()
            && digests_match
            && !export.blocks.is_empty()
            && h.gen.reused >= export.tokens.len() as u64;
        let report = h.report;
        progress(&format!(
            "request {i}: {} prompt tokens, {} blocks exported, {} skipped, {} written in {} descriptors ({} before coalescing), {:.3} GB/s; decode: {:?}, reused {} tokens; {}",
            p.len(),
            export.blocks.len(),
            report.skipped,
            report.blocks,
            report.write.descriptors,
            report.uncoalesced,
            report.write.gb_per_s(),
            h.outcome,
            h.gen.reused,
            if exact { "exact".to_string() } else { format!("MISMATCH {:?}", h.bad) }
        ));
        records.push(RequestRecord {
            id: i,
            prompt_tokens: p.len(),
            exported_blocks: export.blocks.len(),
            transfer: report,
            gb_per_s: report.write.gb_per_s(),
            memcpy_gb_per_s: memcpy_gb_per_s(report.write.bytes),
            outcome: h.outcome,
            imported_blocks: imported,
            decode_reused_tokens: h.gen.reused,
            digests_match,
            exact,
            problems: h.bad,
        });
    }
    session.wire().send(&AppMsg::Done).await?;
    let transport = session.transport_name().to_string();
    session.close().await?;
    engine.kv.check_invariants().await.map_err(BoxError::from)?;
    engine.kv.shutdown().await;
    let exact = records.iter().all(|r| r.exact);
    Ok(RunReport {
        transport,
        backend: s.backend.clone(),
        requests: records,
        exact,
    })
}

/// [`prefill_side`] of a measurement (`s.bench_blocks`, two processes): a one-block
/// warm-up transfer (connection setup), then the timed one of `bench_blocks` blocks of
/// synthetic KV; the decode side reports how much of each import it serves.
pub(crate) async fn bench_prefill_side(
    s: &Setup,
    gpu: usize,
    transport: Box<dyn KvTransport>,
    stream: std::net::TcpStream,
) -> Result<BenchReport, BoxError> {
    let blocks = s
        .bench_blocks
        .ok_or("bench_prefill_side needs bench_blocks")?;
    let mut wire = wire(stream)?;
    wire.send(&AppMsg::Setup(s.clone())).await?;
    let kv = bench_engine(s.layers, blocks, &s.backend, gpu, 1).await?;
    // SAFETY: as in `prefill_side`: the engine outlives the session (declared after
    // it), the wire is our own connection.
    let mut session =
        unsafe { TransferSession::open(&kv, transport, wire, s.session_options()) }.await?;
    let mut out = None;
    for (id, n) in [(1u64, 1usize), (2, blocks)] {
        let id = RequestId(id);
        let (p, export) = crate::bench::bench_export(&kv, id, n).await?;
        let words: Vec<u32> = p.iter().map(|t| t.0).collect();
        let h = hand_over(&mut session, &export, &words, 0).await?;
        match &h.outcome {
            Some(ImportOutcome::Committed { .. }) => {}
            other => return Err(format!("the decode side did not import: {other:?}").into()),
        }
        if h.gen.reused < n as u64 * 64 {
            return Err(format!(
                "the decode side serves {} of the {} imported tokens",
                h.gen.reused,
                n * 64
            )
            .into());
        }
        out = Some(BenchReport::measured(
            session.transport_name(),
            s.layers,
            n,
            &h.report,
            (&s.backend, gpu),
            // Committed with digests on: every page's bytes equal on both sides.
            s.session_options().digests.then_some(true),
            h.gen.reused,
        )?);
    }
    session.wire().send(&AppMsg::Done).await?;
    session.close().await?;
    kv.check_invariants().await.map_err(BoxError::from)?;
    kv.shutdown().await;
    out.ok_or_else(|| "nothing measured".into())
}

/// The decode side: learns the setup, opens the session, imports what the prefill side
/// hands over and decodes each request (or, measuring, reports its reuse).
pub(crate) async fn decode_side(
    gpu: usize,
    transport: Box<dyn KvTransport>,
    stream: std::net::TcpStream,
) -> Result<(), BoxError> {
    let mut wire = wire(stream)?;
    let s = match wire.recv_within(APP_WAIT).await? {
        AppMsg::Setup(s) => s,
        other => return Err(format!("expected the Setup, got {other:?}").into()),
    };
    let model = family(&s)?;
    let engine = Engine::start(&model, &s, gpu).await?;
    // SAFETY: as in `prefill_side`.
    let mut session =
        unsafe { TransferSession::open(&engine.kv, transport, wire, s.session_options()) }.await?;
    loop {
        let (id, p, first) = match session.wire().recv_within(APP_WAIT).await? {
            AppMsg::Request { id, prompt, first } => (id, prompt, first),
            AppMsg::Done => break,
            other => return Err(format!("expected a Request, got {other:?}").into()),
        };
        let offer = session
            .next_offer()
            .await?
            .ok_or("the prefill side ended the session before its offer")?;
        let tokens: Vec<TokenId> = p.iter().map(|&t| TokenId(t)).collect();
        import(&mut session, &engine.kv, id, &tokens, &offer).await?;
        let (gen, bad) = if s.bench_blocks.is_some() {
            // Measuring: the import must be served from the cache; nothing is decoded.
            // The prompt goes one token past the blocks (a fully cached prompt still
            // computes its last token).
            let reused = engine.kv.probe_reuse(SCOPE, &tokens).await?;
            let gen = Gen {
                reused,
                ..Gen::default()
            };
            (gen, Vec::new())
        } else {
            let mut p1 = p.clone();
            p1.push(first);
            let gen = engine.generate(id, &p1, s.max_new - 1).await?;
            let bad = check(&model, &s, &p, first, &gen);
            (gen, bad)
        };
        session.wire().send(&AppMsg::Decoded { gen, bad }).await?;
    }
    if session.next_offer().await?.is_some() {
        return Err("an offer after Done".into());
    }
    drop(session);
    engine.kv.check_invariants().await.map_err(BoxError::from)?;
    engine.kv.shutdown().await;
    Ok(())
}

/// The decode side's import of `offer` for request `id` (its prompt `tokens`, our
/// scope): declined when nothing was exported or no room is found after a few steps
/// (an idle engine's step only runs the copies that free slots), else finished.
async fn import(
    session: &mut TransferSession<tokio::net::TcpStream>,
    kv: &KvCacheHandle,
    id: RequestId,
    tokens: &[TokenId],
    offer: &ExportedBlocks,
) -> Result<Option<ImportOutcome>, BoxError> {
    if offer.blocks.is_empty() {
        session
            .reply(offer.id, Err("nothing was exported: recomputing"))
            .await?;
        return Ok(None);
    }
    for attempt in 0..4 {
        if attempt > 0 {
            kv.step(HashMap::new()).await?;
        }
        if let Some(ticket) = session.begin(id, SCOPE, tokens, offer).await? {
            return Ok(Some(session.finish(&ticket).await?));
        }
    }
    session
        .reply(offer.id, Err("no room on the decode engine: recomputing"))
        .await?;
    Ok(None)
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
            let t = Box::new(dsa_kv::transfer::LocalTransport::new("decode"));
            runtime()?.block_on(decode_side(0, t, stream))
        };
        go().map_err(|e| e.to_string())
    });
    let stream = std::net::TcpStream::connect(addr)?;
    let t = Box::new(dsa_kv::transfer::LocalTransport::new("prefill"));
    let report = runtime()?.block_on(prefill_side(family(s)?, s, 0, t, stream, |_| {}));
    let decoded = decode.join().map_err(|_| "the decode thread panicked")?;
    let report = report?;
    decoded.map_err(|e| format!("decode side: {e}"))?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    //! The example end to end, in one process over the local transport (the NIXL
    //! transport runs it in two processes in CI): `cargo test --example disagg`.
    use super::*;

    /// A request prefilled on one engine and decoded on another gives exactly the
    /// unpaged reference's tokens, outputs and draft proposals; every block's bytes
    /// arrive unchanged (digests); the decode engine reuses the imported blocks, and
    /// shared blocks it already holds are skipped.
    #[test]
    fn prefilled_here_decoded_there_is_exact() {
        let r = run_in_process(&Setup::default()).unwrap();
        assert!(r.exact, "{r:#?}");
        assert_eq!(r.requests.len(), 3);
        for (i, q) in r.requests.iter().enumerate() {
            assert!(
                q.digests_match && q.problems.is_empty(),
                "request {i}: {q:#?}"
            );
            let full = Setup::default().prompt(i as u64).len() / 64 * 64;
            assert_eq!(q.exported_blocks, full / 64);
            assert!(q.decode_reused_tokens >= full as u64, "the import is used");
            // Request 0 brings everything; the others share its 3-block system prompt.
            let skipped = if i == 0 { 0 } else { 3 };
            assert_eq!(q.transfer.skipped, skipped);
            assert_eq!(q.imported_blocks as usize, full / 64 - skipped as usize);
            assert_eq!(
                q.outcome,
                Some(ImportOutcome::Committed {
                    blocks: q.imported_blocks
                })
            );
            // Pages: blocks × (target + draft cache); two pools each (MLA rows, indexer).
            assert_eq!(q.transfer.pages, 2 * q.imported_blocks as u64);
            assert_eq!(q.transfer.uncoalesced, 2 * q.transfer.pages as usize);
            // Fresh slots on a fresh engine are contiguous: one descriptor per pool.
            assert_eq!(q.transfer.write.descriptors, 4, "request {i}");
        }
    }

    /// A drill's one request: inexact, its digests differ, its import aborted with
    /// nothing brought.
    fn caught_and_aborted<'r>(r: &'r RunReport, drop: &str) -> &'r RequestRecord {
        let q = &r.requests[0];
        assert!(!r.exact && !q.digests_match, "dropping {drop}: {q:#?}");
        assert!(
            matches!(
                q.outcome,
                Some(ImportOutcome::Aborted {
                    reason: AbortReason::DigestsDiffer { .. }
                })
            ),
            "dropping {drop}: {:?}",
            q.outcome
        );
        assert_eq!(
            q.imported_blocks, 0,
            "dropping {drop}: the import was aborted"
        );
        q
    }

    /// The mutation drill: a transfer that leaves the indexer pools or the draft cache
    /// out is caught by the page digests, and the import is aborted: nothing of it
    /// enters the decode engine's cache, which then recomputes the prompt and decodes it
    /// exactly.
    #[test]
    fn leaving_out_the_indexer_or_the_draft_cache_is_caught_and_aborted() {
        for drop in ["index_key", "draft"] {
            let r = run_in_process(&Setup {
                requests: 1,
                drop: Some(drop.into()),
                ..Setup::default()
            })
            .unwrap();
            let q = caught_and_aborted(&r, drop);
            assert!(
                q.decode_reused_tokens < 64 * q.exported_blocks as u64,
                "dropping {drop}: the decode engine served what it did not import: {q:#?}"
            );
            assert!(
                q.problems.is_empty(),
                "dropping {drop}: recomputed, the decode is exact: {:?}",
                q.problems
            );
        }
    }

    /// DeepSeek-V4 (the Flash preset's layer structure): each request's compressed
    /// blocks (compressed KV and indexer keys of every layer) and the tail at their last
    /// boundary (raw-window rows and compressor state: pages of the window pools) move
    /// over the session; the decode engine resumes at the boundary and every token and
    /// every position's logits it computes equal the unpaged V4 model's; every page's
    /// bytes arrive unchanged (digests, the tail's included). The second request shares
    /// the first block: skipped, and its own block and tail move. Dropping the window
    /// pools or the compressed indexer keys from the plan is caught by the digests and
    /// aborted (the decode engine then recomputes, exactly). Release builds only: the
    /// 43-layer model is slow unoptimized (the debug pass covers the plan's tail code in
    /// `dsa-kv-device`'s unit tests).
    #[test]
    #[cfg_attr(debug_assertions, ignore = "slow without optimizations")]
    fn deepseek_v4_prefilled_here_decoded_there_is_exact() {
        let v4 = Setup {
            requests: 2,
            system_blocks: 1,
            model: Some("deepseek-v4-flash".into()),
            ..Setup::default()
        };
        let r = run_in_process(&v4).unwrap();
        assert!(r.exact, "{r:#?}");
        for (i, q) in r.requests.iter().enumerate() {
            assert!(
                q.digests_match && q.problems.is_empty(),
                "request {i}: {q:#?}"
            );
            let full = v4.prompt(i as u64).len() / 256 * 256;
            assert_eq!(q.exported_blocks, full / 256, "request {i}");
            assert!(q.decode_reused_tokens >= full as u64, "the import is used");
            let skipped = if i == 0 { 0 } else { 1 };
            assert_eq!(q.transfer.skipped, skipped);
            assert_eq!(q.imported_blocks as usize, full / 256 - skipped as usize);
            // Pages: one per brought block, and the tail's: two raw-window pages, one
            // ratio-4 state page, none of the ratio-128 state at a block boundary.
            assert_eq!(
                q.transfer.pages,
                q.imported_blocks as u64 + 3,
                "request {i}: {q:#?}"
            );
        }
        for drop in ["window", "index_key"] {
            let r = run_in_process(&Setup {
                requests: 1,
                max_new: 2,
                drop: Some(drop.into()),
                ..v4.clone()
            })
            .unwrap();
            let q = caught_and_aborted(&r, drop);
            assert_eq!(
                q.decode_reused_tokens, 0,
                "dropping {drop}: nothing imported"
            );
            assert!(q.problems.is_empty(), "dropping {drop}: {:?}", q.problems);
        }
    }
}
