//! The jail with limits of its own, in three processes (see [`super`]): the caller that
//! waits for it in the host's namespaces (passing stop signals on, clearing its
//! parent-death signal when the VM outlives its starter), and the keeper, PID 1 of the
//! jail's PID namespace, which builds the jail, starts the VM process and reaps. A jail
//! with no cgroup of its own needs neither: it is one process.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicI32, Ordering};

use nix::errno::Errno;
use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::{kill, sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult, Pid};

use super::{
    build_root, drop_privileges, errno_err, jail_err, Cgroup, Checked, JailConfig, Jailed, Link,
    ProcView, StarterLink,
};
use crate::error::{Error, Result};

/// [`super::enter`] for a jail with a cgroup of its own: the keeper in a new PID namespace,
/// the caller waiting for it.
pub(super) fn enter_with_keeper(
    config: &JailConfig,
    checked: &Checked,
    cgroup: Cgroup,
) -> Result<Jailed> {
    let (report_rx, report_tx) = UnixStream::pair()
        .map_err(|e| jail_err(format!("creating the jail's report channel: {e}")))?;
    let (link_rx, link_tx) = UnixStream::pair()
        .map_err(|e| jail_err(format!("creating the jail's starter link: {e}")))?;
    unshare(CloneFlags::CLONE_NEWPID).map_err(|e| errno_err("new PID namespace", e))?;
    // SAFETY: this process has exactly one thread (checked above), so the child is a
    // complete copy and may run any code.
    match unsafe { fork() }.map_err(|e| errno_err("starting the jail's keeper", e))? {
        ForkResult::Child => {
            drop(report_rx);
            drop(link_rx);
            // The jail ends with the process that started it (SIGKILL to PID 1 ends every
            // process of the namespace): no VM is left behind by a killed supervisor.
            // SAFETY: prctl(PR_SET_PDEATHSIG) takes no pointers.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
            // A starter that ended before the signal was set sends none: its end of the
            // link is closed then (it never writes to it), which a peek sees as the end.
            if starter_gone(&link_tx) {
                std::process::exit(1);
            }
            match keeper(config, checked, &cgroup, report_tx, link_tx) {
                Ok(KeeperRole::Vm(link)) => Ok(Jailed::Inside(link)),
                Ok(KeeperRole::Done(code)) => std::process::exit(code.into()),
                Err((e, tx)) => {
                    let msg = match e {
                        Error::Jail(m) => m,
                        other => other.to_string(),
                    };
                    report(tx, &msg);
                    std::process::exit(1)
                }
            }
        }
        ForkResult::Parent { child } => {
            drop(report_tx);
            drop(link_tx);
            // The namespace is for the keeper; this process stays where it was, as root:
            // it removes the jail's cgroup at the end.
            let setup = read_report(report_rx);
            let code = wait_forwarding(child, link_rx);
            if let Err(e) = cgroup.remove() {
                tracing::warn!("{e}; left in place");
            }
            match setup {
                Some(msg) => Err(Error::Jail(msg)),
                None => Ok(Jailed::Ended(code)),
            }
        }
    }
}

/// A signal to pass on, set by [`on_forward_signal`].
static FORWARD: AtomicI32 = AtomicI32::new(0);
/// The write end of the caller's wake-up pipe (-1: none), written by its signal handlers
/// so that a signal between a check and the wait is not missed.
static WAKE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_forward_signal(num: libc::c_int) {
    FORWARD.store(num, Ordering::SeqCst);
    wake();
}

extern "C" fn on_child(_: libc::c_int) {
    wake();
}

fn wake() {
    let fd = WAKE.load(Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: write(2) of one byte from a static buffer to a descriptor this process
        // owns (a non-blocking pipe); async-signal-safe. A full pipe already wakes.
        unsafe { libc::write(fd, [0u8].as_ptr().cast(), 1) };
    }
}

