//! Quota: from a byte budget to slots per pool group, and back. One formula,
//! [`bytes_for_slots`], serves capacity planning, the warm-up (static) estimate and the
//! allocation of the pools, so the budget and what is allocated cannot drift apart.
//!
//! Every pool is rounded up to the 2 MiB physical-allocation granularity of the GPU
//! pools (CUDA VMM chunks). All pool groups get the same slot count: DSA layers are full
//! attention, so a token needs one block in every life cycle. With speculative decoding
//! and a separate draft cache ([`CachePlans`]), one budget pays for both caches and both
//! get the same slot count (the scheduler mirrors every target decision in the draft
//! cache), so a slot costs the target's block bytes plus the draft's.

use serde::Serialize;

mod v4;

pub use v4::{
    v4_capacity, v4_life_cycle_bytes, v4_window_slots, V4Capacity, V4Demand, WindowedCapacityPlan,
};

use crate::config::{DsaModel, LayerSet};
use crate::layout::{LayoutError, LayoutKind, PoolPlan, Role};

/// Physical allocation granularity of a pool (2 MiB).
pub const ALLOC_GRANULARITY: u64 = 2 << 20;

fn round_up(x: u64, g: u64) -> u64 {
    x.div_ceil(g) * g
}

/// The caches one GPU budget pays for: the target cache and, with MTP and a separate
/// draft cache, the draft cache. Both get the same number of slots per pool group.
///
/// A plain `&PoolPlan` converts into a target-only set, so every function here takes
/// either.
#[derive(Clone, Copy, Debug)]
pub struct CachePlans<'a> {
    /// The target model's pools.
    pub target: &'a PoolPlan,
    /// The separate draft cache's pools, if any.
    pub draft: Option<&'a PoolPlan>,
}

impl<'a> CachePlans<'a> {
    /// The target cache and, when given, a separate draft cache.
    pub fn new(target: &'a PoolPlan, draft: Option<&'a PoolPlan>) -> Self {
        CachePlans { target, draft }
    }

    fn plans(&self) -> impl Iterator<Item = &'a PoolPlan> {
        std::iter::once(self.target).chain(self.draft)
    }

    /// Tokens per block (the target's; a draft cache uses the same).
    pub fn tokens_per_block(&self) -> u32 {
        self.target.tokens_per_block()
    }

    /// Bytes of one slot in every pool group of every cache (before rounding).
    pub fn bytes_per_block(&self) -> u64 {
        self.plans().map(PoolPlan::bytes_per_block).sum()
    }

    /// Bytes of one token in every cache (`Role::All` over all layers of both).
    pub fn cache_bytes_per_token(&self) -> u64 {
        self.plans().map(PoolPlan::cache_bytes_per_token).sum()
    }
}

impl<'a> From<&'a PoolPlan> for CachePlans<'a> {
    fn from(target: &'a PoolPlan) -> Self {
        CachePlans::new(target, None)
    }
}

/// Bytes the pools of `plan` take with `slots` slots in every pool group, each pool
/// rounded up to [`ALLOC_GRANULARITY`].
fn plan_bytes_for_slots(plan: &PoolPlan, slots: u64) -> u64 {
    plan.pool_groups()
        .iter()
        .flat_map(|g| g.pools.iter())
        .map(|p| round_up(slots.saturating_mul(p.slot_bytes), ALLOC_GRANULARITY))
        .fold(0u64, u64::saturating_add)
}

/// Bytes the pools take with `slots` slots in every pool group (of the target and, when
/// there is one, of the draft cache), each pool rounded up to [`ALLOC_GRANULARITY`].
pub fn bytes_for_slots<'a>(plans: impl Into<CachePlans<'a>>, slots: u64) -> u64 {
    plans
        .into()
        .plans()
        .map(|p| plan_bytes_for_slots(p, slots))
        .fold(0u64, u64::saturating_add)
}

