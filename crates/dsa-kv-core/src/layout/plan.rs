//! The result of pool planning, shared by the V1 and V2 layouts: pool groups, pools,
//! per-(layer, role) placements with their page-index converters, stable pool
//! representatives, accounting (`Role::All`), and the V1-compatible primary-pool view.

use serde::Serialize;
use std::collections::BTreeMap;

use super::{LayerSpec, LayoutError, LayoutKind, LifeCycleKey, Role, RowLayout};
use crate::ids::{LayerId, LifeCycleId, PageIndex, PoolGroupId, PoolId, SlotId};

/// `page = slot × scale + layer_offset` (then × expansion + i for expanded buffers).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize)]
pub struct PageIndexConverter {
    /// Buffers of this kind per slot (pages per slot before expansion).
    pub scale: u32,
    /// This buffer's position inside the slot's coalesced buffer.
    pub layer_offset: u32,
    /// Pages per buffer per block (1 unless the buffer overrides tokens per block).
    pub expansion: u32,
}

impl PageIndexConverter {
    /// The first page of `slot` for this buffer.
    #[inline]
    pub fn page_index(&self, slot: SlotId) -> PageIndex {
        let base = slot.get() * self.scale + self.layer_offset;
        PageIndex(base * self.expansion)
    }
}

/// Where one (layer, role) buffer lives.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct BufferPlacement {
    /// The layer.
    pub layer: LayerId,
    /// The role.
    pub role: Role,
    /// The layer's life cycle.
    pub life_cycle: LifeCycleId,
    /// The pool group.
    pub pool_group: PoolGroupId,
    /// The pool inside the group.
    pub pool: PoolId,
    /// Byte offset of this buffer inside a slot of the pool ("SHARED" base offset).
    pub offset_in_slot: u64,
    /// Bytes of one page of this buffer (`bytes_per_token × tokens per page`).
    pub page_stride: u64,
    /// Page-index converter ("PER_LAYER" indices: byte address = pool base +
    /// `page × page_stride`).
    pub converter: PageIndexConverter,
    /// Token layout inside a page.
    pub row: RowLayout,
    /// Tokens per page (the plan's tokens per block, or the buffer's override).
    pub page_tokens: u32,
}

impl BufferPlacement {
    /// Byte offset, inside the pool, of this buffer's page for `slot`.
    #[inline]
    pub fn page_byte_offset(&self, slot: SlotId) -> u64 {
        u64::from(self.converter.page_index(slot).get()) * self.page_stride
    }

    /// Tokens per page of this buffer.
    pub fn tokens_per_page(&self) -> u32 {
        self.page_tokens
    }
}

/// One pool: a region holding `slot_bytes` per slot.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct PoolDesc {
    /// Index inside the group.
    pub id: PoolId,
    /// Bytes per slot.
    pub slot_bytes: u64,
}

/// Pools sharing one slot-id space.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct PoolGroupPlan {
    /// The group.
    pub id: PoolGroupId,
    /// Life cycles whose pages live here.
    pub life_cycles: Vec<LifeCycleId>,
    /// Pools (V2: slot size descending).
    pub pools: Vec<PoolDesc>,
}

impl PoolGroupPlan {
    /// Bytes of one slot across every pool of the group.
    pub fn slot_bytes(&self) -> u64 {
        self.pools.iter().map(|p| p.slot_bytes).sum()
    }
}

/// One row of the per-pool table the kernels' wrappers consume (TensorRT-LLM's
/// `kv_cache_pool_pointers` / `index_scales`), taken from the pool's stable
/// representative layer for the role.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct PoolTableEntry {
    /// Pool group.
    pub pool_group: PoolGroupId,
    /// Pool.
    pub pool: PoolId,
    /// Role.
    pub role: Role,
    /// First layer with this role seen in the pool's physical order.
    pub representative: LayerId,
    /// The representative's byte offset inside a slot.
    pub base_offset: u64,
    /// Index scale (pages per slot).
    pub index_scale: u32,
    /// Page stride in bytes.
    pub page_stride: u64,
}

