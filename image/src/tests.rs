//! Images built here by hand (tar layers, blobs named by digest, index, manifest,
//! config), in each of the three forms, unpacked and checked file by file.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::testing::{archive_of, config, layer, oci_layout, sha, E};
use super::*;

struct TestDir(PathBuf);

impl TestDir {
    fn new(name: &str) -> TestDir {
        let d = std::env::temp_dir().join(format!("clade-image-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        TestDir(d)
    }
    fn p(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn two_layers() -> Vec<Vec<u8>> {
    let l1 = layer(&[
        E::Dir("etc/", 0o755),
        E::File("etc/hostname", b"base\n", 0o644, 0),
        E::File("etc/gone", b"x", 0o644, 0),
        E::Dir("var/", 0o755),
        E::Dir("var/cache/", 0o755),
        E::File("var/cache/old", b"old", 0o644, 0),
        E::Dir("home/", 0o755),
        E::Dir("home/user/", 0o750),
        E::File("home/user/.bashrc", b"# rc\n", 0o640, 1000),
        E::File("usr/bin/su", b"\x7fELF", 0o4755, 0),
        E::File("usr/bin/tool", b"tool v1", 0o755, 0),
    ]);
    let l2 = layer(&[
        E::File("etc/.wh.gone", b"", 0o644, 0),
        E::File("var/cache/new", b"new", 0o644, 0),
        E::File("var/cache/.wh..wh..opq", b"", 0o644, 0),
        E::Hardlink("usr/bin/tool-link", "usr/bin/tool"),
        E::Symlink("etc/localtime", "/usr/share/zoneinfo/UTC"),
        E::XattrFile("etc/labelled", b"l", "user.clade", b"yes"),
        E::File("etc/hostname", b"top\n", 0o600, 0),
        E::Fifo("run-fifo"),
    ]);
    vec![l1, l2]
}

fn check_tree(root: &Path, report: &UnpackReport) {
    let read = |p: &str| fs::read(root.join(p)).unwrap();
    let meta = |p: &str| fs::symlink_metadata(root.join(p)).unwrap();
    let fixup = |p: &str| {
        report
            .fixups
            .iter()
            .find(|(r, _)| r == Path::new(p))
            .map(|(_, f)| f.clone())
    };
    assert_eq!(read("etc/hostname"), b"top\n");
    assert_eq!(meta("etc/hostname").mode() & 0o7777, 0o600);
    assert!(!root.join("etc/gone").exists(), "whiteout not applied");
    assert!(!root.join("etc/.wh.gone").exists());
    // Opaque: the lower layer's file went, this layer's stayed (it came first).
    assert!(!root.join("var/cache/old").exists());
    assert_eq!(read("var/cache/new"), b"new");
    assert!(!root.join("var/cache/.wh..wh..opq").exists());
    // Owners other than the service's, set-id bits, xattrs and special files are the
    // image's only: fix-ups, not on the host.
    let rc = meta("home/user/.bashrc");
    assert_eq!((rc.uid(), rc.gid(), rc.mode() & 0o7777), (0, 0, 0o640));
    assert_eq!(
        fixup("home/user/.bashrc").unwrap().owner,
        Some((1000, 1000))
    );
    assert_eq!(meta("home/user").mode() & 0o7777, 0o750);
    assert_eq!(meta("usr/bin/su").mode() & 0o7777, 0o755);
    assert_eq!(
        fixup("usr/bin/su").unwrap().mode,
        Some(0o104755),
        "set-uid bit lost"
    );
    // The hard link across layers shares the lower layer's inode.
    assert_eq!(meta("usr/bin/tool").ino(), meta("usr/bin/tool-link").ino());
    assert_eq!(meta("usr/bin/tool").nlink(), 2);
    assert_eq!(
        fs::read_link(root.join("etc/localtime")).unwrap(),
        Path::new("/usr/share/zoneinfo/UTC")
    );
    assert!(meta("run-fifo").is_file());
    assert_eq!(fixup("run-fifo").unwrap().node, Some(Node::Fifo));
    assert_eq!(
        xattr::get(root.join("etc/labelled"), "user.clade").unwrap(),
        None
    );
    assert_eq!(
        fixup("etc/labelled").unwrap().xattrs,
        [(b"user.clade".to_vec(), b"yes".to_vec())]
    );
    // The root: private on the host, the image's mode in the image.
    assert_eq!(meta("").mode() & 0o7777, 0o700);
    assert_eq!(fixup("").unwrap().mode, Some(0o40755));
    assert_eq!(meta("etc/hostname").mtime(), 1_700_000_000);
    // Written into after its entry, in the same layer: its time is set last.
    assert_eq!(
        meta("home/user").mtime(),
        1_700_000_000,
        "directory times set last"
    );
}

#[test]
fn layout_archive_and_docker_save_give_the_same_tree() {
    let t = TestDir::new("forms");
    let layers = two_layers();
    oci_layout(&t.p("layout"), &layers, true);
    let src = Source::open(&t.p("layout")).unwrap();
    assert_eq!(src.layers().len(), 2);
    let d = src.defaults();
    assert_eq!(d.env[1], ("GREETING".into(), "a=b".into()));
    assert_eq!((d.cwd.as_str(), d.user.as_str()), ("/srv", "1000:1000"));
    assert_eq!(d.start_command(), ["/bin/app", "--serve"]);
    let r = unpack(&src, &t.p("tree1"), UnpackLimits::default()).unwrap();
    assert_eq!((r.layers, r.whiteouts), (2, 2));
    check_tree(&t.p("tree1"), &r);

    // The same layout as an OCI archive, uncompressed layers this time.
    oci_layout(&t.p("layout-raw"), &layers, false);
    archive_of(&t.p("layout-raw"), &t.p("oci.tar"));
    let src = Source::open(&t.p("oci.tar")).unwrap();
    let r = unpack(&src, &t.p("tree2"), UnpackLimits::default()).unwrap();
    check_tree(&t.p("tree2"), &r);

    // docker save: manifest.json naming the config and layer tars by path.
    let ds = t.p("docker");
    fs::create_dir_all(ds.join("l1")).unwrap();
    fs::create_dir_all(ds.join("l2")).unwrap();
    fs::write(ds.join("l1/layer.tar"), &layers[0]).unwrap();
    fs::write(ds.join("l2/layer.tar"), &layers[1]).unwrap();
    let diff_ids: Vec<String> = layers.iter().map(|l| sha(l)).collect();
    fs::write(ds.join("cfg.json"), config(&diff_ids)).unwrap();
    fs::write(
        ds.join("manifest.json"),
        r#"[{"Config":"cfg.json","RepoTags":["x:1"],"Layers":["l1/layer.tar","l2/layer.tar"]}]"#,
    )
    .unwrap();
    archive_of(&ds, &t.p("docker.tar"));
    let src = Source::open(&t.p("docker.tar")).unwrap();
    let r = unpack(&src, &t.p("tree3"), UnpackLimits::default()).unwrap();
    check_tree(&t.p("tree3"), &r);
}

/// Unpacks a one-layer image of `entries` on top of `base` (a first layer), expecting an
/// error containing `want`; the tree is gone afterwards and `outside` untouched.
fn refused(name: &str, base: &[E], entries: &[E], want: &str) {
    let t = TestDir::new(name);
    fs::create_dir_all(t.p("outside")).unwrap();
    let outside = t.p("outside").display().to_string();
    let base = layer(base);
    let top = layer(entries);
    oci_layout(&t.p("layout"), &[base, top], true);
    let src = Source::open(&t.p("layout")).unwrap();
    let e = unpack(&src, &t.p("tree"), UnpackLimits::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains(want), "{name}: {e}");
    assert!(
        !t.p("tree").exists(),
        "{name}: a failed unpack left its tree"
    );
    assert_eq!(
        fs::read_dir(&outside).unwrap().count(),
        0,
        "{name}: wrote outside"
    );
}

#[test]
fn layers_cannot_write_outside_the_tree() {
    let outside = |t: &str| {
        std::env::temp_dir()
            .join(format!("clade-image-{t}-{}", std::process::id()))
            .join("outside")
            .display()
            .to_string()
    };
    refused(
        "dotdot",
        &[],
        &[E::File("../outside/x", b"x", 0o644, 0)],
        "a path with `..`",
    );
    refused(
        "dotdot-mid",
        &[],
        &[E::File("etc/../../outside/x", b"x", 0o644, 0)],
        "a path with `..`",
    );
    // An absolute symlink planted by a lower layer, used as a parent by a higher one.
    let o = outside("abs-symlink");
    refused(
        "abs-symlink",
        &[E::Symlink("etc", &o)],
        &[E::File("etc/passwd", b"root::0:0", 0o644, 0)],
        "its parent etc is a symbolic link",
    );
    // The same within one layer, and a relative one.
    refused(
        "rel-symlink",
        &[],
        &[
            E::Symlink("up", "../outside"),
            E::File("up/x", b"x", 0o644, 0),
        ],
        "its parent up is a symbolic link",
    );
    // Hard links to outside, or through a symlink.
    refused(
        "hardlink-out",
        &[],
        &[E::Hardlink("x", "../outside/secret")],
        "a path with `..`",
    );
    let o = outside("hardlink-via");
    refused(
        "hardlink-via",
        &[E::Symlink("lnk", &o)],
        &[E::Hardlink("x", "lnk/secret")],
        "its parent lnk is a symbolic link",
    );
    refused(
        "hardlink-missing",
        &[],
        &[E::Hardlink("x", "nothing/here")],
        "not in the tree",
    );
    // A whiteout through a symlink does not remove anything outside either.
    let o = outside("whiteout-via");
    refused(
        "whiteout-via",
        &[E::Symlink("w", &o)],
        &[E::File("w/.wh.victim", b"", 0o644, 0)],
        "its parent w is a symbolic link",
    );
}

#[test]
fn corrupt_truncated_and_odd_inputs_are_clear_errors() {
    let t = TestDir::new("corrupt");
    let layers = two_layers();
    let digests = oci_layout(&t.p("layout"), &layers, true);
    // One byte of the second layer's blob changed.
    let blob = t.p(&format!("layout/blobs/sha256/{}", &digests[1][7..]));
    let mut data = fs::read(&blob).unwrap();
    let mid = data.len() / 2;
    data[mid] ^= 0x55;
    fs::write(&blob, &data).unwrap();
    let src = Source::open(&t.p("layout")).unwrap();
    let e = unpack(&src, &t.p("tree"), UnpackLimits::default()).unwrap_err();
    assert!(matches!(e, Error::BadBlob(_)), "{e}");
    assert!(!t.p("tree").exists());
    // Missing blob.
    fs::remove_file(&blob).unwrap();
    let e = unpack(&src, &t.p("tree"), UnpackLimits::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing"), "{e}");

    // A truncated archive.
    oci_layout(&t.p("layout2"), &layers, false);
    archive_of(&t.p("layout2"), &t.p("full.tar"));
    let full = fs::read(t.p("full.tar")).unwrap();
    fs::write(t.p("cut.tar"), &full[..full.len() * 2 / 3]).unwrap();
    let e = match Source::open(&t.p("cut.tar")) {
        Err(e) => e.to_string(),
        Ok(src) => unpack(&src, &t.p("tree"), UnpackLimits::default())
            .unwrap_err()
            .to_string(),
    };
    assert!(!e.is_empty());
    assert!(!t.p("tree").exists());

    // Not an image at all, garbage, a digest that would name a path.
    fs::create_dir_all(t.p("empty")).unwrap();
    let e = Source::open(&t.p("empty")).err().unwrap().to_string();
    assert!(e.contains("neither an OCI image layout"), "{e}");
    fs::write(t.p("garbage.tar"), vec![0xa5u8; 4096]).unwrap();
    assert!(Source::open(&t.p("garbage.tar")).is_err());
    fs::create_dir_all(t.p("evil")).unwrap();
    fs::write(
        t.p("evil/index.json"),
        r#"{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:../../../../etc/passwd","size":1}]}"#,
    )
    .unwrap();
    let e = Source::open(&t.p("evil")).err().unwrap().to_string();
    assert!(!e.contains("root:"), "{e}");
    assert!(source::sha256_hex_of("sha256:../../etc/passwd").is_none());
    assert!(source::sha256_hex_of(&sha(b"x")).is_some());
}

#[test]
fn an_image_larger_than_allowed_is_refused_while_unpacking() {
    let t = TestDir::new("large");
    let big = vec![7u8; 1 << 20];
    let l = layer(&[
        E::File("big1", &big, 0o644, 0),
        E::File("big2", &big, 0o644, 0),
    ]);
    oci_layout(&t.p("layout"), &[l], true);
    let src = Source::open(&t.p("layout")).unwrap();
    let e = unpack(
        &src,
        &t.p("tree"),
        UnpackLimits {
            max_bytes: 1_500_000,
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::TooLarge {
                limit: 1_500_000,
                ..
            }
        ),
        "{e}"
    );
    assert!(!t.p("tree").exists());
    let r = unpack(&src, &t.p("tree"), UnpackLimits { max_bytes: 3 << 20 }).unwrap();
    assert_eq!(r.entries, 2);
    assert_eq!(fs::read(t.p("tree/big2")).unwrap(), big);
}

/// What a local user could use in the host tree at `root` (links not followed): device
/// nodes, FIFOs, set-id files, xattrs, files not the service's own.
fn host_objects(root: &Path) -> Vec<String> {
    use std::os::unix::fs::FileTypeExt;
    let me = nix::unistd::geteuid().as_raw();
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        // The tree may go while it is walked (a conversion's scratch).
        let Ok(m) = fs::symlink_metadata(&p) else {
            continue;
        };
        let ft = m.file_type();
        let what = if ft.is_block_device() || ft.is_char_device() {
            Some("a device node")
        } else if ft.is_fifo() || ft.is_socket() {
            Some("a FIFO or socket")
        } else if m.mode() & 0o6000 != 0 {
            Some("a set-id file")
        } else if m.uid() != me || m.gid() != me {
            Some("an owner not the service's")
        } else if xattr::list(&p)
            .map(|l| l.into_iter().any(|n| n != "security.selinux"))
            .unwrap_or(false)
        {
            Some("an xattr")
        } else {
            None
        };
        if let Some(w) = what {
            found.push(format!("{}: {w}", p.display()));
        }
        if ft.is_dir() {
            for e in fs::read_dir(&p).into_iter().flatten().flatten() {
                stack.push(e.path());
            }
        }
    }
    found
}

/// `debugfs -R 'stat PATH'` of the ext4 image `raw`.
fn debugfs_stat(raw: &Path, path: &str) -> String {
    let out = std::process::Command::new("debugfs")
        .arg("-R")
        .arg(format!("stat \"{}\"", path.replace('"', "\"\"")))
        .arg(raw)
        .output()
        .expect("debugfs (e2fsprogs)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("Inode:"),
        "{path}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn a_hostile_layer_makes_no_host_object_and_the_image_keeps_it() {
    let t = TestDir::new("hostile");
    let id = fs::read("/usr/bin/id").unwrap();
    // A file capability (v2): cap_net_raw permitted and effective.
    let cap: &[u8] = &[
        1, 0, 0, 2, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    let l = layer(&[
        E::Dir("dev/", 0o755),
        E::Dev("dev/mem", false, 1, 1),
        E::Dev("dev/sda", true, 8, 0),
        E::Fifo("run-fifo"),
        E::File("usr/bin/id", &id, 0o4755, 0),
        E::Hardlink("usr/bin/id-link", "usr/bin/id"),
        E::File("usr/bin/wall", b"wall", 0o2755, 0),
        E::File("usr/bin/we \"ird name", b"w", 0o4711, 1234),
        E::XattrFile("usr/bin/ping", b"ping", "security.capability", cap),
        E::Dir("home/", 0o755),
        E::File("home/key", b"secret", 0o600, 1234),
        E::File("root-file", b"r", 0o640, 0),
    ]);
    oci_layout(&t.p("layout"), &[l], true);
    let src = Source::open(&t.p("layout")).unwrap();

    // The unpacked tree as it is once the last layer is applied.
    unpack(&src, &t.p("tree"), UnpackLimits::default()).unwrap();
    assert_eq!(host_objects(&t.0), Vec::<String>::new());
    assert_eq!(fs::read(t.p("tree/usr/bin/id")).unwrap(), id);
    fs::remove_dir_all(t.p("tree")).unwrap();

    // A conversion, watched while it runs, then what it left.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = {
        let (root, stop) = (t.0.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut found = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                found.extend(host_objects(&root));
            }
            found
        })
    };
    let disk = build_disk(&src, &t.p("scratch"), &t.p("base.cdsk"), None, None);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = watch.join().unwrap();
    disk.unwrap();
    assert_eq!(seen, Vec::<String>::new(), "while converting");
    assert_eq!(host_objects(&t.0), Vec::<String>::new(), "after converting");

    // Inside the image: all of it, as the layer had it.
    let raw = t.p("root.raw");
    disk::ops::flatten(&t.p("base.cdsk"), &raw, disk::ops::FlattenFormat::Raw).unwrap();
    let s = debugfs_stat(&raw, "/dev/mem");
    assert!(s.contains("Type: character special    Mode:  0666"), "{s}");
    assert!(s.contains("Device major/minor number: 01:01"), "{s}");
    let s = debugfs_stat(&raw, "/dev/sda");
    assert!(s.contains("Type: block special    Mode:  0666"), "{s}");
    assert!(s.contains("Device major/minor number: 08:00"), "{s}");
    let s = debugfs_stat(&raw, "/run-fifo");
    assert!(s.contains("Type: FIFO    Mode:  0640"), "{s}");
    let s = debugfs_stat(&raw, "/usr/bin/id");
    assert!(s.contains("Type: regular    Mode:  04755"), "{s}");
    assert!(s.contains("User:     0   Group:     0"), "{s}");
    assert!(s.contains("Links: 2"), "{s}");
    let s = debugfs_stat(&raw, "/usr/bin/wall");
    assert!(s.contains("Mode:  02755"), "{s}");
    let s = debugfs_stat(&raw, "/usr/bin/we \"ird name");
    assert!(s.contains("Mode:  04711"), "{s}");
    assert!(s.contains("User:  1234   Group:  1234"), "{s}");
    let s = debugfs_stat(&raw, "/usr/bin/ping");
    assert!(
        s.contains("security.capability (20) = 01 00 00 02 20 00 00 00"),
        "{s}"
    );
    let s = debugfs_stat(&raw, "/home/key");
    assert!(s.contains("Mode:  0600"), "{s}");
    assert!(s.contains("User:  1234   Group:  1234"), "{s}");
    let s = debugfs_stat(&raw, "/");
    assert!(s.contains("Type: directory    Mode:  0755"), "{s}");
}

#[test]
fn a_name_debugfs_cannot_express_is_refused_not_dropped() {
    let t = TestDir::new("newline");
    let l = layer(&[E::File("usr/bin/new\nline", b"x", 0o4755, 0)]);
    oci_layout(&t.p("layout"), &[l], true);
    let src = Source::open(&t.p("layout")).unwrap();
    let e = build_disk(&src, &t.p("scratch"), &t.p("base.cdsk"), None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("a name with a newline"), "{e}");
    assert!(!t.p("base.cdsk").exists());
    assert!(!t.p("scratch").exists());
}
