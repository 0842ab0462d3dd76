//! Tests of the protocol as a whole: every message round trips, frames read back from a
//! stream, oversized and malformed frames are refused, and random bytes never panic the
//! decoder (whatever decodes re-encodes to the same bytes).

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

use super::*;
use crate::Error;

fn stat() -> FileStat {
    FileStat {
        kind: FileKind::Symlink,
        mode: 0o4755,
        size: u64::MAX - 3,
        uid: 1000,
        gid: 65534,
        mtime_ns: -1_234_567,
    }
}

fn host_samples() -> Vec<HostMsg> {
    vec![
        HostMsg::Hello {
            min_version: 1,
            max_version: 7,
            client: "clade-test".into(),
        },
        HostMsg::Ping,
        HostMsg::Exec(ExecSpec::default()),
        HostMsg::Exec(ExecSpec {
            argv: vec![
                "sh".into(),
                "-c".into(),
                OsString::from_vec(vec![0xff, 0, 1]),
            ],
            env: vec![("PATH".into(), "/bin".into()), ("X".into(), "".into())],
            cwd: Some("/tmp".into()),
            uid: Some(1000),
            gid: Some(0),
            tty: Some(WinSize { rows: 24, cols: 80 }),
            stdin: true,
        }),
        HostMsg::Stdin(vec![1, 2, 3]),
        HostMsg::Stdin(vec![]),
        HostMsg::StdinClose,
        HostMsg::Signal {
            target: 9,
            signal: 15,
            group: true,
        },
        HostMsg::Resize {
            target: 3,
            size: WinSize {
                rows: 50,
                cols: 132,
            },
        },
        HostMsg::ReadFile {
            path: "/etc/hostname".into(),
        },
        HostMsg::WriteFile {
            path: "/tmp/x".into(),
            mode: 0o644,
        },
        HostMsg::FileData(vec![0; 1000]),
        HostMsg::FileEnd,
        HostMsg::Stat {
            path: "/".into(),
            follow_symlinks: false,
        },
        HostMsg::List { path: "/".into() },
        HostMsg::Remove {
            path: "/tmp/x".into(),
            recursive: true,
        },
        HostMsg::SetClock { unix_ns: i64::MIN },
        HostMsg::AddEntropy(vec![7; 32]),
        HostMsg::Sync,
        HostMsg::PowerOff,
        HostMsg::MakeDir {
            path: "/tmp/d/e".into(),
            mode: 0o750,
            parents: true,
        },
        HostMsg::Rename {
            from: "/tmp/a".into(),
            to: "/tmp/b".into(),
        },
        HostMsg::Spawn {
            spec: ExecSpec {
                argv: vec!["sleep".into(), "9".into()],
                env: vec![("A".into(), "b".into())],
                cwd: Some("/".into()),
                uid: None,
                gid: Some(5),
                tty: Some(WinSize { rows: 1, cols: 2 }),
                stdin: true,
            },
            tag: Some("server".into()),
            meta: vec![0, 1, 2],
        },
        HostMsg::Spawn {
            spec: ExecSpec::default(),
            tag: None,
            meta: vec![],
        },
        HostMsg::Attach {
            pid: 4242,
            output: true,
        },
        HostMsg::Attach {
            pid: 1,
            output: false,
        },
        HostMsg::ListProcs,
        HostMsg::Watch {
            path: "/tmp/w".into(),
            recursive: true,
        },
        HostMsg::Unwatch { target: 77 },
        HostMsg::ReadLink {
            path: "/tmp/link".into(),
        },
        HostMsg::AsUser {
            uid: 1000,
            gid: 1000,
            groups: vec![1000, 27],
        },
        HostMsg::AsUser {
            uid: 0,
            gid: 0,
            groups: vec![],
        },
        HostMsg::GetXattrs {
            paths: vec!["/a".into(), "/b c".into()],
            prefix: "user.e2b.".into(),
        },
        HostMsg::GetXattrs {
            paths: vec![],
            prefix: String::new(),
        },
        HostMsg::SetXattrs {
            path: "/a".into(),
            prefix: "user.e2b.".into(),
            set: vec![
                ("user.e2b.k".into(), b"v".to_vec()),
                ("user.e2b.e".into(), vec![]),
            ],
        },
    ]
}

