//! The control API of a running VM: newline-delimited JSON over a Unix socket.
//!
//! `clade run --api-sock PATH` and `clade restore DIR --api-sock PATH` serve it (through
//! the host layer's owner loop). The socket exists while the VM runs, with mode 0600; a
//! stale socket at the path is replaced, a live one or any other file is refused, and only
//! the socket this server bound is removed when the process ends. Peers must run as the
//! VMM's user or root (`SO_PEERCRED`, [`PeerCheck`]). Up to 32 connections at once (one more
//! gets an error line and is closed), each a sequence of one request line and one response
//! line, closed after 60 s of silence. Requests are executed one at a time, in arrival
//! order, by the process that owns the VM.
//! A standby process (`clade restore --standby`), before it holds a VM, serves its socket
//! on its own main thread ([`ApiListener::next_request`]): one request per connection, its
//! line read within 2 s.
//!
//! Every response is an object with `"ok"`: `true` plus result fields, or `false` plus
//! `"error"` (one line naming the problem). A line that is not a request gets
//! `{"ok":false,"error":"bad request: ..."}` and the connection stays usable; a line over
//! 64 KiB is answered with an error and the connection closed. A fork makes 1 to 128
//! children.
//!
//! | request | result fields |
//! |---|---|
//! | `{"op":"status"}` | `state` (`"running"`, `"paused"`), `vcpus`, `mem_mib`, `pvm_native`; `last_snapshot` `{id, dir}` once the VM took or was restored from one (the base of its next diff); `restored` `{backend, kind, us}` for a restored VM |
//! | `{"op":"pause"}` | `state`: the vCPUs stop (devices keep running) |
//! | `{"op":"unpause"}` | `state`: paused vCPUs run again (`"resume"` is accepted as an alias) |
//! | `{"op":"shutdown"}` | `state: "ended"`; then the VM stops and the process exits 0 |
//! | `{"op":"snapshot","dir":"/abs/dir","kind":"full"}` | `id`, `kind`, `dir` (absolute), `pause_us` (how long the vCPUs were stopped), `total_us`, `pages_written`, `pages_considered` |
//! | `{"op":"freeze_disk"}` | `layer` (absolute): the disk's top layer, frozen as it is at this instant (the vCPUs stopped for it, then run again if they ran); the VM continues on a new overlay on it, `top` |
//! | `{"op":"fork","count":3,"prefix":"/abs/dir","agent_sync":true,"nets":["tap=tap0,netns=/run/netns/a",...]}` (`nets`: one TAP per child, only for a VM with a network device) | `pause_us`, `children`: one `{pid, api_sock, vsock, cid, serial, log, disk}` per child (`vsock`, `cid`, `disk` null when the VM has none; `pid` as the VMM sees it: the host's, or in a jail with limits of its own, the jail's PID namespace) |
//! | `{"op":"restore","snapshot":"/abs/snap","vsock":"/abs/vm.vsock",...}` | standby processes only (`clade restore --standby`): the fields of [`RestoreRequest`]; the answer is the `status` of the restored VM. A second restore, or one in a process that already runs a VM, is refused |
//! | `{"op":"preload","snapshot":"/abs/snap"}` | standby processes only: `preloaded`, the snapshots it holds open ahead (its `--preload` one and the last ones asked for) |
//!
//! `fork`: the VM pauses for a moment, its memory is frozen (shared copy-on-write) and each
//! child becomes its own `clade` process (its own API socket and vsock socket, named
//! `<prefix>/<api socket stem>-f<k>.{api,vsock}`, serial console and log next to them).
//! Children outlive the parent. If one child fails to start, the ones started are killed,
//! their files removed, and the parent runs on. A VM with a disk forks its disk too: its
//! overlay is frozen, it continues on a new one and each child gets its own.
//!
//! `snapshot`: `kind` is `"full"` (default) or `"diff"` (only pages written since the
//! VM's last snapshot, or since the snapshot it was restored from; that snapshot's directory
//! must stay where it is, and the diff must go to another directory). `dir` is created if
//! needed; it must be absolute, without `..`, and under the owner's files root when one is
//! configured (`--files-root`); so must a fork's `prefix`. A snapshot of a running VM leaves it running, of a
//! paused one paused. Errors: the VM is not running or paused, a diff without a base, I/O.
//!
//! ```text
//! -> {"op":"status"}
//! <- {"ok":true,"state":"running","vcpus":1,"mem_mib":256,"pvm_native":true,"fork_children_waiting":0,"spare_shell":true}
//! -> {"op":"snapshot","dir":"/var/lib/clade/s1"}
//! <- {"ok":true,"id":"6f0c...","kind":"full","dir":"/var/lib/clade/s1","pause_us":5210,...}
//! -> {"op":"pause"}
//! <- {"ok":true,"state":"paused"}
//! -> {"op":"pause"}
//! <- {"ok":false,"error":"VM is paused: cannot pause"}
//! ```
//!
//! The server only carries requests ([`ApiServer`]); the VM's owner (the host layer's owner
//! loop, in `clade run` / `clade restore`) executes them, so the VM itself is never shared
//! between threads. [`ApiClient`] is the client `clade snapshot` uses.
//!
//! Files: `request.rs` (the messages), `listener.rs` (binding the socket, peer checks,
//! serving it on the caller's thread), `server.rs` (the server thread), `connection.rs`
//! (reading request lines with their descriptors, writing answers), `client.rs`.

