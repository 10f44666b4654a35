//! [`NixlTransport`]: KV pages between processes and hosts through NVIDIA NIXL (UCX
//! backend), with the same semantics as [`LocalTransport`](super::LocalTransport).
//!
//! # The library
//!
//! `nixl-sys` is built with its `stub-api` feature: nothing of NIXL is needed to compile
//! (only `libclang` for its bindgen step: Debian `libclang-dev`), and every call goes
//! through `libnixl_capi.so`, which is `dlopen`ed at run time from `LD_LIBRARY_PATH`.
//! [`NixlTransport::new`] checks that the library loaded before any other call (a call
//! into a missing library aborts the process) and returns
//! [`TransportError::Unavailable`] with what to install otherwise.
//!
//! The runtime comes from PyPI's `nixl-cu13` wheel, files only (it `Requires` torch and
//! numpy, which NIXL's C API does not use). Pin **1.5.1**: the `nixl` 1.5.2 meta wheel
//! asks for `nixl-cu13==1.5.2`, which is not published; the 1.5.2 crate against the
//! 1.5.1 library works (the C API uses opaque handles, every symbol is there).
//!
//! ```text
//! pip download --no-deps -d /tmp/whl nixl-cu13==1.5.1
//! python3 -m zipfile -e /tmp/whl/nixl_cu13-*.whl /tmp/whl/unpacked
//! export NIXL_HOME=/tmp/whl/unpacked     # or the trimmed tree of .ci/nixl_setup.sh
//! export LD_LIBRARY_PATH=$NIXL_HOME/.nixl_cu13.mesonpy.libs
//! export NIXL_PLUGIN_DIR=$NIXL_HOME/.nixl_cu13.mesonpy.libs/plugins
//! export UCX_TLS=tcp,self                # machines without RDMA (CI)
//! ```
//!
//! `.ci/nixl_setup.sh` does all of it and keeps only what the UCX backend loads (about
//! 30 MiB instead of 229): `libnixl_capi.so`, `plugins/libplugin_UCX.so`, UCX's `cma`
//! module and their shared-library closure, the wheel's layout kept so that the
//! libraries' `$ORIGIN` run paths and UCX's module directory (`nixl_cu13.libs/ucx`) still
//! resolve.
//!
//! * `LD_LIBRARY_PATH` must hold the wheel's `.nixl_cu13.mesonpy.libs` folder.
//! * `NIXL_PLUGIN_DIR`: where NIXL looks for `libplugin_UCX.so` (the `plugins` folder
//!   next to `libnixl.so` when unset).
//! * `UCX_TLS`: the UCX transports. `tcp,self` works everywhere; the default also uses
//!   `cma` (`process_vm_writev`, needs ptrace permission between the two processes) on
//!   one host, and `rc`/`dc` verbs where the InfiniBand modules are there. `UCX_TLS`
//!   without `tcp` on a host without RDMA (`sm,self`) fails at backend creation.
//! * `UCX_MODULE_DIR` only if the tree is rearranged (UCX's default is the `ucx` folder
//!   next to `libucs`); `NIXL_LOG_LEVEL=INFO` prints the library version.
//!
//! # Two hosts
//!
//! The transport does not carry its own metadata: [`KvTransport::local_metadata`] is a
//! blob that the caller sends to the peer over any channel (a TCP socket, the router's
//! control plane) and the peer passes to [`KvTransport::connect`]. The blob holds the
//! agent's registered memory and its UCX worker address, so only the metadata channel
//! needs an address: run the decode side with its metadata served on `0.0.0.0:PORT`, the
//! prefill side connects to `DECODE_HOST:PORT`, both exchange metadata, and UCX then
//! talks directly, over TCP (`UCX_TLS=tcp,self`), or over RDMA when the wheel's
//! InfiniBand modules (`nixl_cu13.libs/ucx/libuct_ib*` with the bundled `libibverbs`,
//! `libmlx5`, `libnl-3`, `libnl-route-3`) are carried too and `UCX_TLS` allows them
//! (e.g. `rc,tcp,self` or unset). GPU memory (`MemKind::Device`) additionally needs
//! UCX's CUDA modules (`libuct_cuda`, `libucm_cuda`; `.ci/nixl_setup.sh --cuda`) and the
//! driver's `libcuda.so.1`. Both agents need distinct names.
//!
//! # Semantics
//!
//! * one NIXL registration per [`MemRegion`], kept for the transport's life;
//! * [`write`](KvTransport::write) checks every source segment against the local
//!   registrations, then creates one transfer request per [`WriteBatch`] (one descriptor
//!   per segment: callers coalesce, NIXL is told not to merge, so the count posted is
//!   theirs) and creates **all** of them before posting any, so a destination outside
//!   the peer's registered memory (NIXL checks it against the peer's metadata) fails
//!   before a byte moves; it then posts every batch but the last, waits for them, and
//!   posts the last one with the notification, so the peer sees the notification only
//!   after every byte has landed.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap, OptArgs,
    RegistrationHandle, XferDescList, XferOp, XferRequest, XferStatus,
};

