//! The rtnetlink requests this crate makes, and the small runtime they run on.
//!
//! rtnetlink is async (tokio); this crate's API is blocking, so each call builds a
//! current-thread runtime on its own thread (see `netns::on_thread`) and opens its netlink
//! sockets there. A socket belongs to the namespace of the thread that opened it, which is
//! how one thread talks to the host's and a sandbox's namespace at once.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::RawFd;

use futures_util::TryStreamExt;
use netlink_packet_route::link::{InfoData, InfoVeth, LinkAttribute, LinkMessage};
use rtnetlink::{Handle, LinkUnspec, LinkVeth, RouteMessageBuilder};

use crate::{io_err, Error, Result};

/// A runtime for the netlink connections of one call.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(io_err("build a tokio runtime"))
}

/// A netlink connection in the calling thread's current namespace, driven by `rt`.
pub(crate) fn connect(rt: &tokio::runtime::Runtime) -> Result<Handle> {
    // The socket registers with the runtime's reactor as it is made.
    let _ctx = rt.enter();
    let (conn, handle, _) = rtnetlink::new_connection().map_err(io_err("open a netlink socket"))?;
    rt.spawn(conn);
    Ok(handle)
}

fn nl(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> Error {
    let what = what.into();
    move |source| Error::Netlink { what, source }
}

fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| -c.get()),
        _ => None,
    }
}

/// The index of link `name`, if it exists.
pub(crate) async fn link_index(h: &Handle, name: &str) -> Result<Option<u32>> {
    let mut links = h.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(link)) => Ok(Some(link.header.index)),
        Ok(None) => Ok(None),
        Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(None),
        Err(e) => Err(nl(format!("look up link {name}"))(e)),
    }
}

/// The index of link `name`, which must exist.
pub(crate) async fn must_link_index(h: &Handle, name: &str) -> Result<u32> {
    link_index(h, name)
        .await?
        .ok_or_else(|| Error::Config(format!("link {name} does not exist")))
}

/// Names of all links.
pub(crate) async fn link_names(h: &Handle) -> Result<Vec<String>> {
    let links: Vec<LinkMessage> = h
        .link()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl("list links"))?;
    Ok(links
        .iter()
        .filter_map(|l| {
            l.attributes.iter().find_map(|a| match a {
                LinkAttribute::IfName(n) => Some(n.clone()),
                _ => None,
            })
        })
        .collect())
}

/// A veth pair: `name` here, `peer` created directly in the namespace `peer_ns` (so a
/// fixed peer name never collides in this namespace).
pub(crate) async fn add_veth(h: &Handle, name: &str, peer: &str, peer_ns: RawFd) -> Result<()> {
    let peer_msg = LinkUnspec::new_with_name(peer).setns_by_fd(peer_ns).build();
    let msg = LinkVeth::new(name, peer)
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer_msg)))
        .build();
    h.link()
        .add(msg)
        .execute()
        .await
        .map_err(nl(format!("add veth {name} (peer {peer})")))
}

/// Sets a link up, and its MAC address if given.
pub(crate) async fn link_up(h: &Handle, index: u32, mac: Option<[u8; 6]>) -> Result<()> {
    let mut b = LinkUnspec::new_with_index(index).up();
    if let Some(mac) = mac {
        b = b.address(mac.to_vec());
    }
    h.link()
        .set(b.build())
        .execute()
        .await
        .map_err(nl(format!("set link {index} up")))
}

/// Adds `ip/prefix` to a link.
pub(crate) async fn add_addr(h: &Handle, index: u32, ip: Ipv4Addr, prefix: u8) -> Result<()> {
    h.address()
        .add(index, IpAddr::V4(ip), prefix)
        .execute()
        .await
        .map_err(nl(format!("add address {ip}/{prefix} to link {index}")))
}

/// Adds the default route via `gw`.
pub(crate) async fn add_default_route(h: &Handle, gw: Ipv4Addr) -> Result<()> {
    let route = RouteMessageBuilder::<Ipv4Addr>::new().gateway(gw).build();
    h.route()
        .add(route)
        .execute()
        .await
        .map_err(nl(format!("add default route via {gw}")))
}

/// Deletes link `name`. `Ok(false)` if there was none.
pub(crate) async fn del_link(h: &Handle, name: &str) -> Result<bool> {
    let Some(index) = link_index(h, name).await? else {
        return Ok(false);
    };
    match h.link().del(index).execute().await {
        Ok(()) => Ok(true),
        Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(false),
        Err(e) => Err(nl(format!("delete link {name}"))(e)),
    }
}
