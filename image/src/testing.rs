//! Images built by hand for tests (here and in the CLI's tests): tar layers with any
//! entry (names a well-behaved builder refuses included), blobs named by digest, an OCI
//! layout's index, manifest and config, and archives of a directory.

use std::fs;
use std::io::Write;
use std::path::Path;

use sha2::{Digest as _, Sha256};

/// One entry of a test layer.
pub enum E<'a> {
    Dir(&'a str, u32),
    File(&'a str, &'a [u8], u32, u32),
    XattrFile(&'a str, &'a [u8], &'a str, &'a [u8]),
    Symlink(&'a str, &'a str),
    Hardlink(&'a str, &'a str),
    Fifo(&'a str),
    /// A block (`true`) or character device node: path, major, minor.
    Dev(&'a str, bool, u32, u32),
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

pub fn layer(entries: &[E]) -> Vec<u8> {
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
            E::Dev(p, block, major, minor) => {
                let kind = if block { T::Block } else { T::Char };
                let mut h = header(p, kind, 0, 0o666, 0);
                h.set_device_major(major).unwrap();
                h.set_device_minor(minor).unwrap();
                h.set_cksum();
                b.append(&h, &[][..])
            }
        }
        .unwrap();
    }
    b.into_inner().unwrap()
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

pub fn sha(data: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(data))
}

pub fn config(diff_ids: &[String]) -> Vec<u8> {
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
pub fn oci_layout(dir: &Path, layers: &[Vec<u8>], gz: bool) -> Vec<String> {
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
pub fn archive_of(dir: &Path, out: &Path) {
    let mut b = tar::Builder::new(fs::File::create(out).unwrap());
    b.append_dir_all(".", dir).unwrap();
    b.finish().unwrap();
}

/// Pushes an image of `layers` (gzipped here) with [`config`] to `reference` on a
/// loopback registry.
pub fn push(reference: &str, layers: &[Vec<u8>]) {
    use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
    let r = oci_client::Reference::try_from(reference).unwrap();
    let client = oci_client::Client::new(ClientConfig {
        protocol: ClientProtocol::HttpsExcept(vec![r.resolve_registry().to_string()]),
        ..Default::default()
    });
    let diff_ids: Vec<String> = layers.iter().map(|l| sha(l)).collect();
    let blobs: Vec<ImageLayer> = layers
        .iter()
        .map(|l| {
            ImageLayer::new(
                gzip(l),
                oci_client::manifest::IMAGE_LAYER_GZIP_MEDIA_TYPE.into(),
                None,
            )
        })
        .collect();
    let cfg = Config::new(
        config(&diff_ids),
        oci_client::manifest::IMAGE_CONFIG_MEDIA_TYPE.into(),
        None,
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(client.push(
        &r,
        &blobs,
        cfg,
        &oci_client::secrets::RegistryAuth::Anonymous,
        None,
    ))
    .unwrap();
}

/// Debian's `docker-registry` (the CNCF distribution registry) serving on loopback from a
/// directory of its own; stopped when dropped.
pub struct Registry {
    child: std::process::Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
}

impl Registry {
    /// Starts it with its storage and config under `dir`.
    pub fn start(dir: &Path) -> Registry {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let addr = format!("127.0.0.1:{port}");
        fs::create_dir_all(dir.join("storage")).unwrap();
        let cfg = dir.join("config.yml");
        fs::write(
            &cfg,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
                dir.join("storage").display()
            ),
        )
        .unwrap();
        let child = std::process::Command::new("docker-registry")
            .arg("serve")
            .arg(&cfg)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("docker-registry (Debian package docker-registry)");
        let t = std::time::Instant::now();
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(t.elapsed().as_secs() < 20, "the registry did not start");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Registry { child, addr }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
