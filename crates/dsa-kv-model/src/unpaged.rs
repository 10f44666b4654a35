//! The reference cache: one request alone, its rows in position order in plain
//! vectors, no pages, no reuse. The exactness test compares every run through the
//! runtime against the model run on this.

use super::{CacheFormat, DraftCache, KvStore, Model, ModelError, TokenOut, INDEX_VALUE_BYTES};

/// One request's contiguous cache.
pub struct Contiguous {
    row_bytes: usize,
    /// Per layer: rows in position order.
    rows: Vec<Vec<u8>>,
    /// Per layer: indexer keys (values then scale word) in position order.
    keys: Vec<Vec<u8>>,
}

const KEY_BYTES: usize = INDEX_VALUE_BYTES + 4;

impl Contiguous {
    /// An empty cache for `format`.
    pub fn new(format: &CacheFormat) -> Self {
        let n = format.indexer.len();
        Contiguous {
            row_bytes: format.row_bytes(),
            rows: vec![Vec::new(); n],
            keys: vec![Vec::new(); n],
        }
    }

    /// Positions cached.
    pub fn len(&self) -> u32 {
        self.rows
            .first()
            .map_or(0, |r| (r.len() / self.row_bytes) as u32)
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn put(buf: &mut Vec<u8>, unit: usize, pos: u32, bytes: &[u8]) -> Result<(), ModelError> {
    let at = pos as usize * unit;
    if at > buf.len() {
        return Err(ModelError::Access(format!(
            "position {pos} written before position {}",
            buf.len() / unit
        )));
    }
    if at == buf.len() {
        buf.extend_from_slice(bytes);
    } else {
        buf[at..at + unit].copy_from_slice(bytes);
    }
    Ok(())
}

fn get(buf: &[u8], unit: usize, pos: u32) -> Result<&[u8], ModelError> {
    let at = pos as usize * unit;
    buf.get(at..at + unit)
        .ok_or_else(|| ModelError::Access(format!("position {pos} is not cached")))
}

impl KvStore for Contiguous {
    fn write_row(&mut self, layer: usize, pos: u32, row: &[u8]) -> Result<(), ModelError> {
        put(&mut self.rows[layer], self.row_bytes, pos, row)
    }

    fn write_index_key(
        &mut self,
        layer: usize,
        pos: u32,
        values: &[u8],
        scale: &[u8],
    ) -> Result<(), ModelError> {
        let mut k = [0u8; KEY_BYTES];
        k[..INDEX_VALUE_BYTES].copy_from_slice(values);
        k[INDEX_VALUE_BYTES..].copy_from_slice(scale);
        put(&mut self.keys[layer], KEY_BYTES, pos, &k)
    }

    fn index_key(&self, layer: usize, pos: u32) -> Result<(&[u8], &[u8]), ModelError> {
        Ok(get(&self.keys[layer], KEY_BYTES, pos)?.split_at(INDEX_VALUE_BYTES))
    }

    fn rows(&self, layer: usize, positions: &[u32]) -> Result<Vec<&[u8]>, ModelError> {
        positions
            .iter()
            .map(|&p| get(&self.rows[layer], self.row_bytes, p))
            .collect()
    }
}

/// What the model produces for one request run alone: its prompt in one pass, then
/// `max_new` greedy tokens one at a time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    /// Every position's output (the prompt's and each generated token's).
    pub outputs: Vec<TokenOut>,
    /// The generated tokens.
    pub tokens: Vec<u32>,
}

/// Runs `prompt` then `max_new` greedy tokens on a fresh contiguous cache.
pub fn generate(
    model: &Model,
    format: &CacheFormat,
    prompt: &[u32],
    max_new: u32,
) -> Result<Generation, ModelError> {
    let mut kv = Contiguous::new(format);
    let mut outputs = model.run(&mut kv, 0, prompt)?;
    let mut tokens = Vec::new();
    while (tokens.len() as u32) < max_new {
        let next = outputs.last().map_or(0, |o| o.greedy);
        tokens.push(next);
        if tokens.len() as u32 == max_new {
            break;
        }
        let pos = kv.len();
        outputs.extend(model.run(&mut kv, pos, &[next])?);
    }
    Ok(Generation { outputs, tokens })
}

/// The MTP draft layer's proposals along `tokens` (one request alone, contiguous target
/// and draft caches, the draft layer with an indexer when `draft_indexer`): entry
/// `last` holds the `k` tokens proposed once `tokens[last + 1]` is sampled after
/// position `last`, for every `last < tokens.len() - 1`.
pub fn draft_reference(
    model: &Model,
    format: &CacheFormat,
    draft_indexer: bool,
    tokens: &[u32],
    k: usize,
) -> Result<Vec<Vec<u32>>, ModelError> {
    let mut kv = Contiguous::new(format);
    let (_, hidden) = model.run_hidden(&mut kv, 0, tokens)?;
    let mut draft = Contiguous::new(&CacheFormat {
        indexer: vec![draft_indexer],
        ..format.clone()
    });
    let at = DraftCache {
        layer: 0,
        indexer: draft_indexer,
    };
    model.draft_write(&mut draft, at, 0, tokens)?;
    (0..tokens.len().saturating_sub(1))
        .map(|last| model.propose(&draft, at, last as u32, &hidden[last], tokens[last + 1], k))
        .collect()
}
