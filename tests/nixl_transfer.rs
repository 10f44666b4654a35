//! NIXL between two processes: the test spawns itself (the `#[ignore]`d `child_target`
//! test, selected with `--exact --ignored` and told its scenario and the parent's address
//! through the environment) as the decode side, exchanges metadata over a TCP socket on
//! 127.0.0.1, and writes into the child's registered host buffer through UCX.
//!
//! Needs the NIXL runtime (see `dsa_kv::transfer::nixl`; `.ci/nixl_setup.sh` prints the
//! exports). Without it the tests print `SKIPPED: NIXL not available: ...` and pass,
//! unless `DSA_KV_REQUIRE_NIXL=1`, where they fail with that message.

#[path = "common/frames.rs"]
mod frames;

use frames::{pattern, recv_frame, send_frame};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dsa_kv::transfer::nixl::NixlTransport;
use dsa_kv::transfer::{
    KvTransport, MemKind, MemRegion, PeerId, Segment, TransportError, WriteBatch,
};

const BUF: usize = 64 * 1024;
const NOTIF: &[u8] = b"req-42";
/// The child's scenario (`good` or `bad`); unset: not a spawned child.
const ROLE: &str = "DSA_KV_NIXL_CHILD";
/// The parent's listening address, for the child.
const PARENT: &str = "DSA_KV_NIXL_PARENT";
/// How long the child waits for anything.
const CHILD_WAIT: Duration = Duration::from_secs(30);

/// The good write: (source offset, destination offset, length); three non-contiguous
/// destination ranges (odd offsets and lengths included), in two batches.
const GOOD: [&[(usize, usize, usize)]; 2] = [
    &[(0, 4096, 4096), (8192, 16384, 4196)],
    &[(20483, 40965, 5000)],
];

/// One test at a time in this process (each makes a NIXL agent and a child).
static SERIAL: Mutex<()> = Mutex::new(());

/// A page-aligned heap buffer that the peer writes behind the compiler's back: read only
/// through its raw pointer.
struct HostBuf {
    ptr: *mut u8,
    len: usize,
}

impl HostBuf {
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len, 4096).unwrap()
    }
    fn zeroed(len: usize) -> Self {
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout(len)) };
        assert!(!ptr.is_null());
        HostBuf { ptr, len }
    }
    fn patterned(len: usize) -> Self {
        let b = Self::zeroed(len);
        for i in 0..len {
            // SAFETY: inside our allocation.
            unsafe { b.ptr.add(i).write(pattern(i)) };
        }
        b
    }
    fn snapshot(&self) -> Vec<u8> {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: our allocation; read through the raw pointer, copied out at once.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len).to_vec() }
    }
    fn region(&self) -> MemRegion {
        MemRegion {
            addr: self.ptr as u64,
            len: self.len as u64,
            mem: MemKind::Host,
        }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout(self.len)) }
    }
}

