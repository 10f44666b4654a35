//! [`V4Paged`]: one request's DeepSeek-V4 caches in a device's pools ([`PoolBytes`]:
//! the device's own [`V4Pools`](dsa_kv_device::windowed::V4Pools), or a batch's host
//! memory), through its tables (a step plan's, or the model cache's), read and written
//! as the sparse decode and the compressors do:
//!
//! * window rows and state rows through the request's ring page tables
//!   ([`PageTable::row`]);
//! * compressed entries and their indexer keys through its block table
//!   ([`entry_row`]);
//! * a write only at or past the committed length: anything else is a typed
//!   [`ModelError::Access`], not a silent overwrite. That keeps shared rows read-only:
//!   a shared tail ends at a block boundary at or before the committed length, and every
//!   page size divides the 256-token block, so no page of a tail holds a position past
//!   it; a shared block holds only entries closed before it. Built from the cache
//!   ([`V4Paged::from_cache`]), a window or state write also asks the window cache
//!   that the request alone holds the page.

use std::borrow::Cow;

use dsa_kv_core::core::scheduler::PlannedRequest;
use dsa_kv_core::core::{ModelCache, SeqHandle};
use dsa_kv_core::ids::{LayerId, LifeCycleId, RequestId, SlotId};
use dsa_kv_core::layout::{Role, V4Buffer, V4PageFormat};
use dsa_kv_core::metadata::v4::{entry_row, PageTable};
use dsa_kv_core::ops::model1::{MODEL1_DATA, MODEL1_SCALES};
use dsa_kv_device::windowed::PoolBytes;

use super::store::{Model1Row, StateKind, V4Store, INDEX_ENTRY_BYTES};
use crate::{ModelError, INDEX_VALUE_BYTES};

/// One request's caches in a device's pools, through its tables.
pub struct V4Paged<'a> {
    pools: &'a mut dyn PoolBytes,
    m: Option<&'a ModelCache>,
    id: RequestId,
    committed: u64,
    blocks: Vec<SlotId>,
    /// Per window life cycle: the first position held and the slots.
    windows: Cow<'a, [(u64, Vec<SlotId>)]>,
}

