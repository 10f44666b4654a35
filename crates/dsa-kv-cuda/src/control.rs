//! The NCCL transport's control connections, the parts that need no GPU: length-prefixed
//! JSON frames with a size limit and a deadline, and the **authenticated introduction**
//! of a connecting peer.
//!
//! Each transport makes a random 32-byte secret and puts it in its metadata, which the
//! two engines exchange over a channel they trust (the one they already use for it). A
//! connection is accepted as peer `A`'s only if its first frame, the `Hello`, carries an
//! HMAC-SHA256 keyed with the acceptor's secret over a fresh nonce the acceptor sent on
//! that connection, `A`'s own secret, `A`'s name and its NCCL unique id: proof that the
//! connecting process holds both engines' metadata. A local process that merely names
//! itself `A`, or replays an earlier `Hello`, is refused.
//!
//! The [`Acceptor`] runs every handshake at once without blocking: a connection that
//! sends nothing costs a slot until its deadline, never the wait of the next one. The
//! slots are bounded in all and per peer address, so a flood of sockets costs bounded
//! memory, and a newcomer is never turned away for want of one: it displaces the
//! oldest entry of its own address once that address holds its share, else of the
//! address holding the most ([`displaced`]). At most [`MAX_HANDSHAKES`] handshakes are
//! in progress ([`MAX_HANDSHAKES_PER_PEER`] from one address).
//!
//! A `Hello`'s proof needs the connector's secret, which the acceptor learns only from
//! that peer's metadata, when `connect` pairs with it ([`pair`]). While it pairs with
//! `A`, a `Hello` naming `A` is checked the moment it arrives (and those that waited
//! are checked when pairing starts): a forged one is closed at once and a proven one is
//! kept apart, where nothing but `A` itself can add to it. A `Hello` naming anyone else
//! waits unproven for its own `connect`, [`MAX_INTRODUCED`] of them at most
//! ([`MAX_INTRODUCED_PER_PEER`] from one address). A connector whose connection is
//! closed (displaced, refused, or its handshake cut at its deadline) connects again,
//! with a growing pause, until its deadline: an honest peer displaced by a flood from
//! its own address gets in on a later try, and one that connects while we pair with it
//! is proven at once. What is left: an address that opens connections faster than the
//! peer answers its challenge (many per millisecond, without pause) can keep displacing
//! it; that is a flood of the host, not of a slot.
//!
//! The wire protocol is unchanged (challenge, `Hello`, then the transport's frames).

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use dsa_kv_device::transfer::TransportError;

/// Bytes of a secret and of a nonce.
pub(crate) const SECRET_LEN: usize = 32;

/// Handshakes in progress at once; a newcomer past it displaces one (see the module
/// docs).
pub(crate) const MAX_HANDSHAKES: usize = 64;

/// Handshakes in progress from one peer address: a fair share of [`MAX_HANDSHAKES`]
/// (four addresses are needed to fill it; one connector has one at a time).
pub(crate) const MAX_HANDSHAKES_PER_PEER: usize = 16;

/// Introduced connections whose proof cannot be checked yet (they name a peer we are
/// not pairing with now), waiting for their `connect`.
pub(crate) const MAX_INTRODUCED: usize = 16;

/// Unproven introduced connections from one peer address.
pub(crate) const MAX_INTRODUCED_PER_PEER: usize = 4;

/// The first pause before a connector tries again; it doubles up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(20);

/// The longest pause between a connector's tries: it is back within this long of the
/// peer's starting to pair, and tries about deadline / `RETRY_MAX` + 6 times at most.
const RETRY_MAX: Duration = Duration::from_millis(500);

/// The largest `Hello` frame.
const MAX_HELLO: u64 = 4096;

/// The longest a read blocks before looking at its stop flag.
const SLICE: Duration = Duration::from_millis(100);

fn failed(op: &'static str, detail: impl Into<String>) -> TransportError {
    TransportError::Failed {
        transport: "nccl",
        op,
        detail: detail.into(),
    }
}

/// A random secret (or nonce) from the operating system.
pub(crate) fn random_bytes() -> Result<[u8; SECRET_LEN], TransportError> {
    let mut b = [0u8; SECRET_LEN];
    getrandom::fill(&mut b)
        .map_err(|e| failed("random", format!("the OS random source failed: {e}")))?;
    Ok(b)
}

/// Lower-case hex.
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes of a 64-digit hex string.
pub(crate) fn unhex(s: &str) -> Option<[u8; SECRET_LEN]> {
    if s.len() != 2 * SECRET_LEN || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; SECRET_LEN];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// One frame: its length (8 bytes, little-endian), then the body.
