//! The ZMQ publisher: a PUB socket sending every batch of the router event stream as
//! three frames `[topic, sequence (u64 big-endian), payload]`, and a ROUTER socket
//! answering replay requests from its buffer of recent batches. Both speak ZMTP 3.0
//! ([`super::zmtp`]) to any ZeroMQ client (libzmq, pyzmq, the `zeromq` crate).
//!
//! Replay protocol (vLLM's): a client (REQ, or DEALER sending an empty delimiter
//! first) sends one frame, the first sequence number it wants (8 bytes, big-endian); the
//! publisher answers with one message `["", sequence, payload]` per buffered batch from
//! that number on, in order, at most [`ZmqLimits::replay_max_batches`] of them, then the
//! end marker `["", -1 as 8 bytes, ""]`. A request for batches older than the buffer
//! gets what the buffer still has (the first sequence number then tells the client what
//! is gone); a capped answer ends early, and the client asks again from the next one.
//!
//! What a client can cost the publisher is bounded: see [`ZmqLimits`].

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch, Notify};
use tokio::task::{JoinHandle, JoinSet};

use super::wire::{encode_batch, WireEncoding};
use super::zmtp::{self, Incoming, SocketType, ZmtpError};
use crate::actors::{EventSubscriber, StreamItem};

/// The replay end marker: −1 as a signed 64-bit big-endian integer.
pub const END_OF_REPLAY: [u8; 8] = (-1i64).to_be_bytes();

/// The most a client can cost the publisher.
///
/// # What a client can cost
///
/// Every connection is served by its own task, so a slow or hostile client delays only
/// itself. Everything a client can make the publisher hold is bounded by these
/// limits:
///
/// * connections: at most `max_subscribers` on the PUB socket and `max_replay_clients`
///   on the replay socket (handshakes included), and of those at most
///   `max_subscribers_per_peer` / `max_replay_clients_per_peer` from one peer address
///   (an IPv4 address, or an IPv6 address), so that one host cannot lock the routers
///   of others out; the next is closed at once, counted
///   ([`PublisherReport::refused_connections`], [`PublisherReport::refused_per_peer`])
///   and logged. Behind a proxy or NAT that shows every client with one address, raise
///   the per-peer limits to the totals;
/// * a connection that has not completed its handshake within `handshake_timeout` is
///   closed;
/// * a subscriber that holds no subscription matching the publisher's topic for
///   `subscribe_timeout` (from its handshake, or from cancelling its last one) is
///   closed: it would receive nothing, and only hold a slot. One that is subscribed is
///   never closed for being quiet (the publisher is the one that writes), only for a
///   socket that accepts nothing, below;
/// * a frame or command from a peer larger than `max_inbound_frame` is refused from its
///   header, before its body is read; a message of more frames than a request has is
///   refused; the connection is closed;
/// * a subscriber holds at most `max_subscriptions` subscriptions of at most
///   `max_inbound_frame` bytes; one more closes it;
/// * a subscriber's queue holds at most `subscriber_queue_bytes` of messages not yet
///   written to its socket: past that, batches are dropped for that subscriber
///   (counted in [`PublisherReport::dropped_messages`]; it sees a gap in the sequence
///   numbers and can replay it), as a ZeroMQ PUB drops at its high-water mark; a
///   subscriber whose socket accepts nothing for `send_timeout` is closed;
/// * a replay client has one request answered at a time (the next is read once the
///   answer is written; what it sends meanwhile waits in its own TCP buffers); an
///   answer not written within `replay_deadline` closes the client, and a client that
///   asks nothing for `replay_idle_timeout` (from its handshake or its last answer) is
///   closed.
///
/// So the publisher's memory beyond its replay buffer is at most about
/// max_subscribers × (subscriber_queue_bytes + max_subscriptions × max_inbound_frame)
/// plus (max_subscribers + max_replay_clients) × 2 × max_inbound_frame for frames being
/// read, plus the kernel's socket buffers, whatever the clients send
/// (`tests/zmq_hostile.rs` measures it). The queued messages are encoded once and
/// shared by every subscriber's queue (reference-counted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZmqLimits {
    /// Connections on the PUB socket (handshakes included).
    pub max_subscribers: usize,
    /// Connections on the replay socket (handshakes included).
    pub max_replay_clients: usize,
    /// Connections on the PUB socket from one peer address (handshakes included).
    pub max_subscribers_per_peer: usize,
    /// Connections on the replay socket from one peer address (handshakes included).
    pub max_replay_clients_per_peer: usize,
    /// Subscriptions one subscriber may hold.
    pub max_subscriptions: usize,
    /// The largest frame or command a peer may send (subscriptions, requests, READY).
    pub max_inbound_frame: u64,
    /// Bytes of messages queued for one subscriber; past it, batches are dropped for it.
    pub subscriber_queue_bytes: u64,
    /// Time to complete the ZMTP handshake.
    pub handshake_timeout: Duration,
    /// Time a subscriber may hold no subscription that matches the publisher's topic.
    pub subscribe_timeout: Duration,
    /// Time a subscriber's socket may accept nothing while a message waits for it.
    pub send_timeout: Duration,
    /// Time to write one whole replay answer.
    pub replay_deadline: Duration,
    /// Time a replay client may stay connected without asking anything.
    pub replay_idle_timeout: Duration,
    /// Batches in one replay answer.
    pub replay_max_batches: usize,
}

