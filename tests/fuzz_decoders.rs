//! Fuzzing every decoder that reads bytes from outside, through the public API
//! (proptest with a fixed seed and case budget; the decoders the public API cannot
//! reach directly, the NCCL control frames and handshakes, are fuzzed the same way
//! beside their code in `crates/dsa-kv-cuda/src/{control,nccl}.rs` and `src/publish/zmtp.rs`):
//!
//! * the ZMQ publisher's two sockets (the ZMTP front and the replay request), with raw
//!   TCP bytes: random, a greeting followed by random frames, and a full handshake
//!   followed by random frames;
//! * the transports' metadata (`connect` of the local transport, and of NIXL where its
//!   library is installed);
//! * the transfer session's wire (`dsa_kv::transfer::session::Wire::recv` of a
//!   `SessionMsg`), a peer's frames as they come;
//! * the transfer plan's inputs (`ExportedBlocks`, `ImportTicket`, `PoolRegion`s as a
//!   peer sends them): JSON decoding, and `plan_writes` on random structured inputs.
//!
//! Pass, for every case: a decoded value or a typed refusal, no panic, no abort, and no
//! single allocation larger than a bound (a counting global allocator records the
//! largest one made while a case runs); the publisher then still answers an honest
//! replay.
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dsa_kv::actors::{EventBatch, StreamItem};
use dsa_kv::core::{Medium, RouterEvent};
use dsa_kv::publish::{EventSource, ZmqPublisher, ZmqPublisherConfig, END_OF_REPLAY};
use dsa_kv::transfer::{
    plan_writes, ExportedBlocks, ImportTicket, KvTransport, LocalTransport, PoolRegion,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use tokio::sync::mpsc;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The system allocator, recording the largest single allocation, and the bytes live
/// and their peak.
struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        grew(l.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LARGEST.fetch_max(new, Ordering::Relaxed);
        if new >= l.size() {
            grew(new - l.size());
        } else {
            LIVE.fetch_sub(l.size() - new, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// The largest allocation any case may cause: far below what a hostile length field
/// claims (up to 2^64), above the buffers a connection legitimately holds (64 KiB
/// write buffers, the replay buffer's growth).
const BOUND: usize = 4 << 20;

/// One test at a time: the allocation bound is process-wide.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn runner(cases: u32, seed: u8) -> TestRunner {
    TestRunner::new_with_rng(
        Config::with_cases(cases),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
    )
}

fn greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn ready(ty: &str) -> Vec<u8> {
    let mut b = vec![5];
    b.extend_from_slice(b"READY");
    b.push(11);
    b.extend_from_slice(b"Socket-Type");
    b.extend_from_slice(&(ty.len() as u32).to_be_bytes());
    b.extend_from_slice(ty.as_bytes());
    let mut f = vec![0x04, b.len() as u8];
    f.extend(b);
    f
}

/// Frames with random flags and lengths (long ones claiming anything), random bodies.
fn frames() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(
        (
            any::<u8>(),
            prop_oneof![
                (0u64..300).boxed(),
                any::<u64>().boxed(),
                Just(1u64 << 62).boxed()
            ],
            proptest::collection::vec(any::<u8>(), 0..48),
        ),
        1..6,
    )
    .prop_map(|fs| {
        let mut out = Vec::new();
        for (flags, len, body) in fs {
            let flags = flags & 0x0f;
            out.push(flags);
            if flags & 2 != 0 {
                out.extend_from_slice(&len.to_be_bytes());
            } else {
                out.push(len as u8);
            }
            out.extend(body);
        }
        out
    })
}

/// What a client sends: random bytes; a greeting then frames; a handshake then frames.
fn client_bytes(ty: &'static str) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..200),
        frames().prop_map(|f| [greeting(), f].concat()),
        frames().prop_map(move |f| [greeting(), ready(ty), f].concat()),
    ]
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

fn batch(seq: u64) -> StreamItem {
    StreamItem::Batch(Arc::new(EventBatch {
        seq,
        timestamp: 1.7e9,
        events: vec![RouterEvent::BlockStored {
            block_hashes: vec![seq + 1],
            parent_block_hash: None,
            token_ids: (0..64).collect(),
            block_size: 64,
            medium: Medium::Gpu,
            lora_id: None,
            lora_name: None,
        }],
    }))
}

/// Sends `bytes` to `addr`, reads what comes back for a moment, closes.
fn poke(addr: &str, bytes: &[u8]) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return;
    };
    let _ = s.write_all(bytes);
    let _ = s.set_read_timeout(Some(Duration::from_millis(20)));
    let mut buf = [0u8; 4096];
    let until = Instant::now() + Duration::from_millis(40);
    while Instant::now() < until {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

#[test]
fn the_publishers_sockets_refuse_what_they_cannot_decode() {
    let _serial = SERIAL.lock().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let p = rt.block_on(async {
        ZmqPublisher::start(
            Fed(rx),
            ZmqPublisherConfig {
                endpoint: "tcp://127.0.0.1:0".into(),
                replay_endpoint: Some("tcp://127.0.0.1:0".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap()
    });
    for s in 0..50 {
        tx.send(batch(s)).unwrap();
    }
    let pub_addr = p.endpoint().strip_prefix("tcp://").unwrap().to_string();
    let replay = p.replay_endpoint().unwrap().to_string();
    let replay_addr = replay.strip_prefix("tcp://").unwrap().to_string();
    let input = (client_bytes("SUB"), client_bytes("DEALER"));
    runner(160, 11)
        .run(&input, |(to_pub, to_replay)| {
            LARGEST.store(0, Ordering::Relaxed);
            poke(&pub_addr, &to_pub);
            poke(&replay_addr, &to_replay);
            let largest = LARGEST.load(Ordering::Relaxed);
            prop_assert!(largest < BOUND, "an allocation of {largest} bytes");
            Ok(())
        })
        .unwrap();
    // Still serving: an honest replay of the last batches.
    let got = rt.block_on(async {
        let mut d = DealerSocket::new();
        d.connect(&replay).await.unwrap();
        d.send(
            ZmqMessage::try_from(vec![
                Bytes::new(),
                Bytes::copy_from_slice(&45u64.to_be_bytes()),
            ])
            .unwrap(),
        )
        .await
        .unwrap();
        let mut seqs = Vec::new();
        loop {
            let f = tokio::time::timeout(Duration::from_secs(5), d.recv())
                .await
                .expect("replay answers")
                .unwrap()
                .into_vec();
            if f[1].as_ref() == END_OF_REPLAY {
                break seqs;
            }
            seqs.push(u64::from_be_bytes(f[1].as_ref().try_into().unwrap()));
        }
    });
    assert_eq!(got, (45..50).collect::<Vec<_>>());
    let r = p.report();
    assert!(r.dropped_peers > 100, "{r:?}");
    rt.block_on(p.shutdown());
}

/// A JSON-ish input: random bytes, or a valid document with one byte changed.
fn json_like(valid: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..256),
        (0..valid.len(), any::<usize>(), any::<u8>()).prop_map(move |(d, i, x)| {
            let mut b = valid[d].clone();
            let i = i % b.len();
            b[i] = x;
            b
        }),
    ]
}

#[test]
fn transport_metadata_is_refused_or_understood() {
    let _serial = SERIAL.lock().unwrap();
    let t = std::cell::RefCell::new(LocalTransport::new("fuzz"));
    let other = LocalTransport::new("fuzz-peer");
    let mut o = other;
    let valid = vec![o.local_metadata().unwrap()];
    runner(512, 13)
        .run(&json_like(valid), |md| {
            LARGEST.store(0, Ordering::Relaxed);
            // SAFETY: nothing is written: the transport only parses and checks.
            let _ = unsafe { t.borrow_mut().connect(&md) };
            prop_assert!(LARGEST.load(Ordering::Relaxed) < BOUND);
            Ok(())
        })
        .unwrap();
    #[cfg(feature = "nixl")]
    {
        use dsa_kv::transfer::nixl::NixlTransport;
        if let (Ok(a), Ok(mut b)) = (NixlTransport::new("fuzz-a"), NixlTransport::new("fuzz-b")) {
            let a = std::cell::RefCell::new(a);
            let valid = vec![b.local_metadata().unwrap()];
            runner(64, 17)
                .run(&json_like(valid), |md| {
                    // SAFETY: as above; NIXL parses the blob and refuses or loads it.
                    let _ = unsafe { a.borrow_mut().connect(&md) };
                    Ok(())
                })
                .unwrap();
        } else {
            assert!(
                std::env::var("DSA_KV_REQUIRE_NIXL").as_deref() != Ok("1"),
                "DSA_KV_REQUIRE_NIXL=1 but NIXL is not available"
            );
        }
    }
}

#[test]
fn the_session_wire_refuses_or_decodes() {
    use dsa_kv::transfer::session::{SessionMsg, Wire, WireError};
    let _serial = SERIAL.lock().unwrap();
    let input = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..256),
        (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..128)).prop_map(|(n, b)| {
            let mut f = n.to_le_bytes().to_vec();
            f.extend(b);
            f
        }),
        (prop_oneof![Just(0u64), Just(1 << 26), Just(64 << 20), Just(u64::MAX)])
            .prop_map(|n| n.to_le_bytes().to_vec()),
        // Whole frames of JSON that look like the protocol's.
        (
            prop_oneof![
                Just("{\"Offer\":{\"export\":"),
                Just("{\"Ticket\":{\"export\":1,\"ticket\":"),
                Just("{\"Written\":{\"export\":1,\"import\":1,\"digests\":["),
                Just("{\"Hello\":{\"protocol\":1,\"metadata\":["),
                Just("\"Bye\""),
            ],
            proptest::collection::vec(any::<u8>(), 0..96)
        )
            .prop_map(|(head, tail)| {
                let mut body = head.as_bytes().to_vec();
                body.extend(tail);
                let mut f = (body.len() as u64).to_le_bytes().to_vec();
                f.extend(body);
                f
            }),
    ];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runner(192, 19)
        .run(&input, |bytes| {
            LARGEST.store(0, Ordering::Relaxed);
            let mut w = Wire::new(&bytes[..]);
            // Every frame in the input, until the first refusal.
            let mut refused = None;
            for _ in 0..4 {
                match rt.block_on(w.recv::<SessionMsg>()) {
                    Ok(_) => {}
                    Err(e) => {
                        refused = Some(e);
                        break;
                    }
                }
            }
            let largest = LARGEST.load(Ordering::Relaxed);
            prop_assert!(largest < BOUND, "an allocation of {largest} bytes");
            // A frame longer than the limit is refused by its length alone.
            if bytes.len() >= 8 && u64::from_le_bytes(bytes[..8].try_into().unwrap()) > (16 << 20) {
                prop_assert!(
                    matches!(refused, Some(WireError::TooLarge { .. })),
                    "{refused:?}"
                );
            }
            Ok(())
        })
        .unwrap();
}

