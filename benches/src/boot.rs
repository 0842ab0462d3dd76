//! `boot`: from the start of VM creation to the guest's first serial output.

use std::time::Duration;

use vmm::VmExit;

use crate::error::{Error, Result};
use crate::guest::{config, Guest, Machine};
use crate::stats::{Samples, Summary};

/// Boots the guest (its `hello` step) `n` times; each sample is the time from the start
/// of VM creation to the guest's first serial output. Reported as `boot_to_first_output`.
pub fn boot(guest: &Guest, machine: &Machine, n: usize) -> Result<Summary> {
    let mut samples = Samples::new();
    for i in 0..n {
        let mut vm = vmm::boot(config(guest, machine, "hello", None))?;
        vm.start()?;
        let status = vm
            .wait_timeout(Duration::from_secs(10))?
            .ok_or_else(|| Error::Guest(format!("boot {i}: guest did not finish within 10 s")))?;
        if status != VmExit::TestExit(0) {
            return Err(Error::Guest(format!(
                "boot {i}: guest ended with '{status}'"
            )));
        }
        let t = vm
            .time_to_first_output()
            .ok_or_else(|| Error::Guest(format!("boot {i}: guest wrote nothing")))?;
        tracing::debug!(i, ?t, "boot");
        samples.push(t);
    }
    Ok(samples.summary("boot_to_first_output"))
}
