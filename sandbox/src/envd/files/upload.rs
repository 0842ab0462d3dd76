//! `POST /files`: multipart (`file` parts) or an octet-stream body (optionally gzip),
//! each file streamed into the guest on an agent connection of its own, with the
//! metadata of its `X-Metadata-<key>` headers. A signed URL writes exactly its path as its
//! user. A request refused before its body was read has the body drained first
//! ([`drained`]), so that its connection can be reused.

use std::io::Read;
use std::path::Path as FsPath;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Multipart, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use tokio::sync::mpsc;

use super::check_path;
use super::metadata::{meta_map, upload_metadata, META_PREFIX};
use super::transfer::{file_target, http_error, rpc_to_http};
use crate::envd::access::Operation;
use crate::envd::connect::{Code, RpcError};
use crate::envd::{pb, target_sandbox, DataPlane, SandboxConn, Target, User};

/// Most of a refused upload's body read before answering (see [`drained`]).
const DRAIN_MAX: usize = 8 << 20;

/// `answer`, after reading and dropping what is left of `req`'s body (at most
/// [`DRAIN_MAX`] bytes, for at most a second): a server that answers without reading the
/// body closes the connection, and a client that reuses it at that moment sees it closed.
async fn drained(req: Request, answer: Response) -> Response {
    let drain = async {
        let mut left = DRAIN_MAX;
        let mut body = req.into_body().into_data_stream();
        while let Some(Ok(chunk)) = futures_util::StreamExt::next(&mut body).await {
            left = left.saturating_sub(chunk.len());
            if left == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), drain).await;
    answer
}

/// Bytes from the async side, read by a blocking agent upload.
struct ChanReader {
    rx: mpsc::Receiver<Result<Bytes, String>>,
    cur: Bytes,
}

impl Read for ChanReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                None => return Ok(0),
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => return Err(std::io::Error::other(e)),
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        self.cur = self.cur.slice(n..);
        Ok(n)
    }
}

/// One file upload: parents made, bytes streamed in from `rx` (gunzipped if `gzip`).
fn write_one(
    sb: &SandboxConn,
    client: &vmm::agent::Client,
    user: &User,
    path: &FsPath,
    rx: mpsc::Receiver<Result<Bytes, String>>,
    gzip: bool,
    meta: &[(String, Vec<u8>)],
) -> Result<pb::EntryInfo, RpcError> {
    if let Some(parent) = path.parent() {
        client
            .make_dir(parent, 0o755, true)
            .map_err(RpcError::from)?;
    }
    let raw = ChanReader {
        rx,
        cur: Bytes::new(),
    };
    let mut reader: Box<dyn Read> = if gzip {
        Box::new(flate2::read::GzDecoder::new(raw))
    } else {
        Box::new(raw)
    };
    client
        .write_file_from(path, 0o644, &mut reader)
        .map_err(|e| match e {
            vmm::Error::Io { source, .. } => {
                RpcError::new(Code::InvalidArgument, format!("upload body: {source}"))
            }
            e => RpcError::from(e),
        })?;
    // The file's metadata becomes what this upload gave (none: cleared, as envd does
    // for a file overwritten without it).
    match client.set_xattrs(path, META_PREFIX, meta.to_vec()) {
        Ok(()) => {}
        // Nothing to set: an agent without the operation, or a filesystem without
        // extended attributes, has nothing to clear either.
        Err(e) if meta.is_empty() => {
            tracing::debug!(sandbox = %sb.id, "file metadata not cleared: {e}");
        }
        Err(vmm::Error::Agent(e)) if e.kind == vmm::agent::ErrorKind::UnknownMessage => {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                "file metadata needs a newer guest agent: rebuild this sandbox's template",
            ))
        }
        Err(e) => {
            let mut e = RpcError::from(e);
            e.message = format!("file metadata of {}: {}", path.display(), e.message);
            return Err(e);
        }
    }
    let _ = user;
    Ok(pb::EntryInfo {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        r#type: pb::FileType::File as i32,
        path: path.to_string_lossy().into_owned(),
        metadata: meta_map(meta.to_vec()),
        ..Default::default()
    })
}

/// `WriteInfo` of the `/files` answer.
fn write_info(e: &pb::EntryInfo) -> serde_json::Value {
    let mut v = serde_json::json!({"name": e.name, "type": "file", "path": e.path});
    if !e.metadata.is_empty() {
        v["metadata"] = serde_json::json!(e.metadata);
    }
    v
}

