//! The runtime's `tracing` spans as an embedder's subscriber sees them: one `request`
//! span per request, from its submission until it finishes or is cancelled, holding
//! that request's events; a span per call of the handle's methods. The library installs
//! no subscriber: this test installs one that records every span and event.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use dsa_kv::actors::KvCacheBuilder;
use dsa_kv::config::EngineConfig;
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::core::ReuseScope;
use dsa_kv::ids::{RequestId, TokenId};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{Layer, Registry};

/// One span as recorded: where it was made, its fields, its events, whether it closed.
#[derive(Clone, Debug, Default)]
struct SpanLog {
    name: &'static str,
    target: String,
    fields: BTreeMap<String, String>,
    /// The `message` of every event inside it.
    events: Vec<String>,
    closed: bool,
}

/// Every span ever created, in order; the registry reuses ids once a span closes, so
/// `open` maps only the ids of the spans open now.
#[derive(Default)]
struct Log {
    spans: Vec<SpanLog>,
    open: HashMap<Id, usize>,
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Log>>);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.insert(field.name().into(), format!("{value:?}"));
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Recorder {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        let mut span = SpanLog {
            name: attrs.metadata().name(),
            target: attrs.metadata().target().into(),
            ..SpanLog::default()
        };
        attrs.record(&mut Fields(&mut span.fields));
        let mut log = self.0.lock().unwrap();
        let i = log.spans.len();
        log.spans.push(span);
        log.open.insert(id.clone(), i);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let mut log = self.0.lock().unwrap();
        if let Some(&i) = log.open.get(id) {
            values.record(&mut Fields(&mut log.spans[i].fields));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        let mut log = self.0.lock().unwrap();
        if let Some(&i) = log.open.get(&span.id()) {
            let message = fields.remove("message").unwrap_or_default();
            log.spans[i].events.push(message);
        }
    }

    fn on_close(&self, id: Id, _: Context<'_, S>) {
        let mut log = self.0.lock().unwrap();
        if let Some(i) = log.open.remove(&id) {
            log.spans[i].closed = true;
        }
    }
}

impl Recorder {
    /// The spans named `name` made in module `target` of the crate.
    fn spans(&self, target: &str, name: &str) -> Vec<SpanLog> {
        let target = format!("dsa_kv::actors::{target}");
        let log = self.0.lock().unwrap();
        log.spans
            .iter()
            .filter(|s| s.name == name && s.target == target)
            .cloned()
            .collect()
    }
}

fn config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(2);
    c.kv_cache.max_tokens = Some(4096);
    c
}

