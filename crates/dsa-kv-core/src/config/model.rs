//! DSA model specifications: the dimensions that decide every byte of the cache (an MLA
//! latent row of `kv_lora_rank` 512 + `qk_rope_head_dim` 64 elements, one KV head; per
//! indexer layer one 128-dim key and one 4-byte scale per token; 64-token pages, as the
//! DeepGEMM and FlashMLA kernels require), with presets for DeepSeek-V3.2, GLM-5, GLM-5.2 and
//! Mistral Large 3. A [`DsaModelSpec`] is plain data any field of which can be
//! overridden; [`DsaModel::new`] validates it against the kernel contracts.

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::ids::LayerId;

/// Storage type of the MLA latent row.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    /// 576 BF16 values: 1152 B per token per layer.
    Bf16,
    /// 576 FP8 E4M3 values with a per-tensor scale kept outside the cache: 576 B.
    Fp8,
    /// FlashMLA's inline-scale row: 512 FP8 "nope" values in 4 tiles of 128, 4 f32 tile
    /// scales, 64 BF16 rope values: 656 B.
    Fp8DsMla,
    /// E2M1 pairs (288 B) plus one FP8 scale per 16 elements in a separate
    /// `KeyBlockScale` buffer (36 B): 324 B.
    Nvfp4,
}

impl KvDtype {
    /// Every dtype, in documentation order.
    pub const ALL: [KvDtype; 4] = [
        KvDtype::Bf16,
        KvDtype::Fp8,
        KvDtype::Fp8DsMla,
        KvDtype::Nvfp4,
    ];

    /// The name used on command lines and in config files.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8 => "fp8",
            KvDtype::Fp8DsMla => "fp8_ds_mla",
            KvDtype::Nvfp4 => "nvfp4",
        }
    }

    /// Parses a name as printed by [`KvDtype::name`].
    pub fn parse(s: &str) -> Result<Self, ModelError> {
        Self::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| ModelError::UnknownName {
                field: "kv_dtype",
                value: s.to_string(),
                expected: "bf16, fp8, fp8_ds_mla or nvfp4",
            })
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Storage type of the lightning-indexer keys.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexerDtype {
    /// 128 FP8 values + one 4-byte f32 scale: 132 B per token per indexer layer.
    Fp8,
    /// 64 bytes of packed E2M1 pairs + four packed UE8M0 exponents: 68 B.
    Fp4,
}

impl IndexerDtype {
    /// Every dtype.
    pub const ALL: [IndexerDtype; 2] = [IndexerDtype::Fp8, IndexerDtype::Fp4];

    /// The name used on command lines and in config files.
    pub fn name(self) -> &'static str {
        match self {
            IndexerDtype::Fp8 => "fp8",
            IndexerDtype::Fp4 => "fp4",
        }
    }

    /// Parses a name as printed by [`IndexerDtype::name`].
    pub fn parse(s: &str) -> Result<Self, ModelError> {
        Self::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| ModelError::UnknownName {
                field: "indexer_dtype",
                value: s.to_string(),
                expected: "fp8 or fp4",
            })
    }
}

impl fmt::Display for IndexerDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which target layers own an indexer K cache.
///
/// GLM-5.2 shares top-k across layers ("IndexShare"): only *full* layers run the
/// indexer and own indexer storage; *shared* layers reuse the top-k of the previous
/// full layer and store no indexer keys.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexerLayers {
    /// Every target layer owns an indexer (DeepSeek-V3.2, GLM-5).
    All,
    /// The first `skip_offset` layers are full; after them every `freq`-th layer,
    /// counted from the last of those leading layers, is full; the rest are shared.
    ///
    /// GLM-5.2 uses `skip_offset = 3, freq = 4`: full layers are
    /// {0, 1, 2} ∪ {6, 10, 14, …, 74}, 21 of 78. Layers 3–5 reuse layer 2's top-k,
    /// 7–9 reuse layer 6's, and so on up to 75–77 reusing layer 74's.
    Shared {
        /// Number of leading layers that are always full (≥ 1).
        skip_offset: u32,
        /// Period of full layers after the leading ones (≥ 1).
        freq: u32,
    },
    /// An explicit mask, one entry per target layer (`true` = owns an indexer).
    Mask(Vec<bool>),
}

