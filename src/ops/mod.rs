//! Data-plane ops. Each op has a host reference implementation here; the CUDA kernels
//! (`kernels/*.cu`) must produce byte-identical results.

mod block_copy;

pub use block_copy::{copy_slots_between, copy_slots_within, CopyPlan, GroupCopy};
