//! A dump of one layer of one step as `.npy` files: the caches exactly as the DSA
//! kernels read them (the indexer K cache as DeepGEMM's `[pages, 64, 1, 132]` view, the
//! MLA rows as FlashMLA's `[pages, 64, 656]`), the page tables, and the model's inputs
//! and outputs of every new token of the step at that layer (FP8 index queries and
//! weights, index logits, top-k global indices, absorbed queries, attention output), with
//! a JSON manifest. An external kernel run on these inputs must reproduce the outputs
//! (to rounding). The format is documented in README.md ("Dumping one layer for
//! external kernels"); `examples/dump.rs` writes one.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use super::paged::{ForwardOptions, ModelForward};
use super::trace::{StepTrace, Trace, TracePoint, Tracer};
use super::{npy, Model, INDEX_DIM, LATENT, ROPE};
use dsa_kv_core::config::KvDtype;
use dsa_kv_device::forward::{
    Batch, Forward, ForwardError, ForwardFactory, ForwardSetup, Proposals, Sampling,
};

/// Which layer of which step to dump, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DumpSpec {
    /// Step number ([`Batch::step`]).
    pub step: u64,
    /// Decoder layer (it must own an indexer).
    pub layer: usize,
    /// Device index.
    pub device: usize,
    /// Directory the files go to (created if missing).
    pub dir: PathBuf,
}

/// A dump's failure.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DumpError {
    /// The step never ran on the device (the workload ended first).
    #[error("step {step} did not run on device {device}: pick a step the workload reaches")]
    NoSuchStep {
        /// The step asked for.
        step: u64,
        /// The device.
        device: usize,
    },
    /// The layer cannot be dumped.
    #[error("layer {layer}: {what}")]
    Layer {
        /// The layer asked for.
        layer: usize,
        /// Why, and what to do.
        what: String,
    },
    /// A file could not be written.
    #[error("writing {path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        error: String,
    },
    /// The forward's memory or metadata could not be read.
    #[error("reading the batch: {0}")]
    Batch(String),
}

/// A dump in the making: its forward factory, then its manifest.
#[derive(Clone)]
pub struct Dump {
    spec: DumpSpec,
    tracer: Tracer,
    result: Arc<Mutex<Option<Result<Value, DumpError>>>>,
}

impl Dump {
    /// A dump of `spec`.
    pub fn new(spec: DumpSpec) -> Dump {
        let (step, layer, device) = (spec.step, spec.layer, spec.device);
        // Every new token of the step on that device, at that layer.
        let tracer = Tracer::new(move |s| {
            if s.step != step || s.device != device {
                return Vec::new();
            }
            (s.first..s.first + s.tokens as u32)
                .map(|pos| TracePoint { layer, pos })
                .collect()
        });
        Dump {
            spec,
            tracer,
            result: Arc::default(),
        }
    }

    /// The forward factory: [`ModelForward::factory`] with `opts` (its tracer replaced
    /// by the dump's) that writes the dump after the target forward of the chosen step.
    /// With drafts, a decode step verifies `1 + drafts` tokens of each request that has
    /// a proposal, and the dump holds them all (`tokens_per_row`).
    pub fn factory(&self, model: Arc<Model>, opts: ForwardOptions) -> ForwardFactory {
        let inner = ModelForward::factory(model.clone(), opts.tracer(self.tracer.clone()));
        let dump = self.clone();
        Arc::new(move |setup: &ForwardSetup<'_>| {
            Ok(Box::new(DumpForward {
                inner: inner(setup)?,
                model: model.clone(),
                device: setup.device,
                dump: dump.clone(),
            }) as Box<dyn Forward>)
        })
    }

    /// The manifest written (also `manifest.json` in the directory), or why not.
    pub fn result(&self) -> Result<Value, DumpError> {
        let r = self.result.lock().unwrap_or_else(|e| e.into_inner());
        r.clone().unwrap_or(Err(DumpError::NoSuchStep {
            step: self.spec.step,
            device: self.spec.device,
        }))
    }
}

struct DumpForward {
    inner: Box<dyn Forward>,
    model: Arc<Model>,
    device: usize,
    dump: Dump,
}

