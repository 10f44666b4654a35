//! The ZMQ publisher: a PUB socket sending every batch of the router event stream as
//! three frames `[topic, sequence (u64 big-endian), payload]`, and a ROUTER socket
//! answering replay requests from its buffer of recent batches.
//!
//! Replay protocol (vLLM's): a client (REQ, or DEALER sending an empty delimiter
//! first) sends one frame, the first sequence number it wants (8 bytes, big-endian); the
//! publisher answers with one message `[sequence, payload]` per buffered batch from
//! that number on, in order, then the end marker `[-1 as 8 bytes, empty]`. A request
//! for batches older than the buffer gets what the buffer still has (the first
//! sequence number then tells the client what is gone).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use thiserror::Error;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::wire::{encode_batch, WireEncoding};
use crate::actors::{EventSubscriber, StreamItem};

/// The replay end marker: −1 as a signed 64-bit big-endian integer.
pub const END_OF_REPLAY: [u8; 8] = (-1i64).to_be_bytes();

/// Where and how the publisher sends.
#[derive(Clone, Debug)]
pub struct ZmqPublisherConfig {
    /// The PUB socket's endpoint, bound by the publisher (`tcp://HOST:PORT`; port 0
    /// picks a free port, see [`ZmqPublisher::endpoint`]).
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
}

impl Default for ZmqPublisherConfig {
    /// vLLM's defaults: PUB on `tcp://127.0.0.1:5557`, replay on `tcp://127.0.0.1:5558`,
    /// empty topic, array events, no rank, 10,000 batches for replay.
    fn default() -> Self {
        ZmqPublisherConfig {
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: Some("tcp://127.0.0.1:5558".into()),
            topic: String::new(),
            encoding: WireEncoding::Array,
            data_parallel_rank: None,
            replay_buffer: 10_000,
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
        /// What ZMQ said.
        source: zeromq::ZmqError,
    },
    /// The configuration cannot work.
    #[error("invalid publisher configuration: {0}")]
    Config(String),
}

/// What the publisher did, so far or in all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublisherReport {
    /// Batches sent on the PUB socket.
    pub batches: u64,
    /// Events in those batches.
    pub events: u64,
    /// Batches the publisher's own subscription lost (it fell behind the stream):
    /// subscribers see a gap in the sequence numbers that replay cannot fill.
    pub lost_batches: u64,
    /// Replay requests answered.
    pub replay_requests: u64,
    /// Sends that failed (logged; the batch stays available for replay).
    pub send_errors: u64,
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    events: AtomicU64,
    lost_batches: AtomicU64,
    replay_requests: AtomicU64,
    send_errors: AtomicU64,
    /// One more than the last sequence number sent (0: none yet).
    next_seq: AtomicU64,
}

impl Counters {
    fn report(&self) -> PublisherReport {
        PublisherReport {
            batches: self.batches.load(Ordering::Relaxed),
            events: self.events.load(Ordering::Relaxed),
            lost_batches: self.lost_batches.load(Ordering::Relaxed),
            replay_requests: self.replay_requests.load(Ordering::Relaxed),
            send_errors: self.send_errors.load(Ordering::Relaxed),
        }
    }
}

type ReplayBuffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Publishes a runtime's router event stream over ZMQ: each batch on a PUB socket as
/// `[topic, sequence (u64 big-endian), payload]`; replay requests (one frame, the first
/// sequence number wanted, 8 bytes big-endian, from REQ or a DEALER sending an empty
/// delimiter first) answered on a ROUTER socket with `[sequence, payload]` per buffered
/// batch from that number on, then [`END_OF_REPLAY`] and an empty frame. Runs on the caller's tokio runtime until [`shutdown`](Self::shutdown) or until the
/// runtime's stream ends (the cache runtime shut down).
pub struct ZmqPublisher {
    endpoint: String,
    replay_endpoint: Option<String>,
    counters: Arc<Counters>,
    stop: Option<oneshot::Sender<()>>,
    publish_task: JoinHandle<()>,
    replay_task: Option<JoinHandle<()>>,
}

