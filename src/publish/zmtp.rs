//! The server side of ZMTP 3.0 (RFC 23/ZMTP, the wire protocol of ZeroMQ sockets) with
//! the NULL mechanism: the subset a PUB and a ROUTER socket need, with every length a
//! peer sends checked against a limit **before** anything is allocated for it.
//!
//! Why our own: the `zeromq` crate reserves whatever length a frame header claims (a
//! 9-byte header claiming 2^62 bytes aborts the process) and bounds neither multi-part
//! messages nor subscription lists; libzmq bounds message sizes (`ZMQ_MAXMSGSIZE`) but
//! not a subscriber's subscriptions, and queues by message count, not bytes. A PUB and a
//! ROUTER that answer replay requests need little of ZMTP, and owning that little lets
//! every byte a peer can make us hold be counted.
//!
//! What is spoken: the 64-byte greeting (version 3.0, mechanism `NULL`: peers of 3.0
//! and 3.1 interoperate at 3.0, so subscriptions arrive as messages whose first byte is
//! 1 or 0), the `READY` command with `Socket-Type` both ways, then frames (flags byte:
//! `MORE` 1, `LONG` 2, `COMMAND` 4; a one-byte or an eight-byte big-endian length).
//! `SUBSCRIBE` / `CANCEL` commands (ZMTP 3.1) are understood too; other commands are
//! read (within the limit) and ignored. Refused: other mechanisms (CURVE, PLAIN),
//! versions before 3, reserved flag bits, frames or messages past the limits.
//!
//! The readers here are plain `async fn`s over any `AsyncRead`, so the tests and the
//! fuzz targets feed them byte slices.

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bytes of a greeting.
pub(crate) const GREETING_LEN: usize = 64;

/// More frames of the message follow.
pub(crate) const FLAG_MORE: u8 = 1;
const FLAG_LONG: u8 = 2;
const FLAG_COMMAND: u8 = 4;

/// Why a peer's bytes were refused (the connection is then closed).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ZmtpError {
    /// The connection failed or closed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// Not a ZMTP 3 greeting with the NULL mechanism.
    #[error("greeting: {0}")]
    Greeting(String),
    /// A length past its limit.
    #[error("a {what} of {len} bytes (the limit is {limit})")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// The length claimed.
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// Anything else the protocol forbids.
    #[error("protocol: {0}")]
    Protocol(String),
}

/// The socket types on the two ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SocketType {
    Pub,
    Router,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            SocketType::Pub => b"PUB",
            SocketType::Router => b"ROUTER",
        }
    }

    /// Whether a peer of type `peer` may talk to us (RFC 23's table).
    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            SocketType::Pub => matches!(peer, b"SUB" | b"XSUB"),
            SocketType::Router => matches!(peer, b"REQ" | b"DEALER" | b"ROUTER"),
        }
    }
}

/// Our greeting: version 3.0, NULL, not as-server (NULL has no roles).
pub(crate) fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks a peer's greeting: the signature, version 3 or later, the NULL mechanism.
pub(crate) fn check_greeting(g: &[u8; GREETING_LEN]) -> Result<(), ZmtpError> {
    if g[0] != 0xff || g[9] != 0x7f {
        return Err(ZmtpError::Greeting("no ZMTP signature".into()));
    }
    if g[10] < 3 {
        return Err(ZmtpError::Greeting(format!(
            "ZMTP {}.{}: this server speaks 3.0 and later",
            g[10], g[11]
        )));
    }
    let mech = &g[12..32];
    let end = mech.iter().position(|&b| b == 0).unwrap_or(mech.len());
    if &mech[..end] != b"NULL" || mech[end..].iter().any(|&b| b != 0) {
        return Err(ZmtpError::Greeting(format!(
            "mechanism {:?}: only NULL is served",
            String::from_utf8_lossy(&mech[..end])
        )));
    }
    Ok(())
}

/// One frame as read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Frame {
    /// A command (not part of a message).
    pub command: bool,
    /// More frames of this message follow.
    pub more: bool,
    /// The body.
    pub body: Bytes,
}

/// Reads one frame whose body may be at most `limit` bytes; a longer one is refused
/// from its header, before its body is read or anything is allocated for it.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    limit: u64,
) -> Result<Frame, ZmtpError> {
    let flags = r.read_u8().await?;
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(ZmtpError::Protocol(format!(
            "reserved flag bits in {flags:#04x}"
        )));
    }
    let command = flags & FLAG_COMMAND != 0;
    let more = flags & FLAG_MORE != 0;
    if command && more {
        return Err(ZmtpError::Protocol("a command frame with MORE".into()));
    }
    let len = if flags & FLAG_LONG != 0 {
        r.read_u64().await?
    } else {
        u64::from(r.read_u8().await?)
    };
    if len > limit {
        return Err(ZmtpError::TooLarge {
            what: if command { "command" } else { "frame" },
            len,
            limit,
        });
    }
    // `len <= limit`, which the caller keeps small (a usize on every target).
    let mut body = BytesMut::zeroed(len as usize);
    r.read_exact(&mut body).await?;
    Ok(Frame {
        command,
        more,
        body: body.freeze(),
    })
}

