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
    /// A token id the checkpoint's vocabulary does not have.
    #[error(
        "token {token} at input position {index} is not in the checkpoint's vocabulary of \
         {vocab} ids: tokenize with the checkpoint's own tokenizer"
    )]
    TokenOutOfVocab {
        /// The token.
        token: u32,
        /// Its index in the step's input.
        index: usize,
        /// The vocabulary size.
        vocab: usize,
    },
    /// Something this model cannot do (an MTP draft of a checkpoint without one).
    #[error("{0}")]
    Unsupported(String),
}
