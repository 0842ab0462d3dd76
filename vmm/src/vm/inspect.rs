//! What a [`Vm`] tells about itself: its configuration, devices, memory and counters, and
//! guest memory read and written from the VMM. Accessors only: nothing here changes the
//! VM's state, so they are kept apart from the operations that do.

use std::time::Duration;

use snapshot::page_server::{PageServer, PageServerStats};

use super::Vm;
use crate::config::VmConfig;
use crate::error::{Error, Result};
use crate::saved::{Lineage, RestoreReport};
use crate::vstate::memory::{GuestMemory, GuestRam};

impl Vm {
    /// The configuration this VM was built from.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// The virtio-blk device's disk (its current chain), if the VM has one.
    pub fn disk(&self) -> Option<std::sync::Arc<std::sync::Mutex<disk::Disk>>> {
        self.devices.disk()
    }

    /// Guest memory. (Clones of it must not outlive the VM, nor be kept across a fork or a
    /// snapshot of it: the memory is unmapped when the VM is dropped, and a VM that moves
    /// onto its spare shell at a freeze leaves this mapping behind, to be unmapped.)
    pub fn memory(&self) -> &GuestMemory {
        &self.ram.mem
    }

    /// Reads guest memory at guest-physical `addr` (the VM may run: for inspection).
    pub fn read_guest(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        use vm_memory::Bytes;
        self.ram
            .mem
            .read_slice(buf, vm_memory::GuestAddress(addr))
            .map_err(|e| Error::Memory(format!("reading guest memory at {addr:#x}: {e}")))
    }

    /// Writes guest memory at guest-physical `addr` (the VMM's own write: a mailbox for the
    /// guest, tests).
    pub fn write_guest(&self, addr: u64, data: &[u8]) -> Result<()> {
        use vm_memory::Bytes;
        self.ram
            .mem
            .write_slice(data, vm_memory::GuestAddress(addr))
            .map_err(|e| Error::Memory(format!("writing guest memory at {addr:#x}: {e}")))
    }

    /// Reads (or, with `write`, writes) `data` at guest-physical MMIO address `addr` the
    /// way a vCPU's access reaches the devices: for tests that play a guest driver from
    /// the host. False if no device is there.
    #[doc(hidden)]
    pub fn mmio_access(&self, addr: u64, data: &mut [u8], write: bool) -> bool {
        let mmio = self.devices.buses().mmio;
        if write {
            mmio.write(addr, data)
        } else {
            mmio.read(addr, data)
        }
    }

    /// The page server's counters, when the VM was restored with the `uffd` backend and the
    /// server still runs.
    pub fn page_server_stats(&self) -> Option<PageServerStats> {
        self.page_server.as_ref().map(|p| p.stats())
    }

    /// The snapshot this VM's memory last matched (the last one it took, or the one it
    /// was restored from): the base of its next diff snapshot.
    pub fn last_snapshot(&self) -> Option<&Lineage> {
        self.lineage.as_ref()
    }

    /// How the restore that made this VM went (None for a booted or forked VM).
    pub fn restore_report(&self) -> Option<&RestoreReport> {
        self.restore_report.as_ref()
    }

    /// True when this host's PVM hypervisor runs the guest natively through the VIF cell.
    pub fn pvm_native(&self) -> bool {
        self.pvm_native
    }

    /// Serial output so far, when the config asked for [`crate::SerialOutput::Memory`].
    pub fn serial_output(&self) -> Option<Vec<u8>> {
        self.devices
            .serial_tap()
            .buffer
            .as_ref()
            .map(|b| b.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// Time from the start of [`Vm::new`] to the guest's first serial byte.
    pub fn time_to_first_output(&self) -> Option<Duration> {
        self.devices
            .serial_tap()
            .first_byte
            .get()
            .map(|t| t.duration_since(self.created_at))
    }

    /// Guest RAM (snapshot and fork read and freeze it).
    pub(crate) fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// Whether the memory slots log dirty pages.
    pub(crate) fn dirty_tracking(&self) -> bool {
        self.dirty_tracking
    }

    /// Whether a page server records the guest's working set (a first `uffd` restore).
    pub(crate) fn page_server_recording(&self) -> bool {
        self.page_server
            .as_ref()
            .is_some_and(PageServer::is_recording)
    }

    /// Whether the VM has a virtio-net device (a fork then needs a TAP per child).
    pub(crate) fn has_net_device(&self) -> bool {
        self.devices
            .virtio_slots()
            .iter()
            .any(|s| s.device_type == devices::virtio::net::NET_DEVICE_ID)
    }

    /// Whether guest memory is served on demand by a page server (a `uffd` restore).
    pub(crate) fn has_page_server(&self) -> bool {
        self.page_server.is_some()
    }

    /// The pages the guest needed first in this run, if its memory is served on demand
    /// (see `PageServer::first_touches`), with the page count of the image they index.
    pub(crate) fn first_touches(&self) -> Option<(u64, Vec<u64>)> {
        let ps = self.page_server.as_ref()?;
        Some((ps.page_count(), ps.first_touches()))
    }

    /// The guest's current VM generation ID (at [`crate::VMGENID_ADDR`]), if the VM has the
    /// device (VMs from snapshots taken before it existed do not).
    pub fn vm_generation_id(&self) -> Option<[u8; 16]> {
        self.devices.vm_generation_id()
    }

    /// Host memory this VM's guest RAM uses, as its proportional set size in KiB (pages
    /// shared with other VMs count in part), from `/proc/self/smaps`.
    pub fn memory_pss_kib(&self) -> Result<u64> {
        let start = self.ram.image_addr();
        let end = start + self.ram.mem_bytes() as usize;
        crate::vstate::memory::pss_kib(start, end)
    }
}