impl IndexerLayers {
    /// Whether target layer `layer` (0-based) owns an indexer under this pattern.
    pub fn is_full(&self, layer: u32) -> bool {
        match self {
            IndexerLayers::All => true,
            IndexerLayers::Shared { skip_offset, freq } => {
                let last_leading = skip_offset.saturating_sub(1);
                layer < *skip_offset || (layer - last_leading).is_multiple_of((*freq).max(1))
            }
            IndexerLayers::Mask(mask) => mask.get(layer as usize).copied().unwrap_or(false),
        }
    }
}

/// The well-known models. Each DSA preset is a [`DsaModelSpec`] with the published
/// dims; each DeepSeek-V4 preset a [`V4Spec`](super::V4Spec) (a model with sliding
/// windows, served by the same runtime through `KvCacheBuilder::windowed_backend`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum ModelPreset {
    /// DeepSeek-V3.2: 61 layers, all with an indexer, 1 MTP layer.
    #[serde(rename = "deepseek-v3.2")]
    DeepSeekV32,
    /// GLM-5: 78 layers, all with an indexer, 1 MTP layer.
    #[serde(rename = "glm-5")]
    Glm5,
    /// GLM-5.2: 78 layers, 21 own an indexer (see [`IndexerLayers::Shared`]), 1 MTP layer.
    #[serde(rename = "glm-5.2")]
    Glm52,
    /// Mistral Large 3: a DeepSeek-V3 backbone; the layer count is a parameter.
    #[serde(rename = "mistral-large-3")]
    MistralLarge3,
    /// DeepSeek-V4-Flash ([`V4Preset::Flash`](super::V4Preset::Flash)).
    #[serde(rename = "deepseek-v4-flash")]
    DeepSeekV4Flash,
    /// DeepSeek-V4-Pro ([`V4Preset::Pro`](super::V4Preset::Pro)).
    #[serde(rename = "deepseek-v4-pro")]
    DeepSeekV4Pro,
}

impl ModelPreset {
    /// Every DSA preset (those with a [`DsaModelSpec`]).
    pub const ALL: [ModelPreset; 4] = [
        ModelPreset::DeepSeekV32,
        ModelPreset::Glm5,
        ModelPreset::Glm52,
        ModelPreset::MistralLarge3,
    ];

    /// The name used on command lines and in config files.
    pub fn name(self) -> &'static str {
        match self {
            ModelPreset::DeepSeekV32 => "deepseek-v3.2",
            ModelPreset::Glm5 => "glm-5",
            ModelPreset::Glm52 => "glm-5.2",
            ModelPreset::MistralLarge3 => "mistral-large-3",
            ModelPreset::DeepSeekV4Flash => "deepseek-v4-flash",
            ModelPreset::DeepSeekV4Pro => "deepseek-v4-pro",
        }
    }

    /// The DeepSeek-V4 preset this is, if it is one (a model with sliding windows).
    pub fn windowed(self) -> Option<super::V4Preset> {
        match self {
            ModelPreset::DeepSeekV4Flash => Some(super::V4Preset::Flash),
            ModelPreset::DeepSeekV4Pro => Some(super::V4Preset::Pro),
            _ => None,
        }
    }

    /// Parses a name as printed by [`ModelPreset::name`].
    pub fn parse(s: &str) -> Result<Self, ModelError> {
        Self::ALL
            .into_iter()
            .chain([ModelPreset::DeepSeekV4Flash, ModelPreset::DeepSeekV4Pro])
            .find(|p| p.name() == s)
            .ok_or_else(|| ModelError::UnknownName {
                field: "model",
                value: s.to_string(),
                expected: "deepseek-v3.2, glm-5, glm-5.2, mistral-large-3, deepseek-v4-flash \
                           or deepseek-v4-pro",
            })
    }

    /// The preset's spec. `num_layers` is required for Mistral Large 3 and, when given,
    /// overrides the published layer count of the other presets.
    pub fn spec(self, num_layers: Option<u32>) -> Result<DsaModelSpec, ModelError> {
        let mut spec = match self {
            ModelPreset::DeepSeekV32 => DsaModelSpec::deepseek_v32(),
            ModelPreset::Glm5 => DsaModelSpec::glm5(),
            ModelPreset::Glm52 => DsaModelSpec::glm52(),
            ModelPreset::MistralLarge3 => {
                let n = num_layers.ok_or(ModelError::MissingLayerCount)?;
                DsaModelSpec::mistral_large3(n)
            }
            ModelPreset::DeepSeekV4Flash | ModelPreset::DeepSeekV4Pro => {
                return Err(ModelError::V4NotServed { model: self.name() })
            }
        };
        if let Some(n) = num_layers {
            spec.num_layers = n;
        }
        Ok(spec)
    }
}

