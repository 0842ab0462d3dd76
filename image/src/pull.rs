//! Pulling an image from a registry (the OCI distribution API, through `oci-client`) into
//! a content-addressed cache, as an OCI layout that [`Source::open`] reads.
//!
//! The cache holds every blob once, by digest (`blobs/sha256/<hex>`): a layer two images
//! share is fetched once. Each pulled manifest gets a small layout of its own
//! (`refs/<manifest hex>/`: `oci-layout`, `index.json`, and `blobs` pointing at the shared
//! blobs). A blob is streamed to a file under a temporary name, hashed as it passes, and
//! renamed only once its SHA-256 is its digest, so the cache never holds a corrupt blob
//! under a good name.
//!
//! A registry is untrusted: nothing it sends is held in memory beyond a small manifest.
//! A blob may be no larger than its descriptor in the manifest says (and no descriptor
//! over [`MAX_BLOB`]); a manifest or index no larger than [`MAX_MANIFEST`]. Either over
//! its limit is [`Error::OverLimit`].
//!
//! Registries on loopback (`localhost`, `127.0.0.1`, `[::1]`) are spoken to over plain
//! HTTP, as Docker does; others over HTTPS. Credentials come from Docker's config file
//! (`$DOCKER_CONFIG/config.json` or `~/.docker/config.json`, `auths.<registry>.auth`),
//! else the pull is anonymous.
//!
//! [`Source::open`]: crate::Source::open

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::manifest;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWrite;

use crate::error::{Error, Result};
use crate::source::sha256_hex_of;

/// What [`pull`] did.
#[derive(Debug, Clone)]
pub struct PullReport {
    /// The OCI layout of the pulled image (open it with `Source::open`).
    pub layout: PathBuf,
    /// `sha256:` digest of its manifest.
    pub manifest_digest: String,
    /// Blobs (config and layers) fetched now.
    pub fetched: usize,
    /// Blobs found in the cache already.
    pub cached: usize,
    /// Bytes fetched.
    pub bytes: u64,
}

/// How far a pull is: bytes of the blobs to fetch (`total`, known once the manifest is
/// read) and fetched so far.
#[derive(Debug, Default)]
pub struct PullProgress {
    done: AtomicU64,
    total: AtomicU64,
}

impl PullProgress {
    /// (done, total) bytes.
    pub fn get(&self) -> (u64, u64) {
        (
            self.done.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
        )
    }
}

/// The largest blob (config or layer) a manifest may name: 32 GiB, the same as the
/// unpacked tree's default limit ([`crate::UnpackLimits::DEFAULT_MAX_BYTES`]); a layer
/// is rarely a tenth of it.
pub const MAX_BLOB: u64 = 32 << 30;

/// The largest manifest or index: 4 MiB (real ones are a few KiB; Docker's registry
/// refuses manifests over 4 MiB too).
pub const MAX_MANIFEST: u64 = 4 << 20;

/// A writer that hashes what goes through it, counts it into a [`PullProgress`], and
/// refuses to write more than `cap` bytes in all.
struct Counting<'a, W> {
    inner: W,
    progress: Option<&'a PullProgress>,
    hasher: Sha256,
    written: u64,
    cap: u64,
    /// A write would have passed `cap`.
    over: bool,
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Counting<'_, W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.written.saturating_add(buf.len() as u64) > self.cap {
            self.over = true;
            return Poll::Ready(Err(std::io::Error::other(
                "the blob is larger than its descriptor says",
            )));
        }
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            let n = *n;
            self.hasher.update(&buf[..n]);
            self.written += n as u64;
            if let Some(p) = self.progress {
                p.done.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Whether `s` looks like a registry reference rather than a local path: not an existing
/// path, and of the form `[registry/]name[:tag][@digest]`.
pub fn is_reference(s: &str) -> bool {
    !Path::new(s).exists() && Reference::try_from(s).is_ok()
}

/// Pulls `reference` (linux/amd64 from a multi-platform index) into `cache`, counting
/// the bytes fetched into `progress`.
pub fn pull(reference: &str, cache: &Path, progress: Option<&PullProgress>) -> Result<PullReport> {
    let r = Reference::try_from(reference)
        .map_err(|e| Error::NotAnImage(format!("{reference}: not an image reference: {e}")))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("starting a runtime for", cache, e))?;
    rt.block_on(pull_async(&r, cache, progress))
}

