//! `cluster`: what entering a cluster through a node that does not own the sandbox adds.
//!
//! Two `clade serve --cluster` nodes on loopback, on PostgreSQL (Debian's, started here as
//! the unprivileged user `postgres` in a scratch directory) and the tests' S3 server: node
//! `owner` runs the sandboxes, node `gateway` runs none (`--no-sandboxes`) and forwards
//! each request to the owner. Each case is measured both ways, interleaved (so drift hits
//! both alike), and the hop's cost is the difference of the p50s:
//!
//! - **data plane**: envd's `GET /health` of a running sandbox (an agent ping behind it);
//! - **create**: `POST /v2/sandboxes`, until the new sandbox's agent answered a ping;
//! - **wake**: `POST /v2/sandboxes/{id}/connect` of a paused sandbox, until its agent
//!   answered.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde_json::json;
use store::s3server::S3Server;

use crate::error::{Context, Error, Result};
use crate::guest::{probe, Guest, Scratch};
use crate::serve::Service;
use crate::stats::Samples;

/// What to run.
#[derive(Debug, Clone)]
pub struct ClusterParams {
    /// The `clade` executable.
    pub clade: PathBuf,
    /// Samples per case and way.
    pub n: usize,
}

/// One case, both ways.
#[derive(Debug, Default)]
pub struct Hop {
    /// Asked of the owner.
    pub direct: Samples,
    /// Asked of the other node.
    pub via_other_node: Samples,
}

impl Hop {
    /// p50 via the other node minus p50 direct (µs).
    pub fn added_p50_us(&self) -> Option<f64> {
        Some(self.via_other_node.percentile(50.0)? - self.direct.percentile(50.0)?)
    }
}

/// The target of the data plane through another node: the hop adds at most this much to
/// the p50 asked of the owner (us).
pub const HOP_TARGET_P50_US: f64 = 150.0;

/// The three cases.
#[derive(Debug, Default)]
pub struct ClusterReport {
    /// envd's `/health`.
    pub dataplane: Hop,
    /// Create until the agent answers.
    pub create: Hop,
    /// Wake until the agent answers.
    pub wake: Hop,
}

impl ClusterReport {
    /// One JSON object: `direct_p50_us`, `via_other_node_p50_us`, `hop_added_p50_us` (the
    /// data plane), the same with `create_` and `wake_`, and p99s.
    pub fn to_json(&self) -> String {
        let mut o = serde_json::Map::new();
        for (prefix, h) in [
            ("", &self.dataplane),
            ("create_", &self.create),
            ("wake_", &self.wake),
        ] {
            o.insert(
                format!("{prefix}direct_p50_us"),
                json!(h.direct.percentile(50.0)),
            );
            o.insert(
                format!("{prefix}direct_p99_us"),
                json!(h.direct.percentile(99.0)),
            );
            o.insert(
                format!("{prefix}via_other_node_p50_us"),
                json!(h.via_other_node.percentile(50.0)),
            );
            o.insert(
                format!("{prefix}via_other_node_p99_us"),
                json!(h.via_other_node.percentile(99.0)),
            );
            o.insert(format!("{prefix}hop_added_p50_us"), json!(h.added_p50_us()));
            o.insert(format!("{prefix}n"), json!(h.direct.len()));
        }
        serde_json::Value::Object(o).to_string()
    }
}

