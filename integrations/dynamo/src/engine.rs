//! [`DsaKvEngine`]: Dynamo's `LLMEngine` over the dsa-kv runtime and the reference model.
//!
//! * `start` starts the runtime (host backend, the reference model as every step's
//!   forward), the ZMQ publisher of its KV events on loopback, the verifier and the
//!   engine loop ([`crate::serving`]), and registers the cache's geometry: 64-token
//!   blocks, the GPU tier's blocks, the sequences a step may hold.
//! * `generate` checks the request, hands it to the loop, and streams its tokens; the
//!   stream ends with exactly one terminal chunk (length, stop, end-of-sequence, or
//!   cancelled) carrying the usage, or with a typed error. A client that stops
//!   (`ctx.stopped()`) or drops the stream cancels the request in the runtime.
//! * `abort` cancels the requests of the context object it is given, the one Dynamo
//!   passed to `generate`: requests are found by that object's identity, never by its
//!   id, which a client may choose (another client's request with the same id is not
//!   touched).
//! * `kv_event_sources` advertises the publisher (`KvEventSource::Zmq`), so Dynamo's
//!   listener and KV router consume the runtime's own events; `setup_metrics` takes the
//!   snapshot publisher the loop feeds from the runtime's stats.
//! * `cleanup` stops the loop and the runtime, drains the verifier and writes the report.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use dsa_kv::actors::KvCacheBuilder;
use dsa_kv::config::{EngineConfig as KvConfig, KvDtype};
use dsa_kv::ids::RequestId;
use dsa_kv::publish::{PublisherReport, ZmqPublisher, ZmqPublisherConfig};
use dsa_kv::v4::{
    DeviceBackend, V4Preset, WindowedBackendFactory, WindowedHostDevice, WindowedModel,
    WindowedSetup,
};
use dsa_kv_model::paged::{ForwardOptions, ModelForward};
use dsa_kv_model::v4::{V4Model, V4ModelConfig, V4ModelForward};
use dsa_kv_model::{CacheFormat, Model, ModelConfig};
use dynamo_backend_common::{
    chunk, usage, AsyncEngineContext, BackendError, CompletionUsage, DynamoError, EngineConfig,
    ErrorType, FinishReason, GenerateContext, KvEventSource, LLMEngine, LLMEngineOutput,
    LlmRegistration, MetricsBindings, MetricsCtx, PreprocessedRequest, PromptTokensDetails,
    SnapshotPublisher,
};
use futures::stream::BoxStream;
use serde_json::json;
use tokio::sync::{mpsc, Mutex as AsyncMutex};
use tokio::task::JoinHandle;

use crate::fixture::MODEL_VOCAB;
use crate::serving::{Command, Counts, Event, Load, Serving, Stopped};
use crate::stop::StopRule;
use crate::verify::{Reference, Verification, Verifier, FINISH_WITHIN};

/// The reference model's weight seed (the one `serve` runs).
pub const MODEL_SEED: u64 = 7;
/// Tokens per KV block (DSA's page size).
pub const BLOCK_TOKENS: u32 = 64;
/// Tokens per KV block of DeepSeek-V4 (its compressed blocks).
pub const V4_BLOCK_TOKENS: u32 = 256;

/// What a worker serves and how much it holds.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The name clients ask for.
    pub served_model_name: String,
    /// GPU-tier tokens of the cache (a multiple of 64).
    pub kv_tokens: u64,
    /// Requests a step may hold.
    pub max_num_seqs: u32,
    /// Tokens a step may hold.
    pub max_num_batched_tokens: u32,
    /// Prompt tokens of one request per step at most.
    pub max_prefill_chunk: u32,
    /// Prompt plus generated tokens of a request at most (a generation stops there).
    pub context_length: u32,
    /// Check every request against the unpaged model.
    pub verify: bool,
    /// Where `cleanup` writes the report (JSON).
    pub report: Option<PathBuf>,
    /// The host the KV event publisher binds (`tcp://HOST:0`).
    pub events_host: String,
    /// Requests held at most, running and waiting (more are refused with an error).
    pub max_live: usize,
    /// Serve the DeepSeek-V4 reference model with this preset's layer structure (its
    /// window-only, ratio-4 and ratio-128 layers and the MTP layer; tiny widths), through
    /// the same runtime; `None`: the DSA reference model.
    pub v4: Option<V4Preset>,
}

impl Settings {
    /// Tokens per KV block of the model served.
    pub fn block_tokens(&self) -> u32 {
        match self.v4 {
            Some(_) => V4_BLOCK_TOKENS,
            None => BLOCK_TOKENS,
        }
    }

