//! The synthetic writer on a GPU: the BF16 KV of each layer is uploaded and quantized and
//! scattered by our kernels on the batch's stream, through the device metadata the
//! backend uploaded (the addresses of the batch view). Every op is first checked on the
//! host against the same mappings (the host copies of the batch), so an out-of-range
//! mapping refuses the step with the host reference's error before the op is enqueued;
//! the guard kernels keep the device-side check, read after a synchronize.

use std::sync::Arc;

use half::bf16;

use crate::guard::{guard_error, host_check, GuardMaps, GuardedOp};
use crate::kernels::{DevRows, Guard, GuardFailure, MlaEncoding};
use crate::{CudaError, DeviceBuffer, Gpu};
use dsa_kv_core::config::{DsaModel, IndexerDtype};
use dsa_kv_device::forward::{Batch, ForwardError, ForwardSetup, Proposals, Sampling};
use dsa_kv_device::synthetic::{new_tokens, row_view};
use dsa_kv_device::{Forward, KvSource};

/// The CUDA backend's synthetic writer: what
/// [`SyntheticWriter`](dsa_kv_device::synthetic::SyntheticWriter) writes on the host,
/// written by our kernels on the batch's stream. [`CudaDevice`](crate::CudaDevice) builds
/// it when its setup names no forward.
pub struct CudaSyntheticWriter {
    model: DsaModel,
    source: Arc<dyn KvSource>,
    writer: CudaWriter,
}

impl CudaSyntheticWriter {
    /// The writer of one CUDA device (`setup` from the CUDA backend: its extension is
    /// the device's `Gpu`).
    pub fn new(setup: &ForwardSetup<'_>, source: Arc<dyn KvSource>) -> Result<Self, ForwardError> {
        Ok(CudaSyntheticWriter {
            model: setup.model.clone(),
            source,
            writer: CudaWriter::new(setup)?,
        })
    }
}

/// Writes KV and samples nothing: the engine samples and commits.
impl Forward for CudaSyntheticWriter {
    fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        self.writer.write(&self.model, &*self.source, batch)?;
        Ok(Sampling::ByEngine)
    }

    fn draft_forward(&mut self, batch: &mut Batch<'_>) -> Result<Proposals, ForwardError> {
        self.writer.write(&self.model, &*self.source, batch)?;
        Ok(Proposals::new())
    }

    fn after_synchronize(&mut self) -> Result<(), ForwardError> {
        self.writer.check_guard()
    }
}

/// Scratch sized for the largest step, allocated once.
struct CudaWriter {
    gpu: Arc<Gpu>,
    input: DeviceBuffer,
    values: DeviceBuffer,
    scales: DeviceBuffer,
    /// Fail flag of the guard kernels (all ones: nothing failed); read and reset by
    /// [`CudaWriter::check_guard`].
    fail: DeviceBuffer,
    host_in: Vec<bf16>,
    max_tokens: usize,
}

fn cuda(e: CudaError) -> ForwardError {
    ForwardError::framework(e)
}

impl CudaWriter {
    fn new(setup: &ForwardSetup<'_>) -> Result<Self, ForwardError> {
        let gpu = setup
            .extension::<Arc<Gpu>>()
            .ok_or_else(|| ForwardError::Unsupported {
                what: "the synthetic writer's CUDA path needs the CUDA backend's Gpu".into(),
            })?
            .clone();
        let elems = setup.model.mla_row_elems() as usize;
        let key = setup.model.spec().index_head_dim as usize;
        let n = setup.max_num_tokens.max(1);
        let buf = |bytes, what| DeviceBuffer::zeroed(&gpu, bytes, what).map_err(cuda);
        let input = buf(n * elems.max(key) * 2, "KV input")?;
        let values = buf(n * 128, "quantized keys")?;
        let scales = buf(n * 4, "key scales")?;
        let fail = DeviceBuffer::from_slice(&gpu, &[u64::MAX], "fail flag").map_err(cuda)?;
        Ok(CudaWriter {
            gpu,
            input,
            values,
            scales,
            fail,
            host_in: Vec::new(),
            max_tokens: n,
        })
    }

