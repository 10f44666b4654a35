//! How a forward reaches one request's cache: [`KvStore`] (write rows and indexer keys,
//! read them back, the global index a sparse kernel is handed) and the [`CacheFormat`]
//! the rows are encoded in.

use dsa_kv_core::config::{DsaModel, KvDtype};
use dsa_kv_core::ids::LayerId;
use dsa_kv_core::layout::FP8_DS_MLA_ROW_BYTES;
use dsa_kv_core::ops::quant::ScaleFormat;

use super::config::{LATENT, ROPE};
use super::ModelError;

/// How the cache rows are encoded, and whether a layer has an indexer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheFormat {
    /// MLA row encoding (BF16 or `fp8_ds_mla`).
    pub kv_dtype: KvDtype,
    /// Scale format of the FP8 tiles and indexer keys.
    pub scale_format: ScaleFormat,
    /// Per layer: whether it has an indexer (layers without one attend densely).
    pub indexer: Vec<bool>,
}

impl CacheFormat {
    /// The format of the target cache a model configuration describes, as the devices
    /// lay it out: its KV dtype, UE8M0 scales, and which of its target layers have an
    /// indexer.
    pub fn of(dsa: &DsaModel) -> CacheFormat {
        let spec = dsa.spec();
        CacheFormat {
            kv_dtype: spec.kv_dtype,
            scale_format: ScaleFormat::Ue8m0,
            indexer: (0..spec.num_layers)
                .map(|l| dsa.has_indexer(LayerId(l)))
                .collect(),
        }
    }

    /// Bytes of one MLA row.
    pub fn row_bytes(&self) -> usize {
        match self.kv_dtype {
            KvDtype::Fp8DsMla => FP8_DS_MLA_ROW_BYTES,
            _ => 2 * (LATENT + ROPE),
        }
    }
}

/// Where a forward reads and writes one request's cache. Positions count from the
/// request's first token.
pub trait KvStore {
    /// Writes the MLA row of position `pos` of `layer`.
    fn write_row(&mut self, layer: usize, pos: u32, row: &[u8]) -> Result<(), ModelError>;
    /// Writes the indexer key (FP8 values, 4-byte scale word) of position `pos`.
    fn write_index_key(
        &mut self,
        layer: usize,
        pos: u32,
        values: &[u8],
        scale: &[u8],
    ) -> Result<(), ModelError>;
    /// Reads the indexer key of position `pos` (values, scale word).
    fn index_key(&self, layer: usize, pos: u32) -> Result<(&[u8], &[u8]), ModelError>;
    /// Reads the MLA rows of `positions` (ascending), in that order.
    fn rows(&self, layer: usize, positions: &[u32]) -> Result<Vec<&[u8]>, ModelError>;
    /// The global token index a sparse MLA kernel is handed for position `pos` (what
    /// [`rows`](Self::rows) reads). The default, for a store without pages: the
    /// position itself.
    fn global_index(&self, layer: usize, pos: u32) -> Result<i64, ModelError> {
        let _ = layer;
        Ok(i64::from(pos))
    }
}
