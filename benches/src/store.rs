//! `restore --store` and `pause --store`: snapshots in object storage against the same
//! work done locally, in the same run.
//!
//! * Restore: the native guest's snapshot (with its working set recorded) is published;
//!   then, round by round, a local restore of it, a remote restore with a cold cache (a
//!   new cache and fetcher: nothing of the snapshot local) and one with a warm cache
//!   (chunks already fetched). Each is timed from opening the snapshot (the fetcher's
//!   `open` for a remote one: manifest, state file, memory header) until the guest
//!   answered its first ping; each restores into a pre-built VM shell, as a service does.
//!   The fetcher runs on a thread of the benchmark's process and is reached through its
//!   Unix socket, as a VM process reaches a fetcher process.
//! * Pause: the guest is paused and snapshotted, and the snapshot published, until it is
//!   durable (its manifest written); per MiB of memory data, against uploading as many
//!   bytes straight to the same store (same part size and concurrency) in the same run.
//!
//! Without a store URL (`s3`), both start the S3 server the tests use (s3s-fs on
//! loopback).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use store::cache::ChunkCache;
use store::fetcher::{FetchClient, FetcherThread};
use store::location::StoreOptions;
use store::publish::{publish, upload_bytes, PublishOptions, SnapshotFiles};
use store::s3server::S3Server;
use store::Store;
use vmm::{MemoryBackend, PreparedSnapshot, ShellPool, SnapshotKind};

use crate::error::{Context, Error, Result};
use crate::guest::{boot_until, Guest, Machine, Scratch};
use crate::noise::{HostNoise, NOISE_TRIES};
use crate::restore::{filled_then_serving, pin_vmm_threads, BackendRun, Resume};
use crate::stats::{pct_u64, r1, Samples};

/// Where the benchmark's store is.
#[derive(Debug, Clone)]
pub enum StoreTarget {
    /// The S3 server the tests use, started for the run.
    LocalS3,
    /// A store URL (`s3://bucket/prefix`, …), reached with the usual environment.
    Url(String),
}

impl StoreTarget {
    /// `s3` (or empty): a local S3 server; anything else: a URL.
    pub fn parse(s: &str) -> StoreTarget {
        match s {
            "" | "s3" | "local" => StoreTarget::LocalS3,
            url => StoreTarget::Url(url.to_string()),
        }
    }
}

/// A store for the run, and the server behind it when the run started one.
struct RunStore {
    server: Option<S3Server>,
    url: Option<String>,
    prefix: String,
}

impl RunStore {
    fn new(target: &StoreTarget, scratch: &Path) -> Result<RunStore> {
        let prefix = format!("clade-bench-{}", vmm::SnapshotId::random());
        Ok(match target {
            StoreTarget::LocalS3 => RunStore {
                server: Some(S3Server::start(&scratch.join("s3"), "bench")?),
                url: None,
                prefix,
            },
            StoreTarget::Url(u) => RunStore {
                server: None,
                url: Some(u.clone()),
                prefix,
            },
        })
    }

    /// A new client (one per runtime), under this run's prefix and `sub`.
    fn open(&self, sub: &str) -> Result<Store> {
        let timeout = Duration::from_secs(30);
        match (&self.server, &self.url) {
            (Some(s), _) => Ok(s.store("bench", &format!("{}/{sub}", self.prefix), timeout)?),
            (None, Some(u)) => Ok(Store::open(
                &format!("{}/{}/{sub}", u.trim_end_matches('/'), self.prefix),
                &StoreOptions {
                    timeout,
                    ..StoreOptions::default()
                },
            )?),
            (None, None) => Err(Error::InvalidParams("no store".into())),
        }
    }

    fn describe(&self) -> String {
        match (&self.server, &self.url) {
            (Some(s), _) => format!("s3s-fs at {}", s.endpoint()),
            (_, Some(u)) => u.clone(),
            _ => String::new(),
        }
    }
}

/// A ratio rounded to two decimals.
fn ratio2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime")
}

fn files(dir: &Path) -> SnapshotFiles {
    let ws = dir.join(vmm::WORKING_SET_FILE);
    SnapshotFiles {
        state: dir.join(vmm::STATE_FILE),
        memory: dir.join(vmm::MEMORY_FILE),
        working_set: ws.exists().then_some(ws),
        disk: None,
    }
}

