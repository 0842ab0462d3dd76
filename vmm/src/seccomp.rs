//! The VMM's system-call filters.
//!
//! - **The process filter** ([`install`]): an allow-list of the calls a VMM process makes
//!   (KVM, memory, files, Unix sockets, threads, starting fork children, entering a network
//!   namespace to open a TAP there), installed on every
//!   thread at once (TSYNC) and inherited by every thread started later and by the fork
//!   children the VMM starts. `clade run` and `clade restore` install it before the VM is
//!   built, so that each thread the VM starts can narrow it further.
//! - **A filter per thread kind** ([`ThreadKind`], [`confine`]): a thread started while the
//!   process filter is on adds its kind's filter before its body runs. vCPU, device-loop,
//!   page-server, control-API and helper threads can neither start processes nor run
//!   programs (`execve`, `fork`, `clone` without `CLONE_THREAD`), nor create, rename or remove
//!   files; vCPU and page-server threads create no sockets either, and their `ioctl`s are
//!   limited to KVM's (vCPU) or userfaultfd's (page server) request type. Only the owner
//!   (main) thread keeps the whole process list: it takes snapshots and starts fork
//!   children.
//!
//! A call outside a filter traps: the SIGSYS handler writes one line naming the call and the
//! thread to standard error and ends the process with status 159 (128 + SIGSYS).
//!
//! Written with the seccompiler crate. This module is a leaf (it uses only the error type)
//! so that every place that starts a thread can confine it.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use std::sync::OnceLock;

use snapshot::ThreadRunner;

use crate::error::{Error, Result};

/// The calls a VMM process may make, whatever their arguments.
const ALLOWED: &[libc::c_long] = &[
    // Memory and KVM.
    libc::SYS_ioctl,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_memfd_create,
    libc::SYS_userfaultfd,
    libc::SYS_get_mempolicy,
    libc::SYS_set_mempolicy,
    libc::SYS_membarrier,
    // Descriptors and files.
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_lseek,
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_close,
    libc::SYS_close_range,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_fcntl,
    libc::SYS_flock,
    libc::SYS_fstat,
    libc::SYS_stat,
    libc::SYS_lstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_statfs,
    libc::SYS_fstatfs,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_getdents64,
    libc::SYS_getcwd,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_fadvise64,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_sync,
    libc::SYS_copy_file_range,
    libc::SYS_sendfile,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rmdir,
    libc::SYS_link,
    libc::SYS_linkat,
    libc::SYS_symlink,
    libc::SYS_symlinkat,
    libc::SYS_chmod,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_utimensat,
    libc::SYS_umask,
    libc::SYS_pipe2,
    libc::SYS_eventfd2,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_settime,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_poll,
    libc::SYS_ppoll,
    // Unix sockets (`socket` itself is limited to AF_UNIX below).
    libc::SYS_socketpair,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_shutdown,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    // Threads, time, signals, scheduling.
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_futex,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_set_tid_address,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_setaffinity,
    libc::SYS_sched_setscheduler,
    libc::SYS_sched_getparam,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_gettimeofday,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_tgkill,
    libc::SYS_kill,
    libc::SYS_prctl,
    // Adding filters only narrows what is allowed (a fork child installs its own).
    libc::SYS_seccomp,
    libc::SYS_getrandom,
    libc::SYS_getpid,
    libc::SYS_getppid,
    libc::SYS_gettid,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_uname,
    libc::SYS_sysinfo,
    libc::SYS_prlimit64,
    libc::SYS_exit,
    libc::SYS_exit_group,
    // Starting fork children (`clade fork-child`, which inherits this filter).
    libc::SYS_execve,
    libc::SYS_vfork,
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_setpgid,
    libc::SYS_pidfd_open,
    libc::SYS_pidfd_send_signal,
    libc::SYS_arch_prctl,
];

fn rule_err(e: seccompiler::BackendError) -> Error {
    Error::Config(format!("seccomp rule: {e}"))
}

fn compile(filter: SeccompFilter) -> Result<BpfProgram> {
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| Error::Config(format!("seccomp filter: {e}")))
}

/// `arg` (32-bit) equals `value`.
fn arg_eq(arg: u8, value: u64) -> Result<SeccompCondition> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, value).map_err(rule_err)
}

