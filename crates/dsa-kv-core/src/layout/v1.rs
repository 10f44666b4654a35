//! The V1 layout (TensorRT-LLM's `DSACacheManager` over the C++ block manager):
//! one primary pool `[block][layer][token][row]` whose page for (block `b`, local layer
//! `l`) is `b·L + l`; NVFP4 block scales in a second pool with the same geometry; and a
//! separate indexer pool per indexer layer, `[block][token values…][token scales…]`, with
//! page scale 1. Every pool shares one block-id space: one pool group, one life cycle.

use std::collections::BTreeMap;

use super::plan::{BufferPlacement, PageIndexConverter, PoolDesc, PoolGroupPlan, PoolPlan};
use super::v2::{buffer_geometry, canonical_specs, life_cycles_of};
use super::{LayerSpec, LayoutError, LayoutKind, Role};
use crate::ids::{LifeCycleId, PoolGroupId, PoolId};

impl PoolPlan {
    /// Plans the V1 layout. Requires one life cycle, a key buffer on every layer, uniform
    /// key (and block-scale) rows, and no value buffers.
    pub fn v1(tokens_per_block: u32, specs: Vec<LayerSpec>) -> Result<PoolPlan, LayoutError> {
        let layers = canonical_specs(tokens_per_block, specs)?;
        let life_cycles = life_cycles_of(&layers);
        if life_cycles.len() != 1 {
            return Err(LayoutError::V1LifeCycles {
                got: life_cycles.len(),
            });
        }
        let num_layers = layers.len() as u32;
        let first = &layers[0];
        let row_of = |spec: &LayerSpec, role| spec.buffers.iter().find(|b| b.role == role).copied();
        let key0 = row_of(first, Role::Key).ok_or(LayoutError::NoSuchBuffer {
            layer: first.layer,
            role: Role::Key,
            hint: ": the V1 primary pool needs a key buffer on every layer",
        })?;
        let scale0 = row_of(first, Role::KeyBlockScale);
        for spec in &layers {
            for b in &spec.buffers {
                match b.role {
                    Role::Key | Role::KeyBlockScale | Role::IndexKey => {}
                    role => {
                        return Err(LayoutError::NotSelfKOnly {
                            layer: spec.layer,
                            role,
                        })
                    }
                }
                if b.tokens_per_block_override.is_some() {
                    return Err(LayoutError::NotV1Compatible {
                        layer: spec.layer,
                        why: "the V1 layout has no page expansion",
                    });
                }
            }
            for (role, expected) in [(Role::Key, Some(key0)), (Role::KeyBlockScale, scale0)] {
                let got = row_of(spec, role);
                if got.map(|b| b.row) != expected.map(|b| b.row) {
                    return Err(LayoutError::NonUniformKey {
                        layer: spec.layer,
                        got: got.map_or(0, |b| b.row.bytes_per_token()),
                        first: first.layer,
                        expected: expected.map_or(0, |b| b.row.bytes_per_token()),
                    });
                }
            }
        }

        let group = PoolGroupId(0);
        let lc = LifeCycleId(0);
        let mut pools = Vec::new();
        let mut placements = Vec::new();
        let mut representatives = BTreeMap::new();
        // Primary pool, then block scales: L pages per block, layer l at offset l.
        for role in [Role::Key, Role::KeyBlockScale] {
            let Some(b0) = row_of(first, role) else {
                continue;
            };
            let (size, page_stride, _) = buffer_geometry(tokens_per_block, &b0);
            let pool = PoolId(pools.len() as u16);
            pools.push(PoolDesc {
                id: pool,
                slot_bytes: size * u64::from(num_layers),
            });
            representatives.insert((group, pool, role), first.layer);
            for (local, spec) in layers.iter().enumerate() {
                placements.push(BufferPlacement {
                    layer: spec.layer,
                    role,
                    life_cycle: lc,
                    pool_group: group,
                    pool,
                    offset_in_slot: local as u64 * size,
                    page_stride,
                    converter: PageIndexConverter {
                        scale: num_layers,
                        layer_offset: local as u32,
                        expansion: 1,
                    },
                    row: b0.row,
                    page_tokens: tokens_per_block,
                });
            }
        }
        // One indexer pool per indexer layer, one page per block.
        for spec in &layers {
            let Some(b) = row_of(spec, Role::IndexKey) else {
                continue;
            };
            let (size, page_stride, _) = buffer_geometry(tokens_per_block, &b);
            let pool = PoolId(pools.len() as u16);
            pools.push(PoolDesc {
                id: pool,
                slot_bytes: size,
            });
            representatives.insert((group, pool, Role::IndexKey), spec.layer);
            placements.push(BufferPlacement {
                layer: spec.layer,
                role: Role::IndexKey,
                life_cycle: lc,
                pool_group: group,
                pool,
                offset_in_slot: 0,
                page_stride,
                converter: PageIndexConverter {
                    scale: 1,
                    layer_offset: 0,
                    expansion: 1,
                },
                row: b.row,
                page_tokens: tokens_per_block,
            });
        }
        placements.sort_by_key(|p| (p.layer, p.role));
        Ok(PoolPlan {
            kind: LayoutKind::V1,
            tokens_per_block,
            layers,
            life_cycles,
            group_of_life_cycle: vec![group],
            pool_groups: vec![PoolGroupPlan {
                id: group,
                life_cycles: vec![lc],
                pools,
            }],
            placements,
            representatives,
        })
    }
}
