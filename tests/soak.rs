//! The soak: many requests through the runtime while everything that runs beside a real
//! engine runs too, checked at every checkpoint for what long runs break first (memory
//! that creeps, invariants that drift, a router that stops agreeing, transfers left
//! open):
//!
//! * engine A serves the requests (synthetic writer, 2 layers, MTP drafts, a host tier)
//!   with 20 % of its GPU-room requests refused as storage failures;
//! * a ZMQ publisher on A's router events, with one **slow subscriber** (a raw TCP
//!   client with an 8 KiB receive buffer that reads a kilobyte every 20 ms) and one **replaying router** (the
//!   `zeromq` crate's SUB and DEALER, reading only at checkpoints: its queue overflows,
//!   it sees the gaps and fills them by replay), whose mirror is built with Dynamo's own
//!   decoder (`dynamo_kv_router::zmq_wire`);
//! * every 10th finished request's prompt blocks are **transferred** to engine B over the
//!   local transport (export, import bound to B's request, window, push, commit).
//!
//! The same soak runs DeepSeek-V4-Flash from its configuration preset (host devices, a
//! forward that writes nothing: the engine samples): 256-token blocks, window rings and
//! tails, events that announce only blocks a hit can reach, and transfers that move the
//! blocks with the tail at their boundary.
//!
//! At every checkpoint (a tenth of the run, at most 250 DeepSeek-V4 requests): A's and B's `check_invariants`; the router's
//! mirror, caught up to A's `router_snapshot().next_seq`, equals the snapshot's blocks;
//! the process's resident set within ±5 % of its reading at the first checkpoint after
//! the warm-up (2,000 requests, `DSA_KV_SOAK_WARMUP`: the bounded stores fill first). At the end: every request
//! finished, no export or import open on either engine, none expired.
//!
//! Requests: `DSA_KV_SOAK_REQUESTS` (default 4,000; the full soak is 10,000, see
//! RELIABILITY.md); DeepSeek-V4: `DSA_KV_SOAK_V4_REQUESTS` (default 10,000, warm-up
//! `DSA_KV_SOAK_V4_WARMUP`, 5,000: its forward writes nothing, so a request costs little).
mod common;

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dsa_kv::actors::{KvCacheBuilder, KvCacheHandle, RuntimeError};
use dsa_kv::config::{EngineConfig, ModelPreset, SpecMode};
use dsa_kv::core::scheduler::{RequestOutcome, SubmitRequest};
use dsa_kv::core::ReuseScope;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::publish::{ZmqLimits, ZmqPublisher, ZmqPublisherConfig};
use dsa_kv::rng::SplitMix64;
use dsa_kv::transfer::{push, KvTransport, LocalTransport, PeerId, PoolRegion};
use dynamo_kv_router::zmq_wire::{decode_event_batch, RawKvEvent};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const SCOPE: ReuseScope = ReuseScope::SHARED;

/// The model a soak serves.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Family {
    /// DeepSeek-V3.2's cache (2 layers, synthetic writer, MTP drafts, a host tier).
    Dsa,
    /// DeepSeek-V4-Flash from its preset (host devices, a forward that writes nothing).
    V4,
}

impl Family {
    fn tokens_per_block(self) -> u32 {
        match self {
            Family::Dsa => 64,
            Family::V4 => 256,
        }
    }

    fn config(self) -> EngineConfig {
        let mut c = EngineConfig::default();
        c.scheduler.max_prefill_chunk = 512;
        match self {
            Family::Dsa => {
                c.model.num_layers = Some(2);
                c.spec_decode.mode = SpecMode::Mtp;
                c.spec_decode.draft_tokens = 2;
                c.kv_cache.max_tokens = Some(4096);
                c.kv_cache.host_cache_size = Some(16 << 20);
                c.scheduler.max_num_sequences = 32;
                c.scheduler.max_num_tokens = 2048;
                c.scheduler.max_seq_len = 1024;
            }
            Family::V4 => {
                // 40 blocks of 256 tokens (evictions), Flash's window rings for 8
                // sequences; no host tier (V4 preempts by recompute).
                c.model.preset = ModelPreset::DeepSeekV4Flash;
                c.kv_cache.max_tokens = Some(40 * 256);
                c.scheduler.max_num_sequences = 8;
                c.scheduler.max_num_tokens = 1024;
                c.scheduler.max_seq_len = 4096;
            }
        }
        c
    }

