//! Data-plane ops. Each op has a host reference implementation here; the CUDA kernels
//! (`kernels/*.cu`) must produce byte-identical results.
//!
//! * [`quant`]: FP8 E4M3 / FP4 E2M1 conversion and the indexer key quantization.
//! * [`indexer_k`]: indexer K scatter (byte-offset slot mappings, negative = skip) and
//!   gather.
//! * [`mla`]: MLA row writes (BF16, FP8, `fp8_ds_mla` quantize-and-scatter) and gather.
//! * [`model1`]: DeepSeek-V4's 584-byte row (FlashMLA's MODEL1) and its page geometry.
//! * [`topk`]: top-k → global row ids, dense short-sequence top-k.
//! * block copy ([`CopyPlan`]): slot copies between tiers and for copy-on-resume.

mod block_copy;
mod error;
pub mod indexer_k;
pub mod mla;
pub mod model1;
pub mod quant;
pub mod topk;

pub use block_copy::{copy_slots_between, copy_slots_within, CopyPlan, GroupCopy};
pub use error::OpError;

#[cfg(test)]
mod tests;
