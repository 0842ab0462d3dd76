//! `clade bench resume` and `clade bench snapshot`: snapshot and resume latencies on the
//! native test guest.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clade_bench::Samples;
use serde_json::{json, Value};
use vmm::agent::{Client, Transport, AGENT_VSOCK_PORT};
use vmm::{
    MemoryBackend, PreparedSnapshot, RestoreOptions, SerialOutput, ShellPool, ShellSpec,
    SnapshotKind, Vm, VmConfig, VsockConfig,
};

use super::MachineArgs;

/// Guest memory below this is the image, boot structures and the VMM's tables; the
/// native guest's memfill/memchurn steps work above it.
const FILL_BASE_MIB: u64 = 64;

/// A scratch directory removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> anyhow::Result<Scratch> {
        let d = std::env::temp_dir().join(format!("clade-bench-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        Ok(Scratch(d))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn serial(vm: &Vm) -> String {
    String::from_utf8_lossy(&vm.serial_output().unwrap_or_default()).into_owned()
}

/// Boots the native guest with `steps` and waits for `ready` in its output.
pub(super) fn boot_until(
    guest: &Path,
    machine: &MachineArgs,
    steps: &str,
    vsock: Option<&Path>,
    ready: &str,
) -> anyhow::Result<Vm> {
    let config = VmConfig {
        vcpus: machine.vcpus,
        mem_mib: machine.mem_mib,
        kernel: guest.to_path_buf(),
        initrd: None,
        cmdline: format!("steps={steps}"),
        serial: SerialOutput::Memory,
        test_device: true,
        kvm_device: machine.kvm_device.clone(),
        vsock: vsock.map(|p| VsockConfig {
            uds_path: p.to_path_buf(),
            guest_cid: 3,
        }),
        disk: None,
    };
    let mut vm = vmm::boot(config)?;
    vm.start()?;
    let t = Instant::now();
    while !serial(&vm).contains(ready) {
        if let Some(status) = vm.wait_timeout(Duration::from_millis(5))? {
            bail!(
                "the guest ended ({status}) before '{ready}':\n{}",
                serial(&vm)
            );
        }
        if t.elapsed() > Duration::from_secs(120) {
            bail!("no '{ready}' from the guest in 120 s:\n{}", serial(&vm));
        }
    }
    Ok(vm)
}

fn pct_u64(v: &[u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Pins this thread (and so every VMM thread it starts from now on) to host CPU 0 and
/// returns the CPUs left for vCPUs: the native guest busy-polls, and a VMM thread queued
/// behind a spinning vCPU on a 2-CPU host waits out a scheduler time slice (~3 ms).
fn pin_vmm_threads() -> anyhow::Result<Vec<usize>> {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    if cpus < 2 {
        return Ok(Vec::new());
    }
    vmm::pin_current_thread(0).context("pinning the VMM to CPU 0")?;
    Ok((1..cpus).collect())
}

/// Per-step samples, reported as p50 in microseconds.
#[derive(Default)]
struct StepTimes(BTreeMap<&'static str, Samples>);

impl StepTimes {
    fn add(&mut self, name: &'static str, d: Duration) {
        self.0.entry(name).or_default().push(d);
    }

    fn p50_json(&self, order: &[&'static str]) -> Value {
        let mut m = serde_json::Map::new();
        let names = order
            .iter()
            .copied()
            .chain(self.0.keys().copied().filter(|k| !order.contains(k)));
        for name in names {
            if let Some(s) = self.0.get(name) {
                let v = s.percentile(50.0).unwrap_or(f64::NAN);
                m.insert(name.to_string(), json!((v * 10.0).round() / 10.0));
            }
        }
        Value::Object(m)
    }
}

/// One backend's resume measurements.
struct ResumeRun {
    backend: MemoryBackend,
    samples: Samples,
    faults: Vec<u64>,
    bytes_read: Vec<u64>,
    steps: StepTimes,
    cold: Option<(Duration, u64)>,
    working_set_pages: Option<usize>,
}

const STEP_ORDER: &[&str] = &[
    "read_check",
    "shell",
    "disk",
    "memory",
    "devices",
    "vm_state",
    "vcpu_state",
    "start",
    "devices_finish",
    "connect_hello",
    "ping",
];

/// Resumes `snap` `n` times with `backend`; each sample is from the call to
/// `PreparedSnapshot::restore` until the guest answered a ping through vsock.
fn measure_resumes(
    snap: &PreparedSnapshot,
    sock: &Path,
    backend: MemoryBackend,
    n: usize,
    pool: Option<&ShellPool>,
    vcpu_cpus: &[usize],
) -> anyhow::Result<ResumeRun> {
    let mut run = ResumeRun {
        backend,
        samples: Samples::new(),
        faults: Vec::new(),
        bytes_read: Vec::new(),
        steps: StepTimes::default(),
        cold: None,
        working_set_pages: None,
    };
    // uffd: the first resume records the working set (saved once the guest answered);
    // it is reported apart, as the cold resume.
    let rounds = n + usize::from(backend == MemoryBackend::Uffd);
    for i in 0..rounds {
        if let Some(p) = pool {
            // Resumes spaced so the pool is full again (its refill is not measured).
            if !p.wait_full(Duration::from_secs(10)) {
                bail!(
                    "the VM pool did not refill: {}",
                    p.last_error().unwrap_or_default()
                );
            }
        }
        let t0 = Instant::now();
        let mut vm = snap
            .restore(
                backend,
                RestoreOptions {
                    serial: SerialOutput::Memory,
                    vsock_path: Some(sock.to_path_buf()),
                    shell: pool.and_then(ShellPool::take),
                    vcpu_cpus: vcpu_cpus.to_vec(),
                    ..RestoreOptions::default()
                },
            )
            .with_context(|| format!("{backend} resume {i}"))?;
        let t_resumed = t0.elapsed();
        let client = Client::connect_timeout(
            sock,
            Transport::Vsock {
                port: AGENT_VSOCK_PORT,
            },
            Duration::from_secs(10),
        )
        .with_context(|| format!("{backend} resume {i}: connecting; serial:\n{}", serial(&vm)))?;
        let t_connected = t0.elapsed();
        client
            .ping()
            .with_context(|| format!("{backend} resume {i}: ping"))?;
        let total = t0.elapsed();
        let stats = vm.page_server_stats();
        let report = vm.restore_report().cloned();
        if backend == MemoryBackend::Uffd && i == 0 {
            run.cold = Some((total, stats.map_or(0, |s| s.faults)));
            run.working_set_pages = vm.save_working_set()?;
        } else {
            run.samples.push(total);
            run.faults.push(stats.map_or(0, |s| s.faults));
            run.bytes_read.push(stats.map_or_else(
                || report.as_ref().map_or(0, |r| r.bytes_read),
                |s| s.bytes_read,
            ));
            if let Some(r) = &report {
                for (name, d) in &r.steps {
                    run.steps.add(name, *d);
                }
                run.steps
                    .add("start_to_return", t_resumed.saturating_sub(r.total));
            }
            run.steps.add("connect_hello", t_connected - t_resumed);
            run.steps.add("ping", total - t_connected);
        }
        drop(vm);
        drop(client);
    }
    Ok(run)
}

#[allow(clippy::too_many_arguments)]
pub fn resume(
    guest: PathBuf,
    backend: MemoryBackend,
    n: usize,
    json_out: bool,
    machine: MachineArgs,
    pool_size: usize,
    fill_pct: u32,
    baseline_n: Option<usize>,
    pin: bool,
) -> anyhow::Result<u8> {
    super::bench::check_guest(&guest)?;
    let vcpu_cpus = if pin { pin_vmm_threads()? } else { Vec::new() };
    if n == 0 {
        bail!("-n must be at least 1");
    }
    if fill_pct > 100 {
        bail!("--fill must be a percentage (0..=100)");
    }
    let scratch = Scratch::new("resume")?;
    let dir = scratch.0.join("snap");
    let sock = scratch.0.join("v.sock");
    let fill_mib = machine.mem_mib.saturating_sub(FILL_BASE_MIB) * u64::from(fill_pct) / 100;
    let steps = if fill_mib > 0 {
        format!("memfill:5:{fill_mib},vsock")
    } else {
        "vsock".to_string()
    };
    let mut vm = boot_until(&guest, &machine, &steps, Some(&sock), "serving agent port")?;
    let snap = vmm::snapshot(&mut vm, &dir, SnapshotKind::Full)?;
    vm.shutdown();
    drop(vm);

    let pool = if pool_size > 0 {
        Some(ShellPool::new(
            ShellSpec {
                kvm_device: machine.kvm_device.clone(),
                mem_bytes: machine.mem_mib << 20,
                vcpus: machine.vcpus,
                dirty_log: true,
            },
            pool_size,
        )?)
    } else {
        None
    };
    // Opening a snapshot (reading and checking its files) is done once, as a service
    // resuming one snapshot many times would; its cost is reported apart.
    let mut open_t = Samples::new();
    for _ in 0..20 {
        let t = Instant::now();
        drop(PreparedSnapshot::open(&dir, Default::default())?);
        open_t.push(t.elapsed());
    }
    let prepared = PreparedSnapshot::open(&dir, Default::default())?;
    let main = measure_resumes(&prepared, &sock, backend, n, pool.as_ref(), &vcpu_cpus)?;
    let baseline = match baseline_n {
        Some(0) => None,
        _ if backend == MemoryBackend::Copy => None,
        bn => Some(measure_resumes(
            &prepared,
            &sock,
            MemoryBackend::Copy,
            bn.unwrap_or(n),
            pool.as_ref(),
            &vcpu_cpus,
        )?),
    };
    let s = main.samples.summary("resume_to_first_ping");
    let base_s = baseline
        .as_ref()
        .map(|b| b.samples.summary("resume_to_first_ping"));
    let (baseline_p50, baseline_p99) = match (&base_s, backend) {
        (Some(b), _) => (b.p50_us, b.p99_us),
        (None, MemoryBackend::Copy) => (s.p50_us, s.p99_us),
        (None, _) => (f64::NAN, f64::NAN),
    };
    let r1 = |v: f64| (v * 10.0).round() / 10.0;
    let out = json!({
        "backend": backend.name(),
        "mem_mib": machine.mem_mib,
        "vcpus": machine.vcpus,
        "n": s.n,
        "p50_us": r1(s.p50_us),
        "p99_us": r1(s.p99_us),
        "min_us": r1(s.min_us),
        "max_us": r1(s.max_us),
        "faults_p50": pct_u64(&main.faults, 50.0),
        "faults_p99": pct_u64(&main.faults, 99.0),
        "bytes_read_p50": pct_u64(&main.bytes_read, 50.0),
        "baseline_backend": "copy",
        "baseline_n": match (&base_s, backend) {
            (Some(b), _) => b.n,
            (None, MemoryBackend::Copy) => s.n,
            (None, _) => 0,
        },
        "baseline_p50_us": r1(baseline_p50),
        "baseline_p99_us": r1(baseline_p99),
        "baseline_bytes_read_p50": baseline.as_ref().map_or_else(
            || pct_u64(&main.bytes_read, 50.0),
            |b| pct_u64(&b.bytes_read, 50.0)
        ),
        "speedup_p50": r1(baseline_p50 / s.p50_us),
        "cold_us": main.cold.map(|c| r1(us(c.0))),
        "cold_faults": main.cold.map(|c| c.1),
        "working_set_pages": main.working_set_pages,
        "open_p50_us": r1(open_t.percentile(50.0).unwrap_or(f64::NAN)),
        "pool": pool_size,
        "vcpu_cpus": vcpu_cpus,
        "fill_mib": fill_mib,
        "snapshot_pages": snap.pages_written,
        "measured": "PreparedSnapshot::restore call until vmm::agent::Client::ping answered over vsock (native guest `vsock` step); opening the snapshot (open_p50_us) is done once",
        "steps_p50_us": main.steps.p50_json(STEP_ORDER),
        "baseline_steps_p50_us": baseline.as_ref().map(|b| b.steps.p50_json(STEP_ORDER)),
    });
    if json_out {
        println!("{out}");
    } else {
        println!(
            "resume_to_first_ping {}: n={} p50={:.1} us p99={:.1} us, faults p50 {}, \
             {} MiB guest ({} MiB filled), pool {}",
            main.backend,
            s.n,
            s.p50_us,
            s.p99_us,
            pct_u64(&main.faults, 50.0),
            machine.mem_mib,
            fill_mib,
            pool_size
        );
        if let Some((cold, faults)) = main.cold {
            println!(
                "  cold (first, recording): {:.1} us, {faults} faults; working set {} pages",
                us(cold),
                main.working_set_pages.unwrap_or(0)
            );
        }
        println!("  steps p50 (us): {}", main.steps.p50_json(STEP_ORDER));
        if let Some(b) = &base_s {
            println!(
                "  baseline copy: n={} p50={:.1} us p99={:.1} us -> {:.1}x",
                b.n,
                b.p50_us,
                b.p99_us,
                b.p50_us / s.p50_us
            );
        }
    }
    Ok(0)
}

pub fn snapshot(
    guest: PathBuf,
    n: usize,
    json_out: bool,
    machine: MachineArgs,
    dirty_pct: f64,
    fill_pct: u32,
    full_n: usize,
) -> anyhow::Result<u8> {
    super::bench::check_guest(&guest)?;
    if n == 0 || n >= vmm::MAX_DIFF_CHAIN {
        bail!(
            "-n must be in 1..{} (each diff is taken on top of the previous one)",
            vmm::MAX_DIFF_CHAIN
        );
    }
    if !(dirty_pct > 0.0 && dirty_pct <= 100.0) || fill_pct > 100 {
        bail!("--dirty and --fill are percentages");
    }
    let room = machine.mem_mib.saturating_sub(FILL_BASE_MIB);
    let dirty_mib = ((machine.mem_mib as f64 * dirty_pct / 100.0).round() as u64).max(1);
    let fill_mib = (room * u64::from(fill_pct) / 100).max(dirty_mib);
    if fill_mib > room {
        bail!(
            "a {} MiB guest has {room} MiB above {FILL_BASE_MIB} MiB for the test",
            machine.mem_mib
        );
    }
    let scratch = Scratch::new("snapshot")?;
    let steps = format!("memfill:3:{fill_mib},memchurn:{dirty_mib}");
    let ready = format!("step memfill:3:{fill_mib} ok");
    let mut vm = boot_until(&guest, &machine, &steps, None, &ready)?;
    std::thread::sleep(Duration::from_millis(100));

    let mut full = (Samples::new(), Samples::new(), Vec::new());
    for i in 0..full_n.max(1) {
        let info = vmm::snapshot(
            &mut vm,
            &scratch.0.join(format!("full{i}")),
            SnapshotKind::Full,
        )?;
        full.0.push(info.pause_time);
        full.1.push(info.total_time);
        full.2.push(info.pages_written);
    }
    let mut diff = (Samples::new(), Samples::new(), Vec::new(), Vec::new());
    let mut steps_t = StepTimes::default();
    for i in 0..n {
        // The guest rewrites its range over and over; let it dirty every page again.
        std::thread::sleep(Duration::from_millis(100));
        let info = vmm::snapshot(
            &mut vm,
            &scratch.0.join(format!("diff{i}")),
            SnapshotKind::Diff,
        )?;
        diff.0.push(info.pause_time);
        diff.1.push(info.total_time);
        diff.2.push(info.pages_considered);
        diff.3.push(info.pages_written);
        for (name, d) in &info.steps {
            steps_t.add(name, *d);
        }
    }
    vm.shutdown();
    let r1 = |v: f64| (v * 10.0).round() / 10.0;
    let p = |s: &Samples, q: f64| r1(s.percentile(q).unwrap_or(f64::NAN));
    let out = json!({
        "mem_mib": machine.mem_mib,
        "fill_mib": fill_mib,
        "dirty_mib": dirty_mib,
        "dirty_pct": dirty_pct,
        "full": {
            "n": full.0.len(),
            "pause_p50_us": p(&full.0, 50.0),
            "pause_p99_us": p(&full.0, 99.0),
            "total_p50_us": p(&full.1, 50.0),
            "total_p99_us": p(&full.1, 99.0),
            "pages_written_p50": pct_u64(&full.2, 50.0),
        },
        "diff": {
            "n": diff.0.len(),
            "pause_p50_us": p(&diff.0, 50.0),
            "pause_p99_us": p(&diff.0, 99.0),
            "total_p50_us": p(&diff.1, 50.0),
            "total_p99_us": p(&diff.1, 99.0),
            "dirty_pages_p50": pct_u64(&diff.2, 50.0),
            "pages_written_p50": pct_u64(&diff.3, 50.0),
            "steps_p50_us": steps_t.p50_json(&[
                "pause", "save_vcpus", "save_vm_devices", "dirty_log", "write_memory",
                "unpause", "commit_memory", "write_state",
            ]),
        },
        "measured": "Vm::snapshot of the native guest rewriting dirty_mib MiB (memchurn); pause = vCPUs stopped",
    });
    if json_out {
        println!("{out}");
    } else {
        println!(
            "snapshot {} MiB guest, {} MiB dirtied between diffs:\n  full: pause p50 {:.1} us, \
             total p50 {:.1} us ({} pages)\n  diff: pause p50 {:.1} us p99 {:.1} us, total \
             p50 {:.1} us ({} dirty pages)\n  diff steps p50 (us): {}",
            machine.mem_mib,
            dirty_mib,
            p(&full.0, 50.0),
            p(&full.1, 50.0),
            pct_u64(&full.2, 50.0),
            p(&diff.0, 50.0),
            p(&diff.0, 99.0),
            p(&diff.1, 50.0),
            pct_u64(&diff.2, 50.0),
            out["diff"]["steps_p50_us"]
        );
    }
    Ok(0)
}
