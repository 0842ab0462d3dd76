//! ACPI tables: RSDP, XSDT, FADT (hardware-reduced, with sleep control and reset registers on
//! one I/O port), MADT (local APICs and the IOAPIC) and a DSDT announcing S5 (power off).
//! Debian's stock kernel finds virtio-mmio devices only through the DSDT, so each virtio-mmio
//! slot is a DSDT device there (`_HID "LNRO0005"`, the id Linux's virtio_mmio driver matches).
//! The VM generation ID (see `devices::vmgenid`) is a DSDT device too (`_CID
//! "VM_GEN_COUNTER"`, its address from the `ADDR` method), notified through a generic event
//! device (`ACPI0013`), the hardware-reduced way to signal ACPI events with an interrupt.

use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::{aml, Aml};
use devices::legacy::{ACPI_PM_RESET_VALUE, ACPI_PM_S5_SLP_TYP};
use vm_memory::{Bytes, GuestAddress};

use devices::GuestMemory;

use super::layout::{pio, VirtioSlot, ACPI_END, ACPI_START, IOAPIC_ADDR, LAPIC_ADDR};
use crate::error::{Error, Result};

const OEM_ID: [u8; 6] = *b"CLADE ";
const OEM_TABLE_ID: [u8; 8] = *b"CLADEVM ";
const OEM_REVISION: u32 = 1;

fn aml_bytes(t: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    t.to_aml_bytes(&mut v);
    v
}

/// COM1 as an ACPI device. With hardware-reduced ACPI Linux sets up no legacy ISA interrupts,
/// so the UART's IRQ must be announced here or the tty layer cannot use it.
fn com1_device() -> Vec<u8> {
    let base = pio::SERIAL_COM1;
    let io = aml::IO::new(base, base, 1, 8);
    let irq = aml::Interrupt::new(true, true, false, false, pio::SERIAL_COM1_GSI);
    let crs = aml::ResourceTemplate::new(vec![&io, &irq]);
    let hid = aml::EISAName::new("PNP0501");
    let uid = aml::ZERO;
    let names = [
        aml::Name::new("_HID".into(), &hid),
        aml::Name::new("_UID".into(), &uid),
        aml::Name::new("_CRS".into(), &crs),
    ];
    let children: Vec<&dyn Aml> = names.iter().map(|n| n as &dyn Aml).collect();
    aml_bytes(&aml::Device::new("_SB_.COM1".into(), children))
}

/// A virtio-mmio slot as an ACPI device: its register window and its edge-triggered,
/// active-high, exclusive interrupt.
fn virtio_mmio_device(uid: u32, slot: &VirtioSlot) -> Result<Vec<u8>> {
    let (Ok(base), Ok(len)) = (u32::try_from(slot.base), u32::try_from(slot.len)) else {
        return Err(Error::Boot(format!(
            "virtio-mmio slot at {:#x} is not below 4 GiB",
            slot.base
        )));
    };
    let mem = aml::Memory32Fixed::new(true, base, len);
    let irq = aml::Interrupt::new(true, true, false, false, slot.gsi);
    let crs = aml::ResourceTemplate::new(vec![&mem, &irq]);
    let hid: aml::AmlStr = "LNRO0005";
    let names = [
        aml::Name::new("_HID".into(), &hid),
        aml::Name::new("_UID".into(), &uid),
        aml::Name::new("_CRS".into(), &crs),
    ];
    let children: Vec<&dyn Aml> = names.iter().map(|n| n as &dyn Aml).collect();
    let path = format!("_SB_.V{uid:03X}");
    Ok(aml_bytes(&aml::Device::new(path.as_str().into(), children)))
}

/// Where the VM generation ID is and which interrupt announces its changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenIdPlace {
    /// Guest-physical address of the 16-byte ID.
    pub addr: u64,
    /// GSI of the generic event device's interrupt (edge-triggered, active high).
    pub gsi: u32,
}

/// `_HID` of the VM generation ID device (a valid ACPI id: four letters, four hex digits).
/// Linux's driver matches the `_CID`; the `_HID` only has to be this machine's own.
const VMGENID_HID: &str = "CLAD0001";
/// The compatible id (and DOS device name) every VM generation ID driver looks for.
const VMGENID_CID: &str = "VM_GEN_COUNTER";
/// ACPI path of the VM generation ID device.
const VMGENID_PATH: &str = "\\_SB_.VGEN";