impl Default for ZmqLimits {
    /// 64 subscribers and 16 replay clients, of which 16 and 8 from one peer address
    /// (a quarter and a half: a router keeps one subscriber and one replay connection
    /// per engine, so a host of eight routers is served, and no one host fills a
    /// socket); 32 subscriptions; 1 KiB
    /// inbound frames; 16 MiB per subscriber queue; 5 s handshakes; 30 s to subscribe
    /// to the topic; 10 s sends and replay answers; 120 s idle replay clients; 1,000
    /// batches per replay answer.
    fn default() -> Self {
        ZmqLimits {
            max_subscribers: 64,
            max_replay_clients: 16,
            max_subscribers_per_peer: 16,
            max_replay_clients_per_peer: 8,
            max_subscriptions: 32,
            max_inbound_frame: 1024,
            subscriber_queue_bytes: 16 << 20,
            handshake_timeout: Duration::from_secs(5),
            subscribe_timeout: Duration::from_secs(30),
            send_timeout: Duration::from_secs(10),
            replay_deadline: Duration::from_secs(10),
            replay_idle_timeout: Duration::from_secs(120),
            replay_max_batches: 1000,
        }
    }
}

/// Where and how the publisher sends.
#[derive(Clone, Debug)]
pub struct ZmqPublisherConfig {
    /// The PUB socket's endpoint, bound by the publisher (`tcp://HOST:PORT`; `*` for
    /// every interface; port 0 picks a free port, see [`ZmqPublisher::endpoint`]).
    pub endpoint: String,
    /// The replay ROUTER socket's endpoint; `None` for no replay.
    pub replay_endpoint: Option<String>,
    /// The first frame of every message (subscribers filter on its prefix; vLLM's
    /// default is empty).
    pub topic: String,
    /// The events' shape in the payload.
    pub encoding: WireEncoding,
    /// The payload's third element (`None` encodes as nil).
    pub data_parallel_rank: Option<i32>,
    /// Batches kept for replay (the oldest are dropped past it).
    pub replay_buffer: usize,
    /// What one client may cost.
    pub limits: ZmqLimits,
}

impl Default for ZmqPublisherConfig {
    /// vLLM's defaults: PUB on `tcp://127.0.0.1:5557`, replay on `tcp://127.0.0.1:5558`,
    /// empty topic, array events, no rank, 10,000 batches for replay; the default
    /// [`ZmqLimits`].
    fn default() -> Self {
        ZmqPublisherConfig {
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: Some("tcp://127.0.0.1:5558".into()),
            topic: String::new(),
            encoding: WireEncoding::Array,
            data_parallel_rank: None,
            replay_buffer: 10_000,
            limits: ZmqLimits::default(),
        }
    }
}

/// Why the publisher could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PublishError {
    /// A socket could not bind its endpoint.
    #[error("cannot bind the {socket} socket to {endpoint:?}: {source} (is the port in use? port 0 picks a free one)")]
    Bind {
        /// `PUB` or `ROUTER`.
        socket: &'static str,
        /// The endpoint asked for.
        endpoint: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The configuration cannot work.
    #[error("invalid publisher configuration: {0}")]
    Config(String),
}

/// What the publisher did, so far or in all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PublisherReport {
    /// Batches sent on the PUB socket (queued for every matching subscriber).
    pub batches: u64,
    /// Events in those batches.
    pub events: u64,
    /// Batches the publisher's own subscription lost (it fell behind the stream):
    /// subscribers see a gap in the sequence numbers that replay cannot fill.
    pub lost_batches: u64,
    /// Replay requests answered.
    pub replay_requests: u64,
    /// Replay answers cut at [`ZmqLimits::replay_max_batches`].
    pub replay_truncated: u64,
    /// Sends that failed: always 0 since queued sends cannot fail; kept for reports.
    pub send_errors: u64,
    /// Messages dropped for a subscriber whose queue was full (its gap can be replayed).
    pub dropped_messages: u64,
    /// Connections closed at once because the socket had its maximum of connections.
    pub refused_connections: u64,
    /// Connections closed at once because their peer address had its maximum on that
    /// socket ([`ZmqLimits::max_subscribers_per_peer`],
    /// [`ZmqLimits::max_replay_clients_per_peer`]).
    pub refused_per_peer: u64,
    /// Connections closed for breaking a limit or the protocol, a deadline, or a
    /// socket that accepted nothing for too long (each is logged with its reason).
    pub dropped_peers: u64,
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    events: AtomicU64,
    lost_batches: AtomicU64,
    replay_requests: AtomicU64,
    replay_truncated: AtomicU64,
    dropped_messages: AtomicU64,
    refused_connections: AtomicU64,
    refused_per_peer: AtomicU64,
    dropped_peers: AtomicU64,
    /// One more than the last sequence number sent (0: none yet).
    next_seq: AtomicU64,
}

