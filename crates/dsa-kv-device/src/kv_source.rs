//! Where the KV bytes of new tokens come from. A serving framework's model computes
//! them; the synthetic source used by the `serve` example and the tests derives them
//! deterministically from the whole prefix (its [`PrefixHash`]: the reuse scope and
//! every token up to and including this one), the position and the layer, so any byte
//! read back through the page tables can be checked, and a page of another prefix or
//! another tenant that holds the same tokens reads back different bytes.

use half::bf16;

use dsa_kv_core::core::PrefixHash;
use dsa_kv_core::ids::{LayerId, TokenId};
use dsa_kv_core::rng::mix;

/// One token whose KV a forward pass computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPosition {
    /// The token.
    pub token: TokenId,
    /// Its position in the sequence.
    pub pos: u32,
    /// The scope and every token of the sequence up to and including this one.
    pub prefix: PrefixHash,
}

/// The BF16 values a forward pass would produce for one token on one layer.
pub trait KvSource: Send + Sync + 'static {
    /// The indexer key (`index_head_dim` values).
    fn indexer_key(&self, at: KvPosition, layer: LayerId, out: &mut [bf16]);
    /// The MLA latent row (`kv_lora_rank + qk_rope_head_dim` values).
    fn mla_row(&self, at: KvPosition, layer: LayerId, out: &mut [bf16]);
}

/// Deterministic pseudo-random values in [−4, 4) from (prefix, position, layer, seed).
#[derive(Clone, Copy, Debug)]
pub struct SyntheticKv {
    /// Mixed into every value.
    pub seed: u64,
}

impl SyntheticKv {
    fn fill(&self, salt: u64, at: KvPosition, layer: LayerId, out: &mut [bf16]) {
        let mut state = mix(self.seed ^ salt ^ at.prefix.0 ^ u64::from(at.pos))
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
    fn indexer_key(&self, at: KvPosition, layer: LayerId, out: &mut [bf16]) {
        self.fill(0x1d3c, at, layer, out);
    }

    fn mla_row(&self, at: KvPosition, layer: LayerId, out: &mut [bf16]) {
        self.fill(0x4d1a, at, layer, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsa_kv_core::core::ReuseScope;

    fn at(scope: ReuseScope, tokens: &[u32]) -> KvPosition {
        let toks: Vec<TokenId> = tokens.iter().map(|&t| TokenId(t)).collect();
        KvPosition {
            token: *toks.last().unwrap(),
            pos: toks.len() as u32 - 1,
            prefix: PrefixHash::of(scope, &toks),
        }
    }

    #[test]
    fn deterministic_and_distinct() {
        let s = SyntheticKv { seed: 7 };
        let shared = ReuseScope::SHARED;
        let tenant = ReuseScope {
            lora_id: None,
            salt: Some(9),
        };
        let mut a = vec![bf16::ZERO; 128];
        let mut b = vec![bf16::ZERO; 128];
        s.indexer_key(at(shared, &[1, 2, 5]), LayerId(2), &mut a);
        s.indexer_key(at(shared, &[1, 2, 5]), LayerId(2), &mut b);
        assert_eq!(a, b);
        s.indexer_key(at(shared, &[1, 2, 5]), LayerId(3), &mut b);
        assert_ne!(a, b, "another layer");
        // The same token at the same position after another prefix.
        s.indexer_key(at(shared, &[1, 3, 5]), LayerId(2), &mut b);
        assert_ne!(a, b, "another prefix");
        // The same tokens in another tenant's scope.
        s.indexer_key(at(tenant, &[1, 2, 5]), LayerId(2), &mut b);
        assert_ne!(a, b, "another scope");
        s.mla_row(at(shared, &[1, 2, 5]), LayerId(2), &mut b);
        assert_ne!(a, b, "another buffer");
        assert!(a.iter().all(|v| v.to_f32().abs() <= 4.0));
    }
}
