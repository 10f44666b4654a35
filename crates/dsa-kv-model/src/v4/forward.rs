//! The V4 model as a device's [`Forward`]: every planned request runs through its own
//! tables ([`V4Paged::of_step`] over the batch's pools); a decode step accepts each
//! draft the target's greedy token before it agrees with, the MTP layer's rows are
//! written for the tokens kept, the greedy token is sampled and the MTP layer proposes
//! the next step's drafts (at most the plan's `next_drafts`). Every kept position's
//! output is recorded ([`V4Outputs`]) for the exactness check.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use dsa_kv_core::core::scheduler::{PlannedRequest, RequestKind, RequestOutcome};
use dsa_kv_core::ids::{RequestId, TokenId};
use dsa_kv_device::windowed::BatchPools;
use dsa_kv_device::{Batch, Forward, ForwardError, Proposals, Sampled, Sampling};

use super::{V4Model, V4Paged};
use crate::{ModelError, TokenOut};

/// A step's MTP proposals and the bits of their logits, concatenated.
pub type RecordedDrafts = (Vec<u32>, Vec<u32>);

/// What every device's V4 forward produced.
#[derive(Debug, Default)]
pub struct V4Outputs {
    /// `(device, request)` → position → output. A position computed again (a recompute
    /// after preemption) must give the same output: see `conflicts`.
    pub tokens: HashMap<(usize, RequestId), BTreeMap<u32, TokenOut>>,
    /// `(device, request)` → the position a step sampled at → the MTP proposals made
    /// there and the bits of their logits, concatenated (a checkpoint's model; empty
    /// for the built-in one). Proposed again at the same position (after a
    /// preemption), they must be the same: see `conflicts`.
    pub drafts: HashMap<(usize, RequestId), BTreeMap<u32, RecordedDrafts>>,
    /// Positions whose recomputed output or proposals differed from the first (must
    /// stay empty).
    pub conflicts: Vec<String>,
}

impl V4Outputs {
    /// Records the proposals `drafts` made at position `last` of request `id` on
    /// `device`; others recorded there before are a conflict.
    pub(super) fn record_drafts(
        &mut self,
        device: usize,
        id: RequestId,
        last: u32,
        drafts: &[(u32, Vec<f32>)],
    ) {
        let now = (
            drafts.iter().map(|d| d.0).collect::<Vec<_>>(),
            drafts
                .iter()
                .flat_map(|d| d.1.iter().map(|v| v.to_bits()))
                .collect::<Vec<_>>(),
        );
        let m = self.drafts.entry((device, id)).or_default();
        if let Some(prev) = m.insert(last, now.clone()) {
            if prev != now {
                self.conflicts.push(format!(
                    "device {device}, request {id}, drafts at position {last}: {:?} then {:?} \
                     (or their logits differ)",
                    prev.0, now.0
                ));
            }
        }
    }

    /// Records the kept positions' outputs of request `id` on `device`; a position
    /// recorded before with another output is a conflict.
    pub(super) fn record(&mut self, device: usize, id: RequestId, outs: &[TokenOut]) {
        let m = self.tokens.entry((device, id)).or_default();
        for out in outs {
            if let Some(prev) = m.insert(out.pos, *out) {
                if prev != *out {
                    self.conflicts.push(format!(
                        "device {device}, request {id}, position {}: {prev:?} then {out:?}",
                        out.pos
                    ));
                }
            }
        }
    }
}

/// `(accepted drafts, tokens kept)` of a step's `tokens` given their outputs: a context
/// chunk keeps every token; a decode step keeps its first token and each draft the
/// target's greedy token before it agrees with, up to the first that does not.
pub(super) fn verdict(kind: RequestKind, tokens: &[u32], outs: &[TokenOut]) -> (usize, usize) {
    match kind {
        RequestKind::Context => (0, tokens.len()),
        RequestKind::Generation => {
            let accepted = (1..tokens.len())
                .take_while(|&i| tokens[i] == outs[i - 1].greedy)
                .count();
            (accepted, accepted + 1)
        }
    }
}