impl fmt::Display for ModelPreset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The dimensions of a DSA model, as plain data. Start from a preset and override any
/// field, then validate with [`DsaModel::new`].
///
/// ```
/// use dsa_kv_core::config::{DsaModel, DsaModelSpec, KvDtype};
/// let spec = DsaModelSpec { kv_dtype: KvDtype::Fp8DsMla, ..DsaModelSpec::deepseek_v32() };
/// let model = DsaModel::new(spec).unwrap();
/// assert_eq!(model.mla_row_bytes(), 656);
/// ```
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DsaModelSpec {
    /// Display name.
    pub name: String,
    /// Target (non-speculative) decoder layers.
    pub num_layers: u32,
    /// Multi-token-prediction draft layers that follow the target layers.
    pub num_mtp_layers: u32,
    /// Compressed latent width (`kv_lora_rank`), the "nope" part of the MLA row.
    pub kv_lora_rank: u32,
    /// Rotary part of the MLA row (`qk_rope_head_dim`).
    pub qk_rope_head_dim: u32,
    /// Indexer key width (`index_head_dim`).
    pub index_head_dim: u32,
    /// Indexer query heads (`index_n_heads`); not stored in the cache.
    pub index_n_heads: u32,
    /// Keys selected per query token (`index_topk`).
    pub index_topk: u32,
    /// Indexer quantization block (one 4-byte scale word per block per token).
    pub indexer_quant_block: u32,
    /// MLA row storage type.
    pub kv_dtype: KvDtype,
    /// Indexer key storage type.
    pub indexer_dtype: IndexerDtype,
    /// Which target layers own an indexer.
    pub indexer_layers: IndexerLayers,
    /// Whether MTP layers own an indexer (they are full DSA layers in all presets).
    pub mtp_has_indexer: bool,
    /// The model's default for `use_kv_cache_manager_v2: auto` (`None` means V1).
    pub default_kv_manager_v2: Option<bool>,
}

impl DsaModelSpec {
    fn deepseek_family(name: &str, num_layers: u32) -> Self {
        DsaModelSpec {
            name: name.to_string(),
            num_layers,
            num_mtp_layers: 1,
            kv_lora_rank: 512,
            qk_rope_head_dim: 64,
            index_head_dim: 128,
            index_n_heads: 64,
            index_topk: 2048,
            indexer_quant_block: 128,
            kv_dtype: KvDtype::Fp8,
            indexer_dtype: IndexerDtype::Fp8,
            indexer_layers: IndexerLayers::All,
            mtp_has_indexer: true,
            default_kv_manager_v2: Some(true),
        }
    }

    /// DeepSeek-V3.2: 61 layers, every layer has an indexer, 1 MTP layer.
    pub fn deepseek_v32() -> Self {
        Self::deepseek_family("DeepSeek-V3.2", 61)
    }

    /// GLM-5: 78 layers, all with an indexer, 1 MTP layer.
    pub fn glm5() -> Self {
        Self::deepseek_family("GLM-5", 78)
    }

