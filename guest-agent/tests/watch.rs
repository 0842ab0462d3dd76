//! Directory watches (Watch / Unwatch / WatchEvent) against the real `clade-agent` in
//! `--listen-unix` mode: events for what happens in the directory, recursion, the
//! per-connection bound, bad frames, and watches ending with their connection.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use guest_agent::proto::{
    decode_frame, encode_host, read_frame, AgentMsg, ErrorKind, HostMsg, Msg, WatchKind,
    MAX_FRAME_LEN, PROTOCOL_VERSION,
};

struct Agent {
    child: Child,
    dir: PathBuf,
    sock: PathBuf,
}

impl Agent {
    fn start(name: &str) -> Agent {
        let dir =
            std::env::temp_dir().join(format!("clade-agent-watch-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("w")).unwrap();
        let sock = dir.join("agent.sock");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_clade-agent"))
            .arg("--listen-unix")
            .arg(&sock)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start clade-agent");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert!(line.starts_with("CLADE-AGENT-LISTENING"), "{line:?}");
        Agent { child, dir, sock }
    }

    fn connect(&self) -> Conn {
        let s = UnixStream::connect(&self.sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut c = Conn { s, next: 0 };
        c.send(
            0,
            &HostMsg::Hello {
                min_version: 1,
                max_version: PROTOCOL_VERSION,
                client: "watch-test".into(),
            },
        );
        assert!(matches!(c.recv().1, AgentMsg::HelloOk { .. }));
        c
    }

    /// inotify instances the agent holds open.
    fn inotify_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .unwrap()
            .flatten()
            .filter(|e| {
                std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().contains("inotify"))
            })
            .count()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Conn {
    s: UnixStream,
    next: u32,
}

impl Conn {
    fn id(&mut self) -> u32 {
        self.next += 1;
        self.next
    }

    fn send(&mut self, id: u32, m: &HostMsg) {
        self.s.write_all(&encode_host(id, m).unwrap()).unwrap();
    }

    fn recv(&mut self) -> (u32, AgentMsg) {
        let f = read_frame(&mut self.s, MAX_FRAME_LEN)
            .unwrap()
            .expect("agent closed");
        match decode_frame(&f).unwrap().msg {
            Msg::Agent(m) => (decode_frame(&f).unwrap().id, m),
            m => panic!("{m:?}"),
        }
    }

    /// Starts a watch; returns its id once the agent answered Ok.
    fn watch(&mut self, path: &Path, recursive: bool) -> u32 {
        let id = self.id();
        self.send(
            id,
            &HostMsg::Watch {
                path: path.into(),
                recursive,
            },
        );
        assert_eq!(self.recv(), (id, AgentMsg::Ok));
        id
    }

    /// Events of watch `id` until `want` is among them (or 10 s pass: panic).
    fn events_until(&mut self, id: u32, want: (&str, WatchKind)) -> Vec<(String, WatchKind)> {
        let t = Instant::now();
        let mut got = Vec::new();
        while t.elapsed() < Duration::from_secs(10) {
            match self.recv() {
                (i, AgentMsg::WatchEvent { name, kind }) if i == id => {
                    got.push((name.to_string_lossy().into_owned(), kind));
                    if got.last().is_some_and(|(n, k)| n == want.0 && *k == want.1) {
                        return got;
                    }
                }
                other => panic!("unexpected {other:?} while waiting for {want:?}"),
            }
        }
        panic!("no {want:?} in {got:?}");
    }
}

fn has(ev: &[(String, WatchKind)], name: &str, kind: WatchKind) -> bool {
    ev.iter().any(|(n, k)| n == name && *k == kind)
}

#[test]
fn events_for_create_write_rename_remove_then_unwatch() {
    let agent = Agent::start("basic");
    let w = agent.dir.join("w");
    let mut c = agent.connect();
    let id = c.watch(&w, false);
    std::fs::write(w.join("a.txt"), b"hello").unwrap();
    let ev = c.events_until(id, ("a.txt", WatchKind::Write));
    assert_eq!(ev[0], ("a.txt".into(), WatchKind::Create));
    std::fs::rename(w.join("a.txt"), w.join("b.txt")).unwrap();
    let ev = c.events_until(id, ("b.txt", WatchKind::Create));
    assert!(has(&ev, "a.txt", WatchKind::Rename), "{ev:?}");
    std::fs::remove_file(w.join("b.txt")).unwrap();
    c.events_until(id, ("b.txt", WatchKind::Remove));

    let stop = c.id();
    c.send(stop, &HostMsg::Unwatch { target: id });
    let mut finals = vec![c.recv(), c.recv()];
    finals.sort_by_key(|(i, _)| *i);
    assert_eq!(finals, vec![(id, AgentMsg::Ok), (stop, AgentMsg::Ok)]);
    // Nothing more on that id; the connection goes on.
    std::fs::write(w.join("later"), b"x").unwrap();
    let again = c.id();
    c.send(again, &HostMsg::Unwatch { target: id });
    match c.recv() {
        (i, AgentMsg::Error(e)) if i == again => assert_eq!(e.kind, ErrorKind::UnknownId),
        m => panic!("{m:?}"),
    }
}

#[test]
fn recursive_watch_sees_new_subdirectories() {
    let agent = Agent::start("recursive");
    let w = agent.dir.join("w");
    std::fs::create_dir(w.join("existing")).unwrap();
    let mut c = agent.connect();
    let id = c.watch(&w, true);
    std::fs::write(w.join("existing/f"), b"1").unwrap();
    c.events_until(id, ("existing/f", WatchKind::Write));
    std::fs::create_dir_all(w.join("n1/n2")).unwrap();
    std::fs::write(w.join("n1/n2/g"), b"2").unwrap();
    let ev = c.events_until(id, ("n1/n2/g", WatchKind::Create));
    assert!(has(&ev, "n1", WatchKind::Create), "{ev:?}");
}

#[test]
fn errors_missing_path_bad_frames_and_bounds() {
    let agent = Agent::start("errors");
    let mut c = agent.connect();
    // A missing directory, and a file.
    let id = c.id();
    c.send(
        id,
        &HostMsg::Watch {
            path: agent.dir.join("nope"),
            recursive: false,
        },
    );
    match c.recv() {
        (i, AgentMsg::Error(e)) if i == id => assert_eq!(e.kind, ErrorKind::NotFound),
        m => panic!("{m:?}"),
    }
    std::fs::write(agent.dir.join("file"), b"x").unwrap();
    let id = c.id();
    c.send(
        id,
        &HostMsg::Watch {
            path: agent.dir.join("file"),
            recursive: true,
        },
    );
    match c.recv() {
        (i, AgentMsg::Error(e)) if i == id => assert_eq!(e.errno, libc::ENOTDIR),
        m => panic!("{m:?}"),
    }
    // A truncated Watch, and a bad bool.
    let mut f = encode_host(
        900,
        &HostMsg::Watch {
            path: "/".into(),
            recursive: true,
        },
    )
    .unwrap();
    *f.last_mut().unwrap() = 7;
    c.s.write_all(&f).unwrap();
    f.truncate(f.len() - 1);
    let len = (f.len() - 4) as u32;
    f[..4].copy_from_slice(&len.to_le_bytes());
    c.s.write_all(&f).unwrap();
    for _ in 0..2 {
        match c.recv() {
            (900, AgentMsg::Error(e)) => assert_eq!(e.kind, ErrorKind::BadFrame),
            m => panic!("{m:?}"),
        }
    }
    // An id in use by a running watch.
    let w = agent.dir.join("w");
    let first = c.watch(&w, false);
    c.send(
        first,
        &HostMsg::Watch {
            path: w.clone(),
            recursive: false,
        },
    );
    match c.recv() {
        (i, AgentMsg::Error(e)) if i == first => assert_eq!(e.kind, ErrorKind::IdInUse),
        m => panic!("{m:?}"),
    }
    // At most 64 per connection.
    for _ in 1..64 {
        c.watch(&w, false);
    }
    let id = c.id();
    c.send(
        id,
        &HostMsg::Watch {
            path: w.clone(),
            recursive: false,
        },
    );
    match c.recv() {
        (i, AgentMsg::Error(e)) if i == id => assert!(e.message.contains("64"), "{e:?}"),
        m => panic!("{m:?}"),
    }
    // Another connection has its own budget.
    let mut c2 = agent.connect();
    c2.watch(&w, false);
}

#[test]
fn watches_end_with_their_connection_or_directory() {
    let agent = Agent::start("lifetime");
    let w = agent.dir.join("w");
    let base = agent.inotify_fds();
    let mut c = agent.connect();
    for _ in 0..3 {
        c.watch(&w, true);
    }
    assert_eq!(agent.inotify_fds(), base + 3);
    drop(c);
    let t = Instant::now();
    while agent.inotify_fds() != base {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "watches outlive their connection"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The watched directory removed: the watch ends with NotFound.
    let gone = agent.dir.join("gone");
    std::fs::create_dir(&gone).unwrap();
    let mut c = agent.connect();
    let id = c.watch(&gone, false);
    std::fs::remove_dir(&gone).unwrap();
    loop {
        match c.recv() {
            (i, AgentMsg::WatchEvent { .. }) if i == id => {}
            (i, AgentMsg::Error(e)) if i == id => {
                assert_eq!(e.kind, ErrorKind::NotFound);
                break;
            }
            m => panic!("{m:?}"),
        }
    }
}
