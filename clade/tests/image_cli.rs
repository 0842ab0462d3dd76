//! `clade template build --image`: a template whose disk is a container image's root
//! filesystem. The template VM here is the native test guest (it does not read the disk),
//! so the disk is checked from the host, file by file, with e2fsprogs' debugfs; booting
//! such a template as Linux is the nested tier's.

#[allow(dead_code)]
mod common;
#[path = "../../tests/src/native_guest.rs"]
mod native_guest;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use clade_image::testing::{layer, oci_layout, push, Registry, E};
use common::Dir;
use native_guest::native_guest;

fn clade() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clade"))
}

fn build(state: &Path, name: &str, image: &Path, extra: &[&str]) -> Output {
    clade()
        .args(["template", "build", name, "--test-device", "--mem", "64"])
        .arg("--kernel")
        .arg(native_guest())
        .args(["--cmdline", "steps=vsock", "--image"])
        .arg(image)
        .args(extra)
        .arg("--state-dir")
        .arg(state)
        .output()
        .unwrap()
}

fn find(dir: &Path, name: &str) -> Option<PathBuf> {
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        if p.file_name().is_some_and(|n| n == name) {
            return Some(p);
        }
        if p.is_dir() {
            if let Some(f) = find(&p, name) {
                return Some(f);
            }
        }
    }
    None
}