/// What a peer sent next: a whole message (its frames) or a command (name, data).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Incoming {
    Message(Vec<Bytes>),
    Command { name: Bytes, data: Bytes },
}

/// Splits a command body into its name and data.
fn command(body: Bytes) -> Result<(Bytes, Bytes), ZmtpError> {
    let Some(&n) = body.first() else {
        return Err(ZmtpError::Protocol("an empty command".into()));
    };
    let n = usize::from(n);
    if body.len() < 1 + n {
        return Err(ZmtpError::Protocol(
            "a command name longer than its frame".into(),
        ));
    }
    Ok((body.slice(1..1 + n), body.slice(1 + n..)))
}

/// Reads the next message (at most `max_parts` frames of at most `max_frame` bytes) or
/// command (at most `max_frame` bytes). A command between the frames of a message is a
/// protocol error.
pub(crate) async fn read_incoming<R: AsyncRead + Unpin>(
    r: &mut R,
    max_frame: u64,
    max_parts: usize,
) -> Result<Incoming, ZmtpError> {
    let mut parts = Vec::new();
    loop {
        let f = read_frame(r, max_frame).await?;
        if f.command {
            if !parts.is_empty() {
                return Err(ZmtpError::Protocol(
                    "a command inside a multi-part message".into(),
                ));
            }
            let (name, data) = command(f.body)?;
            return Ok(Incoming::Command { name, data });
        }
        parts.push(f.body);
        if !f.more {
            return Ok(Incoming::Message(parts));
        }
        if parts.len() >= max_parts {
            return Err(ZmtpError::TooLarge {
                what: "multi-part message (frames)",
                len: parts.len() as u64 + 1,
                limit: max_parts as u64,
            });
        }
    }
}

/// One metadata property of a `READY` command: (name, value).
pub(crate) type Property<'a> = (&'a [u8], &'a [u8]);

/// The properties of a `READY` command's data.
pub(crate) fn ready_properties(mut data: &[u8]) -> Result<Vec<Property<'_>>, ZmtpError> {
    let mut props = Vec::new();
    while let Some((&n, rest)) = data.split_first() {
        let n = usize::from(n);
        if rest.len() < n + 4 {
            return Err(ZmtpError::Protocol("a truncated READY property".into()));
        }
        let (name, rest) = rest.split_at(n);
        let (len, rest) = rest.split_at(4);
        let len = u32::from_be_bytes(len.try_into().expect("four bytes")) as usize;
        if rest.len() < len {
            return Err(ZmtpError::Protocol(
                "a READY property value longer than its command".into(),
            ));
        }
        let (value, rest) = rest.split_at(len);
        props.push((name, value));
        data = rest;
    }
    Ok(props)
}

/// Appends the header of a frame of `len` bytes to `out` (short up to 255 bytes).
pub(crate) fn put_frame_header(out: &mut BytesMut, flags: u8, len: usize) {
    if len <= 255 {
        out.put_u8(flags);
        out.put_u8(len as u8);
    } else {
        out.put_u8(flags | FLAG_LONG);
        out.put_u64(len as u64);
    }
}

/// Appends one frame to `out`.
pub(crate) fn put_frame(out: &mut BytesMut, flags: u8, body: &[u8]) {
    put_frame_header(out, flags, body.len());
    out.put_slice(body);
}

/// A whole message on the wire: every frame but the last with `MORE`.
pub(crate) fn encode_message(frames: &[&[u8]]) -> Bytes {
    let mut out = BytesMut::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
    for (i, f) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
        put_frame(&mut out, more, f);
    }
    out.freeze()
}

/// Our `READY` command.
fn ready(ty: SocketType) -> Bytes {
    let mut body = BytesMut::new();
    body.put_u8(5);
    body.put_slice(b"READY");
    body.put_u8(11);
    body.put_slice(b"Socket-Type");
    body.put_u32(ty.name().len() as u32);
    body.put_slice(ty.name());
    let mut out = BytesMut::new();
    put_frame(&mut out, FLAG_COMMAND, &body);
    out.freeze()
}

