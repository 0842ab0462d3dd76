//! The VMM library's error type.

use std::path::PathBuf;

/// Everything that can go wrong building or running a VM. Each variant's message is one line
/// that names the problem, suitable to show a user as is.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// /dev/kvm is missing (no KVM on this host, or the module is not loaded).
    #[error(
        "{path}: not found: this host has no KVM (load the kvm module, or enable virtualization)"
    )]
    KvmMissing { path: PathBuf },
    /// /dev/kvm exists but this user may not open it.
    #[error("{path}: permission denied: add this user to the 'kvm' group or run as root")]
    KvmPermission { path: PathBuf },
    /// Opening /dev/kvm failed for another reason.
    #[error("{path}: cannot open: {source}")]
    KvmOpen {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The KVM API version or a required capability is missing.
    #[error("KVM on this host lacks {0}")]
    KvmCapability(&'static str),
    /// A KVM ioctl failed.
    #[error("KVM {op} failed: {source}")]
    Kvm {
        op: &'static str,
        source: kvm_ioctls::Error,
    },
    /// This host's KVM cannot run the requested guest.
    #[error("{0}")]
    UnsupportedHost(String),
    /// Setting up the jail failed (see [`crate::host::jail`]).
    #[error("jail: {0}")]
    Jail(String),
    /// A cgroup could not be made, limited, joined or removed (see [`crate::host::cgroup`]).
    #[error("cgroup: {0}")]
    Cgroup(String),
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// More vCPUs than KVM (or the platform) allows.
    #[error("{requested} vCPUs requested, but at most {max} are supported here")]
    TooManyVcpus { requested: u32, max: u32 },
    /// More memory than the host has.
    #[error("{requested_mib} MiB of guest memory requested, but the host has only {host_mib} MiB")]
    MemoryTooLarge { requested_mib: u64, host_mib: u64 },
    /// Allocating or mapping guest memory failed.
    #[error("guest memory: {0}")]
    Memory(String),
    /// The kernel image cannot be read.
    #[error("kernel {path}: {source}")]
    KernelOpen {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The kernel image is not a loadable x86_64 kernel.
    #[error("kernel {path}: not a usable x86_64 kernel: {reason}")]
    KernelInvalid { path: PathBuf, reason: String },
    /// The initrd cannot be read.
    #[error("initrd {path}: {source}")]
    InitrdOpen {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The initrd does not fit in guest memory.
    #[error("initrd {path}: {size} bytes do not fit in guest memory ({available} bytes free above the kernel)")]
    InitrdTooLarge {
        path: PathBuf,
        size: u64,
        available: u64,
    },
    /// The kernel command line is invalid or too long.
    #[error("kernel command line: {0}")]
    Cmdline(String),
    /// Writing boot structures (boot_params, page tables, ACPI) failed.
    #[error("boot setup: {0}")]
    Boot(String),
    /// The serial output file cannot be created.
    #[error("serial output {path}: {source}")]
    SerialOutput {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Device wiring failed.
    #[error("devices: {0}")]
    Device(#[from] devices::Error),
    /// The disk image cannot be used (missing, corrupt, mismatched layers, in use).
    #[error("disk: {0}")]
    Disk(#[from] disk::Error),
    /// A vCPU thread could not be started or controlled.
    #[error("vCPU {index}: {reason}")]
    Vcpu { index: usize, reason: String },
    /// An operation does not fit the VM's current state (e.g. pausing a VM that has ended).
    #[error("VM is {state}: cannot {op}")]
    InvalidState {
        state: &'static str,
        op: &'static str,
    },
    /// The guest agent's socket cannot be reached.
    #[error("agent socket {path}: {source}")]
    AgentConnect {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The VMM's vsock socket did not accept `CONNECT <port>` (nothing listening yet?).
    #[error("agent socket {path}: vsock CONNECT {port}: {reason}")]
    AgentHandshake {
        path: PathBuf,
        port: u32,
        reason: String,
    },
    /// The agent sent something this client cannot accept.
    #[error("agent protocol: {0}")]
    AgentProtocol(String),
    /// The agent connection is closed.
    #[error(
        "the command wrote more than {limit} bytes of output: killed (stream its output instead)"
    )]
    AgentOutputTooLarge { limit: u64 },

    #[error("agent connection closed")]
    AgentDisconnected,
    /// The agent answered with an error.
    #[error("agent: {0}")]
    Agent(#[from] guest_agent::RemoteError),
    /// A snapshot cannot be taken or restored.
    #[error("snapshot: {0}")]
    Snapshot(String),
    /// A snapshot's files are unusable (missing, truncated, corrupted, foreign, ...).
    #[error("fork: {0}")]
    Fork(String),

    #[error("snapshot {dir}: {source}")]
    SnapshotFile {
        dir: PathBuf,
        source: snapshot::Error,
    },
    /// Other host I/O failure.
    #[error("{context}: {source}")]
    Io {
        context: &'static str,
        source: std::io::Error,
    },
}

/// Result type of the VMM library.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn kvm(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
        move |source| Error::Kvm { op, source }
    }

    /// An I/O error while `context`.
    pub(crate) fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> Error {
        move |source| Error::Io { context, source }
    }
}
