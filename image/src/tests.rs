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

fn check_tree(root: &Path) {
    let read = |p: &str| fs::read(root.join(p)).unwrap();
    let meta = |p: &str| fs::symlink_metadata(root.join(p)).unwrap();
    assert_eq!(read("etc/hostname"), b"top\n");
    assert_eq!(meta("etc/hostname").mode() & 0o7777, 0o600);
    assert!(!root.join("etc/gone").exists(), "whiteout not applied");
    assert!(!root.join("etc/.wh.gone").exists());
    // Opaque: the lower layer's file went, this layer's stayed (it came first).
    assert!(!root.join("var/cache/old").exists());
    assert_eq!(read("var/cache/new"), b"new");
    assert!(!root.join("var/cache/.wh..wh..opq").exists());
    let rc = meta("home/user/.bashrc");
    assert_eq!(
        (rc.uid(), rc.gid(), rc.mode() & 0o7777),
        (1000, 1000, 0o640)
    );
    assert_eq!(meta("home/user").mode() & 0o7777, 0o750);
    assert_eq!(
        meta("usr/bin/su").mode() & 0o7777,
        0o4755,
        "set-uid bit lost"
    );
    // The hard link across layers shares the lower layer's inode.
    assert_eq!(meta("usr/bin/tool").ino(), meta("usr/bin/tool-link").ino());
    assert_eq!(meta("usr/bin/tool").nlink(), 2);
    assert_eq!(
        fs::read_link(root.join("etc/localtime")).unwrap(),
        Path::new("/usr/share/zoneinfo/UTC")
    );
    assert!(meta("run-fifo").file_type().is_fifo_like());
    match xattr::get(root.join("etc/labelled"), "user.clade") {
        Ok(v) => assert_eq!(v.as_deref(), Some(&b"yes"[..])),
        Err(e) => panic!("xattr: {e}"),
    }
    assert_eq!(meta("etc/hostname").mtime(), 1_700_000_000);
    // Written into after its entry, in the same layer: its time is set last.
    assert_eq!(
        meta("home/user").mtime(),
        1_700_000_000,
        "directory times set last"
    );
}

trait FifoLike {
    fn is_fifo_like(&self) -> bool;
}

impl FifoLike for fs::FileType {
    fn is_fifo_like(&self) -> bool {
        use std::os::unix::fs::FileTypeExt;
        self.is_fifo()
    }
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
    check_tree(&t.p("tree1"));

    // The same layout as an OCI archive, uncompressed layers this time.
    oci_layout(&t.p("layout-raw"), &layers, false);
    archive_of(&t.p("layout-raw"), &t.p("oci.tar"));
    let src = Source::open(&t.p("oci.tar")).unwrap();
    unpack(&src, &t.p("tree2"), UnpackLimits::default()).unwrap();
    check_tree(&t.p("tree2"));

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
    unpack(&src, &t.p("tree3"), UnpackLimits::default()).unwrap();
    check_tree(&t.p("tree3"));
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
