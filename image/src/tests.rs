//! Images built here by hand (tar layers, blobs named by digest, index, manifest,
//! config), in each of the three forms, unpacked and checked file by file.

use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use super::*;

/// One entry of a test layer.
enum E<'a> {
    Dir(&'a str, u32),
    File(&'a str, &'a [u8], u32, u32),
    XattrFile(&'a str, &'a [u8], &'a str, &'a [u8]),
    Symlink(&'a str, &'a str),
    Hardlink(&'a str, &'a str),
    Fifo(&'a str),
}

fn header(path: &str, kind: tar::EntryType, size: u64, mode: u32, uid: u32) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    // Written raw: the tests need names a well-behaved builder refuses (`..`).
    let name = &mut h.as_old_mut().name;
    name.fill(0);
    name[..path.len()].copy_from_slice(path.as_bytes());
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(mode);
    h.set_uid(uid.into());
    h.set_gid(uid.into());
    h.set_mtime(1_700_000_000);
    h.set_cksum();
    h
}

/// A PAX extended header with one record.
fn pax(b: &mut tar::Builder<Vec<u8>>, key: &str, value: &[u8]) {
    let body_len = key.len() + value.len() + 3; // ' ', '=', '\n'
    let mut len = body_len + 1;
    while len != body_len + len.to_string().len() {
        len = body_len + len.to_string().len();
    }
    let mut rec = format!("{len} {key}=").into_bytes();
    rec.extend_from_slice(value);
    rec.push(b'\n');
    let h = header(
        "././@PaxHeader",
        tar::EntryType::XHeader,
        rec.len() as u64,
        0o644,
        0,
    );
    b.append(&h, &rec[..]).unwrap();
}

fn layer(entries: &[E]) -> Vec<u8> {
    use tar::EntryType as T;
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        match *e {
            E::Dir(p, mode) => b.append(&header(p, T::Directory, 0, mode, 0), &[][..]),
            E::File(p, data, mode, uid) => {
                b.append(&header(p, T::Regular, data.len() as u64, mode, uid), data)
            }
            E::XattrFile(p, data, name, value) => {
                pax(&mut b, &format!("SCHILY.xattr.{name}"), value);
                b.append(&header(p, T::Regular, data.len() as u64, 0o644, 0), data)
            }
            E::Symlink(p, target) => {
                let mut h = header(p, T::Symlink, 0, 0o777, 0);
                h.set_link_name_literal(target).unwrap();
                h.set_cksum();
                b.append(&h, &[][..])
            }
            E::Hardlink(p, target) => {
                let mut h = header(p, T::Link, 0, 0o644, 0);
                h.set_link_name_literal(target).unwrap();
                h.set_cksum();
                b.append(&h, &[][..])
            }
            E::Fifo(p) => b.append(&header(p, T::Fifo, 0, 0o640, 0), &[][..]),
        }
        .unwrap();
    }
    b.into_inner().unwrap()
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn sha(data: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(data))
}

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

fn config(diff_ids: &[String]) -> Vec<u8> {
    serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/bin:/bin", "GREETING=a=b"],
            "WorkingDir": "/srv",
            "User": "1000:1000",
            "Entrypoint": ["/bin/app"],
            "Cmd": ["--serve"]
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids}
    })
    .to_string()
    .into_bytes()
}

/// Writes an OCI layout of `layers` (gzip when `gz`) into `dir`; returns the layer blobs'
/// digests.
fn oci_layout(dir: &Path, layers: &[Vec<u8>], gz: bool) -> Vec<String> {
    let blobs = dir.join("blobs/sha256");
    fs::create_dir_all(&blobs).unwrap();
    let put = |data: &[u8]| {
        let d = sha(data);
        fs::write(blobs.join(&d[7..]), data).unwrap();
        d
    };
    let diff_ids: Vec<String> = layers.iter().map(|l| sha(l)).collect();
    let mut descs = Vec::new();
    let mut digests = Vec::new();
    for l in layers {
        let stored = if gz { gzip(l) } else { l.clone() };
        let d = put(&stored);
        digests.push(d.clone());
        descs.push(serde_json::json!({
            "mediaType": if gz { "application/vnd.oci.image.layer.v1.tar+gzip" } else { "application/vnd.oci.image.layer.v1.tar" },
            "digest": d, "size": stored.len()
        }));
    }
    let cfg = config(&diff_ids);
    let cfg_d = put(&cfg);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_d, "size": cfg.len()},
        "layers": descs
    })
    .to_string();
    let m_d = put(manifest.as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": m_d, "size": manifest.len(),
                       "platform": {"architecture": "amd64", "os": "linux"}}]
    });
    fs::write(dir.join("index.json"), index.to_string()).unwrap();
    fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    digests
}

/// A tar of every file under `dir` (paths relative to it).
fn archive_of(dir: &Path, out: &Path) {
    let mut b = tar::Builder::new(fs::File::create(out).unwrap());
    b.append_dir_all(".", dir).unwrap();
    b.finish().unwrap();
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
