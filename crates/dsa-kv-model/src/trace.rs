//! The intermediate values of one layer of one token, as the model computed them: what a
//! cross-check against the DSA kernels' published semantics (DeepGEMM's paged MQA
//! logits, the top-k, FlashMLA's sparse decode) starts from. Tracing is asked for per
//! `(layer, position)`; an untraced run takes the plain path and no trace changes a bit
//! of the output.

use std::sync::{Arc, Mutex};

use super::{KvStore, Model, ModelError, TokenOut, INDEX_DIM};
use dsa_kv_core::ids::RequestId;

/// One `(layer, position)` to trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TracePoint {
    /// Decoder layer (the target cache's layer of the same index).
    pub layer: usize,
    /// The token's position in its request.
    pub pos: u32,
}

/// The lightning indexer's side of a trace: what `fp8_paged_mqa_logits` is handed
/// besides the cache, and what it returns.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IndexTrace {
    /// Per index head: the query's FP8 E4M3 bytes as quantized.
    pub q_fp8: Vec<[u8; INDEX_DIM]>,
    /// Per index head: the query's scale word as quantized (an f32, little-endian; the
    /// dequantized query is `e4m3(byte) × scale`).
    pub q_scale: Vec<[u8; 4]>,
    /// Per index head: the weight `w_h`.
    pub weights: Vec<f32>,
    /// Per causal position `j` in `0..=pos`: the score `Σ_h w_h · relu(q_h · k_j) ·
    /// scale_j` the top-k ranks. Traced also when the context fits in the top-k (every
    /// position is then selected, and an untraced run skips the scores).
    pub logits: Vec<f32>,
}

/// One MLA head of a trace, in the absorbed form a sparse MLA kernel computes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HeadTrace {
    /// The query projected into the latent space (512).
    pub q_lat: Vec<f32>,
    /// The query's RoPE part (64), rotated.
    pub q_pe: Vec<f32>,
    /// `Σ_j softmax_j · latent_j` over the selected rows (512), before the value
    /// projection.
    pub o_lat: Vec<f32>,
}

/// The intermediate values of one layer of one token.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    /// Decoder layer.
    pub layer: usize,
    /// Position of the token.
    pub pos: u32,
    /// The indexer's queries, weights and scores (`None`: the layer has no indexer and
    /// attends to every position).
    pub index: Option<IndexTrace>,
    /// The positions attended to, ascending (the top-k; every position when the context
    /// fits in it).
    pub selected: Vec<u32>,
    /// The global token index of each selected position, as a sparse kernel is handed
    /// it ([`KvStore::global_index`]: `block_table[pos / 64] × 64 + pos % 64` in the
    /// pools, the position itself on a contiguous cache).
    pub global: Vec<i64>,
    /// The softmax scale the scores `q · row` are multiplied by.
    pub softmax_scale: f32,
    /// Per MLA head.
    pub heads: Vec<HeadTrace>,
    /// The layer's attention output (hidden size), added to the residual.
    pub attn_out: Vec<f32>,
}

impl Trace {
    pub(crate) fn new(point: TracePoint) -> Trace {
        Trace {
            layer: point.layer,
            pos: point.pos,
            ..Trace::default()
        }
    }
}

/// What [`Model::run_traced`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct TracedRun {
    /// Each new token's output (as [`Model::run`]).
    pub outputs: Vec<TokenOut>,
    /// Each new token's final hidden state (as [`Model::run_hidden`]).
    pub hidden: Vec<Vec<f32>>,
    /// The traces, in layer order, then position order.
    pub traces: Vec<Trace>,
}

/// Where one request's new tokens are in a step: what a [`Tracer`]'s selector sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceSite {
    /// Step number.
    pub step: u64,
    /// Device index.
    pub device: usize,
    /// The request.
    pub request: RequestId,
    /// Its row in the step's page tables.
    pub row: usize,
    /// Its first new position (the cache holds `0..first`).
    pub first: u32,
    /// Its new tokens (positions `first..first + tokens`).
    pub tokens: usize,
}

/// The traces of one request in one step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTrace {
    /// Where.
    pub site: TraceSite,
    /// One per point traced, in layer order, then position order.
    pub traces: Vec<Trace>,
}

type Select = dyn Fn(&TraceSite) -> Vec<TracePoint> + Send + Sync;

/// What a [`ModelForward`](super::paged::ModelForward) traces, and where the traces
/// go. Clones share the traces.
#[derive(Clone)]
pub struct Tracer {
    select: Arc<Select>,
    traces: Arc<Mutex<Vec<StepTrace>>>,
}

impl Tracer {
    /// A tracer that asks `select` which points of each request's new tokens to trace
    /// (points outside the request's new positions are ignored; an empty list runs the
    /// untraced path).
    pub fn new(select: impl Fn(&TraceSite) -> Vec<TracePoint> + Send + Sync + 'static) -> Self {
        Tracer {
            select: Arc::new(select),
            traces: Arc::default(),
        }
    }

