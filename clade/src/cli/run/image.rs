//! `clade run --image REF [-- CMD …]`: a sandbox straight from a container image, with
//! Clade's guest kernel and agent. The image becomes a template once (`clade template build
//! --image`, in the state directory: `--state-dir`, `$CLADE_HOME`, or
//! `~/.local/share/clade`); every run restores that template's snapshot into a VM process
//! of its own on a fresh disk overlay, runs the command in it through the agent (as the
//! image's user, in its working directory, with its environment), and ends the VM. The
//! kernel and initramfs: `--kernel`/`--initrd`, else `<state dir>/guest/vmlinuz` and
//! `<state dir>/guest/initrd` (`scripts/install-guest.sh` puts Debian's kernel and Clade's
//! initramfs there).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use sandbox::TemplateStore;
use sha2::{Digest, Sha256};
use vmm::agent::{Client, Transport};

use super::RunArgs;

/// The template an image becomes: named by the reference (a registry image) or by the
/// path and its modification time (a layout or archive: a rebuilt one is converted again).
fn template_name(image: &str) -> anyhow::Result<String> {
    let mut h = Sha256::new();
    let p = Path::new(image);
    if p.exists() {
        let real = std::fs::canonicalize(p)?;
        let stamp = if real.is_dir() {
            real.join("index.json")
        } else {
            real.clone()
        };
        let m = std::fs::metadata(&stamp)
            .or_else(|_| std::fs::metadata(real.join("manifest.json")))
            .with_context(|| format!("{}", stamp.display()))?;
        h.update(format!("path\0{}\0{:?}", real.display(), m.modified().ok()));
    } else {
        h.update(format!("reference\0{image}"));
    }
    let d = h.finalize();
    Ok(format!(
        "image-{}",
        d[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    ))
}

/// Ends the VM process (asked, then killed) and removes its run directory.
struct RunningVm {
    child: std::process::Child,
    dir: PathBuf,
    api: PathBuf,
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        clade_builder::vm::stop_vm_process(&mut self.child, &self.api);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(super) fn run_image(image: String, a: RunArgs) -> anyhow::Result<u8> {
    let state = match &a.state_dir {
        Some(d) => std::path::absolute(d)?,
        None => super::super::clade_home()?,
    };
    vmm::host::private_dir(&state)
        .with_context(|| format!("the state directory {}", state.display()))?;
    let exe = std::env::current_exe().context("finding the clade executable")?;
    let store = TemplateStore::new(&state);
    let name = template_name(&image)?;
    let t0 = Instant::now();
    let built = match store.get(&name) {
        Ok(_) => None,
        Err(sandbox::Error::TemplateNotFound(_)) => {
            let guest = state.join("guest");
            let kernel = match &a.kernel {
                Some(k) => std::path::absolute(k)?,
                None => guest.join("vmlinuz"),
            };
            if !kernel.is_file() {
                bail!(
                    "no guest kernel: give --kernel, or put one at {} (scripts/install-guest.sh \
                     installs Debian's kernel and Clade's initramfs there)",
                    kernel.display()
                );
            }
            let initrd = match &a.initrd {
                Some(i) => Some(std::path::absolute(i)?),
                None => Some(guest.join("initrd")).filter(|p| p.is_file()),
            };
            let mut cmdline = a.cmdline.clone();
            for part in ["quiet", "clade.root=/dev/vda"] {
                if !cmdline.split_whitespace().any(|w| w == part) {
                    cmdline = format!("{cmdline} {part}");
                }
            }
            let mut cmd = Command::new(&exe);
            cmd.args(["template", "build", &name, "--image", &image])
                .arg("--kernel")
                .arg(&kernel)
                .arg("--cmdline")
                .arg(&cmdline)
                .arg("--state-dir")
                .arg(&state)
                .arg("--vcpus")
                .arg(a.machine.vcpus.to_string())
                .arg("--mem")
                .arg(a.machine.mem_mib.to_string())
                .arg("--kvm-device")
                .arg(&a.machine.kvm_device);
            if let Some(i) = &initrd {
                cmd.arg("--initrd").arg(i);
            }
            let status = cmd
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .status()
                .context("converting the image")?;
            if !status.success() {
                bail!("converting {image} into a template failed ({status})");
            }
            Some(t0.elapsed())
        }
        Err(e) => return Err(e.into()),
    };
    let template = store.get(&name)?;
    // A VM process restored from the template's snapshot, on an overlay of its own.
    let dir = state
        .join("run")
        .join(format!("{}-{}", std::process::id(), sandbox::ids::now_ms()));
    std::fs::create_dir_all(&dir)?;
    let (vsock, api) = (dir.join("vm.vsock"), dir.join("vm.api"));
    let log = std::fs::File::create(dir.join("vm.log"))?;
    let t1 = Instant::now();
    let child = vmm::host::clean_child(&mut Command::new(&exe))
        .arg("restore")
        .arg(store.snapshot_dir(&name)?)
        .arg("--vsock")
        .arg(&vsock)
        .arg("--api-sock")
        .arg(&api)
        .arg("--serial-file")
        .arg(dir.join("vm.serial"))
        .arg("--disk-overlay")
        .arg(dir.join("disk.cdsk"))
        .arg("--kvm-device")
        .arg(&a.machine.kvm_device)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting the VM")?;
    let mut vm = RunningVm {
        child,
        dir: dir.clone(),
        api,
    };
    let agent = loop {
        if let Some(st) = vm.child.try_wait()? {
            bail!(
                "the VM ended ({st}): {}",
                std::fs::read_to_string(dir.join("vm.log")).unwrap_or_default()
            );
        }
        if vsock.exists() {
            if let Ok(c) = Client::connect_timeout(
                &vsock,
                Transport::Vsock { port: 52 },
                Duration::from_secs(10),
            ) {
                if c.ping().is_ok() {
                    break c;
                }
            }
        }
        if t1.elapsed() > Duration::from_secs(60) {
            bail!("the VM's agent did not answer in 60 s");
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let woke = t1.elapsed();
    let defaults = template
        .image
        .clone()
        .unwrap_or_else(|| sandbox::template::FromImage {
            reference: image.clone(),
            env: Default::default(),
            cwd: String::new(),
            user: String::new(),
            start_cmd: Vec::new(),
        });
    let user = if defaults.user.is_empty() {
        None
    } else {
        let (u, g) = clade_builder::vm::resolve_user(&agent, 0, &defaults.user)?;
        Some((u, Some(g)))
    };
    agent.close();
    eprintln!(
        "clade: {image}: template {name} ({}), VM restored and its agent answering in {:.2} ms",
        match built {
            Some(d) => format!("converted in {:.2}s", d.as_secs_f64()),
            None => "cached".into(),
        },
        woke.as_secs_f64() * 1e3
    );
    let command: Vec<OsString> = if !a.command.is_empty() {
        a.command.clone()
    } else if !defaults.start_cmd.is_empty() {
        defaults.start_cmd.iter().map(OsString::from).collect()
    } else {
        vec!["/bin/sh".into()]
    };
    let mut env: Vec<(OsString, OsString)> = defaults
        .env
        .iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
    if !env.iter().any(|(k, _)| k == "TERM") {
        if let Some(t) = std::env::var_os("TERM") {
            env.push(("TERM".into(), t));
        }
    }
    let cwd = Some(defaults.cwd.clone())
        .filter(|c| !c.is_empty())
        .map(PathBuf::from);
    let code = super::super::exec::exec_in(&vsock, command, env, cwd, user);
    drop(vm);
    code
}
