//! Runtime statistics: counters, rates, utilization per pool group and tier
//! ([`RuntimeStats`], cheap to ask for), and a bounded per-step history for plots,
//! fetched incrementally ([`HistoryChunk`]) so that nobody pays for copying it whole.

use std::collections::VecDeque;

use serde::Serialize;

use dsa_kv_core::core::scheduler::SchedulerStats;
use dsa_kv_core::core::GroupUsage;
use dsa_kv_core::ids::Tier;

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
    /// Requests preempted (suspended or dropped for recomputation) to make room in the
    /// step.
    pub preempted: u32,
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
    /// consumer that falls behind resynchronizes with `kv.events().take_with_snapshot()`).
    pub lost: u64,
}

/// A snapshot of the runtime's statistics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, kameo::Reply)]
pub struct RuntimeStats {
    /// The scheduler's counters: steps, requests submitted / finished / failed,
    /// preemptions, prefill and decode tokens, drafts proposed and accepted (flattened
    /// into the same JSON object).
    #[serde(flatten)]
    pub scheduler: SchedulerStats,
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
    /// Step samples dropped from the bounded history so far (it keeps the last
    /// [`HISTORY`]; read it with [`KvCacheHandle::history`](super::KvCacheHandle::history)).
    pub history_dropped: u64,
    /// KV transfers between engines: open exports and imports, and those whose lease
    /// ran out.
    pub transfers: dsa_kv_core::core::scheduler::TransferStats,
    /// Committed steps whose plan went back to the scheduler, whose later plans reuse
    /// its buffers (a plan still shared with a caller's `StepReport` waits until the
    /// report is dropped; one held longer than a few steps is freed instead).
    #[serde(default)]
    pub plans_recycled: u64,
    /// A model with sliding windows: lookups, tokens reused, blocks backed off to the
    /// deepest tail, tails linked, adopted, demoted and evicted (`None` otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub windows: Option<dsa_kv_core::core::WindowKindStats>,
}

/// Part of the per-step history, as
/// [`KvCacheHandle::history`](super::KvCacheHandle::history) returns it: the samples of
/// the steps from `since` on that the runtime still keeps, and whether some of them are
/// gone. A plotter that polls passes [`next_since`](Self::next_since) back each time and
/// gets every step once.
#[derive(Clone, Debug, Default, PartialEq, Serialize, kameo::Reply)]
pub struct HistoryChunk {
    /// The kept samples with `step >= since`, oldest first. Steps that failed on a
    /// device have no sample, so step numbers may skip.
    pub samples: Vec<StepSample>,
    /// The step of the oldest sample kept (`None` before the first step).
    pub first_kept_step: Option<u64>,
    /// Samples dropped from the bounded buffer since the runtime started (all steps).
    pub dropped: u64,
    /// Some samples of steps `>= since` were dropped before this call: the history from
    /// `since` up to `first_kept_step` is incomplete (the caller polled too rarely for
    /// the [`HISTORY`] steps the runtime keeps).
    pub gap: bool,
    /// The `since` of the next call: one past the last sample returned (`since` itself
    /// when none was).
    pub next_since: u64,
}

/// The bounded per-step history: the last `capacity` samples, in step order.
#[derive(Debug)]
pub(crate) struct History {
    samples: VecDeque<StepSample>,
    capacity: usize,
    dropped: u64,
    /// The step of the newest sample dropped.
    last_dropped_step: Option<u64>,
}

impl History {
    /// An empty history keeping the last `capacity` samples (at least one).
    pub(super) fn new(capacity: usize) -> Self {
        History {
            samples: VecDeque::new(),
            capacity: capacity.max(1),
            dropped: 0,
            last_dropped_step: None,
        }
    }

    /// Appends the sample of a step after every sample kept (steps only increase).
    pub(super) fn push(&mut self, sample: StepSample) {
        debug_assert!(
            self.samples.back().is_none_or(|b| b.step < sample.step),
            "invariant: history steps increase ({:?} then {})",
            self.samples.back().map(|b| b.step),
            sample.step
        );
        if self.samples.len() == self.capacity {
            if let Some(old) = self.samples.pop_front() {
                self.dropped += 1;
                self.last_dropped_step = Some(old.step);
            }
        }
        self.samples.push_back(sample);
    }

    /// The newest sample (its step's commit adds to its coordinator time).
    pub(super) fn last_mut(&mut self) -> Option<&mut StepSample> {
        self.samples.back_mut()
    }

