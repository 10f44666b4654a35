//! How the V4 forward reaches one request's caches ([`V4Store`]), the row types, and
//! [`V4Contiguous`], the reference: every position kept in plain vectors, no pages, no
//! reuse.

use dsa_kv_core::ops::model1::{MODEL1_DATA, MODEL1_SCALES};

use dsa_kv_core::ops::quant::{dequantize_fp8_token, e4m3_to_f32, quantize_fp8_token, ScaleFormat};

use crate::math::to_bf16;
use crate::{ModelError, INDEX_DIM, INDEX_VALUE_BYTES};

/// Bytes of an indexer key of a compressed entry: 128 FP8 values and a 4-byte scale word.
pub const INDEX_ENTRY_BYTES: usize = INDEX_VALUE_BYTES + 4;

/// The indexer key of `k` (128 values) as the cache stores it: FP8 of its BF16 values
/// with a UE8M0 scale word.
pub(crate) fn encode_index_key(k: &[f32]) -> [u8; INDEX_ENTRY_BYTES] {
    let mut key = [0u8; INDEX_ENTRY_BYTES];
    let (values, scale) = key.split_at_mut(INDEX_VALUE_BYTES);
    quantize_fp8_token(&to_bf16(k), ScaleFormat::Ue8m0, values, scale);
    key
}

/// A stored indexer key's E4M3 values (unscaled) and its scale.
pub(crate) fn decode_index_key(key: &[u8; INDEX_ENTRY_BYTES]) -> ([f32; INDEX_DIM], f32) {
    let mut k = [0f32; INDEX_DIM];
    for (o, &b) in k.iter_mut().zip(&key[..INDEX_VALUE_BYTES]) {
        *o = e4m3_to_f32(b);
    }
    let s = &key[INDEX_VALUE_BYTES..];
    (k, f32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// An indexer query as the kernel takes it: FP8 of its BF16 values with a UE8M0 scale,
/// dequantized.
pub(crate) fn fp8_query(v: &[f32]) -> Vec<f32> {
    let (mut b, mut s) = ([0u8; INDEX_DIM], [0u8; 4]);
    quantize_fp8_token(&to_bf16(v), ScaleFormat::Ue8m0, &mut b, &mut s);
    let mut out = vec![0f32; INDEX_DIM];
    dequantize_fp8_token(&b, &s, &mut out);
    out
}

/// One MODEL1 row: its data bytes (448 e4m3, 64 bf16) and its scale bytes (7 UE8M0 and
/// a zero pad), which a page stores apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Model1Row {
    /// Data bytes.
    pub data: [u8; MODEL1_DATA],
    /// Scale bytes.
    pub scales: [u8; MODEL1_SCALES],
}

/// Which per-position state row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StateKind {
    /// The KV compressor (`coff · 512` kv values, then as many scores).
    Kv,
    /// The indexer's compressor on ratio-4 layers (`2 · 128` and `2 · 128`).
    Index,
    /// On the MTP layer: the target's residual streams at the position
    /// (`hc_mult × hidden` values, BF16-exact: the paged cache stores them as BF16).
    MtpInput,
}

/// Where a V4 forward reads and writes one request's caches. Layers count the target
/// layers first, then the MTP layer; positions and entries count from the request's
/// first token.
pub trait V4Store {
    /// Writes the window row of position `pos`.
    fn write_window(&mut self, layer: usize, pos: u32, row: &Model1Row) -> Result<(), ModelError>;
    /// Reads the window row of position `pos`.
    fn window(&self, layer: usize, pos: u32) -> Result<Model1Row, ModelError>;
    /// Writes a compressor state row (fp32 values) of position `pos`.
    fn write_state(
        &mut self,
        layer: usize,
        kind: StateKind,
        pos: u32,
        row: &[f32],
    ) -> Result<(), ModelError>;
    /// Reads a compressor state row of position `pos`.
    fn state(&self, layer: usize, kind: StateKind, pos: u32) -> Result<Vec<f32>, ModelError>;
    /// Writes compressed entry `w`.
    fn write_entry(&mut self, layer: usize, w: u32, row: &Model1Row) -> Result<(), ModelError>;
    /// Reads compressed entry `w`.
    fn entry(&self, layer: usize, w: u32) -> Result<Model1Row, ModelError>;
    /// Writes the indexer key of compressed entry `w` (values, then the scale word).
    fn write_index_entry(
        &mut self,
        layer: usize,
        w: u32,
        key: &[u8; INDEX_ENTRY_BYTES],
    ) -> Result<(), ModelError>;
    /// Reads the indexer key of compressed entry `w`.
    fn index_entry(&self, layer: usize, w: u32) -> Result<[u8; INDEX_ENTRY_BYTES], ModelError>;
}

