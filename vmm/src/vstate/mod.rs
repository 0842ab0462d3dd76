//! KVM-owned state: the KVM system and VM file descriptors, VM shells and their pool, guest
//! memory, vCPUs and their saved state, and the process's descriptor table they fill.

pub(crate) mod fdtable;
pub(crate) mod kvm;
pub(crate) mod memory;
pub(crate) mod pool;
pub(crate) mod shell;
pub(crate) mod spare;
pub(crate) mod state;
pub(crate) mod vcpu;
pub(crate) mod warmup;