pub(crate) fn write_frame(s: &mut TcpStream, body: &[u8]) -> Result<(), TransportError> {
    let mut f = (body.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    s.write_all(&f)
        .map_err(|e| failed("control send", e.to_string()))
}

/// Fills `buf` from `s`, all of it before `deadline`; ends early when `stop` is set.
pub(crate) fn read_exact_until(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<(), TransportError> {
    let mut off = 0;
    while off < buf.len() {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return Err(failed("control receive", "the transport is shutting down"));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(failed("control receive", "the peer did not answer in time"));
        }
        s.set_read_timeout(Some(left.clamp(Duration::from_millis(1), SLICE)))
            .map_err(|e| failed("control receive", e.to_string()))?;
        match s.read(&mut buf[off..]) {
            Ok(0) => {
                return Err(failed(
                    "control receive",
                    "the peer closed the control connection",
                ))
            }
            Ok(n) => off += n,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(failed("control receive", e.to_string())),
        }
    }
    Ok(())
}

/// Reads one whole frame of at most `max` bytes before `deadline`; a longer one is
/// refused from its length, before anything is allocated for it.
pub(crate) fn read_frame(
    s: &mut TcpStream,
    max: u64,
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<Vec<u8>, TransportError> {
    let mut n = [0u8; 8];
    read_exact_until(s, &mut n, deadline, stop)?;
    let n = u64::from_le_bytes(n);
    if n > max {
        return Err(failed(
            "control receive",
            format!("a frame of {n} bytes (at most {max}): not this transport's protocol"),
        ));
    }
    // Read in slices, the buffer grown as they arrive: a peer that claims a large frame
    // and sends nothing costs nothing.
    let mut b = Vec::new();
    let mut chunk = vec![0u8; (n as usize).min(64 << 10)];
    while b.len() < n as usize {
        let k = chunk.len().min(n as usize - b.len());
        read_exact_until(s, &mut chunk[..k], deadline, stop)?;
        b.extend_from_slice(&chunk[..k]);
    }
    Ok(b)
}

/// The acceptor's first frame on a new connection.
#[derive(Serialize, Deserialize)]
struct Challenge {
    nonce: String,
}

/// The connecting side's answer: who it is, the id of the communicator it sends on, and
/// the proof.
#[derive(Serialize, Deserialize)]
struct Hello {
    agent: String,
    id: Vec<u8>,
    mac: String,
}

/// The proof a connecting `agent` sends: HMAC-SHA256 keyed with the acceptor's secret
/// over the nonce, the connector's secret, its name and its communicator id.
fn hello_mac(
    acceptor_secret: &[u8; SECRET_LEN],
    connector_secret: &[u8; SECRET_LEN],
    nonce: &[u8; SECRET_LEN],
    agent: &str,
    id: &[u8],
) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256>>::new_from_slice(acceptor_secret).expect("HMAC takes any key");
    m.update(b"dsa-kv nccl hello v1\0");
    m.update(nonce);
    m.update(connector_secret);
    m.update(&(agent.len() as u64).to_le_bytes());
    m.update(agent.as_bytes());
    m.update(id);
    m
}

/// Whether the other end closed `s` (nothing is read).
pub(crate) fn closed(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return true;
    }
    let r = s.peek(&mut [0u8; 1]);
    let _ = s.set_nonblocking(false);
    match r {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
    }
}

/// Who we are and who we pair with, for [`pair`].
pub(crate) struct PairSpec<'a> {
    /// Our name.
    pub me: &'a str,
    /// Our secret.
    pub own_secret: &'a [u8; SECRET_LEN],
    /// The unique id of the communicator we send on.
    pub out_id: &'a [u8],
    /// The peer's name, control address and secret (from its metadata).
    pub agent: &'a str,
    pub control: std::net::SocketAddr,
    pub peer_secret: &'a [u8; SECRET_LEN],
}

/// Both directions of the introduction between us and a peer that does the same at the
/// same time: our connection to it (we answer its challenge) and its connection to us
/// (its `Hello` checked by `acceptor`), served together, so that neither side waits for
/// the other to finish its half first. Returns (our connection, its connection, the id
/// of the communicator it sends on).
///
/// While it runs, `acceptor` checks every `Hello` naming `p.agent` as it arrives. Our
/// own connection is made again (after a pause that grows from [`RETRY_FIRST`] to
/// [`RETRY_MAX`]) whenever the peer closes it before taking it, until `deadline`: the
/// peer's acceptor may have displaced it to make room, or cut its handshake.
pub(crate) fn pair(
    acceptor: &mut Acceptor,
    p: &PairSpec<'_>,
    deadline: Instant,
) -> Result<(TcpStream, TcpStream, Vec<u8>), TransportError> {
    acceptor.expect(p.agent, p.peer_secret);
    let paired = pair_expected(acceptor, p, deadline);
    acceptor.expect_nobody();
    paired
}

/// Our connection to the peer, in its introduction.
struct Outgoing {
    stream: TcpStream,
    /// What has arrived of the peer's challenge.
    challenge: Vec<u8>,
    /// Our `Hello` is sent.
    introduced: bool,
}

/// Why one try of our connection ended.
enum TryEnded {
    /// The peer closed it, or it could not be made: try again.
    Closed(String),
    /// The peer does not speak this protocol: give up.
    Fatal(TransportError),
}

/// Advances our connection's introduction without blocking: reads the challenge,
/// answers it; once answered, watches that the peer keeps the connection.
fn advance_outgoing(o: &mut Outgoing, p: &PairSpec<'_>) -> Result<(), TryEnded> {
    if o.introduced {
        return if closed(&o.stream) {
            Err(TryEnded::Closed(format!(
                "{} closed our control connection after our Hello (refused it, or displaced it to make room)",
                p.agent
            )))
        } else {
            Ok(())
        };
    }
    let nonce = match read_challenge(&mut o.stream, &mut o.challenge).map_err(TryEnded::Fatal)? {
        Challenged::Partial => return Ok(()),
        Challenged::Closed(why) => return Err(TryEnded::Closed(why)),
        Challenged::Nonce(nonce) => nonce,
    };
    let mac = hello_mac(p.peer_secret, p.own_secret, &nonce, p.me, p.out_id)
        .finalize()
        .into_bytes();
    let hello = Hello {
        agent: p.me.to_string(),
        id: p.out_id.to_vec(),
        mac: hex(&mac),
    };
    let body = serde_json::to_vec(&hello)
        .map_err(|e| TryEnded::Fatal(failed("connect", e.to_string())))?;
    // A frame of a few hundred bytes on a fresh connection fits its send buffer, so
    // this write does not wait on the peer; the timeout is for a buffer that is not.
    o.stream
        .set_nonblocking(false)
        .and_then(|()| o.stream.set_write_timeout(Some(Duration::from_secs(1))))
        .map_err(|e| TryEnded::Closed(format!("our control connection: {e}")))?;
    write_frame(&mut o.stream, &body).map_err(|e| TryEnded::Closed(e.to_string()))?;
    o.introduced = true;
    Ok(())
}

