//! Prefill / decode disaggregation through the runtime, in one process over the local
//! transport (the model end to end is the `disagg` example's own test, `cargo test
//! --example disagg`; the NIXL transport has its own two-process tests):
//!
//! * the transfer session (`dsa_kv::transfer::session`) moves every device's pages and
//!   the importer commits them; hostile or failing exporters and importers end a
//!   transfer cleanly: the import's pages freed, the export released, nothing of it
//!   cached, a typed error or outcome saying why;
//! * a failed or partial transfer leaves both engines clean, and bad imports are refused;
//! * both engines keep serving other requests while a transfer is open;
//! * an import is bound to the request the importer serves; leases end what a dead peer
//!   left.
mod common;

use common::engine::step_once;
use common::transfer::{config, engine, prefill, SCOPE};
use dsa_kv::actors::RuntimeError;
use dsa_kv::core::scheduler::SchedError;
use dsa_kv::core::{BlockKey, KvError};
use dsa_kv::ids::{RequestId, TokenId};
use std::time::Duration;

use dsa_kv::actors::KvCacheHandle;
use dsa_kv::transfer::session::{
    host_block_digests, link_pair, AbortReason, BlockDigest, HandOver, ImportOutcome, SessionError,
    SessionMsg, SessionOptions, TransferSession, Wire, PROTOCOL_VERSION,
};
use dsa_kv::transfer::{
    plan_writes, ImportTicket, KvTransport, LocalTransport, MemRegion, PeerId, TransportError,
    WriteBatch, WriteReport,
};
use tokio::io::DuplexStream;

/// Writes the first `keep` segments of a transfer, then fails.
struct Partial {
    inner: LocalTransport,
    keep: usize,
}

