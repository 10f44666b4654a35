//! [`LocalTransport`]: a transport between engines of one process, for host memory. It
//! checks every segment against both sides' registrations exactly as a network
//! transport does, and every destination against the target's open windows (the pages
//! its imports reserved for this writer), then copies with `memcpy`; notifications go
//! through a process-wide registry, at most [`MAX_PENDING_NOTIFICATIONS`] untaken per
//! agent. Tests and single-process examples use it; it is not a fast path (writes of the
//! whole process take one lock).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::{
    KvTransport, MemKind, MemRegion, PeerId, TransportError, Window, WriteBatch, WriteReport,
    MAX_NOTIFICATION, MAX_PENDING_NOTIFICATIONS,
};

static NEXT_AGENT: AtomicU64 = AtomicU64::new(1);

/// What the process-wide registry keeps for one agent: its untaken notifications and
/// the windows its peers may write.
#[derive(Default)]
struct Agent {
    /// (sender, message), at most [`MAX_PENDING_NOTIFICATIONS`].
    inbox: Vec<(PeerId, Vec<u8>)>,
    windows: HashMap<u64, Window>,
}

/// Every live agent of the process, by name. A write holds this lock while it checks
/// the target's windows and copies, so closing a window (which takes it too) returns
/// only after any write into it has finished.
fn agents() -> &'static Mutex<HashMap<String, Agent>> {
    static M: OnceLock<Mutex<HashMap<String, Agent>>> = OnceLock::new();
    M.get_or_init(Mutex::default)
}

fn lock() -> std::sync::MutexGuard<'static, HashMap<String, Agent>> {
    // A panic while holding the lock leaves plain data (lists and maps) behind.
    agents().lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Serialize, Deserialize)]
struct Metadata {
    agent: String,
    pid: u32,
    regions: Vec<MemRegion>,
}

/// See the module docs.
#[derive(Debug)]
pub struct LocalTransport {
    name: String,
    regions: Vec<MemRegion>,
    peers: HashMap<PeerId, Vec<MemRegion>>,
}

impl LocalTransport {
    /// A transport named `name` plus a process-unique suffix.
    pub fn new(name: &str) -> Self {
        let name = format!("{name}-{}", NEXT_AGENT.fetch_add(1, Ordering::Relaxed));
        lock().insert(name.clone(), Agent::default());
        LocalTransport {
            name,
            regions: Vec::new(),
            peers: HashMap::new(),
        }
    }
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        lock().remove(&self.name);
    }
}

fn failed(op: &'static str, detail: String) -> TransportError {
    TransportError::Failed {
        transport: "local",
        op,
        detail,
    }
}

impl KvTransport for LocalTransport {
    fn name(&self) -> &str {
        "local"
    }

    unsafe fn register(&mut self, regions: &[MemRegion]) -> Result<(), TransportError> {
        if let Some(r) = regions.iter().find(|r| r.mem != MemKind::Host) {
            return Err(failed(
                "register",
                format!(
                    "the local transport copies host memory only ({:?} at {:#x})",
                    r.mem, r.addr
                ),
            ));
        }
        if let Some(r) = regions
            .iter()
            .find(|r| r.addr == 0 || r.addr.checked_add(r.len).is_none())
        {
            return Err(failed(
                "register",
                format!("no memory lies at {:#x} ({} bytes)", r.addr, r.len),
            ));
        }
        self.regions.extend_from_slice(regions);
        Ok(())
    }

    fn local_metadata(&mut self) -> Result<Vec<u8>, TransportError> {
        serde_json::to_vec(&Metadata {
            agent: self.name.clone(),
            pid: std::process::id(),
            regions: self.regions.clone(),
        })
        .map_err(|e| TransportError::BadMetadata(e.to_string()))
    }

