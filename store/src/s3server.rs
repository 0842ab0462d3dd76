//! A real S3-compatible server on loopback, for tests and benchmarks that have no bucket
//! of their own: `tests/s3-server` (the `s3s-fs` crate's S3 implementation, served with
//! TCP_NODELAY; `scripts/setup.sh` builds it into `build/tools/bin/clade-test-s3`),
//! started as a child process on a free port with its data in a directory of its own,
//! and stopped (its data removed) when dropped.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::location::StoreOptions;
use crate::{Error, Result, Store};

/// Access key the server is started with.
pub const ACCESS_KEY: &str = "clade-test";
/// Secret key the server is started with.
pub const SECRET_KEY: &str = "clade-test-secret";

/// A running S3 server.
#[derive(Debug)]
pub struct S3Server {
    child: Child,
    root: PathBuf,
    port: u16,
}

/// Starts the server binary on `port` with its data under `root`.
fn spawn(root: &Path, port: u16) -> Result<Child> {
    let bin = server_binary().ok_or_else(|| Error::Config {
        url: "clade-test-s3".into(),
        reason: "no S3 server binary: run scripts/setup.sh (builds build/tools/bin/clade-test-s3) or set CLADE_S3_SERVER".into(),
    })?;
    Command::new(&bin)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
        .arg(root)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| Error::io("start", &bin, e))
}

/// Where the server binary is: `$CLADE_S3_SERVER`, else `build/tools/bin/clade-test-s3`
/// above the current directory or the running executable.
pub fn server_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CLADE_S3_SERVER") {
        return Some(PathBuf::from(p));
    }
    let mut starts: Vec<PathBuf> = Vec::new();
    starts.extend(std::env::current_dir().ok());
    starts.extend(std::env::current_exe().ok());
    starts.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    for s in starts {
        for dir in s.ancestors() {
            let p = dir.join("build/tools/bin/clade-test-s3");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

impl S3Server {
    /// Starts a server with its data under `root` (created; removed on drop) and one
    /// bucket, `bucket`.
    pub fn start(root: &Path, bucket: &str) -> Result<S3Server> {
        std::fs::create_dir_all(root.join(bucket)).map_err(|e| Error::io("create", root, e))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| Error::io("pick a port", root, e))?
            .port();
        let child = spawn(root, port)?;
        let mut server = S3Server {
            child,
            root: root.to_path_buf(),
            port,
        };
        server.wait_listening()?;
        Ok(server)
    }

    /// Starts the server again after [`S3Server::kill`]: the same data, the same port.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.child = spawn(&self.root, self.port)?;
        self.wait_listening()
    }

    fn wait_listening(&mut self) -> Result<()> {
        let t = Instant::now();
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(Error::Config {
                    url: self.endpoint(),
                    reason: format!("the S3 server exited at start: {status}"),
                });
            }
            if t.elapsed() > Duration::from_secs(20) {
                return Err(Error::Config {
                    url: self.endpoint(),
                    reason: "the S3 server did not listen within 20 s".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Its endpoint URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The environment a client needs (credentials and region), as pairs.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.to_string()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.to_string()),
            ("AWS_REGION", "us-east-1".to_string()),
            ("CLADE_STORE_ENDPOINT", self.endpoint()),
        ]
    }

    /// A [`Store`] on `bucket/prefix` of this server, with explicit credentials (no
    /// environment needed).
    pub fn store(&self, bucket: &str, prefix: &str, timeout: Duration) -> Result<Store> {
        Store::open_s3_with_keys(
            bucket,
            prefix,
            &StoreOptions {
                endpoint: Some(self.endpoint()),
                timeout,
            },
            ACCESS_KEY,
            SECRET_KEY,
        )
    }

    /// Stops the server (as a crash would: SIGKILL), keeping its data.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