    /// GLM-5.2: 78 layers, 21 own an indexer (`IndexerLayers::Shared { 3, 4 }`), 1 MTP layer.
    pub fn glm52() -> Self {
        DsaModelSpec {
            indexer_layers: IndexerLayers::Shared {
                skip_offset: 3,
                freq: 4,
            },
            ..Self::deepseek_family("GLM-5.2", 78)
        }
    }

    /// Mistral Large 3: DeepSeek-V3 backbone with `num_layers` layers, an indexer on
    /// every layer, no MTP layer.
    pub fn mistral_large3(num_layers: u32) -> Self {
        DsaModelSpec {
            num_mtp_layers: 0,
            ..Self::deepseek_family("Mistral-Large-3", num_layers)
        }
    }
}

/// Which layers a cache manager holds.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerSet {
    /// Target layers only (MTP layers live in a separate draft manager, or none).
    Target,
    /// Target layers followed by the MTP layers in one manager.
    TargetAndMtp,
    /// The MTP layers only (a separate draft manager).
    MtpOnly,
}

/// Whether a layer is a target or a draft (MTP) layer.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// A decoder layer of the target model.
    Target,
    /// A multi-token-prediction layer.
    Mtp,
}

/// A validated [`DsaModelSpec`].
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct DsaModel {
    spec: DsaModelSpec,
}

/// Invalid model dimensions. Every message names the field, the value and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A dimension outside what the DSA kernels accept.
    #[error("{field} = {value} is invalid: {why}")]
    InvalidDim {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What is required.
        why: &'static str,
    },
    /// A DeepSeek-V4 preset where a DSA model's dimensions are asked for.
    #[error(
        "{model} is a DeepSeek-V4 model (sliding windows, compressed caches): it has no DSA \
         dimensions; its structure is `ModelConfig::windowed_spec` / `V4Preset::spec`, and \
         the runtime serves it with `KvCacheBuilder::windowed_backend` (`plan --model \
         {model}`, `serve --model {model}`)"
    )]
    V4NotServed {
        /// The preset's name.
        model: &'static str,
    },
    /// An unknown name for an enumerated field.
    #[error("unknown {field} {value:?}: expected {expected}")]
    UnknownName {
        /// The field.
        field: &'static str,
        /// The name given.
        value: String,
        /// The accepted names.
        expected: &'static str,
    },
    /// The indexer mask does not have one entry per target layer.
    #[error(
        "indexer_layers mask has {got} entries but the model has {num_layers} target layers: \
         give one entry per target layer"
    )]
    MaskLength {
        /// Entries in the mask.
        got: usize,
        /// Target layers.
        num_layers: u32,
    },
    /// Mistral Large 3 has no fixed layer count in this crate.
    #[error("mistral-large-3 needs a layer count: pass num_layers (e.g. --layers 61)")]
    MissingLayerCount,
}

