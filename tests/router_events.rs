//! Proof with a consumer nobody here wrote: NVIDIA Dynamo's KV router
//! (`dynamo-kv-router`) follows two runtimes' ZMQ streams — one in the positional-array
//! encoding, one in the map encoding — decodes them with its own wire decoder and
//! normalizer, indexes them in its own device tree and host-tier index, and for every
//! request asked its per-engine overlap score equals the whole blocks of the request's
//! prefix that engine holds (`probe_reuse`), through evictions, offloads to the host
//! tier, a LoRA adapter's scope and a prefix-cache reset. Doctored routers (wrong token
//! ids; removals dropped) disagree, so the comparison can fail. The replay socket
//! answers from any sequence number with the bytes the PUB socket sent.
mod common;
#[path = "common/dynamo_router.rs"]
mod dynamo_router;

use std::time::Duration;

use bytes::Bytes;
use common::engine::run_to_end;
use dsa_kv::actors::{EventBatch, KvCacheBuilder, KvCacheHandle};
use dsa_kv::config::{EngineConfig, ModelPreset};
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::core::{Medium, ReuseScope, RouterEvent};
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::publish::{encode_batch, WireEncoding, ZmqPublisher, ZmqPublisherConfig};
use dynamo_kv_router::zmq_wire::{decode_event_batch, RawKvEvent};
use dynamo_router::DynamoRouter;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const BLOCK: usize = 64;
const LORA: u64 = 7;

fn config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(3);
    // 16 GPU blocks and a few dozen on the host: offloads, and evictions from the host.
    c.kv_cache.max_tokens = Some(1024);
    c.kv_cache.host_cache_size = Some(4 << 20);
    c.scheduler.max_num_sequences = 16;
    c.scheduler.max_num_tokens = 512;
    c.scheduler.max_prefill_chunk = 256;
    c.scheduler.max_seq_len = 2048;
    c
}

/// A multi-turn conversation: a system prompt shared with other conversations, then its
/// own turns (each turn's prompt is the previous prompt and the new user tokens).
struct Conv {
    id: u64,
    scope: ReuseScope,
    prompt: Vec<TokenId>,
}

fn user_tokens(conv: u64, turn: u64) -> Vec<TokenId> {
    let n = 40 + (conv * 37 + turn * 53) % 90;
    (0..n)
        .map(|i| TokenId(((conv * 7919 + turn * 104_729 + i * 31) % 30_000) as u32 + 1000))
        .collect()
}

fn conversations(n: u64) -> Vec<Conv> {
    (0..n)
        .map(|id| {
            let system: Vec<TokenId> = (0..150)
                .map(|i| TokenId(i + 100 * (id % 3) as u32))
                .collect();
            let mut prompt = system;
            prompt.extend(user_tokens(id, 0));
            Conv {
                id,
                scope: if id == 5 {
                    ReuseScope {
                        lora_id: Some(LORA),
                        salt: None,
                    }
                } else {
                    ReuseScope::SHARED
                },
                prompt,
            }
        })
        .collect()
}

impl Conv {
    fn lora_name(&self) -> Option<String> {
        self.scope.lora_id.map(|id| id.to_string())
    }
    fn next_turn(&mut self, turn: u64) {
        self.prompt.extend(user_tokens(self.id, turn));
    }
    fn request(&self, turn: u64) -> SubmitRequest {
        SubmitRequest {
            id: RequestId(self.id * 100 + turn),
            scope: self.scope,
            prompt: self.prompt.clone(),
            max_new_tokens: 2 + (self.id as u32 % 5),
            priority: [10, 35, 60][(self.id + turn) as usize % 3],
        }
    }
}

struct Engine {
    kv: KvCacheHandle,
    publisher: ZmqPublisher,
}

impl Engine {
    async fn start(encoding: WireEncoding, topic: &str) -> Engine {
        Engine::start_with(KvCacheBuilder::new().config(config()), encoding, topic).await
    }