    /// The runtime's configuration: the DSA reference model's two layers in
    /// `fp8_ds_mla` (a V4 model's cache comes from its own structure), these capacities.
    pub fn kv_config(&self) -> KvConfig {
        let s = self;
        let mut c = KvConfig::default();
        if s.v4.is_none() {
            c.model.num_layers = Some(ModelConfig::tiny(MODEL_SEED).layers as u32);
            c.model.kv_dtype = Some(KvDtype::Fp8DsMla);
        }
        c.kv_cache.max_tokens = Some(s.kv_tokens);
        c.scheduler.max_num_sequences = s.max_num_seqs;
        c.scheduler.max_num_tokens = s.max_num_batched_tokens;
        c.scheduler.max_prefill_chunk = s.max_prefill_chunk;
        c.scheduler.max_seq_len = s.context_length;
        c
    }
}

/// The reference model `settings` serve: the DSA model for the cache their
/// configuration describes, or the V4 model with the preset's layer structure.
pub fn reference_model(settings: &Settings) -> Result<Reference, String> {
    if let Some(preset) = settings.v4 {
        let spec = preset.spec();
        let cfg = V4ModelConfig {
            ratios: spec.compress_ratios.clone(),
            mtp: spec.num_mtp_layers > 0,
            ..V4ModelConfig::tiny(MODEL_SEED)
        };
        let model = V4Model::new(cfg).map_err(|e| format!("the V4 reference model: {e}"))?;
        return Ok(Reference::V4(Arc::new(model)));
    }
    let dsa = settings
        .kv_config()
        .model
        .build()
        .map_err(|e| format!("the cache configuration: {e}"))?;
    let format = CacheFormat::of(&dsa);
    let model = Model::new(ModelConfig::tiny(MODEL_SEED), format.clone())
        .map_err(|e| format!("the reference model: {e}"))?;
    Ok(Reference::Dsa(Arc::new(model), format))
}

/// The runtime serving `model` with `config`: the DSA model's forward on the host
/// devices, or the V4 model's on windowed host devices (pools sized from the same
/// configuration).
fn builder(config: KvConfig, model: &Reference) -> Result<KvCacheBuilder, String> {
    let b = KvCacheBuilder::new().config(config);
    match model {
        Reference::Dsa(model, _) => Ok(b.forward(ModelForward::factory(
            model.clone(),
            ForwardOptions::default(),
        ))),
        Reference::V4(model) => {
            let spec = model
                .config()
                .spec()
                .map_err(|e| format!("the V4 reference model: {e}"))?;
            let m = model.clone();
            let devices: WindowedBackendFactory = Arc::new(move |i, s: &WindowedSetup| {
                let forward = Box::new(V4ModelForward::serving(m.clone()));
                let d = WindowedHostDevice::new(i, &s.plan, &s.slots, forward)?;
                Ok(Box::new(d) as Box<dyn DeviceBackend>)
            });
            Ok(b.windowed(WindowedModel::new(spec, devices)))
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            served_model_name: "dsa-kv-reference".into(),
            kv_tokens: 65_536,
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            max_prefill_chunk: 512,
            context_length: 4096,
            verify: true,
            report: None,
            events_host: "127.0.0.1".into(),
            max_live: 4096,
            v4: None,
        }
    }
}

struct Running {
    serving: JoinHandle<(Stopped, Verifier)>,
    publisher: ZmqPublisher,
    events_endpoint: String,
    total_blocks: u64,
}

/// The dsa-kv Dynamo engine.
pub struct DsaKvEngine {
    settings: Settings,
    running: AsyncMutex<Option<Running>>,
    /// The loop's command sender (set by `start`, taken by `cleanup`).
    commands: Mutex<Option<mpsc::UnboundedSender<Command>>>,
    snapshots: Arc<OnceLock<Arc<SnapshotPublisher>>>,
    counts: Arc<Mutex<Counts>>,
    next_id: AtomicU64,
    /// The requests of each live stream, by its Dynamo context object (for `abort`).
    contexts: Arc<Mutex<Owners>>,
    /// The report, once `cleanup` wrote it.
    report: Mutex<Option<serde_json::Value>>,
}

impl DsaKvEngine {
    /// An engine that starts nothing until `start`.
    pub fn new(settings: Settings) -> DsaKvEngine {
        DsaKvEngine {
            settings,
            running: AsyncMutex::new(None),
            commands: Mutex::new(None),
            snapshots: Arc::default(),
            counts: Arc::default(),
            next_id: AtomicU64::new(1),
            contexts: Arc::default(),
            report: Mutex::new(None),
        }
    }

