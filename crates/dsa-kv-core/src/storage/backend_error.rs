//! A failure of a backend's own machinery (a driver call, device memory, kernel
//! compilation) carried without naming the backend, so the layers that only know the
//! storage and device contracts never import a backend. The backend's own error type is
//! recovered with [`BackendError::downcast_ref`].

use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// A backend's failure, type-erased (see the module docs).
#[derive(Clone)]
pub struct BackendError(Arc<dyn Error + Send + Sync + 'static>);

impl BackendError {
    /// Wraps a backend's error.
    pub fn new(e: impl Error + Send + Sync + 'static) -> Self {
        BackendError(Arc::new(e))
    }

    /// The backend's own error, if it is a `T` (e.g. `cuda::CudaError`).
    pub fn downcast_ref<T: Error + 'static>(&self) -> Option<&T> {
        self.0.downcast_ref::<T>()
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl Error for BackendError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.0.source()
    }
}

/// Equal when they say the same (errors carry no identity worth comparing).
impl PartialEq for BackendError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.to_string() == other.to_string()
    }
}

impl Eq for BackendError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error, PartialEq)]
    #[error("driver said {0}")]
    struct Driver(u32);

    #[test]
    fn keeps_the_message_and_the_type() {
        let e = BackendError::new(Driver(7));
        assert_eq!(e.to_string(), "driver said 7");
        assert_eq!(e.downcast_ref::<Driver>(), Some(&Driver(7)));
        assert!(e.downcast_ref::<std::fmt::Error>().is_none());
        assert_eq!(e.clone(), BackendError::new(Driver(7)));
        assert_ne!(e, BackendError::new(Driver(8)));
    }
}
