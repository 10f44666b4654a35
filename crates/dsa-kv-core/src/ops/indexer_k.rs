//! Indexer K cache scatter and gather (host reference).
//!
//! The cache is the byte view of one layer's indexer pages (values plane, then scales
//! plane per page). Slot mappings are 64-bit byte offsets into it: one for each token's
//! payload and one for its 4-byte scale word. A negative mapping means "skip" (padding
//! rows of a captured CUDA graph): the token is not written.

use super::OpError;

/// Bytes of an indexer scale word.
pub const SCALE_WORD: usize = 4;

/// Per-token byte offsets of the payload and of the scale word (negative = skip).
#[derive(Clone, Copy, Debug)]
pub struct IndexerMappings<'a> {
    /// Payload offsets.
    pub value: &'a [i64],
    /// Scale-word offsets.
    pub scale: &'a [i64],
}

fn check_width(width: usize) -> Result<(), OpError> {
    if width != 128 && width != 64 {
        return Err(OpError::PayloadWidth { got: width });
    }
    Ok(())
}

fn range(
    cache_len: usize,
    token: usize,
    offset: i64,
    len: usize,
) -> Result<Option<std::ops::Range<usize>>, OpError> {
    if offset < 0 {
        return Ok(None);
    }
    let end = offset + len as i64;
    if end as u64 > cache_len as u64 {
        return Err(OpError::OutOfBounds {
            token,
            offset,
            end,
            cache_len,
        });
    }
    Ok(Some(offset as usize..end as usize))
}

/// Writes `n` tokens: payload `values[i·w..(i+1)·w]` at `value_map[i]`, scale word
/// `scales[4i..4i+4]` at `scale_map[i]`; negative mappings are skipped. Everything is
/// checked before anything is written.
pub fn indexer_k_scatter(
    cache: &mut [u8],
    values: &[u8],
    scales: &[u8],
    maps: IndexerMappings<'_>,
    width: usize,
) -> Result<(), OpError> {
    check_width(width)?;
    let (value_map, scale_map) = (maps.value, maps.scale);
    let n = value_map.len();
    for (what, expected, got) in [
        ("values", n * width, values.len()),
        ("scales", n * SCALE_WORD, scales.len()),
        ("scale mappings", n, scale_map.len()),
    ] {
        if expected != got {
            return Err(OpError::Length {
                what,
                expected,
                got,
            });
        }
    }
    for i in 0..n {
        range(cache.len(), i, value_map[i], width)?;
        range(cache.len(), i, scale_map[i], SCALE_WORD)?;
    }
    for i in 0..n {
        if let Some(r) = range(cache.len(), i, value_map[i], width)? {
            cache[r].copy_from_slice(&values[i * width..(i + 1) * width]);
        }
        if let Some(r) = range(cache.len(), i, scale_map[i], SCALE_WORD)? {
            cache[r].copy_from_slice(&scales[i * SCALE_WORD..(i + 1) * SCALE_WORD]);
        }
    }
    Ok(())
}

/// Reads `n` tokens starting at position `start` of the (full-KV) mappings into
/// contiguous `[n, width]` payloads and `[n, 4]` scale words. A negative mapping reads
/// zeros.
pub fn indexer_k_gather(
    cache: &[u8],
    maps: IndexerMappings<'_>,
    start: usize,
    n: usize,
    width: usize,
    values: &mut [u8],
    scales: &mut [u8],
) -> Result<(), OpError> {
    check_width(width)?;
    let (value_map, scale_map) = (maps.value, maps.scale);
    if scale_map.len() != value_map.len() {
        return Err(OpError::Length {
            what: "scale mappings",
            expected: value_map.len(),
            got: scale_map.len(),
        });
    }
    if start + n > value_map.len() {
        return Err(OpError::Length {
            what: "mapping range end",
            expected: value_map.len(),
            got: start + n,
        });
    }
    for (what, expected, got) in [
        ("values", n * width, values.len()),
        ("scales", n * SCALE_WORD, scales.len()),
    ] {
        if expected != got {
            return Err(OpError::Length {
                what,
                expected,
                got,
            });
        }
    }
    for i in 0..n {
        let t = start + i;
        let dst = &mut values[i * width..(i + 1) * width];
        match range(cache.len(), t, value_map[t], width)? {
            Some(r) => dst.copy_from_slice(&cache[r]),
            None => dst.fill(0),
        }
        let dst = &mut scales[i * SCALE_WORD..(i + 1) * SCALE_WORD];
        match range(cache.len(), t, scale_map[t], SCALE_WORD)? {
            Some(r) => dst.copy_from_slice(&cache[r]),
            None => dst.fill(0),
        }
    }
    Ok(())
}