/// Frames of the session protocol as an exporter could craft them, each as large as the
/// wire admits (16 MiB) and made of what costs the decoder most per byte: 5.6 M empty
/// digest strings, 8 M one-digit tokens or metadata bytes, a 16 MiB reason, 16K + 1
/// blocks with no pages, window tails past their caps. Each is refused (or, for the honest large offer, decoded) with
/// no single allocation over 4 MiB (an offer's 1M tokens take exactly that) and at most
/// the frame's own bytes plus 8 MiB live at the peak. Before: the empty digests cost
/// 320 MiB at the peak and 192 MiB held, the tokens 80 MiB, the metadata and the
/// reason 48 MiB.
#[test]
fn session_frames_cost_no_more_than_their_bytes() {
    use dsa_kv::transfer::session::{SessionMsg, Wire, WireError, MAX_FRAME};
    use dsa_kv::transfer::{MAX_TAIL_SLOTS, MAX_TAIL_WINDOWS, MAX_TRANSFER_BLOCKS};
    let _serial = SERIAL.lock().unwrap();
    let frame = |json: Vec<u8>| {
        let mut f = (json.len() as u64).to_le_bytes().to_vec();
        f.extend(json);
        f
    };
    // `head`, then `n` times `item` comma-separated, then `tail`.
    let list = |head: &str, item: &str, tail: &str, n: usize| {
        let mut b = Vec::with_capacity(head.len() + n * (item.len() + 1) + tail.len());
        b.extend_from_slice(head.as_bytes());
        for i in 0..n {
            if i > 0 {
                b.push(b',');
            }
            b.extend_from_slice(item.as_bytes());
        }
        b.extend_from_slice(tail.as_bytes());
        b
    };
    // As many as fill a whole frame.
    let fill = |head: &str, item: &str, tail: &str| {
        let n = (MAX_FRAME as usize - head.len() - tail.len()) / (item.len() + 1);
        list(head, item, tail, n)
    };
    let room = MAX_FRAME as usize;
    let digest = format!("\"{}\"", "ab".repeat(32));
    let block = format!(
        "{{\"key\":[{}],\"target\":[],\"draft\":[]}}",
        ["0"; 32].join(",")
    );
    let cases: Vec<(&str, Vec<u8>, Option<&str>)> = vec![
        (
            "empty digests",
            fill("{\"Written\":{\"digests\":[", "\"\"", "]}}"),
            Some("invalid value"),
        ),
        (
            "digests past the cap",
            list(
                "{\"Written\":{\"digests\":[",
                &digest,
                "]}}",
                MAX_TRANSFER_BLOCKS + 2,
            ),
            // One per block and one for a windowed model's tail.
            Some("more than 16385 entries"),
        ),
        (
            "offer tail windows",
            list(
                "{\"Offer\":{\"export\":{\"tail\":[",
                "{\"window\":0,\"start\":0,\"slots\":[]}",
                "]}}}",
                MAX_TAIL_WINDOWS + 1,
            ),
            Some("more than 64 entries"),
        ),
        (
            "ticket tail slots",
            list(
                "{\"Ticket\":{\"ticket\":{\"tail\":[{\"window\":0,\"start\":0,\"slots\":[",
                "1",
                "]}]}}}",
                MAX_TAIL_SLOTS + 1,
            ),
            Some("more than 4096 entries"),
        ),
        (
            "offer tokens",
            fill("{\"Offer\":{\"export\":{\"tokens\":[", "1", "]}}}"),
            Some("more than 1048576 entries"),
        ),
        (
            "offer blocks",
            list(
                "{\"Offer\":{\"export\":{\"blocks\":[",
                &block,
                "]}}}",
                MAX_TRANSFER_BLOCKS + 1,
            ),
            Some("more than 16384 entries"),
        ),
        (
            "hello metadata",
            fill("{\"Hello\":{\"metadata\":[", "0", "]}}"),
            Some("more than 1048576 entries"),
        ),
        (
            "a long reason",
            {
                let mut b = b"{\"Failed\":{\"export\":1,\"in_flight\":false,\"why\":\"".to_vec();
                b.resize(room - 3, b'x');
                b.extend_from_slice(b"\"}}");
                b
            },
            Some("a string of more than 65536 bytes"),
        ),
        (
            "an honest offer of 1M tokens",
            {
                let mut b = list(
                    "{\"Offer\":{\"export\":{\"id\":1,\"scope\":{\"lora_id\":null,\"salt\":null},\"tokens\":[",
                    "7",
                    "],",
                    1 << 20,
                );
                b.extend_from_slice(
                    b"\"tokens_per_block\":64,\"layout\":\"x\",\"pools\":[],\"blocks\":[]}}}",
                );
                b
            },
            None,
        ),
    ];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for (name, json, refused) in cases {
        let len = json.len();
        assert!(len as u64 <= MAX_FRAME, "{name}: {len} bytes");
        let bytes = frame(json);
        LARGEST.store(0, Ordering::Relaxed);
        let base = LIVE.load(Ordering::Relaxed);
        PEAK.store(base, Ordering::Relaxed);
        let got = rt.block_on(Wire::new(&bytes[..]).recv::<SessionMsg>());
        let largest = LARGEST.load(Ordering::Relaxed);
        let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
        match (refused, &got) {
            (Some(why), Err(WireError::Decode { why: got, .. })) => {
                assert!(got.contains(why), "{name}: {got}")
            }
            (None, Ok(SessionMsg::Offer { export })) => {
                assert_eq!(export.tokens.len(), 1 << 20, "{name}")
            }
            _ => panic!("{name}: {got:?}"),
        }
        assert!(largest <= BOUND, "{name}: an allocation of {largest} bytes");
        assert!(
            peak <= len + (8 << 20),
            "{name}: {peak} bytes live at the peak for a frame of {len}"
        );
        eprintln!("{name}: {len} B frame, largest allocation {largest} B, peak {peak} B");
    }
}