/// The process filter, compiled.
fn program() -> Result<BpfProgram> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED.iter().map(|&nr| (nr, Vec::new())).collect();
    let unix_only = SeccompRule::new(vec![arg_eq(0, libc::AF_UNIX as u64)?]).map_err(rule_err)?;
    rules.insert(libc::SYS_socket, vec![unix_only]);
    // Entering a network namespace, only: a TAP in a sandbox's namespace is opened from a
    // short-lived thread that enters it (`--net tap=NAME,netns=PATH`; a restore in a
    // standby process or a fork child does that after this filter is on).
    let netns_only =
        SeccompRule::new(vec![arg_eq(1, libc::CLONE_NEWNET as u64)?]).map_err(rule_err)?;
    rules.insert(libc::SYS_setns, vec![netns_only]);
    compile(
        SeccompFilter::new(
            rules,
            SeccompAction::Trap,
            SeccompAction::Allow,
            TargetArch::x86_64,
        )
        .map_err(|e| Error::Config(format!("seccomp filter: {e}")))?,
    )
}

/// What a VMM thread does, which decides its filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadKind {
    /// Runs one vCPU: KVM ioctls and device register accesses.
    Vcpu,
    /// The device event loop: virtqueues, the disk, vsock's Unix sockets, the TAP (reads,
    /// writes, and `TUNSETOFFLOAD` when a guest's network driver starts: done here rather
    /// than on the vCPU that activated the device, whose `ioctl`s are KVM's only).
    DeviceLoop,
    /// Serves guest page faults from a snapshot's memory (userfaultfd).
    PageServer,
    /// Accepts control-API connections and reads their requests.
    Api,
    /// Any other helper (the agent sync after a restore, background work).
    Helper,
}

impl ThreadKind {
    const ALL: [ThreadKind; 5] = [
        ThreadKind::Vcpu,
        ThreadKind::DeviceLoop,
        ThreadKind::PageServer,
        ThreadKind::Api,
        ThreadKind::Helper,
    ];

    /// The kind's name (in the SIGSYS line and the test hook).
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::DeviceLoop => "devices",
            ThreadKind::PageServer => "page-server",
            ThreadKind::Api => "api",
            ThreadKind::Helper => "helper",
        }
    }
}

/// The calls every confined thread may make: memory, waiting, signals, I/O on descriptors it
/// has, time, its own identity.
const THREAD_BASE: &[libc::c_long] = &[
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_setaffinity,
    libc::SYS_sched_setscheduler,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_gettimeofday,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_lseek,
    libc::SYS_close,
    libc::SYS_fstat,
    libc::SYS_fcntl,
    // A guest's power-off (handled on its vCPU) flushes the disk.
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_eventfd2,
    // Devices a vCPU activates arm their timers.
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
    libc::SYS_dup,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_getrandom,
    libc::SYS_prctl,
    libc::SYS_rseq,
    libc::SYS_set_robust_list,
    libc::SYS_membarrier,
    // A panic's abort, a thread's end.
    libc::SYS_tgkill,
    libc::SYS_exit,
    libc::SYS_exit_group,
];

/// Calls no confined thread makes: starting programs and processes, changing the file
/// namespace, signalling other processes, tracing.
const NEVER_IN_THREADS: &[libc::c_long] = &[
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_fork,
    libc::SYS_vfork,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_kill,
    libc::SYS_pidfd_open,
    libc::SYS_pidfd_send_signal,
    libc::SYS_setpgid,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rmdir,
    libc::SYS_link,
    libc::SYS_linkat,
    libc::SYS_symlink,
    libc::SYS_symlinkat,
    libc::SYS_chmod,
    libc::SYS_fchmodat,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_chroot,
    libc::SYS_pivot_root,
    libc::SYS_unshare,
    libc::SYS_setns,
];

