//! A KV-aware router that nobody here wrote: NVIDIA Dynamo's (`dynamo-kv-router`). It
//! subscribes to each runtime's ZMQ publisher, decodes the bytes with Dynamo's own wire
//! decoder and normalizer, applies the events to Dynamo's device radix tree and its
//! lower-tier (host) indexer, and scores requests the way Dynamo's router does: its own
//! block hashes of the request's tokens, the device prefix, then the host tiers
//! continuing it. Shared by `tests/router_events.rs` and `examples/route/main.rs`.

#![allow(dead_code)] // Each user takes what it needs.

use std::time::Duration;

use bytes::Bytes;
use dynamo_kv_router::indexer::{
    query_lower_tiers_with_options, LowerTierIndexers, LowerTierQueryOptions,
};
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, BlockHashOptions, KvCacheEventData, WorkerWithDpRank,
};
use dynamo_kv_router::zmq_wire::{decode_event_batch, RawKvEvent, ZmqEventNormalizer};
use dynamo_kv_router::RadixTree;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// How long the subscriber waits for the next message before asking for a replay.
const QUIET: Duration = Duration::from_millis(300);

/// One engine as the router follows it.
struct Feed {
    worker: WorkerWithDpRank,
    topic: Vec<u8>,
    sub: SubSocket,
    replay: DealerSocket,
    normalizer: ZmqEventNormalizer,
    /// The next sequence number to apply.
    next_seq: u64,
    /// Dynamo's per-worker event id (one per event).
    event_id: u64,
    /// Batches applied from the PUB socket and from replay answers.
    via_pub: u64,
    via_replay: u64,
    /// Decoded payloads by sequence number (for tests comparing the two paths).
    payloads: Vec<(u64, Bytes)>,
}

/// What the router counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FeedStats {
    /// Batches applied from the PUB socket.
    pub via_pub: u64,
    /// Batches applied from replay answers.
    pub via_replay: u64,
    /// Events applied.
    pub events: u64,
}

/// Changes (or, returning `false`, drops) a decoded event before Dynamo applies it: a
/// doctored router for mutation tests.
pub(crate) type Doctor = fn(&mut RawKvEvent) -> bool;

/// Dynamo's indexers fed by several engines' streams.
pub(crate) struct DynamoRouter {
    block_size: u32,
    doctor: Option<Doctor>,
    tree: RadixTree,
    lower: LowerTierIndexers,
    feeds: Vec<Feed>,
}

fn frames(m: ZmqMessage) -> Vec<Bytes> {
    m.into_vec()
}

fn seq_of(frame: &Bytes) -> Result<u64, String> {
    let b: [u8; 8] = frame
        .as_ref()
        .try_into()
        .map_err(|_| format!("sequence frame of {} bytes, want 8", frame.len()))?;
    Ok(u64::from_be_bytes(b))
}

impl DynamoRouter {
    /// A router for engines of `block_size` tokens per block.
    pub(crate) fn new(block_size: u32) -> Self {
        DynamoRouter {
            block_size,
            doctor: None,
            tree: RadixTree::new(),
            lower: LowerTierIndexers::new(1, block_size),
            feeds: Vec::new(),
        }
    }

    /// A router that applies `doctor` to every decoded event (mutation tests).
    #[allow(dead_code)]
    pub(crate) fn doctored(block_size: u32, doctor: Doctor) -> Self {
        DynamoRouter {
            doctor: Some(doctor),
            ..Self::new(block_size)
        }
    }