impl KvTransport for Partial {
    fn name(&self) -> &str {
        "partial"
    }
    unsafe fn register(&mut self, regions: &[MemRegion]) -> Result<(), TransportError> {
        self.inner.register(regions)
    }
    fn local_metadata(&mut self) -> Result<Vec<u8>, TransportError> {
        self.inner.local_metadata()
    }
    unsafe fn connect(&mut self, remote: &[u8]) -> Result<PeerId, TransportError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.connect(remote) }
    }
    fn write(
        &mut self,
        peer: &PeerId,
        batches: &[WriteBatch],
        _: &[u8],
    ) -> Result<WriteReport, TransportError> {
        let mut b = batches[0].clone();
        b.segments.truncate(self.keep);
        self.inner.write(peer, &[b], b"partial")?;
        Err(TransportError::Failed {
            transport: "partial",
            op: "write",
            detail: "the link went down".into(),
        })
    }
    fn take_notifications(&mut self) -> Result<Vec<(PeerId, Vec<u8>)>, TransportError> {
        self.inner.take_notifications()
    }
    unsafe fn open_window(
        &mut self,
        peer: &PeerId,
        window: u64,
        ranges: &[MemRegion],
        deadline: std::time::Instant,
    ) -> Result<(), TransportError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.open_window(peer, window, ranges, deadline) }
    }
    fn close_window(&mut self, window: u64) -> Result<(), TransportError> {
        self.inner.close_window(window)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_transfer_leaves_both_engines_clean() {
    let (a, b) = (
        engine(config(2, 6, None), 1).await,
        engine(config(2, 6, None), 1).await,
    );
    let p: Vec<TokenId> = (0..262).map(|t| TokenId(1000 + t % 3000)).collect();
    let id = RequestId(0);
    prefill(&a, id, SCOPE, &p).await;
    let toks: Vec<TokenId> = p[..256].to_vec();
    let mut probe = toks.clone();
    probe.push(TokenId(1));
    let cached_a = a.probe_reuse(SCOPE, &probe).await.unwrap();
    assert_eq!(cached_a, 256);

    let (ra, rb) = (
        a.transfer().regions().await.unwrap(),
        b.transfer().regions().await.unwrap(),
    );
    let mut ta = Partial {
        inner: LocalTransport::new("a"),
        keep: 1,
    };
    let mut tb = LocalTransport::new("b");
    // SAFETY: the engines' own pools; both engines outlive the transports (dropped at
    // the end of this test, after the last write), and writes go only into pages an
    // import reserved. The metadata is the peer transport's own.
    let (peer, peer_a) = unsafe {
        ta.register(&ra.iter().map(|r| r.region).collect::<Vec<_>>())
            .unwrap();
        tb.register(&rb.iter().map(|r| r.region).collect::<Vec<_>>())
            .unwrap();
        let peer_a = tb.connect(&ta.local_metadata().unwrap()).unwrap();
        (ta.connect(&tb.local_metadata().unwrap()).unwrap(), peer_a)
    };

    let export = a.transfer().export(id, SCOPE, &toks).await.unwrap();
    assert_eq!(export.blocks.len(), 4);
    // The export's id is taken while it lives: a request with it is refused.
    let dup = a
        .submit(dsa_kv::core::scheduler::SubmitRequest {
            id,
            scope: SCOPE,
            prompt: toks.clone(),
            max_new_tokens: 1,
            priority: 35,
        })
        .await;
    assert!(
        matches!(
            dup,
            Err(RuntimeError::Scheduler(SchedError::Kv(
                KvError::DuplicateRequest { .. }
            )))
        ),
        "{dup:?}"
    );
    let ticket = b
        .transfer()
        .begin_import_with(&mut tb, &peer_a, &rb, id, SCOPE, &toks, &export)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((ticket.skipped, ticket.blocks.len()), (0, 4));
    // One segment lands, then the link fails: the importer aborts.
    let plan = plan_writes(&export, &ra, &ticket, &rb).unwrap();
    assert!(ta.write(&peer, &plan.batches, b"req-0").is_err());
    b.transfer().abort_import_with(&mut tb, id).await.unwrap();
    a.transfer().release_export(id).await.unwrap();
    let cb = b.check_invariants().await.unwrap();
    assert_eq!(
        (
            cb.live_sequences,
            cb.cached_blocks,
            cb.pages,
            cb.gpu_slots_used
        ),
        (0, 0, 0, 0),
        "nothing of the import stays"
    );
    assert_eq!(b.probe_reuse(SCOPE, &probe).await.unwrap(), 0);
    let ca = a.check_invariants().await.unwrap();
    assert_eq!(ca.live_sequences, 0, "the export is released");
    assert_eq!(a.probe_reuse(SCOPE, &probe).await.unwrap(), cached_a);
    // Aborting or releasing again is an error that changes nothing.
    assert!(b.transfer().abort_import(id).await.is_err());
    assert!(a.transfer().release_export(id).await.is_err());

    // Refusals: other keys than ours (another scope), and another engine layout.
    let mut forged = a.transfer().export(id, SCOPE, &toks).await.unwrap();
    forged.blocks[2].key = BlockKey([7; 32]);
    let e = b
        .transfer()
        .begin_import(id, SCOPE, &toks, &forged)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("block 2's key"), "{e}");
    let mut other = forged.clone();
    other.blocks = a
        .transfer()
        .export(RequestId(9), SCOPE, &toks)
        .await
        .unwrap()
        .blocks;
    other.layout = "0123456789abcdef".into();
    let e = b
        .transfer()
        .begin_import(id, SCOPE, &toks, &other)
        .await
        .unwrap_err();
    assert!(matches!(e, RuntimeError::Transfer(_)), "{e}");
    assert_eq!(b.check_invariants().await.unwrap().live_sequences, 0);
    a.transfer().release_export(id).await.unwrap();
    a.transfer().release_export(RequestId(9)).await.unwrap();

    // The same blocks, exported again and complete this time, are committed and used.
    let export = a.transfer().export(id, SCOPE, &toks).await.unwrap();
    let mut ok = LocalTransport::new("a2");
    // SAFETY: as above.
    let (peer, peer_ok) = unsafe {
        ok.register(&ra.iter().map(|r| r.region).collect::<Vec<_>>())
            .unwrap();
        let peer_ok = tb.connect(&ok.local_metadata().unwrap()).unwrap();
        (ok.connect(&tb.local_metadata().unwrap()).unwrap(), peer_ok)
    };
    let ticket = b
        .transfer()
        .begin_import_with(&mut tb, &peer_ok, &rb, id, SCOPE, &toks, &export)
        .await
        .unwrap()
        .unwrap();
    let r = dsa_kv::transfer::push(&mut ok, &peer, &export, &ra, &ticket, &rb, b"req-0").unwrap();
    assert_eq!((r.blocks, r.skipped), (4, 0));
    assert!(tb
        .take_notifications()
        .unwrap()
        .iter()
        .any(|(_, m)| m == b"req-0"));
    assert_eq!(
        b.transfer().commit_import_with(&mut tb, id).await.unwrap(),
        4
    );
    assert_eq!(b.probe_reuse(SCOPE, &probe).await.unwrap(), 256);
    for e in [&a, &b] {
        e.check_invariants().await.unwrap();
    }
    a.transfer().release_export(id).await.unwrap();
    assert_eq!(a.check_invariants().await.unwrap().live_sequences, 0);
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Two engines' sessions over an in-memory wire, each with its own local transport
/// (`digests` as given on both).
async fn sessions(
    a: &KvCacheHandle,
    b: &KvCacheHandle,
    digests: bool,
) -> (TransferSession<DuplexStream>, TransferSession<DuplexStream>) {
    let (wa, wb) = tokio::io::duplex(1 << 20);
    let options = SessionOptions {
        digests,
        ..SessionOptions::default()
    };
    // SAFETY: the engines run until after the tests drop the sessions; the wire is
    // in-memory between the two.
    let (sa, sb) = tokio::join!(
        unsafe {
            TransferSession::open(
                a,
                Box::new(LocalTransport::new("session-a")),
                Wire::new(wa),
                options.clone(),
            )
        },
        unsafe {
            TransferSession::open(
                b,
                Box::new(LocalTransport::new("session-b")),
                Wire::new(wb),
                options.clone(),
            )
        },
    );
    (sa.unwrap(), sb.unwrap())
}

/// Tensor parallelism through the session: each of two devices holds its own copy of
/// every page; a hand-over moves every device's pages to the same device index on the
/// other engine, the importer checks every page's digest and commits, and tells the
/// exporter so; the export is released and the import served.
#[test]
fn two_device_engines_move_every_devices_pages() {
    runtime().block_on(async {
        let (a, b) = (
            engine(config(2, 6, None), 2).await,
            engine(config(2, 6, None), 2).await,
        );
        let (mut sa, mut sb) = sessions(&a, &b, true).await;
        assert_eq!(sa.remote_regions(), b.transfer().regions().await.unwrap());
        let p: Vec<TokenId> = (0..6 * 64 + 1).map(|t| TokenId(200_000 + t)).collect();
        let id = RequestId(2);
        prefill(&a, id, SCOPE, &p).await;
        let export = a.transfer().export(id, SCOPE, &p[..6 * 64]).await.unwrap();
        let import = async {
            let offer = sb.next_offer().await.unwrap().expect("an offer");
            assert_eq!(offer, export);
            let ticket = sb
                .begin(id, SCOPE, &p, &offer)
                .await
                .unwrap()
                .expect("room");
            sb.finish(&ticket).await.unwrap()
        };
        let (handed, imported) = tokio::join!(sa.hand_over(&export), import);
        assert_eq!(imported, ImportOutcome::Committed { blocks: 6 });
        let HandOver::Pushed { report, outcome } = handed.unwrap() else {
            panic!("not pushed");
        };
        assert_eq!(
            outcome, imported,
            "the exporter hears the importer's verdict"
        );
        assert_eq!(b.probe_reuse(SCOPE, &p).await.unwrap(), 6 * 64);
        // 6 blocks × (target + draft) × 2 devices; 2 pools each, one descriptor per pool run.
        assert_eq!(report.pages, 24);
        assert_eq!(report.uncoalesced, 48);
        assert_eq!(report.write.descriptors, 8);
        assert_eq!(
            a.stats().await.unwrap().transfers.open_exports,
            0,
            "released"
        );
        sa.close().await.unwrap();
        assert_eq!(sb.next_offer().await.unwrap(), None, "Bye ends the session");
        drop(sb);
        for e in [&a, &b] {
            e.check_invariants().await.unwrap();
        }
        a.shutdown().await;
        b.shutdown().await;
    });
}

/// A peer that speaks the session's frames by hand (a hostile or broken engine): its
/// half of the handshake, as `hello` says, with its own local transport (connected to
/// the real side's, so it can deliver notifications).
async fn fake_open(
    stream: DuplexStream,
    hello: impl FnOnce(Vec<u8>) -> SessionMsg,
) -> (Wire<DuplexStream>, LocalTransport, PeerId) {
    let mut w = Wire::new(stream);
    let mut t = LocalTransport::new("fake");
    let SessionMsg::Hello { metadata, .. } = w.recv().await.unwrap() else {
        panic!("no Hello from the real side");
    };
    // SAFETY: the real side's own metadata; the fake registers nothing and writes no
    // bytes (notifications only).
    let peer = unsafe { t.connect(&metadata) }.unwrap();
    w.send(&hello(t.local_metadata().unwrap())).await.unwrap();
    (w, t, peer)
}

fn honest_hello(digests: bool) -> impl FnOnce(Vec<u8>) -> SessionMsg {
    move |metadata| SessionMsg::Hello {
        protocol: PROTOCOL_VERSION,
        transport: "local".into(),
        metadata,
        regions: Vec::new(),
        digests,
    }
}

/// How a hostile or broken exporter behaves after the importer's ticket.
#[derive(Clone, Copy, Debug)]
enum Exporter {
    /// Reports its write failed.
    Fails,
    /// Reports its write failed and may still be landing.
    FailsInFlight,
    /// Says nothing more (the connection stays open).
    Silent,
    /// Closes the connection.
    Hangs,
    /// Says it wrote, but no byte (and no notification) comes.
    WritesNothing,
    /// Sends the notification without the bytes, with digests of other bytes.
    LiesAboutTheBytes,
    /// One digest for a four-block ticket.
    ShortDigests,
    /// A `Written` about another import.
    OtherImport,
    /// A frame longer than the wire's limit.
    HugeFrame,
}

/// A hostile or broken exporter cannot make the importer commit, or keep its pages: the
/// import ends aborted (or, where a write may still land, by its lease), its pages
/// free, nothing of it cached, and the session says why.
#[test]
fn hostile_exporters_end_the_import_cleanly() {
    runtime().block_on(async {
        let mut c = config(2, 6, None);
        c.transfer.lease_ms = 1500; // the ticket's write window: 750 ms
        let (a, b) = (engine(config(2, 6, None), 1).await, engine(c, 1).await);
        let p: Vec<TokenId> = (0..4 * 64 + 1).map(|t| TokenId(300_000 + t)).collect();
        prefill(&a, RequestId(1), SCOPE, &p).await;
        let export = a
            .transfer()
            .export(RequestId(1), SCOPE, &p[..256])
            .await
            .unwrap();
        let cases = [
            Exporter::Fails,
            Exporter::FailsInFlight,
            Exporter::Silent,
            Exporter::Hangs,
            Exporter::WritesNothing,
            Exporter::LiesAboutTheBytes,
            Exporter::ShortDigests,
            Exporter::OtherImport,
            Exporter::HugeFrame,
        ];
        for (i, case) in cases.into_iter().enumerate() {
            let id = RequestId(100 + i as u64);
            let (wa, wb) = tokio::io::duplex(1 << 20);
            let options = SessionOptions::with_digests();
            // SAFETY: engine `b` runs until after the session is dropped (end of this
            // round); the wire is in-memory, to the fake exporter.
            let (fake, real) = tokio::join!(fake_open(wa, honest_hello(true)), unsafe {
                TransferSession::open(
                    &b,
                    Box::new(LocalTransport::new("real")),
                    Wire::new(wb),
                    options,
                )
            });
            let (mut w, mut t, peer) = fake;
            let mut session = real.unwrap();
            w.send(&SessionMsg::Offer {
                export: export.clone(),
            })
            .await
            .unwrap();
            let offer = session.next_offer().await.unwrap().unwrap();
            let ticket = session.begin(id, SCOPE, &p, &offer).await.unwrap().unwrap();
            let exporter = async move {
                let SessionMsg::Ticket {
                    ticket: Some(t2), ..
                } = w.recv().await.unwrap()
                else {
                    panic!("{case:?}: no ticket");
                };
                let written = |digests: Vec<BlockDigest>, import: RequestId| SessionMsg::Written {
                    export: t2.export,
                    import,
                    report: Default::default(),
                    digests: Some(digests),
                };
                let four = vec![BlockDigest([0; 32]); 4];
                match case {
                    Exporter::Fails | Exporter::FailsInFlight => w
                        .send(&SessionMsg::Failed {
                            export: t2.export,
                            why: "the link went down".into(),
                            in_flight: matches!(case, Exporter::FailsInFlight),
                        })
                        .await
                        .unwrap(),
                    Exporter::Silent => {
                        // Keep the connection open past the ticket's deadline.
                        tokio::time::sleep(Duration::from_millis(1200)).await;
                    }
                    Exporter::Hangs => drop(w),
                    Exporter::WritesNothing => w.send(&written(four, t2.id)).await.unwrap(),
                    Exporter::LiesAboutTheBytes => {
                        w.send(&written(four, t2.id)).await.unwrap();
                        let note = format!("dsa-kv/transfer/{}/{}", t2.export, t2.id.0);
                        t.write(&peer, &[], note.as_bytes()).unwrap();
                    }
                    Exporter::ShortDigests => w
                        .send(&written(vec![BlockDigest([0; 32])], t2.id))
                        .await
                        .unwrap(),
                    Exporter::OtherImport => w
                        .send(&written(four, RequestId(t2.id.0 + 1)))
                        .await
                        .unwrap(),
                    Exporter::HugeFrame => {
                        use tokio::io::AsyncWriteExt;
                        let s = w.get_mut();
                        s.write_all(&(1u64 << 40).to_le_bytes()).await.unwrap();
                        s.write_all(b"{\"Written\":").await.unwrap();
                    }
                }
                t
            };
            let (outcome, _t) = tokio::join!(session.finish(&ticket), exporter);
            let outcome = outcome.unwrap();
            match (case, &outcome) {
                (
                    Exporter::Fails,
                    ImportOutcome::Aborted {
                        reason: AbortReason::PeerFailed { .. },
                    },
                )
                | (Exporter::FailsInFlight, ImportOutcome::LeftToLease { .. })
                | (
                    Exporter::WritesNothing,
                    ImportOutcome::Aborted {
                        reason: AbortReason::NoNotification,
                    },
                )
                | (
                    Exporter::LiesAboutTheBytes,
                    ImportOutcome::Aborted {
                        reason: AbortReason::DigestsDiffer { block: 0 },
                    },
                )
                | (
                    Exporter::Silent
                    | Exporter::Hangs
                    | Exporter::ShortDigests
                    | Exporter::OtherImport
                    | Exporter::HugeFrame,
                    ImportOutcome::Aborted {
                        reason: AbortReason::PeerGone { .. },
                    },
                ) => {}
                _ => panic!("{case:?}: {outcome:?}"),
            }
            if matches!(case, Exporter::FailsInFlight) {
                // The pages stay reserved until the lease ends them.
                assert_eq!(b.stats().await.unwrap().transfers.open_imports, 1);
                tokio::time::sleep(Duration::from_millis(1700)).await;
            }
            drop(session);
            let st = b.stats().await.unwrap();
            assert_eq!(st.transfers.open_imports, 0, "{case:?}");
            let c = b.check_invariants().await.unwrap();
            assert_eq!(
                (c.live_sequences, c.gpu_slots_used),
                (0, 0),
                "{case:?}: pages freed"
            );
            assert_eq!(
                b.probe_reuse(SCOPE, &p).await.unwrap(),
                0,
                "{case:?}: nothing cached"
            );
        }
        a.transfer().release_export(RequestId(1)).await.unwrap();
        a.shutdown().await;
        b.shutdown().await;
    });
}

/// How a hostile or broken importer answers an offer.
#[derive(Clone, Copy, Debug)]
enum Importer {
    /// A ticket for another export.
    OtherExport,
    /// A ticket whose pages lie outside every pool it announced.
    ForgedPages,
    /// No ticket (no room).
    Declines,
    /// Closes the connection.
    Hangs,
    /// Something other than a ticket.
    Garbage,
}

/// A hostile or broken importer cannot keep the exporter's blocks pinned or make it
/// write outside the importer's announced pools: every hand-over ends with a typed
/// error (or `Declined`), the exporter tells the peer when it failed, and the export is
/// released.
#[test]
fn hostile_importers_cannot_keep_the_export() {
    runtime().block_on(async {
        let a = engine(config(2, 6, None), 1).await;
        let p: Vec<TokenId> = (0..4 * 64 + 1).map(|t| TokenId(400_000 + t)).collect();
        prefill(&a, RequestId(1), SCOPE, &p).await;
        for (i, case) in [
            Importer::OtherExport,
            Importer::ForgedPages,
            Importer::Declines,
            Importer::Hangs,
            Importer::Garbage,
        ]
        .into_iter()
        .enumerate()
        {
            let id = RequestId(10 + i as u64);
            let export = a.transfer().export(id, SCOPE, &p[..256]).await.unwrap();
            let (wa, wb) = tokio::io::duplex(1 << 20);
            // SAFETY: engine `a` runs until after the session is dropped; the wire is
            // in-memory, to the fake importer.
            let (real, fake) = tokio::join!(
                unsafe {
                    TransferSession::open(
                        &a,
                        Box::new(LocalTransport::new("real")),
                        Wire::new(wa),
                        SessionOptions::default(),
                    )
                },
                fake_open(wb, honest_hello(false))
            );
            let mut session = real.unwrap();
            let (mut w, _t, _peer) = fake;
            let importer = async move {
                let SessionMsg::Offer { export: offer } = w.recv().await.unwrap() else {
                    panic!("{case:?}: no offer");
                };
                let forged = ImportTicket {
                    id: RequestId(7),
                    export: offer.id,
                    skipped: 0,
                    layout: offer.layout.clone(),
                    pools: offer.pools.clone(),
                    blocks: offer.blocks.clone(),
                    tail: offer.tail.clone(),
                    write_within_ms: 1000,
                    write_by: None,
                };
                let reply = match case {
                    Importer::OtherExport => Some(SessionMsg::Ticket {
                        export: RequestId(offer.id.0 + 1),
                        ticket: Some(forged),
                        why: None,
                    }),
                    Importer::ForgedPages => Some(SessionMsg::Ticket {
                        export: offer.id,
                        ticket: Some(forged),
                        why: None,
                    }),
                    Importer::Declines => Some(SessionMsg::Ticket {
                        export: offer.id,
                        ticket: None,
                        why: Some("no room".into()),
                    }),
                    Importer::Hangs => None,
                    Importer::Garbage => Some(SessionMsg::Bye),
                };
                if let Some(m) = reply {
                    w.send(&m).await.unwrap();
                    // Whatever the exporter says next (a `Failed`), then the end.
                    let _ = w
                        .recv_within::<SessionMsg>(Duration::from_millis(200))
                        .await;
                }
            };
            let (handed, ()) = tokio::join!(session.hand_over(&export), importer);
            match (case, &handed) {
                (Importer::Declines, Ok(HandOver::Declined { why })) => assert_eq!(why, "no room"),
                (
                    Importer::OtherExport | Importer::Garbage,
                    Err(SessionError::Unexpected { .. }),
                )
                | (Importer::ForgedPages, Err(SessionError::Plan(_)))
                | (Importer::Hangs, Err(SessionError::Wire(_))) => {}
                _ => panic!("{case:?}: {handed:?}"),
            }
            drop(session);
            let st = a.stats().await.unwrap();
            assert_eq!(
                st.transfers.open_exports, 0,
                "{case:?}: the export is released"
            );
        }
        assert_eq!(a.check_invariants().await.unwrap().live_sequences, 0);
        a.shutdown().await;
    });
}

/// The handshake refuses a peer of another protocol version, with other digest
/// settings or another transport, or one that does not start with `Hello`: typed
/// errors, and nothing registered stays behind (the transport is dropped with the
/// failed open).
#[test]
fn a_handshake_with_a_mismatched_peer_is_refused() {
    runtime().block_on(async {
        let a = engine(config(2, 6, None), 1).await;
        type Hello = Box<dyn FnOnce(Vec<u8>) -> SessionMsg>;
        let cases: Vec<(&str, Hello)> = vec![
            (
                "version",
                Box::new(|metadata| SessionMsg::Hello {
                    protocol: PROTOCOL_VERSION + 1,
                    transport: "local".into(),
                    metadata,
                    regions: Vec::new(),
                    digests: true,
                }),
            ),
            ("digests", Box::new(honest_hello(false))),
            (
                "transport",
                Box::new(|metadata| SessionMsg::Hello {
                    protocol: PROTOCOL_VERSION,
                    transport: "nixl/UCX".into(),
                    metadata,
                    regions: Vec::new(),
                    digests: true,
                }),
            ),
            ("not a Hello", Box::new(|_| SessionMsg::Bye)),
        ];
        for (what, hello) in cases {
            let (wa, wb) = tokio::io::duplex(1 << 20);
            // SAFETY: engine `a` runs until after the (failed) session is dropped.
            let (real, _fake) = tokio::join!(
                unsafe {
                    TransferSession::open(
                        &a,
                        Box::new(LocalTransport::new("real")),
                        Wire::new(wa),
                        SessionOptions::with_digests(),
                    )
                },
                fake_open(wb, hello)
            );
            let e = real.err().unwrap_or_else(|| panic!("{what}: accepted"));
            let ok = match what {
                "version" => matches!(e, SessionError::Version { .. }),
                "digests" => e.to_string().contains("page digests are on here and off"),
                "transport" => e.to_string().contains("\"nixl/UCX\""),
                _ => matches!(
                    e,
                    SessionError::Unexpected {
                        expected: "Hello",
                        ..
                    }
                ),
            };
            assert!(ok, "{what}: {e}");
        }
        a.shutdown().await;
    });
}

/// Both engines keep serving while a transfer is open: the exporter runs three more
/// requests under eviction pressure (it evicts and offloads other cached blocks, more
/// recently used than the exported ones), the importer runs its own request between
/// reserving pages and committing them. The exported pages' bytes do not change while
/// exported, the reserved pages hold exactly the exporter's bytes at the commit, the
/// import is served afterwards, and both engines keep their invariants. (The pins
/// themselves are proven by `core::transfer_tests`: removing the pin check from
/// `is_evictable` fails those, not this test, whose engine finds room without moving
/// held pages.)
#[test]
fn transfers_overlap_with_serving_on_both_engines() {
    use dsa_kv::core::scheduler::SubmitRequest;
    use dsa_kv::transfer::push_plan;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // Sequences up to 640 tokens; 28 blocks per engine (target and draft alike).
        // A host tier too: a held page could be offloaded there, unless it is pinned.
        let start = || engine(config(2, 6, Some(64 << 20)), 1);
        let (a, b) = (start().await, start().await);
        let (ra, rb) = (
            a.transfer().regions().await.unwrap(),
            b.transfer().regions().await.unwrap(),
        );
        // SAFETY: the engines' own pools, alive until the end of this block (the
        // transports are dropped first); only pages an import reserved are written.
        let (mut ta, mut tb) = (LocalTransport::new("ov-a"), LocalTransport::new("ov-b"));
        let (peer, peer_a) = unsafe { link_pair(&mut ta, &mut tb, &ra, &rb) }.unwrap();
        let prompt = |id: u32, blocks: u32| -> Vec<TokenId> {
            (0..blocks * 64 + 1)
                .map(|t| TokenId(id * 100_000 + t))
                .collect()
        };
        let submit = |kv: &dsa_kv::actors::KvCacheHandle, id: u64, p: Vec<TokenId>| {
            let kv = kv.clone();
            async move {
                kv.submit(SubmitRequest {
                    id: RequestId(id),
                    scope: SCOPE,
                    prompt: p,
                    max_new_tokens: 8,
                    priority: 35,
                })
                .await
                .unwrap()
            }
        };
        let finish = |kv: &dsa_kv::actors::KvCacheHandle| {
            let kv = kv.clone();
            async move {
                for _ in 0..10_000 {
                    if !step_once(&kv).await.unwrap() {
                        return;
                    }
                }
                panic!("the engine did not finish its requests");
            }
        };
        // Engine A prefills request 1 (4 blocks), then requests 5 and 6 (4 blocks each,
        // cached after them), and exports request 1's blocks: the least recently used
        // ones, the first an eviction would pick if pins did not hold.
        let p1 = prompt(1, 4);
        submit(&a, 1, p1.clone()).await;
        finish(&a).await;
        for id in [5, 6] {
            submit(&a, id, prompt(id as u32, 4)).await;
            finish(&a).await;
        }
        let export = a
            .transfer()
            .export(RequestId(1), SCOPE, &p1[..256])
            .await
            .unwrap();
        assert_eq!(export.blocks.len(), 4);
        // SAFETY: A's pools; the blocks are pinned by the export until released below.
        let pinned = unsafe { host_block_digests(&ra, &export.blocks, &[]) }.unwrap();
        // A serves requests 2, 4 and 7 (10 blocks each with their tokens) while the
        // export is open: 12 of its 28 blocks are cached (4 pinned), so A must evict and
        // offload around the pins (the export's held pages would be next if they were
        // not pinned).
        submit(&a, 2, prompt(2, 9)).await;
        submit(&a, 4, prompt(4, 9)).await;
        submit(&a, 7, prompt(7, 9)).await;
        for _ in 0..3 {
            step_once(&a).await.unwrap();
        }
        // B serves request 3 and reserves pages for the import in the middle of it.
        submit(&b, 3, prompt(3, 6)).await;
        step_once(&b).await.unwrap();
        let id1 = RequestId(1);
        let mut ticket = None;
        for attempt in 0..4 {
            if attempt > 0 {
                step_once(&b).await.unwrap();
            }
            ticket = b
                .transfer()
                .begin_import_with(&mut tb, &peer_a, &rb, id1, SCOPE, &p1, &export)
                .await
                .unwrap();
            if ticket.is_some() {
                break;
            }
        }
        let ticket = ticket.expect("B found room for the import");
        for _ in 0..2 {
            step_once(&a).await.unwrap();
            step_once(&b).await.unwrap();
        }
        let plan = plan_writes(&export, &ra, &ticket, &rb).unwrap();
        push_plan(&mut ta, &peer, &ticket, &plan, b"req-1").unwrap();
        // SAFETY: as above: still pinned.
        let before_release = unsafe { host_block_digests(&ra, &export.blocks, &[]) }.unwrap();
        assert_eq!(before_release, pinned, "A's serving changed pinned pages");
        a.transfer().release_export(RequestId(1)).await.unwrap();
        assert!(tb
            .take_notifications()
            .unwrap()
            .iter()
            .any(|(_, m)| m == b"req-1"));
        // B keeps serving request 3 between the bytes landing and the commit.
        step_once(&b).await.unwrap();
        // SAFETY: B's pools; the import's reserved pages, whose bytes have landed.
        let landed = unsafe { host_block_digests(&rb, &ticket.blocks, &[]) }.unwrap();
        assert_eq!(landed, pinned, "the reserved pages differ from the export");
        b.transfer().commit_import_with(&mut tb, id1).await.unwrap();
        finish(&a).await;
        finish(&b).await;
        assert_eq!(b.probe_reuse(SCOPE, &p1).await.unwrap(), 256);
        // The pressure was real: A evicted (or offloaded) blocks of request 5, which
        // were more recently used than the pinned ones.
        let sa = a.stats().await.unwrap();
        let r5 = a.probe_reuse(SCOPE, &prompt(5, 4)).await.unwrap();
        eprintln!(
            "A: request 5 would reuse {r5} tokens; {} bytes offloaded",
            sa.offload_bytes
        );
        assert!(
            r5 < 256 || sa.offload_bytes > 0,
            "no eviction happened: {sa:?}"
        );
        a.check_invariants().await.unwrap();
        b.check_invariants().await.unwrap();
        drop((ta, tb));
        a.shutdown().await;
        b.shutdown().await;
    });
}

