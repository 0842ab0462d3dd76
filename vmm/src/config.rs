//! What a VM should look like: the only input of [`crate::Vm::new`].

use std::path::PathBuf;

use crate::error::{Error, Result};

/// Where the guest's serial console (ttyS0) goes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum SerialOutput {
    /// The VMM process's standard output.
    #[default]
    Stdout,
    /// A file, created or truncated.
    File(PathBuf),
    /// An in-memory buffer, read back with [`crate::Vm::serial_output`] (tests, benchmarks).
    Memory,
    /// Discarded.
    Discard,
}

/// Smallest guest memory accepted: below this Linux and our boot layout do not fit.
pub const MIN_MEM_MIB: u64 = 16;

/// Configuration of one VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmConfig {
    /// Number of vCPUs, 1..=KVM's limit.
    pub vcpus: u32,
    /// Guest memory in MiB.
    pub mem_mib: u64,
    /// Kernel: an x86_64 bzImage or ELF (vmlinux, or the project's test guest).
    pub kernel: PathBuf,
    /// Optional initramfs.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
    /// Serial console destination.
    pub serial: SerialOutput,
    /// Attach the test device used by the project's bare-metal test guest.
    pub test_device: bool,
    /// KVM device node (default `/dev/kvm`).
    pub kvm_device: PathBuf,
}

impl VmConfig {
    /// A config with one vCPU, 256 MiB and serial to stdout.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        Self {
            vcpus: 1,
            mem_mib: 256,
            kernel: kernel.into(),
            initrd: None,
            cmdline: String::new(),
            serial: SerialOutput::Stdout,
            test_device: false,
            kvm_device: PathBuf::from(crate::vstate::kvm::KVM_PATH),
        }
    }

    /// Checks what can be checked without touching KVM or the host.
    pub fn validate(&self) -> Result<()> {
        if self.vcpus == 0 {
            return Err(Error::Config("vcpus must be at least 1".into()));
        }
        if self.mem_mib == 0 {
            return Err(Error::Config("memory size must be greater than 0".into()));
        }
        if self.mem_mib < MIN_MEM_MIB {
            return Err(Error::Config(format!(
                "memory size {} MiB is below the minimum of {MIN_MEM_MIB} MiB",
                self.mem_mib
            )));
        }
        if self.mem_mib > (1 << 30) {
            return Err(Error::Config(format!(
                "memory size {} MiB is beyond any host",
                self.mem_mib
            )));
        }
        if self.cmdline.contains('\0') {
            return Err(Error::Cmdline("contains a NUL byte".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_zero_and_tiny_memory_and_zero_vcpus() {
        let mut c = VmConfig::new("/k");
        assert!(c.validate().is_ok());
        c.mem_mib = 0;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("greater than 0"));
        c.mem_mib = 4;
        assert!(c.validate().unwrap_err().to_string().contains("minimum"));
        c.mem_mib = 256;
        c.vcpus = 0;
        assert!(c.validate().unwrap_err().to_string().contains("vcpus"));
    }
}