/// Whether the process at the other end of `link` (the jail's starter, which holds it
/// open and writes nothing into it while it lives) has ended.
pub(super) fn starter_gone(link: &UnixStream) -> bool {
    use nix::sys::socket::{recv, MsgFlags};
    let mut b = [0u8; 1];
    matches!(
        recv(
            link.as_raw_fd(),
            &mut b,
            MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT
        ),
        Ok(0)
    )
}

/// Writes a setup failure to the report channel.
fn report(mut tx: UnixStream, msg: &str) {
    let _ = tx.write_all(msg.as_bytes());
}

/// Reads the report channel to its end: None when the jail was set up (nothing written).
fn read_report(rx: UnixStream) -> Option<String> {
    let mut msg = String::new();
    let _ = rx.take(4096).read_to_string(&mut msg);
    (!msg.is_empty()).then_some(msg)
}

fn forward_signals() {
    let action = SigAction::new(
        SigHandler::Handler(on_forward_signal),
        // No SA_RESTART: waitpid returns EINTR so the signal is passed on at once.
        SaFlags::empty(),
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        if let Err(e) = unsafe { sigaction(sig, &action) } {
            tracing::warn!("jail: cannot pass {sig} on: {e}");
        }
    }
}

fn pass_on(pid: Pid) {
    let sig = FORWARD.swap(0, Ordering::SeqCst);
    if sig != 0 {
        if let Ok(s) = Signal::try_from(sig) {
            let _ = kill(pid, s);
        }
    }
}

fn exit_code(status: WaitStatus) -> Option<u8> {
    match status {
        WaitStatus::Exited(_, code) => Some(code as u8),
        WaitStatus::Signaled(_, sig, _) => Some(128u8.saturating_add(sig as i32 as u8)),
        _ => None,
    }
}

/// The caller's side: waits for the keeper, passing stop signals on, and clears its own
/// parent-death signal when the VM process says it outlives its starter (`link`).
fn wait_forwarding(keeper: Pid, link: UnixStream) -> u8 {
    // Non-blocking both ways: the handlers never block, the drain below never waits.
    let pipe = std::io::pipe().and_then(|(rx, tx)| {
        for fd in [rx.as_raw_fd(), tx.as_raw_fd()] {
            nix::fcntl::fcntl(fd, nix::fcntl::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK))?;
        }
        Ok((rx, tx))
    });
    let Ok((mut wake_rx, wake_tx)) = pipe else {
        tracing::warn!("jail: no wake-up pipe; the starter link is not watched");
        return wait_blocking(keeper);
    };
    WAKE.store(wake_tx.as_raw_fd(), Ordering::SeqCst);
    forward_signals();
    let action = SigAction::new(
        SigHandler::Handler(on_child),
        SaFlags::SA_NOCLDSTOP,
        SigSet::empty(),
    );
    // SAFETY: the handler only writes one byte to a pipe, which is async-signal-safe.
    if let Err(e) = unsafe { sigaction(Signal::SIGCHLD, &action) } {
        tracing::warn!("jail: cannot watch the keeper's end: {e}");
        return wait_blocking(keeper);
    }
    let code = watch(keeper, link, &mut wake_rx);
    // The handlers stay installed: they must not write to a descriptor reused later.
    WAKE.store(-1, Ordering::SeqCst);
    drop(wake_tx);
    code
}

/// [`wait_forwarding`]'s loop: woken through `wake_rx` by signals and the keeper's end.
fn watch(keeper: Pid, link: UnixStream, wake_rx: &mut std::io::PipeReader) -> u8 {
    use nix::poll::{poll, PollFd, PollFlags};
    use nix::sys::wait::WaitPidFlag;
    let mut link = Some(link);
    loop {
        match waitpid(keeper, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(Errno::EINTR) => {}
            Ok(status) => {
                if let Some(code) = exit_code(status) {
                    return code;
                }
            }
            Err(e) => {
                tracing::warn!("jail: waiting for the keeper: {e}");
                return 1;
            }
        }
        pass_on(keeper);
        let mut fds = vec![PollFd::new(&*wake_rx, PollFlags::POLLIN)];
        if let Some(l) = &link {
            fds.push(PollFd::new(l, PollFlags::POLLIN));
        }
        match poll(&mut fds, -1) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => {
                tracing::warn!("jail: waiting: {e}");
                return wait_blocking(keeper);
            }
        }
        let link_ready = fds
            .get(1)
            .and_then(|f| f.revents())
            .is_some_and(|r| !r.is_empty());
        drop(fds);
        let mut buf = [0u8; 64];
        while matches!(wake_rx.read(&mut buf), Ok(n) if n > 0) {}
        if link_ready {
            if let Some(mut l) = link.take() {
                if matches!(l.read(&mut buf[..1]), Ok(1)) {
                    // SAFETY: PR_SET_PDEATHSIG with 0 only changes this thread's attribute.
                    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, 0, 0, 0, 0) };
                    tracing::debug!("jail: the VM outlives its starter");
                }
                // Anything else (its end, an error): nothing more to watch.
            }
        }
    }
}

