//! The V4 caches as the kernels hold them: [`V4Pools`], the byte pools a
//! [`V4Plan`] lays out (per life cycle, per tier, per pool), and [`V4Paged`], one
//! request's view of them through the V4 cache manager's tables, which the forward
//! reads and writes as the sparse decode and the compressors do:
//!
//! * window rows and state rows through the request's ring page tables
//!   ([`PageTable::row`]);
//! * compressed entries and their indexer keys through its block table
//!   ([`entry_row`]);
//! * a write only at or past the committed length, and a window or state write only to
//!   a page the request alone holds (never a shared tail): anything else is a typed
//!   [`ModelError::Access`], not a silent overwrite.
//!
//! Offload and onboarding move compressed blocks between the tiers by the manager's
//! [`CopyPlan`]s ([`V4Pools::apply`]).

use dsa_kv_core::core::{V4CacheManager, V4Slots};
use dsa_kv_core::ids::{LayerId, RequestId, SlotId, Tier};
use dsa_kv_core::layout::{Retention, Role, V4Buffer, V4PageFormat, V4Plan};
use dsa_kv_core::metadata::v4::{entry_row, PageTable};
use dsa_kv_core::ops::model1::{MODEL1_DATA, MODEL1_SCALES};
use dsa_kv_core::ops::CopyPlan;

use super::store::{Model1Row, StateKind, V4Store, INDEX_ENTRY_BYTES};
use crate::{ModelError, INDEX_VALUE_BYTES};

/// The pools of every life cycle of a plan: the compressed one on the GPU and (with a
/// host tier) on the host, the window ones on the GPU.
pub struct V4Pools {
    plan: V4Plan,
    /// Per life cycle (plan order): per tier (GPU, host): per pool: its bytes.
    bytes: Vec<[Vec<Vec<u8>>; 2]>,
    /// Per life cycle: its index among the window life cycles (the manager's `lc`).
    window_index: Vec<Option<usize>>,
}

fn tier_index(t: Tier) -> usize {
    match t {
        Tier::Gpu => 0,
        Tier::Host => 1,
    }
}

impl V4Pools {
    /// Zeroed pools for `plan` with `slots` (as the manager was built with).
    pub fn new(plan: &V4Plan, slots: &V4Slots) -> Result<V4Pools, ModelError> {
        let mut bytes = Vec::new();
        let mut window_index = Vec::new();
        let mut windows = 0;
        for lc in plan.life_cycles() {
            let (gpu, host, index) = match lc.retention {
                Retention::Full => (
                    slots.blocks.gpu.first().copied(),
                    slots.blocks.host.first().copied().unwrap_or(0),
                    None,
                ),
                Retention::Window { .. } => {
                    windows += 1;
                    (
                        slots.windows.get(windows - 1).copied(),
                        0,
                        Some(windows - 1),
                    )
                }
            };
            let gpu = gpu.ok_or_else(|| {
                ModelError::Cache(format!(
                    "no slot count for the {} life cycle: give V4Slots one per life cycle",
                    lc.kind.name()
                ))
            })?;
            let tier = |n: u32| -> Vec<Vec<u8>> {
                lc.pools
                    .iter()
                    .map(|p| vec![0u8; (u64::from(n) * p.slot_bytes()) as usize])
                    .collect()
            };
            bytes.push([tier(gpu), tier(host)]);
            window_index.push(index);
        }
        Ok(V4Pools {
            plan: plan.clone(),
            bytes,
            window_index,
        })
    }

    /// The plan.
    pub fn plan(&self) -> &V4Plan {
        &self.plan
    }

    /// The bytes of pool `pool` of life cycle `lc` (plan order) on `tier` (empty for a
    /// tier the life cycle does not have): what a kernel or a dump reads.
    pub fn pool(&self, lc: usize, tier: Tier, pool: usize) -> &[u8] {
        self.bytes
            .get(lc)
            .and_then(|t| t[tier_index(tier)].get(pool))
            .map_or(&[], Vec::as_slice)
    }

