//! The VMM will put kvm-bindings structs (with their `serde` feature) into the state
//! file's payload: check that they round-trip through postcard and the state file.

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_pit_state2,
    kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, Msrs,
};
use serde::{Deserialize, Serialize};
use snapshot::state_file::{self, Expect, SnapshotMeta};
use snapshot::SnapshotId;

#[derive(Serialize, Deserialize)]
struct VcpuState {
    regs: kvm_regs,
    sregs: kvm_sregs,
    xsave: kvm_xsave,
    xcrs: kvm_xcrs,
    msrs: Msrs,
    lapic: kvm_lapic_state,
    events: kvm_vcpu_events,
    mp_state: kvm_mp_state,
}

#[derive(Serialize, Deserialize)]
struct VmState {
    vcpus: Vec<VcpuState>,
    irqchips: Vec<kvm_irqchip>,
    pit: kvm_pit_state2,
    clock: kvm_clock_data,
}

#[test]
fn kvm_structs_roundtrip_through_the_state_file() {
    let vcpu = |i: u64| {
        let regs = kvm_regs {
            rip: 0x10_0000 + i,
            rsp: 0x8000,
            ..Default::default()
        };
        let mut sregs = kvm_sregs {
            cr0: 0x8000_0011,
            ..Default::default()
        };
        sregs.cs.selector = 0x8;
        let mut xsave = kvm_xsave::default();
        xsave.region[7] = 0xdead_beef;
        let mut lapic = kvm_lapic_state::default();
        lapic.regs[0x20] = 1;
        let msrs = Msrs::from_entries(&[
            kvm_msr_entry {
                index: 0xc000_0080,
                data: 0x500,
                ..Default::default()
            },
            kvm_msr_entry {
                index: 0x4b56_4d10,
                data: 0x1000 | 0x400,
                ..Default::default()
            },
        ])
        .unwrap();
        VcpuState {
            regs,
            sregs,
            xsave,
            xcrs: kvm_xcrs::default(),
            msrs,
            lapic,
            events: kvm_vcpu_events::default(),
            mp_state: kvm_mp_state { mp_state: 0 },
        }
    };
    let clock = kvm_clock_data {
        clock: 123_456,
        ..Default::default()
    };
    let state = VmState {
        vcpus: vec![vcpu(0), vcpu(1)],
        irqchips: vec![kvm_irqchip::default(); 3],
        pit: kvm_pit_state2::default(),
        clock,
    };
    let bytes =
        state_file::encode(&SnapshotMeta::full(SnapshotId::random(), 256 << 20), &state).unwrap();
    let (_, back): (_, VmState) =
        state_file::decode_from_bytes(&bytes, &Expect::default()).unwrap();
    assert_eq!(back.vcpus.len(), 2);
    assert_eq!(back.vcpus[1].regs.rip, 0x10_0001);
    assert_eq!(back.vcpus[0].sregs.cr0, 0x8000_0011);
    assert_eq!(back.vcpus[0].sregs.cs.selector, 0x8);
    assert_eq!(back.vcpus[0].xsave.region[7], 0xdead_beef);
    assert_eq!(back.vcpus[0].lapic.regs[0x20], 1);
    let msrs = back.vcpus[1].msrs.as_slice();
    assert_eq!(msrs.len(), 2);
    assert_eq!((msrs[1].index, msrs[1].data), (0x4b56_4d10, 0x1400));
    assert_eq!(back.clock.clock, 123_456);
    eprintln!("2-vCPU KVM state: {} bytes", bytes.len());
}
