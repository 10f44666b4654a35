//! [`NcclTransport`]: KV pages between processes over NCCL point-to-point (`ncclSend` /
//! `ncclRecv`), the transport for machines without NIXL. The library is `dlopen`ed at
//! run time (cudarc's dynamic loading, which looks for the unversioned `libnccl.so`): a
//! build needs nothing of NCCL, and [`NcclTransport::new`] returns
//! [`TransportError::Unavailable`] where the library (NCCL 2.19 or later; tested with
//! 2.28.3) or a CUDA device is missing.
//!
//! # What it moves
//!
//! GPU memory of **one** device (the transport's ordinal) and pinned, device-mapped host
//! memory (the CUDA backend's host tier): NCCL's kernels read and write the pages
//! directly. [`register`](KvTransport::register) asks the driver about the first and
//! the last byte of every region and refuses pageable host memory (the host backend's
//! pools: use the NIXL or the local transport there) and other devices' memory (one
//! transport per GPU; an engine with several devices moves its pages over NIXL).
//! Register every region before the first `connect`.
//!
//! # How a one-sided write runs on a two-sided library
//!
//! NCCL needs a receive posted for every send. Each transport therefore keeps, per
//! connected peer, a TCP control connection per direction and a **receive thread**; the
//! importing side's caller does nothing but read notifications, as with NIXL:
//!
//! 1. [`write`](KvTransport::write) checks every segment against both sides'
//!    registrations and sends a header (a sequence number, the segments' destinations
//!    and lengths, the notification) on its control connection;
//! 2. the peer's receive thread checks every destination against **its own**
//!    registrations and its open **windows** (a header is admitted only if every
//!    destination lies in one window the importer opened for this writer,
//!    [`KvTransport::open_window`], and before its deadline; and only if the inbox has
//!    room: at most [`MAX_PENDING_NOTIFICATIONS`] untaken notifications of at most
//!    [`MAX_NOTIFICATION`] bytes), refuses anything else before posting, acknowledges,
//!    and posts one `ncclRecv` per segment (one NCCL group);
//! 3. the writer posts one `ncclSend` per segment (one group) and waits for its stream,
//!    watching the control connection for the receiver's failure;
//! 4. the receive thread waits for its stream, files the notification (visible to
//!    [`take_notifications`](KvTransport::take_notifications) only after every byte has
//!    landed), and answers `Done`; only then does `write` return. Every answer carries
//!    the header's sequence number, and an answer to another write breaks the pair.
//!
//! # Who may connect
//!
//! Each transport makes a random secret and puts it in its metadata; a control
//! connection is taken for peer `A`'s only if its first frame proves it holds `A`'s
//! metadata and ours (an HMAC over a fresh challenge: `control.rs`), so a local process
//! that merely names itself `A` is refused. Handshakes run concurrently and are
//! bounded in number and time: silent sockets cannot use up `connect`'s deadline. The
//! metadata must travel over a channel both engines trust.
//!
//! # Windows
//!
//! A receive admitted into a window must land before the window's deadline; past it,
//! or when [`close_window`](KvTransport::close_window) is called while it runs, the
//! receive thread aborts its communicator (its kernels stop, the pair breaks) and
//! `close_window` returns once it has; if it does not within the grace period,
//! `close_window` returns [`TransportError::InFlight`].
//!
//! # Failures
//!
//! Every wait has a deadline ([`NcclTransport::set_timeout`], 60 s by default; a control
//! frame must arrive whole within it), and the communicators are non-blocking, so
//! joining one and launching a group are waits with deadlines too. When the writer
//! fails after the receiver acknowledged (a launch error, a timeout, the connection
//! lost) it aborts its communicator (`ncclCommAbort`: its kernels stop) and asks the
//! receiver to abort too; the receiver stops its kernels and confirms with `Failed`,
//! and `write` returns [`TransportError::Failed`]: nothing lands any more. If the
//! receiver had finished first (`Done`: everything landed, the notification is filed),
//! `write` returns `Ok`. Without an answer within the grace period (the timeout, at
//! most 10 s), it returns [`TransportError::InFlight`]: the receiver's kernels may still
//! write the destination pages. A receiver that fails on its own aborts and answers
//! `Failed`, which the writer sees while it waits. A receiver that sees the control
//! connection close while it waits aborts as well.
//!
//! Any failure but a refused header breaks the pair: the side that fails drops it, and
//! its connections close, so the other side's receive thread ends too (within its
//! 100 ms idle poll); a later `write` to a broken pair says to connect again, and
//! [`connect`] with the peer's metadata replaces it. [`NcclTransport::is_connected`]
//! tells whether a pair is up. A refused header breaks nothing: the writer gets
//! `Failed`, the receiver logs it (`tracing`), no notification is filed.
//!
//! Not bounded: a `connect` that fails before both sides joined a communicator leaves
//! NCCL's bootstrap thread for that unique id waiting in the process that made it.
//! `NCCL_COMM_BLOCKING=1` in the environment overrides the non-blocking configuration,
//! and joining a communicator then has no deadline: leave it unset.
//!
//! # Communicators
//!
//! Two 2-rank communicators per pair of transports, one per direction (sender rank 0,
//! receiver rank 1): the writer's calls and the receive thread never share one.
//! [`connect`](KvTransport::connect) exchanges their unique ids over the control
//! connections, joins both (in the same order on both sides: the lexically smaller
//! agent's sending communicator first) and moves one byte over each, so that NCCL's
//! point-to-point connections are set up there, while both sides are known to take
//! part. Both sides must call `connect` with each other's metadata within the timeout.
//! NCCL warns that communicators used concurrently on one device can deadlock when
//! their kernels cannot all be resident. Here the writer and every peer's receive
//! thread may run a group at once (one communicator each); each uses a few thread
//! blocks, so a handful of peers per GPU stays far from that limit.
//!
//! # Two ranks, one GPU
//!
//! NCCL refuses two ranks on one GPU of one host ("Duplicate GPU detected"). To run both
//! engines on one GPU (as the tests here do, with one GPU lent), give one process its
//! own `NCCL_HOSTID`: NCCL then takes the two processes for two hosts and moves the
//! bytes over its network transport (sockets on this host, `NCCL_SOCKET_IFNAME=lo`),
//! which is slow: the number measures that path, not NVLink. With two GPUs (one rank
//! each) NCCL uses its peer-to-peer transport (NVLink / PCIe) and no variable is needed.
//! Across hosts the metadata's control address must be reachable from the peer:
//! [`NcclTransport::with_control`] binds a given address.
//!
//! [`connect`]: KvTransport::connect