    /// [`pool`](Self::pool), writable (a transfer landing, a fault injected in a test).
    pub fn pool_mut(&mut self, lc: usize, tier: Tier, pool: usize) -> &mut [u8] {
        self.bytes
            .get_mut(lc)
            .and_then(|t| t[tier_index(tier)].get_mut(pool))
            .map_or(&mut [], Vec::as_mut_slice)
    }

    /// Executes the manager's copy plans (offload, onboarding) in order: every pool of
    /// the compressed life cycle, slot by slot.
    pub fn apply(&mut self, plans: &[CopyPlan]) -> Result<(), ModelError> {
        let lc = self
            .plan
            .life_cycles()
            .iter()
            .position(|lc| lc.retention == Retention::Full)
            .ok_or_else(|| ModelError::Cache("the plan has no compressed life cycle".into()))?;
        let slot_bytes: Vec<usize> = self.plan.life_cycles()[lc]
            .pools
            .iter()
            .map(|p| p.slot_bytes() as usize)
            .collect();
        for copy in plans.iter().flat_map(|p| &p.copies) {
            if copy.pool_group.index() != 0 {
                return Err(ModelError::Access(format!(
                    "a copy of pool group {}: V4 blocks have one",
                    copy.pool_group.index()
                )));
            }
            let (src, dst) = (tier_index(copy.src_tier), tier_index(copy.dst_tier));
            for (pool, &n) in slot_bytes.iter().enumerate() {
                for &(s, d) in &copy.pairs {
                    let range = |slot: SlotId, t: usize| {
                        let at = slot.index() * n;
                        (at + n <= self.bytes[lc][t][pool].len()).then_some(at..at + n)
                    };
                    let (Some(from), Some(to)) = (range(s, src), range(d, dst)) else {
                        return Err(ModelError::Access(format!(
                            "copy {s:?} → {d:?} ({:?} → {:?}) is past the pools",
                            copy.src_tier, copy.dst_tier
                        )));
                    };
                    let data = self.bytes[lc][src][pool][from].to_vec();
                    self.bytes[lc][dst][pool][to].copy_from_slice(&data);
                }
            }
        }
        Ok(())
    }

    /// Request `id`'s view through `m`'s tables (taken now; build a new view after the
    /// manager changes).
    pub fn view<'a>(
        &'a mut self,
        m: &'a V4CacheManager,
        id: RequestId,
    ) -> Result<V4Paged<'a>, ModelError> {
        let err = |e: dsa_kv_core::core::V4Error| ModelError::Access(e.to_string());
        let blocks = m.block_slots(id).map_err(err)?;
        let windows = (0..self.window_index.iter().flatten().count())
            .map(|lc| m.window_table(id, lc).map_err(err))
            .collect::<Result<_, _>>()?;
        let committed = m.committed(id).map_err(err)?;
        Ok(V4Paged {
            pools: self,
            m,
            id,
            committed,
            blocks,
            windows,
        })
    }
}

/// One request's caches in [`V4Pools`], through its tables.
pub struct V4Paged<'a> {
    pools: &'a mut V4Pools,
    m: &'a V4CacheManager,
    id: RequestId,
    committed: u64,
    blocks: Vec<SlotId>,
    /// Per window life cycle: the first position held and the slots.
    windows: Vec<(u64, Vec<SlotId>)>,
}

/// Where a row lives: (life cycle, pool, byte offset of its data, of its scale bytes).
struct At {
    lc: usize,
    pool: usize,
    data: usize,
    scales: usize,
}