impl Forward for DumpForward {
    fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        let sampled = self.inner.forward(batch)?;
        let spec = &self.dump.spec;
        if batch.step != spec.step || self.device != spec.device {
            return Ok(sampled);
        }
        let traces = self.dump.tracer.take();
        // A failed dump is reported by `Dump::result`; the run goes on.
        let r = write(spec, &self.model, batch, &traces);
        *self.dump.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        Ok(sampled)
    }

    fn draft_forward(&mut self, batch: &mut Batch<'_>) -> Result<Proposals, ForwardError> {
        self.inner.draft_forward(batch)
    }

    fn after_synchronize(&mut self) -> Result<(), ForwardError> {
        self.inner.after_synchronize()
    }
}

/// The files, for the manifest: name → (shape, dtype, what).
struct Files<'a> {
    dir: &'a Path,
    list: serde_json::Map<String, Value>,
}

impl Files<'_> {
    fn put<T: npy::NpyElem>(
        &mut self,
        name: &str,
        shape: &[usize],
        data: &[T],
        dtype: &str,
        what: &str,
    ) -> Result<(), DumpError> {
        let path = self.dir.join(format!("{name}.npy"));
        npy::write(&path, shape, data).map_err(|e| DumpError::Io {
            path: path.clone(),
            error: e.to_string(),
        })?;
        self.list.insert(
            name.into(),
            json!({ "file": format!("{name}.npy"), "shape": shape, "dtype": dtype, "what": what }),
        );
        Ok(())
    }
}

fn batch_err(e: ForwardError) -> DumpError {
    DumpError::Batch(e.to_string())
}

