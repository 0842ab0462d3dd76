//! `WatchDir`, the server-streaming watch: the start event, then the directory's events
//! through a bounded channel as a pump thread reads them, keepalives if the client asked
//! for them, until the client goes, its deadline passes or the watch fails. The watch is
//! stopped however the stream ends ([`StopOnDrop`]).

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::HeaderMap;
use axum::response::Response;
use tokio::sync::mpsc;
use vmm::agent::WatchStopper;

use super::watch::{ended, fs_event, open_watch, EventEntries};
use crate::envd::connect::{self, Code, Codec, RpcError};
use crate::envd::{pb, read_body, target_sandbox, DataPlane, Target};

/// Events buffered between a WatchDir stream's pump and its HTTP response.
const WATCH_STREAM_DEPTH: usize = 64;
/// envd's keepalive request header (seconds between keepalive messages).
const KEEPALIVE_HEADER: &str = "keepalive-ping-interval";

/// Stops a watch when the stream that owns it ends, however it ends (on a thread: the
/// stop waits for the agent's answer).
struct StopOnDrop(Option<WatchStopper>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            let _ = std::thread::Builder::new()
                .name("unwatch".into())
                .spawn(move || {
                    let _ = s.stop();
                });
        }
    }
}

fn keepalive_interval(h: &HeaderMap) -> Option<Duration> {
    h.get(KEEPALIVE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
}

/// `WatchDir` (server streaming): the start event once the agent watches, then the
/// directory's events as they come (keepalives in between if the client asked for them),
/// until the client goes, its `Connect-Timeout-Ms` passes (`deadline_exceeded`), or the
/// watch fails (the directory was removed, events were lost).
pub(super) async fn watch_dir(dp: Arc<DataPlane>, req: Request) -> Response {
    let codec = match Codec::from_headers(req.headers(), true) {
        Ok(c) => c,
        Err(e) => return e.unary_response(),
    };
    let sb = match target_sandbox(&dp, req.extensions().get::<Target>().cloned()).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let headers = req.headers().clone();
    let user_name = crate::envd::basic_user(&headers);
    let body = match read_body(req, connect::MAX_MESSAGE + 5).await {
        Ok(b) => b,
        Err(e) => return connect::stream_error(codec, &e),
    };
    let msg: pb::WatchRequest = match connect::unwrap_envelope(&body).and_then(|m| codec.decode(m))
    {
        Ok(m) => m,
        Err(e) => return connect::stream_error(codec, &e),
    };
    let opened = tokio::task::spawn_blocking(move || {
        let user = sb.user(user_name.as_deref())?;
        let entries = EventEntries::of(&sb, &user, &msg);
        open_watch(&sb, &user, &msg).map(|(c, w)| (c, w, entries))
    })
    .await
    .unwrap_or_else(|e| Err(RpcError::new(Code::Internal, format!("worker: {e}"))));
    let (client, mut watch, entries) = match opened {
        Ok(x) => x,
        Err(e) => return connect::stream_error(codec, &e),
    };
    let guard = StopOnDrop(Some(watch.stopper()));
    let (ev_tx, mut ev_rx) =
        mpsc::channel::<Result<pb::FilesystemEvent, RpcError>>(WATCH_STREAM_DEPTH);
    let spawned = std::thread::Builder::new()
        .name("watch-dir".into())
        .spawn(move || {
            let _client = client;
            loop {
                let r = watch.next_event();
                let item = match r {
                    Ok(Some(ev)) => match fs_event(ev) {
                        Ok(Some(mut e)) => {
                            EventEntries::add(&entries, &mut e);
                            Ok(e)
                        }
                        Ok(None) => continue,
                        Err(e) => Err(e),
                    },
                    r => match ended(r) {
                        Some(e) => Err(e),
                        None => return,
                    },
                };
                let last = item.is_err();
                // The stream is gone: dropping the watch stops it.
                if ev_tx.blocking_send(item).is_err() || last {
                    return;
                }
            }
        });
    if let Err(e) = spawned {
        return connect::stream_error(
            codec,
            &RpcError::new(Code::Internal, format!("watch thread: {e}")),
        );
    }
    let keepalive = keepalive_interval(&headers);
    let deadline = connect::timeout(&headers).map(|d| tokio::time::Instant::now() + d);
    let (tx, mut out) = mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    let enc =
        move |e: pb::WatchDirEvent| connect::envelope(&codec.encode(&pb::WatchDirResponse::new(e)));
    tokio::spawn(async move {
        let _guard = guard;
        if tx
            .send(Ok(enc(pb::WatchDirEvent::Start(pb::Empty {}))))
            .await
            .is_err()
        {
            return;
        }
        let far = tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 86400);
        let sleep = tokio::time::sleep_until(deadline.unwrap_or(far));
        tokio::pin!(sleep);
        let period = keepalive.unwrap_or(Duration::from_secs(3600));
        let mut ka = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        let err = loop {
            tokio::select! {
                ev = ev_rx.recv() => match ev {
                    Some(Ok(e)) => {
                        if tx.send(Ok(enc(pb::WatchDirEvent::Filesystem(e)))).await.is_err() {
                            return;
                        }
                        ka.reset();
                    }
                    Some(Err(e)) => break Some(e),
                    None => break None,
                },
                _ = ka.tick(), if keepalive.is_some() => {
                    if tx.send(Ok(enc(pb::WatchDirEvent::Keepalive(pb::Empty {})))).await.is_err() {
                        return;
                    }
                }
                _ = &mut sleep => break Some(RpcError::new(
                    Code::DeadlineExceeded,
                    "the watch's deadline passed",
                )),
                _ = tx.closed() => return,
            }
        };
        let _ = tx.send(Ok(connect::end_envelope(err.as_ref()))).await;
    });
    let body = Body::from_stream(futures_util::stream::poll_fn(move |cx| out.poll_recv(cx)));
    connect::stream_response(codec, body)
}