/// What `restore --store` measures.
#[derive(Debug, Clone)]
pub struct StoreRestoreParams {
    /// The store.
    pub target: StoreTarget,
    /// Rounds (each: local, cold, warm).
    pub n: usize,
    /// Percentage of the memory above 64 MiB the guest fills before the snapshot.
    pub fill_pct: u32,
    /// Chunk size of the published memory data, bytes.
    pub chunk_size: u64,
}

/// What `restore --store` reports.
#[derive(Debug, Clone)]
pub struct StoreRestoreReport {
    machine: Machine,
    store: String,
    chunk_size: u64,
    data_bytes: u64,
    working_set_bytes: u64,
    local: Samples,
    cold: Samples,
    warm: Samples,
    cold_open: Samples,
    local_open: Samples,
    warm_open: Samples,
    cold_bytes: Vec<u64>,
    cold_requests: Vec<u64>,
    noise: HostNoise,
}

/// One remote open: connect to the fetcher, open the snapshot through it.
fn open_remote(socket: &Path, id: vmm::SnapshotId) -> Result<(PreparedSnapshot, Arc<FetchClient>)> {
    let client = FetchClient::connect(socket, Duration::from_secs(60))?;
    let remote = client.open(id)?;
    let snap = PreparedSnapshot::open_with_layers(
        remote.dir(),
        Default::default(),
        remote.memory_layers()?,
    )?;
    Ok((snap, client))
}

