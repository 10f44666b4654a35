//! The model as a framework's [`Forward`] on the host backend: it writes every new
//! token's KV through the step's slot mappings and reads the cache back as the DSA
//! kernels do: indexer keys through the indexer page table, MLA rows through global
//! token indices (`block table entry × 64 + offset`) built from the top-k positions.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::trace::{TraceSite, Tracer};
use super::{CacheFormat, DraftCache, KvStore, Model, ModelError, TokenOut};
use dsa_kv_core::core::scheduler::{PlannedRequest, RequestOutcome};
use dsa_kv_core::ids::{RequestId, TokenId};
use dsa_kv_core::ops::quant::ScaleFormat;
use dsa_kv_device::forward::{
    Batch, Forward, ForwardError, ForwardFactory, ForwardSetup, HostMemory, LayerCache, Proposals,
    Sampled, Sampling,
};

/// What every device's forward computed at each position, for checking a run against
/// the model run alone ([`crate::unpaged`]): the greedy token and the logits' digest of
/// every position that ran. The tokens a step sampled travel in the step's outcomes
/// ([`Sampled`]), not here; a forward keeps this record only when given one
/// ([`ForwardOptions::record`]).
#[derive(Debug, Default)]
pub struct Outputs {
    /// `(device, request)` → position → output. A position computed again (a request
    /// recomputed after preemption) must give the same output: see `conflicts`.
    pub tokens: HashMap<(usize, RequestId), BTreeMap<u32, TokenOut>>,
    /// Positions whose recomputed output differed from the first (must stay empty).
    pub conflicts: Vec<String>,
}

impl Outputs {
    /// Records the outputs of committed positions (`outs`: the step's positions up to the
    /// last accepted one).
    pub(crate) fn record(&mut self, device: usize, id: RequestId, outs: &[TokenOut]) {
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
    }
}

/// How the model's forward runs: drafts proposed per step, a record of every position's
/// output, a trace. The default proposes no drafts, keeps no record and traces nothing.
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct ForwardOptions {
    /// Draft tokens the MTP layer proposes per request and step (0: no speculation).
    pub drafts: usize,
    /// Where every position's output is recorded, for an exactness check.
    pub record: Option<Arc<Mutex<Outputs>>>,
    /// The target forward's points to trace (see [`super::trace`]).
    pub tracer: Option<Tracer>,
}

impl ForwardOptions {
    /// `n` draft tokens proposed per request and step (the cache needs an MTP layer:
    /// `model.num_mtp_layers = 1`, in a separate draft cache or the target's); the next
    /// step's drafts are accepted while they equal the target's greedy tokens.
    pub fn drafts(mut self, n: usize) -> Self {
        self.drafts = n;
        self
    }

    /// Every position's output recorded into `record`.
    pub fn record(mut self, record: Arc<Mutex<Outputs>>) -> Self {
        self.record = Some(record);
        self
    }

    /// The target forward's points that `tracer` selects traced.
    pub fn tracer(mut self, tracer: Tracer) -> Self {
        self.tracer = Some(tracer);
        self
    }
}

/// Checks that a cache layer has the shapes the model reads and writes: an MLA cache
/// of 64-token pages and, if it has an indexer, FP8 keys of 128 bytes with a 4-byte scale
/// word in 64-token pages.
pub(crate) fn check_layer(l: &LayerCache) -> Result<(), ModelError> {
    let bad = |what: String| {
        Err(ModelError::Cache(format!(
            "layer {}: {what}",
            l.layer.get()
        )))
    };
    let Some(m) = l.mla else {
        return bad("no MLA cache".into());
    };
    if m.rows.tokens_per_page != 64 {
        return bad(format!(
            "{}-token MLA pages (the model reads 64)",
            m.rows.tokens_per_page
        ));
    }
    if let Some(ix) = l.indexer {
        if ix.dtype != dsa_kv_core::config::IndexerDtype::Fp8
            || ix.value_bytes as usize != super::INDEX_VALUE_BYTES
            || ix.scale_bytes != 4
            || ix.tokens_per_page != 64
        {
            return bad(format!(
                "indexer keys {:?} of {} + {} bytes in {}-token pages: the model writes FP8 \
                 keys of 128 bytes with a 4-byte scale (set indexer_dtype = fp8)",
                ix.dtype, ix.value_bytes, ix.scale_bytes, ix.tokens_per_page
            ));
        }
    }
    Ok(())
}