/// The largest slot count (per pool group) whose pools fit in `budget` bytes.
pub fn slots_for_budget<'a>(plans: impl Into<CachePlans<'a>>, budget: u64) -> u64 {
    let plans = plans.into();
    let per_block = plans.bytes_per_block().max(1);
    let (mut lo, mut hi) = (0u64, budget / per_block + 1);
    // Invariant: bytes_for_slots(lo) ≤ budget < bytes_for_slots(hi).
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if bytes_for_slots(plans, mid) <= budget {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Bytes needed to hold `tokens` tokens (whole blocks).
pub fn bytes_for_tokens<'a>(plans: impl Into<CachePlans<'a>>, tokens: u64) -> u64 {
    let plans = plans.into();
    bytes_for_slots(plans, tokens.div_ceil(u64::from(plans.tokens_per_block())))
}

/// Tokens that fit in `budget` bytes.
pub fn tokens_for_budget<'a>(plans: impl Into<CachePlans<'a>>, budget: u64) -> u64 {
    let plans = plans.into();
    slots_for_budget(plans, budget) * u64::from(plans.tokens_per_block())
}

/// The warm-up (static) estimate: tokens of `model` that fit in `budget` bytes, computed
/// with the same plans and formula the allocation uses (`draft`: the layers of a
/// separate draft cache, which the same budget pays for).
pub fn estimate_tokens(
    model: &DsaModel,
    set: LayerSet,
    draft: Option<LayerSet>,
    kind: LayoutKind,
    tokens_per_block: u32,
    budget: u64,
) -> Result<u64, LayoutError> {
    let target = PoolPlan::for_model(model, set, kind, tokens_per_block)?;
    let draft = draft
        .map(|d| PoolPlan::for_model(model, d, kind, tokens_per_block))
        .transpose()?;
    Ok(tokens_for_budget(
        CachePlans::new(&target, draft.as_ref()),
        budget,
    ))
}

/// Bytes per token of each buffer role, summed over layers (and over both caches when
/// there is a draft cache), largest first (for "which component dominates").
pub fn bytes_per_token_by_role<'a>(plans: impl Into<CachePlans<'a>>) -> Vec<(Role, u64)> {
    let mut out: Vec<(Role, u64)> = Vec::new();
    for p in plans.into().plans().flat_map(|p| p.placements()) {
        let b = u64::from(p.row.bytes_per_token());
        match out.iter_mut().find(|(r, _)| *r == p.role) {
            Some(e) => e.1 += b,
            None => out.push((p.role, b)),
        }
    }
    out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    out
}

/// Inputs of the GPU budget.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct QuotaInputs {
    /// An explicit byte budget (wins over the fraction).
    pub max_gpu_total_bytes: Option<u64>,
    /// Fraction of free GPU memory to use when no explicit budget is set.
    pub free_gpu_memory_fraction: f64,
    /// Free GPU memory in bytes (measured by the device), when known.
    pub free_gpu_memory: Option<u64>,
    /// Cap: the budget never exceeds what `max_tokens` needs at `max_util_for_resume`.
    pub max_tokens: Option<u64>,
    /// Headroom factor for resume (default 0.97).
    pub max_util_for_resume: f64,
}

impl Default for QuotaInputs {
    fn default() -> Self {
        QuotaInputs {
            max_gpu_total_bytes: None,
            free_gpu_memory_fraction: 0.9,
            free_gpu_memory: None,
            max_tokens: None,
            max_util_for_resume: 0.97,
        }
    }
}

/// Where the budget came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetSource {
    /// `max_gpu_total_bytes`.
    Explicit,
    /// `free_gpu_memory_fraction × free memory`.
    FreeMemoryFraction,
    /// Capped by `max_tokens`.
    MaxTokens,
}

/// A GPU budget resolved to slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GpuBudget {
    /// The byte budget.
    pub bytes: u64,
    /// What decided it.
    pub source: BudgetSource,
    /// Slots per pool group.
    pub slots: u64,
    /// Tokens that fit (`slots × T`).
    pub tokens: u64,
    /// Bytes the target cache's pools take.
    pub target_bytes: u64,
    /// Bytes the separate draft cache's pools take (0 without one).
    pub draft_bytes: u64,
    /// Bytes all pools take: `target_bytes + draft_bytes` (≤ `bytes`).
    pub allocated_bytes: u64,
}

