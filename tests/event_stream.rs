//! The router event stream through the public handle: subscribers see identical,
//! gap-free batch sequences; replaying every batch gives exactly the cache's full blocks
//! (through reuse, preemption, offload and onboard, eviction and a prefix-cache reset);
//! a subscriber that falls behind the stream's capacity is told which batches it lost
//! and resynchronizes from a snapshot; a late subscriber starts from one.
mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::engine::run_to_end;
use dsa_kv::actors::{EventBatch, EventSubscriber, KvCacheBuilder, StreamItem};
use dsa_kv::config::EngineConfig;
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::core::{Medium, ReuseScope, RouterBlock, RouterEvent, RouterView};
use dsa_kv::ids::{RequestId, TokenId};

fn config(max_tokens: u64, host: bool) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(3);
    c.kv_cache.max_tokens = Some(max_tokens);
    if host {
        c.kv_cache.host_cache_size = Some(2048 * 3 * 708 + (8 << 20));
    }
    c.scheduler.max_num_sequences = 16;
    c.scheduler.max_num_tokens = 512;
    c.scheduler.max_prefill_chunk = 256;
    c.scheduler.max_seq_len = 2048;
    c
}

/// Requests sharing a 150-token system prompt, then their own tokens.
fn request(id: u64, len: usize) -> SubmitRequest {
    SubmitRequest {
        id: RequestId(id),
        scope: ReuseScope::SHARED,
        prompt: (0..len)
            .map(|i| {
                TokenId(if i < 150 {
                    i as u32
                } else {
                    (id * 1000 + i as u64) as u32 % 30_000
                })
            })
            .collect(),
        max_new_tokens: 3 + (id as u32 % 7),
        priority: [10, 35, 60][id as usize % 3],
    }
}

/// A router: its view, the batches it saw, and the lost ranges it was told about.
struct Router {
    sub: EventSubscriber,
    view: RouterView,
    batches: Vec<Arc<EventBatch>>,
    lost: Vec<(u64, u64)>,
}

impl Router {
    fn new(sub: EventSubscriber) -> Self {
        Router {
            sub,
            view: RouterView::default(),
            batches: Vec::new(),
            lost: Vec::new(),
        }
    }

    /// Reads what is ready. Applies batches while nothing is lost; after a loss it
    /// only records (until `resync`).
    fn drain(&mut self) {
        while let Some(item) = self.sub.try_recv() {
            match item {
                StreamItem::Batch(b) => {
                    if self.lost.is_empty() {
                        for e in &b.events {
                            self.view.apply(e).unwrap_or_else(|err| {
                                panic!("batch {}: {e:?} does not follow: {err}", b.seq)
                            });
                        }
                    }
                    self.batches.push(b);
                }
                StreamItem::Lost { first, count } => self.lost.push((first, count)),
            }
        }
    }
}

fn kinds(batches: &[Arc<EventBatch>]) -> [usize; 5] {
    let mut k = [0; 5];
    for e in batches.iter().flat_map(|b| &b.events) {
        k[match e {
            RouterEvent::BlockStored {
                medium: Medium::Gpu,
                ..
            } => 0,
            RouterEvent::BlockStored { .. } => 1,
            RouterEvent::BlockRemoved {
                medium: Medium::Gpu,
                ..
            } => 2,
            RouterEvent::BlockRemoved { .. } => 3,
            _ => 4,
        }] += 1;
    }
    k
}