impl DsaModel {
    /// Validates `spec` against the DSA kernel contracts.
    pub fn new(spec: DsaModelSpec) -> Result<Self, ModelError> {
        let bad = |field, value: u32, why| {
            Err(ModelError::InvalidDim {
                field,
                value: u64::from(value),
                why,
            })
        };
        if spec.num_layers == 0 {
            return bad("num_layers", 0, "a model needs at least one target layer");
        }
        if spec.num_layers > 4096 {
            return bad(
                "num_layers",
                spec.num_layers,
                "at most 4096 layers are supported",
            );
        }
        if spec.num_mtp_layers > 16 {
            return bad(
                "num_mtp_layers",
                spec.num_mtp_layers,
                "at most 16 MTP layers are supported",
            );
        }
        if spec.kv_lora_rank == 0 || !spec.kv_lora_rank.is_multiple_of(128) {
            return bad(
                "kv_lora_rank",
                spec.kv_lora_rank,
                "must be a positive multiple of 128 (FP8 tiles of 128 values)",
            );
        }
        if spec.qk_rope_head_dim == 0 || !spec.qk_rope_head_dim.is_multiple_of(16) {
            return bad(
                "qk_rope_head_dim",
                spec.qk_rope_head_dim,
                "must be a positive multiple of 16 (NVFP4 scales cover 16 elements)",
            );
        }
        if spec.kv_dtype == KvDtype::Fp8DsMla
            && (spec.kv_lora_rank != 512 || spec.qk_rope_head_dim != 64)
        {
            return bad(
                "kv_lora_rank",
                spec.kv_lora_rank,
                "fp8_ds_mla is FlashMLA's fixed 656-byte row: it needs kv_lora_rank 512 and \
                 qk_rope_head_dim 64; use kv_dtype fp8 or bf16 for other dims",
            );
        }
        if spec.indexer_quant_block != 128 {
            return bad(
                "indexer_quant_block",
                spec.indexer_quant_block,
                "DSA quantizes indexer keys in blocks of 128 (one 4-byte scale word per token)",
            );
        }
        if spec.index_head_dim != 128 {
            return bad(
                "index_head_dim",
                spec.index_head_dim,
                "the indexer scatter/gather kernels take 128-dim keys (128 B FP8 or 64 B FP4 \
                 payload plus a 4-byte scale)",
            );
        }
        if spec.index_n_heads == 0 {
            return bad(
                "index_n_heads",
                0,
                "the indexer needs at least one query head",
            );
        }
        if spec.index_topk == 0 || !spec.index_topk.is_multiple_of(64) {
            return bad(
                "index_topk",
                spec.index_topk,
                "must be a positive multiple of 64 (2048 in every DSA model)",
            );
        }
        match &spec.indexer_layers {
            IndexerLayers::All => {}
            IndexerLayers::Shared { skip_offset, freq } => {
                if *skip_offset == 0 {
                    return bad(
                        "indexer_layers.skip_offset",
                        0,
                        "layer 0 must own an indexer (shared layers reuse an earlier full layer)",
                    );
                }
                if *freq == 0 {
                    return bad(
                        "indexer_layers.freq",
                        0,
                        "the period of full layers must be ≥ 1",
                    );
                }
            }
            IndexerLayers::Mask(mask) => {
                if mask.len() != spec.num_layers as usize {
                    return Err(ModelError::MaskLength {
                        got: mask.len(),
                        num_layers: spec.num_layers,
                    });
                }
                if mask.iter().any(|&b| b) && !mask[0] {
                    return bad(
                        "indexer_layers.mask[0]",
                        0,
                        "a shared layer reuses the previous full layer's top-k, so layer 0 must \
                         be full when any layer has an indexer",
                    );
                }
            }
        }
        Ok(DsaModel { spec })
    }

    /// A validated preset. Mistral Large 3 needs `num_layers`.
    pub fn preset(preset: ModelPreset, num_layers: Option<u32>) -> Result<Self, ModelError> {
        Self::new(preset.spec(num_layers)?)
    }

    /// DeepSeek-V3.2 with its published dims.
    pub fn deepseek_v32() -> Self {
        Self::new(DsaModelSpec::deepseek_v32())
            .expect("invariant: the DeepSeek-V3.2 preset is valid")
    }

    /// GLM-5 with its published dims.
    pub fn glm5() -> Self {
        Self::new(DsaModelSpec::glm5()).expect("invariant: the GLM-5 preset is valid")
    }

    /// GLM-5.2 with its published dims.
    pub fn glm52() -> Self {
        Self::new(DsaModelSpec::glm52()).expect("invariant: the GLM-5.2 preset is valid")
    }

    /// The validated spec.
    pub fn spec(&self) -> &DsaModelSpec {
        &self.spec
    }

    /// Elements of one MLA latent row (`kv_lora_rank + qk_rope_head_dim`, 576).
    pub fn mla_row_elems(&self) -> u32 {
        self.spec.kv_lora_rank + self.spec.qk_rope_head_dim
    }

    /// Bytes of one MLA row per token per layer, all buffers of the layer's latent
    /// included (NVFP4: data + block scales).
    pub fn mla_row_bytes(&self) -> u32 {
        let n = self.spec.kv_lora_rank;
        let r = self.spec.qk_rope_head_dim;
        match self.spec.kv_dtype {
            KvDtype::Bf16 => (n + r) * 2,
            KvDtype::Fp8 => n + r,
            KvDtype::Fp8DsMla => n + 4 * (n / 128) + 2 * r,
            KvDtype::Nvfp4 => (n + r) / 2 + (n + r) / 16,
        }
    }

