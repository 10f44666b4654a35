//! DeepSeek-V4's step metadata, host references (milestone 3 of the plan in
//! ARCHITECTURE.md): where each new position's rows are written, and which rows FlashMLA's
//! sparse decode reads for a query, in both of its caches.
//!
//! Rows are addressed as the kernels take them: `page × rows_per_page + row`, with
//! `page = converter.page_index(slot)` for the (layer, role) buffer (a
//! [`PageIndexConverter`] of scale 1 and offset 0 gives slot units). Every table is in
//! position order: a page table's slot `i` holds positions `[start + i·P, start + (i+1)·P)`
//! of a window life cycle; a block table's slot `b` holds compressed entries of tokens
//! `[256b, 256(b + 1))`.
//!
//! * **Window rows** (`k_cache`, every layer): position `p` → row `p mod 64` of the page
//!   holding it. A query at `q` reads positions `max(0, q − W + 1) ..= q` (`W`, the window).
//! * **Compressed entries** (`extra_k_cache`): entry `w` of ratio `r` pools tokens up to
//!   `r·w + r − 1` and is written by that token; it lives in block `⌊r·w / 256⌋`, row
//!   `w mod (256 / r)`. A query at `q` sees entries `w < (q + 1) / r`: all of them on a
//!   ratio-128 layer, the indexer's top-k of them on a ratio-4 layer.
//! * **Compressor state rows**: position `p` → row `p mod P` of its state page.
//!
//! Index lists are padded with −1 to the kernel's width and come with their valid length
//! (`topk_length`, `extra_topk_length`).

use crate::ids::SlotId;
use crate::layout::PageIndexConverter;

/// A position or entry the tables given do not hold.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum V4MetadataError {
    /// A position outside the window table.
    #[error(
        "position {pos} is not held by the table (it holds [{start}, {end})): the rings were \
         not extended for this step, or the position lies behind the window"
    )]
    NotHeld {
        /// The position.
        pos: u64,
        /// The table's first position.
        start: u64,
        /// Its end.
        end: u64,
    },
    /// An entry past the block table.
    #[error(
        "entry {entry} of ratio {ratio} lies in block {block}, but the block table has {blocks}"
    )]
    NoBlock {
        /// The entry.
        entry: u64,
        /// The ratio.
        ratio: u64,
        /// Its block.
        block: u64,
        /// Blocks in the table.
        blocks: usize,
    },
    /// More indices than the kernel's width.
    #[error("{got} indices do not fit the kernel's width {width}")]
    TooMany {
        /// Indices.
        got: usize,
        /// Width.
        width: usize,
    },
    /// A row past what the kernels' int32 indices address.
    #[error("row {row} does not fit the kernels' int32 indices: use fewer slots per pool")]
    RowOverflow {
        /// The row.
        row: i64,
    },
    /// A ratio that is not a compressed layer's.
    #[error("ratio {ratio}: compressed layers have ratio 4 or 128")]
    Ratio {
        /// The ratio.
        ratio: u64,
    },
}

/// Tokens of a V4 block.
const BLOCK: u64 = 256;

/// A window life cycle's page table: the first position held and the slots.
#[derive(Clone, Copy, Debug)]
pub struct PageTable<'a> {
    /// First position of the first page.
    pub start: u64,
    /// Slots, in position order.
    pub slots: &'a [SlotId],
    /// Positions per page.
    pub page: u64,
}

impl PageTable<'_> {
    /// The kernel row of position `pos` for the buffer with `conv`.
    pub fn row(&self, conv: PageIndexConverter, pos: u64) -> Result<i64, V4MetadataError> {
        let end = self.start + self.slots.len() as u64 * self.page;
        if pos < self.start || pos >= end {
            return Err(V4MetadataError::NotHeld {
                pos,
                start: self.start,
                end,
            });
        }
        // `pos ≥ start` and `end > start` here, so `page > 0`.
        let off = pos - self.start;
        let slot = self.slots[(off / self.page) as usize];
        Ok(i64::from(conv.page_index(slot).get()) * self.page as i64 + (off % self.page) as i64)
    }

    /// The write mapping of positions `[from, to)`.
    pub fn slot_mapping(
        &self,
        conv: PageIndexConverter,
        from: u64,
        to: u64,
    ) -> Result<Vec<i64>, V4MetadataError> {
        (from..to).map(|p| self.row(conv, p)).collect()
    }
}

