//! DeepSeek-V4's budget: one byte budget pays for every life cycle. The window life
//! cycles are sized first, from what they must hold at once ([`V4Demand`]); the
//! compressed life cycle gets every remaining byte as 256-token blocks. Every pool is
//! rounded up to [`ALLOC_GRANULARITY`], as for the other models.

use serde::Serialize;

use super::{resolve_budget, round_up, GpuBudget, QuotaError, QuotaInputs, ALLOC_GRANULARITY};
use crate::config::{ConfigError, EngineConfig, KvCacheConfig, V4Spec};
use crate::layout::{Retention, V4LifeCycle, V4Plan};

/// What the window life cycles must hold at once.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct V4Demand {
    /// Sequences scheduled at once.
    pub max_sequences: u32,
    /// Draft positions kept per sequence for rollback.
    pub drafts: u32,
    /// Positions written per step, all sequences together (prefill chunks included).
    pub max_batched_tokens: u32,
    /// Block boundaries whose tails (the window pages a request resuming there reads)
    /// are kept for prefix reuse.
    pub tail_boundaries: u32,
}

impl V4Demand {
    /// What the window life cycles of the model with sliding windows `spec` must hold
    /// at once under `config`: `scheduler.max_num_sequences` and `max_num_tokens`, the
    /// drafts of `spec_decode` (its rules for every model: mode `mtp` needs an MTP
    /// layer), and `tail_boundaries` retained tails. Drafts must stay below
    /// `max_num_tokens` (a decode step carries 1 + drafts tokens).
    pub fn of_config(
        config: &EngineConfig,
        spec: &V4Spec,
        tail_boundaries: u32,
    ) -> Result<V4Demand, ConfigError> {
        let s = &config.scheduler;
        let drafts = config
            .spec_decode
            .draft_tokens(&spec.name, spec.num_mtp_layers)?;
        if drafts >= s.max_num_tokens {
            return Err(ConfigError::Invalid {
                field: "spec_decode.draft_tokens",
                value: drafts.to_string(),
                why: "a decode step carries 1 + drafts tokens: keep drafts below \
                      scheduler.max_num_tokens"
                    .into(),
            });
        }
        Ok(V4Demand {
            max_sequences: s.max_num_sequences,
            drafts,
            max_batched_tokens: s.max_num_tokens,
            tail_boundaries,
        })
    }
}

/// Slots and bytes per life cycle for one budget.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct V4Capacity {
    /// Slots per life cycle, by id.
    pub slots: Vec<u64>,
    /// Bytes per life cycle (its pools rounded up), by id.
    pub bytes: Vec<u64>,
    /// 256-token blocks of the compressed life cycle.
    pub blocks: u64,
    /// Tokens those blocks hold.
    pub tokens: u64,
    /// Bytes of every pool together.
    pub allocated_bytes: u64,
}

/// Slots a window life cycle needs for `demand`:
///
/// `S · pages(W + d) + ⌈B / P⌉ + min(S, B) + tails · tail_pages`
///
/// A sequence writing `n` positions in a step touches at most `pages(W + d + n − 1) ≤
/// pages(W + d) + ⌈(n − 1) / P⌉` pages of `P` tokens (`W` retained, `d` drafts), and over
/// the step's sequences `Σ ⌈(nᵢ − 1)/P⌉ ≤ ⌈B/P⌉ + min(S, B)` for `B` positions in all.
/// A full life cycle needs no fixed share: `None`.
pub fn v4_window_slots(lc: &V4LifeCycle, demand: &V4Demand) -> Option<u64> {
    let per_seq = lc.window_pages(demand.drafts, 1)?;
    let s = u64::from(demand.max_sequences);
    let b = u64::from(demand.max_batched_tokens);
    Some(
        s * per_seq
            + b.div_ceil(u64::from(lc.tokens_per_page))
            + s.min(b)
            + u64::from(demand.tail_boundaries) * lc.tail_pages(),
    )
}

/// Bytes of `slots` slots of `lc`, each pool rounded up.
pub fn v4_life_cycle_bytes(lc: &V4LifeCycle, slots: u64) -> u64 {
    lc.pools
        .iter()
        .map(|p| round_up(slots.saturating_mul(p.slot_bytes()), ALLOC_GRANULARITY))
        .fold(0u64, u64::saturating_add)
}