    /// Enqueues the writes of the batch's new tokens, layer by layer (indexer keys, then
    /// MLA rows), like the host reference.
    fn write(
        &mut self,
        model: &DsaModel,
        source: &dyn KvSource,
        batch: &mut Batch<'_>,
    ) -> Result<(), ForwardError> {
        let toks = new_tokens(batch.requests);
        let n = toks.len();
        let meta = batch.host_metadata();
        if n != meta.counts().num_tokens || n > self.max_tokens {
            return Err(ForwardError::Memory {
                what: format!(
                    "the batch has {n} new tokens; its metadata maps {} (at most {})",
                    meta.counts().num_tokens,
                    self.max_tokens
                ),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let stream = batch
            .cuda_stream()
            .ok_or_else(|| ForwardError::Unsupported {
                what: "a CUDA write needs the batch's stream".into(),
            })?;
        let gpu = &*self.gpu;
        let dev = gpu.ordinal();
        let k = gpu.kernels();
        let maps = GuardMaps {
            value: &meta.slot_mapping_value()[..n],
            scale: &meta.slot_mapping_scale()[..n],
            rows: &meta.mla_slot_mapping()[..n],
        };
        let md = &batch.metadata;
        let (vmap, smap, mla) = (
            md.slot_mapping_value.addr,
            md.slot_mapping_scale.addr,
            md.mla_slot_mapping.addr,
        );
        let spec = model.spec();
        let row_elems = model.mla_row_elems() as usize;
        let key_elems = spec.index_head_dim as usize;
        let mut one = vec![bf16::ZERO; row_elems.max(key_elems)];
        let flag = self.fail.ptr();
        let mut op_index = 0u32;
        // Refuses `op` (nothing of it enqueued) when a mapping is out of range.
        let mut admit = |op: GuardedOp| -> Result<Guard, ForwardError> {
            let index = op_index;
            op_index += 1;
            match host_check(&op, index, maps) {
                None => Ok(Guard { flag, op: index }),
                Some(f) => Err(
                    match guard_error(&[op], GuardFailure { op: 0, ..f }, maps) {
                        Ok(e) => ForwardError::Op(e),
                        Err(what) => cuda(CudaError::Invalid { device: dev, what }),
                    },
                ),
            }
        };
        for l in &batch.cache.layers {
            if let Some(ix) = l.indexer {
                let cache_len = ix.pool.addr + ix.pool.bytes - ix.base;
                let width = ix.value_bytes as usize;
                let g = admit(GuardedOp::Indexer {
                    cache_len,
                    width: width as u64,
                })?;
                self.host_in.clear();
                for &at in &toks {
                    source.indexer_key(at, l.layer, &mut one[..key_elems]);
                    self.host_in.extend_from_slice(&one[..key_elems]);
                }
                gpu.upload(&self.input, &self.host_in).map_err(cuda)?;
                let fp4 = ix.dtype == IndexerDtype::Fp4;
                let (values, scales) = (self.values.ptr(), self.scales.ptr());
                // SAFETY: the scratch buffers hold `max_tokens ≥ n` keys, payloads and
                // scales; the cache view is this layer's pages to the end of its pool;
                // every mapping was checked against it above.
                unsafe {
                    k.quantize_indexer(stream, dev, self.input.ptr(), values, scales, n, fp4, true)
                        .map_err(cuda)?;
                    k.indexer_k_scatter(
                        stream,
                        dev,
                        ix.base,
                        cache_len,
                        values,
                        scales,
                        vmap,
                        smap,
                        n,
                        width,
                        Some(g),
                    )
                    .map_err(cuda)?;
                }
            }
            if let Some(m) = l.mla {
                let enc = MlaEncoding::of(&m).map_err(|what| ForwardError::Unsupported {
                    what: format!("layer {}: {what}", l.layer.get()),
                })?;
                let g = admit(GuardedOp::Mla {
                    view: row_view(&m.rows),
                    cache_len: m.rows.pool.bytes,
                    scales: m.block_scales.map(|s| (row_view(&s), s.pool.bytes)),
                })?;
                self.host_in.clear();
                for &at in &toks {
                    source.mla_row(at, l.layer, &mut one[..row_elems]);
                    self.host_in.extend_from_slice(&one[..row_elems]);
                }
                gpu.upload(&self.input, &self.host_in).map_err(cuda)?;
                // SAFETY: `input` holds n rows; the views are this cache's pools; every
                // mapping was checked against them above.
                unsafe {
                    k.mla_scatter(
                        stream,
                        dev,
                        DevRows::of(&m.rows),
                        enc,
                        self.input.ptr(),
                        mla,
                        n,
                        Some(g),
                    )
                    .map_err(cuda)?
                };
            }
        }
        Ok(())
    }

    /// After a synchronize: a set flag means a guard kernel refused an op the host check
    /// admitted (the device and host mappings disagree). Resets the flag.
    fn check_guard(&mut self) -> Result<(), ForwardError> {
        let mut got = [0u64];
        self.gpu.download(&self.fail, &mut got).map_err(cuda)?;
        let Some(f) = GuardFailure::decode(got[0]) else {
            return Ok(());
        };
        self.gpu.upload(&self.fail, &[u64::MAX]).map_err(cuda)?;
        Err(cuda(CudaError::Invalid {
            device: self.gpu.ordinal(),
            what: format!(
                "a guard kernel refused op {} at token {} although the host check of the same \
                 mappings passed: the device metadata differs from the host's",
                f.op, f.token
            ),
        }))
    }
}
