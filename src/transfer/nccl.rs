//! [`NcclTransport`]: KV pages between processes over NCCL point-to-point (`ncclSend` /
//! `ncclRecv`), the transport for machines without NIXL. The library is `dlopen`ed at
//! run time (cudarc's dynamic loading): a build needs nothing of NCCL, and
//! [`NcclTransport::new`] returns [`TransportError::Unavailable`] where `libnccl.so.2` or
//! a CUDA device is missing.
//!
//! # What it moves
//!
//! GPU memory of **one** device (the transport's ordinal) and pinned, device-mapped host
//! memory (the CUDA backend's host tier): NCCL's kernels read and write the pages
//! directly. [`register`](KvTransport::register) asks the driver about every region and
//! refuses pageable host memory (the host backend's pools: use the NIXL or the local
//! transport there) and other devices' memory (one transport per GPU; an engine with
//! several devices moves its pages over NIXL).
//!
//! # How a one-sided write runs on a two-sided library
//!
//! NCCL needs a receive posted for every send. Each transport therefore keeps, per
//! connected peer, a small TCP control connection and a **receive thread**; the caller
//! of the importing side does nothing but read notifications, as with NIXL:
//!
//! 1. [`write`](KvTransport::write) checks every segment against both sides'
//!    registrations and sends the segment list (destination, length) and the
//!    notification as a header on the control connection;
//! 2. the peer's receive thread checks every destination against **its own**
//!    registrations (a forged or stale header is refused before anything is posted:
//!    nothing moves), acknowledges, and posts one `ncclRecv` per segment (one NCCL
//!    group);
//! 3. the writer posts one `ncclSend` per segment (one group) and waits for its stream;
//! 4. the receive thread waits for its stream, files the notification (it is visible to
//!    [`take_notifications`](KvTransport::take_notifications) only after every byte has
//!    landed), and reports `Done`; only then does `write` return.
//!
//! Every wait has a deadline ([`NcclTransport::set_timeout`], 60 s by default). A side
//! that times out aborts its communicator (`ncclCommAbort`: its kernels stop) and tells
//! the other; the connection is then closed and the peer must be connected again. When
//! the writer gives up before the receiver reported (no `Done`, no failure), the
//! receiver's receives may still be landing and `write` returns
//! [`TransportError::InFlight`]; after the receiver reported a failure it returns
//! [`TransportError::Failed`] (nothing lands any more).
//!
//! # Communicators
//!
//! Two 2-rank communicators per pair of transports, one per direction (sender rank 0,
//! receiver rank 1): the writer's calls and the receive thread never share one.
//! [`connect`](KvTransport::connect) exchanges their unique ids over the control
//! connections, initializes both (in the same order on both sides: the lexically
//! smaller agent's sending communicator first) and moves one byte each way, so that
//! NCCL's point-to-point connections are set up there, while both sides are known to
//! take part. Both sides must call `connect` with each other's metadata at about the
//! same time (within the timeout).
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

use std::collections::HashMap;
use std::ffi::CStr;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{sys as cu, CudaContext, CudaStream};
use cudarc::nccl::sys as nc;
use serde::{Deserialize, Serialize};

use super::{
    check_segments, KvTransport, MemKind, MemRegion, PeerId, TransportError, WriteBatch,
    WriteReport,
};

const TRANSPORT: &str = "nccl";
/// How often a waiting thread looks at its stream, its control socket and its stop flag.
const POLL: Duration = Duration::from_micros(50);
/// How long a receive thread blocks on its control socket before it looks at its stop
/// flag.
const IDLE: Duration = Duration::from_millis(100);
/// The largest control frame accepted (a header of about 500,000 segments).
const MAX_FRAME: u64 = 16 << 20;