/// A small random engine side: regions of 1–3 pools per cache (target, draft, and a
/// windowed model's window life cycles), random slot counts and addresses (some near
/// the end of the address space), random pages, random window tails (the ticket's of
/// the export's shape, or of any).
fn plan_inputs() -> impl Strategy<Value = (String, String, String, String)> {
    use dsa_kv::core::{BlockKey, PageLoc};
    use dsa_kv::ids::{LifeCycleId, PoolGroupId, RequestId, SlotId, Tier, TokenId};
    use dsa_kv::transfer::{BlockPages, CacheKind, MemKind, MemRegion, PoolRef, WindowTail};
    let cache = || {
        prop_oneof![
            Just(CacheKind::Target),
            Just(CacheKind::Draft),
            (0u16..3).prop_map(CacheKind::Window)
        ]
    };
    let tail = proptest::collection::vec(
        (
            0u16..3,
            0u64..600,
            proptest::collection::vec((0u32..80).prop_map(SlotId), 0..3),
        )
            .prop_map(|(window, start, slots)| WindowTail {
                window,
                start,
                slots,
            }),
        0..3,
    );
    let region = (
        0u32..2,
        cache(),
        0u16..3,
        1u64..4096,
        0u32..64,
        prop_oneof![
            (0u64..1 << 40).boxed(),
            (u64::MAX - (1 << 20)..u64::MAX).boxed()
        ],
    )
        .prop_map(
            |(device, cache, pool, slot_bytes, slots, addr)| PoolRegion {
                device,
                cache,
                tier: Tier::Gpu,
                group: PoolGroupId(0),
                pool,
                slot_bytes,
                slots,
                roles: vec![],
                region: MemRegion {
                    addr,
                    len: slot_bytes.saturating_mul(u64::from(slots)),
                    mem: MemKind::Host,
                },
            },
        );
    let page = (0u32..80).prop_map(|s| PageLoc {
        life_cycle: LifeCycleId(0),
        tier: Tier::Gpu,
        group: PoolGroupId(0),
        slot: SlotId(s),
    });
    let block = (
        any::<u8>(),
        proptest::collection::vec(page.clone(), 1..2),
        proptest::collection::vec(page, 0..2),
    )
        .prop_map(|(k, target, draft)| BlockPages {
            key: BlockKey([k; 32]),
            target,
            draft,
        });
    let pools = proptest::collection::vec(
        (cache(), 0u16..3).prop_map(|(cache, pool)| PoolRef {
            cache,
            group: PoolGroupId(0),
            pool,
        }),
        1..4,
    );
    (
        proptest::collection::vec(region.clone(), 1..6),
        proptest::collection::vec(region, 1..6),
        proptest::collection::vec(block, 0..5),
        0u32..3,
        pools,
        (tail.clone(), tail, any::<bool>()),
    )
        .prop_map(|(src, dst, blocks, skipped, pools, (tail, other, same))| {
            // The ticket's tail: the export's shape on other slots, or any.
            let ticket_tail = if same {
                tail.iter()
                    .map(|w| WindowTail {
                        slots: w.slots.iter().map(|s| SlotId((s.0 + 1) % 80)).collect(),
                        ..w.clone()
                    })
                    .collect()
            } else {
                other
            };
            let export = ExportedBlocks {
                id: RequestId(1),
                scope: Default::default(),
                tokens: vec![TokenId(1); blocks.len() * 64],
                tokens_per_block: 64,
                layout: "L".into(),
                pools: pools.clone(),
                blocks: blocks.clone(),
                tail,
            };
            let skip = (skipped as usize).min(blocks.len());
            let ticket = ImportTicket {
                id: RequestId(2),
                export: RequestId(1),
                skipped: skip as u32,
                layout: "L".into(),
                pools,
                blocks: blocks[skip..].to_vec(),
                tail: ticket_tail,
                write_within_ms: 1000,
                write_by: None,
            };
            (
                serde_json::to_string(&export).unwrap(),
                serde_json::to_string(&src).unwrap(),
                serde_json::to_string(&ticket).unwrap(),
                serde_json::to_string(&dst).unwrap(),
            )
        })
}

