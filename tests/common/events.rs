//! A consumer of KV events, as a router keeps one: replayed in order, the events must
//! describe exactly the reuse tree the manager holds.

use std::collections::BTreeMap;

use dsa_kv::core::{BlockKey, KvEvent};
use dsa_kv::ids::{LifeCycleId, Tier};

/// What a router learns from the KV events: (block key, life cycle) → tier.
pub(crate) struct EventMirror {
    tiers: BTreeMap<(BlockKey, LifeCycleId), Tier>,
    n_lc: usize,
}

impl EventMirror {
    /// An empty mirror of a cache with `n_lc` life cycles.
    pub(crate) fn new(n_lc: usize) -> Self {
        EventMirror {
            tiers: BTreeMap::new(),
            n_lc,
        }
    }

    /// Applies events in order; each must agree with what the mirror already knows.
    pub(crate) fn apply(&mut self, events: &[KvEvent]) {
        for e in events {
            match *e {
                KvEvent::Stored { key, tier, .. } => {
                    for lc in 0..self.n_lc {
                        let old = self.tiers.insert((key, LifeCycleId(lc as u16)), tier);
                        assert_eq!(old, None, "{e:?}: the block was already stored");
                    }
                }
                KvEvent::Removed { key } => {
                    let before = self.tiers.len();
                    self.tiers.retain(|k, _| k.0 != key);
                    assert_eq!(before - self.tiers.len(), self.n_lc, "{e:?}: unknown block");
                }
                KvEvent::TierUpdated {
                    key,
                    life_cycle,
                    from,
                    to,
                } => {
                    let tier = self
                        .tiers
                        .get_mut(&(key, life_cycle))
                        .unwrap_or_else(|| panic!("{e:?}: unknown block"));
                    assert_eq!(*tier, from, "{e:?}: the events had it on {tier}");
                    *tier = to;
                }
                KvEvent::AllBlocksCleared => self.tiers.clear(),
            }
        }
    }

    /// (key, life cycle, tier) of every page the events say is cached, sorted.
    pub(crate) fn pages(&self) -> Vec<(BlockKey, LifeCycleId, Tier)> {
        self.tiers.iter().map(|(k, &t)| (k.0, k.1, t)).collect()
    }
}
