//! Shared test support: a seeded RNG and a deterministic KV pattern that depends on a
//! token's whole prefix (as real KV does), so serving the wrong block is caught.
#![allow(dead_code)]

use dsa_kv::core::{KvCacheManager, SeqHandle};
use dsa_kv::ids::{LayerId, SlotId, Tier, TokenId};
use dsa_kv::layout::{BufferPlacement, Role};
use dsa_kv::storage::{HostStorage, KvStorage};

/// The crate's seeded generator (SplitMix64).
pub(crate) use dsa_kv::rng::SplitMix64 as Rng;

/// Hash of a token prefix, extended one token at a time.
pub(crate) fn extend_prefix_hash(h: u64, t: TokenId) -> u64 {
    let mut r = Rng(h ^ u64::from(t.get()).wrapping_mul(0x1000_0000_01b3));
    r.next_u64()
}

/// Prefix hashes of every position of `tokens` (`out[p]` covers `tokens[..=p]`).
pub(crate) fn prefix_hashes(scope_seed: u64, tokens: &[TokenId]) -> Vec<u64> {
    let mut h = scope_seed;
    tokens
        .iter()
        .map(|&t| {
            h = extend_prefix_hash(h, t);
            h
        })
        .collect()
}

/// The bytes of one token of one buffer: payload and scale word.
pub(crate) fn pattern(
    prefix_hash: u64,
    layer: LayerId,
    role: Role,
    value_len: usize,
    scale_len: usize,
) -> (Vec<u8>, Vec<u8>) {
    let mut r = Rng(prefix_hash ^ (u64::from(layer.get()) << 40) ^ ((role as u64) << 56));
    let mut bytes = |n: usize| -> Vec<u8> {
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            v.extend_from_slice(&r.next_u64().to_le_bytes());
        }
        v.truncate(n);
        v
    };
    let value = bytes(value_len);
    let scale = bytes(scale_len);
    (value, scale)
}

fn lens(p: &BufferPlacement, tpb: u32) -> (usize, usize) {
    let r = p.row.token_ranges(tpb, 0);
    (r.value.1 as usize, r.scale.map_or(0, |s| s.1 as usize))
}

/// Writes positions `range` of an active sequence through its block table.
pub(crate) fn write_positions(
    m: &KvCacheManager,
    st: &mut HostStorage,
    h: &SeqHandle,
    hashes: &[u64],
    range: std::ops::Range<usize>,
) {
    let tpb = m.tokens_per_block() as usize;
    let placements: Vec<BufferPlacement> = m.plan().placements().to_vec();
    let tables: Vec<Vec<SlotId>> = (0..m.plan().num_life_cycles())
        .map(|lc| {
            m.block_slots(h, dsa_kv::ids::LifeCycleId(lc as u16))
                .unwrap()
        })
        .collect();
    for p in range {
        for pl in &placements {
            let (vl, sl) = lens(pl, tpb as u32);
            let (v, s) = pattern(hashes[p], pl.layer, pl.role, vl, sl);
            let slot = tables[pl.life_cycle.index()][p / tpb];
            st.write_token(Tier::Gpu, pl, slot, (p % tpb) as u32, &v, &s);
        }
    }
}

/// Checks positions `range` of an active sequence through its block table; returns the
/// first mismatch as `(position, layer, role)`.
pub(crate) fn verify_positions(
    m: &KvCacheManager,
    st: &HostStorage,
    h: &SeqHandle,
    hashes: &[u64],
    range: std::ops::Range<usize>,
) -> Result<(), (usize, LayerId, Role)> {
    let tpb = m.tokens_per_block() as usize;
    let tables: Vec<Vec<SlotId>> = (0..m.plan().num_life_cycles())
        .map(|lc| {
            m.block_slots(h, dsa_kv::ids::LifeCycleId(lc as u16))
                .unwrap()
        })
        .collect();
    for p in range {
        for pl in m.plan().placements() {
            let (vl, sl) = lens(pl, tpb as u32);
            let (v, s) = pattern(hashes[p], pl.layer, pl.role, vl, sl);
            let slot = tables[pl.life_cycle.index()][p / tpb];
            let (rv, rs) = st.read_token(Tier::Gpu, pl, slot, (p % tpb) as u32);
            if rv != v.as_slice() || rs != s.as_slice() {
                return Err((p, pl.layer, pl.role));
            }
        }
    }
    Ok(())
}

/// Runs every pending copy plan on `st` and completes its fence.
pub(crate) fn run_copy_plans(m: &mut KvCacheManager, st: &mut HostStorage) -> usize {
    let plans = m.take_copy_plans();
    for p in &plans {
        st.execute(p).unwrap();
        m.complete_fences(p.fence).unwrap();
    }
    plans.len()
}

pub(crate) mod engine;
pub(crate) mod events;
pub(crate) mod transfer;
