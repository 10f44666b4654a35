//! What loading a checkpoint can fail with.

/// A checkpoint that cannot be loaded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file could not be read or parsed.
    #[error("{path}: {what}")]
    Io {
        /// The file.
        path: String,
        /// What failed.
        what: String,
    },
    /// A configuration key the model cannot take.
    #[error("config.json: {key} = {what}")]
    Config {
        /// The key.
        key: String,
        /// What is wrong with it, and what the model takes.
        what: String,
    },
    /// A tensor that is missing, of the wrong shape or type, or left over.
    #[error("tensor {name}: {what}")]
    Tensor {
        /// The tensor's name.
        name: String,
        /// What is wrong with it.
        what: String,
    },
}
