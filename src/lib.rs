//! dsa-kv: the paged KV-cache manager for DeepSeek Sparse Attention models.

pub mod config;
pub mod core;
pub mod ids;
pub mod layout;
pub mod ops;
pub mod storage;