impl ZmqPublisher {
    /// Binds the sockets and starts publishing what `subscriber` receives (take it from
    /// [`KvCacheHandle::subscribe_events`](crate::actors::KvCacheHandle::subscribe_events)
    /// before the first request, so nothing is missed).
    pub async fn start(
        subscriber: EventSubscriber,
        config: ZmqPublisherConfig,
    ) -> Result<Self, PublishError> {
        if config.replay_endpoint.is_some() && config.replay_buffer == 0 {
            return Err(PublishError::Config(
                "replay_buffer is 0 with a replay endpoint: keep at least one batch, or set replay_endpoint to None".into(),
            ));
        }
        let mut pub_socket = PubSocket::new();
        let endpoint = pub_socket
            .bind(&config.endpoint)
            .await
            .map_err(|source| PublishError::Bind {
                socket: "PUB",
                endpoint: config.endpoint.clone(),
                source,
            })?
            .to_string();
        let buffer: ReplayBuffer = Arc::new(Mutex::new(VecDeque::new()));
        let counters = Arc::new(Counters::default());
        let (replay_endpoint, replay_task) = match &config.replay_endpoint {
            Some(ep) => {
                let mut router = RouterSocket::new();
                let bound = router
                    .bind(ep)
                    .await
                    .map_err(|source| PublishError::Bind {
                        socket: "ROUTER",
                        endpoint: ep.clone(),
                        source,
                    })?
                    .to_string();
                let task = tokio::spawn(serve_replay(router, buffer.clone(), counters.clone()));
                (Some(bound), Some(task))
            }
            None => (None, None),
        };
        let (stop, stop_rx) = oneshot::channel();
        let publish_task = tokio::spawn(publish(
            subscriber,
            pub_socket,
            config,
            buffer,
            counters.clone(),
            stop_rx,
        ));
        tracing::info!(%endpoint, replay = ?replay_endpoint, "publishing KV events over ZMQ");
        Ok(ZmqPublisher {
            endpoint,
            replay_endpoint,
            counters,
            stop: Some(stop),
            publish_task,
            replay_task,
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
        self.counters.next_seq.load(Ordering::Acquire)
    }

    /// What the publisher did so far.
    pub fn report(&self) -> PublisherReport {
        self.counters.report()
    }

    /// Sends every batch already in the stream, then closes the sockets.
    pub async fn shutdown(mut self) -> PublisherReport {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.publish_task).await;
        if let Some(t) = self.replay_task.take() {
            t.abort();
            let _ = t.await;
        }
        self.counters.report()
    }
}

impl Drop for ZmqPublisher {
    fn drop(&mut self) {
        self.publish_task.abort();
        if let Some(t) = &self.replay_task {
            t.abort();
        }
    }
}

async fn publish(
    mut sub: EventSubscriber,
    mut socket: PubSocket,
    config: ZmqPublisherConfig,
    buffer: ReplayBuffer,
    counters: Arc<Counters>,
    mut stop: oneshot::Receiver<()>,
) {
    let topic = Bytes::from(config.topic.clone().into_bytes());
    loop {
        let item = tokio::select! {
            biased;
            item = sub.recv() => item,
            _ = &mut stop => {
                // Drain what the stream already has, then stop.
                while let Some(item) = sub.try_recv() {
                    handle(item, &mut socket, &topic, &config, &buffer, &counters).await;
                }
                break;
            }
        };
        match item {
            Some(item) => handle(item, &mut socket, &topic, &config, &buffer, &counters).await,
            None => break,
        }
    }
}

async fn handle(
    item: StreamItem,
    socket: &mut PubSocket,
    topic: &Bytes,
    config: &ZmqPublisherConfig,
    buffer: &ReplayBuffer,
    counters: &Counters,
) {
    match item {
        StreamItem::Batch(batch) => {
            let payload = Bytes::from(encode_batch(
                &batch,
                config.encoding,
                config.data_parallel_rank,
            ));
            let seq = Bytes::copy_from_slice(&batch.seq.to_be_bytes());
            if config.replay_endpoint.is_some() {
                let mut b = buffer
                    .lock()
                    .expect("invariant: replay buffer lock not poisoned");
                b.push_back((batch.seq, payload.clone()));
                while b.len() > config.replay_buffer {
                    b.pop_front();
                }
            }
            let msg = ZmqMessage::try_from(vec![topic.clone(), seq, payload])
                .expect("invariant: three frames make a message");
            if let Err(e) = socket.send(msg).await {
                counters.send_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(seq = batch.seq, error = %e, "ZMQ publish failed");
            }
            counters.batches.fetch_add(1, Ordering::Relaxed);
            counters
                .events
                .fetch_add(batch.events.len() as u64, Ordering::Relaxed);
            counters.next_seq.store(batch.seq + 1, Ordering::Release);
            metrics::counter!("dsa_kv_zmq_batches_published_total").increment(1);
        }
        StreamItem::Lost { first, count } => {
            counters.lost_batches.fetch_add(count, Ordering::Relaxed);
            metrics::counter!("dsa_kv_zmq_batches_lost_total").increment(count);
            tracing::error!(
                first,
                count,
                "the ZMQ publisher fell behind the event stream: batches lost (raise event_stream_capacity)"
            );
        }
    }
}

/// The sequence number a replay request asks for: `[identity, "", seq]` from REQ or a
/// DEALER that sends the delimiter, `[identity, seq]` from a bare DEALER.
fn replay_start(frames: &[Bytes]) -> Option<u64> {
    let seq = match frames {
        [_id, empty, seq] if empty.is_empty() => seq,
        [_id, seq] => seq,
        _ => return None,
    };
    let bytes: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

async fn serve_replay(mut socket: RouterSocket, buffer: ReplayBuffer, counters: Arc<Counters>) {
    loop {
        let msg = match socket.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "replay socket closed");
                return;
            }
        };
        let frames = msg.into_vec();
        let id = frames[0].clone();
        let start = replay_start(&frames);
        if start.is_none() {
            tracing::warn!(
                frames = frames.len(),
                "malformed replay request (want one 8-byte big-endian sequence number); answering with the end marker"
            );
        }
        counters.replay_requests.fetch_add(1, Ordering::Relaxed);
        let batches: Vec<(u64, Bytes)> = match start {
            Some(start) => buffer
                .lock()
                .expect("invariant: replay buffer lock not poisoned")
                .iter()
                .filter(|(s, _)| *s >= start)
                .cloned()
                .collect(),
            None => Vec::new(),
        };
        let empty = Bytes::new();
        for (seq, payload) in batches {
            let m = ZmqMessage::try_from(vec![
                id.clone(),
                empty.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ])
            .expect("invariant: four frames make a message");
            if let Err(e) = socket.send(m).await {
                tracing::warn!(error = %e, "replay send failed (client gone?)");
                break;
            }
        }
        let end = ZmqMessage::try_from(vec![
            id,
            empty.clone(),
            Bytes::copy_from_slice(&END_OF_REPLAY),
            empty,
        ])
        .expect("invariant: four frames make a message");
        if let Err(e) = socket.send(end).await {
            tracing::warn!(error = %e, "replay end marker not sent (client gone?)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_requests_parse() {
        let id = Bytes::from_static(b"client");
        let seq = Bytes::copy_from_slice(&42u64.to_be_bytes());
        assert_eq!(
            replay_start(&[id.clone(), Bytes::new(), seq.clone()]),
            Some(42)
        );
        assert_eq!(replay_start(&[id.clone(), seq]), Some(42));
        assert_eq!(replay_start(&[id.clone(), Bytes::from_static(b"42")]), None);
        assert_eq!(replay_start(std::slice::from_ref(&id)), None);
        assert_eq!(END_OF_REPLAY, [0xff; 8]);
    }
}
