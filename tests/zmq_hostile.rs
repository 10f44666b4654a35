//! Hostile clients against the ZMQ publisher (`dsa_kv::publish`), over raw TCP: each
//! test is a client a serving cluster can meet (a port scanner, a buggy or malicious
//! router, a subscriber that stopped reading) and checks that it costs the engine no
//! more than a bounded amount of memory, never the process, and never the service of
//! the honest clients next to it. The honest clients are the `zeromq` crate's SUB and
//! DEALER sockets (their ZMTP implementation is not ours).
//!
//! Run: `cargo test --release --features zmq --test zmq_hostile`.
mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use dsa_kv::actors::{EventBatch, KvCacheBuilder, KvCacheHandle, StreamItem};
use dsa_kv::config::EngineConfig;
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::core::{Medium, ReuseScope, RouterEvent};
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::publish::{EventSource, ZmqLimits, ZmqPublisher, ZmqPublisherConfig, END_OF_REPLAY};
use tokio::io::AsyncBufReadExt;
use tokio::sync::mpsc;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// The tests run one at a time: two of them measure the process's resident set.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(1);
    c.kv_cache.max_tokens = Some(2048);
    c.scheduler.max_num_sequences = 32;
    c.scheduler.max_num_tokens = 4096;
    c.scheduler.max_prefill_chunk = 4096;
    c.scheduler.max_seq_len = 1024;
    c
}

/// Where an engine's batches come from: a real runtime, or batches made here and fed
/// through the public [`EventSource`] trait (thousands per second, for the tests that
/// need many).
enum Source {
    Runtime {
        kv: KvCacheHandle,
        next_id: u64,
    },
    Fed {
        tx: mpsc::UnboundedSender<StreamItem>,
        next_seq: u64,
        /// Blocks per batch.
        blocks: u64,
    },
}

struct Fed(mpsc::UnboundedReceiver<StreamItem>);

impl EventSource for Fed {
    async fn recv(&mut self) -> Option<StreamItem> {
        self.0.recv().await
    }
    fn try_recv(&mut self) -> Option<StreamItem> {
        self.0.try_recv().ok()
    }
}

/// A batch as the runtime makes one: `blocks` stored blocks of a prompt.
fn batch(seq: u64, blocks: u64) -> StreamItem {
    let events = (0..blocks)
        .map(|b| RouterEvent::BlockStored {
            block_hashes: vec![seq * 4 + b + 1],
            parent_block_hash: (b > 0).then_some(seq * 4 + b),
            token_ids: (0..64)
                .map(|i| (seq * 7919 + b * 64 + i) as u32 % 100_000)
                .collect(),
            block_size: 64,
            medium: Medium::Gpu,
            lora_id: None,
            lora_name: None,
        })
        .collect();
    StreamItem::Batch(Arc::new(EventBatch {
        seq,
        timestamp: 1.7e9,
        events,
    }))
}

struct Engine {
    source: Source,
    publisher: ZmqPublisher,
}

fn publisher_config(limits: ZmqLimits) -> ZmqPublisherConfig {
    ZmqPublisherConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        replay_buffer: 100_000,
        limits,
        ..Default::default()
    }
}

impl Engine {
    /// A publisher of a real runtime's stream.
    async fn runtime(limits: ZmqLimits) -> Engine {
        let kv = KvCacheBuilder::new()
            .config(config())
            .start()
            .await
            .unwrap();
        let publisher = ZmqPublisher::start(
            kv.events().subscribe().await.unwrap(),
            publisher_config(limits),
        )
        .await
        .unwrap();
        Engine {
            source: Source::Runtime { kv, next_id: 0 },
            publisher,
        }
    }

    /// A publisher of batches made here.
    async fn fed(limits: ZmqLimits) -> Engine {
        let (tx, rx) = mpsc::unbounded_channel();
        let publisher = ZmqPublisher::start(Fed(rx), publisher_config(limits))
            .await
            .unwrap();
        Engine {
            source: Source::Fed {
                tx,
                next_seq: 0,
                blocks: 4,
            },
            publisher,
        }
    }

