//! The crate's one error type.

/// Everything the cluster layer can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// PostgreSQL refused or could not be reached.
    #[error("cluster registry (PostgreSQL): {0}")]
    Db(#[from] tokio_postgres::Error),
    /// A setting is not usable (said before anything starts).
    #[error("{0}")]
    Config(String),
    /// Another node of the cluster could not be reached or answered badly.
    #[error("node {node}: {why}")]
    Hop {
        /// The node.
        node: String,
        /// What happened.
        why: String,
    },
    /// The sandbox was killed (the registry holds its tombstone): nothing may record or
    /// act on it again.
    #[error("sandbox {0} was killed")]
    Killed(String),
    /// No such node.
    #[error("no node named {0} in the cluster")]
    NoSuchNode(String),
}

/// The crate's result.
pub type Result<T> = std::result::Result<T, Error>;

/// An error with its causes: tokio-postgres's and hyper's own messages do not name them
/// ("error performing TLS handshake", "client error (Connect)" without the certificate's
/// fault).
pub(crate) fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}
