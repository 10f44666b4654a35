//! NCCL between two processes on GPU memory: the test spawns itself (the `#[ignore]`d
//! `child_target` test, told its role and the parent's address through the environment)
//! as the receiving side, exchanges metadata over a TCP socket on 127.0.0.1, and writes
//! into the child's registered device buffer.
//!
//! Needs a CUDA GPU and `libnccl.so.2`. Without them the test prints `SKIPPED: NCCL not
//! available: ...` and passes, unless `DSA_KV_REQUIRE_NCCL=1` (the GPU machine's
//! script), where it fails with that message. With one GPU both processes use it: the
//! child gets its own `NCCL_HOSTID` (see `dsa_kv::transfer::nccl`).

#[path = "common/frames.rs"]
mod frames;

use dsa_kv::cuda::cudarc;
use frames::{pattern, recv_frame, send_frame};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use dsa_kv::transfer::nccl::NcclTransport;
use dsa_kv::transfer::{
    KvTransport, MemKind, MemRegion, PeerId, Segment, TransportError, WriteBatch,
};

const BUF: usize = 1 << 20;
const NOTIF: &[u8] = b"req-42";
const ROLE: &str = "DSA_KV_NCCL_CHILD";
const PARENT: &str = "DSA_KV_NCCL_PARENT";
const WAIT: Duration = Duration::from_secs(60);

/// (source offset, destination offset, length): three ranges, odd offsets and lengths,
/// in two batches.
const GOOD: [&[(usize, usize, usize)]; 2] = [
    &[(0, 4096, 4096), (8192, 65536, 300_001)],
    &[(20483, 500_003, 5000)],
];

/// GPU 0's context and a device buffer holding `bytes`.
struct Gpu {
    stream: Arc<CudaStream>,
    buf: CudaSlice<u8>,
}

impl Gpu {
    fn new(bytes: &[u8]) -> Gpu {
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.default_stream();
        let buf = stream.clone_htod(bytes).unwrap();
        stream.synchronize().unwrap();
        Gpu { stream, buf }
    }
    fn addr(&self) -> u64 {
        let (p, _sync) = self.buf.device_ptr(&self.stream);
        p
    }
    fn region(&self) -> MemRegion {
        MemRegion {
            addr: self.addr(),
            len: BUF as u64,
            mem: MemKind::Device { ordinal: 0 },
        }
    }
    fn snapshot(&self) -> Vec<u8> {
        self.stream.clone_dtoh(&self.buf).unwrap()
    }
}