/// A kind's filters, compiled (they come on top of the process filter).
fn thread_program(kind: ThreadKind) -> Result<Vec<BpfProgram>> {
    let cond = |c: Result<SeccompCondition>| -> Result<SeccompRule> {
        SeccompRule::new(vec![c?]).map_err(rule_err)
    };
    // Only new threads of this process (pthread_create's clone has CLONE_THREAD).
    let thread_clone = cond(
        SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
            libc::CLONE_THREAD as u64,
        )
        .map_err(rule_err),
    )?;
    // An ioctl request's type byte (bits 8-15).
    let ioctl_type = |t: u64| {
        cond(
            SeccompCondition::new(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(0xff00),
                t << 8,
            )
            .map_err(rule_err),
        )
    };
    let (allow, trap): (
        BTreeMap<i64, Vec<SeccompRule>>,
        BTreeMap<i64, Vec<SeccompRule>>,
    ) = match kind {
        // Allow-lists: these threads do few things.
        ThreadKind::Vcpu | ThreadKind::PageServer => {
            let mut m: BTreeMap<i64, Vec<SeccompRule>> =
                THREAD_BASE.iter().map(|&nr| (nr, Vec::new())).collect();
            let mut ioctls = vec![if kind == ThreadKind::Vcpu {
                ioctl_type(u64::from(kvm_bindings::KVMIO))?
            } else {
                // userfaultfd's ioctls (UFFDIO_*), type 0xAA.
                ioctl_type(0xaa)?
            }];
            // A device the guest activates from a vCPU sets its sockets non-blocking and
            // close-on-exec; a log line may ask whether stderr is a terminal.
            for request in [libc::FIONBIO, libc::FIOCLEX, libc::FIONCLEX, libc::TCGETS] {
                ioctls.push(cond(arg_eq(1, request))?);
            }
            m.insert(libc::SYS_ioctl, ioctls);
            (m, BTreeMap::new())
        }
        // Deny-lists: these threads need sockets or spawn threads.
        ThreadKind::DeviceLoop | ThreadKind::Api | ThreadKind::Helper => {
            let mut m: BTreeMap<i64, Vec<SeccompRule>> = NEVER_IN_THREADS
                .iter()
                .map(|&nr| (nr, Vec::new()))
                .collect();
            // clone without CLONE_THREAD (a new process) traps.
            m.insert(
                libc::SYS_clone,
                vec![cond(
                    SeccompCondition::new(
                        0,
                        SeccompCmpArgLen::Qword,
                        SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
                        0,
                    )
                    .map_err(rule_err),
                )?],
            );
            (BTreeMap::new(), m)
        }
    };
    let filter_err = |e| Error::Config(format!("seccomp filter ({}): {e}", kind.name()));
    if trap.is_empty() {
        let mut allow = allow;
        allow.insert(libc::SYS_clone, vec![thread_clone]);
        let f = SeccompFilter::new(
            allow,
            SeccompAction::Trap,
            SeccompAction::Allow,
            TargetArch::x86_64,
        )
        .map_err(filter_err)?;
        Ok(vec![compile(f)?])
    } else {
        let f = SeccompFilter::new(
            trap,
            SeccompAction::Allow,
            SeccompAction::Trap,
            TargetArch::x86_64,
        )
        .map_err(filter_err)?;
        // clone3 passes its flags in memory, out of a filter's sight: refused with ENOSYS
        // (a second filter: one filter has one action), which makes the C library fall back
        // to clone, whose flags the first one checks.
        let clone3 = SeccompFilter::new(
            [(libc::SYS_clone3, Vec::new())].into_iter().collect(),
            SeccompAction::Allow,
            SeccompAction::Errno(libc::ENOSYS as u32),
            TargetArch::x86_64,
        )
        .map_err(filter_err)?;
        Ok(vec![compile(f)?, compile(clone3)?])
    }
}

/// The compiled filters of every thread kind, made once by [`install`] (compiling on a
/// restore's critical path would cost more than installing).
static THREAD_PROGRAMS: OnceLock<Vec<(ThreadKind, Vec<BpfProgram>)>> = OnceLock::new();

fn thread_programs() -> Result<&'static [(ThreadKind, Vec<BpfProgram>)]> {
    if let Some(p) = THREAD_PROGRAMS.get() {
        return Ok(p);
    }
    let programs = ThreadKind::ALL
        .iter()
        .map(|&k| thread_program(k).map(|p| (k, p)))
        .collect::<Result<Vec<_>>>()?;
    Ok(THREAD_PROGRAMS.get_or_init(|| programs))
}

/// True if this thread runs under a seccomp filter (the process filter, normally).
pub fn active() -> bool {
    // SAFETY: PR_GET_SECCOMP takes no pointers.
    unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) == 2 }
}

/// Adds `kind`'s filter to the calling thread if the process filter is on (nothing
/// otherwise: a VMM run with `--no-seccomp`, or a library user without filters).
pub fn confine_current_thread(kind: ThreadKind) {
    add_thread_filter(kind);
    probe(Some(kind));
}