    unsafe fn connect(&mut self, remote_metadata: &[u8]) -> Result<PeerId, TransportError> {
        let md: Metadata = serde_json::from_slice(remote_metadata)
            .map_err(|e| TransportError::BadMetadata(e.to_string()))?;
        if md.pid != std::process::id() {
            return Err(TransportError::BadMetadata(format!(
                "agent {} lives in process {}, not this one ({}): the local transport \
                 cannot reach another process; use the NIXL transport",
                md.agent,
                md.pid,
                std::process::id()
            )));
        }
        if !lock().contains_key(&md.agent) {
            return Err(TransportError::BadMetadata(format!(
                "no agent {:?} lives in this process",
                md.agent
            )));
        }
        let id = PeerId(md.agent);
        self.peers.insert(id.clone(), md.regions);
        Ok(id)
    }

    fn write(
        &mut self,
        peer: &PeerId,
        batches: &[WriteBatch],
        notification: &[u8],
    ) -> Result<WriteReport, TransportError> {
        let remote = self
            .peers
            .get(peer)
            .ok_or_else(|| TransportError::UnknownPeer(peer.0.clone()))?;
        if notification.len() > MAX_NOTIFICATION {
            return Err(failed(
                "write",
                format!(
                    "a notification of {} bytes (at most {MAX_NOTIFICATION})",
                    notification.len()
                ),
            ));
        }
        // Every segment is checked before the first byte moves.
        super::check_segments(batches, &self.regions, "local")?;
        super::check_segments(batches, remote, "remote")?;
        let mut agents = lock();
        let target = agents
            .get_mut(&peer.0)
            .ok_or_else(|| TransportError::UnknownPeer(peer.0.clone()))?;
        // The receiving side's rule: only the pages of one of our open windows there
        // (and a write with nothing to copy only while one is open).
        let dsts = batches
            .iter()
            .flat_map(|b| b.segments.iter().map(move |s| (b.dst_mem, s.dst, s.len)));
        let now = Instant::now();
        let found = super::window_for(&target.windows, &self.name, dsts, now);
        super::prune_expired(&mut target.windows, now, |w| w, |_| false);
        found.map_err(|why| failed("write", format!("{} refused the write: {why}", peer.0)))?;
        if target.inbox.len() >= MAX_PENDING_NOTIFICATIONS {
            return Err(failed(
                "write",
                format!(
                    "{} holds {MAX_PENDING_NOTIFICATIONS} untaken notifications: it is not reading them",
                    peer.0
                ),
            ));
        }
        let t0 = Instant::now();
        let mut report = WriteReport::default();
        for b in batches {
            for s in &b.segments {
                // SAFETY: both ranges lie inside memory registered by live transports of
                // this process (checked above); registered pools are allocated once and
                // never move or shrink while registered. The destination lies in an open
                // window of the target, whose `open_window` contract is that only the
                // transfer writes it until the window closes, and closing waits for this
                // lock, which the copy holds. Source and destination are different pools.
                unsafe {
                    std::ptr::copy(s.src as *const u8, s.dst as *mut u8, s.len as usize);
                }
                report.bytes += s.len;
            }
            report.descriptors += b.segments.len();
        }
        report.elapsed = t0.elapsed();
        target
            .inbox
            .push((PeerId(self.name.clone()), notification.to_vec()));
        Ok(report)
    }

    fn take_notifications(&mut self) -> Result<Vec<(PeerId, Vec<u8>)>, TransportError> {
        Ok(lock()
            .get_mut(&self.name)
            .map(|a| std::mem::take(&mut a.inbox))
            .unwrap_or_default())
    }

    unsafe fn open_window(
        &mut self,
        peer: &PeerId,
        window: u64,
        ranges: &[MemRegion],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let w = Window::new(peer, ranges, deadline, &self.regions)?;
        let mut agents = lock();
        let me = agents
            .get_mut(&self.name)
            .expect("invariant: an agent is registered while its transport lives");
        super::prune_expired(&mut me.windows, Instant::now(), |w| w, |_| false);
        if me.windows.contains_key(&window) {
            return Err(failed(
                "open window",
                format!("window {window} is open already"),
            ));
        }
        me.windows.insert(window, w);
        Ok(())
    }