/// `plan_writes` on what a peer could send: a typed refusal, or a plan whose every
/// segment lies inside the regions it was given (source and destination).
#[test]
fn transfer_plans_from_peer_inputs_stay_inside_the_regions() {
    let _serial = SERIAL.lock().unwrap();
    runner(512, 37)
        .run(&plan_inputs(), |(e, s, t, d)| {
            let export: ExportedBlocks = serde_json::from_str(&e).unwrap();
            let src: Vec<PoolRegion> = serde_json::from_str(&s).unwrap();
            let ticket: ImportTicket = serde_json::from_str(&t).unwrap();
            let dst: Vec<PoolRegion> = serde_json::from_str(&d).unwrap();
            if let Ok(plan) = plan_writes(&export, &src, &ticket, &dst) {
                for b in &plan.batches {
                    for seg in &b.segments {
                        prop_assert!(src.iter().any(|r| r.region.contains(seg.src, seg.len)));
                        prop_assert!(dst.iter().any(|r| r.region.contains(seg.dst, seg.len)));
                    }
                }
            }
            let _ = ticket.write_ranges(&dst);
            // Mutated documents decode or are refused.
            for (i, doc) in [&e, &s, &t, &d].iter().enumerate() {
                let mut b = doc.as_bytes().to_vec();
                let k = (i * 7919 + b.len() / 2) % b.len();
                b[k] = b'"';
                let _ = serde_json::from_slice::<ExportedBlocks>(&b);
                let _ = serde_json::from_slice::<ImportTicket>(&b);
                let _ = serde_json::from_slice::<Vec<PoolRegion>>(&b);
            }
            Ok(())
        })
        .unwrap();
}

