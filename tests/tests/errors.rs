//! Bad input gets one clear error, never a panic.

use std::path::{Path, PathBuf};

use clade_tests::{guest_config, native_guest};
use vmm::{Error, VmConfig};

/// A file in this test process's scratch directory, removed when dropped (and the
/// directory with the last one).
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        if let Some(dir) = self.0.parent() {
            // Fails while another test's file is still in it.
            let _ = std::fs::remove_dir(dir);
        }
    }
}

fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("clade-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir.join(name))
}

fn build_err(c: VmConfig) -> Error {
    match vmm::boot(c) {
        Ok(_) => panic!("expected an error"),
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "one line: {msg}");
            e
        }
    }
}

#[test]
fn missing_kernel() {
    let e = build_err(VmConfig::new("/nonexistent/vmlinuz"));
    assert!(matches!(e, Error::KernelOpen { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/vmlinuz"), "{e}");
}

fn hardware_virtualization() -> bool {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap()
        .split_whitespace()
        .any(|w| w == "vmx" || w == "svm")
}

#[test]
fn linux_on_a_host_without_hardware_virtualization_is_refused_with_the_reason() {
    if hardware_virtualization() {
        eprintln!("skipped: this host has VMX/SVM and boots Linux directly");
        return;
    }
    // Anything that is not an ELF is treated as a Linux bzImage.
    let bz = scratch("bzimage");
    let mut img = vec![0u8; 64 << 10];
    img[0x202..0x206].copy_from_slice(b"HdrS");
    std::fs::write(&*bz, img).unwrap();
    let e = build_err(VmConfig::new(&*bz));
    assert!(matches!(e, Error::UnsupportedHost(_)), "{e}");
    assert!(e.to_string().contains("hardware virtualization"), "{e}");
}

#[test]
fn corrupt_kernels() {
    let junk = scratch("junk-kernel");
    std::fs::write(&*junk, vec![0xa5u8; 64 << 10]).unwrap();
    let e = build_err(VmConfig::new(&*junk));
    if hardware_virtualization() {
        assert!(matches!(e, Error::KernelInvalid { .. }), "{e}");
    } else {
        // A non-ELF kernel is refused before loading on the PVM host (see the next test).
        assert!(matches!(e, Error::UnsupportedHost(_)), "{e}");
    }
    // A truncated copy of a real ELF.
    let elf = std::fs::read(native_guest()).unwrap();
    let cut = scratch("truncated-elf");
    std::fs::write(&*cut, &elf[..200]).unwrap();
    let e = build_err(VmConfig::new(&*cut));
    assert!(matches!(e, Error::KernelInvalid { .. }), "{e}");
}

#[test]
fn initrd_too_large_for_memory() {
    let big = scratch("big-initrd");
    std::fs::File::create(&*big)
        .unwrap()
        .set_len(48 << 20)
        .unwrap();
    let mut c = guest_config("hello");
    c.mem_mib = 32;
    c.initrd = Some(big.to_path_buf());
    let e = build_err(c);
    assert!(matches!(e, Error::InitrdTooLarge { .. }), "{e}");
}

#[test]
fn memory_zero_and_beyond_the_host() {
    let mut c = guest_config("hello");
    c.mem_mib = 0;
    assert!(matches!(build_err(c.clone()), Error::Config(_)));
    c.mem_mib = vmm::host_mem_mib().unwrap() + 1024;
    let e = build_err(c);
    assert!(matches!(e, Error::MemoryTooLarge { .. }), "{e}");
}

#[test]
fn more_vcpus_than_kvm_allows() {
    let mut c = guest_config("hello");
    c.vcpus = 4096;
    let e = build_err(c);
    assert!(matches!(e, Error::TooManyVcpus { .. }), "{e}");
}

#[test]
fn no_kvm_device() {
    let mut c = guest_config("hello");
    c.kvm_device = "/nonexistent/kvm".into();
    let e = build_err(c.clone());
    assert!(matches!(e, Error::KvmMissing { .. }), "{e}");
    // Something that exists but is not KVM.
    c.kvm_device = "/dev/null".into();
    let e = build_err(c);
    assert!(
        matches!(
            e,
            Error::KvmOpen { .. } | Error::KvmCapability(_) | Error::Kvm { .. }
        ),
        "{e}"
    );
}