/// A V1-compatible view of the primary (MLA key) pool: `[blocks, L, 1, T × row]`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct PrimaryPoolView {
    /// Pool group of the primary pool.
    pub pool_group: PoolGroupId,
    /// The primary pool.
    pub pool: PoolId,
    /// Local layers `L`.
    pub num_layers: u32,
    /// Tokens per block `T`.
    pub tokens_per_block: u32,
    /// Key bytes per token (576 FP8, 1152 BF16, 656 fp8_ds_mla, 288 NVFP4 data).
    pub row_bytes: u32,
    /// Bytes of one (block, layer) page: `T × row_bytes`.
    pub page_stride: u64,
}

impl PrimaryPoolView {
    /// The view's shape in bytes for `num_blocks` physical blocks:
    /// `[blocks, L, 1, T × row_bytes]`.
    pub fn shape(&self, num_blocks: u32) -> [u64; 4] {
        [
            u64::from(num_blocks),
            u64::from(self.num_layers),
            1,
            u64::from(self.tokens_per_block) * u64::from(self.row_bytes),
        ]
    }

    /// Byte offset of the page of (`slot`, local layer `l`): `(slot·L + l) × page_stride`.
    pub fn page_byte_offset(&self, slot: SlotId, local_layer: u32) -> u64 {
        (u64::from(slot.get()) * u64::from(self.num_layers) + u64::from(local_layer))
            * self.page_stride
    }

    /// Flat row id of token `pos` of `slot` on local layer `l` in the view flattened to
    /// `[blocks × L × T, row]`: the currency of sparse-MLA top-k global ids.
    pub fn global_row(&self, slot: SlotId, local_layer: u32, pos: u32) -> u64 {
        (u64::from(slot.get()) * u64::from(self.num_layers) + u64::from(local_layer))
            * u64::from(self.tokens_per_block)
            + u64::from(pos)
    }
}

/// A complete pool plan (V1 or V2). Built by [`PoolPlan::v1`], [`PoolPlan::v2`] or
/// [`PoolPlan::for_model`](crate::layout::PoolPlan::for_model).
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct PoolPlan {
    pub(super) kind: LayoutKind,
    pub(super) tokens_per_block: u32,
    /// Layer specs, sorted by layer id.
    pub(super) layers: Vec<LayerSpec>,
    /// Life-cycle keys by id (first-seen order over ascending layers).
    pub(super) life_cycles: Vec<LifeCycleKey>,
    /// Pool group of each life cycle.
    pub(super) group_of_life_cycle: Vec<PoolGroupId>,
    pub(super) pool_groups: Vec<PoolGroupPlan>,
    /// Sorted by (layer, role).
    pub(super) placements: Vec<BufferPlacement>,
    /// (group, pool, role) → first layer in physical order.
    pub(super) representatives: BTreeMap<(PoolGroupId, PoolId, Role), LayerId>,
}

impl PoolPlan {
    /// V1 or V2.
    pub fn kind(&self) -> LayoutKind {
        self.kind
    }

    /// Tokens per block `T`.
    pub fn tokens_per_block(&self) -> u32 {
        self.tokens_per_block
    }

    /// Layer ids, ascending.
    pub fn layer_ids(&self) -> impl Iterator<Item = LayerId> + '_ {
        self.layers.iter().map(|l| l.layer)
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Number of life cycles.
    pub fn num_life_cycles(&self) -> usize {
        self.life_cycles.len()
    }

    /// The key of a life cycle.
    pub fn life_cycle_key(&self, lc: LifeCycleId) -> LifeCycleKey {
        self.life_cycles[lc.index()]
    }

    /// The pool group that holds a life cycle's pages.
    pub fn pool_group_of(&self, lc: LifeCycleId) -> PoolGroupId {
        self.group_of_life_cycle[lc.index()]
    }

    /// Pool groups.
    pub fn pool_groups(&self) -> &[PoolGroupPlan] {
        &self.pool_groups
    }

    /// Every placement, sorted by (layer, role).
    pub fn placements(&self) -> &[BufferPlacement] {
        &self.placements
    }

    /// Stable representatives: for each (group, pool, role), the first layer seen in the
    /// pool's physical order.
    pub fn representatives(&self) -> &BTreeMap<(PoolGroupId, PoolId, Role), LayerId> {
        &self.representatives
    }