use super::{KvTransport, MemKind, MemRegion, PeerId, TransportError, WriteBatch, WriteReport};

const TRANSPORT: &str = "nixl";

/// How long [`KvTransport::write`] waits for its requests by default.
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// What to do when `libnixl_capi.so` is missing.
const INSTALL_HINT: &str = "libnixl_capi.so could not be loaded (nixl-sys is built with its \
stub API and loads NIXL at run time). Install the runtime from the nixl-cu13 wheel: \
`pip download --no-deps nixl-cu13==1.5.1` and unpack it (or run .ci/nixl_setup.sh, which \
prints the exports), then set LD_LIBRARY_PATH=$NIXL_HOME/.nixl_cu13.mesonpy.libs, \
NIXL_PLUGIN_DIR=$NIXL_HOME/.nixl_cu13.mesonpy.libs/plugins and, without RDMA, \
UCX_TLS=tcp,self";

/// A registered region as NIXL sees it.
#[derive(Debug)]
struct Region(MemRegion);

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0.addr as *const u8
    }

    fn size(&self) -> usize {
        self.0.len as usize
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        mem_type(self.0.mem)
    }

    fn device_id(&self) -> u64 {
        device_id(self.0.mem)
    }
}

fn mem_type(m: MemKind) -> MemType {
    match m {
        MemKind::Host => MemType::Dram,
        MemKind::Device { .. } => MemType::Vram,
    }
}

fn device_id(m: MemKind) -> u64 {
    match m {
        MemKind::Host => 0,
        MemKind::Device { ordinal } => u64::from(ordinal),
    }
}

fn failed(op: &'static str, detail: impl ToString) -> TransportError {
    TransportError::Failed {
        transport: TRANSPORT,
        op,
        detail: detail.to_string(),
    }
}

/// See the module docs.
pub struct NixlTransport {
    // Field order is drop order: the registrations go before the agent.
    registrations: Vec<RegistrationHandle>,
    regions: Vec<MemRegion>,
    peers: HashSet<String>,
    timeout: Duration,
    backend: Backend,
    agent: Agent,
    name: String,
}

impl std::fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransport")
            .field("agent", &self.name)
            .field("regions", &self.regions)
            .field("peers", &self.peers)
            .finish_non_exhaustive()
    }
}

impl NixlTransport {
    /// Whether `libnixl_capi.so` can be loaded (the first call tries to load it).
    pub fn available() -> bool {
        !nixl_sys::is_stub()
    }

    /// A NIXL agent named `name` (unique among the agents that talk to each other) with
    /// a UCX backend. [`TransportError::Unavailable`] when the NIXL library or its UCX
    /// plugin cannot be loaded, with what to install and which variables to set.
    pub fn new(name: &str) -> Result<Self, TransportError> {
        // Before any other call: a call into the stub without the library aborts.
        if !Self::available() {
            let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
            let seen = match path.split(':').find(|d| d.contains(".nixl_cu")) {
                Some(dir) => format!("LD_LIBRARY_PATH holds {dir} but it did not load from there"),
                None => "no .nixl_cu*.mesonpy.libs folder is on LD_LIBRARY_PATH".to_owned(),
            };
            return Err(TransportError::Unavailable {
                transport: TRANSPORT,
                why: format!("{INSTALL_HINT} ({seen})"),
            });
        }
        let agent = Agent::new(name).map_err(|e| failed("create agent", e))?;
        let plugins: Vec<String> = agent
            .get_available_plugins()
            .map_err(|e| failed("list plugins", e))?
            .iter()
            .filter_map(|p| p.ok().map(str::to_owned))
            .collect();
        if !plugins.iter().any(|p| p == "UCX") {
            return Err(TransportError::Unavailable {
                transport: TRANSPORT,
                why: format!(
                    "the NIXL library loaded but its UCX plugin did not (plugins found: \
                     {plugins:?}): set NIXL_PLUGIN_DIR to the folder holding \
                     libplugin_UCX.so ($NIXL_HOME/.nixl_cu13.mesonpy.libs/plugins; it is \
                     {:?})",
                    std::env::var("NIXL_PLUGIN_DIR").unwrap_or_default()
                ),
            });
        }
        let (_mems, params) = agent
            .get_plugin_params("UCX")
            .map_err(|e| failed("get UCX parameters", e))?;
        let backend = agent.create_backend("UCX", &params).map_err(|e| {
            failed(
                "create UCX backend",
                format!(
                    "{e} (UCX_TLS is {:?}: it must allow a transport that reaches this \
                     host, e.g. tcp,self)",
                    std::env::var("UCX_TLS").unwrap_or_default()
                ),
            )
        })?;
        Ok(NixlTransport {
            registrations: Vec::new(),
            regions: Vec::new(),
            peers: HashSet::new(),
            timeout: DEFAULT_WRITE_TIMEOUT,
            backend,
            agent,
            name: name.to_owned(),
        })
    }