fn request(id: u64, len: u32) -> SubmitRequest {
    SubmitRequest {
        id: RequestId(id),
        scope: ReuseScope::SHARED,
        prompt: (0..len).map(|t| TokenId(t + id as u32 * 1000)).collect(),
        max_new_tokens: 4,
        priority: 35,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_span_lives_from_submit_to_finish() {
    let recorder = Recorder::default();
    tracing::subscriber::set_global_default(Registry::default().with(recorder.clone()))
        .expect("the only subscriber of this test binary");
    let kv = KvCacheBuilder::new()
        .config(config())
        .start()
        .await
        .unwrap();
    kv.submit(request(1, 100)).await.unwrap();
    kv.submit(request(2, 70)).await.unwrap();
    let waiter = {
        let kv = kv.clone();
        tokio::spawn(async move { kv.wait(RequestId(2)).await })
    };
    let (mut finished, mut steps) = (0, 0);
    while finished < 2 {
        let rep = kv.step(HashMap::new()).await.unwrap();
        steps += 1;
        finished += kv
            .commit(rep.outcomes_from(|_| TokenId(7)))
            .await
            .unwrap()
            .finished
            .len();
        assert!(steps < 50, "the two requests did not finish");
    }
    assert_eq!(waiter.await.unwrap().unwrap().finished.generated, 4);
    // A third request is cancelled before it ever runs.
    kv.submit(request(3, 30)).await.unwrap();
    kv.cancel(RequestId(3)).await.unwrap();

    // Every request's span closed when it ended, before the runtime stops.
    let requests = recorder.spans("coordinator", "request");
    let ids: Vec<&str> = requests.iter().map(|s| s.fields["id"].as_str()).collect();
    assert_eq!(ids, ["1", "2", "3"], "one request span per request");
    for (span, prompt) in requests.iter().zip(["100", "70", "30"]) {
        let id = &span.fields["id"];
        assert!(span.closed, "request {id}: span still open: {span:?}");
        assert_eq!(span.fields["prompt_tokens"], prompt, "request {id}");
        assert_eq!(span.fields["max_new_tokens"], "4", "request {id}");
        assert_eq!(span.fields["reused"], "0", "request {id}");
        assert_eq!(
            span.events.first().map(String::as_str),
            Some("submitted"),
            "{span:?}"
        );
    }
    for span in &requests[..2] {
        // Started and prefilled in one step, then 3 decode steps (the prefill's step
        // sampled the first token); then finished, once.
        assert_eq!(
            span.events,
            [
                "submitted",
                "started",
                "scheduled",
                "scheduled",
                "scheduled",
                "scheduled",
                "finished"
            ],
            "{span:?}"
        );
    }
    assert_eq!(
        requests[2].events,
        ["submitted", "failed"],
        "the cancelled request"
    );

    // The handle's calls, each in its own span with its request.
    let submits = recorder.spans("handle", "submit");
    let submitted: Vec<&str> = submits
        .iter()
        .map(|s| s.fields["request"].as_str())
        .collect();
    assert_eq!(submitted, ["1", "2", "3"]);
    assert_eq!(submits[0].fields["prompt_tokens"], "100");
    assert!(submits.iter().all(|s| s.closed));
    let step_calls = recorder.spans("handle", "step");
    assert_eq!(step_calls.len(), steps);
    assert_eq!(step_calls[0].fields["step"], "1");
    assert_eq!(step_calls[0].fields["scheduled"], "2");
    let commits = recorder.spans("handle", "commit");
    assert_eq!(commits.len(), steps);
    let finished: usize = commits
        .iter()
        .map(|c| c.fields["finished"].parse::<usize>().unwrap())
        .sum();
    assert_eq!(finished, 2);
    assert_eq!(recorder.spans("handle", "wait")[0].fields["request"], "2");
    assert_eq!(recorder.spans("handle", "cancel")[0].fields["request"], "3");
    assert_eq!(recorder.spans("handle", "start").len(), 1);

    kv.shutdown().await;
    let shutdown = recorder.spans("handle", "shutdown");
    assert!(shutdown.len() == 1 && shutdown[0].closed, "{shutdown:?}");

    // Under memory pressure: every preemption is an event in its request's span.
    let requests: Vec<SubmitRequest> = (0..16u64)
        .map(|i| SubmitRequest {
            max_new_tokens: 8 + (i as u32 % 9),
            priority: [10, 35, 60][i as usize % 3],
            ..request(100 + i, 200 + (i as u32 * 53) % 300)
        })
        .collect();
    under_pressure(&recorder, tight_config(), requests).await;

    // DeepSeek-V4 through the same runtime (from its configuration preset): the same
    // spans, and its preemptions (by recompute) are events in their requests' spans.
    let requests: Vec<SubmitRequest> = (0..10u64)
        .map(|i| SubmitRequest {
            max_new_tokens: 8 + (i as u32 % 9),
            ..request(200 + i, 300 + (i as u32 * 97) % 500)
        })
        .collect();
    let st = under_pressure(&recorder, v4_config(), requests).await;
    assert!(st.windows.is_some(), "a windowed runtime: {st:?}");
    assert_eq!(recorder.spans("handle", "start").len(), 3);
}

/// Runs `requests` to their end on a runtime of `config` that is too small for all of
/// them: every request's span closes with one submitted, started and finished event,
/// and holds a `preempted` event per preemption. Returns the runtime's last counters.
async fn under_pressure(
    recorder: &Recorder,
    config: EngineConfig,
    requests: Vec<SubmitRequest>,
) -> dsa_kv::actors::RuntimeStats {
    let before = recorder.spans("coordinator", "request").len();
    let kv = KvCacheBuilder::new().config(config).start().await.unwrap();
    let n = requests.len() as u64;
    for r in requests {
        kv.submit(r).await.unwrap();
    }
    let mut finished = 0;
    for _ in 0..5000 {
        let rep = kv.step(HashMap::new()).await.unwrap();
        let c = kv.commit(rep.outcomes_from(|_| TokenId(7))).await.unwrap();
        finished += c.finished.len() as u64;
        if finished == n {
            break;
        }
    }
    let st = kv.stats().await.unwrap();
    kv.shutdown().await;
    assert_eq!(st.scheduler.finished, n);
    let spans = recorder.spans("coordinator", "request");
    let spans = &spans[before..];
    assert_eq!(spans.len(), n as usize);
    let mut preempted = 0;
    for span in spans {
        assert!(span.closed, "{span:?}");
        let count = |what: &str| span.events.iter().filter(|e| *e == what).count();
        assert_eq!(
            (count("submitted"), count("started"), count("finished")),
            (1, 1, 1),
            "{span:?}"
        );
        assert_eq!(span.events.last().map(String::as_str), Some("finished"));
        preempted += count("preempted") as u64;
    }
    assert!(st.scheduler.preemptions > 0, "no memory pressure: {st:?}");
    assert_eq!(
        preempted, st.scheduler.preemptions,
        "a preempted event per preemption"
    );
    st
}

/// DeepSeek-V4-Flash from its preset: 5 blocks of 256 tokens for 10 requests of up to
/// 800 tokens (preemption by recompute).
fn v4_config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.preset = dsa_kv::config::ModelPreset::DeepSeekV4Flash;
    c.kv_cache.max_tokens = Some(1280);
    c.scheduler.max_num_sequences = 8;
    c.scheduler.max_num_tokens = 1024;
    c.scheduler.max_prefill_chunk = 512;
    c.scheduler.max_seq_len = 2048;
    c
}

/// Room for a few requests at a time, and a host tier to offload to (as in
/// `tests/metrics.rs`).
fn tight_config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(3);
    c.kv_cache.max_tokens = Some(1024);
    c.kv_cache.host_cache_size = Some(2048 * 3 * 708 + (8 << 20));
    c.scheduler.max_num_sequences = 16;
    c.scheduler.max_num_tokens = 512;
    c.scheduler.max_prefill_chunk = 256;
    c.scheduler.max_seq_len = 2048;
    c
}