/// The audit's cross-tenant poisoning, both halves. (a) An import is bound to the
/// request the importer serves: blocks a peer computed under another tenant's salt (the
/// victim's), under its own scope, or for other tokens are refused before anything is
/// reserved, and the victim's scope on the importer holds nothing. Before the fix,
/// `begin_import` took the scope and tokens from the export itself, so the first of
/// these was accepted and the victim's next request reused the planted blocks. The
/// legitimate case, the importer serving the victim's own request, is accepted. (b) A
/// write aimed at the importer's committed pages — registered memory outside every
/// open window — is refused by the receiving side and the pages keep their bytes.
#[test]
fn an_import_is_bound_to_the_request_the_importer_serves() {
    use dsa_kv::core::scheduler::SubmitRequest;
    use dsa_kv::core::ReuseScope;
    use dsa_kv::transfer::{push, ImportTicket};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let start = || engine(config(2, 6, None), 1);
        let (a, b) = (start().await, start().await);
        let victim = ReuseScope {
            lora_id: None,
            salt: Some(0xbeef),
        };
        let attacker = ReuseScope {
            lora_id: None,
            salt: Some(7),
        };
        let p: Vec<TokenId> = (0..4 * 64 + 1).map(|t| TokenId(5000 + t)).collect();
        a.submit(SubmitRequest {
            id: RequestId(1),
            scope: victim,
            prompt: p.clone(),
            max_new_tokens: 2,
            priority: 35,
        })
        .await
        .unwrap();
        while step_once(&a).await.unwrap() {}
        // A hostile exporter's offer: the victim's blocks, with keys for its salt.
        let export = a
            .transfer()
            .export(RequestId(1), victim, &p[..256])
            .await
            .unwrap();
        assert_eq!((export.scope, export.blocks.len()), (victim, 4));
        for scope in [attacker, ReuseScope::SHARED] {
            let e = b
                .transfer()
                .begin_import(RequestId(9), scope, &p, &export)
                .await
                .unwrap_err();
            assert!(e.to_string().contains("block 0's key"), "{e}");
        }
        let other: Vec<TokenId> = (0..257).map(|t| TokenId(9000 + t)).collect();
        let e = b
            .transfer()
            .begin_import(RequestId(9), victim, &other, &export)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("block 0's key"), "{e}");
        let e = b
            .transfer()
            .begin_import(RequestId(9), victim, &p[..100], &export)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("has 100 tokens"), "{e}");
        let c = b.check_invariants().await.unwrap();
        assert_eq!(
            (c.live_sequences, c.gpu_slots_used),
            (0, 0),
            "nothing reserved"
        );
        assert_eq!(b.probe_reuse(victim, &p).await.unwrap(), 0);

        // The importer serves the victim's own request: accepted, and only the victim
        // reuses it.
        let (ra, rb) = (
            a.transfer().regions().await.unwrap(),
            b.transfer().regions().await.unwrap(),
        );
        // SAFETY: the engines' own pools, alive until the end of this block (the
        // transports are dropped first); the windows admit only reserved pages.
        let (mut ta, mut tb) = (LocalTransport::new("bind-a"), LocalTransport::new("bind-b"));
        let (peer, peer_a) = unsafe { link_pair(&mut ta, &mut tb, &ra, &rb) }.unwrap();
        let ticket = b
            .transfer()
            .begin_import_with(&mut tb, &peer_a, &rb, RequestId(9), victim, &p, &export)
            .await
            .unwrap()
            .expect("room");
        push(&mut ta, &peer, &export, &ra, &ticket, &rb, b"req-9").unwrap();
        assert_eq!(
            b.transfer()
                .commit_import_with(&mut tb, RequestId(9))
                .await
                .unwrap(),
            4
        );
        assert_eq!(b.probe_reuse(victim, &p).await.unwrap(), 256);
        assert_eq!(b.probe_reuse(attacker, &p).await.unwrap(), 0);
        assert_eq!(b.probe_reuse(ReuseScope::SHARED, &p).await.unwrap(), 0);

        // (b) A write aimed at B's committed pages.
        let held = b
            .transfer()
            .export(RequestId(20), victim, &p[..256])
            .await
            .unwrap();
        // SAFETY: B's pools; the pages are pinned by this export.
        let before = unsafe { host_block_digests(&rb, &held.blocks, &[]) }.unwrap();
        let forged = ImportTicket {
            id: RequestId(21),
            export: export.id,
            skipped: 0,
            layout: export.layout.clone(),
            pools: export.pools.clone(),
            blocks: held.blocks.clone(),
            tail: Vec::new(),
            write_within_ms: 0,
            write_by: None,
        };
        let e = push(&mut ta, &peer, &export, &ra, &forged, &rb, b"poison").unwrap_err();
        assert!(e.to_string().contains("no open window"), "{e}");
        // SAFETY: as above.
        let after = unsafe { host_block_digests(&rb, &held.blocks, &[]) }.unwrap();
        assert_eq!(before, after, "a committed page changed");
        assert!(tb
            .take_notifications()
            .unwrap()
            .iter()
            .all(|(_, m)| m != b"poison"));
        b.transfer().release_export(RequestId(20)).await.unwrap();
        a.transfer().release_export(RequestId(1)).await.unwrap();
        for e in [&a, &b] {
            assert_eq!(e.check_invariants().await.unwrap().live_sequences, 0);
        }
        drop((ta, tb));
        a.shutdown().await;
        b.shutdown().await;
    });
}

