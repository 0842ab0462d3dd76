//! Clade as a library: boot a VM, run a command through its agent, snapshot it, restore the
//! snapshot as a second VM, fork the first into two children; print what each step took.
//!
//!     cargo run --release -p vmm --example embed -- KERNEL [INITRD] [--test-guest]
//!
//! KERNEL/INITRD: a Linux kernel and an initramfs whose init is `clade-agent` (hardware
//! KVM), or the project's native test guest with `--test-guest` (what CI runs: its agent
//! answers ping and reports every other operation, exec included, as unsupported).
use std::path::PathBuf;
use std::time::{Duration, Instant};

use vmm::agent::{Client, Command, Transport, AGENT_VSOCK_PORT};
use vmm::{ForkOptions, MemoryBackend, RestoreOptions, SerialOutput, SnapshotKind, VmConfig};

fn agent(sock: &std::path::Path) -> vmm::Result<Client> {
    let vsock = Transport::Vsock {
        port: AGENT_VSOCK_PORT,
    };
    Client::connect_timeout(sock, vsock, Duration::from_secs(60))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let test_guest = args.iter().any(|a| a == "--test-guest");
    let files: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let kernel = files
        .first()
        .ok_or("usage: embed KERNEL [INITRD] [--test-guest]")?;
    let dir = std::env::temp_dir().join(format!("clade-embed-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;

    let mut config = VmConfig::new(kernel.as_str());
    config.initrd = files.get(1).map(PathBuf::from);
    config.serial = SerialOutput::Memory;
    config.vsock = Some(vmm::VsockConfig {
        uds_path: dir.join("vm.sock"),
        guest_cid: 3,
    });
    if test_guest {
        config.cmdline = "steps=vsock,vsock,vsock".into();
        config.test_device = true;
    }
    let t = Instant::now();
    let mut vm = vmm::boot(config)?;
    vm.start()?;
    let client = agent(&dir.join("vm.sock"))?;
    println!(
        "booted; agent {} answers after {:?}",
        client.ping()?.agent_version,
        t.elapsed()
    );
    match client.output(&Command::new("uname").args(["-sr"]), None) {
        Ok(out) => println!(
            "$ uname -sr: {}",
            String::from_utf8_lossy(&out.stdout).trim()
        ),
        Err(e) => println!("$ uname -sr: the agent cannot run it: {e}"),
    }

    let info = vmm::snapshot(&mut vm, &dir.join("snap"), SnapshotKind::Full)?;
    println!(
        "snapshot: VM paused {:?}, {} pages written",
        info.pause_time, info.pages_written
    );
    let t = Instant::now();
    let options = RestoreOptions {
        vsock_path: Some(dir.join("restored.sock")),
        serial: SerialOutput::Memory,
        ..RestoreOptions::default()
    };
    let restored = vmm::restore(&dir.join("snap"), MemoryBackend::Uffd, options)?;
    agent(&dir.join("restored.sock"))?.ping()?;
    println!(
        "restored: answers a ping {:?} after restore() was called",
        t.elapsed()
    );

    let options = ForkOptions {
        start: true,
        ..ForkOptions::default()
    };
    let (children, report) = vmm::fork_with_report(&mut vm, 2, options)?;
    for child in &children {
        let sock = &child
            .config()
            .vsock
            .as_ref()
            .ok_or("a child without vsock")?
            .uds_path;
        agent(sock)?.ping()?;
    }
    println!(
        "forked 2 children: parent paused {:?}; both answer",
        report.pause_time
    );
    for mut v in children.into_iter().chain([restored, vm]) {
        v.shutdown();
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
