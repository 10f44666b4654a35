//! [`LocalTransport`]: a transport between engines of one process, for host memory. It
//! checks every segment against both sides' registrations exactly as a network
//! transport does, then copies with `memcpy`; notifications go through a process-wide
//! mailbox. Tests and single-process examples use it; it is not a fast path.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::{KvTransport, MemKind, MemRegion, PeerId, TransportError, WriteBatch, WriteReport};

static NEXT_AGENT: AtomicU64 = AtomicU64::new(1);

/// The notifications waiting for one agent: (sender, message).
type Inbox = Vec<(PeerId, Vec<u8>)>;

/// Notifications waiting for each agent, by agent name.
fn mailboxes() -> &'static Mutex<HashMap<String, Inbox>> {
    static M: OnceLock<Mutex<HashMap<String, Inbox>>> = OnceLock::new();
    M.get_or_init(Mutex::default)
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
        mailboxes()
            .lock()
            .expect("mailbox lock")
            .insert(name.clone(), Vec::new());
        LocalTransport {
            name,
            regions: Vec::new(),
            peers: HashMap::new(),
        }
    }
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        if let Ok(mut m) = mailboxes().lock() {
            m.remove(&self.name);
        }
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
        // Every segment is checked before the first byte moves.
        super::check_segments(batches, &self.regions, "local")?;
        super::check_segments(batches, remote, "remote")?;
        let t0 = Instant::now();
        let mut report = WriteReport::default();
        for b in batches {
            for s in &b.segments {
                // SAFETY: both ranges lie inside memory registered by live transports of
                // this process (checked above); registered pools are allocated once and
                // never move or shrink while registered, and the importer writes only
                // into pages it reserved for this transfer, which nothing else touches
                // until the import commits. Source and destination are different pools.
                unsafe {
                    std::ptr::copy(s.src as *const u8, s.dst as *mut u8, s.len as usize);
                }
                report.bytes += s.len;
            }
            report.descriptors += b.segments.len();
        }
        report.elapsed = t0.elapsed();
        let mut m = mailboxes().lock().expect("mailbox lock");
        let inbox = m
            .get_mut(&peer.0)
            .ok_or_else(|| TransportError::UnknownPeer(peer.0.clone()))?;
        inbox.push((PeerId(self.name.clone()), notification.to_vec()));
        Ok(report)
    }

    fn take_notifications(&mut self) -> Result<Vec<(PeerId, Vec<u8>)>, TransportError> {
        let mut m = mailboxes().lock().expect("mailbox lock");
        Ok(m.get_mut(&self.name)
            .map(std::mem::take)
            .unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::Segment;

    fn host(v: &[u8]) -> MemRegion {
        MemRegion {
            addr: v.as_ptr() as u64,
            len: v.len() as u64,
            mem: MemKind::Host,
        }
    }

    #[test]
    fn writes_checked_segments_then_notifies() {
        let src: Vec<u8> = (0..64).collect();
        let dst = vec![0u8; 64];
        let (mut a, mut b) = (LocalTransport::new("a"), LocalTransport::new("b"));
        // SAFETY: both vectors outlive the transports; only the transfer writes `dst`.
        let peer = unsafe {
            a.register(&[host(&src)]).unwrap();
            b.register(&[host(&dst)]).unwrap();
            a.connect(&b.local_metadata().unwrap()).unwrap()
        };
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
        let r = a
            .write(
                &peer,
                &[batch(vec![seg(8, 0, 8), seg(32, 40, 4)])],
                b"req-7",
            )
            .unwrap();
        assert_eq!((r.descriptors, r.bytes), (2, 12));
        assert_eq!(&dst[..8], &src[8..16]);
        assert_eq!(&dst[40..44], &src[32..36]);
        assert!(dst[8..40].iter().chain(&dst[44..]).all(|&x| x == 0));
        let n = b.take_notifications().unwrap();
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].1, b"req-7");
        assert!(b.take_notifications().unwrap().is_empty());
    }
}
