//! The session's wire: length-prefixed JSON frames (an 8-byte little-endian length, then
//! that many bytes of JSON) on any async byte stream, bounded: a frame longer than the
//! limit is refused from its length alone, and a frame's buffer grows only as its bytes
//! arrive, so a peer that claims a large frame and sends nothing costs nothing.
//!
//! What a frame may cost is bounded too, not only its length: the body is kept in
//! pieces of at most 1 MiB, a string longer than [`MAX_STRING`] refuses the frame as its
//! bytes arrive, and the messages' lists decode into capped shapes
//! ([`dsa_kv_core::bounded`]). So no single allocation while a frame is received and
//! decoded is larger than 4 MiB (the largest list a message may hold, an offer's 1M
//! tokens), and a frame of `n` bytes holds about `n` bytes plus its decoded value.

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest frame a [`Wire`] accepts by default (16 MiB): an offer of a 128K-token
/// prefix (2,048 blocks of a tensor-parallel-8 engine with a draft cache) is well under
/// 2 MiB of JSON.
pub const MAX_FRAME: u64 = 16 << 20;

/// The longest string (raw JSON, escapes included) a received frame may hold: 64 KiB.
/// The protocol's strings are names, fingerprints, digests and error messages.
pub const MAX_STRING: usize = 64 << 10;

/// A received frame's body is kept in pieces of at most this many bytes.
const PIECE: usize = 1 << 20;

/// Bytes read from the stream at a time.
const READ: usize = 16 << 10;

/// Why a frame could not be sent or received.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The peer closed the connection between frames.
    #[error("the peer closed the connection (its own error says why)")]
    Closed,
    /// The peer closed the connection inside a frame.
    #[error("the peer closed the connection inside a frame ({got} of {want} bytes)")]
    Truncated {
        /// Bytes of the frame (or of its 8-byte length) received.
        got: u64,
        /// Bytes announced.
        want: u64,
    },
    /// A frame longer than the limit (nothing of its body was read or allocated; the
    /// wire is out of step after it: close the connection).
    #[error(
        "a frame of {len} bytes is longer than the wire's limit of {max}: the peer does not \
         speak this protocol, or sends more than it should (raise the limit with \
         Wire::with_max_frame only for a peer you trust)"
    )]
    TooLarge {
        /// The announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// No whole frame arrived in time.
    #[error("no frame from the peer within {0:?}")]
    Timeout(Duration),
    /// An earlier receive stopped inside a frame (it timed out or was dropped): the
    /// stream is out of step, and every later receive fails. Close the connection.
    #[error(
        "an earlier receive stopped inside a frame (timed out or cancelled): the connection is \
         out of step; close it and connect again"
    )]
    OutOfStep,
    /// A whole frame that is not the message expected.
    #[error("a frame of {len} bytes does not decode as a {expected}: {why}")]
    Decode {
        /// Its length.
        len: u64,
        /// The message type expected.
        expected: &'static str,
        /// The decoder's message.
        why: String,
    },
    /// A message that cannot be encoded (or whose encoding is over the limit).
    #[error("cannot send the frame: {0}")]
    Encode(String),
    /// The connection failed.
    #[error("the connection failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Length-prefixed JSON frames on `S` (a `tokio::net::TcpStream`, one half of a
/// `tokio::io::duplex`, or any async byte stream). Sending needs `S: AsyncWrite`,
/// receiving `S: AsyncRead`.
#[derive(Debug)]
pub struct Wire<S> {
    stream: S,
    max_frame: u64,
    /// A receive is inside a frame: set while one runs, left set when it is dropped or
    /// times out there.
    mid_frame: bool,
}

impl<S> Wire<S> {
    /// A wire on `stream`, frames up to [`MAX_FRAME`].
    pub fn new(stream: S) -> Wire<S> {
        Wire {
            stream,
            max_frame: MAX_FRAME,
            mid_frame: false,
        }
    }

    /// The same wire with frames up to `max` bytes, both ways.
    pub fn with_max_frame(mut self, max: u64) -> Wire<S> {
        self.max_frame = max;
        self
    }

