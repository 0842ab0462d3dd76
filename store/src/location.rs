//! Where snapshots are stored: an object store and a key prefix in it, from a URL.
//!
//! * `s3://bucket/prefix`: AWS S3 or an S3-compatible server. Credentials and region come
//!   from the usual AWS environment variables (`AWS_ACCESS_KEY_ID`,
//!   `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ENDPOINT_URL`);
//!   [`StoreOptions::endpoint`] names an S3-compatible server (plain `http://` allowed,
//!   path-style requests).
//! * `gs://bucket/prefix`, `az://container/prefix`: Google Cloud Storage and Azure Blob
//!   Storage, configured from their usual environment variables.
//! * `file:///dir`: a local directory (a shared filesystem between hosts, or tests).
//! * `memory://`: in this process only (tests).
//!
//! Every request is bounded in time ([`StoreOptions::timeout`]): a store that does not
//! answer gives [`Error::Timeout`] naming the object, never a hang.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::manifest::MAX_SMALL_OBJECT;
use crate::{Error, Result};

/// How to reach a store.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// An S3-compatible server's endpoint (`http://127.0.0.1:9000`), for `s3://` URLs.
    pub endpoint: Option<String>,
    /// The longest one request may take, retries included.
    pub timeout: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            endpoint: std::env::var("CLADE_STORE_ENDPOINT").ok(),
            timeout: Duration::from_secs(30),
        }
    }
}

fn client_options(options: &StoreOptions) -> object_store::ClientOptions {
    object_store::ClientOptions::new()
        .with_timeout(options.timeout)
        .with_connect_timeout(options.timeout.min(Duration::from_secs(10)))
}

fn retry_config(options: &StoreOptions) -> object_store::RetryConfig {
    object_store::RetryConfig {
        max_retries: 3,
        retry_timeout: options.timeout,
        ..Default::default()
    }
}

/// The bucket, time limits and endpoint (path-style requests, plain HTTP allowed) of an
/// S3 client.
fn s3_options(
    b: object_store::aws::AmazonS3Builder,
    bucket: &str,
    options: &StoreOptions,
) -> object_store::aws::AmazonS3Builder {
    let b = b
        .with_bucket_name(bucket)
        .with_client_options(client_options(options))
        .with_retry(retry_config(options));
    match &options.endpoint {
        Some(ep) => b
            .with_endpoint(ep)
            .with_allow_http(ep.starts_with("http://"))
            .with_virtual_hosted_style_request(false),
        None => b,
    }
}

/// Why a cloud store's client could not be made. The HTTP client loads the host's CA
/// certificates even for an `http://` endpoint: without any it fails with only "builder
/// error", which is said here in words.
fn build_error(e: object_store::Error) -> String {
    let s = e.to_string();
    if s.contains("builder error") {
        format!(
            "{s} (the HTTP client could not be set up: is a CA certificate bundle installed, \
             e.g. /etc/ssl/certs/ca-certificates.crt? it is needed for http:// endpoints too)"
        )
    } else {
        s
    }
}

/// An object store and the prefix Clade's objects live under.
///
/// Use one per tokio runtime: an HTTP store's pooled connections belong to the runtime
/// that opened them, and fail when driven from another.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    prefix: String,
    url: String,
    timeout: Duration,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("url", &self.url).finish()
    }
}

/// The prefixes of the environment variables [`Store::open`] takes an object store's
/// region, endpoint and credentials from (`AmazonS3Builder::from_env` and its GCS and
/// Azure twins read every variable so named).
pub const CREDENTIAL_ENV_PREFIXES: &[&str] = &["AWS_", "GOOGLE_", "AZURE_"];

