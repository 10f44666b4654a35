//! What a NIXL transfer between two processes on one GPU reaches when the memory is a
//! plain `cuMemAlloc` allocation (legacy CUDA IPC-capable) instead of our VMM pools:
//! UCX then picks `cuda_ipc` (zero-copy) instead of staging through TCP. The probe
//! behind the "GPU fast path" note in BENCHMARKS.md: it moves `--mib` MiB three times
//! (the first sets the connection up) and prints each write's GB/s.
//!
//! ```text
//! # the NIXL runtime with UCX's CUDA modules: NIXL_HOME=.gpu/nixl .ci/nixl_setup.sh --cuda
//! UCX_PROTO_INFO=y cargo run --release --features nixl --example nixl_ipc_probe
//! ```

use dsa_kv::cuda::cudarc;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use clap::Parser;
use dsa_kv::transfer::nixl::NixlTransport;
use dsa_kv::transfer::{KvTransport, MemKind, MemRegion, Segment, WriteBatch};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Two processes, one cuMemAlloc buffer each, three NIXL writes.
#[derive(Parser, Debug)]
struct Args {
    /// MiB per write.
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// GPU of both processes.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Internal: run as the receiving child, connecting to this address.
    #[arg(long, hide = true)]
    child_of: Option<String>,
}

fn send(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    s.write_all(&(b.len() as u64).to_le_bytes())?;
    s.write_all(b)
}

fn recv(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut n = [0u8; 8];
    s.read_exact(&mut n)?;
    let mut b = vec![0u8; u64::from_le_bytes(n).min(1 << 24) as usize];
    s.read_exact(&mut b)?;
    Ok(b)
}

/// A `cuMemAlloc` buffer, freed on drop.
struct Buffer {
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    ptr: u64,
}

impl Buffer {
    fn new(gpu: usize, bytes: usize) -> Result<Buffer, BoxError> {
        let ctx = cudarc::driver::CudaContext::new(gpu)?;
        ctx.bind_to_thread()?;
        // SAFETY: the context is current; freed in Drop.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }?;
        Ok(Buffer { ctx, ptr })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `new`; the transport that registered it is gone.
            let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
        }
    }
}

fn main() -> Result<(), BoxError> {
    let a = Args::parse();
    let bytes = a.mib << 20;
    let buf = Buffer::new(a.gpu, bytes)?;
    let region = MemRegion {
        addr: buf.ptr,
        len: bytes as u64,
        mem: MemKind::Device {
            ordinal: a.gpu as u32,
        },
    };
    let mut t = NixlTransport::new(if a.child_of.is_some() {
        "probe-b"
    } else {
        "probe-a"
    })?;
    // SAFETY: `buf` outlives the transport (dropped at the end of main, after `t`, which
    // is declared later); only the peer's probe writes land in it.
    unsafe { t.register(&[region])? };
    if let Some(addr) = a.child_of {
        let mut s = TcpStream::connect(addr)?;
        send(&mut s, &t.local_metadata()?)?;
        send(&mut s, &buf.ptr.to_le_bytes())?;
        let md = recv(&mut s)?;
        // SAFETY: the parent's own metadata.
        unsafe { t.connect(&md)? };
        let until = Instant::now() + Duration::from_secs(60);
        while !t.take_notifications()?.iter().any(|(_, m)| m == b"done") {
            if Instant::now() > until {
                return Err("no notification within 60 s".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        send(&mut s, b"ok")?;
        return Ok(());
    }
    let l = TcpListener::bind("127.0.0.1:0")?;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["--mib", &a.mib.to_string(), "--gpu", &a.gpu.to_string()])
        .args(["--child-of", &l.local_addr()?.to_string()])
        .spawn()?;
    let (mut s, _) = l.accept()?;
    let md = recv(&mut s)?;
    let dst: [u8; 8] = recv(&mut s)?
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or("bad address frame")?;
    send(&mut s, &t.local_metadata()?)?;
    // SAFETY: the child's own metadata; its buffer lives until it answered.
    let peer = unsafe { t.connect(&md)? };
    for i in 0..3 {
        let b = WriteBatch {
            src_mem: region.mem,
            dst_mem: region.mem,
            segments: vec![Segment {
                src: buf.ptr,
                dst: u64::from_le_bytes(dst),
                len: bytes as u64,
            }],
        };
        let note: &[u8] = if i == 2 { b"done" } else { b"warm" };
        let r = t.write(&peer, &[b], note)?;
        println!(
            "write {i}: {} bytes in {:?}: {:.1} GB/s",
            r.bytes,
            r.elapsed,
            r.gb_per_s()
        );
    }
    recv(&mut s)?;
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("the child failed ({status})").into());
    }
    Ok(())
}
