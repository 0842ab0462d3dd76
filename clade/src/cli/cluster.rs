//! `clade serve --cluster URL` (this node joins a cluster: see the `clade-cluster` crate)
//! and `clade node ls|drain` (the cluster's nodes, as its registry has them).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clade_cluster::{Node, NodeConfig};
use clap::{Args, Subcommand};

/// `clade serve`'s cluster options.
#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// Join a cluster whose registry is this PostgreSQL database
    /// (postgres://user:password@host:port/db). Without it the service is one host with
    /// its own registry (SQLite).
    #[arg(
        long,
        value_name = "URL",
        env = "CLADE_CLUSTER",
        hide_env_values = true
    )]
    cluster: Option<String>,
    /// This node's name (default: the machine's host name).
    #[arg(long, value_name = "NAME", requires = "cluster")]
    node_name: Option<String>,
    /// Where other nodes reach this one: https://HOST:PORT (default: --listen, https://
    /// with --tls-cert, else http://).
    #[arg(long, value_name = "URL", requires = "cluster")]
    advertise: Option<String>,
    /// The cluster CA (PEM): every node's certificate (its --tls-cert) is verified to it
    /// when a request hops to it over https://.
    #[arg(
        long,
        value_name = "FILE",
        env = "CLADE_CLUSTER_CA",
        requires = "cluster"
    )]
    cluster_ca: Option<PathBuf>,
    /// Allow http:// node addresses that are not loopback: the cluster secret and the API
    /// key then cross the network in clear text (only for a network private by other
    /// means).
    #[arg(long, requires = "cluster")]
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
    #[arg(long, value_name = "N", requires = "cluster")]
    capacity_vcpus: Option<u32>,
    /// Memory (MiB) this node may commit to running sandboxes (default: its memory).
    #[arg(long, value_name = "MIB", requires = "cluster")]
    capacity_mem: Option<u64>,
    /// Run no sandboxes: a gateway that forwards every sandbox's requests.
    #[arg(long, requires = "cluster")]
    no_sandboxes: bool,
    /// The node's lease (ms): renewed every third of it; a node that misses it loses the
    /// right to act on its sandboxes.
    #[arg(long, value_name = "MS", default_value_t = 5000, requires = "cluster")]
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
        let Some(url) = &self.cluster else {
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
            url: url.clone(),
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
        /// The cluster's registry (postgres://…).
        #[arg(
            long,
            value_name = "URL",
            env = "CLADE_CLUSTER",
            hide_env_values = true
        )]
        cluster: String,
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
        /// The cluster's registry (postgres://…).
        #[arg(
            long,
            value_name = "URL",
            env = "CLADE_CLUSTER",
            hide_env_values = true
        )]
        cluster: String,
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
        NodeCommand::Ls { cluster, json } => {
            let db = clade_cluster::db::Db::connect(&cluster)?;
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
            cluster,
            wait,
        } => {
            let db = clade_cluster::db::Db::connect(&cluster)?;
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
