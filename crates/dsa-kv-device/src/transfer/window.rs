//! The receiving side's check: an import opens a window (who may write, where, until
//! when) and every incoming write must lie in one open window of its peer
//! ([`window_for`]), or it is refused before any byte lands.

use std::time::Instant;

use super::{MemKind, MemRegion, PeerId, TransportError};

/// An import's window as the receiving side keeps it (for [`KvTransport`](super::KvTransport)
/// implementations: a receiver checks every incoming write against its open windows
/// with [`window_for`]).
#[derive(Clone, Debug)]
pub struct Window {
    /// Who may write it.
    pub peer: String,
    /// Where, sorted by (memory, address).
    pub ranges: Vec<MemRegion>,
    /// Until when.
    pub deadline: Instant,
}

impl Window {
    /// Checks `ranges` lie in `registered` memory and builds the window.
    pub fn new(
        peer: &PeerId,
        ranges: &[MemRegion],
        deadline: Instant,
        registered: &[MemRegion],
    ) -> Result<Window, TransportError> {
        if let Some((index, r)) = ranges.iter().enumerate().find(|(_, r)| {
            !registered
                .iter()
                .any(|g| g.mem == r.mem && g.contains(r.addr, r.len))
        }) {
            return Err(TransportError::Unregistered {
                index,
                side: "window",
                addr: r.addr,
                len: r.len,
            });
        }
        let mut sorted = ranges.to_vec();
        sorted.sort_by_key(|m| (m.mem_key(), m.addr));
        // Overlapping and adjacent ranges merged: the search in `covers` is then exact.
        let mut ranges: Vec<MemRegion> = Vec::with_capacity(sorted.len());
        for m in sorted {
            match ranges.last_mut() {
                Some(l) if l.mem == m.mem && m.addr <= l.addr + l.len => {
                    l.len = l.len.max(m.addr + m.len - l.addr);
                }
                _ => ranges.push(m),
            }
        }
        Ok(Window {
            peer: peer.0.clone(),
            ranges,
            deadline,
        })
    }

    /// Whether `len` bytes of `mem` at `addr` lie inside one of the window's ranges.
    pub fn covers(&self, mem: MemKind, addr: u64, len: u64) -> bool {
        // The last range starting at or before `addr` is the only candidate.
        let key = (MemRegion { addr, len, mem }.mem_key(), addr);
        let i = self
            .ranges
            .partition_point(|m| (m.mem_key(), m.addr) <= key);
        i > 0 && self.ranges[i - 1].mem == mem && self.ranges[i - 1].contains(addr, len)
    }
}

/// Finds the window of `peer` that covers every destination of `dsts` (`(memory,
/// address, length)`), open at `now`: its id, or why the write is refused. A write with
/// no destination (nothing to copy, only its notification) still needs an open window
/// of its peer: a peer without one files no notification.
pub fn window_for<'w>(
    windows: impl IntoIterator<Item = (&'w u64, &'w Window)>,
    peer: &str,
    dsts: impl Iterator<Item = (MemKind, u64, u64)> + Clone,
    now: Instant,
) -> Result<u64, String> {
    let mut expired = false;
    for (&id, w) in windows {
        if w.peer != peer {
            continue;
        }
        if dsts.clone().all(|(m, a, l)| w.covers(m, a, l)) {
            if now < w.deadline {
                return Ok(id);
            }
            expired = true;
        }
    }
    Err(if expired {
        "the import's window has passed its deadline".into()
    } else if dsts.clone().next().is_none() {
        "no open window of this peer: a write, even one with nothing to copy, needs an \
         import's window"
            .into()
    } else {
        let first = dsts.clone().next();
        format!(
            "no open window of this peer covers the write (first destination {first:?}): only pages an import reserved for it may be written"
        )
    })
}