fn nccl_or_skip(name: &str) -> Option<NcclTransport> {
    match NcclTransport::new(name, 0) {
        Ok(mut t) => {
            t.set_timeout(WAIT);
            Some(t)
        }
        Err(TransportError::Unavailable { why, .. }) => {
            if std::env::var("DSA_KV_REQUIRE_NCCL").as_deref() == Ok("1") {
                panic!("DSA_KV_REQUIRE_NCCL=1 but NCCL is not available: {why}");
            }
            let _ = writeln!(std::io::stderr(), "SKIPPED: NCCL not available: {why}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// One parent, one child:
/// 1. a pageable host buffer is refused at registration;
/// 2. a forged write (the child's metadata claims more memory than it registered): the
///    child refuses the header, nothing lands, the pair stays up; so is a write into
///    registered memory outside the window the child opened (a "committed page");
/// 3. a stalled receiver (the child stopped with SIGSTOP): no acknowledgement within the
///    timeout, the write fails, the pair breaks on both sides, nothing lands;
/// 4. both sides connect again, and a good write lands, checked byte for byte;
/// 5. (feature `fault-injection`) the receiver stalls after acknowledging a write: the
///    writer gives up, asks it to stop, hears nothing within the grace period and
///    returns `InFlight`; the receiver then closes the import's window, which returns
///    once its receive has stopped, and nothing of that write landed.
#[test]
fn two_processes_refuse_a_forged_write_survive_a_stall_then_move_device_memory() {
    let Some(nccl) = nccl_or_skip("prefill") else {
        return;
    };
    let src: Vec<u8> = (0..BUF).map(pattern).collect();
    let gpu = Gpu::new(&src);
    // Declared after `gpu`, so dropped before it (also when an assertion fails).
    let mut nccl = nccl;
    // Pageable host memory: NCCL's kernels cannot reach it; refused, nothing registered.
    let pageable = vec![0u8; 4096];
    // SAFETY: refused before anything keeps the pointer.
    let e = unsafe {
        nccl.register(&[MemRegion {
            addr: pageable.as_ptr() as u64,
            len: 4096,
            mem: MemKind::Host,
        }])
    }
    .unwrap_err();
    assert!(e.to_string().contains("not device-accessible"), "{e}");
    // SAFETY: `gpu` outlives the transport (declared before it, dropped after it).
    unsafe { nccl.register(&[gpu.region()]) }.unwrap();

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "child_target", "--nocapture", "--ignored"])
        .env(ROLE, "decode")
        .env(PARENT, listener.local_addr().unwrap().to_string())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit());
    if std::env::var_os("NCCL_HOSTID").is_none() {
        // One GPU for both ranks: NCCL must take them for two hosts.
        cmd.env("NCCL_HOSTID", "dsa-kv-nccl-test-child");
    }
    let mut child = cmd.spawn().unwrap();
    let (mut stream, _) = listener.accept().unwrap();
    stream.set_read_timeout(Some(WAIT * 2)).unwrap();
    let child_md = recv_frame(&mut stream).unwrap();
    let remote: MemRegion = serde_json::from_slice(&recv_frame(&mut stream).unwrap()).unwrap();
    send_frame(&mut stream, &nccl.local_metadata().unwrap()).unwrap();
    // Forged: the child's region claims twice its length.
    let mut md: serde_json::Value = serde_json::from_slice(&child_md).unwrap();
    md["regions"][0]["len"] = serde_json::json!(2 * BUF as u64);
    // SAFETY: deliberately breaks the contract (the regions are forged); the receiver's
    // own check is what is under test, and it must refuse before anything lands.
    let peer = unsafe { nccl.connect(&serde_json::to_vec(&md).unwrap()) }.unwrap();
    assert_eq!(peer, PeerId("decode".into()));
    let batch = |segs: &[(usize, usize, usize)]| WriteBatch {
        src_mem: MemKind::Device { ordinal: 0 },
        dst_mem: MemKind::Device { ordinal: 0 },
        segments: segs
            .iter()
            .map(|&(s, d, len)| Segment {
                src: gpu.addr() + s as u64,
                dst: remote.addr + d as u64,
                len: len as u64,
            })
            .collect(),
    };
    let forged = [batch(GOOD[0]), batch(&[(0, BUF - 100, 4096)])];
    let e = nccl.write(&peer, &forged, b"req-forged").unwrap_err();
    assert!(
        e.to_string().contains("refused") && e.to_string().contains("registered memory"),
        "{e}"
    );
    assert!(nccl.is_connected(&peer), "a refused write keeps the pair");
    // Registered, but no window of ours covers it: refused the same way.
    let e = nccl
        .write(&peer, &[batch(&[(0, 1000, 64)])], b"req-outside")
        .unwrap_err();
    assert!(e.to_string().contains("no open window"), "{e}");
    assert!(nccl.is_connected(&peer));
    send_frame(&mut stream, b"refused").unwrap();

    let batches: Vec<WriteBatch> = GOOD.iter().map(|b| batch(b)).collect();
    nccl.set_timeout(Duration::from_secs(3));
    // SAFETY: signals our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGSTOP) }, 0);
    // Stopped for sure before the write starts (`T` in /proc).
    let state = || {
        std::fs::read_to_string(format!("/proc/{}/stat", child.id()))
            .ok()
            .and_then(|st| st.rsplit(')').next().map(|r| r.trim().to_string()))
            .and_then(|r| r.chars().next())
    };
    let until = Instant::now() + Duration::from_secs(5);
    while state() != Some('T') {
        assert!(
            Instant::now() < until,
            "the child did not stop: {:?}",
            state()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    let e = nccl.write(&peer, &batches, b"req-stalled").unwrap_err();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGCONT) }, 0);
    eprintln!(
        "[prefill] stalled write failed after {:?}: {e}",
        t0.elapsed()
    );
    assert!(
        matches!(e, TransportError::Failed { .. }) && e.to_string().contains("connect again"),
        "no acknowledgement, nothing sent: {e}"
    );
    assert!(!nccl.is_connected(&peer));
    let e = nccl.write(&peer, &batches, NOTIF).unwrap_err();
    assert!(matches!(e, TransportError::UnknownPeer(_)), "{e}");
    send_frame(&mut stream, b"stalled").unwrap();
    nccl.set_timeout(WAIT);
    // SAFETY: the child's own metadata (unforged this time); it connects again too.
    let peer = unsafe { nccl.connect(&child_md) }.unwrap();
    let report = nccl.write(&peer, &batches, NOTIF).unwrap();
    let bytes: usize = GOOD.iter().flat_map(|b| b.iter()).map(|c| c.2).sum();
    assert_eq!((report.descriptors, report.bytes), (3, bytes as u64));
    eprintln!(
        "[prefill] {} descriptors, {} bytes in {:?}",
        report.descriptors, report.bytes, report.elapsed
    );
    send_frame(&mut stream, b"written").unwrap();
    if cfg!(feature = "fault-injection") {
        // The child stalls after its next Ack for longer than our timeout and grace.
        assert_eq!(recv_frame(&mut stream).unwrap(), b"stalling");
        nccl.set_timeout(Duration::from_secs(2));
        let t0 = Instant::now();
        let e = nccl
            .write(&peer, &[batch(&[(0, 4096, 4096)])], b"req-inflight")
            .unwrap_err();
        eprintln!(
            "[prefill] stalled-after-Ack write: {e} after {:?}",
            t0.elapsed()
        );
        assert!(e.in_flight(), "{e}");
        assert!(
            !nccl.is_connected(&peer),
            "an InFlight write drops the pair"
        );
        send_frame(&mut stream, b"inflight").unwrap();
    }
    let verdict = recv_frame(&mut stream).expect("the child's verdict");
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("child did not exit in {WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(
        String::from_utf8_lossy(&verdict),
        "ok",
        "the child's verdict"
    );
    assert!(status.success(), "child: {status}");
    drop(nccl);
    drop(gpu);
}

