//! A small DeepSeek-V4-style model (random weights from a seed) that reads and writes
//! every cache a V4 layer has: the raw sliding window, the compressed entries, the
//! indexer keys over them and the compressor state. It is the reference behind the V4
//! exactness test: run on [`V4Contiguous`] (one request, every position kept, no pages)
//! and on [`V4Paged`] (the pools a [`V4Plan`](dsa_kv_core::layout::V4Plan) lays out,
//! addressed through the model cache's block table and ring page tables), it must
//! give the same bits.
//!
//! The cache rows have V4's real sizes and formats; everything the cache does not store
//! is small. Per layer `l` of ratio `r ∈ {0, 4, 128}`, for every new token at `p`:
//!
//! * **Window row**: the latent `c = w_kv · x̂` (512: 448 NoPE, 64 RoPE), RMS-normed, RoPE
//!   on its last 64 values at `p`, in bf16, then the 584-byte MODEL1 row
//!   ([`quantize_model1_row`](dsa_kv_core::ops::model1::quantize_model1_row)).
//! * **Compressor state** (`r > 0`): the fp32 row `[kv | score]` of `coff · 512` values
//!   each (`coff` = 2 for ratio 4, whose groups overlap; 1 for ratio 128), `kv = w_ckv ·
//!   x̂`, `score = w_cs · x̂ + ape[p mod r]`.
//! * **Compressed entry** `w`, written by the token that closes its group (`p = r·w + r −
//!   1`): per channel a softmax over the group's slots of the scores, the weighted sum of
//!   the kv values (ratio 4: the first halves of tokens `4w − 4 .. 4w − 1`, when `w > 0`,
//!   then the second halves of `4w .. 4w + 3`; ratio 128: tokens `128w .. 128w + 127`),
//!   RMS-normed, RoPE on the last 64 at `r·w`, a MODEL1 row. The slots are read back from
//!   the state cache, so an entry depends on nothing a step keeps in registers.
//! * **Indexer key** (`r = 4`): the same overlapping compressor at width 128 over its own
//!   state rows, RMS-normed, RoPE on its first 64 at `4w`, FP8 with a UE8M0 scale word
//!   (132 bytes).
//!
//! Then each new token attends: the window rows `max(0, q − W + 1) ..= q` and the
//! compressed entries it sees (`w < (q + 1) / r`: all of them on a ratio-128 layer, the
//! indexer's top-k on a ratio-4 layer: `Σ_h w_h · relu(q_h · k_w) · scale_w` with FP8
//! queries, ties to the earlier entry), in one softmax per head with scale `512^−½` and a
//! per-head sink logit, the head's query (RMS-normed, RoPE on its last 64 at `q`) in
//! bf16 as the sparse decode takes it; the 512-wide output (values are the keys' rows) gets the inverse
//! RoPE at `q` on its last 64, then the output projection, a residual, a small MLP.
//! [`V4Model::run_traced`] gives a token's attention as the sparse decode sees it
//! ([`V4Trace`]), for external kernels.
//! The MTP draft layer is window-only (it has its own window cache after the target
//! layers); its row of a position depends only on that position's token. (A
//! checkpoint's published MTP layer reads the target's streams too: see
//! [`V4Model::draft_write`].)
//!
//! Arithmetic: that of the V3.2 model (`exp` as a fixed polynomial, softmax and
//! weighted sums in ascending order), except that every dot product (projections,
//! attention scores, indexer scores, RMSNorm's sum of squares) runs in 8
//! interleaved lanes combined pairwise (`dot8`): a fixed order that vectorizes on the
//! host and that a GPU twin reproduces.
//!
//! Left out, because the cache does not see them: mixture of experts, hyper-connections,
//! grouped output projections, learned norms. Batch invariance is the V3.2 model's:
//! every value is computed for one token of one request by loops in a fixed order,
//! reading only that request's cache.

#[cfg(feature = "cuda")]
pub mod cuda;
mod forward;
mod model;
mod paged;
mod store;

pub use dsa_kv_device::windowed::V4Pools;
pub use forward::{RecordedDrafts, V4ModelForward, V4Outputs};
pub(crate) use model::{attend_sink, model1};
pub use model::{V4Model, V4ModelConfig, V4Trace};
pub use paged::V4Paged;
pub(crate) use store::{decode_index_key, encode_index_key, fp8_query};
pub use store::{Model1Row, StateKind, V4Contiguous, V4Store, INDEX_ENTRY_BYTES};

#[cfg(test)]
mod tests;
