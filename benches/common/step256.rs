//! The 256-request MTP decode step that `benches/runtime.rs` and `examples/step_bench.rs`
//! share (both include this file with `#[path]`): 256 requests of 1,000–2,999 prompt
//! tokens on DeepSeek-V3.2 with MTP and 3 drafts, a device that only acknowledges, and
//! outcomes that accept 1 draft + 1 sampled token per step (sequences grow by 2 tokens a
//! step). `benches/vllm_step/vllm_alloc.py` builds the same requests for vLLM's manager.

use std::collections::HashMap;

use dsa_kv::actors::KvCacheHandle;
use dsa_kv::config::EngineConfig;
use dsa_kv::core::scheduler::{RequestKind, RequestOutcome, StepPlan, SubmitRequest};
use dsa_kv::core::ReuseScope;
use dsa_kv::device::{
    DeviceBackend, DeviceError, DeviceStepReport, Mismatch, Proposals, VerifySpec,
};
use dsa_kv::ids::{RequestId, TokenId};
use dsa_kv::metadata::{DraftSnapshot, MetadataError};

/// A device that does nothing but acknowledge.
pub(crate) struct NullDevice(pub(crate) usize);

impl DeviceBackend for NullDevice {
    fn index(&self) -> usize {
        self.0
    }
    fn execute_step(&mut self, plan: &StepPlan) -> Result<DeviceStepReport, DeviceError> {
        Ok(DeviceStepReport::new(self.0, plan))
    }
    fn draft_prepare(&mut self, _: &StepPlan) -> Result<DraftSnapshot, DeviceError> {
        Err(DeviceError::Metadata {
            device: self.0,
            source: MetadataError::NoDraftBuffers,
        })
    }
    fn draft_forward(&mut self, _: &StepPlan) -> Result<(u64, Proposals), DeviceError> {
        Ok((0, Proposals::new()))
    }
    fn draft_restore(&mut self, _: &DraftSnapshot) -> Result<(), DeviceError> {
        Ok(())
    }
    fn verify(&mut self, _: &[VerifySpec]) -> Result<(u64, Vec<Mismatch>), DeviceError> {
        Ok((0, Vec::new()))
    }

    fn cache_digest(&mut self) -> Result<String, DeviceError> {
        Ok(String::new()) // holds no bytes
    }
}

pub(crate) const SEQS: u64 = 256;

/// Sequences grow by 2 tokens per step; the state is rebuilt (untimed) every
/// `REBUILD` steps so that every measured step sees 1,000–3,200-token sequences.
pub(crate) const REBUILD: u64 = 100;

/// Request `i` has a prompt of `1000 + (7 i mod 2000)` tokens, token ids
/// `t + 3000 i` (no two requests share a page).
pub(crate) fn requests() -> Vec<SubmitRequest> {
    (0..SEQS)
        .map(|i| SubmitRequest {
            id: RequestId(i),
            scope: ReuseScope::SHARED,
            prompt: (0..1000 + (i as u32 * 7) % 2000)
                .map(|t| TokenId(t + i as u32 * 3000))
                .collect(),
            max_new_tokens: 900_000,
            priority: 35,
        })
        .collect()
}

/// Three drafts (tokens 1, 2, 3) for every request.
pub(crate) fn drafts() -> HashMap<RequestId, Vec<TokenId>> {
    (0..SEQS)
        .map(|i| (RequestId(i), vec![TokenId(1), TokenId(2), TokenId(3)]))
        .collect()
}

/// Outcomes of a step: `accepted` drafts each, and a sampled token.
pub(crate) fn outcomes<'a>(
    reqs: impl Iterator<Item = (RequestId, u32)> + 'a,
) -> Vec<RequestOutcome> {
    reqs.map(|(id, drafts)| RequestOutcome {
        id,
        accepted_drafts: drafts.min(1),
        next_token: Some(TokenId(9)),
    })
    .collect()
}

/// DeepSeek-V3.2 (the default model) with MTP, 3 drafts, one cache for target and MTP.
pub(crate) fn config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.kv_cache.max_tokens = Some(12_000_000);
    c.scheduler.max_num_sequences = 256;
    c.scheduler.max_num_tokens = 8192;
    c.scheduler.max_prefill_chunk = 8192;
    c.scheduler.max_seq_len = 1_000_000;
    c.spec_decode.mode = dsa_kv::config::SpecMode::Mtp;
    c.spec_decode.draft_tokens = 3;
    c.spec_decode.separate_draft_cache = false;
    c
}

/// Submits [`requests`] to a started runtime and steps (untimed) until all of them are
/// decoding in one step.
pub(crate) async fn settle(kv: KvCacheHandle) -> KvCacheHandle {
    for r in requests() {
        kv.submit(r).await.unwrap();
    }
    loop {
        let rep = kv.step(drafts()).await.unwrap();
        kv.commit(outcomes(rep.scheduled.iter().map(|r| (r.id, r.num_drafts))))
            .await
            .unwrap();
        if rep.scheduled.len() == SEQS as usize
            && rep
                .scheduled
                .iter()
                .all(|r| r.kind == RequestKind::Generation)
        {
            return kv;
        }
    }
}