/// The VM generation ID device: `ADDR` returns the ID's address as a package of its low
/// and high 32 bits.
fn vmgenid_device(place: &GenIdPlace) -> Vec<u8> {
    let hid: aml::AmlStr = VMGENID_HID;
    let cid: aml::AmlStr = VMGENID_CID;
    let low = place.addr & 0xffff_ffff;
    let high = place.addr >> 32;
    let addr = aml::Package::new(vec![&low, &high]);
    let ret = aml::Return::new(&addr);
    let names = [
        aml::Name::new("_HID".into(), &hid),
        aml::Name::new("_CID".into(), &cid),
        aml::Name::new("_DDN".into(), &cid),
    ];
    let method = aml::Method::new("ADDR".into(), 0, false, vec![&ret]);
    let mut children: Vec<&dyn Aml> = names.iter().map(|n| n as &dyn Aml).collect();
    children.push(&method);
    aml_bytes(&aml::Device::new(VMGENID_PATH.into(), children))
}

/// The generic event device: one edge-triggered interrupt whose `_EVT` (called with the
/// GSI) notifies the VM generation ID device (0x80: "the ID changed, read it again").
fn ged_device(place: &GenIdPlace) -> Vec<u8> {
    let hid: aml::AmlStr = "ACPI0013";
    let uid = aml::ZERO;
    let irq = aml::Interrupt::new(true, true, false, false, place.gsi);
    let crs = aml::ResourceTemplate::new(vec![&irq]);
    let target = aml::Path::new(VMGENID_PATH);
    let notify = aml::Notify::new(&target, &0x80u8);
    let is_ours = aml::Equal::new(&aml::Arg(0), &place.gsi);
    let on_event = aml::If::new(&is_ours, vec![&notify]);
    let evt = aml::Method::new("_EVT".into(), 1, true, vec![&on_event]);
    let names = [
        aml::Name::new("_HID".into(), &hid),
        aml::Name::new("_UID".into(), &uid),
        aml::Name::new("_CRS".into(), &crs),
    ];
    let mut children: Vec<&dyn Aml> = names.iter().map(|n| n as &dyn Aml).collect();
    children.push(&evt);
    aml_bytes(&aml::Device::new("_SB_.GED_".into(), children))
}

fn dsdt(virtio: &[VirtioSlot], genid: Option<&GenIdPlace>) -> Result<Vec<u8>> {
    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    let s5 = aml::Name::new("_S5_".into(), &aml::Package::new(vec![&ACPI_PM_S5_SLP_TYP]));
    dsdt.append_slice(&aml_bytes(&s5));
    dsdt.append_slice(&com1_device());
    for (uid, slot) in virtio.iter().enumerate() {
        let uid = u32::try_from(uid).map_err(|_| Error::Boot("too many devices".into()))?;
        dsdt.append_slice(&virtio_mmio_device(uid, slot)?);
    }
    if let Some(place) = genid {
        dsdt.append_slice(&vmgenid_device(place));
        dsdt.append_slice(&ged_device(place));
    }
    Ok(dsdt.as_slice().to_vec())
}

fn fadt(dsdt_addr: u64) -> Vec<u8> {
    let mut f = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::ResetRegSup)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton)
        .dsdt_64(dsdt_addr);
    let port = GAS::new(
        AddressSpace::SystemIo,
        8,
        0,
        AccessSize::ByteAccess,
        u64::from(pio::ACPI_PM),
    );
    f.sleep_control_reg = port;
    f.sleep_status_reg = port;
    f.reset_reg = port;
    f.reset_value = ACPI_PM_RESET_VALUE;
    // "Hypervisor vendor identity": unused by Linux, but honest.
    f.hypervisor_vendor_identity = u64::from_le_bytes(*b"CLADEVMM").into();
    aml_bytes(&f.finalize())
}

fn madt(vcpus: u32) -> Vec<u8> {
    let mut m = MADT::new(
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
        LocalInterruptController::Address(LAPIC_ADDR as u32),
    );
    for id in 0..vcpus {
        m.add_structure(ProcessorLocalApic::new(
            id as u8,
            id as u8,
            EnabledStatus::Enabled,
        ));
    }
    m.add_structure(IoApic::new(0, IOAPIC_ADDR as u32, 0));
    aml_bytes(&m)
}