/// A budget that cannot work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum QuotaError {
    /// Neither an explicit budget nor the free memory is known.
    #[error(
        "no GPU budget: set max_gpu_total_bytes or max_tokens, or provide the free GPU memory \
         so that free_gpu_memory_fraction can apply"
    )]
    NoBudget,
    /// A fraction outside (0, 1].
    #[error("{field} = {value} is invalid: it must be in (0, 1]")]
    BadFraction {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// Not even `needed` tokens fit.
    #[error(
        "{needed} tokens need {needed_bytes} bytes but the budget is {budget} bytes ({fit} tokens \
         fit). One token costs {bytes_per_token} B, {dominant_role} dominating with \
         {dominant_bytes} B ({dominant_pct:.1}%). Raise the budget, lower the sequence length, \
         or use a smaller kv_dtype."
    )]
    DoesNotFit {
        /// Tokens required.
        needed: u64,
        /// Bytes they need.
        needed_bytes: u64,
        /// The budget.
        budget: u64,
        /// Tokens that fit.
        fit: u64,
        /// Bytes per token (all roles).
        bytes_per_token: u64,
        /// The largest component.
        dominant_role: Role,
        /// Its bytes per token.
        dominant_bytes: u64,
        /// Its share in percent.
        dominant_pct: f64,
    },
    /// Page indices would overflow.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The host tier asked for more slots than page indices can address.
    #[error(
        "host_cache_size = {host_cache_size} B would make {slots} host-tier slots per pool \
         group, past the {max_slots} that the kernels' int32 page indices address (the host \
         tier's pages are numbered like the GPU's): set host_cache_size to at most {max_bytes} B"
    )]
    HostTierTooLarge {
        /// The configured host budget.
        host_cache_size: u64,
        /// Slots it would make.
        slots: u64,
        /// The most slots page indices address.
        max_slots: u64,
        /// The bytes those take: the largest host budget that works.
        max_bytes: u64,
    },
    /// DeepSeek-V4: the window life cycles alone take the budget, or leave no room for
    /// one block.
    #[error(
        "the budget of {budget} B cannot hold the sliding windows and compressor states for \
         max_sequences = {max_sequences} and max_batched_tokens = {max_batched_tokens} \
         ({window_bytes} B) plus one 256-token block ({block_bytes} B): raise the budget or \
         lower max_sequences or max_batched_tokens"
    )]
    V4WindowsDoNotFit {
        /// The budget.
        budget: u64,
        /// What the window life cycles take.
        window_bytes: u64,
        /// One block of the compressed life cycle (its pools rounded up).
        block_bytes: u64,
        /// Sequences at once.
        max_sequences: u32,
        /// Positions per step.
        max_batched_tokens: u32,
    },
}

/// Checks that `needed` tokens fit in `budget`; the error says which component dominates
/// and how many tokens fit.
pub fn check_fits<'a>(
    plans: impl Into<CachePlans<'a>>,
    budget: u64,
    needed: u64,
) -> Result<(), QuotaError> {
    let plans = plans.into();
    let fit = tokens_for_budget(plans, budget);
    if needed <= fit {
        return Ok(());
    }
    let per_token = plans.cache_bytes_per_token();
    let (role, bytes) = bytes_per_token_by_role(plans)[0];
    Err(QuotaError::DoesNotFit {
        needed,
        needed_bytes: bytes_for_tokens(plans, needed),
        budget,
        fit,
        bytes_per_token: per_token,
        dominant_role: role,
        dominant_bytes: bytes,
        dominant_pct: 100.0 * bytes as f64 / per_token as f64,
    })
}

/// The byte budget of `q` and what decided it (every model's rule): the fractions
/// checked, then an explicit byte count, or `fraction × free memory`, or with neither
/// what `max_tokens` needs (`cap_for`), and never more than that.
pub(super) fn resolve_budget(
    q: &QuotaInputs,
    cap_for: impl Fn(u64) -> u64,
) -> Result<(u64, BudgetSource), QuotaError> {
    for (field, value) in [
        ("free_gpu_memory_fraction", q.free_gpu_memory_fraction),
        ("max_util_for_resume", q.max_util_for_resume),
    ] {
        if !(value > 0.0 && value <= 1.0) {
            return Err(QuotaError::BadFraction { field, value });
        }
    }
    let (mut bytes, mut source) = match (q.max_gpu_total_bytes, q.free_gpu_memory) {
        (Some(b), _) => (b, BudgetSource::Explicit),
        (None, Some(free)) => (
            (free as f64 * q.free_gpu_memory_fraction) as u64,
            BudgetSource::FreeMemoryFraction,
        ),
        (None, None) => match q.max_tokens {
            // No budget and no memory reading: the token cap alone sizes the cache.
            Some(t) => (cap_for(t), BudgetSource::MaxTokens),
            None => return Err(QuotaError::NoBudget),
        },
    };
    if let Some(t) = q.max_tokens {
        let cap = cap_for(t);
        if cap < bytes {
            bytes = cap;
            source = BudgetSource::MaxTokens;
        }
    }
    Ok((bytes, source))
}