fn to_i32(row: i64) -> Result<i32, V4MetadataError> {
    i32::try_from(row).map_err(|_| V4MetadataError::RowOverflow { row })
}

fn check_ratio(ratio: u64) -> Result<u64, V4MetadataError> {
    match ratio {
        4 | 128 => Ok(BLOCK / ratio),
        _ => Err(V4MetadataError::Ratio { ratio }),
    }
}

/// The kernel row of compressed entry `w` of ratio `ratio` through `blocks`.
pub fn entry_row(
    blocks: &[SlotId],
    conv: PageIndexConverter,
    ratio: u64,
    w: u64,
) -> Result<i64, V4MetadataError> {
    let per_block = check_ratio(ratio)?;
    let block = w / per_block;
    let slot = *blocks.get(block as usize).ok_or(V4MetadataError::NoBlock {
        entry: w,
        ratio,
        block,
        blocks: blocks.len(),
    })?;
    Ok(i64::from(conv.page_index(slot).get()) * per_block as i64 + (w % per_block) as i64)
}

/// The compressed write mapping of positions `[from, to)`: −1 except at the last token of
/// a group, which writes its entry.
pub fn compressed_slot_mapping(
    blocks: &[SlotId],
    conv: PageIndexConverter,
    ratio: u64,
    from: u64,
    to: u64,
) -> Result<Vec<i64>, V4MetadataError> {
    check_ratio(ratio)?;
    (from..to)
        .map(|p| {
            if (p + 1).is_multiple_of(ratio) {
                entry_row(blocks, conv, ratio, p / ratio)
            } else {
                Ok(-1)
            }
        })
        .collect()
}

/// The window rows a query at `q` reads (`window` positions up to `q`), padded with −1
/// to `width`, and how many are valid.
pub fn window_indices(
    table: &PageTable<'_>,
    conv: PageIndexConverter,
    q: u64,
    window: u64,
    width: usize,
) -> Result<(Vec<i32>, u32), V4MetadataError> {
    let low = (q + 1).saturating_sub(window);
    let n = (q + 1 - low) as usize;
    if n > width {
        return Err(V4MetadataError::TooMany { got: n, width });
    }
    let mut out = Vec::with_capacity(width);
    for p in low..=q {
        out.push(to_i32(table.row(conv, p)?)?);
    }
    out.resize(width, -1);
    Ok((out, n as u32))
}

/// The compressed entries a query at `q` can see: `(q + 1) / ratio`.
pub fn visible_entries(q: u64, ratio: u64) -> u64 {
    (q + 1) / ratio
}

/// The indexer's context for a query at `q` on a ratio-4 layer: the `(q + 1) / 4` visible
/// entries, read through the block table's 64-entry pages (the paged indexer-logits
/// problem of the other models, with entries for tokens).
pub fn indexer_context(q: u64) -> u64 {
    visible_entries(q, 4)
}

