//! VM generation ID: a 16-byte value in guest memory that changes whenever the VM may have
//! been duplicated (each restore of a snapshot, each child of a fork), with an interrupt
//! telling the guest so.
//!
//! Why: two VMs resumed from one instant start with the same kernel CRNG state and would
//! hand out the same "random" bytes until something reseeds them. Linux's `vmgenid` driver
//! (ACPI `_CID "VM_GEN_COUNTER"`) reads the ID at boot, and on a device notification
//! compares it with the one it knows and, when it changed, reseeds the CRNG at once
//! (`add_vmfork_randomness`), before user space gets to run much. That needs no guest
//! agent.
//!
//! The guest finds the ID through the ACPI tables (the VMM's DSDT describes a VMGenID device
//! whose `ADDR` method returns [`VmGenId::addr`]); the page holding it is reserved in the
//! e820 map. The notification is an ACPI Generic Event Device interrupt on [`VmGenId::gsi`]
//! (edge-triggered, raised through the irqfd given here) whose `_EVT` method notifies the
//! VMGenID device. There is only one event source, so the GED needs no register for the
//! guest to read which event fired: the device has no MMIO or port I/O window.
//!
//! The ID itself lives in guest memory (and so in every snapshot's memory); the saved
//! state only records where it is and its last value, so that a restore knows the guest
//! has the device (snapshots taken before it existed have no such state and get no ID).

use std::io::Read;

use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress};

use crate::{Error, GuestMemory, IrqLine, Result};

/// Length of the generation ID.
pub const VMGENID_LEN: usize = 16;

/// The saved state of a [`VmGenId`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmGenIdState {
    /// Guest-physical address of the 16-byte ID.
    pub addr: u64,
    /// The GSI of the generic event device's interrupt.
    pub gsi: u32,
    /// The ID when the state was saved.
    pub generation_id: [u8; VMGENID_LEN],
}

/// The VM generation ID device.
pub struct VmGenId {
    addr: GuestAddress,
    gsi: u32,
    id: [u8; VMGENID_LEN],
    irq: IrqLine,
}

/// A fresh random ID from the host's CRNG.
fn random_id() -> Result<[u8; VMGENID_LEN]> {
    let mut id = [0u8; VMGENID_LEN];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut id))
        .map_err(|e| Error::VmGenId(format!("reading /dev/urandom: {e}")))?;
    Ok(id)
}

fn check_addr(addr: u64) -> Result<()> {
    // The ID must not cross a page boundary and is read as two 8-byte words.
    if !addr.is_multiple_of(8) || addr % 4096 > 4096 - VMGENID_LEN as u64 {
        return Err(Error::VmGenId(format!(
            "the ID at {addr:#x} is not 8-byte aligned within one page"
        )));
    }
    Ok(())
}

impl VmGenId {
    /// A device for a booting VM: a random first ID, written at `addr` in `mem`; `irq` is
    /// the line wired to `gsi`.
    pub fn new(mem: &GuestMemory, addr: u64, gsi: u32, irq: impl Into<IrqLine>) -> Result<Self> {
        check_addr(addr)?;
        let mut dev = VmGenId {
            addr: GuestAddress(addr),
            gsi,
            id: [0; VMGENID_LEN],
            irq: irq.into(),
        };
        dev.write_id(mem, random_id()?)?;
        Ok(dev)
    }

    /// The device of a VM built from saved state. Guest memory is left as it is: call
    /// [`VmGenId::new_generation`] once the VM's memory and interrupt controller are in
    /// place.
    pub fn restore(state: &VmGenIdState, irq: impl Into<IrqLine>) -> Result<Self> {
        check_addr(state.addr)?;
        Ok(VmGenId {
            addr: GuestAddress(state.addr),
            gsi: state.gsi,
            id: state.generation_id,
            irq: irq.into(),
        })
    }