impl Store {
    /// The store at `url` (see the [module documentation](self)).
    pub fn open(url: &str, options: &StoreOptions) -> Result<Store> {
        let config = |reason: String| Error::Config {
            url: url.to_string(),
            reason,
        };
        let parsed = url::Url::parse(url).map_err(|e| config(e.to_string()))?;
        let (client, retry) = (client_options(options), retry_config(options));
        let bucket_prefix = || parsed.path().trim_matches('/').to_string();
        let (inner, prefix): (Arc<dyn ObjectStore>, String) = match parsed.scheme() {
            "s3" => {
                let bucket = parsed
                    .host_str()
                    .filter(|b| !b.is_empty())
                    .ok_or_else(|| config("no bucket in the URL".into()))?;
                let mut b = object_store::aws::AmazonS3Builder::from_env();
                if std::env::var_os("AWS_REGION").is_none()
                    && std::env::var_os("AWS_DEFAULT_REGION").is_none()
                {
                    b = b.with_region("us-east-1");
                }
                let s = s3_options(b, bucket, options)
                    .build()
                    .map_err(|e| config(build_error(e)))?;
                (Arc::new(s), bucket_prefix())
            }
            "gs" => {
                let bucket = parsed
                    .host_str()
                    .ok_or_else(|| config("no bucket in the URL".into()))?;
                let s = object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_bucket_name(bucket)
                    .with_client_options(client)
                    .with_retry(retry)
                    .build()
                    .map_err(|e| config(build_error(e)))?;
                (Arc::new(s), bucket_prefix())
            }
            "az" | "azure" => {
                let container = parsed
                    .host_str()
                    .ok_or_else(|| config("no container in the URL".into()))?;
                let s = object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_container_name(container)
                    .with_client_options(client)
                    .with_retry(retry)
                    .build()
                    .map_err(|e| config(build_error(e)))?;
                (Arc::new(s), bucket_prefix())
            }
            "file" => {
                let dir = parsed
                    .to_file_path()
                    .map_err(|_| config("not a local path".into()))?;
                // Every sandbox's snapshots: private to the service's user, as its state is.
                vmm::host::private_dir(&dir)
                    .map_err(|e| config(format!("{}: {e}", dir.display())))?;
                let s = object_store::local::LocalFileSystem::new_with_prefix(&dir)
                    .map_err(|e| config(e.to_string()))?;
                (Arc::new(s), String::new())
            }
            "memory" => (
                Arc::new(object_store::memory::InMemory::new()),
                bucket_prefix(),
            ),
            other => return Err(config(format!("unsupported scheme {other:?}"))),
        };
        Ok(Store {
            inner,
            prefix,
            url: url.to_string(),
            timeout: options.timeout,
        })
    }

    /// An S3 store on `bucket/prefix` with these credentials (not the environment's):
    /// for a server this process started ([`crate::s3server`]).
    pub fn open_s3_with_keys(
        bucket: &str,
        prefix: &str,
        options: &StoreOptions,
        access_key: &str,
        secret_key: &str,
    ) -> Result<Store> {
        let url = format!("s3://{bucket}/{prefix}");
        let b = object_store::aws::AmazonS3Builder::new()
            .with_region("us-east-1")
            .with_access_key_id(access_key)
            .with_secret_access_key(secret_key);
        let b = s3_options(b, bucket, options);
        let s = b.build().map_err(|e| Error::Config {
            url: url.clone(),
            reason: build_error(e),
        })?;
        Ok(Store {
            inner: Arc::new(s),
            prefix: prefix.trim_matches('/').to_string(),
            url,
            timeout: options.timeout,
        })
    }

    /// A store over an existing `object_store` client (tests, embedding).
    pub fn from_object_store(inner: Arc<dyn ObjectStore>, prefix: &str) -> Store {
        Store {
            inner,
            prefix: prefix.trim_matches('/').to_string(),
            url: format!("object-store:{prefix}"),
            timeout: Duration::from_secs(30),
        }
    }

