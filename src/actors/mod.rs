//! The runtime a serving framework embeds: a cheap-to-clone async [`KvCacheHandle`] in
//! front of a coordinator actor that owns the scheduler and cache managers, one device
//! actor per device (own thread) that owns pools and metadata and runs the ops, and a
//! draft-replay actor for speculative decoding (kameo actors on tokio).

mod coordinator;
mod device;
mod draft;
mod error;
mod event_stream;
mod faults;
mod handle;
mod metrics;
mod shared;
mod stats;
mod transfer;
mod windowed;

pub use coordinator::{
    CacheCounts, CommitAndStepReport, CommitReport, Drafts, EventSnapshot, FinishedReport,
    Scheduled, StepReport, StepTiming,
};
pub use draft::DraftReport;
pub use error::RuntimeError;
pub use event_stream::{
    EventBatch, EventSubscriber, RouterSnapshot, StreamItem, EVENT_STREAM_CAPACITY,
};
#[cfg(feature = "fault-injection")]
pub use faults::{DeviceFault, Misdirect};
pub use handle::{Events, KvCacheBuilder, KvCacheHandle, RuntimeInfo};
pub use shared::{LiveCounters, RuntimeShared};
pub use stats::{
    EventCounts, HistoryChunk, RuntimeStats, StepSample, TierUsage, HISTORY, ROLLING_WINDOW,
};
pub use transfer::{Lease, Transfers};
pub use windowed::{host_windowed_backend, WindowedBackendFactory, WindowedModel, WindowedSetup};
