//! `clade disk` and `clade run --disk`: images made, inspected and flattened through the
//! binary, and bad images refused with one clear line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn clade() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clade"))
}

fn run(args: &[&str]) -> Output {
    clade().args(args).output().unwrap()
}

fn ok(args: &[&str]) -> String {
    let o = run(args);
    assert!(
        o.status.success(),
        "clade {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).to_string()
}

fn one_line_error(args: &[&str], needle: &str) {
    let o = run(args);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(1), "clade {args:?}: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "one line expected: {err}"
    );
    assert!(err.contains(needle), "expected '{needle}' in: {err}");
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("clade-disk-cli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
    fn p(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn create_info_flatten_round_trip() {
    let t = TempDir::new("rt");
    let mut raw: Vec<u8> = (0..3 * 1024 * 1024u32).map(|i| (i / 7) as u8).collect();
    raw[1024 * 1024..2 * 1024 * 1024].fill(0);
    std::fs::write(t.p("in.raw"), &raw).unwrap();
    let out = ok(&[
        "disk",
        "create",
        "--from",
        &t.p("in.raw"),
        &t.p("base.cdsk"),
    ]);
    assert!(
        out.contains("frozen base") && out.contains("32 of 48 blocks"),
        "{out}"
    );
    let out = ok(&[
        "disk",
        "create",
        "--parent",
        &t.p("base.cdsk"),
        &t.p("top.cdsk"),
    ]);
    assert!(out.contains("overlay"), "{out}");

    let info = ok(&["disk", "info", &t.p("top.cdsk")]);
    let lines: Vec<&str> = info.lines().collect();
    assert_eq!(lines.len(), 2, "{info}");
    assert!(lines[0].contains("writable") && lines[0].contains("parent=base.cdsk"));
    assert!(lines[1].starts_with("  ") && lines[1].contains("frozen"));
    let json = ok(&["disk", "info", "--json", &t.p("top.cdsk")]);
    let first: serde_json::Value = serde_json::from_str(json.lines().next().unwrap()).unwrap();
    assert_eq!(first["virtual_size"], 3 * 1024 * 1024);
    assert_eq!(first["allocated_blocks"], 0);

    ok(&[
        "disk",
        "flatten",
        "--raw",
        &t.p("top.cdsk"),
        &t.p("out.raw"),
    ]);
    assert_eq!(std::fs::read(t.p("out.raw")).unwrap(), raw);
    ok(&["disk", "flatten", &t.p("top.cdsk"), &t.p("flat.cdsk")]);
    let info = ok(&["disk", "info", &t.p("flat.cdsk")]);
    assert_eq!(info.lines().count(), 1, "standalone: {info}");

    // Blank disks, freezing.
    ok(&["disk", "create", "--size", "8M", &t.p("blank.cdsk")]);
    one_line_error(
        &[
            "disk",
            "create",
            "--parent",
            &t.p("blank.cdsk"),
            &t.p("o.cdsk"),
        ],
        "frozen",
    );
    ok(&["disk", "freeze", &t.p("blank.cdsk")]);
    ok(&[
        "disk",
        "create",
        "--parent",
        &t.p("blank.cdsk"),
        &t.p("o.cdsk"),
    ]);
    one_line_error(
        &["disk", "create", "--size", "1M", &t.p("o.cdsk")],
        "File exists",
    );
    one_line_error(&["disk", "create", &t.p("x.cdsk")], "needs --size");
}

#[test]
fn bad_images_are_refused_with_one_line() {
    let t = TempDir::new("bad");
    std::fs::write(t.p("junk.img"), vec![0x55u8; 8192]).unwrap();
    one_line_error(
        &["disk", "info", &t.p("junk.img")],
        "not a Clade disk layer",
    );
    one_line_error(&["disk", "info", &t.p("missing.cdsk")], "No such file");
    ok(&[
        "disk",
        "create",
        "--from",
        &t.p("junk.img"),
        &t.p("base.cdsk"),
    ]);
    ok(&[
        "disk",
        "create",
        "--parent",
        &t.p("base.cdsk"),
        &t.p("top.cdsk"),
    ]);
    // Truncate the base's table: the child's chain is refused, naming the base.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(t.p("base.cdsk"))
        .unwrap();
    f.set_len(4096 + 4).unwrap();
    one_line_error(
        &["disk", "info", &t.p("top.cdsk")],
        "truncated allocation table",
    );

    // `clade run --disk` with a bad image: refused before the guest runs.
    if !Path::new("/dev/kvm").exists() {
        eprintln!("skipped the run part: no /dev/kvm");
        return;
    }
    let kernel = env!("CARGO_BIN_EXE_clade");
    one_line_error(
        &["run", "--kernel", kernel, "--disk", &t.p("junk.img")],
        "not a Clade disk layer",
    );
    one_line_error(
        &["run", "--kernel", kernel, "--disk", &t.p("top.cdsk")],
        "truncated allocation table",
    );
}