fn loopback(registry: &str) -> bool {
    let host = match registry.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => registry,
    };
    matches!(host, "localhost" | "127.0.0.1" | "[::1]")
}

/// Basic credentials for `registry` from Docker's config file, if it has them.
fn docker_auth(registry: &str) -> RegistryAuth {
    let path = std::env::var_os("DOCKER_CONFIG")
        .map(|d| PathBuf::from(d).join("config.json"))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker/config.json")));
    let Some(text) = path.and_then(|p| std::fs::read_to_string(p).ok()) else {
        return RegistryAuth::Anonymous;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return RegistryAuth::Anonymous;
    };
    let auth = v["auths"][registry]["auth"].as_str().and_then(|a| {
        use base64::Engine as _;
        let raw = base64::engine::general_purpose::STANDARD.decode(a).ok()?;
        let s = String::from_utf8(raw).ok()?;
        let (u, p) = s.split_once(':')?;
        Some(RegistryAuth::Basic(u.to_string(), p.to_string()))
    });
    auth.unwrap_or(RegistryAuth::Anonymous)
}

/// A manifest or index over [`MAX_MANIFEST`] is refused.
fn check_manifest_size(r: &Reference, bytes: &[u8]) -> Result<()> {
    if bytes.len() as u64 > MAX_MANIFEST {
        return Err(Error::OverLimit {
            what: format!("{r}: manifest"),
            size: bytes.len() as u64,
            limit: MAX_MANIFEST,
        });
    }
    Ok(())
}

fn reg_err(r: &Reference, e: impl std::fmt::Display) -> Error {
    Error::NotAnImage(format!("pulling {r}: {e}"))
}

