//! `clade template build|ls|rm|prune` (what sandboxes start from).
//!
//! A template build is an ordinary `clade run` child with an API and a vsock socket: this
//! command waits for its agent, runs the setup commands through it, snapshots it into
//! `<state dir>/templates/<name>/snapshot` and stops it. Only then is `template.json`
//! written, so `clade serve` never sees half a template. A base disk from a container image
//! or a Dockerfile is made first (`template/base_layer.rs`).

mod base_layer;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clade_builder::vm::VmSpec;
use clap::{Args, Subcommand};
use sandbox::{Template, TemplateStore};

use super::NetRangeArgs;
use crate::cli::MachineArgs;
use base_layer::{dockerfile_base, image_base};

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
    #[arg(long, value_name = "SIZE", value_parser = crate::cli::disk::parse_size)]
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
const BASE_DOCKERFILE: &str = include_str!("../base.Dockerfile");

fn build(mut a: BuildArgs) -> anyhow::Result<u8> {
    // The installed guest unless one is given.
    if a.kernel.is_none() {
        let guest = crate::cli::clade_home()?.join("guest");
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
