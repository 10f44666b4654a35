//! Persistent metadata buffers and the bindings that say which buffer currently plays
//! which role. Buffers are allocated once (sized for `max_num_sequences ×
//! max_blocks_per_seq` and `max_num_tokens`) and never reallocated, so their addresses
//! stay valid for captured CUDA graphs; draft replay swaps *bindings*, never contents.

use serde::Serialize;

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
}

impl MetaBuffer {
    pub(super) fn i32(role: BufferRole, len: usize, fill: i32) -> Self {
        MetaBuffer {
            role,
            data: Data::I32(vec![fill; len]),
            dirty: 0,
        }
    }

    pub(super) fn i64(role: BufferRole, len: usize, fill: i64) -> Self {
        MetaBuffer {
            role,
            data: Data::I64(vec![fill; len]),
            dirty: 0,
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
    /// Whether the full-KV mappings alias the slot mappings.
    pub fn full_kv_aliased(&self) -> bool {
        self.full_kv_value == self.slot_mapping_value
            && self.full_kv_scale == self.slot_mapping_scale
    }
}

/// The buffers of one set (target or draft), including both full-KV choices.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct BufferSet {
    pub indexer_page_table: BufferId,
    pub block_table: BufferId,
    pub slot_mapping_value: BufferId,
    pub slot_mapping_scale: BufferId,
    pub mla_slot_mapping: BufferId,
    pub full_kv_value: BufferId,
    pub full_kv_scale: BufferId,
    pub kv_lens: BufferId,
    pub num_cached: BufferId,
}

impl BufferSet {
    /// Bindings of this set with the full-KV mappings aliased or not.
    pub(super) fn bindings(&self, aliased: bool) -> Bindings {
        Bindings {
            indexer_page_table: self.indexer_page_table,
            block_table: self.block_table,
            slot_mapping_value: self.slot_mapping_value,
            slot_mapping_scale: self.slot_mapping_scale,
            mla_slot_mapping: self.mla_slot_mapping,
            full_kv_value: if aliased {
                self.slot_mapping_value
            } else {
                self.full_kv_value
            },
            full_kv_scale: if aliased {
                self.slot_mapping_scale
            } else {
                self.full_kv_scale
            },
            kv_lens: self.kv_lens,
            num_cached: self.num_cached,
        }
    }

    pub(super) fn ids(&self) -> [BufferId; 9] {
        [
            self.indexer_page_table,
            self.block_table,
            self.slot_mapping_value,
            self.slot_mapping_scale,
            self.mla_slot_mapping,
            self.full_kv_value,
            self.full_kv_scale,
            self.kv_lens,
            self.num_cached,
        ]
    }
}
