//! Byte layouts inside one page, as the DSA kernels read them: where a token's bytes sit in the page of a
//! buffer. MLA rows are token-interleaved (row `t` at `t × row_bytes`); indexer pages
//! put all values first, then all scale words ("values plane, then scales plane").
//! All offsets are 64-bit.

use serde::{Deserialize, Serialize};

/// `fp8_ds_mla` row: FP8 E4M3 "nope" values in tiles of this many elements.
pub const FP8_DS_MLA_TILE: usize = 128;
/// `fp8_ds_mla` row: bytes of FP8 nope values (4 tiles of 128).
pub const FP8_DS_MLA_NOPE_BYTES: usize = 512;
/// `fp8_ds_mla` row: offset of the 4 f32 tile scales.
pub const FP8_DS_MLA_SCALE_OFFSET: usize = 512;
/// `fp8_ds_mla` row: offset of the 64 BF16 rope values.
pub const FP8_DS_MLA_ROPE_OFFSET: usize = 528;
/// `fp8_ds_mla` row: total bytes.
pub const FP8_DS_MLA_ROW_BYTES: usize = 656;
/// Bytes of one indexer scale word.
pub const INDEXER_SCALE_BYTES: u32 = 4;

/// DeepSeek-V4 "MODEL1" row (FlashMLA's format on H100/H200): data bytes (448 FP8 E4M3
/// nope values, then 64 BF16 RoPE values).
pub const MODEL1_DATA_BYTES: u32 = 576;
/// MODEL1 row: scale bytes (7 UE8M0, one per 64 nope values, then a zero pad).
pub const MODEL1_SCALE_BYTES: u32 = 8;
/// MODEL1 row: bytes in all.
pub const MODEL1_ROW_BYTES: u32 = MODEL1_DATA_BYTES + MODEL1_SCALE_BYTES;
/// A MODEL1 page is padded to a multiple of this many bytes.
pub const MODEL1_PAGE_ALIGN: u64 = 576;

/// Geometry of a page of MODEL1 rows: the `entries` rows' data first (row `i` at
/// `576·i`), then their scale rows (at `576·E + 8·i`), the page padded to a multiple of
/// 576 bytes. DeepSeek-V4's window pages (64 tokens) and compressed pages (64 or 2
/// entries per 256-token block) are such pages.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Model1PageLayout {
    /// Rows per page.
    pub entries: u32,
}

impl Model1PageLayout {
    /// Bytes per page, padding included.
    pub fn page_bytes(&self) -> u64 {
        (u64::from(self.entries) * u64::from(MODEL1_ROW_BYTES)).div_ceil(MODEL1_PAGE_ALIGN)
            * MODEL1_PAGE_ALIGN
    }

    /// Offset of row `i`'s data in page `page`.
    pub fn data_offset(&self, page: u64, i: u32) -> u64 {
        page * self.page_bytes() + u64::from(i) * u64::from(MODEL1_DATA_BYTES)
    }

    /// Offset of row `i`'s scale bytes in page `page`.
    pub fn scale_offset(&self, page: u64, i: u32) -> u64 {
        page * self.page_bytes()
            + u64::from(self.entries) * u64::from(MODEL1_DATA_BYTES)
            + u64::from(i) * u64::from(MODEL1_SCALE_BYTES)
    }
}

/// How the tokens of one page of a buffer are laid out.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RowLayout {
    /// Token `t`'s `row_bytes` bytes start at `t × row_bytes` (MLA rows, block scales).
    Interleaved {
        /// Bytes per token.
        row_bytes: u32,
    },
    /// All tokens' payloads first, then all tokens' scale words (indexer keys):
    /// value of token `t` at `t × data_bytes`, scale at `T × data_bytes + t × scale_bytes`.
    ValuesThenScales {
        /// Payload bytes per token (128 FP8, 64 FP4).
        data_bytes: u32,
        /// Scale bytes per token (4).
        scale_bytes: u32,
    },
    /// DeepSeek-V4's MODEL1 rows ([`Model1PageLayout`]), one per `tokens_per_entry`
    /// tokens: every row's 576 data bytes, then every row's 8 scale bytes, the page
    /// padded to a multiple of 576 B.
    Model1 {
        /// Tokens one row stands for (1: the raw window; 4 or 128: compressed KV).
        tokens_per_entry: u32,
    },
    /// DeepSeek-V4's indexer keys over compressed entries: values then scales, as
    /// [`RowLayout::ValuesThenScales`], one entry per `tokens_per_entry` tokens.
    EntryValuesThenScales {
        /// Payload bytes per entry.
        data_bytes: u32,
        /// Scale bytes per entry.
        scale_bytes: u32,
        /// Tokens one entry stands for.
        tokens_per_entry: u32,
    },
}

