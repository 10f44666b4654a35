//! State the actors share outside messages (built on `crate::sync`, loom-checked):
//! completion fences published by the devices, each device's current metadata bindings,
//! live counters the handle reads without a mailbox round trip, and the quota ledger.

use serde::Serialize;

use dsa_kv_core::ids::Fence;
use dsa_kv_core::metadata::Bindings;
use dsa_kv_core::sync::{FenceBoard, Published, QuotaLedger, SeqCounters};

/// Index of each live counter in [`RuntimeShared::counters`].
pub(crate) mod counter {
    pub(crate) const SUBMITTED: usize = 0;
    pub(crate) const FINISHED: usize = 1;
    pub(crate) const FAILED: usize = 2;
    pub(crate) const STEPS: usize = 3;
}

/// Shared by the coordinator, the device actors and every handle.
#[derive(Debug)]
pub struct RuntimeShared {
    /// Target fences each device completed.
    pub fences: FenceBoard,
    /// Each device's bound metadata set (`None` before its first step).
    pub bindings: Vec<Published<Option<Bindings>>>,
    /// Submitted, finished, failed, steps.
    pub(crate) counters: SeqCounters<4>,
    /// GPU bytes reserved by the target and draft caches (per device).
    pub quota: QuotaLedger,
}

impl RuntimeShared {
    pub(crate) fn new(devices: usize, quota_capacity: u64) -> Self {
        RuntimeShared {
            fences: FenceBoard::new(devices),
            bindings: (0..devices).map(|_| Published::new(None)).collect(),
            counters: SeqCounters::new(),
            quota: QuotaLedger::new(quota_capacity),
        }
    }
}

/// A consistent snapshot of the live counters (read without asking the coordinator).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LiveCounters {
    /// Requests submitted.
    pub submitted: u64,
    /// Requests finished.
    pub finished: u64,
    /// Requests failed.
    pub failed: u64,
    /// Requests admitted and not yet finished or failed.
    pub in_flight: u64,
    /// Steps run.
    pub steps: u64,
    /// The highest target fence every live device completed.
    pub completed_fence: Fence,
}

/// Awaits `fut`, first polling it for up to `spin` without yielding the worker: a reply
/// that arrives meanwhile costs no wake-up of a parked worker (the device thread's reply
/// otherwise has to unpark one, tens of microseconds on a large host). Polled outside
/// tokio's cooperative budget so a ready reply is seen as ready.
pub(crate) async fn spin_then_await<F: std::future::Future + Unpin>(
    mut fut: F,
    spin: std::time::Duration,
) -> F::Output {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    if !spin.is_zero() {
        let until = std::time::Instant::now() + spin;
        let mut cx = Context::from_waker(Waker::noop());
        loop {
            let poll = std::pin::Pin::new(&mut tokio::task::unconstrained(&mut fut)).poll(&mut cx);
            if let Poll::Ready(out) = poll {
                return out;
            }
            if std::time::Instant::now() >= until {
                break;
            }
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
    }
    fut.await
}