    /// What the loop counted so far.
    pub fn counts(&self) -> Counts {
        self.counts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The cache's load between two steps (GPU-tier slots in use and in total, requests
    /// live).
    pub async fn load(&self) -> Result<Load, DynamoError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.sender()?
            .send(Command::Load(tx))
            .map_err(|_| engine_shutdown("the engine loop stopped"))?;
        rx.await
            .map_err(|_| engine_shutdown("the engine loop stopped"))?
            .map_err(engine_error)
    }

    /// The report `cleanup` wrote (`None` before).
    pub fn report(&self) -> Option<serde_json::Value> {
        self.report
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn sender(&self) -> Result<mpsc::UnboundedSender<Command>, DynamoError> {
        self.commands
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                engine_shutdown("the engine is not running (not started, or cleaned up)")
            })
    }

    /// The request's prompt and generation budget, or why it cannot run.
    fn admit(&self, r: &PreprocessedRequest) -> Result<(Arc<Vec<u32>>, u32), DynamoError> {
        let prompt = r.token_ids.clone();
        let ctx = self.settings.context_length;
        if prompt.is_empty() {
            return Err(invalid("the prompt is empty: send at least one token"));
        }
        if let Some((i, t)) = prompt.iter().enumerate().find(|(_, &t)| t >= MODEL_VOCAB) {
            return Err(invalid(format!(
                "prompt token {i} is id {t}, outside the model's vocabulary of {MODEL_VOCAB} \
                 ids (use the worker's own tokenizer)"
            )));
        }
        let n = prompt.len() as u64;
        if n >= u64::from(ctx) {
            return Err(invalid(format!(
                "the prompt has {n} tokens; the context length is {ctx}: send fewer"
            )));
        }
        // A generation that would pass the context length stops at it (finish reason
        // `length`), as Dynamo's conformance kit expects of an engine.
        let room = ctx - n as u32;
        let max_new = match r.stop_conditions.max_tokens {
            Some(0) => return Err(invalid("max_tokens is 0: ask for at least one token")),
            Some(m) => m.min(room),
            None => room,
        };
        Ok((prompt, max_new))
    }

    fn write_report(
        &self,
        stopped: &Stopped,
        verification: &Verification,
        published: &PublisherReport,
    ) -> serde_json::Value {
        let report = json!({
            "served_model_name": self.settings.served_model_name,
            "counts": self.counts(),
            "verification": verification,
            "exact": verification.all_exact(),
            "prefix_hit_rate": stopped.prefix_hit_rate,
            "manager_us": stopped.manager_us,
            "device_us": stopped.device_us,
            "kv_events": {
                "batches": published.batches,
                "events": published.events,
                "lost_batches": published.lost_batches,
                "send_errors": published.send_errors,
                "dropped_messages": published.dropped_messages,
            },
            "error": stopped.error,
        });
        if let Some(path) = &self.settings.report {
            let text = serde_json::to_string_pretty(&report).unwrap_or_default();
            if let Err(e) = std::fs::write(path, text + "\n") {
                tracing::error!("writing the report {}: {e}", path.display());
            }
        }
        *self.report.lock().unwrap_or_else(|e| e.into_inner()) = Some(report.clone());
        report
    }
}