/// The cache format of a target cache view: the rows' encoding and which of the first
/// `layers` layers own an indexer. The cache must have exactly the model's target layers
/// (an MTP layer of the target's manager comes after them), each of a shape the model
/// reads (see `check_layer`).
pub fn cache_format(setup: &ForwardSetup<'_>, layers: usize) -> Result<CacheFormat, ModelError> {
    let ls = &setup.target.layers;
    let target = setup.model.spec().num_layers as usize;
    if ls.len() < layers || target != layers {
        return Err(ModelError::Cache(format!(
            "the cache has {target} target layers ({} in its view), the model {layers}: set \
             model.num_layers = {layers}",
            ls.len()
        )));
    }
    for l in ls {
        check_layer(l)?;
    }
    if let Some(d) = setup.draft {
        for l in &d.layers {
            check_layer(l)?;
        }
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

/// Where the MTP draft layer's cache is.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Mtp {
    /// No MTP layer in the cache.
    None,
    /// Layer `layer` of the target cache (MTP layers in the target's manager): written
    /// and read by the target forward.
    Combined { layer: usize, indexer: bool },
    /// Layer 0 of the separate draft cache: written and read in the draft replay.
    Separate { indexer: bool },
}

/// Checks a device's caches against `model` (format, layers, shapes) and finds the MTP
/// layer's cache; `drafts > 0` needs one. Shared by the host and GPU forwards.
pub(crate) fn check_setup(
    setup: &ForwardSetup<'_>,
    model: &Model,
    drafts: usize,
) -> Result<Mtp, ForwardError> {
    let layers = model.config().layers;
    let found = cache_format(setup, layers).map_err(ForwardError::framework)?;
    if found != model.format {
        return Err(ForwardError::Unsupported {
            what: format!(
                "the model was built for {:?}, the cache is {found:?}",
                model.format
            ),
        });
    }
    let mtp = match (setup.draft, setup.target.layers.get(layers)) {
        (Some(d), _) => match d.layers.first() {
            Some(l) if l.mla.is_some() => Mtp::Separate {
                indexer: l.indexer.is_some(),
            },
            _ => Mtp::None,
        },
        (None, Some(l)) if l.mla.is_some() => Mtp::Combined {
            layer: layers,
            indexer: l.indexer.is_some(),
        },
        _ => Mtp::None,
    };
    if !matches!(mtp, Mtp::None) {
        model.has_draft().map_err(|e| ForwardError::Unsupported {
            what: e.to_string(),
        })?;
    }
    if drafts > 0 && matches!(mtp, Mtp::None) {
        return Err(ForwardError::Unsupported {
            what: format!(
                "{drafts} draft tokens need the MTP layer's cache: set \
                 model.num_mtp_layers = 1 (spec_decode.mode = mtp)"
            ),
        });
    }
    Ok(mtp)
}

/// A decoding request's state between the target forward and the draft replay.
struct Pending {
    id: RequestId,
    /// Its row in the step.
    row: usize,
    /// Its last accepted position.
    last: u32,
    /// The target's final hidden state there.
    hidden: Vec<f32>,
    /// The token sampled after it.
    next: u32,
}

/// The model on one device.
pub struct ModelForward {
    model: Arc<Model>,
    device: usize,
    opts: ForwardOptions,
    mtp: Mtp,
    pending: Vec<Pending>,
}

impl ModelForward {
    /// A factory giving every device the model `model` (its cache format must be the
    /// devices' target cache format). Each step it samples the greedy token of every
    /// request that produces one and accepts drafts while they equal the target's
    /// greedy tokens; with `opts.drafts`, the MTP draft layer proposes the next step's
    /// drafts. The MTP layer's KV, if the cache has one, is written.
    pub fn factory(model: Arc<Model>, opts: ForwardOptions) -> ForwardFactory {
        Arc::new(move |setup: &ForwardSetup<'_>| {
            let mtp = check_setup(setup, &model, opts.drafts)?;
            Ok(Box::new(ModelForward {
                model: model.clone(),
                device: setup.device,
                opts: opts.clone(),
                mtp,
                pending: Vec::new(),
            }) as Box<dyn Forward>)
        })
    }

    /// Writes the MTP layer's KV of every new token of `batch` (cache layer `layer`)
    /// and proposes the pending requests' drafts.
    fn draft(&mut self, batch: &mut Batch<'_>, at: DraftCache) -> Result<Proposals, ForwardError> {
        let pending = std::mem::take(&mut self.pending);
        let mut proposals = Proposals::with_capacity(pending.len());
        let model = self.model.clone();
        let drafts = self.opts.drafts;
        each_request(batch, |r, req, store| {
            let tokens: Vec<u32> = req.tokens.iter().map(|t| t.0).collect();
            model.draft_write(store, at, req.num_cached, &tokens)?;
            for p in pending.iter().filter(|p| p.row == r && drafts > 0) {
                let d = model.propose(store, at, p.last, &p.hidden, p.next, drafts)?;
                proposals.push((p.id, d.into_iter().map(TokenId).collect()));
            }
            Ok(())
        })?;
        Ok(proposals)
    }
}

