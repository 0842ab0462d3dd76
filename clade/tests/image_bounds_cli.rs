//! A hostile image converted by `clade template build --image`: the converting process's
//! memory stays bounded. Alone in its test binary so that the peak resident size of this
//! process's children (`getrusage(RUSAGE_CHILDREN)`) is the `clade` run's.

#[allow(dead_code)]
mod common;

use std::io::Write;
use std::process::Command;

use clade_image::testing::sha;
use common::Dir;
use flate2::{Compress, Compression, FlushCompress};

/// `data` deflated on its own (a full flush: it refers to nothing before it), as a piece
/// of a raw deflate stream that can be repeated.
fn deflate_piece(data: &[u8]) -> Vec<u8> {
    let mut c = Compress::new(Compression::fast(), false);
    let mut out = Vec::with_capacity(data.len() + 1024);
    c.compress_vec(data, &mut out, FlushCompress::Full).unwrap();
    assert_eq!(c.total_in(), data.len() as u64);
    out
}

/// A gzip layer whose tar holds one PAX extended header of `pax` bytes (then the end of
/// the archive), generated as it is written: its 1 MiB of body deflated once and that
/// piece repeated, so neither the tar nor the gzip stream is ever whole in memory or on
/// disk (the stored blob is about 5 KiB per MiB: 7 MB for 1.5 GiB).
fn hostile_layer(out: &mut impl Write, pax: u64) {
    const MIB: u64 = 1 << 20;
    assert_eq!(pax % MIB, 0);
    let mut h = tar::Header::new_ustar();
    h.set_path("././@PaxHeader").unwrap();
    h.set_entry_type(tar::EntryType::XHeader);
    h.set_size(pax);
    h.set_mode(0o644);
    h.set_cksum();
    let body = vec![b'a'; MIB as usize];
    let end = [0u8; 1024];
    let (ph, pb, pe) = (
        deflate_piece(h.as_bytes()),
        deflate_piece(&body),
        deflate_piece(&end),
    );
    let crc_of = |d: &[u8]| {
        let mut c = crc32fast::Hasher::new();
        c.update(d);
        c
    };
    let mut crc = crc_of(h.as_bytes());
    let cb = crc_of(&body);
    // gzip header: deflate, no name, no time, Unix.
    out.write_all(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3])
        .unwrap();
    out.write_all(&ph).unwrap();
    for _ in 0..pax / MIB {
        out.write_all(&pb).unwrap();
        crc.combine(&cb);
    }
    out.write_all(&pe).unwrap();
    crc.combine(&crc_of(&end));
    // The last block: final, fixed Huffman, end of block at once.
    out.write_all(&[0x03, 0x00]).unwrap();
    out.write_all(&crc.finalize().to_le_bytes()).unwrap();
    let len = 512 + pax + 1024;
    out.write_all(&(len as u32).to_le_bytes()).unwrap();
}

#[test]
fn a_layer_with_a_huge_pax_header_converts_in_bounded_memory() {
    let d = Dir::new("image-bounds");
    let layout = d.p("hostile");
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    // 1.5 GiB of PAX header in a layer of about 7 MB.
    const PAX: u64 = 3 << 29;
    let mut stored = Vec::new();
    hostile_layer(&mut stored, PAX);
    assert!(stored.len() < 16 << 20, "{} bytes stored", stored.len());
    // The stream is what it claims: it inflates (the first 64 MiB checked here).
    {
        let mut r = flate2::read::GzDecoder::new(&stored[..]);
        let mut buf = vec![0u8; 64 << 20];
        std::io::Read::read_exact(&mut r, &mut buf).unwrap();
        assert_eq!(&buf[257..262], b"ustar");
        assert!(buf[512..].iter().all(|&b| b == b'a'));
    }
    let put = |data: &[u8]| {
        let dg = sha(data);
        std::fs::write(blobs.join(&dg[7..]), data).unwrap();
        dg
    };
    let layer = put(&stored);
    // Its diff_id is never reached: the layer's entries are read before any digest of
    // it is checked, which is what the attack relies on.
    let diff_id = sha(b"not reached");
    let cfg = clade_image::testing::config(&[diff_id]);
    let cfg_d = put(&cfg);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_d, "size": cfg.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer, "size": stored.len()}]
    })
    .to_string();
    let m_d = put(manifest.as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": m_d, "size": manifest.len()}]
    });
    std::fs::write(layout.join("index.json"), index.to_string()).unwrap();
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    drop(stored);
    // The conversion fails before a VM would boot: the kernel is never read.
    let kernel = d.p("kernel");
    std::fs::write(&kernel, b"").unwrap();

    let t = std::time::Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_clade"))
        .args([
            "template",
            "build",
            "hostile",
            "--test-device",
            "--mem",
            "64",
        ])
        .arg("--kernel")
        .arg(&kernel)
        .arg("--image")
        .arg(&layout)
        .arg("--state-dir")
        .arg(d.p("state"))
        .output()
        .unwrap();
    let peak_kib = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
        .unwrap()
        .max_rss();
    let err = String::from_utf8_lossy(&o.stderr);
    eprintln!(
        "clade: peak {} MiB in {:.1}s: {err}",
        peak_kib >> 10,
        t.elapsed().as_secs_f64()
    );
    assert!(
        peak_kib < 200 << 10,
        "the conversion's peak resident size was {} MiB",
        peak_kib >> 10
    );
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains(
            "a PAX extended header of 1610612736 bytes: more than the 1048576 bytes allowed"
        ),
        "{err}"
    );
}