    /// The frame limit.
    pub fn max_frame(&self) -> u64 {
        self.max_frame
    }

    /// The stream.
    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    /// The stream, e.g. to shut it down.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.stream
    }

    /// The stream back.
    pub fn into_inner(self) -> S {
        self.stream
    }
}

impl<S: AsyncWrite + Unpin> Wire<S> {
    /// Sends `m` as one frame (one write of length and body, then a flush).
    pub async fn send<T: Serialize + ?Sized>(&mut self, m: &T) -> Result<(), WireError> {
        let frame = encode(m, self.max_frame)?;
        self.stream.write_all(&frame).await?;
        self.stream.flush().await?;
        Ok(())
    }
}

impl<S: AsyncRead + Unpin> Wire<S> {
    /// Receives one frame and decodes it as a `T`. Not cancel-safe: a receive dropped
    /// inside a frame leaves the wire [`OutOfStep`](WireError::OutOfStep); use
    /// [`recv_within`](Self::recv_within) for a deadline.
    pub async fn recv<T: DeserializeOwned>(&mut self) -> Result<T, WireError> {
        if self.mid_frame {
            return Err(WireError::OutOfStep);
        }
        self.read_frame::<T>().await
    }

    /// [`recv`](Self::recv) within `within`; after a [`Timeout`](WireError::Timeout)
    /// the wire may be out of step (when the frame had begun to arrive).
    pub async fn recv_within<T: DeserializeOwned>(
        &mut self,
        within: Duration,
    ) -> Result<T, WireError> {
        match tokio::time::timeout(within, self.recv()).await {
            Ok(r) => r,
            Err(_) => Err(WireError::Timeout(within)),
        }
    }

