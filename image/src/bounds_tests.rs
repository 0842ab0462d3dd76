//! Sizes an image's producer controls, each over its limit: a clear error, nothing held
//! whole in memory.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;

use crate::testing::{config, layer, oci_layout, sha, E};
use crate::{pull, unpack, Error, Source, UnpackLimits};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("clade-image-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A registry on loopback that serves `manifest` for every tag and `blobs` by digest,
/// whatever their descriptors say (it lies as a hostile registry would).
fn fake_registry(manifest: Vec<u8>, blobs: HashMap<String, Vec<u8>>) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let (manifest, blobs) = (manifest.clone(), blobs.clone());
            std::thread::spawn(move || {
                let mut r = BufReader::new(s.try_clone().unwrap());
                let mut first = String::new();
                r.read_line(&mut first).unwrap();
                loop {
                    let mut h = String::new();
                    if r.read_line(&mut h).unwrap() == 0 || h == "\r\n" {
                        break;
                    }
                }
                let path = first.split(' ').nth(1).unwrap_or("").to_string();
                let (ctype, body, digest) = if path.contains("/manifests/") {
                    (
                        "application/vnd.oci.image.manifest.v1+json",
                        manifest.clone(),
                        Some(sha(&manifest)),
                    )
                } else if let Some(d) = path
                    .rsplit("/blobs/")
                    .next()
                    .filter(|_| path.contains("/blobs/"))
                {
                    match blobs.get(d.split('?').next().unwrap()) {
                        Some(b) => ("application/octet-stream", b.clone(), None),
                        None => {
                            let _ = s.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                            return;
                        }
                    }
                } else {
                    ("application/json", b"{}".to_vec(), None)
                };
                let mut head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n",
                    body.len()
                );
                if let Some(d) = digest {
                    head.push_str(&format!("Docker-Content-Digest: {d}\r\n"));
                }
                head.push_str("\r\n");
                let _ = s.write_all(head.as_bytes());
                let _ = s.write_all(&body);
            });
        }
    });
    addr
}

/// A manifest of `layers` (digest, declared size) over config `cfg`.
fn manifest_of(cfg: &[u8], layers: &[(String, u64)], pad: usize) -> Vec<u8> {
    let layers: Vec<_> = layers
        .iter()
        .map(|(d, n)| {
            serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                               "digest": d, "size": n})
        })
        .collect();
    serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha(cfg), "size": cfg.len()},
        "layers": layers,
        "annotations": {"pad": "p".repeat(pad)},
    })
    .to_string()
    .into_bytes()
}

#[test]
fn a_blob_larger_than_its_descriptor_is_refused_while_it_streams() {
    let d = tmp("pull-blob");
    // A 6 MiB layer the manifest says is 1000 bytes: its digest is right, its size is not.
    let big = vec![7u8; 6 << 20];
    let cfg = config(&[sha(&big)]);
    let m = manifest_of(&cfg, &[(sha(&big), 1000)], 0);
    let blobs = HashMap::from([(sha(&cfg), cfg.clone()), (sha(&big), big.clone())]);
    let addr = fake_registry(m, blobs);
    let e = pull(&format!("{addr}/hostile/img:1"), &d.join("cache"), None).unwrap_err();
    match &e {
        Error::OverLimit { what, limit, .. } => {
            assert!(what.contains(&sha(&big)), "{e}");
            assert_eq!(*limit, 1000, "{e}");
        }
        _ => panic!("not an over-limit error: {e}"),
    }
    // Nothing of it kept, under its name or a temporary one.
    let left: Vec<_> = std::fs::read_dir(d.join("cache/blobs/sha256"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().contains(&sha(&big)[7..]))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_manifest_over_its_limit_is_refused() {
    let d = tmp("pull-manifest");
    let l = layer(&[E::File("f", b"x", 0o644, 0)]);
    let cfg = config(&[sha(&l)]);
    // A valid manifest, padded past 4 MiB with an annotation.
    let m = manifest_of(&cfg, &[(sha(&l), l.len() as u64)], 5 << 20);
    let blobs = HashMap::from([(sha(&cfg), cfg.clone()), (sha(&l), l.clone())]);
    let addr = fake_registry(m, blobs);
    let e = pull(&format!("{addr}/hostile/img:1"), &d.join("cache"), None).unwrap_err();
    assert!(
        matches!(&e, Error::OverLimit { limit, .. } if *limit == crate::MAX_MANIFEST),
        "{e}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// A header claiming a file of 33 GiB (its data never comes): refused by the default
/// limit when its header is read, before anything is written.
#[test]
fn the_default_unpack_limit_refuses_a_huge_tree() {
    let d = tmp("unpack-default");
    let mut h = tar::Header::new_gnu();
    h.set_path("huge").unwrap();
    h.set_size(33 << 30);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_cksum();
    let mut l = h.as_bytes().to_vec();
    l.extend_from_slice(&[0u8; 4096]);
    oci_layout(&d.join("img"), &[l], true);
    let src = Source::open(&d.join("img")).unwrap();
    let e = unpack(&src, &d.join("tree"), UnpackLimits::default()).unwrap_err();
    assert!(
        matches!(e, Error::TooLarge { limit, .. } if limit == UnpackLimits::DEFAULT_MAX_BYTES),
        "{e}"
    );
    assert!(!d.join("tree").exists());
    std::fs::remove_dir_all(&d).unwrap();
}

/// A layer whose PAX header claims 1.5 GiB: the unpack refuses it at its header.
#[test]
fn an_unpack_refuses_a_huge_pax_header() {
    let d = tmp("unpack-pax");
    let mut h = tar::Header::new_ustar();
    h.set_path("PaxHeader").unwrap();
    h.set_entry_type(tar::EntryType::XHeader);
    h.set_size(3 << 29);
    h.set_cksum();
    let mut l = h.as_bytes().to_vec();
    l.extend_from_slice(&[b'a'; 8192]);
    oci_layout(&d.join("img"), &[l], true);
    let src = Source::open(&d.join("img")).unwrap();
    let e = unpack(&src, &d.join("tree"), UnpackLimits::default()).unwrap_err();
    assert!(
        e.to_string().contains(
            "a PAX extended header of 1610612736 bytes: more than the 1048576 bytes allowed"
        ),
        "{e}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}
