//! DeepSeek-V4's layer structure ([`V4Spec`]): per target layer a compression ratio
//! (0: sliding window only; 4: overlapping 4→1 compressed KV with a lightning indexer;
//! 128: 128→1 compressed KV, dense), the window-only MTP layers, the window, the
//! 256-token logical block. Presets: [`V4Spec::flash`], [`V4Spec::pro`] (the published
//! configurations' `compress_ratios`, checked against transcriptions of their
//! `config.json`; transformers' default list does not match Pro's). Not yet a model the
//! cache manager plans: the plan is in ARCHITECTURE.md; `layout` computes its bytes
//! ([`crate::layout::V4BlockBytes`], [`crate::layout::V4WindowBytes`]).

use serde::{Deserialize, Serialize};

use super::IndexerDtype;

/// Tokens of a V4 logical block (the prefix-reuse unit: a multiple of every page size
/// and of both compression ratios).
pub const V4_BLOCK_TOKENS: u32 = 256;
/// The most values of the MTP layer's target input per position ([`V4Spec::mtp_input_width`]).
pub const MAX_MTP_INPUT_WIDTH: u32 = 1 << 20;
/// Tokens per page of the sliding-window KV.
pub const V4_WINDOW_PAGE_TOKENS: u32 = 64;

/// A DeepSeek-V4 model's cache structure.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct V4Spec {
    /// Display name.
    pub name: String,
    /// Per target layer: 0, 4 or 128.
    pub compress_ratios: Vec<u32>,
    /// MTP layers (window only).
    pub num_mtp_layers: u32,
    /// Raw tokens every layer attends in its sliding window.
    pub window: u32,
    /// Indexer keys selected per query (ratio-4 layers).
    pub index_topk: u32,
    /// Query heads (the sparse decode kernel takes 64 or 128).
    pub num_q_heads: u32,
    /// Indexer key storage (FP8: 132 B, MXFP4: 68 B per compressed entry).
    pub indexer_dtype: IndexerDtype,
    /// Values per position of what the published MTP layer reads of the target besides
    /// the tokens: its pre-`hc_head` residual streams (`hc_mult × hidden`), kept as BF16
    /// for the last position written and at every block boundary, so that the MTP row
    /// after a boundary can be built on a prefix hit. 0: the MTP layer reads no target
    /// state (or there is none).
    #[serde(default)]
    pub mtp_input_width: u32,
}

/// The published DeepSeek-V4 models.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum V4Preset {
    /// [`V4Spec::flash`].
    #[serde(rename = "deepseek-v4-flash")]
    Flash,
    /// [`V4Spec::pro`].
    #[serde(rename = "deepseek-v4-pro")]
    Pro,
}

impl V4Preset {
    /// Every preset.
    pub const ALL: [V4Preset; 2] = [V4Preset::Flash, V4Preset::Pro];

    /// The name used on command lines.
    pub fn name(self) -> &'static str {
        match self {
            V4Preset::Flash => "deepseek-v4-flash",
            V4Preset::Pro => "deepseek-v4-pro",
        }
    }

    /// Parses a name as printed by [`V4Preset::name`].
    pub fn parse(s: &str) -> Option<V4Preset> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The preset's structure.
    pub fn spec(self) -> V4Spec {
        match self {
            V4Preset::Flash => V4Spec::flash(),
            V4Preset::Pro => V4Spec::pro(),
        }
    }
}

/// What a layer caches.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum V4LayerKind {
    /// Ratio 0: the window only.
    WindowOnly,
    /// Ratio 4: window, 4→1 compressed KV, indexer keys over it.
    Compressed4,
    /// Ratio 128: window, 128→1 compressed KV.
    Compressed128,
}

/// A V4 structure that cannot be.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum V4Error {
    /// A ratio other than 0, 4 or 128.
    #[error("compress_ratios[{layer}] = {ratio}: DeepSeek-V4 layers have ratio 0, 4 or 128")]
    Ratio {
        /// The layer.
        layer: usize,
        /// Its ratio.
        ratio: u32,
    },
    /// A setting outside what the format and kernels take.
    #[error("{field} = {value}: {what}")]
    Field {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What is required.
        what: &'static str,
    },
}

impl V4Spec {
    /// `[0, 0]` or `[128, 128]` then ratio 4 at even and 128 at odd layers.
    fn alternating(first_two: u32, layers: usize) -> Vec<u32> {
        (0..layers)
            .map(|l| match l {
                0 | 1 => first_two,
                l if l % 2 == 0 => 4,
                _ => 128,
            })
            .collect()
    }

    /// DeepSeek-V4-Flash: 43 layers (2 window-only, 21 ratio-4, 20 ratio-128), 1 MTP
    /// layer, window 128, top-512, 64 query heads, FP8 indexer keys. Without the MTP
    /// layer's target input (`mtp_input_width` 0): a checkpoint's configuration supplies
    /// it (`hc_mult × hidden_size`, 16,384 for Flash).
    pub fn flash() -> V4Spec {
        V4Spec {
            name: "DeepSeek-V4-Flash".into(),
            compress_ratios: Self::alternating(0, 43),
            num_mtp_layers: 1,
            window: 128,
            index_topk: 512,
            num_q_heads: 64,
            indexer_dtype: IndexerDtype::Fp8,
            mtp_input_width: 0,
        }
    }