    /// Follows one more engine (worker id = its index): SUB on `endpoint` for `topic`,
    /// DEALER on `replay_endpoint`.
    pub(crate) async fn follow(
        &mut self,
        endpoint: &str,
        replay_endpoint: &str,
        topic: &str,
    ) -> Result<usize, String> {
        let mut sub = SubSocket::new();
        sub.connect(endpoint)
            .await
            .map_err(|e| format!("SUB connect {endpoint}: {e}"))?;
        sub.subscribe(topic)
            .await
            .map_err(|e| format!("subscribe: {e}"))?;
        let mut replay = DealerSocket::new();
        replay
            .connect(replay_endpoint)
            .await
            .map_err(|e| format!("DEALER connect {replay_endpoint}: {e}"))?;
        let w = self.feeds.len();
        self.feeds.push(Feed {
            worker: WorkerWithDpRank::new(w as u64, 0),
            topic: topic.as_bytes().to_vec(),
            sub,
            replay,
            normalizer: ZmqEventNormalizer::new(self.block_size),
            next_seq: 0,
            event_id: 0,
            via_pub: 0,
            via_replay: 0,
            payloads: Vec::new(),
        });
        Ok(w)
    }

    /// The counts of engine `w`.
    pub(crate) fn stats(&self, w: usize) -> FeedStats {
        let f = &self.feeds[w];
        FeedStats {
            via_pub: f.via_pub,
            via_replay: f.via_replay,
            events: f.event_id,
        }
    }

    /// The payloads applied for engine `w`, by sequence number.
    pub(crate) fn payloads(&self, w: usize) -> &[(u64, Bytes)] {
        &self.feeds[w].payloads
    }

    /// Reads engine `w`'s stream until every batch before `target` is applied: from the
    /// PUB socket, and from the replay socket when a gap shows (a batch sent before the
    /// subscription took hold) or the socket stays quiet.
    pub(crate) async fn catch_up(&mut self, w: usize, target: u64) -> Result<(), String> {
        let mut quiet_rounds = 0;
        while self.feeds[w].next_seq < target {
            let msg = tokio::time::timeout(QUIET, self.feeds[w].sub.recv()).await;
            match msg {
                Ok(Ok(m)) => {
                    let f = frames(m);
                    let [topic, seq, payload] = f.as_slice() else {
                        return Err(format!("PUB message of {} frames, want 3", f.len()));
                    };
                    if topic.as_ref() != self.feeds[w].topic.as_slice() {
                        return Err(format!("topic {topic:?}"));
                    }
                    let seq = seq_of(seq)?;
                    if seq > self.feeds[w].next_seq {
                        self.replay(w).await?;
                    }
                    if seq == self.feeds[w].next_seq {
                        self.apply(w, seq, payload.clone()).await?;
                        self.feeds[w].via_pub += 1;
                    }
                }
                Ok(Err(e)) => return Err(format!("SUB recv: {e}")),
                Err(_) => {
                    quiet_rounds += 1;
                    if quiet_rounds > 20 {
                        return Err(format!(
                            "engine {w}: stuck at batch {} of {target}",
                            self.feeds[w].next_seq
                        ));
                    }
                    self.replay(w).await?;
                }
            }
        }
        Ok(())
    }

    /// Asks engine `w`'s replay socket for every batch from the next expected one and
    /// applies them, up to the end marker.
    async fn replay(&mut self, w: usize) -> Result<(), String> {
        let from = self.feeds[w].next_seq;
        let req = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .map_err(|e| e.to_string())?;
        self.feeds[w]
            .replay
            .send(req)
            .await
            .map_err(|e| format!("replay request: {e}"))?;
        loop {
            let m = tokio::time::timeout(Duration::from_secs(10), self.feeds[w].replay.recv())
                .await
                .map_err(|_| "no replay answer in 10 s".to_string())?
                .map_err(|e| format!("replay recv: {e}"))?;
            let f = frames(m);
            let [empty, seq, payload] = f.as_slice() else {
                return Err(format!("replay answer of {} frames, want 3", f.len()));
            };
            if !empty.is_empty() {
                return Err("replay answer without the empty delimiter".into());
            }
            if seq.as_ref() == [0xff; 8] {
                if !payload.is_empty() {
                    return Err("end marker with a payload".into());
                }
                return Ok(());
            }
            let seq = seq_of(seq)?;
            if seq > self.feeds[w].next_seq {
                return Err(format!(
                    "replay skipped from {} to {seq}: batches lost",
                    self.feeds[w].next_seq
                ));
            }
            if seq == self.feeds[w].next_seq {
                self.apply(w, seq, payload.clone()).await?;
                self.feeds[w].via_replay += 1;
            }
        }
    }

