//! The weights of one decoder layer (the MTP draft layer has the same shape), random
//! from the model's seed.

use super::config::{ModelConfig, INDEX_DIM, LATENT, ROPE};
use super::math::Mat;
use dsa_kv_core::rng::SplitMix64;

/// One layer's projections (per head where a `Vec`).
#[derive(Clone)]
pub(crate) struct Layer {
    pub(crate) w_dkv: Mat,
    pub(crate) w_kr: Mat,
    pub(crate) w_ik: Mat,
    pub(crate) w_iq: Vec<Mat>,
    pub(crate) w_iw: Mat,
    pub(crate) w_qn: Vec<Mat>,
    pub(crate) w_uk: Vec<Mat>,
    pub(crate) w_qr: Vec<Mat>,
    pub(crate) w_uv: Vec<Mat>,
    pub(crate) w_o: Mat,
    pub(crate) w_1: Mat,
    pub(crate) w_2: Mat,
}

impl Layer {
    /// A layer of no weights (a checkpoint's model has no built-in layers).
    pub(crate) fn empty() -> Layer {
        let m = || Mat {
            rows: 0,
            cols: 0,
            w: Vec::new(),
        };
        Layer {
            w_dkv: m(),
            w_kr: m(),
            w_ik: m(),
            w_iq: Vec::new(),
            w_iw: m(),
            w_qn: Vec::new(),
            w_uk: Vec::new(),
            w_qr: Vec::new(),
            w_uv: Vec::new(),
            w_o: m(),
            w_1: m(),
            w_2: m(),
        }
    }

    pub(crate) fn random(rng: &mut SplitMix64, cfg: &ModelConfig) -> Layer {
        let h = cfg.hidden;
        let heads = |rng: &mut SplitMix64, n: usize, rows: usize, cols: usize| -> Vec<Mat> {
            (0..n).map(|_| Mat::random(rng, rows, cols)).collect()
        };
        Layer {
            w_dkv: Mat::random(rng, LATENT, h),
            w_kr: Mat::random(rng, ROPE, h),
            w_ik: Mat::random(rng, INDEX_DIM, h),
            w_iq: heads(rng, cfg.index_heads, INDEX_DIM, h),
            w_iw: Mat::random(rng, cfg.index_heads, h),
            w_qn: heads(rng, cfg.heads, cfg.nope_dim, h),
            w_uk: heads(rng, cfg.heads, cfg.nope_dim, LATENT),
            w_qr: heads(rng, cfg.heads, ROPE, h),
            w_uv: heads(rng, cfg.heads, cfg.v_dim, LATENT),
            w_o: Mat::random(rng, h, cfg.heads * cfg.v_dim),
            w_1: Mat::random(rng, cfg.mlp, h),
            w_2: Mat::random(rng, h, cfg.mlp),
        }
    }
}