/// Two routers subscribed from the start see the same batches, numbered 0, 1, 2, …
/// without gaps, and each ends with exactly the cache's full blocks: through prefix
/// reuse, preemption, offload to the host and onboarding back, eviction and a reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_subscribers_see_the_same_gap_free_stream_and_replay_to_the_cache() {
    let kv = KvCacheBuilder::new()
        .config(config(1024, true))
        .start()
        .await
        .unwrap();
    let mut a = Router::new(kv.events().subscribe().await.unwrap());
    let mut b = Router::new(kv.events().subscribe().await.unwrap());
    assert_eq!((a.sub.next_seq(), b.sub.next_seq()), (0, 0));
    // A third router reads in its own task, awaiting each item, until the runtime stops.
    let mut c = kv.events().subscribe().await.unwrap();
    let awaiting = tokio::spawn(async move {
        let mut batches = Vec::new();
        while let Some(item) = c.recv().await {
            match item {
                StreamItem::Batch(b) => batches.push(b),
                StreamItem::Lost { first, count } => panic!("lost {count} from {first}"),
            }
        }
        batches
    });
    for id in 0..30 {
        kv.submit(request(id, 160 + (id as usize * 37) % 300))
            .await
            .unwrap();
    }
    run_to_end(&kv, || {
        a.drain();
        b.drain();
    })
    .await;
    let st = kv.stats().await.unwrap();
    assert!(
        st.scheduler.preemptions > 0,
        "a 1,024-token cache for 30 requests must preempt"
    );
    assert!(st.offload_bytes > 0 && st.onboard_bytes > 0);
    assert!(st.prefix_hit_rate > 0.0);
    // Blocks were dropped from the last tier, not only moved: the replay so far is the
    // cache.
    assert!(st.events.removed > 0, "the workload never dropped a block");
    let before_reset = kv.events().router_snapshot().await.unwrap();
    a.drain();
    b.drain();
    assert_eq!(
        a.view.blocks(),
        before_reset.blocks,
        "the replay is the cache"
    );
    assert_eq!(b.view.blocks(), before_reset.blocks);
    // The whole cache is dropped, then refilled.
    kv.reset_prefix_cache().await.unwrap();
    for id in 100..106 {
        kv.submit(request(id, 200)).await.unwrap();
    }
    run_to_end(&kv, || {
        a.drain();
        b.drain();
    })
    .await;
    let snap = kv.events().router_snapshot().await.unwrap();
    a.drain();
    b.drain();
    assert_eq!((a.lost.clone(), b.lost.clone()), (vec![], vec![]));
    let seqs: Vec<u64> = a.batches.iter().map(|x| x.seq).collect();
    assert_eq!(
        seqs,
        (0..snap.next_seq).collect::<Vec<_>>(),
        "gap-free from 0"
    );
    assert_eq!(
        a.batches, b.batches,
        "both subscribers see the same batches"
    );
    assert!(a.batches.iter().all(|x| !x.events.is_empty()));
    assert!(
        a.batches.iter().all(|x| x.timestamp > 1.0e9),
        "seconds since the epoch"
    );
    let k = kinds(&a.batches);
    assert!(
        k.iter().all(|&n| n > 0),
        "stored GPU / host, removed GPU / host, cleared: {k:?}"
    );
    assert_eq!(k[4], 1);
    assert!(!snap.blocks.is_empty());
    assert_eq!(a.view.blocks(), snap.blocks, "the replay is the cache");
    assert_eq!(b.view.blocks(), snap.blocks);
    // Every router block is a block of the crate's own snapshot, on the GPU iff its
    // pages and those of every block before it in its prefix are.
    let tree = kv.events().take_with_snapshot().await.unwrap().blocks;
    let mut own: HashMap<u64, bool> = HashMap::new();
    let mut parent: HashMap<u64, Option<u64>> = HashMap::new();
    for p in &tree {
        *own.entry(p.key.hash64()).or_insert(true) &= p.tier == dsa_kv::ids::Tier::Gpu;
        parent.insert(p.key.hash64(), p.parent.map(|k| k.hash64()));
    }
    for blk in &snap.blocks {
        let mut gpu = own[&blk.hash];
        let mut up = parent[&blk.hash];
        while let Some(h) = up {
            gpu &= own[&h];
            up = parent[&h];
        }
        let medium = if gpu { Medium::Gpu } else { Medium::CpuPinned };
        assert_eq!(blk.medium, medium, "{blk:?}");
    }
    kv.shutdown().await;
    // The stream ends when the runtime stops, after every batch.
    let awaited = tokio::time::timeout(std::time::Duration::from_secs(30), awaiting)
        .await
        .expect("the stream ends at shutdown")
        .unwrap();
    assert_eq!(awaited, a.batches);
}

