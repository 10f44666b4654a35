//! One byte budget shared by the target and draft caches.

use super::{AtomicU64, Ordering};

/// A refused reservation or release.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QuotaError {
    /// Not enough budget left.
    #[error("{what} needs {bytes} bytes but only {available} of the {capacity}-byte KV budget are left: lower max_tokens or the draft cache size, or raise the budget")]
    Exceeded {
        /// Who asked.
        what: String,
        /// Bytes asked for.
        bytes: u64,
        /// Bytes left.
        available: u64,
        /// The budget.
        capacity: u64,
    },
    /// Releasing bytes that were not reserved (a double release).
    #[error("releasing {bytes} bytes but only {used} are reserved (released twice?)")]
    OverRelease {
        /// Bytes released.
        bytes: u64,
        /// Bytes reserved.
        used: u64,
    },
}

/// Reserved bytes against a fixed capacity. Reservations are all-or-nothing, each landing
/// as one compare-and-swap: a reader ([`used`](QuotaLedger::used)) never sees a refused
/// reservation or more than the capacity, and concurrent reservers cannot over-commit
/// (the runtime has none: it reserves at start, from one thread, and reads from any).
#[derive(Debug)]
pub struct QuotaLedger {
    capacity: u64,
    used: AtomicU64,
}

impl QuotaLedger {
    /// An empty ledger of `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        QuotaLedger {
            capacity,
            used: AtomicU64::new(0),
        }
    }

    /// Reserves `bytes` for `what`.
    pub fn try_reserve(&self, what: &str, bytes: u64) -> Result<(), QuotaError> {
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let next = cur.checked_add(bytes).filter(|&n| n <= self.capacity);
            let Some(next) = next else {
                return Err(QuotaError::Exceeded {
                    what: what.to_string(),
                    bytes,
                    available: self.capacity - cur,
                    capacity: self.capacity,
                });
            };
            match self
                .used
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    /// Returns `bytes` to the budget.
    pub fn release(&self, bytes: u64) -> Result<(), QuotaError> {
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            if bytes > cur {
                return Err(QuotaError::OverRelease { bytes, used: cur });
            }
            match self.used.compare_exchange_weak(
                cur,
                cur - bytes,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    /// Bytes reserved.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// The budget.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }
}
