//! Pool planning: how every (layer, role) buffer of a model maps onto pools of slots
//! (the page index each kernel addresses a (layer, role) buffer with). Two layouts share one result type, [`PoolPlan`]:
//!
//! * **V2** ([`PoolPlan::v2`]): buffers of one life cycle with equal per-block size
//!   coalesce into one pool; a life cycle's pools form a slot variant; life cycles with
//!   identical slot-size lists share one pool group. Each (layer, role) gets a
//!   [`PageIndexConverter`] `page = slot × scale + layer_offset`.
//! * **V1** ([`PoolPlan::v1`]): one primary pool `[block][layer][token][row]` (page
//!   params `(L, l)`), a separate indexer pool per indexer layer (page scale 1).
//!
//! Everything above this module (quota, core, metadata, storage) sees only `PoolPlan`.

mod bytes;
mod model_layers;
mod plan;
mod v1;
mod v2;
mod v4;

pub use crate::config::DSA_TOKENS_PER_BLOCK;
pub use bytes::{
    IndexerPageLayout, Model1PageLayout, RowLayout, TokenRanges, FP8_DS_MLA_NOPE_BYTES,
    FP8_DS_MLA_ROPE_OFFSET, FP8_DS_MLA_ROW_BYTES, FP8_DS_MLA_SCALE_OFFSET, FP8_DS_MLA_TILE,
    INDEXER_SCALE_BYTES, MODEL1_DATA_BYTES, MODEL1_PAGE_ALIGN, MODEL1_ROW_BYTES,
    MODEL1_SCALE_BYTES,
};
pub use model_layers::layer_specs_for_model;
pub use plan::{
    BufferPlacement, PageIndexConverter, PoolDesc, PoolGroupPlan, PoolPlan, PoolTableEntry,
    PrimaryPoolView,
};
pub use v4::{
    Retention, V4BlockBytes, V4Buffer, V4LifeCycle, V4LifeCycleKind, V4PageFormat, V4Plan, V4Pool,
    V4WindowBytes,
};

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::ids::LayerId;

/// What a buffer of a layer holds.
///
/// `All` is a pseudo-role for accounting only ("every buffer of the layer"); it is never
/// a buffer and never owns pages.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Role {
    /// The MLA latent row (K only: MLA caches are SELFKONLY).
    Key,
    /// A value row (dense models only; a DSA layout has none).
    Value,
    /// NVFP4 block scales of the key (one FP8 scale per 16 elements).
    KeyBlockScale,
    /// NVFP4 block scales of the value.
    ValueBlockScale,
    /// The lightning-indexer K cache of a layer that owns an indexer.
    IndexKey,
    /// DeepSeek-V4: a layer's raw sliding-window KV (MODEL1 rows, one per token).
    WindowKey,
    /// DeepSeek-V4: a layer's compressed KV (MODEL1 rows, one per 4 or 128 tokens).
    CompressedKey,
    /// DeepSeek-V4: the indexer keys of a ratio-4 layer's compressed entries.
    CompressedIndexKey,
    /// DeepSeek-V4: a compressor's fp32 state rows (one per token).
    CompressorState,
    /// DeepSeek-V4: a ratio-4 layer's indexer compressor's fp32 state rows.
    IndexerCompressorState,
    /// DeepSeek-V4: what the MTP layer reads of the target at a position (its
    /// pre-`hc_head` residual streams, BF16).
    MtpInput,
    /// Accounting only: the sum of every buffer of the layer.
    All,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Key => "key",
            Role::Value => "value",
            Role::KeyBlockScale => "key_block_scale",
            Role::ValueBlockScale => "value_block_scale",
            Role::IndexKey => "index_key",
            Role::WindowKey => "window_key",
            Role::CompressedKey => "compressed_key",
            Role::CompressedIndexKey => "compressed_index_key",
            Role::CompressorState => "compressor_state",
            Role::IndexerCompressorState => "indexer_compressor_state",
            Role::MtpInput => "mtp_input",
            Role::All => "all",
        })
    }
}

/// Which layout a plan uses: a plain choice that the configuration resolves
/// (`use_kv_cache_manager_v2`) and the planner reads.
pub use crate::config::LayoutKind;

/// Layers with equal keys share one allocation life cycle (their pages are allocated,
/// reused, evicted and freed together). DSA layers are all full attention, so the key
/// is only a cache domain tag (e.g. target vs. a separately managed draft domain).
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct LifeCycleKey(pub u32);

/// One buffer of a layer as the planner receives it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct BufferSpec {
    /// What the buffer holds (never [`Role::All`]).
    pub role: Role,
    /// How tokens sit inside a page; gives the bytes per token.
    pub row: RowLayout,
    /// Tokens per page of this buffer when smaller than the plan's `tokens_per_block`
    /// (page expansion). DSA buffers never use it.
    pub tokens_per_block_override: Option<u32>,
}

impl BufferSpec {
    /// A buffer with the plan's tokens per block.
    pub fn new(role: Role, row: RowLayout) -> Self {
        BufferSpec {
            role,
            row,
            tokens_per_block_override: None,
        }
    }
}

/// One layer as the planner receives it.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct LayerSpec {
    /// The layer.
    pub layer: LayerId,
    /// Its life cycle.
    pub life_cycle: LifeCycleKey,
    /// Its buffers, in registration order (standard roles first, extras after).
    pub buffers: Vec<BufferSpec>,
}

