//! Top-k → global row ids for sparse MLA (host reference), and the dense short-sequence
//! path.
//!
//! The indexer's top-k are request-local token positions. Sparse MLA reads rows of the
//! primary pool flattened to `[blocks × L × T, row]`; for top-k position `p ≥ 0` of
//! request `r` on local layer `l` with primary page params `(scale, offset)`:
//! `global = block_table[r][p / T] × (scale × T) + offset × T + p mod T`.
//! `−1` stays `−1`; a page column past the table, or a padded (−1) table entry, gives −1.

use super::OpError;

/// Page geometry of one layer's primary (MLA key) pages.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PrimaryPageParams {
    /// Tokens per block `T`.
    pub tokens_per_block: u32,
    /// Key pages per slot (`L` in V1 and the usual V2 plan).
    pub scale: u32,
    /// This layer's page offset inside a slot.
    pub layer_offset: u32,
}

/// Converts top-k rows (`rows × k`, request-local positions) to global row ids.
/// `row_request[i]` is the request (block-table row) of top-k row `i`.
pub fn topk_to_global(
    topk: &[i32],
    k: usize,
    row_request: &[i32],
    block_table: &[i32],
    max_blocks: usize,
    params: PrimaryPageParams,
    out: &mut [i32],
) -> Result<(), OpError> {
    if topk.len() != row_request.len() * k || out.len() != topk.len() {
        return Err(OpError::Length {
            what: "top-k entries",
            expected: row_request.len() * k,
            got: topk.len().min(out.len()),
        });
    }
    let t = i64::from(params.tokens_per_block);
    let per_slot = i64::from(params.scale) * t;
    let base = i64::from(params.layer_offset) * t;
    for (row, &r) in row_request.iter().enumerate() {
        let table_row = usize::try_from(r)
            .ok()
            .filter(|&r| (r + 1) * max_blocks <= block_table.len())
            .ok_or(OpError::Length {
                what: "block-table rows",
                expected: block_table.len() / max_blocks.max(1),
                got: r.max(0) as usize + 1,
            })?;
        let table = &block_table[table_row * max_blocks..(table_row + 1) * max_blocks];
        for j in row * k..(row + 1) * k {
            let p = topk[j];
            out[j] = if p < 0 {
                -1
            } else {
                let col = (i64::from(p) / t) as usize;
                match table.get(col) {
                    Some(&slot) if slot >= 0 => {
                        let g = i64::from(slot) * per_slot + base + i64::from(p) % t;
                        i32::try_from(g).map_err(|_| OpError::Int32Overflow {
                            what: "global row id",
                            value: g,
                        })?
                    }
                    _ => -1,
                }
            };
        }
    }
    Ok(())
}

/// The short-sequence path: when a row's `kv_len ≤ k` the indexer is skipped and the
/// row attends to every token: `[0, kv_len)` then `−1` padding.
pub fn dense_topk(kv_lens: &[i32], k: usize, out: &mut [i32]) -> Result<(), OpError> {
    if out.len() != kv_lens.len() * k {
        return Err(OpError::Length {
            what: "top-k entries",
            expected: kv_lens.len() * k,
            got: out.len(),
        });
    }
    for (row, &len) in kv_lens.iter().enumerate() {
        if len < 0 || len as usize > k {
            return Err(OpError::Length {
                what: "kv_len of the dense top-k path (must be ≤ top-k)",
                expected: k,
                got: len.max(0) as usize,
            });
        }
        for (j, o) in out[row * k..(row + 1) * k].iter_mut().enumerate() {
            *o = if (j as i32) < len { j as i32 } else { -1 };
        }
    }
    Ok(())
}