#[async_trait]
impl LLMEngine for DsaKvEngine {
    async fn start(&self, worker_id: u64) -> Result<EngineConfig, DynamoError> {
        let mut running = self.running.lock().await;
        if running.is_some() {
            return Err(engine_shutdown("the engine is already started"));
        }
        let config = self.settings.kv_config();
        let model = reference_model(&self.settings).map_err(invalid)?;
        let builder = builder(config, &model).map_err(invalid)?;
        // Started first: nothing else is running yet if it fails.
        let verifier = if self.settings.verify {
            Verifier::start(model)
                .map_err(|e| engine_shutdown(format!("the verifier thread: {e}")))?
        } else {
            Verifier::off()
        };
        let kv = builder
            .start()
            .await
            .map_err(|e| engine_shutdown(format!("the dsa-kv runtime did not start: {e}")))?;
        let total_blocks = kv.info().budget.slots;
        let subscriber = match kv.events().subscribe().await {
            Ok(s) => s,
            Err(e) => {
                kv.shutdown().await;
                return Err(engine_shutdown(format!("subscribing to KV events: {e}")));
            }
        };
        let publisher = match ZmqPublisher::start(
            subscriber,
            ZmqPublisherConfig {
                endpoint: format!("tcp://{}:0", self.settings.events_host),
                replay_endpoint: None,
                ..Default::default()
            },
        )
        .await
        {
            Ok(p) => p,
            Err(e) => {
                kv.shutdown().await;
                return Err(engine_shutdown(format!("the KV event publisher: {e}")));
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let serving = Serving::new(
            kv,
            rx,
            self.settings.max_live,
            verifier,
            self.snapshots.clone(),
            self.counts.clone(),
        );
        let events_endpoint = publisher.endpoint().to_string();
        tracing::info!(
            worker_id,
            events = %events_endpoint,
            total_blocks,
            "dsa-kv engine started: the reference model on the host backend"
        );
        *self.commands.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        *running = Some(Running {
            serving: tokio::spawn(serving.run()),
            publisher,
            events_endpoint,
            total_blocks,
        });
        let s = &self.settings;
        Ok(EngineConfig {
            model: s.served_model_name.clone(),
            served_model_name: Some(s.served_model_name.clone()),
            llm: Some(LlmRegistration {
                context_length: Some(s.context_length),
                kv_cache_block_size: Some(s.block_tokens()),
                total_kv_blocks: Some(total_blocks),
                max_num_seqs: Some(u64::from(s.max_num_seqs)),
                max_num_batched_tokens: Some(u64::from(s.max_num_batched_tokens)),
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    async fn generate(
        &self,
        request: PreprocessedRequest,
        ctx: GenerateContext,
    ) -> Result<BoxStream<'static, Result<LLMEngineOutput, DynamoError>>, DynamoError> {
        let commands = self.sender()?;
        let (prompt, max_new) = self.admit(&request)?;
        let rule = StopRule::of(&request).map_err(|e| invalid(e.to_string()))?;
        let prompt_tokens = prompt.len() as u32;
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        // Registered before the loop sees the request, so an abort finds it at once.
        // Cancels the request if the stream is dropped before its end, read or not (the
        // stream's body first runs when it is first polled); forgets its context either way.
        let mut guard =
            CancelOnDrop::register(id, commands.clone(), self.contexts.clone(), ctx.inner_arc());
        let (events, mut rx) = mpsc::unbounded_channel();
        if commands
            .send(Command::Submit {
                id,
                prompt,
                max_new,
                rule,
                events,
            })
            .is_err()
        {
            guard.disarm();
            return Err(engine_shutdown("the engine loop stopped"));
        }
        let stream = async_stream::stream! {
            let mut returned = 0u32;
            let mut stopping = false;
            loop {
                let event = if stopping {
                    rx.recv().await
                } else {
                    tokio::select! {
                        biased;
                        e = rx.recv() => e,
                        _ = ctx.stopped() => {
                            guard.cancel();
                            stopping = true;
                            continue;
                        }
                    }
                };
                match event {
                    Some(Event::Token(t)) => {
                        if !stopping {
                            returned += 1;
                            yield Ok(chunk::token(t));
                        }
                    }
                    Some(Event::End { reason, last, cached_tokens }) => {
                        guard.disarm();
                        let (reason, tokens) = match (stopping, last) {
                            (true, _) => (FinishReason::Cancelled, Vec::new()),
                            (false, l) => (reason, l.into_iter().collect()),
                        };
                        returned += tokens.len() as u32;
                        let mut out = terminal(reason);
                        out.token_ids = tokens;
                        out.completion_usage = Some(usage_of(prompt_tokens, returned, cached_tokens));
                        yield Ok(out);
                        break;
                    }
                    Some(Event::Failed(why)) => {
                        guard.disarm();
                        yield Err(engine_error(format!("request failed: {why}")));
                        break;
                    }
                    None => {
                        guard.disarm();
                        yield Err(engine_shutdown("the engine loop stopped before the request ended"));
                        break;
                    }
                }
            }
        };
        Ok(Box::pin(stream))
    }

    async fn cleanup(&self) -> Result<(), DynamoError> {
        let Some(r) = self.running.lock().await.take() else {
            return Ok(());
        };
        let commands = self
            .commands
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        // Streams still held keep senders alive: the loop is told to stop.
        if let Some(c) = commands {
            let _ = c.send(Command::Shutdown);
        }
        let (stopped, mut verifier) = r
            .serving
            .await
            .map_err(|e| engine_shutdown(format!("the engine loop panicked: {e}")))?;
        let published = r.publisher.shutdown().await;
        let verification = tokio::task::spawn_blocking(move || verifier.finish(FINISH_WITHIN))
            .await
            .map_err(|e| engine_shutdown(format!("the verifier: {e}")))?;
        let report = self.write_report(&stopped, &verification, &published);
        tracing::info!(
            total_blocks = r.total_blocks,
            "dsa-kv engine stopped: {report}"
        );
        Ok(())
    }

    /// Dynamo calls this when a request's client stops or the operator kills it, with
    /// the context object it passed to `generate`; the stream notices `ctx.stopped()`
    /// too, and whichever comes first cancels it. Only the requests generated with this
    /// very object are cancelled: another context with the same id owns none of them.
    async fn abort(&self, ctx: Arc<dyn AsyncEngineContext>) {
        let ids = self
            .contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&ContextKey::of(&ctx))
            .cloned()
            .unwrap_or_default();
        if let Ok(commands) = self.sender() {
            for id in ids {
                let _ = commands.send(Command::Cancel(id));
            }
        }
    }

    async fn kv_event_sources(&self) -> Result<Vec<KvEventSource>, DynamoError> {
        let running = self.running.lock().await;
        let r = running
            .as_ref()
            .ok_or_else(|| engine_shutdown("the engine is not started"))?;
        Ok(vec![KvEventSource::Zmq {
            endpoint: r.events_endpoint.clone(),
            topic: String::new(),
            dp_rank: 0,
            image_token_id: None,
        }])
    }

    async fn setup_metrics(&self, _ctx: MetricsCtx<'_>) -> Result<MetricsBindings, DynamoError> {
        let slot = self.snapshots.clone();
        Ok(MetricsBindings {
            dp_ranks: vec![0],
            on_publisher_ready: Some(Box::new(move |p| {
                // A second publisher (a second `setup_metrics`) leaves the first in place.
                let _ = slot.set(p);
                Ok(())
            })),
        })
    }
}

/// A Dynamo context object's identity: its address. Unforgeable by a client (unlike
/// the context's id, which it may choose), and unique among the keys of [`Owners`]:
/// every entry's [`CancelOnDrop`] holds its context's `Arc`, so no other object can be
/// allocated there before the entry is removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct ContextKey(usize);

impl ContextKey {
    fn of(ctx: &Arc<dyn AsyncEngineContext>) -> ContextKey {
        ContextKey(Arc::as_ptr(ctx) as *const () as usize)
    }
}

/// The live requests generated with each context object (usually one; Dynamo may reuse
/// an object, and then `abort` cancels them all). Its size follows the live streams.
type Owners = HashMap<ContextKey, Vec<RequestId>>;

/// Registers its request under its context object; sends a cancellation for the
/// request when dropped armed; removes the registration when dropped.
struct CancelOnDrop {
    id: RequestId,
    commands: Option<mpsc::UnboundedSender<Command>>,
    contexts: Arc<Mutex<Owners>>,
    /// Held so that the key stays this object's until the entry is gone.
    context: Arc<dyn AsyncEngineContext>,
}

impl CancelOnDrop {
    fn register(
        id: RequestId,
        commands: mpsc::UnboundedSender<Command>,
        contexts: Arc<Mutex<Owners>>,
        context: Arc<dyn AsyncEngineContext>,
    ) -> CancelOnDrop {
        contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(ContextKey::of(&context))
            .or_default()
            .push(id);
        CancelOnDrop {
            id,
            commands: Some(commands),
            contexts,
            context,
        }
    }

    fn cancel(&mut self) {
        if let Some(c) = self.commands.take() {
            let _ = c.send(Command::Cancel(self.id));
        }
    }

    fn disarm(&mut self) {
        self.commands = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.cancel();
        let mut contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        let key = ContextKey::of(&self.context);
        // Only its own request (a context object used again holds the others too).
        if let Some(ids) = contexts.get_mut(&key) {
            ids.retain(|&id| id != self.id);
            if ids.is_empty() {
                contexts.remove(&key);
            }
        }
    }
}

fn terminal(reason: FinishReason) -> LLMEngineOutput {
    let mut out = LLMEngineOutput::stop();
    out.finish_reason = Some(reason);
    out
}

fn usage_of(prompt: u32, completion: u32, cached: u64) -> CompletionUsage {
    let mut u = usage(prompt, completion);
    u.prompt_tokens_details = Some(PromptTokensDetails {
        cached_tokens: Some(cached.min(u64::from(prompt)) as u32),
        ..Default::default()
    });
    u
}

fn error(kind: BackendError, message: impl Into<String>) -> DynamoError {
    let message = message.into();
    DynamoError::builder()
        .error_type(ErrorType::Backend(kind))
        .public_message(message.clone())
        .message(message)
        .build()
}

fn invalid(message: impl Into<String>) -> DynamoError {
    error(BackendError::InvalidArgument, message)
}

fn engine_shutdown(message: impl Into<String>) -> DynamoError {
    error(BackendError::EngineShutdown, message)
}

fn engine_error(message: impl Into<String>) -> DynamoError {
    error(BackendError::Unknown, message)
}