/// A checkpoint folder with the fixture's tensors and an edited `config.json` (or, with
/// `zero`, a `config.json` that links to `/dev/zero`).
fn checkpoint_copy(variant: &str, edit: impl FnOnce(&mut serde_json::Value)) -> std::path::PathBuf {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(variant);
    let dst =
        std::env::temp_dir().join(format!("dsa-kv-fuzz-ckpt-{}-{variant}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::copy(src.join("model.safetensors"), dst.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dst.join("config.json"), cfg.to_string()).unwrap();
    dst
}

/// A `config.json` that claims many layers costs nothing before the first missing
/// tensor: 2^24 layers are refused by the parser, the most it admits (4,096) at the
/// first missing layer, with no allocation over 4 MiB (before: both loaders reserved
/// every layer up front, 12.6 GB for V3.2 and 18.5 GB for V4 at 2^24); a `config.json`
/// that is not a regular file (`/dev/zero`, a FIFO) is refused without reading it
/// (before: memory grew without bound, or the loader hung).
#[test]
fn checkpoint_files_cannot_make_the_loaders_reserve_or_hang() {
    use dsa_kv::config::KvDtype;
    use dsa_kv::ops::quant::ScaleFormat;
    use dsa_kv_model::v4::V4Model;
    use dsa_kv_model::{CacheFormat, Model};
    let _serial = SERIAL.lock().unwrap();
    let format = CacheFormat {
        kv_dtype: KvDtype::Bf16,
        scale_format: ScaleFormat::Ue8m0,
        indexer: vec![true, true],
    };
    let v32_with = |n: u64| {
        checkpoint_copy("deepseek_v32", |c| {
            // Dense first, then MoE (`first_k_dense_replace`), for any count.
            let o = c.as_object_mut().unwrap();
            o.remove("layer_types");
            o.remove("mlp_layer_types");
            c["num_hidden_layers"] = n.into();
        })
    };
    let v4_with = |n: u64| {
        checkpoint_copy("deepseek_v4", |c| {
            // The default layer pattern, for any count.
            let o = c.as_object_mut().unwrap();
            o.remove("layer_types");
            o.remove("mlp_layer_types");
            c["num_hidden_layers"] = n.into();
        })
    };
    let v32 = v32_with(1 << 24);
    let e = Model::from_checkpoint(&v32, format.clone())
        .err()
        .expect("refused");
    assert!(
        e.to_string()
            .starts_with("config.json: num_hidden_layers = 16777216: at most 4096"),
        "{e}"
    );
    let v32 = v32_with(4096);
    LARGEST.store(0, Ordering::Relaxed);
    let e = Model::from_checkpoint(&v32, format.clone())
        .err()
        .expect("refused");
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(largest < BOUND, "an allocation of {largest} bytes ({e})");
    assert!(e.to_string().contains("model.layers.2."), "{e}");
    let v4 = v4_with(1 << 24);
    let e = V4Model::from_checkpoint(&v4).err().expect("refused");
    assert!(
        e.to_string()
            .starts_with("config.json: num_hidden_layers = 16777216: at most 4096"),
        "{e}"
    );
    let v4 = v4_with(4096);
    LARGEST.store(0, Ordering::Relaxed);
    let e = V4Model::from_checkpoint(&v4).err().expect("refused");
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(largest < BOUND, "an allocation of {largest} bytes ({e})");
    assert!(e.to_string().contains("model.layers."), "{e}");
    // Files that are not regular files.
    let refusal = |dir: &std::path::Path| match dir == v32.as_path() {
        true => Model::from_checkpoint(dir, format.clone())
            .err()
            .unwrap()
            .to_string(),
        false => V4Model::from_checkpoint(dir).err().unwrap().to_string(),
    };
    for dir in [&v32, &v4] {
        let cfg = dir.join("config.json");
        std::fs::remove_file(&cfg).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &cfg).unwrap();
        let e = refusal(dir);
        assert!(e.contains("not a regular file (a character device)"), "{e}");
        std::fs::remove_file(&cfg).unwrap();
        assert!(std::process::Command::new("mkfifo")
            .arg(&cfg)
            .status()
            .unwrap()
            .success());
        let e = refusal(dir);
        assert!(e.contains("not a regular file (a FIFO)"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
