//! A value published as a whole.

use super::{lock, Arc, AtomicU64, Mutex, Ordering};

/// A read-mostly value that a writer replaces as a whole and readers load as a whole:
/// a reader gets the value before or after a [`publish`](Published::publish), never a
/// mix. The epoch counts publications (cheap "did it change?" checks).
#[derive(Debug)]
pub struct Published<T> {
    epoch: AtomicU64,
    value: Mutex<Arc<T>>,
}

impl<T> Published<T> {
    /// Starts with `value` at epoch 0.
    pub fn new(value: T) -> Self {
        Published {
            epoch: AtomicU64::new(0),
            value: Mutex::new(Arc::new(value)),
        }
    }

    /// Replaces the value; returns the new epoch.
    pub fn publish(&self, value: T) -> u64 {
        let v = Arc::new(value);
        let mut g = lock(&self.value);
        *g = v;
        // Inside the lock: epochs and values change together.
        self.epoch.fetch_add(1, Ordering::Release) + 1
    }

    /// The current value.
    pub fn load(&self) -> Arc<T> {
        lock(&self.value).clone()
    }

    /// The current value and its epoch, read together.
    pub fn load_with_epoch(&self) -> (Arc<T>, u64) {
        let g = lock(&self.value);
        (g.clone(), self.epoch.load(Ordering::Acquire))
    }

    /// Publications so far.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }
}
