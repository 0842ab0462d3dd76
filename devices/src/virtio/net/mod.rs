//! virtio-net (device id 1) over a TAP device ([`tap::Tap`]), or any other [`NetBackend`].
//!
//! What the guest sees:
//! - two queues: receive (index 0) and transmit (index 1), [`QUEUE_SIZE`] entries each; no
//!   control queue, one queue pair;
//! - features: `VIRTIO_NET_F_MAC`, `VIRTIO_NET_F_STATUS` (the link is always up),
//!   `VIRTIO_NET_F_MRG_RXBUF`, and, when the backend can take them (a TAP whose kernel accepts
//!   `TUNSETOFFLOAD` with checksum and TSO), the offloads `CSUM`, `GUEST_CSUM`,
//!   `HOST_TSO4/6`, `GUEST_TSO4/6`, plus `HOST_UFO`/`GUEST_UFO` when it also accepts
//!   `TUN_F_UFO`. (Linux guests have not sent UFO since 4.14; the host kernel still takes
//!   and segments it, so offering it costs nothing.) The transport adds `VERSION_1`, so every
//!   frame on both queues starts with the 12-byte `struct virtio_net_hdr_v1`;
//! - config space (read-only): `mac[6]` at 0, `le16 status` at 6 (`VIRTIO_NET_S_LINK_UP`).
//!
//! The vnet header goes to and from the TAP unchanged (the TAP is set up with a 12-byte
//! vnet header, `TUNSETVNETHDRSZ`), so checksum and segmentation offloads are the host
//! kernel's work. On transmit the header is checked against the negotiated features first
//! (a guest may only ask for the offloads it accepted, see [`VnetHeader::check_tx`]). On
//! receive the TAP hands us offloaded frames only as far as the guest accepted them: the
//! worker sets `TUNSETOFFLOAD` from the driver's `GUEST_*` features when it starts.
//!
//! # Receive buffers: mergeable
//!
//! A frame from the TAP (up to [`MAX_FRAME_LEN`] bytes with TSO) is written across as many
//! receive chains as it needs, and the header's `num_buffers` says how many
//! (`VIRTIO_NET_F_MRG_RXBUF`). That is what Linux prefers: it posts page-sized buffers and a
//! 64 KiB GSO frame takes as many as it needs, instead of the "big packets" mode where every
//! chain must hold 64 KiB (17 pages per ring entry, whatever the traffic). A driver that
//! does not accept MRG_RXBUF gets each frame in one chain, or the frame is dropped when it
//! does not fit (the chain stays available). A frame for which the ring has too few buffers
//! waits (the worker stops reading the TAP, so the host kernel queues or drops, as a NIC
//! would) until the driver posts more.
//!
//! # Untrusted chains
//!
//! Every chain is walked once before any buffer is mapped: at most [`QUEUE_SIZE`]
//! descriptors, all in the right direction (transmit: device-readable only; receive:
//! device-writable only), a transmit chain of [`VNET_HDR_LEN`]..=[`MAX_FRAME_LEN`] bytes, a
//! chain that ends; then every buffer must lie in guest memory (virtio-queue's
//! `Reader`/`Writer`). A bad transmit chain is returned with used length 0 and its frame
//! dropped; a bad receive chain is returned with used length 0 (with the chains already
//! taken for the same frame, whose frame is dropped). Both are logged (rate-limited) and
//! counted. Frames move through two fixed bounce buffers of [`MAX_FRAME_LEN`] bytes; a
//! worker turn handles at most [`ROUND_FRAMES`] frames each way, so the event loop that
//! vsock and the disk share stays responsive.
//!
//! # Snapshot and restore
//!
//! The device saves its MAC and the features it offered ([`NetState`]); the transport saves
//! the rest (features acked, queues and their positions). The TAP is the VMM's to reopen for
//! the restored VM; it must offer at least the offloads the saved device offered. A frame
//! read from the TAP but not yet in guest memory when the VM is saved is lost, like any
//! frame in flight.
//!
//! # What a Linux guest needs
//!
//! `CONFIG_VIRTIO_NET` (Debian: the `virtio_net` module, which depends on `net_failover` and
//! `failover`) and `CONFIG_VIRTIO_MMIO`, which finds the device through the ACPI DSDT entry
//! the VMM writes for every virtio-mmio slot (`LNRO0005`), or `virtio_mmio.device=` on the
//! command line.