    /// Indexer payload bytes per token (128 FP8 / 64 FP4).
    pub fn indexer_data_bytes(&self) -> u32 {
        match self.spec.indexer_dtype {
            IndexerDtype::Fp8 => self.spec.index_head_dim,
            IndexerDtype::Fp4 => self.spec.index_head_dim / 2,
        }
    }

    /// Indexer scale bytes per token (one 4-byte word per quantization block).
    pub fn indexer_scale_bytes(&self) -> u32 {
        self.spec.index_head_dim / self.spec.indexer_quant_block * 4
    }

    /// Indexer bytes per token per indexer layer (132 FP8 / 68 FP4).
    pub fn indexer_row_bytes(&self) -> u32 {
        self.indexer_data_bytes() + self.indexer_scale_bytes()
    }

    /// Total layers (target + MTP).
    pub fn total_layers(&self) -> u32 {
        self.spec.num_layers + self.spec.num_mtp_layers
    }

    /// Target or MTP.
    pub fn layer_kind(&self, layer: LayerId) -> LayerKind {
        if layer.get() < self.spec.num_layers {
            LayerKind::Target
        } else {
            LayerKind::Mtp
        }
    }

    /// Whether `layer` owns indexer storage.
    pub fn has_indexer(&self, layer: LayerId) -> bool {
        match self.layer_kind(layer) {
            LayerKind::Target => self.spec.indexer_layers.is_full(layer.get()),
            LayerKind::Mtp => self.spec.mtp_has_indexer && layer.get() < self.total_layers(),
        }
    }

    /// For a shared (non-indexer) target layer, the full layer whose top-k it reuses.
    /// `None` for full layers and layers without any full layer before them.
    pub fn topk_source(&self, layer: LayerId) -> Option<LayerId> {
        if self.has_indexer(layer) {
            return None;
        }
        (0..layer.get())
            .rev()
            .map(LayerId)
            .find(|&l| self.has_indexer(l))
    }

    /// The layers of `set`, in ascending order.
    pub fn layers(&self, set: LayerSet) -> Vec<LayerId> {
        let t = self.spec.num_layers;
        let range = match set {
            LayerSet::Target => 0..t,
            LayerSet::TargetAndMtp => 0..self.total_layers(),
            LayerSet::MtpOnly => t..self.total_layers(),
        };
        range.map(LayerId).collect()
    }

    /// Target layers that own an indexer.
    pub fn num_indexer_layers(&self) -> u32 {
        (0..self.spec.num_layers)
            .filter(|&l| self.has_indexer(LayerId(l)))
            .count() as u32
    }

    /// Bytes per token of one rank, split by component, for the layers of `set`.
    pub fn bytes_per_token(&self, set: LayerSet) -> ComponentBytes {
        let mut out = ComponentBytes::default();
        for layer in self.layers(set) {
            out.mla += u64::from(self.mla_row_bytes());
            if self.has_indexer(layer) {
                out.indexer += u64::from(self.indexer_row_bytes());
            }
        }
        out
    }
}

/// Bytes per token split into the MLA latent and the indexer keys.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct ComponentBytes {
    /// MLA latent rows.
    pub mla: u64,
    /// Indexer keys (payload + scale).
    pub indexer: u64,
}

