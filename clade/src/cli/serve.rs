//! `clade serve`: the sandbox host (the `sandbox` crate behind an HTTP listener), its
//! flags and how they become a [`Host`] with its drivers, limits, jails, networks, store
//! and cluster node.
//!
//! `clade template build|ls|rm|prune` (what sandboxes start from) is in `serve/template.rs`:
//! it shares the state directory and the network range flags ([`NetRangeArgs`]) with
//! `clade serve`.

mod template;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use sandbox::http::{serve, AppState, Listen};
use sandbox::vmproc::{Shape, StandbyConfig};
use sandbox::{Host, HostConfig, ProcessDriver, TemplateStore};

pub use template::{template, TemplateCommand};

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on (HTTP, or HTTPS with --tls-cert), e.g. 127.0.0.1:3000 (point
    /// the SDK's E2B_API_URL here).
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: String,
    /// The domain sandboxes are reached under: each sandbox's `domain`, so that the SDK's
    /// `get_host(port)` gives `<port>-<id>.DOMAIN` (a wildcard DNS record `*.DOMAIN` must
    /// point at this host; see docs/cli.md).
    #[arg(long, value_name = "DOMAIN")]
    domain: Option<String>,
    /// Serve HTTPS with this PEM certificate chain (a wildcard `*.DOMAIN`; with --tls-key).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The host's state: registry.sqlite, templates/, sandboxes/ (created if needed).
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Keep paused sandboxes durable in this object store (each pause is published after
    /// it returns; another `clade serve` on the same store may resume them). Without it,
    /// sandboxes live in the state directory only.
    #[command(flatten)]
    store: super::store::StoreArgs,
    /// With --store: the chunk cache of what this host fetches (default
    /// `<state dir>/store-cache`).
    #[arg(long, value_name = "DIR")]
    store_cache: Option<PathBuf>,
    /// With --store: publish a checkpoint of every running sandbox this often (its VM
    /// snapshotted as it runs, listed as snapshot `checkpoint-<id>`). In a cluster, a
    /// running sandbox whose node is lost then comes back from its last checkpoint on
    /// another node (its info says `restoredFromCheckpoint`) instead of being lost.
    #[arg(long, value_name = "SECONDS", requires = "store", value_parser = clap::value_parser!(u64).range(1..))]
    checkpoint_every: Option<u64>,
    /// With --store: the chunk cache's size limit (MiB).
    #[arg(long, value_name = "MIB", default_value_t = 16384)]
    store_cache_max: u64,
    /// Build templates through E2B's template build API (`Template.build(...)` of the SDK)
    /// with this guest kernel: each build's steps and its template VM boot it. Without
    /// it, build requests are refused.
    #[arg(long, value_name = "FILE")]
    build_kernel: Option<PathBuf>,
    /// With --build-kernel: its initramfs (with clade-agent).
    #[arg(long, value_name = "FILE", requires = "build_kernel")]
    build_initrd: Option<PathBuf>,
    /// With --build-kernel: its command line.
    #[arg(
        long,
        value_name = "CMDLINE",
        requires = "build_kernel",
        default_value = "console=ttyS0 panic=-1 quiet clade.root=/dev/vda"
    )]
    build_cmdline: String,
    /// With --build-kernel: each built template's disk size (default: what its image
    /// needs plus 256 MiB).
    #[arg(long, value_name = "SIZE", requires = "build_kernel", value_parser = super::disk::parse_size)]
    build_disk_size: Option<u64>,
    /// The API key clients must send in X-API-KEY (E2B_API_KEY for the SDK).
    #[arg(
        long,
        env = "CLADE_API_KEY",
        hide_env_values = true,
        conflicts_with = "api_key_file"
    )]
    api_key: Option<String>,
    /// Read the API key from this file (first line).
    #[arg(long, value_name = "FILE")]
    api_key_file: Option<PathBuf>,
    /// Most children one fork request may make.
    #[arg(long, default_value_t = 16)]
    max_fork: usize,
    /// Longest sandbox timeout a client may ask for (seconds).
    #[arg(long, default_value_t = 86400)]
    max_timeout: u64,
    /// VM processes kept ready per VM shape (vCPUs, memory) of the templates: started
    /// ahead of time with their VM shell built, a create or resume only restores into one
    /// (refilled in the background). 0: each sandbox's process is started on its request.
    #[arg(long, value_name = "N", env = "CLADE_SERVE_STANDBY", default_value_t = 2, value_parser = clap::value_parser!(u8).range(0..=16))]
    standby: u8,
    /// DEVELOPMENT ONLY: run sandboxes' VM processes without a cgroup of their own (no CPU,
    /// memory or process limits: one busy sandbox can starve the others). By default each
    /// VM process (standbys, sandboxes, fork children) has one; a host where the limits
    /// cannot be applied is refused with what is missing.
    #[arg(long)]
    no_limits: bool,
    /// DEVELOPMENT ONLY: run sandboxes' VM processes as root in the host's namespaces (a
    /// guest that escapes into its VMM then has the host). By default each VM process
    /// (standbys, sandboxes, fork children) runs as a user of its own from --jail-uids, with
    /// no capabilities, in its own mount, PID, IPC, UTS and network namespaces, seeing only the
    /// files it needs.
    #[arg(long)]
    no_jail: bool,
    /// The users sandboxes' VM processes run as: FIRST:COUNT (uid and gid FIRST to
    /// FIRST+COUNT-1; none of them should be a user of this host).
    #[arg(long, value_name = "FIRST:COUNT", default_value = "2000000:65536", value_parser = parse_uid_range)]
    jail_uids: sandbox::vmproc::JailConfig,
    /// CPUs' worth of time a sandbox may use per vCPU (its cgroup's quota; below 1 the
    /// host is oversubscribed).
    #[arg(long, value_name = "F", default_value_t = 1.0)]
    cpu_per_vcpu: f64,
    /// Memory a sandbox's VM process may use beyond its guest's RAM (MiB); a VM over its
    /// limit is killed by the kernel and reported as crashed.
    #[arg(long, value_name = "MIB", default_value_t = 192)]
    vmm_overhead: u64,
    /// Processes and threads per sandbox VM process.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pids_max: u64,
    /// TEST HARNESS ONLY: every sandbox's memory limit (MiB), whatever its RAM.
    #[arg(long, value_name = "MIB", hide = true)]
    test_memory_limit: Option<u64>,
    /// TEST HARNESS ONLY: sandboxes are host-run `clade-agent --listen-unix` processes
    /// (this executable), not VMs; commands run on the host as this user. Installs the
    /// template `host-agent`. For SDK tests on machines that cannot boot Linux guests.
    #[arg(long, value_name = "CLADE_AGENT", hide = true)]
    test_host_agent: Option<PathBuf>,
    /// Sandbox networking: `auto` turns it on when a template has a network device
    /// (`clade template build --net`), `on` always, `off` never. On: each such sandbox gets
    /// its own network namespace with a TAP, NAT to the outside through this host, and an
    /// egress policy; the service installs its nftables table and enables IPv4 forwarding
    /// (needs root and the `nft` tool). Set up failing is logged, and such sandboxes then
    /// fail to start with the reason.
    #[arg(long, value_name = "auto|on|off", default_value = "auto")]
    net: NetMode,
    /// Networks kept ready (namespace made, rules in place), off the create path.
    #[arg(long, value_name = "N", default_value_t = 2)]
    net_pool: usize,
    /// The resolver sandboxes' DNS queries are forwarded to (each sandbox's resolver is a
    /// forwarder on its gateway); default: the first nameserver of /etc/resolv.conf.
    #[arg(long, value_name = "IP")]
    net_dns: Option<std::net::IpAddr>,
    #[command(flatten)]
    range: NetRangeArgs,
    #[command(flatten)]
    cluster: super::cluster::ClusterArgs,
}