pub mod tap;
mod worker;

#[cfg(test)]
mod tests;

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
    VIRTIO_NET_F_GUEST_UFO, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_HOST_UFO,
    VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_F_STATUS, VIRTIO_NET_HDR_F_NEEDS_CSUM,
    VIRTIO_NET_HDR_GSO_ECN, VIRTIO_NET_HDR_GSO_NONE, VIRTIO_NET_HDR_GSO_TCPV4,
    VIRTIO_NET_HDR_GSO_TCPV6, VIRTIO_NET_HDR_GSO_UDP, VIRTIO_NET_S_LINK_UP,
};

use super::worker::{take_queues, DeviceWorker, QueueWorker};
use super::{Interrupt, QueuePosition, VirtQueue, VirtioDevice, VirtioDeviceState};
use crate::event_loop::LoopHandle;
use crate::{Error, GuestMemory, Result};

pub use worker::NetWorker;

/// virtio device id of a network device.
pub const NET_DEVICE_ID: u32 = virtio_bindings::virtio_ids::VIRTIO_ID_NET;
/// Size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Index of the receive queue.
pub const RX_QUEUE: usize = 0;
/// Index of the transmit queue.
pub const TX_QUEUE: usize = 1;
/// Length of `struct virtio_net_hdr_v1` (with `num_buffers`), in front of every frame.
pub const VNET_HDR_LEN: usize = 12;
/// Largest frame, vnet header included: a 64 KiB GSO packet with its Ethernet and VLAN
/// headers (65550 bytes, the spec's bound for big receive buffers) plus the header.
pub const MAX_FRAME_LEN: usize = 65550 + VNET_HDR_LEN;
/// Most frames handled each way in one turn on the event loop.
pub const ROUND_FRAMES: usize = 64;
/// The MAC address a device gets when the config names none: locally administered,
/// unicast, the same for every VM (each sits behind its own TAP, in its own namespace).
pub const DEFAULT_MAC: [u8; 6] = [0x06, 0x00, 0xac, 0x10, 0x00, 0x02];
/// Size of the config space we fill: `mac` and `status`.
const CONFIG_SIZE: usize = 8;

/// `TUN_F_*` offload bits, as `TUNSETOFFLOAD` takes them.
pub mod offload {
    /// The TAP may hand us frames with a partial checksum.
    pub const CSUM: u32 = libc::TUN_F_CSUM;
    /// ... TCP over IPv4 segmentation offload frames.
    pub const TSO4: u32 = libc::TUN_F_TSO4;
    /// ... TCP over IPv6 segmentation offload frames.
    pub const TSO6: u32 = libc::TUN_F_TSO6;
    /// ... UDP fragmentation offload frames.
    pub const UFO: u32 = libc::TUN_F_UFO;
}

const fn bit(b: u32) -> u64 {
    1u64 << b
}

/// Features offered with any backend.
const BASE_FEATURES: u64 =
    bit(VIRTIO_NET_F_MAC) | bit(VIRTIO_NET_F_STATUS) | bit(VIRTIO_NET_F_MRG_RXBUF);
/// Features offered when the backend takes checksum and TSO offloads.
const OFFLOAD_FEATURES: u64 = bit(VIRTIO_NET_F_CSUM)
    | bit(VIRTIO_NET_F_GUEST_CSUM)
    | bit(VIRTIO_NET_F_HOST_TSO4)
    | bit(VIRTIO_NET_F_HOST_TSO6)
    | bit(VIRTIO_NET_F_GUEST_TSO4)
    | bit(VIRTIO_NET_F_GUEST_TSO6);
/// Features offered when the backend also takes UFO.
const UFO_FEATURES: u64 = bit(VIRTIO_NET_F_HOST_UFO) | bit(VIRTIO_NET_F_GUEST_UFO);

/// The features a device over a backend with offloads `caps` (`TUN_F_*`) offers.
pub fn features_for(caps: u32) -> u64 {
    let tso = offload::CSUM | offload::TSO4 | offload::TSO6;
    let mut f = BASE_FEATURES;
    if caps & tso == tso {
        f |= OFFLOAD_FEATURES;
        if caps & offload::UFO != 0 {
            f |= UFO_FEATURES;
        }
    }
    f
}

