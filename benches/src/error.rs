//! The benchmarks' error type.

use std::path::PathBuf;

/// Everything that can end a benchmark. Each message is one line naming the problem; a
/// message that wraps another error quotes it, so callers need not print the source chain.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The guest ELF given does not exist.
    #[error("native test guest {} not found", .path.display())]
    GuestNotFound {
        /// The path given.
        path: PathBuf,
    },
    /// Writing an in-memory guest image to a memory file failed.
    #[error("writing the native test guest to a memory file: {0}")]
    GuestImage(#[source] std::io::Error),
    /// A benchmark parameter is out of range.
    #[error("{0}")]
    InvalidParams(String),
    /// The VMM library failed.
    #[error(transparent)]
    Vmm(#[from] vmm::Error),
    /// A VMM call failed while doing `what`.
    #[error("{what}: {source}")]
    VmmAt {
        /// What the benchmark was doing.
        what: String,
        /// The VMM's error.
        #[source]
        source: vmm::Error,
    },
    /// A host I/O operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What the benchmark was doing.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The guest did not behave as the benchmark needs (it ended early, stopped answering,
    /// or reported something else than expected).
    #[error("{0}")]
    Guest(String),
    /// Another error, with what the benchmark was doing (and, where it helps, the guest's
    /// last output).
    #[error("{what}: {source}")]
    Context {
        /// What the benchmark was doing.
        what: String,
        /// The error.
        #[source]
        source: Box<Error>,
    },
    /// The object store or its fetcher failed.
    #[error(transparent)]
    Store(#[from] store::Error),
    /// A report could not be drawn, written or read.
    #[error("report: {0}")]
    Report(String),
    /// A measuring thread panicked.
    #[error("the {0} thread panicked")]
    ThreadPanicked(&'static str),
}

/// The benchmarks' result type.
pub type Result<T> = std::result::Result<T, Error>;

/// Adds what the benchmark was doing to an error.
pub(crate) trait Context<T> {
    /// On error, wraps it with `what()`.
    fn context_with(self, what: impl FnOnce() -> String) -> Result<T>;

    /// On error, wraps it with `what`.
    fn context(self, what: &str) -> Result<T>
    where
        Self: Sized,
    {
        self.context_with(|| what.to_string())
    }
}

impl<T> Context<T> for std::result::Result<T, vmm::Error> {
    fn context_with(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::VmmAt {
            what: what(),
            source,
        })
    }
}

impl<T> Context<T> for std::result::Result<T, std::io::Error> {
    fn context_with(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Io {
            what: what(),
            source,
        })
    }
}

impl<T> Context<T> for std::result::Result<T, store::Error> {
    fn context_with(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Context {
            what: what(),
            source: Box::new(Error::Store(source)),
        })
    }
}

impl<T> Context<T> for Result<T> {
    fn context_with(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Context {
            what: what(),
            source: Box::new(source),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_quote_their_source_on_one_line() {
        let e: Result<()> = Err(std::io::Error::other("boom")).context("creating /x");
        let e = e.context_with(|| "step 1".into()).unwrap_err();
        assert_eq!(e.to_string(), "step 1: creating /x: boom");
        let e = Error::GuestNotFound {
            path: "/no/guest".into(),
        };
        assert_eq!(e.to_string(), "native test guest /no/guest not found");
    }
}
