//! `clade bench`: latency measurements on the native test guest.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clade_bench::Samples;
use clap::Subcommand;
use vmm::{ExitStatus, SerialOutput, Vm, VmConfig};

use super::MachineArgs;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Boot time: from the start of VM creation to the guest's first serial output.
    Boot {
        /// The native test guest ELF (see tests/native-guest).
        #[arg(
            long,
            env = "CLADE_NATIVE_GUEST",
            default_value = "target/native-guest/release/native-guest"
        )]
        guest: PathBuf,
        /// Number of boots.
        #[arg(short, long, default_value_t = 20)]
        n: usize,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        machine: MachineArgs,
    },
}

pub fn bench(cmd: BenchCommand) -> anyhow::Result<u8> {
    match cmd {
        BenchCommand::Boot {
            guest,
            n,
            json,
            machine,
        } => boot(guest, n, json, machine),
    }
}

fn boot(guest: PathBuf, n: usize, json: bool, machine: MachineArgs) -> anyhow::Result<u8> {
    if !guest.exists() {
        bail!(
            "native test guest {} not found: build it with tests/native-guest/build.sh",
            guest.display()
        );
    }
    let mut samples = Samples::new();
    for i in 0..n {
        let config = VmConfig {
            vcpus: machine.vcpus,
            mem_mib: machine.mem_mib,
            kernel: guest.clone(),
            initrd: None,
            cmdline: "steps=hello".into(),
            serial: SerialOutput::Memory,
            test_device: true,
            kvm_device: machine.kvm_device.clone(),
        };
        let mut vm = Vm::new(config)?;
        vm.start()?;
        let status = vm
            .wait_timeout(Duration::from_secs(10))?
            .with_context(|| format!("boot {i}: guest did not finish within 10 s"))?;
        if status != ExitStatus::TestExit(0) {
            bail!("boot {i}: guest ended with '{status}'");
        }
        let t = vm
            .time_to_first_output()
            .with_context(|| format!("boot {i}: guest wrote nothing"))?;
        samples.push(t);
    }
    let summary = samples.summary("boot_to_first_output");
    if json {
        println!("{}", summary.json());
    } else {
        println!("{}", summary.line());
    }
    Ok(0)
}