/// The offloads (`TUN_F_*`) the backend may use towards a guest that accepted `features`.
pub fn offloads_for(features: u64) -> u32 {
    let mut o = 0;
    for (f, t) in [
        (VIRTIO_NET_F_GUEST_CSUM, offload::CSUM),
        (VIRTIO_NET_F_GUEST_TSO4, offload::TSO4),
        (VIRTIO_NET_F_GUEST_TSO6, offload::TSO6),
        (VIRTIO_NET_F_GUEST_UFO, offload::UFO),
    ] {
        if features & bit(f) != 0 {
            o |= t;
        }
    }
    o
}

/// The spec's feature dependencies (5.1.3.1): the offloads a driver accepted need the
/// checksum feature of their direction.
pub fn check_feature_dependencies(features: u64) -> std::result::Result<(), String> {
    let needs = [
        (VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_CSUM),
        (VIRTIO_NET_F_GUEST_TSO6, VIRTIO_NET_F_GUEST_CSUM),
        (VIRTIO_NET_F_GUEST_UFO, VIRTIO_NET_F_GUEST_CSUM),
        (VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_CSUM),
        (VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_CSUM),
        (VIRTIO_NET_F_HOST_UFO, VIRTIO_NET_F_CSUM),
    ];
    for (f, need) in needs {
        if features & bit(f) != 0 && features & bit(need) == 0 {
            return Err(format!(
                "feature bit {f} accepted without feature bit {need}, which it depends on"
            ));
        }
    }
    Ok(())
}

/// `struct virtio_net_hdr_v1`, little-endian, in front of every frame.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VnetHeader {
    /// `VIRTIO_NET_HDR_F_*`.
    pub flags: u8,
    /// `VIRTIO_NET_HDR_GSO_*`, possibly with the ECN bit.
    pub gso_type: u8,
    /// Length of the headers to copy into each segment.
    pub hdr_len: u16,
    /// Payload bytes per segment.
    pub gso_size: u16,
    /// Where checksumming starts.
    pub csum_start: u16,
    /// Where the checksum goes, from `csum_start`.
    pub csum_offset: u16,
    /// Receive buffers this frame spans (mergeable receive buffers).
    pub num_buffers: u16,
}

impl VnetHeader {
    /// Parses the first [`VNET_HDR_LEN`] bytes of `b` (`None` if shorter).
    pub fn parse(b: &[u8]) -> Option<Self> {
        let b: &[u8; VNET_HDR_LEN] = b.get(..VNET_HDR_LEN)?.try_into().ok()?;
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        Some(Self {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u16_at(2),
            gso_size: u16_at(4),
            csum_start: u16_at(6),
            csum_offset: u16_at(8),
            num_buffers: u16_at(10),
        })
    }