use std::collections::HashMap;
use std::ffi::CStr;
use std::io::{ErrorKind, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{sys as cu, CudaContext, CudaStream};
use cudarc::nccl::sys as nc;
use serde::{Deserialize, Serialize};

use crate::control::{self, Acceptor, SECRET_LEN};
use dsa_kv_device::transfer::{
    check_segments, prune_expired, window_for, KvTransport, MemKind, MemRegion, PeerId,
    TransportError, Window, WriteBatch, WriteReport, MAX_NOTIFICATION, MAX_PENDING_NOTIFICATIONS,
};

const TRANSPORT: &str = "nccl";
/// How often a waiting thread looks at its stream, its communicator, its control
/// connection and its stop flag.
const POLL: Duration = Duration::from_micros(50);
/// How long a receive thread blocks on its control connection before it looks at its
/// stop flag.
const IDLE: Duration = Duration::from_millis(100);
/// The longest a writer waits for the receiver's answer after it gave up.
const GRACE: Duration = Duration::from_secs(10);
/// The largest control frame (a header of roughly 300,000 segments).
const MAX_FRAME: u64 = 16 << 20;
/// The oldest NCCL accepted (the calls used here, and the non-blocking configuration).
const MIN_NCCL: i32 = 21900;

fn failed(op: &'static str, detail: impl Into<String>) -> TransportError {
    TransportError::Failed {
        transport: TRANSPORT,
        op,
        detail: detail.into(),
    }
}

fn in_flight(detail: impl Into<String>) -> TransportError {
    TransportError::InFlight {
        transport: TRANSPORT,
        detail: detail.into(),
    }
}

fn io(op: &'static str) -> impl Fn(std::io::Error) -> TransportError {
    move |e| failed(op, e.to_string())
}

/// NCCL's message for `r`, with its last error text.
fn nccl_message(r: nc::ncclResult_t) -> String {
    // SAFETY: both return static (or thread-local) NUL-terminated strings, or null.
    unsafe {
        let text = |p: *const std::ffi::c_char| {
            (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
        };
        let what = text(nc::ncclGetErrorString(r)).unwrap_or_else(|| format!("{r:?}"));
        match text(nc::ncclGetLastError(std::ptr::null_mut())) {
            Some(last) if !last.is_empty() => format!("{what} ({last})"),
            _ => what,
        }
    }
}

/// A call's result: success, or "in progress" (non-blocking communicators: settled by
/// [`Comm::settle`]).
fn nccl(op: &'static str, r: nc::ncclResult_t) -> Result<(), TransportError> {
    match r {
        nc::ncclResult_t::ncclSuccess | nc::ncclResult_t::ncclInProgress => Ok(()),
        r => Err(failed(op, nccl_message(r))),
    }
}

fn driver(op: &'static str, e: cudarc::driver::DriverError) -> TransportError {
    failed(op, format!("{e:?}"))
}

/// The non-blocking configuration (NCCL's `NCCL_CONFIG_INITIALIZER` for 2.28, with
/// `blocking = 0`; every other field left to NCCL).
fn config() -> nc::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    nc::ncclConfig_t {
        size: std::mem::size_of::<nc::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22800,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

/// Why a wait ended early.
enum WaitEnd {
    Failed(TransportError),
    TimedOut,
    Stopped,
}

/// One non-blocking communicator; aborted when dropped (`ncclCommAbort` is local: it
/// never waits for the peer, and stops this side's kernels).
struct Comm(nc::ncclComm_t);

// SAFETY: a communicator is used by one thread at a time (the writer, or its receive
// thread); the handle is a plain pointer NCCL allows to move between threads.
unsafe impl Send for Comm {}

impl Comm {
    fn abort(&mut self) {
        if !self.0.is_null() {
            // SAFETY: a communicator NCCL created and nobody aborted yet.
            unsafe { nc::ncclCommAbort(self.0) };
            self.0 = std::ptr::null_mut();
        }
    }

    /// NCCL's state: `Ok(true)` settled, `Ok(false)` still in progress.
    fn state(&self) -> Result<bool, String> {
        if self.0.is_null() {
            return Err("the communicator was aborted".into());
        }
        let mut r = nc::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator, a valid out-pointer.
        let q = unsafe { nc::ncclCommGetAsyncError(self.0, &mut r) };
        match (q, r) {
            (nc::ncclResult_t::ncclSuccess, nc::ncclResult_t::ncclSuccess) => Ok(true),
            (nc::ncclResult_t::ncclSuccess, nc::ncclResult_t::ncclInProgress) => Ok(false),
            (nc::ncclResult_t::ncclSuccess, r) | (r, _) => Err(nccl_message(r)),
        }
    }

    /// Waits until the communicator has no operation in progress (joined, a group
    /// launched).
    fn settle(&self, deadline: Instant, stop: Option<&AtomicBool>) -> Result<(), WaitEnd> {
        loop {
            match self.state() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(WaitEnd::Failed(failed("ncclCommGetAsyncError", e))),
            }
            if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
                return Err(WaitEnd::Stopped);
            }
            if Instant::now() > deadline {
                return Err(WaitEnd::TimedOut);
            }
            std::thread::sleep(POLL);
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Posts one send (`send`) or receive per `(address, bytes)` on `comm` as one group.
/// The group is launched when this returns; [`Comm::settle`] waits for it.
fn post(
    comm: &Comm,
    stream: &CudaStream,
    send: bool,
    parts: impl Iterator<Item = (u64, u64)>,
) -> Result<(), TransportError> {
    let s = stream.cu_stream() as nc::cudaStream_t;
    // SAFETY: group calls on this thread only.
    nccl("ncclGroupStart", unsafe { nc::ncclGroupStart() })?;
    let mut first_error = None;
    for (addr, len) in parts {
        // SAFETY: the callers pass registered memory (checked against the registrations)
        // that stays allocated while the transport lives, and wait for the group.
        let r = unsafe {
            if send {
                nc::ncclSend(
                    addr as *const std::ffi::c_void,
                    len as usize,
                    nc::ncclDataType_t::ncclUint8,
                    1,
                    comm.0,
                    s,
                )
            } else {
                nc::ncclRecv(
                    addr as *mut std::ffi::c_void,
                    len as usize,
                    nc::ncclDataType_t::ncclUint8,
                    0,
                    comm.0,
                    s,
                )
            }
        };
        if let Err(e) = nccl(if send { "ncclSend" } else { "ncclRecv" }, r) {
            first_error = Some(e);
            break;
        }
    }
    // SAFETY: closes the group opened above (also after a failed call in it).
    let end = nccl("ncclGroupEnd", unsafe { nc::ncclGroupEnd() });
    match first_error {
        Some(e) => Err(e),
        None => end,
    }
}

/// Waits for `stream`'s work (and `comm` to have nothing in progress), polling, until
/// `deadline`, `stop`, or `watch` says to end.
fn wait_until(
    stream: &CudaStream,
    comm: &Comm,
    deadline: Instant,
    stop: Option<&AtomicBool>,
    mut watch: impl FnMut() -> Option<WaitEnd>,
) -> Result<(), WaitEnd> {
    loop {
        // The communicator first: once it has settled, the group's kernels are on the
        // stream, so the query below covers them.
        let settled = comm
            .state()
            .map_err(|e| WaitEnd::Failed(failed("transfer", e)))?;
        // SAFETY: a live stream of a context current on this thread.
        let done = match unsafe { cu::cuStreamQuery(stream.cu_stream()) } {
            cu::CUresult::CUDA_SUCCESS => true,
            cu::CUresult::CUDA_ERROR_NOT_READY => false,
            r => return Err(WaitEnd::Failed(failed("cuStreamQuery", format!("{r:?}")))),
        };
        if settled && done {
            return Ok(());
        }
        if let Some(end) = watch() {
            return Err(end);
        }
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return Err(WaitEnd::Stopped);
        }
        if Instant::now() > deadline {
            return Err(WaitEnd::TimedOut);
        }
        std::thread::sleep(POLL);
    }
}

/// The control frames, length-prefixed JSON. `seq` numbers a writer's headers; every
/// answer names the header it answers.
#[derive(Debug, Serialize, Deserialize)]
enum Ctrl {
    /// A write: `(memory, destination, bytes)` per segment, then the notification.
    Header {
        seq: u64,
        segments: Vec<(MemKind, u64, u64)>,
        notification: Vec<u8>,
    },
    /// The destinations are registered; the receives are being posted.
    Ack { seq: u64 },
    /// The header was refused; nothing was posted.
    Refused { seq: u64, why: String },
    /// Every byte has landed; the notification is filed.
    Done { seq: u64 },
    /// The receiver failed and aborted its communicator: nothing lands any more.
    Failed { seq: u64, why: String },
    /// The writer gave up: abort, then answer `Failed` (or `Done` if it all landed).
    Abort { seq: u64 },
}

impl Ctrl {
    fn encode(&self) -> Result<Vec<u8>, TransportError> {
        let b = serde_json::to_vec(self).map_err(|e| failed("control", e.to_string()))?;
        let mut f = (b.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(&b);
        Ok(f)
    }
}

fn send_ctrl(s: &mut TcpStream, m: &Ctrl) -> Result<(), TransportError> {
    s.write_all(&m.encode()?).map_err(io("control send"))
}

/// Reads one whole frame before `deadline` (ending early when `stop` is set).
fn recv_ctrl_or_stop(
    s: &mut TcpStream,
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<Ctrl, TransportError> {
    let b = control::read_frame(s, MAX_FRAME, deadline, stop)?;
    serde_json::from_slice(&b).map_err(|e| failed("control receive", e.to_string()))
}

/// Reads one whole frame before `deadline`.
fn recv_ctrl(s: &mut TcpStream, deadline: Instant) -> Result<Ctrl, TransportError> {
    recv_ctrl_or_stop(s, deadline, None)
}

/// What a control connection has without blocking: `Ok(None)` nothing yet,
/// `Ok(Some(frame))`, or an error (closed, broken).
fn poll_ctrl(s: &mut TcpStream, timeout: Duration) -> Result<Option<Ctrl>, TransportError> {
    s.set_nonblocking(true).map_err(io("control receive"))?;
    let mut one = [0u8; 1];
    let peeked = s.peek(&mut one);
    s.set_nonblocking(false).map_err(io("control receive"))?;
    match peeked {
        Ok(0) => Err(failed(
            "control receive",
            "the peer closed the control connection",
        )),
        Ok(_) => recv_ctrl(s, Instant::now() + timeout).map(Some),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => Ok(None),
        Err(e) => Err(failed("control receive", e.to_string())),
    }
}

#[derive(Serialize, Deserialize)]
struct Metadata {
    agent: String,
    /// Where this transport accepts control connections.
    control: SocketAddr,
    regions: Vec<MemRegion>,
    /// This transport's secret (hex): a connection proves it holds it (`control.rs`).
    secret: String,
}

/// An import's window on the receiving side, with the receives using it.
struct NcclWindow {
    window: Window,
    /// Headers into it being received now.
    in_use: u32,
    /// `close_window` waits for `in_use` to reach 0; no new header is accepted.
    closing: bool,
}

/// Every open window of a transport, shared with its receive threads.
type Windows = Arc<Mutex<HashMap<u64, NcclWindow>>>;

fn lock_windows(w: &Windows) -> std::sync::MutexGuard<'_, HashMap<u64, NcclWindow>> {
    // Plain data: a panic elsewhere leaves it consistent.
    w.lock().unwrap_or_else(|e| e.into_inner())
}

/// One connected peer. Fields drop in this order: the receive thread stops (aborting
/// its communicator), then ours is aborted, then the connection closes.
struct Peer {
    /// The receive thread of the other direction.
    receiver: Receiver,
    /// The communicator this side sends on (rank 0).
    out: Comm,
    /// The control connection of this direction (headers out, answers in).
    ctrl: TcpStream,
    regions: Vec<MemRegion>,
    /// The last header's sequence number.
    seq: u64,
}

struct Receiver {
    stop: Arc<AtomicBool>,
    /// Cleared by the receive thread when it ends (the pair is broken).
    alive: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The notifications the receive threads filed.
type Inbox = Arc<Mutex<Vec<(PeerId, Vec<u8>)>>>;

/// See the module docs.
pub struct NcclTransport {
    name: String,
    ordinal: u32,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// One byte of device memory for the connection warm-up.
    scratch: cu::CUdeviceptr,
    /// Accepts control connections and runs their authenticated handshakes.
    acceptor: Acceptor,
    control: SocketAddr,
    /// This transport's secret, sent in its metadata.
    secret: [u8; SECRET_LEN],
    regions: Vec<MemRegion>,
    timeout: Duration,
    peers: HashMap<PeerId, Peer>,
    inbox: Inbox,
    windows: Windows,
    /// Fault drill: how long receive threads wait after acknowledging a header before
    /// they post its receives (microseconds; 0: not at all).
    stall_after_ack: Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for NcclTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclTransport")
            .field("name", &self.name)
            .field("ordinal", &self.ordinal)
            .field("control", &self.control)
            .field("peers", &self.peers.len())
            .finish()
    }
}

fn unavailable(why: impl Into<String>) -> TransportError {
    TransportError::Unavailable {
        transport: TRANSPORT,
        why: why.into(),
    }
}

impl NcclTransport {
    /// A transport named `name` moving memory of CUDA device `ordinal`, with its control
    /// socket on `127.0.0.1` (one host).
    pub fn new(name: &str, ordinal: usize) -> Result<Self, TransportError> {
        Self::with_control(name, ordinal, SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// Like [`new`](Self::new), with the control socket bound to `control` (an address
    /// the peer can reach, e.g. this host's address on the network both hosts share;
    /// port 0 picks one). The address goes into the metadata as bound, so an unspecified
    /// one (`0.0.0.0`) is refused.
    pub fn with_control(
        name: &str,
        ordinal: usize,
        control: SocketAddr,
    ) -> Result<Self, TransportError> {
        if control.ip().is_unspecified() {
            return Err(failed(
                "new",
                format!(
                    "control address {control} is unspecified: bind an address the peer can reach"
                ),
            ));
        }
        // SAFETY: only probes whether the libraries load.
        if !unsafe { cu::is_culib_present() } {
            return Err(unavailable(
                "the CUDA driver (libcuda.so.1) is not installed: NCCL needs a GPU",
            ));
        }
        // SAFETY: as above.
        if !unsafe { nc::is_culib_present() } {
            return Err(unavailable(
                "libnccl.so was not found on the library path. Install NCCL 2.19 or later \
                 (Debian/Ubuntu `libnccl2` plus `libnccl-dev`, which adds the unversioned \
                 `libnccl.so`; or the `nvidia-nccl-cu13` wheel's `lib` folder) and, where only \
                 `libnccl.so.2` is there, add a `libnccl.so -> libnccl.so.2` link in a folder \
                 on LD_LIBRARY_PATH",
            ));
        }
        let mut version = 0;
        // SAFETY: a valid out-pointer; the library is present.
        let r = unsafe { nc::ncclGetVersion(&mut version) };
        if r != nc::ncclResult_t::ncclSuccess {
            return Err(unavailable(format!(
                "the loaded libnccl.so does not report its version ({r:?}): install NCCL 2.19 or later"
            )));
        }
        if version < MIN_NCCL {
            return Err(unavailable(format!(
                "NCCL version code {version} is loaded; this transport needs 2.19 or later (code {MIN_NCCL})"
            )));
        }
        cudarc::driver::result::init().map_err(|e| unavailable(format!("cuInit: {e:?}")))?;
        let count = CudaContext::device_count()
            .map_err(|e| unavailable(format!("cuDeviceGetCount: {e:?}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(unavailable(format!(
                "CUDA device {ordinal} was requested but {count} are present"
            )));
        }
        let listener = TcpListener::bind(control).map_err(io("bind the control socket"))?;
        let control = listener
            .local_addr()
            .map_err(io("bind the control socket"))?;
        let secret = control::random_bytes()?;
        let acceptor = Acceptor::new(listener, secret, Duration::from_secs(5))
            .map_err(io("bind the control socket"))?;
        let ctx = CudaContext::new(ordinal).map_err(|e| driver("cuCtxCreate", e))?;
        let stream = ctx.new_stream().map_err(|e| driver("cuStreamCreate", e))?;
        ctx.bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        // SAFETY: the context is current; freed in Drop.
        let scratch = unsafe { cudarc::driver::result::malloc_sync(1) }
            .map_err(|e| driver("cuMemAlloc", e))?;
        Ok(NcclTransport {
            name: name.to_string(),
            ordinal: ordinal as u32,
            ctx,
            stream,
            scratch,
            acceptor,
            control,
            secret,
            regions: Vec::new(),
            timeout: Duration::from_secs(60),
            peers: HashMap::new(),
            inbox: Arc::default(),
            windows: Arc::default(),
            stall_after_ack: Arc::default(),
        })
    }

    /// How long any wait may last (connect, a write, a receive, a control frame); 60 s
    /// by default. Peers already connected keep the timeout they were connected with
    /// on their receive side.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Fault drill (feature `fault-injection`): from now on this side's receive threads
    /// wait `d` after acknowledging a write before they post its receives, as a
    /// receiver that stalls mid-protocol would. With `d` longer than the writer's timeout
    /// and grace period, the writer's `write` returns [`TransportError::InFlight`]: the
    /// deterministic test of that path.
    #[cfg(feature = "fault-injection")]
    pub fn stall_after_ack(&self, d: Duration) {
        self.stall_after_ack
            .store(d.as_micros() as u64, Ordering::Relaxed);
    }

    /// Whether `peer` is connected and its pair unbroken.
    pub fn is_connected(&self, peer: &PeerId) -> bool {
        self.peers
            .get(peer)
            .is_some_and(|p| p.receiver.alive.load(Ordering::Relaxed))
    }

    /// Drops the pair with `peer` (its receive thread ends, both communicators are
    /// aborted); the peer sees its connections close. Whether it was connected.
    pub fn disconnect(&mut self, peer: &PeerId) -> bool {
        self.peers.remove(peer).is_some()
    }

    fn bind(&self) -> Result<(), TransportError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))
    }

    /// Joins the communicator `id` (as the sender, rank 0, or the receiver, rank 1) and
    /// moves one byte over it.
    fn open(
        &self,
        peer: &str,
        id: &[u8],
        sending: bool,
        deadline: Instant,
    ) -> Result<Comm, TransportError> {
        let what = if sending { "sending" } else { "receiving" };
        let timed = |step: &str, w: WaitEnd| {
            match w {
            WaitEnd::Failed(e) => e,
            _ => failed(
                "connect",
                format!(
                    "{step} of the {what} communicator with {peer} did not finish within {:?}: both sides must connect",
                    self.timeout
                ),
            ),
        }
        };
        let mut uid = nc::ncclUniqueId { internal: [0; 128] };
        if id.len() != uid.internal.len() {
            return Err(TransportError::BadMetadata(format!(
                "an NCCL unique id of {} bytes from {peer} (want {})",
                id.len(),
                uid.internal.len()
            )));
        }
        for (d, s) in uid.internal.iter_mut().zip(id) {
            *d = *s as std::ffi::c_char;
        }
        self.bind()?;
        let mut c: nc::ncclComm_t = std::ptr::null_mut();
        let mut cfg = config();
        // SAFETY: valid out-pointers, a unique id and a configuration NCCL reads during
        // the call; the context is current.
        let r = unsafe {
            nc::ncclCommInitRankConfig(&mut c, 2, uid, if sending { 0 } else { 1 }, &mut cfg)
        };
        // Owned (and aborted when dropped) even when the call failed after creating it.
        let comm = Comm(c);
        nccl("ncclCommInitRankConfig", r)?;
        comm.settle(deadline, None)
            .map_err(|w| timed("joining", w))?;
        let p = self.scratch;
        post(&comm, &self.stream, sending, std::iter::once((p, 1)))?;
        wait_until(&self.stream, &comm, deadline, None, || None)
            .map_err(|w| timed("the one-byte warm-up", w))?;
        Ok(comm)
    }

    /// The writer's way out after the receiver acknowledged header `seq`: our kernels
    /// stop, the receiver is asked to stop its own, and its answer decides: `Done`
    /// (everything had landed, the notification is filed) is `Ok`, `Failed` (it
    /// stopped) is [`TransportError::Failed`], no answer is
    /// [`TransportError::InFlight`]. The caller drops the pair in every case.
    fn give_up(p: &mut Peer, seq: u64, why: String, grace: Duration) -> Result<(), TransportError> {
        p.out.abort();
        if send_ctrl(&mut p.ctrl, &Ctrl::Abort { seq }).is_err() {
            return Err(in_flight(format!(
                "{why}; the receiver could not be told to stop (control connection lost)"
            )));
        }
        match recv_ctrl(&mut p.ctrl, Instant::now() + grace) {
            Ok(Ctrl::Done { seq: s }) if s == seq => Ok(()),
            Ok(Ctrl::Failed { seq: s, .. }) if s == seq => Err(failed(
                "write",
                format!("{why}; the receiver stopped, nothing lands any more"),
            )),
            // Anything else after its Ack: the protocol is broken, the state of the
            // receives unknown.
            Ok(other) => Err(in_flight(format!(
                "{why}; then the receiver sent {other:?}"
            ))),
            Err(e) => Err(in_flight(format!(
                "{why}; the receiver did not confirm it stopped ({e})"
            ))),
        }
    }
}

impl Drop for NcclTransport {
    fn drop(&mut self) {
        // Receive threads stop (and abort their communicators) first, then ours abort.
        self.peers.clear();
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `with_control`; no transfer uses it any more.
            let _ = unsafe { cudarc::driver::result::free_sync(self.scratch) };
        }
    }
}

fn unique_id() -> Result<Vec<u8>, TransportError> {
    let mut id = nc::ncclUniqueId { internal: [0; 128] };
    // SAFETY: a valid out-pointer.
    let r = unsafe { nc::ncclGetUniqueId(&mut id) };
    nccl("ncclGetUniqueId", r)?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// Whether `r` is memory NCCL's kernels on device `ordinal` can use at its own address:
/// device memory of that device, or pinned, device-mapped host memory (UVA). Every
/// allocation the region spans is asked about, from its first byte to its last (the
/// driver's allocation ranges, walked), so a hole in the middle is refused too.
fn check_region(r: &MemRegion, ordinal: u32) -> Result<(), String> {
    if let MemKind::Device { ordinal: o } = r.mem {
        if o != ordinal {
            return Err(format!(
                "device {o} memory at {:#x}: this transport moves device {ordinal}'s memory only (one transport per GPU)",
                r.addr
            ));
        }
    }
    if r.len == 0 {
        return Ok(());
    }
    let end = r.addr.checked_add(r.len).ok_or_else(|| {
        format!(
            "the region at {:#x} of {} bytes wraps around",
            r.addr, r.len
        )
    })?;
    // SAFETY: valid out-pointers of each attribute's type; the driver only looks the
    // address up.
    let attr = |at: u64, a: cu::CUpointer_attribute| -> (cu::CUresult, u64) {
        let mut v: u64 = 0;
        let q = unsafe { cu::cuPointerGetAttribute((&mut v as *mut u64).cast(), a, at) };
        (q, v)
    };
    let mut at = r.addr;
    // A region spans few allocations (one, or a VMM pool's chunks): bound the walk.
    for _ in 0..1 << 20 {
        let (q, dev) = attr(
            at,
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
        );
        if q != cu::CUresult::CUDA_SUCCESS || dev != at {
            return Err(format!(
                "{:?} memory at {at:#x} (in the region at {:#x} of {} bytes) is not device-accessible at its own address ({q:?}): NCCL moves GPU memory and pinned, device-mapped host memory (the CUDA backend's pools); the host backend's pools need the NIXL or the local transport",
                r.mem, r.addr, r.len
            ));
        }
        if let MemKind::Device { ordinal: want } = r.mem {
            let mut o: std::ffi::c_int = -1;
            // SAFETY: as above, an int attribute.
            let q = unsafe {
                cu::cuPointerGetAttribute(
                    (&mut o as *mut std::ffi::c_int).cast(),
                    cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    at,
                )
            };
            if q != cu::CUresult::CUDA_SUCCESS || o != want as std::ffi::c_int {
                return Err(format!(
                    "memory at {at:#x} is said to be on device {want} but the driver places it on device {o} ({q:?})"
                ));
            }
        }
        let (q1, start) = attr(
            at,
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        );
        let (q2, size) = attr(at, cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE);
        let next = start.checked_add(size);
        match (q1, q2, next) {
            (cu::CUresult::CUDA_SUCCESS, cu::CUresult::CUDA_SUCCESS, Some(next))
                if start <= at && next > at =>
            {
                if next >= end {
                    return Ok(());
                }
                at = next;
            }
            _ => {
                return Err(format!(
                    "the driver gives no allocation range for {at:#x} ({q1:?}, {q2:?}: start {start:#x}, {size} bytes), in the region at {:#x} of {} bytes",
                    r.addr, r.len
                ))
            }
        }
    }
    Err(format!(
        "the region at {:#x} of {} bytes spans more than 2^20 allocations",
        r.addr, r.len
    ))
}

/// Everything a receive thread owns.
struct ReceiveSide {
    /// The pair's other control connection (our writer's): shut down when this side
    /// ends, so that the peer's receive thread sees the pair break too.
    writer_ctrl: TcpStream,
    ctx: Arc<CudaContext>,
    peer: PeerId,
    comm: Comm,
    ctrl: TcpStream,
    regions: Vec<MemRegion>,
    inbox: Inbox,
    windows: Windows,
    stall_after_ack: Arc<std::sync::atomic::AtomicU64>,
    stop: Arc<AtomicBool>,
    alive: Arc<AtomicBool>,
    timeout: Duration,
}

impl ReceiveSide {
    /// Why header `segments` may not be received, or the window it writes (counted in
    /// use until [`release`](Self::release)). Checked before anything is posted: every
    /// destination in memory this side registered and in one open window of this peer;
    /// room in the inbox for its notification.
    fn admit(
        &self,
        segments: &[(MemKind, u64, u64)],
        notification: &[u8],
    ) -> Result<Option<(u64, Instant)>, String> {
        if let Some((index, &(mem, dst, len))) =
            segments.iter().enumerate().find(|(_, &(mem, dst, len))| {
                !self
                    .regions
                    .iter()
                    .any(|r| r.mem == mem && r.contains(dst, len))
            })
        {
            return Err(format!(
                "segment {index} of the write (counting its non-empty segments across batches: {len} bytes of {mem:?} at {dst:#x}) lies outside the receiver's registered memory"
            ));
        }
        if notification.len() > MAX_NOTIFICATION {
            return Err(format!(
                "a notification of {} bytes (at most {MAX_NOTIFICATION})",
                notification.len()
            ));
        }
        if self.inbox.lock().expect("inbox lock").len() >= MAX_PENDING_NOTIFICATIONS {
            return Err(format!(
                "{MAX_PENDING_NOTIFICATIONS} notifications wait untaken: the importer is not reading them"
            ));
        }
        // A write with no segments (its import's blocks were all cached) still needs an
        // open window of this peer: no notification is filed without one.
        let mut ws = lock_windows(&self.windows);
        let now = Instant::now();
        let open = ws
            .iter()
            .filter(|(_, w)| !w.closing)
            .map(|(id, w)| (id, &w.window));
        let found = window_for(open, &self.peer.0, segments.iter().copied(), now);
        prune_expired(&mut ws, now, |w| &w.window, |w| w.in_use > 0);
        let id = found?;
        let w = ws.get_mut(&id).expect("found above, and open: not pruned");
        w.in_use += 1;
        Ok(Some((id, w.window.deadline)))
    }

    /// The receive into `window` ended.
    fn release(&self, window: Option<(u64, Instant)>) {
        if let Some((id, _)) = window {
            if let Some(w) = lock_windows(&self.windows).get_mut(&id) {
                w.in_use -= 1;
            }
        }
    }

    /// Serves headers until the connection closes, the transport stops, or a transfer
    /// fails (then the communicator is aborted and the writer told). Clears `alive`
    /// when it returns.
    fn run(mut self) {
        if let Err(e) = self.serve() {
            tracing::warn!(peer = %self.peer.0, "nccl: the receive side of this pair ended: {e}");
        }
        self.comm.abort();
        self.alive.store(false, Ordering::Relaxed);
        let _ = self.writer_ctrl.shutdown(std::net::Shutdown::Both);
    }

    fn serve(&mut self) -> Result<(), String> {
        let stream = self
            .ctx
            .bind_to_thread()
            .and_then(|()| self.ctx.new_stream())
            .map_err(|e| format!("cannot create the receive stream: {e:?}"))?;
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            // Wait for a frame, looking at the stop flag between reads.
            self.ctrl
                .set_read_timeout(Some(IDLE))
                .map_err(|e| e.to_string())?;
            match self.ctrl.peek(&mut [0u8; 1]) {
                Ok(0) => return Err("the writer closed the control connection".into()),
                Ok(_) => {}
                // A signal (job control, a profiler) interrupts the wait: not an error.
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                    ) =>
                {
                    continue
                }
                Err(e) => return Err(format!("control connection: {e}")),
            }
            let frame = recv_ctrl_or_stop(
                &mut self.ctrl,
                Instant::now() + self.timeout,
                Some(&self.stop),
            )
            .map_err(|e| e.to_string())?;
            let Ctrl::Header {
                seq,
                segments,
                notification,
            } = frame
            else {
                return Err(format!("unexpected control frame {frame:?}"));
            };
            // Every destination must lie in memory this side registered and in an open
            // window of this peer (the pages an import reserved for it): a header that
            // says otherwise is refused before anything is posted.
            let window = match self.admit(&segments, &notification) {
                Ok(w) => w,
                Err(why) => {
                    tracing::warn!(peer = %self.peer.0, "nccl: refused a write: {why}");
                    send_ctrl(&mut self.ctrl, &Ctrl::Refused { seq, why })
                        .map_err(|e| e.to_string())?;
                    continue;
                }
            };
            // Acknowledged before posting: the writer's group and ours then launch
            // together (NCCL may connect a channel inside either, and that needs both).
            if let Err(e) = send_ctrl(&mut self.ctrl, &Ctrl::Ack { seq }) {
                self.release(window);
                return Err(e.to_string());
            }
            let stall = self.stall_after_ack.load(Ordering::Relaxed);
            if stall > 0 {
                std::thread::sleep(Duration::from_micros(stall));
            }
            // The receives end by the window's deadline at the latest: past it they are
            // stopped (the import's pages are about to be freed).
            let deadline = window.map_or(Instant::now() + self.timeout, |(_, d)| {
                d.min(Instant::now() + self.timeout)
            });
            let windows = self.windows.clone();
            let window_id = window.map(|(id, _)| id);
            let ended = post(
                &self.comm,
                &stream,
                false,
                segments.iter().map(|&(_, dst, len)| (dst, len)),
            )
            .map_err(WaitEnd::Failed)
            .and_then(|()| {
                let (ctrl, stop) = (&mut self.ctrl, &self.stop);
                wait_until(&stream, &self.comm, deadline, Some(stop), || {
                    // The importer closed the window (an abort, an expired lease): stop.
                    if let Some(id) = window_id {
                        if lock_windows(&windows).get(&id).is_none_or(|w| w.closing) {
                            return Some(WaitEnd::Failed(failed(
                                "receive",
                                "the import's window was closed",
                            )));
                        }
                    }
                    // The writer gave up (Abort) or is gone: stop at once.
                    let left = deadline.saturating_duration_since(Instant::now());
                    match poll_ctrl(ctrl, left) {
                        Ok(None) => None,
                        Ok(Some(Ctrl::Abort { .. })) => {
                            Some(WaitEnd::Failed(failed("receive", "the writer gave up")))
                        }
                        Ok(Some(other)) => Some(WaitEnd::Failed(failed(
                            "receive",
                            format!("unexpected control frame {other:?} during a transfer"),
                        ))),
                        Err(e) => Some(WaitEnd::Failed(e)),
                    }
                })
            });
            match ended {
                Ok(()) => {
                    self.release(window);
                    self.inbox
                        .lock()
                        .expect("inbox lock")
                        .push((self.peer.clone(), notification));
                    send_ctrl(&mut self.ctrl, &Ctrl::Done { seq }).map_err(|e| e.to_string())?;
                }
                Err(w) => {
                    let why = match w {
                        WaitEnd::Failed(e) => e.to_string(),
                        WaitEnd::TimedOut => format!(
                            "the bytes did not land within {:?} or by the window's deadline",
                            self.timeout
                        ),
                        WaitEnd::Stopped => "the transport is shutting down".into(),
                    };
                    // Stop our kernels before telling the writer (and `close_window`)
                    // that nothing lands any more.
                    self.comm.abort();
                    self.release(window);
                    let _ = send_ctrl(
                        &mut self.ctrl,
                        &Ctrl::Failed {
                            seq,
                            why: why.clone(),
                        },
                    );
                    return Err(why);
                }
            }
        }
    }
}

