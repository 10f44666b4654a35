//! Page digests: SHA-256 of each block's bytes in every pool of every page, read
//! straight from an engine's registered pools (host memory), independent of the write
//! plan, so a transfer that leaves a pool out, or lands bytes in the wrong page, is
//! caught before the import is committed.

use sha2::{Digest, Sha256};

use dsa_kv_device::transfer::{transfer_units, BlockPages, MemKind, PoolRegion, WindowTail};

use super::SessionError;

/// SHA-256 of one block's pages: 32 bytes, sent as 64 lowercase hex digits. A peer's
/// digest decodes only from exactly that (an empty or odd string is refused at once).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockDigest(pub [u8; 32]);

impl std::fmt::Display for BlockDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl std::fmt::Debug for BlockDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockDigest({self})")
    }
}

impl serde::Serialize for BlockDigest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for BlockDigest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Hex;
        impl serde::de::Visitor<'_> for Hex {
            type Value = BlockDigest;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a SHA-256 digest as 64 hex digits")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<BlockDigest, E> {
                let bad = || E::invalid_value(serde::de::Unexpected::Str(v), &self);
                if v.len() != 64 {
                    return Err(bad());
                }
                let mut out = [0u8; 32];
                for (o, pair) in out.iter_mut().zip(v.as_bytes().chunks_exact(2)) {
                    let pair = std::str::from_utf8(pair).map_err(|_| bad())?;
                    *o = u8::from_str_radix(pair, 16).map_err(|_| bad())?;
                }
                Ok(BlockDigest(out))
            }
        }
        d.deserialize_str(Hex)
    }
}

/// SHA-256 of each block of `blocks` (its pages' slots in every pool of their group,
/// target cache then draft cache, pools in (device, pool) order), then, when `tail` has
/// pages lists (a windowed model's transfer that moves its tail), one more of the tail's
/// pages in every window pool, window by window.
///
/// # Safety
///
/// `regions` must be live pools of this process (an engine's `Transfers::regions`, the
/// engine running) and nothing may write the blocks' pages during the call (pinned by
/// an export, or reserved by an import whose bytes have landed).
// Public with feature `testing` (tests compare pages with it); the session's own else.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub unsafe fn host_block_digests(
    regions: &[PoolRegion],
    blocks: &[BlockPages],
    tail: &[WindowTail],
) -> Result<Vec<BlockDigest>, SessionError> {
    let units = transfer_units(blocks, tail);
    let mut out = Vec::with_capacity(units.len());
    for unit in units {
        let mut h = Sha256::new();
        for (cache, p) in unit {
            let mut pools: Vec<&PoolRegion> = regions
                .iter()
                .filter(|r| (r.cache, r.tier, r.group) == (cache, p.tier, p.group))
                .collect();
            pools.sort_by_key(|r| (r.device, r.pool));
            if pools.is_empty() {
                return Err(SessionError::Digests(format!(
                    "no pool region holds page {p:?} of the {cache:?} cache"
                )));
            }
            for r in pools {
                if r.region.mem != MemKind::Host {
                    return Err(SessionError::Digests(format!(
                        "pool {} of group {} is {:?} memory: digests read host memory only \
                         (the host backend); turn them off for GPU pools",
                        r.pool, r.group, r.region.mem
                    )));
                }
                let off = u64::from(p.slot.0)
                    .checked_mul(r.slot_bytes)
                    .filter(|off| {
                        off.checked_add(r.slot_bytes)
                            .is_some_and(|end| end <= r.region.len)
                    })
                    .ok_or_else(|| {
                        SessionError::Digests(format!(
                            "slot {} lies outside pool {} of group {} ({} B)",
                            p.slot, r.pool, r.group, r.region.len
                        ))
                    })?;
                let len = usize::try_from(r.slot_bytes)
                    .map_err(|_| SessionError::Digests("a slot larger than memory".into()))?;
                // SAFETY: inside a pool region of this process (checked above); the
                // caller's contract keeps the pool alive and the page unwritten.
                let bytes =
                    unsafe { std::slice::from_raw_parts((r.region.addr + off) as *const u8, len) };
                h.update(bytes);
            }
        }
        out.push(BlockDigest(h.finalize().into()));
    }
    Ok(out)
}
