//! A Jepsen-style test of prefill / decode transfers between two processes over NIXL
//! (UCX over TCP, host memory): export → import → write → commit in a loop while the
//! other process is killed (SIGKILL) or stopped (SIGSTOP, then killed) at a random
//! point of the protocol, and a new one started for the next round. The test process
//! plays one side for every round and a child process (this binary, the `#[ignore]`d
//! `child` test) the other:
//!
//! * **the exporter dies** (the child exports, the test imports): before the ticket is
//!   sent, just after it (the push may be half done), stopped until the import's lease
//!   has run out, or after its `Written`. The checker: an import is committed only when
//!   the notification arrived and every page's digest equals the exporter's; every
//!   other import ends by its lease (its pages freed, a late commit told
//!   `TransferExpired`); every committed prefix, served at once, is read back by the
//!   runtime's verifier (independent of the transfer: it recomputes each position's KV
//!   from the prompt) with no mismatch; at the end no import is open, the engine's
//!   invariants hold, and a prefix-cache reset leaves no GPU page used;
//! * **the importer dies** (the test exports, the child imports): before its ticket,
//!   after it (the push then meets a dead peer), or during the push. The checker: the
//!   push fails or lands, and the export is released, by the test or by its lease,
//!   so no export pin survives: at the end no export is open and no sequence lives.
//!
//! Leaks: none after the lease (1.5 s here). A stopped exporter that is *resumed* after
//! the importer's lease ran out could, over NIXL, still write pages that were freed
//! (NIXL's writes are one-sided: its target cannot refuse them; the local and NCCL
//! transports close the window first); so stopped exporters are killed, as a crashed
//! host would be.
//!
//! Rounds: `DSA_KV_PD_KILL_ROUNDS` per scenario (default 12); seed `DSA_KV_PD_KILL_SEED`.
//! Needs the NIXL runtime (`.ci/nixl_setup.sh`); skipped without it unless
//! `DSA_KV_REQUIRE_NIXL=1`.
#[path = "../examples/disagg/protocol.rs"]
mod disagg;
#[path = "common/frames.rs"]
mod frames;

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use disagg::SCOPE;
use dsa_kv::actors::{KvCacheHandle, RuntimeError};
use dsa_kv::config::EngineConfig;
use dsa_kv::core::scheduler::{SchedError, SubmitRequest};
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::rng::SplitMix64;
use dsa_kv::transfer::nixl::NixlTransport;
use dsa_kv::transfer::{
    push, ExportedBlocks, ImportTicket, KvTransport, PeerId, PoolRegion, TransportError,
};
use frames::{recv_frame, send_frame};
use serde::{Deserialize, Serialize};

const ROLE: &str = "DSA_KV_PD_KILL_ROLE";
const ADDR: &str = "DSA_KV_PD_KILL_ADDR";
const ROUND: &str = "DSA_KV_PD_KILL_ROUND";
const LEASE_MS: u64 = 1500;

/// The frames both sides exchange.
#[derive(Debug, Serialize, Deserialize)]
enum Msg {
    Hello {
        metadata: Vec<u8>,
        regions: Vec<PoolRegion>,
    },
    Export {
        export: ExportedBlocks,
        prompt: Vec<TokenId>,
    },
    Ticket(Option<ImportTicket>),
    Written {
        digests: Vec<String>,
    },
    Bye,
}

fn send(s: &mut TcpStream, m: &Msg) -> std::io::Result<()> {
    send_frame(s, &serde_json::to_vec(m).expect("serializable"))
}

fn recv(s: &mut TcpStream, within: Duration) -> Result<Msg, String> {
    s.set_read_timeout(Some(within.max(Duration::from_millis(1))))
        .map_err(|e| e.to_string())?;
    let b = recv_frame(s).map_err(|e| e.to_string())?;
    serde_json::from_slice(&b).map_err(|e| e.to_string())
}

fn config() -> EngineConfig {
    let mut c = disagg::bench_config(2, 6, None);
    c.transfer.lease_ms = LEASE_MS;
    c
}