impl KvTransport for NcclTransport {
    fn name(&self) -> &str {
        "nccl"
    }

    unsafe fn register(&mut self, regions: &[MemRegion]) -> Result<(), TransportError> {
        if !self.peers.is_empty() {
            return Err(failed(
                "register",
                "register every region before the first connect (the receive threads check destinations against the regions registered when they started)",
            ));
        }
        self.bind()?;
        for r in regions {
            check_region(r, self.ordinal).map_err(|why| failed("register", why))?;
        }
        self.regions.extend_from_slice(regions);
        Ok(())
    }

    fn local_metadata(&mut self) -> Result<Vec<u8>, TransportError> {
        serde_json::to_vec(&Metadata {
            agent: self.name.clone(),
            control: self.control,
            regions: self.regions.clone(),
            secret: control::hex(&self.secret),
        })
        .map_err(|e| TransportError::BadMetadata(e.to_string()))
    }

    unsafe fn connect(&mut self, remote_metadata: &[u8]) -> Result<PeerId, TransportError> {
        let md: Metadata = serde_json::from_slice(remote_metadata)
            .map_err(|e| TransportError::BadMetadata(e.to_string()))?;
        if md.agent == self.name {
            return Err(TransportError::BadMetadata(format!(
                "the peer is named {:?} like this transport: both agents need distinct names",
                md.agent
            )));
        }
        let peer_secret = control::unhex(&md.secret).ok_or_else(|| {
            TransportError::BadMetadata(format!(
                "{:?}'s metadata has no 32-byte secret: it is not an NCCL transport's metadata of this version",
                md.agent
            ))
        })?;
        let id = PeerId(md.agent.clone());
        if self.is_connected(&id) {
            return Err(failed(
                "connect",
                format!(
                    "{:?} is connected already: disconnect it first to connect again",
                    md.agent
                ),
            ));
        }
        // A broken pair is replaced.
        self.peers.remove(&id);
        let deadline = Instant::now() + self.timeout;
        // Our direction: a control connection to the peer, and the unique id of the
        // communicator we send on.
        let out_id = unique_id()?;
        let (ctrl, incoming, in_id) = control::pair(
            &mut self.acceptor,
            &control::PairSpec {
                me: &self.name,
                own_secret: &self.secret,
                out_id: &out_id,
                agent: &md.agent,
                control: md.control,
                peer_secret: &peer_secret,
            },
            deadline,
        )?;
        ctrl.set_write_timeout(Some(self.timeout))
            .map_err(io("connect"))?;
        incoming
            .set_nodelay(true)
            .and_then(|()| incoming.set_write_timeout(Some(self.timeout)))
            .map_err(io("accept"))?;
        // Both communicators, each with its one-byte warm-up, in the same order on both
        // sides (the lexically smaller agent's sending communicator first).
        let (out, inc) = if self.name < md.agent {
            let out = self.open(&md.agent, &out_id, true, deadline)?;
            (out, self.open(&md.agent, &in_id, false, deadline)?)
        } else {
            let inc = self.open(&md.agent, &in_id, false, deadline)?;
            (self.open(&md.agent, &out_id, true, deadline)?, inc)
        };
        let stop = Arc::new(AtomicBool::new(false));
        let alive = Arc::new(AtomicBool::new(true));
        let side = ReceiveSide {
            writer_ctrl: ctrl.try_clone().map_err(io("connect"))?,
            ctx: self.ctx.clone(),
            peer: id.clone(),
            comm: inc,
            ctrl: incoming,
            regions: self.regions.clone(),
            inbox: self.inbox.clone(),
            windows: self.windows.clone(),
            stall_after_ack: self.stall_after_ack.clone(),
            stop: stop.clone(),
            alive: alive.clone(),
            timeout: self.timeout,
        };
        let thread = std::thread::Builder::new()
            .name(format!("nccl-recv-{}", md.agent))
            .spawn(move || side.run())
            .map_err(io("spawn the receive thread"))?;
        self.peers.insert(
            id.clone(),
            Peer {
                receiver: Receiver {
                    stop,
                    alive,
                    thread: Some(thread),
                },
                out,
                ctrl,
                regions: md.regions,
                seq: 0,
            },
        );
        Ok(id)
    }