impl V4Paged<'_> {
    fn buffer(&self, layer: usize, role: Role) -> Result<V4Buffer, ModelError> {
        self.pools
            .plan
            .buffer(LayerId(layer as u32), role)
            .copied()
            .ok_or_else(|| {
                ModelError::Cache(format!("layer {layer} has no {role:?} buffer in the plan"))
            })
    }

    /// The window or state row of `pos` in `buffer` (through its ring's page table); with
    /// `write`, only a page the request alone holds, at or past the committed length.
    fn ring_row(&self, b: &V4Buffer, pos: u32, write: bool) -> Result<At, ModelError> {
        let lc = b.life_cycle.index();
        let w = self.pools.window_index[lc].ok_or_else(|| {
            ModelError::Cache(format!(
                "{:?} of layer {} is not windowed",
                b.role,
                b.layer.get()
            ))
        })?;
        let page = u64::from(self.pools.plan.life_cycles()[lc].tokens_per_page);
        let (start, slots) = &self.windows[w];
        let table = PageTable {
            start: *start,
            slots,
            page,
        };
        let row = table
            .row(b.converter, u64::from(pos))
            .map_err(|e| ModelError::Access(format!("layer {}: {e}", b.layer.get())))?;
        if write {
            let ok = u64::from(pos) >= self.committed
                && self
                    .m
                    .windows()
                    .writable(self.id, w, u64::from(pos))
                    .map_err(|e| ModelError::Access(e.to_string()))?;
            if !ok {
                return Err(ModelError::Access(format!(
                    "request {}: position {pos} of the {} life cycle is not writable (behind \
                     the committed {} or in a page shared with a tail)",
                    self.id,
                    self.pools.plan.life_cycles()[lc].kind.name(),
                    self.committed
                )));
            }
        }
        let (row, e) = (row as u64, u64::from(b.format.entries()));
        Ok(match b.format {
            V4PageFormat::Model1 { page, .. } => At {
                lc,
                pool: b.pool.index(),
                data: page.data_offset(row / e, (row % e) as u32) as usize,
                scales: page.scale_offset(row / e, (row % e) as u32) as usize,
            },
            V4PageFormat::State { row_bytes, .. } => At {
                lc,
                pool: b.pool.index(),
                data: (row * u64::from(row_bytes)) as usize,
                scales: 0,
            },
            V4PageFormat::IndexKeys { .. } => {
                return Err(ModelError::Cache("indexer keys are not windowed".into()))
            }
        })
    }

    /// Compressed entry `w` of `buffer` (through the block table); with `write`, only
    /// an entry closed at or past the committed length.
    fn entry_at(&self, b: &V4Buffer, w: u32, write: bool) -> Result<At, ModelError> {
        let ratio = u64::from(b.format.tokens_per_entry());
        let closer = ratio * u64::from(w) + ratio - 1;
        if write && closer < self.committed {
            return Err(ModelError::Access(format!(
                "request {}: entry {w} of ratio {ratio} was closed by committed position \
                 {closer}: it is read-only",
                self.id
            )));
        }
        let row = entry_row(&self.blocks, b.converter, ratio, u64::from(w))
            .map_err(|e| ModelError::Access(format!("layer {}: {e}", b.layer.get())))?;
        let (row, e) = (row as u64, u64::from(b.format.entries()));
        let (page, i) = (row / e, (row % e) as u32);
        let (data, scales) = match b.format {
            V4PageFormat::Model1 { page: p, .. } => {
                (p.data_offset(page, i), p.scale_offset(page, i))
            }
            V4PageFormat::IndexKeys { page: p, .. } => {
                (p.value_offset(page, i), p.scale_offset(page, i))
            }
            V4PageFormat::State { .. } => {
                return Err(ModelError::Cache(
                    "state rows are not compressed entries".into(),
                ))
            }
        };
        Ok(At {
            lc: b.life_cycle.index(),
            pool: b.pool.index(),
            data: data as usize,
            scales: scales as usize,
        })
    }

    fn bytes(&self, at: &At, from: usize, n: usize) -> &[u8] {
        &self.pools.bytes[at.lc][0][at.pool][from..from + n]
    }

    fn bytes_mut(&mut self, at: &At, from: usize, n: usize) -> &mut [u8] {
        &mut self.pools.bytes[at.lc][0][at.pool][from..from + n]
    }

    fn read_model1(&self, at: &At) -> Model1Row {
        let mut row = Model1Row {
            data: [0; MODEL1_DATA],
            scales: [0; MODEL1_SCALES],
        };
        row.data
            .copy_from_slice(self.bytes(at, at.data, MODEL1_DATA));
        row.scales
            .copy_from_slice(self.bytes(at, at.scales, MODEL1_SCALES));
        row
    }

    fn write_model1(&mut self, at: &At, row: &Model1Row) {
        self.bytes_mut(at, at.data, MODEL1_DATA)
            .copy_from_slice(&row.data);
        self.bytes_mut(at, at.scales, MODEL1_SCALES)
            .copy_from_slice(&row.scales);
    }

    fn state_role(kind: StateKind) -> Role {
        match kind {
            StateKind::Kv => Role::CompressorState,
            StateKind::Index => Role::IndexerCompressorState,
        }
    }
}