/// Resolves the GPU budget: an explicit byte count, or `fraction × free memory`;
/// capped by `ceil(bytes_for_tokens(max_tokens) / max_util_for_resume)`. At least one
/// block must fit. With a draft cache the budget pays for both caches: `max_tokens`
/// counts tokens of the target (the draft cache holds the same tokens), and the slots
/// are the largest count whose target and draft pools together fit.
pub fn gpu_budget<'a>(
    plans: impl Into<CachePlans<'a>>,
    q: &QuotaInputs,
) -> Result<GpuBudget, QuotaError> {
    let plans = plans.into();
    let (bytes, source) = resolve_budget(q, |t| {
        (bytes_for_tokens(plans, t) as f64 / q.max_util_for_resume).ceil() as u64
    })?;
    check_fits(plans, bytes, u64::from(plans.tokens_per_block()))?;
    let slots = slots_for_budget(plans, bytes);
    for p in plans.plans() {
        p.check_page_index_range(slots)?;
    }
    let target_bytes = plan_bytes_for_slots(plans.target, slots);
    let draft_bytes = plans.draft.map_or(0, |d| plan_bytes_for_slots(d, slots));
    Ok(GpuBudget {
        bytes,
        source,
        slots,
        tokens: slots * u64::from(plans.tokens_per_block()),
        target_bytes,
        draft_bytes,
        allocated_bytes: target_bytes + draft_bytes,
    })
}

/// What one engine configuration allocates on each device: the target and draft pool
/// plans, the GPU budget resolved to slots, and the host tier. Built once from a
/// resolved configuration by [`CapacityPlan::new`]; the runtime sizes and reserves its
/// pools from it and the `plan` example prints it, so planning, the warm-up estimate
/// and allocation are one computation.
#[derive(Clone, Debug)]
pub struct CapacityPlan {
    /// The target cache's pools.
    pub target: PoolPlan,
    /// The separate draft cache's pools (MTP with `separate_draft_cache`).
    pub draft: Option<PoolPlan>,
    /// The GPU budget and the slots per pool group of both caches.
    pub gpu: GpuBudget,
    /// Host-tier slots per pool group of both caches (0: no host tier).
    pub host_slots: u64,
    /// Host-tier bytes of the target and draft caches together (≤ `host_cache_size`).
    pub host_bytes: u64,
}

impl CapacityPlan {
    /// Plans the pools of `resolved` (`free_gpu_memory`: the device's free memory, when
    /// measured, for `free_gpu_memory_fraction`).
    pub fn new(
        resolved: &crate::config::ResolvedConfig,
        free_gpu_memory: Option<u64>,
    ) -> Result<Self, QuotaError> {
        let kv = &resolved.config.kv_cache;
        let t = kv.tokens_per_block;
        let target =
            PoolPlan::for_model(&resolved.model, resolved.target_layers, resolved.layout, t)?;
        let draft = resolved
            .draft_layers
            .map(|set| PoolPlan::for_model(&resolved.model, set, resolved.layout, t))
            .transpose()?;
        let plans = CachePlans::new(&target, draft.as_ref());
        let gpu = gpu_budget(
            plans,
            &QuotaInputs {
                max_gpu_total_bytes: kv.max_gpu_total_bytes,
                free_gpu_memory_fraction: kv.free_gpu_memory_fraction,
                free_gpu_memory,
                max_tokens: kv.max_tokens,
                max_util_for_resume: kv.max_util_for_resume,
            },
        )?;
        let host_slots = kv.host_cache_size.map_or(0, |b| slots_for_budget(plans, b));
        // The host tier's pages are numbered like the GPU's: the same int32 bound.
        let max_slots = plans
            .plans()
            .map(|p| (i32::MAX as u64 + 1) / p.max_pages_per_slot().max(1))
            .min()
            .unwrap_or(u64::from(u32::MAX))
            .min(u64::from(u32::MAX));
        if host_slots > max_slots {
            return Err(QuotaError::HostTierTooLarge {
                host_cache_size: kv.host_cache_size.unwrap_or(0),
                slots: host_slots,
                max_slots,
                max_bytes: bytes_for_slots(plans, max_slots),
            });
        }
        let host_bytes = bytes_for_slots(plans, host_slots);
        Ok(CapacityPlan {
            target,
            draft,
            gpu,
            host_slots,
            host_bytes,
        })
    }