impl std::fmt::Display for ClusterReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let us = |s: &Samples, p: f64| s.percentile(p).map_or("-".into(), |v| format!("{v:.0}"));
        writeln!(
            f,
            "{:<12} {:>12} {:>12} {:>14} {:>14} {:>12}",
            "cluster", "direct p50", "direct p99", "via other p50", "via other p99", "hop p50"
        )?;
        for (name, h) in [
            ("data plane", &self.dataplane),
            ("create", &self.create),
            ("wake", &self.wake),
        ] {
            writeln!(
                f,
                "{:<12} {:>10}us {:>10}us {:>12}us {:>12}us {:>10}us",
                name,
                us(&h.direct, 50.0),
                us(&h.direct, 99.0),
                us(&h.via_other_node, 50.0),
                us(&h.via_other_node, 99.0),
                h.added_p50_us().map_or("-".into(), |v| format!("{v:+.0}")),
            )?;
        }
        write!(
            f,
            "(n = {} each way; target: the data-plane hop adds <= {HOP_TARGET_P50_US:.0} us at p50)",
            self.dataplane.direct.len()
        )
    }
}

/// PostgreSQL in a scratch directory, as user `postgres`, on loopback; stopped when dropped.
struct Postgres {
    bin: PathBuf,
    data: PathBuf,
    url: String,
    _dir: Scratch,
}

impl Postgres {
    fn start() -> Result<Postgres> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .ok()
            .and_then(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.path().join("bin"))
                    .filter(|b| b.join("initdb").exists())
                    .max()
            })
            .ok_or_else(|| {
                Error::InvalidParams(
                    "PostgreSQL is not installed (/usr/lib/postgresql/*/bin/initdb): apt-get install postgresql-15".into(),
                )
            })?;
        let dir = Scratch::new("pg")?;
        let owned = Command::new("chown")
            .args(["postgres:postgres"])
            .arg(&dir.0)
            .status()
            .map_err(|source| Error::Io {
                what: "chown".into(),
                source,
            })?;
        if !owned.success() {
            return Err(Error::InvalidParams(
                "PostgreSQL runs as user postgres: this needs root and that user".into(),
            ));
        }
        let data = dir.0.join("data");
        let port = free_port()?;
        as_postgres(
            &bin.join("initdb"),
            &["-D", &data.to_string_lossy(), "-U", "clade", "--auth=trust"],
        )?;
        as_postgres(
            &bin.join("pg_ctl"),
            &[
                "-D",
                &data.to_string_lossy(),
                "-l",
                &dir.0.join("log").to_string_lossy(),
                "-w",
                "-o",
                &format!(
                    "-k {} -c listen_addresses=127.0.0.1 -p {port} -c fsync=off",
                    dir.0.display()
                ),
                "start",
            ],
        )?;
        Ok(Postgres {
            bin,
            data,
            url: format!("postgres://clade@127.0.0.1:{port}/postgres"),
            _dir: dir,
        })
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = as_postgres(
            &self.bin.join("pg_ctl"),
            &[
                "-D",
                &self.data.to_string_lossy(),
                "-m",
                "immediate",
                "stop",
            ],
        );
    }
}

fn as_postgres(prog: &Path, args: &[&str]) -> Result<()> {
    let o = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(prog)
        .args(args)
        .output()
        .map_err(|source| Error::Io {
            what: format!("running {}", prog.display()),
            source,
        })?;
    if !o.status.success() {
        return Err(Error::Guest(format!(
            "{}: {}",
            prog.display(),
            String::from_utf8_lossy(&o.stderr).trim()
        )));
    }
    Ok(())
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|source| Error::Io {
        what: "finding a free port".into(),
        source,
    })?;
    Ok(l.local_addr()
        .map_err(|source| Error::Io {
            what: "finding a free port".into(),
            source,
        })?
        .port())
}

