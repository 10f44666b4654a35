//! The model's dimensions: the widths the cache stores (DeepSeek-V3.2's real sizes) as
//! constants, and [`ModelConfig`], everything else (small, so the host backend runs it in
//! CI).

/// Latent width of an MLA row (`kv_lora_rank`).
pub const LATENT: usize = 512;
/// RoPE part of an MLA row.
pub const ROPE: usize = 64;
/// Indexer key and query width.
pub const INDEX_DIM: usize = 128;
/// Indexer key bytes in the cache (FP8).
pub const INDEX_VALUE_BYTES: usize = INDEX_DIM;

/// The model's dimensions. The cache rows have DeepSeek-V3.2's real sizes; everything
/// the cache does not store is small.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// Decoder layers (the cache must have as many target layers).
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Vocabulary (token ids are taken modulo this).
    pub vocab: usize,
    /// MLA query heads.
    pub heads: usize,
    /// Per-head "nope" query width (projected into the 512-wide latent).
    pub nope_dim: usize,
    /// Per-head value width.
    pub v_dim: usize,
    /// Indexer query heads.
    pub index_heads: usize,
    /// Tokens each query attends to (the indexer's top-k); smaller contexts attend to
    /// every token.
    pub topk: usize,
    /// MLP hidden size.
    pub mlp: usize,
    /// Weight seed.
    pub seed: u64,
}

impl ModelConfig {
    /// A tiny DeepSeek-V3.2: 2 layers, hidden 64, 2 MLA heads, 2 indexer heads, top-64,
    /// vocabulary 256; small enough for the host backend in CI.
    pub fn tiny(seed: u64) -> Self {
        ModelConfig {
            layers: 2,
            hidden: 64,
            vocab: 256,
            heads: 2,
            nope_dim: 32,
            v_dim: 32,
            index_heads: 2,
            topk: 64,
            mlp: 128,
            seed,
        }
    }
}