fn agent_samples() -> Vec<AgentMsg> {
    vec![
        AgentMsg::HelloOk {
            version: 1,
            agent_version: "0.1.0".into(),
            max_frame_len: MAX_FRAME_LEN,
        },
        AgentMsg::Ok,
        AgentMsg::Error(RemoteError {
            kind: ErrorKind::NotFound,
            errno: 2,
            message: "open /x: no such file".into(),
        }),
        AgentMsg::Error(RemoteError::new(ErrorKind::Other(999), "future")),
        AgentMsg::Pong {
            agent_version: "0.1.0".into(),
            protocol: 1,
            uptime_ms: 123_456,
            running_execs: 3,
        },
        AgentMsg::Started { pid: 42 },
        AgentMsg::Stdout(b"hello\n".to_vec()),
        AgentMsg::Stderr(vec![]),
        AgentMsg::StdinAck(65536),
        AgentMsg::Exited(ExitStatus::Exited(-1)),
        AgentMsg::Exited(ExitStatus::Signaled {
            signal: 9,
            core_dumped: true,
        }),
        AgentMsg::FileData(vec![9; CHUNK_LEN]),
        AgentMsg::FileDone { bytes: 5 << 20 },
        AgentMsg::Stat(stat()),
        AgentMsg::DirEntries(vec![]),
        AgentMsg::DirEntries(vec![
            DirEntry {
                name: "a".into(),
                stat: stat(),
            },
            DirEntry {
                name: OsString::from_vec(vec![0x80, b'b']),
                stat: FileStat {
                    kind: FileKind::Dir,
                    ..stat()
                },
            },
        ]),
        AgentMsg::ProcList(vec![]),
        AgentMsg::ProcList(vec![
            ProcInfo {
                pid: 77,
                tag: Some("t".into()),
                meta: b"{}".to_vec(),
                argv: vec!["sh".into(), "-c".into(), "x".into()],
                env: vec![("K".into(), OsString::from_vec(vec![0xfe]))],
                cwd: Some("/tmp".into()),
                tty: true,
                stdin: false,
                exit: None,
            },
            ProcInfo {
                pid: 78,
                exit: Some(ExitStatus::Signaled {
                    signal: 9,
                    core_dumped: false,
                }),
                ..Default::default()
            },
        ]),
        AgentMsg::WatchEvent {
            name: "sub/f.txt".into(),
            kind: WatchKind::Create,
        },
        AgentMsg::WatchEvent {
            name: "".into(),
            kind: WatchKind::Overflow,
        },
        AgentMsg::WatchEvent {
            name: PathBuf::from(OsString::from_vec(vec![0xfe])),
            kind: WatchKind::Other(200),
        },
        AgentMsg::LinkTarget {
            target: PathBuf::from(OsString::from_vec(vec![b'.', b'/', 0xfe])),
        },
        AgentMsg::Xattrs(vec![vec![], vec![("user.e2b.x".into(), vec![0, 255])]]),
    ]
}

fn all_frames() -> Vec<Vec<u8>> {
    let mut v: Vec<Vec<u8>> = host_samples()
        .iter()
        .enumerate()
        .map(|(i, m)| encode_host(i as u32, m).unwrap())
        .collect();
    v.extend(
        agent_samples()
            .iter()
            .enumerate()
            .map(|(i, m)| encode_agent(u32::MAX - i as u32, m).unwrap()),
    );
    v
}

#[test]
fn every_message_round_trips() {
    for (i, m) in host_samples().into_iter().enumerate() {
        let f = encode_host(i as u32, &m).unwrap();
        let back = decode_frame(&f).unwrap();
        assert_eq!(
            back,
            Frame {
                id: i as u32,
                msg: Msg::Host(m)
            }
        );
    }
    for (i, m) in agent_samples().into_iter().enumerate() {
        let f = encode_agent(i as u32 + 1000, &m).unwrap();
        let back = decode_frame(&f).unwrap();
        assert_eq!(
            back,
            Frame {
                id: i as u32 + 1000,
                msg: Msg::Agent(m)
            }
        );
    }
}

#[test]
fn proc_info_wire_len_matches_the_encoding() {
    for m in agent_samples() {
        if let AgentMsg::ProcList(procs) = &m {
            let f = encode_agent(1, &m).unwrap();
            let want: usize = procs.iter().map(proc_info_wire_len).sum();
            assert_eq!(f.len(), 4 + FRAME_HEADER_LEN + 4 + want);
        }
    }
}

