//! The engine as Dynamo's worker drives it, without the network: Dynamo's own
//! conformance kit, tokens bit-exact against the unpaged model, prefix reuse in the
//! usage, each way a request ends, cancellation releasing the request's pages, an abort
//! reaching only its own context's request, and bad requests (stop-id lists past the
//! limit among them) refused with typed errors.

use std::sync::Arc;
use std::time::Duration;

use dsa_kv::v4::V4Preset;
use dsa_kv_dynamo::engine::{reference_model, DsaKvEngine, Settings};
use dsa_kv_dynamo::serving::Load;
use dsa_kv_dynamo::verify::Reference;
use dynamo_backend_common::testing::{mock_context, run_conformance};
use dynamo_backend_common::{
    BackendError, DynamoError, ErrorType, FinishReason, GenerateContext, LLMEngine,
    LLMEngineOutput, OutputOptions, PreprocessedRequest, SamplingOptions, StopConditions,
};
use dynamo_runtime::engine::AsyncEngineContext;
use dynamo_runtime::pipeline::context::Controller;
use futures::StreamExt;

fn settings() -> Settings {
    Settings {
        kv_tokens: 8192,
        max_num_seqs: 8,
        max_num_batched_tokens: 512,
        max_prefill_chunk: 96,
        context_length: 2048,
        ..Settings::default()
    }
}

fn request(prompt: Vec<u32>, stop: StopConditions, eos: Vec<u32>) -> PreprocessedRequest {
    PreprocessedRequest::builder()
        .model("dsa-kv-reference".to_string())
        .token_ids(prompt)
        .stop_conditions(stop)
        .sampling_options(SamplingOptions::default())
        .output_options(OutputOptions::default())
        .eos_token_ids(eos)
        .build()
        .expect("a request")
}

fn max_tokens(n: u32) -> StopConditions {
    StopConditions {
        max_tokens: Some(n),
        ..Default::default()
    }
}

fn prompt(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| (seed * 7919 + i * 31) % 256).collect()
}

/// The unpaged model's greedy tokens for `prompt`.
fn reference(prompt: &[u32], n: u32) -> Vec<u32> {
    reference_model(&settings())
        .expect("model")
        .generate(prompt, n)
        .expect("generate")
}

async fn collect(
    engine: &DsaKvEngine,
    r: PreprocessedRequest,
    ctx: Arc<dyn AsyncEngineContext>,
) -> Vec<Result<LLMEngineOutput, DynamoError>> {
    engine
        .generate(r, GenerateContext::new(ctx, None))
        .await
        .expect("generate")
        .collect()
        .await
}

/// The tokens of a stream that ended with one terminal chunk (its last item), the
/// terminal's reason and its usage `(prompt, completion, cached)`.
fn tokens_of(
    items: &[Result<LLMEngineOutput, DynamoError>],
) -> (Vec<u32>, FinishReason, (u32, u32, u32)) {
    let chunks: Vec<&LLMEngineOutput> = items
        .iter()
        .map(|i| i.as_ref().expect("no error"))
        .collect();
    let (last, body) = chunks.split_last().expect("a chunk");
    assert!(
        body.iter().all(|c| c.finish_reason.is_none()),
        "one terminal chunk, the last"
    );
    let tokens: Vec<u32> = chunks.iter().flat_map(|c| c.token_ids.clone()).collect();
    let u = last
        .completion_usage
        .as_ref()
        .expect("usage on the terminal");
    let cached = u
        .prompt_tokens_details
        .as_ref()
        .and_then(|d| d.cached_tokens)
        .expect("cached tokens");
    assert_eq!(u.completion_tokens as usize, tokens.len());
    (
        tokens,
        last.finish_reason.clone().expect("a reason"),
        (u.prompt_tokens, u.completion_tokens, cached),
    )
}

/// The load once no request is live (a dropped stream's cancellation reaches the loop
/// asynchronously), or after 2 s.
async fn settled(e: &DsaKvEngine) -> Load {
    let mut load = e.load().await.expect("load");
    for _ in 0..200 {
        if load.live == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        load = e.load().await.expect("load");
    }
    load
}

