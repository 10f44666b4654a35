//! Where the KV bytes of new tokens come from. A serving framework's model computes
//! them; the synthetic source used by the `serve` example and the tests derives them
//! deterministically from (token id, position, layer), so any byte read back through the
//! page tables can be checked.

use half::bf16;

use crate::ids::{LayerId, TokenId};
use crate::rng::mix;

/// The BF16 values a forward pass would produce for one token on one layer.
pub trait KvSource: Send + Sync + 'static {
    /// The indexer key (`index_head_dim` values).
    fn indexer_key(&self, token: TokenId, pos: u32, layer: LayerId, out: &mut [bf16]);
    /// The MLA latent row (`kv_lora_rank + qk_rope_head_dim` values).
    fn mla_row(&self, token: TokenId, pos: u32, layer: LayerId, out: &mut [bf16]);
}

/// Deterministic pseudo-random values in [−4, 4) from (token, position, layer, seed).
#[derive(Clone, Copy, Debug)]
pub struct SyntheticKv {
    /// Mixed into every value.
    pub seed: u64,
}

impl SyntheticKv {
    fn fill(&self, salt: u64, token: TokenId, pos: u32, layer: LayerId, out: &mut [bf16]) {
        let mut state = mix(self.seed ^ salt ^ (u64::from(token.get()) << 32) ^ u64::from(pos))
            ^ mix(u64::from(layer.get()).wrapping_add(salt));
        for chunk in out.chunks_mut(4) {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let bits = state ^ (state >> 29);
            for (k, o) in chunk.iter_mut().enumerate() {
                let v = ((bits >> (16 * k)) as u16 as i16) as f32 / 8192.0;
                *o = bf16::from_f32(v);
            }
        }
    }
}

impl KvSource for SyntheticKv {
    fn indexer_key(&self, token: TokenId, pos: u32, layer: LayerId, out: &mut [bf16]) {
        self.fill(0x1d3c, token, pos, layer, out);
    }

    fn mla_row(&self, token: TokenId, pos: u32, layer: LayerId, out: &mut [bf16]) {
        self.fill(0x4d1a, token, pos, layer, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_distinct() {
        let s = SyntheticKv { seed: 7 };
        let mut a = vec![bf16::ZERO; 128];
        let mut b = vec![bf16::ZERO; 128];
        s.indexer_key(TokenId(5), 9, LayerId(2), &mut a);
        s.indexer_key(TokenId(5), 9, LayerId(2), &mut b);
        assert_eq!(a, b);
        s.indexer_key(TokenId(5), 9, LayerId(3), &mut b);
        assert_ne!(a, b);
        s.indexer_key(TokenId(5), 10, LayerId(2), &mut b);
        assert_ne!(a, b);
        s.mla_row(TokenId(5), 9, LayerId(2), &mut b);
        assert_ne!(a, b);
        assert!(a.iter().all(|v| v.to_f32().abs() <= 4.0));
    }
}
