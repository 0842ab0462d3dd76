//! HTTPS for `clade serve --domain D --tls-cert C --tls-key K`: the control plane, the data
//! plane and every exposed port on one TLS listener, so that the `https://<port>-<id>.D`
//! URLs the SDK's `get_host(port)` builds work in a browser.
//!
//! The certificate is the operator's (a wildcard `*.D`, and `D` itself if the API is
//! reached there), loaded once at start with rustls; handshakes run on tasks of their own,
//! so a client that stalls in one holds up nobody else, and is dropped after
//! [`HANDSHAKE_TIMEOUT`].

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
pub use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::error::{Error, Result};

/// How long a client may take over its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshaken connections waiting for the server to take them.
const READY_DEPTH: usize = 64;

/// The server's TLS configuration from a PEM certificate chain and private key.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>> {
    let bad =
        |what: &str, p: &Path, e: String| Error::BadRequest(format!("{what} {}: {e}", p.display()));
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| bad("TLS certificate", cert, e.to_string()))?
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| bad("TLS certificate", cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(bad("TLS certificate", cert, "no certificate in it".into()));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| bad("TLS key", key, e.to_string()))?;
    // The provider named, not the process default: another crate enabling a second
    // provider must not make the builder panic.
    let provider = Arc::new(tokio_rustls::rustls::crypto::aws_lc_rs::default_provider());
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("TLS", cert, e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| bad("TLS certificate and key", cert, e.to_string()))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// A TLS listener for [`axum::serve`]: TCP connections are accepted and handshaken on
/// tasks of their own; `accept` hands out the ones that completed.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    acceptor: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    /// Serves TLS with `cfg` on `listener`.
    pub fn new(listener: TcpListener, cfg: Arc<ServerConfig>) -> io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(READY_DEPTH);
        let tls = TlsAcceptor::from(cfg);
        let acceptor = tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of descriptors and the like: wait a moment, as axum does.
                        tracing::warn!("accepting a connection: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let (tls, tx) = (tls.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(tcp)).await {
                        Ok(Ok(s)) => {
                            let _ = tx.send((s, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, "TLS handshake: {e}"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self {
            ready,
            local,
            acceptor,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(x) => x,
            // The acceptor task ended (aborted): nothing will come again.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_certificates_and_keys_are_clear_errors() {
        let d = std::env::temp_dir().join(format!("sandbox-tls-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let (c, k) = (d.join("c.pem"), d.join("k.pem"));
        std::fs::write(&c, "not a certificate").unwrap();
        std::fs::write(&k, "not a key").unwrap();
        let e = server_config(&c, &k).unwrap_err().to_string();
        assert!(e.contains("c.pem"), "{e}");
        let e = server_config(&d.join("missing.pem"), &k)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.pem"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