    /// How long [`write`](KvTransport::write) waits for its transfers before failing
    /// ([`DEFAULT_WRITE_TIMEOUT`] unless set).
    pub fn with_write_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This agent's name (the [`PeerId`] the peer sees).
    pub fn agent_name(&self) -> &str {
        &self.name
    }

    /// The regions registered so far.
    pub fn regions(&self) -> &[MemRegion] {
        &self.regions
    }

    /// Why creating the request of `batch` failed: the first destination segment that
    /// lies outside the peer's registered memory, or NIXL's error.
    fn explain_create_error(&self, peer: &str, batch: &WriteBatch, e: NixlError) -> TransportError {
        for (index, s) in batch.segments.iter().enumerate() {
            let Ok(mut one) = XferDescList::new(mem_type(batch.dst_mem)) else {
                break;
            };
            one.add_desc(s.dst as usize, s.len as usize, device_id(batch.dst_mem));
            if !self.agent.check_remote_metadata(peer, Some(&one)) {
                return TransportError::Unregistered {
                    index,
                    side: "remote",
                    addr: s.dst,
                    len: s.len,
                };
            }
        }
        failed("create transfer request", e)
    }

    /// Polls `req` until it completes, fails, or `deadline` passes.
    fn wait(&self, req: &XferRequest, deadline: Instant) -> Result<(), TransportError> {
        loop {
            match self.agent.get_xfer_status(req) {
                Ok(XferStatus::Success) => return Ok(()),
                Ok(XferStatus::InProgress) => {}
                Err(e) => return Err(failed("transfer", e)),
            }
            if Instant::now() > deadline {
                return Err(failed(
                    "transfer",
                    format!("not complete after {:?}", self.timeout),
                ));
            }
            std::thread::yield_now();
        }
    }

    fn post(&self, req: &XferRequest, opt: &OptArgs) -> Result<(), TransportError> {
        self.agent
            .post_xfer_req(req, Some(opt))
            .map(|_in_progress| ())
            .map_err(|e| failed("post transfer request", e))
    }
}

impl KvTransport for NixlTransport {
    fn name(&self) -> &str {
        "nixl/UCX"
    }

    unsafe fn register(&mut self, regions: &[MemRegion]) -> Result<(), TransportError> {
        for r in regions {
            let handle = self.agent.register_memory(&Region(*r), None).map_err(|e| {
                failed(
                    "register memory",
                    format!("{e} ({:?}, {} bytes at {:#x})", r.mem, r.len, r.addr),
                )
            })?;
            self.registrations.push(handle);
            self.regions.push(*r);
        }
        Ok(())
    }

    fn local_metadata(&mut self) -> Result<Vec<u8>, TransportError> {
        self.agent
            .get_local_md()
            .map_err(|e| failed("get local metadata", e))
    }

    unsafe fn connect(&mut self, remote_metadata: &[u8]) -> Result<PeerId, TransportError> {
        let name = self
            .agent
            .load_remote_md(remote_metadata)
            .map_err(|e| TransportError::BadMetadata(format!("NIXL refused it: {e}")))?;
        self.peers.insert(name.clone());
        Ok(PeerId(name))
    }