impl Counters {
    fn report(&self) -> PublisherReport {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PublisherReport {
            batches: l(&self.batches),
            events: l(&self.events),
            lost_batches: l(&self.lost_batches),
            replay_requests: l(&self.replay_requests),
            replay_truncated: l(&self.replay_truncated),
            send_errors: 0,
            dropped_messages: l(&self.dropped_messages),
            refused_connections: l(&self.refused_connections),
            refused_per_peer: l(&self.refused_per_peer),
            dropped_peers: l(&self.dropped_peers),
        }
    }
}

/// Where the publisher's batches come from: the runtime's [`EventSubscriber`] (from
/// [`Events::subscribe`](crate::actors::Events::subscribe)),
/// or any stream of [`StreamItem`]s (a filtered one, a test's).
pub trait EventSource: Send + 'static {
    /// The next item; `None` once the stream has ended.
    fn recv(&mut self) -> impl Future<Output = Option<StreamItem>> + Send;
    /// The next item if one is ready now.
    fn try_recv(&mut self) -> Option<StreamItem>;
}

impl EventSource for EventSubscriber {
    fn recv(&mut self) -> impl Future<Output = Option<StreamItem>> + Send {
        EventSubscriber::recv(self)
    }
    fn try_recv(&mut self) -> Option<StreamItem> {
        EventSubscriber::try_recv(self)
    }
}

/// The batches kept for replay, oldest first, in sequence order.
type ReplayBuffer = Mutex<VecDeque<(u64, Bytes)>>;

/// One subscriber connection, as the fan-out sees it.
struct Subscriber {
    /// Topic prefixes subscribed to (a ZeroMQ subscription is a prefix match).
    subscriptions: Mutex<Vec<Bytes>>,
    queue: Mutex<Queue>,
    /// Signalled when a message is queued, the connection ends, or the publisher stops.
    wake: Notify,
    /// The connection ended (its reader saw the peer go, or it broke a limit).
    gone: AtomicBool,
}

#[derive(Default)]
struct Queue {
    messages: VecDeque<Bytes>,
    bytes: u64,
}

impl Subscriber {
    fn new() -> Self {
        Subscriber {
            subscriptions: Mutex::new(Vec::new()),
            queue: Mutex::new(Queue::default()),
            wake: Notify::new(),
            gone: AtomicBool::new(false),
        }
    }

    fn wants(&self, topic: &[u8]) -> bool {
        lock(&self.subscriptions)
            .iter()
            .any(|s| topic.starts_with(s))
    }

    /// Queues `msg` unless that would pass `cap` bytes; whether it was queued.
    fn offer(&self, msg: &Bytes, cap: u64) -> bool {
        let mut q = lock(&self.queue);
        let len = msg.len() as u64;
        if q.bytes + len > cap {
            return false;
        }
        q.bytes += len;
        q.messages.push_back(msg.clone());
        drop(q);
        self.wake.notify_one();
        true
    }

    fn end(&self) {
        self.gone.store(true, Ordering::Relaxed);
        self.wake.notify_one();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock()
        .expect("invariant: the publisher's locks are never held across a panic")
}

/// The connections one socket holds, in all and per peer address.
struct Slots {
    max: usize,
    per_peer: usize,
    held: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    total: usize,
    /// Only addresses holding at least one (so at most `max` entries).
    by_peer: HashMap<IpAddr, usize>,
}

/// Why a connection got no slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NoSlot {
    /// The socket holds its maximum.
    Full,
    /// The connection's peer address holds its maximum.
    PeerFull,
}

/// A connection's place on its socket, given back when dropped (however its task ends).
struct Slot {
    slots: Arc<Slots>,
    peer: IpAddr,
}

impl Slots {
    fn new(max: usize, per_peer: usize) -> Arc<Slots> {
        Arc::new(Slots {
            max,
            per_peer,
            held: Mutex::new(Held::default()),
        })
    }

    /// A slot for a connection from `peer` (an IPv4-mapped IPv6 address counts as its
    /// IPv4 address), unless the socket or that address holds its maximum.
    fn take(self: &Arc<Self>, peer: IpAddr) -> Result<Slot, NoSlot> {
        let peer = peer.to_canonical();
        let mut h = lock(&self.held);
        if h.total >= self.max {
            return Err(NoSlot::Full);
        }
        let n = h.by_peer.get(&peer).copied().unwrap_or(0);
        if n >= self.per_peer {
            return Err(NoSlot::PeerFull);
        }
        h.by_peer.insert(peer, n + 1);
        h.total += 1;
        drop(h);
        #[cfg(debug_assertions)]
        self.check_invariants();
        Ok(Slot {
            slots: self.clone(),
            peer,
        })
    }

