//! The host-wide part of sandbox networking, and sweeping what crashes leave behind.
//!
//! [`HostNet::init`] turns forwarding on and installs the host's table (masquerade of the
//! range toward other networks, no access from a sandbox to the host or to another
//! sandbox; see `nft.rs`). It is idempotent: the table is replaced whole in one
//! transaction. Forwarding is left on when the service stops (other users of the host may
//! rely on it too), and so is the table unless [`HostNet::remove`] is called.
//!
//! [`sweep`] removes the namespaces and host veth ends of one [`NetRange`] whose index the
//! caller does not claim: after a crash of the service (nothing destroyed) or of a VMM (a
//! sandbox the service forgot). A sandbox's rules live in its namespace and go with it, so
//! there are no per-sandbox host rules to sweep.

use std::path::Path;

use crate::range::{NetRange, NETNS_DIR};
use crate::{io_err, netlink, netns, nft, Result};

/// The host-wide setup for one [`NetRange`].
#[derive(Debug, Clone)]
pub struct HostNet {
    range: NetRange,
}

impl HostNet {
    /// Enables `net.ipv4.ip_forward` and (re)installs the host table `<name>`.
    pub fn init(range: &NetRange) -> Result<HostNet> {
        range.validate()?;
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
            .map_err(io_err("enable net.ipv4.ip_forward"))?;
        let glob = format!("{}h*", range.link_prefix);
        nft::apply(
            None,
            &nft::host_table(&range.host_table(), &range.cidr, &glob),
        )?;
        tracing::info!(table = %range.host_table(), range = %range.cidr, "host network rules installed");
        Ok(HostNet {
            range: range.clone(),
        })
    }

    /// The range this was set up for.
    pub fn range(&self) -> &NetRange {
        &self.range
    }

    /// Removes the host table (forwarding stays on).
    pub fn remove(self) -> Result<()> {
        nft::apply(None, &nft::delete_table_doc(&self.range.host_table()))
    }
}

/// What [`sweep`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    /// Indexes whose namespace was removed.
    pub namespaces: Vec<u32>,
    /// Indexes whose host veth end was removed.
    pub veths: Vec<u32>,
}

/// Removes every namespace (`/run/netns/<name>-<i>`) and host veth (`<link_prefix>h<i>`)
/// of `range` whose index is not in `keep`, and says which.
pub fn sweep(range: &NetRange, keep: &[u32]) -> Result<Swept> {
    range.validate()?;
    let mut swept = Swept::default();
    let r = range.clone();
    let keep_v = keep.to_vec();
    swept.veths = netns::on_thread(move || {
        let rt = netlink::runtime()?;
        let host = netlink::connect(&rt)?;
        rt.block_on(async {
            let mut gone = Vec::new();
            for name in netlink::link_names(&host).await? {
                let Some(i) = r.parse_host_veth(&name) else {
                    continue;
                };
                if !keep_v.contains(&i) && netlink::del_link(&host, &name).await? {
                    gone.push(i);
                }
            }
            Ok(gone)
        })
    })?;
    let entries = match std::fs::read_dir(NETNS_DIR) {
        Ok(e) => e.filter_map(|e| e.ok()).collect::<Vec<_>>(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(io_err(format!("list {NETNS_DIR}"))(e)),
    };
    for entry in entries {
        let name = entry.file_name();
        let Some(i) = name.to_str().and_then(|n| range.parse_netns_name(n)) else {
            continue;
        };
        if !keep.contains(&i) && netns::remove(&Path::new(NETNS_DIR).join(&name))? {
            swept.namespaces.push(i);
        }
    }
    swept.veths.sort_unstable();
    swept.namespaces.sort_unstable();
    if swept != Swept::default() {
        tracing::warn!(?swept, "removed leaked sandbox networks");
    }
    Ok(swept)
}