    /// Makes at least `n` more batches and waits until the publisher has sent them:
    /// runtime requests (distinct four-block prompts, one output token), or fed ones.
    async fn produce(&mut self, n: u64) {
        let target = self.publisher.next_seq() + n;
        match &mut self.source {
            Source::Fed {
                tx,
                next_seq,
                blocks,
            } => {
                for _ in 0..n {
                    tx.send(batch(*next_seq, *blocks)).unwrap();
                    *next_seq += 1;
                }
            }
            Source::Runtime { kv, next_id } => {
                while kv.events().router_snapshot().await.unwrap().next_seq < target {
                    for _ in 0..16 {
                        let id = *next_id;
                        *next_id += 1;
                        let prompt = (0..256)
                            .map(|i| TokenId(((id * 7919 + i * 31) % 100_000) as u32 + 1))
                            .collect();
                        kv.submit(SubmitRequest {
                            id: RequestId(id),
                            scope: ReuseScope::SHARED,
                            prompt,
                            max_new_tokens: 1,
                            priority: 35,
                        })
                        .await
                        .unwrap();
                    }
                    while kv.counters().in_flight > 0 {
                        let r = kv.step(HashMap::new()).await.unwrap();
                        let outs = r.outcomes_from(|_| TokenId(7));
                        if !outs.is_empty() {
                            kv.commit(outs).await.unwrap();
                        }
                    }
                }
            }
        }
        let want = match &mut self.source {
            Source::Fed { next_seq, .. } => *next_seq,
            Source::Runtime { kv, .. } => kv.events().router_snapshot().await.unwrap().next_seq,
        };
        let t0 = Instant::now();
        while self.publisher.next_seq() < want {
            assert!(t0.elapsed() < Duration::from_secs(30), "publisher stuck");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    async fn shutdown(self) {
        self.publisher.shutdown().await;
        if let Source::Runtime { kv, .. } = self.source {
            kv.shutdown().await;
        }
    }
}

fn addr(endpoint: &str) -> &str {
    endpoint.strip_prefix("tcp://").unwrap()
}

/// A ZMTP 3.0 greeting with the NULL mechanism.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A short frame: flags, one length byte, the body.
fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    assert!(body.len() < 256);
    let mut f = vec![flags, body.len() as u8];
    f.extend_from_slice(body);
    f
}

/// The READY command of a socket of type `ty`.
fn ready(ty: &str) -> Vec<u8> {
    let mut b = vec![5];
    b.extend_from_slice(b"READY");
    b.push(11);
    b.extend_from_slice(b"Socket-Type");
    b.extend_from_slice(&(ty.len() as u32).to_be_bytes());
    b.extend_from_slice(ty.as_bytes());
    frame(0x04, &b)
}

/// A raw client that completed the handshake as a `ty` socket (the server's greeting
/// and READY are read and discarded).
fn handshaken(endpoint: &str, ty: &str) -> TcpStream {
    handshake_on(TcpStream::connect(addr(endpoint)).unwrap(), ty).unwrap()
}

/// The client's half of the handshake as a `ty` socket on `s`; an error if the server
/// closed the connection instead.
fn handshake_on(mut s: TcpStream, ty: &str) -> std::io::Result<TcpStream> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(&greeting())?;
    s.write_all(&ready(ty))?;
    let mut g = [0u8; 64];
    s.read_exact(&mut g)?;
    assert_eq!((g[0], g[9], g[10]), (0xff, 0x7f, 3), "a ZMTP 3 greeting");
    // The server's READY: flags, length, body.
    let mut h = [0u8; 2];
    s.read_exact(&mut h)?;
    assert_eq!(h[0] & 0x04, 0x04, "a command frame");
    let mut body = vec![0u8; h[1] as usize];
    s.read_exact(&mut body)?;
    assert_eq!(&body[1..6], b"READY");
    Ok(s)
}

