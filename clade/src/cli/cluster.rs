//! `clade serve --cluster URL` (this node joins a cluster: see the `clade-cluster` crate)
//! and `clade node ls|drain` (the cluster's nodes, as its registry has them).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clade_cluster::{Node, NodeConfig};
use clap::{Args, Subcommand};

/// The cluster's registry, a PostgreSQL database (postgres://user:password@host:port/db):
/// its URL holds a password, so it is taken from the environment or a file as well as
/// from the command line (where `ps` shows it to every local user).
#[derive(Debug, Args, Clone)]
#[group(id = "registry", multiple = true)]
pub struct RegistryArgs {
    /// Join (or, for `clade node`, read) the cluster whose registry is this PostgreSQL
    /// database (postgres://user:password@host:port/db); without it `clade serve` is one
    /// host with its own registry (SQLite). Prefer CLADE_CLUSTER or --cluster-file: a
    /// command line is visible to every local user.
    #[arg(
        long,
        value_name = "URL",
        env = "CLADE_CLUSTER",
        hide_env_values = true
    )]
    cluster: Option<String>,
    /// Read the registry's URL from this file (its first line).
    #[arg(long, value_name = "FILE")]
    cluster_file: Option<PathBuf>,
}

impl RegistryArgs {
    /// The registry's URL, if one was given (an error if given twice).
    pub fn url(&self) -> anyhow::Result<Option<String>> {
        match (&self.cluster, &self.cluster_file) {
            (Some(u), None) => Ok(Some(u.clone())),
            (None, Some(f)) => Ok(Some(super::secret_file(f)?)),
            (None, None) => Ok(None),
            (Some(_), Some(_)) => {
                bail!(
                    "the registry is given twice: --cluster (or CLADE_CLUSTER) and --cluster-file"
                )
            }
        }
    }

    /// [`Self::url`], which must be given.
    fn required(&self) -> anyhow::Result<String> {
        self.url()?.context(
            "no cluster registry given (--cluster-file FILE, CLADE_CLUSTER or --cluster URL)",
        )
    }
}

/// `clade serve`'s cluster options.
#[derive(Debug, Args)]
pub struct ClusterArgs {
    // Join a cluster whose registry is this PostgreSQL database. Without it the service
    // is one host with its own registry (SQLite).
    #[command(flatten)]
    registry: RegistryArgs,
    /// This node's name (default: the machine's host name).
    #[arg(long, value_name = "NAME", requires = "registry")]
    node_name: Option<String>,
    /// Where other nodes reach this one: https://HOST:PORT (default: --listen, https://
    /// with --tls-cert, else http://).
    #[arg(long, value_name = "URL", requires = "registry")]
    advertise: Option<String>,
    /// The cluster CA (PEM): every node's certificate (its --tls-cert) is verified to it
    /// when a request hops to it over https://.
    #[arg(
        long,
        value_name = "FILE",
        env = "CLADE_CLUSTER_CA",
        requires = "registry"
    )]
    cluster_ca: Option<PathBuf>,
    /// Allow http:// node addresses that are not loopback: the cluster secret and the API
    /// key then cross the network in clear text (only for a network private by other
    /// means).
    #[arg(long, requires = "registry")]
    cluster_plain_http: bool,
    /// The secret every request between nodes carries (at least 16 characters).
    #[arg(
        long,
        env = "CLADE_CLUSTER_SECRET",
        hide_env_values = true,
        conflicts_with = "cluster_secret_file"
    )]
    cluster_secret: Option<String>,
    /// The cluster secret's file (its first line).
    #[arg(long, value_name = "FILE")]
    cluster_secret_file: Option<PathBuf>,
    /// vCPUs this node may commit to running sandboxes (default: its CPUs).
    #[arg(long, value_name = "N", requires = "registry")]
    capacity_vcpus: Option<u32>,
    /// Memory (MiB) this node may commit to running sandboxes (default: its memory).
    #[arg(long, value_name = "MIB", requires = "registry")]
    capacity_mem: Option<u64>,
    /// Run no sandboxes: a gateway that forwards every sandbox's requests.
    #[arg(long, requires = "registry")]
    no_sandboxes: bool,
    /// The node's lease (ms): renewed every third of it; a node that misses it loses the
    /// right to act on its sandboxes.
    #[arg(long, value_name = "MS", default_value_t = 5000, requires = "registry")]
    lease_ms: u64,
}