/// The server's half of the handshake: greetings both ways, then `READY` both ways; the
/// peer's socket type must suit ours. The caller bounds it in time.
pub(crate) async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    ty: SocketType,
    max_frame: u64,
) -> Result<(), ZmtpError> {
    s.write_all(&greeting()).await?;
    let mut g = [0u8; GREETING_LEN];
    s.read_exact(&mut g).await?;
    check_greeting(&g)?;
    s.write_all(&ready(ty)).await?;
    match read_incoming(s, max_frame, 1).await? {
        Incoming::Command { name, data } if name.as_ref() == b"READY" => {
            let props = ready_properties(&data)?;
            match props
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(b"Socket-Type"))
            {
                Some((_, peer)) if ty.accepts(peer) => Ok(()),
                Some((_, peer)) => Err(ZmtpError::Protocol(format!(
                    "a {} socket cannot talk to a {} socket",
                    String::from_utf8_lossy(peer),
                    String::from_utf8_lossy(ty.name())
                ))),
                None => Err(ZmtpError::Protocol("READY without Socket-Type".into())),
            }
        }
        other => Err(ZmtpError::Protocol(format!(
            "expected READY, got {}",
            describe(&other)
        ))),
    }
}

/// A short description of what a peer sent, for logs.
pub(crate) fn describe(i: &Incoming) -> String {
    match i {
        Incoming::Message(p) => format!("a message of {} frames", p.len()),
        Incoming::Command { name, .. } => {
            format!("the command {:?}", String::from_utf8_lossy(name))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn frames_round_trip_and_long_lengths_are_refused_from_the_header() {
        let m = encode_message(&[b"topic", &[7; 300], b""]);
        // Short, long (300 > 255), short: flags 1, 3, 0.
        assert_eq!(&m[..2], &[1, 5]);
        assert_eq!(&m[7..16], &[3, 0, 0, 0, 0, 0, 0, 1, 44]);
        assert_eq!(&m[m.len() - 2..], &[0, 0]);
        let got = block_on(read_incoming(&mut &m[..], 300, 3)).unwrap();
        assert_eq!(
            got,
            Incoming::Message(vec![
                Bytes::from_static(b"topic"),
                Bytes::from(vec![7; 300]),
                Bytes::new()
            ])
        );
        // One byte less of limit: refused from the header.
        let e = block_on(read_incoming(&mut &m[..], 299, 3)).unwrap_err();
        assert!(
            matches!(
                e,
                ZmtpError::TooLarge {
                    len: 300,
                    limit: 299,
                    ..
                }
            ),
            "{e}"
        );
        // The audit's header: 2^62 bytes, nothing allocated, a typed refusal.
        let hostile = [0x06u8, 0x40, 0, 0, 0, 0, 0, 0, 0];
        let e = block_on(read_frame(&mut &hostile[..], 1 << 20)).unwrap_err();
        assert!(
            matches!(e, ZmtpError::TooLarge { what: "command", len, .. } if len == 1 << 62),
            "{e}"
        );
        // Too many parts.
        let e = block_on(read_incoming(&mut &m[..], 300, 2)).unwrap_err();
        assert!(
            matches!(
                e,
                ZmtpError::TooLarge {
                    len: 3,
                    limit: 2,
                    ..
                }
            ),
            "{e}"
        );
        // Reserved bits, MORE on a command, truncated input.
        for bad in [&[0x08u8, 0][..], &[0x05, 0], &[0x00, 4, 1, 2]] {
            assert!(block_on(read_incoming(&mut &bad[..], 300, 3)).is_err());
        }
    }

    #[test]
    fn greetings_and_ready() {
        assert!(check_greeting(&greeting()).is_ok());
        let mut g = greeting();
        g[10] = 2;
        assert!(check_greeting(&g).is_err());
        let mut g = greeting();
        g[12..17].copy_from_slice(b"CURVE");
        assert!(check_greeting(&g).is_err());
        let mut g = greeting();
        g[9] = 0;
        assert!(check_greeting(&g).is_err());
        let r = ready(SocketType::Router);
        let Incoming::Command { name, data } =
            block_on(read_incoming(&mut &r[..], 1024, 1)).unwrap()
        else {
            panic!("a command")
        };
        assert_eq!(name.as_ref(), b"READY");
        assert_eq!(
            ready_properties(&data).unwrap(),
            vec![(&b"Socket-Type"[..], &b"ROUTER"[..])]
        );
        assert!(ready_properties(&[11, b'S', 0, 0]).is_err());
        assert!(SocketType::Pub.accepts(b"SUB") && !SocketType::Pub.accepts(b"DEALER"));
        assert!(SocketType::Router.accepts(b"REQ") && !SocketType::Router.accepts(b"SUB"));
    }

    #[test]
    fn the_handshake_refuses_a_wrong_peer_type() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        block_on(async move {
            let server =
                tokio::spawn(async move { handshake(&mut a, SocketType::Pub, 1024).await });
            b.write_all(&greeting()).await.unwrap();
            let mut g = [0u8; GREETING_LEN];
            b.read_exact(&mut g).await.unwrap();
            b.write_all(&ready(SocketType::Router)).await.unwrap();
            let e = server.await.unwrap().unwrap_err();
            assert!(
                e.to_string()
                    .contains("a ROUTER socket cannot talk to a PUB socket"),
                "{e}"
            );
        });
    }
}