/// A TCP connection to `endpoint` from the loopback address `from` (127.0.0.2 is
/// another host as far as the publisher can tell).
async fn connect_from(endpoint: &str, from: [u8; 4]) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind((from, 0).into())?;
    let s = socket.connect(addr(endpoint).parse().unwrap()).await?;
    let s = s.into_std()?;
    s.set_nonblocking(false)?;
    Ok(s)
}

/// The next whole message on a raw client's connection: its frames.
fn read_message(s: &mut TcpStream) -> std::io::Result<Vec<Vec<u8>>> {
    let mut frames = Vec::new();
    loop {
        let mut flags = [0u8; 1];
        s.read_exact(&mut flags)?;
        let len = if flags[0] & 0x02 != 0 {
            let mut n = [0u8; 8];
            s.read_exact(&mut n)?;
            u64::from_be_bytes(n) as usize
        } else {
            let mut n = [0u8; 1];
            s.read_exact(&mut n)?;
            usize::from(n[0])
        };
        let mut body = vec![0u8; len];
        s.read_exact(&mut body)?;
        frames.push(body);
        if flags[0] & 0x01 == 0 {
            return Ok(frames);
        }
    }
}

/// Whether the server closed `s` within `within` (reads and discards what comes).
fn closed_by_server(s: &mut TcpStream, within: Duration) -> bool {
    let until = Instant::now() + within;
    let mut buf = [0u8; 65536];
    while Instant::now() < until {
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return true,
        }
    }
    false
}

/// An honest DEALER asks for replay from `from`: the batches' sequence numbers, up to
/// the end marker, within `within`.
async fn replay_from(endpoint: &str, from: u64, within: Duration) -> Result<Vec<u64>, String> {
    let mut d = DealerSocket::new();
    d.connect(endpoint).await.map_err(|e| e.to_string())?;
    d.send(
        ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .unwrap(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let until = Instant::now() + within;
    let mut seqs = Vec::new();
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let m = tokio::time::timeout(left, d.recv())
            .await
            .map_err(|_| format!("no end marker within {within:?} ({} batches)", seqs.len()))?
            .map_err(|e| e.to_string())?
            .into_vec();
        if m[1].as_ref() == END_OF_REPLAY {
            return Ok(seqs);
        }
        seqs.push(u64::from_be_bytes(m[1].as_ref().try_into().unwrap()));
    }
}

/// An honest SUB receives the next batch (a new request's blocks).
async fn sub_sees_a_batch(e: &mut Engine) {
    let mut sub = SubSocket::new();
    sub.connect(e.publisher.endpoint()).await.unwrap();
    sub.subscribe("").await.unwrap();
    // The subscription reaches the publisher asynchronously: keep producing until a
    // batch arrives.
    for _ in 0..50 {
        e.produce(1).await;
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(200), sub.recv()).await {
            assert_eq!(m.unwrap().into_vec().len(), 3);
            return;
        }
    }
    panic!("the honest subscriber received nothing");
}

/// Resident set size of this process, in bytes.
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = s.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// The audit's one-packet abort: a greeting and one long-frame header claiming 2^62
/// bytes, before any handshake, on the PUB and on the replay port. Before the fix the
/// `zeromq` crate reserved that length and the process aborted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_long_frame_header_aborts_nothing() {
    let _serial = SERIAL.lock().await;
    let mut e = Engine::runtime(ZmqLimits::default()).await;
    e.produce(3).await;
    for endpoint in [
        e.publisher.endpoint().to_string(),
        e.publisher.replay_endpoint().unwrap().to_string(),
    ] {
        let mut s = TcpStream::connect(addr(&endpoint)).unwrap();
        s.write_all(&greeting()).unwrap();
        s.write_all(&[0x06, 0x40, 0, 0, 0, 0, 0, 0, 0]).unwrap();
        assert!(
            closed_by_server(&mut s, Duration::from_secs(5)),
            "{endpoint}: the server kept a client that claimed a 2^62-byte frame"
        );
        // The same header after a complete handshake, as a message frame.
        let mut s = handshaken(
            &endpoint,
            if endpoint == e.publisher.endpoint() {
                "SUB"
            } else {
                "DEALER"
            },
        );
        s.write_all(&[0x02, 0x40, 0, 0, 0, 0, 0, 0, 0]).unwrap();
        assert!(closed_by_server(&mut s, Duration::from_secs(5)));
    }
    // Still serving: the report, a subscriber, a replay.
    assert!(e.publisher.report().batches >= 3);
    sub_sees_a_batch(&mut e).await;
    let next = e.publisher.next_seq();
    let got = replay_from(
        e.publisher.replay_endpoint().unwrap(),
        next - 2,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert_eq!(got, vec![next - 2, next - 1]);
    let r = e.publisher.report();
    assert!(r.dropped_peers >= 4, "{r:?}");
    e.shutdown().await;
}

