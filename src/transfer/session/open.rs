//! The session itself: the handshake that links two engines' transports, what both
//! sides keep (the peer, both engines' pool regions, notifications taken early), and
//! the end.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite};

#[cfg(feature = "testing")]
use dsa_kv_device::transfer::WritePlan;
use dsa_kv_device::transfer::{
    KvTransport, MemKind, PeerId, PoolRegion, MAX_PENDING_NOTIFICATIONS,
};

use super::{SessionError, SessionMsg, Wire, PROTOCOL_VERSION};
use crate::actors::KvCacheHandle;

/// How a session behaves; both sides must agree on `digests`.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Send and check SHA-256 digests of every written page (host memory only: the
    /// host backend). The importer commits only pages whose bytes equal the
    /// exporter's. Default off.
    pub digests: bool,
    /// The longest wait for a reply the protocol expects at once (the peer's `Hello`,
    /// a ticket, an outcome). Default 60 s.
    pub reply_timeout: Duration,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            digests: false,
            reply_timeout: Duration::from_secs(60),
        }
    }
}

impl SessionOptions {
    /// The default options with page digests on (host backend).
    pub fn with_digests() -> SessionOptions {
        SessionOptions {
            digests: true,
            ..SessionOptions::default()
        }
    }
}

/// A plan edit for mutation drills (feature `testing`).
#[cfg(feature = "testing")]
pub(super) type PlanEdit = Box<dyn Fn(WritePlan) -> WritePlan + Send>;

/// One engine's end of a KV transfer session with one peer engine: its transport
/// (registered with the engine's pools and connected to the peer's), the wire the
/// protocol's frames travel on, and the engine's handle. Either side exports
/// ([`hand_over`](Self::hand_over), or step by step [`offer`](Self::offer),
/// [`wait_ticket`](Self::wait_ticket), [`push`](Self::push),
/// [`wait_outcome`](Self::wait_outcome)) or imports ([`next_offer`](Self::next_offer),
/// [`begin`](Self::begin), then [`finish`](Self::finish), or step by step
/// [`reply`](Self::reply), [`wait_written`](Self::wait_written),
/// [`complete`](Self::complete)); the protocol is in lockstep, one transfer at a time.
///
/// Dropping the session drops the transport first (what it may still read or write lies
/// in the engine's pools), then the wire, then its clone of the handle.
pub struct TransferSession<S> {
    // Field order is drop order: the transport before anything else.
    pub(super) transport: Box<dyn KvTransport>,
    pub(super) wire: Wire<S>,
    pub(super) kv: KvCacheHandle,
    pub(super) peer: PeerId,
    pub(super) local: Vec<PoolRegion>,
    pub(super) remote: Vec<PoolRegion>,
    pub(super) options: SessionOptions,
    /// Notifications taken from the transport before anyone waited for them.
    unclaimed: VecDeque<Vec<u8>>,
    #[cfg(feature = "testing")]
    pub(super) plan_edit: Option<PlanEdit>,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> TransferSession<S> {
    /// Links this engine with the peer at the other end of `wire`: registers the
    /// engine's pools with `transport`, exchanges `Hello`s (protocol version, transport,
    /// metadata, pool regions, digests), and connects the transport to the peer's.
    /// Both sides call it; neither waits for the other to go first.
    ///
    /// # Safety
    ///
    /// * The engine behind `kv` keeps running (no `shutdown`) while the session lives:
    ///   the transport registers its pools, and a peer writes into them.
    /// * `wire` leads to the peer engine's own session (a connection only the two
    ///   engines reach: loopback, or their own network): the peer's transport metadata
    ///   is trusted as it comes, and a forged region list would let this side's writes
    ///   reach memory the peer never registered.
    pub async unsafe fn open(
        kv: &KvCacheHandle,
        mut transport: Box<dyn KvTransport>,
        mut wire: Wire<S>,
        options: SessionOptions,
    ) -> Result<TransferSession<S>, SessionError> {
        let local = kv.transfer().regions().await?;
        if options.digests {
            if let Some(r) = local.iter().find(|r| r.region.mem != MemKind::Host) {
                return Err(SessionError::Digests(format!(
                    "this engine's pools are {:?} memory (pool {} of group {}): digests read \
                     host memory only; open the session without them",
                    r.region.mem, r.pool, r.group
                )));
            }
        }
        let regions: Vec<_> = local.iter().map(|r| r.region).collect();
        // SAFETY: the engine's own pools, alive while the session (which owns the
        // transport) lives by the caller's contract; peers write only into the windows
        // of open imports, which cover pages the import reserved.
        unsafe { transport.register(&regions)? };
        let hello = SessionMsg::Hello {
            protocol: PROTOCOL_VERSION,
            transport: transport.name().to_string(),
            metadata: transport.local_metadata()?,
            regions: local.clone(),
            digests: options.digests,
        };
        // Both sides send theirs while they receive the other's.
        let (metadata, remote) = match wire.exchange(&hello, options.reply_timeout).await? {
            SessionMsg::Hello {
                protocol,
                transport: theirs,
                metadata,
                regions,
                digests,
            } => {
                if protocol != PROTOCOL_VERSION {
                    return Err(SessionError::Version {
                        ours: PROTOCOL_VERSION,
                        theirs: protocol,
                    });
                }
                if theirs != transport.name() {
                    return Err(SessionError::Mismatch(format!(
                        "this side's transport is {:?}, the peer's {theirs:?}",
                        transport.name()
                    )));
                }
                if digests != options.digests {
                    return Err(SessionError::Mismatch(format!(
                        "page digests are {} here and {} on the peer: set \
                         SessionOptions::digests alike on both sides",
                        on_off(options.digests),
                        on_off(digests)
                    )));
                }
                (metadata, regions)
            }
            other => {
                return Err(SessionError::Unexpected {
                    expected: "Hello",
                    got: other.kind().into(),
                })
            }
        };
        // SAFETY: the peer's own metadata, from its Hello on the wire the caller
        // vouches for.
        let peer = unsafe { transport.connect(&metadata)? };
        Ok(TransferSession {
            transport,
            wire,
            kv: kv.clone(),
            peer,
            local,
            remote,
            options,
            unclaimed: VecDeque::new(),
            #[cfg(feature = "testing")]
            plan_edit: None,
        })
    }

    /// Ends the session: sends `Bye`, then drops the transport before returning the wire.
    pub async fn close(mut self) -> Result<Wire<S>, SessionError> {
        let sent = self.wire.send(&SessionMsg::Bye).await;
        let TransferSession {
            transport, wire, ..
        } = self;
        drop(transport);
        sent?;
        Ok(wire)
    }
}

impl<S> TransferSession<S> {
    /// The wire, for the application's own frames between the protocol's.
    pub fn wire(&mut self) -> &mut Wire<S> {
        &mut self.wire
    }

