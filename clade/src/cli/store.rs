//! `clade store publish|ls|fetcher`, and the fetcher `clade restore --store` starts.
//!
//! A restore from the store runs two processes: the VM process (confined as ever: no
//! network socket) and a fetcher child (`clade store fetcher`, ended with its parent) that
//! reaches the store and fills the local chunk cache the VM process reads.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use store::cache::ChunkCache;
use store::fetcher::FetchClient;
use store::location::StoreOptions;
use store::publish::PublishOptions;
use store::Store;

/// Where the store is.
#[derive(Debug, Args, Clone)]
pub struct StoreArgs {
    /// The object store: s3://BUCKET/PREFIX (AWS environment variables), gs://, az://,
    /// file:///DIR.
    #[arg(long, value_name = "URL", env = "CLADE_STORE")]
    pub store: Option<String>,
    /// An S3-compatible server's endpoint (e.g. http://127.0.0.1:9000).
    #[arg(long, value_name = "URL", env = "CLADE_STORE_ENDPOINT")]
    pub store_endpoint: Option<String>,
    /// The longest one store request may take (seconds, retries included).
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub store_timeout: u64,
}

impl StoreArgs {
    /// Opens the store (an error if none was given).
    pub fn open(&self) -> anyhow::Result<Store> {
        let Some(url) = &self.store else {
            bail!("no object store given (--store URL or CLADE_STORE)");
        };
        Ok(Store::open(url, &self.options())?)
    }

    pub(crate) fn options(&self) -> StoreOptions {
        StoreOptions {
            endpoint: self.store_endpoint.clone(),
            timeout: Duration::from_secs(self.store_timeout.max(1)),
        }
    }

    /// The arguments that give a child process the same store.
    fn child_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(s) = &self.store {
            v.extend(["--store".to_string(), s.clone()]);
        }
        if let Some(e) = &self.store_endpoint {
            v.extend(["--store-endpoint".to_string(), e.clone()]);
        }
        v.extend([
            "--store-timeout".to_string(),
            self.store_timeout.to_string(),
        ]);
        v
    }
}

/// The chunk cache's directory by default: `$CLADE_CACHE_DIR`, else
/// `/var/cache/clade/store` for root, else `$HOME/.cache/clade/store`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CLADE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if nix::unistd::geteuid().is_root() {
        return PathBuf::from("/var/cache/clade/store");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    home.join(".cache/clade/store")
}