    /// The header's bytes.
    pub fn to_bytes(&self) -> [u8; VNET_HDR_LEN] {
        let mut b = [0u8; VNET_HDR_LEN];
        b[0] = self.flags;
        b[1] = self.gso_type;
        for (i, v) in [
            self.hdr_len,
            self.gso_size,
            self.csum_start,
            self.csum_offset,
            self.num_buffers,
        ]
        .into_iter()
        .enumerate()
        {
            b[2 + 2 * i..4 + 2 * i].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// A transmitted frame may only ask for the offloads the driver accepted (spec
    /// 5.1.6.2): a partial checksum needs `CSUM`, each GSO type its `HOST_*` feature, and a
    /// GSO frame needs a segment size. (The host kernel checks the offsets against the
    /// frame itself.)
    pub fn check_tx(&self, features: u64) -> std::result::Result<(), String> {
        let has = |f: u32| features & bit(f) != 0;
        if u32::from(self.flags) & VIRTIO_NET_HDR_F_NEEDS_CSUM != 0 && !has(VIRTIO_NET_F_CSUM) {
            return Err("partial checksum without VIRTIO_NET_F_CSUM".into());
        }
        let ecn = u32::from(self.gso_type) & VIRTIO_NET_HDR_GSO_ECN != 0;
        let needed = match u32::from(self.gso_type) & !VIRTIO_NET_HDR_GSO_ECN {
            VIRTIO_NET_HDR_GSO_NONE => {
                if ecn {
                    return Err("ECN bit without a GSO type".into());
                }
                return Ok(());
            }
            VIRTIO_NET_HDR_GSO_TCPV4 => VIRTIO_NET_F_HOST_TSO4,
            VIRTIO_NET_HDR_GSO_TCPV6 => VIRTIO_NET_F_HOST_TSO6,
            VIRTIO_NET_HDR_GSO_UDP => VIRTIO_NET_F_HOST_UFO,
            t => return Err(format!("unknown GSO type {t}")),
        };
        if !has(needed) {
            return Err(format!(
                "GSO type {} without feature bit {needed}",
                self.gso_type
            ));
        }
        if ecn {
            // HOST_ECN is never offered.
            return Err("GSO with ECN, which was not offered".into());
        }
        if self.gso_size == 0 {
            return Err("GSO frame with segment size 0".into());
        }
        Ok(())
    }
}

/// Where frames go to and come from: a TAP device ([`tap::Tap`]) or, in tests, a socket.
/// Every frame starts with a [`VNET_HDR_LEN`]-byte vnet header, both ways.
pub trait NetBackend: Send + Sync {
    /// Reads one frame into `buf` (non-blocking: `WouldBlock` when there is none); a frame
    /// longer than `buf` is truncated.
    fn recv(&self, buf: &mut [u8]) -> std::io::Result<usize>;
    /// Sends one frame.
    fn send(&self, frame: &[u8]) -> std::io::Result<usize>;
    /// The descriptor that polls readable when a frame can be read.
    fn raw_fd(&self) -> RawFd;
    /// The offloads (`TUN_F_*`) the backend can use at all.
    fn offload_capability(&self) -> u32;
    /// Lets the backend hand us frames with offloads `flags` (`TUN_F_*`, within the
    /// capability).
    fn set_offloads(&self, flags: u32) -> std::io::Result<()>;
}

/// What a virtio-net device saves besides its transport: the identity the guest saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    /// The MAC address.
    pub mac: [u8; 6],
    /// The features the device offered (the restored device offers the same).
    pub features: u64,
}

/// What the device counted, at one instant.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NetCounters {
    /// Frames put into guest receive buffers.
    pub rx_frames: u64,
    /// Frames from the backend dropped (no fitting buffers, bad chains, short frames).
    pub rx_dropped: u64,
    /// Frames the guest sent that reached the backend.
    pub tx_frames: u64,
    /// Frames the guest sent that were dropped (bad chains, bad headers, backend errors).
    pub tx_dropped: u64,
}

/// The device's counters, kept across activations and updated by its workers.
#[derive(Debug, Default)]
pub struct NetStats {
    rx_frames: AtomicU64,
    rx_dropped: AtomicU64,
    tx_frames: AtomicU64,
    tx_dropped: AtomicU64,
}