/// [`confine_current_thread`] without the test hook (a spare thread confines itself long
/// before it gets its body, and probes then).
pub(crate) fn add_thread_filter(kind: ThreadKind) {
    if !active() {
        return;
    }
    let program = match thread_programs() {
        Ok(p) => p.iter().find(|(k, _)| *k == kind).map(|(_, p)| p),
        Err(e) => {
            tracing::error!(
                "seccomp: {e}; this {} thread keeps the process filter only",
                kind.name()
            );
            return;
        }
    };
    for p in program.into_iter().flatten() {
        if let Err(e) = seccompiler::apply_filter(p) {
            tracing::error!(
                "seccomp: confining a {} thread: {e}; it keeps the process filter only",
                kind.name()
            );
            break;
        }
    }
}

/// `runner`, with each body run as a confined thread of `kind`.
pub fn confine(kind: ThreadKind, runner: ThreadRunner) -> ThreadRunner {
    Box::new(move |name, body| {
        runner(
            name,
            Box::new(move || {
                confine_current_thread(kind);
                body()
            }),
        )
    })
}

/// Writes `clade: seccomp: system call N is not allowed` and ends the process.
extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: for SIGSYS the kernel fills siginfo's `_sigsys` member; on x86_64 its
    // `_syscall` int is at byte offset 24 of the siginfo_t `info` points to.
    let nr = unsafe { (info as *const u8).add(24).cast::<i32>().read_unaligned() };
    // Built in a fixed buffer: nothing here may allocate.
    let mut line = [0u8; 128];
    let mut len = 0;
    let mut put = |bytes: &[u8]| {
        for &b in bytes {
            if len < line.len() {
                line[len] = b;
                len += 1;
            }
        }
    };
    put(b"clade: seccomp: system call #");
    let mut digits = [0u8; 10];
    let mut n = nr.unsigned_abs();
    let mut d = 0;
    loop {
        digits[d] = b'0' + (n % 10) as u8;
        n /= 10;
        d += 1;
        if n == 0 || d == digits.len() {
            break;
        }
    }
    digits[..d].reverse();
    put(&digits[..d]);
    put(b" is not allowed in thread ");
    let mut name = [0u8; 16];
    // SAFETY: PR_GET_NAME writes at most 16 bytes (NUL-terminated) into `name`.
    unsafe {
        libc::prctl(
            libc::PR_GET_NAME,
            name.as_mut_ptr() as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    put(&name[..end]);
    put(b"; stopping\n");
    // SAFETY: write(2) and _exit(2) are async-signal-safe; `line` outlives the call.
    unsafe {
        libc::write(2, line.as_ptr().cast(), len);
        libc::_exit(128 + libc::SIGSYS);
    }
}

/// Installs the process filter on every thread of this process (see the module
/// documentation); nothing if a filter is on already (`clade` installs it before building the
/// VM; a fork child inherits it).
pub fn install() -> Result<()> {
    if active() {
        return Ok(());
    }
    let program = program()?;
    thread_programs()?;
    vmm_sys_util::signal::register_signal_handler(libc::SIGSYS, on_sigsys).map_err(|e| {
        Error::Io {
            context: "installing the SIGSYS handler",
            source: std::io::Error::from_raw_os_error(e.errno()),
        }
    })?;
    seccompiler::apply_filter_all_threads(&program)
        .map_err(|e| Error::Config(format!("installing the seccomp filter: {e}")))?;
    tracing::debug!("seccomp filter installed on all threads");
    Ok(())
}

/// Test hook: `CLADE_SECCOMP_PROBE=1` makes the owner try a call outside the process filter
/// right after installing it; `CLADE_SECCOMP_PROBE=<kind>` (`vcpu`, `devices`, ...) makes a
/// thread of that kind try `execve` (allowed by the process filter, not by the kind's) right
/// after confining itself. The seccomp tests expect the process to end with the log line.
pub(crate) fn probe(kind: Option<ThreadKind>) {
    #[cfg(feature = "test-hooks")]
    if let Ok(v) = std::env::var("CLADE_SECCOMP_PROBE") {
        match kind {
            None if v == "1" => {
                // SAFETY: personality(0xffffffff) only queries the persona; here it traps.
                unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffffu64) };
            }
            Some(k) if v == k.name() => {
                // SAFETY: execve with null pointers fails with EFAULT if it is allowed at
                // all; here it must trap.
                unsafe { libc::syscall(libc::SYS_execve, 0usize, 0usize, 0usize) };
            }
            _ => {}
        }
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = kind;
}