    fn write(
        &mut self,
        peer: &PeerId,
        batches: &[WriteBatch],
        notification: &[u8],
    ) -> Result<WriteReport, TransportError> {
        if !self.peers.contains_key(peer) {
            return Err(TransportError::UnknownPeer(peer.0.clone()));
        }
        if !self.is_connected(peer) {
            self.peers.remove(peer);
            return Err(failed(
                "write",
                format!(
                    "the pair with {:?} is broken (its side failed or shut down): connect again",
                    peer.0
                ),
            ));
        }
        check_segments(batches, &self.regions, "local")?;
        let p = self.peers.get_mut(peer).expect("checked above");
        check_segments(batches, &p.regions, "remote")?;
        let segments: Vec<_> = batches
            .iter()
            .flat_map(|b| b.segments.iter().map(move |s| (b.dst_mem, *s)))
            .filter(|(_, s)| s.len > 0)
            .collect();
        let seq = p.seq + 1;
        let header = Ctrl::Header {
            seq,
            segments: segments.iter().map(|(m, s)| (*m, s.dst, s.len)).collect(),
            notification: notification.to_vec(),
        }
        .encode()?;
        if header.len() as u64 > MAX_FRAME + 8 {
            return Err(failed(
                "write",
                format!(
                    "{} segments make a header of {} bytes, over the {MAX_FRAME}-byte control frame limit: split the write",
                    segments.len(),
                    header.len()
                ),
            ));
        }
        p.seq = seq;
        let timeout = self.timeout;
        let t0 = Instant::now();
        let deadline = t0 + timeout;
        let answer = p
            .ctrl
            .write_all(&header)
            .map_err(io("control send"))
            .and_then(|()| recv_ctrl(&mut p.ctrl, deadline));
        match answer {
            Ok(Ctrl::Ack { seq: s }) if s == seq => {}
            // Nothing was posted; the pair stays up.
            Ok(Ctrl::Refused { seq: s, why }) if s == seq => {
                return Err(failed(
                    "write",
                    format!("{} refused the write: {why}", peer.0),
                ))
            }
            // No Ack: whatever the receiver posted is never matched (our communicator is
            // aborted with the pair), so nothing lands.
            other => {
                self.peers.remove(peer);
                let why = match other {
                    Ok(f) => format!("unexpected answer {f:?} to write {seq}"),
                    Err(TransportError::Failed { detail, .. }) => detail,
                    Err(e) => e.to_string(),
                };
                return Err(failed(
                    "write",
                    format!(
                        "{} did not acknowledge the write ({why}); nothing was sent and the pair is dropped: connect again",
                        peer.0
                    ),
                ));
            }
        }
        // The receiver's receives are being posted into its pages: from here a failure
        // goes through `give_up`.
        let sent = self
            .ctx
            .bind_to_thread()
            .map_err(|e| WaitEnd::Failed(driver("cuCtxSetCurrent", e)))
            .and_then(|()| {
                post(
                    &p.out,
                    &self.stream,
                    true,
                    segments.iter().map(|(_, s)| (s.src, s.len)),
                )
                .map_err(WaitEnd::Failed)
            })
            .and_then(|()| {
                let ctrl = &mut p.ctrl;
                let mut early = None;
                let r = wait_until(&self.stream, &p.out, deadline, None, || {
                    // The receiver's failure (or the connection's) ends the wait.
                    let left = deadline.saturating_duration_since(Instant::now());
                    match poll_ctrl(ctrl, left) {
                        Ok(None) => None,
                        Ok(Some(f)) => {
                            early = Some(f);
                            Some(WaitEnd::Stopped)
                        }
                        Err(e) => Some(WaitEnd::Failed(e)),
                    }
                });
                match (r, early) {
                    (Err(WaitEnd::Stopped), Some(f)) => Ok(Some(f)),
                    (r, _) => r.map(|()| None),
                }
            });
        let grace = GRACE.min(timeout);
        let unexpected = |other: &Ctrl| format!("unexpected answer {other:?} to write {seq}");
        // `(outcome, keep the pair)`.
        let (outcome, keep) = match sent {
            // Our sends are done; the receiver's answer follows.
            Ok(None) => match recv_ctrl(&mut p.ctrl, deadline) {
                Ok(Ctrl::Done { seq: s }) if s == seq => (Ok(()), true),
                Ok(Ctrl::Failed { seq: s, why }) if s == seq => (
                    Err(failed("write", format!("{} failed: {why}", peer.0))),
                    false,
                ),
                Ok(other) => (Self::give_up(p, seq, unexpected(&other), grace), false),
                Err(e) => (Self::give_up(p, seq, e.to_string(), grace), false),
            },
            // The receiver answered while our sends ran. Everything landed; our group
            // must have finished too before the communicator takes another one.
            Ok(Some(Ctrl::Done { seq: s })) if s == seq => {
                let ours = wait_until(&self.stream, &p.out, deadline, None, || None);
                (Ok(()), ours.is_ok())
            }
            Ok(Some(Ctrl::Failed { seq: s, why })) if s == seq => (
                Err(failed("write", format!("{} failed: {why}", peer.0))),
                false,
            ),
            Ok(Some(other)) => (Self::give_up(p, seq, unexpected(&other), grace), false),
            Err(w) => {
                let why = match w {
                    WaitEnd::Failed(e) => e.to_string(),
                    _ => format!("the sends did not complete within {timeout:?}"),
                };
                (Self::give_up(p, seq, why, grace), false)
            }
        };
        if !keep {
            // The pair is broken: our communicator stops, the peer must reconnect.
            self.peers.remove(peer);
        }
        outcome.map(|()| WriteReport {
            descriptors: segments.len(),
            bytes: segments.iter().map(|(_, s)| s.len).sum(),
            elapsed: t0.elapsed(),
        })
    }