    /// Takes the traces recorded so far, in the order they were made.
    pub fn take(&self) -> Vec<StepTrace> {
        std::mem::take(&mut *self.traces.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Runs `tokens` of the request at `site` as [`Model::run_hidden`] does, tracing
    /// what the selector asks for.
    pub(crate) fn run_hidden(
        tracer: Option<&Tracer>,
        model: &Model,
        kv: &mut dyn KvStore,
        site: TraceSite,
        tokens: &[u32],
    ) -> Result<(Vec<TokenOut>, Vec<Vec<f32>>), ModelError> {
        let points = tracer.map(|t| (t.select)(&site)).unwrap_or_default();
        let Some(t) = tracer.filter(|_| !points.is_empty()) else {
            return model.run_hidden(kv, site.first, tokens);
        };
        let run = model.run_traced(kv, site.first, tokens, &points)?;
        t.traces
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(StepTrace {
                site,
                traces: run.traces,
            });
        Ok((run.outputs, run.hidden))
    }
}

#[cfg(test)]
mod tests {
    use super::super::unpaged::Contiguous;
    use super::super::{CacheFormat, ModelConfig};
    use super::*;
    use dsa_kv_core::config::KvDtype;
    use dsa_kv_core::ops::quant::ScaleFormat;

    fn model() -> Model {
        let format = CacheFormat {
            kv_dtype: KvDtype::Fp8DsMla,
            scale_format: ScaleFormat::Ue8m0,
            indexer: vec![true, false],
        };
        Model::new(ModelConfig::tiny(5), format).unwrap()
    }

    /// Tracing changes no output bit, and the trace of a chunked run equals the trace of
    /// one pass.
    #[test]
    fn tracing_changes_no_bit() {
        let m = model();
        let prompt: Vec<u32> = (0..130).map(|i| (i * 29 + 3) % 256).collect();
        let points = [
            TracePoint { layer: 0, pos: 129 },
            TracePoint { layer: 1, pos: 129 },
            TracePoint { layer: 0, pos: 40 },
            TracePoint { layer: 0, pos: 500 },
        ];
        let mut plain = Contiguous::new(&m.format);
        let want = m.run_hidden(&mut plain, 0, &prompt).unwrap();
        let mut kv = Contiguous::new(&m.format);
        let run = m.run_traced(&mut kv, 0, &prompt, &points).unwrap();
        assert_eq!((run.outputs, run.hidden), want);
        let traces = run.traces;
        let at: Vec<(usize, u32)> = traces.iter().map(|t| (t.layer, t.pos)).collect();
        assert_eq!(
            at,
            [(0, 40), (0, 129), (1, 129)],
            "layer order, then position"
        );

        let mut chunked = Contiguous::new(&m.format);
        m.run(&mut chunked, 0, &prompt[..100]).unwrap();
        let late = m
            .run_traced(&mut chunked, 100, &prompt[100..], &points)
            .unwrap()
            .traces;
        assert_eq!(
            late,
            traces[1..],
            "position 40 is not new in the second chunk"
        );
    }

    /// What a trace holds: exact shapes, the selection is the top-k of the logits (ties
    /// to the earlier position), contiguous global indices are positions, a layer
    /// without an indexer attends densely.
    #[test]
    fn a_trace_holds_every_intermediate_value() {
        let m = model();
        let cfg = *m.config();
        let prompt: Vec<u32> = (0..100).map(|i| (i * 7 + 1) % 256).collect();
        let points = [
            TracePoint { layer: 0, pos: 99 },
            TracePoint { layer: 1, pos: 99 },
            TracePoint { layer: 0, pos: 10 },
        ];
        let mut kv = Contiguous::new(&m.format);
        let t = m.run_traced(&mut kv, 0, &prompt, &points).unwrap().traces;
        let (small, sparse, dense) = (&t[0], &t[1], &t[2]);

        let ix = sparse.index.as_ref().unwrap();
        assert_eq!((ix.q_fp8.len(), ix.q_scale.len()), (2, 2));
        assert_eq!((ix.weights.len(), ix.logits.len()), (2, 100));
        let mut order: Vec<u32> = (0..100).collect();
        order.sort_by(|&a, &b| {
            let (x, y) = (ix.logits[a as usize], ix.logits[b as usize]);
            y.total_cmp(&x).then(a.cmp(&b))
        });
        let mut top = order[..cfg.topk].to_vec();
        top.sort_unstable();
        assert_eq!(sparse.selected, top);
        assert_eq!(
            sparse.global,
            top.iter().map(|&p| i64::from(p)).collect::<Vec<_>>()
        );
        assert_eq!(sparse.softmax_scale, 1.0 / 96f32.sqrt());
        assert_eq!(sparse.heads.len(), cfg.heads);
        for h in &sparse.heads {
            assert_eq!((h.q_lat.len(), h.q_pe.len(), h.o_lat.len()), (512, 64, 512));
        }
        assert_eq!(sparse.attn_out.len(), cfg.hidden);

        // Position 10 fits in the top-k: every position, scores traced all the same.
        assert_eq!(small.selected, (0..=10).collect::<Vec<_>>());
        assert_eq!(small.index.as_ref().unwrap().logits.len(), 11);
        // Layer 1 has no indexer.
        assert_eq!(dense.index, None);
        assert_eq!(dense.selected, (0..=99).collect::<Vec<_>>());
    }
}
