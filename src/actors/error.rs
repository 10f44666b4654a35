//! Errors of the runtime handle.

use dsa_kv_core::config::ConfigError;
use dsa_kv_core::core::quota::QuotaError;
use dsa_kv_core::core::scheduler::SchedError;
use dsa_kv_core::core::KvError;
use dsa_kv_core::ids::RequestId;
use dsa_kv_core::layout::LayoutError;

use dsa_kv_device::backend::DeviceError;

/// What a runtime call can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// The configuration cannot run.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The budget cannot hold the model.
    #[error(transparent)]
    Quota(#[from] QuotaError),
    /// The layout cannot be planned.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A cache-manager error.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A scheduling error.
    #[error(transparent)]
    Scheduler(#[from] SchedError),
    /// A device error.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A device died; the requests whose pages it held were failed.
    #[error(
        "device {device} is gone ({reason}); {failed} request(s) holding pages on it were failed"
    )]
    DeviceLost {
        /// Device index.
        device: usize,
        /// Why it stopped.
        reason: String,
        /// Requests failed.
        failed: usize,
    },
    /// Every device is gone.
    #[error("no device is left: restart the runtime")]
    NoDevices,
    /// Devices computed different results for one step (tensor-parallel ranks must
    /// agree); the step's requests were failed.
    #[error(
        "step {step}: device {device} returned other {what} than device 0 (every device must \
         compute the same)"
    )]
    DevicesDisagree {
        /// The step.
        step: u64,
        /// The first device that disagreed.
        device: usize,
        /// What differed: sampled outcomes, draft proposals, or who samples.
        what: &'static str,
    },
    /// A builder setting past its limit.
    #[error("KvCacheBuilder::{setting}({value}) is too large: at most {max}")]
    BadSetting {
        /// The builder method.
        setting: &'static str,
        /// Its value.
        value: u64,
        /// The largest accepted.
        max: u64,
    },
    /// The request failed.
    #[error("request {id} failed: {reason}")]
    RequestFailed {
        /// The request.
        id: RequestId,
        /// Why.
        reason: String,
    },
    /// `reset_prefix_cache` while requests hold KV pages; nothing was changed.
    #[error(
        "cannot reset the prefix cache: {requests} request(s) hold KV pages (running, in the \
         step in flight, or preempted with their pages kept); let them finish or cancel them, \
         then reset again (nothing was changed)"
    )]
    PrefixCacheInUse {
        /// Requests holding pages.
        requests: usize,
    },
    /// The runtime is not running (shut down, or its coordinator stopped).
    #[error("the KV-cache runtime is not running: {0}")]
    NotRunning(String),
    /// A KV transfer between engines was refused (nothing was reserved or pinned).
    #[error("KV transfer refused: {0}")]
    Transfer(String),
    /// A KV transport failed (opening or closing an import's window).
    #[error(transparent)]
    Transport(#[from] dsa_kv_device::transfer::TransportError),
    /// `start` was called outside a tokio runtime.
    #[error("KvCacheBuilder::start needs a tokio runtime (call it from async code)")]
    NoTokioRuntime,
    /// `start` was called on a current-thread tokio runtime.
    #[error(
        "KvCacheBuilder::start needs a multi-thread tokio runtime: device actors run on their \
         own threads (use #[tokio::main] or #[tokio::test(flavor = \"multi_thread\")])"
    )]
    CurrentThreadRuntime,
    /// The budget resolves to more slots per pool group than slot ids address.
    #[error(
        "{slots} slots per pool group is more than this crate addresses (at most {max}): lower \
         the KV budget or max_tokens"
    )]
    TooManySlots {
        /// Slots the budget resolved to.
        slots: u64,
        /// The most slot ids address.
        max: u64,
    },
    /// A cache's pools do not fit in what is left of `max_gpu_total_bytes`. (`start`
    /// sizes both caches inside the budget, so its reservations are a cross-check.)
    #[error(transparent)]
    Reservation(#[from] dsa_kv_core::sync::QuotaError),
    /// An actor failed while starting.
    #[error("the {actor} did not start: {reason}")]
    StartFailed {
        /// Which actor.
        actor: &'static str,
        /// Why.
        reason: String,
    },
    /// Verification was asked for together with a framework forward.
    #[error(
        "verification ({verify:?}) reads back the synthetic writer's KV, but a framework \
         forward writes its own: use Verification::Off with KvCacheBuilder::forward"
    )]
    VerifyNeedsSyntheticWriter {
        /// The verification asked for.
        verify: dsa_kv_device::Verification,
    },
    /// `check_invariants` found the cache state inconsistent (a bug: please report it).
    #[error("cache invariant violated: {0}")]
    InvariantViolated(String),
    /// A device index that this runtime does not have (or no longer has).
    #[error("device {index} does not exist or is gone (this runtime has {devices} device(s))")]
    NoSuchDevice {
        /// The index asked for.
        index: usize,
        /// Devices the runtime started with.
        devices: usize,
    },
}

impl<M, E: Into<RuntimeError>> From<kameo::error::SendError<M, E>> for RuntimeError {
    fn from(e: kameo::error::SendError<M, E>) -> Self {
        use kameo::error::SendError as S;
        match e {
            S::HandlerError(e) => e.into(),
            S::ActorNotRunning(_) | S::ActorStopped => {
                RuntimeError::NotRunning("the actor has stopped".into())
            }
            S::ActorRestarting(_) => RuntimeError::NotRunning("the actor is restarting".into()),
            S::MailboxFull(_) => RuntimeError::NotRunning("the mailbox is full".into()),
            S::Timeout(_) => RuntimeError::NotRunning("timed out".into()),
        }
    }
}

impl From<std::convert::Infallible> for RuntimeError {
    fn from(e: std::convert::Infallible) -> Self {
        match e {}
    }
}

impl From<kameo::error::Infallible> for RuntimeError {
    fn from(e: kameo::error::Infallible) -> Self {
        match e {}
    }
}