/// Sizes `plan`'s pools for `budget` bytes: the window life cycles for `demand`, then as
/// many blocks as the rest holds. Refused when the windows alone do not fit, or leave
/// no room for one block.
pub fn v4_capacity(
    plan: &V4Plan,
    budget: u64,
    demand: &V4Demand,
) -> Result<V4Capacity, QuotaError> {
    let lcs = plan.life_cycles();
    let mut slots = vec![0u64; lcs.len()];
    let mut bytes = vec![0u64; lcs.len()];
    for lc in lcs {
        if let Some(n) = v4_window_slots(lc, demand) {
            slots[lc.id.index()] = n;
            bytes[lc.id.index()] = v4_life_cycle_bytes(lc, n);
        }
    }
    let windows: u64 = bytes.iter().fold(0, |a, &b| a.saturating_add(b));
    let full = lcs.iter().find(|l| l.retention == Retention::Full);
    let left = budget.checked_sub(windows);
    let blocks = match (full, left) {
        (_, None) => 0,
        (None, Some(_)) => 0,
        (Some(lc), Some(left)) => {
            // The largest count whose rounded pools fit in `left`.
            let (mut lo, mut hi) = (0u64, left / lc.slot_bytes().max(1) + 1);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if v4_life_cycle_bytes(lc, mid) <= left {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            slots[lc.id.index()] = lo;
            bytes[lc.id.index()] = v4_life_cycle_bytes(lc, lo);
            lo
        }
    };
    if left.is_none() || (full.is_some() && blocks == 0) {
        let block = full.map_or(0, |lc| v4_life_cycle_bytes(lc, 1));
        return Err(QuotaError::V4WindowsDoNotFit {
            budget,
            window_bytes: windows,
            block_bytes: block,
            max_sequences: demand.max_sequences,
            max_batched_tokens: demand.max_batched_tokens,
        });
    }
    let allocated_bytes = bytes.iter().sum();
    Ok(V4Capacity {
        slots,
        bytes,
        blocks,
        tokens: blocks * u64::from(plan.tokens_per_block()),
        allocated_bytes,
    })
}

/// What one configuration allocates on each device for a model with sliding windows:
/// the budget resolved as for every model (`max_gpu_total_bytes`, else
/// `free_gpu_memory_fraction` of the free memory, capped by `max_tokens`), the window
/// life cycles sized for the demand, the blocks the rest holds, and the host tier of the
/// compressed blocks. The runtime's builder sizes its pools from it and the `plan`
/// example prints it: planning and allocation are one computation, as
/// [`CapacityPlan`](super::CapacityPlan) is for the DSA models.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct WindowedCapacityPlan {
    /// The model's cache plan.
    pub plan: V4Plan,
    /// What the window life cycles are sized for.
    pub demand: V4Demand,
    /// Slots and bytes per life cycle.
    pub capacity: V4Capacity,
    /// The budget and what decided it; `slots` are the compressed life cycle's blocks.
    pub gpu: GpuBudget,
    /// Host-tier blocks of the compressed life cycle (0: no host tier).
    pub host_blocks: u64,
}