    fn layer_spec(&self, layer: LayerId) -> Result<&LayerSpec, LayoutError> {
        self.layers
            .binary_search_by_key(&layer, |l| l.layer)
            .map(|i| &self.layers[i])
            .map_err(|_| LayoutError::NoSuchLayer {
                layer,
                first: self.layers[0].layer,
                last: self.layers[self.layers.len() - 1].layer,
            })
    }

    /// The life cycle of a layer.
    pub fn life_cycle_of(&self, layer: LayerId) -> Result<LifeCycleId, LayoutError> {
        let spec = self.layer_spec(layer)?;
        let pos = self
            .life_cycles
            .iter()
            .position(|k| *k == spec.life_cycle)
            .expect("invariant: every layer's life cycle is registered");
        Ok(LifeCycleId(pos as u16))
    }

    /// Where (layer, role) lives. `Role::All` is not a buffer.
    pub fn placement(&self, layer: LayerId, role: Role) -> Result<&BufferPlacement, LayoutError> {
        self.layer_spec(layer)?;
        self.placements
            .binary_search_by(|p| (p.layer, p.role).cmp(&(layer, role)))
            .map(|i| &self.placements[i])
            .map_err(|_| LayoutError::NoSuchBuffer {
                layer,
                role,
                hint: match role {
                    Role::All => ": `all` is an accounting role, ask bytes_per_token instead",
                    Role::IndexKey => {
                        ": it is a shared layer that reuses the previous full layer's top-k"
                    }
                    _ => "",
                },
            })
    }

    /// The page-index converter of (layer, role).
    pub fn converter(&self, layer: LayerId, role: Role) -> Result<PageIndexConverter, LayoutError> {
        self.placement(layer, role).map(|p| p.converter)
    }

    /// Whether `layer` has a buffer with `role`.
    pub fn has_buffer(&self, layer: LayerId, role: Role) -> bool {
        self.placement(layer, role).is_ok()
    }

    /// Bytes per token of (layer, role); `Role::All` sums every buffer of the layer.
    pub fn bytes_per_token(&self, layer: LayerId, role: Role) -> Result<u64, LayoutError> {
        let spec = self.layer_spec(layer)?;
        if role == Role::All {
            return Ok(spec
                .buffers
                .iter()
                .map(|b| u64::from(b.row.bytes_per_token()))
                .sum());
        }
        self.placement(layer, role)
            .map(|p| u64::from(p.row.bytes_per_token()))
    }

    /// Σ over layers of `Role::All`: the bytes one token costs in this plan.
    pub fn cache_bytes_per_token(&self) -> u64 {
        self.layers
            .iter()
            .flat_map(|l| l.buffers.iter())
            .map(|b| u64::from(b.row.bytes_per_token()))
            .sum()
    }

    /// Bytes of one block (one slot in every pool group).
    pub fn bytes_per_block(&self) -> u64 {
        self.pool_groups.iter().map(|g| g.slot_bytes()).sum()
    }

    /// The largest `scale × expansion` of any converter (bounds page indices).
    pub fn max_pages_per_slot(&self) -> u64 {
        self.placements
            .iter()
            .map(|p| u64::from(p.converter.scale) * u64::from(p.converter.expansion))
            .max()
            .unwrap_or(1)
    }

    /// Checks that `slots` slots per group keep every page index inside int32, the type
    /// the kernels take.
    pub fn check_page_index_range(&self, slots: u64) -> Result<(), LayoutError> {
        let scale = self.max_pages_per_slot();
        let max_index = slots.saturating_mul(scale).saturating_sub(1);
        if max_index > i32::MAX as u64 {
            return Err(LayoutError::PageIndexOverflow {
                slots,
                scale,
                max_index,
            });
        }
        Ok(())
    }

    /// `(scale, layer_offset)` of a layer's primary (MLA key) pages: `(L, l)` in V1 and
    /// in the usual V2 plan.
    pub fn primary_page_params(&self, layer: LayerId) -> Result<(u32, u32), LayoutError> {
        let c = self.converter(layer, Role::Key)?;
        Ok((c.scale, c.layer_offset))
    }