/// The audit's replay wedge: a client that asks for everything twenty times and never
/// reads. Before the fix one task served every replay request with no deadline, so the
/// second client never got its end marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_client_that_never_reads_wedges_nobody() {
    let _serial = SERIAL.lock().await;
    let limits = ZmqLimits {
        replay_deadline: Duration::from_secs(2),
        ..ZmqLimits::default()
    };
    let mut e = Engine::fed(limits).await;
    e.produce(3_000).await;
    let endpoint = e.publisher.replay_endpoint().unwrap().to_string();
    let mut hog = handshaken(&endpoint, "DEALER");
    for _ in 0..20 {
        hog.write_all(&[0x01, 0x00]).unwrap(); // the empty delimiter, more to come
        hog.write_all(&frame(0x00, &0u64.to_be_bytes())).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The honest router asks for the last few batches: answered within a second.
    let next = e.publisher.next_seq();
    let t0 = Instant::now();
    let got = replay_from(&endpoint, next - 5, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(got, (next - 5..next).collect::<Vec<_>>());
    assert!(t0.elapsed() < Duration::from_secs(1));
    // The hog is dropped once an answer misses the deadline (read nothing before:
    // reading would make it an honest client).
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        closed_by_server(&mut hog, Duration::from_secs(20)),
        "the client that never reads was kept"
    );
    let r = e.publisher.report();
    assert!(r.dropped_peers >= 1, "{r:?}");
    // A request for everything is capped, and says so with its first sequence number.
    let got = replay_from(&endpoint, 0, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(got.len(), ZmqLimits::default().replay_max_batches);
    assert_eq!(got[0], 0);
    assert!(e.publisher.report().replay_truncated >= 1);
    e.shutdown().await;
}

/// A million SUBSCRIBE messages from one client: the publisher keeps at most
/// `max_subscriptions` and drops the client past them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_flood_is_cut_off() {
    let _serial = SERIAL.lock().await;
    let mut e = Engine::fed(ZmqLimits::default()).await;
    let mut s = handshaken(e.publisher.endpoint(), "SUB");
    s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let before = rss();
    let mut sent = 0u32;
    let mut chunk = Vec::new();
    'flood: for block in 0..1000u32 {
        chunk.clear();
        for i in 0..1000u32 {
            let mut body = vec![1u8];
            body.extend_from_slice(format!("topic-{block}-{i}").as_bytes());
            chunk.extend_from_slice(&frame(0x00, &body));
        }
        if s.write_all(&chunk).is_err() {
            break 'flood;
        }
        sent += 1000;
    }
    assert!(
        closed_by_server(&mut s, Duration::from_secs(5)),
        "the flooding subscriber was kept after {sent} subscriptions"
    );
    let grown = rss().saturating_sub(before);
    assert!(grown < 64 << 20, "RSS grew by {grown} bytes");
    sub_sees_a_batch(&mut e).await;
    e.shutdown().await;
}