#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Publish a snapshot directory to the store (a diff's bases first, each once): its
    /// objects, then its manifest. Prints the snapshot id.
    Publish {
        /// The snapshot directory (`clade snapshot`).
        dir: PathBuf,
        #[command(flatten)]
        store: StoreArgs,
        /// Chunk size of the memory data, in KiB (64 to 65536).
        #[arg(long, value_name = "KIB", default_value_t = 128)]
        chunk_kib: u64,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Delete a published snapshot: its manifest and every object no other snapshot
    /// names (refused while a diff is published on top of it).
    Rm {
        /// The snapshot's id.
        id: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// List the snapshots published in the store.
    Ls {
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Serve a chunk cache to VM processes on a Unix socket, until stopped.
    Fetcher {
        #[command(flatten)]
        store: StoreArgs,
        /// The cache directory (kept across runs).
        #[arg(long, value_name = "DIR")]
        cache: Option<PathBuf>,
        /// The most the cache holds (MiB, or 512M, 4G); least recently used chunks of
        /// snapshots no VM uses are evicted past it.
        #[arg(long, value_name = "SIZE", default_value = "10G", value_parser = super::parse_mem_mib)]
        cache_max: u64,
        /// The Unix socket to serve.
        #[arg(long, value_name = "PATH")]
        socket: PathBuf,
        /// End when the parent process ends.
        #[arg(long)]
        exit_with_parent: bool,
    },
}

pub fn store(cmd: StoreCommand) -> anyhow::Result<u8> {
    match cmd {
        StoreCommand::Publish {
            dir,
            store,
            chunk_kib,
            json,
        } => publish(&dir, &store, chunk_kib, json),
        StoreCommand::Rm { id, store } => {
            let id = store::manifest::parse_snapshot_id(&id)?;
            let rt = runtime()?;
            let s = {
                let _g = rt.enter();
                store.open()?
            };
            let r = rt.block_on(store::publish::delete(&s, id))?;
            eprintln!(
                "deleted {id}: {} objects removed, {} kept (named by other snapshots), {} left \
                 for a later delete (recently published or touched, or named by an unreadable \
                 manifest)",
                r.objects_deleted, r.objects_kept, r.objects_deferred
            );
            Ok(0)
        }
        StoreCommand::Ls { store } => {
            let s = store.open()?;
            let rt = runtime()?;
            let mut ids: Vec<String> = rt
                .block_on(s.list("snapshots"))?
                .into_iter()
                .filter_map(|k| {
                    k.strip_prefix("snapshots/")
                        .and_then(|k| k.strip_suffix(".json"))
                        .map(str::to_string)
                })
                .collect();
            ids.sort();
            for id in ids {
                println!("{id}");
            }
            Ok(0)
        }
        StoreCommand::Fetcher {
            store,
            cache,
            cache_max,
            socket,
            exit_with_parent,
        } => {
            if exit_with_parent {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)?;
            }
            let rt = runtime()?;
            let s = {
                let _g = rt.enter();
                store.open()?
            };
            let cache_dir = cache.unwrap_or_else(default_cache_dir);
            let cache = ChunkCache::new(&cache_dir, s, cache_max.saturating_mul(1 << 20))?;
            let _ = std::fs::remove_file(&socket);
            rt.block_on(async {
                let listener = tokio::net::UnixListener::bind(&socket)
                    .with_context(|| format!("bind {}", socket.display()))?;
                tracing::info!(socket = %socket.display(), cache = %cache_dir.display(), "fetcher serving");
                tokio::select! {
                    _ = store::fetcher::serve(listener, cache) => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
                anyhow::Ok(())
            })?;
            let _ = std::fs::remove_file(&socket);
            Ok(0)
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

fn publish(dir: &Path, store: &StoreArgs, chunk_kib: u64, json: bool) -> anyhow::Result<u8> {
    let rt = runtime()?;
    let s = {
        let _g = rt.enter();
        store.open()?
    };
    let progress = Arc::new(store::publish::Progress::default());
    let options = PublishOptions {
        chunk_size: chunk_kib.saturating_mul(1024),
        progress: Some(progress.clone()),
        ..Default::default()
    };
    let t = Instant::now();
    let files = store::publish::chain_files(dir)?;
    // On a terminal (and without --json): a bar of the memory data published so far.
    let bar = (!json).then(|| super::progress::Bar::bytes("memory data", 0));
    let shown = bar.as_ref().map(|b| b.follow(move || progress.get()));
    let published = rt.block_on(store::publish::publish_chain(&s, &files, &options));
    if let Some(shown) = shown {
        shown.finish(published.is_ok());
    }
    let (m, r) = published?;
    if json {
        println!(
            "{}",
            serde_json::json!({
                "id": m.id,
                "manifest": s.key(&store::manifest::manifest_key(m.snapshot_id())),
                "layers": files.len(),
                "published_now": r.published.len(),
                "bytes_uploaded": r.bytes_uploaded,
                "data_bytes": m.memory.data.size,
                "total_us": t.elapsed().as_micros() as u64,
            })
        );
    } else {
        println!("{}", m.id);
        eprintln!(
            "published {} ({} layer(s), {} published now): {} bytes uploaded, {} bytes of memory data, {:.1} ms",
            s.key(&store::manifest::manifest_key(m.snapshot_id())),
            files.len(),
            r.published.len(),
            r.bytes_uploaded,
            m.memory.data.size,
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    Ok(0)
}

/// A fetcher child process (`clade store fetcher`), ended when dropped.
pub struct FetcherChild {
    child: Child,
    socket: PathBuf,
    _dir: vmm_sys_util::tempdir::TempDir,
}

impl Drop for FetcherChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl FetcherChild {
    /// Starts `clade store fetcher` for `store` with its cache in `cache`, and waits
    /// until it listens.
    pub fn start(store: &StoreArgs, cache: &Path) -> anyhow::Result<FetcherChild> {
        let dir = vmm_sys_util::tempdir::TempDir::new_with_prefix("/tmp/clade-fetcher-")
            .context("temporary directory for the fetcher's socket")?;
        let socket = dir.as_path().join("fetch.sock");
        let exe = std::env::current_exe().context("the clade binary")?;
        let mut cmd = Command::new(exe);
        vmm::host::clean_child(&mut cmd);
        // The fetcher is the one process of a restore that reaches the store, so it keeps
        // the store's credentials: the object store clients read them from the
        // environment only (or from the cloud's metadata service). It is this command's
        // own child, run by the same user, unjailed, and never holds a VM; the VM
        // process (the one a guest that escapes into its VMM has) gets none of them. A
        // service does not start it: `clade serve`'s fetcher is a thread of its own.
        cmd.envs(std::env::vars_os().filter(|(k, _)| {
            let k = k.as_encoded_bytes();
            store::location::CREDENTIAL_ENV_PREFIXES
                .iter()
                .any(|p| k.starts_with(p.as_bytes()))
        }));
        if let Some(home) = std::env::var_os("HOME") {
            // Where GCS's and Azure's clients look for a user's default credentials.
            cmd.env("HOME", home);
        }
        let mut child = cmd
            .args(["store", "fetcher", "--exit-with-parent", "--socket"])
            .arg(&socket)
            .arg("--cache")
            .arg(cache)
            .args(store.child_args())
            .stdin(Stdio::null())
            .spawn()
            .context("starting the fetcher")?;
        let t = Instant::now();
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            if let Some(status) = child.try_wait()? {
                bail!("the fetcher ended at start ({status})");
            }
            if t.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                bail!("the fetcher did not listen within 20 s");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(FetcherChild {
            child,
            socket,
            _dir: dir,
        })
    }

    /// Its socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

/// A published snapshot opened through a fetcher, ready to restore: the prepared
/// snapshot and the directory it is known by.
pub fn open_published(
    fetcher: &Path,
    id: &str,
) -> anyhow::Result<(PathBuf, vmm::PreparedSnapshot, Arc<FetchClient>)> {
    let id = store::manifest::parse_snapshot_id(id)?;
    let client = FetchClient::connect(fetcher, Duration::from_secs(120))?;
    let remote = client.open(id)?;
    let dir = remote.dir().to_path_buf();
    let mut prepared = vmm::PreparedSnapshot::open_with_layers(
        &dir,
        vmm::CpuCheck::default(),
        remote.memory_layers()?,
    )?;
    // The saved state names the disk layer where the publishing host had it; here the
    // chain is in the fetcher's cache.
    match (&remote.disk, prepared.disk().is_some()) {
        (Some(d), true) => prepared.relocate_disk(
            d.layer.clone(),
            Some(store::fetcher::FetcherLayers::sources(Arc::clone(&client))),
        )?,
        (None, true) => bail!(
            "snapshot {id} has a disk, but the fetcher did not provide its layers \
             (a fetcher of an older build?)"
        ),
        (Some(_), false) => bail!("the fetcher gave a disk for snapshot {id}, which has none"),
        (None, false) => {}
    }
    Ok((dir, prepared, client))
}