/// The audit's lease finding: an exporter that dies after the ticket left the importer's
/// reserved pages held forever. Now the import's lease (here 400 ms) runs out on an idle
/// engine (the coordinator's timer), its pages return, `stats()` counts it, the window
/// closes a margin before, and the late commit is told `TransferExpired`. An export
/// nobody releases ends the same way. A renewal keeps a transfer alive past its first
/// lease.
#[test]
fn leases_free_what_a_dead_peer_left() {
    use dsa_kv::core::scheduler::SubmitRequest;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = config(2, 6, None);
        c.transfer.lease_ms = 400;
        let (a, b) = (engine(c.clone(), 1).await, engine(c, 1).await);
        let p: Vec<TokenId> = (0..4 * 64 + 1).map(|t| TokenId(700 + t)).collect();
        a.submit(SubmitRequest {
            id: RequestId(1),
            scope: SCOPE,
            prompt: p.clone(),
            max_new_tokens: 2,
            priority: 35,
        })
        .await
        .unwrap();
        while step_once(&a).await.unwrap() {}
        let export = a
            .transfer()
            .export(RequestId(1), SCOPE, &p[..256])
            .await
            .unwrap();
        let ticket = b
            .transfer()
            .begin_import(RequestId(1), SCOPE, &p, &export)
            .await
            .unwrap()
            .expect("room");
        assert_eq!(ticket.blocks.len(), 4);
        // The window's deadline: the lease less the drain margin (half of 400 ms).
        assert!(
            (150..=200).contains(&ticket.write_within_ms),
            "{}",
            ticket.write_within_ms
        );
        let held = b.check_invariants().await.unwrap().gpu_slots_used;
        assert_eq!(
            held, 4,
            "4 blocks reserved (the draft cache mirrors the slots)"
        );
        // A renewal at 300 ms keeps the export alive until 700 ms.
        let t0 = std::time::Instant::now();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        a.transfer().renew(RequestId(1)).await.unwrap();
        // Nobody writes, nobody commits: the "dead exporter". At 500 ms the import's
        // lease (400 ms, checked every 40 ms) has run out.
        tokio::time::sleep(std::time::Duration::from_millis(500).saturating_sub(t0.elapsed()))
            .await;
        let sb = b.stats().await.unwrap();
        assert_eq!(
            (sb.transfers.open_imports, sb.transfers.expired_imports),
            (0, 1)
        );
        let cb = b.check_invariants().await.unwrap();
        assert_eq!(
            (cb.live_sequences, cb.gpu_slots_used),
            (0, 0),
            "the pages are back"
        );
        let e = b.transfer().commit_import(RequestId(1)).await.unwrap_err();
        assert!(
            matches!(
                e,
                RuntimeError::Scheduler(SchedError::TransferExpired { id: RequestId(1) })
            ),
            "{e}"
        );
        let sa = a.stats().await.unwrap();
        assert_eq!(
            sa.transfers.open_exports, 1,
            "the renewed export still lives"
        );
        tokio::time::sleep(std::time::Duration::from_millis(400)).await;
        let sa = a.stats().await.unwrap();
        assert_eq!(
            (sa.transfers.open_exports, sa.transfers.expired_exports),
            (0, 1)
        );
        assert_eq!(a.check_invariants().await.unwrap().live_sequences, 0);
        assert!(matches!(
            a.transfer().release_export(RequestId(1)).await,
            Err(RuntimeError::Scheduler(SchedError::TransferExpired { .. }))
        ));
        a.shutdown().await;
        b.shutdown().await;
    });
}
