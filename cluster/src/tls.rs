//! TLS of the cluster's links: to PostgreSQL (libpq's `sslmode`) and between nodes (the
//! cluster CA).
//!
//! Every hop between nodes carries the cluster secret and the API key, and the registry's
//! connection its password and every sandbox's owner: in clear text, anyone on the path
//! could take the cluster. Both links therefore speak rustls (the same provider the
//! service's own HTTPS listener uses, `sandbox::http::tls`), and both authenticate the
//! other side against a CA the operator names, not the system's: a cluster's nodes and
//! its database have certificates of the operator's own CA.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::client::WebPkiServerVerifier;
use tokio_rustls::rustls::crypto::{self, CryptoProvider};
use tokio_rustls::rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::error::{Error, Result};

/// The crypto provider, named rather than the process default (as `sandbox::http::tls`
/// does): another crate enabling a second provider must not make a builder panic.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(crypto::aws_lc_rs::default_provider())
}

/// The CA certificates of PEM file `path` (at least one).
pub fn roots(path: &Path) -> Result<RootCertStore> {
    let bad = |why: String| Error::Config(format!("CA certificates {}: {why}", path.display()));
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no certificate in it".into()));
    }
    let mut store = RootCertStore::empty();
    for c in certs {
        store.add(c).map_err(|e| bad(e.to_string()))?;
    }
    Ok(store)
}

/// A client configuration that verifies servers' chains to `roots` and their names.
/// An empty `roots` makes a configuration that trusts no server.
pub fn verifying(roots: RootCertStore) -> Result<ClientConfig> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

fn with_verifier(v: Arc<dyn ServerCertVerifier>) -> Result<ClientConfig> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(format!("TLS: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(v)
        .with_no_client_auth())
}

/// libpq's `sslmode`: whether the registry's connection is encrypted, and what of the
/// server is verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Clear text.
    Disable,
    /// TLS if the server offers it, clear text if not; the server is not verified.
    Prefer,
    /// TLS or nothing; the server is not verified (verified as `verify-ca` if an
    /// `sslrootcert` is given, as libpq does).
    Require,
    /// TLS, the server's chain verified to `sslrootcert`.
    VerifyCa,
    /// TLS, the chain verified and the certificate naming the host connected to.
    VerifyFull,
}

impl SslMode {
    /// libpq's spelling.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "disable" => Self::Disable,
            "prefer" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            // libpq's "allow" (clear text first) is not offered: nothing is gained by it.
            other => {
                return Err(Error::Config(format!(
                    "sslmode={other}: give disable, prefer, require, verify-ca or verify-full"
                )))
            }
        })
    }

    /// What tokio-postgres negotiates (it knows no verification: the verifier does it).
    pub fn negotiation(self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as M;
        match self {
            Self::Disable => M::Disable,
            Self::Prefer => M::Prefer,
            Self::Require | Self::VerifyCa | Self::VerifyFull => M::Require,
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Disable => "disable",
            Self::Prefer => "prefer",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        })
    }
}

/// The client configuration of the registry's connection for `mode`, trusting the CA
/// certificates of `root` (`sslrootcert`).
pub fn postgres(mode: SslMode, root: Option<&Path>) -> Result<ClientConfig> {
    let roots = root.map(roots).transpose()?;
    match (mode, roots) {
        (SslMode::VerifyFull, Some(r)) => verifying(r),
        (SslMode::VerifyCa | SslMode::Require, Some(r)) => {
            let chain = WebPkiServerVerifier::builder_with_provider(Arc::new(r), provider())
                .build()
                .map_err(|e| Error::Config(format!("TLS verifier: {e}")))?;
            with_verifier(Arc::new(Lenient {
                chain: Some(chain),
                provider: provider(),
            }))
        }
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => Err(Error::Config(format!(
            "sslmode={mode} needs sslrootcert=FILE (the CA of the server's certificate)"
        ))),
        (SslMode::Disable | SslMode::Prefer | SslMode::Require, _) => {
            with_verifier(Arc::new(Lenient {
                chain: None,
                provider: provider(),
            }))
        }
    }
}

