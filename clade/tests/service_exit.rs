//! `clade serve` on the native test guest, stopped (SIGTERM) or killed (SIGKILL) at any
//! moment of its life: while its standby pool fills, while a create's VM process starts,
//! while the pool refills after creates, and with VM processes dying mid-start. No process
//! the service started outlives it but the VM processes of its running sandboxes, which
//! are meant to (a sandbox keeps running across a restart of the service, and the next
//! service finds it again): each of those answers, is one process, and is the registry's.

#[path = "../../tests/src/native_guest.rs"]
mod native_guest;

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Dir;
use native_guest::native_guest;
use serde_json::Value;

fn clade() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clade"))
}

/// One HTTP/1.1 request (Connection: close); returns (status, body as JSON or Null).
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, Value) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nX-API-KEY: k\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status: u16 = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn build_template(state: &Path) {
    let o = clade()
        .args(["template", "build", "t", "--test-device", "--mem", "64"])
        .arg("--kernel")
        .arg(native_guest())
        .args(["--cmdline", "steps=vsock"])
        .arg("--state-dir")
        .arg(state)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `clade serve` on `state` with `standbys` standby processes; returned at once (not
/// waiting for it to listen), its log appended to `state.serve.log`.
fn spawn_serve(state: &Path, port: u16, standbys: &str) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(state.with_extension("serve.log"))
        .unwrap();
    clade()
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--state-dir")
        .arg(state)
        .args(["--api-key", "k", "--standby", standbys])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

fn wait_listening(port: u16) {
    let t = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "serve never listened"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Live processes (not zombies) whose command line names a path under `state`, the
/// service itself aside.
fn processes_under(state: &Path) -> Vec<i32> {
    let needle = state.as_os_str().as_encoded_bytes();
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let zombie = stat
            .rsplit(')')
            .next()
            .is_some_and(|s| s.trim_start().starts_with('Z'));
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        if !zombie
            && args.iter().any(|a| a.starts_with(needle))
            && !args.iter().any(|a| *a == b"serve")
        {
            pids.push(pid);
        }
    }
    pids.sort();
    pids
}

/// Ends the service with `signal` and waits for it (at most 30 s).
fn stop(mut serve: Child, signal: i32) {
    // SAFETY: kill(2) of our own child, which has not been reaped.
    unsafe { libc::kill(serve.id() as i32, signal) };
    let t = Instant::now();
    while serve.try_wait().unwrap().is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the service did not end on signal {signal}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The processes under `state` once those that are ending have ended (at most 10 s for
/// the count to drop to `expected`).
fn left_under(state: &Path, expected: usize) -> Vec<i32> {
    let t = Instant::now();
    loop {
        let left = processes_under(state);
        if left.len() <= expected || t.elapsed() > Duration::from_secs(10) {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn describe(pids: &[i32]) -> String {
    pids.iter()
        .map(|p| {
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            format!("{p}: {}", String::from_utf8_lossy(&cmd).replace('\0', " "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn create(port: u16) -> String {
    let (s, v) = http(
        port,
        "POST",
        "/v2/sandboxes",
        r#"{"templateID":"t","timeout":300}"#,
    );
    assert_eq!(s, 201, "{v}");
    v["sandboxID"].as_str().unwrap().to_string()
}

#[test]
fn no_process_outlives_the_service_stopped_or_killed_while_standbys_start() {
    let d = Dir::new("serve-exit-standbys");
    let state = d.p("s");
    build_template(&state);
    // At once (the pool not started), while it fills, and once it is full.
    for signal in [libc::SIGTERM, libc::SIGKILL] {
        for after_ms in [0u64, 30, 150, 600, 2500] {
            let port = free_port();
            let serve = spawn_serve(&state, port, "3");
            wait_listening(port);
            std::thread::sleep(Duration::from_millis(after_ms));
            stop(serve, signal);
            let left = left_under(&state, 0);
            assert!(
                left.is_empty(),
                "signal {signal} {after_ms} ms after listening left:\n{}",
                describe(&left)
            );
        }
    }
}

#[test]
fn only_running_sandboxes_outlive_the_service_and_the_next_one_finds_them() {
    let d = Dir::new("serve-exit-sandboxes");
    let state = d.p("s");
    build_template(&state);
    let mut running = Vec::new();
    // Creates from standbys and without (a VM process started for the request), each
    // followed at once by the end of the service: the pool is refilling then.
    for (signal, standbys) in [
        (libc::SIGTERM, "2"),
        (libc::SIGKILL, "2"),
        (libc::SIGTERM, "0"),
        (libc::SIGKILL, "0"),
    ] {
        let port = free_port();
        let serve = spawn_serve(&state, port, standbys);
        wait_listening(port);
        running.push(create(port));
        stop(serve, signal);
        let left = left_under(&state, running.len());
        assert_eq!(
            left.len(),
            running.len(),
            "after signal {signal} (standbys {standbys}), sandboxes {running:?}, left:\n{}",
            describe(&left)
        );
        // Each is a running sandbox's VM process, and answers.
        for id in &running {
            let vsock = state.join("sandboxes").join(id).join("vm.vsock");
            let o = clade().arg("ping").arg(&vsock).output().unwrap();
            assert!(
                o.status.success(),
                "{id}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
    // The next service has them all, running; once they are killed nothing is left.
    let port = free_port();
    let serve = spawn_serve(&state, port, "1");
    wait_listening(port);
    let (s, v) = http(port, "GET", "/v2/sandboxes?state=running", "");
    assert_eq!(s, 200, "{v}");
    let mut listed: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["sandboxID"].as_str().unwrap().to_string())
        .collect();
    listed.sort();
    running.sort();
    assert_eq!(listed, running);
    for id in &running {
        let (s, v) = http(port, "DELETE", &format!("/sandboxes/{id}"), "");
        assert_eq!(s, 204, "{v}");
    }
    stop(serve, libc::SIGTERM);
    let left = left_under(&state, 0);
    assert!(left.is_empty(), "left:\n{}", describe(&left));
}

#[test]
fn vm_processes_killed_mid_start_leave_nothing_and_the_service_goes_on() {
    let d = Dir::new("serve-exit-midstart");
    let state = d.p("s");
    build_template(&state);
    let port = free_port();
    let serve = spawn_serve(&state, port, "2");
    wait_listening(port);
    // Every VM process the pool starts is killed as soon as it is seen, for 3 s: each dies
    // somewhere in its start (its jail, its VM shell, its snapshot).
    let t = Instant::now();
    let mut killed = 0;
    while t.elapsed() < Duration::from_secs(3) {
        for p in processes_under(&state) {
            // SAFETY: kill(2) of a process this test's service started.
            if unsafe { libc::kill(p, libc::SIGKILL) } == 0 {
                killed += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(killed > 0, "no VM process was seen starting");
    // The service goes on: a create succeeds, and the sandbox answers.
    let id = create(port);
    let vsock = state.join("sandboxes").join(&id).join("vm.vsock");
    let o = clade().arg("ping").arg(&vsock).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (s, v) = http(port, "DELETE", &format!("/sandboxes/{id}"), "");
    assert_eq!(s, 204, "{v}");
    stop(serve, libc::SIGTERM);
    let left = left_under(&state, 0);
    assert!(left.is_empty(), "left:\n{}", describe(&left));
}