    /// The indexer page scale shared by every indexer layer (`1` when no layer owns an
    /// indexer, and always `1` in V1). Errors when scales differ or pages expand.
    pub fn indexer_page_scale(&self) -> Result<u32, LayoutError> {
        let mut first: Option<(LayerId, u32)> = None;
        for p in self.placements.iter().filter(|p| p.role == Role::IndexKey) {
            if p.converter.expansion != 1 {
                return Err(LayoutError::IndexerExpansion {
                    layer: p.layer,
                    expansion: p.converter.expansion,
                });
            }
            match first {
                None => first = Some((p.layer, p.converter.scale)),
                Some((l0, s0)) if s0 != p.converter.scale => {
                    return Err(LayoutError::NonUniformIndexerScale {
                        layer: p.layer,
                        got: p.converter.scale,
                        first: l0,
                        expected: s0,
                    })
                }
                Some(_) => {}
            }
        }
        Ok(first.map_or(1, |(_, s)| s))
    }

    /// Per (pool group, pool, role): the stable representative and the values taken
    /// from it. Independent of the order layers are listed in.
    pub fn pool_table(&self) -> Vec<PoolTableEntry> {
        self.representatives
            .iter()
            .map(|(&(pool_group, pool, role), &layer)| {
                let p = self
                    .placement(layer, role)
                    .expect("invariant: representatives are placed buffers");
                PoolTableEntry {
                    pool_group,
                    pool,
                    role,
                    representative: layer,
                    base_offset: p.offset_in_slot,
                    index_scale: p.converter.scale,
                    page_stride: p.page_stride,
                }
            })
            .collect()
    }

    /// The V1-compatible view of the primary pool, with every check TensorRT-LLM's
    /// `get_unique_primary_pool` performs: SELFKONLY, uniform key rows, the first layer at
    /// offset 0 with scale `L`, every layer in the same pool with the same scale, no
    /// expansion, `layer_offset` equal to the local layer index, and contiguous per-layer
    /// pages in each slot.
    pub fn primary_pool_view(&self) -> Result<PrimaryPoolView, LayoutError> {
        let first = &self.layers[0];
        let num_layers = self.layers.len() as u32;
        let key0 = self.placement(first.layer, Role::Key)?;
        let row_bytes = key0.row.bytes_per_token();
        for spec in &self.layers {
            if let Some(b) = spec
                .buffers
                .iter()
                .find(|b| matches!(b.role, Role::Value | Role::ValueBlockScale))
            {
                return Err(LayoutError::NotSelfKOnly {
                    layer: spec.layer,
                    role: b.role,
                });
            }
            let key = self.placement(spec.layer, Role::Key)?;
            if key.row.bytes_per_token() != row_bytes {
                return Err(LayoutError::NonUniformKey {
                    layer: spec.layer,
                    got: key.row.bytes_per_token(),
                    first: first.layer,
                    expected: row_bytes,
                });
            }
        }
        let not = |layer, why| Err(LayoutError::NotV1Compatible { layer, why });
        if key0.converter.expansion != 1 {
            return not(
                first.layer,
                "the first layer's key pages expand (expansion must be 1)",
            );
        }
        if key0.converter.layer_offset != 0 {
            return not(
                first.layer,
                "the first layer's key pages must sit at layer offset 0",
            );
        }
        if key0.converter.scale != num_layers {
            return not(
                first.layer,
                "the key pool must hold one uniformly coalesced K page per local layer \
                 (scale must equal the number of layers)",
            );
        }
        for (local, spec) in self.layers.iter().enumerate() {
            let key = self.placement(spec.layer, Role::Key)?;
            if key.pool_group != key0.pool_group || key.pool != key0.pool {
                return not(
                    spec.layer,
                    "every layer's key pages must live in the same pool",
                );
            }
            if key.converter.scale != key0.converter.scale || key.converter.expansion != 1 {
                return not(
                    spec.layer,
                    "every layer needs the same key page scale and no expansion",
                );
            }
            if key.converter.layer_offset != local as u32 {
                return not(spec.layer, "K pages must follow local-layer order");
            }
            if key.offset_in_slot != key0.offset_in_slot + local as u64 * key0.page_stride {
                return not(
                    spec.layer,
                    "per-layer K pages must be contiguous in each slot",
                );
            }
        }
        Ok(PrimaryPoolView {
            pool_group: key0.pool_group,
            pool: key0.pool,
            num_layers,
            tokens_per_block: self.tokens_per_block,
            row_bytes,
            page_stride: key0.page_stride,
        })
    }
}
