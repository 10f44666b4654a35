//! Persistent metadata buffers and the bindings that say which buffer currently plays
//! which role. Buffers are allocated once (sized for `max_num_sequences ×
//! max_blocks_per_seq` and `max_num_tokens`) and never reallocated, so their addresses
//! stay valid for captured CUDA graphs; draft replay swaps *bindings*, never contents.

use serde::Serialize;

use super::MetadataDims;

/// A persistent buffer (index into the metadata's buffer arena).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize)]
pub struct BufferId(pub(super) u32);

/// What a buffer holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub enum BufferRole {
    /// `[max_num_sequences, max_blocks_per_seq]` i32: indexer page per block
    /// (`slot × indexer_page_scale`), padding clamped to 0.
    IndexerPageTable,
    /// `[max_num_sequences, max_blocks_per_seq]` i32: physical slot per block, −1 past
    /// `ceil(kv_len / T)`.
    BlockTable,
    /// `[max_num_tokens]` i64: byte offset of each new token's indexer payload.
    SlotMappingValue,
    /// `[max_num_tokens]` i64: byte offset of each new token's indexer scale word.
    SlotMappingScale,
    /// `[max_num_tokens]` i64: token slot (`block_slot × T + pos`) of each new token's
    /// MLA row.
    MlaSlotMapping,
    /// `[max_context_kv_tokens]` i64: payload offsets of every KV token of the context
    /// requests (own buffer, used when some context request has cached tokens).
    FullKvValue,
    /// `[max_context_kv_tokens]` i64: scale-word offsets, as above.
    FullKvScale,
    /// `[max_num_sequences]` i32: KV tokens of each request after this step
    /// (`cached + new`, or `cached` on an inactive Helix rank).
    KvLens,
    /// `[max_num_sequences]` i32: KV tokens of each request before this step.
    NumCached,
}

impl BufferRole {
    /// Every role, in the order of a set's buffers (their allocation order, and
    /// [`StepMetadata::set_buffers`](super::StepMetadata::set_buffers)).
    pub const ALL: [BufferRole; 9] = [
        BufferRole::IndexerPageTable,
        BufferRole::BlockTable,
        BufferRole::SlotMappingValue,
        BufferRole::SlotMappingScale,
        BufferRole::MlaSlotMapping,
        BufferRole::FullKvValue,
        BufferRole::FullKvScale,
        BufferRole::KvLens,
        BufferRole::NumCached,
    ];