/// Writes the dump of `traces` (every new token of the step at `spec.layer`).
fn write(
    spec: &DumpSpec,
    model: &Model,
    batch: &mut Batch<'_>,
    traces: &[StepTrace],
) -> Result<Value, DumpError> {
    let cfg = *model.config();
    let layer_err = |what: String| DumpError::Layer {
        layer: spec.layer,
        what,
    };
    let cache =
        *batch.cache.layers.get(spec.layer).ok_or_else(|| {
            layer_err(format!("the cache has {} layers", batch.cache.layers.len()))
        })?;
    let (Some(ix), Some(mla)) = (cache.indexer, cache.mla) else {
        return Err(layer_err(
            "no indexer cache here: dump a layer that owns an indexer".into(),
        ));
    };
    if spec.layer >= cfg.layers {
        return Err(layer_err(format!("the model has {} layers", cfg.layers)));
    }
    let (d, s, t) = (
        ix.value_bytes as usize,
        ix.scale_bytes as usize,
        ix.tokens_per_page as usize,
    );
    if ix.page_bytes != (t * (d + s)) as u64 || d != INDEX_DIM || s != 4 {
        return Err(layer_err(format!(
            "an FP8 indexer page of {t} × ({d} + {s}) bytes was expected, the page has {} bytes",
            ix.page_bytes
        )));
    }
    let m = batch.metadata;
    let request_ids: Vec<u64> = batch.requests.iter().map(|r| r.id.get()).collect();
    let host = batch.host().ok_or_else(|| {
        DumpError::Batch("the dump reads host memory: run on the host backend".into())
    })?;
    let cols = m.max_blocks_per_seq;
    let rows = m.indexer_page_table.used / cols.max(1);
    let page_table = &host.i32s(&m.indexer_page_table).map_err(batch_err)?[..rows * cols];
    let block_table = &host.i32s(&m.block_table).map_err(batch_err)?[..rows * cols];
    let kv_lens = &host.i32s(&m.kv_lens).map_err(batch_err)?[..m.kv_lens.used];
    let index_cache = host
        .bytes(ix.base, ix.pages * ix.page_bytes)
        .map_err(batch_err)?;
    let (rb, mt) = (
        mla.rows.row_bytes as usize,
        mla.rows.tokens_per_page as usize,
    );
    let mut mla_cache = Vec::with_capacity(mla.rows.pages as usize * mt * rb);
    for p in 0..mla.rows.pages {
        let page = host
            .bytes(mla.rows.row_addr(p, 0), (mt * rb) as u64)
            .map_err(batch_err)?;
        mla_cache.extend_from_slice(page);
    }

    std::fs::create_dir_all(&spec.dir).map_err(|e| DumpError::Io {
        path: spec.dir.clone(),
        error: e.to_string(),
    })?;
    let mut f = Files {
        dir: &spec.dir,
        list: serde_json::Map::new(),
    };
    f.put(
        "index_k_cache",
        &[ix.pages as usize, t, 1, d + s],
        index_cache,
        "uint8",
        "the layer's indexer K cache from its base, DeepGEMM's fused view: page p is 64 × 128 \
         FP8 E4M3 key bytes (token o at byte 128·o) then 64 f32 scale words (token o at byte \
         8192 + 4·o); the [64, 1, 132] shape is the page's 8448 bytes reinterpreted",
    )?;
    f.put(
        "index_page_table",
        &[rows, cols],
        page_table,
        "int32",
        "per request row: the indexer page of each 64-token block (slot × page_scale), 0 past the KV",
    )?;
    f.put(
        "block_table",
        &[rows, cols],
        block_table,
        "int32",
        "per request row: the MLA page (slot) of each 64-token block, -1 past the KV",
    )?;
    f.put(
        "kv_lens",
        &[kv_lens.len()],
        kv_lens,
        "int32",
        "per request row: KV tokens after this step",
    )?;

    let all: Vec<(usize, &Trace)> = traces
        .iter()
        .flat_map(|st| st.traces.iter().map(move |tr| (st.site.row, tr)))
        .collect();
    let n = all.len();
    let mut tokens_per_row = vec![0usize; rows];
    for &(r, _) in &all {
        if let Some(c) = tokens_per_row.get_mut(r) {
            *c += 1;
        }
    }
    let (ih, h) = (cfg.index_heads, cfg.heads);
    let max_ctx = all
        .iter()
        .map(|(_, tr)| tr.pos as usize + 1)
        .max()
        .unwrap_or(0);
    let mut q_fp8 = Vec::with_capacity(n * ih * INDEX_DIM);
    let (mut q_scale, mut weights) = (Vec::new(), Vec::new());
    let mut logits = vec![f32::NEG_INFINITY; n * max_ctx];
    let mut topk_global = vec![-1i32; n * cfg.topk];
    let mut topk_pos = vec![-1i32; n * cfg.topk];
    let (mut q_abs, mut o_lat, mut attn_out) = (Vec::new(), Vec::new(), Vec::new());
    for (i, (_, tr)) in all.iter().enumerate() {
        let index = tr.index.as_ref().ok_or_else(|| {
            layer_err("the model traced no indexer here: the layer has no indexer".into())
        })?;
        for (q, sc) in index.q_fp8.iter().zip(&index.q_scale) {
            q_fp8.extend_from_slice(q);
            q_scale.push(f32::from_le_bytes(*sc));
        }
        weights.extend_from_slice(&index.weights);
        logits[i * max_ctx..][..index.logits.len()].copy_from_slice(&index.logits);
        for (k, (&p, &g)) in tr.selected.iter().zip(&tr.global).enumerate() {
            topk_pos[i * cfg.topk + k] = p as i32;
            topk_global[i * cfg.topk + k] = i32::try_from(g)
                .map_err(|_| layer_err(format!("global token index {g} does not fit an int32")))?;
        }
        for hd in &tr.heads {
            q_abs.extend_from_slice(&hd.q_lat);
            q_abs.extend_from_slice(&hd.q_pe);
            o_lat.extend_from_slice(&hd.o_lat);
        }
        attn_out.extend_from_slice(&tr.attn_out);
    }
    f.put(
        "positions",
        &[n],
        &all.iter()
            .map(|(_, tr)| tr.pos as i32)
            .collect::<Vec<i32>>(),
        "int32",
        "per new token of the step (requests in row order, positions ascending): its position",
    )?;
    f.put(
        "token_row",
        &[n],
        &all.iter().map(|(r, _)| *r as i32).collect::<Vec<i32>>(),
        "int32",
        "per token: its request's row in the page tables",
    )?;
    f.put(
        "context_lens",
        &[n],
        &all.iter()
            .map(|(_, tr)| tr.pos as i32 + 1)
            .collect::<Vec<i32>>(),
        "int32",
        "per token: its causal context length (position + 1)",
    )?;
    f.put(
        "index_q_fp8",
        &[n, ih, INDEX_DIM],
        &q_fp8,
        "uint8",
        "per token and index head: the query's FP8 E4M3 bytes",
    )?;
    f.put(
        "index_q_scale",
        &[n, ih],
        &q_scale,
        "float32",
        "per token and index head: the query's scale (query = e4m3 × scale)",
    )?;
    f.put(
        "index_weights",
        &[n, ih],
        &weights,
        "float32",
        "per token and index head: w_h",
    )?;
    f.put(
        "index_logits",
        &[n, max_ctx],
        &logits,
        "float32",
        "per token and position j: sum_h w_h relu(q_h . k_j) scale_j (-inf past the causal window)",
    )?;
    f.put(
        "topk_positions",
        &[n, cfg.topk],
        &topk_pos,
        "int32",
        "per token: the selected positions, ascending, -1 padded",
    )?;
    f.put(
        "topk_global",
        &[n, cfg.topk],
        &topk_global,
        "int32",
        "per token: the selected rows' global token indices (block_table[row][p / 64] × 64 + p % 64), -1 padded",
    )?;
    let mla_what =
        "the layer's MLA rows, page p = block-table entry p, row o = global index p × 64 + o";
    let mla_dtype = match model.format.kv_dtype {
        KvDtype::Fp8DsMla => {
            f.put(
                "mla_cache",
                &[mla.rows.pages as usize, mt, rb],
                &mla_cache,
                "uint8",
                &format!("{mla_what}; fp8_ds_mla: 512 E4M3, 4 f32 tile scales, 64 bf16 rope"),
            )?;
            "fp8_ds_mla"
        }
        _ => {
            let bits: Vec<u16> = mla_cache
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            f.put(
                "mla_cache",
                &[mla.rows.pages as usize, mt, rb / 2],
                &bits,
                "bfloat16 bits as uint16",
                &format!("{mla_what}; bf16: 512 latent then 64 rope"),
            )?;
            "bf16"
        }
    };
    f.put(
        "q_absorbed",
        &[n, h, LATENT + ROPE],
        &q_abs,
        "float32",
        "per token and MLA head: the query in the latent space (512) then its rope part (64)",
    )?;
    f.put(
        "attn_lat",
        &[n, h, LATENT],
        &o_lat,
        "float32",
        "per token and MLA head: softmax(scale · q_absorbed · rows) · latents over the selected rows",
    )?;
    f.put(
        "attn_out",
        &[n, cfg.hidden],
        &attn_out,
        "float32",
        "per token: the layer's attention output (after the value and output projections)",
    )?;
    let softmax_scale = all
        .first()
        .map_or(1.0 / ((cfg.nope_dim + ROPE) as f32).sqrt(), |(_, tr)| {
            tr.softmax_scale
        });
    let manifest = json!({
        "format": "dsa-kv layer dump v1",
        "step": spec.step,
        "device": spec.device,
        "layer": spec.layer,
        "tokens": n,
        "rows": rows,
        "request_ids": request_ids,
        "tokens_per_row": tokens_per_row,
        "max_context": max_ctx,
        "softmax_scale": softmax_scale,
        "model": {
            "layers": cfg.layers,
            "hidden": cfg.hidden,
            "heads": h,
            "nope_dim": cfg.nope_dim,
            "v_dim": cfg.v_dim,
            "kv_lora_rank": LATENT,
            "rope_dim": ROPE,
            "index_heads": ih,
            "index_head_dim": INDEX_DIM,
            "topk": cfg.topk,
            "seed": cfg.seed,
        },
        "index_cache": {
            "tokens_per_page": t,
            "value_bytes": d,
            "scale_bytes": s,
            "page_bytes": ix.page_bytes,
            "page_scale": ix.page_scale,
            "scale_format": format!("{:?}", model.format.scale_format),
        },
        "mla_cache": {
            "encoding": mla_dtype,
            "row_bytes": rb,
            "tokens_per_page": mt,
            "pool_page_stride": mla.rows.page_stride,
        },
        "files": Value::Object(f.list),
    });
    let path = spec.dir.join("manifest.json");
    let text = serde_json::to_string_pretty(&manifest).expect("invariant: JSON values serialize");
    std::fs::write(&path, text).map_err(|e| DumpError::Io {
        path,
        error: e.to_string(),
    })?;
    Ok(manifest)
}