    fn close_window(&mut self, window: u64) -> Result<(), TransportError> {
        if let Some(me) = lock().get_mut(&self.name) {
            me.windows.remove(&window);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::Segment;
    use std::time::Duration;

    fn host(v: &[u8]) -> MemRegion {
        MemRegion {
            addr: v.as_ptr() as u64,
            len: v.len() as u64,
            mem: MemKind::Host,
        }
    }

    #[test]
    fn writes_checked_segments_into_open_windows_then_notifies() {
        let src: Vec<u8> = (0..64).collect();
        let dst = vec![0u8; 64];
        let (mut a, mut b) = (LocalTransport::new("a"), LocalTransport::new("b"));
        // SAFETY: both vectors outlive the transports; only the transfer writes `dst`.
        let peer = unsafe {
            a.register(&[host(&src)]).unwrap();
            b.register(&[host(&dst)]).unwrap();
            a.connect(&b.local_metadata().unwrap()).unwrap()
        };
        let writer = PeerId(a.name.clone());
        let seg = |s: u64, d: u64, len: u64| Segment {
            src: src.as_ptr() as u64 + s,
            dst: dst.as_ptr() as u64 + d,
            len,
        };
        let batch = |segments| WriteBatch {
            src_mem: MemKind::Host,
            dst_mem: MemKind::Host,
            segments,
        };
        let range = |off: u64, len: u64| MemRegion {
            addr: dst.as_ptr() as u64 + off,
            len,
            mem: MemKind::Host,
        };
        let good = [batch(vec![seg(8, 0, 8), seg(32, 40, 4)])];
        // No window yet: the receiving side refuses, nothing lands, nothing is filed.
        let e = a.write(&peer, &good, b"req-7").unwrap_err();
        assert!(
            e.to_string()
                .contains("no open window of this peer covers the write"),
            "{e}"
        );
        assert!(dst.iter().all(|&x| x == 0));
        // A window over [0, 8) and [40, 48); writes elsewhere (a "committed page") stay
        // refused, so does a window outside the registered memory.
        let soon = Instant::now() + Duration::from_secs(60);
        // SAFETY: `dst` is registered and written only by the transfer.
        unsafe {
            assert!(matches!(
                b.open_window(&writer, 7, &[range(60, 8)], soon),
                Err(TransportError::Unregistered { side: "window", .. })
            ));
            b.open_window(&writer, 7, &[range(40, 8), range(0, 8)], soon)
                .unwrap();
            assert!(b.open_window(&writer, 7, &[range(0, 8)], soon).is_err());
        }
        let outside = [batch(vec![seg(0, 16, 8)])];
        assert!(a.write(&peer, &outside, b"x").is_err());
        // One segment past the end of the remote region: refused, nothing written.
        let bad = [batch(vec![seg(0, 0, 8), seg(0, 60, 8)])];
        assert!(matches!(
            a.write(&peer, &bad, b"x"),
            Err(TransportError::Unregistered {
                index: 1,
                side: "remote",
                ..
            })
        ));
        assert!(dst.iter().all(|&x| x == 0));
        assert!(b.take_notifications().unwrap().is_empty());
        // Another writer may not use a's window.
        let mut c = LocalTransport::new("c");
        // SAFETY: as above.
        let cpeer = unsafe {
            c.register(&[host(&src)]).unwrap();
            c.connect(&b.local_metadata().unwrap()).unwrap()
        };
        assert!(c.write(&cpeer, &good, b"x").is_err());
        let r = a.write(&peer, &good, b"req-7").unwrap();
        assert_eq!((r.descriptors, r.bytes), (2, 12));
        assert_eq!(&dst[..8], &src[8..16]);
        assert_eq!(&dst[40..44], &src[32..36]);
        assert!(dst[8..40].iter().chain(&dst[44..]).all(|&x| x == 0));
        let n = b.take_notifications().unwrap();
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].1, b"req-7");
        assert!(b.take_notifications().unwrap().is_empty());
        // Closed: refused again.
        b.close_window(7).unwrap();
        assert!(a.write(&peer, &good, b"x").is_err());
        // Past its deadline: refused.
        // SAFETY: as above.
        unsafe {
            b.open_window(&writer, 8, &[range(0, 64)], Instant::now())
                .unwrap()
        };
        let e = a.write(&peer, &good, b"x").unwrap_err();
        assert!(e.to_string().contains("passed its deadline"), "{e}");
        b.close_window(8).unwrap();
    }