/// Writes the tables into the legacy BIOS area; the RSDP lands at [`ACPI_START`].
/// `virtio` are the virtio-mmio slots to announce in the DSDT, `genid` the VM generation
/// ID device, if the VM has one.
pub fn write_tables(
    mem: &GuestMemory,
    vcpus: u32,
    virtio: &[VirtioSlot],
    genid: Option<&GenIdPlace>,
) -> Result<()> {
    let mut cursor = ACPI_START + Rsdp::len() as u64;
    let mut place = |bytes: &[u8]| -> Result<u64> {
        let addr = (cursor + 15) & !15;
        if addr + bytes.len() as u64 > ACPI_END {
            return Err(Error::Boot("ACPI tables do not fit below 1 MiB".into()));
        }
        mem.write_slice(bytes, GuestAddress(addr))
            .map_err(|e| Error::Boot(format!("writing ACPI tables: {e}")))?;
        cursor = addr + bytes.len() as u64;
        Ok(addr)
    };
    let dsdt_addr = place(&dsdt(virtio, genid)?)?;
    let fadt_addr = place(&fadt(dsdt_addr))?;
    let madt_addr = place(&madt(vcpus))?;
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let xsdt_addr = place(&aml_bytes(&xsdt))?;
    let rsdp = aml_bytes(&Rsdp::new(OEM_ID, xsdt_addr));
    mem.write_slice(&rsdp, GuestAddress(ACPI_START))
        .map_err(|e| Error::Boot(format!("writing RSDP: {e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checksum_ok(b: &[u8]) -> bool {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x)) == 0
    }

    #[test]
    fn tables_are_linked_and_checksummed() {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_tables(&mem, 4, &[], None).unwrap();
        let mut rsdp = [0u8; 36];
        mem.read_slice(&mut rsdp, GuestAddress(ACPI_START)).unwrap();
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert!(checksum_ok(&rsdp[..20]) && checksum_ok(&rsdp));
        let xsdt_addr = u64::from_le_bytes(rsdp[24..32].try_into().unwrap());
        let read_table = |addr: u64| {
            let mut hdr = [0u8; 8];
            mem.read_slice(&mut hdr, GuestAddress(addr)).unwrap();
            let len = u32::from_le_bytes(hdr[4..8].try_into().unwrap()) as usize;
            let mut t = vec![0u8; len];
            mem.read_slice(&mut t, GuestAddress(addr)).unwrap();
            assert!(checksum_ok(&t), "bad checksum {:?}", &t[..4]);
            t
        };
        let xsdt = read_table(xsdt_addr);
        let sigs: Vec<Vec<u8>> = xsdt[36..]
            .chunks(8)
            .map(|c| read_table(u64::from_le_bytes(c.try_into().unwrap()))[..4].to_vec())
            .collect();
        assert_eq!(sigs, vec![b"FACP".to_vec(), b"APIC".to_vec()]);
        let dsdt = dsdt(&[], None).unwrap();
        assert!(dsdt.windows(4).any(|w| w == b"_S5_"));
        assert!(dsdt.windows(4).any(|w| w == b"COM1"));
        assert!(checksum_ok(&dsdt));
        assert!(!dsdt.windows(8).any(|w| w == b"LNRO0005"));
        assert!(!dsdt.windows(4).any(|w| w == b"VGEN" || w == b"GED_"));
    }

    #[test]
    fn vmgenid_and_its_event_device_are_in_the_dsdt() {
        let place = GenIdPlace {
            addr: 0xff000,
            gsi: 3,
        };
        let dsdt = dsdt(&[], Some(&place)).unwrap();
        assert!(checksum_ok(&dsdt));
        let find = |needle: &[u8]| dsdt.windows(needle.len()).position(|w| w == needle);
        let count = |needle: &[u8]| dsdt.windows(needle.len()).filter(|w| *w == needle).count();
        // Names: strings are StringPrefix (0x0d), the bytes, NUL.
        let vgen = find(b"VGEN").expect("device VGEN");
        let hid = find(b"\x0dCLAD0001\0").expect("_HID string");
        assert_eq!(count(b"\x0dVM_GEN_COUNTER\0"), 2, "_CID and _DDN");
        assert!(vgen < hid);
        assert_eq!(&dsdt[hid - 4..hid], b"_HID");
        let cid = find(b"_CID\x0dVM_GEN_COUNTER\0").expect("_CID");
        assert!(cid > vgen);
        // ADDR: MethodOp, PkgLength, name, flags (no arguments), then
        // Return(Package(2) { DWord 0xff000, Zero }).
        let m = find(b"ADDR").expect("ADDR method");
        assert_eq!(dsdt[m - 2], 0x14, "MethodOp");
        let mut body = vec![0x00, 0xa4, 0x12, 0x08, 0x02, 0x0c];
        body.extend_from_slice(&0xff000u32.to_le_bytes());
        body.push(0x00);
        assert_eq!(
            &dsdt[m + 4..m + 4 + body.len()],
            &body[..],
            "ADDR returns the address"
        );

        // The GED: _HID ACPI0013, its interrupt (extended interrupt descriptor: consumer,
        // edge, active high, exclusive; GSI 3) and _EVT notifying \_SB_.VGEN with 0x80.
        let ged = find(b"GED_").expect("device GED_");
        assert!(ged > m, "the GED comes after the device it notifies");
        assert_eq!(
            &dsdt[ged + 4..ged + 8],
            b"\x08_HI",
            "its first name is _HID"
        );
        assert!(find(b"\x0dACPI0013\0").unwrap() > ged);
        let irq = [0x89, 6, 0, 0x03, 1, 3, 0, 0, 0];
        assert!(find(&irq).unwrap() > ged, "the GED's interrupt");
        let evt = find(b"_EVT").expect("_EVT");
        assert_eq!(dsdt[evt + 4], 0x09, "one argument, serialized");
        // If (LEqual (Arg0, 3)) { Notify (\_SB_.VGEN, 0x80) }
        let mut cond = vec![0x93, 0x68, 0x0a, 0x03];
        cond.extend_from_slice(&[0x86, b'\\', 0x2e]);
        cond.extend_from_slice(b"_SB_VGEN");
        cond.extend_from_slice(&[0x0a, 0x80]);
        let c = find(&cond).expect("If (Arg0 == GSI) Notify (\\_SB_.VGEN, 0x80)");
        assert!(c > evt);
        assert_eq!(dsdt[c - 2], 0xa0, "IfOp");

        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_tables(&mem, 1, &[], Some(&place)).unwrap();
    }

    #[test]
    fn virtio_mmio_slots_are_dsdt_devices() {
        let slots = [
            VirtioSlot {
                base: 0xd000_1000,
                len: 0x1000,
                gsi: 6,
                device_type: 19,
            },
            VirtioSlot {
                base: 0xd000_2000,
                len: 0x1000,
                gsi: 7,
                device_type: 2,
            },
        ];
        let dsdt = dsdt(&slots, None).unwrap();
        assert!(checksum_ok(&dsdt));
        let find = |needle: &[u8]| dsdt.windows(needle.len()).position(|w| w == needle);
        // Device names and the _HID string.
        let v0 = find(b"V000").expect("device V000");
        let v1 = find(b"V001").expect("device V001");
        assert!(v0 < v1);
        assert_eq!(dsdt.windows(8).filter(|w| *w == b"LNRO0005").count(), 2);
        for (i, s) in slots.iter().enumerate() {
            // Memory32Fixed: tag 0x86, length 9, read-write, base, length.
            let mut mem = vec![0x86, 9, 0, 1];
            mem.extend_from_slice(&(s.base as u32).to_le_bytes());
            mem.extend_from_slice(&0x1000u32.to_le_bytes());
            let m = find(&mem).unwrap_or_else(|| panic!("Memory32Fixed of slot {i}"));
            // Extended interrupt right after: tag 0x89, length 6, flags consumer|edge (active
            // high, exclusive) = 0b0011, one interrupt, the GSI.
            let mut irq = vec![0x89, 6, 0, 0x03, 1];
            irq.extend_from_slice(&s.gsi.to_le_bytes());
            assert_eq!(&dsdt[m + mem.len()..m + mem.len() + irq.len()], &irq[..]);
        }
        // _UID values 0 and 1 follow their _UID names.
        let uid0 = find(b"_UID").unwrap();
        assert_eq!(dsdt[uid0 + 4], 0x00, "ZeroOp");
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_tables(&mem, 1, &slots, None).unwrap();
    }
}
