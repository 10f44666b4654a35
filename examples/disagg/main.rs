//! Prefill / decode disaggregation: a prefill engine and a decode engine, each running
//! the reference DSA model on its own dsa-kv runtime. Each request is prefilled on the
//! first (its first token sampled there); its prompt's full blocks — every layer's MLA
//! rows and indexer keys, in the target cache and the MTP draft cache — are pushed to
//! the second over a KV transport; the second imports them into its reuse tree and
//! decodes the request from there. Every token, every position's output and every
//! draft proposal must equal the unpaged single-engine reference, the bytes of each
//! block must arrive unchanged (host backend: SHA-256 of every page on both sides), and
//! the decode engine must actually reuse the imported blocks.
//!
//! ```text
//! # two processes over NIXL (UCX); the library comes from the nixl-cu13 wheel (README)
//! cargo run --release --features nixl --example disagg -- --transport nixl
//! # two threads of one process, no NIXL needed
//! cargo run --release --example disagg -- --transport local
//! # two processes over NCCL (CUDA backend; libnccl.so on the library path)
//! cargo run --release --features nccl --example disagg -- --transport nccl --backend cuda \
//!     --prefill-gpu 0 --decode-gpu 1
//! # two hosts: on the decode host (its address on the engines' own network: the
//! # metadata socket trusts its first connection), then on the prefill host
//! disagg --transport nixl --role decode --listen DECODE_HOST_IP:7700
//! disagg --transport nixl --role prefill --connect DECODE_HOST_IP:7700
//! ```
//!
//! `--drop index_key` (or `draft`) is the mutation drill: the prefill side leaves those
//! pools out of the transfer, and the run must come out inexact (exit 2).

mod bench;
#[path = "../common/mod.rs"]
mod common;
mod protocol;

use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::Duration;

use bench::BenchReport;
use clap::Parser;
use dsa_kv::transfer::{KvTransport, LocalTransport};
use protocol::{BoxError, RunReport, Setup};