    /// Samples dropped so far.
    pub(super) fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The kept samples with `step >= since`.
    pub(super) fn since(&self, since: u64) -> HistoryChunk {
        let start = self.samples.partition_point(|s| s.step < since);
        let samples: Vec<StepSample> = self.samples.range(start..).copied().collect();
        HistoryChunk {
            next_since: samples.last().map_or(since, |s| s.step.saturating_add(1)),
            samples,
            first_kept_step: self.samples.front().map(|s| s.step),
            dropped: self.dropped,
            gap: self.last_dropped_step.is_some_and(|d| d >= since),
        }
    }
}

/// Steps in the rolling hit-rate window.
pub const ROLLING_WINDOW: usize = 256;
/// Steps kept in the history (about 6 MB of samples).
pub const HISTORY: usize = 100_000;

/// Rolling prefix hit rate over the last steps.
#[derive(Debug, Default)]
pub(crate) struct Rolling {
    window: VecDeque<(u64, u64)>,
    sum: (u64, u64),
}

impl Rolling {
    pub(super) fn push(&mut self, lookup: u64, reused: u64) {
        self.window.push_back((lookup, reused));
        self.sum.0 += lookup;
        self.sum.1 += reused;
        if self.window.len() > ROLLING_WINDOW {
            let (l, r) = self.window.pop_front().expect("invariant: non-empty");
            self.sum.0 -= l;
            self.sum.1 -= r;
        }
    }

    pub(super) fn rate(&self) -> f64 {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64) -> StepSample {
        StepSample {
            step,
            gpu_utilization: 0.5,
            host_utilization: 0.0,
            rolling_hit_rate: 0.25,
            scheduled: 3,
            preempted: 0,
            waiting: 1,
            manager_us: step * 10,
        }
    }

    fn steps(c: &HistoryChunk) -> Vec<u64> {
        c.samples.iter().map(|s| s.step).collect()
    }

    #[test]
    fn history_since_returns_the_steps_from_since_on() {
        let mut h = History::new(HISTORY);
        assert_eq!(
            h.since(0),
            HistoryChunk {
                samples: vec![],
                first_kept_step: None,
                dropped: 0,
                gap: false,
                next_since: 0,
            }
        );
        // Steps are numbered from 1.
        for step in 1..=10 {
            h.push(sample(step));
        }
        let all = h.since(0);
        assert_eq!(steps(&all), (1..=10).collect::<Vec<_>>());
        assert_eq!(all.samples[3], sample(4));
        assert_eq!(
            (all.first_kept_step, all.dropped, all.gap, all.next_since),
            (Some(1), 0, false, 11)
        );
        let tail = h.since(7);
        assert_eq!(steps(&tail), vec![7, 8, 9, 10]);
        assert_eq!(tail.next_since, 11);
        // The last step, then past the end: nothing, and the cursor stays.
        assert_eq!(steps(&h.since(10)), vec![10]);
        let past = h.since(11);
        assert_eq!(
            (past.samples.len(), past.next_since, past.gap),
            (0, 11, false)
        );
        assert_eq!(h.since(u64::MAX).next_since, u64::MAX);
        // Polling with next_since sees every step once.
        h.push(sample(11));
        assert_eq!(steps(&h.since(tail.next_since)), vec![11]);
    }

    #[test]
    fn history_reports_the_gap_once_the_buffer_wraps() {
        let mut h = History::new(4);
        for step in 1..=10 {
            h.push(sample(step));
        }
        // Steps 1..=6 were dropped; 7..=10 are kept.
        let c = h.since(0);
        assert_eq!(steps(&c), vec![7, 8, 9, 10]);
        assert_eq!(
            (c.first_kept_step, c.dropped, c.gap, c.next_since),
            (Some(7), 6, true, 11)
        );
        let c = h.since(6);
        assert_eq!((steps(&c), c.gap), (vec![7, 8, 9, 10], true));
        // From the oldest kept step on, nothing is missing.
        let c = h.since(7);
        assert_eq!((steps(&c), c.gap, c.dropped), (vec![7, 8, 9, 10], false, 6));
        let c = h.since(9);
        assert_eq!((steps(&c), c.gap), (vec![9, 10], false));
        // The newest sample is the one a commit updates.
        h.last_mut().expect("ten samples pushed").manager_us += 5;
        assert_eq!(h.since(10).samples[0].manager_us, 105);
    }

    #[test]
    fn history_keeps_the_last_history_steps() {
        let mut h = History::new(HISTORY);
        let n = HISTORY as u64 + 3;
        for step in 1..=n {
            h.push(sample(step));
        }
        let c = h.since(0);
        assert_eq!(c.samples.len(), HISTORY);
        assert_eq!((c.first_kept_step, c.dropped, c.gap), (Some(4), 3, true));
        assert_eq!(c.samples.last().map(|s| s.step), Some(n));
        assert_eq!(h.since(n - 1).samples.len(), 2);
    }
}