mod client;
mod connection;
mod listener;
mod request;
mod server;

use std::time::Duration;

use crate::error::Error;

pub use client::ApiClient;
pub use connection::PendingRequest;
pub use listener::{ApiListener, PeerCheck, DIRECT_READ_TIMEOUT};
pub use request::{Request, Response, RestoreRequest};
pub use server::{ApiServer, ServerAhead};

/// Longest request line accepted; longer lines are answered with an error and the
/// connection is closed.
pub const MAX_REQUEST: usize = 64 * 1024;
/// Most descriptors one request may carry (`SCM_RIGHTS`); a request with more is refused.
pub const MAX_REQUEST_FDS: usize = 4;
/// Most connections served at once; one more is answered with an error and closed.
pub const MAX_CONNECTIONS: usize = 32;
/// A connection that sends nothing for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long an [`ApiClient`] waits for the answer to a request that does no work that
/// grows with the VM (status, pause, unpause, shutdown).
pub const QUICK_ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an [`ApiClient`] waits for the answer to a snapshot, fork, restore or preload:
/// work that grows with the VM's memory, its children and the disk's speed.
pub const WORK_ANSWER_TIMEOUT: Duration = Duration::from_secs(600);

fn io_err(context: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixStream;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;

    #[test]
    fn requests_round_trip_and_bad_lines_get_errors() {
        let path = std::env::temp_dir().join(format!("clade-api-{}.sock", std::process::id()));
        let server = ApiServer::bind(&path).unwrap();
        // A second server on a live socket is refused.
        assert!(ApiServer::bind(&path).is_err());
        let owner = std::thread::spawn({
            move || {
                for _ in 0..2 {
                    let p = server.next_request(Duration::from_secs(5)).unwrap();
                    let r = match &p.request {
                        Request::Status => Response::ok(serde_json::json!({"state": "running"})),
                        other => Response::err(format!("unsupported {other:?}")),
                    };
                    p.respond(r);
                }
                server
            }
        });
        let mut c = ApiClient::connect(&path).unwrap();
        let r = c.call(&Request::Status).unwrap();
        assert!(r.ok);
        assert_eq!(r.fields["state"], "running");
        // Garbage gets an error line and the connection stays usable.
        c.stream.get_mut().write_all(b"{not json\n").unwrap();
        let mut line = String::new();
        c.stream.read_line(&mut line).unwrap();
        let r: Response = serde_json::from_str(&line).unwrap();
        assert!(!r.ok && r.error.unwrap().contains("bad request"));
        let r = c.call(&Request::Pause).unwrap();
        assert!(!r.ok);
        let server = owner.join().unwrap();
        drop(server);
        assert!(!path.exists(), "socket removed on drop");
    }

    #[test]
    fn a_request_nobody_answers_fails_within_its_time_limit() {
        assert_eq!(Request::Pause.answer_timeout(), QUICK_ANSWER_TIMEOUT);
        assert_eq!(
            Request::Fork {
                count: 1,
                prefix: None,
                agent_sync: true,
                nets: vec![]
            }
            .answer_timeout(),
            WORK_ANSWER_TIMEOUT
        );
        let path = std::env::temp_dir().join(format!("clade-api-mute-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        // A wedged VM process: its socket takes connections and reads, but never answers.
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mut c = ApiClient::connect(&path).unwrap();
        let (_held, _) = listener.accept().unwrap();
        c.set_answer_timeout(Duration::from_millis(100));
        let t = std::time::Instant::now();
        let e = c.call(&Request::Shutdown).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(e.to_string().contains("time limit"), "{e}");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn descriptors_sent_with_a_request_come_with_it() {
        use std::os::fd::AsFd;
        let path = std::env::temp_dir().join(format!("clade-api-fds-{}.sock", std::process::id()));
        let server = ApiServer::bind(&path).unwrap();
        let owner = std::thread::spawn(move || {
            let mut got = Vec::new();
            for _ in 0..3 {
                let mut p = server.next_request(Duration::from_secs(5)).unwrap();
                let fds = p.take_fds();
                // What the descriptor is: the contents of the file sent.
                let text = fds.first().map(|fd| {
                    let mut f = std::fs::File::from(fd.try_clone().unwrap());
                    std::io::Seek::rewind(&mut f).unwrap();
                    let mut s = String::new();
                    std::io::Read::read_to_string(&mut f, &mut s).unwrap();
                    s
                });
                got.push((fds.len(), text));
                p.respond(Response::ok(serde_json::json!({})));
            }
            got
        });
        let dir = scratch("fds");
        let file = dir.join("payload");
        std::fs::write(&file, "sent along").unwrap();
        let f = std::fs::File::open(&file).unwrap();
        let mut c = ApiClient::connect(&path).unwrap();
        assert!(c.call_with_fds(&Request::Status, &[f.as_fd()]).unwrap().ok);
        // More than the limit: refused, the connection stays usable.
        let many: Vec<_> = (0..MAX_REQUEST_FDS + 1).map(|_| f.as_fd()).collect();
        let r = c.call_with_fds(&Request::Status, &many).unwrap();
        assert!(!r.ok && r.error.unwrap().contains("descriptors"));
        assert!(c.call(&Request::Status).unwrap().ok);
        assert!(
            c.call_with_fds(&Request::Pause, &[f.as_fd(), f.as_fd()])
                .unwrap()
                .ok
        );
        let got = owner.join().unwrap();
        assert_eq!(
            got,
            vec![
                (1, Some("sent along".to_string())),
                (0, None),
                (2, Some("sent along".to_string()))
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_listener_serves_a_request_per_connection_on_its_thread_then_hands_over() {
        use std::io::Read;
        use std::os::fd::AsFd;
        let d = scratch("direct");
        let path = d.join("sb.api");
        let listener = ApiListener::bind(&path).unwrap();
        assert!(
            ApiListener::bind(&path).is_err(),
            "a live socket is not replaced"
        );
        // Nobody connects: nothing, after the timeout.
        assert!(listener.next_request(Duration::from_millis(20)).is_none());
        let client = std::thread::spawn({
            let path = path.clone();
            let payload = d.join("payload");
            move || {
                std::fs::write(&payload, "sent along").unwrap();
                let f = std::fs::File::open(&payload).unwrap();
                let mut c = ApiClient::connect(&path).unwrap();
                let r = c.call_with_fds(&Request::Status, &[f.as_fd()]).unwrap();
                // One request per connection: the next one finds it closed.
                let again = c.call(&Request::Status);
                // A line that is not a request gets its error, then the connection closes.
                let mut raw = UnixStream::connect(&path).unwrap();
                raw.write_all(b"{not json\n").unwrap();
                let mut answer = String::new();
                raw.read_to_string(&mut answer).unwrap();
                (r, again.is_err(), answer)
            }
        });
        let mut p = loop {
            if let Some(p) = listener.next_request(Duration::from_secs(5)) {
                break p;
            }
        };
        assert!(matches!(p.request, Request::Status));
        let fds = p.take_fds();
        let mut f = std::fs::File::from(fds.into_iter().next().expect("the descriptor"));
        let mut text = String::new();
        std::io::Seek::rewind(&mut f).unwrap();
        f.read_to_string(&mut text).unwrap();
        assert_eq!(text, "sent along");
        p.respond(Response::ok(serde_json::json!({"state": "standby"})));
        // The bad line: answered here, no request.
        assert!(listener.next_request(Duration::from_secs(5)).is_none());
        let (r, closed, answer) = client.join().unwrap();
        assert!(r.ok && r.fields["state"] == "standby", "{r:?}");
        assert!(closed, "a second request on the same connection fails");
        let bad: Response = serde_json::from_str(answer.trim()).unwrap();
        assert!(!bad.ok && bad.error.unwrap().contains("bad request"));
        // From here a server thread serves the same socket, with connections as usual.
        let server = listener.serve().unwrap();
        let owner = std::thread::spawn(move || {
            for _ in 0..2 {
                let p = server.next_request(Duration::from_secs(5)).unwrap();
                p.respond(Response::ok(serde_json::json!({"state": "running"})));
            }
            server
        });
        let mut c = ApiClient::connect(&path).unwrap();
        for _ in 0..2 {
            assert_eq!(c.call(&Request::Status).unwrap().fields["state"], "running");
        }
        drop(owner.join().unwrap());
        assert!(!path.exists(), "the socket goes with the server");
        // An unserved listener removes its socket too.
        drop(ApiListener::bind(&path).unwrap());
        assert!(!path.exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_server_started_ahead_at_idle_priority_serves_at_normal_priority_once_handed_its_socket() {
        let d = scratch("ahead");
        let path = d.join("vm.api");
        // Started by a thread at idle priority, as a waiting standby's main thread is.
        let ahead = std::thread::spawn(|| {
            crate::vstate::spare::run_at_idle_priority("test");
            ServerAhead::start().unwrap()
        })
        .join()
        .unwrap();
        let listener = ApiListener::bind(&path).unwrap();
        // Not handed its socket yet: nobody accepts (the connection waits in the backlog).
        let mut early = ApiClient::connect(&path).unwrap();
        let server = listener.serve_on(ahead).unwrap();
        let owner = std::thread::spawn(move || {
            let p = server.next_request(Duration::from_secs(5)).unwrap();
            p.respond(Response::ok(serde_json::json!({"state": "running"})));
            server
        });
        assert_eq!(
            early.call(&Request::Status).unwrap().fields["state"],
            "running"
        );
        // It served a connection, so it ran past its start: no API thread of this process
        // (other tests' included) is left at idle priority.
        let idle: Vec<String> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "api")
            })
            .filter_map(|t| t.file_name().to_str()?.parse::<i32>().ok())
            // SAFETY: sched_getscheduler only reads the policy of the thread with this ID.
            .filter(|&tid| unsafe { libc::sched_getscheduler(tid) } == libc::SCHED_IDLE)
            .map(|tid| tid.to_string())
            .collect();
        assert!(idle.is_empty(), "API threads at idle priority: {idle:?}");
        drop(owner.join().unwrap());
        assert!(!path.exists(), "the socket goes with the server");
        // One dropped unused ends quietly.
        drop(ServerAhead::start().unwrap());
        let _ = std::fs::remove_dir_all(&d);
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("clade-api-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn the_socket_is_private_and_only_a_stale_socket_is_replaced() {
        use std::os::unix::fs::PermissionsExt;
        let d = scratch("files");
        let path = d.join("vm.api");
        // A regular file (say, one a symlink attack aims at) is never removed.
        std::fs::write(&path, b"precious").unwrap();
        let e = ApiServer::bind(&path)
            .err()
            .expect("a file in the way is refused");
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"precious");
        std::fs::remove_file(&path).unwrap();

        let server = ApiServer::bind(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "socket mode {mode:o}");
        // Another VM took the path over (ours was removed under us): dropping ours must
        // leave theirs.
        std::fs::remove_file(&path).unwrap();
        let other = ApiServer::bind(&path).unwrap();
        drop(server);
        assert!(path.exists(), "the other VM's socket was removed");
        ApiClient::connect(&path).expect("the other VM's socket still answers");
        drop(other);
        assert!(!path.exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn connections_beyond_the_limit_get_an_error() {
        let d = scratch("conns");
        let path = d.join("vm.api");
        let server = ApiServer::bind(&path).unwrap();
        let held: Vec<UnixStream> = (0..MAX_CONNECTIONS)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        // Let the accept loop take them all.
        let t = std::time::Instant::now();
        let refused = loop {
            let extra = UnixStream::connect(&path).unwrap();
            extra
                .set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            let mut line = String::new();
            if BufReader::new(&extra).read_line(&mut line).is_ok() && !line.is_empty() {
                break line;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "no refusal");
        };
        assert!(refused.contains("too many connections"), "{refused}");
        drop(held);
        // Slots free up again once connections close.
        let t = std::time::Instant::now();
        loop {
            let p2 = path.clone();
            let client = std::thread::spawn(move || {
                ApiClient::connect(&p2).and_then(|mut c| c.call(&Request::Status))
            });
            if let Some(p) = server.next_request(Duration::from_secs(2)) {
                p.respond(Response::ok(serde_json::json!({})));
            }
            if client.join().unwrap().is_ok_and(|r| r.ok) {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "slots never freed");
        }
        drop(server);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Mutated and random request lines through a live server: each gets one answer line
    /// (an error for what is not a request) and the server keeps serving.
    #[test]
    fn mutated_request_lines_get_answers_and_the_server_survives() {
        let d = scratch("fuzz");
        let path = d.join("vm.api");
        let server = ApiServer::bind(&path).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let owner = std::thread::spawn(move || {
            while !stop2.load(Ordering::SeqCst) {
                if let Some(p) = server.next_request(Duration::from_millis(20)) {
                    p.respond(Response::err("fuzzing"));
                }
            }
        });
        let seeds: [&[u8]; 4] = [
            br#"{"op":"status"}"#,
            br#"{"op":"snapshot","dir":"/tmp/x","kind":"diff"}"#,
            br#"{"op":"fork","count":3,"prefix":"/tmp/p","agent_sync":false}"#,
            br#"{"op":"unpause"}"#,
        ];
        let mut x: u64 = 0x0061_7069_6675_7a7a;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let conn = UnixStream::connect(&path).unwrap();
        let mut reader = BufReader::new(conn.try_clone().unwrap());
        let mut writer = conn;
        let (mut parsed, mut refused) = (0, 0);
        for i in 0..3000 {
            let mut line = seeds[i % seeds.len()].to_vec();
            for _ in 0..1 + next() % 4 {
                let v = next();
                let at = (v >> 8) as usize % (line.len() + 1);
                match v % 3 {
                    0 if at < line.len() => line[at] = (v >> 16) as u8,
                    1 => line.insert(at, (v >> 16) as u8),
                    _ => line.truncate(at.max(1)),
                }
            }
            line.retain(|&b| b != b'\n');
            if serde_json::from_slice::<Request>(&line).is_ok() {
                parsed += 1;
            } else {
                refused += 1;
            }
            line.push(b'\n');
            writer.write_all(&line).unwrap();
            let mut answer = String::new();
            reader.read_line(&mut answer).unwrap();
            let r: Response = serde_json::from_str(&answer).unwrap();
            assert!(!r.ok, "{answer}");
        }
        assert!(
            refused > 0 && parsed > 0,
            "{parsed} parsed, {refused} refused"
        );
        let mut c = ApiClient::connect(&path).unwrap();
        assert!(!c.call(&Request::Status).unwrap().ok, "still answering");
        stop.store(true, Ordering::SeqCst);
        owner.join().unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }
}