    /// The total is the sum per address; no address holds more than its maximum, none
    /// is listed with nothing.
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    fn check_invariants(&self) {
        let h = lock(&self.held);
        assert_eq!(h.total, h.by_peer.values().sum::<usize>());
        assert!(h.total <= self.max);
        assert!(h
            .by_peer
            .values()
            .all(|&n| (1..=self.per_peer).contains(&n)));
    }

    /// (connections held, of them from `peer`), for tests.
    #[cfg(test)]
    fn held(&self, peer: IpAddr) -> (usize, usize) {
        let h = lock(&self.held);
        (h.total, h.by_peer.get(&peer).copied().unwrap_or(0))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut h = lock(&self.slots.held);
        h.total -= 1;
        if let Some(n) = h.by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                h.by_peer.remove(&self.peer);
            }
        }
        drop(h);
        #[cfg(debug_assertions)]
        self.slots.check_invariants();
    }
}

/// What every task of the publisher shares.
struct Shared {
    limits: ZmqLimits,
    /// The first frame of every message (what a subscription must match).
    topic: Bytes,
    counters: Counters,
    subscribers: Mutex<Vec<Arc<Subscriber>>>,
    buffer: ReplayBuffer,
    /// Flipped to true when the sockets close.
    closing: watch::Sender<bool>,
}

impl Shared {
    fn drop_peer(&self, socket: &'static str, peer: SocketAddr, why: &dyn std::fmt::Display) {
        self.counters.dropped_peers.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("dsa_kv_zmq_peers_dropped_total").increment(1);
        tracing::warn!(socket, %peer, "ZMQ publisher: closing the connection: {why}");
    }
}

/// Publishes a runtime's router event stream over ZMQ: each batch on a PUB socket as
/// `[topic, sequence (u64 big-endian), payload]`; replay requests (one frame, the first
/// sequence number wanted, 8 bytes big-endian, from REQ or a DEALER sending an empty
/// delimiter first) answered on a ROUTER socket with `["", sequence, payload]` per
/// buffered batch from that number on, then `["", `[`END_OF_REPLAY`]`, ""]`. Runs on the
/// caller's tokio runtime until [`shutdown`](Self::shutdown) or until the stream ends
/// (the cache runtime shut down). What a client can cost is bounded: see
/// [`ZmqLimits`].
pub struct ZmqPublisher {
    endpoint: String,
    replay_endpoint: Option<String>,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    publish_task: JoinHandle<()>,
    listeners: Vec<JoinHandle<()>>,
}

/// `tcp://HOST:PORT` (`*` for every interface) as a socket address.
fn parse_endpoint(endpoint: &str) -> Result<SocketAddr, PublishError> {
    let bad = |why: &str| PublishError::Config(format!("endpoint {endpoint:?}: {why}"));
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| bad("only tcp:// endpoints are served"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| bad("want tcp://HOST:PORT"))?;
    let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip = if host == "*" {
        std::net::IpAddr::from([0, 0, 0, 0])
    } else if host == "localhost" {
        std::net::IpAddr::from([127, 0, 0, 1])
    } else {
        host.parse()
            .map_err(|_| bad("the host is not an IP address (or * or localhost)"))?
    };
    Ok(SocketAddr::new(ip, port))
}

async fn bind(socket: &'static str, endpoint: &str) -> Result<(TcpListener, String), PublishError> {
    let addr = parse_endpoint(endpoint)?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| PublishError::Bind {
            socket,
            endpoint: endpoint.to_string(),
            source,
        })?;
    let bound = listener.local_addr().map_err(|source| PublishError::Bind {
        socket,
        endpoint: endpoint.to_string(),
        source,
    })?;
    Ok((listener, format!("tcp://{bound}")))
}

