//! The V2 planner (TensorRT-LLM KV cache manager V2's storage configuration, restated):
//! life cycles in first-seen order; per life cycle, buffers of equal per-block size
//! coalesce into one pool, pools sorted by slot size descending; life cycles with
//! identical slot-size lists merge into one pool group sharing slot ids.
//!
//! Layers are placed in ascending layer-id order, whatever order they were given in, so
//! the physical layout, the converters and the stable representatives (the first layer
//! per (pool, role) in physical order) do not depend on the caller's ordering.

use std::collections::BTreeMap;

use super::plan::{BufferPlacement, PageIndexConverter, PoolDesc, PoolGroupPlan, PoolPlan};
use super::{BufferSpec, LayerSpec, LayoutError, LayoutKind, LifeCycleKey, Role};
use crate::ids::{LayerId, LifeCycleId, PoolGroupId, PoolId};

/// Validates layer specs shared by both planners and sorts them by layer id.
pub(super) fn canonical_specs(
    tokens_per_block: u32,
    mut specs: Vec<LayerSpec>,
) -> Result<Vec<LayerSpec>, LayoutError> {
    if tokens_per_block == 0 || tokens_per_block > 1024 || !tokens_per_block.is_power_of_two() {
        return Err(LayoutError::TokensPerBlock {
            got: tokens_per_block,
        });
    }
    if specs.is_empty() {
        return Err(LayoutError::NoLayers);
    }
    specs.sort_by_key(|s| s.layer);
    for w in specs.windows(2) {
        if w[0].layer == w[1].layer {
            return Err(LayoutError::DuplicateLayer { layer: w[0].layer });
        }
    }
    for spec in &specs {
        if spec.buffers.is_empty() {
            return Err(LayoutError::EmptyLayer { layer: spec.layer });
        }
        for (i, b) in spec.buffers.iter().enumerate() {
            if b.role == Role::All {
                return Err(LayoutError::AllIsNotABuffer { layer: spec.layer });
            }
            if spec.buffers[..i].iter().any(|o| o.role == b.role) {
                return Err(LayoutError::DuplicateRole {
                    layer: spec.layer,
                    role: b.role,
                });
            }
            if b.row.bytes_per_token() == 0 {
                return Err(LayoutError::EmptyBuffer {
                    layer: spec.layer,
                    role: b.role,
                });
            }
            let entry = b.row.tokens_per_entry();
            let page_tokens = b.tokens_per_block_override.unwrap_or(tokens_per_block);
            if entry == 0 || !page_tokens.is_multiple_of(entry) {
                return Err(LayoutError::BadEntry {
                    layer: spec.layer,
                    role: b.role,
                    tokens_per_entry: entry,
                    page_tokens,
                });
            }
            if let Some(o) = b.tokens_per_block_override {
                if o == 0 || !tokens_per_block.is_multiple_of(o) {
                    return Err(LayoutError::BadOverride {
                        layer: spec.layer,
                        role: b.role,
                        got: o,
                        tokens_per_block,
                    });
                }
            }
        }
    }
    Ok(specs)
}

/// Life-cycle keys in first-seen order over ascending layers.
pub(super) fn life_cycles_of(layers: &[LayerSpec]) -> Vec<LifeCycleKey> {
    let mut out: Vec<LifeCycleKey> = Vec::new();
    for l in layers {
        if !out.contains(&l.life_cycle) {
            out.push(l.life_cycle);
        }
    }
    out
}

/// Page geometry of one buffer: (expanded bytes per block, page stride, expansion).
pub(super) fn buffer_geometry(tokens_per_block: u32, b: &BufferSpec) -> (u64, u64, u32) {
    let page_tokens = b.tokens_per_block_override.unwrap_or(tokens_per_block);
    let expansion = tokens_per_block / page_tokens;
    let stride = b.row.page_bytes(page_tokens);
    (stride * u64::from(expansion), stride, expansion)
}

/// Buffers of one life cycle with one expanded size, in physical order.
struct Coalesced {
    size: u64,
    members: Vec<(LayerId, BufferSpec)>,
}