    /// This role's buffer in a set of dimensions `d`: element type, length and padding
    /// value as the role's documentation says.
    pub(super) fn alloc(self, d: &MetadataDims) -> MetaBuffer {
        let table = d.max_num_sequences * d.max_blocks_per_seq;
        match self {
            BufferRole::IndexerPageTable => MetaBuffer::i32(self, table, 0),
            BufferRole::BlockTable => MetaBuffer::i32(self, table, -1),
            BufferRole::SlotMappingValue
            | BufferRole::SlotMappingScale
            | BufferRole::MlaSlotMapping => MetaBuffer::i64(self, d.max_num_tokens, -1),
            BufferRole::FullKvValue | BufferRole::FullKvScale => {
                MetaBuffer::i64(self, d.max_context_kv_tokens, -1)
            }
            BufferRole::KvLens | BufferRole::NumCached => {
                MetaBuffer::i32(self, d.max_num_sequences, 0)
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Data {
    I32(Vec<i32>),
    I64(Vec<i64>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct MetaBuffer {
    pub role: BufferRole,
    pub data: Data,
    /// Entries past this index hold the padding value (so a rewrite only re-pads what
    /// the previous step used).
    pub dirty: usize,
    /// The cells written since a mirror last took them (page tables only).
    pub log: ChangeLog,
}

/// Element ranges of a buffer written since a mirror last took them
/// ([`StepMetadata::mirror_changes`](super::StepMetadata::mirror_changes)). Bounded:
/// past [`ChangeLog::MAX_RANGES`] ranges, or more cells than a quarter of the buffer
/// (where copying the used part costs about as much), it keeps nothing and says
/// "copy the extent" until the mirror takes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct ChangeLog {
    /// Whether writes are logged at all (page tables).
    tracked: bool,
    /// Written ranges `[start, end)` in write order (adjacent ones merged; they may
    /// overlap).
    ranges: Vec<(u32, u32)>,
    cells: usize,
    overflow: bool,
}

impl ChangeLog {
    /// Ranges one log keeps before it gives up.
    pub(super) const MAX_RANGES: usize = 8192;

    fn tracked() -> Self {
        ChangeLog {
            tracked: true,
            ..ChangeLog::default()
        }
    }

    /// Logs a write of elements `[start, end)` of a buffer of `len` elements.
    pub(super) fn record(&mut self, start: usize, end: usize, len: usize) {
        if !self.tracked || self.overflow || start >= end {
            return;
        }
        self.cells += end - start;
        // Bit 31 of a cell names the table in the CUDA upload's pairs: larger tables
        // are copied by extent.
        if self.cells > len / 4 || end > 1 << 31 {
            self.overflow = true;
            self.ranges.clear();
            return;
        }
        let (s, e) = (start as u32, end as u32);
        if let Some(last) = self.ranges.last_mut().filter(|l| l.1 == s) {
            last.1 = e;
        } else if self.ranges.len() == Self::MAX_RANGES {
            self.overflow = true;
            self.ranges.clear();
        } else {
            self.ranges.push((s, e));
        }
    }

    /// The logged ranges, or `None` when the mirror must copy the extent (untracked, or
    /// the log overflowed).
    pub(super) fn ranges(&self) -> Option<&[(u32, u32)]> {
        (self.tracked && !self.overflow).then_some(&self.ranges[..])
    }

    /// Forgets what was logged (a mirror took it).
    pub(super) fn clear(&mut self) {
        self.ranges.clear();
        self.cells = 0;
        self.overflow = false;
    }
}

impl MetaBuffer {
    pub(super) fn i32(role: BufferRole, len: usize, fill: i32) -> Self {
        MetaBuffer {
            role,
            data: Data::I32(vec![fill; len]),
            dirty: 0,
            // Page tables are rewritten by the columns that changed: worth logging.
            log: if matches!(role, BufferRole::IndexerPageTable | BufferRole::BlockTable) {
                ChangeLog::tracked()
            } else {
                ChangeLog::default()
            },
        }
    }

    pub(super) fn i64(role: BufferRole, len: usize, fill: i64) -> Self {
        MetaBuffer {
            role,
            data: Data::I64(vec![fill; len]),
            dirty: 0,
            log: ChangeLog::default(),
        }
    }

    /// The buffer's address (stable for its whole life).
    pub(super) fn addr(&self) -> usize {
        match &self.data {
            Data::I32(v) => v.as_ptr() as usize,
            Data::I64(v) => v.as_ptr() as usize,
        }
    }
}

/// Which buffer plays each role right now. Full-KV mappings either have their own
/// buffers or **alias** the slot mappings (same buffer ids: the kernels see the same
/// addresses), and that alias state is part of the bindings.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct Bindings {
    /// Indexer page table.
    pub indexer_page_table: BufferId,
    /// Physical block table.
    pub block_table: BufferId,
    /// New tokens' payload offsets.
    pub slot_mapping_value: BufferId,
    /// New tokens' scale-word offsets.
    pub slot_mapping_scale: BufferId,
    /// New tokens' MLA token slots.
    pub mla_slot_mapping: BufferId,
    /// Full-KV payload offsets (`== slot_mapping_value` when aliased).
    pub full_kv_value: BufferId,
    /// Full-KV scale offsets (`== slot_mapping_scale` when aliased).
    pub full_kv_scale: BufferId,
    /// KV lengths.
    pub kv_lens: BufferId,
    /// Cached lengths.
    pub num_cached: BufferId,
}

impl Bindings {
    /// The buffer playing `role`.
    pub fn get(&self, role: BufferRole) -> BufferId {
        match role {
            BufferRole::IndexerPageTable => self.indexer_page_table,
            BufferRole::BlockTable => self.block_table,
            BufferRole::SlotMappingValue => self.slot_mapping_value,
            BufferRole::SlotMappingScale => self.slot_mapping_scale,
            BufferRole::MlaSlotMapping => self.mla_slot_mapping,
            BufferRole::FullKvValue => self.full_kv_value,
            BufferRole::FullKvScale => self.full_kv_scale,
            BufferRole::KvLens => self.kv_lens,
            BufferRole::NumCached => self.num_cached,
        }
    }

    /// A set's own buffers, `id(role)` for each role, called in [`BufferRole::ALL`] order.
    pub(super) fn from_roles(id: impl FnMut(BufferRole) -> BufferId) -> Bindings {
        let [indexer_page_table, block_table, slot_mapping_value, slot_mapping_scale, mla_slot_mapping, full_kv_value, full_kv_scale, kv_lens, num_cached] =
            BufferRole::ALL.map(id);
        Bindings {
            indexer_page_table,
            block_table,
            slot_mapping_value,
            slot_mapping_scale,
            mla_slot_mapping,
            full_kv_value,
            full_kv_scale,
            kv_lens,
            num_cached,
        }
    }

    /// A set's own bindings with its full-KV mappings aliasing its slot mappings
    /// (`aliased`), or on their own buffers.
    pub(super) fn with_alias(self, aliased: bool) -> Bindings {
        if !aliased {
            return self;
        }
        Bindings {
            full_kv_value: self.slot_mapping_value,
            full_kv_scale: self.slot_mapping_scale,
            ..self
        }
    }

    /// The buffer of every role, in [`BufferRole::ALL`] order.
    pub(super) fn ids(&self) -> [BufferId; 9] {
        BufferRole::ALL.map(|r| self.get(r))
    }

    /// Whether the full-KV mappings alias the slot mappings.
    pub fn full_kv_aliased(&self) -> bool {
        self.full_kv_value == self.slot_mapping_value
            && self.full_kv_scale == self.slot_mapping_scale
    }
}