    /// The engine's handle.
    pub fn kv(&self) -> &KvCacheHandle {
        &self.kv
    }

    /// The transport's name.
    pub fn transport_name(&self) -> &str {
        self.transport.name()
    }

    /// The peer, as the transport knows it.
    pub fn peer(&self) -> &PeerId {
        &self.peer
    }

    /// This engine's pool regions (registered with the transport).
    pub fn local_regions(&self) -> &[PoolRegion] {
        &self.local
    }

    /// The peer engine's pool regions (from its `Hello`).
    pub fn remote_regions(&self) -> &[PoolRegion] {
        &self.remote
    }

    /// The options both sides agreed on.
    pub fn options(&self) -> &SessionOptions {
        &self.options
    }

    /// Mutation drills (feature `testing`): every later push writes `edit(plan)`
    /// instead of the plan (e.g. [`WritePlan::without_pools`]), so a checker can be
    /// proven to notice a transfer that leaves something out.
    #[cfg(feature = "testing")]
    pub fn edit_plans(&mut self, edit: impl Fn(WritePlan) -> WritePlan + Send + 'static) {
        self.plan_edit = Some(Box::new(edit));
    }

    /// Waits (polling the transport every 200 µs) until the peer's notification
    /// `want` has arrived, or `until` has passed (`Ok(false)`). Others taken meanwhile
    /// are kept for later waits, at most [`MAX_PENDING_NOTIFICATIONS`] of them (the
    /// oldest go first).
    pub(super) async fn wait_notification(
        &mut self,
        want: &[u8],
        until: Instant,
    ) -> Result<bool, SessionError> {
        loop {
            for (from, note) in self.transport.take_notifications()? {
                if from == self.peer {
                    self.unclaimed.push_back(note);
                }
            }
            while self.unclaimed.len() > MAX_PENDING_NOTIFICATIONS {
                self.unclaimed.pop_front();
            }
            if let Some(i) = self.unclaimed.iter().position(|n| n == want) {
                self.unclaimed.remove(i);
                return Ok(true);
            }
            if Instant::now() >= until {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
}

/// The notification the exporter's write of transfer (`export` → `import`) ends with.
pub(super) fn notification(export: u64, import: u64) -> Vec<u8> {
    format!("dsa-kv/transfer/{export}/{import}").into_bytes()
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// Runs `f`, a blocking call (a transport's write, hashing pages), off the async
/// worker's back where the runtime allows it (a multi-thread tokio runtime), else in
/// place.
pub(super) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// Registers two engines' pools (`ra` the exporter's, `rb` the importer's) with two
/// transports of one process and connects each to the other, without a wire (both
/// engines in one process, driven by one task: tests, benchmarks). Returns (the
/// importer as the exporter's peer, the exporter as the importer's peer, whom the
/// importer's windows admit). Feature `testing`.
///
/// # Safety
///
/// The engines of `ra` and `rb` outlive the transports, and peers write only into the
/// windows of open imports (`register`'s and `connect`'s contracts).
#[cfg(feature = "testing")]
pub unsafe fn link_pair(
    ta: &mut dyn KvTransport,
    tb: &mut dyn KvTransport,
    ra: &[PoolRegion],
    rb: &[PoolRegion],
) -> Result<(PeerId, PeerId), SessionError> {
    // SAFETY: the caller's contract; each side loads the other's own metadata.
    unsafe {
        ta.register(&ra.iter().map(|r| r.region).collect::<Vec<_>>())?;
        tb.register(&rb.iter().map(|r| r.region).collect::<Vec<_>>())?;
        let exporter = tb.connect(&ta.local_metadata()?)?;
        let importer = ta.connect(&tb.local_metadata()?)?;
        Ok((importer, exporter))
    }
}