impl ZmqPublisher {
    /// Binds the sockets and starts publishing what `source` receives (for the runtime,
    /// take it from
    /// [`Events::subscribe`](crate::actors::Events::subscribe)
    /// before the first request, so nothing is missed).
    pub async fn start(
        source: impl EventSource,
        config: ZmqPublisherConfig,
    ) -> Result<Self, PublishError> {
        if config.replay_endpoint.is_some() && config.replay_buffer == 0 {
            return Err(PublishError::Config(
                "replay_buffer is 0 with a replay endpoint: keep at least one batch, or set replay_endpoint to None".into(),
            ));
        }
        let l = &config.limits;
        if l.max_subscribers == 0
            || l.max_replay_clients == 0
            || l.max_subscribers_per_peer == 0
            || l.max_replay_clients_per_peer == 0
            || l.max_subscriptions == 0
            || l.replay_max_batches == 0
            || l.max_inbound_frame < 64
        {
            return Err(PublishError::Config(format!(
                "limits {l:?}: every count must be at least 1 and max_inbound_frame at least 64 bytes (a READY command)"
            )));
        }
        let (pub_listener, endpoint) = bind("PUB", &config.endpoint).await?;
        let replay = match &config.replay_endpoint {
            Some(ep) => Some(bind("ROUTER", ep).await?),
            None => None,
        };
        let shared = Arc::new(Shared {
            limits: config.limits.clone(),
            topic: Bytes::copy_from_slice(config.topic.as_bytes()),
            counters: Counters::default(),
            subscribers: Mutex::new(Vec::new()),
            buffer: Mutex::new(VecDeque::new()),
            closing: watch::Sender::new(false),
        });
        let mut listeners = vec![tokio::spawn(accept(
            pub_listener,
            SocketType::Pub,
            shared.clone(),
        ))];
        let replay_endpoint = replay.map(|(listener, bound)| {
            listeners.push(tokio::spawn(accept(
                listener,
                SocketType::Router,
                shared.clone(),
            )));
            bound
        });
        let (stop, stop_rx) = oneshot::channel();
        let publish_task = tokio::spawn(publish(source, config, shared.clone(), stop_rx));
        tracing::info!(%endpoint, replay = ?replay_endpoint, "publishing KV events over ZMQ");
        Ok(ZmqPublisher {
            endpoint,
            replay_endpoint,
            shared,
            stop: Some(stop),
            publish_task,
            listeners,
        })
    }

    /// The PUB socket's bound endpoint (`tcp://HOST:PORT`, the port resolved).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay ROUTER socket's bound endpoint, if replay is on.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// One more than the last sequence number sent (0 before the first batch): a test
    /// or a shutdown path can wait until a batch it caused went out.
    pub fn next_seq(&self) -> u64 {
        self.shared.counters.next_seq.load(Ordering::Acquire)
    }

    /// What the publisher did so far.
    pub fn report(&self) -> PublisherReport {
        self.shared.counters.report()
    }

    /// Sends every batch already in the stream, gives each subscriber up to
    /// [`ZmqLimits::send_timeout`] to take what is queued for it, then closes the
    /// sockets.
    pub async fn shutdown(mut self) -> PublisherReport {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.publish_task).await;
        self.shared.closing.send_replace(true);
        for l in std::mem::take(&mut self.listeners) {
            let _ = l.await;
        }
        self.shared.counters.report()
    }
}

impl Drop for ZmqPublisher {
    fn drop(&mut self) {
        self.publish_task.abort();
        self.shared.closing.send_replace(true);
        for l in &self.listeners {
            l.abort();
        }
    }
}

async fn publish(
    mut source: impl EventSource,
    config: ZmqPublisherConfig,
    shared: Arc<Shared>,
    mut stop: oneshot::Receiver<()>,
) {
    let topic = config.topic.as_bytes();
    loop {
        let item = tokio::select! {
            biased;
            item = source.recv() => item,
            _ = &mut stop => {
                // Drain what the stream already has, then stop.
                while let Some(item) = source.try_recv() {
                    handle(item, topic, &config, &shared);
                }
                break;
            }
        };
        match item {
            Some(item) => handle(item, topic, &config, &shared),
            None => break,
        }
    }
}

/// One stream item: a batch is encoded once, kept for replay and queued for every
/// subscriber whose subscriptions match the topic.
fn handle(item: StreamItem, topic: &[u8], config: &ZmqPublisherConfig, shared: &Shared) {
    let c = &shared.counters;
    match item {
        StreamItem::Batch(batch) => {
            let payload = Bytes::from(encode_batch(
                &batch,
                config.encoding,
                config.data_parallel_rank,
            ));
            let msg = zmtp::encode_message(&[topic, &batch.seq.to_be_bytes(), &payload]);
            if config.replay_endpoint.is_some() {
                let mut b = lock(&shared.buffer);
                b.push_back((batch.seq, payload));
                while b.len() > config.replay_buffer {
                    b.pop_front();
                }
            }
            let cap = shared.limits.subscriber_queue_bytes;
            for s in lock(&shared.subscribers).iter() {
                if s.wants(topic) && !s.offer(&msg, cap) {
                    c.dropped_messages.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("dsa_kv_zmq_messages_dropped_total").increment(1);
                }
            }
            c.batches.fetch_add(1, Ordering::Relaxed);
            c.events
                .fetch_add(batch.events.len() as u64, Ordering::Relaxed);
            c.next_seq.store(batch.seq + 1, Ordering::Release);
            metrics::counter!("dsa_kv_zmq_batches_published_total").increment(1);
        }
        StreamItem::Lost { first, count } => {
            c.lost_batches.fetch_add(count, Ordering::Relaxed);
            metrics::counter!("dsa_kv_zmq_batches_lost_total").increment(count);
            tracing::error!(
                first,
                count,
                "the ZMQ publisher fell behind the event stream: batches lost (raise event_stream_capacity)"
            );
        }
    }
}

