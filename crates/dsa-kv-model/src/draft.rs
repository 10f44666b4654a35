//! The MTP draft layer: its KV (a pure function of token and position, written to the
//! draft cache or to the layer after the target's) and its proposal chains, whose own KV
//! lives in an [`Overlay`] over the cache, never written to it.

use super::math::{add, rmsnorm32};
use super::model::At;
use super::{KvStore, Model, ModelError};

/// Where the MTP draft layer's KV lives in a [`KvStore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftCache {
    /// The store's layer index (0 in a separate draft cache; after the target layers
    /// when the MTP layer shares the target's cache).
    pub layer: usize,
    /// Whether that layer has an indexer cache.
    pub indexer: bool,
}

/// A draft chain's view: positions from `from` on live in local buffers (computed, not
/// yet in the cache), earlier ones are read from `base`.
pub(crate) struct Overlay<'a> {
    base: &'a dyn KvStore,
    layer: usize,
    from: u32,
    rows: Vec<Vec<u8>>,
    keys: Vec<(Vec<u8>, Vec<u8>)>,
    row_bytes: usize,
}

impl<'a> Overlay<'a> {
    fn new(base: &'a dyn KvStore, layer: usize, from: u32, row_bytes: usize) -> Self {
        Overlay {
            base,
            layer,
            from,
            rows: Vec::new(),
            keys: Vec::new(),
            row_bytes,
        }
    }

    /// Index of local position `pos`, if it is one.
    fn local(&self, layer: usize, pos: u32) -> Result<Option<usize>, ModelError> {
        if layer != self.layer {
            return Err(ModelError::Access(format!(
                "the draft chain reads layer {layer}, not {}",
                self.layer
            )));
        }
        Ok(pos.checked_sub(self.from).map(|i| i as usize))
    }
}

impl KvStore for Overlay<'_> {
    fn write_row(&mut self, layer: usize, pos: u32, row: &[u8]) -> Result<(), ModelError> {
        match self.local(layer, pos)? {
            Some(i) if i == self.rows.len() && row.len() == self.row_bytes => {
                self.rows.push(row.to_vec());
                Ok(())
            }
            _ => Err(ModelError::Access(format!(
                "the draft chain writes position {pos} out of order"
            ))),
        }
    }

    fn write_index_key(
        &mut self,
        layer: usize,
        pos: u32,
        values: &[u8],
        scale: &[u8],
    ) -> Result<(), ModelError> {
        match self.local(layer, pos)? {
            Some(i) if i == self.keys.len() => {
                self.keys.push((values.to_vec(), scale.to_vec()));
                Ok(())
            }
            _ => Err(ModelError::Access(format!(
                "the draft chain writes key {pos} out of order"
            ))),
        }
    }

    fn index_key(&self, layer: usize, pos: u32) -> Result<(&[u8], &[u8]), ModelError> {
        match self.local(layer, pos)? {
            Some(i) => self
                .keys
                .get(i)
                .map(|(v, s)| (v.as_slice(), s.as_slice()))
                .ok_or_else(|| ModelError::Access(format!("draft key {pos} not computed"))),
            None => self.base.index_key(layer, pos),
        }
    }

    fn rows(&self, layer: usize, positions: &[u32]) -> Result<Vec<&[u8]>, ModelError> {
        let split = positions.partition_point(|&p| p < self.from);
        let mut out = self.base.rows(layer, &positions[..split])?;
        for &p in &positions[split..] {
            let i = self.local(layer, p)?.unwrap_or(usize::MAX);
            out.push(
                self.rows
                    .get(i)
                    .ok_or_else(|| ModelError::Access(format!("draft row {p} not computed")))?,
            );
        }
        Ok(out)
    }

    fn global_index(&self, layer: usize, pos: u32) -> Result<i64, ModelError> {
        match self.local(layer, pos)? {
            Some(_) => Err(ModelError::Access(format!(
                "draft position {pos} is not in the cache"
            ))),
            None => self.base.global_index(layer, pos),
        }
    }
}

impl Model {
    /// A checkpoint's model has no MTP draft layer (transformers does not load one).
    pub(crate) fn has_draft(&self) -> Result<(), ModelError> {
        if self.hf.is_some() {
            return Err(ModelError::Unsupported(
                "a checkpoint's model has no MTP draft layer: run it without speculative \
                 decoding and without an MTP cache layer (model.num_mtp_layers = 0)"
                    .into(),
            ));
        }
        Ok(())
    }

    fn draft_at(&self, cache: DraftCache) -> At<'_> {
        At {
            w: &self.draft,
            cache: cache.layer,
            indexer: cache.indexer,
        }
    }

    /// Writes the MTP draft layer's KV of `tokens` at positions `first..` into `cache`. The
    /// draft layer's KV of a position depends only on its token and position, so it is
    /// the same for every request that shares the prefix.
    pub fn draft_write(
        &self,
        kv: &mut dyn KvStore,
        cache: DraftCache,
        first: u32,
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        self.has_draft()?;
        let at = self.draft_at(cache);
        for (i, &t) in tokens.iter().enumerate() {
            self.write_kv(kv, at, &rmsnorm32(&self.embedding(t)), first + i as u32)?;
        }
        Ok(())
    }

    /// The MTP draft layer's `k` proposals for positions `last + 2 ..`: `hidden` is the
    /// target's final hidden state at `last`, `next` the token sampled there (position
    /// `last + 1`); `cache` in `kv` holds the draft KV of positions
    /// `0..=last`. Each proposal is the draft layer's greedy token; the chain feeds each
    /// proposal back with the draft's own hidden state (its KV is computed here, not
    /// written). Deterministic and batch-invariant like the target.
    pub fn propose(
        &self,
        kv: &dyn KvStore,
        cache: DraftCache,
        last: u32,
        hidden: &[f32],
        next: u32,
        k: usize,
    ) -> Result<Vec<u32>, ModelError> {
        self.has_draft()?;
        let at = self.draft_at(cache);
        let mut local = Overlay::new(kv, cache.layer, last + 1, self.format.row_bytes());
        let mut h = hidden.to_vec();
        let mut tok = next;
        let mut out = Vec::with_capacity(k);
        for i in 0..k as u32 {
            let pos = last + 1 + i;
            self.write_kv(&mut local, at, &rmsnorm32(&self.embedding(tok)), pos)?;
            let mut x = self.embedding(tok);
            add(&mut x, &rmsnorm32(&h));
            let attn = self.attend(&local, at, &rmsnorm32(&x), pos, None)?;
            add(&mut x, &attn);
            self.mlp(&self.draft, &mut x);
            tok = self.output(&x, pos).greedy;
            out.push(tok);
            h = x;
        }
        Ok(out)
    }
}