    async fn read_frame<T: DeserializeOwned>(&mut self) -> Result<T, WireError> {
        read_frame(&mut self.stream, self.max_frame, &mut self.mid_frame).await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Wire<S> {
    /// Sends `m` and receives one frame at the same time, within `within` (both sides of
    /// a symmetric exchange can call it: neither waits for the other to read first, so
    /// no frame is too large for the connection's buffers).
    pub async fn exchange<T: Serialize + ?Sized, U: DeserializeOwned>(
        &mut self,
        m: &T,
        within: Duration,
    ) -> Result<U, WireError> {
        if self.mid_frame {
            return Err(WireError::OutOfStep);
        }
        let frame = encode(m, self.max_frame)?;
        let (max, mid) = (self.max_frame, &mut self.mid_frame);
        let (mut r, mut w) = tokio::io::split(&mut self.stream);
        let send = async {
            w.write_all(&frame).await?;
            w.flush().await?;
            Ok::<(), WireError>(())
        };
        let both = async { tokio::join!(send, read_frame::<_, U>(&mut r, max, mid)) };
        match tokio::time::timeout(within, both).await {
            Ok((sent, got)) => {
                sent?;
                got
            }
            Err(_) => Err(WireError::Timeout(within)),
        }
    }
}

/// `m` as one frame: the 8-byte little-endian length, then the JSON.
fn encode<T: Serialize + ?Sized>(m: &T, max_frame: u64) -> Result<Vec<u8>, WireError> {
    let body = serde_json::to_vec(m).map_err(|e| WireError::Encode(e.to_string()))?;
    let len = body.len() as u64;
    if len > max_frame {
        return Err(WireError::Encode(format!(
            "the message is {len} bytes of JSON, over the wire's limit of {max_frame}"
        )));
    }
    let mut frame = Vec::with_capacity(8 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Reads one frame from `stream` (at most `max_frame` bytes of body) and decodes it;
/// `mid_frame` is set from its first byte until it is whole.
async fn read_frame<R: AsyncRead + Unpin, T: DeserializeOwned>(
    stream: &mut R,
    max_frame: u64,
    mid_frame: &mut bool,
) -> Result<T, WireError> {
    let mut head = [0u8; 8];
    let mut got = 0;
    while got < head.len() {
        match stream.read(&mut head[got..]).await? {
            0 if got == 0 => return Err(WireError::Closed),
            0 => {
                return Err(WireError::Truncated {
                    got: got as u64,
                    want: 8,
                })
            }
            n => {
                // From the first byte on, stopping here leaves the stream mid-frame.
                *mid_frame = true;
                got += n;
            }
        }
    }
    let len = u64::from_le_bytes(head);
    if len > max_frame {
        return Err(WireError::TooLarge {
            len,
            max: max_frame,
        });
    }
    let expected = std::any::type_name::<T>()
        .rsplit("::")
        .next()
        .unwrap_or("message");
    // The body in pieces, each grown as its bytes arrive; a string past MAX_STRING
    // refuses the frame, whose remaining bytes are then read and dropped (the wire
    // stays in step).
    let mut pieces: Vec<Vec<u8>> = Vec::new();
    let mut scan = StringScan::default();
    let mut refused: Option<String> = None;
    let mut buf = vec![0u8; READ];
    let mut got = 0u64;
    while got < len {
        let want = (len - got).min(READ as u64) as usize;
        let n = stream.read(&mut buf[..want]).await?;
        if n == 0 {
            return Err(WireError::Truncated { got, want: len });
        }
        got += n as u64;
        let bytes = &buf[..n];
        if refused.is_some() {
            continue;
        }
        if let Err(run) = scan.feed(bytes, MAX_STRING) {
            refused = Some(format!(
                "a string of more than {run} bytes (at most {MAX_STRING}): the protocol's \
                 strings are names, digests and messages"
            ));
            pieces = Vec::new();
            continue;
        }
        let mut rest = bytes;
        while !rest.is_empty() {
            if pieces.last().is_none_or(|p| p.len() == PIECE) {
                pieces.push(Vec::new());
            }
            let piece = pieces.last_mut().expect("pushed above");
            let take = rest.len().min(PIECE - piece.len());
            if piece.len() + take > piece.capacity() {
                // Doubling, never past a piece.
                let grow = piece.capacity().max(take).min(PIECE - piece.len());
                piece.reserve_exact(grow);
            }
            piece.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
        }
    }
    // The frame is whole: the next receive starts at a frame's beginning.
    *mid_frame = false;
    if let Some(why) = refused {
        return Err(WireError::Decode { len, expected, why });
    }
    serde_json::from_reader(Pieces {
        pieces: &pieces,
        at: (0, 0),
    })
    .map_err(|e| WireError::Decode {
        len,
        expected,
        why: e.to_string(),
    })
}

/// Where a frame's JSON is inside a string literal, and how long that literal has run
/// (raw bytes, escapes included: never fewer than the decoded string's).
#[derive(Default)]
struct StringScan {
    in_string: bool,
    escaped: bool,
    run: usize,
}

impl StringScan {
    /// Follows `bytes`; `Err(run)` when a string passes `max` bytes.
    fn feed(&mut self, bytes: &[u8], max: usize) -> Result<(), usize> {
        for &b in bytes {
            if !self.in_string {
                if b == b'"' {
                    self.in_string = true;
                    self.run = 0;
                }
                continue;
            }
            if self.escaped {
                self.escaped = false;
            } else if b == b'\\' {
                self.escaped = true;
            } else if b == b'"' {
                self.in_string = false;
                continue;
            }
            self.run += 1;
            if self.run > max {
                return Err(self.run - 1);
            }
        }
        Ok(())
    }
}

/// The pieces of a frame's body as one reader.
struct Pieces<'a> {
    pieces: &'a [Vec<u8>],
    /// (piece, offset in it).
    at: (usize, usize),
}

impl std::io::Read for Pieces<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let (mut i, mut off) = self.at;
        let mut n = 0;
        while n < out.len() && i < self.pieces.len() {
            let p = &self.pieces[i][off..];
            let k = p.len().min(out.len() - n);
            out[n..n + k].copy_from_slice(&p[..k]);
            n += k;
            off += k;
            if off == self.pieces[i].len() {
                i += 1;
                off = 0;
            }
        }
        self.at = (i, off);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
            .block_on(f)
    }

    fn frame(len: u64, body: &[u8]) -> Vec<u8> {
        let mut f = len.to_le_bytes().to_vec();
        f.extend_from_slice(body);
        f
    }

    #[test]
    fn frames_round_trip_and_end_cleanly() {
        block_on(async {
            let (a, b) = tokio::io::duplex(1024);
            let (mut a, mut b) = (Wire::new(a), Wire::new(b));
            a.send(&vec![1u32, 2, 3]).await.unwrap();
            a.send("two").await.unwrap();
            drop(a);
            assert_eq!(b.recv::<Vec<u32>>().await.unwrap(), vec![1, 2, 3]);
            assert_eq!(b.recv::<String>().await.unwrap(), "two");
            assert!(matches!(b.recv::<String>().await, Err(WireError::Closed)));
        });
    }

    #[test]
    fn bad_frames_are_typed_errors() {
        block_on(async {
            let too_long = frame(MAX_FRAME + 1, b"");
            let e = Wire::new(&too_long[..]).recv::<u32>().await.unwrap_err();
            assert!(
                matches!(e, WireError::TooLarge { len, max } if len == MAX_FRAME + 1 && max == MAX_FRAME),
                "{e}"
            );
            let short = frame(10, b"12");
            let e = Wire::new(&short[..]).recv::<u32>().await.unwrap_err();
            assert!(
                matches!(e, WireError::Truncated { got: 2, want: 10 }),
                "{e}"
            );
            let e = Wire::new(&[1u8, 0, 0][..]).recv::<u32>().await.unwrap_err();
            assert!(matches!(e, WireError::Truncated { got: 3, want: 8 }), "{e}");
            let garbage = frame(3, b"{x}");
            let e = Wire::new(&garbage[..]).recv::<u32>().await.unwrap_err();
            assert!(
                matches!(
                    e,
                    WireError::Decode {
                        len: 3,
                        expected: "u32",
                        ..
                    }
                ),
                "{e}"
            );
            // The limit is the wire's own, both ways.
            let small = frame(5, b"12345");
            let e = Wire::new(&small[..])
                .with_max_frame(4)
                .recv::<u32>()
                .await
                .unwrap_err();
            assert!(matches!(e, WireError::TooLarge { len: 5, max: 4 }), "{e}");
            let mut sink = Wire::new(Vec::new()).with_max_frame(4);
            assert!(matches!(
                sink.send("a long string").await,
                Err(WireError::Encode(_))
            ));
            assert!(sink.get_ref().is_empty(), "nothing was written");
        });
    }

    /// Both ends exchange a frame far larger than the connection buffers at once: each
    /// sends while it receives, so neither blocks.
    #[test]
    fn a_symmetric_exchange_does_not_depend_on_buffer_sizes() {
        block_on(async {
            let (a, b) = tokio::io::duplex(64);
            let (mut a, mut b) = (Wire::new(a), Wire::new(b));
            let big = vec![7u8; 100_000];
            let within = Duration::from_secs(5);
            let (x, y) = tokio::join!(
                a.exchange::<_, Vec<u8>>(&big, within),
                b.exchange::<_, Vec<u8>>(&big, within)
            );
            assert_eq!((x.unwrap().len(), y.unwrap().len()), (100_000, 100_000));
        });
    }

    #[test]
    fn a_receive_stopped_inside_a_frame_leaves_the_wire_out_of_step() {
        block_on(async {
            let (mut a, b) = tokio::io::duplex(1024);
            let mut b = Wire::new(b);
            // Half a frame, then nothing.
            a.write_all(&frame(4, b"12")).await.unwrap();
            let e = b
                .recv_within::<u32>(Duration::from_millis(20))
                .await
                .unwrap_err();
            assert!(matches!(e, WireError::Timeout(_)), "{e}");
            a.write_all(b"34").await.unwrap();
            assert!(matches!(b.recv::<u32>().await, Err(WireError::OutOfStep)));
            // A timeout between frames leaves it in step.
            let (mut c, d) = tokio::io::duplex(1024);
            let mut d = Wire::new(d);
            assert!(d
                .recv_within::<u32>(Duration::from_millis(5))
                .await
                .is_err());
            c.write_all(&frame(2, b"42")).await.unwrap();
            assert_eq!(d.recv::<u32>().await.unwrap(), 42);
        });
    }
}
