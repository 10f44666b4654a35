//! Models with sliding windows (DeepSeek-V4) through the one runtime: the builder's
//! [`KvCacheBuilder::windowed`] sizes the pools from the configuration's budget
//! (`core::quota::v4_capacity`), builds the [`ModelCache`] (compressed blocks + window
//! rings with tails) under the one [`Scheduler`], and the same coordinator and device
//! actors as every other model: the same handle, step reports, events, metrics and
//! spans. What differs is data: the cache's attention kinds, and the device backends
//! (built by a [`WindowedBackendFactory`]: the host's
//! [`WindowedHostDevice`](dsa_kv_device::windowed::WindowedHostDevice) with the
//! framework's forward, or a GPU device).

use std::sync::Arc;

use dsa_kv_core::config::limits;
use dsa_kv_core::config::V4Spec;
use dsa_kv_core::core::quota::{
    v4_life_cycle_bytes, BudgetSource, GpuBudget, V4Demand, WindowedCapacityPlan,
};
use dsa_kv_core::core::scheduler::{Scheduler, SchedulerLimits};
use dsa_kv_core::core::{ManagerOptions, ModelCache, TierSlots, WindowedSlots};
use dsa_kv_core::layout::{LayoutKind, Retention, V4Plan};
use dsa_kv_device::backend::VerifiedLayers;
use dsa_kv_device::{DeviceBackend, DeviceError};

use super::error::RuntimeError;
use super::handle::{KvCacheBuilder, KvCacheHandle, RuntimeInfo};
use super::shared::RuntimeShared;

/// What a windowed model's device backend is built from.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct WindowedSetup {
    /// The model's cache plan.
    pub plan: V4Plan,
    /// The slots the cache was built with (the device's pools hold as many).
    pub slots: WindowedSlots,
    /// Positions a request may reach (`max_seq_len` + drafts + 1).
    pub max_positions: u32,
}

/// Builds one device backend of a windowed model: `(device index, setup)`.
pub type WindowedBackendFactory =
    Arc<dyn Fn(usize, &WindowedSetup) -> Result<Box<dyn DeviceBackend>, DeviceError> + Send + Sync>;

/// A model with sliding windows and how its devices are built. See the module docs.
#[derive(Clone)]
#[non_exhaustive]
pub struct WindowedModel {
    /// The model's layer structure (e.g. [`V4Preset::spec`](dsa_kv_core::config::V4Preset::spec)).
    pub spec: V4Spec,
    /// Builds each device.
    pub backend: WindowedBackendFactory,
    /// Every `tail_interval`-th block boundary of a sequence keeps its window tail in
    /// LRU order (see [`ModelCache::windowed`]).
    pub tail_interval: u32,
    /// Block boundaries whose tails the pools are sized to keep beyond the running
    /// sequences' (`V4Demand::tail_boundaries`).
    pub tail_boundaries: u32,
    /// Slot counts to use instead of sizing the pools from the budget (tests and tools
    /// that need a small cache; the budget must still cover their bytes).
    pub slots: Option<WindowedSlots>,
}

impl WindowedModel {
    /// `spec` with devices from `backend`; tails at every 16th boundary, room for 16.
    pub fn new(spec: V4Spec, backend: WindowedBackendFactory) -> Self {
        WindowedModel {
            spec,
            backend,
            tail_interval: 16,
            tail_boundaries: 16,
            slots: None,
        }
    }
}

/// Host devices whose forward writes nothing and leaves sampling to the engine
/// ([`WritesNothing`](dsa_kv_device::windowed::WritesNothing)): what a windowed preset
/// starts on when the builder is given no devices, as a DSA model starts on host devices
/// with the synthetic writer. A model's own forward comes with
/// [`KvCacheBuilder::windowed_backend`].
pub fn host_windowed_backend() -> WindowedBackendFactory {
    Arc::new(|i, s: &WindowedSetup| {
        let forward = Box::new(dsa_kv_device::windowed::WritesNothing);
        let d = dsa_kv_device::windowed::WindowedHostDevice::new(i, &s.plan, &s.slots, forward)?;
        Ok(Box::new(d) as Box<dyn DeviceBackend>)
    })
}