/// Waits for the keeper without watching the starter link.
fn wait_blocking(keeper: Pid) -> u8 {
    forward_signals();
    loop {
        match waitpid(keeper, None) {
            Ok(status) => {
                if let Some(code) = exit_code(status) {
                    return code;
                }
            }
            Err(Errno::EINTR) => pass_on(keeper),
            Err(e) => {
                tracing::warn!("jail: waiting for the keeper: {e}");
                return 1;
            }
        }
    }
}

enum KeeperRole {
    /// This is the VM process.
    Vm(StarterLink),
    /// The keeper's work is done: exit with this code.
    Done(u8),
}

type KeeperResult<T> = std::result::Result<T, (Error, UnixStream)>;

/// PID 1 of the jail: builds the jail, starts the VM process, reaps.
fn keeper(
    config: &JailConfig,
    checked: &Checked,
    cgroup: &Cgroup,
    report_tx: UnixStream,
    link_tx: UnixStream,
) -> KeeperResult<KeeperRole> {
    if let Err(e) = build_root(config, checked, Some(cgroup), ProcView::Namespace) {
        return Err((e, report_tx));
    }
    // SAFETY: the keeper has one thread (it is a fork of a one-thread process and started
    // none).
    match unsafe { fork() } {
        Err(e) => Err((errno_err("starting the VM process", e), report_tx)),
        Ok(ForkResult::Child) => match drop_privileges(config) {
            Ok(()) => {
                // Success is the channel's end with nothing written.
                drop(report_tx);
                Ok(KeeperRole::Vm(StarterLink(Link::Caller(link_tx))))
            }
            Err(e) => Err((e, report_tx)),
        },
        Ok(ForkResult::Parent { child }) => {
            // The jail is built: reaping and passing signals on to processes of the VM's
            // user need no privilege, so the keeper keeps none, for as long as the VM
            // lives. A keeper that cannot drop them ends the VM it started.
            if let Err(e) = drop_privileges(config) {
                let _ = kill(child, Signal::SIGKILL);
                let _ = waitpid(child, None);
                return Err((e, report_tx));
            }
            // Changing credentials cleared the parent-death signal: set it again, and see
            // that the starter did not end meanwhile (it would send none).
            // SAFETY: prctl(PR_SET_PDEATHSIG) takes no pointers.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
            if starter_gone(&link_tx) {
                let _ = kill(child, Signal::SIGKILL);
                let _ = waitpid(child, None);
                std::process::exit(1);
            }
            drop(link_tx);
            drop(report_tx);
            Ok(KeeperRole::Done(reap(child)))
        }
    }
}

/// Waits for every process of the jail; the VM process's exit code.
fn reap(vm: Pid) -> u8 {
    forward_signals();
    let mut code = None;
    loop {
        match waitpid(Pid::from_raw(-1), None) {
            Ok(status) => {
                if status.pid() == Some(vm) {
                    code = exit_code(status).or(code);
                }
            }
            Err(Errno::EINTR) => pass_on(vm),
            Err(Errno::ECHILD) => return code.unwrap_or(1),
            Err(e) => {
                tracing::warn!("jail: reaping: {e}");
                return code.unwrap_or(1);
            }
        }
    }
}
