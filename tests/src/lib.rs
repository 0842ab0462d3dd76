//! Support for Clade's integration tests.
//!
//! Tiers: unit tests live next to the code; `tests/tests/*.rs` here are the native KVM tier
//! (the project's bare-metal guest on this machine's KVM); `tests/nested/run.sh` is the
//! nested tier (Debian's kernel under nested KVM inside QEMU).

mod native_guest;

use std::time::Duration;

pub use native_guest::{native_guest, repo_root};
use vmm::{SerialOutput, VmConfig, VmExit};

/// A config that boots the native test guest with `steps`, serial captured in memory.
pub fn guest_config(steps: &str) -> VmConfig {
    let mut c = VmConfig::new(native_guest());
    c.cmdline = format!("steps={steps}");
    c.serial = SerialOutput::Memory;
    c.test_device = true;
    c
}

/// Runs a VM to its end (at most `timeout`), returning the status and the serial output.
pub fn run_to_end(config: VmConfig, timeout: Duration) -> (VmExit, String) {
    let mut vm = vmm::boot(config).expect("building the VM");
    vm.start().expect("starting the VM");
    let status = vm
        .wait_timeout(timeout)
        .expect("waiting for the VM")
        .unwrap_or_else(|| {
            let out = String::from_utf8_lossy(&vm.serial_output().unwrap_or_default()).to_string();
            vm.shutdown();
            panic!("guest did not finish within {timeout:?}; serial so far:\n{out}")
        });
    let out = String::from_utf8_lossy(&vm.serial_output().unwrap_or_default()).to_string();
    (status, out)
}
