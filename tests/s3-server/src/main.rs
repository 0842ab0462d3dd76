//! The S3 server Clade's tests and benchmarks start on loopback: the `s3s-fs` crate's
//! S3 implementation (objects as files under a root directory) served by `s3s`, as the
//! `s3s-fs` binary serves it, but with TCP_NODELAY on every connection. The stock binary
//! leaves Nagle's algorithm on, so the tail of a response larger than a few segments
//! waits for the client's delayed acknowledgement (~40 ms on Linux): a range read of
//! 256 KiB took ~44 ms instead of ~2 ms, which is that server's artifact, not what an S3
//! service costs.
//!
//! It also makes conditional writes atomic. `s3s-fs` checks `If-None-Match: *` (create
//! only if absent) and `If-Match` by looking at the file, then writes it: two requests at
//! once can both pass the check, where S3 lets exactly one succeed. Clade relies on that
//! (`clade serve --store` claims a paused sandbox's pause with a create-if-absent, so that
//! one host resumes it), so this server runs conditional writes one at a time.
//!
//! Usage: clade-test-s3 --host H --port P --access-key K --secret-key S ROOT

use std::path::PathBuf;
use std::sync::Arc;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use s3s::auth::SimpleAuth;
use s3s::service::S3ServiceBuilder;

struct Opt {
    host: String,
    port: u16,
    keys: Option<(String, String)>,
    root: PathBuf,
}

fn parse() -> Result<Opt, String> {
    let mut args = std::env::args().skip(1);
    let (mut host, mut port, mut ak, mut sk, mut root) =
        ("127.0.0.1".to_string(), 8014u16, None, None, None);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--host" => host = val()?,
            "--port" => port = val()?.parse().map_err(|e| format!("--port: {e}"))?,
            "--access-key" => ak = Some(val()?),
            "--secret-key" => sk = Some(val()?),
            "--version" => {
                println!("clade-test-s3 (s3s-fs 0.14.1)");
                std::process::exit(0);
            }
            r if !r.starts_with("--") => root = Some(PathBuf::from(r)),
            other => return Err(format!("unknown option {other}")),
        }
    }
    let keys = match (ak, sk) {
        (Some(a), Some(s)) => Some((a, s)),
        (None, None) => None,
        _ => return Err("--access-key and --secret-key go together".into()),
    };
    Ok(Opt {
        host,
        port,
        keys,
        root: root.ok_or("give the root directory")?,
    })
}

#[tokio::main]
async fn main() {
    let opt = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("clade-test-s3: {e}");
            std::process::exit(2);
        }
    };
    let fs = match s3s_fs::FileSystem::new(&opt.root) {
        Ok(fs) => fs,
        Err(e) => {
            eprintln!("clade-test-s3: {}: {e:?}", opt.root.display());
            std::process::exit(1);
        }
    };
    let mut b = S3ServiceBuilder::new(fs);
    if let Some((ak, sk)) = opt.keys {
        b.set_auth(SimpleAuth::from_single(ak, sk));
    }
    let service = b.build();
    let listener = match tokio::net::TcpListener::bind((opt.host.as_str(), opt.port)).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("clade-test-s3: bind {}:{}: {e}", opt.host, opt.port);
            std::process::exit(1);
        }
    };
    let http = ConnBuilder::new(TokioExecutor::new());
    // Conditional writes (a PUT, or a multipart upload's completing POST, with If-Match or
    // If-None-Match), one at a time.
    let conditional = Arc::new(tokio::sync::Mutex::new(()));
    loop {
        tokio::select! {
            r = listener.accept() => {
                let Ok((socket, _)) = r else { continue };
                let _ = socket.set_nodelay(true);
                let (service, conditional) = (service.clone(), Arc::clone(&conditional));
                let serve = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let (service, conditional) = (service.clone(), Arc::clone(&conditional));
                    async move {
                        let is_write = matches!(*req.method(), hyper::Method::PUT | hyper::Method::POST);
                        let h = req.headers();
                        let _one_at_a_time = if is_write
                            && (h.contains_key(hyper::header::IF_NONE_MATCH) || h.contains_key(hyper::header::IF_MATCH))
                        {
                            Some(conditional.lock_owned().await)
                        } else {
                            None
                        };
                        hyper::service::Service::call(&service, req).await
                    }
                });
                let conn = http.serve_connection(TokioIo::new(socket), serve).into_owned();
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
            _ = tokio::signal::ctrl_c() => break,
        }
    }
}