/// Fifty subscribers that never read, while 4,000 batches go out: each holds at most
/// `subscriber_queue_bytes` of queued messages (the rest are dropped for it and
/// counted), so the engine's memory stays bounded; an honest subscriber that keeps up
/// gets every batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_subscribers_cost_bounded_memory() {
    let _serial = SERIAL.lock().await;
    let limits = ZmqLimits {
        subscriber_queue_bytes: 512 << 10,
        // All 51 come from 127.0.0.1 here.
        max_subscribers_per_peer: 64,
        ..ZmqLimits::default()
    };
    let mut e = Engine::fed(limits.clone()).await;
    // 16-block batches (about 5 KB): 20 MB for each stalled subscriber, more than the
    // kernel's socket buffers take.
    if let Source::Fed { blocks, .. } = &mut e.source {
        *blocks = 16;
    }
    let stalled: Vec<TcpStream> = (0..50)
        .map(|_| {
            let mut s = handshaken(e.publisher.endpoint(), "SUB");
            s.write_all(&frame(0x00, &[1])).unwrap(); // subscribe to everything
            s
        })
        .collect();
    let mut honest = SubSocket::new();
    honest.connect(e.publisher.endpoint()).await.unwrap();
    honest.subscribe("").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first = e.publisher.next_seq();
    let before = rss();
    let received = Arc::new(AtomicU64::new(0));
    let got = received.clone();
    let reader = tokio::spawn(async move {
        let mut seqs = Vec::new();
        while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_secs(5), honest.recv()).await {
            let f = m.into_vec();
            seqs.push(u64::from_be_bytes(f[1].as_ref().try_into().unwrap()));
            got.fetch_add(1, Ordering::Relaxed);
        }
        seqs
    });
    // In rounds of 100 batches (about 500 KB), each sent once the honest subscriber has
    // the previous round: it never falls a queue behind.
    for round in 1..=40u64 {
        e.produce(100).await;
        let t0 = Instant::now();
        while received.load(Ordering::Relaxed) < round * 100 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the honest subscriber stalled"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let last = e.publisher.next_seq();
    let grown = rss().saturating_sub(before);
    eprintln!(
        "RSS grew by {grown} bytes while {} batches went out",
        last - first
    );
    let seqs = reader.await.unwrap();
    assert_eq!(
        seqs.len() as u64,
        last - first,
        "the honest subscriber got every batch"
    );
    assert!(seqs.iter().copied().eq(first..last), "in order, no gap");
    // 50 × 512 KiB of queues, plus the replay buffer's growth (the batches themselves,
    // about 20 MB) and allocator slack.
    let bound = 50 * limits.subscriber_queue_bytes + (40 << 20);
    assert!(grown < bound, "RSS grew by {grown} bytes (bound {bound})");
    let r = e.publisher.report();
    assert!(r.dropped_messages > 0, "{r:?}");
    drop(stalled);
    e.shutdown().await;
}

/// Connections past `max_subscribers` (and `max_replay_clients`) are closed at once;
/// silent connections are closed after `handshake_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_caps_and_handshake_deadlines() {
    let _serial = SERIAL.lock().await;
    let limits = ZmqLimits {
        max_subscribers: 4,
        max_replay_clients: 2,
        handshake_timeout: Duration::from_millis(500),
        ..ZmqLimits::default()
    };
    let mut e = Engine::fed(limits).await;
    let subs: Vec<TcpStream> = (0..4)
        .map(|_| handshaken(e.publisher.endpoint(), "SUB"))
        .collect();
    let mut extra = TcpStream::connect(addr(e.publisher.endpoint())).unwrap();
    extra.write_all(&greeting()).unwrap();
    assert!(closed_by_server(&mut extra, Duration::from_secs(2)));
    drop(subs);
    // Silent sockets: closed after the handshake deadline; then honest clients connect.
    let mut silent: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(addr(e.publisher.replay_endpoint().unwrap())).unwrap())
        .collect();
    for s in &mut silent {
        assert!(closed_by_server(s, Duration::from_secs(3)));
    }
    e.produce(2).await;
    let next = e.publisher.next_seq();
    let got = replay_from(
        e.publisher.replay_endpoint().unwrap(),
        next - 1,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert_eq!(got, vec![next - 1]);
    sub_sees_a_batch(&mut e).await;
    let r = e.publisher.report();
    assert!(r.refused_connections >= 1, "{r:?}");
    e.shutdown().await;
}