    async fn engine(self) -> KvCacheHandle {
        KvCacheBuilder::new()
            // Bounded buffers small enough to be full after the warm-up tenth.
            .event_stream_capacity(256)
            .event_capacity(1024)
            .config(self.config())
            .start()
            .await
            .unwrap()
    }

    /// Request `i`'s prompt: one of eight shared system prompts (2 blocks), then its
    /// own tokens (1 to 3 blocks and a partial one).
    fn prompt(self, i: u64) -> Vec<TokenId> {
        let per = self.tokens_per_block() / 64;
        let sys = (i % 8) as u32;
        let own = (64 + (i * 37 % 150) as u32) * per;
        (0..128 * per)
            .map(|t| TokenId(sys * 1000 + t + 1))
            .chain((0..own).map(|t| TokenId(100_000 + (i as u32 % 50_000) * 300 * per + t)))
            .collect()
    }

    /// The most requests between two checkpoints (a DeepSeek-V4 request publishes about
    /// 1.3 event batches: 250 requests leave room in the replay buffer).
    fn max_checkpoint(self) -> u64 {
        match self {
            Family::Dsa => u64::MAX,
            Family::V4 => 250,
        }
    }

    /// In-flight requests the soak keeps.
    fn in_flight(self) -> u64 {
        match self {
            Family::Dsa => 24,
            Family::V4 => 12,
        }
    }
}

/// A router that reads A's stream only when asked: Dynamo's decoder applies every batch
/// in order to a mirror of (block hash, medium); a gap (its queue overflowed at the
/// publisher) is filled from the replay socket.
struct Router {
    sub: SubSocket,
    replay: DealerSocket,
    next_seq: u64,
    mirror: HashSet<(u64, String)>,
    replayed: u64,
}

impl Router {
    async fn new(p: &ZmqPublisher) -> Router {
        let mut sub = SubSocket::new();
        sub.connect(p.endpoint()).await.unwrap();
        sub.subscribe("").await.unwrap();
        let mut replay = DealerSocket::new();
        replay.connect(p.replay_endpoint().unwrap()).await.unwrap();
        Router {
            sub,
            replay,
            next_seq: 0,
            mirror: HashSet::new(),
            replayed: 0,
        }
    }

    fn apply(&mut self, payload: &[u8]) {
        let batch = decode_event_batch(payload).expect("Dynamo decodes our payload");
        for e in batch.events {
            match e {
                RawKvEvent::BlockStored {
                    block_hashes,
                    medium,
                    ..
                } => {
                    for h in block_hashes {
                        let new = self
                            .mirror
                            .insert((h.into_u64(), medium.clone().unwrap_or_default()));
                        assert!(new, "stored twice");
                    }
                }
                RawKvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    ..
                } => {
                    for h in block_hashes {
                        let was = self
                            .mirror
                            .remove(&(h.into_u64(), medium.clone().unwrap_or_default()));
                        assert!(was, "removed a block it did not hold");
                    }
                }
                RawKvEvent::AllBlocksCleared { .. } => self.mirror.clear(),
                _ => {}
            }
        }
        self.next_seq += 1;
    }

    async fn replay_from_next(&mut self) {
        let req = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&self.next_seq.to_be_bytes()),
        ])
        .unwrap();
        self.replay.send(req).await.unwrap();
        loop {
            let f = tokio::time::timeout(Duration::from_secs(10), self.replay.recv())
                .await
                .expect("a replay answer")
                .unwrap()
                .into_vec();
            if f[1].as_ref() == [0xff; 8] {
                return;
            }
            let seq = u64::from_be_bytes(f[1].as_ref().try_into().unwrap());
            assert!(seq <= self.next_seq, "replay skipped batches");
            if seq == self.next_seq {
                self.apply(&f[2]);
                self.replayed += 1;
            }
        }
    }

    /// Applies every batch before `target`.
    async fn catch_up(&mut self, target: u64) {
        let until = Instant::now() + Duration::from_secs(60);
        while self.next_seq < target {
            assert!(
                Instant::now() < until,
                "the router is stuck at {}",
                self.next_seq
            );
            match tokio::time::timeout(Duration::from_millis(50), self.sub.recv()).await {
                Ok(Ok(m)) => {
                    let f = m.into_vec();
                    let seq = u64::from_be_bytes(f[1].as_ref().try_into().unwrap());
                    if seq > self.next_seq {
                        self.replay_from_next().await;
                    }
                    if seq == self.next_seq {
                        self.apply(&f[2]);
                    }
                }
                Ok(Err(e)) => panic!("SUB: {e}"),
                Err(_) => self.replay_from_next().await,
            }
        }
    }
}

