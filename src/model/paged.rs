//! The model as a framework's [`Forward`] on the host backend: it writes every new
//! token's KV through the step's slot mappings and reads the cache back as the DSA
//! kernels do: indexer keys through the indexer page table, MLA rows through global
//! token indices (`block table entry × 64 + offset`) built from the top-k positions.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::{CacheFormat, KvStore, Model, ModelError, TokenOut};
use crate::device::forward::{
    Batch, Forward, ForwardError, ForwardFactory, ForwardSetup, HostMemory, LayerCache,
};
use crate::ids::RequestId;
use crate::ops::quant::ScaleFormat;

/// What every device's forward produced, by request and position.
#[derive(Debug, Default)]
pub struct Outputs {
    /// `(device, request)` → position → output. A position computed again (a request
    /// recomputed after preemption) must give the same output: see `conflicts`.
    pub tokens: HashMap<(usize, RequestId), BTreeMap<u32, TokenOut>>,
    /// `(device, request)` → the greedy token after the request's last new token of the
    /// latest step (the engine's `next_token`).
    pub next: HashMap<(usize, RequestId), u32>,
    /// Positions whose recomputed output differed from the first (must stay empty).
    pub conflicts: Vec<String>,
}

impl Outputs {
    fn record(&mut self, device: usize, id: RequestId, outs: &[TokenOut]) {
        let m = self.tokens.entry((device, id)).or_default();
        for o in outs {
            if let Some(prev) = m.insert(o.pos, *o) {
                if prev != *o {
                    self.conflicts.push(format!(
                        "device {device}, request {id}, position {}: {prev:?} then {o:?}",
                        o.pos
                    ));
                }
            }
        }
        if let Some(o) = outs.last() {
            self.next.insert((device, id), o.greedy);
        }
    }
}

/// The cache format of a target cache view: the rows' encoding and which of the first
/// `layers` layers own an indexer.
pub fn cache_format(setup: &ForwardSetup<'_>, layers: usize) -> Result<CacheFormat, ModelError> {
    let ls = &setup.target.layers;
    if ls.len() < layers {
        return Err(ModelError::Cache(format!(
            "the target cache has {} layers, the model needs {layers}",
            ls.len()
        )));
    }
    let kv_dtype = ls[0]
        .mla
        .map(|m| m.encoding)
        .ok_or_else(|| ModelError::Cache("layer 0 has no MLA cache".into()))?;
    Ok(CacheFormat {
        kv_dtype,
        scale_format: ScaleFormat::Ue8m0,
        indexer: ls[..layers].iter().map(|l| l.indexer.is_some()).collect(),
    })
}

/// The model on one device.
pub struct ModelForward {
    model: Arc<Model>,
    device: usize,
    outputs: Arc<Mutex<Outputs>>,
}

impl ModelForward {
    /// A factory giving every device the model `model` (its cache format must be the
    /// devices' target cache format), recording into `outputs`.
    pub fn factory(model: Arc<Model>, outputs: Arc<Mutex<Outputs>>) -> ForwardFactory {
        Arc::new(move |setup: &ForwardSetup<'_>| {
            let found =
                cache_format(setup, model.config().layers).map_err(ForwardError::framework)?;
            if found != model.format {
                return Err(ForwardError::Unsupported {
                    what: format!(
                        "the model was built for {:?}, the cache is {found:?}",
                        model.format
                    ),
                });
            }
            Ok(Box::new(ModelForward {
                model: model.clone(),
                device: setup.device,
                outputs: outputs.clone(),
            }) as Box<dyn Forward>)
        })
    }
}

impl Forward for ModelForward {
    fn forward(&mut self, batch: &mut Batch<'_>) -> Result<(), ForwardError> {
        let layers = self.model.config().layers;
        let m = batch.metadata;
        let cache: Vec<LayerCache> =
            batch.cache.layers[..layers.min(batch.cache.layers.len())].to_vec();
        let requests = batch.requests;
        let Some(host) = batch.host() else {
            return Err(ForwardError::Unsupported {
                what: "the reference model runs on the host backend only (for now)".into(),
            });
        };
        let meta = Meta {
            block_table: host.i32s(&m.block_table)?,
            page_table: host.i32s(&m.indexer_page_table)?,
            mla_slots: host.i64s(&m.mla_slot_mapping)?,
            value_slots: host.i64s(&m.slot_mapping_value)?,
            scale_slots: host.i64s(&m.slot_mapping_scale)?,
            req_idx: host.i32s(&m.req_idx_per_token)?,
            cols: m.max_blocks_per_seq,
        };
        let mut t0 = 0usize;
        let mut results = Vec::with_capacity(requests.len());
        for (r, req) in requests.iter().enumerate() {
            let n = req.tokens.len();
            if meta
                .req_idx
                .get(t0..t0 + n)
                .is_none_or(|s| s.iter().any(|&i| i as usize != r))
            {
                return Err(ForwardError::framework(ModelError::Access(format!(
                    "tokens {t0}..{} are not request {r}'s in the step metadata",
                    t0 + n
                ))));
            }
            let mut store = Paged {
                host: &mut *host,
                cache: &cache,
                meta: &meta,
                row: r,
                first: req.num_cached,
                t0,
                n,
            };
            let tokens: Vec<u32> = req.tokens.iter().map(|t| t.0).collect();
            let outs = self
                .model
                .run(&mut store, req.num_cached, &tokens)
                .map_err(ForwardError::framework)?;
            results.push((req.id, outs));
            t0 += n;
        }
        let mut o = self.outputs.lock().unwrap_or_else(|e| e.into_inner());
        for (id, outs) in results {
            o.record(self.device, id, &outs);
        }
        Ok(())
    }
}

