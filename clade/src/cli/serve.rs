//! `clade serve` (the sandbox host: the `sandbox` crate behind an HTTP listener) and
//! `clade template build|ls|rm` (what sandboxes start from).
//!
//! A template build is an ordinary `clade run` child with an API and a vsock socket: this
//! command waits for its agent, runs the setup commands through it, snapshots it into
//! `<state dir>/templates/<name>/snapshot` and stops it. Only then is `template.json`
//! written, so `clade serve` never sees half a template.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clade_builder::vm::VmSpec;
use clap::{Args, Subcommand};
use sandbox::http::{serve, AppState, Listen};
use sandbox::template::FromImage;
use sandbox::vmproc::{Shape, StandbyConfig};
use sandbox::{Host, HostConfig, ProcessDriver, Template, TemplateStore};

use super::MachineArgs;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on (HTTP, or HTTPS with --tls-cert), e.g. 127.0.0.1:3000 (point
    /// the SDK's E2B_API_URL here).
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: String,
    /// The domain sandboxes are reached under: each sandbox's `domain`, so that the SDK's
    /// `get_host(port)` gives `<port>-<id>.DOMAIN` (a wildcard DNS record `*.DOMAIN` must
    /// point at this host; see the README).
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

#[derive(Debug, Subcommand)]
pub enum TemplateCommand {
    /// Boot a VM, wait for its agent, run setup commands, snapshot it as template NAME.
    Build(Box<BuildArgs>),
    /// List the templates in a state dir.
    Ls {
        /// The host's state dir.
        #[arg(long, value_name = "DIR")]
        state_dir: PathBuf,
        /// One JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Remove the layers of the build cache (image conversions, Dockerfile steps) that no
    /// template, sandbox or snapshot of the state dir stands on, and what killed builds
    /// left. Refused while a build is running.
    Prune {
        /// The host's state dir.
        #[arg(long, value_name = "DIR")]
        state_dir: PathBuf,
    },
    /// Remove a template (no sandbox may use it).
    Rm {
        /// Template name.
        name: String,
        /// The host's state dir.
        #[arg(long, value_name = "DIR")]
        state_dir: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct BuildArgs {
    /// Template name (the SDK's template / templateID).
    name: String,
    /// Kernel image (or the project's native test guest, with --test-device). Default:
    /// the guest `scripts/install-guest.sh` installs (`$CLADE_HOME/guest/vmlinuz`, with its
    /// `initrd`).
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Initramfs.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long, default_value = "console=ttyS0 panic=-1")]
    cmdline: String,
    /// A frozen base disk layer: the template VM writes its own overlay on it, frozen by
    /// the snapshot; each sandbox gets an overlay on that.
    #[arg(long, value_name = "BASE.cdsk")]
    disk: Option<PathBuf>,
    /// A container image whose root filesystem becomes the template's disk: an OCI image
    /// layout directory, an OCI archive, a `docker save` archive, or a registry reference
    /// (pulled into the state dir's `images/` cache, each blob once; registries on
    /// loopback over HTTP; credentials from Docker's config.json). Its layers are applied
    /// in order into an ext4 filesystem (a frozen base layer in the template); its config's
    /// Env becomes every sandbox's environment (under the create request's envVars). The
    /// kernel and initramfs (with clade-agent) are Clade's: the image needs no init.
    #[arg(long, value_name = "PATH", conflicts_with = "disk")]
    image: Option<PathBuf>,
    /// A Dockerfile to build the template's disk from: its FROM image (a registry
    /// reference, or an image layout or archive path, relative to the context) converted
    /// once, then its RUN and COPY steps run in a VM booted from the image built so far,
    /// each step's result a disk layer cached by content in `<state dir>/templates/.build-cache`
    /// (an unchanged prefix is not run again). ENV, WORKDIR, USER, CMD and ENTRYPOINT
    /// become the template's defaults.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["disk", "image"])]
    dockerfile: Option<PathBuf>,
    /// With --dockerfile: the directory COPY reads from (default: the Dockerfile's).
    #[arg(long, value_name = "DIR", requires = "dockerfile")]
    context: Option<PathBuf>,
    /// With --dockerfile, or for the base template: a build argument (repeatable). The
    /// base template's BASE is the image it is built FROM (default `debian:bookworm`;
    /// any Debian or Ubuntu image: a registry reference, an image layout or an archive).
    #[arg(long = "build-arg", value_name = "NAME=VALUE")]
    build_arg: Vec<String>,
    /// With --image or --dockerfile: the disk's size (default: what the image needs plus
    /// 256 MiB); an image that does not fit is refused.
    #[arg(long, value_name = "SIZE", value_parser = super::disk::parse_size)]
    disk_size: Option<u64>,
    /// The project's bare-metal test guest (it answers only the agent's Hello and Ping).
    #[arg(long)]
    test_device: bool,
    /// A setup command run in the guest with `sh -c` (repeatable; in order; any failure
    /// fails the build). Needs a Linux guest with clade-agent.
    #[arg(long = "run", value_name = "CMD")]
    run: Vec<String>,
    /// A command started (`sh -c`, kept running) before the snapshot, so that every
    /// sandbox of the template has it running; as the image's or Dockerfile's user, in its
    /// working directory, with its environment.
    #[arg(long, value_name = "CMD")]
    start_cmd: Option<String>,
    /// With --start-cmd: a command run (`sh -c`) until it exits 0 before the snapshot
    /// (at most --agent-timeout seconds).
    #[arg(long, value_name = "CMD", requires = "start_cmd")]
    ready_cmd: Option<String>,
    /// The host's state dir.
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Replace an existing template of that name.
    #[arg(long)]
    force: bool,
    /// How long the agent may take to answer after boot (seconds).
    #[arg(long, default_value_t = 60.0)]
    agent_timeout: f64,
    /// Give the VM a network device (virtio-net) in a network namespace of its own, with
    /// the address every sandbox of the template then has (the guest agent configures it
    /// from the kernel command line, added here); setup commands reach the outside through
    /// this host's NAT. Needs root and the `nft` tool, like `clade serve`'s networking.
    #[arg(long)]
    net: bool,
    #[command(flatten)]
    range: NetRangeArgs,
    #[command(flatten)]
    machine: MachineArgs,
}

pub fn template(cmd: TemplateCommand) -> anyhow::Result<u8> {
    match cmd {
        TemplateCommand::Build(a) => build(*a),
        TemplateCommand::Ls { state_dir, json } => {
            let store = TemplateStore::new(&state_dir);
            let ts = store.list()?;
            // The tags that mean each build (a build of a template: `name@<build id>`).
            let tags_of = |build: &str| -> Vec<String> {
                let name = sandbox::template::tags::template_of(build);
                store
                    .tags(name)
                    .map(|f| {
                        f.tags
                            .into_iter()
                            .filter(|(_, t)| t.build == build)
                            .map(|(tag, _)| tag)
                            .collect()
                    })
                    .unwrap_or_default()
            };
            if json {
                let v: Vec<_> = ts
                    .iter()
                    .map(|t| {
                        serde_json::json!({"name": t.name, "vcpus": t.vcpus, "mem_mib": t.mem_mib,
                            "disk": t.disk, "test_guest": t.test_guest, "created_ms": t.created_ms,
                            "build_id": t.build_id(), "tags": tags_of(&t.name)})
                    })
                    .collect();
                println!("{}", serde_json::Value::Array(v));
            } else {
                for t in ts {
                    let tags = tags_of(&t.name);
                    println!(
                        "{}\t{} vCPU\t{} MiB\t{}{}\t{}",
                        t.name,
                        t.vcpus,
                        t.mem_mib,
                        if t.disk { "disk" } else { "no disk" },
                        if t.test_guest { "\ttest guest" } else { "" },
                        if tags.is_empty() {
                            "no tag (removed once unused)".to_string()
                        } else {
                            format!("tags: {}", tags.join(","))
                        }
                    );
                }
            }
            Ok(0)
        }
        TemplateCommand::Prune { state_dir } => {
            let state_dir = std::path::absolute(&state_dir)?;
            let cache_dir = TemplateStore::new(&state_dir).build_cache_dir();
            let in_use = layers_in_use(&state_dir, &cache_dir)?;
            let r = clade_builder::layers::LayerCache::new(&cache_dir).prune(&in_use)?;
            println!(
                "pruned {} layers ({} MiB) and {} leftovers of killed builds; {} layers in use kept",
                r.layers,
                r.bytes >> 20,
                r.scratch,
                in_use.iter().filter(|p| p.starts_with(&cache_dir)).count()
            );
            Ok(0)
        }
        TemplateCommand::Rm { name, state_dir } => {
            let state_dir = std::path::absolute(&state_dir)?;
            // A service may hold the registry open: SQLite allows a second reader.
            let store = TemplateStore::new(&state_dir);
            let mut users = 0;
            if state_dir.join("registry.sqlite").exists() {
                let reg = sandbox::registry::Registry::open(&state_dir.join("registry.sqlite"))?;
                for b in store.builds(&name)? {
                    users += reg.count_template(&b)?;
                }
            }
            store.remove(&name, users)?;
            println!("removed template {name}");
            Ok(0)
        }
    }
}

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The base template's Dockerfile (`clade template build base`).
const BASE_DOCKERFILE: &str = include_str!("base.Dockerfile");

fn build(mut a: BuildArgs) -> anyhow::Result<u8> {
    // The installed guest unless one is given.
    if a.kernel.is_none() {
        let guest = super::clade_home()?.join("guest");
        let k = guest.join("vmlinuz");
        if !k.is_file() {
            bail!(
                "no --kernel, and no guest kernel at {} (scripts/install-guest.sh installs \
                 Debian's kernel and Clade's initramfs there)",
                k.display()
            );
        }
        a.kernel = Some(k);
        if a.initrd.is_none() {
            a.initrd = Some(guest.join("initrd")).filter(|p| p.is_file());
        }
    }
    // `clade template build base`: E2B's base, from the built-in Dockerfile.
    let _base_context = if a.name == sandbox::build::BASE_TEMPLATE
        && a.disk.is_none()
        && a.image.is_none()
        && a.dockerfile.is_none()
        && !a.test_device
    {
        let ctx = std::env::temp_dir().join(format!("clade-base-{}", std::process::id()));
        std::fs::create_dir_all(&ctx)?;
        std::fs::write(ctx.join("Dockerfile"), BASE_DOCKERFILE)?;
        a.dockerfile = Some(ctx.join("Dockerfile"));
        // Its packages come from the distribution's archive.
        a.net = true;
        eprintln!(
            "building the base template (user `user`, sudo, curl, git, python3 and pip) from {}",
            ctx.join("Dockerfile").display()
        );
        Some(TempDir(ctx))
    } else {
        None
    };
    if !a.build_arg.is_empty() && a.dockerfile.is_none() {
        bail!("--build-arg is for a build from a Dockerfile (--dockerfile, or the base template)");
    }
    // A guest whose root is the image's disk is told so.
    if (a.image.is_some() || a.dockerfile.is_some()) && !a.test_device {
        for part in ["quiet", "clade.root=/dev/vda"] {
            if !a.cmdline.split_whitespace().any(|w| w == part) {
                a.cmdline = format!("{} {part}", a.cmdline);
            }
        }
    }
    if a.test_device && !a.run.is_empty() {
        bail!(
            "--run needs a Linux guest with clade-agent: the native test guest (--test-device) \
             answers only the agent's Hello and Ping"
        );
    }
    let state_dir = std::path::absolute(&a.state_dir)?;
    // The service's state directory, whoever makes it first: private to this user.
    vmm::host::private_dir(&state_dir)
        .with_context(|| format!("the state directory {}", state_dir.display()))?;
    let store = TemplateStore::new(&state_dir);
    // Layers of the build cache this template will stand on are not pruned meanwhile.
    let _cache = (a.image.is_some() || a.dockerfile.is_some())
        .then(|| clade_builder::layers::LayerCache::new(&store.build_cache_dir()).hold())
        .transpose()?;
    let dir = store.prepare(&a.name, a.force)?;
    let t0 = Instant::now();
    let r = build_into(&a, &store, &dir);
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let t = r?;
    println!(
        "template {} built in {:.2}s: {} ({} vCPU, {} MiB{})",
        t.name,
        t0.elapsed().as_secs_f64(),
        dir.display(),
        t.vcpus,
        t.mem_mib,
        if t.disk { ", disk" } else { "" }
    );
    Ok(0)
}

/// Every layer (canonical path) of every disk chain of `state_dir`'s templates, sandboxes
/// and snapshots (the build cache `cache_dir` left out): what they stand on. A chain that
/// cannot be read is an error: what it stands on cannot be known, so nothing may be
/// pruned.
fn layers_in_use(
    state_dir: &Path,
    cache_dir: &Path,
) -> anyhow::Result<std::collections::HashSet<PathBuf>> {
    fn walk(d: &Path, skip: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
        for e in std::fs::read_dir(d)? {
            let e = e?;
            let p = e.path();
            let t = e.file_type()?;
            if t.is_dir() && p != skip {
                walk(&p, skip, out)?;
            } else if t.is_file() && p.extension().is_some_and(|x| x == "cdsk") {
                out.push(p);
            }
        }
        Ok(())
    }
    let mut tops = Vec::new();
    for sub in ["templates", "sandboxes", "snapshots"] {
        let d = state_dir.join(sub);
        if d.is_dir() {
            walk(&d, cache_dir, &mut tops)
                .with_context(|| format!("looking for disks in {}", d.display()))?;
        }
    }
    let mut used = std::collections::HashSet::new();
    for top in tops {
        let chain = disk::ops::info(&top).with_context(|| {
            format!(
                "reading the disk chain of {}: nothing pruned",
                top.display()
            )
        })?;
        for l in chain {
            used.insert(std::fs::canonicalize(&l.path).unwrap_or(l.path));
        }
    }
    Ok(used)
}

/// The image `name` names, as a layout or archive path: pulled into the state dir's
/// `images/` cache when it is a registry reference.
fn image_layout(name: &str, state_dir: &Path) -> anyhow::Result<PathBuf> {
    if !clade_image::is_reference(name) || Path::new(name).exists() {
        return Ok(PathBuf::from(name));
    }
    let cache = state_dir.join("images");
    let progress = Arc::new(clade_image::PullProgress::default());
    let bar = super::progress::Bar::bytes("pull", 0);
    let shown = {
        let p = progress.clone();
        bar.follow(move || p.get())
    };
    let pulled = clade_image::pull(name, &cache, Some(&progress));
    shown.finish(pulled.is_ok());
    let r = pulled?;
    eprintln!(
        "pulled {name} ({}): {} blobs fetched ({} KiB), {} already cached",
        r.manifest_digest,
        r.fetched,
        r.bytes >> 10,
        r.cached
    );
    Ok(r.layout)
}

/// From `--image`: the image's root filesystem as the template's base layer, converted
/// once (the build cache's, shared by every template of the same image and disk size).
fn image_base(a: &BuildArgs, img: &Path) -> anyhow::Result<(PathBuf, FromImage)> {
    let t = Instant::now();
    let state_dir = std::path::absolute(&a.state_dir)?;
    let layout = image_layout(&img.to_string_lossy(), &state_dir)?;
    let src = clade_image::Source::open(&layout)?;
    let cache =
        clade_builder::layers::LayerCache::new(&TemplateStore::new(&state_dir).build_cache_dir());
    let (base, _key, converted) =
        super::progress::converting(|p| cache.image_base(&src, a.disk_size, p))
            .with_context(|| format!("the root filesystem of {}", img.display()))?;
    let Some(d) = converted else {
        eprintln!("image {}: converted before (cached)", img.display());
        return Ok((base, from_image(img.display().to_string(), src.defaults())));
    };
    eprintln!(
        "image {}: {} layers, {} entries, {} MiB unpacked, a {} MiB ext4 disk in {:.2}s \
         (unpack {:.2}s, mkfs.ext4 {:.2}s, import {:.2}s)",
        img.display(),
        d.unpacked.layers,
        d.unpacked.entries,
        d.unpacked.bytes >> 20,
        d.size >> 20,
        t.elapsed().as_secs_f64(),
        d.times[0].as_secs_f64(),
        d.times[1].as_secs_f64(),
        d.times[2].as_secs_f64()
    );
    Ok((base, from_image(img.display().to_string(), src.defaults())))
}

fn from_image(reference: String, d: &clade_image::ImageDefaults) -> FromImage {
    FromImage {
        reference,
        env: d.env.iter().cloned().collect(),
        cwd: d.cwd.clone(),
        user: d.user.clone(),
        start_cmd: d.start_command(),
    }
}

/// From `--dockerfile`: its FROM image converted (once, cached), its steps run in build
/// VMs (each step's layer cached); the top layer is the template's base.
fn dockerfile_base(
    a: &BuildArgs,
    df: &Path,
    spec: &VmSpec,
) -> anyhow::Result<(PathBuf, FromImage)> {
    use clade_builder::dockerfile::MAX_DOCKERFILE;
    let t = Instant::now();
    let state_dir = std::path::absolute(&a.state_dir)?;
    let len = std::fs::metadata(df)
        .with_context(|| format!("the Dockerfile {}", df.display()))?
        .len();
    if len > MAX_DOCKERFILE as u64 {
        bail!(
            "the Dockerfile {} is larger than {MAX_DOCKERFILE} bytes",
            df.display()
        );
    }
    let text = std::fs::read_to_string(df)
        .with_context(|| format!("reading the Dockerfile {}", df.display()))?;
    let parsed =
        clade_builder::dockerfile::parse(&text).with_context(|| format!("{}", df.display()))?;
    let mut args = std::collections::BTreeMap::new();
    for kv in &a.build_arg {
        match kv.split_once('=') {
            Some((k, v)) => args.insert(k.to_string(), v.to_string()),
            // `--build-arg NAME`: its value from this environment, as docker build does.
            None => match std::env::var(kv) {
                Ok(v) => args.insert(kv.clone(), v),
                Err(_) => {
                    bail!("--build-arg {kv}: no value given and no such environment variable")
                }
            },
        };
    }
    let context = match &a.context {
        Some(c) => std::path::absolute(c)?,
        None => std::path::absolute(df)?
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("/")),
    };
    let from = parsed.base_image(&args)?;
    // FROM names a path (relative to the context) when one is there, else a registry
    // reference.
    let local = context.join(&from);
    let layout = if local.exists() {
        local
    } else if clade_image::is_reference(&from) {
        image_layout(&from, &state_dir)?
    } else {
        bail!(
            "FROM {from}: no image at {} and not a registry reference",
            local.display()
        );
    };
    let src = clade_image::Source::open(&layout).with_context(|| format!("FROM {from}"))?;
    let cache =
        clade_builder::layers::LayerCache::new(&TemplateStore::new(&state_dir).build_cache_dir());
    let (base, key, converted) =
        super::progress::converting(|p| cache.image_base(&src, a.disk_size, p))
            .with_context(|| format!("the root filesystem of {from}"))?;
    match converted {
        Some(d) => eprintln!(
            "FROM {from}: {} layers, {} MiB unpacked, a {} MiB ext4 disk in {:.2}s",
            d.unpacked.layers,
            d.unpacked.bytes >> 20,
            d.size >> 20,
            t.elapsed().as_secs_f64()
        ),
        None => eprintln!("FROM {from}: cached"),
    }
    let plan = parsed.plan(src.defaults(), &args)?;
    if a.test_device && !plan.steps.is_empty() {
        bail!(
            "{}: RUN and COPY need a Linux guest with clade-agent: the native test guest \
             (--test-device) answers only the agent's Hello and Ping",
            df.display()
        );
    }
    for i in &plan.ignored {
        eprintln!("ignored (no effect on a sandbox): {i}");
    }
    for u in &plan.unused_args {
        eprintln!("warning: --build-arg {u} is not declared by an ARG");
    }
    let mut bar = super::progress::StepsBar::new("build");
    let built =
        clade_builder::layers::build(&plan, &base, &key, Some(&context), &cache, spec, &mut bar);
    bar.finish(built.is_ok());
    let (top, report) = built?;
    eprintln!(
        "dockerfile {}: {} steps, {} cached, {} run{} in {:.2}s",
        df.display(),
        report.steps,
        report.cached,
        report.ran.len(),
        report
            .boot
            .map(|b| format!(" (build VM boot {:.2}s)", b.as_secs_f64()))
            .unwrap_or_default(),
        t.elapsed().as_secs_f64()
    );
    Ok((
        top,
        from_image(format!("{} (FROM {from})", df.display()), &plan.defaults),
    ))
}

fn build_into(a: &BuildArgs, store: &TemplateStore, dir: &Path) -> anyhow::Result<Template> {
    if a.disk_size.is_some() && a.image.is_none() && a.dockerfile.is_none() {
        bail!("--disk-size is for --image or --dockerfile");
    }
    let overlay = dir.join("disk.cdsk");
    // The build VM's own network (in the service's range, from the top; the service takes
    // the lowest), removed when the build ends. Setup commands (and a Dockerfile's RUN
    // steps) resolve names through the host's resolver, as sandboxes do.
    let net = if a.net {
        let range = a.range.range()?;
        Some(
            sandbox::net::own::OwnNetwork::create(
                &range,
                Path::new(sandbox::net::own::OWN_NET_LOCK_DIR),
            )
            .context("the build VM's network")?,
        )
    } else {
        None
    };
    let cmdline = match &net {
        Some(_) => format!("{} {}", a.cmdline, sandbox::net::guest_cmdline()),
        None => a.cmdline.clone(),
    };
    let spec = VmSpec {
        exe: std::env::current_exe().context("finding the clade executable")?,
        kernel: std::path::absolute(a.kernel.as_ref().context("no kernel")?)?,
        initrd: a.initrd.as_deref().map(std::path::absolute).transpose()?,
        cmdline: cmdline.clone(),
        vcpus: a.machine.vcpus,
        mem_mib: a.machine.mem_mib,
        kvm_device: a.machine.kvm_device.clone(),
        net: net.as_ref().map(|n| n.vmm_spec()),
        test_device: a.test_device,
        agent_timeout: Duration::from_secs_f64(a.agent_timeout.max(0.1)),
        // The CLI's build runs as its user, on what that user gave it.
        confine: None,
        network: None,
    };
    let (base, image) = match (&a.image, &a.dockerfile) {
        (Some(img), _) => {
            let (b, f) = image_base(a, img)?;
            (Some(b), Some(f))
        }
        (None, Some(df)) => {
            let (b, f) = dockerfile_base(a, df, &spec)?;
            (Some(b), Some(f))
        }
        (None, None) => (a.disk.clone(), None),
    };
    if let Some(base) = &base {
        disk::ops::create_overlay(&overlay, &std::path::absolute(base)?)
            .with_context(|| format!("overlay on {}", base.display()))?;
    }
    let start = a.start_cmd.as_ref().map(|cmd| {
        let d = image.as_ref();
        clade_builder::vm::StartCmd {
            cmd: cmd.clone(),
            ready: a.ready_cmd.clone(),
            env: d
                .map(|i| i.env.clone().into_iter().collect())
                .unwrap_or_default(),
            cwd: d.map(|i| i.cwd.clone()).unwrap_or_default(),
            user: d.map(|i| i.user.clone()).unwrap_or_default(),
            ready_timeout: Duration::from_secs_f64(a.agent_timeout.max(0.1)),
        }
    });
    clade_builder::vm::snapshot_template(
        &spec,
        dir,
        base.is_some().then_some(overlay.as_path()),
        &a.run,
        start.as_ref(),
        &store.snapshot_dir(&a.name)?,
    )?;
    // What a sandbox whose memory was dropped boots from its own disk.
    let boot = store.keep_boot(&a.name, &spec.kernel, a.initrd.as_deref(), &cmdline)?;
    let t = Template {
        name: a.name.clone(),
        vcpus: a.machine.vcpus,
        mem_mib: a.machine.mem_mib,
        disk: base.is_some(),
        test_guest: a.test_device,
        created_ms: sandbox::ids::now_ms(),
        setup: a.run.clone(),
        net: net.is_some(),
        image,
        boot: Some(boot),
        build_id: None,
    };
    // The build VM has ended: its network goes (dropping the handle removes it).
    drop(net);
    store.finish(&t)?;
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::BASE_DOCKERFILE;

    #[test]
    fn the_base_template_is_e2bs_shape() {
        let p = clade_builder::dockerfile::parse(BASE_DOCKERFILE).unwrap();
        let args = Default::default();
        assert_eq!(p.base_image(&args).unwrap(), "debian:bookworm");
        let plan = p.plan(&Default::default(), &args).unwrap();
        assert_eq!(plan.steps.len(), 2);
        assert_eq!(plan.defaults.user, "user");
        assert_eq!(plan.defaults.cwd, "/home/user");
        // Both RUN steps as root, before USER.
        assert!(plan.steps.iter().all(|s| s.user.is_empty()));
        let b = [("BASE".to_string(), "ubuntu:24.04".to_string())].into();
        assert_eq!(p.base_image(&b).unwrap(), "ubuntu:24.04");
    }
}
