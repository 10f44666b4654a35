//! Prefix-reuse keys: one root per reuse scope, `root = SHA-256(scope)`, and
//! for each block `key = SHA-256(parent key ∥ token ids as 4-byte little-endian)`. Keys
//! chain, so a key names the whole prefix. Matching trusts the digest alone, so the hash
//! must be cryptographic: tenant isolation (different salts never share) rests on it.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;

use crate::ids::TokenId;

/// A 256-bit chained block key.
/// (`Hash` takes 8 of the digest's bytes; see `radix.rs`.)
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockKey(pub [u8; 32]);

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({})", self)
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("…")
    }
}

impl BlockKey {
    /// The 64-bit block hash routers see ([`RouterEvent`](super::RouterEvent)): the first
    /// 8 bytes of the key, little-endian (the truncation used for salts and
    /// [`PrefixHash::root`]; vLLM's wire form takes the last 8 bytes big-endian instead,
    /// any fixed choice works since routers treat the hash as opaque).
    pub fn hash64(&self) -> u64 {
        u64::from_le_bytes(
            self.0[..8]
                .try_into()
                .expect("invariant: a key has 32 bytes"),
        )
    }

    /// Lowercase hex of all 32 bytes.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Who may share cached blocks: requests share a prefix only within one scope.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default, Serialize, Deserialize)]
pub struct ReuseScope {
    /// LoRA adapter id, if any.
    pub lora_id: Option<u64>,
    /// Tenant salt, if any (see [`ReuseScope::salt_from_str`]).
    pub salt: Option<u64>,
}

impl ReuseScope {
    /// The shared, unsalted scope without LoRA.
    pub const SHARED: ReuseScope = ReuseScope {
        lora_id: None,
        salt: None,
    };

    /// A salt derived from a string: the first 8 bytes (little-endian) of its SHA-256.
    pub fn salt_from_str(cache_salt: &str) -> u64 {
        let d = Sha256::digest(cache_salt.as_bytes());
        u64::from_le_bytes(d[..8].try_into().expect("invariant: a digest has 32 bytes"))
    }

    /// The root key: SHA-256 of one mask byte (bit 0: LoRA present, bit 1: salt present)
    /// followed by each present field as a little-endian u64.
    pub fn root_key(&self) -> BlockKey {
        let mut h = Sha256::new();
        let mask = u8::from(self.lora_id.is_some()) | (u8::from(self.salt.is_some()) << 1);
        h.update([mask]);
        for v in [self.lora_id, self.salt].into_iter().flatten() {
            h.update(v.to_le_bytes());
        }
        BlockKey(h.finalize().into())
    }
}

/// A running 64-bit hash of a reuse scope and every token of a prefix, extended one
/// token at a time: `root(scope)` is the first 8 bytes of the scope's root key, and
/// `then(t)` chains one token. Like a block key it names the whole prefix (and the
/// scope), but per position, so the partial last block is covered too. Not
/// cryptographic: it makes synthetic KV values depend on the whole prefix, so a page of
/// another prefix or another tenant holding the same tokens reads back different bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct PrefixHash(pub u64);

impl PrefixHash {
    /// The hash of the empty prefix in `scope`.
    pub fn root(scope: ReuseScope) -> Self {
        let k = scope.root_key();
        PrefixHash(u64::from_le_bytes(
            k.0[..8]
                .try_into()
                .expect("invariant: a digest has 32 bytes"),
        ))
    }

    /// The hash of this prefix followed by `t`.
    pub fn then(self, t: TokenId) -> Self {
        PrefixHash(crate::rng::mix(
            self.0.rotate_left(23) ^ u64::from(t.get()).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        ))
    }

    /// The hash of `tokens` in `scope`.
    pub fn of(scope: ReuseScope, tokens: &[TokenId]) -> Self {
        tokens.iter().fold(Self::root(scope), |h, &t| h.then(t))
    }
}

/// Computes chained block keys, reusing one byte buffer.
#[derive(Default)]
pub(crate) struct KeyHasher {
    buf: Vec<u8>,
}

impl KeyHasher {
    /// `SHA-256(parent ∥ tokens as 4-byte LE)`.
    pub(super) fn block_key(&mut self, parent: &BlockKey, tokens: &[TokenId]) -> BlockKey {
        self.buf.clear();
        self.buf.reserve(32 + tokens.len() * 4);
        self.buf.extend_from_slice(&parent.0);
        for t in tokens {
            self.buf.extend_from_slice(&t.get().to_le_bytes());
        }
        BlockKey(Sha256::digest(&self.buf).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Golden digests computed independently with Python's hashlib.
    #[test]
    fn golden_root_keys() {
        assert_eq!(
            ReuseScope::SHARED.root_key().to_hex(),
            "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
        );
        let lora = ReuseScope {
            lora_id: Some(5),
            salt: None,
        };
        assert_eq!(
            lora.root_key().to_hex(),
            "fadee97341d48aa37015edff6dfdd433ed192c94c0c3f14ca5b533d9547b3804"
        );
        let salt = ReuseScope {
            lora_id: None,
            salt: Some(7),
        };
        assert_eq!(
            salt.root_key().to_hex(),
            "95d6f8b53c8e5c1d2e3c443dfee0705a7ebdff9f6442377ef935ecc87dd1695a"
        );
        let both = ReuseScope {
            lora_id: Some(5),
            salt: Some(7),
        };
        assert_eq!(
            both.root_key().to_hex(),
            "65a69abe2c862979c226ec726ea15c567bd9ab0c76ffda6bc30be1ee8547943b"
        );
        assert_eq!(
            ReuseScope::salt_from_str("tenant-a"),
            16_248_643_848_220_682_112
        );
    }

    #[test]
    fn golden_block_keys_chain() {
        let mut h = KeyHasher::default();
        let root = ReuseScope::SHARED.root_key();
        let b1 = h.block_key(&root, &[TokenId(1), TokenId(2), TokenId(3)]);
        assert_eq!(
            b1.to_hex(),
            "cfb54dcb32c106a7cf6e868309d3ce024413595c044ff9e5f525b359017de1eb"
        );
        let toks: Vec<TokenId> = (100..164).map(TokenId).collect();
        let b2 = h.block_key(&b1, &toks);
        assert_eq!(
            b2.to_hex(),
            "170f867eb0d04c09be6dae8462a30a338389334e7b4bd349f0f833075be75584"
        );
        assert_eq!(b1.hash64(), 0xa706_c132_cb4d_b5cf);
        assert_ne!(
            b1,
            h.block_key(
                &ReuseScope {
                    lora_id: None,
                    salt: Some(7)
                }
                .root_key(),
                &[TokenId(1), TokenId(2), TokenId(3)]
            )
        );
    }
}
