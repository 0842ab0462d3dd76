//! `clade run|restore --net auto`: the VM gets a network of its own (namespace, veth pair,
//! NAT to the host's network, a TAP inside the namespace, DNS on its gateway; see
//! `sandbox::net::own`), made before the VM starts and removed when it ends.
//!
//! The network is made and owned by this process, which then runs the VM as a child
//! `clade` with the same arguments but `--net fd=N`, the TAP in the new namespace opened
//! here and inherited (and, for `run`, the guest's addresses on the kernel command line);
//! with `--jail`, the jailed VMM takes it as it must, by descriptor. The VMM process stays
//! what it always is (its system-call filter has no room for netlink, `nft` or a DNS
//! forwarder), and the network outlives any way the VMM ends. The child is killed if
//! this process dies; a network left behind then (SIGKILL) is removed by the next
//! `--net auto` that takes its index.

use std::ffi::OsString;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use devices::virtio::net::tap::Tap;
use sandbox::net::own::{OwnNetwork, OWN_NET_LOCK_DIR};

/// The own networks' range: its namespace names (`/run/netns/cladevm-<i>`) and host veth
/// prefix (`cxh<i>`) differ from `clade serve`'s, so a service's sweep leaves them alone.
const OWN_NET_NAME: &str = "cladevm";
const OWN_NET_LINK: &str = "cx";

/// Options of `--net auto`.
#[derive(Debug, Args)]
pub struct OwnNetArgs {
    /// With `--net auto`: the IPv4 range the network's outer address comes from (a /30
    /// per VM); it must not overlap addresses the host uses.
    #[arg(long, value_name = "CIDR", default_value = "10.201.0.0/16")]
    own_net_range: String,
}

/// What `--net` asks for: a network of its own, or a TAP as given.
#[derive(Debug, Clone)]
pub enum NetArg<T> {
    /// `auto`.
    Auto,
    /// Anything else, parsed.
    Given(T),
}

/// `--net`'s value: `auto`, or what `given` accepts.
pub fn parse_net_arg<T>(
    spec: &str,
    given: impl Fn(&str) -> Result<T, String>,
) -> Result<NetArg<T>, String> {
    match spec {
        "auto" => Ok(NetArg::Auto),
        _ => given(spec).map(NetArg::Given),
    }
}

impl<T> NetArg<T> {
    /// The given value (None for `auto`, which never reaches a VMM).
    pub fn given(self) -> Option<T> {
        match self {
            NetArg::Auto => None,
            NetArg::Given(t) => Some(t),
        }
    }
}

/// Makes the VM's own network and runs this command again as a child with `--net`
/// naming its TAP (and `guest_cmdline`, for `run`: the kernel command line with the
/// guest's addresses); returns the child's exit status once the network is removed.
pub fn run_with_own_network(
    args: &OwnNetArgs,
    guest_cmdline: Option<String>,
) -> anyhow::Result<u8> {
    let cidr = hostnet::parse_cidr(&args.own_net_range)?;
    let range = hostnet::NetRange::new(cidr, OWN_NET_NAME, OWN_NET_LINK)?;
    let stop = vmm::host::stop_on_signals()?;
    let net = OwnNetwork::create(&range, Path::new(OWN_NET_LOCK_DIR))
        .context("making the VM's own network (--net auto)")?;
    // The TAP opened here and inherited as a descriptor: the VMM needs no way into the
    // namespace, and a jailed one (which cannot open a TAP by name) takes it the same way.
    let tap_name = net.tap_name();
    let tap = hostnet::in_netns(net.netns_path(), move || Tap::open(tap_name))?
        .context("opening the network's TAP")?;
    let fd = tap.as_fd().try_clone_to_owned()?;
    let mut argv = without_options(std::env::args_os().skip(1), &["--net", "--cmdline"]);
    argv.push("--net".into());
    argv.push(format!("fd={}", fd.as_raw_fd()).into());
    if let Some(c) = guest_cmdline {
        argv.push("--cmdline".into());
        argv.push(c.into());
    }
    let exe = std::env::current_exe().context("finding the clade executable")?;
    let mut cmd = Command::new(exe);
    vmm::host::clean_child(&mut cmd).args(&argv);
    sandbox::vmproc::inherit_descriptor(&mut cmd, fd.as_raw_fd());
    sandbox::vmproc::end_with_this_process(&mut cmd);
    let mut child = cmd.spawn().context("starting the VM")?;
    let mut forwarded = false;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        let signal = stop.load(std::sync::atomic::Ordering::SeqCst);
        if signal != 0 && !forwarded {
            // SAFETY: kill(2) on the child's pid, which is ours until we wait for it.
            unsafe { libc::kill(child.id() as i32, signal) };
            forwarded = true;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    drop((fd, tap, net));
    Ok(match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(sig)) => 128u8.saturating_add(sig as u8),
        (None, None) => 1,
    })
}

/// `argv` without the options in `names` and their values (`--name VALUE` or
/// `--name=VALUE`).
fn without_options(argv: impl Iterator<Item = OsString>, names: &[&str]) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut skip_value = false;
    for a in argv {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        let s = a.to_string_lossy();
        if names.contains(&s.as_ref()) {
            skip_value = true;
        } else if !names.iter().any(|n| s.starts_with(&format!("{n}="))) {
            out.push(a);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vm_child_gets_the_arguments_without_the_rewritten_options() {
        let argv = [
            "run",
            "--kernel",
            "k",
            "--net",
            "auto",
            "--cmdline=console=ttyS0",
            "--net-range",
            "x",
            "--cmdline",
            "a b",
            "--vsock",
            "v",
        ]
        .map(OsString::from);
        let out = without_options(argv.into_iter(), &["--net", "--cmdline"]);
        let out: Vec<_> = out.iter().map(|s| s.to_str().unwrap()).collect();
        assert_eq!(
            out,
            ["run", "--kernel", "k", "--net-range", "x", "--vsock", "v"]
        );
        assert!(matches!(
            parse_net_arg("auto", |_| Err::<(), _>("no".into())),
            Ok(NetArg::Auto)
        ));
        assert!(parse_net_arg("tap=x", |_| Err::<(), _>("no".into())).is_err());
    }
}
