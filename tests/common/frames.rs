//! What the two-process transport tests share: length-prefixed frames on the test's
//! own TCP socket, and the byte pattern the writer sends.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;

/// Byte `i` of the writer's pattern (never 0, so a zeroed destination shows what landed).
pub(crate) fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31).wrapping_add(7) % 251) as u8 + 1
}

pub(crate) fn send_frame(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    s.write_all(&(b.len() as u64).to_le_bytes())?;
    s.write_all(b)
}

pub(crate) fn recv_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut n = [0u8; 8];
    s.read_exact(&mut n)?;
    let n = u64::from_le_bytes(n) as usize;
    assert!(n < 1 << 24, "frame of {n} bytes");
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}