async fn started() -> DsaKvEngine {
    let e = DsaKvEngine::new(settings());
    let config = e.start(1).await.expect("start");
    let llm = config.llm.expect("LLM registration");
    assert_eq!(llm.kv_cache_block_size, Some(64));
    assert_eq!(llm.max_num_seqs, Some(8));
    // The runtime rounds the cache up to whole pool pages: at least the tokens asked for,
    // and the snapshot's total is what was registered.
    let total = llm.total_kv_blocks.expect("total blocks");
    assert!(total >= 8192 / 64, "{total}");
    assert_eq!(e.load().await.expect("load").total, total);
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_conformance_kit_passes() {
    run_conformance(|| DsaKvEngine::new(settings()))
        .await
        .expect("Dynamo's conformance kit");
}

/// Sends every prompt at once (prompt `i` asks for `first + 3i` tokens) and checks each
/// stream: it ends by length with the usage asked for, its tokens bit-exact against the
/// unpaged `reference`.
async fn all_at_once(
    e: &Arc<DsaKvEngine>,
    prompts: &[Vec<u32>],
    first: u32,
    reference: &Reference,
) {
    let mut tasks = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (e, p) = (e.clone(), p.clone());
        tasks.push(tokio::spawn(async move {
            let n = first + i as u32 * 3;
            let items = collect(
                &e,
                request(p.clone(), max_tokens(n), vec![]),
                mock_context(),
            )
            .await;
            (p, n, items)
        }));
    }
    for t in tasks {
        let (p, n, items) = t.await.expect("task");
        let (tokens, reason, (prompt_tokens, completion, _)) = tokens_of(&items);
        assert_eq!(reason, FinishReason::Length);
        assert_eq!((prompt_tokens, completion), (p.len() as u32, n));
        let want = reference.generate(&p, n).expect("the unpaged run");
        assert_eq!(tokens, want, "bit-exact against the unpaged model");
    }
}

