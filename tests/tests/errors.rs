//! Bad input gets one clear error, never a panic.

use std::path::PathBuf;

use clade_tests::{guest_config, native_guest};
use vmm::{Error, Vm, VmConfig};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("clade-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn build_err(c: VmConfig) -> Error {
    match Vm::new(c) {
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

#[test]
fn corrupt_kernels() {
    let junk = scratch("junk-kernel");
    std::fs::write(&junk, vec![0xa5u8; 64 << 10]).unwrap();
    let e = build_err(VmConfig::new(&junk));
    assert!(matches!(e, Error::KernelInvalid { .. }), "{e}");
    // A truncated copy of a real ELF.
    let elf = std::fs::read(native_guest()).unwrap();
    let cut = scratch("truncated-elf");
    std::fs::write(&cut, &elf[..200]).unwrap();
    let e = build_err(VmConfig::new(&cut));
    assert!(matches!(e, Error::KernelInvalid { .. }), "{e}");
}

#[test]
fn initrd_too_large_for_memory() {
    let big = scratch("big-initrd");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(48 << 20)
        .unwrap();
    let mut c = guest_config("hello");
    c.mem_mib = 32;
    c.initrd = Some(big);
    let e = build_err(c);
    assert!(matches!(e, Error::InitrdTooLarge { .. }), "{e}");
}

#[test]
fn memory_zero_and_beyond_the_host() {
    let mut c = guest_config("hello");
    c.mem_mib = 0;
    assert!(matches!(build_err(c.clone()), Error::Config(_)));
    c.mem_mib = vmm::vstate::memory::host_mem_mib().unwrap() + 1024;
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
