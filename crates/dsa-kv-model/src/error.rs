//! The model's error: a cache that does not fit the model, or an access outside what a
//! step's metadata covers.

/// A model run's failure.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The cache's shape does not fit the model.
    #[error("the model cannot use this cache: {0}")]
    Cache(String),
    /// A cache access outside what the step's metadata covers.
    #[error("cache access: {0}")]
    Access(String),
    /// A checkpoint that cannot be loaded.
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// Something this model cannot do (an MTP draft of a checkpoint without one).
    #[error("{0}")]
    Unsupported(String),
}
