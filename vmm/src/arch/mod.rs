//! x86_64 platform code: guest memory layout, boot protocol, CPU state and ACPI tables.

pub mod acpi;
pub mod boot;
pub mod cpuid;
pub mod layout;
pub mod msrs;
pub mod regs;
