//! Counters read as a consistent snapshot (a sequence lock).

use super::{fence, lock, spin, AtomicU64, Mutex, Ordering};

/// `N` counters that writers update together and readers snapshot without blocking
/// them: a reader never sees half of an update (e.g. a request counted as finished but
/// still running). Writers are serialized by a lock; readers retry while an update is in
/// progress (the sequence number is odd) or happened while they read.
#[derive(Debug)]
pub struct SeqCounters<const N: usize> {
    seq: AtomicU64,
    vals: [AtomicU64; N],
    writer: Mutex<()>,
}

impl<const N: usize> Default for SeqCounters<N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const N: usize> SeqCounters<N> {
    /// All zero.
    pub fn new() -> Self {
        SeqCounters {
            seq: AtomicU64::new(0),
            vals: std::array::from_fn(|_| AtomicU64::new(0)),
            writer: Mutex::new(()),
        }
    }

    /// Applies `f` to the counters as one update.
    pub fn update(&self, f: impl FnOnce(&mut [u64; N])) {
        let _w = lock(&self.writer);
        let mut cur: [u64; N] = std::array::from_fn(|i| self.vals[i].load(Ordering::Relaxed));
        f(&mut cur);
        let s = self.seq.load(Ordering::Relaxed);
        self.seq.store(s + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        for (v, &x) in self.vals.iter().zip(&cur) {
            v.store(x, Ordering::Relaxed);
        }
        self.seq.store(s + 2, Ordering::Release);
    }

    /// A consistent snapshot.
    pub fn snapshot(&self) -> [u64; N] {
        loop {
            let s1 = self.seq.load(Ordering::Acquire);
            if s1.is_multiple_of(2) {
                let out: [u64; N] = std::array::from_fn(|i| self.vals[i].load(Ordering::Relaxed));
                fence(Ordering::Acquire);
                if self.seq.load(Ordering::Relaxed) == s1 {
                    return out;
                }
            }
            spin();
        }
    }
}