/// Accepts connections on one socket, each served by its own task, at most the
/// socket's maximum at once and its maximum per peer address; on close, waits for them
/// (subscribers flush their queues within `send_timeout`).
async fn accept(listener: TcpListener, ty: SocketType, shared: Arc<Shared>) {
    let l = &shared.limits;
    let slots = match ty {
        SocketType::Pub => Slots::new(l.max_subscribers, l.max_subscribers_per_peer),
        SocketType::Router => Slots::new(l.max_replay_clients, l.max_replay_clients_per_peer),
    };
    let mut tasks = JoinSet::new();
    let mut closing = shared.closing.subscribe();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = closing.wait_for(|c| *c) => break,
        };
        // Reap finished connection tasks so the set stays as small as the connections.
        while tasks.try_join_next().is_some() {}
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: wait, then accept again.
                tracing::warn!(error = %e, "ZMQ publisher: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let slot = match slots.take(peer.ip()) {
            Ok(slot) => slot,
            Err(no) => {
                let c = &shared.counters;
                let (counter, limit, what) = match no {
                    NoSlot::Full => (&c.refused_connections, slots.max, "in all"),
                    NoSlot::PeerFull => (&c.refused_per_peer, slots.per_peer, "from its address"),
                };
                counter.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%peer, socket = ?ty, limit, "ZMQ publisher: the socket holds its maximum of connections {what}; closing the new one");
                drop(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        tasks.spawn(async move {
            let _slot = slot;
            match ty {
                SocketType::Pub => serve_subscriber(stream, peer, &shared).await,
                SocketType::Router => serve_replay(stream, peer, &shared).await,
            }
        });
    }
    drop(listener);
    // Subscribers flush what is queued; replay answers in progress end at their
    // deadline. Past the longest of them every task is stopped.
    let grace = shared
        .limits
        .send_timeout
        .max(shared.limits.replay_deadline);
    if tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} })
        .await
        .is_err()
    {
        tasks.shutdown().await;
    }
}

async fn handshake(
    stream: &mut TcpStream,
    ty: SocketType,
    peer: SocketAddr,
    shared: &Shared,
) -> bool {
    let socket = if ty == SocketType::Pub {
        "PUB"
    } else {
        "ROUTER"
    };
    let l = &shared.limits;
    match tokio::time::timeout(
        l.handshake_timeout,
        zmtp::handshake(stream, ty, l.max_inbound_frame),
    )
    .await
    {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            shared.drop_peer(socket, peer, &format!("handshake: {e}"));
            false
        }
        Err(_) => {
            shared.drop_peer(
                socket,
                peer,
                &format!("no handshake within {:?}", l.handshake_timeout),
            );
            false
        }
    }
}

/// One subscriber: its reader (this task) takes subscriptions; its writer (a task of
/// its own) writes what the fan-out queued.
async fn serve_subscriber(mut stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>) {
    if !handshake(&mut stream, SocketType::Pub, peer, shared).await {
        return;
    }
    let (mut rd, wr) = stream.into_split();
    let sub = Arc::new(Subscriber::new());
    lock(&shared.subscribers).push(sub.clone());
    let writer = tokio::spawn(write_queued(wr, sub.clone(), shared.clone(), peer));
    let mut closing = shared.closing.subscribe();
    let why = tokio::select! {
        why = read_subscriptions(&mut rd, &sub, &shared.limits, &shared.topic) => Some(why),
        _ = closing.wait_for(|c| *c) => None,
        // The writer ended first (the socket broke or accepted nothing in time).
        _ = wait_gone(&sub) => None,
    };
    lock(&shared.subscribers).retain(|s| !Arc::ptr_eq(s, &sub));
    match why {
        // The peer closed its connection: not its fault.
        Some(ReaderEnd::Zmtp(ZmtpError::Io(e)))
            if e.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            sub.end();
        }
        Some(e) => {
            shared.drop_peer("PUB", peer, &e);
            sub.end();
        }
        // Closing: the writer flushes the queue first, then ends.
        None => sub.wake.notify_one(),
    }
    let _ = writer.await;
}