/// With room for 4 batches, a subscriber that reads nothing while the cache works is
/// told exactly which batches it lost, resynchronizes from a snapshot, and from then on
/// agrees with a subscriber that kept up; a subscriber that joins late starts from its
/// own snapshot and agrees too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lagging_subscriber_learns_the_lost_range_and_resyncs() {
    let kv = KvCacheBuilder::new()
        .config(config(1024, true))
        .event_stream_capacity(4)
        .start()
        .await
        .unwrap();
    let mut fast = Router::new(kv.events().subscribe().await.unwrap());
    let mut slow = Router::new(kv.events().subscribe().await.unwrap());
    for id in 0..12 {
        kv.submit(request(id, 160 + (id as usize * 53) % 250))
            .await
            .unwrap();
    }
    run_to_end(&kv, || fast.drain()).await;
    let published = kv.events().router_snapshot().await.unwrap().next_seq;
    assert!(published > 4, "only {published} batches");
    // The slow one lost all but the newest 4.
    slow.drain();
    assert_eq!(slow.lost, vec![(0, published - 4)]);
    assert_eq!(
        slow.batches.iter().map(|b| b.seq).collect::<Vec<_>>(),
        (published - 4..published).collect::<Vec<_>>()
    );
    // Resynchronize: the snapshot's blocks, then the batches after it.
    let snap = kv.events().router_snapshot().await.unwrap();
    assert_eq!(snap.next_seq, published);
    assert_eq!(fast.view.blocks(), snap.blocks, "the one that kept up");
    slow.view = RouterView::from_blocks(snap.blocks.iter().copied());
    slow.sub.resync(&snap);
    slow.lost.clear();
    slow.batches.clear();
    // A late joiner starts from its own snapshot.
    let (late_sub, late_snap) = kv.events().subscribe_with_snapshot().await.unwrap();
    assert_eq!(late_snap, snap);
    let mut late = Router::new(late_sub);
    late.view = RouterView::from_blocks(late_snap.blocks.iter().copied());
    for id in 50..56 {
        kv.submit(request(id, 180 + id as usize)).await.unwrap();
    }
    run_to_end(&kv, || {
        fast.drain();
        slow.drain();
        late.drain();
    })
    .await;
    let end = kv.events().router_snapshot().await.unwrap();
    for r in [&mut fast, &mut slow, &mut late] {
        r.drain();
        assert_eq!(r.lost, vec![]);
    }
    assert!(end.next_seq > published);
    assert_eq!(
        slow.batches.iter().map(|b| b.seq).collect::<Vec<_>>(),
        (published..end.next_seq).collect::<Vec<_>>()
    );
    assert_eq!(slow.batches, late.batches);
    let blocks: Vec<RouterBlock> = end.blocks;
    assert_eq!(fast.view.blocks(), blocks);
    assert_eq!(slow.view.blocks(), blocks);
    assert_eq!(late.view.blocks(), blocks);
    kv.shutdown().await;
}

/// The batch and its events survive a JSON round trip (the wire a publisher would use).
#[test]
fn a_batch_round_trips_through_serde() {
    let batch = EventBatch {
        seq: 3,
        timestamp: 1_764_560_000.25,
        events: vec![
            RouterEvent::BlockStored {
                block_hashes: vec![1],
                parent_block_hash: None,
                token_ids: (0..64).collect(),
                block_size: 64,
                medium: Medium::Gpu,
                lora_id: None,
                lora_name: None,
            },
            RouterEvent::BlockRemoved {
                block_hashes: vec![1],
                medium: Medium::CpuPinned,
            },
            RouterEvent::AllBlocksCleared,
        ],
    };
    let json = serde_json::to_string(&batch).unwrap();
    assert_eq!(serde_json::from_str::<EventBatch>(&json).unwrap(), batch);
}
