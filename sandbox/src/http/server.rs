//! Running the service: [`serve`] listens (plain HTTP or TLS), runs the timeout and
//! metrics sweep beside the router, and stops within [`SHUTDOWN_GRACE`] of its signal.
//! Separate from the routes: this is the listener and its lifetime, not an endpoint.

use std::sync::Arc;

use axum::Router;

use super::{router, tls, AppState};
use crate::ids;

/// Serves the API on `listener` until `shutdown` resolves; applies timeouts and notices
/// crashed VMs every `tick`. `wrap` may put layers around the whole router (a cluster's
/// gateway: see the `cluster` crate).
pub async fn serve(
    listen: Listen,
    state: AppState,
    wrap: impl FnOnce(Router) -> Router,
    tick: std::time::Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let host = state.host.clone();
    let ticker = tokio::spawn(async move {
        let mut iv = tokio::time::interval(tick);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            iv.tick().await;
            let h = host.clone();
            let r = tokio::task::spawn_blocking(move || {
                h.expire(ids::now_ms())?;
                h.reap()?;
                h.sample_metrics()
            })
            .await;
            match r {
                Ok(Err(e)) => tracing::warn!("timeout sweep: {e}"),
                Err(e) => tracing::warn!("timeout sweep: {e}"),
                Ok(Ok(())) => {}
            }
        }
    });
    // Requests in progress get SHUTDOWN_GRACE after the signal; a stream whose client
    // never goes away must not keep the service from stopping.
    let (fired_tx, fired_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown.await;
        let _ = fired_tx.send(());
    };
    let app = wrap(router(state));
    let r = match listen {
        // TCP_NODELAY on every connection: a streamed answer (a command's output, a PTY)
        // goes out chunk by chunk, not held back until the client acknowledges the
        // previous one (Nagle's algorithm, against a client's delayed acknowledgement: up
        // to 40 ms a chunk). The TLS listener sets it too.
        Listen::Http(l) => {
            let l = axum::serve::ListenerExt::tap_io(l, |tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!("TCP_NODELAY on a connection: {e}");
                }
            });
            run_until(l, app, shutdown, fired_rx).await
        }
        Listen::Https(l, cfg) => {
            run_until(tls::TlsListener::new(l, cfg)?, app, shutdown, fired_rx).await
        }
    };
    ticker.abort();
    r
}

/// Where the service listens: plain HTTP, or HTTPS with this TLS configuration
/// ([`tls::server_config`]).
pub enum Listen {
    Http(tokio::net::TcpListener),
    Https(tokio::net::TcpListener, Arc<tls::ServerConfig>),
}

/// Serves `app` on `listener` until `shutdown`, then at most [`SHUTDOWN_GRACE`] more
/// (`fired` says when the signal came).
async fn run_until<L>(
    listener: L,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    fired_rx: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let server = axum::serve(listener, app).with_graceful_shutdown(shutdown);
    let grace = async move {
        match fired_rx.await {
            Ok(()) => tokio::time::sleep(SHUTDOWN_GRACE).await,
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        r = std::future::IntoFuture::into_future(server) => r,
        _ = grace => {
            tracing::warn!("requests still open {SHUTDOWN_GRACE:?} after the stop signal: stopping anyway");
            Ok(())
        }
    }
}

/// How long requests in progress may run on after the service was told to stop.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