/// Prefill on one engine, decode on another, KV pages moved between them.
#[derive(Parser, Debug, Clone)]
#[command(name = "disagg", args_override_self = true)]
struct Args {
    /// The KV transport: `nixl` (two processes, UCX; feature `nixl`), `nccl` (two
    /// processes, CUDA backend; feature `nccl`) or `local` (two threads of this process).
    #[arg(long, default_value = "local")]
    transport: String,
    /// `both` (this process prefills and starts the decode side), `prefill`, `decode`.
    #[arg(long, default_value = "both")]
    role: String,
    /// Decode role: the address to listen on for the prefill side (loopback by
    /// default; the socket trusts its first connection).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Prefill role: the decode side's address.
    #[arg(long)]
    connect: Option<String>,
    /// Requests.
    #[arg(long, default_value_t = 3)]
    requests: u64,
    /// MTP draft tokens per step (0: no speculation, no draft cache).
    #[arg(long, default_value_t = 2)]
    drafts: u32,
    /// Tokens generated per request (the first on the prefill engine).
    #[arg(long, default_value_t = 12)]
    max_new: u32,
    /// Model layers.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// `host`, `cuda`, or `cuda-ipc` (the CUDA backend with `cuMemAlloc` pools that
    /// CUDA IPC exports: NIXL between processes on one host maps them directly).
    #[arg(long, default_value = "host")]
    backend: String,
    /// GPU of the prefill engine.
    #[arg(long, default_value_t = 0)]
    prefill_gpu: usize,
    /// GPU of the decode engine (the same GPU as the prefill engine when only one is lent).
    #[arg(long, default_value_t = 0)]
    decode_gpu: usize,
    /// Mutation drill: leave out the `index_key` pools (DeepSeek-V4: the compressed
    /// indexer keys), the `draft` cache (DSA) or the `window` pools (DeepSeek-V4: the
    /// tails).
    #[arg(long)]
    drop: Option<String>,
    /// The model: `dsa` (the DSA reference model, DeepSeek-V3.2's cache) or a
    /// DeepSeek-V4 preset, `deepseek-v4-flash` or `deepseek-v4-pro` (the V4 reference
    /// model with its layer structure, tiny widths; host backend; `--layers` does not
    /// apply).
    #[arg(long)]
    model: Option<String>,
    /// Blocks of the system prompt every request shares (request 0 transfers them).
    #[arg(long, default_value_t = 3)]
    system_blocks: u32,
    /// Measure instead: move this many blocks (synthetic KV, DeepSeek-V3.2 page sizes with
    /// `--layers` layers, MTP draft cache) between two engines: of this process (local,
    /// nixl), or of two processes (nccl: one rank per process).
    #[arg(long)]
    bench_blocks: Option<usize>,
    /// With `--bench-blocks`: run the two engines in two processes for every transport
    /// (NCCL always does). Some paths exist only between processes (CUDA IPC).
    #[arg(long)]
    bench_two_processes: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

fn transport(kind: &str, name: &str, gpu: usize) -> Result<Box<dyn KvTransport>, BoxError> {
    match kind {
        "local" => Ok(Box::new(LocalTransport::new(name))),
        #[cfg(feature = "nccl")]
        "nccl" => Ok(Box::new(dsa_kv::transfer::nccl::NcclTransport::new(
            name, gpu,
        )?)),
        #[cfg(not(feature = "nccl"))]
        "nccl" => {
            let _ = gpu;
            Err("this build has no NCCL transport: build with `--features nccl`".into())
        }
        #[cfg(feature = "nixl")]
        "nixl" => Ok(Box::new(dsa_kv::transfer::nixl::NixlTransport::new(name)?)),
        #[cfg(not(feature = "nixl"))]
        "nixl" => Err("this build has no NIXL transport: build with `--features nixl`".into()),
        other => Err(format!("unknown transport {other:?}: use nixl, nccl or local").into()),
    }
}

fn setup(a: &Args) -> Setup {
    Setup {
        requests: a.requests,
        drafts: a.drafts,
        max_new: a.max_new.max(2),
        layers: a.layers,
        backend: a.backend.clone(),
        drop: a.drop.clone(),
        system_blocks: a.system_blocks,
        bench_blocks: a.bench_blocks,
        model: a.model.clone(),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, BoxError> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// The decode role: listens, serves one prefill side, returns.
fn decode(a: &Args, listener: TcpListener) -> Result<(), BoxError> {
    let (stream, _) = listener.accept()?;
    let t = transport(&a.transport, "decode", a.decode_gpu)?;
    // The setup (model, drafts, backend) comes from the prefill side.
    runtime()?.block_on(protocol::decode_side(a.decode_gpu, t, stream))
}

/// What the prefill role did: a run, or a measurement.
enum Outcome {
    Run(RunReport),
    Bench(BenchReport),
}

fn prefill(a: &Args, addr: &str) -> Result<Outcome, BoxError> {
    let stream = connect(addr)?;
    let t = transport(&a.transport, "prefill", a.prefill_gpu)?;
    let s = setup(a);
    if s.bench_blocks.is_some() {
        return Ok(Outcome::Bench(runtime()?.block_on(
            protocol::bench_prefill_side(&s, a.prefill_gpu, t, stream),
        )?));
    }
    let model = protocol::family(&s)?;
    let quiet = a.json;
    runtime()?
        .block_on(protocol::prefill_side(
            model,
            &s,
            a.prefill_gpu,
            t,
            stream,
            move |line| {
                if !quiet {
                    eprintln!("{line}");
                }
            },
        ))
        .map(Outcome::Run)
}

fn connect(addr: &str) -> Result<TcpStream, BoxError> {
    let mut last = None;
    for _ in 0..100 {
        match TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!("cannot reach the decode side at {addr}: {last:?}").into())
}

fn run(a: &Args) -> Result<Option<Outcome>, BoxError> {
    match a.role.as_str() {
        "decode" => {
            let l = TcpListener::bind(&a.listen)?;
            if l.local_addr()?.ip().is_unspecified() {
                eprintln!(
                    "warning: the metadata socket listens on every interface ({}); it trusts \
                     the first connection, so bind the address of the engines' own network",
                    a.listen
                );
            }
            // The parent (or the operator) reads the address from this line.
            println!("listening {}", l.local_addr()?);
            decode(a, l)?;
            Ok(None)
        }
        "prefill" => {
            let addr = a
                .connect
                .as_deref()
                .ok_or("the prefill role needs --connect DECODE_ADDR")?;
            Ok(Some(prefill(a, addr)?))
        }
        // Two threads: the local transport reaches only this process.
        "both" if a.transport == "local" => {
            Ok(Some(Outcome::Run(protocol::run_in_process(&setup(a))?)))
        }
        "both" => {
            // Two processes: this one prefills, a child decodes.
            use std::io::BufRead;
            let exe = std::env::current_exe()?;
            let mut cmd = std::process::Command::new(exe);
            cmd.args(std::env::args().skip(1))
                .args(["--role", "decode", "--listen", "127.0.0.1:0"])
                .stdout(std::process::Stdio::piped());
            if a.transport == "nccl" && a.prefill_gpu == a.decode_gpu {
                // NCCL refuses two ranks on one GPU of one host: the child gets a host
                // id of its own (derived from ours when one is set), and NCCL moves the
                // bytes over its socket transport (slow; see `dsa_kv::transfer::nccl`).
                let ours = std::env::var("NCCL_HOSTID").unwrap_or_else(|_| "dsa-kv-disagg".into());
                cmd.env("NCCL_HOSTID", format!("{ours}-decode"));
            }
            let mut child = cmd.spawn()?;
            let out = child.stdout.take().ok_or("no child stdout")?;
            let mut out = std::io::BufReader::new(out);
            let mut line = String::new();
            out.read_line(&mut line)?;
            // The child's later output (NCCL prints its version there) goes to our
            // stderr: a closed pipe would kill it with SIGPIPE.
            std::thread::spawn(move || {
                for l in out.lines().map_while(Result::ok) {
                    eprintln!("[decode] {l}");
                }
            });
            let addr = line
                .trim()
                .strip_prefix("listening ")
                .ok_or_else(|| format!("the decode process said {line:?}"))?
                .to_string();
            let report = prefill(a, &addr);
            let status = child.wait()?;
            let report = report?;
            if !status.success() {
                return Err(format!("the decode process failed ({status})").into());
            }
            Ok(Some(report))
        }
        other => Err(format!("unknown role {other:?}: use both, prefill or decode").into()),
    }
}

fn bench(a: &Args, blocks: usize) -> Result<(), BoxError> {
    let r = if a.transport == "nccl" || (a.bench_two_processes && a.transport != "local") {
        // One rank per process: the decode side is a child, as in a run.
        match run(a)? {
            Some(Outcome::Bench(r)) => r,
            _ => return Ok(()), // the decode role
        }
    } else {
        bench_in_process(a, blocks)?
    };
    print_bench(a, &r);
    if r.digests_match == Some(false) {
        Err("the transferred bytes differ".into())
    } else {
        Ok(())
    }
}

fn bench_in_process(a: &Args, blocks: usize) -> Result<BenchReport, BoxError> {
    let ta = transport(&a.transport, "bench-a", a.prefill_gpu)?;
    let tb = transport(&a.transport, "bench-b", a.decode_gpu)?;
    runtime()?.block_on(bench::bench(
        a.layers,
        blocks,
        &a.backend,
        (a.prefill_gpu, a.decode_gpu),
        1,
        ta,
        tb,
    ))
}

fn print_bench(a: &Args, r: &BenchReport) {
    if a.json {
        println!(
            "{}",
            serde_json::to_string(r).expect("the report serializes")
        );
    } else {
        println!(
            "{} blocks x {} layers over {} ({} backend): {} pages, {} bytes in {} descriptors ({} uncoalesced), {:.4} s, {:.3} GB/s (host memcpy {:.1} GB/s{}), bytes compared: {}, decode reuses {} tokens",
            r.blocks, r.layers, r.transport, a.backend, r.pages, r.bytes, r.descriptors, r.uncoalesced,
            r.seconds, r.gb_per_s, r.memcpy_gb_per_s,
            r.dtod_gb_per_s.map_or(String::new(), |g| format!(", GPU device-to-device {g:.1} GB/s")),
            r.digests_match.map_or("not compared (device memory)".to_string(), |m| format!("equal {m}")),
            r.decode_reuse_tokens
        );
    }
}

fn main() -> ExitCode {
    common::quiet_on_closed_stdout();
    let a = Args::parse();
    if let Some(n) = a.bench_blocks {
        return match bench(&a, n) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match run(&a) {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(Outcome::Bench(r))) => {
            print_bench(&a, &r);
            ExitCode::SUCCESS
        }
        Ok(Some(Outcome::Run(r))) => {
            if a.json {
                println!("{}", serde_json::to_string(&r).expect("report serializes"));
            } else {
                for q in &r.requests {
                    println!(
                        "request {}: {} blocks exported, {} skipped, {} pages in {} descriptors ({} uncoalesced), {} bytes, {:.3} GB/s (host memcpy {:.1} GB/s), reused {} tokens on decode, exact {}",
                        q.id,
                        q.exported_blocks,
                        q.transfer.skipped,
                        q.transfer.pages,
                        q.transfer.write.descriptors,
                        q.transfer.uncoalesced,
                        q.transfer.write.bytes,
                        q.gb_per_s,
                        q.memcpy_gb_per_s,
                        q.decode_reused_tokens,
                        q.exact
                    );
                }
                println!(
                    "{} over {} ({} backend): exact {}",
                    r.requests.len(),
                    r.transport,
                    r.backend,
                    r.exact
                );
            }
            if r.exact {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