    /// Decodes one payload with Dynamo's decoder and applies each event to Dynamo's
    /// indexers the way its indexer service routes them (device tier to the radix tree,
    /// host tiers to the lower-tier indexer, a clear to all of them).
    async fn apply(&mut self, w: usize, seq: u64, payload: Bytes) -> Result<(), String> {
        let batch = decode_event_batch(&payload)
            .map_err(|e| format!("engine {w} batch {seq}: Dynamo cannot decode it: {e}"))?;
        if batch.ts < 1.0e9 {
            return Err(format!(
                "batch {seq}: timestamp {} is not Unix time",
                batch.ts
            ));
        }
        let feed = &mut self.feeds[w];
        for mut raw in batch.events {
            if let Some(doctor) = self.doctor {
                if !doctor(&mut raw) {
                    continue;
                }
            }
            let id = feed.event_id;
            feed.event_id += 1;
            let Some(placed) = feed.normalizer.normalize(raw, id, feed.worker) else {
                return Err(format!(
                    "engine {w} batch {seq}: Dynamo filtered event {id} out"
                ));
            };
            let Some(event) = placed.into_router_event() else {
                return Err(format!(
                    "engine {w} batch {seq}: event {id} is not a worker's"
                ));
            };
            if matches!(event.event.data, KvCacheEventData::Cleared) {
                self.tree
                    .apply_event(event.clone())
                    .map_err(|e| format!("clear: {e:?}"))?;
                for lower in self.lower.all() {
                    lower
                        .apply_event_and_wait(event.clone())
                        .await
                        .map_err(|e| format!("clear lower tier: {e:?}"))?;
                }
            } else if event.storage_tier.is_gpu() {
                self.tree.apply_event(event).map_err(|e| {
                    format!(
                        "engine {w} batch {seq} event {id}: Dynamo's device tree refused it: {e:?}"
                    )
                })?;
            } else {
                self.lower
                    .get_or_create(event.storage_tier)
                    .apply_event_and_wait(event)
                    .await
                    .map_err(|e| {
                        format!("engine {w} batch {seq} event {id}: Dynamo's host index refused it: {e:?}")
                    })?;
            }
        }
        feed.next_seq = seq + 1;
        feed.payloads.push((seq, payload));
        Ok(())
    }

    /// Dynamo's overlap score of `tokens` for every engine, in whole blocks: the blocks
    /// of its own hash of the tokens matched on the device tree, plus those the host
    /// tiers continue. `lora_name` salts the hashes as the engine's events name the
    /// adapter.
    pub(crate) fn scores(&self, tokens: &[u32], lora_name: Option<&str>) -> Vec<u32> {
        self.scores_by_tier(tokens, lora_name)
            .into_iter()
            .map(|(d, h)| d + h)
            .collect()
    }

    /// [`scores`](Self::scores) split: (device blocks, host-tier blocks continuing them).
    pub(crate) fn scores_by_tier(
        &self,
        tokens: &[u32],
        lora_name: Option<&str>,
    ) -> Vec<(u32, u32)> {
        let options = BlockHashOptions {
            lora_name,
            ..Default::default()
        };
        let seq = compute_block_hash_for_seq(tokens, self.block_size, options);
        let device = self.tree.find_match_details(seq.clone(), false);
        let lower = query_lower_tiers_with_options(
            &self.lower,
            &seq,
            &device,
            LowerTierQueryOptions::default(),
        );
        self.feeds
            .iter()
            .map(|f| {
                let d = device
                    .overlap_scores
                    .scores
                    .get(&f.worker)
                    .copied()
                    .unwrap_or(0);
                let h: usize = lower
                    .values()
                    .map(|t| t.hits.get(&f.worker).copied().unwrap_or(0))
                    .sum();
                (d, h as u32)
            })
            .collect()
    }
}