impl RowLayout {
    /// Bytes per token. For the per-entry layouts (one row per several tokens, pages
    /// padded) this is the row's bytes over its tokens, rounded up: an accounting figure;
    /// [`RowLayout::page_bytes`] is exact.
    pub fn bytes_per_token(&self) -> u32 {
        match *self {
            RowLayout::Interleaved { row_bytes } => row_bytes,
            RowLayout::ValuesThenScales {
                data_bytes,
                scale_bytes,
            } => data_bytes + scale_bytes,
            RowLayout::Model1 { tokens_per_entry } => {
                MODEL1_ROW_BYTES.div_ceil(tokens_per_entry.max(1))
            }
            RowLayout::EntryValuesThenScales {
                data_bytes,
                scale_bytes,
                tokens_per_entry,
            } => (data_bytes + scale_bytes).div_ceil(tokens_per_entry.max(1)),
        }
    }

    /// Tokens one row stands for (1 but for the per-entry layouts).
    pub fn tokens_per_entry(&self) -> u32 {
        match *self {
            RowLayout::Interleaved { .. } | RowLayout::ValuesThenScales { .. } => 1,
            RowLayout::Model1 { tokens_per_entry }
            | RowLayout::EntryValuesThenScales {
                tokens_per_entry, ..
            } => tokens_per_entry,
        }
    }

    /// Bytes of a page of `tokens` tokens (a multiple of
    /// [`tokens_per_entry`](Self::tokens_per_entry)), padding included.
    pub fn page_bytes(&self, tokens: u32) -> u64 {
        match *self {
            RowLayout::Interleaved { .. } | RowLayout::ValuesThenScales { .. } => {
                u64::from(self.bytes_per_token()) * u64::from(tokens)
            }
            RowLayout::Model1 { tokens_per_entry } => Model1PageLayout {
                entries: tokens / tokens_per_entry.max(1),
            }
            .page_bytes(),
            RowLayout::EntryValuesThenScales {
                data_bytes,
                scale_bytes,
                tokens_per_entry,
            } => u64::from(tokens / tokens_per_entry.max(1)) * u64::from(data_bytes + scale_bytes),
        }
    }

    /// Byte ranges `(offset, len)` inside a page of `tokens_per_block` tokens that hold
    /// token `pos`: one range for interleaved rows, two (value, scale) for split pages.
    ///
    /// The per-entry layouts give entry `pos` of a page of `tokens_per_block` tokens
    /// (`pos < tokens_per_block / tokens_per_entry`).
    pub fn token_ranges(&self, tokens_per_block: u32, pos: u32) -> TokenRanges {
        debug_assert!(pos < tokens_per_block / self.tokens_per_entry().max(1));
        match *self {
            RowLayout::Model1 { tokens_per_entry } => {
                let page = Model1PageLayout {
                    entries: tokens_per_block / tokens_per_entry.max(1),
                };
                TokenRanges {
                    value: (page.data_offset(0, pos), MODEL1_DATA_BYTES),
                    scale: Some((page.scale_offset(0, pos), MODEL1_SCALE_BYTES)),
                }
            }
            RowLayout::EntryValuesThenScales {
                data_bytes,
                scale_bytes,
                tokens_per_entry,
            } => {
                let split = IndexerPageLayout {
                    tokens_per_block: tokens_per_block / tokens_per_entry.max(1),
                    data_bytes,
                    scale_bytes,
                };
                TokenRanges {
                    value: (split.value_offset(0, pos), data_bytes),
                    scale: Some((split.scale_offset(0, pos), scale_bytes)),
                }
            }
            RowLayout::Interleaved { row_bytes } => TokenRanges {
                value: (u64::from(pos) * u64::from(row_bytes), row_bytes),
                scale: None,
            },
            RowLayout::ValuesThenScales {
                data_bytes,
                scale_bytes,
            } => {
                let split = IndexerPageLayout {
                    tokens_per_block,
                    data_bytes,
                    scale_bytes,
                };
                TokenRanges {
                    value: (split.value_offset(0, pos), data_bytes),
                    scale: Some((split.scale_offset(0, pos), scale_bytes)),
                }
            }
        }
    }
}

/// Where one token's bytes sit inside a page.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct TokenRanges {
    /// `(offset, len)` of the payload (the whole row for interleaved layouts).
    pub value: (u64, u32),
    /// `(offset, len)` of the scale word, for values-then-scales pages.
    pub scale: Option<(u64, u32)>,
}