impl NetStats {
    /// The counters now.
    pub fn get(&self) -> NetCounters {
        NetCounters {
            rx_frames: self.rx_frames.load(Ordering::Relaxed),
            rx_dropped: self.rx_dropped.load(Ordering::Relaxed),
            tx_frames: self.tx_frames.load(Ordering::Relaxed),
            tx_dropped: self.tx_dropped.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn count(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// The virtio-net device model: features, configuration space and activation. The data
/// path is [`NetWorker`] on the device event loop.
pub struct NetDevice {
    /// Guest-triggered warnings, across activations.
    log: crate::virtio::mmio::LogLimiter,
    backend: Arc<dyn NetBackend>,
    mac: [u8; 6],
    features: u64,
    stats: Arc<NetStats>,
    worker: DeviceWorker<NetWorker>,
}

impl NetDevice {
    /// A network device with address `mac` over `backend`; the worker will run on
    /// `event_loop`. It offers the offloads the backend can take.
    pub fn new(backend: Arc<dyn NetBackend>, mac: [u8; 6], event_loop: LoopHandle) -> Result<Self> {
        let features = features_for(backend.offload_capability());
        Self::with_features(backend, mac, features, event_loop)
    }

    fn with_features(
        backend: Arc<dyn NetBackend>,
        mac: [u8; 6],
        features: u64,
        event_loop: LoopHandle,
    ) -> Result<Self> {
        if mac[0] & 1 != 0 {
            return Err(Error::Virtio(format!(
                "virtio-net: MAC {} is a multicast address",
                format_mac(&mac)
            )));
        }
        Ok(Self {
            log: crate::virtio::mmio::LogLimiter::new(),
            backend,
            mac,
            features,
            stats: Arc::new(NetStats::default()),
            worker: DeviceWorker::new(event_loop),
        })
    }

    /// A device restored from `state` over `backend` (reopened by the VMM). The backend
    /// must take the offloads the saved device offered: they are set on it, which checks
    /// them in one call (no probe on a restore's path); the worker narrows them to the
    /// ones the guest accepted when it starts. The transport restores the queues.
    pub fn restore(
        state: &NetState,
        backend: Arc<dyn NetBackend>,
        event_loop: LoopHandle,
    ) -> Result<Self> {
        let known = BASE_FEATURES | OFFLOAD_FEATURES | UFO_FEATURES;
        if state.features & !known != 0 || state.features & BASE_FEATURES != BASE_FEATURES {
            return Err(Error::Restore(format!(
                "virtio-net: saved features {:#x} are not ones this device offers",
                state.features
            )));
        }
        let offloads = offloads_for(state.features);
        backend.set_offloads(offloads).map_err(|e| {
            Error::Restore(format!(
                "virtio-net: the TAP does not take the offloads the saved device offered \
                 (TUNSETOFFLOAD {offloads:#x}: {e}); the host kernel must accept the same flags"
            ))
        })?;
        Self::with_features(backend, state.mac, state.features, event_loop)
            .map_err(|e| Error::Restore(e.to_string()))
    }

    /// The MAC address.
    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// The device's counters (frames moved and dropped each way, since it was made).
    pub fn stats(&self) -> Arc<NetStats> {
        Arc::clone(&self.stats)
    }

    fn config(&self) -> [u8; CONFIG_SIZE] {
        let mut c = [0u8; CONFIG_SIZE];
        c[..6].copy_from_slice(&self.mac);
        c[6..8].copy_from_slice(&(VIRTIO_NET_S_LINK_UP as u16).to_le_bytes());
        c
    }
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Parses `aa:bb:cc:dd:ee:ff` (hex digits, either case).
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

impl VirtioDevice for NetDevice {
    fn device_type(&self) -> u32 {
        NET_DEVICE_ID
    }

    fn avail_features(&self) -> u64 {
        self.features
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.config();
        for (i, b) in data.iter_mut().enumerate() {
            *b = offset
                .checked_add(i as u64)
                .and_then(|o| config.get(usize::try_from(o).ok()?).copied())
                .unwrap_or(0);
        }
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // The MAC is writable only for legacy drivers without CTRL_MAC_ADDR.
        tracing::debug!(
            "virtio-net: guest wrote {} bytes of read-only config at {offset:#x}, ignored",
            data.len()
        );
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<VirtQueue>,
        interrupt: Arc<Interrupt>,
        features: u64,
    ) -> Result<()> {
        check_feature_dependencies(features)
            .map_err(|e| Error::Virtio(format!("virtio-net: {e}")))?;
        let queues = take_queues(
            NetWorker::NAME,
            queues,
            &[(RX_QUEUE, "receive"), (TX_QUEUE, "transmit")],
        )?;
        let worker = NetWorker::new(
            mem,
            queues,
            interrupt,
            Arc::clone(&self.backend),
            features,
            Arc::clone(&self.stats),
        )
        .with_log(self.log.clone());
        self.worker.start(worker)?;
        tracing::debug!("virtio-net: active (features {features:#x})");
        Ok(())
    }

    fn reset(&mut self) {
        self.worker.stop();
    }

    fn pause(&mut self) {
        self.worker.pause();
    }

    fn replace_memory(&mut self, mem: &GuestMemory) {
        self.worker.replace_memory(mem);
    }

    fn unpause(&mut self) {
        self.worker.unpause();
    }

    fn queue_positions(&self) -> Vec<QueuePosition> {
        self.worker.queue_positions()
    }

    fn save_state(&self) -> Option<VirtioDeviceState> {
        Some(VirtioDeviceState::Net(NetState {
            mac: self.mac,
            features: self.features,
        }))
    }
}