/// A layout that cannot be built or a query it cannot answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// DSA needs 64-token pages.
    #[error(
        "tokens_per_block must be 64 for DSA (got {got}): the DeepGEMM paged indexer-logits \
         kernel and FlashMLA read 64-token pages, and the MLA and indexer caches share one \
         block table; set tokens_per_block: 64"
    )]
    DsaTokensPerBlock {
        /// The value given.
        got: u32,
    },
    /// Tokens per block out of range.
    #[error("tokens_per_block must be a power of two in 1..=1024 (got {got})")]
    TokensPerBlock {
        /// The value given.
        got: u32,
    },
    /// A plan with no layer.
    #[error("a layout needs at least one layer")]
    NoLayers,
    /// The same layer given twice.
    #[error("layer {layer} is given twice: layer ids must be unique")]
    DuplicateLayer {
        /// The layer.
        layer: LayerId,
    },
    /// A layer without buffers.
    #[error("layer {layer} has no buffer: every layer needs at least a key buffer")]
    EmptyLayer {
        /// The layer.
        layer: LayerId,
    },
    /// The same role given twice for one layer.
    #[error("layer {layer} registers role {role} twice: roles must be unique within a layer")]
    DuplicateRole {
        /// The layer.
        layer: LayerId,
        /// The role.
        role: Role,
    },
    /// `Role::All` used as a buffer.
    #[error("layer {layer}: role `all` is for accounting only and cannot be a buffer")]
    AllIsNotABuffer {
        /// The layer.
        layer: LayerId,
    },
    /// A buffer with no bytes.
    #[error("layer {layer} role {role}: a buffer needs at least one byte per token")]
    EmptyBuffer {
        /// The layer.
        layer: LayerId,
        /// The role.
        role: Role,
    },
    /// A bad tokens_per_block override.
    #[error(
        "layer {layer} role {role}: tokens_per_block_override {got} must divide \
         tokens_per_block {tokens_per_block}"
    )]
    BadOverride {
        /// The layer.
        layer: LayerId,
        /// The role.
        role: Role,
        /// The override.
        got: u32,
        /// The plan's tokens per block.
        tokens_per_block: u32,
    },
    /// A per-entry row layout whose entries do not tile the page.
    #[error(
        "layer {layer} role {role}: one entry per {tokens_per_entry} tokens does not tile a \
         {page_tokens}-token page; tokens_per_entry must be positive and divide the page"
    )]
    BadEntry {
        /// The layer.
        layer: LayerId,
        /// The role.
        role: Role,
        /// Tokens per entry given.
        tokens_per_entry: u32,
        /// Tokens per page.
        page_tokens: u32,
    },
    /// A query for a buffer the layer does not have.
    #[error("layer {layer} has no {role} buffer{hint}")]
    NoSuchBuffer {
        /// The layer.
        layer: LayerId,
        /// The role.
        role: Role,
        /// Extra explanation (may be empty).
        hint: &'static str,
    },
    /// A query for a layer the plan does not hold.
    #[error("layer {layer} is not in this layout (it holds layers {first}..={last})")]
    NoSuchLayer {
        /// The layer.
        layer: LayerId,
        /// First layer held.
        first: LayerId,
        /// Last layer held.
        last: LayerId,
    },
    /// The V1 layout supports one life cycle only.
    #[error(
        "the V1 layout has one block-id space and supports a single life cycle (got {got}); \
         use the V2 layout for several life cycles"
    )]
    V1LifeCycles {
        /// Life cycles given.
        got: usize,
    },
    /// A V1 layout or a V1-compatible view needs a SELFKONLY (MLA) cache.
    #[error(
        "layer {layer}: the V1 primary pool requires a SELFKONLY KV cache (key only), but the \
         layer has a {role} buffer"
    )]
    NotSelfKOnly {
        /// The layer.
        layer: LayerId,
        /// The offending role.
        role: Role,
    },
    /// Non-uniform key rows.
    #[error(
        "layer {layer}: key rows must be uniform across layers for a V1 primary pool \
         ({got} B/token vs {expected} B/token on layer {first})"
    )]
    NonUniformKey {
        /// The layer.
        layer: LayerId,
        /// Its bytes per token.
        got: u32,
        /// The first layer.
        first: LayerId,
        /// The first layer's bytes per token.
        expected: u32,
    },
    /// The V1-compatible primary-pool view is not possible for this V2 plan.
    #[error("no V1-compatible primary pool: layer {layer}: {why}")]
    NotV1Compatible {
        /// The first layer that breaks it.
        layer: LayerId,
        /// Which rule it breaks.
        why: &'static str,
    },
    /// Indexer pages with page expansion.
    #[error(
        "DSA indexer K-cache does not support page expansion (layer {layer} expands {expansion}×)"
    )]
    IndexerExpansion {
        /// The layer.
        layer: LayerId,
        /// Its expansion.
        expansion: u32,
    },
    /// Indexer scales differ across layers.
    #[error(
        "DSA requires a uniform shared INDEX_KEY page mapping across layers: layer {layer} has \
         scale {got}, layer {first} has {expected}"
    )]
    NonUniformIndexerScale {
        /// The layer.
        layer: LayerId,
        /// Its scale.
        got: u32,
        /// The first indexer layer.
        first: LayerId,
        /// Its scale.
        expected: u32,
    },
    /// Page indices would not fit the kernels' int32.
    #[error(
        "{slots} slots × page scale {scale} exceed the int32 page indices the kernels take \
         (largest page index {max_index}); lower the KV budget or split the layers over more ranks"
    )]
    PageIndexOverflow {
        /// Slots requested.
        slots: u64,
        /// The largest converter scale × expansion.
        scale: u64,
        /// The largest page index that would be produced.
        max_index: u64,
    },
}

#[cfg(test)]
mod tests;
