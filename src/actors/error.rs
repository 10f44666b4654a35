//! Errors of the runtime handle.

use crate::config::ConfigError;
use crate::core::quota::QuotaError;
use crate::core::scheduler::SchedError;
use crate::core::KvError;
use crate::ids::RequestId;
use crate::layout::LayoutError;

use super::backend::DeviceError;

/// What a runtime call can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
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
    /// The caller's tokio runtime cannot host the actors.
    #[error("{0}")]
    Runtime(String),
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