/// One request's caches, every position and entry kept, in position order.
#[derive(Default)]
pub struct V4Contiguous {
    windows: Vec<Vec<Option<Model1Row>>>,
    /// Per [`StateKind`] (`Kv`, `Index`, `MtpInput`): per layer, rows in position order.
    states: [Vec<Vec<Option<Vec<f32>>>>; 3],
    entries: Vec<Vec<Option<Model1Row>>>,
    index: Vec<Vec<Option<[u8; INDEX_ENTRY_BYTES]>>>,
}

impl V4Contiguous {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }
}

/// Puts `v` at `at` of layer `layer`'s list, growing both as needed.
fn put<T: Clone>(lists: &mut Vec<Vec<Option<T>>>, layer: usize, at: u32, v: T) {
    if lists.len() <= layer {
        lists.resize(layer + 1, Vec::new());
    }
    let list = &mut lists[layer];
    let at = at as usize;
    if list.len() <= at {
        list.resize(at + 1, None);
    }
    list[at] = Some(v);
}

fn get<T: Clone>(
    lists: &[Vec<Option<T>>],
    layer: usize,
    at: u32,
    what: &str,
) -> Result<T, ModelError> {
    lists
        .get(layer)
        .and_then(|l| l.get(at as usize))
        .and_then(Clone::clone)
        .ok_or_else(|| ModelError::Access(format!("layer {layer}: {what} {at} was never written")))
}

impl V4Store for V4Contiguous {
    fn write_window(&mut self, layer: usize, pos: u32, row: &Model1Row) -> Result<(), ModelError> {
        put(&mut self.windows, layer, pos, *row);
        Ok(())
    }

    fn window(&self, layer: usize, pos: u32) -> Result<Model1Row, ModelError> {
        get(&self.windows, layer, pos, "window row")
    }

    fn write_state(
        &mut self,
        layer: usize,
        kind: StateKind,
        pos: u32,
        row: &[f32],
    ) -> Result<(), ModelError> {
        put(&mut self.states[kind as usize], layer, pos, row.to_vec());
        Ok(())
    }

    fn state(&self, layer: usize, kind: StateKind, pos: u32) -> Result<Vec<f32>, ModelError> {
        let what = match kind {
            StateKind::Kv => "kv state of position",
            StateKind::Index => "indexer state of position",
            StateKind::MtpInput => "MTP input of position",
        };
        get(&self.states[kind as usize], layer, pos, what)
    }

    fn write_entry(&mut self, layer: usize, w: u32, row: &Model1Row) -> Result<(), ModelError> {
        put(&mut self.entries, layer, w, *row);
        Ok(())
    }

    fn entry(&self, layer: usize, w: u32) -> Result<Model1Row, ModelError> {
        get(&self.entries, layer, w, "compressed entry")
    }

    fn write_index_entry(
        &mut self,
        layer: usize,
        w: u32,
        key: &[u8; INDEX_ENTRY_BYTES],
    ) -> Result<(), ModelError> {
        put(&mut self.index, layer, w, *key);
        Ok(())
    }

    fn index_entry(&self, layer: usize, w: u32) -> Result<[u8; INDEX_ENTRY_BYTES], ModelError> {
        get(&self.index, layer, w, "indexer key of entry")
    }
}