/// `clade disk flatten --raw TOP RAW`: the chain's content as one raw image.
fn flatten(top: &Path, raw: &Path) {
    let o = clade()
        .args(["disk", "flatten", "--raw"])
        .arg(top)
        .arg(raw)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn debugfs(raw: &Path, request: &str) -> String {
    let o = Command::new("debugfs")
        .args(["-R", request])
        .arg(raw)
        .output()
        .expect("debugfs (e2fsprogs)");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn templates(state: &Path) -> String {
    let o = clade()
        .args(["template", "ls", "--json", "--state-dir"])
        .arg(state)
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn a_template_from_an_image_has_its_files_on_its_disk() {
    let d = Dir::new("image-template");
    let state = d.p("state");
    let l1 = layer(&[
        E::Dir("etc/", 0o755),
        E::File("etc/hostname", b"from-image\n", 0o644, 0),
        E::File("etc/gone", b"x", 0o644, 0),
        E::Dir("home/", 0o755),
        E::Dir("home/user/", 0o750),
        E::File("home/user/.bashrc", b"# rc\n", 0o640, 1000),
        E::File("usr/bin/tool", b"tool", 0o4755, 0),
    ]);
    let l2 = layer(&[
        E::File("etc/.wh.gone", b"", 0o644, 0),
        E::Hardlink("usr/bin/tool2", "usr/bin/tool"),
        E::Symlink("etc/localtime", "/usr/share/zoneinfo/UTC"),
    ]);
    oci_layout(&d.p("img"), &[l1, l2], true);
    let o = build(&state, "img", &d.p("img"), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("2 layers"), "{err}");

    // The template records the image and its config's defaults.
    let t = std::fs::read_to_string(find(&state, "template.json").unwrap()).unwrap();
    let t: serde_json::Value = serde_json::from_str(&t).unwrap();
    assert_eq!(t["disk"], true);
    assert_eq!(t["image"]["env"]["GREETING"], "a=b");
    assert_eq!(t["image"]["cwd"], "/srv");
    assert_eq!(t["image"]["start_cmd"][0], "/bin/app");

    // Its disk, flattened to a raw ext4 image, holds the image's files as the layers left
    // them. Its base is the build cache's conversion of the image.
    let base = cached_bases(&state);
    assert_eq!(base.len(), 1, "{base:?}");
    let base = base[0].clone();
    let raw = d.p("disk.raw");
    flatten(&base, &raw);
    assert_eq!(debugfs(&raw, "cat /etc/hostname"), "from-image\n");
    let ls = debugfs(&raw, "ls -l /etc");
    assert!(!ls.contains("gone"), "whiteout not applied: {ls}");
    assert!(ls.contains("localtime"), "{ls}");
    let rc = debugfs(&raw, "stat /home/user/.bashrc");
    assert!(
        rc.contains("User:  1000") && rc.contains("Mode:  0640"),
        "{rc}"
    );
    let tool = debugfs(&raw, "stat /usr/bin/tool");
    assert!(
        tool.contains("Mode:  04755") && tool.contains("Links: 2"),
        "{tool}"
    );
    // The mount points the agent needs were made.
    let root = debugfs(&raw, "ls -l /");
    for dir in ["dev", "proc", "sys", "tmp", "run"] {
        assert!(root.contains(dir), "/{dir} missing: {root}");
    }
    // No scratch left in the template or the cache.
    assert!(find(&state, "image-build").is_none());
    assert!(std::fs::read_dir(base.parent().unwrap())
        .unwrap()
        .flatten()
        .all(|e| !e.file_name().to_string_lossy().starts_with(".scratch")));

    // A second template of the same image: not converted again, the same base shared.
    let o = build(&state, "img2", &d.p("img"), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("converted before (cached)"), "{err}");
    assert_eq!(cached_bases(&state), vec![base]);
    // Without a terminal, no progress bar is drawn.
    assert!(!err.contains('%'), "{err}");
}

/// The image conversions in the build cache.
fn cached_bases(state: &Path) -> Vec<PathBuf> {
    let dir = state.join("templates/.build-cache/images");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cdsk"))
        .collect();
    v.sort();
    v
}

#[test]
fn a_conversion_shows_its_progress_on_a_terminal() {
    let d = Dir::new("image-progress");
    let state = d.p("state");
    // Incompressible data, so the bar has bytes to count.
    let mut big = vec![0u8; 8 << 20];
    let mut x: u64 = 0x9e3779b97f4a7c15;
    for b in big.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    oci_layout(
        &d.p("img"),
        &[layer(&[
            E::Dir("data/", 0o755),
            E::File("data/blob", &big, 0o644, 0),
        ])],
        true,
    );
    // Under a pseudo-terminal (util-linux `script`).
    let cmd = format!(
        "{} template build img --test-device --mem 64 --kernel {} --cmdline steps=vsock --image {} --state-dir {}",
        env!("CARGO_BIN_EXE_clade"),
        native_guest().display(),
        d.p("img").display(),
        state.display()
    );
    let out = Command::new("script")
        .args(["-qefc", &cmd, "/dev/null"])
        .output()
        .expect("run script(1)");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{shown}");
    assert!(shown.contains("unpack"), "no unpack bar: {shown:?}");
    assert!(shown.contains("100%"), "no finished bar: {shown:?}");
    assert!(
        shown.contains("MiB/8."),
        "the bar counts the layer's bytes: {shown:?}"
    );
}

#[test]
fn bad_images_register_nothing() {
    let d = Dir::new("image-bad");
    let state = d.p("state");
    let big = vec![1u8; 3 << 20];
    oci_layout(
        &d.p("big"),
        &[layer(&[E::File("big", &big, 0o644, 0)])],
        true,
    );
    let o = build(&state, "big", &d.p("big"), &["--disk-size", "2M"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("larger than"), "{err}");

    // A layer that escapes the tree through a symlink another layer planted.
    let l1 = layer(&[E::Symlink("etc", "/etc")]);
    let l2 = layer(&[E::File("etc/clade-escape", b"x", 0o644, 0)]);
    oci_layout(&d.p("escape"), &[l1, l2], true);
    let o = build(&state, "escape", &d.p("escape"), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("symbolic link"), "{err}");
    assert!(!Path::new("/etc/clade-escape").exists());

    // A corrupt layer blob.
    let digests = oci_layout(
        &d.p("corrupt"),
        &[layer(&[E::File("f", b"data", 0o644, 0)])],
        true,
    );
    let blob = d.p(&format!("corrupt/blobs/sha256/{}", &digests[0][7..]));
    let mut data = std::fs::read(&blob).unwrap();
    let n = data.len();
    data[n - 5] ^= 0xff;
    std::fs::write(&blob, data).unwrap();
    let o = build(&state, "corrupt", &d.p("corrupt"), &[]);
    assert!(!o.status.success());
    // Not an image at all.
    std::fs::create_dir_all(d.p("nothing")).unwrap();
    let o = build(&state, "nothing", &d.p("nothing"), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("neither an OCI image layout"),
        "{err}"
    );

    // None of them left a template.
    assert_eq!(templates(&state).trim(), "[]");
}

/// From a registry by reference: Debian's docker-registry on loopback, images pushed to it
/// here; a second image sharing the base layer fetches only what it does not share.
#[test]
fn a_template_from_a_registry_reference() {
    let d = Dir::new("image-registry");
    let state = d.p("state");
    let reg = Registry::start(&d.p("registry"));
    let base = layer(&[
        E::Dir("etc/", 0o755),
        E::File("etc/os-release", b"ID=clade-test\n", 0o644, 0),
    ]);
    let app1 = layer(&[E::File("srv/app", b"one", 0o755, 1000)]);
    let app2 = layer(&[E::File("srv/app", b"two", 0o755, 1000)]);
    let r1 = format!("{}/clade/app:1", reg.addr);
    let r2 = format!("{}/clade/app:2", reg.addr);
    push(&r1, &[base.clone(), app1]);
    push(&r2, &[base, app2]);

    let o = build(&state, "app1", Path::new(&r1), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("3 blobs fetched") && err.contains("0 already cached"),
        "{err}"
    );
    let o = build(&state, "app2", Path::new(&r2), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // Its config and top layer are new; the base layer is the first image's.
    assert!(
        err.contains("2 blobs fetched") && err.contains("1 already cached"),
        "{err}"
    );

    let raw = d.p("app2.raw");
    // The template's disk (its overlay on the cached conversion of the image).
    let base2 = find(&state.join("templates").join("app2"), "disk.cdsk").expect("app2's disk");
    flatten(&base2, &raw);
    assert_eq!(debugfs(&raw, "cat /srv/app"), "two");
    assert_eq!(debugfs(&raw, "cat /etc/os-release"), "ID=clade-test\n");

    // On a terminal, the pull draws a bar that ends at 100 %.
    let big = vec![3u8; 4 << 20];
    let r3 = format!("{}/clade/app:3", reg.addr);
    push(&r3, &[layer(&[E::File("srv/big", &big, 0o644, 0)])]);
    let cmd = format!(
        "{} template build app3 --test-device --mem 64 --kernel {} --cmdline steps=vsock \
         --image {r3} --state-dir {}",
        env!("CARGO_BIN_EXE_clade"),
        native_guest().display(),
        state.display()
    );
    let shown = common::on_a_terminal(&cmd);
    assert!(
        shown.contains("pull [") && shown.contains("100%"),
        "no finished bar: {shown:?}"
    );

    // A tag the registry does not have: a clear error, nothing registered.
    let o = build(
        &state,
        "nope",
        Path::new(&format!("{}/clade/app:9", reg.addr)),
        &[],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("clade/app:9"), "{err}");
    let ls = templates(&state);
    assert!(
        ls.contains("app1") && ls.contains("app2") && !ls.contains("nope"),
        "{ls}"
    );
}

fn build_dockerfile(state: &Path, name: &str, dockerfile: &Path, extra: &[&str]) -> Output {
    clade()
        .args(["template", "build", name, "--test-device", "--mem", "64"])
        .arg("--kernel")
        .arg(native_guest())
        .args(["--cmdline", "steps=vsock", "--dockerfile"])
        .arg(dockerfile)
        .args(extra)
        .arg("--state-dir")
        .arg(state)
        .output()
        .unwrap()
}

/// A Dockerfile whose instructions change no file (the test guest runs no RUN or COPY):
/// its FROM image is converted once and shared, its ENV, WORKDIR, USER, ENTRYPOINT and
/// CMD are the template's defaults; bad Dockerfiles are refused naming their line, and
/// register nothing. RUN and COPY are the nested tier's (tests/nested/scenarios/dockerfile.sh).
#[test]
fn a_template_from_a_dockerfile_takes_its_defaults_and_shares_its_base() {
    let d = Dir::new("dockerfile-template");
    let state = d.p("state");
    let ctx = d.p("ctx");
    std::fs::create_dir_all(&ctx).unwrap();
    let l1 = layer(&[
        E::Dir("etc/", 0o755),
        E::File("etc/hostname", b"from-image\n", 0o644, 0),
    ]);
    oci_layout(&ctx.join("img"), &[l1], true);
    std::fs::write(
        ctx.join("Dockerfile"),
        "ARG IMG=img\nFROM ${IMG}\nENV GREETING=\"hello there\" \\\n    LANG=C.UTF-8\n\
         WORKDIR /srv\nUSER 1000:1000\nLABEL a=b\nENTRYPOINT [\"/bin/app\"]\nCMD [\"--serve\"]\n",
    )
    .unwrap();
    let o = build_dockerfile(&state, "df1", &ctx.join("Dockerfile"), &[]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    assert!(err.contains("FROM img: 1 layers"), "{err}");
    assert!(
        err.contains("ignored (no effect on a sandbox): line 7: LABEL"),
        "{err}"
    );
    let t: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join("templates/df1/template.json")).unwrap())
            .unwrap();
    let img = &t["image"];
    assert_eq!(img["env"]["GREETING"], "hello there", "{t}");
    assert_eq!(img["env"]["LANG"], "C.UTF-8", "{t}");
    assert_eq!(img["cwd"], "/srv", "{t}");
    assert_eq!(img["user"], "1000:1000", "{t}");
    assert_eq!(
        img["start_cmd"],
        serde_json::json!(["/bin/app", "--serve"]),
        "{t}"
    );
    // A second template from the same image: its conversion is not done again.
    let o = build_dockerfile(
        &state,
        "df2",
        &ctx.join("Dockerfile"),
        &["--build-arg", "IMG=img"],
    );
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    assert!(err.contains("FROM img: cached"), "{err}");
    // Refused, naming the line; no template registered.
    for (text, needle) in [
        ("FROM img\nRUN true\n", "RUN and COPY need a Linux guest"),
        (
            "FROM img\nFROBNICATE x\n",
            "line 2: unknown instruction 'FROBNICATE'",
        ),
        ("FROM img AS a\nFROM img\n", "line 2: a second FROM"),
        ("FROM missing-image-dir/\n", "FROM missing-image-dir/"),
        (
            "FROM img\nADD http://127.0.0.1/x /x\n",
            "line 2: ADD of a URL",
        ),
    ] {
        std::fs::write(ctx.join("Bad"), text).unwrap();
        let o = build_dockerfile(&state, "bad", &ctx.join("Bad"), &[]);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!o.status.success(), "{text}");
        assert!(err.contains(needle), "{text}: {err}");
        assert!(!state.join("templates/bad").exists(), "{text}");
    }
    assert!(!templates(&state).contains("\"bad\""));
}

#[test]
fn prune_removes_what_no_template_stands_on_and_waits_for_builds() {
    let d = Dir::new("image-prune");
    let state = d.p("state");
    oci_layout(
        &d.p("a"),
        &[layer(&[E::File("etc/a", b"a\n", 0o644, 0)])],
        true,
    );
    oci_layout(
        &d.p("b"),
        &[layer(&[E::File("etc/b", b"b\n", 0o644, 0)])],
        true,
    );
    for (name, img) in [("ta", "a"), ("tb", "b")] {
        let o = build(&state, name, &d.p(img), &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let bases = cached_bases(&state);
    assert_eq!(bases.len(), 2, "{bases:?}");
    // What a killed build leaves: a conversion's scratch, a run directory.
    let cache = state.join("templates/.build-cache");
    std::fs::create_dir_all(cache.join("images/.scratch-dead/tree")).unwrap();
    std::fs::create_dir_all(cache.join("run-dead")).unwrap();
    std::fs::write(cache.join("run-dead/step.cdsk"), b"half").unwrap();
    let prune = || {
        clade()
            .args(["template", "prune", "--state-dir"])
            .arg(&state)
            .output()
            .unwrap()
    };
    // Both templates stand on their bases: only the leftovers go.
    let o = prune();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("2 leftovers"), "{out}");
    assert_eq!(cached_bases(&state), bases);
    assert!(!cache.join("images/.scratch-dead").exists() && !cache.join("run-dead").exists());
    // Template ta removed: its base goes, tb's stays and still reads whole.
    let o = clade()
        .args(["template", "rm", "ta", "--state-dir"])
        .arg(&state)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Not while a build holds the cache.
    // (-o: the lock is flock's own, not inherited by the command it waits for.)
    let mut holder = Command::new("flock")
        .args(["-s", "-o"])
        .arg(cache.join(".lock"))
        .args(["sleep", "30"])
        .spawn()
        .expect("flock (util-linux)");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let o = prune();
    let _ = holder.kill();
    let _ = holder.wait();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("in use by a build"),
        "{err}"
    );
    assert_eq!(cached_bases(&state).len(), 2);
    let o = prune();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("pruned 1 layers"), "{out}");
    let left = cached_bases(&state);
    assert_eq!(left.len(), 1);
    let raw = d.p("tb.raw");
    let top = find(&state.join("templates/tb"), "disk.cdsk").expect("tb's disk");
    flatten(&top, &raw);
    assert_eq!(debugfs(&raw, "cat /etc/b"), "b\n");
}