fn pair_expected(
    acceptor: &mut Acceptor,
    p: &PairSpec<'_>,
    deadline: Instant,
) -> Result<(TcpStream, TcpStream, Vec<u8>), TransportError> {
    let mut out: Option<Outgoing> = None;
    let mut tries = 0u32;
    let mut next_try = Instant::now();
    let mut pause = RETRY_FIRST;
    let mut last_end = String::new();
    let mut incoming: Option<(TcpStream, Vec<u8>)> = None;
    loop {
        acceptor.poll()?;
        if out.is_none() && Instant::now() >= next_try {
            tries += 1;
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .clamp(Duration::from_millis(1), Duration::from_secs(1));
            match TcpStream::connect_timeout(&p.control, wait).and_then(|s| {
                s.set_nodelay(true)?;
                s.set_nonblocking(true)?;
                Ok(s)
            }) {
                Ok(stream) => {
                    out = Some(Outgoing {
                        stream,
                        challenge: Vec::new(),
                        introduced: false,
                    })
                }
                Err(e) => {
                    last_end = format!("cannot reach {} at {}: {e}", p.agent, p.control);
                    next_try = Instant::now() + pause;
                    pause = (pause * 2).min(RETRY_MAX);
                }
            }
        }
        if let Some(o) = out.as_mut() {
            match advance_outgoing(o, p) {
                Ok(()) => {}
                Err(TryEnded::Fatal(e)) => return Err(e),
                Err(TryEnded::Closed(why)) => {
                    tracing::debug!(
                        agent = p.agent,
                        tries,
                        "nccl: our control connection ended ({why}); connecting again"
                    );
                    last_end = why;
                    out = None;
                    next_try = Instant::now() + pause;
                    pause = (pause * 2).min(RETRY_MAX);
                }
            }
        }
        while incoming.is_none() {
            match acceptor.take(p.agent, p.peer_secret) {
                // One the agent closed (left by an earlier, failed attempt) is skipped.
                Some((s, id)) if !closed(&s) => incoming = Some((s, id)),
                Some(_) => {}
                None => break,
            }
        }
        // Our connection was seen open after our Hello in this round (above), so the
        // peer holds it: both directions are done.
        if out.as_ref().is_some_and(|o| o.introduced) && incoming.is_some() {
            if let (Some(o), Some((s, id))) = (out.take(), incoming.take()) {
                return Ok((o.stream, s, id));
            }
        }
        if Instant::now() > deadline {
            let ours = if out.as_ref().is_some_and(|o| o.introduced) {
                String::new()
            } else if last_end.is_empty() {
                "; it sent no challenge on our connection".to_string()
            } else {
                format!("; it did not keep our connection ({tries} tries, the last: {last_end})")
            };
            return Err(failed(
                "connect",
                format!(
                    "{} did not complete the authenticated introduction in time ({}{ours}): both sides must connect, each with the other's metadata",
                    p.agent,
                    if incoming.is_some() {
                        "its connection to us proved it holds our metadata"
                    } else {
                        "no connection from it proved it holds our metadata"
                    },
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// What has arrived of the peer's challenge.
enum Challenged {
    /// Not all of it yet.
    Partial,
    /// All of it: its nonce.
    Nonce([u8; SECRET_LEN]),
    /// The peer closed the connection (or it failed) first: why.
    Closed(String),
}

/// Reads what has arrived of the peer's challenge on the non-blocking `s` into `buf`;
/// an error for a challenge that is not this protocol's.
fn read_challenge(s: &mut TcpStream, buf: &mut Vec<u8>) -> Result<Challenged, TransportError> {
    let mut chunk = [0u8; 512];
    loop {
        let want = if buf.len() < 8 {
            8
        } else {
            let n = u64::from_le_bytes(buf[..8].try_into().expect("eight bytes"));
            if n > MAX_HELLO {
                return Err(failed(
                    "connect",
                    format!("the peer's challenge claims {n} bytes"),
                ));
            }
            8 + n as usize
        };
        if buf.len() == want && want > 8 {
            let c: Challenge = serde_json::from_slice(&buf[8..])
                .map_err(|e| failed("connect", format!("the peer's challenge: {e}")))?;
            return unhex(&c.nonce)
                .map(Challenged::Nonce)
                .ok_or_else(|| failed("connect", "the peer's challenge is not a 32-byte nonce"));
        }
        let room = (want - buf.len()).min(chunk.len());
        match s.read(&mut chunk[..room]) {
            Ok(0) => {
                return Ok(Challenged::Closed(
                    "the peer closed our control connection before its challenge".into(),
                ))
            }
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(Challenged::Partial),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                return Ok(Challenged::Closed(format!(
                    "our control connection, before the challenge: {e}"
                )))
            }
        }
    }
}

/// The connecting side of an introduction on a fresh connection to the peer: reads its
/// challenge, answers with our `Hello` (name, communicator id, proof). (Blocking: for a
/// peer whose acceptor runs on its own, as in the tests; two transports connecting to
/// each other use [`pair`].)
#[cfg(test)]
pub(crate) fn introduce(
    s: &mut TcpStream,
    agent: &str,
    id: &[u8],
    own_secret: &[u8; SECRET_LEN],
    peer_secret: &[u8; SECRET_LEN],
    deadline: Instant,
) -> Result<(), TransportError> {
    let c = read_frame(s, MAX_HELLO, deadline, None)?;
    let c: Challenge = serde_json::from_slice(&c)
        .map_err(|e| failed("connect", format!("the peer's challenge: {e}")))?;
    let nonce = unhex(&c.nonce)
        .ok_or_else(|| failed("connect", "the peer's challenge is not a 32-byte nonce"))?;
    let mac = hello_mac(peer_secret, own_secret, &nonce, agent, id)
        .finalize()
        .into_bytes();
    let hello = Hello {
        agent: agent.to_string(),
        id: id.to_vec(),
        mac: hex(&mac),
    };
    write_frame(
        s,
        &serde_json::to_vec(&hello).map_err(|e| failed("connect", e.to_string()))?,
    )
}

/// A connection in its handshake: the challenge is sent, the `Hello` is being read.
struct Handshake {
    stream: TcpStream,
    /// The peer's address (canonical: an IPv4-mapped IPv6 address as IPv4).
    peer: IpAddr,
    started: Instant,
    nonce: [u8; SECRET_LEN],
    buf: Vec<u8>,
    deadline: Instant,
}

/// A connection whose `Hello` arrived naming a peer we are not pairing with: its proof
/// waits for that peer's secret.
struct Introduced {
    stream: TcpStream,
    peer: IpAddr,
    arrived: Instant,
    nonce: [u8; SECRET_LEN],
    hello: Hello,
}

/// The peer we are pairing with, and its connections whose proof checked.
struct Expected {
    agent: String,
    secret: [u8; SECRET_LEN],
    /// Oldest first; only that peer can add to it (a proof needs its secret).
    proven: VecDeque<(TcpStream, Vec<u8>)>,
}

/// Whether `hello`, the answer on a connection challenged with `nonce`, proves that its
/// sender holds `acceptor_secret` and `connector_secret`.
fn proves(
    acceptor_secret: &[u8; SECRET_LEN],
    connector_secret: &[u8; SECRET_LEN],
    nonce: &[u8; SECRET_LEN],
    hello: &Hello,
) -> bool {
    unhex(&hello.mac).is_some_and(|mac| {
        hello_mac(
            acceptor_secret,
            connector_secret,
            nonce,
            &hello.agent,
            &hello.id,
        )
        .verify_slice(&mac)
        .is_ok()
    })
}

/// Which entry of a table of `entries` (each its peer address and age) a newcomer from
/// `peer` displaces, if any: none while there is room; once `peer` holds `per_peer`,
/// the oldest of its own; once the table holds `total`, the oldest of the address that
/// holds the most (of those, the one with the oldest entry). So a newcomer displaces
/// another address's entry only if that address holds at least as many as its own,
/// and it is never turned away.
fn displaced(
    entries: &[(IpAddr, Instant)],
    peer: IpAddr,
    total: usize,
    per_peer: usize,
) -> Option<usize> {
    let mut held: HashMap<IpAddr, (usize, Instant)> = HashMap::new();
    for &(ip, t) in entries {
        let e = held.entry(ip).or_insert((0, t));
        e.0 += 1;
        e.1 = e.1.min(t);
    }
    let victim = if held.get(&peer).is_some_and(|&(n, _)| n >= per_peer) {
        peer
    } else if entries.len() >= total {
        // The most entries; of those, the oldest entry (reversed: min_by on age).
        held.iter()
            .max_by(|a, b| a.1 .0.cmp(&b.1 .0).then(b.1 .1.cmp(&a.1 .1)))
            .map(|(ip, _)| *ip)?
    } else {
        return None;
    };
    entries
        .iter()
        .enumerate()
        .filter(|(_, (ip, _))| *ip == victim)
        .min_by_key(|(_, (_, t))| *t)
        .map(|(i, _)| i)
}

/// Accepts control connections and runs their handshakes concurrently (see the module
/// docs).
pub(crate) struct Acceptor {
    listener: TcpListener,
    secret: [u8; SECRET_LEN],
    hello_timeout: Duration,
    handshaking: Vec<Handshake>,
    /// Unproven, oldest first.
    introduced: VecDeque<Introduced>,
    /// The peer [`pair`] is pairing with.
    expected: Option<Expected>,
    /// Connections closed: displaced to make room, silent past the deadline,
    /// malformed, or with a wrong proof.
    pub refused: u64,
}

impl Acceptor {
    /// Accepts on `listener` (made non-blocking) for a transport whose secret is `secret`.
    pub(crate) fn new(
        listener: TcpListener,
        secret: [u8; SECRET_LEN],
        hello_timeout: Duration,
    ) -> std::io::Result<Acceptor> {
        listener.set_nonblocking(true)?;
        Ok(Acceptor {
            listener,
            secret,
            hello_timeout,
            handshaking: Vec::new(),
            introduced: VecDeque::new(),
            expected: None,
            refused: 0,
        })
    }

    /// Accepts every connection waiting and advances every handshake, without blocking.
    pub(crate) fn poll(&mut self) -> Result<(), TransportError> {
        loop {
            match self.listener.accept() {
                Ok((s, addr)) => {
                    let peer = addr.ip().to_canonical();
                    let table: Vec<(IpAddr, Instant)> = self
                        .handshaking
                        .iter()
                        .map(|h| (h.peer, h.started))
                        .collect();
                    if let Some(i) =
                        displaced(&table, peer, MAX_HANDSHAKES, MAX_HANDSHAKES_PER_PEER)
                    {
                        let old = self.handshaking.swap_remove(i);
                        self.refused += 1;
                        tracing::warn!(
                            displaced = %old.peer,
                            %addr,
                            "nccl: control handshakes at their limit ({MAX_HANDSHAKES} in all, {MAX_HANDSHAKES_PER_PEER} per address); closing the oldest of the busiest address for a new connection"
                        );
                    }
                    if let Err(e) = self.start(s, peer) {
                        self.refused += 1;
                        tracing::warn!(%addr, "nccl: a control connection failed its challenge: {e}");
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // Out of descriptors and the like: try again at the next poll.
                Err(e) => {
                    tracing::warn!("nccl: accept failed: {e}");
                    break;
                }
            }
        }
        let now = Instant::now();
        let mut i = 0;
        while i < self.handshaking.len() {
            match Self::advance(&mut self.handshaking[i], now) {
                Ok(None) => i += 1,
                Ok(Some(hello)) => {
                    let h = self.handshaking.swap_remove(i);
                    let _ = h.stream.set_nonblocking(false);
                    self.introduce(h, hello, now);
                }
                Err(why) => {
                    let h = self.handshaking.swap_remove(i);
                    self.refused += 1;
                    tracing::warn!(peer = ?h.stream.peer_addr().ok(), "nccl: closing a control connection: {why}");
                }
            }
        }
        Ok(())
    }

    /// Files a connection whose `Hello` arrived: checked now if it names the peer we
    /// pair with, else kept unproven (displacing one past the limits).
    fn introduce(&mut self, h: Handshake, hello: Hello, now: Instant) {
        if let Some(x) = self.expected.as_mut().filter(|x| x.agent == hello.agent) {
            if proves(&self.secret, &x.secret, &h.nonce, &hello) {
                x.proven.push_back((h.stream, hello.id));
                // Only the peer itself gets here; the bound is for form's sake.
                if x.proven.len() > MAX_INTRODUCED {
                    x.proven.pop_front();
                }
            } else {
                self.refused += 1;
                tracing::warn!(agent = %hello.agent, peer = %h.peer, "nccl: refused a control connection that names a peer but cannot prove it (wrong secret)");
            }
            return;
        }
        let table: Vec<(IpAddr, Instant)> = self
            .introduced
            .iter()
            .map(|i| (i.peer, i.arrived))
            .collect();
        if let Some(k) = displaced(&table, h.peer, MAX_INTRODUCED, MAX_INTRODUCED_PER_PEER) {
            let old = self
                .introduced
                .remove(k)
                .expect("invariant: an index of the table");
            self.refused += 1;
            tracing::warn!(
                agent = %old.hello.agent,
                displaced = %old.peer,
                "nccl: introduced control connections at their limit ({MAX_INTRODUCED} in all, {MAX_INTRODUCED_PER_PEER} per address); closing the oldest of the busiest address"
            );
        }
        self.introduced.push_back(Introduced {
            stream: h.stream,
            peer: h.peer,
            arrived: now,
            nonce: h.nonce,
            hello,
        });
    }

    /// From now on a `Hello` naming `agent` is checked with `peer_secret` (from that
    /// agent's metadata) as it arrives; those waiting are checked now. Connections
    /// naming `agent` with a wrong proof are closed and counted.
    pub(crate) fn expect(&mut self, agent: &str, peer_secret: &[u8; SECRET_LEN]) {
        if self
            .expected
            .as_ref()
            .is_some_and(|x| x.agent == agent && x.secret == *peer_secret)
        {
            return;
        }
        let mut x = Expected {
            agent: agent.to_string(),
            secret: *peer_secret,
            proven: VecDeque::new(),
        };
        let mut kept = VecDeque::with_capacity(self.introduced.len());
        for i in self.introduced.drain(..) {
            if i.hello.agent != agent {
                kept.push_back(i);
            } else if proves(&self.secret, peer_secret, &i.nonce, &i.hello) {
                x.proven.push_back((i.stream, i.hello.id));
            } else {
                self.refused += 1;
                tracing::warn!(agent, peer = %i.peer, "nccl: refused a control connection that names a peer but cannot prove it (wrong secret)");
            }
        }
        self.introduced = kept;
        self.expected = Some(x);
    }

    /// Back to keeping every `Hello` unproven; proven connections not taken are closed.
    pub(crate) fn expect_nobody(&mut self) {
        self.expected = None;
    }

    fn start(&mut self, s: TcpStream, peer: IpAddr) -> std::io::Result<()> {
        let nonce = random_bytes().map_err(std::io::Error::other)?;
        let body = serde_json::to_vec(&Challenge { nonce: hex(&nonce) })?;
        let mut f = (body.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(&body);
        // A fresh socket takes a hundred bytes without blocking.
        s.set_nonblocking(false)?;
        s.set_write_timeout(Some(Duration::from_millis(200)))?;
        s.set_nodelay(true)?;
        (&s).write_all(&f)?;
        s.set_nonblocking(true)?;
        let now = Instant::now();
        self.handshaking.push(Handshake {
            stream: s,
            peer,
            started: now,
            nonce,
            buf: Vec::new(),
            deadline: now + self.hello_timeout,
        });
        Ok(())
    }

    /// Reads what has arrived: `Some(hello)` once it is whole, an error to close it.
    fn advance(h: &mut Handshake, now: Instant) -> Result<Option<Hello>, String> {
        let mut chunk = [0u8; 1024];
        loop {
            let want = if h.buf.len() < 8 {
                8
            } else {
                let n = u64::from_le_bytes(h.buf[..8].try_into().expect("eight bytes"));
                if n > MAX_HELLO {
                    return Err(format!("a Hello of {n} bytes (at most {MAX_HELLO})"));
                }
                8 + n as usize
            };
            if h.buf.len() == want && want > 8 {
                return serde_json::from_slice(&h.buf[8..])
                    .map(Some)
                    .map_err(|e| format!("a malformed Hello: {e}"));
            }
            let room = (want - h.buf.len()).min(chunk.len());
            match h.stream.read(&mut chunk[..room]) {
                Ok(0) => return Err("closed before its Hello".into()),
                Ok(n) => h.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    return if now > h.deadline {
                        Err("no Hello before the deadline".into())
                    } else {
                        Ok(None)
                    };
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// A connection from `agent` whose proof checks with our secret and `peer_secret`
    /// (from that agent's metadata), oldest first: the stream and its communicator id.
    /// Expects `agent` from now on ([`expect`](Self::expect)).
    pub(crate) fn take(
        &mut self,
        agent: &str,
        peer_secret: &[u8; SECRET_LEN],
    ) -> Option<(TcpStream, Vec<u8>)> {
        self.expect(agent, peer_secret);
        self.expected.as_mut()?.proven.pop_front()
    }

    /// Handshakes in progress and introduced connections waiting, proven or not (for
    /// tests).
    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        let proven = self.expected.as_ref().map_or(0, |x| x.proven.len());
        (self.handshaking.len(), self.introduced.len() + proven)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acceptor(timeout: Duration) -> (Acceptor, std::net::SocketAddr, [u8; 32]) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let secret = random_bytes().unwrap();
        (Acceptor::new(l, secret, timeout).unwrap(), addr, secret)
    }

    /// Polls until `f` says done or 5 s pass.
    fn poll_until(a: &mut Acceptor, mut f: impl FnMut(&mut Acceptor) -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            a.poll().unwrap();
            if f(a) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }

    #[test]
    fn hex_round_trips_and_refuses_junk() {
        let b = random_bytes().unwrap();
        assert_eq!(unhex(&hex(&b)), Some(b));
        assert_eq!(unhex("00"), None);
        assert_eq!(unhex(&"zz".repeat(32)), None);
        assert_eq!(unhex(&"é".repeat(32)), None);
        assert_ne!(random_bytes().unwrap(), b);
    }

    /// The audit's two findings: twelve silent sockets used to exhaust the connect
    /// deadline (one five-second wait each, in turn), and any process naming a peer was
    /// taken for it. Now the honest peer is introduced at once whatever the silent ones
    /// do, and a forged Hello (right name, wrong secret; or a replayed Hello) is refused.
    #[test]
    fn silent_sockets_and_impostors_do_not_stand_in_for_a_peer() {
        let (mut a, addr, secret) = acceptor(Duration::from_secs(5));
        let peer_secret = random_bytes().unwrap();
        let silent: Vec<TcpStream> = (0..12).map(|_| TcpStream::connect(addr).unwrap()).collect();
        // An impostor that names the peer but holds only the acceptor's metadata.
        let wrong = random_bytes().unwrap();
        let mut impostor = TcpStream::connect(addr).unwrap();
        // The honest peer.
        let mut honest = TcpStream::connect(addr).unwrap();
        let t0 = Instant::now();
        let d = t0 + Duration::from_secs(5);
        let go = |s: &mut TcpStream, own: [u8; 32]| {
            let mut s = s.try_clone().unwrap();
            std::thread::spawn(move || introduce(&mut s, "prefill", b"comm-id", &own, &secret, d))
        };
        let i = go(&mut impostor, wrong);
        let h = go(&mut honest, peer_secret);
        assert!(poll_until(&mut a, |a| a.counts().1 == 2));
        i.join().unwrap().unwrap();
        h.join().unwrap().unwrap();
        let (_, id) = a.take("prefill", &peer_secret).expect("the honest peer");
        assert_eq!(id, b"comm-id");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        assert_eq!(a.refused, 1, "the impostor was refused");
        assert!(a.take("prefill", &peer_secret).is_none());
        // A replayed Hello (the honest bytes on a new connection) fails: its nonce is
        // another connection's.
        let mut replay = TcpStream::connect(addr).unwrap();
        let mut c = TcpStream::connect(addr).unwrap();
        let rec = std::thread::spawn(move || {
            // Read the challenge of `c`, answer it honestly, and send the same Hello
            // on `replay` after reading replay's own challenge.
            let ch = read_frame(&mut c, 4096, d, None).unwrap();
            let nonce = unhex(&serde_json::from_slice::<Challenge>(&ch).unwrap().nonce).unwrap();
            let mac = hello_mac(&secret, &peer_secret, &nonce, "prefill", b"x").finalize();
            let hello = serde_json::to_vec(&Hello {
                agent: "prefill".into(),
                id: b"x".to_vec(),
                mac: hex(&mac.into_bytes()),
            })
            .unwrap();
            read_frame(&mut replay, 4096, d, None).unwrap();
            write_frame(&mut replay, &hello).unwrap();
            (c, replay)
        });
        // (`take` made the acceptor expect "prefill": the replay is checked, and
        // refused, the moment it arrives.)
        assert!(poll_until(&mut a, |a| a.refused == 2));
        let _keep = rec.join().unwrap();
        assert!(a.take("prefill", &peer_secret).is_none());
        assert_eq!(
            a.counts(),
            (12 + 1, 0),
            "the silent ones and `c`, in handshakes"
        );
        // The silent sockets (and `c`, which never sent its Hello) are closed at their
        // deadline (here: shortened).
        a.hello_timeout = Duration::ZERO;
        for h in &mut a.handshaking {
            h.deadline = Instant::now();
        }
        assert!(poll_until(&mut a, |a| a.counts().0 == 0));
        assert_eq!(a.refused, 2 + 12 + 1);
        drop(silent);
    }

    /// Two transports introducing themselves to each other at the same time (what
    /// `NcclTransport::connect` does on both sides): each completes both directions.
    /// A first version answered its own challenge before serving its acceptor, and
    /// two peers doing that waited for each other until the deadline (found on the
    /// H200 run).
    #[test]
    fn two_peers_pair_at_the_same_time() {
        let (mut a, addr_a, sa) = acceptor(Duration::from_secs(5));
        let (mut b, addr_b, sb) = acceptor(Duration::from_secs(5));
        let d = Instant::now() + Duration::from_secs(5);
        let t = std::thread::spawn(move || {
            let p = PairSpec {
                me: "b",
                own_secret: &sb,
                out_id: b"id-b",
                agent: "a",
                control: addr_a,
                peer_secret: &sa,
            };
            // The streams are kept until the other side is done, as a transport would.
            pair(&mut b, &p, d)
        });
        let p = PairSpec {
            me: "a",
            own_secret: &sa,
            out_id: b"id-a",
            agent: "b",
            control: addr_b,
            peer_secret: &sb,
        };
        let t0 = Instant::now();
        let (_out, _in, id) = pair(&mut a, &p, d).unwrap();
        assert_eq!(id, b"id-b");
        assert_eq!(t.join().unwrap().unwrap().2, b"id-a");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        // A peer that pairs with the wrong secret for us is never taken.
        let (mut a, addr_a, sa) = acceptor(Duration::from_secs(5));
        let (mut b, addr_b, sb) = acceptor(Duration::from_secs(5));
        let wrong = random_bytes().unwrap();
        let d = Instant::now() + Duration::from_millis(800);
        let t = std::thread::spawn(move || {
            let p = PairSpec {
                me: "b",
                own_secret: &wrong,
                out_id: b"id-b",
                agent: "a",
                control: addr_a,
                peer_secret: &sa,
            };
            pair(&mut b, &p, d).map(|_| ())
        });
        let p = PairSpec {
            me: "a",
            own_secret: &sa,
            out_id: b"id-a",
            agent: "b",
            control: addr_b,
            peer_secret: &sb,
        };
        let e = pair(&mut a, &p, d).unwrap_err();
        assert!(e.to_string().contains("proved"), "{e}");
        let _ = t.join().unwrap();
    }

    /// A client that answers its challenge with a well-formed `Hello` naming `agent`
    /// whose proof is garbage (it holds nobody's secret).
    fn forge(addr: std::net::SocketAddr, agent: &str, deadline: Instant) -> TcpStream {
        let mut s = TcpStream::connect(addr).unwrap();
        read_frame(&mut s, MAX_HELLO, deadline, None).unwrap();
        let hello = Hello {
            agent: agent.into(),
            id: b"forged".to_vec(),
            mac: "00".repeat(SECRET_LEN),
        };
        write_frame(&mut s, &serde_json::to_vec(&hello).unwrap()).unwrap();
        s
    }

    /// Issue 39, item 6 (silent sockets): a full table of silent handshakes, which an
    /// attacker refreshes every 5 s, closed every new connection at once, the honest
    /// peer's too. Now a newcomer displaces the oldest silent one of its address.
    #[test]
    fn a_full_table_of_silent_sockets_does_not_lock_out_a_peer() {
        let (mut a, addr, secret) = acceptor(Duration::from_secs(5));
        let peer_secret = random_bytes().unwrap();
        let silent: Vec<TcpStream> = (0..MAX_HANDSHAKES)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        assert!(poll_until(&mut a, |a| a.counts().0 + a.refused as usize
            == MAX_HANDSHAKES));
        let mut honest = TcpStream::connect(addr).unwrap();
        let d = Instant::now() + Duration::from_secs(5);
        let h = std::thread::spawn(move || {
            introduce(&mut honest, "prefill", b"comm-id", &peer_secret, &secret, d)
        });
        let arrived = poll_until(&mut a, |a| a.counts().1 == 1);
        let answered = h.join().unwrap();
        assert!(
            arrived,
            "the honest peer's Hello never arrived: {answered:?}"
        );
        answered.expect("the honest peer was challenged");
        let (_, id) = a.take("prefill", &peer_secret).expect("the honest peer");
        assert_eq!(id, b"comm-id");
        // The address held its share of silent handshakes; the 48 past it and then one
        // more, for the honest peer, were displaced (all from 127.0.0.1 here).
        let share = MAX_HANDSHAKES_PER_PEER;
        assert_eq!(a.refused, (MAX_HANDSHAKES - share + 1) as u64);
        assert_eq!(a.counts(), (share - 1, 0));
        drop(silent);
    }

    /// Issue 39, item 6 (forged Hellos): the peer connected first and its `Hello`
    /// waited for our `connect`; well-formed `Hello`s with garbage proofs then pushed it
    /// out of the 16-slot queue (proofs were checked only at `take`), and pairing failed
    /// at the deadline. Now the peer's connector sees its connection closed and tries
    /// again, and while we pair, a `Hello` naming the peer is checked when it arrives.
    #[test]
    fn forged_hellos_do_not_keep_a_peer_from_pairing() {
        let (mut a, addr_a, sa) = acceptor(Duration::from_secs(5));
        let (mut b, addr_b, sb) = acceptor(Duration::from_secs(5));
        let d = Instant::now() + Duration::from_secs(5);
        let peer_b = std::thread::spawn(move || {
            let p = PairSpec {
                me: "b",
                own_secret: &sb,
                out_id: b"id-b",
                agent: "a",
                control: addr_a,
                peer_secret: &sa,
            };
            // The streams are kept until the other side is done, as a transport would.
            pair(&mut b, &p, d)
        });
        assert!(poll_until(&mut a, |a| a.counts().1 == 1), "b's Hello");
        let forger = std::thread::spawn(move || {
            (0..2 * MAX_INTRODUCED)
                .map(|i| forge(addr_a, if i % 2 == 0 { "b" } else { "x" }, d))
                .collect::<Vec<_>>()
        });
        assert!(poll_until(&mut a, |_| forger.is_finished()));
        let _forged = forger.join().unwrap();
        assert!(poll_until(&mut a, |a| a.counts().0 == 0));
        let p = PairSpec {
            me: "a",
            own_secret: &sa,
            out_id: b"id-a",
            agent: "b",
            control: addr_b,
            peer_secret: &sb,
        };
        let (_out, _in, id) = pair(&mut a, &p, d).expect("a pairs with b");
        assert_eq!(id, b"id-b");
        assert_eq!(peer_b.join().unwrap().expect("b pairs with a").2, b"id-a");
        // What is left unproven: forgeries naming "x", at most one address's share.
        assert!(a.counts().1 <= MAX_INTRODUCED_PER_PEER, "{:?}", a.counts());
    }

    /// While we pair with a peer, a `Hello` naming it is checked as it arrives: a
    /// forgery is closed at once and takes no slot; the peer's proven connection waits
    /// apart. Once pairing ends, such `Hello`s wait unproven again.
    #[test]
    fn while_pairing_a_forged_hello_for_the_peer_is_refused_on_arrival() {
        let (mut a, addr, secret) = acceptor(Duration::from_secs(5));
        let peer_secret = random_bytes().unwrap();
        let d = Instant::now() + Duration::from_secs(5);
        a.expect("prefill", &peer_secret);
        let forger = std::thread::spawn(move || {
            (0..2 * MAX_INTRODUCED)
                .map(|_| forge(addr, "prefill", d))
                .collect::<Vec<_>>()
        });
        let forged = 2 * MAX_INTRODUCED as u64;
        assert!(poll_until(&mut a, |a| a.refused == forged));
        let _forged = forger.join().unwrap();
        assert_eq!(a.counts(), (0, 0));
        let mut honest = TcpStream::connect(addr).unwrap();
        let h = std::thread::spawn(move || {
            introduce(&mut honest, "prefill", b"comm-id", &peer_secret, &secret, d)
        });
        assert!(poll_until(&mut a, |a| a.counts().1 == 1));
        h.join().unwrap().unwrap();
        let (_, id) = a.take("prefill", &peer_secret).expect("the honest peer");
        assert_eq!(id, b"comm-id");
        assert_eq!(a.refused, forged);
        a.expect_nobody();
        let forger = std::thread::spawn(move || forge(addr, "prefill", d));
        assert!(poll_until(&mut a, |a| a.counts().1 == 1));
        let _forged = forger.join().unwrap();
        assert_eq!(a.refused, forged);
    }

    /// The choice of whom a newcomer displaces (`t(ms)`: an entry's age).
    #[test]
    fn displacement_keeps_a_fair_share_per_address() {
        let t0 = Instant::now();
        let t = |ms| t0 + Duration::from_millis(ms);
        let (a, b, c) = (
            IpAddr::from([10, 0, 0, 1]),
            IpAddr::from([10, 0, 0, 2]),
            IpAddr::from([10, 0, 0, 3]),
        );
        // Room, and the newcomer's address under its share: nobody.
        assert_eq!(displaced(&[], a, 4, 2), None);
        assert_eq!(displaced(&[(a, t(0)), (b, t(1))], a, 4, 2), None);
        // The newcomer's address holds its share: its own oldest, though `b`'s is older.
        let table = [(b, t(0)), (a, t(5)), (a, t(1))];
        assert_eq!(displaced(&table, a, 4, 2), Some(2));
        // Full: the oldest of the address holding the most, not `b`'s older entry.
        let table = [(b, t(0)), (a, t(3)), (a, t(2)), (c, t(1))];
        assert_eq!(displaced(&table, c, 4, 2), Some(2));
        assert_eq!(displaced(&table, b, 4, 2), Some(2));
        // Two addresses hold the most: the one with the oldest entry.
        let table = [(b, t(4)), (a, t(3)), (b, t(2)), (a, t(1))];
        assert_eq!(displaced(&table, c, 4, 3), Some(3));
        // One address holds everything: the newcomer from another takes its oldest.
        let table = [(a, t(2)), (a, t(1)), (a, t(3))];
        assert_eq!(displaced(&table, b, 3, 3), Some(1));
    }

    #[test]
    fn floods_are_bounded() {
        let (mut a, addr, _) = acceptor(Duration::from_secs(30));
        let conns: Vec<TcpStream> = (0..MAX_HANDSHAKES + 10)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        // One address: it holds its share; each newer connection displaced its oldest.
        let over = (MAX_HANDSHAKES + 10 - MAX_HANDSHAKES_PER_PEER) as u64;
        assert!(poll_until(&mut a, |a| a.refused == over));
        assert_eq!(a.counts(), (MAX_HANDSHAKES_PER_PEER, 0));
        drop(conns);
        // A Hello claiming a huge length is refused from its length.
        let (mut a, addr, _) = acceptor(Duration::from_secs(30));
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&u64::MAX.to_le_bytes()).unwrap();
        assert!(poll_until(&mut a, |a| a.refused == 1));
        // Garbage JSON of a legal length.
        let mut s2 = TcpStream::connect(addr).unwrap();
        write_frame(&mut s2, b"{\"agent\": 1}").unwrap();
        assert!(poll_until(&mut a, |a| a.refused == 2));
        drop((s, s2));
    }

    #[test]
    fn frames_are_bounded_and_deadlined() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        write_frame(&mut c, b"hello").unwrap();
        let d = Instant::now() + Duration::from_secs(2);
        assert_eq!(read_frame(&mut s, 16, d, None).unwrap(), b"hello");
        c.write_all(&(1u64 << 40).to_le_bytes()).unwrap();
        let e = read_frame(&mut s, 16, d, None).unwrap_err();
        assert!(e.to_string().contains("at most 16"), "{e}");
        // A frame dripped past its deadline; a stop flag ends a wait early.
        c.write_all(&8u64.to_le_bytes()).unwrap();
        let e = read_frame(
            &mut s,
            16,
            Instant::now() + Duration::from_millis(300),
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("in time"), "{e}");
        let stop = AtomicBool::new(true);
        let t0 = Instant::now();
        let e = read_frame(
            &mut s,
            16,
            Instant::now() + Duration::from_secs(30),
            Some(&stop),
        )
        .unwrap_err();
        assert!(e.to_string().contains("shutting down"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(1));
    }
}

/// Fuzzing the decoders a peer's bytes reach before it is trusted (proptest, a fixed
/// seed and case budget): frames, the acceptor's handshake, the connector's challenge.
/// Pass: a typed refusal or a decoded value, no panic, never more than the limits
/// buffered.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    fn runner(cases: u32) -> TestRunner {
        TestRunner::new_with_rng(
            Config::with_cases(cases),
            TestRng::from_seed(RngAlgorithm::ChaCha, &[23; 32]),
        )
    }

    /// A connected pair; `bytes` written on the first, which is then shut for writing.
    fn fed(bytes: &[u8]) -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        a.write_all(bytes).unwrap();
        a.shutdown(std::net::Shutdown::Write).unwrap();
        (a, b)
    }

    /// Random bytes, or a valid frame with its length or body mutated.
    fn input() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..64),
            (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..200)).prop_map(|(n, body)| {
                let mut f = n.to_le_bytes().to_vec();
                f.extend(body);
                f
            }),
            (0usize..300, any::<u8>()).prop_map(|(i, x)| {
                let hello = serde_json::to_vec(&Hello {
                    agent: "prefill".into(),
                    id: vec![1; 128],
                    mac: "00".repeat(32),
                })
                .unwrap();
                let mut f = (hello.len() as u64).to_le_bytes().to_vec();
                f.extend(hello);
                let i = i % f.len();
                f[i] ^= x | 1;
                f
            }),
        ]
    }

    #[test]
    fn frames_handshakes_and_challenges_refuse_or_decode() {
        runner(192)
            .run(&input(), |bytes| {
                let (_a, mut b) = fed(&bytes);
                let d = Instant::now() + Duration::from_secs(2);
                if let Ok(f) = read_frame(&mut b, 256, d, None) {
                    prop_assert!(f.len() <= 256);
                }
                let (_a, b) = fed(&bytes);
                b.set_nonblocking(true).unwrap();
                let mut h = Handshake {
                    stream: b,
                    peer: IpAddr::from([127, 0, 0, 1]),
                    started: Instant::now(),
                    nonce: [0; SECRET_LEN],
                    buf: Vec::new(),
                    deadline: d,
                };
                while let Ok(None) = Acceptor::advance(&mut h, Instant::now()) {
                    prop_assert!(h.buf.len() as u64 <= 8 + MAX_HELLO);
                    std::thread::sleep(Duration::from_millis(1));
                }
                prop_assert!(h.buf.len() as u64 <= 8 + MAX_HELLO);
                let (_a, mut b) = fed(&bytes);
                b.set_nonblocking(true).unwrap();
                let mut buf = Vec::new();
                while let Ok(Challenged::Partial) = read_challenge(&mut b, &mut buf) {
                    prop_assert!(buf.len() as u64 <= 8 + MAX_HELLO);
                    std::thread::sleep(Duration::from_millis(1));
                }
                prop_assert!(buf.len() as u64 <= 8 + MAX_HELLO);
                Ok(())
            })
            .unwrap();
    }
}