fn failed(op: &'static str, detail: impl Into<String>) -> TransportError {
    TransportError::Failed {
        transport: TRANSPORT,
        op,
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

fn nccl(op: &'static str, r: nc::ncclResult_t) -> Result<(), TransportError> {
    match r {
        nc::ncclResult_t::ncclSuccess => Ok(()),
        r => Err(failed(op, nccl_message(r))),
    }
}

fn driver(op: &'static str, e: cudarc::driver::DriverError) -> TransportError {
    failed(op, format!("{e:?}"))
}

/// One communicator; aborted when dropped (`ncclCommAbort` is local: it never waits for
/// the peer, and stops this side's kernels).
struct Comm(nc::ncclComm_t);

// SAFETY: a communicator is used by one thread at a time (the writer, or its receive
// thread); the handle itself is a plain pointer NCCL allows to move between threads.
unsafe impl Send for Comm {}

impl Comm {
    fn abort(&mut self) {
        if !self.0.is_null() {
            // SAFETY: a communicator NCCL created and nobody aborted yet.
            unsafe { nc::ncclCommAbort(self.0) };
            self.0 = std::ptr::null_mut();
        }
    }

    /// An error NCCL reported asynchronously (a network failure, a peer gone).
    fn async_error(&self) -> Option<String> {
        let mut r = nc::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator, a valid out-pointer.
        unsafe { nc::ncclCommGetAsyncError(self.0, &mut r) };
        match r {
            nc::ncclResult_t::ncclSuccess | nc::ncclResult_t::ncclInProgress => None,
            r => Some(nccl_message(r)),
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.abort();
    }
}

/// The control frames, length-prefixed JSON.
#[derive(Debug, Serialize, Deserialize)]
enum Ctrl {
    /// First frame on a control connection: who connects, and the unique id of the
    /// communicator it sends on (this connection's direction).
    Hello { agent: String, id: Vec<u8> },
    /// A write: `(memory, destination, bytes)` per segment, then the notification.
    Header {
        segments: Vec<(MemKind, u64, u64)>,
        notification: Vec<u8>,
    },
    /// The receives are posted.
    Ack,
    /// The header was refused; nothing was posted.
    Refused(String),
    /// Every byte has landed; the notification is filed.
    Done,
    /// The receiver failed and aborted its communicator: nothing lands any more.
    Failed(String),
}

fn send_ctrl(s: &mut TcpStream, m: &Ctrl) -> Result<(), TransportError> {
    let b = serde_json::to_vec(m).map_err(|e| failed("control", e.to_string()))?;
    s.write_all(&(b.len() as u64).to_le_bytes())
        .and_then(|()| s.write_all(&b))
        .map_err(io("control send"))
}

/// Reads one frame, waiting at most `timeout` for it.
fn recv_ctrl(s: &mut TcpStream, timeout: Duration) -> Result<Ctrl, TransportError> {
    s.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
        .map_err(io("control receive"))?;
    let mut n = [0u8; 8];
    s.read_exact(&mut n).map_err(|e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => failed(
            "control receive",
            format!("the peer did not answer within {timeout:?}"),
        ),
        _ => failed("control receive", e.to_string()),
    })?;
    let n = u64::from_le_bytes(n);
    if n > MAX_FRAME {
        return Err(failed(
            "control receive",
            format!("a frame of {n} bytes: not this transport's protocol"),
        ));
    }
    let mut b = vec![0u8; n as usize];
    s.read_exact(&mut b).map_err(io("control receive"))?;
    serde_json::from_slice(&b).map_err(|e| failed("control receive", e.to_string()))
}

#[derive(Serialize, Deserialize)]
struct Metadata {
    agent: String,
    /// Where this transport accepts control connections.
    control: SocketAddr,
    regions: Vec<MemRegion>,
}

/// The writer's side of one peer.
struct Peer {
    regions: Vec<MemRegion>,
    /// The communicator this side sends on (rank 0).
    out: Comm,
    /// The control connection of this direction (headers out, answers in).
    ctrl: TcpStream,
    /// The receive thread of the other direction (held for its `Drop`: stop, join).
    _receiver: Receiver,
}

struct Receiver {
    stop: Arc<AtomicBool>,
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

/// What the receive threads filed: notifications, and failures (reported once each).
type Inbox = Arc<Mutex<Vec<Result<(PeerId, Vec<u8>), String>>>>;

/// See the module docs.
pub struct NcclTransport {
    name: String,
    ordinal: u32,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// One byte of device memory for the connection warm-up.
    scratch: cu::CUdeviceptr,
    listener: TcpListener,
    control: SocketAddr,
    regions: Vec<MemRegion>,
    timeout: Duration,
    peers: HashMap<PeerId, Peer>,
    /// Control connections accepted for a `connect` not made yet: agent → (stream, id).
    pending: HashMap<String, (TcpStream, Vec<u8>)>,
    inbox: Inbox,
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
                "libnccl.so.2 was not found: install NCCL (Debian/Ubuntu `libnccl2`, or \
                 the `nvidia-nccl-cu13` wheel's `lib` folder) and put it on LD_LIBRARY_PATH",
            ));
        }
        cudarc::driver::result::init().map_err(|e| unavailable(format!("cuInit: {e:?}")))?;
        let count = CudaContext::device_count()
            .map_err(|e| unavailable(format!("cuDeviceGetCount: {e:?}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(unavailable(format!(
                "CUDA device {ordinal} was requested but {count} are present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver("cuCtxCreate", e))?;
        let stream = ctx.new_stream().map_err(|e| driver("cuStreamCreate", e))?;
        ctx.bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        // SAFETY: the context is current; freed in Drop.
        let scratch = unsafe { cudarc::driver::result::malloc_sync(1) }
            .map_err(|e| driver("cuMemAlloc", e))?;
        let listener = TcpListener::bind(control).map_err(io("bind the control socket"))?;
        let control = listener
            .local_addr()
            .map_err(io("bind the control socket"))?;
        listener
            .set_nonblocking(true)
            .map_err(io("bind the control socket"))?;
        Ok(NcclTransport {
            name: name.to_string(),
            ordinal: ordinal as u32,
            ctx,
            stream,
            scratch,
            listener,
            control,
            regions: Vec::new(),
            timeout: Duration::from_secs(60),
            peers: HashMap::new(),
            pending: HashMap::new(),
            inbox: Arc::default(),
        })
    }

    /// How long any wait may last (connect, a write, a receive); 60 s by default.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn bind(&self) -> Result<(), TransportError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))
    }

    /// The control connection `agent` opened to us, with the id of the communicator it
    /// sends on.
    fn accept_from(
        &mut self,
        agent: &str,
        deadline: Instant,
    ) -> Result<(TcpStream, Vec<u8>), TransportError> {
        loop {
            if let Some(c) = self.pending.remove(agent) {
                return Ok(c);
            }
            match self.listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false).map_err(io("accept"))?;
                    s.set_nodelay(true).map_err(io("accept"))?;
                    let left = deadline.saturating_duration_since(Instant::now());
                    // Anything but a Hello is not a peer of ours: dropped.
                    if let Ok(Ctrl::Hello { agent, id }) = recv_ctrl(&mut s, left) {
                        self.pending.insert(agent, (s, id));
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        return Err(failed(
                            "connect",
                            format!("{agent} did not open its control connection within {:?}: both sides must connect", self.timeout),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(failed("accept", e.to_string())),
            }
        }
    }

    /// Joins the communicator `id` (as the sender, rank 0, or the receiver, rank 1) and
    /// moves one byte over it.
    fn open(&self, id: &[u8], sending: bool, deadline: Instant) -> Result<Comm, TransportError> {
        let comm = init_comm(&self.ctx, id, if sending { 0 } else { 1 }, deadline)?;
        self.bind()?;
        self.warm_up(&comm, sending, deadline)?;
        Ok(comm)
    }

    /// Moves one byte over `comm` (sending or receiving) and waits for it.
    fn warm_up(&self, comm: &Comm, send: bool, deadline: Instant) -> Result<(), TransportError> {
        let s = self.stream.cu_stream() as nc::cudaStream_t;
        let p = self.scratch as *mut std::ffi::c_void;
        // SAFETY: one byte of our scratch allocation, on our stream, over a live
        // communicator; waited for below.
        let r = unsafe {
            if send {
                nc::ncclSend(p, 1, nc::ncclDataType_t::ncclUint8, 1, comm.0, s)
            } else {
                nc::ncclRecv(p, 1, nc::ncclDataType_t::ncclUint8, 0, comm.0, s)
            }
        };
        nccl(if send { "ncclSend" } else { "ncclRecv" }, r)?;
        wait(&self.stream, comm, deadline, None)
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

/// Why a wait ended early.
enum WaitEnd {
    Failed(TransportError),
    TimedOut,
    Stopped,
}

impl From<WaitEnd> for TransportError {
    fn from(w: WaitEnd) -> Self {
        match w {
            WaitEnd::Failed(e) => e,
            WaitEnd::TimedOut => failed("wait", "timed out"),
            WaitEnd::Stopped => failed("wait", "the transport is shutting down"),
        }
    }
}

/// Waits for `stream`'s work, polling, until `deadline` (or `stop`).
fn wait_until(
    stream: &CudaStream,
    comm: &Comm,
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<(), WaitEnd> {
    loop {
        // SAFETY: a live stream of a context current on this thread.
        match unsafe { cu::cuStreamQuery(stream.cu_stream()) } {
            cu::CUresult::CUDA_SUCCESS => return Ok(()),
            cu::CUresult::CUDA_ERROR_NOT_READY => {}
            r => return Err(WaitEnd::Failed(failed("cuStreamQuery", format!("{r:?}")))),
        }
        if let Some(e) = comm.async_error() {
            return Err(WaitEnd::Failed(failed("transfer", e)));
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

fn wait(
    stream: &CudaStream,
    comm: &Comm,
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<(), TransportError> {
    wait_until(stream, comm, deadline, stop).map_err(Into::into)
}

/// Initializes a 2-rank communicator as `rank`, waiting at most until `deadline` for the
/// peer to join (on a helper thread: `ncclCommInitRank` blocks until it does; one left
/// behind by a timeout aborts its communicator if the peer ever joins).
fn init_comm(
    ctx: &Arc<CudaContext>,
    id: &[u8],
    rank: i32,
    deadline: Instant,
) -> Result<Comm, TransportError> {
    let mut uid = nc::ncclUniqueId { internal: [0; 128] };
    if id.len() != uid.internal.len() {
        return Err(TransportError::BadMetadata(format!(
            "an NCCL unique id of {} bytes (want {})",
            id.len(),
            uid.internal.len()
        )));
    }
    for (d, s) in uid.internal.iter_mut().zip(id) {
        *d = *s as std::ffi::c_char;
    }
    let (tx, rx) = mpsc::channel();
    let ctx = ctx.clone();
    std::thread::spawn(move || {
        let r = ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))
            .and_then(|()| {
                let mut c: nc::ncclComm_t = std::ptr::null_mut();
                // SAFETY: a valid out-pointer and unique id; the context is current.
                nccl("ncclCommInitRank", unsafe {
                    nc::ncclCommInitRank(&mut c, 2, uid, rank)
                })
                .map(|()| Comm(c))
            });
        // A receiver gone (timed out) drops the communicator here: aborted.
        let _ = tx.send(r);
    });
    let left = deadline.saturating_duration_since(Instant::now());
    match rx.recv_timeout(left) {
        Ok(r) => r,
        Err(_) => Err(failed(
            "ncclCommInitRank",
            "the peer did not join the communicator in time: both sides must connect",
        )),
    }
}

fn unique_id() -> Result<Vec<u8>, TransportError> {
    let mut id = nc::ncclUniqueId { internal: [0; 128] };
    // SAFETY: a valid out-pointer.
    nccl("ncclGetUniqueId", unsafe { nc::ncclGetUniqueId(&mut id) })?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// Whether `r` is memory NCCL's kernels on device `ordinal` can use at its own address:
/// device memory of that device, or pinned, device-mapped host memory (UVA).
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
    let mut dev: cu::CUdeviceptr = 0;
    // SAFETY: a valid out-pointer of the attribute's type; the driver only looks the
    // address up.
    let q = unsafe {
        cu::cuPointerGetAttribute(
            (&mut dev as *mut cu::CUdeviceptr).cast(),
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
            r.addr,
        )
    };
    if q != cu::CUresult::CUDA_SUCCESS || dev != r.addr {
        return Err(format!(
            "{:?} memory at {:#x} is not device-accessible at its own address ({q:?}): NCCL moves GPU memory and pinned, device-mapped host memory (the CUDA backend's pools); the host backend's pools need the NIXL or the local transport",
            r.mem, r.addr
        ));
    }
    Ok(())
}

/// The receive thread of one peer: serves its headers until the connection closes, the
/// transport stops, or a transfer fails (then the communicator is aborted and the peer
/// told).
#[allow(clippy::too_many_arguments)]
fn receive_loop(
    ctx: Arc<CudaContext>,
    peer: PeerId,
    mut comm: Comm,
    mut ctrl: TcpStream,
    regions: Vec<MemRegion>,
    inbox: Inbox,
    stop: Arc<AtomicBool>,
    timeout: Duration,
) {
    let file = |e: String| {
        tracing::warn!(peer = %peer.0, "nccl receive: {e}");
        inbox.lock().expect("inbox lock").push(Err(e));
    };
    let stream = match ctx.bind_to_thread().and_then(|()| ctx.new_stream()) {
        Ok(s) => s,
        Err(e) => return file(format!("cannot create the receive stream: {e:?}")),
    };
    let s = stream.cu_stream() as nc::cudaStream_t;
    loop {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        // Wait for a frame, looking at the stop flag between reads.
        if ctrl.set_read_timeout(Some(IDLE)).is_err() {
            return;
        }
        let mut one = [0u8; 1];
        match ctrl.peek(&mut one) {
            Ok(0) => return, // the peer closed the connection
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(e) => return file(format!("control connection: {e}")),
        }
        let (segments, notification) = match recv_ctrl(&mut ctrl, timeout) {
            Ok(Ctrl::Header {
                segments,
                notification,
            }) => (segments, notification),
            Ok(other) => return file(format!("unexpected control frame {other:?}")),
            Err(e) => return file(e.to_string()),
        };
        // Every destination must lie in memory this side registered: a header that says
        // otherwise is refused before anything is posted.
        let bad = segments.iter().enumerate().find(|(_, &(mem, dst, len))| {
            !regions.iter().any(|r| r.mem == mem && r.contains(dst, len))
        });
        if let Some((index, &(mem, dst, len))) = bad {
            let why = format!(
                "segment {index} ({len} bytes of {mem:?} at {dst:#x}) lies outside this side's registered memory"
            );
            file(format!("refused a write: {why}"));
            if send_ctrl(&mut ctrl, &Ctrl::Refused(why)).is_err() {
                return;
            }
            continue;
        }
        // Acknowledged before posting: the writer's group and ours then run together
        // (NCCL may set up a channel's connection inside either, and that needs both).
        if send_ctrl(&mut ctrl, &Ctrl::Ack).is_err() {
            return;
        }
        let posted = (|| {
            // SAFETY: group calls on this thread only.
            nccl("ncclGroupStart", unsafe { nc::ncclGroupStart() })?;
            for &(_, dst, len) in &segments {
                // SAFETY: inside registered memory (checked above), which stays
                // allocated while the transport lives; only pages an import reserved are
                // written (the register contract); waited for below.
                let r = unsafe {
                    nc::ncclRecv(
                        dst as *mut std::ffi::c_void,
                        len as usize,
                        nc::ncclDataType_t::ncclUint8,
                        0,
                        comm.0,
                        s,
                    )
                };
                if let Err(e) = nccl("ncclRecv", r) {
                    // SAFETY: closes the group opened above.
                    let _ = unsafe { nc::ncclGroupEnd() };
                    return Err(e);
                }
            }
            // SAFETY: closes the group opened above.
            nccl("ncclGroupEnd", unsafe { nc::ncclGroupEnd() })
        })();
        let ended = posted.and_then(|()| {
            wait_until(&stream, &comm, Instant::now() + timeout, Some(&stop)).map_err(|w| match w {
                WaitEnd::TimedOut => failed(
                    "receive",
                    format!("the bytes did not land within {timeout:?}"),
                ),
                w => w.into(),
            })
        });
        match ended {
            Ok(()) => {
                inbox
                    .lock()
                    .expect("inbox lock")
                    .push(Ok((peer.clone(), notification)));
                if send_ctrl(&mut ctrl, &Ctrl::Done).is_err() {
                    return;
                }
            }
            Err(e) => {
                // Stop our kernels before telling the writer nothing lands any more.
                comm.abort();
                let _ = send_ctrl(&mut ctrl, &Ctrl::Failed(e.to_string()));
                return file(e.to_string());
            }
        }
    }
}

impl KvTransport for NcclTransport {
    fn name(&self) -> &str {
        "nccl"
    }

    unsafe fn register(&mut self, regions: &[MemRegion]) -> Result<(), TransportError> {
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
        let id = PeerId(md.agent.clone());
        if self.peers.contains_key(&id) {
            return Err(TransportError::BadMetadata(format!(
                "{:?} is connected already",
                md.agent
            )));
        }
        let deadline = Instant::now() + self.timeout;
        // Our direction: a control connection to the peer, and the unique id of the
        // communicator we send on.
        let out_id = unique_id()?;
        let mut ctrl = loop {
            match TcpStream::connect_timeout(&md.control, Duration::from_secs(1)) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    return Err(failed(
                        "connect",
                        format!("cannot reach {} at {}: {e}", md.agent, md.control),
                    ))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        ctrl.set_nodelay(true).map_err(io("connect"))?;
        send_ctrl(
            &mut ctrl,
            &Ctrl::Hello {
                agent: self.name.clone(),
                id: out_id.clone(),
            },
        )?;
        // The peer's direction.
        let (incoming, in_id) = self.accept_from(&md.agent, deadline)?;
        // Both communicators, each with its one-byte warm-up, in the same order on both
        // sides (the lexically smaller agent's sending communicator first).
        let (out, inc) = if self.name < md.agent {
            let out = self.open(&out_id, true, deadline)?;
            (out, self.open(&in_id, false, deadline)?)
        } else {
            let inc = self.open(&in_id, false, deadline)?;
            (self.open(&out_id, true, deadline)?, inc)
        };
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (ctx, peer, regions, inbox, stop, timeout) = (
                self.ctx.clone(),
                id.clone(),
                self.regions.clone(),
                self.inbox.clone(),
                stop.clone(),
                self.timeout,
            );
            std::thread::Builder::new()
                .name(format!("nccl-recv-{}", md.agent))
                .spawn(move || {
                    receive_loop(ctx, peer, inc, incoming, regions, inbox, stop, timeout)
                })
                .map_err(io("spawn the receive thread"))?
        };
        self.peers.insert(
            id.clone(),
            Peer {
                regions: md.regions,
                out,
                ctrl,
                _receiver: Receiver {
                    stop,
                    thread: Some(thread),
                },
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
        let p = self
            .peers
            .get_mut(peer)
            .ok_or_else(|| TransportError::UnknownPeer(peer.0.clone()))?;
        check_segments(batches, &self.regions, "local")?;
        check_segments(batches, &p.regions, "remote")?;
        let segments: Vec<_> = batches
            .iter()
            .flat_map(|b| b.segments.iter().map(move |s| (b.dst_mem, *s)))
            .filter(|(_, s)| s.len > 0)
            .collect();
        let t0 = Instant::now();
        let deadline = t0 + self.timeout;
        send_ctrl(
            &mut p.ctrl,
            &Ctrl::Header {
                segments: segments.iter().map(|(m, s)| (*m, s.dst, s.len)).collect(),
                notification: notification.to_vec(),
            },
        )?;
        match recv_ctrl(&mut p.ctrl, self.timeout)? {
            Ctrl::Ack => {}
            Ctrl::Refused(why) => {
                return Err(failed(
                    "write",
                    format!("{} refused the write: {why}", peer.0),
                ))
            }
            Ctrl::Failed(why) => return Err(failed("write", format!("{} failed: {why}", peer.0))),
            other => return Err(failed("write", format!("unexpected answer {other:?}"))),
        }
        // From here on the peer has receives posted into its pages: until it reports, a
        // failure here leaves bytes possibly in flight.
        let in_flight = |detail: String| TransportError::InFlight {
            transport: TRANSPORT,
            detail,
        };
        let result = (|| {
            self.ctx
                .bind_to_thread()
                .map_err(|e| driver("cuCtxSetCurrent", e))?;
            let s = self.stream.cu_stream() as nc::cudaStream_t;
            // SAFETY: group calls on this thread only.
            nccl("ncclGroupStart", unsafe { nc::ncclGroupStart() })?;
            for (_, seg) in &segments {
                // SAFETY: inside our registered memory (checked above), read only; the
                // peer's receive for the same bytes is posted; waited for below.
                let r = unsafe {
                    nc::ncclSend(
                        seg.src as *const std::ffi::c_void,
                        seg.len as usize,
                        nc::ncclDataType_t::ncclUint8,
                        1,
                        p.out.0,
                        s,
                    )
                };
                if let Err(e) = nccl("ncclSend", r) {
                    // SAFETY: closes the group opened above.
                    let _ = unsafe { nc::ncclGroupEnd() };
                    return Err(e);
                }
            }
            // SAFETY: closes the group opened above.
            nccl("ncclGroupEnd", unsafe { nc::ncclGroupEnd() })?;
            wait_until(&self.stream, &p.out, deadline, None).map_err(|w| match w {
                WaitEnd::TimedOut => failed(
                    "write",
                    format!("the sends did not complete within {:?}", self.timeout),
                ),
                w => w.into(),
            })
        })();
        let answer = match result {
            Ok(()) => recv_ctrl(
                &mut p.ctrl,
                deadline.saturating_duration_since(Instant::now()),
            ),
            Err(e) => Err(e),
        };
        let outcome = match answer {
            Ok(Ctrl::Done) => Ok(()),
            // The receiver aborted its communicator: nothing lands any more.
            Ok(Ctrl::Failed(why)) => Err(failed("write", format!("{} failed: {why}", peer.0))),
            Ok(other) => Err(in_flight(format!("unexpected answer {other:?}"))),
            Err(e) => Err(in_flight(e.to_string())),
        };
        match outcome {
            Ok(()) => Ok(WriteReport {
                descriptors: segments.len(),
                bytes: segments.iter().map(|(_, s)| s.len).sum(),
                elapsed: t0.elapsed(),
            }),
            Err(e) => {
                // The pair is broken: our communicator stops, the peer must reconnect.
                self.peers.remove(peer);
                Err(e)
            }
        }
    }

    fn take_notifications(&mut self) -> Result<Vec<(PeerId, Vec<u8>)>, TransportError> {
        let mut inbox = self.inbox.lock().expect("inbox lock");
        let mut out = Vec::new();
        while !inbox.is_empty() {
            match inbox.remove(0) {
                Ok(n) => out.push(n),
                Err(e) => {
                    // Reported once; the notifications before it stay filed.
                    for n in out.into_iter().rev() {
                        inbox.insert(0, Ok(n));
                    }
                    return Err(failed("receive", e));
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_frames_round_trip_and_refuse_oversized_ones() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let h = Ctrl::Header {
            segments: vec![(MemKind::Device { ordinal: 0 }, 0x1000, 4096)],
            notification: b"req-7".to_vec(),
        };
        send_ctrl(&mut a, &h).unwrap();
        match recv_ctrl(&mut b, Duration::from_secs(5)).unwrap() {
            Ctrl::Header {
                segments,
                notification,
            } => {
                assert_eq!(
                    segments,
                    vec![(MemKind::Device { ordinal: 0 }, 0x1000, 4096)]
                );
                assert_eq!(notification, b"req-7");
            }
            other => panic!("{other:?}"),
        }
        // Silence: a typed timeout, not a hang.
        let e = recv_ctrl(&mut b, Duration::from_millis(50)).unwrap_err();
        assert!(e.to_string().contains("did not answer"), "{e}");
        a.write_all(&(MAX_FRAME + 1).to_le_bytes()).unwrap();
        let e = recv_ctrl(&mut b, Duration::from_secs(5)).unwrap_err();
        assert!(
            e.to_string().contains("not this transport's protocol"),
            "{e}"
        );
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
}