#[test]
fn frames_read_back_from_a_stream() {
    let frames = all_frames();
    let stream: Vec<u8> = frames.concat();
    let mut r = &stream[..];
    for f in &frames {
        let got = read_frame(&mut r, MAX_FRAME_LEN).unwrap().unwrap();
        assert_eq!(&got, f);
    }
    assert!(read_frame(&mut r, MAX_FRAME_LEN).unwrap().is_none());
}

#[test]
fn oversized_frames_are_refused_both_ways() {
    let big = HostMsg::FileData(vec![0; MAX_FRAME_LEN as usize]);
    assert!(matches!(
        encode_host(1, &big),
        Err(Error::FrameTooLarge { .. })
    ));
    let mut prefix = &(MAX_FRAME_LEN + 1).to_le_bytes()[..];
    assert!(matches!(
        read_frame(&mut prefix, MAX_FRAME_LEN),
        Err(Error::FrameTooLarge { .. })
    ));
    let mut f = (MAX_FRAME_LEN + 1).to_le_bytes().to_vec();
    f.extend_from_slice(&[0; 16]);
    assert!(matches!(decode_frame(&f), Err(Error::FrameTooLarge { .. })));
}

#[test]
fn malformed_frames_are_errors() {
    // Truncated at every possible point.
    for f in all_frames() {
        for cut in 0..f.len() {
            let mut g = f[..cut].to_vec();
            if g.len() >= 4 {
                let len = (g.len() - 4) as u32;
                g[..4].copy_from_slice(&len.to_le_bytes());
            }
            assert!(decode_frame(&g).is_err(), "cut {cut} of {f:?}");
        }
        // Trailing garbage.
        let mut g = f.clone();
        g.push(0);
        let len = (g.len() - 4) as u32;
        g[..4].copy_from_slice(&len.to_le_bytes());
        assert!(matches!(decode_frame(&g), Err(Error::TrailingBytes(1))));
    }
    // Unknown tags, bad bools, lying counts.
    let mut f = encode_host(1, &HostMsg::Ping).unwrap();
    f[4] = 0x7f;
    assert!(matches!(decode_frame(&f), Err(Error::UnknownTag(0x7f))));
    let mut f = encode_host(1, &HostMsg::Sync).unwrap();
    f[4] = 0xff;
    assert!(matches!(decode_frame(&f), Err(Error::UnknownTag(0xff))));
    let mut f = encode_host(
        1,
        &HostMsg::Stat {
            path: "/".into(),
            follow_symlinks: true,
        },
    )
    .unwrap();
    *f.last_mut().unwrap() = 2;
    assert!(matches!(decode_frame(&f), Err(Error::Invalid(_))));
    let mut f = encode_agent(1, &AgentMsg::DirEntries(vec![])).unwrap();
    f[9..13].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(decode_frame(&f), Err(Error::Truncated(_))));
}

/// xorshift64*: deterministic pseudo-random bytes without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Property: decoding arbitrary bytes returns Ok or Err, never panics, and whatever
/// decodes re-encodes to the same bytes (the encoding is canonical).
#[test]
fn random_bytes_never_panic() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let seeds = all_frames();
    let mut decoded = 0;
    for round in 0..200_000 {
        let mut f = if round % 2 == 0 {
            // Pure noise, sometimes with a consistent length prefix.
            let n = rng.below(96);
            let mut f: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            if f.len() >= 4 && rng.below(2) == 0 {
                let len = (f.len() - 4) as u32;
                f[..4].copy_from_slice(&len.to_le_bytes());
            }
            f
        } else {
            // A valid frame with a few bytes flipped (length prefix kept consistent).
            let mut f = seeds[rng.below(seeds.len())].clone();
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(f.len());
                f[i] = rng.next() as u8;
            }
            if rng.below(4) != 0 {
                let len = (f.len() - 4) as u32;
                f[..4].copy_from_slice(&len.to_le_bytes());
            }
            f
        };
        if let Ok(frame) = decode_frame(&f) {
            decoded += 1;
            let again = match &frame.msg {
                Msg::Host(m) => encode_host(frame.id, m).unwrap(),
                Msg::Agent(m) => encode_agent(frame.id, m).unwrap(),
            };
            // Error messages are truncated on encode; nothing else changes.
            assert_eq!(again, f, "{frame:?}");
        }
        // Streams of noise never panic the frame reader either.
        f.truncate(64);
        let mut r = &f[..];
        while let Ok(Some(_)) = read_frame(&mut r, 1024) {}
    }
    assert!(decoded > 1000, "mutations should often still decode");
}