fn rounds() -> u64 {
    std::env::var("DSA_KV_PD_KILL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12)
}

fn seed() -> u64 {
    std::env::var("DSA_KV_PD_KILL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed)
}

/// Round `r`'s prompt: four full blocks of its own plus one token.
fn prompt(r: u64) -> Vec<TokenId> {
    (0..4 * 64 + 1)
        .map(|t| TokenId((r as u32 + 1) * 10_000 + t))
        .collect()
}

fn nixl(name: &str) -> Option<NixlTransport> {
    match NixlTransport::new(name) {
        Ok(t) => Some(t.with_write_timeout(Duration::from_secs(2))),
        Err(TransportError::Unavailable { why, .. }) => {
            assert!(
                std::env::var("DSA_KV_REQUIRE_NIXL").as_deref() != Ok("1"),
                "DSA_KV_REQUIRE_NIXL=1 but NIXL is not available: {why}"
            );
            eprintln!("SKIPPED: NIXL not available: {why}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Prefills `prompt` as request `id` on `kv` (synthetic writer).
async fn prefill(kv: &KvCacheHandle, id: RequestId, prompt: &[TokenId]) {
    kv.submit(SubmitRequest {
        id,
        scope: SCOPE,
        prompt: prompt.to_vec(),
        max_new_tokens: 2,
        priority: 35,
    })
    .await
    .unwrap();
    while disagg::step_synthetic(kv).await.unwrap() {}
}

fn spawn_child(role: &str, addr: std::net::SocketAddr, round: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--ignored"])
        .env(ROLE, role)
        .env(ADDR, addr.to_string())
        .env(ROUND, round.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: signals our own child process.
    unsafe { libc::kill(child.id() as i32, sig) };
}

fn reap(mut child: Child) {
    signal(&child, libc::SIGKILL);
    let _ = child.wait();
}

/// Starts round `r`'s child in `role` and exchanges `Hello`s with it: the child, our
/// connection to it, its transport as our peer, and its pool regions.
fn meet(
    listener: &TcpListener,
    role: &str,
    r: u64,
    t: &mut NixlTransport,
    regions: &[PoolRegion],
) -> (Child, TcpStream, PeerId, Vec<PoolRegion>) {
    let child = spawn_child(role, listener.local_addr().unwrap(), r);
    let (mut s, _) = listener.accept().unwrap();
    let Ok(Msg::Hello {
        metadata,
        regions: theirs,
    }) = recv(&mut s, Duration::from_secs(60))
    else {
        panic!("round {r}: no Hello from the {role}");
    };
    // SAFETY: the child's own metadata.
    let peer = unsafe { t.connect(&metadata) }.unwrap();
    send(
        &mut s,
        &Msg::Hello {
            metadata: t.local_metadata().unwrap(),
            regions: regions.to_vec(),
        },
    )
    .unwrap();
    (child, s, peer, theirs)
}

/// Waits until `f` holds, at most `within`.
async fn eventually(within: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let until = Instant::now() + within;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() > until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The notification `want` from the transport, before `until`.
fn notified(t: &mut NixlTransport, want: &[u8], until: Instant) -> bool {
    loop {
        if t.take_notifications()
            .unwrap_or_default()
            .iter()
            .any(|(_, m)| m == want)
        {
            return true;
        }
        if Instant::now() > until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Where the other side is killed or stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kill {
    Never,
    BeforeTicket,
    AfterTicket,
    StoppedAfterTicket,
    AfterWritten,
    DuringPush,
}

#[test]
fn transfers_survive_either_side_killed_at_random_points() {
    let Some(mut tb) = nixl("pd-kill-importer") else {
        return;
    };
    let rt = runtime();
    let mut rng = SplitMix64(seed());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();

    // Scenario 1: the exporter (child) dies; we import.
    let summary = rt.block_on(async {
        let kv = disagg::bench_engine_config(config(), "host", 0, 1)
            .await
            .unwrap();
        let rb = kv.transfer().regions().await.unwrap();
        // SAFETY: the engine's pools, alive until the end of this block (the transport
        // is dropped after it: its last writes come from children killed by then);
        // writes into them go only to reserved pages (NIXL cannot refuse others: the
        // children are ours).
        unsafe { tb.register(&rb.iter().map(|r| r.region).collect::<Vec<_>>()) }.unwrap();
        let mut outcomes: BTreeMap<(Kill, &str), u32> = BTreeMap::new();
        let mut committed = Vec::new();
        for r in 0..rounds() {
            let kill = [
                Kill::Never,
                Kill::BeforeTicket,
                Kill::AfterTicket,
                Kill::StoppedAfterTicket,
                Kill::AfterWritten,
            ][rng.next_u64() as usize % 5];
            let (child, mut s, peer, _) = meet(&listener, "exporter", r, &mut tb, &rb);
            let Ok(Msg::Export { export, prompt: p }) = recv(&mut s, Duration::from_secs(60))
            else {
                panic!("round {r}: no Export");
            };
            if kill == Kill::BeforeTicket {
                signal(&child, libc::SIGKILL);
            }
            let id = RequestId(1000 + r);
            let ticket = kv
                .transfer()
                .begin_import_with(&mut tb, &peer, &rb, id, SCOPE, &p, &export)
                .await
                .unwrap()
                .expect("room: every round's import ends before the next");
            let _ = send(&mut s, &Msg::Ticket(Some(ticket.clone())));
            match kill {
                Kill::AfterTicket => {
                    std::thread::sleep(Duration::from_micros(rng.next_u64() % 3000));
                    signal(&child, libc::SIGKILL);
                }
                Kill::StoppedAfterTicket => signal(&child, libc::SIGSTOP),
                _ => {}
            }
            let write_by = ticket.write_by.unwrap();
            let written = match recv(&mut s, write_by.saturating_duration_since(Instant::now())) {
                Ok(Msg::Written { digests }) => Some(digests),
                _ => None,
            };
            if kill == Kill::AfterWritten {
                signal(&child, libc::SIGKILL);
            }
            let note = format!("req-{}", export.id.0);
            let landed = written.filter(|_| notified(&mut tb, note.as_bytes(), write_by));
            let outcome = match landed {
                Some(digests) => {
                    // SAFETY: our pools; the import's pages, whose bytes have landed.
                    let ours = unsafe { disagg::block_digests(&rb, &ticket.blocks) }.unwrap();
                    if ours == digests {
                        kv.transfer().commit_import_with(&mut tb, id).await.unwrap();
                        // Served at once (the cache is small: later rounds evict it),
                        // so the runtime's verifier reads every imported position back.
                        assert_eq!(kv.probe_reuse(SCOPE, &p).await.unwrap(), 256);
                        let verified = kv.stats().await.unwrap().tokens_verified;
                        prefill(&kv, RequestId(50_000 + r), &p).await;
                        let st = kv.stats().await.unwrap();
                        assert!(st.tokens_verified > verified, "round {r}: nothing verified");
                        assert_eq!(
                            st.mismatches, 0,
                            "round {r}: an imported page holds wrong bytes"
                        );
                        committed.push(p.clone());
                        "committed"
                    } else {
                        kv.transfer().abort_import_with(&mut tb, id).await.unwrap();
                        "aborted: digests differ"
                    }
                }
                None => {
                    // The exporter is gone (or stopped): nobody aborts; the lease does.
                    let before = kv.stats().await.unwrap().transfers.expired_imports;
                    let expired = eventually(Duration::from_millis(LEASE_MS + 2000), async || {
                        kv.stats().await.unwrap().transfers.expired_imports > before
                    })
                    .await;
                    assert!(
                        expired,
                        "round {r} ({kill:?}): the import's lease did not end"
                    );
                    let e = kv.transfer().commit_import(id).await.unwrap_err();
                    assert!(
                        matches!(
                            e,
                            RuntimeError::Scheduler(SchedError::TransferExpired { .. })
                        ),
                        "round {r}: {e}"
                    );
                    let c = kv.check_invariants().await.unwrap();
                    assert_eq!(c.live_sequences, 0, "round {r}: the pages are back");
                    "expired"
                }
            };
            *outcomes.entry((kill, outcome)).or_default() += 1;
            let _ = send(&mut s, &Msg::Bye);
            reap(child);
        }
        let after = kv.stats().await.unwrap();
        assert_eq!(after.mismatches, 0, "an imported page holds wrong bytes");
        assert_eq!(after.transfers.open_imports, 0);
        assert_eq!(kv.check_invariants().await.unwrap().live_sequences, 0);
        kv.reset_prefix_cache().await.unwrap();
        assert_eq!(kv.check_invariants().await.unwrap().gpu_slots_used, 0);
        kv.shutdown().await;
        (outcomes, committed.len())
    });
    drop(tb);
    eprintln!("exporter killed: {:?}; {} committed", summary.0, summary.1);
    assert!(
        summary.1 > 0,
        "no round committed: the happy path never ran"
    );

    // Scenario 2: the importer (child) dies; we export.
    let Some(mut ta) = nixl("pd-kill-exporter") else {
        return;
    };
    let summary = rt.block_on(async {
        let kv = disagg::bench_engine_config(config(), "host", 0, 1)
            .await
            .unwrap();
        let ra = kv.transfer().regions().await.unwrap();
        // SAFETY: the engine's pools, alive until the end of this block; we only read
        // them (the children write nothing here).
        unsafe { ta.register(&ra.iter().map(|r| r.region).collect::<Vec<_>>()) }.unwrap();
        let mut outcomes: BTreeMap<(Kill, &str), u32> = BTreeMap::new();
        for r in 0..rounds() {
            let kill = [
                Kill::Never,
                Kill::BeforeTicket,
                Kill::AfterTicket,
                Kill::DuringPush,
            ][rng.next_u64() as usize % 4];
            let (child, mut s, peer, regions) = meet(&listener, "importer", r, &mut ta, &ra);
            let id = RequestId(2000 + r);
            let p = prompt(r);
            prefill(&kv, id, &p).await;
            let export = kv.transfer().export(id, SCOPE, &p[..256]).await.unwrap();
            send(
                &mut s,
                &Msg::Export {
                    export: export.clone(),
                    prompt: p.clone(),
                },
            )
            .unwrap();
            if kill == Kill::BeforeTicket {
                signal(&child, libc::SIGKILL);
            }
            let ticket = match recv(&mut s, Duration::from_secs(30)) {
                Ok(Msg::Ticket(Some(t))) => Some(t),
                _ => None,
            };
            if kill == Kill::AfterTicket {
                signal(&child, libc::SIGKILL);
            }
            let pushed = ticket.map(|t| {
                let pid = child.id() as i32;
                let delay = Duration::from_micros(rng.next_u64() % 2000);
                let killer = (kill == Kill::DuringPush).then(|| {
                    std::thread::spawn(move || {
                        std::thread::sleep(delay);
                        // SAFETY: signals our own child process.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    })
                });
                let note = format!("req-{}", export.id.0);
                let r = push(&mut ta, &peer, &export, &ra, &t, &regions, note.as_bytes());
                if let Some(k) = killer {
                    k.join().unwrap();
                }
                r
            });
            let outcome = match &pushed {
                None => "no ticket",
                Some(Ok(_)) => "pushed",
                Some(Err(e)) if e.to_string().contains("in flight") => "push in flight",
                Some(Err(_)) => "push failed",
            };
            // Half the time the exporter releases; otherwise the lease must.
            if rng.next_u64().is_multiple_of(2) {
                kv.transfer().release_export(id).await.unwrap();
            } else {
                let gone = eventually(Duration::from_millis(LEASE_MS + 2000), async || {
                    kv.stats().await.unwrap().transfers.open_exports == 0
                })
                .await;
                assert!(
                    gone,
                    "round {r} ({kill:?}): the export's pins survived its lease"
                );
            }
            *outcomes.entry((kill, outcome)).or_default() += 1;
            let _ = send(&mut s, &Msg::Bye);
            reap(child);
        }
        let st = kv.stats().await.unwrap();
        assert_eq!(st.transfers.open_exports, 0, "no export pin survives");
        let c = kv.check_invariants().await.unwrap();
        assert_eq!(c.live_sequences, 0);
        kv.reset_prefix_cache().await.unwrap();
        assert_eq!(kv.check_invariants().await.unwrap().gpu_slots_used, 0);
        kv.shutdown().await;
        outcomes
    });
    drop(ta);
    eprintln!("importer killed: {summary:?}");
}

/// The other side; only run when spawned by the test above.
#[test]
#[ignore = "the child process of the kill test"]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        eprintln!("child: not spawned by the kill test, nothing to do");
        return;
    };
    let addr = std::env::var(ADDR).unwrap();
    let round: u64 = std::env::var(ROUND).unwrap().parse().unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    let mut t = nixl(&format!("pd-kill-{role}-{round}")).expect("NIXL");
    runtime().block_on(async move {
        let kv = disagg::bench_engine_config(config(), "host", 0, 1)
            .await
            .unwrap();
        let regions = kv.transfer().regions().await.unwrap();
        // SAFETY: the engine's pools, alive until this process ends (it is killed, or
        // it returns after shutting the engine down, the transport first).
        unsafe { t.register(&regions.iter().map(|r| r.region).collect::<Vec<_>>()) }.unwrap();
        send(
            &mut s,
            &Msg::Hello {
                metadata: t.local_metadata().unwrap(),
                regions: regions.clone(),
            },
        )
        .unwrap();
        let Ok(Msg::Hello {
            metadata,
            regions: remote,
        }) = recv(&mut s, Duration::from_secs(60))
        else {
            return;
        };
        // SAFETY: the parent's own metadata.
        let peer = unsafe { t.connect(&metadata) }.unwrap();
        let wait = Duration::from_secs(60);
        if role == "exporter" {
            let id = RequestId(round);
            let p = prompt(round);
            prefill(&kv, id, &p).await;
            let export = kv.transfer().export(id, SCOPE, &p[..256]).await.unwrap();
            send(
                &mut s,
                &Msg::Export {
                    export: export.clone(),
                    prompt: p,
                },
            )
            .unwrap();
            if let Ok(Msg::Ticket(Some(ticket))) = recv(&mut s, wait) {
                kv.transfer().renew(id).await.unwrap();
                let note = format!("req-{}", export.id.0);
                if push(
                    &mut t,
                    &peer,
                    &export,
                    &regions,
                    &ticket,
                    &remote,
                    note.as_bytes(),
                )
                .is_ok()
                {
                    let skip = ticket.skipped as usize;
                    // SAFETY: our pools, pinned by the export until released below.
                    let digests =
                        unsafe { disagg::block_digests(&regions, &export.blocks[skip..]) }.unwrap();
                    let _ = send(&mut s, &Msg::Written { digests });
                }
                let _ = kv.transfer().release_export(id).await;
            }
        } else {
            let Ok(Msg::Export { export, prompt: p }) = recv(&mut s, wait) else {
                return;
            };
            let id = RequestId(round);
            let ticket = kv
                .transfer()
                .begin_import_with(&mut t, &peer, &regions, id, SCOPE, &p, &export)
                .await
                .unwrap();
            let _ = send(&mut s, &Msg::Ticket(ticket.clone()));
            if ticket.is_some() {
                let note = format!("req-{}", export.id.0);
                if notified(&mut t, note.as_bytes(), Instant::now() + wait) {
                    let _ = kv.transfer().commit_import_with(&mut t, id).await;
                }
            }
        }
        let _ = recv(&mut s, wait);
        drop(t);
        kv.shutdown().await;
    });
}
