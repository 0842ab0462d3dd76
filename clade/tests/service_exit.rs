//! `clade serve` on the native test guest, stopped (SIGTERM) or killed (SIGKILL) at any
//! moment of its life: while its standby pool fills, while a create's VM process starts,
//! while the pool refills after creates, and with VM processes dying mid-start. No process
//! the service started outlives it but the VM processes of its running sandboxes, which
//! are meant to (a sandbox keeps running across a restart of the service, and the next
//! service finds it again): each of those answers, is one process, and is the registry's.

#[path = "../../tests/src/native_guest.rs"]
mod native_guest;

mod common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::serve::{
    self, build_template_of, clade, describe, free_port, processes_under, wait_listening,
};
use common::Dir;
use native_guest::native_guest;
use serde_json::Value;

/// One request with the service's API key.
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, Value) {
    serve::http(port, method, path, Some("k"), body)
}

fn build_template(state: &Path) {
    build_template_of(state, &native_guest(), "t", "64", "vsock");
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
