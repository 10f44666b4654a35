//! The synthetic writer: a [`Forward`] that writes every new token's KV from a
//! [`KvSource`] (by default [`SyntheticKv`](crate::SyntheticKv), which derives
//! it from the request's whole prefix) through the batch's slot mappings, and reads
//! nothing. `serve`, the drills and the tests run it; verification knows what it wrote.
//! It uses only the public batch view and the host reference ops over
//! [`HostMemory`](crate::HostMemory). A backend of other memory supplies its own
//! synthetic writer (the CUDA backend's runs our kernels on the batch's stream); a
//! backend builds its synthetic writer when [`DeviceSetup::forward`](crate::DeviceSetup)
//! is `None`.

use std::sync::Arc;

use half::bf16;

use crate::backend::quantize_key;
use crate::forward::{
    Batch, Forward, ForwardError, ForwardFactory, ForwardSetup, Proposals, Sampling,
};
use crate::{KvPosition, KvSource, MemKind};
use dsa_kv_core::config::{DsaModel, KvDtype};
use dsa_kv_core::core::scheduler::PlannedRequest;
use dsa_kv_core::ops::indexer_k::{indexer_k_scatter, IndexerMappings};
use dsa_kv_core::ops::mla::{
    mla_scatter_bf16, mla_scatter_fp8, mla_scatter_fp8_ds_mla, mla_scatter_nvfp4, RowView,
};
use dsa_kv_core::ops::quant::ScaleFormat;

/// Writes synthetic KV for every new token. See the module docs.
pub struct SyntheticWriter {
    model: DsaModel,
    source: Arc<dyn KvSource>,
}

impl SyntheticWriter {
    /// A factory that gives every device a writer of `source`'s KV.
    pub fn factory(source: Arc<dyn KvSource>) -> ForwardFactory {
        Arc::new(move |setup: &ForwardSetup<'_>| {
            Ok(Box::new(SyntheticWriter::new(setup, source.clone())?) as Box<dyn Forward>)
        })
    }

    /// The writer of one host device.
    pub fn new(setup: &ForwardSetup<'_>, source: Arc<dyn KvSource>) -> Result<Self, ForwardError> {
        if setup.memory != MemKind::Host {
            return Err(ForwardError::Unsupported {
                what: format!(
                    "this synthetic writer writes host memory, not {:?}: use the backend's own",
                    setup.memory
                ),
            });
        }
        Ok(SyntheticWriter {
            model: setup.model.clone(),
            source,
        })
    }
}

/// The synthetic writer writes KV and samples nothing: the engine samples and commits.
impl Forward for SyntheticWriter {
    fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        write_host(&self.model, &*self.source, batch)?;
        Ok(Sampling::ByEngine)
    }

    fn draft_forward(&mut self, batch: &mut Batch<'_>) -> Result<Proposals, ForwardError> {
        write_host(&self.model, &*self.source, batch)?;
        Ok(Proposals::new())
    }
}

/// Every new token of the batch, in metadata order, with its prefix hash chained onto
/// the request's (so the draft forward, writing the same tokens, writes the same values).
pub fn new_tokens(requests: &[PlannedRequest]) -> Vec<KvPosition> {
    let mut out = Vec::with_capacity(requests.iter().map(|r| r.tokens.len()).sum());
    for r in requests {
        let mut prefix = r.prefix;
        for (pos, &token) in (r.num_cached..).zip(&r.tokens) {
            prefix = prefix.then(token);
            out.push(KvPosition { token, pos, prefix });
        }
    }
    out
}

/// The host reference: layer by layer, the indexer keys then the MLA rows, each op
/// checking all its mappings before it writes (so a failing op writes nothing and the
/// layers before it stay written).
fn write_host(
    model: &DsaModel,
    source: &dyn KvSource,
    batch: &mut Batch<'_>,
) -> Result<(), ForwardError> {
    let (cache, requests, meta) = (batch.cache, batch.requests, batch.host_metadata());
    let toks = new_tokens(requests);
    let n = toks.len();
    if n != meta.counts().num_tokens {
        return Err(ForwardError::Memory {
            what: format!(
                "the batch has {n} new tokens but its metadata maps {}",
                meta.counts().num_tokens
            ),
        });
    }
    let vm = &meta.slot_mapping_value()[..n];
    let sm = &meta.slot_mapping_scale()[..n];
    let mla = &meta.mla_slot_mapping()[..n];
    let spec = model.spec();
    let host = batch.host().ok_or_else(|| ForwardError::Unsupported {
        what: "host write on a device batch".into(),
    })?;
    let mut key = vec![bf16::ZERO; spec.index_head_dim as usize];
    let mut row = vec![bf16::ZERO; model.mla_row_elems() as usize];
    for l in &cache.layers {
        if let Some(ix) = l.indexer {
            let width = ix.value_bytes as usize;
            let mut vals = vec![0u8; n * width];
            let mut scales = vec![0u8; n * 4];
            for (i, &at) in toks.iter().enumerate() {
                source.indexer_key(at, l.layer, &mut key);
                quantize_key(
                    ix.dtype,
                    &key,
                    &mut vals[i * width..(i + 1) * width],
                    &mut scales[i * 4..i * 4 + 4],
                );
            }
            let view = host.bytes_mut(ix.base, ix.pool.addr + ix.pool.bytes - ix.base)?;
            indexer_k_scatter(
                view,
                &vals,
                &scales,
                IndexerMappings {
                    value: vm,
                    scale: sm,
                },
                width,
            )?;
        }
        if let Some(m) = l.mla {
            let mut rows = Vec::with_capacity(n * row.len());
            for &at in &toks {
                source.mla_row(at, l.layer, &mut row);
                rows.extend_from_slice(&row);
            }
            let rv = row_view(&m.rows);
            let pool = (m.rows.pool.addr, m.rows.pool.bytes);
            match m.encoding {
                KvDtype::Bf16 => mla_scatter_bf16(host.pool_mut(m.rows.pool)?, &rv, &rows, mla)?,
                KvDtype::Fp8 => mla_scatter_fp8(
                    host.pool_mut(m.rows.pool)?,
                    &rv,
                    &rows,
                    mla,
                    m.fp8_tensor_scale,
                )?,
                KvDtype::Fp8DsMla => mla_scatter_fp8_ds_mla(
                    host.pool_mut(m.rows.pool)?,
                    &rv,
                    &rows,
                    mla,
                    ScaleFormat::Ue8m0,
                )?,
                KvDtype::Nvfp4 => {
                    let s = m.block_scales.ok_or_else(|| ForwardError::Unsupported {
                        what: format!("NVFP4 layer {} has no block-scale buffer", l.layer.get()),
                    })?;
                    let (data, scales) = host.two_mut(pool, (s.pool.addr, s.pool.bytes))?;
                    mla_scatter_nvfp4(data, &rv, scales, &row_view(&s), &rows, mla)?;
                }
            }
        }
    }
    Ok(())
}

/// The host ops' view of rows: offsets counted from the pool's first byte.
pub fn row_view(r: &crate::RowsView) -> RowView {
    RowView {
        base: r.base - r.pool.addr,
        block_stride: r.page_stride,
        tokens_per_block: r.tokens_per_page,
        row_bytes: r.row_bytes,
    }
}