    fn take_notifications(&mut self) -> Result<Vec<(PeerId, Vec<u8>)>, TransportError> {
        Ok(std::mem::take(&mut *self.inbox.lock().expect("inbox lock")))
    }

    unsafe fn open_window(
        &mut self,
        peer: &PeerId,
        window: u64,
        ranges: &[MemRegion],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let w = Window::new(peer, ranges, deadline, &self.regions)?;
        let mut ws = lock_windows(&self.windows);
        // Windows of imports that ended by their lease, never closed: past their
        // deadline they take no write, and their ids may come again.
        prune_expired(&mut ws, Instant::now(), |w| &w.window, |w| w.in_use > 0);
        if ws.contains_key(&window) {
            return Err(failed(
                "open window",
                format!("window {window} is open already"),
            ));
        }
        ws.insert(
            window,
            NcclWindow {
                window: w,
                in_use: 0,
                closing: false,
            },
        );
        Ok(())
    }

    fn close_window(&mut self, window: u64) -> Result<(), TransportError> {
        // The receive thread stops a receive into a closing window at its next poll and
        // aborts its communicator; wait for that, at most the grace period.
        let until = Instant::now() + GRACE.min(self.timeout);
        loop {
            {
                let mut ws = lock_windows(&self.windows);
                match ws.get_mut(&window) {
                    None => return Ok(()),
                    Some(w) if w.in_use == 0 => {
                        ws.remove(&window);
                        return Ok(());
                    }
                    Some(w) => w.closing = true,
                }
            }
            if Instant::now() > until {
                return Err(in_flight(format!(
                    "window {window} is closing but a receive into it did not stop within {:?}",
                    GRACE.min(self.timeout)
                )));
            }
            std::thread::sleep(POLL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn control_frames_round_trip_and_refuse_oversized_ones() {
        let (mut a, mut b) = pair();
        let h = Ctrl::Header {
            seq: 7,
            segments: vec![(MemKind::Device { ordinal: 0 }, 0x1000, 4096)],
            notification: b"req-7".to_vec(),
        };
        assert!(matches!(
            poll_ctrl(&mut b, Duration::from_secs(1)),
            Ok(None)
        ));
        send_ctrl(&mut a, &h).unwrap();
        let soon = || Instant::now() + Duration::from_secs(5);
        match recv_ctrl(&mut b, soon()).unwrap() {
            Ctrl::Header {
                seq,
                segments,
                notification,
            } => {
                assert_eq!(seq, 7);
                assert_eq!(
                    segments,
                    vec![(MemKind::Device { ordinal: 0 }, 0x1000, 4096)]
                );
                assert_eq!(notification, b"req-7");
            }
            other => panic!("{other:?}"),
        }
        // Silence: a typed timeout, not a hang.
        let e = recv_ctrl(&mut b, Instant::now() + Duration::from_millis(50)).unwrap_err();
        assert!(e.to_string().contains("did not answer"), "{e}");
        a.write_all(&(MAX_FRAME + 1).to_le_bytes()).unwrap();
        let e = recv_ctrl(&mut b, soon()).unwrap_err();
        assert!(
            e.to_string().contains("not this transport's protocol"),
            "{e}"
        );
        drop(a);
        let e = poll_ctrl(&mut b, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("closed"), "{e}");
    }

    #[test]
    fn a_frame_dripped_slower_than_its_deadline_is_cut_off() {
        let (mut a, mut b) = pair();
        let frame = Ctrl::Ack { seq: 1 }.encode().unwrap();
        let t = std::thread::spawn(move || {
            for byte in frame {
                if a.write_all(&[byte]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let t0 = Instant::now();
        let e = recv_ctrl(&mut b, Instant::now() + Duration::from_millis(150)).unwrap_err();
        assert!(e.to_string().contains("did not answer"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        drop(b);
        t.join().unwrap();
    }

    #[test]
    fn without_nccl_or_a_gpu_new_says_what_is_missing() {
        // On a machine with both this builds a transport; elsewhere the error names
        // what to install, and nothing panics.
        match NcclTransport::new("t", 0) {
            Ok(t) => assert_eq!(t.name(), "nccl"),
            Err(TransportError::Unavailable { transport, why }) => {
                assert_eq!(transport, "nccl");
                assert!(
                    why.contains("libnccl") || why.contains("CUDA") || why.contains("cu"),
                    "{why}"
                );
            }
            Err(e) => panic!("{e}"),
        }
        let e = NcclTransport::with_control("t", 0, "0.0.0.0:0".parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("unspecified"), "{e}");
    }

    #[test]
    fn the_configuration_is_nccls_initializer_with_blocking_off() {
        let c = config();
        assert_eq!(c.size, std::mem::size_of::<nc::ncclConfig_t>());
        assert_eq!((c.magic, c.version, c.blocking), (0xcafe_beef, 22800, 0));
        assert_eq!(c.minCTAs, i32::MIN);
        assert!(c.netName.is_null() && c.commName.is_null());
    }
}

/// Fuzzing the control protocol's JSON and the metadata (proptest, a fixed seed and
/// case budget): random bytes and mutated encodings of every frame decode to a frame or
/// a typed error, never a panic.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    #[test]
    fn control_frames_and_metadata_refuse_or_decode() {
        let frames: Vec<Vec<u8>> = [
            Ctrl::Header {
                seq: 3,
                segments: vec![(MemKind::Device { ordinal: 0 }, 1 << 40, 4096)],
                notification: b"req-1".to_vec(),
            },
            Ctrl::Ack { seq: 3 },
            Ctrl::Refused {
                seq: 3,
                why: "x".into(),
            },
            Ctrl::Done { seq: 3 },
            Ctrl::Failed {
                seq: 3,
                why: "y".into(),
            },
            Ctrl::Abort { seq: 3 },
        ]
        .iter()
        .map(|c| c.encode().unwrap()[8..].to_vec())
        .chain(std::iter::once(
            serde_json::to_vec(&Metadata {
                agent: "a".into(),
                control: "127.0.0.1:1".parse().unwrap(),
                regions: vec![],
                secret: "ab".repeat(32),
            })
            .unwrap(),
        ))
        .collect();
        let input = prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..128),
            (0..frames.len(), any::<usize>(), any::<u8>()).prop_map(move |(f, i, x)| {
                let mut b = frames[f].clone();
                let i = i % b.len();
                b[i] = x;
                b
            }),
        ];
        let mut runner = TestRunner::new_with_rng(
            Config::with_cases(512),
            TestRng::from_seed(RngAlgorithm::ChaCha, &[29; 32]),
        );
        runner
            .run(&input, |b| {
                let _ = serde_json::from_slice::<Ctrl>(&b);
                if let Ok(md) = serde_json::from_slice::<Metadata>(&b) {
                    let _ = control::unhex(&md.secret);
                }
                Ok(())
            })
            .unwrap();
    }
}