/// Drops the snapshot from a cache, once the last client's lease is given back (the
/// fetcher sees its connection close a moment after the client is dropped).
fn forget(cache: &Arc<ChunkCache>, id: vmm::SnapshotId) -> Result<()> {
    let t = Instant::now();
    loop {
        match cache.forget(id) {
            Ok(_) => return Ok(()),
            Err(_) if t.elapsed() < Duration::from_secs(5) => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Boots the guest, snapshots it, records its working set, publishes it, and measures
/// local, cold and warm restores round by round.
pub fn restore_store(
    guest: &Guest,
    machine: &Machine,
    params: &StoreRestoreParams,
) -> Result<StoreRestoreReport> {
    if params.n == 0 {
        return Err(Error::InvalidParams("-n must be at least 1".into()));
    }
    let scratch = Scratch::new("restore-store")?;
    // The store's server and the fetchers start before the VMM's threads are pinned: they
    // stand for other processes, which the pinning would put on the VMM's CPU.
    let rs = RunStore::new(&params.target, &scratch.0)?;
    let fetcher = |name: &str| -> Result<FetcherThread> {
        Ok(FetcherThread::start(
            &scratch.0.join(format!("{name}.sock")),
            ChunkCache::new(
                &scratch.0.join(format!("{name}-cache")),
                rs.open("snapshots")?,
                1 << 40,
            )?,
        )?)
    };
    let warm_fetcher = fetcher("warm")?;
    let cold_fetcher = fetcher("cold")?;
    let (_pin, vcpu_cpus) = pin_vmm_threads()?;
    let dir = scratch.0.join("snap");
    let sock = scratch.0.join("v.sock");
    let (_, steps) = filled_then_serving(machine, params.fill_pct);
    let mut vm = boot_until(guest, machine, &steps, Some(&sock), "serving agent port")?;
    vmm::snapshot(&mut vm, &dir, SnapshotKind::Full)?;
    vm.shutdown();
    drop(vm);
    let pool = ShellPool::new(machine.shell_spec(), 2)?;
    let resume = |snap: &PreparedSnapshot, i: usize, run: &mut BackendRun| {
        Resume {
            snap,
            sock: &sock,
            backend: MemoryBackend::Uffd,
            pool: Some(&pool),
            prefill: false,
            vcpu_cpus: &vcpu_cpus,
            net: None,
        }
        .once(i, run)
    };
    // The first restore records the working set, which is published with the snapshot.
    {
        let snap = PreparedSnapshot::open(&dir, Default::default())?;
        resume(&snap, 0, &mut BackendRun::new(MemoryBackend::Uffd))?;
    }
    let options = PublishOptions {
        chunk_size: params.chunk_size,
        ..PublishOptions::default()
    };
    let rt = runtime()?;
    let publish_store = {
        let _g = rt.enter();
        rs.open("snapshots")?
    };
    let (manifest, _) = rt
        .block_on(publish(&publish_store, &files(&dir), &options))
        .context("publishing the snapshot")?;
    let id = manifest.snapshot_id();
    let working_set_bytes = match &manifest.working_set {
        Some(_) => {
            let ws = snapshot::working_set::WorkingSet::load(
                &dir.join(vmm::WORKING_SET_FILE),
                id,
                manifest.pages(),
            )
            .map_err(|e| Error::Guest(format!("the recorded working set: {e}")))?;
            ws.pages.len() as u64 * 4096
        }
        None => {
            return Err(Error::Guest(
                "the first restore recorded no working set".into(),
            ))
        }
    };

    // The warm cache: filled by one untimed restore.
    {
        let (snap, _c) = open_remote(warm_fetcher.socket(), id)?;
        resume(&snap, 1, &mut BackendRun::new(MemoryBackend::Uffd))?;
    }
    let (mut local, mut cold, mut warm, mut cold_open) = (
        Samples::new(),
        Samples::new(),
        Samples::new(),
        Samples::new(),
    );
    let (mut cold_bytes, mut cold_requests) = (Vec::new(), Vec::new());
    let (mut local_open, mut warm_open) = (Samples::new(), Samples::new());
    for i in 0..params.n {
        // Local.
        let mut run = BackendRun::new(MemoryBackend::Uffd);
        let t = Instant::now();
        let snap = PreparedSnapshot::open(&dir, Default::default())?;
        let opened = t.elapsed();
        local_open.push(opened);
        resume(&snap, i + 1, &mut run)?;
        local.push(opened + Duration::from_secs_f64(run.samples.values()[0] / 1e6));
        drop(snap);

        // Cold: nothing of the snapshot in the cache (dropped after the last round), a
        // fetcher that has been running (its connections to the store open, as a host's).
        forget(cold_fetcher.cache(), id)?;
        let before = cold_fetcher.cache().stats();
        let mut run = BackendRun::new(MemoryBackend::Uffd);
        let t = Instant::now();
        let (snap, client) = open_remote(cold_fetcher.socket(), id)
            .context_with(|| format!("cold remote open {i}"))?;
        let opened = t.elapsed();
        resume(&snap, i + 1, &mut run).context_with(|| format!("cold remote restore {i}"))?;
        cold.push(opened + Duration::from_secs_f64(run.samples.values()[0] / 1e6));
        cold_open.push(opened);
        let st = cold_fetcher.cache().stats();
        cold_bytes.push(st.bytes_fetched - before.bytes_fetched);
        cold_requests.push(st.requests - before.requests);
        drop((snap, client));

        // Warm.
        let mut run = BackendRun::new(MemoryBackend::Uffd);
        let t = Instant::now();
        let (snap, client) = open_remote(warm_fetcher.socket(), id)?;
        let opened = t.elapsed();
        warm_open.push(opened);
        resume(&snap, i + 1, &mut run).context_with(|| format!("warm remote restore {i}"))?;
        warm.push(opened + Duration::from_secs_f64(run.samples.values()[0] / 1e6));
        drop((snap, client));
    }
    Ok(StoreRestoreReport {
        machine: machine.clone(),
        store: rs.describe(),
        chunk_size: params.chunk_size,
        data_bytes: manifest.memory.data.size,
        working_set_bytes,
        local,
        cold,
        warm,
        cold_open,
        local_open,
        warm_open,
        cold_bytes,
        cold_requests,
        noise: HostNoise::measure(NOISE_TRIES),
    })
}

impl StoreRestoreReport {
    /// The report as one JSON object.
    pub fn to_json(&self) -> String {
        let (l, c, w) = (
            self.local.summary("local"),
            self.cold.summary("cold"),
            self.warm.summary("warm"),
        );
        json!({
            "store": self.store,
            "mem_mib": self.machine.mem_mib,
            "vcpus": self.machine.vcpus,
            "n": l.n,
            "chunk_kib": self.chunk_size / 1024,
            "data_bytes": self.data_bytes,
            "working_set_bytes": self.working_set_bytes,
            "local_p50_us": r1(l.p50_us),
            "local_p99_us": r1(l.p99_us),
            "remote_cold_p50_us": r1(c.p50_us),
            "remote_cold_p99_us": r1(c.p99_us),
            "remote_cold_open_p50_us": r1(self.cold_open.summary("open").p50_us),
            "local_open_p50_us": r1(self.local_open.summary("open").p50_us),
            "remote_warm_open_p50_us": r1(self.warm_open.summary("open").p50_us),
            "remote_warm_p50_us": r1(w.p50_us),
            "remote_warm_p99_us": r1(w.p99_us),
            "cold_over_local_p50": ratio2(c.p50_us / l.p50_us),
            "warm_over_local_p50": ratio2(w.p50_us / l.p50_us),
            "cold_bytes_fetched_p50": pct_u64(&self.cold_bytes, 50.0),
            "cold_requests_p50": pct_u64(&self.cold_requests, 50.0),
            "cold_bytes_over_working_set": ratio2(pct_u64(&self.cold_bytes, 50.0) as f64 / self.working_set_bytes.max(1) as f64),
            "noise": self.noise.to_json(),
        })
        .to_string()
    }
}

impl std::fmt::Display for StoreRestoreReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (l, c, w) = (
            self.local.summary("local"),
            self.cold.summary("cold"),
            self.warm.summary("warm"),
        );
        writeln!(
            f,
            "restore from the store ({}), {} MiB guest, {} KiB chunks, {} KiB of memory data, working set {} KiB; open → first ping, {} rounds:",
            self.store,
            self.machine.mem_mib,
            self.chunk_size / 1024,
            self.data_bytes / 1024,
            self.working_set_bytes / 1024,
            l.n
        )?;
        writeln!(
            f,
            "  local        p50 {:>8.1} us  p99 {:>8.1} us  (open {:.1} us)",
            l.p50_us,
            l.p99_us,
            self.local_open.summary("open").p50_us
        )?;
        writeln!(
            f,
            "  remote cold  p50 {:>8.1} us  p99 {:>8.1} us  ({:.2}x local; open {:.1} us; {} KiB in {} requests)",
            c.p50_us,
            c.p99_us,
            c.p50_us / l.p50_us,
            self.cold_open.summary("open").p50_us,
            pct_u64(&self.cold_bytes, 50.0) / 1024,
            pct_u64(&self.cold_requests, 50.0)
        )?;
        writeln!(
            f,
            "  remote warm  p50 {:>8.1} us  p99 {:>8.1} us  ({:.2}x local; open {:.1} us)",
            w.p50_us,
            w.p99_us,
            w.p50_us / l.p50_us,
            self.warm_open.summary("open").p50_us
        )?;
        write!(f, "  {}", self.noise)
    }
}

/// What `pause --store` measures.
#[derive(Debug, Clone)]
pub struct StorePauseParams {
    /// The store.
    pub target: StoreTarget,
    /// Rounds.
    pub n: usize,
    /// Percentage of the memory above 64 MiB the guest fills.
    pub fill_pct: u32,
}

/// What `pause --store` reports.
#[derive(Debug, Clone)]
pub struct StorePauseReport {
    machine: Machine,
    store: String,
    data_bytes: Vec<u64>,
    durable: Samples,
    snapshot: Samples,
    raw: Samples,
}

/// Boots the guest and, `n` times: snapshot + publish (timed until durable), and a raw
/// upload of as many bytes.
pub fn pause_store(
    guest: &Guest,
    machine: &Machine,
    params: &StorePauseParams,
) -> Result<StorePauseReport> {
    if params.n == 0 {
        return Err(Error::InvalidParams("-n must be at least 1".into()));
    }
    let scratch = Scratch::new("pause-store")?;
    let sock = scratch.0.join("v.sock");
    let (_, steps) = filled_then_serving(machine, params.fill_pct);
    let mut vm = boot_until(guest, machine, &steps, Some(&sock), "serving agent port")?;
    let rs = RunStore::new(&params.target, &scratch.0)?;
    let rt = runtime()?;
    let options = PublishOptions::default();
    let (mut durable, mut snapshot, mut raw) = (Samples::new(), Samples::new(), Samples::new());
    let mut data_bytes = Vec::new();
    for i in 0..params.n {
        // Each round under a prefix of its own: nothing is found already uploaded.
        let st = rs.open(&format!("pause-{i}"))?;
        let dir = scratch.0.join(format!("snap-{i}"));
        let t = Instant::now();
        vmm::snapshot(&mut vm, &dir, SnapshotKind::Full)?;
        let snapped = t.elapsed();
        let (_, report) = rt
            .block_on(publish(&st, &files(&dir), &options))
            .context_with(|| format!("publishing snapshot {i}"))?;
        durable.push(t.elapsed());
        snapshot.push(snapped);
        data_bytes.push(report.data_bytes);
        let _ = std::fs::remove_dir_all(&dir);
        // The same number of bytes, straight to the store.
        let bytes = bytes::Bytes::from(vec![i as u8 ^ 0x5a; report.data_bytes as usize]);
        let t = Instant::now();
        rt.block_on(upload_bytes(&st, "raw/upload", bytes, &options))
            .context_with(|| format!("raw upload {i}"))?;
        raw.push(t.elapsed());
    }
    vm.shutdown();
    Ok(StorePauseReport {
        machine: machine.clone(),
        store: rs.describe(),
        data_bytes,
        durable,
        snapshot,
        raw,
    })
}

impl StorePauseReport {
    fn rates(&self) -> (f64, f64) {
        let mib = pct_u64(&self.data_bytes, 50.0) as f64 / f64::from(1u32 << 20);
        let d = self.durable.summary("d").p50_us / 1e6;
        let r = self.raw.summary("r").p50_us / 1e6;
        (mib / d, mib / r)
    }

    /// The report as one JSON object.
    pub fn to_json(&self) -> String {
        let (durable, raw) = self.rates();
        let d = self.durable.summary("durable");
        json!({
            "store": self.store,
            "mem_mib": self.machine.mem_mib,
            "n": d.n,
            "data_mib": r1(pct_u64(&self.data_bytes, 50.0) as f64 / f64::from(1u32 << 20)),
            "pause_to_durable_p50_us": r1(d.p50_us),
            "snapshot_p50_us": r1(self.snapshot.summary("s").p50_us),
            "raw_upload_p50_us": r1(self.raw.summary("r").p50_us),
            "durable_mib_per_s": r1(durable),
            "raw_upload_mib_per_s": r1(raw),
            "durable_over_raw": ratio2(durable / raw),
        })
        .to_string()
    }
}

impl std::fmt::Display for StorePauseReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (durable, raw) = self.rates();
        let d = self.durable.summary("durable");
        write!(
            f,
            "pause until durable ({}), {} MiB guest, {:.1} MiB of memory data, {} rounds: p50 {:.1} ms (snapshot {:.1} ms) = {:.1} MiB/s; raw upload {:.1} MiB/s ({:.0} %)",
            self.store,
            self.machine.mem_mib,
            pct_u64(&self.data_bytes, 50.0) as f64 / f64::from(1u32 << 20),
            d.n,
            d.p50_us / 1e3,
            self.snapshot.summary("s").p50_us / 1e3,
            durable,
            raw,
            durable / raw * 100.0
        )
    }
}