    async fn start_with(builder: KvCacheBuilder, encoding: WireEncoding, topic: &str) -> Engine {
        let kv = builder.start().await.unwrap();
        let publisher = ZmqPublisher::start(
            kv.events().subscribe().await.unwrap(),
            ZmqPublisherConfig {
                endpoint: "tcp://127.0.0.1:0".into(),
                replay_endpoint: Some("tcp://127.0.0.1:0".into()),
                topic: topic.into(),
                encoding,
                data_parallel_rank: Some(0),
                replay_buffer: 100_000,
                ..Default::default()
            },
        )
        .await
        .unwrap();
        Engine { kv, publisher }
    }

    /// The sequence number after the last batch of everything done so far, once the
    /// publisher has sent it.
    async fn published(&self) -> u64 {
        let target = self.kv.events().router_snapshot().await.unwrap().next_seq;
        let t0 = std::time::Instant::now();
        while self.publisher.next_seq() < target {
            assert!(t0.elapsed() < Duration::from_secs(30), "publisher stuck");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        target
    }
}

/// Routers: the honest one (from the start), one that joins late (it catches up by
/// replay), then the doctored ones.
struct Routers {
    honest: DynamoRouter,
    late: Option<DynamoRouter>,
    mutants: Vec<(&'static str, DynamoRouter, bool)>,
}

fn shift_tokens(e: &mut RawKvEvent) -> bool {
    if let RawKvEvent::BlockStored { token_ids, .. } = e {
        if let Some(t) = token_ids.first_mut() {
            *t += 1;
        }
    }
    true
}

fn drop_removals(e: &mut RawKvEvent) -> bool {
    !matches!(e, RawKvEvent::BlockRemoved { .. })
}

/// Every engine's stream caught up, then every query: the honest router's scores equal
/// each engine's own reuse, in whole blocks. Returns (queries with reuse somewhere,
/// blocks the host tier contributed).
async fn check(
    routers: &mut Routers,
    engines: &[Engine],
    convs: &[Conv],
    label: &str,
) -> (usize, u32) {
    let mut targets = Vec::new();
    for (w, e) in engines.iter().enumerate() {
        let target = e.published().await;
        routers
            .honest
            .catch_up(w, target)
            .await
            .unwrap_or_else(|err| panic!("{label}: {err}"));
        if let Some(late) = &mut routers.late {
            late.catch_up(w, target)
                .await
                .unwrap_or_else(|err| panic!("{label}, late router: {err}"));
        }
        targets.push(target);
    }
    for (_, r, detected) in &mut routers.mutants {
        for (w, &target) in targets.iter().enumerate() {
            if r.catch_up(w, target).await.is_err() {
                *detected = true;
            }
        }
    }
    // The queries: each conversation's current prompt, an unseen prompt, a system prompt
    // with a fresh question, and a prompt diverging inside a block.
    let mut queries: Vec<(ReuseScope, Vec<TokenId>, Option<String>)> = convs
        .iter()
        .map(|c| (c.scope, c.prompt.clone(), c.lora_name()))
        .collect();
    queries.push((
        ReuseScope::SHARED,
        (0..300).map(|i| TokenId(20_000 + i)).collect(),
        None,
    ));
    let mut sys: Vec<TokenId> = (0..150).map(TokenId).collect();
    sys.extend((0..70).map(|i| TokenId(25_000 + i)));
    queries.push((ReuseScope::SHARED, sys, None));
    let mut diverge = convs[0].prompt.clone();
    diverge[BLOCK + 10] = TokenId(29_999);
    queries.push((convs[0].scope, diverge, convs[0].lora_name()));

    let mut with_reuse = 0;
    let mut host_blocks = 0;
    for (scope, prompt, lora) in &queries {
        let mut want = Vec::new();
        for e in engines {
            want.push((e.kv.probe_reuse(*scope, prompt).await.unwrap() / BLOCK as u64) as u32);
        }
        let tokens: Vec<u32> = prompt[..prompt.len() - 1].iter().map(|t| t.get()).collect();
        let by_tier = routers.honest.scores_by_tier(&tokens, lora.as_deref());
        let got: Vec<u32> = by_tier.iter().map(|(d, h)| d + h).collect();
        assert_eq!(
            got, want,
            "{label}: Dynamo's overlap scores (device, host) {by_tier:?} vs the engines' reuse, for a {}-token prompt (LoRA {lora:?})",
            prompt.len()
        );
        if let Some(late) = &routers.late {
            assert_eq!(
                late.scores(&tokens, lora.as_deref()),
                want,
                "{label}: the late router"
            );
        }
        with_reuse += usize::from(want.iter().any(|&b| b > 0));
        host_blocks += by_tier.iter().map(|(_, h)| h).sum::<u32>();
        for (_, r, detected) in &mut routers.mutants {
            if r.scores(&tokens, lora.as_deref()) != want {
                *detected = true;
            }
        }
    }
    (with_reuse, host_blocks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dynamo_decodes_both_encodings_and_its_scores_equal_each_engines_reuse() {
    let engines = [
        Engine::start(WireEncoding::Array, "").await,
        Engine::start(WireEncoding::Map, "kv@b").await,
    ];
    let mut routers = Routers {
        honest: DynamoRouter::new(BLOCK as u32),
        late: None,
        mutants: vec![
            (
                "token ids shifted",
                DynamoRouter::doctored(BLOCK as u32, shift_tokens),
                false,
            ),
            (
                "removals dropped",
                DynamoRouter::doctored(BLOCK as u32, drop_removals),
                false,
            ),
        ],
    };
    let topics = ["", "kv@b"];
    for (e, topic) in engines.iter().zip(topics) {
        let ep = e.publisher.endpoint().to_string();
        let rep = e.publisher.replay_endpoint().unwrap().to_string();
        routers.honest.follow(&ep, &rep, topic).await.unwrap();
        for (_, r, _) in &mut routers.mutants {
            r.follow(&ep, &rep, topic).await.unwrap();
        }
    }
    let mut convs = conversations(16);
    // Turn 1: even conversations on engine 0, odd on engine 1.
    for c in &convs {
        engines[(c.id % 2) as usize]
            .kv
            .submit(c.request(1))
            .await
            .unwrap();
    }
    for e in &engines {
        run_to_end(&e.kv, || {}).await;
    }
    for c in &mut convs {
        c.next_turn(2);
    }
    let (reuse1, _) = check(&mut routers, &engines, &convs, "after turn 1").await;
    // A router joining now learns everything so far from the replay sockets.
    let mut late = DynamoRouter::new(BLOCK as u32);
    for (e, topic) in engines.iter().zip(topics) {
        late.follow(
            e.publisher.endpoint(),
            e.publisher.replay_endpoint().unwrap(),
            topic,
        )
        .await
        .unwrap();
    }
    routers.late = Some(late);
    // Turn 2 on the same engines; the cache is too small for all: evictions, offloads.
    for c in &convs {
        engines[(c.id % 2) as usize]
            .kv
            .submit(c.request(2))
            .await
            .unwrap();
    }
    for e in &engines {
        run_to_end(&e.kv, || {}).await;
    }
    for c in &mut convs {
        c.next_turn(3);
    }
    let (reuse2, host2) = check(&mut routers, &engines, &convs, "after turn 2").await;
    // Engine 0 drops its whole prefix cache: its scores go to 0, engine 1's stay.
    engines[0].kv.reset_prefix_cache().await.unwrap();
    let (reuse3, _) = check(&mut routers, &engines, &convs, "after engine 0's reset").await;
    // Turn 3 for half the conversations, all on engine 0: it refills.
    for c in convs.iter().take(8) {
        engines[0].kv.submit(c.request(3)).await.unwrap();
    }
    run_to_end(&engines[0].kv, || {}).await;
    for c in convs.iter_mut().take(8) {
        c.next_turn(4);
    }
    let (reuse4, host4) = check(&mut routers, &engines, &convs, "after turn 3").await;

    // Not vacuous: reuse on both engines, blocks from the host tier, evictions, offloads.
    assert!(
        reuse1 >= 10 && reuse2 >= 10 && reuse3 >= 5 && reuse4 >= 10,
        "{reuse1} {reuse2} {reuse3} {reuse4}"
    );
    assert!(host2 + host4 > 0, "no score came from the host tier");
    for e in &engines {
        let st = e.kv.stats().await.unwrap();
        assert!(st.offload_bytes > 0, "no offload");
        assert!(st.events.removed > 0, "no eviction");
    }
    // Both the PUB socket and replay carried batches (the first batches can precede the
    // subscription taking hold).
    for w in 0..2 {
        let s = routers.honest.stats(w);
        assert!(s.via_pub > 0, "engine {w}: nothing came over PUB: {s:?}");
        assert!(s.events > 100, "engine {w}: {s:?}");
        let l = routers.late.as_ref().unwrap().stats(w);
        assert!(
            l.via_replay > 0,
            "engine {w}: the late router replayed nothing: {l:?}"
        );
        assert_eq!(
            l.events, s.events,
            "engine {w}: both routers applied every event"
        );
    }
    for (name, _, detected) in &routers.mutants {
        assert!(
            detected,
            "the doctored router ({name}) agreed with the engines"
        );
    }

    // Replay from any point returns the bytes the router applied, then the end marker.
    for (w, e) in engines.iter().enumerate() {
        let applied = routers.honest.payloads(w).to_vec();
        let from = applied.len() as u64 / 2;
        let mut dealer = DealerSocket::new();
        dealer
            .connect(e.publisher.replay_endpoint().unwrap())
            .await
            .unwrap();
        dealer
            .send(
                ZmqMessage::try_from(vec![
                    Bytes::new(),
                    Bytes::copy_from_slice(&from.to_be_bytes()),
                ])
                .unwrap(),
            )
            .await
            .unwrap();
        let mut replayed = Vec::new();
        loop {
            let f = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
                .await
                .expect("replay answers")
                .unwrap()
                .into_vec();
            assert_eq!(f.len(), 3);
            if f[1].as_ref() == [0xff; 8] {
                assert!(f[2].is_empty());
                break;
            }
            replayed.push((
                u64::from_be_bytes(f[1].as_ref().try_into().unwrap()),
                f[2].clone(),
            ));
        }
        assert_eq!(
            replayed,
            applied[from as usize..],
            "engine {w}: replay from {from}"
        );
    }
    for e in engines {
        let report = e.publisher.shutdown().await;
        assert_eq!((report.lost_batches, report.send_errors), (0, 0));
        assert!(report.replay_requests > 0);
        e.kv.shutdown().await;
    }
}

/// DeepSeek-V4-Flash from its configuration preset: 24 blocks of 256 tokens per engine
/// (evictions), Flash's window rings, host devices (the preset's default).
fn v4_builder() -> KvCacheBuilder {
    let mut c = EngineConfig::default();
    c.model.preset = ModelPreset::DeepSeekV4Flash;
    c.kv_cache.max_tokens = Some(24 * 256);
    c.scheduler.max_num_sequences = 4;
    c.scheduler.max_num_tokens = 1024;
    c.scheduler.max_prefill_chunk = 512;
    c.scheduler.max_seq_len = 8192;
    // The preset's default devices: host pools, a forward that writes nothing.
    KvCacheBuilder::new().config(c)
}

/// DeepSeek-V4 through Dynamo's router: the events announce only blocks a hit can reach
/// (a tail at or below them), so for each conversation's prompt just served Dynamo's
/// score on the engine holding it is exactly that engine's reuse, on the other engine
/// it is never below its reuse, and a repeated prompt is routed to its holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dynamo_routes_a_repeated_deepseek_v4_prompt_to_its_holder() {
    const V4_BLOCK: u64 = 256;
    let engines = [
        Engine::start_with(v4_builder(), WireEncoding::Array, "").await,
        Engine::start_with(v4_builder(), WireEncoding::Map, "").await,
    ];
    let mut router = DynamoRouter::new(V4_BLOCK as u32);
    for e in &engines {
        let ep = e.publisher.endpoint().to_string();
        let rep = e.publisher.replay_endpoint().unwrap().to_string();
        router.follow(&ep, &rep, "").await.unwrap();
    }
    let mut convs: Vec<Conv> = (0..8)
        .map(|id| {
            let mut prompt: Vec<TokenId> = (0..600)
                .map(|i| TokenId(i + 1000 * (id % 3) as u32))
                .collect();
            prompt.extend(user_tokens(id, 0).repeat(4));
            Conv {
                id,
                scope: ReuseScope::SHARED,
                prompt,
            }
        })
        .collect();
    let (mut routed, mut held) = (0, 0);
    for turn in 1..=3 {
        for c in &convs {
            let holder = &engines[(c.id % 2) as usize].kv;
            holder.submit(c.request(turn)).await.unwrap();
            run_to_end(holder, || {}).await;
        }
        for (w, e) in engines.iter().enumerate() {
            let target = e.published().await;
            router.catch_up(w, target).await.unwrap();
        }
        for c in &convs {
            let holder = (c.id % 2) as usize;
            let mut want = Vec::new();
            for e in &engines {
                let reuse = e.kv.probe_reuse(c.scope, &c.prompt).await.unwrap();
                want.push((reuse / V4_BLOCK) as u32);
            }
            let tokens: Vec<u32> = c.prompt[..c.prompt.len() - 1]
                .iter()
                .map(|t| t.get())
                .collect();
            let got = router.scores(&tokens, None);
            let label = format!(
                "turn {turn}, conversation {}: scores {got:?}, reuse {want:?}",
                c.id
            );
            assert_eq!(got[holder], want[holder], "{label}");
            assert!(got[1 - holder] >= want[1 - holder], "{label}");
            if want[holder] > 0 {
                held += 1;
                routed += usize::from(got[holder] > got[1 - holder]);
            }
        }
        for c in &mut convs {
            c.next_turn(turn + 1);
            c.prompt.extend(user_tokens(c.id, turn + 100).repeat(3));
        }
    }
    assert!(held >= 16, "only {held} prompts were held");
    assert!(
        routed * 10 >= held * 9,
        "only {routed} of {held} held prompts scored highest on their holder"
    );
    for e in engines {
        let st = e.kv.stats().await.unwrap();
        assert!(st.events.removed > 0, "no eviction: {:?}", st.events);
        e.publisher.shutdown().await;
        e.kv.shutdown().await;
    }
}

/// One batch of every event kind: Dynamo decodes the array and the map encodings to the
/// same events, with our hashes, parent, tokens, block size, medium and LoRA name.
#[test]
fn both_encodings_decode_to_the_same_events_in_dynamo() {
    let batch = EventBatch {
        seq: 9,
        timestamp: 1.7e9,
        events: vec![
            RouterEvent::BlockStored {
                block_hashes: vec![0xfedc_ba98_7654_3210],
                parent_block_hash: Some(42),
                token_ids: (0..64).collect(),
                block_size: 64,
                medium: Medium::CpuPinned,
                lora_id: Some(LORA),
                lora_name: None,
            },
            RouterEvent::BlockRemoved {
                block_hashes: vec![42],
                medium: Medium::Gpu,
            },
            RouterEvent::AllBlocksCleared,
        ],
    };
    let mut decoded = Vec::new();
    for enc in [WireEncoding::Array, WireEncoding::Map] {
        let d = decode_event_batch(&encode_batch(&batch, enc, Some(3))).unwrap();
        assert_eq!(
            (d.ts, d.data_parallel_rank, d.events.len()),
            (1.7e9, Some(3), 3)
        );
        match &d.events[0] {
            RawKvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora_name,
                ..
            } => {
                assert_eq!(block_hashes[0].into_u64(), 0xfedc_ba98_7654_3210);
                assert_eq!(parent_block_hash.unwrap().into_u64(), 42);
                assert_eq!(*token_ids, (0..64).collect::<Vec<u32>>());
                assert_eq!(*block_size, 64);
                assert_eq!(medium.as_deref(), Some("CPU_PINNED"));
                assert_eq!(lora_name.as_deref(), Some("7"));
            }
            other => panic!("{other:?}"),
        }
        match &d.events[1] {
            RawKvEvent::BlockRemoved {
                block_hashes,
                medium,
                ..
            } => {
                assert_eq!(block_hashes[0].into_u64(), 42);
                assert_eq!(medium.as_deref(), Some("GPU"));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(d.events[2], RawKvEvent::AllBlocksCleared { .. }));
        decoded.push(format!("{:?}", d.events));
    }
    assert_eq!(decoded[0], decoded[1], "array and map decode alike");
}