/// The DeepSeek-V4 reference model (Flash's 43 layers and MTP layer, tiny widths)
/// through the same engine: 256-token blocks registered, tokens bit-exact against the
/// unpaged V4 model, a repeated prompt served from its last whole block (where a window
/// tail is kept), a dropped request's pages freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_v4_flash_is_served_bit_exact_with_prefix_hits_and_cancellation() {
    let settings = Settings {
        v4: Some(V4Preset::Flash),
        max_prefill_chunk: 256,
        ..settings()
    };
    let reference = reference_model(&settings).expect("the V4 model");
    let e = Arc::new(DsaKvEngine::new(settings));
    let llm = e
        .start(1)
        .await
        .expect("start")
        .llm
        .expect("LLM registration");
    assert_eq!(llm.kv_cache_block_size, Some(256));
    let total = llm.total_kv_blocks.expect("total blocks");
    assert!(total >= 8192 / 256, "{total}");
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(i, 300 + 140 * i)).collect();
    all_at_once(&e, &prompts, 4, &reference).await;
    // 580 tokens: the repeat resumes at the last whole block, 512.
    let p = prompts[2].clone();
    let items = collect(
        &e,
        request(p.clone(), max_tokens(3), vec![]),
        mock_context(),
    )
    .await;
    let (tokens, _, (_, _, cached)) = tokens_of(&items);
    assert_eq!(cached, 512, "the repeat resumes at its last whole block");
    assert_eq!(tokens, reference.generate(&p, 3).unwrap());
    // A request dropped mid-stream is cancelled and its pages freed.
    let before = settled(&e).await;
    let stream = e
        .generate(
            request(prompt(9, 400), max_tokens(1000), vec![]),
            GenerateContext::new(mock_context(), None),
        )
        .await
        .expect("generate");
    let mut stream = stream;
    for _ in 0..3 {
        stream.next().await.expect("a chunk").expect("a token");
    }
    drop(stream);
    let after = settled(&e).await;
    assert_eq!(after.live, 0, "{after:?}");
    assert_eq!(
        after.in_use, before.in_use,
        "the dropped request's pages were freed"
    );
    e.cleanup().await.expect("cleanup");
    let report = e.report().expect("a report");
    assert_eq!(report["exact"], true, "{report}");
    assert_eq!(report["counts"]["cancelled"], 1, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_are_bit_exact_and_a_repeated_prompt_is_served_from_the_cache() {
    let e = Arc::new(started().await);
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(i, 100 + 37 * i)).collect();
    all_at_once(
        &e,
        &prompts,
        5,
        &reference_model(&settings()).expect("model"),
    )
    .await;
    // The same prompt again: all of it but the last token (which must run to give the
    // first output) comes from the cache; the tokens are the same.
    let p = prompts[5].clone();
    let items = collect(
        &e,
        request(p.clone(), max_tokens(4), vec![]),
        mock_context(),
    )
    .await;
    let (tokens, _, (_, _, cached)) = tokens_of(&items);
    assert_eq!(cached, p.len() as u32 - 1, "the prompt reused");
    assert_eq!(tokens, reference(&p, 4));
    e.cleanup().await.expect("cleanup");
    let report = e.report().expect("a report");
    assert_eq!(report["exact"], true, "{report}");
    assert_eq!(report["verification"]["verified"], 7, "{report}");
    assert_eq!(report["counts"]["length"], 7, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_ids_and_end_of_sequence_end_a_request_early() {
    let e = started().await;
    let p = prompt(11, 80);
    let want = reference(&p, 12);
    // The model's 4th token as a hidden stop id (first occurrence in the output).
    let k = 3;
    let first = want.iter().position(|&t| t == want[k]).expect("present");
    let hidden = StopConditions {
        max_tokens: Some(12),
        stop_token_ids_hidden: Some(vec![want[k]]),
        ..Default::default()
    };
    let (tokens, reason, _) =
        tokens_of(&collect(&e, request(p.clone(), hidden, vec![]), mock_context()).await);
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(tokens, want[..first], "the stop token is not returned");
    // As a visible stop id it is returned.
    let visible = StopConditions {
        max_tokens: Some(12),
        stop_token_ids_visible: Some(vec![want[k]]),
        ..Default::default()
    };
    let (tokens, reason, _) =
        tokens_of(&collect(&e, request(p.clone(), visible, vec![]), mock_context()).await);
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(tokens, want[..=first]);
    // As end-of-sequence: not returned, reason eos; with ignore_eos it runs to max_tokens.
    let (tokens, reason, _) = tokens_of(
        &collect(
            &e,
            request(p.clone(), max_tokens(12), vec![want[k]]),
            mock_context(),
        )
        .await,
    );
    assert_eq!(reason, FinishReason::EoS);
    assert_eq!(tokens, want[..first]);
    let ignore = StopConditions {
        max_tokens: Some(12),
        ignore_eos: Some(true),
        ..Default::default()
    };
    let (tokens, reason, _) = tokens_of(
        &collect(
            &e,
            request(p.clone(), ignore, vec![want[k]]),
            mock_context(),
        )
        .await,
    );
    assert_eq!(reason, FinishReason::Length);
    assert_eq!(tokens, want);
    // Every early end released its request: nothing is held, nothing is live.
    let load = e.load().await.expect("load");
    assert_eq!((load.in_use, load.live), (0, 0), "{load:?}");
    let c = e.counts();
    assert_eq!(
        (c.stop, c.eos, c.length, c.cancel_leaks),
        (2, 1, 1, 0),
        "{c:?}"
    );
    e.cleanup().await.expect("cleanup");
    assert_eq!(e.report().expect("report")["exact"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_dropped_or_aborted_request_is_cancelled_and_its_pages_freed() {
    let e = started().await;
    // A client that stops: the stream ends with one `Cancelled` terminal.
    let ctx = mock_context();
    let mut stream = e
        .generate(
            request(prompt(3, 300), max_tokens(1500), vec![]),
            GenerateContext::new(ctx.clone(), None),
        )
        .await
        .expect("generate");
    let mut returned = 0;
    while returned < 5 {
        let c = stream.next().await.expect("a chunk").expect("no error");
        assert!(c.finish_reason.is_none());
        returned += c.token_ids.len();
    }
    // Held while it runs: its prompt's blocks and more.
    let held = e.load().await.expect("load");
    assert!(held.in_use >= 5, "{held:?}");
    ctx.stop_generating();
    let rest: Vec<_> = stream.collect().await;
    let last = rest.last().expect("a terminal").as_ref().expect("no error");
    assert_eq!(last.finish_reason, Some(FinishReason::Cancelled));
    let load = e.load().await.expect("load");
    assert_eq!((load.in_use, load.live), (0, 0), "pages freed: {load:?}");
    // A client that drops its stream: the request is cancelled too.
    let mut stream = e
        .generate(
            request(prompt(4, 200), max_tokens(1500), vec![]),
            GenerateContext::new(mock_context(), None),
        )
        .await
        .expect("generate");
    stream.next().await.expect("a chunk").expect("no error");
    drop(stream);
    let load = settled(&e).await;
    assert_eq!((load.in_use, load.live), (0, 0), "pages freed: {load:?}");
    // A stream dropped before it was ever read: cancelled too.
    let stream = e
        .generate(
            request(prompt(8, 120), max_tokens(1500), vec![]),
            GenerateContext::new(mock_context(), None),
        )
        .await
        .expect("generate");
    drop(stream);
    let load = settled(&e).await;
    assert_eq!((load.in_use, load.live), (0, 0), "pages freed: {load:?}");
    // Dynamo's `abort` (the client's context is not stopped here): cancelled as well.
    let ctx = mock_context();
    let mut stream = e
        .generate(
            request(prompt(7, 150), max_tokens(1500), vec![]),
            GenerateContext::new(ctx.clone(), None),
        )
        .await
        .expect("generate");
    stream.next().await.expect("a chunk").expect("no error");
    e.abort(ctx).await;
    let rest: Vec<_> = stream.collect().await;
    let last = rest.last().expect("a terminal").as_ref().expect("no error");
    assert_eq!(last.finish_reason, Some(FinishReason::Cancelled));
    let load = e.load().await.expect("load");
    assert_eq!((load.in_use, load.live), (0, 0), "pages freed: {load:?}");
    let c = e.counts();
    assert_eq!(c.cancelled, 4, "{c:?}");
    assert_eq!(c.cancel_leaks, 0, "{c:?}");
    assert!(c.slots_released >= 8, "{c:?}");
    e.cleanup().await.expect("cleanup");
    // The cancelled requests' tokens were exact too.
    let report = e.report().expect("report");
    assert_eq!(report["exact"], true, "{report}");
    assert_eq!(report["verification"]["verified"], 3, "{report}");
}

fn invalid(e: DynamoError) -> String {
    assert_eq!(
        e.error_type(),
        ErrorType::Backend(BackendError::InvalidArgument),
        "{e}"
    );
    e.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_typed_errors_and_the_engine_serves_on() {
    let e = started().await;
    let cases: Vec<(PreprocessedRequest, &str)> = vec![
        (request(vec![], max_tokens(4), vec![]), "empty"),
        (
            request(vec![1, 2, 256], max_tokens(4), vec![]),
            "outside the model's vocabulary",
        ),
        (
            request(prompt(1, 2048), max_tokens(4), vec![]),
            "context length",
        ),
        (
            request(prompt(1, 10), max_tokens(0), vec![]),
            "max_tokens is 0",
        ),
    ];
    for (r, want) in cases {
        let err = match e
            .generate(r, GenerateContext::new(mock_context(), None))
            .await
        {
            Ok(_) => panic!("accepted a bad request ({want})"),
            Err(err) => invalid(err),
        };
        assert!(err.contains(want), "{err} should say {want:?}");
    }
    let (tokens, _, _) = tokens_of(
        &collect(
            &e,
            request(prompt(2, 70), max_tokens(3), vec![]),
            mock_context(),
        )
        .await,
    );
    assert_eq!(tokens, reference(&prompt(2, 70), 3));
    // max_tokens beyond the context: the generation stops at the context length.
    let p = prompt(5, 2040);
    let (tokens, reason, _) = tokens_of(
        &collect(
            &e,
            request(p.clone(), max_tokens(100), vec![]),
            mock_context(),
        )
        .await,
    );
    assert_eq!(reason, FinishReason::Length);
    assert_eq!(tokens, reference(&p, 8));
    e.cleanup().await.expect("cleanup");
    // After cleanup: a typed error, not a hang.
    let err = match e
        .generate(
            request(prompt(2, 70), max_tokens(3), vec![]),
            GenerateContext::new(mock_context(), None),
        )
        .await
    {
        Ok(_) => panic!("served after cleanup"),
        Err(err) => err,
    };
    assert_eq!(
        err.error_type(),
        ErrorType::Backend(BackendError::EngineShutdown)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_ends_a_request_whose_stream_is_still_held() {
    let e = started().await;
    let mut stream = e
        .generate(
            request(prompt(6, 100), max_tokens(1900), vec![]),
            GenerateContext::new(mock_context(), None),
        )
        .await
        .expect("generate");
    stream.next().await.expect("a chunk").expect("no error");
    // The stream is held (its sender too): cleanup must not wait for it.
    tokio::time::timeout(Duration::from_secs(30), e.cleanup())
        .await
        .expect("cleanup finished")
        .expect("cleanup");
    // The stream ends with an error, after the tokens already sent.
    let rest: Vec<_> = tokio::time::timeout(Duration::from_secs(30), stream.collect())
        .await
        .expect("the stream ended");
    let err = rest
        .last()
        .expect("an item")
        .as_ref()
        .expect_err("an error");
    assert!(err.to_string().contains("shutting down"), "{err}");
    assert!(rest[..rest.len() - 1].iter().all(|i| i.is_ok()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_limit_are_refused_with_an_error() {
    let e = DsaKvEngine::new(Settings {
        max_live: 1,
        ..settings()
    });
    e.start(1).await.expect("start");
    let mut first = e
        .generate(
            request(prompt(9, 100), max_tokens(1500), vec![]),
            GenerateContext::new(mock_context(), None),
        )
        .await
        .expect("generate");
    first.next().await.expect("a chunk").expect("no error");
    let second = collect(
        &e,
        request(prompt(10, 100), max_tokens(4), vec![]),
        mock_context(),
    )
    .await;
    let err = second
        .last()
        .expect("an item")
        .as_ref()
        .expect_err("refused");
    assert!(err.to_string().contains("limit"), "{err}");
    assert_eq!(e.counts().refused, 1);
    drop(first);
    assert_eq!(settled(&e).await.live, 0);
    e.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_id_lists_past_256_ids_are_refused_naming_the_limit() {
    let e = started().await;
    let many: Vec<u32> = (0..257).collect();
    let cases = vec![
        (
            "stop_token_ids",
            StopConditions {
                stop_token_ids: Some(many.clone()),
                ..max_tokens(4)
            },
            vec![],
        ),
        (
            "stop_token_ids_hidden",
            StopConditions {
                stop_token_ids_hidden: Some(many.clone()),
                ..max_tokens(4)
            },
            vec![],
        ),
        (
            "stop_token_ids_visible",
            StopConditions {
                stop_token_ids_visible: Some(many.clone()),
                ..max_tokens(4)
            },
            vec![],
        ),
        ("eos_token_ids", max_tokens(4), many.clone()),
    ];
    for (field, stop, eos) in cases {
        let err = match e
            .generate(
                request(prompt(1, 10), stop, eos),
                GenerateContext::new(mock_context(), None),
            )
            .await
        {
            Ok(_) => panic!("accepted {field} with 257 ids"),
            Err(err) => invalid(err),
        };
        assert!(
            err.contains(field) && err.contains("257") && err.contains("256"),
            "{err} should name {field}, its length and the limit"
        );
    }
    // 256 ids, unsorted, is at the limit: served, and the one the model produces stops it.
    let p = prompt(11, 80);
    let want = reference(&p, 12);
    let first = want.iter().position(|&t| t == want[3]).expect("present");
    let mut ids: Vec<u32> = (300..555).rev().collect();
    ids.insert(100, want[3]);
    assert_eq!(ids.len(), 256);
    let hidden = StopConditions {
        max_tokens: Some(12),
        stop_token_ids_hidden: Some(ids),
        ..Default::default()
    };
    let (tokens, reason, _) =
        tokens_of(&collect(&e, request(p.clone(), hidden, vec![]), mock_context()).await);
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(tokens, want[..first]);
    assert_eq!(e.counts().refused, 0, "refused before the loop");
    e.cleanup().await.expect("cleanup");
}

/// A context with an id of the client's choosing (Dynamo's request plane takes the id a
/// client sends).
fn context_with_id(id: &str) -> Arc<dyn AsyncEngineContext> {
    Arc::new(Controller::new(id.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_cancels_only_its_own_contexts_request() {
    let e = started().await;
    // One client's long request, then another's with the same context id.
    let attacker = context_with_id("chosen-id");
    let mut theirs = e
        .generate(
            request(prompt(12, 100), max_tokens(1500), vec![]),
            GenerateContext::new(attacker.clone(), None),
        )
        .await
        .expect("generate");
    theirs.next().await.expect("a chunk").expect("no error");
    let p = prompt(13, 90);
    let n = 64;
    let mut ours = e
        .generate(
            request(p.clone(), max_tokens(n), vec![]),
            GenerateContext::new(context_with_id("chosen-id"), None),
        )
        .await
        .expect("generate");
    let mut items = vec![ours.next().await.expect("a chunk")];
    // An abort from a context that sent nothing here, and one from the first client's:
    // neither reaches the second client's request.
    e.abort(context_with_id("chosen-id")).await;
    e.abort(attacker).await;
    items.extend(ours.collect::<Vec<_>>().await);
    let (tokens, reason, _) = tokens_of(&items);
    assert_eq!(
        reason,
        FinishReason::Length,
        "not cancelled by another's abort"
    );
    assert_eq!(tokens, reference(&p, n));
    // The first client's own request was cancelled by its abort.
    let rest: Vec<_> = theirs.collect().await;
    let last = rest.last().expect("a terminal").as_ref().expect("no error");
    assert_eq!(last.finish_reason, Some(FinishReason::Cancelled));
    let load = settled(&e).await;
    assert_eq!((load.in_use, load.live), (0, 0), "{load:?}");
    assert_eq!((e.counts().cancelled, e.counts().length), (1, 1));
    e.cleanup().await.expect("cleanup");
}
