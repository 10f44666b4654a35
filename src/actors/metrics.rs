//! The runtime's metrics through the [`metrics`] facade: after every step (off the
//! caller's path) the coordinator publishes its counters, the cache occupancy per tier
//! and pool group, hit rates, and the step's timings. Nothing is recorded unless the
//! embedder installs a recorder (`metrics-exporter-prometheus`, or any other); without
//! one each call is a load of the global recorder and a return.
//!
//! Names (all prefixed `dsa_kv_`): counters `steps_total`, `requests_submitted_total`,
//! `requests_finished_total`, `requests_failed_total`, `preemptions_total`,
//! `prefill_tokens_total`, `decode_tokens_total`, `drafts_proposed_total`,
//! `drafts_accepted_total`, `prefix_lookup_tokens_total`, `prefix_reused_tokens_total`,
//! `offload_bytes_total`, `onboard_bytes_total`, `evicted_pages_total` (committed pages
//! dropped from the last tier), `kv_events_total{kind}`, `kv_events_dropped_total`;
//! gauges `cache_slots{tier, pool_group, state = total | free | evictable}`,
//! `cache_utilization{tier, pool_group}`, `prefix_hit_rate`, `rolling_hit_rate`,
//! `requests_waiting`; histograms (seconds) `step_manager_seconds` (schedule + commit),
//! `step_device_seconds` (the slowest device's handler) and `step_runtime_seconds` (the
//! runtime's own work: everything but schedule, commit and the device handler). A model
//! with sliding windows adds counters `window_tails_total{event = linked | adopted |
//! evicted | demoted}` and `window_backed_off_blocks_total` (cached blocks a hit could
//! not use for want of a tail).

use metrics::{counter, gauge, histogram};

use super::coordinator::StepTiming;
use super::stats::{EventCounts, TierUsage};
use dsa_kv_core::core::scheduler::SchedulerStats;
use dsa_kv_core::core::ManagerStats;

/// What one publication reads.
pub(crate) struct Sample<'a> {
    pub sched: SchedulerStats,
    pub manager: ManagerStats,
    pub usage: &'a [TierUsage],
    pub events: EventCounts,
    pub hit_rate: f64,
    pub rolling_hit_rate: f64,
    pub waiting: usize,
    pub manager_us: u64,
    pub timing: &'a StepTiming,
    pub windows: Option<dsa_kv_core::core::WindowKindStats>,
}

/// Publishes one step's sample.
pub(crate) fn publish(s: &Sample<'_>) {
    let c = |name: &'static str, v: u64| counter!(name).absolute(v);
    c("dsa_kv_steps_total", s.sched.steps);
    c("dsa_kv_requests_submitted_total", s.sched.submitted);
    c("dsa_kv_requests_finished_total", s.sched.finished);
    c("dsa_kv_requests_failed_total", s.sched.failed);
    c("dsa_kv_preemptions_total", s.sched.preemptions);
    c("dsa_kv_prefill_tokens_total", s.sched.prefill_tokens);
    c("dsa_kv_decode_tokens_total", s.sched.decode_tokens);
    c("dsa_kv_drafts_proposed_total", s.sched.drafts_proposed);
    c("dsa_kv_drafts_accepted_total", s.sched.drafts_accepted);
    c("dsa_kv_prefix_lookup_tokens_total", s.manager.lookup_tokens);
    c("dsa_kv_prefix_reused_tokens_total", s.manager.reused_tokens);
    c("dsa_kv_offload_bytes_total", s.manager.offloaded_bytes);
    c("dsa_kv_onboard_bytes_total", s.manager.onboarded_bytes);
    c("dsa_kv_evicted_pages_total", s.manager.dropped_pages);
    for (kind, v) in [
        ("stored", s.events.stored),
        ("removed", s.events.removed),
        ("tier_updated", s.events.tier_updated),
        ("cleared", s.events.cleared),
    ] {
        counter!("dsa_kv_kv_events_total", "kind" => kind).absolute(v);
    }
    c("dsa_kv_kv_events_dropped_total", s.events.lost);
    if let Some(w) = &s.windows {
        for (event, v) in [
            ("linked", w.windows.tails_linked),
            ("adopted", w.windows.tails_adopted),
            ("evicted", w.windows.tails_evicted),
            ("demoted", w.tails_demoted),
        ] {
            counter!("dsa_kv_window_tails_total", "event" => event).absolute(v);
        }
        c("dsa_kv_window_backed_off_blocks_total", w.backed_off_blocks);
    }
    for u in s.usage {
        // The tier's display name ("gpu", "host").
        let (t, g) = (u.tier.to_string(), u.usage.pool_group.0.to_string());
        for (state, v) in [
            ("total", u.usage.total),
            ("free", u.usage.free),
            ("evictable", u.usage.evictable),
        ] {
            gauge!("dsa_kv_cache_slots", "tier" => t.clone(), "pool_group" => g.clone(), "state" => state)
                .set(f64::from(v));
        }
        gauge!("dsa_kv_cache_utilization", "tier" => t, "pool_group" => g).set(u.usage.utilization);
    }
    gauge!("dsa_kv_prefix_hit_rate").set(s.hit_rate);
    gauge!("dsa_kv_rolling_hit_rate").set(s.rolling_hit_rate);
    gauge!("dsa_kv_requests_waiting").set(s.waiting as f64);
    histogram!("dsa_kv_step_manager_seconds").record(s.manager_us as f64 / 1e6);
    let t = s.timing;
    histogram!("dsa_kv_step_device_seconds").record(t.device_ns as f64 / 1e9);
    let own = t.to_coordinator_ns
        + t.enqueue_ns
        + t.to_device_ns
        + t.from_device_ns
        + t.finish_ns
        + t.to_caller_ns;
    histogram!("dsa_kv_step_runtime_seconds").record(own as f64 / 1e9);
}