/// Geometry of an indexer K page: `T` payloads of `D` bytes, then `T` scale words of `S`
/// bytes. Page stride `T(D+S)`: 8448 B for FP8, 4352 B for FP4 (T = 64).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct IndexerPageLayout {
    /// Tokens per page (64 for DSA).
    pub tokens_per_block: u32,
    /// Payload bytes per token (`D`).
    pub data_bytes: u32,
    /// Scale bytes per token (`S`).
    pub scale_bytes: u32,
}

impl IndexerPageLayout {
    /// Bytes per page: `T × (D + S)`.
    pub fn page_bytes(&self) -> u64 {
        u64::from(self.tokens_per_block) * u64::from(self.data_bytes + self.scale_bytes)
    }

    /// `page × T(D+S) + pos × D`.
    pub fn value_offset(&self, page: u64, pos: u32) -> u64 {
        page * self.page_bytes() + u64::from(pos) * u64::from(self.data_bytes)
    }

    /// `page × T(D+S) + T·D + pos × S`.
    pub fn scale_offset(&self, page: u64, pos: u32) -> u64 {
        page * self.page_bytes()
            + u64::from(self.tokens_per_block) * u64::from(self.data_bytes)
            + u64::from(pos) * u64::from(self.scale_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexer_page_offsets_are_exact() {
        let fp8 = IndexerPageLayout {
            tokens_per_block: 64,
            data_bytes: 128,
            scale_bytes: 4,
        };
        assert_eq!(fp8.page_bytes(), 8448);
        assert_eq!(fp8.value_offset(0, 0), 0);
        assert_eq!(fp8.value_offset(0, 63), 63 * 128);
        assert_eq!(fp8.scale_offset(0, 0), 8192);
        assert_eq!(fp8.scale_offset(0, 63), 8192 + 252);
        assert_eq!(fp8.value_offset(3, 5), 3 * 8448 + 640);
        assert_eq!(fp8.scale_offset(3, 5), 3 * 8448 + 8192 + 20);
        // 64-bit: a page index past 2^32 / 8448 must not wrap.
        assert_eq!(fp8.value_offset(1 << 20, 1), (1u64 << 20) * 8448 + 128);
        let fp4 = IndexerPageLayout {
            data_bytes: 64,
            ..fp8
        };
        assert_eq!(fp4.page_bytes(), 4352);
        assert_eq!(fp4.scale_offset(2, 7), 2 * 4352 + 4096 + 28);
    }

    #[test]
    fn token_ranges() {
        let mla = RowLayout::Interleaved { row_bytes: 656 };
        assert_eq!(
            mla.token_ranges(64, 2),
            TokenRanges {
                value: (1312, 656),
                scale: None
            }
        );
        let idx = RowLayout::ValuesThenScales {
            data_bytes: 128,
            scale_bytes: 4,
        };
        assert_eq!(idx.bytes_per_token(), 132);
        assert_eq!(
            idx.token_ranges(64, 2),
            TokenRanges {
                value: (256, 128),
                scale: Some((8200, 4))
            }
        );
        // MODEL1, a 64-entry page of 256 tokens: data rows, then scale rows, padded.
        let c4 = RowLayout::Model1 {
            tokens_per_entry: 4,
        };
        assert_eq!(c4.page_bytes(256), 37_440);
        assert_eq!(c4.bytes_per_token(), 146);
        assert_eq!(
            c4.token_ranges(256, 3),
            TokenRanges {
                value: (3 * 576, 576),
                scale: Some((64 * 576 + 3 * 8, 8))
            }
        );
        assert_eq!(
            RowLayout::Model1 {
                tokens_per_entry: 128
            }
            .page_bytes(256),
            1_728
        );
        let ci = RowLayout::EntryValuesThenScales {
            data_bytes: 128,
            scale_bytes: 4,
            tokens_per_entry: 4,
        };
        assert_eq!(ci.page_bytes(256), 8_448);
        assert_eq!(
            ci.token_ranges(256, 2),
            TokenRanges {
                value: (256, 128),
                scale: Some((8200, 4))
            }
        );
        assert_eq!(idx.page_bytes(64), 8_448);
        assert_eq!(FP8_DS_MLA_NOPE_BYTES / FP8_DS_MLA_TILE, 4);
        assert_eq!(FP8_DS_MLA_ROPE_OFFSET + 64 * 2, FP8_DS_MLA_ROW_BYTES);
    }
}