/// Records planned request `p`'s kept outputs on `device` and returns its outcome
/// (`(accepted, kept)` from [`verdict`]); its proposals `drafts` join `proposals` when
/// the step samples.
pub(super) fn outcome(
    outputs: Option<&Mutex<V4Outputs>>,
    device: usize,
    p: &PlannedRequest,
    outs: &[TokenOut],
    (accepted, kept): (usize, usize),
    drafts: Vec<(u32, Vec<f32>)>,
    proposals: &mut Proposals,
) -> RequestOutcome {
    if let Some(outputs) = outputs {
        let mut o = outputs.lock().unwrap_or_else(|e| e.into_inner());
        o.record(device, p.id, &outs[..kept]);
        if p.produces_token && !drafts.is_empty() {
            o.record_drafts(device, p.id, outs[kept - 1].pos, &drafts);
        }
    }
    if p.produces_token {
        proposals.push((p.id, drafts.into_iter().map(|d| TokenId(d.0)).collect()));
    }
    RequestOutcome {
        id: p.id,
        accepted_drafts: accepted as u32,
        next_token: p.produces_token.then_some(TokenId(outs[kept - 1].greedy)),
    }
}

/// The V4 model as a device's forward. See the module docs.
pub struct V4ModelForward {
    model: Arc<V4Model>,
    outputs: Option<Arc<Mutex<V4Outputs>>>,
}

impl V4ModelForward {
    /// The forward of `model`, recording every kept position's output into `outputs`
    /// (for an exactness check: it grows with every request).
    pub fn new(model: Arc<V4Model>, outputs: Arc<Mutex<V4Outputs>>) -> Self {
        V4ModelForward {
            model,
            outputs: Some(outputs),
        }
    }

    /// The forward of `model` recording nothing (a serving engine's: memory stays
    /// bounded however many requests it serves).
    pub fn serving(model: Arc<V4Model>) -> Self {
        V4ModelForward {
            model,
            outputs: None,
        }
    }
}

impl Forward for V4ModelForward {
    fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        let (requests, device) = (batch.requests, batch.device);
        let mut pools = BatchPools::of(batch).ok_or_else(|| ForwardError::Unsupported {
            what: "the V4 model's host forward needs a host batch over a windowed cache".into(),
        })?;
        let mut outcomes = Vec::with_capacity(requests.len());
        let mut proposals = Proposals::new();
        for p in requests {
            // The paged store's errors name the request and the position already.
            let err = ForwardError::framework;
            let first = p.num_cached;
            let tokens: Vec<u32> = p.tokens.iter().map(|t| t.0).collect();
            if tokens.is_empty() {
                return Err(err(ModelError::Access(format!(
                    "request {}: planned with no tokens",
                    p.id
                ))));
            }
            let mut kv = V4Paged::of_step(&mut pools, p).map_err(err)?;
            let (outs, hidden) = self
                .model
                .run_hidden(&mut kv, first, &tokens)
                .map_err(err)?;
            let (accepted, kept) = verdict(p.kind, &tokens, &outs);
            let mtp = self.model.config().mtp;
            if mtp {
                self.model
                    .draft_write(&mut kv, first, &tokens[..kept], &hidden[..kept])
                    .map_err(err)?;
            }
            let next = outs[kept - 1].greedy;
            let drafts = if p.produces_token && mtp && p.next_drafts > 0 {
                let (last, k) = (first + kept as u32 - 1, p.next_drafts as usize);
                if self.outputs.is_some() {
                    // Recorded with their logits for the exactness check.
                    self.model
                        .propose_logits(&kv, last, &hidden[kept - 1], next, k)
                        .map_err(err)?
                } else {
                    let d = self.model.propose(&kv, last, &hidden[kept - 1], next, k);
                    d.map_err(err)?
                        .into_iter()
                        .map(|t| (t, Vec::new()))
                        .collect()
                }
            } else {
                Vec::new()
            };
            outcomes.push(outcome(
                self.outputs.as_deref(),
                device,
                p,
                &outs,
                (accepted, kept),
                drafts,
                &mut proposals,
            ));
        }
        Ok(Sampling::Sampled(
            Sampled::new(outcomes).with_drafts(proposals),
        ))
    }
}