fn bad(setting: &'static str, value: u64, max: u64) -> RuntimeError {
    RuntimeError::BadSetting {
        setting,
        value,
        max,
    }
}

impl KvCacheBuilder {
    /// Serves a model with sliding windows (DeepSeek-V4) instead of the configuration's
    /// DSA model: its cache is sized from the budget of every pool on one device
    /// (`kv_cache.max_gpu_total_bytes`, or the blocks `kv_cache.max_tokens` needs; the
    /// sizing is [`WindowedCapacityPlan`], what `plan` prints) and
    /// `kv_cache.host_cache_size` (the host tier of the compressed blocks), scheduled with `scheduler.*` and `spec_decode` (MTP
    /// drafts: `mode = "mtp"`, `draft_tokens`), on `parallel.tp_size` devices (or
    /// [`host_devices`](Self::host_devices)). A separate draft cache and partial-block
    /// reuse do not apply: they are turned off, with a warning in
    /// [`RuntimeInfo::warnings`].
    pub fn windowed(mut self, model: WindowedModel) -> Self {
        self.windowed = Some(model);
        self
    }

    /// The devices of a model with sliding windows named by the configuration
    /// (`model.preset = "deepseek-v4-flash"` or `"deepseek-v4-pro"`): `start` then serves
    /// that preset's structure ([`ModelConfig::windowed_spec`](dsa_kv_core::config::ModelConfig::windowed_spec))
    /// as [`windowed`](Self::windowed) would. Ignored for a DSA preset. Without it (and
    /// without a DSA [`backend`](Self::backend) or [`forward`](Self::forward)) a windowed
    /// preset starts on [`host_windowed_backend`].
    pub fn windowed_backend(mut self, backend: WindowedBackendFactory) -> Self {
        self.windowed_backend = Some(backend);
        self
    }

