//! The Hugging Face checkpoint format of the published DSA implementations
//! (`DeepseekV32ForCausalLM`, `GlmMoeDsaForCausalLM` in transformers 5.x): `config.json`
//! and safetensors under their own tensor names, loaded into [`Model`](crate::Model)
//! with [`Model::from_checkpoint`](crate::Model::from_checkpoint) and run through the
//! same [`KvStore`](crate::KvStore) as the built-in model (paged or unpaged).
//!
//! What is supported: q-LoRA attention (`q_lora_rank`; the implementations require it),
//! RoPE `default` or `yarn` (with `mscale` / `mscale_all_dim`), attention biases, dense
//! MLP layers and MoE layers (sigmoid router with the correction bias, group-limited
//! top-k, normalized and scaled weights, a shared expert), tied or separate output
//! head, GLM's layers that share the previous layer's top-k. The cache's widths are
//! fixed (latent 512, RoPE 64, indexer key 128: DeepSeek-V3.2's and GLM-5's); a
//! checkpoint with others is refused, as are quantized (FP8) checkpoints and an MTP
//! layer for speculative decoding (its weights are skipped, as transformers skips them).
//! The routing keys (`n_group`, `topk_group`, `routed_scaling_factor`,
//! `norm_topk_prob`, `n_shared_experts`) and one of `mlp_layer_types` /
//! `first_k_dense_replace` are required, not defaulted: transformers' defaults differ by
//! model type, and `save_pretrained` writes them all. Token ids past the vocabulary are
//! refused. The GPU forward runs the built-in model only.
//!
//! DeepSeek-V4 (`deepseek_v4`, transformers ≥ 5.8): [`HfV4Config`] reads its
//! `config.json` (the cache structure and every size its implementation reads),
//! `v4_weights.rs` its tensors (under the names transformers' `save_pretrained` writes,
//! its module names, or DeepSeek's published names with FP8 / FP4 weights dequantized
//! by `tensors.rs`), `v4_forward.rs` its forward and the published MTP layer through a
//! [`V4Store`](crate::v4::V4Store); [`V4Model::from_checkpoint`](crate::v4::V4Model::from_checkpoint)
//! builds the model (the host backend only).
//! `tests/hf_checkpoint_v4.rs` compares it with transformers' own forward.

mod config;
mod error;
mod forward;
mod tensors;
#[cfg(test)]
mod tests;
mod v4_config;
mod v4_forward;
mod v4_weights;
mod weights;

pub use config::{Family, HfConfig, MlpKind, RopeConfig, Yarn};
pub use error::CheckpointError;
pub use v4_config::{HfV4Config, V4MlpKind, V4Scoring};
pub(crate) use v4_weights::HfV4Model;
pub(crate) use weights::HfModel;