    /// A write with nothing to copy files a notification only while the writer has an
    /// open window here (before: any connected peer filed notifications at will).
    #[test]
    fn a_write_with_nothing_to_copy_needs_an_open_window() {
        let (mut a, mut b) = (LocalTransport::new("a"), LocalTransport::new("b"));
        // SAFETY: nothing is registered; notifications only.
        let peer = unsafe { a.connect(&b.local_metadata().unwrap()).unwrap() };
        let e = a.write(&peer, &[], b"forged").unwrap_err();
        assert!(e.to_string().contains("needs an import's window"), "{e}");
        assert!(b.take_notifications().unwrap().is_empty());
        // An import whose blocks were all cached opens a window over no pages: the
        // exporter's notification is then admitted.
        let writer = PeerId(a.name.clone());
        let soon = Instant::now() + Duration::from_secs(60);
        // SAFETY: the window covers nothing.
        unsafe { b.open_window(&writer, 3, &[], soon).unwrap() };
        a.write(&peer, &[], b"done").unwrap();
        assert_eq!(b.take_notifications().unwrap()[0].1, b"done");
        // Another peer still cannot.
        let mut c = LocalTransport::new("c");
        // SAFETY: as above.
        let cpeer = unsafe { c.connect(&b.local_metadata().unwrap()).unwrap() };
        assert!(c.write(&cpeer, &[], b"forged").is_err());
        b.close_window(3).unwrap();
        assert!(a.write(&peer, &[], b"late").is_err());
        assert!(b.take_notifications().unwrap().is_empty());
    }

    /// A window its import never closed (the import ended by its lease) is removed once
    /// past its deadline: the map does not grow with every such import, and the id can
    /// open a window again (before: "window 9 is open already" forever).
    #[test]
    fn expired_windows_are_removed_and_their_ids_open_again() {
        let dst = vec![0u8; 64];
        let (a, mut b) = (LocalTransport::new("a"), LocalTransport::new("b"));
        // SAFETY: `dst` outlives `b`; nothing writes it.
        unsafe { b.register(&[host(&dst)]).unwrap() };
        let writer = PeerId(a.name.clone());
        let windows = |b: &LocalTransport| lock().get(&b.name).map_or(0, |g| g.windows.len());
        for id in 0..100 {
            // SAFETY: as above.
            unsafe {
                b.open_window(&writer, id, &[host(&dst)], Instant::now())
                    .unwrap()
            };
        }
        assert!(windows(&b) <= 1, "{} windows kept", windows(&b));
        // SAFETY: as above.
        unsafe {
            b.open_window(&writer, 9, &[host(&dst)], Instant::now())
                .unwrap()
        };
        // A live window stays.
        let later = Instant::now() + Duration::from_secs(60);
        // SAFETY: as above.
        unsafe { b.open_window(&writer, 10, &[host(&dst)], later).unwrap() };
        // SAFETY: as above.
        unsafe { b.open_window(&writer, 11, &[host(&dst)], later).unwrap() };
        assert_eq!(windows(&b), 2);
    }

    #[test]
    fn untaken_notifications_are_bounded() {
        let (mut a, mut b) = (LocalTransport::new("a"), LocalTransport::new("b"));
        // SAFETY: nothing is registered; notifications only.
        let peer = unsafe { a.connect(&b.local_metadata().unwrap()).unwrap() };
        let writer = PeerId(a.name.clone());
        // SAFETY: the window covers nothing.
        unsafe {
            b.open_window(&writer, 1, &[], Instant::now() + Duration::from_secs(60))
                .unwrap()
        };
        for _ in 0..MAX_PENDING_NOTIFICATIONS {
            a.write(&peer, &[], b"n").unwrap();
        }
        let e = a.write(&peer, &[], b"n").unwrap_err();
        assert!(e.to_string().contains("untaken notifications"), "{e}");
        assert!(a.write(&peer, &[], &vec![0; MAX_NOTIFICATION + 1]).is_err());
        assert_eq!(
            b.take_notifications().unwrap().len(),
            MAX_PENDING_NOTIFICATIONS
        );
        a.write(&peer, &[], b"n").unwrap();
    }
}
