//! Prefill / decode disaggregation through the runtime, in one process over the local
//! transport (the NIXL transport has its own two-process test and the `disagg` example):
//!
//! * a request prefilled on one engine and decoded on another gives exactly the unpaged
//!   reference's tokens, outputs and draft proposals, every block's bytes arrive
//!   unchanged, and the decode engine reuses the imported blocks (shared blocks already
//!   there are skipped);
//! * leaving the indexer pools, or the draft cache, out of the transfer is caught;
//! * a failed or partial transfer leaves both engines clean, and bad imports are refused;
//! * both engines keep serving other requests while a transfer is open.
#[path = "../examples/disagg/protocol.rs"]
mod disagg;

use disagg::{prompt, run_in_process, Engine, Setup, SCOPE};
use dsa_kv::actors::RuntimeError;
use dsa_kv::core::scheduler::SchedError;
use dsa_kv::core::{BlockKey, KvError};
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::transfer::{
    plan_writes, KvTransport, LocalTransport, MemRegion, PeerId, TransportError, WriteBatch,
    WriteReport,
};

#[test]
fn prefilled_here_decoded_there_is_exact() {
    let r = run_in_process(&Setup::default()).unwrap();
    assert!(r.exact, "{r:#?}");
    assert_eq!(r.requests.len(), 3);
    for (i, q) in r.requests.iter().enumerate() {
        assert!(
            q.digests_match && q.problems.is_empty(),
            "request {i}: {q:#?}"
        );
        let full = prompt(i as u64).len() / 64 * 64;
        assert_eq!(q.exported_blocks, full / 64);
        assert!(q.decode_reused_tokens >= full as u64, "the import is used");
        // Request 0 brings everything; the others share its 3-block system prompt.
        let skipped = if i == 0 { 0 } else { 3 };
        assert_eq!(q.transfer.skipped, skipped);
        assert_eq!(q.imported_blocks as usize, full / 64 - skipped as usize);
        // Pages: blocks × (target + draft cache); two pools each (MLA rows, indexer).
        assert_eq!(q.transfer.pages, 2 * q.imported_blocks as u64);
        assert_eq!(q.transfer.uncoalesced, 2 * q.transfer.pages as usize);
        // Fresh slots on a fresh engine are contiguous: one descriptor per pool.
        assert_eq!(q.transfer.write.descriptors, 4, "request {i}");
    }
}

