//! `GET /files`: a file's bytes streamed out of the guest on an agent connection of its
//! own, gzipped on the fly when `Accept-Encoding` allows it (as envd decides).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use tokio::sync::mpsc;
use vmm::agent::FileKind;

use super::transfer::{file_target, http_error, rpc_to_http};
use super::{check_path, missing};
use crate::envd::access::Operation;
use crate::envd::connect::{Code, RpcError};
use crate::envd::{target_sandbox, DataPlane, Target};

/// Whether a response may be gzipped, by `Accept-Encoding` as envd decides: gzip when
/// listed with a non-zero quality not below identity's, or when identity is refused
/// (`identity;q=0`) and `*` is accepted.
fn accepts_gzip(h: &HeaderMap) -> bool {
    let (mut gzip, mut identity, mut star) = (None, None, None);
    for v in h.get_all(header::ACCEPT_ENCODING) {
        let Ok(v) = v.to_str() else { continue };
        for item in v.split(',') {
            let mut parts = item.split(';');
            let name = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.trim().strip_prefix("q=").or(p.trim().strip_prefix("Q=")))
                .find_map(|q| q.trim().parse::<f32>().ok())
                .unwrap_or(1.0);
            match name.as_str() {
                "gzip" | "x-gzip" => gzip = Some(q),
                "identity" => identity = Some(q),
                "*" => star = Some(q),
                _ => {}
            }
        }
    }
    match gzip {
        Some(q) => q > 0.0 && identity.is_none_or(|i| q >= i),
        None => identity == Some(0.0) && star.is_some_and(|q| q > 0.0),
    }
}

/// `GET /files?path=…&username=…`: the file's bytes, streamed (gzipped on the fly when
/// the client accepts it, at the fastest level: the transfer is local, CPU is the cost).
/// A signed URL reads its signed path as its signed user only ([`file_target`]).
pub(crate) async fn download(State(dp): State<Arc<DataPlane>>, req: Request) -> Response {
    let sb = match target_sandbox(&dp, req.extensions().get::<Target>().cloned()).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let (path, user_name) = match file_target(&req, Operation::Read) {
        Ok(t) => (t.path, t.user),
        Err(m) => return http_error(StatusCode::UNAUTHORIZED, m),
    };
    let gzip = accepts_gzip(req.headers());
    let Some(path) = path.filter(|p| !p.is_empty()) else {
        return http_error(StatusCode::BAD_REQUEST, "the path parameter is required");
    };
    if let Err(e) = check_path(&path) {
        return rpc_to_http(e);
    }
    let sb2 = sb.clone();
    let prep = tokio::task::spawn_blocking(move || {
        let user = sb2.user(user_name.as_deref())?;
        let p = user.resolve(&path);
        let st = sb2
            .with_user(&user, |c| c.stat(&p))
            .map_err(|e| missing(e, &p))?;
        if st.kind == FileKind::Dir {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!("path '{}' is a directory", p.display()),
            ));
        }
        let client = sb2.connect_as(&user)?;
        Ok((p, st.size, client))
    })
    .await
    .unwrap_or_else(|e| Err(RpcError::new(Code::Internal, format!("worker: {e}"))));
    let (p, size, client) = match prep {
        Ok(x) => x,
        Err(e) => return rpc_to_http(e),
    };
    let (tx, mut rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    // How the read began: the status line waits for it, so that a file the agent cannot
    // open (permissions, gone since the stat) is an HTTP error, not a broken body.
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<Result<(), RpcError>>();
    tokio::task::spawn_blocking(move || {
        let w = ChanWriter {
            tx: tx.clone(),
            first: Some(first_tx),
        };
        let (r, first) = if gzip {
            let mut gz = flate2::write::GzEncoder::new(w, flate2::Compression::fast());
            let r = client.read_file_to(&p, &mut gz).and_then(|_| {
                gz.try_finish().map_err(|e| vmm::Error::Io {
                    context: "gzip the download",
                    source: e,
                })
            });
            let first = gz.get_mut().first.take();
            (r.map(drop), first)
        } else {
            let mut w = w;
            let r = client.read_file_to(&p, &mut w).map(drop);
            (r, w.first.take())
        };
        match (r, first) {
            // Nothing was sent yet: the answer is this outcome.
            (r, Some(first)) => {
                let _ = first.send(r.map_err(|e| missing(RpcError::from(e), &p)));
            }
            // The status line is gone: fail the body so the client sees a broken transfer.
            (Err(e), None) => {
                let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
            }
            (Ok(()), None) => {}
        }
    });
    match first_rx.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return rpc_to_http(e),
        Err(_) => return rpc_to_http(RpcError::new(Code::Internal, "the download worker ended")),
    }
    let body = Body::from_stream(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
    let mut r = Response::new(body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    r.headers_mut()
        .insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    if gzip {
        r.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    // Only a hint: the agent streams what the file holds when it reads it.
    let _ = size;
    r
}

struct ChanWriter {
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    /// Told `Ok` at the first bytes (the read began well).
    first: Option<tokio::sync::oneshot::Sender<Result<(), RpcError>>>,
}

impl std::io::Write for ChanWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(first) = self.first.take() {
            let _ = first.send(Ok(()));
        }
        self.tx
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "client went away"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_by_accept_encoding() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::ACCEPT_ENCODING, v.parse().unwrap());
            accepts_gzip(&h)
        };
        assert!(!accepts_gzip(&HeaderMap::new()));
        assert!(with("gzip"));
        assert!(with("gzip, deflate, br"));
        assert!(with("GZIP;q=0.5"));
        assert!(!with("gzip;q=0"));
        assert!(!with("deflate, br"));
        assert!(!with("gzip;q=0.5, identity"));
        assert!(!with("*"));
        assert!(with("identity;q=0, *"));
        // An unparsable quality counts as 1, as envd reads it.
        assert!(with("gzip;q=nonsense;;,,"));
    }
}
