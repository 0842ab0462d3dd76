//! A network of its own for one VM outside the host service: `clade run|restore --net
//! auto` and `clade template build --net`. The same sandbox network the service gives its
//! sandboxes (namespace, veth pair, NAT, persistent TAP, allow-all egress) and a DNS
//! forwarder on its gateway, at a free index of a range taken from the top (a service on
//! the same range takes the lowest), removed when the handle is dropped.
//!
//! Nothing else keeps a record of these networks, so each is claimed through a lock file,
//! `<dir>/<range name>-<index>.lock`: its holder keeps it locked (`flock`, released by the
//! kernel when the process dies, however it dies) and writes its pid into it while the
//! network exists (emptied when the network is removed). A taker that can lock an index
//! whose file still names a process found a network left by one that died (SIGKILL, a
//! crash): it removes that first. An index whose namespace exists without such a record
//! (the service's, or anyone else's) is left alone and skipped. Lock files are never
//! removed: removing one while another process opens it would let two processes lock two
//! different files of the same name.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use hostnet::{EgressPolicy, HostNet, NetRange, SandboxNet};

use super::dns::{self, Forwarder};
use super::net_err;
use crate::error::{Error, Result};

/// Where the lock files of networks outside the service live.
pub const OWN_NET_LOCK_DIR: &str = "/run/clade/own-net";

/// A VM's own network; removed when dropped (see the module documentation).
pub struct OwnNetwork {
    /// Dropped first: the forwarder's socket lives in the namespace.
    dns: Option<Forwarder>,
    net: Option<SandboxNet>,
    lock: File,
    lock_path: PathBuf,
}

impl OwnNetwork {
    /// Makes a network at the highest free index of `range`, with its lock file in
    /// `lock_dir` (normally [`OWN_NET_LOCK_DIR`]). Its DNS forwarder asks the first
    /// resolver of the host's `/etc/resolv.conf` (none there: the guest has no DNS).
    /// Needs root, like every sandbox network.
    pub fn create(range: &NetRange, lock_dir: &Path) -> Result<OwnNetwork> {
        HostNet::init(range).map_err(net_err("host network set-up"))?;
        std::fs::create_dir_all(lock_dir).map_err(Error::io("creating", lock_dir))?;
        for index in (0..range.capacity()).rev() {
            let lock_path = lock_dir.join(format!("{}-{index}.lock", range.name));
            let mut lock = File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&lock_path)
                .map_err(Error::io("opening", &lock_path))?;
            match lock.try_lock() {
                Ok(()) => {}
                // A live process holds it.
                Err(std::fs::TryLockError::WouldBlock) => continue,
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(Error::io("locking", &lock_path)(e))
                }
            }
            let mut holder = String::new();
            lock.read_to_string(&mut holder)
                .map_err(Error::io("reading", &lock_path))?;
            if !holder.trim().is_empty() {
                // Its holder died with the network up: remove what it left.
                tracing::warn!(
                    index,
                    holder = holder.trim(),
                    "removing the network a process that ended left behind"
                );
                if range.netns_path(index).exists() {
                    SandboxNet::adopt(range, index)
                        .and_then(SandboxNet::destroy)
                        .map_err(net_err("removing a network left behind"))?;
                }
                set_holder(&mut lock, &lock_path, None)?;
            }
            // Recorded before the network exists: a death in between is found as above.
            set_holder(&mut lock, &lock_path, Some(std::process::id()))?;
            match SandboxNet::create(range, index) {
                Ok(net) => {
                    let dns = start_dns(&net)?;
                    tracing::info!(index, netns = %net.netns_path().display(), "own network made");
                    return Ok(OwnNetwork {
                        dns,
                        net: Some(net),
                        lock,
                        lock_path,
                    });
                }
                // Someone else's (the service's): not ours to touch.
                Err(hostnet::Error::Exists(_)) => set_holder(&mut lock, &lock_path, None)?,
                Err(e) => {
                    set_holder(&mut lock, &lock_path, None)?;
                    return Err(net_err("making the network")(e));
                }
            }
        }
        Err(Error::Network(format!(
            "no free index in {} for a network of its own",
            range.cidr
        )))
    }

    /// The VMM's `--net` value: the TAP inside the network's namespace.
    pub fn vmm_spec(&self) -> String {
        let net = self.net();
        format!(
            "tap={},netns={}",
            net.tap_name(),
            net.netns_path().display()
        )
    }

    /// The TAP's name inside the namespace.
    pub fn tap_name(&self) -> &'static str {
        self.net().tap_name()
    }

    /// The network's namespace.
    pub fn netns_path(&self) -> &Path {
        self.net().netns_path()
    }

    fn net(&self) -> &SandboxNet {
        self.net
            .as_ref()
            .expect("only taken when the network is dropped")
    }
}

impl Drop for OwnNetwork {
    fn drop(&mut self) {
        drop(self.dns.take());
        if let Some(net) = self.net.take() {
            match net.destroy() {
                // Removed: the record goes. Not removed: it stays, for the next taker.
                Ok(()) => {
                    if let Err(e) = set_holder(&mut self.lock, &self.lock_path, None) {
                        tracing::warn!("{e}");
                    }
                }
                Err(e) => tracing::warn!("removing the VM's own network: {e}"),
            }
        }
    }
}

/// Writes `pid` (or nothing) as the holder recorded in a lock file.
fn set_holder(lock: &mut File, path: &Path, pid: Option<u32>) -> Result<()> {
    let text = pid.map(|p| format!("{p}\n")).unwrap_or_default();
    lock.set_len(0)
        .and_then(|()| lock.rewind())
        .and_then(|()| lock.write_all(text.as_bytes()))
        .and_then(|()| lock.sync_data())
        .map_err(Error::io("writing", path))
}

/// The network's DNS forwarder (allow-all), if the host names a resolver.
fn start_dns(net: &SandboxNet) -> Result<Option<Forwarder>> {
    let resolv = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    let Some(upstream) = dns::upstream_from(&resolv) else {
        tracing::warn!("no nameserver in /etc/resolv.conf: the guest gets no DNS");
        return Ok(None);
    };
    Forwarder::start(
        net.netns_path(),
        SocketAddr::new(hostnet::GUEST_GATEWAY.into(), 53),
        upstream,
        &EgressPolicy::allow_all(),
    )
    .map(Some)
}