impl WindowedCapacityPlan {
    /// Sizes `plan`'s pools for `demand` from `kv`'s budget (`free_gpu_memory`: the
    /// device's free memory, when measured, for `free_gpu_memory_fraction`). Refused
    /// with the part that does not fit: no budget, the windows alone, a host tier past
    /// what page indices address.
    pub fn new(
        plan: V4Plan,
        demand: V4Demand,
        kv: &KvCacheConfig,
        free_gpu_memory: Option<u64>,
    ) -> Result<Self, QuotaError> {
        let t = u64::from(plan.tokens_per_block());
        // The bytes `max_tokens` needs: the windows and the blocks holding that many.
        let full = plan
            .life_cycles()
            .iter()
            .find(|l| l.retention == Retention::Full);
        let for_tokens = |tokens: u64| {
            let windows = plan
                .life_cycles()
                .iter()
                .filter_map(|lc| v4_window_slots(lc, &demand).map(|n| v4_life_cycle_bytes(lc, n)))
                .fold(0u64, u64::saturating_add);
            let blocks = full.map_or(0, |lc| v4_life_cycle_bytes(lc, tokens.div_ceil(t).max(1)));
            windows.saturating_add(blocks)
        };
        let q = QuotaInputs {
            max_gpu_total_bytes: kv.max_gpu_total_bytes,
            free_gpu_memory_fraction: kv.free_gpu_memory_fraction,
            free_gpu_memory,
            max_tokens: kv.max_tokens,
            max_util_for_resume: kv.max_util_for_resume,
        };
        let (bytes, source) = resolve_budget(&q, for_tokens)?;
        let capacity = v4_capacity(&plan, bytes, &demand)?;
        let block = plan.bytes_per_block().max(1);
        let host_blocks = kv.host_cache_size.map_or(0, |b| b / block);
        let max_slots = u64::from(u32::MAX);
        if host_blocks > max_slots {
            return Err(QuotaError::HostTierTooLarge {
                host_cache_size: kv.host_cache_size.unwrap_or(0),
                slots: host_blocks,
                max_slots,
                max_bytes: max_slots * block,
            });
        }
        let gpu = GpuBudget {
            bytes,
            source,
            slots: capacity.blocks,
            tokens: capacity.tokens,
            target_bytes: capacity.allocated_bytes,
            draft_bytes: 0,
            allocated_bytes: capacity.allocated_bytes,
        };
        Ok(WindowedCapacityPlan {
            plan,
            demand,
            capacity,
            gpu,
            host_blocks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::BudgetSource;
    use super::*;
    use crate::config::V4Spec;
    use crate::layout::V4LifeCycleKind;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn demand() -> V4Demand {
        V4Demand {
            max_sequences: 256,
            drafts: 3,
            max_batched_tokens: 8192,
            tail_boundaries: 1024,
        }
    }

    /// The configuration's budget resolves as for every model: explicit bytes, else the
    /// fraction of the free memory; `max_tokens` caps it (alone, it sizes it) at exactly
    /// the blocks holding that many tokens; no budget, a bad fraction and windows that
    /// do not fit are refused naming the part.
    #[test]
    fn a_windowed_capacity_plan_resolves_the_budget_like_every_model() {
        let p = V4Plan::new(&V4Spec::flash()).unwrap();
        let d = demand();
        let plan = |kv: &KvCacheConfig, free| WindowedCapacityPlan::new(p.clone(), d, kv, free);
        let mut kv = KvCacheConfig {
            max_gpu_total_bytes: Some(100 * GIB),
            ..KvCacheConfig::default()
        };
        let explicit = plan(&kv, Some(GIB)).unwrap();
        assert_eq!(explicit.capacity, v4_capacity(&p, 100 * GIB, &d).unwrap());
        assert_eq!(explicit.gpu.source, BudgetSource::Explicit);
        assert_eq!(explicit.gpu.slots, explicit.capacity.blocks);
        assert_eq!(
            explicit.gpu.allocated_bytes,
            explicit.capacity.allocated_bytes
        );
        assert!(explicit.gpu.allocated_bytes <= 100 * GIB);
        kv.max_gpu_total_bytes = None;
        kv.free_gpu_memory_fraction = 0.5;
        let fraction = plan(&kv, Some(200 * GIB)).unwrap();
        assert_eq!(fraction.capacity, explicit.capacity);
        assert_eq!(fraction.gpu.source, BudgetSource::FreeMemoryFraction);
        // 1,000 tokens need 4 blocks of 256: the budget is the windows and 4 blocks'
        // pools, rounded up to 2 MiB each, where a fifth block fits as well.
        kv.max_tokens = Some(1_000);
        let four = v4_capacity(&p, 100 * GIB, &d).unwrap();
        let windows = four.allocated_bytes - four.bytes[0];
        let full = p.life_cycle(V4LifeCycleKind::Compressed).unwrap();
        for free in [Some(200 * GIB), None] {
            let capped = plan(&kv, free).unwrap();
            assert_eq!(capped.gpu.bytes, windows + v4_life_cycle_bytes(full, 4));
            assert_eq!(capped.capacity.blocks, 5);
            assert_eq!(capped.gpu.tokens, 5 * 256);
            assert_eq!(capped.gpu.source, BudgetSource::MaxTokens);
            assert_eq!(capped.gpu.bytes, capped.capacity.allocated_bytes);
            assert_eq!(v4_life_cycle_bytes(full, 5), v4_life_cycle_bytes(full, 4));
        }
        kv.max_tokens = None;
        assert_eq!(plan(&kv, None).unwrap_err(), QuotaError::NoBudget);
        kv.free_gpu_memory_fraction = 1.5;
        assert!(matches!(
            plan(&kv, Some(GIB)).unwrap_err(),
            QuotaError::BadFraction {
                field: "free_gpu_memory_fraction",
                ..
            }
        ));
        kv.free_gpu_memory_fraction = 0.9;
        assert!(matches!(
            plan(&kv, Some(GIB)).unwrap_err(),
            QuotaError::V4WindowsDoNotFit { .. }
        ));
        kv.max_gpu_total_bytes = Some(100 * GIB);
        kv.host_cache_size = Some(10 * GIB);
        let host = plan(&kv, None).unwrap();
        assert_eq!(host.host_blocks, 10 * GIB / p.bytes_per_block());
    }

    /// Flash with 256 sequences, 3 drafts, 8,192 positions a step, 1,024 tails, worked by
    /// hand: window: 256 · 4 + 128 + 256 + 1024 · 2 = 3,456 slots of 44 · 37,440 B;
    /// state4: 256 · 4 + 2048 + 256 + 1024 · 1 = 4,352 slots of 21 · 4 · (8,192 + 2,048)
    /// B; state128: 256 · 18 + 1024 + 256 = 5,888 slots of 20 · 8 · 4,096 B.
    #[test]
    fn flash_window_slots_worked_by_hand() {
        let p = V4Plan::new(&V4Spec::flash()).unwrap();
        let d = demand();
        let slots = |k| v4_window_slots(p.life_cycle(k).unwrap(), &d);
        assert_eq!(slots(V4LifeCycleKind::Compressed), None);
        assert_eq!(slots(V4LifeCycleKind::Window), Some(3_456));
        assert_eq!(slots(V4LifeCycleKind::State4), Some(4_352));
        assert_eq!(slots(V4LifeCycleKind::State128), Some(5_888));
        let c = v4_capacity(&p, 100 * GIB, &d).unwrap();
        let r = |x: u64| x.div_ceil(2 * MIB) * 2 * MIB;
        let windows = r(3_456 * 44 * 37_440)
            + r(4_352 * 21 * 4 * 8_192)
            + r(4_352 * 21 * 4 * 2_048)
            + r(5_888 * 20 * 8 * 4_096);
        assert_eq!(c.bytes[1..].iter().sum::<u64>(), windows);
        // The rest as blocks: the largest count whose three rounded pools fit.
        let fits = |n: u64| r(n * 21 * 37_440) + r(n * 21 * 8_448) + r(n * 20 * 1_728);
        assert!(fits(c.blocks) <= 100 * GIB - windows);
        assert!(fits(c.blocks + 1) > 100 * GIB - windows);
        assert_eq!(c.tokens, c.blocks * 256);
        assert_eq!(c.allocated_bytes, windows + fits(c.blocks));
        assert!(c.allocated_bytes <= 100 * GIB);
    }

    /// The transient bound holds for every split of a step's positions over its
    /// sequences (seeded random splits, every draft count, every life cycle).
    #[test]
    fn the_window_bound_covers_every_split_of_a_step() {
        let p = V4Plan::new(&V4Spec::flash()).unwrap();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..2_000 {
            let s = 1 + next(64) as u32;
            let b = s + next(3_000) as u32;
            let drafts = next(4) as u32;
            // Split b positions over s sequences, each at least 1.
            let mut n = vec![1u32; s as usize];
            for _ in 0..(b - s) {
                n[next(u64::from(s)) as usize] += 1;
            }
            let d = V4Demand {
                max_sequences: s,
                drafts,
                max_batched_tokens: b,
                tail_boundaries: 0,
            };
            for lc in p.life_cycles() {
                let Some(bound) = v4_window_slots(lc, &d) else {
                    continue;
                };
                let used: u64 = n
                    .iter()
                    .map(|&ni| lc.window_pages(drafts, ni).unwrap())
                    .sum();
                assert!(used <= bound, "{:?}: {used} > {bound}", lc.kind);
            }
        }
    }

    #[test]
    fn windows_that_do_not_fit_are_a_typed_error() {
        let p = V4Plan::new(&V4Spec::flash()).unwrap();
        let e = v4_capacity(&p, GIB, &demand()).unwrap_err();
        let QuotaError::V4WindowsDoNotFit { window_bytes, .. } = e else {
            panic!("{e}")
        };
        assert!(window_bytes > GIB);
        assert!(e.to_string().contains("max_sequences = 256"), "{e}");
        // Windows fit, not one block.
        let small = V4Demand {
            max_sequences: 1,
            drafts: 0,
            max_batched_tokens: 1,
            tail_boundaries: 0,
        };
        let w: u64 = p
            .life_cycles()
            .iter()
            .filter_map(|l| v4_window_slots(l, &small).map(|n| v4_life_cycle_bytes(l, n)))
            .sum();
        assert!(v4_capacity(&p, w, &small).is_err());
        assert!(v4_capacity(&p, w + 6 * MIB, &small).unwrap().blocks >= 1);
    }
}