    fn write_id(&mut self, mem: &GuestMemory, id: [u8; VMGENID_LEN]) -> Result<()> {
        mem.write_slice(&id, self.addr)
            .map_err(|e| Error::VmGenId(format!("writing the ID at {:#x}: {e}", self.addr.0)))?;
        self.id = id;
        Ok(())
    }

    /// Gives the guest a new random ID (16 bytes written into `mem`) and raises the
    /// interrupt that makes it look. Call before the vCPUs run again, after the interrupt
    /// controller's state is restored (which would otherwise drop the edge); the guest
    /// takes the interrupt when it runs.
    pub fn new_generation(&mut self, mem: &GuestMemory) -> Result<()> {
        let mut id = random_id()?;
        // Two equal IDs in a row would not be seen as a change.
        while id == self.id {
            id = random_id()?;
        }
        self.write_id(mem, id)?;
        self.irq
            .trigger()
            .map_err(|e| Error::VmGenId(format!("raising the GED interrupt: {e}")))?;
        tracing::debug!(gsi = self.gsi, "new VM generation ID");
        Ok(())
    }

    /// The current ID.
    pub fn generation_id(&self) -> [u8; VMGENID_LEN] {
        self.id
    }

    /// Guest-physical address of the ID.
    pub fn addr(&self) -> u64 {
        self.addr.0
    }

    /// The GED interrupt's GSI.
    pub fn gsi(&self) -> u32 {
        self.gsi
    }

    /// The state to save.
    pub fn save(&self) -> VmGenIdState {
        VmGenIdState {
            addr: self.addr.0,
            gsi: self.gsi,
            generation_id: self.id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::EventFd;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn read_id(mem: &GuestMemory, addr: u64) -> [u8; VMGENID_LEN] {
        let mut b = [0u8; VMGENID_LEN];
        mem.read_slice(&mut b, GuestAddress(addr)).unwrap();
        b
    }

    #[test]
    fn ids_are_written_changed_and_announced() {
        let mem = mem();
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut dev = VmGenId::new(&mem, 0xff000, 3, irq.try_clone().unwrap()).unwrap();
        let first = read_id(&mem, 0xff000);
        assert_eq!(first, dev.generation_id());
        assert_ne!(first, [0; VMGENID_LEN], "a random ID");
        // Booting raises no interrupt.
        assert!(irq.read().is_err());

        let saved = dev.save();
        assert_eq!(
            saved,
            VmGenIdState {
                addr: 0xff000,
                gsi: 3,
                generation_id: first
            }
        );
        dev.new_generation(&mem).unwrap();
        let second = read_id(&mem, 0xff000);
        assert_ne!(second, first);
        assert_eq!(second, dev.generation_id());
        assert_eq!(irq.read().unwrap(), 1, "one interrupt");

        // Two restores of one saved state get different IDs.
        let mem2 = mem.clone();
        let mut a = VmGenId::restore(&saved, EventFd::new(EFD_NONBLOCK).unwrap()).unwrap();
        assert_eq!(
            read_id(&mem2, 0xff000),
            second,
            "restore alone writes nothing"
        );
        a.new_generation(&mem2).unwrap();
        let mut b = VmGenId::restore(&saved, EventFd::new(EFD_NONBLOCK).unwrap()).unwrap();
        b.new_generation(&mem2).unwrap();
        assert_ne!(a.generation_id(), b.generation_id());
        assert_ne!(a.generation_id(), first);
    }

    #[test]
    fn misplaced_ids_are_refused() {
        let mem = mem();
        let irq = || EventFd::new(EFD_NONBLOCK).unwrap();
        assert!(VmGenId::new(&mem, 0xff004, 3, irq()).is_err());
        assert!(VmGenId::new(&mem, 0xffff8, 3, irq()).is_err());
        // Outside guest memory.
        assert!(VmGenId::new(&mem, 0x20_0000, 3, irq()).is_err());
        let bad = VmGenIdState {
            addr: 0x1ff8,
            gsi: 3,
            generation_id: [1; VMGENID_LEN],
        };
        assert!(VmGenId::restore(&bad, irq()).is_err());
    }
}
