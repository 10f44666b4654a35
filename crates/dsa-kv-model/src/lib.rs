//! A small but real DeepSeek-V3.2-style model (random weights from a seed) that runs
//! through the cache: the reference forward behind the exactness test.
//!
//! Per layer, for every new token: the MLA latent (512) and its RoPE part (64) are
//! written as one cache row in the cache's encoding (BF16 or `fp8_ds_mla`, the crate's
//! quantizers), the lightning indexer's key (128, RoPE on its first 64 values) as FP8
//! with its scale word; then each new token attends: the indexer scores every cached
//! token `j ≤ p` as `Σ_h w_h · relu(q_h · k_j) · scale_j` (FP8 queries), the top-k
//! (ties to the earlier position) become global token indices, and sparse MLA attends
//! over those rows only in the absorbed form (query projected into the latent space,
//! softmax, output through the value projection). A small MLP, logits over a small
//! vocabulary, greedy sampling.
//!
//! **Batch invariance.** Every value is computed for one token of one request with
//! sums in a fixed order (matrix-vector products, norms, indexer and attention scores and
//! softmax denominators in the warp-shaped `Lanes32` order of `math.rs` that the GPU twin
//! computes with one warp each; the attention's weighted sum of rows by ascending
//! selected position), reading only that request's cache: the result cannot depend on batch
//! size, batch mates, chunk size or position in the batch. The cache is reached only
//! through [`KvStore`]: [`unpaged::Contiguous`] (one request, contiguous rows, no reuse:
//! the reference) and [`paged::ModelForward`] (the runtime's pools through the step
//! metadata, as the DSA kernels read them) run the same code. [`trace`] captures the
//! intermediate values of one layer of one token; [`dump`] writes one layer of one step
//! as `.npy` files for external kernels.

pub mod checkpoint;
mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
mod draft;
pub mod dump;
mod error;
mod math;
mod model;
mod npy;
pub mod paged;
mod store;
pub mod trace;
pub mod unpaged;
pub mod v4;
mod weights;

pub use config::{ModelConfig, INDEX_DIM, INDEX_VALUE_BYTES, LATENT, ROPE};
pub use draft::DraftCache;
pub use error::ModelError;
pub use model::{Model, TokenOut};
pub use store::{CacheFormat, KvStore};
