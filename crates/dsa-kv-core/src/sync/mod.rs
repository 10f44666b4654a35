//! Shared-memory primitives: everything the runtime shares between threads outside actor
//! messages. Each is written against the shim below — `std` normally, `loom` under
//! `cfg(loom)` — and model-checked by the loom tests in `tests/loom_*.rs`, each next to a
//! deliberately broken twin the checker must catch.
//!
//! * [`FenceBoard`]: per-device completion fences; a slot released behind a fence is
//!   handed out only after every device's completion of that fence is observed.
//! * [`Published`]: a read-mostly value swapped as a whole (the device's metadata
//!   bindings during draft replay; readers see the whole target or the whole draft set).
//! * [`SeqCounters`]: counters updated together by one writer and read as a consistent
//!   snapshot without blocking it (the handle's lock-free stats read path).
//! * [`QuotaLedger`]: bytes reserved by the target and draft caches against one budget;
//!   never over-committed, releases checked.
//!
//! Nothing here panics on a poisoned lock: a panicking writer leaves a value that is
//! still whole (every update is a single store or a swap).

mod counters;
mod fences;
mod published;
mod quota;

pub use counters::SeqCounters;
pub use fences::FenceBoard;
pub use published::Published;
pub use quota::{QuotaError, QuotaLedger};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

/// Yields in a retry loop (loom must be told, or its unfair scheduler spins forever).
pub(crate) fn spin() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// Locks, ignoring poisoning (see the module docs).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