impl<'a> V4Paged<'a> {
    /// `p`'s view: the tables of its step plan (positions from `p.num_cached` written).
    pub fn of_step(
        pools: &'a mut dyn PoolBytes,
        p: &'a PlannedRequest,
    ) -> Result<Self, ModelError> {
        if p.window_tables.len() != pools.window_life_cycles() {
            return Err(ModelError::Access(format!(
                "request {}: {} window tables for {} window life cycles",
                p.id,
                p.window_tables.len(),
                pools.window_life_cycles()
            )));
        }
        let blocks = p
            .block_slots
            .iter()
            .map(|&s| {
                u32::try_from(s).map(SlotId).map_err(|_| {
                    ModelError::Access(format!("request {}: block slot {s} in the plan", p.id))
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(V4Paged {
            pools,
            m: None,
            id: p.id,
            committed: u64::from(p.num_cached),
            blocks,
            windows: Cow::Borrowed(&p.window_tables),
        })
    }

    /// The view of the sequence `h` through `m`'s tables (taken now; build a new view
    /// after the cache changes).
    pub fn from_cache(
        pools: &'a mut dyn PoolBytes,
        m: &'a ModelCache,
        h: &SeqHandle,
    ) -> Result<Self, ModelError> {
        let err = |e: dsa_kv_core::core::KvError| ModelError::Access(e.to_string());
        let id = h.id();
        let blocks = m.block_slots(h, LifeCycleId(0)).map_err(err)?;
        let mut windows = Vec::new();
        m.window_tables_into(id, &mut windows).map_err(err)?;
        if windows.len() != pools.window_life_cycles() {
            return Err(ModelError::Access(format!(
                "request {id}: the cache has {} window life cycles, the pools {}",
                windows.len(),
                pools.window_life_cycles()
            )));
        }
        let committed = m.info_of(h).map_err(err)?.committed;
        Ok(V4Paged {
            pools,
            m: Some(m),
            id,
            committed,
            blocks,
            windows: Cow::Owned(windows),
        })
    }
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
            .plan()
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
        let w = self.pools.window_index(lc).ok_or_else(|| {
            ModelError::Cache(format!(
                "{:?} of layer {} is not windowed",
                b.role,
                b.layer.get()
            ))
        })?;
        let page = u64::from(self.pools.plan().life_cycles()[lc].tokens_per_page);
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
            let alone = match self.m.and_then(ModelCache::windows) {
                Some(c) => c
                    .writable(self.id, w, u64::from(pos))
                    .map_err(|e| ModelError::Access(e.to_string()))?,
                None => true,
            };
            let ok = u64::from(pos) >= self.committed && alone;
            if !ok {
                return Err(ModelError::Access(format!(
                    "request {}: position {pos} of the {} life cycle is not writable (behind \
                     the committed {} or in a page shared with a tail)",
                    self.id,
                    self.pools.plan().life_cycles()[lc].kind.name(),
                    self.committed
                )));
            }
        }
        let (row, e) = (row as u64, u64::from(b.format.entries()));
        let at = match b.format {
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
        };
        self.inside(at, &b.format)
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
        let at = At {
            lc: b.life_cycle.index(),
            pool: b.pool.index(),
            data: data as usize,
            scales: scales as usize,
        };
        self.inside(at, &b.format)
    }

    /// `at` with its row's bytes checked to lie inside the device's pool: a table that
    /// names a slot past the pools (a device built with fewer slots than the manager
    /// hands out) is a typed error, not an out-of-bounds access.
    fn inside(&self, at: At, format: &V4PageFormat) -> Result<At, ModelError> {
        let (data, scales) = match *format {
            V4PageFormat::Model1 { .. } => (MODEL1_DATA, MODEL1_SCALES),
            V4PageFormat::IndexKeys { page, .. } => {
                (page.data_bytes as usize, page.scale_bytes as usize)
            }
            V4PageFormat::State { row_bytes, .. } => (row_bytes as usize, 0),
        };
        let len = self.pools.gpu_pool(at.lc, at.pool).len();
        if at.data + data > len || at.scales + scales > len {
            return Err(ModelError::Access(format!(
                "request {}: a row at byte {} of pool {} of life cycle {} is past the \
                 device's {len} bytes: the device has fewer slots than the manager hands out",
                self.id, at.data, at.pool, at.lc
            )));
        }
        Ok(at)
    }

    fn bytes(&self, at: &At, from: usize, n: usize) -> &[u8] {
        &self.pools.gpu_pool(at.lc, at.pool)[from..from + n]
    }

    fn bytes_mut(&mut self, at: &At, from: usize, n: usize) -> &mut [u8] {
        &mut self.pools.gpu_pool_mut(at.lc, at.pool)[from..from + n]
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
            StateKind::MtpInput => Role::MtpInput,
        }
    }
}

/// Bytes per value of a state row: fp32 compressor state, BF16 MTP input.
fn state_width(kind: StateKind) -> usize {
    match kind {
        StateKind::Kv | StateKind::Index => 4,
        StateKind::MtpInput => 2,
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
        let width = state_width(kind);
        if row.len() * width != row_bytes as usize {
            return Err(ModelError::Cache(format!(
                "layer {layer}: a {kind:?} state row of {} values, the plan's has {}",
                row.len(),
                row_bytes as usize / width
            )));
        }
        let at = self.ring_row(&b, pos, true)?;
        let out = self.bytes_mut(&at, at.data, row_bytes as usize);
        if kind == StateKind::MtpInput {
            for (o, v) in out.chunks_exact_mut(2).zip(row) {
                o.copy_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes());
            }
        } else {
            for (o, v) in out.chunks_exact_mut(4).zip(row) {
                o.copy_from_slice(&v.to_le_bytes());
            }
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
        let bytes = self.bytes(&at, at.data, row_bytes as usize);
        Ok(if kind == StateKind::MtpInput {
            bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect()
        } else {
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        })
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
