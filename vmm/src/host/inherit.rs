//! What the processes Clade starts inherit from their starter: an allow-list of
//! environment variables and the three standard streams, never whatever the starter
//! happens to have.
//!
//! A service (`clade serve`) is given its secrets in its environment: the API key, the
//! cluster secret, the registry's database URL with its password, the object store's
//! credentials. It may also have been handed descriptors by whoever started it (a
//! supervisor's pipes, a build tool's jobserver). A process it starts with
//! `std::process::Command` inherits all of the environment, and every descriptor that is
//! not close-on-exec, unless told otherwise; and a VM process is exactly the one a guest
//! that escapes into its VMM gets: `/proc/self/environ` (and its own memory) would hand it
//! the cluster. So every VM process, standby, build VM, fork child and host agent is
//! started through [`clean_child`]: the environment is cleared and only the variables
//! such a child reads that are no secret ([`PASSED`]) are copied, and every descriptor but
//! 0, 1 and 2 is closed at the exec. A child that needs another variable or descriptor is
//! given it explicitly by its starter (`cmd.env(..)`, `sandbox::vmproc::inherit_descriptor`).

use std::os::unix::process::CommandExt;
use std::process::Command;

/// The variables a started process keeps (when its starter has them): where programs are
/// found, where temporary files go, the log filters (`CLADE_LOG` for `clade`,
/// `CLADE_AGENT_LOG` for `clade-agent`, Rust's backtrace switches), and the fault
/// injection points the VMM's own tests set (`CLADE_FORK_FAIL_AFTER`,
/// `CLADE_SNAPSHOT_CRASH_AT`, `CLADE_SECCOMP_PROBE`), which name steps, never data.
pub const PASSED: &[&str] = &[
    "PATH",
    "TMPDIR",
    "CLADE_LOG",
    "CLADE_AGENT_LOG",
    "RUST_BACKTRACE",
    "RUST_LIB_BACKTRACE",
    "CLADE_FORK_FAIL_AFTER",
    "CLADE_SNAPSHOT_CRASH_AT",
    "CLADE_SECCOMP_PROBE",
];

/// Makes `cmd` start with an empty environment plus the variables of [`PASSED`] this
/// process has, and with no descriptor of this process but its standard streams (as
/// `cmd` sets them up). Call it first, right after `Command::new`: variables set on `cmd`
/// afterwards are added, and descriptors handed over by a later `pre_exec` (which clears
/// their close-on-exec flag) are kept.
pub fn clean_child(cmd: &mut Command) -> &mut Command {
    cmd.env_clear();
    for name in PASSED {
        if let Some(value) = std::env::var_os(name) {
            cmd.env(name, value);
        }
    }
    // SAFETY: the closure runs in the child between fork and exec and makes one
    // async-signal-safe system call (close_range on the child's own descriptors),
    // allocating nothing.
    unsafe {
        cmd.pre_exec(|| {
            // Close-on-exec rather than closed: a later closure may still use one of them
            // before the exec (a cgroup's file), or hand it over by clearing the flag. A
            // kernel without close_range (before 5.9) or its flag (5.11) leaves them as
            // they are: Rust opens its own descriptors close-on-exec anyway.
            const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, CLOSE_RANGE_CLOEXEC);
            Ok(())
        })
    };
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_child_gets_only_the_allow_listed_variables_and_descriptors() {
        // cargo runs tests with variables of its own (CARGO_*): none is on the list.
        assert!(std::env::vars_os().any(|(k, _)| !PASSED.iter().any(|p| *p == k)));
        // A descriptor this process has without close-on-exec, as one inherited from a
        // service's own starter would be.
        let file = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: dup of a descriptor this test owns; the copy is closed below.
        let leaked = unsafe { libc::dup(file.as_raw_fd()) };
        assert!(leaked > 2);
        let mut cmd = Command::new("sh");
        clean_child(&mut cmd)
            .env("CLADE_CHILD_SPECIFIC", "1")
            .args([
                "-c",
                &format!(
                "cat /proc/self/environ; if test -e /proc/self/fd/{leaked}; then echo LEAKED; fi"
            ),
            ]);
        let out = cmd.output().unwrap();
        // SAFETY: closes the copy made above.
        unsafe { libc::close(leaked) };
        assert!(out.status.success());
        let out = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(!out.contains("LEAKED"), "fd {leaked} reached the child");
        let env: Vec<(&str, &str)> = out
            .split('\0')
            .filter(|kv| !kv.is_empty())
            .map(|kv| kv.split_once('=').unwrap_or((kv, "")))
            .collect();
        for (k, _) in &env {
            // The shell adds PWD (and may add SHLVL, _) of its own.
            assert!(
                PASSED.contains(k) || ["CLADE_CHILD_SPECIFIC", "PWD", "SHLVL", "_"].contains(k),
                "{k} passed: {env:?}"
            );
        }
        assert!(env.contains(&("CLADE_CHILD_SPECIFIC", "1")));
        if let Some(path) = std::env::var("PATH").ok().filter(|p| !p.is_empty()) {
            assert!(env.contains(&("PATH", path.as_str())));
        }
    }
}
