//! The builder's error type.

use std::path::PathBuf;

/// Everything that can go wrong in a build. Messages name the Dockerfile line, the file
/// or the step concerned.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Dockerfile asks for something wrong or not supported (line 0: the whole file).
    #[error("Dockerfile{}: {msg}", if *.line == 0 { String::new() } else { format!(" line {}", .line) })]
    Dockerfile {
        /// The line (1-based; 0 for the whole file).
        line: usize,
        /// What is wrong.
        msg: String,
    },
    /// A COPY source is missing, leaves the context, or cannot be read.
    #[error("Dockerfile line {line}: {msg}")]
    Context {
        /// The line of the COPY.
        line: usize,
        /// What is wrong.
        msg: String,
    },
    /// A step ran and failed.
    #[error("Dockerfile line {line}: `{text}` failed ({status}){}", if .output.is_empty() { String::new() } else { format!(":\n{}", .output) })]
    StepFailed {
        /// The line of the step.
        line: usize,
        /// The instruction.
        text: String,
        /// How it ended.
        status: String,
        /// The end of its output.
        output: String,
    },
    /// The build cache is in use by a build (a prune waits for none).
    #[error("the build cache {} is in use by a build: try again when it has ended", .0.display())]
    CacheBusy(PathBuf),
    /// The build VM failed (did not start, its agent did not answer, a request failed).
    #[error("the build VM: {0}")]
    Vm(String),
    /// The base image.
    #[error(transparent)]
    Image(#[from] clade_image::Error),
    /// A disk layer.
    #[error(transparent)]
    Disk(#[from] disk::Error),
    /// A host I/O operation failed.
    #[error("{what} {}: {source}", .path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            what,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn vm(e: impl std::fmt::Display) -> Self {
        Error::Vm(e.to_string())
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
