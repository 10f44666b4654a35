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
mod common;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::transfer::SCOPE;
use dsa_kv::actors::{KvCacheHandle, RuntimeError};
use dsa_kv::config::EngineConfig;
use dsa_kv::core::scheduler::SchedError;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::rng::SplitMix64;
use dsa_kv::transfer::nixl::NixlTransport;
use dsa_kv::transfer::session::{
    AbortReason, ImportOutcome, SessionOptions, TransferSession, Wire,
};
use dsa_kv::transfer::TransportError;
use tokio::net::TcpStream;

const ROLE: &str = "DSA_KV_PD_KILL_ROLE";
const ADDR: &str = "DSA_KV_PD_KILL_ADDR";
const ROUND: &str = "DSA_KV_PD_KILL_ROUND";
const LEASE_MS: u64 = 1500;

fn config() -> EngineConfig {
    let mut c = common::transfer::config(2, 6, None);
    c.transfer.lease_ms = LEASE_MS;
    c
}

/// Both sides' session settings: page digests (host pools), replies within 30 s.
fn options() -> SessionOptions {
    SessionOptions {
        digests: true,
        reply_timeout: Duration::from_secs(30),
    }
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
    common::transfer::prefill(kv, id, SCOPE, prompt).await;
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

/// The session's wire on a connection of this test.
fn wire(s: std::net::TcpStream) -> Wire<TcpStream> {
    s.set_nonblocking(true).unwrap();
    Wire::new(TcpStream::from_std(s).unwrap())
}

/// Starts round `r`'s child in `role` and opens a session with it over a new NIXL agent
/// of ours (registered with `kv`'s pools): the child and the session.
async fn meet(
    listener: &TcpListener,
    role: &str,
    r: u64,
    kv: &KvCacheHandle,
) -> (Child, TransferSession<TcpStream>) {
    let child = spawn_child(role, listener.local_addr().unwrap(), r);
    let (s, _) = listener.accept().unwrap();
    let t = nixl(&format!("pd-kill-{role}-peer-{r}")).expect("NIXL");
    // SAFETY: the engine runs until after the session is dropped (each round drops it
    // before the next; the engine shuts down after the last); the wire is our own
    // connection to our own child. NIXL cannot refuse writes outside the windows: the
    // children are ours, and stopped ones are killed, never resumed.
    let session = unsafe { TransferSession::open(kv, Box::new(t), wire(s), options()) }
        .await
        .unwrap_or_else(|e| panic!("round {r}: no session with the {role}: {e}"));
    (child, session)
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
    if nixl("pd-kill-probe").is_none() {
        return;
    }
    let rt = runtime();
    let mut rng = SplitMix64(seed());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();

    // Scenario 1: the exporter (child) dies; we import.
    let summary = rt.block_on(async {
        let kv = common::transfer::engine(config(), 1).await;
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
            let (child, mut session) = meet(&listener, "exporter", r, &kv).await;
            let offer = session
                .next_offer()
                .await
                .unwrap_or_else(|e| panic!("round {r}: no offer: {e}"))
                .expect("an offer");
            if kill == Kill::BeforeTicket {
                signal(&child, libc::SIGKILL);
            }
            // The request we serve: round r's prompt, as the child exported it.
            let p = prompt(r);
            let id = RequestId(1000 + r);
            let ticket = session
                .begin(id, SCOPE, &p, &offer)
                .await
                .unwrap()
                .expect("room: every round's import ends before the next");
            let _ = session.reply(offer.id, Ok(&ticket)).await;
            match kill {
                Kill::AfterTicket => {
                    std::thread::sleep(Duration::from_micros(rng.next_u64() % 3000));
                    signal(&child, libc::SIGKILL);
                }
                Kill::StoppedAfterTicket => signal(&child, libc::SIGSTOP),
                _ => {}
            }
            let written = session.wait_written(&ticket).await.ok();
            if kill == Kill::AfterWritten {
                signal(&child, libc::SIGKILL);
            }
            let outcome = match written {
                Some(w) => match session.complete(&ticket, &w).await.unwrap() {
                    ImportOutcome::Committed { blocks } => {
                        assert_eq!(blocks, 4);
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
                    }
                    ImportOutcome::Aborted {
                        reason: AbortReason::DigestsDiffer { .. },
                    } => "aborted: digests differ",
                    ImportOutcome::Aborted {
                        reason: AbortReason::NoNotification,
                    } => "aborted: no notification",
                    other => panic!("round {r} ({kill:?}): {other:?}"),
                },
                None if rng.next_u64().is_multiple_of(2) => {
                    // The exporter is gone (or stopped): we abort at once.
                    let o = session
                        .abort(
                            &ticket,
                            AbortReason::PeerGone {
                                why: "killed".into(),
                            },
                        )
                        .await
                        .unwrap();
                    assert!(
                        matches!(o, ImportOutcome::Aborted { .. }),
                        "round {r}: {o:?}"
                    );
                    "aborted: the exporter is gone"
                }
                None => {
                    // Nobody aborts: the lease does.
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
                    "expired"
                }
            };
            let c = kv.check_invariants().await.unwrap();
            assert_eq!(c.live_sequences, 0, "round {r}: the pages are back");
            *outcomes.entry((kill, outcome)).or_default() += 1;
            let _ = session.close().await;
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
    eprintln!("exporter killed: {:?}; {} committed", summary.0, summary.1);
    assert!(
        summary.1 > 0,
        "no round committed: the happy path never ran"
    );

    // Scenario 2: the importer (child) dies; we export.
    let summary = rt.block_on(async {
        let kv = common::transfer::engine(config(), 1).await;
        let mut outcomes: BTreeMap<(Kill, &str), u32> = BTreeMap::new();
        for r in 0..rounds() {
            let kill = [
                Kill::Never,
                Kill::BeforeTicket,
                Kill::AfterTicket,
                Kill::DuringPush,
            ][rng.next_u64() as usize % 4];
            let (child, mut session) = meet(&listener, "importer", r, &kv).await;
            let id = RequestId(2000 + r);
            let p = prompt(r);
            prefill(&kv, id, &p).await;
            let export = kv.transfer().export(id, SCOPE, &p[..256]).await.unwrap();
            session.offer(&export).await.unwrap();
            if kill == Kill::BeforeTicket {
                signal(&child, libc::SIGKILL);
            }
            let ticket = match session.wait_ticket(&export).await {
                Ok(Ok(t)) => Some(t),
                _ => None,
            };
            if kill == Kill::AfterTicket {
                signal(&child, libc::SIGKILL);
            }
            let outcome = match ticket {
                None => "no ticket",
                Some(t) => {
                    let pid = child.id() as i32;
                    let delay = Duration::from_micros(rng.next_u64() % 2000);
                    let killer = (kill == Kill::DuringPush).then(|| {
                        std::thread::spawn(move || {
                            std::thread::sleep(delay);
                            // SAFETY: signals our own child process.
                            unsafe { libc::kill(pid, libc::SIGKILL) };
                        })
                    });
                    let pushed = session.push(&export, &t).await;
                    if let Some(k) = killer {
                        k.join().unwrap();
                    }
                    match pushed {
                        Ok(_) => "pushed",
                        Err(e) if e.in_flight() => "push in flight",
                        Err(_) => "push failed",
                    }
                }
            };
            // Half the time the exporter releases (never while a write may still read
            // the pages: then the lease must); otherwise the lease must.
            if outcome != "push in flight" && rng.next_u64().is_multiple_of(2) {
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
            let _ = session.close().await;
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
    let s = std::net::TcpStream::connect(addr).unwrap();
    let t = nixl(&format!("pd-kill-{role}-{round}")).expect("NIXL");
    runtime().block_on(async move {
        let kv = common::transfer::engine(config(), 1).await;
        // SAFETY: the engine runs until after the session is dropped (this process is
        // killed, or it drops the session before shutting the engine down); the wire
        // is our parent's connection.
        let Ok(mut session) =
            (unsafe { TransferSession::open(&kv, Box::new(t), wire(s), options()) }).await
        else {
            return;
        };
        if role == "exporter" {
            let id = RequestId(round);
            let p = prompt(round);
            prefill(&kv, id, &p).await;
            let export = kv.transfer().export(id, SCOPE, &p[..256]).await.unwrap();
            if session.offer(&export).await.is_ok() {
                let mut in_flight = false;
                if let Ok(Ok(ticket)) = session.wait_ticket(&export).await {
                    match session.push(&export, &ticket).await {
                        Ok(_) => {
                            let _ = session.wait_outcome(&export, &ticket).await;
                        }
                        Err(e) => in_flight = e.in_flight(),
                    }
                }
                // A write that may still read the pages keeps them pinned (the lease ends it).
                if !in_flight {
                    let _ = kv.transfer().release_export(id).await;
                }
            }
        } else if let Ok(Some(offer)) = session.next_offer().await {
            let ticket = session
                .begin(RequestId(round), SCOPE, &prompt(round), &offer)
                .await
                .unwrap();
            match ticket {
                Some(t) => {
                    let _ = session.finish(&t).await;
                }
                None => {
                    let _ = session.reply(offer.id, Err("no room")).await;
                }
            }
        }
        // The parent's Bye (or its end).
        let _ = session
            .wire()
            .recv_within::<dsa_kv::transfer::session::SessionMsg>(Duration::from_secs(60))
            .await;
        drop(session);
        kv.shutdown().await;
    });
}