fn parse_uid_range(s: &str) -> Result<sandbox::vmproc::JailConfig, String> {
    let (first, count) = s
        .split_once(':')
        .ok_or_else(|| format!("'{s}': give FIRST:COUNT (e.g. 2000000:65536)"))?;
    let cfg = sandbox::vmproc::JailConfig {
        first_uid: first
            .parse()
            .map_err(|_| format!("'{first}' is not a uid"))?,
        uids: count
            .parse()
            .map_err(|_| format!("'{count}' is not a number of uids"))?,
    };
    cfg.check().map_err(|e| e.to_string())?;
    Ok(cfg)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum NetMode {
    Auto,
    On,
    Off,
}

/// The outer addressing of sandbox networks (shared by `clade serve` and `clade template
/// build --net`, which must agree).
#[derive(Debug, Args)]
pub struct NetRangeArgs {
    /// The IPv4 range sandbox networks' outer addresses come from, /30 each (the host
    /// reaches a guest's ports at its outer address).
    #[arg(long, value_name = "CIDR", default_value = "10.200.0.0/16")]
    net_range: String,
    /// Prefix of the names of sandbox network namespaces (`/run/netns/NAME-<i>`) and of
    /// the host's nftables table: a second service on the same host needs its own.
    #[arg(long, value_name = "NAME", default_value = "clade")]
    net_name: String,
}

impl NetRangeArgs {
    fn range(&self) -> anyhow::Result<hostnet::NetRange> {
        let cidr = hostnet::parse_cidr(&self.net_range)?;
        // Host veth ends: `<two letters of the name>h<i>`, one prefix per name.
        let link: String = self
            .net_name
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .take(2)
            .collect();
        Ok(hostnet::NetRange::new(cidr, &self.net_name, &link)?)
    }
}

/// `clade serve`: runs until SIGINT/SIGTERM. Sandboxes' VM processes are not stopped then:
/// the next `clade serve` on the same state dir finds them again.
pub fn serve_cmd(args: ServeArgs) -> anyhow::Result<u8> {
    let key = match (&args.api_key, &args.api_key_file) {
        (Some(k), None) => k.clone(),
        (None, Some(f)) => super::secret_file(f)?,
        _ => bail!("give --api-key KEY (or CLADE_API_KEY) or --api-key-file FILE"),
    };
    if key.is_empty() {
        bail!("the API key is empty");
    }
    // Checked before anything starts: a bad certificate is an error now, not at the
    // first connection.
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(c), Some(k)) => Some(sandbox::http::tls::server_config(c, k)?),
        _ => None,
    };
    if let Some(d) = &args.domain {
        let ok = !d.is_empty()
            && d.len() <= 200
            && d.split('.').all(|l| {
                !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
        if !ok {
            bail!("--domain {d:?}: not a domain name");
        }
    }
    let state_dir = std::path::absolute(&args.state_dir)?;
    // Before anything is made in it (cgroups, jails, templates): private to this user.
    vmm::host::private_dir(&state_dir)
        .with_context(|| format!("the state directory {}", state_dir.display()))?;
    let mut cfg = HostConfig::new(state_dir.clone());
    cfg.max_fork = args.max_fork.clamp(1, 64);
    cfg.max_timeout_s = args.max_timeout.max(1);
    let exe = std::env::current_exe().context("finding the clade executable")?;
    let mut processes: Option<Arc<ProcessDriver>> = None;
    let cgroups = if args.no_limits || args.test_host_agent.is_some() {
        if args.test_host_agent.is_none() {
            eprintln!(
                "clade serve: --no-limits: sandboxes run WITHOUT cgroup limits (development \
                 only: one busy sandbox can starve the others)"
            );
        }
        None
    } else {
        let cfg = sandbox::vmproc::LimitsConfig {
            cpu_share: args.cpu_per_vcpu,
            vmm_overhead_mib: args.vmm_overhead,
            pids_max: args.pids_max,
            test_memory_mib: args.test_memory_limit,
            ..Default::default()
        };
        Some(Arc::new(
            sandbox::vmproc::VmCgroups::new(&state_dir, cfg)
                .context("sandbox limits (cgroups); --no-limits runs without them")?,
        ))
    };
    let jails = if args.no_jail || args.test_host_agent.is_some() {
        if args.test_host_agent.is_none() {
            eprintln!(
                "clade serve: --no-jail: sandboxes' VM processes run AS ROOT in the host's \
                 namespaces (development only: a guest that escapes into its VMM has the host)"
            );
        }
        None
    } else {
        Some(Arc::new(
            sandbox::vmproc::Jails::new(
                &state_dir,
                &state_dir.join("sandboxes"),
                vec![state_dir.join("templates")],
                args.jail_uids.clone(),
            )
            .context("jailing sandboxes; --no-jail runs them unjailed (development only)")?,
        ))
    };
    let driver: Arc<dyn sandbox::VmDriver> = match &args.test_host_agent {
        Some(agent) => {
            eprintln!(
                "clade serve: TEST HARNESS: sandboxes are host-run {} processes, not VMs; commands run on this host",
                agent.display()
            );
            sandbox::hostagent::HostAgentDriver::install_template(&state_dir)?;
            Arc::new(sandbox::hostagent::HostAgentDriver::new(
                std::path::absolute(agent)?,
            ))
        }
        None if args.standby == 0 => {
            let mut d = ProcessDriver::new(exe);
            if let Some(cg) = &cgroups {
                d = d.limited(Arc::clone(cg));
            }
            if let Some(j) = &jails {
                d = d.jailed_by(Arc::clone(j));
            }
            let d = Arc::new(d);
            processes = Some(Arc::clone(&d));
            d
        }
        None => {
            let shapes = TemplateStore::new(&state_dir)
                .list()?
                .iter()
                .map(|t| Shape {
                    vcpus: t.vcpus,
                    mem_mib: t.mem_mib,
                })
                .collect();
            let sandboxes = state_dir.join("sandboxes");
            let d = Arc::new(ProcessDriver::with_standby(
                exe,
                StandbyConfig {
                    // Inside the files root: a jailed standby sees both through one
                    // mount, so the files it makes ahead (serial file, vsock socket, log)
                    // can be renamed into the sandbox's directory at its restore (across
                    // two mounts a rename fails, and they were made on its path).
                    dir: sandboxes.join("standby"),
                    per_shape: args.standby.into(),
                    files_root: sandboxes,
                    shapes,
                    cgroups: cgroups.clone(),
                    jails: jails.clone(),
                },
            )?);
            processes = Some(Arc::clone(&d));
            d
        }
    };
    let mut host = Host::open(cfg, driver)?;
    let node = args.cluster.node(&args.listen, tls.is_some(), &key)?;
    if let Some(n) = &node {
        if args.store.store.is_none() {
            bail!("--cluster needs --store: paused sandboxes must be resumable on any node");
        }
        host.set_ownership(Arc::clone(n) as Arc<dyn sandbox::ownership::Ownership>);
    }
    let wants_net = match args.net {
        NetMode::Off => false,
        NetMode::On => true,
        NetMode::Auto => TemplateStore::new(&state_dir).list()?.iter().any(|t| t.net),
    };
    let networks = if !wants_net || args.test_host_agent.is_some() {
        Err("sandbox networking is off (clade serve --net)".into())
    } else {
        let dns = match args.net_dns {
            Some(ip) => Some(std::net::SocketAddr::new(ip, 53)),
            None => sandbox::net::dns::upstream_from(
                &std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default(),
            ),
        };
        match sandbox::net::Networks::init(args.range.range()?, args.net_pool, dns) {
            Ok(n) => {
                tracing::info!(range = %args.range.net_range, "sandbox networking on");
                Ok(n)
            }
            Err(e) => {
                tracing::error!("sandbox networking is unavailable: {e}");
                Err(e.to_string())
            }
        }
    };
    host.set_networks(networks.clone());
    if let Some(url) = &args.store.store {
        let cache_dir = args
            .store_cache
            .clone()
            .unwrap_or_else(|| state_dir.join("store-cache"));
        let d = sandbox::durable::Durable::open(
            &sandbox::durable::StoreConfig {
                url: url.clone(),
                options: args.store.options(),
                cache_dir,
                cache_limit: args.store_cache_max.saturating_mul(1 << 20),
            },
            &state_dir,
        )?;
        host.set_store(Arc::new(d));
    }
    let builds = sandbox::build::Builds::new(
        &state_dir,
        match &args.build_kernel {
            Some(k) => Some(sandbox::build::BuildConfig {
                exe: std::env::current_exe().context("finding the clade executable")?,
                kernel: std::path::absolute(k)?,
                initrd: args
                    .build_initrd
                    .as_deref()
                    .map(std::path::absolute)
                    .transpose()?,
                cmdline: args.build_cmdline.clone(),
                kvm_device: PathBuf::from("/dev/kvm"),
                disk_size: args.build_disk_size,
                // Build VMs are jailed and limited as sandboxes' are: they run what
                // tenants send.
                confine: sandbox::vmproc::BuildConfinement::new(jails.clone(), cgroups.clone())
                    .map(|c| Arc::new(c) as Arc<dyn clade_builder::vm::Confine>),
                // Build VMs on the sandbox networks (RUN steps fetch packages); the
                // templates they make have a network device then.
                network: networks.as_ref().ok().map(|n| {
                    Arc::new(sandbox::net::BuildNetworks::new(Arc::clone(n)))
                        as Arc<dyn clade_builder::vm::AttachNetwork>
                }),
            }),
            None => None,
        },
    );
    let (running, paused, crashed) = host.recover()?;
    tracing::info!(running, paused, crashed, "registry loaded");
    let host = Arc::new(host);
    host.start_uploads()?;
    let kept = Arc::clone(&host);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let served = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("listening on {}", args.listen))?;
        eprintln!(
            "clade serve: listening on {}://{} (state {}; {running} running, {paused} paused, {crashed} crashed sandboxes)",
            if tls.is_some() { "https" } else { "http" },
            listener.local_addr()?,
            state_dir.display()
        );
        let state = AppState {
            host,
            api_key: Arc::new(key),
            domain: args.domain.clone().map(Arc::new),
            sessions: Arc::new(sandbox::dashboard::Sessions::new(tls.is_some())),
            builds: Arc::new(builds.https(tls.is_some())),
        };
        let listen = match tls {
            Some(cfg) => Listen::Https(listener, cfg),
            None => Listen::Http(listener),
        };
        let shutdown = async {
            use tokio::signal::unix::{signal, SignalKind};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = term.recv() => {}
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        };
        if let Some(n) = &node {
            // The dashboard's sessions open the cluster's merged views too.
            n.set_dashboard(axum::extract::FromRef::from_ref(&state));
        }
        let wrap = |app: axum::Router| match &node {
            Some(n) => app.layer(axum::middleware::from_fn_with_state(
                Arc::clone(n),
                clade_cluster::gateway::route,
            )),
            None => app,
        };
        if let Some(secs) = args.checkpoint_every {
            let host = Arc::clone(&state.host);
            tokio::spawn(async move {
                let mut iv = tokio::time::interval(Duration::from_secs(secs));
                iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                iv.tick().await;
                loop {
                    iv.tick().await;
                    let h = Arc::clone(&host);
                    match tokio::task::spawn_blocking(move || h.checkpoint_running()).await {
                        Ok(Ok(n)) => tracing::debug!(sandboxes = n, "checkpoints published"),
                        Ok(Err(e)) => tracing::warn!("checkpoints: {e}"),
                        Err(e) => tracing::warn!("checkpoints: {e}"),
                    }
                }
            });
        }
        if let Some(n) = &node {
            n.start(Arc::clone(&state.host)).await?;
            eprintln!(
                "clade serve: node {} of the cluster (reached at {})",
                n.config().name,
                n.config().address
            );
        }
        serve(listen, state, wrap, Duration::from_millis(250), shutdown).await?;
        anyhow::Ok(())
    });
    // Blocking work still running (an agent call of a stream whose client stayed) must not
    // keep the process from ending.
    rt.shutdown_timeout(Duration::from_secs(1));
    // Unused standby processes and ready networks end with the service (sandboxes' VMs
    // and networks do not).
    if let Some(d) = processes {
        d.stop_standby();
    }
    kept.shutdown_networks();
    served?;
    Ok(0)
}
