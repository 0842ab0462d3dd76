//! `ping`: agent round trips, `vmm::agent::Client::ping` over virtio-vsock to the native
//! guest's agent-protocol responder (its `vsock` step), through the VM's Unix socket.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm::VmExit;

use crate::error::{Context, Error, Result};
use crate::guest::{config, connect, last_serial_line, serial, Guest, Machine};
use crate::stats::{Samples, Summary};

/// Longest the ping benchmark waits for any progress (connecting included: it retries for
/// 10 s, each try waiting up to 10 s for the guest).
const STALL: Duration = Duration::from_secs(25);

/// Boots the guest's `vsock` step, pings its agent port `warmup` times, then measures `n`
/// round trips; checks that the guest counted as many. Reported as `agent_ping_rtt`.
///
/// `gap`: how long the client waits before each measured ping. The guest halts as soon as
/// it is idle (unless booted with a `poll_us=` window), so every round trip includes its
/// wake-up by the device's interrupt; a gap longer than the host's halt-polling window
/// (KVM's `halt_poll_ns`, 200 us by default) also puts the vCPU's thread to sleep in
/// between, as before the first request to an idle guest (a restored or newly created
/// sandbox's). Reported as `agent_ping_rtt_after_<gap>us`.
pub fn ping(
    guest: &Guest,
    machine: &Machine,
    n: usize,
    warmup: usize,
    gap: Duration,
) -> Result<Summary> {
    if n == 0 {
        return Err(Error::InvalidParams("--n must be at least 1".into()));
    }
    // Removed by the VM when it is dropped.
    let sock = std::env::temp_dir().join(format!("clade-bench-ping-{}.sock", std::process::id()));
    // One connection: closing it ends the step and the guest, which then reports its count.
    let mut vm = vmm::boot(config(guest, machine, "vsock:1", Some(&sock)))?;
    vm.start()?;
    // The client blocks without a timeout; it runs on a thread of its own so that a stuck
    // device or guest ends the benchmark with an error instead of hanging it.
    let done = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mpsc::channel();
    let progress = Arc::clone(&done);
    let sock_path = sock.clone();
    std::thread::spawn(move || {
        let _ = tx.send(measure(&sock_path, warmup, n, gap, &progress));
    });
    let mut seen = 0;
    let mut since = Instant::now();
    let samples = loop {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok(samples)) => break samples,
            Ok(Err(e)) => {
                return Err(e)
                    .context_with(|| format!("guest's last output: {}", last_serial_line(&vm)))
            }
            Err(RecvTimeoutError::Disconnected) => return Err(Error::ThreadPanicked("client")),
            Err(RecvTimeoutError::Timeout) => {
                let now = done.load(Ordering::Relaxed);
                if now != seen {
                    seen = now;
                    since = Instant::now();
                } else if since.elapsed() > STALL {
                    return Err(Error::Guest(format!(
                        "no answer from the guest for {STALL:?} after {now} pings \
                         (guest's last output: {})",
                        last_serial_line(&vm)
                    )));
                }
            }
        }
    };
    // The client closed the connection, which ends the guest's step and the guest.
    let status = vm.wait_timeout(Duration::from_secs(10))?.ok_or_else(|| {
        Error::Guest(format!(
            "guest still running after the host closed (last output: {})",
            last_serial_line(&vm)
        ))
    })?;
    if status != VmExit::TestExit(0) {
        return Err(Error::Guest(format!(
            "guest ended with '{status}' (last output: {})",
            last_serial_line(&vm)
        )));
    }
    // The guest's own count must match what was measured.
    let expect = format!(" {} pings,", warmup + n);
    if !serial(&vm).contains(&expect) {
        return Err(Error::Guest(format!(
            "the guest did not report{expect} its output ends with {}",
            last_serial_line(&vm)
        )));
    }
    Ok(if gap.is_zero() {
        samples.summary("agent_ping_rtt")
    } else {
        samples.summary(&format!("agent_ping_rtt_after_{}us", gap.as_micros()))
    })
}

/// Connects to the guest's agent port through the VM's vsock socket, pings `warmup + n`
/// times (the last `n` each after `gap`) and returns the round trips of the last `n`.
/// Closes the connection when done.
fn measure(
    sock: &Path,
    warmup: usize,
    n: usize,
    gap: Duration,
    done: &AtomicUsize,
) -> Result<Samples> {
    let client =
        connect(sock, Duration::from_secs(10)).context("connect to the guest's agent port")?;
    tracing::debug!(warmup, n, "connected to the guest's agent port");
    let mut samples = Samples::new();
    for i in 0..warmup + n {
        if i >= warmup && !gap.is_zero() {
            std::thread::sleep(gap);
        }
        let t = Instant::now();
        client.ping().context_with(|| format!("ping {i}"))?;
        if i >= warmup {
            samples.push(t.elapsed());
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(samples)
}