/// The checks libpq's weaker modes make of the server's certificate, which rustls' own
/// verifier (`verify-full`: chain and name) does not offer: `verify-ca` checks the chain to
/// a trusted CA whatever host the certificate names (`chain`); `prefer` and `require`
/// take any certificate (`chain` is `None`). Either way the handshake's signatures are
/// checked, so the session is with whoever holds the certificate's key.
#[derive(Debug)]
struct Lenient {
    chain: Option<Arc<WebPkiServerVerifier>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, tokio_rustls::rustls::Error> {
        use tokio_rustls::rustls::{CertificateError, Error as E};
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        // webpki checks the chain before the name: a name error means the chain held.
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(E::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            r => r,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A registry URL split into what tokio-postgres parses and the TLS settings it does not
/// know (`sslmode=verify-ca|verify-full`, `sslrootcert`), taken out of it.
#[derive(Debug, Clone, PartialEq)]
pub struct PgTarget {
    /// The URL without `sslmode` and `sslrootcert`.
    pub url: String,
    /// `sslmode` (default `prefer`, as libpq's).
    pub mode: SslMode,
    /// `sslrootcert`.
    pub root: Option<PathBuf>,
}

impl PgTarget {
    /// Splits `url`: `postgres://…?sslmode=…&sslrootcert=…` or `host=… sslmode=…`. Errors
    /// never quote the URL (it may hold a password).
    pub fn parse(url: &str) -> Result<Self> {
        let (rest, params) = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            split_uri(url)
        } else {
            split_keywords(url)?
        };
        let (mut mode, mut root) = (SslMode::Prefer, None);
        for (k, v) in params {
            match k.as_str() {
                "sslmode" => mode = SslMode::parse(&v)?,
                _ => root = Some(PathBuf::from(v)),
            }
        }
        Ok(Self {
            url: rest,
            mode,
            root,
        })
    }
}

fn taken(key: &str) -> bool {
    key == "sslmode" || key == "sslrootcert"
}

/// The URI form: its query's `sslmode` and `sslrootcert` (percent-decoded) taken out.
fn split_uri(url: &str) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_string(), Vec::new());
    };
    let (mut kept, mut params) = (Vec::new(), Vec::new());
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if taken(k) {
            let v = percent_encoding::percent_decode_str(v).decode_utf8_lossy();
            params.push((k.to_string(), v.into_owned()));
        } else {
            kept.push(pair);
        }
    }
    let rest = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (rest, params)
}

/// The keyword/value form (`host=h sslmode='verify-full'`): those pairs taken out, the
/// rest left as written.
fn split_keywords(s: &str) -> Result<(String, Vec<(String, String)>)> {
    let bad = |why: &str| Error::Config(format!("the registry's connection string: {why}"));
    let b = s.as_bytes();
    let (mut i, mut rest, mut params) = (0, String::new(), Vec::new());
    loop {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if i == b.len() {
            break;
        }
        let start = i;
        while i < b.len() && b[i] != b'=' && !b[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = &s[start..i];
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if i == b.len() || b[i] != b'=' || key.is_empty() {
            return Err(bad("expected KEY=VALUE"));
        }
        i += 1;
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        let mut value = Vec::new();
        let quoted = i < b.len() && b[i] == b'\'';
        if quoted {
            i += 1;
        }
        loop {
            match b.get(i) {
                None if quoted => return Err(bad("a quote is not closed")),
                None => break,
                Some(b'\'') if quoted => {
                    i += 1;
                    break;
                }
                Some(c) if !quoted && c.is_ascii_whitespace() => break,
                Some(b'\\') => {
                    let c = *b.get(i + 1).ok_or_else(|| bad("it ends in a backslash"))?;
                    value.push(c);
                    i += 2;
                }
                Some(&c) => {
                    value.push(c);
                    i += 1;
                }
            }
        }
        if taken(key) {
            let v = String::from_utf8(value).map_err(|_| bad("a value is not UTF-8"))?;
            params.push((key.to_string(), v));
        } else {
            if !rest.is_empty() {
                rest.push(' ');
            }
            rest.push_str(&s[start..i]);
        }
    }
    Ok((rest, params))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslmode_and_sslrootcert_are_taken_out_of_both_forms() {
        let t = PgTarget::parse(
            "postgres://u:p@h:5432/db?connect_timeout=3&sslmode=verify-full&sslrootcert=%2Fetc%2Fca%20x.pem",
        )
        .unwrap();
        assert_eq!(t.url, "postgres://u:p@h:5432/db?connect_timeout=3");
        assert_eq!(t.mode, SslMode::VerifyFull);
        assert_eq!(t.root.as_deref(), Some(Path::new("/etc/ca x.pem")));
        let t = PgTarget::parse("postgresql://u@h/db?sslmode=require").unwrap();
        assert_eq!(
            (t.url.as_str(), t.mode),
            ("postgresql://u@h/db", SslMode::Require)
        );
        let t = PgTarget::parse("postgres://u@h/db").unwrap();
        assert_eq!((t.mode, t.root), (SslMode::Prefer, None));

        let t = PgTarget::parse(
            "host=127.0.0.1 sslmode = verify-ca password='a b\\'c' sslrootcert='/x y/ca.pem'",
        )
        .unwrap();
        assert_eq!(t.url, "host=127.0.0.1 password='a b\\'c'");
        assert_eq!(t.mode, SslMode::VerifyCa);
        assert_eq!(t.root.as_deref(), Some(Path::new("/x y/ca.pem")));
        t.url.parse::<tokio_postgres::Config>().unwrap();
    }

    #[test]
    fn bad_settings_are_clear_errors_that_do_not_quote_the_password() {
        let e = PgTarget::parse("postgres://u:hunter2@h/db?sslmode=verify-everything")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("sslmode=verify-everything") && !e.contains("hunter2"),
            "{e}"
        );
        let e = PgTarget::parse("host=h password='hunter2")
            .unwrap_err()
            .to_string();
        assert!(e.contains("quote") && !e.contains("hunter2"), "{e}");
        let e = postgres(SslMode::VerifyFull, None).unwrap_err().to_string();
        assert!(e.contains("sslrootcert"), "{e}");
        let e = postgres(SslMode::VerifyCa, Some(Path::new("/nonexistent/ca.pem")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
    }
}
