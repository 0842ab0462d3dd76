//! The VMM's system-call filter ([`install`]): an allow-list of the calls a VMM process
//! makes (KVM, memory, files, Unix sockets, threads, starting fork children), installed on
//! every thread of the process at once (TSYNC) before the owner loop runs, and inherited
//! by the fork children it starts. Anything else traps: the SIGSYS handler writes one line
//! naming the call to standard error and ends the process with status 159 (128 + SIGSYS).
//!
//! One filter for the whole process for now; arguments are checked only for `socket`
//! (Unix sockets only). Written with the seccompiler crate.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

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

/// The filter, compiled.
fn program() -> Result<BpfProgram> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED.iter().map(|&nr| (nr, Vec::new())).collect();
    let unix_only = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        libc::AF_UNIX as u64,
    )
    .and_then(|c| SeccompRule::new(vec![c]))
    .map_err(|e| Error::Config(format!("seccomp rule: {e}")))?;
    rules.insert(libc::SYS_socket, vec![unix_only]);
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Trap,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|e| Error::Config(format!("seccomp filter: {e}")))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| Error::Config(format!("seccomp filter: {e}")))
}

/// Writes `clade: seccomp: system call N is not allowed` and ends the process.
extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: for SIGSYS the kernel fills siginfo's `_sigsys` member; on x86_64 its
    // `_syscall` int is at byte offset 24 of the siginfo_t `info` points to.
    let nr = unsafe { (info as *const u8).add(24).cast::<i32>().read_unaligned() };
    let mut line = *b"clade: seccomp: system call #          is not allowed; stopping\n";
    // The number right after '#' (byte 29), at most 9 digits, padded after with spaces.
    let mut digits = [0u8; 10];
    let mut n = nr.unsigned_abs();
    let mut len = 0;
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        n /= 10;
        len += 1;
        if n == 0 || len == 9 {
            break;
        }
    }
    for (k, d) in digits[..len].iter().rev().enumerate() {
        line[29 + k] = *d;
    }
    // SAFETY: write(2) and _exit(2) are async-signal-safe; `line` outlives the call.
    unsafe {
        libc::write(2, line.as_ptr().cast(), line.len());
        libc::_exit(128 + libc::SIGSYS);
    }
}

/// Installs the filter on every thread of this process (see the module documentation).
pub fn install() -> Result<()> {
    let program = program()?;
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

/// Test hook: `CLADE_SECCOMP_PROBE=1` makes the owner try a call outside the filter right
/// after installing it (the seccomp test expects the process to end with the log line).
pub(crate) fn probe() {
    #[cfg(feature = "test-hooks")]
    if std::env::var("CLADE_SECCOMP_PROBE").is_ok_and(|v| v == "1") {
        // SAFETY: personality(0xffffffff) only queries the persona; here it must trap.
        unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffffu64) };
    }
}