/// A subscriber that reads a kilobyte every 20 ms (50 KB/s) until told to stop.
fn slow_subscriber(endpoint: &str, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    let addr = endpoint.strip_prefix("tcp://").unwrap().to_string();
    std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        // A small receive buffer, so the kernel does not absorb what the subscriber is
        // too slow for: the publisher's queue for it fills and drops.
        {
            use std::os::fd::AsRawFd;
            let size: libc::c_int = 8192;
            // SAFETY: a valid socket and a valid option value of its size.
            unsafe {
                libc::setsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVBUF,
                    (&size as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
        }
        let mut g = [0u8; 64];
        g[0] = 0xff;
        g[9] = 0x7f;
        g[10] = 3;
        g[12..16].copy_from_slice(b"NULL");
        let mut ready = vec![0x04, 25, 5];
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        ready.extend_from_slice(&3u32.to_be_bytes());
        ready.extend_from_slice(b"SUB");
        use std::io::Write;
        s.write_all(&g).unwrap();
        s.write_all(&ready).unwrap();
        s.write_all(&[0x00, 1, 1]).unwrap(); // subscribe to everything
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut got = 0u64;
        let mut buf = [0u8; 1024];
        while !stop.load(Ordering::Relaxed) {
            if let Ok(n) = s.read(&mut buf) {
                if n == 0 {
                    break;
                }
                got += n as u64;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        got
    })
}

fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    s.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 4096
}

struct Transfers {
    ta: LocalTransport,
    tb: LocalTransport,
    peer: PeerId,
    writer: PeerId,
    ra: Vec<PoolRegion>,
    rb: Vec<PoolRegion>,
    done: u64,
    /// Tail pages moved (DeepSeek-V4).
    tail_pages: u64,
    tokens_per_block: usize,
}

impl Transfers {
    /// Moves `prompt`'s cached full blocks from A to B (ids: `id` on both).
    async fn move_blocks(
        &mut self,
        a: &KvCacheHandle,
        b: &KvCacheHandle,
        id: RequestId,
        prompt: &[TokenId],
    ) {
        let t = self.tokens_per_block;
        let full = &prompt[..prompt.len() / t * t];
        let export = match a.transfer().export(id, SCOPE, full).await {
            Ok(e) => e,
            // A windowed model with no cached boundary keeping a tail: nothing pinned.
            Err(RuntimeError::Transfer(_)) if t == 256 => return,
            Err(e) => panic!("export {id}: {e}"),
        };
        if export.blocks.is_empty() {
            a.transfer().release_export(id).await.unwrap();
            return;
        }
        let ticket = b
            .transfer()
            .begin_import_with(
                &mut self.tb,
                &self.writer,
                &self.rb,
                id,
                SCOPE,
                prompt,
                &export,
            )
            .await
            .unwrap();
        let Some(ticket) = ticket else {
            // No room on B now: a step there makes some.
            a.transfer().release_export(id).await.unwrap();
            let _ = b.step(HashMap::new()).await;
            return;
        };
        push(
            &mut self.ta,
            &self.peer,
            &export,
            &self.ra,
            &ticket,
            &self.rb,
            b"soak",
        )
        .unwrap();
        a.transfer().release_export(id).await.unwrap();
        assert!(self
            .tb
            .take_notifications()
            .unwrap()
            .iter()
            .any(|(_, m)| m == b"soak"));
        b.transfer()
            .commit_import_with(&mut self.tb, id)
            .await
            .unwrap();
        self.done += 1;
        self.tail_pages += ticket
            .tail
            .iter()
            .map(|w| w.slots.len() as u64)
            .sum::<u64>();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_run_loses_nothing_and_grows_nothing() {
    // The bounded stores (1,024 unwaited results, the replay buffer, the event buffers)
    // fill during the first 2,000 requests of this workload: the resident set is
    // compared from the first checkpoint after them.
    soak(
        Family::Dsa,
        env("DSA_KV_SOAK_REQUESTS", 4_000),
        env("DSA_KV_SOAK_WARMUP", 2_000),
    )
    .await;
}

/// The soak for DeepSeek-V4-Flash (see the module docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_deepseek_v4_run_loses_nothing_and_grows_nothing() {
    soak(
        Family::V4,
        env("DSA_KV_SOAK_V4_REQUESTS", 10_000),
        env("DSA_KV_SOAK_V4_WARMUP", 5_000),
    )
    .await;
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn soak(family: Family, total: u64, warm: u64) {
    // A tenth of the run, and at most as many requests as leave fewer router batches
    // than the publisher's replay buffer (512) between two checkpoints: the router
    // reads only at checkpoints and fills its gaps by replay.
    let checkpoint = (total / 10).min(family.max_checkpoint()).max(1);
    // ±5 %; another bound only to explore (`DSA_KV_SOAK_RSS_TOLERANCE=1` prints the drift).
    let tolerance: f64 = std::env::var("DSA_KV_SOAK_RSS_TOLERANCE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.05);
    let t0 = Instant::now();
    let (a, b) = (family.engine().await, family.engine().await);
    a.inject_room_failures(7, 20).await.unwrap();
    let publisher = ZmqPublisher::start(
        a.events().subscribe().await.unwrap(),
        ZmqPublisherConfig {
            endpoint: "tcp://127.0.0.1:0".into(),
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            replay_buffer: 512,
            limits: ZmqLimits {
                subscriber_queue_bytes: 64 << 10,
                ..ZmqLimits::default()
            },
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let slow = slow_subscriber(publisher.endpoint(), stop.clone());
    let mut router: Option<Router> = None;
    let (ra, rb) = (
        a.transfer().regions().await.unwrap(),
        b.transfer().regions().await.unwrap(),
    );
    let (mut ta, mut tb) = (LocalTransport::new("soak-a"), LocalTransport::new("soak-b"));
    // SAFETY: the engines' own pools, alive until the end of the test (the transports
    // are dropped first); writes go only into the windows of open imports.
    let (peer, writer) = unsafe {
        ta.register(&ra.iter().map(|r| r.region).collect::<Vec<_>>())
            .unwrap();
        tb.register(&rb.iter().map(|r| r.region).collect::<Vec<_>>())
            .unwrap();
        let writer = tb.connect(&ta.local_metadata().unwrap()).unwrap();
        (ta.connect(&tb.local_metadata().unwrap()).unwrap(), writer)
    };
    let mut moves = Transfers {
        ta,
        tb,
        peer,
        writer,
        ra,
        rb,
        done: 0,
        tail_pages: 0,
        tokens_per_block: family.tokens_per_block() as usize,
    };
    let mut rng = SplitMix64(42);
    let mut prompts: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
    let (mut submitted, mut finished) = (0u64, 0u64);
    let mut next_check = checkpoint;
    let mut first_rss: Option<u64> = None;
    let steps = AtomicU64::new(0);
    while finished < total {
        while submitted < total && a.counters().in_flight < family.in_flight() {
            let id = RequestId(submitted);
            let p = family.prompt(submitted);
            a.submit(SubmitRequest {
                id,
                scope: SCOPE,
                prompt: p.clone(),
                max_new_tokens: 2 + (submitted % 5) as u32,
                priority: [10, 35, 60][submitted as usize % 3],
            })
            .await
            .unwrap();
            prompts.insert(id, p);
            submitted += 1;
        }
        // Drafts for every decoding request; a random number of them accepted.
        let r = a.step(HashMap::new()).await.unwrap();
        steps.fetch_add(1, Ordering::Relaxed);
        let outs: Vec<RequestOutcome> = r
            .scheduled
            .iter()
            .map(|s| RequestOutcome {
                id: s.id,
                accepted_drafts: 0,
                next_token: s
                    .produces_token
                    .then(|| TokenId((rng.next_u64() % 30_000) as u32 + 1)),
            })
            .collect();
        if outs.is_empty() {
            continue;
        }
        let c = a.commit(outs).await.unwrap();
        for f in &c.finished {
            assert!(
                f.mismatches.is_empty(),
                "request {}: {:?}",
                f.finished.id,
                f.mismatches
            );
            let id = f.finished.id;
            let p = prompts.remove(&id).expect("a submitted request");
            finished += 1;
            if finished % 10 == 0 {
                moves
                    .move_blocks(&a, &b, RequestId(1_000_000 + id.0), &p)
                    .await;
            }
        }
        // The router joins once the stream has begun: what it missed, it replays.
        if router.is_none() && finished >= 20 {
            router = Some(Router::new(&publisher).await);
        }
        if finished >= next_check {
            next_check += checkpoint;
            let router = router.as_mut().expect("joined before the first checkpoint");
            a.check_invariants().await.unwrap();
            b.check_invariants().await.unwrap();
            let snap = a.events().router_snapshot().await.unwrap();
            router.catch_up(snap.next_seq).await;
            let want: HashSet<(u64, String)> = snap
                .blocks
                .iter()
                .map(|b| {
                    let m = serde_json::to_value(b.medium).unwrap();
                    (b.hash, m.as_str().unwrap().to_string())
                })
                .collect();
            assert_eq!(router.mirror, want, "the router's mirror left the cache");
            let now = rss();
            match first_rss {
                None if finished < warm => {}
                None => first_rss = Some(now),
                Some(first) => {
                    let drift = now as f64 / first as f64 - 1.0;
                    assert!(
                        drift.abs() <= tolerance,
                        "RSS {now} B at {finished} requests, {:.1} % from {first} B",
                        drift * 100.0
                    );
                }
            }
            eprintln!(
                "soak ({family:?}): {finished} requests, {} steps, RSS {:.1} MiB, {} blocks mirrored ({} batches replayed), {} transfers, {:?}",
                steps.load(Ordering::Relaxed),
                now as f64 / (1 << 20) as f64,
                router.mirror.len(),
                router.replayed,
                moves.done,
                t0.elapsed()
            );
        }
    }
    let (sa, sb) = (a.stats().await.unwrap(), b.stats().await.unwrap());
    assert_eq!((sa.scheduler.finished, sa.scheduler.failed), (total, 0));
    for s in [&sa, &sb] {
        let t = s.transfers;
        assert_eq!(
            (
                t.open_exports,
                t.open_imports,
                t.expired_exports,
                t.expired_imports
            ),
            (0, 0, 0, 0),
            "{t:?}"
        );
    }
    assert!(moves.done >= total / 20, "{} transfers", moves.done);
    if family == Family::V4 {
        assert!(moves.tail_pages > 0, "no tail moved");
        let w = sa.windows.expect("a windowed model's counters");
        assert!(
            w.windows.tails_evicted > 0,
            "the windows were never under pressure: {w:?}"
        );
    }
    assert!(
        router.as_ref().is_some_and(|r| r.replayed > 0),
        "the router never had to replay"
    );
    let report = publisher.report();
    assert!(
        report.dropped_messages > 0,
        "nobody fell behind: {report:?}"
    );
    stop.store(true, Ordering::Relaxed);
    let slow_read = slow.join().unwrap();
    eprintln!(
        "soak ({family:?}) done: {total} requests in {:?}, {} tail pages moved; publisher {report:?}; the slow subscriber read {slow_read} bytes; A offloaded {} B, {} preemptions",
        t0.elapsed(),
        moves.tail_pages,
        sa.offload_bytes,
        sa.scheduler.preemptions
    );
    drop(moves);
    publisher.shutdown().await;
    a.shutdown().await;
    b.shutdown().await;
}
