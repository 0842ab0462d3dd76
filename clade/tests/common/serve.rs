//! Helpers of the tests that drive `clade serve` over HTTP on the native test guest: one
//! request, a free port, a template, the processes a service started.
#![allow(dead_code)]

use std::io::{BufRead, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The `clade` binary under test.
pub fn clade() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clade"))
}

/// One HTTP/1.1 request (Connection: close) with API key `key`; returns (status, body as
/// JSON or Null).
pub fn http(port: u16, method: &str, path: &str, key: Option<&str>, body: &str) -> (u16, Value) {
    let (s, v, _) = http_timed(port, method, path, key, body);
    (s, v)
}

/// [`http`], and how long the answer took. It waits up to 200 s for the answer: a hang
/// shows as a long elapsed time, or a failed assertion of the test's own.
pub fn http_timed(
    port: u16,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> (u16, Value, Duration) {
    let t = Instant::now();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(200))).unwrap();
    let key = key
        .map(|k| format!("X-API-KEY: {k}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{key}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status: u16 = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    (
        status,
        serde_json::from_str(body).unwrap_or(Value::Null),
        t.elapsed(),
    )
}

/// The agent behind vsock socket `sock` answers a ping.
pub fn ping(sock: &Path) {
    let o = clade().arg("ping").arg(sock).output().unwrap();
    assert!(
        o.status.success(),
        "ping {}: {}",
        sock.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Starts `cmd` (a `clade serve`) with its standard error going to the test's output and
/// appended to `log` (read to the end whatever happens: a full pipe would stop it).
pub fn spawn_logged(cmd: &mut Command, log: PathBuf) -> super::Proc {
    let mut p = super::Proc(
        cmd.stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let err = p.0.stderr.take();
    std::thread::spawn(move || {
        let Some(err) = err else { return };
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .ok();
        for line in std::io::BufReader::new(err).split(b'\n') {
            let Ok(line) = line else { break };
            eprintln!("{}", String::from_utf8_lossy(&line));
            if let Some(f) = &mut file {
                let _ = f.write_all(&line);
                let _ = f.write_all(b"\n");
            }
        }
    });
    p
}

/// A TCP port on loopback nobody listens on (just now).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits (at most 30 s) until something listens on loopback port `port`.
pub fn wait_listening(port: u16) {
    let t = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "serve never listened"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Builds template `name` in `state` of the native guest `kernel` with `mem` MiB running
/// `steps`.
pub fn build_template_of(state: &Path, kernel: &Path, name: &str, mem: &str, steps: &str) {
    let o = clade()
        .args(["template", "build", name, "--test-device", "--mem", mem])
        .arg("--kernel")
        .arg(kernel)
        .args(["--cmdline", &format!("steps={steps}")])
        .arg("--state-dir")
        .arg(state)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Whether process `pid` is a zombie (ended, not yet reaped).
pub fn zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .is_some_and(|s| s.trim_start().starts_with('Z'))
    })
}

/// Live processes (not zombies) whose command line names a path under `state`, the
/// `clade serve` processes aside: the VM processes a service on `state` started.
pub fn processes_under(state: &Path) -> Vec<i32> {
    let needle = state.as_os_str().as_encoded_bytes();
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        if args.iter().any(|a| a.starts_with(needle))
            && !args.iter().any(|a| *a == b"serve")
            && !zombie(pid)
        {
            pids.push(pid);
        }
    }
    pids.sort();
    pids
}

/// Each of `pids` with its command line, one per line (for a failure's message).
pub fn describe(pids: &[i32]) -> String {
    pids.iter()
        .map(|p| {
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            format!("{p}: {}", String::from_utf8_lossy(&cmd).replace('\0', " "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}
