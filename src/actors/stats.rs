//! Runtime statistics: counters, rates, utilization per pool group and tier, and a
//! per-step history for plots.

use std::collections::VecDeque;

use serde::Serialize;

use crate::core::GroupUsage;
use crate::ids::Tier;

/// Utilization of one pool group on one tier.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TierUsage {
    /// Tier.
    pub tier: Tier,
    /// Occupancy.
    pub usage: GroupUsage,
}

/// One step of the history.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StepSample {
    /// Step number.
    pub step: u64,
    /// GPU utilization of pool group 0 (unavailable / total).
    pub gpu_utilization: f64,
    /// Host utilization of pool group 0 (0 without a host tier).
    pub host_utilization: f64,
    /// Rolling prefix hit rate at this step.
    pub rolling_hit_rate: f64,
    /// Requests scheduled in the step.
    pub scheduled: u32,
    /// Requests waiting.
    pub waiting: u32,
    /// Coordinator time of the step (schedule + commit), microseconds.
    pub manager_us: u64,
}

/// KV events seen, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EventCounts {
    /// Blocks stored.
    pub stored: u64,
    /// Blocks removed.
    pub removed: u64,
    /// Tier moves.
    pub tier_updated: u64,
    /// Whole-cache clears (`reset_prefix_cache`).
    pub cleared: u64,
    /// Events dropped untaken: the runtime keeps the newest `event_capacity` (a
    /// consumer that falls behind resynchronizes with `take_events_with_snapshot`).
    pub lost: u64,
}

/// A snapshot of the runtime's statistics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, kameo::Reply)]
pub struct RuntimeStats {
    /// Steps run.
    pub steps: u64,
    /// Requests submitted.
    pub submitted: u64,
    /// Requests finished.
    pub finished: u64,
    /// Requests failed (errors, cancellation, lost devices).
    pub failed: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Prefill tokens processed.
    pub prefill_tokens: u64,
    /// Decode tokens processed (drafts included).
    pub decode_tokens: u64,
    /// Draft tokens proposed.
    pub drafts_proposed: u64,
    /// Draft tokens accepted.
    pub drafts_accepted: u64,
    /// `drafts_accepted / drafts_proposed`.
    pub draft_acceptance_rate: f64,
    /// Prompt tokens served from the cache / prompt tokens looked up, since start.
    pub prefix_hit_rate: f64,
    /// The same over the last `ROLLING_WINDOW` steps.
    pub rolling_hit_rate: f64,
    /// Bytes moved GPU → host.
    pub offload_bytes: u64,
    /// Bytes moved host → GPU.
    pub onboard_bytes: u64,
    /// Current utilization per pool group and tier.
    pub utilization: Vec<TierUsage>,
    /// KV events.
    pub events: EventCounts,
    /// Coordinator time (schedule + commit + bookkeeping), microseconds in total.
    pub manager_us: u64,
    /// Device time (slowest device per step), microseconds in total.
    pub device_us: u64,
    /// Token positions verified (× layers).
    pub tokens_verified: u64,
    /// Byte mismatches found by verification.
    pub mismatches: u64,
    /// Devices alive.
    pub devices_alive: usize,
    /// Draft replays (prepare → draft → restore on every device).
    pub draft_replays: u64,
    /// Per-step history (the last `HISTORY` steps).
    pub history: Vec<StepSample>,
}

/// Steps in the rolling hit-rate window.
pub const ROLLING_WINDOW: usize = 256;
/// Steps kept in the history.
pub const HISTORY: usize = 100_000;

/// Rolling prefix hit rate over the last steps.
#[derive(Debug, Default)]
pub(crate) struct Rolling {
    window: VecDeque<(u64, u64)>,
    sum: (u64, u64),
}

impl Rolling {
    pub fn push(&mut self, lookup: u64, reused: u64) {
        self.window.push_back((lookup, reused));
        self.sum.0 += lookup;
        self.sum.1 += reused;
        if self.window.len() > ROLLING_WINDOW {
            let (l, r) = self.window.pop_front().expect("invariant: non-empty");
            self.sum.0 -= l;
            self.sum.1 -= r;
        }
    }

    pub fn rate(&self) -> f64 {
        ratio(self.sum.1, self.sum.0)
    }
}

pub(crate) fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}