/// The rows of compressed entries `entries` (a ratio-4 layer: the indexer's top-k; a
/// ratio-128 layer: `0..visible_entries(q, 128)`), padded with −1 to `width`, and how many
/// are valid.
pub fn extra_indices(
    blocks: &[SlotId],
    conv: PageIndexConverter,
    ratio: u64,
    entries: impl IntoIterator<Item = u64>,
    width: usize,
) -> Result<(Vec<i32>, u32), V4MetadataError> {
    let mut out = Vec::with_capacity(width);
    for w in entries {
        if out.len() == width {
            return Err(V4MetadataError::TooMany {
                got: width + 1,
                width,
            });
        }
        out.push(to_i32(entry_row(blocks, conv, ratio, w)?)?);
    }
    let n = out.len() as u32;
    out.resize(width, -1);
    Ok((out, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNIT: PageIndexConverter = PageIndexConverter {
        scale: 1,
        layer_offset: 0,
        expansion: 1,
    };

    fn slots(v: &[u32]) -> Vec<SlotId> {
        v.iter().map(|&s| SlotId(s)).collect()
    }

    /// Worked by hand: a window ring from position 128 over slots 7, 3, 9 (pages of 64).
    #[test]
    fn window_rows_and_indices() {
        let s = slots(&[7, 3, 9]);
        let t = PageTable {
            start: 128,
            slots: &s,
            page: 64,
        };
        assert_eq!(t.row(UNIT, 128), Ok(7 * 64));
        assert_eq!(t.row(UNIT, 200), Ok(3 * 64 + 8));
        assert_eq!(t.row(UNIT, 319), Ok(9 * 64 + 63));
        assert!(matches!(
            t.row(UNIT, 320),
            Err(V4MetadataError::NotHeld { .. })
        ));
        assert!(matches!(
            t.row(UNIT, 127),
            Err(V4MetadataError::NotHeld { .. })
        ));
        // Layer 5 of 44 in the window pool: page = slot · 44 + 5.
        let l5 = PageIndexConverter {
            scale: 44,
            layer_offset: 5,
            expansion: 1,
        };
        assert_eq!(t.row(l5, 200), Ok((3 * 44 + 5) * 64 + 8));
        assert_eq!(
            t.slot_mapping(UNIT, 254, 258).unwrap(),
            [3 * 64 + 62, 3 * 64 + 63, 9 * 64, 9 * 64 + 1]
        );
        // A query at 300 reads 173..=300: 128 rows, all valid.
        let (idx, n) = window_indices(&t, UNIT, 300, 128, 128).unwrap();
        assert_eq!(n, 128);
        assert_eq!(idx[0], 7 * 64 + 45);
        assert_eq!(idx[127], 9 * 64 + 300 - 256);
        // Early in a sequence: a query at 5 reads 0..=5, the rest is padding.
        let s0 = slots(&[4]);
        let t0 = PageTable {
            start: 0,
            slots: &s0,
            page: 64,
        };
        let (idx, n) = window_indices(&t0, UNIT, 5, 128, 128).unwrap();
        assert_eq!((n, &idx[..7]), (6, &[256, 257, 258, 259, 260, 261, -1][..]));
        assert!(idx[6..].iter().all(|&i| i == -1));
        assert!(matches!(
            window_indices(&t, UNIT, 300, 128, 64),
            Err(V4MetadataError::TooMany { .. })
        ));
    }

    /// Worked by hand: blocks 2, 8 (256 tokens each); ratio 4: 64 entries per block;
    /// ratio 128: 2.
    #[test]
    fn compressed_rows_mappings_and_indices() {
        let b = slots(&[2, 8]);
        assert_eq!(entry_row(&b, UNIT, 4, 0), Ok(2 * 64));
        assert_eq!(entry_row(&b, UNIT, 4, 70), Ok(8 * 64 + 6));
        assert_eq!(entry_row(&b, UNIT, 128, 3), Ok(8 * 2 + 1));
        assert!(matches!(
            entry_row(&b, UNIT, 4, 128),
            Err(V4MetadataError::NoBlock { block: 2, .. })
        ));
        assert!(matches!(
            entry_row(&b, UNIT, 2, 0),
            Err(V4MetadataError::Ratio { .. })
        ));
        // Positions 250..262: entries close at 251 (w 62), 255 (63), 259 (64: block 1).
        let m = compressed_slot_mapping(&b, UNIT, 4, 250, 262).unwrap();
        assert_eq!(
            m,
            [
                -1,
                2 * 64 + 62,
                -1,
                -1,
                -1,
                2 * 64 + 63,
                -1,
                -1,
                -1,
                8 * 64,
                -1,
                -1
            ]
        );
        let m = compressed_slot_mapping(&b, UNIT, 128, 126, 130).unwrap();
        assert_eq!(m, [-1, 2 * 2, -1, -1]);
        // A query at 400 sees 100 ratio-4 entries and 3 ratio-128 ones.
        assert_eq!(
            (visible_entries(400, 4), visible_entries(400, 128)),
            (100, 3)
        );
        let (idx, n) = extra_indices(&b, UNIT, 128, 0..3, 128).unwrap();
        assert_eq!((n, &idx[..4]), (3, &[4, 5, 16, -1][..]));
        let (idx, n) = extra_indices(&b, UNIT, 4, [99, 3, 64], 512).unwrap();
        assert_eq!((n, &idx[..3]), (3, &[8 * 64 + 35, 2 * 64 + 3, 8 * 64][..]));
        assert!(matches!(
            extra_indices(&b, UNIT, 4, 0..3, 2),
            Err(V4MetadataError::TooMany { .. })
        ));
        let far = slots(&[40_000_000]);
        assert!(matches!(
            extra_indices(&far, UNIT, 4, [0], 64),
            Err(V4MetadataError::RowOverflow { .. })
        ));
    }
}