impl ClusterArgs {
    /// The node to join as, if --cluster was given (connects to the registry).
    pub fn node(
        &self,
        listen: &str,
        https: bool,
        api_key: &str,
    ) -> anyhow::Result<Option<Arc<Node>>> {
        let Some(url) = self.registry.url()? else {
            return Ok(None);
        };
        let secret = match (&self.cluster_secret, &self.cluster_secret_file) {
            (Some(s), None) => s.clone(),
            (None, Some(f)) => super::secret_file(f)?,
            _ => bail!("--cluster needs --cluster-secret (or CLADE_CLUSTER_SECRET) or --cluster-secret-file"),
        };
        let name = match &self.node_name {
            Some(n) => n.clone(),
            None => nix::unistd::gethostname()
                .context("reading the host name (give --node-name)")?
                .to_string_lossy()
                .into_owned(),
        };
        let address = match &self.advertise {
            Some(a) => a.trim_end_matches('/').to_string(),
            None => {
                if listen.starts_with("0.0.0.0") || listen.starts_with("[::]") {
                    bail!("--listen {listen} is every address: give --advertise https://HOST:PORT");
                }
                format!("{}://{listen}", if https { "https" } else { "http" })
            }
        };
        let sys = nix::sys::sysinfo::sysinfo().context("reading the machine's memory")?;
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        let cfg = NodeConfig {
            url,
            name,
            address,
            ca: self.cluster_ca.clone(),
            plain_http: self.cluster_plain_http,
            secret,
            api_key: api_key.to_string(),
            vcpus: self.capacity_vcpus.unwrap_or(cpus),
            mem_mib: self.capacity_mem.unwrap_or(sys.ram_total() / (1 << 20)),
            takes_sandboxes: !self.no_sandboxes,
            lease: Duration::from_millis(self.lease_ms),
        };
        Ok(Some(Node::connect(cfg).context("joining the cluster")?))
    }
}

/// `clade node …`.
#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// The cluster's nodes: lease, capacity and what is committed, drain state.
    Ls {
        #[command(flatten)]
        registry: RegistryArgs,
        /// One JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Drain node NAME: no more placements there; its running sandboxes are paused into
    /// the object store and resumed on other nodes, its paused ones stay paused (a resume
    /// goes elsewhere). With --wait, returns once the drain finished.
    Drain {
        /// The node.
        name: String,
        #[command(flatten)]
        registry: RegistryArgs,
        /// Wait for the drain to finish (at most this many seconds).
        #[arg(long, value_name = "SECONDS")]
        wait: Option<u64>,
    },
}

pub fn node(cmd: NodeCommand) -> anyhow::Result<u8> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match cmd {
        NodeCommand::Ls { registry, json } => {
            let db = clade_cluster::db::Db::connect(&registry.required()?)?;
            let nodes = rt.block_on(db.nodes())?;
            if json {
                let v: Vec<serde_json::Value> = nodes
                    .iter()
                    .map(|n| {
                        serde_json::json!({
                            "name": n.name, "address": n.address, "live": n.live,
                            "leaseLeftS": n.lease_left_s, "vcpus": n.vcpus, "memMiB": n.mem_mib,
                            "usedVcpus": n.used_vcpus, "usedMemMiB": n.used_mem_mib,
                            "sandboxes": n.sandboxes, "takesSandboxes": n.takes_sandboxes,
                            "draining": n.draining, "drained": n.drained, "templates": n.templates,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!(
                    "{:<16} {:<28} {:<6} {:>10} {:>14} {:>9}  state",
                    "NODE", "ADDRESS", "LEASE", "VCPUS", "MEM MiB", "SANDBOXES"
                );
                for n in nodes {
                    let state = match (n.takes_sandboxes, n.draining, n.drained) {
                        (false, _, _) => "gateway",
                        (_, true, true) => "drained",
                        (_, true, false) => "draining",
                        _ => "active",
                    };
                    println!(
                        "{:<16} {:<28} {:<6} {:>10} {:>14} {:>9}  {state}",
                        n.name,
                        n.address,
                        if n.live { "live" } else { "ended" },
                        format!("{}/{}", n.used_vcpus, n.vcpus),
                        format!("{}/{}", n.used_mem_mib, n.mem_mib),
                        n.sandboxes
                    );
                }
            }
            Ok(0)
        }
        NodeCommand::Drain {
            name,
            registry,
            wait,
        } => {
            let db = clade_cluster::db::Db::connect(&registry.required()?)?;
            rt.block_on(db.set_draining(&name))?;
            eprintln!("node {name}: draining");
            let Some(secs) = wait else { return Ok(0) };
            let deadline = std::time::Instant::now() + Duration::from_secs(secs);
            loop {
                let nodes = rt.block_on(db.nodes())?;
                let n = nodes
                    .iter()
                    .find(|n| n.name == name)
                    .with_context(|| format!("node {name} left the registry"))?;
                if n.drained {
                    eprintln!(
                        "node {name}: drained ({} sandboxes left on it, paused)",
                        n.sandboxes
                    );
                    return Ok(0);
                }
                if std::time::Instant::now() > deadline {
                    bail!("node {name}: not drained after {secs} s (see its log)");
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}