async fn pull_async(
    r: &Reference,
    cache: &Path,
    progress: Option<&PullProgress>,
) -> Result<PullReport> {
    let registry = r.resolve_registry().to_string();
    let protocol = if loopback(&registry) {
        ClientProtocol::HttpsExcept(vec![registry.clone()])
    } else {
        ClientProtocol::Https
    };
    let client = Client::new(ClientConfig {
        protocol,
        ..Default::default()
    });
    let auth = docker_auth(&registry);
    let accepted = [
        manifest::OCI_IMAGE_MEDIA_TYPE,
        manifest::IMAGE_MANIFEST_MEDIA_TYPE,
        manifest::OCI_IMAGE_INDEX_MEDIA_TYPE,
        manifest::IMAGE_MANIFEST_LIST_MEDIA_TYPE,
    ];
    let (mut bytes, mut digest) = client
        .pull_manifest_raw(r, &auth, &accepted)
        .await
        .map_err(|e| reg_err(r, e))?;
    check_manifest_size(r, &bytes)?;
    let mut v: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| reg_err(r, format!("its manifest: {e}")))?;
    if let Some(list) = v.get("manifests").and_then(|m| m.as_array()) {
        let pick = list
            .iter()
            .find(|m| m["platform"]["os"] == "linux" && m["platform"]["architecture"] == "amd64")
            .or(if list.len() == 1 { list.first() } else { None })
            .and_then(|m| m["digest"].as_str())
            .ok_or_else(|| reg_err(r, "no linux/amd64 image in its index"))?
            .to_string();
        let by_digest = r.clone_with_digest(pick);
        (bytes, digest) = client
            .pull_manifest_raw(&by_digest, &auth, &accepted)
            .await
            .map_err(|e| reg_err(r, e))?;
        check_manifest_size(r, &bytes)?;
        v = serde_json::from_slice(&bytes).map_err(|e| reg_err(r, format!("its manifest: {e}")))?;
    }
    let got = format!("sha256:{:x}", Sha256::digest(&bytes));
    if got != digest {
        return Err(Error::BadBlob(format!(
            "{r}: manifest is {got}, the registry said {digest}"
        )));
    }
    let media_type = v["mediaType"]
        .as_str()
        .unwrap_or(manifest::OCI_IMAGE_MEDIA_TYPE)
        .to_string();
    let descs = std::iter::once(&v["config"]).chain(v["layers"].as_array().into_iter().flatten());
    let blobs: Vec<(String, u64)> = descs
        .map(|d| {
            let digest = d["digest"].as_str().unwrap_or_default().to_string();
            (digest, d["size"].as_u64().unwrap_or(0))
        })
        .collect();
    let blob_dir = cache.join("blobs/sha256");
    if let Some(p) = progress {
        let missing = blobs
            .iter()
            .filter(|(d, _)| sha256_hex_of(d).is_none_or(|h| !blob_dir.join(h).is_file()));
        p.total
            .fetch_add(missing.map(|(_, n)| n).sum(), Ordering::Relaxed);
    }
    std::fs::create_dir_all(&blob_dir).map_err(|e| Error::io("creating", &blob_dir, e))?;
    let mut report = PullReport {
        layout: PathBuf::new(),
        manifest_digest: digest.clone(),
        fetched: 0,
        cached: 0,
        bytes: 0,
    };
    for (d, declared) in &blobs {
        let hex = sha256_hex_of(d)
            .ok_or_else(|| reg_err(r, format!("blob digest {d:?} is not sha256")))?;
        if *declared > MAX_BLOB {
            return Err(Error::OverLimit {
                what: format!("{r}: blob {d}"),
                size: *declared,
                limit: MAX_BLOB,
            });
        }
        // A descriptor without a size (0) is allowed up to the largest blob.
        let cap = if *declared > 0 { *declared } else { MAX_BLOB };
        let path = blob_dir.join(hex);
        if path.is_file() {
            report.cached += 1;
            continue;
        }
        let tmp = blob_dir.join(format!(".{hex}.{}.part", std::process::id()));
        let fetched = async {
            let f = tokio::fs::File::create(&tmp)
                .await
                .map_err(|e| Error::io("creating", &tmp, e))?;
            let mut w = Counting {
                inner: tokio::io::BufWriter::new(f),
                progress,
                hasher: Sha256::new(),
                written: 0,
                cap,
                over: false,
            };
            let pulled = client.pull_blob(r, d.as_str(), &mut w).await;
            if w.over {
                return Err(Error::OverLimit {
                    what: format!("{r}: blob {d} (more than its descriptor says)"),
                    size: w.written,
                    limit: cap,
                });
            }
            pulled.map_err(|e| reg_err(r, e))?;
            tokio::io::AsyncWriteExt::flush(&mut w)
                .await
                .map_err(|e| Error::io("writing", &tmp, e))?;
            let got = format!("sha256:{:x}", w.hasher.clone().finalize());
            if &got != d {
                return Err(Error::BadBlob(format!("{r}: blob {d} arrived as {got}")));
            }
            if *declared > 0 && w.written != *declared {
                return Err(Error::BadBlob(format!(
                    "{r}: blob {d} is {} bytes, its descriptor says {declared}",
                    w.written
                )));
            }
            std::fs::rename(&tmp, &path).map_err(|e| Error::io("renaming", &tmp, e))?;
            Ok(w.written)
        }
        .await;
        match fetched {
            Ok(n) => {
                report.fetched += 1;
                report.bytes += n;
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        }
    }
    // The manifest itself, and the layout naming it.
    let mhex = sha256_hex_of(&digest).ok_or_else(|| reg_err(r, "manifest digest is not sha256"))?;
    std::fs::write(blob_dir.join(mhex), &bytes).map_err(|e| Error::io("writing", &blob_dir, e))?;
    let layout = cache.join("refs").join(mhex);
    std::fs::create_dir_all(&layout).map_err(|e| Error::io("creating", &layout, e))?;
    let link = layout.join("blobs");
    if std::fs::symlink_metadata(&link).is_err() {
        std::os::unix::fs::symlink("../../blobs", &link)
            .map_err(|e| Error::io("linking", &link, e))?;
    }
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .map_err(|e| Error::io("writing", &layout, e))?;
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": media_type,
            "digest": digest,
            "size": bytes.len(),
            "annotations": {"org.opencontainers.image.ref.name": r.whole()},
        }]
    });
    std::fs::write(layout.join("index.json"), index.to_string())
        .map_err(|e| Error::io("writing", &layout, e))?;
    report.layout = layout;
    tracing::info!(reference = %r, fetched = report.fetched, cached = report.cached, "pulled");
    Ok(report)
}