    /// The plans one budget pays for.
    pub fn plans(&self) -> CachePlans<'_> {
        CachePlans::new(&self.target, self.draft.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DsaModelSpec, KvDtype};

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn v32(kind: LayoutKind) -> PoolPlan {
        PoolPlan::for_model(&DsaModel::deepseek_v32(), LayerSet::Target, kind, 64).unwrap()
    }

    #[test]
    fn granularity_and_exact_slot_counts() {
        let p = v32(LayoutKind::V2);
        // Pools: 2,248,704 B and 515,328 B per slot.
        assert_eq!(bytes_for_slots(&p, 0), 0);
        assert_eq!(bytes_for_slots(&p, 1), 4 * MIB + 2 * MIB);
        assert_eq!(
            bytes_for_slots(&p, 10),
            round_up(22_487_040, 2 * MIB) + round_up(5_153_280, 2 * MIB)
        );
        assert_eq!(bytes_for_slots(&p, 10), 22 * MIB + 6 * MIB);
        let s = slots_for_budget(&p, 80 * GIB);
        assert!(bytes_for_slots(&p, s) <= 80 * GIB && bytes_for_slots(&p, s + 1) > 80 * GIB);
        assert_eq!(s, 31_077);
        assert_eq!(tokens_for_budget(&p, 80 * GIB), 31_077 * 64);
        assert_eq!(slots_for_budget(&p, 6 * MIB - 1), 0);
        assert_eq!(slots_for_budget(&p, 6 * MIB), 1);
        // V1 has 62 pools, each rounded: fewer slots fit the same budget.
        let v1 = v32(LayoutKind::V1);
        assert_eq!(bytes_for_slots(&v1, 1), 4 * MIB + 61 * 2 * MIB);
        assert!(slots_for_budget(&v1, 80 * GIB) <= s);
    }

