//! `clade bench fork`: fork a running native guest (its `vsock` step answering pings) into
//! N children; the parent's pause, each child's time to its first answered ping, all of
//! them, and the host memory an idle child adds; a fork by full memory copy as baseline.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clade_bench::Samples;
use vmm::agent::{Client, Transport, AGENT_VSOCK_PORT};
use vmm::{ChildSpec, ForkOptions, SerialOutput, Shell, ShellSpec};

use super::bench_snapshot::boot_until;
use super::MachineArgs;

fn ping_once(sock: &Path) -> anyhow::Result<()> {
    let c = Client::connect_timeout(
        sock,
        Transport::Vsock {
            port: AGENT_VSOCK_PORT,
        },
        Duration::from_secs(20),
    )
    .with_context(|| format!("connecting to {}", sock.display()))?;
    c.ping()?;
    Ok(())
}

fn shells(machine: &MachineArgs, mem_mib: u64, n: usize) -> anyhow::Result<Vec<Shell>> {
    let spec = ShellSpec {
        kvm_device: machine.kvm_device.clone(),
        mem_bytes: mem_mib << 20,
        vcpus: machine.vcpus,
        dirty_log: true,
    };
    (0..n)
        .map(|_| Shell::create(&spec).map_err(Into::into))
        .collect()
}

pub fn fork(
    guest: PathBuf,
    n: usize,
    json: bool,
    machine: MachineArgs,
    fill: u32,
) -> anyhow::Result<u8> {
    super::bench::check_guest(&guest)?;
    let mem_mib = machine.mem_mib;
    let dir = std::env::temp_dir().join(format!("clade-bench-fork-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let psock = dir.join("p.sock");
    let fill_mib = (mem_mib.saturating_sub(64) * u64::from(fill) / 100).max(1);
    let mut parent = boot_until(
        &guest,
        &machine,
        &format!("memfill:1:{fill_mib},vsock,vsock"),
        Some(&psock),
        "serving agent port",
    )?;
    // Shells are built ahead (a pool's job, not measured).
    let pre = shells(&machine, mem_mib, n)?;
    let paths: Vec<PathBuf> = (0..n).map(|i| dir.join(format!("c{i}.sock"))).collect();
    let t0 = Instant::now();
    let (children, report) = vmm::fork_with_report(
        &mut parent,
        n,
        ForkOptions {
            serial: SerialOutput::Memory,
            vsock_paths: paths.clone(),
            shells: pre,
            start: true,
            ..ForkOptions::default()
        },
    )?;
    let built = t0.elapsed();
    // Every child answered: pinged in parallel.
    let handles: Vec<_> = paths
        .iter()
        .cloned()
        .map(|p| {
            std::thread::spawn(move || -> anyhow::Result<Duration> {
                let t = Instant::now();
                ping_once(&p)?;
                Ok(t.elapsed())
            })
        })
        .collect();
    let mut ping_times = Vec::new();
    for h in handles {
        ping_times.push(
            h.join()
                .map_err(|_| anyhow::anyhow!("ping thread panicked"))??,
        );
    }
    let all = t0.elapsed();
    // A child's latency: the pause plus its own build, then its first answered ping.
    let mut samples = Samples::new();
    for (b, p) in report.child_times.iter().zip(&ping_times) {
        samples.push(report.pause_time + *b + *p);
    }
    std::thread::sleep(Duration::from_millis(200));
    let pss: u64 = children
        .iter()
        .map(|c| c.memory_pss_kib())
        .collect::<Result<Vec<_>, _>>()?
        .iter()
        .sum();
    let pss_per_child = pss / n.max(1) as u64;
    let parent_pss = parent.memory_pss_kib()?;
    drop(children);

    // Baseline: a fork by full copy of guest memory (freeze, copy the frozen image, then
    // the same child build).
    let (frozen, freeze_report) = vmm::freeze(&mut parent)?;
    let tb = Instant::now();
    let frozen = frozen.with_copied_memory()?;
    let copy_time = tb.elapsed();
    let base_pause = freeze_report.pause_time;
    let bsock = dir.join("baseline.sock");
    let child = frozen.child(ChildSpec {
        disk_path: None,
        vsock_path: Some(bsock.clone()),
        guest_cid: 99,
        serial: SerialOutput::Memory,
        shell: shells(&machine, mem_mib, 1)?.pop(),
        agent_sync: None,
        hostname_suffix: String::new(),
        start: true,
        vcpu_cpus: Vec::new(),
    })?;
    ping_once(&bsock)?;
    let baseline = base_pause + tb.elapsed();
    drop(child);
    drop(parent);
    let _ = std::fs::remove_dir_all(&dir);

    let s = samples.summary("child_first_ping");
    let p50 = s.p50_us as u128;
    let p99 = s.p99_us as u128;
    if json {
        println!(
            "{}",
            serde_json::json!({
                "bench": "fork",
                "mem_mib": mem_mib,
                "fill_mib": fill_mib,
                "n": n,
                "pause_us": report.pause_time.as_micros() as u64,
                "pause_steps_us": report.pause_steps.iter().map(|(k, d)| (k.to_string(), d.as_micros() as u64)).collect::<std::collections::BTreeMap<_, _>>(),
                "child_p50_us": p50 as u64,
                "child_p99_us": p99 as u64,
                "children_built_ms": built.as_secs_f64() * 1e3,
                "all_ms": all.as_secs_f64() * 1e3,
                "pss_per_child_kib": pss_per_child,
                "parent_pss_kib": parent_pss,
                "baseline_child_p50_us": baseline.as_micros() as u64,
                "baseline_copy_us": copy_time.as_micros() as u64,
            })
        );
    } else {
        println!("fork of a {mem_mib} MiB guest ({fill_mib} MiB filled) into {n} children");
        println!(
            "  parent paused       {:?} ({:?})",
            report.pause_time, report.pause_steps
        );
        println!("  child first ping    p50 {p50} us, p99 {p99} us");
        println!(
            "  all {n} answering    {:.2} ms (built in {:.2} ms)",
            all.as_secs_f64() * 1e3,
            built.as_secs_f64() * 1e3
        );
        println!("  PSS per idle child  {pss_per_child} KiB (parent {parent_pss} KiB)");
        println!(
            "  baseline (full copy) child first ping {} us (copy {:?})",
            baseline.as_micros(),
            copy_time
        );
    }
    Ok(0)
}
