//! KVM-owned state: the KVM system and VM file descriptors, guest memory and vCPUs.

pub mod kvm;
pub mod memory;
pub mod shell;
pub mod spare;
pub mod state;
pub mod vcpu;