    #[test]
    fn a_draft_cache_shares_the_budget_with_equal_slots() {
        let m = DsaModel::deepseek_v32();
        let target = v32(LayoutKind::V2);
        let draft = PoolPlan::for_model(&m, LayerSet::MtpOnly, LayoutKind::V2, 64).unwrap();
        let both = CachePlans::new(&target, Some(&draft));
        // Draft pools: 36,864 B (MLA) and 8,448 B (indexer) per slot, each rounded.
        assert_eq!(
            bytes_for_slots(both, 1),
            4 * MIB + 2 * MIB + 2 * MIB + 2 * MIB
        );
        assert_eq!(slots_for_budget(both, 10 * MIB - 1), 0);
        assert_eq!(slots_for_budget(both, 10 * MIB), 1);
        let s = slots_for_budget(both, 72 * GIB);
        assert_eq!(s, 27_518);
        assert!(bytes_for_slots(both, s) <= 72 * GIB && bytes_for_slots(both, s + 1) > 72 * GIB);
        let b = gpu_budget(
            both,
            &QuotaInputs {
                max_gpu_total_bytes: Some(72 * GIB),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(b.slots, s);
        assert_eq!(b.target_bytes, bytes_for_slots(&target, s));
        assert_eq!(b.draft_bytes, bytes_for_slots(&draft, s));
        assert_eq!(b.allocated_bytes, b.target_bytes + b.draft_bytes);
        assert_eq!(
            estimate_tokens(
                &m,
                LayerSet::Target,
                Some(LayerSet::MtpOnly),
                LayoutKind::V2,
                64,
                72 * GIB
            ),
            Ok(s * 64)
        );
        // The dominant component counts both caches' keys.
        assert_eq!(
            bytes_per_token_by_role(both),
            vec![(Role::Key, 62 * 576), (Role::IndexKey, 62 * 132)]
        );
    }

    #[test]
    fn block_bytes_are_role_all_accounting() {
        // One block costs exactly T × Σ_layers Role::All, for every preset, dtype and
        // layout: the quota cannot leave the indexer out.
        for spec in [
            DsaModelSpec::deepseek_v32(),
            DsaModelSpec::glm5(),
            DsaModelSpec::glm52(),
        ] {
            for kv_dtype in KvDtype::ALL {
                let m = DsaModel::new(DsaModelSpec {
                    kv_dtype,
                    ..spec.clone()
                })
                .unwrap();
                for set in [LayerSet::Target, LayerSet::TargetAndMtp, LayerSet::MtpOnly] {
                    for kind in [LayoutKind::V1, LayoutKind::V2] {
                        let p = PoolPlan::for_model(&m, set, kind, 64).unwrap();
                        let all: u64 = p
                            .layer_ids()
                            .map(|l| p.bytes_per_token(l, Role::All).unwrap())
                            .sum();
                        assert_eq!(all, m.bytes_per_token(set).total());
                        assert_eq!(
                            p.bytes_per_block(),
                            64 * all,
                            "{} {kv_dtype} {set:?} {kind:?}",
                            spec.name
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn warmup_estimate_uses_the_allocation_formula() {
        let m = DsaModel::deepseek_v32();
        for kind in [LayoutKind::V1, LayoutKind::V2] {
            let p = v32(kind);
            let est = estimate_tokens(&m, LayerSet::Target, None, kind, 64, 40 * GIB).unwrap();
            assert_eq!(est, tokens_for_budget(&p, 40 * GIB));
            let b = gpu_budget(
                &p,
                &QuotaInputs {
                    max_gpu_total_bytes: Some(40 * GIB),
                    ..Default::default()
                },
            )
            .unwrap();
            assert_eq!(b.tokens, est);
            assert!(b.allocated_bytes <= 40 * GIB);
        }
        assert_eq!(
            estimate_tokens(&m, LayerSet::Target, None, LayoutKind::V2, 32, GIB),
            Err(LayoutError::DsaTokensPerBlock { got: 32 })
        );
    }

    #[test]
    fn budget_sources_and_max_tokens_cap() {
        let p = v32(LayoutKind::V2);
        let frac = gpu_budget(
            &p,
            &QuotaInputs {
                free_gpu_memory: Some(100 * GIB),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(frac.bytes, 90 * GIB);
        assert_eq!(frac.source, BudgetSource::FreeMemoryFraction);
        let capped = gpu_budget(
            &p,
            &QuotaInputs {
                max_gpu_total_bytes: Some(90 * GIB),
                max_tokens: Some(64_000),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(capped.source, BudgetSource::MaxTokens);
        assert_eq!(
            capped.bytes,
            (bytes_for_tokens(&p, 64_000) as f64 / 0.97).ceil() as u64
        );
        assert!(capped.tokens >= 64_000);
        assert_eq!(
            gpu_budget(&p, &QuotaInputs::default()),
            Err(QuotaError::NoBudget)
        );
        assert!(matches!(
            gpu_budget(
                &p,
                &QuotaInputs {
                    max_gpu_total_bytes: Some(GIB),
                    free_gpu_memory_fraction: 1.5,
                    ..Default::default()
                }
            ),
            Err(QuotaError::BadFraction {
                field: "free_gpu_memory_fraction",
                ..
            })
        ));
    }

    #[test]
    fn does_not_fit_names_the_dominant_component() {
        let m = DsaModel::new(DsaModelSpec {
            kv_dtype: KvDtype::Fp8DsMla,
            ..DsaModelSpec::deepseek_v32()
        })
        .unwrap();
        let p = PoolPlan::for_model(&m, LayerSet::Target, LayoutKind::V2, 64).unwrap();
        assert_eq!(
            bytes_per_token_by_role(&p),
            vec![(Role::Key, 61 * 656), (Role::IndexKey, 61 * 132)]
        );
        let err = check_fits(&p, GIB, 1_000_000).unwrap_err();
        let QuotaError::DoesNotFit {
            fit,
            dominant_role,
            dominant_bytes,
            bytes_per_token,
            ..
        } = err.clone()
        else {
            panic!("{err:?}")
        };
        assert_eq!(
            (dominant_role, dominant_bytes, bytes_per_token),
            (Role::Key, 40_016, 48_068)
        );
        assert_eq!(fit, tokens_for_budget(&p, GIB));
        let msg = err.to_string();
        assert!(msg.contains("key dominating with 40016 B (83.2%)"), "{msg}");
        assert!(matches!(
            gpu_budget(
                &p,
                &QuotaInputs {
                    max_gpu_total_bytes: Some(MIB),
                    ..Default::default()
                }
            ),
            Err(QuotaError::DoesNotFit {
                needed: 64,
                fit: 0,
                ..
            })
        ));
    }
}
