//! Counters read as a consistent snapshot (a sequence lock).

use super::{fence, lock, spin, AtomicU64, Mutex, Ordering};

/// `N` counters that writers update together and readers snapshot without blocking
/// them: a reader never sees half of an update (e.g. a request counted as finished but
/// still running). Writers are serialized by a lock that owns the current values; they
/// publish into the atomics under a sequence number, and readers retry while an update
/// is in progress (the number is odd) or happened while they read.
#[derive(Debug)]
pub struct SeqCounters<const N: usize> {
    seq: AtomicU64,
    vals: [AtomicU64; N],
    /// The current values and the sequence number (writers only).
    writer: Mutex<([u64; N], u64)>,
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
            writer: Mutex::new(([0; N], 0)),
        }
    }

    /// Applies `f` to the counters as one update.
    pub fn update(&self, f: impl FnOnce(&mut [u64; N])) {
        let mut w = lock(&self.writer);
        let (cur, seq) = &mut *w;
        f(cur);
        // Writers never read the atomics back: the lock owns the truth.
        self.seq.store(*seq + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        for (v, &x) in self.vals.iter().zip(cur.iter()) {
            v.store(x, Ordering::Relaxed);
        }
        *seq += 2;
        self.seq.store(*seq, Ordering::Release);
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
