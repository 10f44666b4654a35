//! `--bench-blocks`: one timed transfer of N full blocks of synthetic KV (DeepSeek-V3.2
//! page sizes) between two engines, against the ceilings of the same bytes (a host
//! `memcpy`, and a device-to-device copy on a GPU), measured in the same run.

use std::collections::HashMap;
use std::time::Instant;

use dsa_kv::actors::{KvCacheBuilder, KvCacheHandle};
use dsa_kv::config::{EngineConfig, SpecMode};
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::transfer::session::{HandOver, ImportOutcome, SessionOptions, TransferSession, Wire};
use dsa_kv::transfer::{ExportedBlocks, KvTransport, TransferReport};
use serde::Serialize;

use crate::protocol::{BoxError, SCOPE};

/// What a measurement found: one transfer of `blocks` full blocks between two engines
/// (synthetic KV, the model's real page sizes).
#[derive(Clone, Debug, Serialize)]
pub(crate) struct BenchReport {
    pub transport: String,
    pub layers: usize,
    pub blocks: usize,
    pub pages: u64,
    pub bytes: u64,
    pub descriptors: usize,
    pub uncoalesced: usize,
    pub seconds: f64,
    pub gb_per_s: f64,
    /// The same bytes copied by one `memcpy` in this process.
    pub memcpy_gb_per_s: f64,
    /// The same bytes copied device to device on the prefill GPU (cuda backend).
    pub dtod_gb_per_s: Option<f64>,
    /// Every page's SHA-256 equal on both engines (host backend: the session's digests,
    /// checked before the commit; `None`: not compared, device memory).
    pub digests_match: Option<bool>,
    pub decode_reuse_tokens: u64,
}

impl BenchReport {
    /// The report of one timed transfer of `blocks` blocks: the transport's numbers,
    /// and the host memcpy and (CUDA backends) device-to-device ceilings of the same
    /// bytes, measured now on `(backend, gpu)`.
    pub(crate) fn measured(
        transport: &str,
        layers: usize,
        blocks: usize,
        report: &TransferReport,
        (backend, gpu): (&str, usize),
        digests_match: Option<bool>,
        decode_reuse_tokens: u64,
    ) -> Result<BenchReport, BoxError> {
        let w = &report.write;
        Ok(BenchReport {
            transport: transport.to_string(),
            layers,
            blocks,
            pages: report.pages,
            bytes: w.bytes,
            descriptors: w.descriptors,
            uncoalesced: report.uncoalesced,
            seconds: w.elapsed.as_secs_f64(),
            gb_per_s: w.gb_per_s(),
            memcpy_gb_per_s: memcpy_gb_per_s(w.bytes),
            dtod_gb_per_s: dtod(backend, gpu, w.bytes)?,
            digests_match,
            decode_reuse_tokens,
        })
    }
}