async fn wait_gone(sub: &Subscriber) {
    while !sub.gone.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Why a subscriber's reader ended.
#[derive(Debug, Error)]
enum ReaderEnd {
    /// The connection failed, or the peer broke the protocol or a limit.
    #[error(transparent)]
    Zmtp(#[from] ZmtpError),
    /// No subscription matched the topic for this long.
    #[error("no subscription to the publisher's topic for {0:?}: it would receive nothing")]
    Unsubscribed(Duration),
}

/// Reads subscriptions until the connection fails, breaks a limit, or holds no
/// subscription that matches `topic` for `subscribe_timeout` (the reason).
async fn read_subscriptions(
    rd: &mut tokio::net::tcp::OwnedReadHalf,
    sub: &Subscriber,
    limits: &ZmqLimits,
    topic: &[u8],
) -> ReaderEnd {
    // While the subscriber wants nothing we send: when it is closed unless it asks.
    let mut unsubscribed_until = Some(tokio::time::Instant::now() + limits.subscribe_timeout);
    loop {
        let next = zmtp::read_incoming(rd, limits.max_inbound_frame, 1);
        let read = match unsubscribed_until {
            None => next.await,
            // Cut mid-frame or not, the connection is closed.
            Some(t) => match tokio::time::timeout_at(t, next).await {
                Ok(read) => read,
                Err(_) => return ReaderEnd::Unsubscribed(limits.subscribe_timeout),
            },
        };
        let change = match read {
            Err(e) => return e.into(),
            // ZMTP 3.0: a message whose first byte is 1 (subscribe) or 0 (cancel).
            Ok(Incoming::Message(parts)) => match parts[0].first() {
                Some(1) => Some((true, parts[0].slice(1..))),
                Some(0) => Some((false, parts[0].slice(1..))),
                // Other messages (an XSUB's own) mean nothing to a PUB socket.
                _ => None,
            },
            // ZMTP 3.1 commands.
            Ok(Incoming::Command { name, data }) => match name.as_ref() {
                b"SUBSCRIBE" => Some((true, data)),
                b"CANCEL" => Some((false, data)),
                _ => None,
            },
        };
        let Some((add, prefix)) = change else {
            continue;
        };
        let mut subs = lock(&sub.subscriptions);
        if add {
            if subs.len() >= limits.max_subscriptions {
                return ZmtpError::TooLarge {
                    what: "subscription list (entries)",
                    len: subs.len() as u64 + 1,
                    limit: limits.max_subscriptions as u64,
                }
                .into();
            }
            subs.push(prefix);
        } else if let Some(i) = subs.iter().position(|s| *s == prefix) {
            subs.swap_remove(i);
        }
        let wanted = subs.iter().any(|s| topic.starts_with(s));
        drop(subs);
        unsubscribed_until = match (wanted, unsubscribed_until) {
            (true, _) => None,
            (false, Some(t)) => Some(t),
            (false, None) => Some(tokio::time::Instant::now() + limits.subscribe_timeout),
        };
    }
}

/// Writes what is queued for `sub` until it is gone (or, when the publisher closes,
/// until its queue is empty). A write that makes no progress for `send_timeout` ends
/// the connection.
async fn write_queued(
    wr: tokio::net::tcp::OwnedWriteHalf,
    sub: Arc<Subscriber>,
    shared: Arc<Shared>,
    peer: SocketAddr,
) {
    let mut wr = BufWriter::with_capacity(64 << 10, wr);
    let timeout = shared.limits.send_timeout;
    loop {
        let next = {
            let mut q = lock(&sub.queue);
            let m = q.messages.pop_front();
            if let Some(m) = &m {
                q.bytes -= m.len() as u64;
            }
            m
        };
        let result = match next {
            Some(m) => tokio::time::timeout(timeout, wr.write_all(&m)).await,
            None => {
                let ended = sub.gone.load(Ordering::Relaxed) || *shared.closing.borrow();
                let flushed = tokio::time::timeout(timeout, wr.flush()).await;
                if ended {
                    break;
                }
                match flushed {
                    Ok(Ok(())) => {
                        sub.wake.notified().await;
                        continue;
                    }
                    other => other,
                }
            }
        };
        match result {
            Ok(Ok(())) => {}
            Ok(Err(_)) => break,
            Err(_) => {
                shared.drop_peer(
                    "PUB",
                    peer,
                    &format!("its socket accepted nothing for {timeout:?}"),
                );
                break;
            }
        }
    }
    sub.end();
}

/// The sequence number a replay request asks for: `["", seq]` from REQ or a DEALER
/// that sends the delimiter, `[seq]` from a bare DEALER.
fn replay_start(frames: &[Bytes]) -> Option<u64> {
    let seq = match frames {
        [empty, seq] if empty.is_empty() => seq,
        [seq] => seq,
        _ => return None,
    };
    let bytes: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

/// One replay client: one request answered at a time, each answer within its deadline.
async fn serve_replay(mut stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    if !handshake(&mut stream, SocketType::Router, peer, shared).await {
        return;
    }
    let l = &shared.limits;
    let mut closing = shared.closing.subscribe();
    loop {
        let read = tokio::select! {
            r = tokio::time::timeout(
                l.replay_idle_timeout,
                zmtp::read_incoming(&mut stream, l.max_inbound_frame, 2),
            ) => r,
            _ = closing.wait_for(|c| *c) => return,
        };
        let frames = match read {
            Err(_) => {
                shared.drop_peer(
                    "ROUTER",
                    peer,
                    &format!("no request for {:?}", l.replay_idle_timeout),
                );
                return;
            }
            Ok(Err(ZmtpError::Io(e))) if e.kind() == std::io::ErrorKind::UnexpectedEof => return,
            Ok(Err(e)) => {
                shared.drop_peer("ROUTER", peer, &e);
                return;
            }
            Ok(Ok(Incoming::Command { .. })) => continue,
            Ok(Ok(Incoming::Message(frames))) => frames,
        };
        let start = replay_start(&frames);
        if start.is_none() {
            tracing::warn!(
                %peer,
                frames = frames.len(),
                "malformed replay request (want one 8-byte big-endian sequence number); answering with the end marker"
            );
        }
        shared
            .counters
            .replay_requests
            .fetch_add(1, Ordering::Relaxed);
        let batches = match start {
            Some(start) => {
                let b = lock(&shared.buffer);
                let first = b.partition_point(|(s, _)| *s < start);
                let n = (b.len() - first).min(l.replay_max_batches);
                if b.len() - first > n {
                    shared
                        .counters
                        .replay_truncated
                        .fetch_add(1, Ordering::Relaxed);
                }
                b.range(first..first + n).cloned().collect()
            }
            None => Vec::new(),
        };
        match tokio::time::timeout(l.replay_deadline, answer(&mut stream, &batches)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return,
            Err(_) => {
                shared.drop_peer(
                    "ROUTER",
                    peer,
                    &format!(
                        "a replay answer of {} batches was not taken within {:?}",
                        batches.len(),
                        l.replay_deadline
                    ),
                );
                return;
            }
        }
    }
}

/// Writes one replay answer: `["", seq, payload]` per batch, then the end marker. The
/// payloads are written from the buffer's bytes, not copied.
async fn answer(stream: &mut TcpStream, batches: &[(u64, Bytes)]) -> std::io::Result<()> {
    let mut w = BufWriter::with_capacity(64 << 10, stream);
    for (seq, payload) in batches {
        let mut head = bytes::BytesMut::with_capacity(32);
        zmtp::put_frame(&mut head, zmtp::FLAG_MORE, b"");
        zmtp::put_frame(&mut head, zmtp::FLAG_MORE, &seq.to_be_bytes());
        zmtp::put_frame_header(&mut head, 0, payload.len());
        w.write_all(&head).await?;
        w.write_all(payload).await?;
    }
    w.write_all(&zmtp::encode_message(&[b"", &END_OF_REPLAY, b""]))
        .await?;
    w.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_requests_parse() {
        let seq = Bytes::copy_from_slice(&42u64.to_be_bytes());
        assert_eq!(replay_start(&[Bytes::new(), seq.clone()]), Some(42));
        assert_eq!(replay_start(std::slice::from_ref(&seq)), Some(42));
        assert_eq!(replay_start(&[Bytes::from_static(b"42")]), None);
        assert_eq!(replay_start(&[Bytes::from_static(b"x"), seq]), None);
        assert_eq!(replay_start(&[]), None);
        assert_eq!(END_OF_REPLAY, [0xff; 8]);
    }

    #[test]
    fn slots_hold_a_share_per_peer_and_come_back_when_dropped() {
        let s = Slots::new(3, 2);
        let (a, b) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        let a_mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let a1 = s.take(a).unwrap();
        // The IPv4-mapped form of `a` is `a`.
        let a2 = s.take(a_mapped).unwrap();
        assert_eq!(s.take(a).err(), Some(NoSlot::PeerFull));
        assert_eq!(s.held(a), (2, 2));
        let b1 = s.take(b).unwrap();
        assert_eq!(
            s.take(IpAddr::from([10, 0, 0, 3])).err(),
            Some(NoSlot::Full)
        );
        assert_eq!(s.take(a).err(), Some(NoSlot::Full));
        drop(a1);
        assert_eq!(s.held(a), (2, 1));
        let a3 = s.take(a).unwrap();
        assert_eq!(s.held(a), (3, 2));
        s.check_invariants();
        drop((a2, a3, b1));
        assert_eq!(s.held(a), (0, 0));
        s.check_invariants();
        assert!(lock(&s.held).by_peer.is_empty());
    }

    #[test]
    fn endpoints_parse() {
        let p = |e: &str| parse_endpoint(e).map(|a| a.to_string());
        assert_eq!(p("tcp://127.0.0.1:5557").unwrap(), "127.0.0.1:5557");
        assert_eq!(p("tcp://*:0").unwrap(), "0.0.0.0:0");
        assert_eq!(p("tcp://localhost:1").unwrap(), "127.0.0.1:1");
        assert_eq!(p("tcp://[::1]:9").unwrap(), "[::1]:9");
        for bad in [
            "ipc:///tmp/x",
            "tcp://127.0.0.1",
            "tcp://host:1",
            "tcp://1.2.3.4:x",
        ] {
            assert!(p(bad).is_err(), "{bad}");
        }
    }
}
