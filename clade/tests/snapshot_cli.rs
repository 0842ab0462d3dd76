//! `clade run --api-sock`, `clade snapshot`, `clade restore` and `clade bench
//! resume|snapshot` on the native test guest.

#[path = "../../tests/src/native_guest.rs"]
mod native_guest;

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Dir, Proc};
use native_guest::native_guest;
use vmm::api::{ApiClient, Request};

fn clade() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clade"))
}

fn wait_for(path: &Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn wait_for_text(path: &Path, text: &str) {
    let t = Instant::now();
    while !std::fs::read_to_string(path)
        .unwrap_or_default()
        .contains(text)
    {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no '{text}' in {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn api(sock: &Path, req: Request) -> vmm::api::Response {
    ApiClient::connect(sock).unwrap().call(&req).unwrap()
}

fn wait_exit(p: &mut Proc) -> i32 {
    let t = Instant::now();
    loop {
        if let Some(s) = p.0.try_wait().unwrap() {
            return s.code().unwrap_or(-1);
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the VM process did not end"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn text(o: &Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn run_serves_the_api_and_snapshots_resume_side_by_side() {
    let d = Dir::new("api");
    let (api_sock, vsock, serial) = (d.p("api.sock"), d.p("v.sock"), d.p("serial.log"));
    let mut vm = Proc(
        clade()
            .arg("run")
            .arg("--kernel")
            .arg(native_guest())
            // One connection: the ping below ends the guest's step, and the guest.
            .args(["--test-device", "--cmdline", "steps=vsock:1"])
            .arg("--vsock")
            .arg(&vsock)
            .arg("--api-sock")
            .arg(&api_sock)
            .arg("--serial-file")
            .arg(&serial)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for(&api_sock);
    wait_for_text(&serial, "serving agent port");

    let r = api(&api_sock, Request::Status);
    assert!(r.ok, "{r:?}");
    assert_eq!(r.fields["state"], "running");
    assert_eq!(r.fields["mem_mib"], 256);
    let r = api(&api_sock, Request::Pause);
    assert_eq!(r.fields["state"], "paused");
    let r = api(&api_sock, Request::Pause);
    assert!(
        !r.ok && r.error.as_deref().unwrap().contains("paused"),
        "{r:?}"
    );
    let r = api(
        &api_sock,
        Request::Snapshot {
            dir: d.p("paused"),
            kind: "sideways".into(),
        },
    );
    assert!(!r.ok, "bad kind: {r:?}");
    let r = api(&api_sock, Request::Unpause);
    assert_eq!(r.fields["state"], "running");

    // `clade snapshot`: full, then a diff on top (relative paths are the client's).
    let o = clade()
        .arg("snapshot")
        .arg(&api_sock)
        .arg(d.p("full"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("full snapshot"));
    let o = clade()
        .arg("snapshot")
        .arg(&api_sock)
        .arg(d.p("diff"))
        .args(["--diff", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["kind"], "diff");
    assert!(j["pause_us"].as_u64().unwrap() > 0);
    let r = api(&api_sock, Request::Status);
    assert_eq!(r.fields["last_snapshot"]["id"], j["id"]);
    // The diff and its full base: what `clade serve` counts before a pause.
    assert_eq!(r.fields["last_snapshot"]["layers"], 2);

    // The original still answers; then it is shut down through the API.
    let o = clade().arg("ping").arg(&vsock).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        wait_exit(&mut vm),
        0,
        "the guest's vsock step ended with the ping"
    );

    // Two resumes of the diff, side by side, each with its own sockets.
    let mut resumed = Vec::new();
    for (name, backend) in [("a", "uffd"), ("b", "file")] {
        let p = Proc(
            clade()
                .arg("restore")
                .arg(d.p("diff"))
                .args(["--backend", backend, "--no-agent-sync"])
                .arg("--vsock")
                .arg(d.p(&format!("{name}.sock")))
                .arg("--api-sock")
                .arg(d.p(&format!("{name}.api")))
                .arg("--serial-file")
                .arg(d.p(&format!("{name}.log")))
                .spawn()
                .unwrap(),
        );
        wait_for(&d.p(&format!("{name}.api")));
        resumed.push(p);
    }
    for name in ["a", "b"] {
        let r = api(&d.p(&format!("{name}.api")), Request::Status);
        assert_eq!(r.fields["state"], "running", "{r:?}");
        assert_eq!(r.fields["restored"]["kind"], "diff");
    }
    // b answers a ping and ends; a is still there and is shut down through its API.
    let o = clade().arg("ping").arg(d.p("b.sock")).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(wait_exit(&mut resumed[1]), 0);
    let r = api(&d.p("a.api"), Request::Status);
    assert_eq!(r.fields["state"], "running");
    let r = api(&d.p("a.api"), Request::Shutdown);
    assert!(r.ok);
    assert_eq!(wait_exit(&mut resumed[0]), 0);
    assert!(!d.p("a.api").exists() && !d.p("a.sock").exists());
}

#[test]
fn resume_of_a_bad_snapshot_is_a_one_line_error() {
    let d = Dir::new("bad");
    std::fs::create_dir_all(d.p("empty")).unwrap();
    std::fs::write(d.p("empty/state.snap"), b"CLADESNP\x01\0\0\0").unwrap();
    for (dir, needle) in [
        (d.p("missing"), "No such file"),
        (d.p("empty"), "truncated"),
    ] {
        let o = clade()
            .arg("restore")
            .arg(&dir)
            .arg("--api-sock")
            .arg(d.p("x.api"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains(needle), "{err}");
        assert!(!d.p("x.api").exists());
    }
    let o = clade()
        .args(["restore", "/tmp", "--backend", "mmap"])
        .output()
        .unwrap();
    assert_ne!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stderr).contains("uffd, file or copy"));
}

#[test]
fn bench_resume_and_snapshot_print_one_json_object() {
    let o = clade()
        .args([
            "bench",
            "restore",
            "-n",
            "5",
            "--baseline-n",
            "3",
            "--mem",
            "128M",
            "--json",
            "--guest",
        ])
        .arg(native_guest())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    for k in [
        "backend",
        "mem_mib",
        "n",
        "p50_us",
        "p99_us",
        "faults_p50",
        "baseline_p50_us",
    ] {
        assert!(!j[k].is_null(), "{k} missing: {j}");
    }
    assert_eq!(j["backend"], "uffd");
    assert_eq!(j["n"], 5);
    assert_eq!(j["baseline_n"], 3);
    assert!(j["p50_us"].as_f64().unwrap() > 0.0);

    let o = clade()
        .args([
            "bench", "snapshot", "-n", "3", "--full-n", "1", "--mem", "128M", "--json", "--guest",
        ])
        .arg(native_guest())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(j["diff"]["n"], 3);
    assert!(j["diff"]["pause_p50_us"].as_f64().unwrap() > 0.0, "{j}");
    assert!(j["diff"]["dirty_pages_p50"].as_u64().unwrap() >= 256, "{j}");
}

/// A native guest VM process serving `<name>.api`, killed when dropped; `crash_at` sets
/// the snapshot crash hook (the process aborts at that point of its next snapshot).
fn vm_process(d: &Dir, name: &str, crash_at: Option<&str>) -> Proc {
    let (api_sock, serial) = (d.p(&format!("{name}.api")), d.p(&format!("{name}.serial")));
    let mut cmd = clade();
    cmd.arg("run")
        .arg("--kernel")
        .arg(native_guest())
        .args(["--test-device", "--cmdline", "steps=vsock"])
        .arg("--vsock")
        .arg(d.p(&format!("{name}.vsock")))
        .arg("--api-sock")
        .arg(&api_sock)
        .arg("--serial-file")
        .arg(&serial)
        .stderr(Stdio::null());
    if let Some(point) = crash_at {
        cmd.env("CLADE_SNAPSHOT_CRASH_AT", point);
    }
    let p = Proc(cmd.spawn().unwrap());
    wait_for(&api_sock);
    wait_for_text(&serial, "serving agent port");
    p
}

fn snapshot_id(dir: &Path) -> String {
    let o = clade()
        .args([
            "restore",
            "--backend",
            "copy",
            "--no-agent-sync",
            "--serial-file",
        ])
        .arg(dir.with_extension("probe-serial"))
        .arg("--vsock")
        .arg(dir.with_extension("probe-vsock"))
        .arg("--api-sock")
        .arg(dir.with_extension("probe-api"))
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut p = Proc(o);
    let api_sock = dir.with_extension("probe-api");
    wait_for(&api_sock);
    let r = api(&api_sock, Request::Status);
    assert!(r.ok, "{r:?}");
    let id = r.fields["last_snapshot"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    api(&api_sock, Request::Shutdown);
    wait_exit(&mut p);
    id
}

/// A snapshot replacing another is one transaction: a VMM killed before or right after
/// the new one is put in place leaves a whole snapshot (old or new) that restores, and
/// the files others keep in the directory (a restored VM's disk overlay) survive.
#[test]
fn a_kill_while_replacing_a_snapshot_leaves_a_whole_one() {
    let d = Dir::new("crash");
    let snap = d.p("snap");
    let mut good = vm_process(&d, "good", None);
    let full = |sock: &Path| {
        api(
            sock,
            Request::Snapshot {
                dir: snap.clone(),
                kind: "full".into(),
            },
        )
    };
    let r = full(&d.p("good.api"));
    assert!(r.ok, "{r:?}");
    let first = r.fields["id"].as_str().unwrap().to_string();
    std::fs::write(snap.join("restore-keep.cdsk"), b"someone's overlay").unwrap();
    let staging = || -> Vec<String> {
        std::fs::read_dir(&d.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".staging-"))
            .collect()
    };

    // Killed with the new snapshot written but not in place: the old one is there.
    let mut dying = vm_process(&d, "staged", Some("staged"));
    let _ = ApiClient::connect(&d.p("staged.api"))
        .unwrap()
        .call(&Request::Snapshot {
            dir: snap.clone(),
            kind: "full".into(),
        });
    assert_ne!(wait_exit(&mut dying), 0);
    assert_eq!(snapshot_id(&snap), first);
    assert_eq!(
        std::fs::read(snap.join("restore-keep.cdsk")).unwrap(),
        b"someone's overlay"
    );
    assert_eq!(
        staging().len(),
        1,
        "the dead VMM's staging directory is left"
    );

    // Killed right after the exchange: the new snapshot is in place, whole.
    let mut dying = vm_process(&d, "exchanged", Some("exchanged"));
    let _ = ApiClient::connect(&d.p("exchanged.api"))
        .unwrap()
        .call(&Request::Snapshot {
            dir: snap.clone(),
            kind: "full".into(),
        });
    assert_ne!(wait_exit(&mut dying), 0);
    let second = snapshot_id(&snap);
    assert_ne!(second, first);

    // The next snapshot sweeps what the dead ones left and brings the overlay back.
    let r = full(&d.p("good.api"));
    assert!(r.ok, "{r:?}");
    assert_eq!(snapshot_id(&snap), r.fields["id"].as_str().unwrap());
    assert_eq!(
        std::fs::read(snap.join("restore-keep.cdsk")).unwrap(),
        b"someone's overlay"
    );
    assert!(staging().is_empty(), "left: {:?}", staging());
    api(&d.p("good.api"), Request::Shutdown);
    wait_exit(&mut good);
}

/// Under RLIMIT_FSIZE a file that would grow past the limit (here: the guest's memory
/// itself) is an error with a message, not SIGXFSZ killing the VMM.
#[test]
fn the_file_size_limit_gives_an_error_not_a_signal() {
    use std::os::unix::process::ExitStatusExt;
    let d = Dir::new("fsize");
    // 16 MiB files at most (`ulimit -f` counts 1 KiB blocks); the guest has 256 MiB.
    let o = Command::new("sh")
        .arg("-c")
        .arg("ulimit -f 16384 && exec \"$@\"")
        .arg("sh")
        .arg(env!("CARGO_BIN_EXE_clade"))
        .arg("run")
        .arg("--kernel")
        .arg(native_guest())
        .args(["--test-device", "--cmdline", "steps=vsock"])
        .arg("--api-sock")
        .arg(d.p("vm.api"))
        .output()
        .unwrap();
    assert_eq!(o.status.signal(), None, "killed by a signal: {}", text(&o));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("too large"), "{err}");
}

/// `clade store publish` to a real S3 server, the snapshot's files deleted, then `clade
/// restore --store` (a fetcher child, the VM process under its system-call filter): the
/// guest continues with its memory exactly as it was (its own checksum, `memsum`).
#[test]
fn a_published_snapshot_restores_through_the_store_after_its_files_are_gone() {
    let d = Dir::new("store");
    let (api_sock, serial) = (d.p("a.api"), d.p("a.serial"));
    let mut vm = Proc(
        clade()
            .arg("run")
            .arg("--kernel")
            .arg(native_guest())
            .args(["--test-device", "--mem", "128", "--cmdline"])
            .arg("steps=memfill:9:32,memsum,loop:32,memsum")
            .arg("--api-sock")
            .arg(&api_sock)
            .arg("--serial-file")
            .arg(&serial)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(&api_sock);
    wait_for_text(&serial, "step memsum ok");
    let o = clade()
        .arg("snapshot")
        .arg(&api_sock)
        .arg(d.p("snap"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let _ = vm.0.kill();
    let _ = vm.0.wait();
    let before = std::fs::read_to_string(&serial).unwrap();
    let memsum = before
        .lines()
        .find(|l| l.starts_with("memsum "))
        .unwrap()
        .to_string();

    // On a terminal, the publish draws a bar of the memory data that ends at 100 % (a
    // store of its own: the one below must find nothing published yet).
    let cmd = format!(
        "{} store publish --store file://{} {}",
        env!("CARGO_BIN_EXE_clade"),
        d.p("bar-store").display(),
        d.p("snap").display()
    );
    std::fs::create_dir_all(d.p("bar-store")).unwrap();
    let shown = common::on_a_terminal(&cmd);
    assert!(
        shown.contains("memory data") && shown.contains("100%"),
        "no finished bar: {shown:?}"
    );

    let server = store::s3server::S3Server::start(&d.p("s3"), "clade").unwrap();
    let with_store = |c: &mut Command| {
        c.envs(server.env())
            .args(["--store", "s3://clade/sandboxes"]);
    };
    let mut publish = clade();
    publish
        .args(["store", "publish", "--json"])
        .arg(d.p("snap"));
    with_store(&mut publish);
    let o = publish.output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let id = j["id"].as_str().unwrap().to_string();
    assert!(j["bytes_uploaded"].as_u64().unwrap() > 32 << 20, "{j}");
    std::fs::remove_dir_all(d.p("snap")).unwrap();

    let mut ls = clade();
    ls.args(["store", "ls"]);
    with_store(&mut ls);
    let o = ls.output().unwrap();
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(&id),
        "{}",
        text(&o)
    );

    let mut restore = clade();
    restore
        .args(["restore", &id, "--no-agent-sync", "--cache"])
        .arg(d.p("cache"))
        .arg("--serial-file")
        .arg(d.p("b.serial"))
        .stderr(Stdio::piped());
    with_store(&mut restore);
    let mut p = Proc(restore.spawn().unwrap());
    let code = wait_exit(&mut p);
    let mut err = String::new();
    if let Some(mut e) = p.0.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    let after = std::fs::read_to_string(d.p("b.serial")).unwrap_or_default();
    assert_eq!(code, 0, "{after}\n{err}");
    let sums: Vec<&str> = after.lines().filter(|l| l.starts_with("memsum ")).collect();
    assert_eq!(sums, vec![memsum.as_str()], "{after}");
    assert!(after.contains("loop 2^32 done"), "{after}");

    // Deleted from the store: gone from its listing, and a restore says so.
    let mut rm = clade();
    rm.args(["store", "rm", &id]);
    with_store(&mut rm);
    let o = rm.output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let mut ls = clade();
    ls.args(["store", "ls"]);
    with_store(&mut ls);
    let o = ls.output().unwrap();
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains(&id),
        "{}",
        text(&o)
    );

    // An unknown id is a one-line error, and nothing is left running.
    let mut bad = clade();
    bad.args(["restore", "0123456789abcdef0123456789abcdef", "--cache"])
        .arg(d.p("cache"));
    with_store(&mut bad);
    let o = bad.output().unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("does not exist"),
        "{}",
        text(&o)
    );
}

/// `clade store publish` of a snapshot of a VM with a disk (a frozen base with content
/// under the VM's overlay) to a local-directory store, every file of the publishing host
/// deleted (snapshot and disk layers), then `clade restore --store`: the VM runs to its end
/// on its own overlay, whose chain is the downloaded layers and reads the disk as it was.
/// `--net auto` is refused with `--store`.
#[test]
fn a_published_snapshot_with_a_disk_restores_through_the_store_after_its_files_are_gone() {
    let d = Dir::new("store-disk");
    let host_a = d.p("host-a");
    std::fs::create_dir_all(&host_a).unwrap();
    let mut raw: Vec<u8> = (0..(4u32 << 20)).map(|i| (i % 251) as u8).collect();
    raw[..24].copy_from_slice(b"the disk before snapshot");
    std::fs::write(host_a.join("base.raw"), &raw).unwrap();
    let base = host_a.join("base.cdsk");
    disk::ops::import_raw(&host_a.join("base.raw"), &base, None).unwrap();
    let top = host_a.join("vm.cdsk");
    disk::ops::create(
        &top,
        &disk::ops::CreateOptions {
            parent: Some(base.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    let (api_sock, serial) = (d.p("a.api"), d.p("a.serial"));
    let mut vm = Proc(
        clade()
            .arg("run")
            .arg("--kernel")
            .arg(native_guest())
            .args(["--test-device", "--mem", "128", "--cmdline"])
            .arg("steps=memfill:9:32,memsum,loop:32,memsum")
            .arg("--disk")
            .arg(&top)
            .arg("--api-sock")
            .arg(&api_sock)
            .arg("--serial-file")
            .arg(&serial)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(&api_sock);
    wait_for_text(&serial, "step memsum ok");
    let snap = host_a.join("snap");
    let o = clade()
        .arg("snapshot")
        .arg(&api_sock)
        .arg(&snap)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let _ = vm.0.kill();
    let _ = vm.0.wait();

    let url = format!("file://{}", d.p("store").display());
    let mut publish = clade();
    publish
        .args(["store", "publish", "--json", "--store", &url])
        .arg(&snap);
    let o = publish.output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let id = j["id"].as_str().unwrap().to_string();
    std::fs::remove_dir_all(&host_a).unwrap();

    let o = clade()
        .args(["restore", &id, "--store", &url, "--net", "auto"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--net auto"),
        "{}",
        text(&o)
    );

    let overlay = d.p("own.cdsk");
    let mut restore = clade();
    restore
        .args([
            "restore",
            &id,
            "--no-agent-sync",
            "--store",
            &url,
            "--cache",
        ])
        .arg(d.p("cache"))
        .arg("--disk-overlay")
        .arg(&overlay)
        .arg("--serial-file")
        .arg(d.p("b.serial"))
        .stderr(Stdio::piped());
    let mut p = Proc(restore.spawn().unwrap());
    let code = wait_exit(&mut p);
    let mut err = String::new();
    if let Some(mut e) = p.0.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    let after = std::fs::read_to_string(d.p("b.serial")).unwrap_or_default();
    assert_eq!(code, 0, "{after}\n{err}");
    assert!(after.contains("loop 2^32 done"), "{after}");
    let chain = disk::ops::info(&overlay).unwrap();
    assert_eq!(chain.len(), 3, "overlay, the VM's frozen layer, the base");
    let layers = d.p("cache").join("layers");
    for l in &chain[1..] {
        assert_eq!(
            l.path.canonicalize().unwrap(),
            layers
                .join(format!("{}.cdsk", disk::id_hex(&l.header.layer_id)))
                .canonicalize()
                .unwrap()
        );
    }
    // The layers are read lazily: their data only through a fetcher of that cache.
    let mut buf = vec![0u8; raw.len()];
    let disk = disk::Disk::open(&overlay, disk::OpenOptions { read_only: true }).unwrap();
    let e = disk.read_at(0, &mut buf).unwrap_err();
    assert!(matches!(e, disk::Error::Unfilled { .. }), "{e}");
    drop(disk);
    let cache = store::cache::ChunkCache::new(
        &d.p("cache"),
        store::Store::open(&url, &Default::default()).unwrap(),
        1 << 30,
    )
    .unwrap();
    let f = store::fetcher::FetcherThread::start(&d.p("f.sock"), cache).unwrap();
    let c = store::fetcher::FetchClient::connect(f.socket(), Duration::from_secs(60)).unwrap();
    let disk = disk::Disk::open_with_sources(
        &overlay,
        disk::OpenOptions { read_only: true },
        Some(&store::fetcher::FetcherLayers::sources(c)),
    )
    .unwrap();
    disk.read_at(0, &mut buf).unwrap();
    assert!(buf == raw, "the restored disk differs");
}