/// Issue 39, item 10: one host that opens every connection both sockets allow (quiet
/// subscribers subscribed to everything, replay clients that ask nothing yet: each
/// looks honest) locked every other router out until it let go. Now a peer address
/// holds at most `max_subscribers_per_peer` / `max_replay_clients_per_peer`, and a
/// router on another host (127.0.0.2) subscribes and replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_host_cannot_take_every_connection() {
    let _serial = SERIAL.lock().await;
    let limits = ZmqLimits::default();
    let mut e = Engine::fed(limits.clone()).await;
    e.produce(2).await;
    let pub_ep = e.publisher.endpoint().to_string();
    let replay_ep = e.publisher.replay_endpoint().unwrap().to_string();
    let mut hog = Vec::new();
    for _ in 0..limits.max_subscribers {
        let mut s = TcpStream::connect(addr(&pub_ep)).unwrap();
        let _ = s.write_all(&greeting());
        let _ = s.write_all(&ready("SUB"));
        let _ = s.write_all(&frame(0x00, &[1]));
        hog.push(s);
    }
    for _ in 0..limits.max_replay_clients {
        let mut s = TcpStream::connect(addr(&replay_ep)).unwrap();
        let _ = s.write_all(&greeting());
        let _ = s.write_all(&ready("DEALER"));
        hog.push(s);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The router on another host: a subscriber that gets the next batch.
    let sub = connect_from(&pub_ep, [127, 0, 0, 2]).await.unwrap();
    let mut sub = handshake_on(sub, "SUB").expect("the other host's subscriber was refused");
    sub.write_all(&frame(0x00, &[1])).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    e.produce(1).await;
    let m = read_message(&mut sub).expect("the other host's subscriber got a batch");
    assert_eq!(m.len(), 3);
    assert_eq!(m[1], 2u64.to_be_bytes());
    // And its replay client: asks from 1, gets batches 1 and 2 and the end marker.
    let replay = connect_from(&replay_ep, [127, 0, 0, 2]).await.unwrap();
    let mut replay =
        handshake_on(replay, "DEALER").expect("the other host's replay client was refused");
    replay.write_all(&[0x01, 0x00]).unwrap();
    replay.write_all(&frame(0x00, &1u64.to_be_bytes())).unwrap();
    let mut seqs = Vec::new();
    loop {
        let m = read_message(&mut replay).expect("the replay answer");
        if m[1] == END_OF_REPLAY {
            break;
        }
        seqs.push(u64::from_be_bytes(m[1].as_slice().try_into().unwrap()));
    }
    assert_eq!(seqs, vec![1, 2]);
    // The host kept its share on each socket: 16 subscribers, 8 replay clients; the
    // rest were closed at once, counted and logged.
    let mut kept = 0;
    for s in &mut hog {
        if !closed_by_server(s, Duration::from_millis(100)) {
            kept += 1;
        }
    }
    assert_eq!(
        kept,
        limits.max_subscribers_per_peer + limits.max_replay_clients_per_peer
    );
    let r = e.publisher.report();
    let refused = (limits.max_subscribers - limits.max_subscribers_per_peer)
        + (limits.max_replay_clients - limits.max_replay_clients_per_peer);
    assert_eq!(r.refused_per_peer, refused as u64, "{r:?}");
    assert_eq!(r.refused_connections, 0, "{r:?}");
    drop(hog);
    e.shutdown().await;
}