impl Coalesced {
    fn slot_bytes(&self) -> u64 {
        self.size * self.members.len() as u64
    }
}

impl PoolPlan {
    /// Plans the V2 layout for arbitrary layer specs (any power-of-two tokens per block;
    /// [`PoolPlan::for_model`] enforces DSA's 64).
    pub fn v2(tokens_per_block: u32, specs: Vec<LayerSpec>) -> Result<PoolPlan, LayoutError> {
        let layers = canonical_specs(tokens_per_block, specs)?;
        let life_cycles = life_cycles_of(&layers);

        // Per life cycle: coalesced buffers sorted by slot size, descending (ties: larger
        // single buffers first, then first-seen).
        let variants: Vec<Vec<Coalesced>> = life_cycles
            .iter()
            .map(|key| {
                let mut by_size: Vec<Coalesced> = Vec::new();
                for spec in layers.iter().filter(|l| l.life_cycle == *key) {
                    for b in &spec.buffers {
                        let (size, _, _) = buffer_geometry(tokens_per_block, b);
                        match by_size.iter_mut().find(|c| c.size == size) {
                            Some(c) => c.members.push((spec.layer, *b)),
                            None => by_size.push(Coalesced {
                                size,
                                members: vec![(spec.layer, *b)],
                            }),
                        }
                    }
                }
                by_size.sort_by(|a, b| {
                    b.slot_bytes()
                        .cmp(&a.slot_bytes())
                        .then(b.size.cmp(&a.size))
                });
                by_size
            })
            .collect();

        // Merge life cycles with identical slot-size lists into pool groups.
        let mut group_lists: Vec<Vec<u64>> = Vec::new();
        let mut group_of_life_cycle = Vec::with_capacity(life_cycles.len());
        let mut pool_groups: Vec<PoolGroupPlan> = Vec::new();
        for (lc, variant) in variants.iter().enumerate() {
            let list: Vec<u64> = variant.iter().map(Coalesced::slot_bytes).collect();
            let gid = match group_lists.iter().position(|l| *l == list) {
                Some(g) => g,
                None => {
                    group_lists.push(list.clone());
                    pool_groups.push(PoolGroupPlan {
                        id: PoolGroupId(pool_groups.len() as u16),
                        life_cycles: Vec::new(),
                        pools: list
                            .iter()
                            .enumerate()
                            .map(|(i, &slot_bytes)| PoolDesc {
                                id: PoolId(i as u16),
                                slot_bytes,
                            })
                            .collect(),
                    });
                    pool_groups.len() - 1
                }
            };
            pool_groups[gid].life_cycles.push(LifeCycleId(lc as u16));
            group_of_life_cycle.push(PoolGroupId(gid as u16));
        }

        let mut placements = Vec::new();
        let mut representatives = BTreeMap::new();
        for group in &pool_groups {
            for &lc in &group.life_cycles {
                for (pool, coalesced) in variants[lc.index()].iter().enumerate() {
                    let scale = coalesced.members.len() as u32;
                    for (pos, (layer, b)) in coalesced.members.iter().enumerate() {
                        let (size, page_stride, expansion) = buffer_geometry(tokens_per_block, b);
                        let pool = PoolId(pool as u16);
                        representatives
                            .entry((group.id, pool, b.role))
                            .or_insert(*layer);
                        placements.push(BufferPlacement {
                            layer: *layer,
                            role: b.role,
                            life_cycle: lc,
                            pool_group: group.id,
                            pool,
                            offset_in_slot: pos as u64 * size,
                            page_stride,
                            converter: PageIndexConverter {
                                scale,
                                layer_offset: pos as u32,
                                expansion,
                            },
                            row: b.row,
                            page_tokens: tokens_per_block / expansion,
                        });
                    }
                }
            }
        }
        placements.sort_by_key(|p| (p.layer, p.role));
        Ok(PoolPlan {
            kind: LayoutKind::V2,
            tokens_per_block,
            layers,
            life_cycles,
            group_of_life_cycle,
            pool_groups,
            placements,
            representatives,
        })
    }
}
