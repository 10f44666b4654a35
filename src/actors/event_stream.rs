//! The KV event stream for routers: every coordinator drain that produced
//! [`RouterEvent`]s (one per step or commit, reset, or event take) becomes one
//! [`EventBatch`] with the next sequence number (contiguous from 0), published on a
//! bounded broadcast channel that any number of [`EventSubscriber`]s read. A subscriber
//! that falls more than the capacity behind is told which batches it lost
//! ([`StreamItem::Lost`]), never a silent gap, and resynchronizes from a
//! [`RouterSnapshot`] that names the sequence number it is consistent with.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use dsa_kv_core::core::{RouterBlock, RouterEvent};

/// Default number of batches the stream keeps for slow subscribers (a power of two:
/// the channel rounds its capacity up to one).
pub const EVENT_STREAM_CAPACITY: usize = 1 << 13;

/// The router events of one coordinator drain.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventBatch {
    /// Position in the stream: 0 for the first batch, then +1 per batch, no gaps.
    pub seq: u64,
    /// When the batch was published, seconds since the Unix epoch (vLLM's `ts`).
    pub timestamp: f64,
    /// The events, in the order the cache made them.
    pub events: Vec<RouterEvent>,
}

/// What a subscriber receives.
#[derive(Clone, Debug, PartialEq)]
pub enum StreamItem {
    /// The next batch (its `seq` is one more than the previous item's last sequence).
    Batch(Arc<EventBatch>),
    /// The subscriber fell behind by more than the stream's capacity: the batches
    /// `first..first + count` are gone. Its view is stale: resynchronize from
    /// [`Events::router_snapshot`](super::Events::router_snapshot) and
    /// [`EventSubscriber::resync`].
    Lost {
        /// The first lost sequence number.
        first: u64,
        /// How many consecutive batches were lost.
        count: u64,
    },
}

/// The full blocks of the target cache as a router sees them, consistent with the
/// stream: exactly the state after applying every batch with `seq < next_seq`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, kameo::Reply)]
pub struct RouterSnapshot {
    /// The sequence number of the first batch *not* included.
    pub next_seq: u64,
    /// Every full block with its medium, sorted.
    pub blocks: Vec<RouterBlock>,
}

/// One consumer of the stream (from
/// [`Events::subscribe`](super::Events::subscribe)).
/// Dropping it unsubscribes.
#[derive(Debug, kameo::Reply)]
pub struct EventSubscriber {
    rx: broadcast::Receiver<Arc<EventBatch>>,
    /// The sequence number the channel hands out next.
    next: u64,
    /// Batches below this are covered by a snapshot and skipped.
    skip_below: u64,
}

impl EventSubscriber {
    pub(super) fn new(rx: broadcast::Receiver<Arc<EventBatch>>, next: u64) -> Self {
        EventSubscriber {
            rx,
            next,
            skip_below: next,
        }
    }

    /// The sequence number of the next batch this subscriber expects.
    pub fn next_seq(&self) -> u64 {
        self.next.max(self.skip_below)
    }

    /// Skips every batch the snapshot already includes: after replacing its view with
    /// `snapshot.blocks`, a consumer applies the batches from `snapshot.next_seq` on.
    pub fn resync(&mut self, snapshot: &RouterSnapshot) {
        self.skip_below = self.skip_below.max(snapshot.next_seq);
    }

    /// The next item; `None` once the runtime has stopped and every batch was read.
    pub async fn recv(&mut self) -> Option<StreamItem> {
        loop {
            let r = self.rx.recv().await;
            if let Some(item) = self.accept(r.map_err(|e| match e {
                broadcast::error::RecvError::Closed => broadcast::error::TryRecvError::Closed,
                broadcast::error::RecvError::Lagged(n) => broadcast::error::TryRecvError::Lagged(n),
            })) {
                return item;
            }
        }
    }

    /// The next item if one is ready; `None` when none is (or the runtime stopped).
    pub fn try_recv(&mut self) -> Option<StreamItem> {
        loop {
            let r = self.rx.try_recv();
            if let Some(item) = self.accept(r) {
                return item;
            }
        }
    }

    /// `Some(answer)` for the caller, `None` to read on (a batch the snapshot covers).
    fn accept(
        &mut self,
        r: Result<Arc<EventBatch>, broadcast::error::TryRecvError>,
    ) -> Option<Option<StreamItem>> {
        use broadcast::error::TryRecvError;
        match r {
            Ok(batch) => {
                debug_assert_eq!(batch.seq, self.next, "the channel keeps order");
                self.next = batch.seq + 1;
                (batch.seq >= self.skip_below).then_some(Some(StreamItem::Batch(batch)))
            }
            Err(TryRecvError::Lagged(n)) => {
                let (first, end) = (self.next, self.next + n);
                self.next = end;
                let first = first.max(self.skip_below);
                (first < end).then_some(Some(StreamItem::Lost {
                    first,
                    count: end - first,
                }))
            }
            Err(TryRecvError::Empty | TryRecvError::Closed) => Some(None),
        }
    }
}

/// The publishing side, owned by the coordinator.
pub(super) struct EventStream {
    tx: broadcast::Sender<Arc<EventBatch>>,
    next_seq: u64,
}

impl EventStream {
    pub(super) fn new(capacity: usize) -> Self {
        EventStream {
            tx: broadcast::Sender::new(capacity.max(1)),
            next_seq: 0,
        }
    }

    /// The sequence number the next batch gets.
    pub(super) fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Publishes `events` as the next batch (none when empty). A batch nobody is
    /// subscribed to is still numbered, so sequence numbers count drains, not readers.
    pub(super) fn publish(&mut self, events: Vec<RouterEvent>) {
        if events.is_empty() {
            return;
        }
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let batch = EventBatch {
            seq: self.next_seq,
            timestamp,
            events,
        };
        self.next_seq += 1;
        // An error means no subscriber: nothing to deliver.
        let _ = self.tx.send(Arc::new(batch));
    }

    /// A subscriber that receives every batch from the next one on.
    pub(super) fn subscribe(&self) -> EventSubscriber {
        EventSubscriber::new(self.tx.subscribe(), self.next_seq)
    }
}