/// Issue 39, item 10 (idle peers): a subscriber that never subscribes to the
/// publisher's topic, or cancels it, would receive nothing and only hold a slot; it is
/// closed after `subscribe_timeout` (before: kept for ever). A replay client that asks
/// nothing is closed after `replay_idle_timeout`. A subscriber that subscribed is kept
/// however quiet it is (the publisher is the one that writes) and gets the next batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_peers_go_and_quiet_subscribers_stay() {
    let _serial = SERIAL.lock().await;
    let limits = ZmqLimits {
        subscribe_timeout: Duration::from_millis(500),
        replay_idle_timeout: Duration::from_millis(500),
        ..ZmqLimits::default()
    };
    let mut e = Engine::fed(limits).await;
    e.produce(1).await;
    let pub_ep = e.publisher.endpoint().to_string();
    let mut never = handshaken(&pub_ep, "SUB");
    let mut elsewhere = handshaken(&pub_ep, "SUB");
    elsewhere
        .write_all(&frame(0x00, b"\x01another topic"))
        .unwrap();
    let mut quiet = handshaken(&pub_ep, "SUB");
    quiet.write_all(&frame(0x00, &[1])).unwrap();
    let mut asks_nothing = handshaken(e.publisher.replay_endpoint().unwrap(), "DEALER");
    let t0 = Instant::now();
    assert!(
        closed_by_server(&mut never, Duration::from_secs(3)),
        "a subscriber without a subscription was kept"
    );
    assert!(
        closed_by_server(&mut elsewhere, Duration::from_secs(3)),
        "a subscriber to another topic was kept"
    );
    assert!(closed_by_server(&mut asks_nothing, Duration::from_secs(3)));
    let quiet_for = Duration::from_secs(2).saturating_sub(t0.elapsed());
    assert!(
        !closed_by_server(&mut quiet, quiet_for),
        "a quiet subscriber was closed"
    );
    e.produce(1).await;
    let m = read_message(&mut quiet).expect("the quiet subscriber got the batch");
    assert_eq!(m[1], 1u64.to_be_bytes());
    // It cancels its subscription: it wants nothing now, and goes.
    quiet.write_all(&frame(0x00, &[0])).unwrap();
    assert!(closed_by_server(&mut quiet, Duration::from_secs(3)));
    assert_eq!(e.publisher.report().dropped_peers, 4);
    e.shutdown().await;
}

/// libzmq (through pyzmq), the reference ZeroMQ implementation, as a client: its SUB
/// receives every batch, its DEALER replays from a sequence number to the end marker,
/// its REQ gets the first answer. Skipped when `python3 -c "import zmq"` fails, unless
/// `DSA_KV_REQUIRE_PYZMQ=1` (CI installs pyzmq).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libzmq_clients_subscribe_and_replay() {
    let _serial = SERIAL.lock().await;
    let have = std::process::Command::new("python3")
        .args(["-c", "import zmq"])
        .status()
        .is_ok_and(|s| s.success());
    if !have {
        assert!(
            std::env::var("DSA_KV_REQUIRE_PYZMQ").is_err(),
            "DSA_KV_REQUIRE_PYZMQ is set but python3 cannot import zmq (pip install pyzmq)"
        );
        eprintln!("skipped: python3 with pyzmq is not installed (pip install pyzmq)");
        return;
    }
    let mut e = Engine::fed(ZmqLimits::default()).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/libzmq_client.py");
    let mut child = tokio::process::Command::new("python3")
        .args([
            script,
            e.publisher.endpoint(),
            e.publisher.replay_endpoint().unwrap(),
            "50",
            "20",
        ])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.as_deref(), Some("subscribed"));
    // The subscription reaches us asynchronously: wait until the SUB is registered.
    tokio::time::sleep(Duration::from_millis(500)).await;
    e.produce(50).await;
    let out = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .expect("the client's report");
    assert!(child.wait().await.unwrap().success());
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let list = |k: &str| -> Vec<u64> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    assert_eq!(list("pub"), (0..50).collect::<Vec<_>>(), "{out}");
    assert_eq!(list("replay"), (20..50).collect::<Vec<_>>(), "{out}");
    assert_eq!(v["req_first"].as_u64(), Some(20), "{out}");
    eprintln!("libzmq {}: subscribed and replayed", v["libzmq"]);
    e.shutdown().await;
}
