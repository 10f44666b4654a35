//! What an engine embedding the runtime needs, in one import:
//! `use dsa_kv::prelude::*;`.

pub use crate::actors::{
    CommitAndStepReport, CommitReport, Drafts, FinishedReport, KvCacheBuilder, KvCacheHandle,
    RuntimeError, RuntimeInfo, RuntimeStats, Scheduled, StepReport, StepTiming,
};
pub use crate::config::{EngineConfig, ModelPreset, SpecMode};
pub use crate::core::scheduler::{PlannedRequest, RequestKind, RequestOutcome, SubmitRequest};
pub use crate::core::ReuseScope;
pub use crate::device::forward::{
    Batch, CacheView, Forward, ForwardError, ForwardFactory, ForwardSetup, MemKind, MetadataView,
    Phase, Proposals, Sampled, Sampling,
};
pub use crate::device::Verification;
pub use crate::ids::{RequestId, TokenId};