/// Host `memcpy` bandwidth of `bytes` (the ceiling a host transfer can reach), GB/s.
pub(crate) fn memcpy_gb_per_s(bytes: u64) -> f64 {
    let n = bytes.max(1) as usize;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    // Untimed first copy: the destination's pages are faulted in, as the pools' are.
    dst.copy_from_slice(&src);
    let reps = ((256 << 20) / n).max(3);
    let t = Instant::now();
    for _ in 0..reps {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    (n * reps) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// The GPU pool allocation of a backend name: `cuda-ipc` is the CUDA backend with
/// pools a transport between processes maps directly (`GpuPoolAlloc::Ipc`).
#[cfg(feature = "cuda")]
pub(crate) fn pool_alloc(backend: &str) -> dsa_kv::cuda::GpuPoolAlloc {
    if backend == "cuda-ipc" {
        dsa_kv::cuda::GpuPoolAlloc::Ipc
    } else {
        dsa_kv::cuda::GpuPoolAlloc::Vmm
    }
}

/// Device-to-device copy bandwidth of `bytes` on GPU `gpu` (the ceiling of a transfer
/// between two engines on one GPU), GB/s.
#[cfg(feature = "cuda")]
fn dtod_gb_per_s(gpu: usize, bytes: u64) -> Result<f64, BoxError> {
    use dsa_kv::cuda::cudarc::driver::sys;
    let g = dsa_kv::cuda::Gpu::open(gpu)?;
    let n = bytes.max(1) as usize;
    let a = dsa_kv::cuda::DeviceBuffer::zeroed(&g, n, "ceiling source")?;
    let b = dsa_kv::cuda::DeviceBuffer::zeroed(&g, n, "ceiling destination")?;
    g.bind()?;
    let copy = || {
        // SAFETY: both buffers hold `n` bytes and live until the end of this function.
        let r = unsafe { sys::cuMemcpyDtoD_v2(b.ptr(), a.ptr(), n) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemcpyDtoD: {r:?}"));
        }
        g.context().synchronize().map_err(|e| format!("{e:?}"))
    };
    copy()?;
    let reps = 10;
    let t = Instant::now();
    for _ in 0..reps {
        copy()?;
    }
    Ok((n * reps) as f64 / t.elapsed().as_secs_f64() / 1e9)
}

fn dtod(backend: &str, gpu: usize, bytes: u64) -> Result<Option<f64>, BoxError> {
    match backend {
        #[cfg(feature = "cuda")]
        "cuda" | "cuda-ipc" => Ok(Some(dtod_gb_per_s(gpu, bytes)?)),
        _ => {
            let _ = (gpu, bytes);
            Ok(None)
        }
    }
}

/// One step of an engine with synthetic KV: every scheduled request that produces a
/// token gets token 7. Whether requests are still in flight after it.
async fn step_synthetic(kv: &KvCacheHandle) -> Result<bool, BoxError> {
    let report = kv.step(HashMap::new()).await?;
    let outs = report.outcomes_from(|_| TokenId(7));
    if !outs.is_empty() {
        kv.commit(outs).await?;
    }
    Ok(kv.counters().in_flight > 0)
}

/// An engine for a measurement: DeepSeek-V3.2 page sizes with `layers` layers, an MTP
/// draft cache, room for `blocks` blocks and a warm-up block, synthetic KV, on
/// `devices` devices of `backend` (GPU `gpu`).
pub(crate) async fn bench_engine(
    layers: usize,
    blocks: usize,
    backend: &str,
    gpu: usize,
    devices: usize,
) -> Result<KvCacheHandle, BoxError> {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(layers as u32);
    c.spec_decode.mode = SpecMode::Mtp;
    c.spec_decode.draft_tokens = 1;
    c.kv_cache.max_tokens = Some((blocks as u64 + 4) * 64 * 2);
    c.scheduler.max_seq_len = (blocks as u32 + 4) * 64;
    c.scheduler.max_num_tokens = 4096;
    let b = KvCacheBuilder::new().config(c).host_devices(devices);
    let b = match backend {
        #[cfg(feature = "cuda")]
        "cuda" | "cuda-ipc" => b.backend(dsa_kv::cuda::CudaDevice::factory_with(
            vec![gpu; devices],
            pool_alloc(backend),
        )),
        "host" => b,
        other => {
            return Err(format!("unknown or unavailable backend {other:?} (gpu {gpu})").into())
        }
    };
    Ok(b.start().await?)
}

/// Prefills request `id` (`n` full blocks and one token) on `kv` with synthetic KV and
/// exports its blocks. Returns the prompt and the export.
pub(crate) async fn bench_export(
    kv: &KvCacheHandle,
    id: RequestId,
    n: usize,
) -> Result<(Vec<TokenId>, ExportedBlocks), BoxError> {
    let p: Vec<TokenId> = (0..n as u32 * 64 + 1)
        .map(|t| TokenId(id.0 as u32 * 100_000 + t))
        .collect();
    let mut request = SubmitRequest::new(id, p.clone(), 1);
    request.scope = SCOPE;
    kv.submit(request).await?;
    for _ in 0..100_000 {
        if !step_synthetic(kv).await? {
            let export = kv.transfer().export(id, SCOPE, &p[..n * 64]).await?;
            return Ok((p, export));
        }
    }
    Err(format!("request {id} did not finish").into())
}

/// Two engines of this process (`devices` devices each), linked by a transfer session
/// over an in-memory wire: prefills `blocks` blocks on the first, then hands them over
/// to the second through `ta` → `tb`: a 1-block warm-up (connection setup), then the
/// timed transfer.
pub(crate) async fn bench(
    layers: usize,
    blocks: usize,
    backend: &str,
    gpus: (usize, usize),
    devices: usize,
    ta: Box<dyn KvTransport>,
    tb: Box<dyn KvTransport>,
) -> Result<BenchReport, BoxError> {
    let a = bench_engine(layers, blocks, backend, gpus.0, devices).await?;
    let b = bench_engine(layers, blocks, backend, gpus.1, devices).await?;
    let r = moves(&a, &b, (layers, blocks), backend, gpus.0, ta, tb).await;
    a.shutdown().await;
    b.shutdown().await;
    r
}

async fn moves(
    a: &KvCacheHandle,
    b: &KvCacheHandle,
    (layers, blocks): (usize, usize),
    backend: &str,
    gpu: usize,
    ta: Box<dyn KvTransport>,
    tb: Box<dyn KvTransport>,
) -> Result<BenchReport, BoxError> {
    let options = SessionOptions {
        digests: backend == "host",
        ..SessionOptions::default()
    };
    let (wa, wb) = tokio::io::duplex(1 << 20);
    // SAFETY: both engines run until after the sessions are dropped (at the end of this
    // function; the caller shuts them down after it); the wire is in-memory, between
    // our own two sessions.
    let (sa, sb) = tokio::join!(
        unsafe { TransferSession::open(a, ta, Wire::new(wa), options.clone()) },
        unsafe { TransferSession::open(b, tb, Wire::new(wb), options.clone()) },
    );
    let (mut sa, mut sb) = (sa?, sb?);
    let mut out = None;
    for (id, n) in [(1u64, 1usize), (2, blocks)] {
        let id = RequestId(id);
        let (p, export) = bench_export(a, id, n).await?;
        let import = async {
            let offer = sb.next_offer().await?.ok_or("no offer")?;
            // B serves the same prompt under the same scope.
            let ticket = sb
                .begin(id, SCOPE, &p, &offer)
                .await?
                .ok_or("no room on engine B")?;
            Ok::<_, BoxError>(sb.finish(&ticket).await?)
        };
        let (handed, imported) = tokio::join!(sa.hand_over(&export), import);
        let report = match handed? {
            HandOver::Pushed { report, .. } => report,
            other => return Err(format!("the transfer did not happen: {other:?}").into()),
        };
        let imported = imported?;
        if !matches!(imported, ImportOutcome::Committed { .. }) {
            return Err(format!("engine B did not commit the import: {imported:?}").into());
        }
        let reuse = b.probe_reuse(SCOPE, &p).await?;
        if reuse < n as u64 * 64 {
            return Err(
                format!("engine B serves {reuse} of the {} imported tokens", n * 64).into(),
            );
        }
        out = Some(BenchReport::measured(
            sa.transport_name(),
            layers,
            n,
            &report,
            (backend, gpu),
            // Committed with digests on: every page's bytes equal on both sides.
            options.digests.then_some(true),
            reuse,
        )?);
    }
    out.ok_or_else(|| "nothing measured".into())
}