/// Removes the windows whose deadline has passed at `now` and that `busy` does not
/// hold: they accept no write any more ([`window_for`]), so an import that ended
/// without closing its window (its lease ran out) leaves nothing behind, and its id
/// can open a window again.
pub fn prune_expired<W>(
    windows: &mut std::collections::HashMap<u64, W>,
    now: Instant,
    window: impl Fn(&W) -> &Window,
    busy: impl Fn(&W) -> bool,
) {
    windows.retain(|_, w| now < window(w).deadline || busy(w));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::{MemKind, MemRegion, PeerId};
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    use std::collections::HashMap;
    use std::time::Duration;

    /// A write with no destination is admitted by an open window of its peer only;
    /// `prune_expired` keeps open and busy windows and drops the rest.
    #[test]
    fn empty_writes_need_a_window_and_expired_ones_are_pruned() {
        let now = Instant::now();
        let w = |peer: &str, deadline| Window {
            peer: peer.into(),
            ranges: Vec::new(),
            deadline,
        };
        let later = now + Duration::from_secs(1);
        let none = std::iter::empty::<(MemKind, u64, u64)>();
        let mut ws: HashMap<u64, Window> = HashMap::new();
        let e = window_for(&ws, "p", none.clone(), now).unwrap_err();
        assert!(e.contains("needs an import's window"), "{e}");
        ws.insert(1, w("q", later));
        assert!(window_for(&ws, "p", none.clone(), now).is_err());
        ws.insert(2, w("p", now));
        let e = window_for(&ws, "p", none.clone(), now).unwrap_err();
        assert!(e.contains("passed its deadline"), "{e}");
        ws.insert(3, w("p", later));
        assert_eq!(window_for(&ws, "p", none, now), Ok(3));
        ws.insert(4, w("p", now));
        prune_expired(&mut ws, now, |w| w, |_| false);
        let mut kept: Vec<u64> = ws.keys().copied().collect();
        kept.sort_unstable();
        assert_eq!(kept, [1, 3]);
        let mut busy: HashMap<u64, (Window, bool)> =
            [(5, (w("p", now), true)), (6, (w("p", now), false))].into();
        prune_expired(&mut busy, now, |(w, _)| w, |&(_, b)| b);
        assert_eq!(busy.keys().copied().collect::<Vec<_>>(), [5]);
    }

    /// `Window::covers` (a binary search) against a plain scan, and `window_for`'s
    /// rules, on random windows and writes.
    #[test]
    fn windows_cover_exactly_their_ranges() {
        let range = (0u64..4, 0u64..4096, 1u64..512);
        let input = (
            proptest::collection::vec(range.clone(), 0..8),
            proptest::collection::vec(range, 1..6),
        );
        let mut runner = TestRunner::new_with_rng(
            Config::with_cases(512),
            TestRng::from_seed(RngAlgorithm::ChaCha, &[31; 32]),
        );
        let mem = |k: u64| {
            if k == 0 {
                MemKind::Host
            } else {
                MemKind::Device { ordinal: k as u32 }
            }
        };
        runner
            .run(&input, |(ranges, writes)| {
                let ranges: Vec<MemRegion> = ranges
                    .iter()
                    .map(|&(m, addr, len)| MemRegion {
                        addr,
                        len,
                        mem: mem(m),
                    })
                    .collect();
                let registered: Vec<MemRegion> = (0..4)
                    .map(|m| MemRegion {
                        addr: 0,
                        len: 1 << 20,
                        mem: mem(m),
                    })
                    .collect();
                let now = Instant::now();
                let w = Window::new(&PeerId("p".into()), &ranges, now, &registered).unwrap();
                for &(m, addr, len) in &writes {
                    // A plain scan over the union of the ranges, byte by byte.
                    let plain = (addr..addr + len)
                        .all(|b| ranges.iter().any(|r| r.mem == mem(m) && r.contains(b, 1)));
                    prop_assert_eq!(w.covers(mem(m), addr, len), plain);
                }
                let windows: HashMap<u64, Window> = [(1, w.clone())].into_iter().collect();
                let dsts = writes.iter().map(|&(m, a, l)| (mem(m), a, l));
                let later = now + Duration::from_secs(1);
                let open = Window {
                    deadline: later,
                    ..w.clone()
                };
                let open: HashMap<u64, Window> = [(1, open)].into_iter().collect();
                let all = dsts.clone().all(|(m, a, l)| w.covers(m, a, l));
                prop_assert_eq!(window_for(&open, "p", dsts.clone(), now).is_ok(), all);
                prop_assert!(window_for(&open, "q", dsts.clone(), now).is_err());
                prop_assert!(
                    window_for(&windows, "p", dsts, now).is_err(),
                    "past its deadline"
                );
                Ok(())
            })
            .unwrap();
    }
}