    /// DeepSeek-V4-Pro: 61 layers (30 ratio-4, 31 ratio-128), 1 MTP layer, window 128,
    /// top-1024, 128 query heads, FP8 indexer keys; `mtp_input_width` 0 as for
    /// [`flash`](Self::flash) (28,672 for Pro).
    pub fn pro() -> V4Spec {
        V4Spec {
            name: "DeepSeek-V4-Pro".into(),
            compress_ratios: Self::alternating(128, 61),
            num_mtp_layers: 1,
            window: 128,
            index_topk: 1024,
            num_q_heads: 128,
            indexer_dtype: IndexerDtype::Fp8,
            mtp_input_width: 0,
        }
    }

    /// Checks the structure.
    pub fn validate(&self) -> Result<(), V4Error> {
        if self.compress_ratios.is_empty() {
            return Err(V4Error::Field {
                field: "compress_ratios",
                value: 0,
                what: "one ratio per target layer, at least one layer",
            });
        }
        for (layer, &ratio) in self.compress_ratios.iter().enumerate() {
            if !matches!(ratio, 0 | 4 | 128) {
                return Err(V4Error::Ratio { layer, ratio });
            }
        }
        if self.window == 0 || self.window > V4_BLOCK_TOKENS {
            return Err(V4Error::Field {
                field: "window",
                value: u64::from(self.window),
                what: "between 1 and the 256-token block (the published models: 128)",
            });
        }
        if !matches!(self.num_q_heads, 64 | 128) {
            return Err(V4Error::Field {
                field: "num_q_heads",
                value: u64::from(self.num_q_heads),
                what: "64 or 128 (FlashMLA's sparse decode)",
            });
        }
        if self.mtp_input_width > MAX_MTP_INPUT_WIDTH {
            return Err(V4Error::Field {
                field: "mtp_input_width",
                value: u64::from(self.mtp_input_width),
                what: "at most 2^20 values (hc_mult × hidden; the published models: 16,384 and 28,672)",
            });
        }
        if self.index_topk == 0 || !self.index_topk.is_multiple_of(64) {
            return Err(V4Error::Field {
                field: "index_topk",
                value: u64::from(self.index_topk),
                what: "a positive multiple of 64 (FlashMLA's sparse decode)",
            });
        }
        Ok(())
    }

    /// What target layer `layer` caches (`None` past the target layers).
    pub fn layer_kind(&self, layer: usize) -> Option<V4LayerKind> {
        self.compress_ratios.get(layer).map(|r| match r {
            0 => V4LayerKind::WindowOnly,
            4 => V4LayerKind::Compressed4,
            _ => V4LayerKind::Compressed128,
        })
    }

    /// Target layers of each kind: (window only, ratio 4, ratio 128).
    pub fn layer_counts(&self) -> (usize, usize, usize) {
        let count = |k| {
            (0..self.compress_ratios.len())
                .filter(|&l| self.layer_kind(l) == Some(k))
                .count()
        };
        (
            count(V4LayerKind::WindowOnly),
            count(V4LayerKind::Compressed4),
            count(V4LayerKind::Compressed128),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_presets_have_the_published_layer_structure() {
        let f = V4Spec::flash();
        assert_eq!(f.compress_ratios.len(), 43);
        assert_eq!(&f.compress_ratios[..5], &[0, 0, 4, 128, 4]);
        assert_eq!(f.compress_ratios[42], 4);
        assert_eq!(f.layer_counts(), (2, 21, 20));
        let p = V4Spec::pro();
        assert_eq!(p.compress_ratios.len(), 61);
        assert_eq!(&p.compress_ratios[..5], &[128, 128, 4, 128, 4]);
        assert_eq!(p.layer_counts(), (0, 30, 31));
        assert_eq!(p.layer_kind(61), None);
        f.validate().unwrap();
        p.validate().unwrap();
        for preset in V4Preset::ALL {
            assert_eq!(V4Preset::parse(preset.name()), Some(preset));
        }
        assert_eq!(V4Preset::Pro.spec(), p);
        assert_eq!(V4Preset::parse("deepseek-v4"), None);
    }

    #[test]
    fn impossible_structures_are_typed_errors() {
        let bad = |f: fn(&mut V4Spec)| {
            let mut s = V4Spec::flash();
            f(&mut s);
            s.validate().unwrap_err().to_string()
        };
        assert!(bad(|s| s.compress_ratios[7] = 2).contains("compress_ratios[7] = 2"));
        assert!(bad(|s| s.compress_ratios.clear()).contains("at least one layer"));
        assert!(bad(|s| s.window = 0).contains("window = 0"));
        assert!(bad(|s| s.num_q_heads = 32).contains("64 or 128"));
        assert!(bad(|s| s.index_topk = 500).contains("multiple of 64"));
    }
}