/// The receiving side; only run when spawned by the test above.
#[test]
#[ignore = "the child process of the two-process test"]
fn child_target() {
    if std::env::var(ROLE).is_err() {
        eprintln!("child_target: not spawned by the NCCL test, nothing to do");
        return;
    }
    let addr = std::env::var(PARENT).expect(PARENT);
    let mut stream = TcpStream::connect(&addr).unwrap();
    stream.set_read_timeout(Some(WAIT * 2)).unwrap();
    let verdict = child_run(&mut stream);
    let text = match &verdict {
        Ok(()) => "ok".to_string(),
        Err(e) => e.clone(),
    };
    let _ = send_frame(&mut stream, text.as_bytes());
    if let Err(e) = verdict {
        panic!("[decode] {e}");
    }
    eprintln!("[decode] OK");
}

fn child_run(stream: &mut TcpStream) -> Result<(), String> {
    let s = |e: TransportError| e.to_string();
    let io = |e: std::io::Error| format!("socket: {e}");
    let gpu = Gpu::new(&vec![0u8; BUF]);
    // Declared after `gpu`, so dropped before it, on every return.
    let mut nccl = NcclTransport::new("decode", 0).map_err(s)?;
    nccl.set_timeout(WAIT);
    // SAFETY: `gpu` outlives the transport; only the parent's writes land in it.
    unsafe { nccl.register(&[gpu.region()]) }.map_err(s)?;
    send_frame(stream, &nccl.local_metadata().map_err(s)?).map_err(io)?;
    send_frame(stream, &serde_json::to_vec(&gpu.region()).unwrap()).map_err(io)?;
    let parent_md = recv_frame(stream).map_err(io)?;
    // SAFETY: the parent's own metadata, over our socket.
    let parent = unsafe { nccl.connect(&parent_md) }.map_err(s)?;
    // The "reserved pages": the good write's destinations, for the parent only.
    let window: Vec<MemRegion> = GOOD
        .iter()
        .flat_map(|b| b.iter())
        .map(|&(_, d, len)| MemRegion {
            addr: gpu.addr() + d as u64,
            len: len as u64,
            mem: MemKind::Device { ordinal: 0 },
        })
        .collect();
    // SAFETY: registered memory only the parent's writes touch.
    unsafe { nccl.open_window(&parent, 42, &window, Instant::now() + WAIT * 4) }.map_err(s)?;

    // The forged write: refused here (logged), no notification, nothing landed, and
    // the pair stays up.
    if recv_frame(stream).map_err(io)? != b"refused" {
        return Err("expected the parent's refused write".into());
    }
    let notes = nccl.take_notifications().map_err(s)?;
    if !notes.is_empty() {
        return Err(format!("notifications after a refused write: {notes:?}"));
    }
    if gpu.snapshot().iter().any(|&b| b != 0) {
        return Err("bytes landed from a refused write".into());
    }
    if !nccl.is_connected(&parent) {
        return Err("a refused write broke the pair".into());
    }
    // The stalled write (we were stopped while it was sent): resumed, we see the pair
    // break; nothing landed, no notification. Then we connect again.
    if recv_frame(stream).map_err(io)? != b"stalled" {
        return Err("expected the parent's stalled write".into());
    }
    let until = Instant::now() + Duration::from_secs(20);
    while nccl.is_connected(&parent) {
        if Instant::now() > until {
            return Err("the pair did not break after the parent gave up".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let notes = nccl.take_notifications().map_err(s)?;
    if !notes.is_empty() || gpu.snapshot().iter().any(|&b| b != 0) {
        return Err(format!("a failed write left something: {notes:?}"));
    }
    // SAFETY: the parent's own metadata, as before.
    let parent = unsafe { nccl.connect(&parent_md) }.map_err(s)?;
    // The good write: the notification is filed before the parent's write returns.
    if recv_frame(stream).map_err(io)? != b"written" {
        return Err("expected the parent's write".into());
    }
    let notes = nccl.take_notifications().map_err(s)?;
    if notes != vec![(parent, NOTIF.to_vec())] {
        return Err(format!("notifications {notes:?}"));
    }
    let mut expect = vec![0u8; BUF];
    for &(s, d, len) in GOOD.iter().flat_map(|b| b.iter()) {
        for k in 0..len {
            expect[d + k] = pattern(s + k);
        }
    }
    let got = gpu.snapshot();
    let bad: Vec<usize> = (0..BUF).filter(|&i| got[i] != expect[i]).collect();
    if !bad.is_empty() {
        return Err(format!(
            "{} of {BUF} bytes differ (first at {})",
            bad.len(),
            bad[0]
        ));
    }
    eprintln!(
        "[decode] checked {BUF} bytes ({} written, the rest still zero)",
        expect.iter().filter(|&&b| b != 0).count()
    );
    #[cfg(feature = "fault-injection")]
    {
        // Overwrite the first window range with zeros so a late write would show.
        let before = gpu.snapshot();
        nccl.stall_after_ack(Duration::from_secs(6));
        send_frame(stream, b"stalling").map_err(io)?;
        if recv_frame(stream).map_err(io)? != b"inflight" {
            return Err("expected the parent's InFlight".into());
        }
        // Our receive thread wakes, posts, sees the writer gone and aborts: closing
        // the window waits for that.
        let t0 = Instant::now();
        nccl.close_window(42).map_err(s)?;
        eprintln!("[decode] the window closed after {:?}", t0.elapsed());
        std::thread::sleep(Duration::from_millis(500));
        if gpu.snapshot() != before {
            return Err("the InFlight write landed something".into());
        }
        if !nccl.take_notifications().map_err(s)?.is_empty() {
            return Err("the InFlight write filed a notification".into());
        }
    }
    drop(nccl);
    Ok(())
}