impl crate::report::Reported for StoreRestoreReport {
    fn section(&self, scenario: &str) -> crate::report::Section {
        use crate::report::{Headline, Plot, Section, Series};
        let local = self.local.percentile(50.0);
        let headline = |cache: &str, s: &Samples| {
            Headline::new(
                format!("restore from the store until the first ping, p50, {cache} cache"),
                s.percentile(50.0),
                "us",
            )
            .against("local restore", local)
        };
        let headlines = vec![headline("cold", &self.cold), headline("warm", &self.warm)];
        Section::new(
            scenario,
            self.to_string(),
            &self.to_json(),
            vec![
                Plot::distribution(
                    "restore",
                    "Restore from the object store until the first answered ping",
                    vec![
                        Series::measured("cold cache", &self.cold),
                        Series::measured("warm cache", &self.warm),
                        Series::baseline("local restore (baseline)", &self.local),
                    ],
                ),
                self.noise.plot(),
            ],
        )
        .with_headlines(headlines)
    }
}

impl crate::report::Reported for StorePauseReport {
    fn section(&self, scenario: &str) -> crate::report::Section {
        use crate::report::{Headline, Plot, Section, Series};
        let (durable, raw) = self.rates();
        let headlines = vec![
            Headline::new("pause until durable, p50", Some(durable), "MiB/s")
                .against("raw upload of as many bytes", Some(raw)),
        ];
        Section::new(
            scenario,
            self.to_string(),
            &self.to_json(),
            vec![Plot::distribution(
                "durable",
                "Pause until durable in the object store",
                vec![
                    Series::measured("snapshot + publish", &self.durable),
                    Series::baseline("snapshot alone", &self.snapshot),
                    Series::baseline("raw upload of as many bytes (baseline)", &self.raw),
                ],
            )],
        )
        .with_headlines(headlines)
    }
}
