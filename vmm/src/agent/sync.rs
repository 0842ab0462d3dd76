//! The agent sync after a VM was restored or forked: its guest clock stood still while it
//! was saved, its entropy pool is a copy, and a fork child shares its parent's hostname.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use super::{Client, Command, Transport, AGENT_VSOCK_PORT};
use crate::error::{Error, Result};

/// Gives the guest agent behind the vsock socket `path` the current time and 64 bytes of
/// fresh entropy, and with `hostname_suffix` appends it to the guest's hostname. Best
/// effort: the outcome is logged and returned (how long it took, or why it failed).
pub(crate) fn sync_after_restore(
    path: &Path,
    timeout: Duration,
    hostname_suffix: Option<&str>,
) -> std::result::Result<Duration, String> {
    let t = Instant::now();
    // A just-restored guest resets the connections it has when it handles the vsock
    // device's transport-reset event, which may come after this connection was made: a
    // sync cut off that way (before or after the agent's answer) is done again on a new
    // connection (each step is idempotent).
    let mut result = sync_once(path, timeout, hostname_suffix);
    for _ in 0..SYNC_ATTEMPTS - 1 {
        let cut = matches!(
            result,
            Err(Error::AgentDisconnected | Error::AgentHandshake { .. })
        );
        if !cut || t.elapsed() >= timeout {
            break;
        }
        tracing::debug!("agent sync: connection reset by the restored guest, again");
        std::thread::sleep(Duration::from_millis(5));
        result = sync_once(path, timeout.saturating_sub(t.elapsed()), hostname_suffix);
    }
    match result {
        Ok(()) => {
            tracing::info!(
                "agent sync: clock set, entropy added{} in {:?}",
                if hostname_suffix.is_some() {
                    ", hostname suffixed"
                } else {
                    ""
                },
                t.elapsed()
            );
            Ok(t.elapsed())
        }
        Err(e) => {
            tracing::warn!("agent sync failed (best effort): {e}");
            Err(e.to_string())
        }
    }
}

/// How many connections a sync may take (see [`sync_after_restore`]).
const SYNC_ATTEMPTS: usize = 4;

/// One sync on one connection. A hostname suffix is appended only if the guest's name
/// does not end with it yet, so a repeated sync does not append it twice.
fn sync_once(path: &Path, timeout: Duration, hostname_suffix: Option<&str>) -> Result<()> {
    {
        let client = Client::connect_timeout(
            path,
            Transport::Vsock {
                port: AGENT_VSOCK_PORT,
            },
            timeout,
        )?;
        // Entropy (and the guest's CRNG reseed) first: once the clock is right, the
        // guest's randomness is its own too (tests rely on that order).
        let mut seed = [0u8; 64];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut seed))
            .map_err(|source| Error::Io {
                context: "reading /dev/urandom",
                source,
            })?;
        client.add_entropy(&seed)?;
        client.set_clock(SystemTime::now())?;
        if let Some(suffix) = hostname_suffix {
            // Through /proc: hostname(1) may refuse names it finds invalid, e.g. "(none)-f1".
            let script = format!(
                "h=$(cat /proc/sys/kernel/hostname); case \"$h\" in ''|'(none)') h=clade;; esac; \
                 case \"$h\" in *'{suffix}') ;; *) echo \"$h{suffix}\" > /proc/sys/kernel/hostname;; esac"
            );
            client.output(&Command::new("/bin/sh").args(["-c", &script]), None)?;
        }
        Ok(())
    }
}