    fn write(
        &mut self,
        peer: &PeerId,
        batches: &[WriteBatch],
        notification: &[u8],
    ) -> Result<WriteReport, TransportError> {
        if !self.peers.contains(&peer.0) {
            return Err(TransportError::UnknownPeer(peer.0.clone()));
        }
        super::check_segments(batches, &self.regions, "local")?;
        let batches: Vec<&WriteBatch> = batches.iter().filter(|b| !b.segments.is_empty()).collect();
        let mut report = WriteReport::default();
        if batches.is_empty() {
            // Nothing to move: the peer is still told.
            self.agent
                .send_notification(&peer.0, notification, Some(&self.backend))
                .map_err(|e| failed("send notification", e))?;
            return Ok(report);
        }

        // Every request exists before the first is posted: a remote range error (NIXL
        // checks the destinations against the peer's metadata here) moves nothing.
        let last = batches.len() - 1;
        let mut reqs = Vec::with_capacity(batches.len());
        for (i, b) in batches.iter().enumerate() {
            let mut src =
                XferDescList::new(mem_type(b.src_mem)).map_err(|e| failed("descriptors", e))?;
            let mut dst =
                XferDescList::new(mem_type(b.dst_mem)).map_err(|e| failed("descriptors", e))?;
            for s in &b.segments {
                src.add_desc(s.src as usize, s.len as usize, device_id(b.src_mem));
                dst.add_desc(s.dst as usize, s.len as usize, device_id(b.dst_mem));
            }
            let mut opt = OptArgs::new().map_err(|e| failed("options", e))?;
            opt.add_backend(&self.backend)
                .and_then(|()| opt.set_skip_descriptor_merge(true))
                .map_err(|e| failed("options", e))?;
            if i == last {
                opt.set_notification_message(notification)
                    .and_then(|()| opt.set_has_notification(true))
                    .map_err(|e| failed("options", e))?;
            }
            let req = self
                .agent
                .create_xfer_req(XferOp::Write, &src, &dst, &peer.0, Some(&opt))
                .map_err(|e| self.explain_create_error(&peer.0, b, e))?;
            report.descriptors += b.segments.len();
            report.bytes += b.bytes();
            reqs.push((req, opt, src, dst));
        }

        let t0 = Instant::now();
        let deadline = t0 + self.timeout;
        let (last_req, rest) = reqs.split_last().expect("at least one batch");
        let mut posted = 0;
        let mut run = || -> Result<(), TransportError> {
            for (req, opt, ..) in rest {
                self.post(req, opt)?;
                posted += 1;
            }
            for (req, ..) in rest {
                self.wait(req, deadline)?;
            }
            self.post(&last_req.0, &last_req.1)?;
            posted += 1;
            self.wait(&last_req.0, deadline)
        };
        if let Err(e) = run() {
            // Nothing may still be writing the peer's memory when we return: the caller
            // aborts the import and its pages go to others. Wait (once more the timeout)
            // until every posted request has ended; if one has not, say so.
            let grace = Instant::now() + self.timeout;
            let settled = reqs[..posted].iter().all(|(req, ..)| loop {
                match self.agent.get_xfer_status(req) {
                    Ok(XferStatus::InProgress) if Instant::now() < grace => {
                        std::thread::yield_now()
                    }
                    Ok(XferStatus::InProgress) => break false,
                    _ => break true,
                }
            });
            return Err(if settled {
                e
            } else {
                TransportError::InFlight {
                    transport: "nixl",
                    detail: e.to_string(),
                }
            });
        }
        report.elapsed = t0.elapsed();
        Ok(report)
    }

    /// NIXL's writes are one-sided (RDMA, UCX): the target's CPU never sees them, so a
    /// window cannot be enforced on this side. The ranges are checked against the
    /// registrations and nothing else is kept: with NIXL a connected peer can write any
    /// byte this side registered, and a write cut off at a deadline cannot be stopped
    /// here. Use NIXL only between engines that trust each other; the local and NCCL
    /// transports enforce windows.
    unsafe fn open_window(
        &mut self,
        peer: &PeerId,
        _window: u64,
        ranges: &[MemRegion],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        super::Window::new(peer, ranges, deadline, &self.regions).map(|_| ())
    }

    fn close_window(&mut self, _window: u64) -> Result<(), TransportError> {
        Ok(())
    }