impl V4Store for V4Paged<'_> {
    fn write_window(&mut self, layer: usize, pos: u32, row: &Model1Row) -> Result<(), ModelError> {
        let b = self.buffer(layer, Role::WindowKey)?;
        let at = self.ring_row(&b, pos, true)?;
        self.write_model1(&at, row);
        Ok(())
    }

    fn window(&self, layer: usize, pos: u32) -> Result<Model1Row, ModelError> {
        let b = self.buffer(layer, Role::WindowKey)?;
        Ok(self.read_model1(&self.ring_row(&b, pos, false)?))
    }

    fn write_state(
        &mut self,
        layer: usize,
        kind: StateKind,
        pos: u32,
        row: &[f32],
    ) -> Result<(), ModelError> {
        let b = self.buffer(layer, Self::state_role(kind))?;
        let V4PageFormat::State { row_bytes, .. } = b.format else {
            return Err(ModelError::Cache(format!(
                "layer {layer}: not a state buffer"
            )));
        };
        if row.len() * 4 != row_bytes as usize {
            return Err(ModelError::Cache(format!(
                "layer {layer}: a {kind:?} state row of {} values, the plan's has {}",
                row.len(),
                row_bytes / 4
            )));
        }
        let at = self.ring_row(&b, pos, true)?;
        let out = self.bytes_mut(&at, at.data, row_bytes as usize);
        for (o, v) in out.chunks_exact_mut(4).zip(row) {
            o.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }

    fn state(&self, layer: usize, kind: StateKind, pos: u32) -> Result<Vec<f32>, ModelError> {
        let b = self.buffer(layer, Self::state_role(kind))?;
        let V4PageFormat::State { row_bytes, .. } = b.format else {
            return Err(ModelError::Cache(format!(
                "layer {layer}: not a state buffer"
            )));
        };
        let at = self.ring_row(&b, pos, false)?;
        Ok(self
            .bytes(&at, at.data, row_bytes as usize)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    fn write_entry(&mut self, layer: usize, w: u32, row: &Model1Row) -> Result<(), ModelError> {
        let b = self.buffer(layer, Role::CompressedKey)?;
        let at = self.entry_at(&b, w, true)?;
        self.write_model1(&at, row);
        Ok(())
    }

    fn entry(&self, layer: usize, w: u32) -> Result<Model1Row, ModelError> {
        let b = self.buffer(layer, Role::CompressedKey)?;
        Ok(self.read_model1(&self.entry_at(&b, w, false)?))
    }

    fn write_index_entry(
        &mut self,
        layer: usize,
        w: u32,
        key: &[u8; INDEX_ENTRY_BYTES],
    ) -> Result<(), ModelError> {
        let b = self.buffer(layer, Role::CompressedIndexKey)?;
        let at = self.entry_at(&b, w, true)?;
        self.bytes_mut(&at, at.data, INDEX_VALUE_BYTES)
            .copy_from_slice(&key[..INDEX_VALUE_BYTES]);
        self.bytes_mut(&at, at.scales, 4)
            .copy_from_slice(&key[INDEX_VALUE_BYTES..]);
        Ok(())
    }

    fn index_entry(&self, layer: usize, w: u32) -> Result<[u8; INDEX_ENTRY_BYTES], ModelError> {
        let b = self.buffer(layer, Role::CompressedIndexKey)?;
        let at = self.entry_at(&b, w, false)?;
        let mut key = [0u8; INDEX_ENTRY_BYTES];
        key[..INDEX_VALUE_BYTES].copy_from_slice(self.bytes(&at, at.data, INDEX_VALUE_BYTES));
        key[INDEX_VALUE_BYTES..].copy_from_slice(self.bytes(&at, at.scales, 4));
        Ok(key)
    }
}
