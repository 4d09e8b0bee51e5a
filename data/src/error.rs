//! The one error type of flux-data's files (checkpoints and datasets): every variant names the
//! file, and the dataset or attribute where there is one.

use std::path::Path;

/// Why a checkpoint or dataset file could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A filesystem operation failed.
    #[error("{path}: {message}")]
    Io {
        /// The file or directory.
        path: String,
        /// The OS error.
        message: String,
    },
    /// The HDF5 library refused an operation (a truncated file, a missing dataset, …).
    #[error("{path}: {what}: {message}")]
    Hdf5 {
        /// The file.
        path: String,
        /// Dataset or attribute.
        what: String,
        /// HDF5's message.
        message: String,
    },
    /// A dataset's bytes do not match their checksum (the file's CRC-32, or HDF5's per-chunk
    /// Fletcher-32).
    #[error("{path}: dataset `{dataset}` is corrupt (checksum mismatch)")]
    Corrupt {
        /// The file.
        path: String,
        /// The dataset.
        dataset: String,
    },
    /// The file's structure is not what this version writes (version, shapes, attributes).
    #[error("{path}: {message}")]
    Format {
        /// The file or directory.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// Another rank failed its part of a collective save.
    #[error("checkpoint {dir}: {failed} rank(s) failed to write their part; the previous checkpoint stays current")]
    PeerFailed {
        /// The checkpoint being written.
        dir: String,
        /// How many ranks failed.
        failed: u32,
    },
}

impl DataError {
    /// A [`DataError::Format`] for `path`.
    pub fn format(path: &Path, message: impl Into<String>) -> Self {
        Self::Format {
            path: path.display().to_string(),
            message: message.into(),
        }
    }
}

/// Map an OS error on `path`.
pub fn io(path: &Path) -> impl Fn(std::io::Error) -> DataError + '_ {
    move |e| DataError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}