    /// The URL it was opened from.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The request time limit.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The full key of `rel` (a key relative to the prefix).
    pub fn key(&self, rel: &str) -> String {
        if self.prefix.is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix)
        }
    }

    fn path(&self, rel: &str) -> ObjectPath {
        ObjectPath::from(self.key(rel))
    }

    async fn bounded<T>(
        &self,
        op: &'static str,
        rel: &str,
        fut: impl std::future::Future<Output = object_store::Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r.map_err(|e| Error::store(op, &self.key(rel), e)),
            Err(_) => Err(Error::Timeout {
                op,
                key: self.key(rel),
                secs: self.timeout.as_secs(),
            }),
        }
    }

    /// The whole object `rel`, of at most [`MAX_SMALL_OBJECT`] bytes (see
    /// [`Store::get_max`]).
    pub async fn get(&self, rel: &str) -> Result<Bytes> {
        self.get_max(rel, MAX_SMALL_OBJECT).await
    }

    /// The whole object `rel`, of at most `max` bytes: a larger one is
    /// [`Error::TooLarge`], refused on the size the store gives before its body is read,
    /// and again if the body runs past `max` (nothing over `max` is held in memory).
    pub async fn get_max(&self, rel: &str, max: u64) -> Result<Bytes> {
        let path = self.path(rel);
        let too_large = |size: u64| Error::TooLarge {
            key: self.key(rel),
            size,
            limit: max,
        };
        let r = self.bounded("get", rel, self.inner.get(&path)).await?;
        if r.meta.size > max {
            return Err(too_large(r.meta.size));
        }
        self.bounded("get", rel, async {
            let mut body = r.into_stream();
            let mut out = bytes::BytesMut::new();
            while let Some(piece) = futures::StreamExt::next(&mut body).await {
                let piece = piece?;
                if (out.len() + piece.len()) as u64 > max {
                    return Ok(Err(too_large((out.len() + piece.len()) as u64)));
                }
                out.extend_from_slice(&piece);
            }
            Ok(Ok(out.freeze()))
        })
        .await?
    }

    /// Bytes `start..end` of object `rel`, checked to be exactly that long.
    pub async fn get_range(&self, rel: &str, start: u64, end: u64) -> Result<Bytes> {
        let path = self.path(rel);
        let b = self
            .bounded("get range of", rel, self.inner.get_range(&path, start..end))
            .await?;
        if b.len() as u64 != end - start {
            return Err(Error::BadManifest {
                key: self.key(rel),
                reason: format!(
                    "range {start}..{end} gave {} bytes (object shorter than its manifest says)",
                    b.len()
                ),
            });
        }
        Ok(b)
    }

    /// The size of object `rel`, or `None` if it does not exist.
    pub async fn size(&self, rel: &str) -> Result<Option<u64>> {
        let path = self.path(rel);
        match self.bounded("head", rel, self.inner.head(&path)).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(Error::Missing { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// When object `rel` was last written, in milliseconds since the epoch by the store's
    /// clock, or `None` if it does not exist.
    pub async fn modified(&self, rel: &str) -> Result<Option<i64>> {
        let path = self.path(rel);
        match self.bounded("head", rel, self.inner.head(&path)).await {
            Ok(meta) => Ok(Some(meta.last_modified.timestamp_millis())),
            Err(Error::Missing { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Writes object `rel` (whole).
    pub async fn put(&self, rel: &str, bytes: Bytes) -> Result<()> {
        let path = self.path(rel);
        self.bounded(
            "put",
            rel,
            self.inner.put(&path, PutPayload::from_bytes(bytes)),
        )
        .await
        .map(|_| ())
    }

    /// Writes object `rel` only if it does not exist yet: `Ok(false)` if it did (the
    /// other writer won). Stores without conditional writes fall back to a check first.
    pub async fn put_if_absent(&self, rel: &str, bytes: Bytes) -> Result<bool> {
        let path = self.path(rel);
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        let r = tokio::time::timeout(
            self.timeout,
            self.inner
                .put_opts(&path, PutPayload::from_bytes(bytes.clone()), opts),
        )
        .await;
        match r {
            Ok(Ok(_)) => Ok(true),
            Ok(Err(object_store::Error::AlreadyExists { .. }))
            | Ok(Err(object_store::Error::Precondition { .. })) => Ok(false),
            Ok(Err(object_store::Error::NotImplemented { .. })) => {
                if self.size(rel).await?.is_some() {
                    return Ok(false);
                }
                self.put(rel, bytes).await?;
                Ok(true)
            }
            Ok(Err(e)) => Err(Error::store("put", &self.key(rel), e)),
            Err(_) => Err(Error::Timeout {
                op: "put",
                key: self.key(rel),
                secs: self.timeout.as_secs(),
            }),
        }
    }

    /// A multipart upload of object `rel`.
    pub(crate) async fn put_multipart(
        &self,
        rel: &str,
    ) -> Result<Box<dyn object_store::MultipartUpload>> {
        let path = self.path(rel);
        self.bounded("start upload of", rel, self.inner.put_multipart(&path))
            .await
    }

    /// Deletes object `rel` (no error if it is already gone).
    pub async fn delete(&self, rel: &str) -> Result<()> {
        let path = self.path(rel);
        match self.bounded("delete", rel, self.inner.delete(&path)).await {
            Ok(()) | Err(Error::Missing { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Keys (relative to the prefix) under `rel_dir`.
    pub async fn list(&self, rel_dir: &str) -> Result<Vec<String>> {
        use futures::TryStreamExt;
        let path = self.path(rel_dir);
        let base = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        let metas: Vec<_> = self
            .bounded(
                "list",
                rel_dir,
                self.inner.list(Some(&path)).try_collect::<Vec<_>>(),
            )
            .await?;
        Ok(metas
            .into_iter()
            .map(|m| {
                let k = m.location.to_string();
                k.strip_prefix(&base).map(str::to_string).unwrap_or(k)
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        let o = StoreOptions::default();
        assert!(matches!(
            Store::open("ftp://x/y", &o),
            Err(Error::Config { .. })
        ));
        assert!(matches!(
            Store::open("not a url", &o),
            Err(Error::Config { .. })
        ));
        let s = Store::open("memory://bucket/some/prefix", &o).unwrap();
        assert_eq!(s.key("objects/ab"), "some/prefix/objects/ab");
    }

    /// A local store holds every sandbox's snapshots: its directory is made private to
    /// the service's user, even when it existed readable by all.
    #[test]
    fn a_local_store_is_private() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let d = std::env::temp_dir().join(format!("store-local-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let store = d.join("objects");
        let url = format!("file://{}", store.display());
        Store::open(&url, &StoreOptions::default()).unwrap();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&store), 0o700);
        std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o755)).unwrap();
        Store::open(&url, &StoreOptions::default()).unwrap();
        assert_eq!(mode(&store), 0o700);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[tokio::test]
    async fn put_get_range_and_conditional_put() {
        let s = Store::open("memory://b/p", &StoreOptions::default()).unwrap();
        s.put("a", Bytes::from_static(b"hello world"))
            .await
            .unwrap();
        assert_eq!(&s.get_range("a", 6, 11).await.unwrap()[..], b"world");
        assert!(s.get_range("a", 6, 20).await.is_err());
        assert!(matches!(s.get("nope").await, Err(Error::Missing { .. })));
        assert!(s
            .put_if_absent("c", Bytes::from_static(b"1"))
            .await
            .unwrap());
        assert!(!s
            .put_if_absent("c", Bytes::from_static(b"2"))
            .await
            .unwrap());
        assert_eq!(&s.get("c").await.unwrap()[..], b"1");
        assert_eq!(s.size("c").await.unwrap(), Some(1));
        s.delete("c").await.unwrap();
        s.delete("c").await.unwrap();
        assert_eq!(s.size("c").await.unwrap(), None);
        let mut l = s.list("").await.unwrap();
        l.sort();
        assert_eq!(l, vec!["a".to_string()]);
    }

    #[tokio::test]
    async fn whole_objects_are_bounded_before_they_are_read() {
        let s = Store::open("memory://b/p", &StoreOptions::default()).unwrap();
        s.put("big", Bytes::from(vec![1u8; 2048])).await.unwrap();
        assert_eq!(s.get_max("big", 2048).await.unwrap().len(), 2048);
        let e = s.get_max("big", 2047).await.unwrap_err();
        assert!(
            matches!(
                &e,
                Error::TooLarge {
                    size: 2048,
                    limit: 2047,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("p/big is 2048 bytes"), "{e}");
    }

    /// A manifest over its cap (a faulty or hostile store) is refused on its size, not
    /// read whole first: deleting or opening the snapshot is a clear error.
    #[tokio::test]
    async fn a_manifest_over_its_cap_is_refused_unread() {
        let s = Store::open("memory://b/p", &StoreOptions::default()).unwrap();
        let id = snapshot::SnapshotId([7; 16]);
        let huge = vec![b' '; crate::manifest::MAX_MANIFEST_BYTES + 1];
        s.put(&crate::manifest::manifest_key(id), Bytes::from(huge))
            .await
            .unwrap();
        let e = crate::publish::delete(&s, id).await.unwrap_err();
        assert!(matches!(&e, Error::TooLarge { .. }), "{e}");
    }
}