impl ComponentBytes {
    /// MLA + indexer.
    pub fn total(&self) -> u64 {
        self.mla + self.indexer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(spec: DsaModelSpec) -> DsaModel {
        DsaModel::new(spec).unwrap()
    }

    #[test]
    fn row_bytes_match_the_contract() {
        let base = DsaModelSpec::deepseek_v32();
        let expect = [
            (KvDtype::Bf16, 1152),
            (KvDtype::Fp8, 576),
            (KvDtype::Fp8DsMla, 656),
            (KvDtype::Nvfp4, 324),
        ];
        for (dtype, bytes) in expect {
            let m = model(DsaModelSpec {
                kv_dtype: dtype,
                ..base.clone()
            });
            assert_eq!(m.mla_row_bytes(), bytes, "{dtype}");
        }
        let fp4 = model(DsaModelSpec {
            indexer_dtype: IndexerDtype::Fp4,
            ..base.clone()
        });
        assert_eq!(fp4.indexer_row_bytes(), 68);
        assert_eq!(fp4.indexer_data_bytes(), 64);
        assert_eq!(model(base).indexer_row_bytes(), 132);
    }

    #[test]
    fn whole_model_totals_are_exact() {
        let v32 = DsaModelSpec::deepseek_v32();
        let total = |spec: DsaModelSpec| model(spec).bytes_per_token(LayerSet::Target).total();
        assert_eq!(total(v32.clone()), 43_188);
        assert_eq!(
            total(DsaModelSpec {
                kv_dtype: KvDtype::Fp8DsMla,
                ..v32.clone()
            }),
            48_068
        );
        assert_eq!(
            total(DsaModelSpec {
                kv_dtype: KvDtype::Bf16,
                ..v32.clone()
            }),
            78_324
        );
        assert_eq!(total(DsaModelSpec::glm5()), 55_224);
        assert_eq!(total(DsaModelSpec::glm52()), 47_700);
        // Indexer share of V3.2 fp8_ds_mla: 132 / 788.
        let ds = model(DsaModelSpec {
            kv_dtype: KvDtype::Fp8DsMla,
            ..v32
        })
        .bytes_per_token(LayerSet::Target);
        assert_eq!((ds.indexer, ds.total()), (61 * 132, 61 * 788));
    }

    #[test]
    fn glm52_mask_is_documented_pattern() {
        let m = DsaModel::glm52();
        let full: Vec<u32> = (0..78).filter(|&l| m.has_indexer(LayerId(l))).collect();
        let mut expect = vec![0, 1, 2];
        expect.extend((6..=74).step_by(4));
        assert_eq!(full, expect);
        assert_eq!(m.num_indexer_layers(), 21);
        assert_eq!(m.topk_source(LayerId(3)), Some(LayerId(2)));
        assert_eq!(m.topk_source(LayerId(5)), Some(LayerId(2)));
        assert_eq!(m.topk_source(LayerId(9)), Some(LayerId(6)));
        assert_eq!(m.topk_source(LayerId(77)), Some(LayerId(74)));
        assert_eq!(m.topk_source(LayerId(6)), None);
        // The MTP layer (78) is a full DSA layer.
        assert!(m.has_indexer(LayerId(78)));
        assert_eq!(m.layer_kind(LayerId(78)), LayerKind::Mtp);
    }

    #[test]
    fn presets_and_layer_sets() {
        let v = DsaModel::deepseek_v32();
        assert_eq!(v.total_layers(), 62);
        assert_eq!(v.layers(LayerSet::MtpOnly), vec![LayerId(61)]);
        assert_eq!(v.layers(LayerSet::TargetAndMtp).len(), 62);
        let mtp = v.bytes_per_token(LayerSet::MtpOnly);
        assert_eq!((mtp.mla, mtp.indexer), (576, 132));
        assert_eq!(
            DsaModel::preset(ModelPreset::MistralLarge3, None),
            Err(ModelError::MissingLayerCount)
        );
        let ml3 = DsaModel::preset(ModelPreset::MistralLarge3, Some(61)).unwrap();
        assert_eq!(ml3.bytes_per_token(LayerSet::Target).total(), 43_188);
        assert_eq!(ml3.spec().num_mtp_layers, 0);
        for p in ModelPreset::ALL {
            assert_eq!(ModelPreset::parse(p.name()), Ok(p));
        }
        assert!(matches!(
            ModelPreset::parse("llama"),
            Err(ModelError::UnknownName { field: "model", .. })
        ));
        for d in KvDtype::ALL {
            assert_eq!(KvDtype::parse(d.name()), Ok(d));
        }
        // The V4 presets parse; they have no DSA dimensions.
        let v4 = ModelPreset::parse("deepseek-v4-flash").unwrap();
        assert_eq!(v4.windowed(), Some(super::super::V4Preset::Flash));
        let e = v4.spec(None).unwrap_err();
        assert_eq!(
            e,
            ModelError::V4NotServed {
                model: "deepseek-v4-flash"
            }
        );
        assert!(e.to_string().contains("plan --model deepseek-v4-flash"));
        assert_eq!(ModelPreset::DeepSeekV32.windowed(), None);
    }

    #[test]
    fn invalid_dims_are_errors_naming_the_field() {
        let base = DsaModelSpec::deepseek_v32();
        let cases: Vec<(DsaModelSpec, &str)> = vec![
            (
                DsaModelSpec {
                    num_layers: 0,
                    ..base.clone()
                },
                "num_layers",
            ),
            (
                DsaModelSpec {
                    kv_lora_rank: 500,
                    ..base.clone()
                },
                "kv_lora_rank",
            ),
            (
                DsaModelSpec {
                    qk_rope_head_dim: 0,
                    ..base.clone()
                },
                "qk_rope_head_dim",
            ),
            (
                DsaModelSpec {
                    kv_dtype: KvDtype::Fp8DsMla,
                    kv_lora_rank: 256,
                    ..base.clone()
                },
                "kv_lora_rank",
            ),
            (
                DsaModelSpec {
                    index_head_dim: 64,
                    ..base.clone()
                },
                "index_head_dim",
            ),
            (
                DsaModelSpec {
                    indexer_quant_block: 64,
                    ..base.clone()
                },
                "indexer_quant_block",
            ),
            (
                DsaModelSpec {
                    index_topk: 100,
                    ..base.clone()
                },
                "index_topk",
            ),
            (
                DsaModelSpec {
                    index_n_heads: 0,
                    ..base.clone()
                },
                "index_n_heads",
            ),
            (
                DsaModelSpec {
                    indexer_layers: IndexerLayers::Shared {
                        skip_offset: 0,
                        freq: 4,
                    },
                    ..base.clone()
                },
                "indexer_layers.skip_offset",
            ),
            (
                DsaModelSpec {
                    indexer_layers: IndexerLayers::Shared {
                        skip_offset: 3,
                        freq: 0,
                    },
                    ..base.clone()
                },
                "indexer_layers.freq",
            ),
        ];
        for (spec, field) in cases {
            match DsaModel::new(spec) {
                Err(ModelError::InvalidDim { field: f, .. }) => assert_eq!(f, field),
                other => panic!("expected InvalidDim for {field}, got {other:?}"),
            }
        }
        let short_mask = DsaModelSpec {
            indexer_layers: IndexerLayers::Mask(vec![true; 3]),
            ..base.clone()
        };
        assert_eq!(
            DsaModel::new(short_mask),
            Err(ModelError::MaskLength {
                got: 3,
                num_layers: 61
            })
        );
        let mut mask = vec![false; 61];
        mask[5] = true;
        let bad_first = DsaModelSpec {
            indexer_layers: IndexerLayers::Mask(mask),
            ..base
        };
        assert!(matches!(
            DsaModel::new(bad_first),
            Err(ModelError::InvalidDim {
                field: "indexer_layers.mask[0]",
                ..
            })
        ));
        let msg = DsaModel::new(DsaModelSpec {
            index_head_dim: 64,
            ..DsaModelSpec::deepseek_v32()
        })
        .unwrap_err()
        .to_string();
        assert!(msg.starts_with("index_head_dim = 64 is invalid"), "{msg}");
    }

    #[test]
    fn mask_without_indexer_is_plain_mla() {
        let m = model(DsaModelSpec {
            indexer_layers: IndexerLayers::Mask(vec![false; 61]),
            mtp_has_indexer: false,
            ..DsaModelSpec::deepseek_v32()
        });
        assert_eq!(m.num_indexer_layers(), 0);
        assert_eq!(m.bytes_per_token(LayerSet::TargetAndMtp).indexer, 0);
        assert_eq!(m.topk_source(LayerId(4)), None);
    }
}