    /// [`start`](Self::start) for a windowed model.
    pub(super) async fn start_windowed(
        self,
        model: WindowedModel,
    ) -> Result<KvCacheHandle, RuntimeError> {
        let c = &self.config;
        let s = &c.scheduler;
        let invalid = |field: &'static str, value: String, why: &str| {
            RuntimeError::Config(dsa_kv_core::config::ConfigError::Invalid {
                field,
                value,
                why: why.into(),
            })
        };
        // The DSA defaults that do not apply are adjusted, and said so.
        let mut warnings = Vec::new();
        if c.spec_decode.separate_draft_cache {
            warnings.push(
                "spec_decode.separate_draft_cache ignored: a windowed model's MTP layer keeps \
                 its window in the model's own cache"
                    .to_string(),
            );
        }
        if c.kv_cache.enable_partial_reuse {
            warnings.push(
                "kv_cache.enable_partial_reuse turned off: a windowed model hits only at \
                 whole-block boundaries"
                    .to_string(),
            );
        }
        for w in &warnings {
            tracing::warn!("{w}");
        }
        let devices = self.devices.unwrap_or(c.parallel.tp_size as usize);
        if devices == 0 {
            return Err(RuntimeError::NoDevices);
        }
        if devices > limits::MAX_DEVICES as usize {
            return Err(bad(
                "host_devices",
                devices as u64,
                u64::from(limits::MAX_DEVICES),
            ));
        }
        c.scheduler.validate()?;
        c.transfer.validate()?;
        let demand = V4Demand::of_config(c, &model.spec, model.tail_boundaries)?;
        let drafts = demand.drafts;
        let plan = V4Plan::new(&model.spec)
            .map_err(|e| invalid("model", model.spec.name.clone(), &e.to_string()))?;
        let too_many = |n: u64| {
            u32::try_from(n).map_err(|_| RuntimeError::TooManySlots {
                slots: n,
                max: u64::from(u32::MAX),
            })
        };
        let (slots, budget) = match &model.slots {
            Some(slots) => {
                let budget = c.kv_cache.max_gpu_total_bytes.ok_or_else(|| {
                    invalid(
                        "kv_cache.max_gpu_total_bytes",
                        "none".into(),
                        "given slots are checked against an explicit byte budget per device",
                    )
                })?;
                // The bytes of the given slots, life cycle by life cycle.
                let mut windows = slots.windows.iter();
                let bytes = plan
                    .life_cycles()
                    .iter()
                    .map(|lc| {
                        let n = match lc.retention {
                            Retention::Full => slots.blocks.gpu.first().copied(),
                            _ => windows.next().copied(),
                        };
                        v4_life_cycle_bytes(lc, u64::from(n.unwrap_or(0)))
                    })
                    .fold(0u64, u64::saturating_add);
                if bytes > budget {
                    return Err(invalid(
                        "kv_cache.max_gpu_total_bytes",
                        budget.to_string(),
                        &format!("the given slots take {bytes} B: raise the budget"),
                    ));
                }
                let blocks = u64::from(slots.blocks.gpu.first().copied().unwrap_or(0));
                let t = u64::from(plan.tokens_per_block());
                let gpu = GpuBudget {
                    bytes: budget,
                    source: BudgetSource::Explicit,
                    slots: blocks,
                    tokens: blocks * t,
                    target_bytes: bytes,
                    draft_bytes: 0,
                    allocated_bytes: bytes,
                };
                (slots.clone(), gpu)
            }
            None => {
                // The computation `plan --model deepseek-v4-flash` prints.
                let cap = WindowedCapacityPlan::new(plan.clone(), demand, &c.kv_cache, None)?;
                let windows = plan
                    .life_cycles()
                    .iter()
                    .filter(|lc| lc.retention != Retention::Full)
                    .map(|lc| too_many(cap.capacity.slots[lc.id.index()]))
                    .collect::<Result<Vec<u32>, _>>()?;
                let host = too_many(cap.host_blocks)?;
                let slots = WindowedSlots {
                    blocks: TierSlots {
                        gpu: vec![too_many(cap.capacity.blocks)?],
                        host: if host > 0 { vec![host] } else { vec![] },
                    },
                    windows,
                };
                (slots, cap.gpu)
            }
        };
        let allocated = budget.allocated_bytes;
        let host = slots.blocks.host.first().copied().unwrap_or(0);
        let opts = ManagerOptions {
            enable_block_reuse: c.kv_cache.enable_block_reuse,
            enable_partial_reuse: false,
            max_util_for_resume: c.kv_cache.max_util_for_resume,
            record_events: true,
        };
        let cache = ModelCache::windowed(&plan, slots.clone(), opts, model.tail_interval)?;
        let limits = SchedulerLimits {
            max_num_sequences: s.max_num_sequences,
            max_num_tokens: s.max_num_tokens,
            max_prefill_chunk: s.max_prefill_chunk,
            max_seq_len: s.max_seq_len,
            draft_tokens: drafts,
            livelock_steps: 10_000,
            max_context_kv_tokens: u32::MAX,
            transfer_lease: std::time::Duration::from_millis(c.transfer.lease_ms),
        };
        let sched = Scheduler::new(cache, None, limits);
        let shared = Arc::new(RuntimeShared::new(devices, budget.bytes));
        shared
            .quota
            .try_reserve("the windowed model's pools", allocated)?;
        let setup = WindowedSetup {
            plan: plan.clone(),
            slots: slots.clone(),
            max_positions: s.max_seq_len + drafts + 1,
        };
        // Every backend is built (pools allocated) before any actor starts.
        let backends = (0..devices)
            .map(|i| (model.backend)(i, &setup))
            .collect::<Result<Vec<_>, _>>()?;
        let (coordinator, draft) = self
            .spawn_actors(sched, backends, shared.clone(), false, Some(plan.clone()))
            .await?;
        let t = u64::from(plan.tokens_per_block());
        let info = RuntimeInfo {
            model: model.spec.name.clone(),
            layout: LayoutKind::V2,
            bytes_per_token: plan.bytes_per_block() / t,
            budget,
            host_slots: u64::from(host),
            devices,
            draft_cache: false,
            draft_tokens: drafts,
            verified_layers: VerifiedLayers {
                target: (0, model.spec.compress_ratios.len()),
                draft: None,
            },
            window_slots: slots.windows.clone(),
            warnings,
        };
        tracing::info!(?info, "dsa-kv runtime started (windowed model)");
        Ok(KvCacheHandle::from_parts(coordinator, draft, info, shared))
    }
}
