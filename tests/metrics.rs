//! The runtime's metrics (`metrics` facade) as an embedder's recorder sees them: after a
//! workload with reuse, preemption and offload, every published counter and gauge equals
//! the runtime's own `stats()`, and every step recorded its timings.
mod common;

use std::collections::HashMap;

use dsa_kv::actors::KvCacheBuilder;
use dsa_kv::config::EngineConfig;
use dsa_kv::core::scheduler::SubmitRequest;
use dsa_kv::core::ReuseScope;
use dsa_kv::ids::{RequestId, Tier, TokenId};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

fn config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.num_layers = Some(3);
    c.kv_cache.max_tokens = Some(1024);
    c.kv_cache.host_cache_size = Some(2048 * 3 * 708 + (8 << 20));
    c.scheduler.max_num_sequences = 16;
    c.scheduler.max_num_tokens = 512;
    c.scheduler.max_prefill_chunk = 256;
    c.scheduler.max_seq_len = 2048;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_metrics_equal_the_runtime_stats() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");
    let kv = KvCacheBuilder::new()
        .config(config())
        .start()
        .await
        .unwrap();
    const N: u64 = 24;
    for i in 0..N {
        let len = 200 + (i as u32 * 53) % 300;
        kv.submit(SubmitRequest {
            id: RequestId(i),
            scope: ReuseScope::SHARED,
            // A shared 150-token prefix, then the request's own tokens.
            prompt: (0..len)
                .map(|t| TokenId(if t < 150 { t } else { i as u32 * 1000 + t }))
                .collect(),
            max_new_tokens: 8 + (i as u32 % 9),
            priority: [10, 35, 60][i as usize % 3],
        })
        .await
        .unwrap();
    }
    let mut done = 0;
    let mut steps = 0u64;
    while done < N {
        let rep = kv.step(HashMap::new()).await.unwrap();
        steps += 1;
        let c = kv.commit(rep.outcomes_from(|_| TokenId(7))).await.unwrap();
        done += c.finished.len() as u64;
        assert!(steps < 5000);
    }
    // One more (empty) step publishes the state after the last commit.
    kv.step(HashMap::new()).await.unwrap();
    let st = kv.stats().await.unwrap();
    kv.shutdown().await;
    assert!(st.scheduler.preemptions > 0 && st.offload_bytes > 0 && st.prefix_hit_rate > 0.0);

    let mut counters = HashMap::new();
    let mut gauges = HashMap::new();
    let mut histograms = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let k = key.key();
        let mut labels: Vec<String> = k
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let name = format!("{}{{{}}}", k.name(), labels.join(","));
        match value {
            DebugValue::Counter(v) => {
                counters.insert(name, v);
            }
            DebugValue::Gauge(v) => {
                gauges.insert(name, v.into_inner());
            }
            DebugValue::Histogram(v) => {
                histograms.insert(name, v.len());
            }
        }
    }
    let c = |n: &str| counters.get(&format!("{n}{{}}")).copied();
    assert_eq!(c("dsa_kv_steps_total"), Some(st.scheduler.steps));
    assert_eq!(
        c("dsa_kv_requests_submitted_total"),
        Some(st.scheduler.submitted)
    );
    assert_eq!(c("dsa_kv_requests_finished_total"), Some(N));
    assert_eq!(c("dsa_kv_requests_failed_total"), Some(0));
    assert_eq!(
        c("dsa_kv_preemptions_total"),
        Some(st.scheduler.preemptions)
    );
    assert_eq!(
        c("dsa_kv_prefill_tokens_total"),
        Some(st.scheduler.prefill_tokens)
    );
    assert_eq!(
        c("dsa_kv_decode_tokens_total"),
        Some(st.scheduler.decode_tokens)
    );
    assert_eq!(c("dsa_kv_offload_bytes_total"), Some(st.offload_bytes));
    assert_eq!(c("dsa_kv_onboard_bytes_total"), Some(st.onboard_bytes));
    assert_eq!(
        counters.get("dsa_kv_kv_events_total{kind=stored}").copied(),
        Some(st.events.stored)
    );
    assert_eq!(
        counters
            .get("dsa_kv_kv_events_total{kind=removed}")
            .copied(),
        Some(st.events.removed)
    );
    assert_eq!(c("dsa_kv_kv_events_dropped_total"), Some(st.events.lost));
    let g = |n: &str| gauges.get(n).copied();
    assert_eq!(g("dsa_kv_prefix_hit_rate{}"), Some(st.prefix_hit_rate));
    assert_eq!(g("dsa_kv_rolling_hit_rate{}"), Some(st.rolling_hit_rate));
    for u in &st.utilization {
        let tier = match u.tier {
            Tier::Gpu => "gpu",
            Tier::Host => "host",
        };
        let group = u.usage.pool_group.0;
        assert_eq!(
            g(&format!(
                "dsa_kv_cache_utilization{{pool_group={group},tier={tier}}}"
            )),
            Some(u.usage.utilization)
        );
        // Labels sorted by name.
        for (state, v) in [("free", u.usage.free), ("total", u.usage.total)] {
            assert_eq!(
                g(&format!(
                    "dsa_kv_cache_slots{{pool_group={group},state={state},tier={tier}}}"
                )),
                Some(f64::from(v)),
                "{tier} {state}"
            );
        }
    }
    // One sample per step in each timing histogram.
    for h in [
        "dsa_kv_step_manager_seconds{}",
        "dsa_kv_step_device_seconds{}",
        "dsa_kv_step_runtime_seconds{}",
    ] {
        assert_eq!(
            histograms.get(h).copied(),
            Some(st.scheduler.steps as usize),
            "{h}"
        );
    }
}