/// The mutation drill: a transfer that leaves the indexer pools or the draft cache out
/// is caught by the page digests (host backend), and the import is aborted: nothing of
/// it enters the decode engine's cache (before, the digests differed and the blocks
/// were committed anyway), which then recomputes the prompt and decodes it exactly.
#[test]
fn leaving_out_the_indexer_or_the_draft_cache_is_caught_and_aborted() {
    for drop in ["index_key", "draft"] {
        let r = run_in_process(&Setup {
            requests: 1,
            drop: Some(drop.into()),
            ..Setup::default()
        })
        .unwrap();
        let q = &r.requests[0];
        assert!(!r.exact && !q.digests_match, "dropping {drop}: {q:#?}");
        assert_eq!(
            q.imported_blocks, 0,
            "dropping {drop}: the import was aborted"
        );
        assert!(
            q.decode_reused_tokens < 64 * q.exported_blocks as u64,
            "dropping {drop}: the decode engine served what it did not import: {q:#?}"
        );
        assert!(
            q.problems.is_empty(),
            "dropping {drop}: recomputed, the decode is exact: {:?}",
            q.problems
        );
    }
}

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
    let s = Setup::default();
    let model = disagg::model(s.layers).unwrap();
    let a = Engine::start(model.clone(), &s, 0).await.unwrap();
    let b = Engine::start(model.clone(), &s, 0).await.unwrap();
    let p = prompt(0);
    let id = RequestId(0);
    a.generate(id, &p, 1).await.unwrap();
    let toks: Vec<TokenId> = p[..256].iter().map(|&t| TokenId(t)).collect();
    let mut probe = toks.clone();
    probe.push(TokenId(1));
    let cached_a = a.kv.probe_reuse(SCOPE, &probe).await.unwrap();
    assert_eq!(cached_a, 256);

    let (ra, rb) = (
        a.kv.transfer().regions().await.unwrap(),
        b.kv.transfer().regions().await.unwrap(),
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

    let export = a.kv.transfer().export(id, SCOPE, &toks).await.unwrap();
    assert_eq!(export.blocks.len(), 4);
    // The export's id is taken while it lives: a request with it is refused.
    let dup =
        a.kv.submit(dsa_kv::core::scheduler::SubmitRequest {
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
    let ticket =
        b.kv.transfer()
            .begin_import_with(&mut tb, &peer_a, &rb, id, SCOPE, &toks, &export)
            .await
            .unwrap()
            .unwrap();
    assert_eq!((ticket.skipped, ticket.blocks.len()), (0, 4));
    // One segment lands, then the link fails: the importer aborts.
    let plan = plan_writes(&export, &ra, &ticket, &rb).unwrap();
    assert!(ta.write(&peer, &plan.batches, b"req-0").is_err());
    b.kv.transfer()
        .abort_import_with(&mut tb, id)
        .await
        .unwrap();
    a.kv.transfer().release_export(id).await.unwrap();
    let cb = b.kv.check_invariants().await.unwrap();
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
    assert_eq!(b.kv.probe_reuse(SCOPE, &probe).await.unwrap(), 0);
    let ca = a.kv.check_invariants().await.unwrap();
    assert_eq!(ca.live_sequences, 0, "the export is released");
    assert_eq!(a.kv.probe_reuse(SCOPE, &probe).await.unwrap(), cached_a);
    // Aborting or releasing again is an error that changes nothing.
    assert!(b.kv.transfer().abort_import(id).await.is_err());
    assert!(a.kv.transfer().release_export(id).await.is_err());

    // Refusals: other keys than ours (another scope), and another engine layout.
    let mut forged = a.kv.transfer().export(id, SCOPE, &toks).await.unwrap();
    forged.blocks[2].key = BlockKey([7; 32]);
    let e =
        b.kv.transfer()
            .begin_import(id, SCOPE, &toks, &forged)
            .await
            .unwrap_err();
    assert!(e.to_string().contains("block 2's key"), "{e}");
    let mut other = forged.clone();
    other.blocks =
        a.kv.transfer()
            .export(RequestId(9), SCOPE, &toks)
            .await
            .unwrap()
            .blocks;
    other.layout = "0123456789abcdef".into();
    let e =
        b.kv.transfer()
            .begin_import(id, SCOPE, &toks, &other)
            .await
            .unwrap_err();
    assert!(matches!(e, RuntimeError::Transfer(_)), "{e}");
    assert_eq!(b.kv.check_invariants().await.unwrap().live_sequences, 0);
    a.kv.transfer().release_export(id).await.unwrap();
    a.kv.transfer().release_export(RequestId(9)).await.unwrap();

    // The same blocks, exported again and complete this time, are committed and used.
    let export = a.kv.transfer().export(id, SCOPE, &toks).await.unwrap();
    let mut ok = LocalTransport::new("a2");
    // SAFETY: as above.
    let (peer, peer_ok) = unsafe {
        ok.register(&ra.iter().map(|r| r.region).collect::<Vec<_>>())
            .unwrap();
        let peer_ok = tb.connect(&ok.local_metadata().unwrap()).unwrap();
        (ok.connect(&tb.local_metadata().unwrap()).unwrap(), peer_ok)
    };
    let ticket =
        b.kv.transfer()
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
        b.kv.transfer()
            .commit_import_with(&mut tb, id)
            .await
            .unwrap(),
        4
    );
    assert_eq!(b.kv.probe_reuse(SCOPE, &probe).await.unwrap(), 256);
    for e in [&a, &b] {
        e.kv.check_invariants().await.unwrap();
    }
    a.kv.transfer().release_export(id).await.unwrap();
    assert_eq!(a.kv.check_invariants().await.unwrap().live_sequences, 0);
}

/// Tensor parallelism: each of two devices holds its own copy of every page; a transfer
/// moves every device's pages to the same device index on the other engine.
#[test]
fn two_device_engines_move_every_devices_pages() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (a, b) = (LocalTransport::new("tp-a"), LocalTransport::new("tp-b"));
    let r = rt
        .block_on(disagg::bench(
            2,
            6,
            "host",
            (0, 0),
            2,
            Box::new(a),
            Box::new(b),
        ))
        .unwrap();
    assert_eq!(r.digests_match, Some(true), "{r:#?}");
    assert_eq!(r.decode_reuse_tokens, 6 * 64);
    // 6 blocks × (target + draft) × 2 devices; 2 pools each, one descriptor per pool run.
    assert_eq!(r.pages, 24);
    assert_eq!(r.uncoalesced, 48);
    assert_eq!(r.descriptors, 8);
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
        let start = || disagg::bench_engine_with(2, 6, "host", 0, 1, Some(64 << 20));
        let (a, b) = (start().await.unwrap(), start().await.unwrap());
        let (ra, rb) = (
            a.transfer().regions().await.unwrap(),
            b.transfer().regions().await.unwrap(),
        );
        // SAFETY: the engines' own pools, alive until the end of this block (the
        // transports are dropped first); only pages an import reserved are written.
        let (mut ta, mut tb) = (LocalTransport::new("ov-a"), LocalTransport::new("ov-b"));
        let (peer, peer_a) = unsafe { disagg::connect_pair(&mut ta, &mut tb, &ra, &rb) }.unwrap();
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
                    if !disagg::step_synthetic(&kv).await.unwrap() {
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
        let pinned = unsafe { disagg::block_digests(&ra, &export.blocks) }.unwrap();
        // A serves requests 2, 4 and 7 (10 blocks each with their tokens) while the
        // export is open: 12 of its 28 blocks are cached (4 pinned), so A must evict and
        // offload around the pins (the export's held pages would be next if they were
        // not pinned).
        submit(&a, 2, prompt(2, 9)).await;
        submit(&a, 4, prompt(4, 9)).await;
        submit(&a, 7, prompt(7, 9)).await;
        for _ in 0..3 {
            disagg::step_synthetic(&a).await.unwrap();
        }
        // B serves request 3 and reserves pages for the import in the middle of it.
        submit(&b, 3, prompt(3, 6)).await;
        disagg::step_synthetic(&b).await.unwrap();
        let id1 = RequestId(1);
        let mut ticket = None;
        for attempt in 0..4 {
            if attempt > 0 {
                disagg::step_synthetic(&b).await.unwrap();
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
            disagg::step_synthetic(&a).await.unwrap();
            disagg::step_synthetic(&b).await.unwrap();
        }
        let plan = plan_writes(&export, &ra, &ticket, &rb).unwrap();
        push_plan(&mut ta, &peer, &ticket, &plan, b"req-1").unwrap();
        // SAFETY: as above: still pinned.
        let before_release = unsafe { disagg::block_digests(&ra, &export.blocks) }.unwrap();
        assert_eq!(before_release, pinned, "A's serving changed pinned pages");
        a.transfer().release_export(RequestId(1)).await.unwrap();
        assert!(tb
            .take_notifications()
            .unwrap()
            .iter()
            .any(|(_, m)| m == b"req-1"));
        // B keeps serving request 3 between the bytes landing and the commit.
        disagg::step_synthetic(&b).await.unwrap();
        // SAFETY: B's pools; the import's reserved pages, whose bytes have landed.
        let landed = unsafe { disagg::block_digests(&rb, &ticket.blocks) }.unwrap();
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
        let start = || disagg::bench_engine_with(2, 6, "host", 0, 1, None);
        let (a, b) = (start().await.unwrap(), start().await.unwrap());
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
        while disagg::step_synthetic(&a).await.unwrap() {}
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
        let (peer, peer_a) = unsafe { disagg::connect_pair(&mut ta, &mut tb, &ra, &rb) }.unwrap();
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
        let before = unsafe { disagg::block_digests(&rb, &held.blocks) }.unwrap();
        let forged = ImportTicket {
            id: RequestId(21),
            export: export.id,
            skipped: 0,
            layout: export.layout.clone(),
            pools: export.pools.clone(),
            blocks: held.blocks.clone(),
            write_within_ms: 0,
            write_by: None,
        };
        let e = push(&mut ta, &peer, &export, &ra, &forged, &rb, b"poison").unwrap_err();
        assert!(e.to_string().contains("no open window"), "{e}");
        // SAFETY: as above.
        let after = unsafe { disagg::block_digests(&rb, &held.blocks) }.unwrap();
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
        let mut c = disagg::bench_config(2, 6, None);
        c.transfer.lease_ms = 400;
        let a = disagg::bench_engine_config(c.clone(), "host", 0, 1)
            .await
            .unwrap();
        let b = disagg::bench_engine_config(c, "host", 0, 1).await.unwrap();
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
        while disagg::step_synthetic(&a).await.unwrap() {}
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