struct Meta<'a> {
    block_table: &'a [i32],
    page_table: &'a [i32],
    mla_slots: &'a [i64],
    value_slots: &'a [i64],
    scale_slots: &'a [i64],
    req_idx: &'a [i32],
    cols: usize,
}

/// One request's cache in the pools, addressed through the step metadata.
struct Paged<'h, 'a> {
    host: &'h mut HostMemory<'a>,
    cache: &'h [LayerCache],
    meta: &'h Meta<'a>,
    /// The request's row in the page tables.
    row: usize,
    /// Its first new position.
    first: u32,
    /// Its first token in the step's token order.
    t0: usize,
    /// Its new tokens.
    n: usize,
}

fn access(what: String) -> ModelError {
    ModelError::Access(what)
}

impl Paged<'_, '_> {
    /// The step's token index of new position `pos`.
    fn token(&self, pos: u32) -> Result<usize, ModelError> {
        let i = pos.checked_sub(self.first).map(|i| i as usize);
        match i {
            Some(i) if i < self.n => Ok(self.t0 + i),
            _ => Err(access(format!("position {pos} is not new in this step"))),
        }
    }

    /// Entry `pos / 64` of this request's row of `table`.
    fn entry(&self, table: &[i32], pos: u32, tokens_per_page: u32) -> Result<i64, ModelError> {
        let col = (pos / tokens_per_page) as usize;
        let v = if col < self.meta.cols {
            table.get(self.row * self.meta.cols + col).copied()
        } else {
            None
        };
        match v {
            Some(v) if v >= 0 => Ok(i64::from(v)),
            _ => Err(access(format!("no page-table entry for position {pos}"))),
        }
    }

    fn mla(&self, layer: usize) -> Result<crate::device::forward::MlaCacheView, ModelError> {
        self.cache[layer]
            .mla
            .ok_or_else(|| access(format!("layer {layer} has no MLA cache")))
    }

    fn indexer(
        &self,
        layer: usize,
    ) -> Result<crate::device::forward::IndexerCacheView, ModelError> {
        self.cache[layer]
            .indexer
            .ok_or_else(|| access(format!("layer {layer} has no indexer cache")))
    }
}

fn mem(e: ForwardError) -> ModelError {
    ModelError::Access(e.to_string())
}

impl KvStore for Paged<'_, '_> {
    fn write_row(&mut self, layer: usize, pos: u32, row: &[u8]) -> Result<(), ModelError> {
        let v = self.mla(layer)?;
        let slot = self.meta.mla_slots[self.token(pos)?];
        if slot < 0 || v.rows.row_bytes as usize != row.len() {
            return Err(access(format!("MLA slot {slot} for position {pos}")));
        }
        let addr = v.rows.token_addr(slot);
        self.host
            .bytes_mut(addr, row.len() as u64)
            .map_err(mem)?
            .copy_from_slice(row);
        Ok(())
    }

    fn write_index_key(
        &mut self,
        layer: usize,
        pos: u32,
        values: &[u8],
        scale: &[u8],
    ) -> Result<(), ModelError> {
        let v = self.indexer(layer)?;
        let t = self.token(pos)?;
        let (vo, so) = (self.meta.value_slots[t], self.meta.scale_slots[t]);
        if vo < 0 || so < 0 {
            return Err(access(format!("indexer slot {vo}/{so} for position {pos}")));
        }
        for (off, bytes) in [(vo, values), (so, scale)] {
            self.host
                .bytes_mut(v.base + off as u64, bytes.len() as u64)
                .map_err(mem)?
                .copy_from_slice(bytes);
        }
        Ok(())
    }

    fn index_key(&self, layer: usize, pos: u32) -> Result<(&[u8], &[u8]), ModelError> {
        let v = self.indexer(layer)?;
        let page = self.entry(self.meta.page_table, pos, v.tokens_per_page)? as u64;
        let off = pos % v.tokens_per_page;
        let values = self
            .host
            .bytes(v.value_addr(page, off), u64::from(v.value_bytes))
            .map_err(mem)?;
        let scale = self
            .host
            .bytes(v.scale_addr(page, off), u64::from(v.scale_bytes))
            .map_err(mem)?;
        Ok((values, scale))
    }

    fn rows(&self, layer: usize, positions: &[u32]) -> Result<Vec<&[u8]>, ModelError> {
        let v = self.mla(layer)?;
        let t = v.rows.tokens_per_page;
        positions
            .iter()
            .map(|&p| {
                // The global token index a sparse kernel is handed.
                let global =
                    self.entry(self.meta.block_table, p, t)? * i64::from(t) + i64::from(p % t);
                self.host
                    .bytes(v.rows.token_addr(global), u64::from(v.rows.row_bytes))
                    .map_err(mem)
            })
            .collect()
    }
}