/// Runs the benchmark (see the module documentation).
pub fn cluster(guest: &Guest, params: &ClusterParams) -> Result<ClusterReport> {
    if params.n == 0 {
        return Err(Error::InvalidParams("--n must be at least 1".into()));
    }
    let scratch = Scratch::new("cluster")?;
    let pg = Postgres::start().context("starting PostgreSQL")?;
    let s3 = S3Server::start(&scratch.0.join("s3"), "clade")?;
    let mut env: Vec<(&str, String)> = s3.env();
    // The registry and the secret in the environment: a command line is visible to every
    // local user.
    env.push(("CLADE_CLUSTER", pg.url.clone()));
    env.push(("CLADE_CLUSTER_SECRET", "clade-bench-cluster-secret".into()));
    let endpoint = s3.endpoint();
    let node = |name: &str, more: &[&str]| {
        let mut args = vec![
            "--store",
            "s3://clade/cluster",
            "--store-endpoint",
            &endpoint,
            "--node-name",
            name,
            "--net",
            "off",
        ];
        args.extend_from_slice(more);
        Service::start(&params.clade, guest, &args, &env)
    };
    // Room for every sandbox the benchmark runs at once, whatever this machine's CPUs
    // (a node commits no more than its capacity, by default its CPUs).
    let owner = node("owner", &["--capacity-vcpus", "64"]).context("starting node owner")?;
    let gateway = node("gateway", &["--no-sandboxes"]).context("starting node gateway")?;
    let mut r = ClusterReport::default();

    let id = owner.create()?;
    probe(&owner.vsock(&id)).context("the sandbox's agent")?;
    // Both ways warmed (connections pooled, routes cached) before measuring.
    for _ in 0..5 {
        owner.health(&id)?;
        gateway.health(&id)?;
    }
    for _ in 0..params.n {
        let t = Instant::now();
        owner.health(&id)?;
        r.dataplane.direct.push(t.elapsed());
        let t = Instant::now();
        gateway.health(&id)?;
        r.dataplane.via_other_node.push(t.elapsed());
    }
    for i in 0..params.n * 2 {
        let (through, samples) = if i % 2 == 0 {
            (&owner, &mut r.create.direct)
        } else {
            (&gateway, &mut r.create.via_other_node)
        };
        let t = Instant::now();
        let new = through.create()?;
        probe(&owner.vsock(&new)).context("a new sandbox's agent")?;
        samples.push(t.elapsed());
        owner.kill(&new)?;
    }
    for i in 0..params.n * 2 {
        owner.pause(&id)?;
        let (through, samples) = if i % 2 == 0 {
            (&owner, &mut r.wake.direct)
        } else {
            (&gateway, &mut r.wake.via_other_node)
        };
        let t = Instant::now();
        through.connect(&id)?;
        probe(&owner.vsock(&id)).context("a woken sandbox's agent")?;
        samples.push(t.elapsed());
    }
    owner.kill(&id)?;
    drop(gateway);
    drop(owner);
    drop(s3);
    drop(pg);
    Ok(r)
}

impl crate::report::Reported for ClusterReport {
    fn section(&self, scenario: &str) -> crate::report::Section {
        use crate::report::{Headline, Plot, Section, Series, Target};
        let headline = |what: &str, h: &Hop| {
            Headline::new(
                format!("{what} through the other node, p50"),
                h.via_other_node.percentile(50.0),
                "us",
            )
            .against("asked of the owner", h.direct.percentile(50.0))
        };
        let headlines = vec![
            headline("data plane (envd /health)", &self.dataplane).target(Target::AddedAtMost {
                value: HOP_TARGET_P50_US,
            }),
            headline("create until the agent answered", &self.create),
            headline("wake until the agent answered", &self.wake),
        ];
        let plot = |id: &str, title: &str, h: &Hop| {
            Plot::distribution(
                id,
                title,
                vec![
                    Series::measured("via the other node", &h.via_other_node),
                    Series::baseline("direct to the owner", &h.direct),
                ],
            )
        };
        Section::new(
            scenario,
            self.to_string(),
            &self.to_json(),
            vec![
                plot(
                    "dataplane",
                    "Data plane: envd /health (interleaved)",
                    &self.dataplane,
                ),
                plot(
                    "create",
                    "Create until the agent answered (interleaved)",
                    &self.create,
                ),
                plot(
                    "wake",
                    "Wake until the agent answered (interleaved)",
                    &self.wake,
                ),
            ],
        )
        .with_headlines(headlines)
    }
}