/// `POST /files?path=…&username=…`: multipart (`file` parts, each named by its
/// filename when no `path` is given) or an octet-stream body (one file at `path`,
/// `Content-Encoding: gzip` allowed). Answers `[WriteInfo]`.
///
/// A signed URL ([`Grant::Signed`](crate::envd::access::Grant::Signed)) writes exactly
/// its path as its user: as envd, only `file` parts are read, the first goes to the signed
/// path whatever its file name, and a second is refused (400) without being written
/// anywhere; an `Authorization` header does not choose the user.
pub(crate) async fn upload(State(dp): State<Arc<DataPlane>>, req: Request) -> Response {
    let sb = match target_sandbox(&dp, req.extensions().get::<Target>().cloned()).await {
        Ok(s) => s,
        Err(r) => return drained(req, r).await,
    };
    let (qpath, user_name, signed) = match file_target(&req, Operation::Write) {
        Ok(t) => (t.path, t.user, t.signed),
        Err(m) => return drained(req, http_error(StatusCode::UNAUTHORIZED, m)).await,
    };
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let gzip = req
        .headers()
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().eq_ignore_ascii_case("gzip"))
        .unwrap_or(false);
    for p in qpath.iter() {
        if let Err(e) = check_path(p) {
            return drained(req, rpc_to_http(e)).await;
        }
    }
    let meta = match upload_metadata(req.headers()) {
        Ok(m) => Arc::new(m),
        Err(e) => return drained(req, http_error(StatusCode::BAD_REQUEST, e)).await,
    };
    let sb2 = sb.clone();
    let setup = tokio::task::spawn_blocking(move || {
        let user = sb2.user(user_name.as_deref())?;
        let client = sb2.connect_as(&user)?;
        Ok::<_, RpcError>((user, client))
    })
    .await
    .unwrap_or_else(|e| Err(RpcError::new(Code::Internal, format!("worker: {e}"))));
    let (user, client) = match setup {
        Ok(x) => x,
        Err(e) => return drained(req, rpc_to_http(e)).await,
    };
    let mut written = Vec::new();
    if ct.starts_with("multipart/form-data") {
        let mut mp = match Multipart::from_request(req, &()).await {
            Ok(m) => m,
            Err(e) => return http_error(StatusCode::BAD_REQUEST, format!("multipart: {e}")),
        };
        let mut n = 0usize;
        loop {
            let mut field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return http_error(StatusCode::BAD_REQUEST, format!("multipart: {e}")),
            };
            n += 1;
            let target = if signed {
                // As envd: only `file` parts count, each goes to the signed path (its
                // own file name is not looked at), and a second one is refused.
                if field.name() != Some("file") {
                    continue;
                }
                match (&qpath, written.is_empty()) {
                    (Some(p), true) => p.clone(),
                    _ => {
                        return http_error(
                            StatusCode::BAD_REQUEST,
                            format!(
                                "you cannot upload multiple files to the same path '{}' in one \
                                 upload request, only the first specified file was uploaded",
                                qpath.as_deref().unwrap_or_default()
                            ),
                        )
                    }
                }
            } else {
                match (&qpath, field.file_name()) {
                    (Some(p), _) if n == 1 => p.clone(),
                    (_, Some(f)) if !f.is_empty() => f.to_string(),
                    _ => {
                        return http_error(
                            StatusCode::BAD_REQUEST,
                            "a multipart part without a file name (and no path parameter)",
                        )
                    }
                }
            };
            if let Err(e) = check_path(&target) {
                return rpc_to_http(e);
            }
            let path = user.resolve(&target);
            let (tx, rx) = mpsc::channel(8);
            let (sb3, c3, u3, p3) = (sb.clone(), client.clone(), user.clone(), path.clone());
            let m3 = meta.clone();
            let job =
                tokio::task::spawn_blocking(move || write_one(&sb3, &c3, &u3, &p3, rx, false, &m3));
            let mut feed_err = None;
            loop {
                match field.chunk().await {
                    Ok(Some(b)) => {
                        if tx.send(Ok(b)).await.is_err() {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string())).await;
                        feed_err = Some(e.to_string());
                        break;
                    }
                }
            }
            drop(tx);
            match job.await {
                Ok(Ok(e)) if feed_err.is_none() => written.push(e),
                Ok(Ok(_)) => {
                    return http_error(
                        StatusCode::BAD_REQUEST,
                        format!("multipart: {}", feed_err.unwrap_or_default()),
                    )
                }
                Ok(Err(e)) => return rpc_to_http(e),
                Err(e) => return http_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            }
        }
    } else {
        let Some(target) = qpath.filter(|p| !p.is_empty()) else {
            return http_error(StatusCode::BAD_REQUEST, "the path parameter is required");
        };
        let path = user.resolve(&target);
        let (tx, rx) = mpsc::channel(8);
        let (sb3, c3, u3, p3) = (sb.clone(), client.clone(), user.clone(), path.clone());
        let m3 = meta.clone();
        let job =
            tokio::task::spawn_blocking(move || write_one(&sb3, &c3, &u3, &p3, rx, gzip, &m3));
        let mut stream = req.into_body().into_data_stream();
        while let Some(chunk) = stream.next().await {
            let r = chunk.map_err(|e| e.to_string());
            let stop = r.is_err();
            if tx.send(r).await.is_err() || stop {
                break;
            }
        }
        drop(tx);
        match job.await {
            Ok(Ok(e)) => written.push(e),
            Ok(Err(e)) => return rpc_to_http(e),
            Err(e) => return http_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }
    let out: Vec<serde_json::Value> = written.iter().map(write_info).collect();
    axum::Json(out).into_response()
}