    fn take_notifications(&mut self) -> Result<Vec<(PeerId, Vec<u8>)>, TransportError> {
        let mut map = NotificationMap::new().map_err(|e| failed("notifications", e))?;
        self.agent
            .get_notifications(&mut map, None)
            .map_err(|e| failed("get notifications", e))?;
        let mut out = Vec::new();
        for agent in map.agents() {
            let agent = agent.map_err(|e| failed("notifications", e))?;
            for msg in map
                .get_notifications(agent)
                .map_err(|e| failed("notifications", e))?
            {
                out.push((
                    PeerId(agent.to_owned()),
                    msg.map_err(|e| failed("notifications", e))?,
                ));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::Segment;

    /// The transport, or `None` (with a note) where NIXL is not installed.
    fn transport(name: &str) -> Option<NixlTransport> {
        match NixlTransport::new(name) {
            Ok(t) => Some(t),
            Err(TransportError::Unavailable { why, .. }) => {
                assert!(why.contains("LD_LIBRARY_PATH") || why.contains("NIXL_PLUGIN_DIR"));
                assert!(why.contains("nixl-cu13==1.5.1") || why.contains("plugins"));
                // Straight to the process's stderr: the test harness captures `eprintln!`.
                use std::io::Write as _;
                let _ = writeln!(std::io::stderr(), "SKIPPED: NIXL not available: {why}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// The first notifications to arrive (waits up to 30 s).
    fn next_notifications(t: &mut NixlTransport) -> Vec<(PeerId, Vec<u8>)> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut got = Vec::new();
        while got.is_empty() && Instant::now() < deadline {
            got = t.take_notifications().unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        got
    }

    #[test]
    fn unavailable_is_an_error_not_an_abort() {
        // Either works or says what to install; never aborts the process.
        let _ = transport("dsa-kv-unit-probe");
    }

    #[test]
    fn in_process_write_checks_then_notifies() {
        let Some(mut a) = transport("dsa-kv-unit-a") else {
            return;
        };
        let Some(mut b) = transport("dsa-kv-unit-b") else {
            return;
        };
        let src: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8 + 1).collect();
        // The peer writes it behind the compiler's back: only raw-pointer access.
        let mut dst_buf = vec![0u8; 4096];
        let dst_ptr = dst_buf.as_mut_ptr();
        let host = |addr: *const u8, len: usize| MemRegion {
            addr: addr as u64,
            len: len as u64,
            mem: MemKind::Host,
        };
        // SAFETY: both buffers outlive the agents; only the transfer writes `dst_buf`.
        unsafe {
            a.register(&[host(src.as_ptr(), src.len())]).unwrap();
            b.register(&[host(dst_ptr, 4096)]).unwrap();
        }
        let unknown = PeerId("nobody".into());
        assert!(matches!(
            a.write(&unknown, &[], b"x"),
            Err(TransportError::UnknownPeer(_))
        ));
        // SAFETY: each side's own metadata.
        let peer = unsafe { a.connect(&b.local_metadata().unwrap()) }.unwrap();
        assert_eq!(peer.0, "dsa-kv-unit-b");
        unsafe { b.connect(&a.local_metadata().unwrap()) }.unwrap();
        let seg = |s: u64, d: u64, len: u64| Segment {
            src: src.as_ptr() as u64 + s,
            dst: dst_ptr as u64 + d,
            len,
        };
        let batch = |segments| WriteBatch {
            src_mem: MemKind::Host,
            dst_mem: MemKind::Host,
            segments,
        };
        // A source past the local registration: refused before NIXL sees it.
        let err = a
            .write(&peer, &[batch(vec![seg(0, 0, 8), seg(4090, 0, 8)])], b"x")
            .unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Unregistered {
                    index: 1,
                    side: "local",
                    ..
                }
            ),
            "{err}"
        );
        let r = a
            .write(
                &peer,
                &[batch(vec![seg(8, 0, 8)]), batch(vec![seg(100, 1000, 50)])],
                b"req-7",
            )
            .unwrap();
        assert_eq!((r.descriptors, r.bytes), (2, 58));
        assert_eq!(
            next_notifications(&mut b),
            vec![(PeerId("dsa-kv-unit-a".into()), b"req-7".to_vec())]
        );
        // Nothing to move (no batch, or only empty ones): the peer is still notified.
        let r = a.write(&peer, &[batch(vec![])], b"empty").unwrap();
        assert_eq!((r.descriptors, r.bytes), (0, 0));
        assert_eq!(
            next_notifications(&mut b),
            vec![(PeerId("dsa-kv-unit-a".into()), b"empty".to_vec())]
        );
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: dst_buf is alive and nothing writes it any more (the notification came
        // after the last byte).
        let dst = unsafe { std::slice::from_raw_parts(dst_ptr, 4096) };
        assert_eq!(&dst[..8], &src[8..16]);
        assert_eq!(&dst[1000..1050], &src[100..150]);
        assert!(dst[8..1000].iter().chain(&dst[1050..]).all(|&x| x == 0));
        drop(a);
        drop(b);
        drop(dst_buf);
    }
}