/// The verdict on one request's step: the index of its last accepted token in the step
/// and the drafts accepted. Drafts are accepted while each equals the target's greedy
/// token before it (`outs`: the outputs of the step's tokens).
pub(crate) fn verdict(req: &PlannedRequest, outs: &[TokenOut]) -> Result<(usize, u32), ModelError> {
    let nd = req.num_drafts as usize;
    let n = req.tokens.len();
    let Some(base) = n.checked_sub(nd + 1).filter(|_| outs.len() == n) else {
        return Err(ModelError::Access(format!(
            "request {} has {n} tokens, {nd} drafts and {} outputs",
            req.id,
            outs.len()
        )));
    };
    let accepted = (0..nd)
        .take_while(|&i| req.tokens[base + 1 + i].0 == outs[base + i].greedy)
        .count();
    Ok((base + accepted, accepted as u32))
}

/// Runs `f` on every request of `batch` with its store (the batch's cache through the
/// step metadata bound for the batch's phase).
fn each_request(
    batch: &mut Batch<'_>,
    mut f: impl FnMut(usize, &PlannedRequest, &mut Paged<'_, '_>) -> Result<(), ModelError>,
) -> Result<(), ForwardError> {
    let m = batch.metadata;
    let cache: Vec<LayerCache> = batch.cache.layers.clone();
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
        f(r, req, &mut store).map_err(ForwardError::framework)?;
        t0 += n;
    }
    Ok(())
}

impl Forward for ModelForward {
    fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        self.pending.clear();
        let model = self.model.clone();
        let mut outcomes = Vec::with_capacity(batch.requests.len());
        let mut kept = Vec::new();
        let mut pending = Vec::new();
        let (step, device, tracer) = (batch.step, self.device, self.opts.tracer.as_ref());
        each_request(batch, |r, req, store| {
            let tokens: Vec<u32> = req.tokens.iter().map(|t| t.0).collect();
            let site = TraceSite {
                step,
                device,
                request: req.id,
                row: r,
                first: req.num_cached,
                tokens: tokens.len(),
            };
            let (outs, hidden) = Tracer::run_hidden(tracer, &model, store, site, &tokens)?;
            let (keep, accepted) = verdict(req, &outs)?;
            if req.produces_token {
                pending.push(Pending {
                    id: req.id,
                    row: r,
                    last: outs[keep].pos,
                    hidden: hidden[keep].clone(),
                    next: outs[keep].greedy,
                });
            }
            outcomes.push(RequestOutcome {
                id: req.id,
                accepted_drafts: accepted,
                next_token: req.produces_token.then_some(TokenId(outs[keep].greedy)),
            });
            if self.opts.record.is_some() {
                kept.push((req.id, outs[..=keep].to_vec()));
            }
            Ok(())
        })?;
        if let Some(record) = &self.opts.record {
            let mut o = record.lock().unwrap_or_else(|e| e.into_inner());
            for (id, outs) in &kept {
                o.record(self.device, *id, outs);
            }
        }
        self.pending = pending;
        let drafts = match self.mtp {
            Mtp::Combined { layer, indexer } => self.draft(batch, DraftCache { layer, indexer })?,
            _ => Proposals::new(),
        };
        Ok(Sampling::Sampled(
            Sampled::new(outcomes).with_drafts(drafts),
        ))
    }

    fn draft_forward(&mut self, batch: &mut Batch<'_>) -> Result<Proposals, ForwardError> {
        match self.mtp {
            Mtp::Separate { indexer } => self.draft(batch, DraftCache { layer: 0, indexer }),
            _ => Ok(Proposals::new()),
        }
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

    fn mla(&self, layer: usize) -> Result<dsa_kv_device::forward::MlaCacheView, ModelError> {
        self.cache[layer]
            .mla
            .ok_or_else(|| access(format!("layer {layer} has no MLA cache")))
    }

    fn indexer(
        &self,
        layer: usize,
    ) -> Result<dsa_kv_device::forward::IndexerCacheView, ModelError> {
        self.cache[layer]
            .indexer
            .ok_or_else(|| access(format!("layer {layer} has no indexer cache")))
    }

    /// The global token index of `pos` in rows of `tokens_per_page`: block-table entry
    /// `pos / T` × T + `pos % T`.
    fn global(&self, pos: u32, tokens_per_page: u32) -> Result<i64, ModelError> {
        let t = tokens_per_page;
        Ok(self.entry(self.meta.block_table, pos, t)? * i64::from(t) + i64::from(pos % t))
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
        // The indexer page table pads with page 0; the block table says whether the
        // position's block is there at all.
        self.entry(self.meta.block_table, pos, v.tokens_per_page)?;
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
                let global = self.global(p, t)?;
                self.host
                    .bytes(v.rows.token_addr(global), u64::from(v.rows.row_bytes))
                    .map_err(mem)
            })
            .collect()
    }

    fn global_index(&self, layer: usize, pos: u32) -> Result<i64, ModelError> {
        self.global(pos, self.mla(layer)?.rows.tokens_per_page)
    }
}