/// The transport, or `None` after the SKIPPED line; fails under `DSA_KV_REQUIRE_NIXL=1`.
fn nixl_or_skip(name: &str) -> Option<NixlTransport> {
    match NixlTransport::new(name) {
        Ok(t) => Some(t),
        Err(TransportError::Unavailable { why, .. }) => {
            if std::env::var("DSA_KV_REQUIRE_NIXL").as_deref() == Ok("1") {
                panic!("DSA_KV_REQUIRE_NIXL=1 but NIXL is not available: {why}");
            }
            // Straight to the process's stderr: the test harness captures `eprintln!`.
            let _ = writeln!(std::io::stderr(), "SKIPPED: NIXL not available: {why}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// The parent's side of one scenario: spawn the child, exchange metadata, run `act`
/// (the writes), then read the child's verdict.
struct Session {
    nixl: NixlTransport,
    buf: HostBuf,
    stream: TcpStream,
    child: Child,
    peer: PeerId,
    /// The child's registered buffer.
    remote: (u64, u64),
}

fn start(scenario: &str) -> Option<Session> {
    let mut nixl = nixl_or_skip(&format!("prefill-{scenario}"))?;
    let buf = HostBuf::patterned(BUF);
    // SAFETY: `buf` outlives the transport (dropped after it at the end of this function)
    // and only the transfer writes it.
    unsafe { nixl.register(&[buf.region()]) }.unwrap();

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_target", "--nocapture", "--ignored"])
        .env(ROLE, scenario)
        .env(PARENT, addr.to_string())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    // Accept with a deadline, and notice a child that died before connecting.
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + CHILD_WAIT;
    let mut stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Some(st) = child.try_wait().unwrap() {
                    panic!("child exited before connecting: {st}");
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    panic!("child did not connect in {CHILD_WAIT:?}");
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    stream.set_nonblocking(false).unwrap();
    stream.set_read_timeout(Some(CHILD_WAIT * 2)).unwrap();

    let child_md = recv_frame(&mut stream).unwrap();
    let region = recv_frame(&mut stream).unwrap();
    let remote = (
        u64::from_le_bytes(region[..8].try_into().unwrap()),
        u64::from_le_bytes(region[8..16].try_into().unwrap()),
    );
    send_frame(&mut stream, &nixl.local_metadata().unwrap()).unwrap();
    // SAFETY: the child's own metadata; its buffer lives until it has replied.
    let peer = unsafe { nixl.connect(&child_md) }.unwrap();
    assert_eq!(peer.0, format!("decode-{scenario}"));
    Some(Session {
        nixl,
        buf,
        stream,
        child,
        peer,
        remote,
    })
}

impl Session {
    fn batch(&self, segs: &[(usize, usize, usize)]) -> WriteBatch {
        WriteBatch {
            src_mem: MemKind::Host,
            dst_mem: MemKind::Host,
            segments: segs
                .iter()
                .map(|&(s, d, len)| Segment {
                    src: self.buf.ptr as u64 + s as u64,
                    dst: self.remote.0 + d as u64,
                    len: len as u64,
                })
                .collect(),
        }
    }

    /// The child's verdict, then its exit status (waited for with a deadline).
    fn finish(mut self) {
        let verdict = recv_frame(&mut self.stream);
        let deadline = Instant::now() + CHILD_WAIT;
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("child did not exit in {CHILD_WAIT:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let verdict = verdict.expect("the child's verdict");
        assert_eq!(
            String::from_utf8_lossy(&verdict),
            "ok",
            "the child's verdict"
        );
        assert!(status.success(), "child: {status}");
    }
}

#[test]
fn two_processes_write_three_segments_then_notify() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut s) = start("good") else {
        return;
    };
    let batches: Vec<WriteBatch> = GOOD.iter().map(|b| s.batch(b)).collect();
    let report = s.nixl.write(&s.peer, &batches, NOTIF).unwrap();
    let bytes: usize = GOOD.iter().flat_map(|b| b.iter()).map(|c| c.2).sum();
    assert_eq!((report.descriptors, report.bytes), (3, bytes as u64));
    eprintln!(
        "[prefill-good] {} descriptors, {} bytes in {:?}",
        report.descriptors, report.bytes, report.elapsed
    );
    s.finish();
}

#[test]
fn write_outside_remote_registration_fails_and_moves_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut s) = start("bad") else {
        return;
    };
    // A valid batch first, then one whose second segment runs 2 KiB past the end of the
    // child's buffer: every request is created before any is posted, so nothing moves.
    let end = s.remote.1 as usize;
    let batches = [
        s.batch(GOOD[0]),
        s.batch(&[(0, 0, 1024), (4096, end - 2048, 4096)]),
    ];
    let err = s.nixl.write(&s.peer, &batches, b"req-bad").unwrap_err();
    eprintln!("[prefill-bad] refused as expected: {err}");
    // NIXL refuses it at request creation; the transport names the segment.
    assert!(
        matches!(
            err,
            TransportError::Unregistered {
                side: "remote",
                index: 1,
                ..
            }
        ),
        "{err}"
    );
    send_frame(&mut s.stream, b"attempted").unwrap();
    s.finish();
}

/// The decode side; only run when spawned by the tests above.
#[test]
#[ignore = "the child process of the two-process tests"]
fn child_target() {
    let Ok(scenario) = std::env::var(ROLE) else {
        eprintln!("child_target: not spawned by the NIXL tests, nothing to do");
        return;
    };
    let addr = std::env::var(PARENT).expect(PARENT);
    let mut stream = TcpStream::connect(&addr).unwrap();
    stream.set_read_timeout(Some(CHILD_WAIT)).unwrap();
    let verdict = child_run(&scenario, &mut stream);
    let text = match &verdict {
        Ok(()) => "ok".to_string(),
        Err(e) => e.clone(),
    };
    let _ = send_frame(&mut stream, text.as_bytes());
    if let Err(e) = verdict {
        panic!("[decode-{scenario}] {e}");
    }
    eprintln!("[decode-{scenario}] OK");
}

fn child_run(scenario: &str, stream: &mut TcpStream) -> Result<(), String> {
    let name = format!("decode-{scenario}");
    let mut nixl = NixlTransport::new(&name).map_err(|e| e.to_string())?;
    let buf = HostBuf::zeroed(BUF);
    // SAFETY: `buf` outlives the transport; only the parent's transfer writes it.
    unsafe { nixl.register(&[buf.region()]) }.map_err(|e| e.to_string())?;
    let io = |e: std::io::Error| format!("socket: {e}");
    send_frame(stream, &nixl.local_metadata().map_err(|e| e.to_string())?).map_err(io)?;
    let mut region = (buf.ptr as u64).to_le_bytes().to_vec();
    region.extend_from_slice(&(BUF as u64).to_le_bytes());
    send_frame(stream, &region).map_err(io)?;
    let parent_md = recv_frame(stream).map_err(io)?;
    // SAFETY: the parent's own metadata, over our socket.
    let parent = unsafe { nixl.connect(&parent_md) }.map_err(|e| e.to_string())?;

    let mut expect = vec![0u8; BUF];
    match scenario {
        "good" => {
            // Wait for the notification (it comes after the last byte), watching the
            // socket so that a parent that failed does not leave us waiting.
            let deadline = Instant::now() + CHILD_WAIT;
            stream
                .set_read_timeout(Some(Duration::from_millis(1)))
                .map_err(io)?;
            let mut seen = Vec::new();
            while !seen.iter().any(|(_, m): &(PeerId, Vec<u8>)| m == NOTIF) {
                if Instant::now() > deadline {
                    return Err(format!("no notification in {CHILD_WAIT:?}; got {seen:?}"));
                }
                if let Ok(0) = stream.peek(&mut [0u8; 1]) {
                    return Err("the parent closed the connection before notifying".into());
                }
                seen.extend(nixl.take_notifications().map_err(|e| e.to_string())?);
                std::thread::sleep(Duration::from_millis(1));
            }
            stream.set_read_timeout(Some(CHILD_WAIT)).map_err(io)?;
            let from: Vec<_> = seen.iter().filter(|(_, m)| m == NOTIF).collect();
            if from.len() != 1 || from[0].0 != parent {
                return Err(format!(
                    "expected one {NOTIF:?} from {parent:?}, got {seen:?}"
                ));
            }
            for &(s, d, len) in GOOD.iter().flat_map(|b| b.iter()) {
                for k in 0..len {
                    expect[d + k] = pattern(s + k);
                }
            }
        }
        "bad" => {
            // The parent tells us once its write was refused; then nothing may have
            // arrived: no notification, every byte still zero.
            let cmd = recv_frame(stream).map_err(io)?;
            if cmd != b"attempted" {
                return Err(format!("unexpected command {cmd:?}"));
            }
            let t = Instant::now();
            while t.elapsed() < Duration::from_millis(300) {
                let n = nixl.take_notifications().map_err(|e| e.to_string())?;
                if !n.is_empty() {
                    return Err(format!("notification after a refused write: {n:?}"));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        other => return Err(format!("unknown scenario {other:?}")),
    }
    let got = buf.snapshot();
    let bad: Vec<usize> = (0..BUF).filter(|&i| got[i] != expect[i]).collect();
    if !bad.is_empty() {
        return Err(format!(
            "{} of {BUF} bytes differ (first at {})",
            bad.len(),
            bad[0]
        ));
    }
    eprintln!(
        "[decode-{scenario}] checked {BUF} bytes ({} copied, rest zero)",
        expect.iter().filter(|&&b| b != 0).count()
    );
    drop(nixl);
    Ok(())
}
