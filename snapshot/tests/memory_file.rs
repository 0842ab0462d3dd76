mod common;

use std::os::fd::AsFd;
use std::path::Path;
use std::time::Instant;

use common::{allocated_bytes, make_image, Mapping, Rng, PAGE};
use snapshot::memory_file::{
    self, GuestRegion, HoleFill, MemoryChain, MemoryFile, PageLocation, RegionData,
};
use snapshot::state_file::{self, SnapshotMeta};
use snapshot::{Error, SnapshotId, SnapshotKind};
use vmm_sys_util::tempdir::TempDir;

fn tmp() -> TempDir {
    TempDir::new_with_prefix("/tmp/clade-snap-mem").unwrap()
}

/// Two regions like an x86 VM with a PCI hole: [0, 3 MiB) and [4 GiB, 4 GiB + 1 MiB).
fn two_regions(img: &[u8]) -> Vec<GuestRegion<'_>> {
    let split = 3 << 20;
    vec![
        GuestRegion {
            guest_addr: 0,
            data: RegionData::Slice(&img[..split]),
        },
        GuestRegion {
            guest_addr: 4 << 30,
            data: RegionData::Slice(&img[split..]),
        },
    ]
}

#[test]
fn full_file_roundtrip_is_sparse() {
    let dir = tmp();
    let path = dir.as_path().join("mem");
    let img = make_image(1024, 1); // 4 MiB
    let id = SnapshotId::random();
    let (h, stats) = memory_file::write_full(&path, id, &two_regions(&img)).unwrap();
    let nonzero = img
        .chunks(PAGE)
        .filter(|p| p.iter().any(|&b| b != 0))
        .count() as u64;
    assert_eq!(stats.pages_scanned, 1024);
    assert_eq!(stats.pages_written, nonzero);
    assert_eq!(h.mem_size, img.len() as u64);
    assert_eq!(h.regions.len(), 2);
    assert_eq!(h.regions[1].guest_addr, 4 << 30);
    assert_eq!(h.regions[1].offset, 3 << 20);
    assert_eq!(h.data_offset % PAGE as u64, 0);

    // Zero pages are holes.
    let on_disk = allocated_bytes(&path);
    assert!(
        on_disk <= (nonzero + 1) * PAGE as u64 + 64 * 1024,
        "{on_disk} bytes allocated for {nonzero} non-zero pages"
    );

    let f = MemoryFile::open(&path).unwrap();
    assert_eq!(f.header(), &h);
    assert!(f.present_pages().is_none());
    let mut dst = Mapping::anon(img.len());
    f.read_into(dst.as_mut_slice(), HoleFill::AssumeZeroed)
        .unwrap();
    assert!(dst.as_slice() == &img[..]);

    // HoleFill::Zero over garbage.
    let mut garbage = vec![0x77u8; img.len()];
    f.read_into(&mut garbage, HoleFill::Zero).unwrap();
    assert!(garbage == img);

    // Wrong destination size: clear error, destination untouched.
    let mut small = vec![0x55u8; img.len() - PAGE];
    assert!(matches!(
        f.read_into(&mut small, HoleFill::Zero),
        Err(Error::GeometryMismatch(_))
    ));
    assert!(small.iter().all(|&b| b == 0x55));
}

#[test]
fn memfd_source_matches_slice_source() {
    let dir = tmp();
    let img = make_image(512, 2);
    let mut guest = Mapping::memfd(img.len(), libc::MAP_SHARED);
    // Leave some pages of the memfd never written (holes in the memfd).
    for (i, page) in img.chunks(PAGE).enumerate() {
        if page.iter().any(|&b| b != 0) {
            guest.as_mut_slice()[i * PAGE..(i + 1) * PAGE].copy_from_slice(page);
        }
    }
    let fd = guest.memfd_fd().unwrap().as_fd();
    let regions = [GuestRegion {
        guest_addr: 0x10_0000,
        data: RegionData::Fd {
            fd,
            offset: 0,
            len: img.len() as u64,
        },
    }];
    let a = dir.as_path().join("from-fd");
    let b = dir.as_path().join("from-slice");
    let id = SnapshotId::random();
    let (_, sa) = memory_file::write_full(&a, id, &regions).unwrap();
    let slice_regions = [GuestRegion {
        guest_addr: 0x10_0000,
        data: RegionData::Slice(&img),
    }];
    let (_, sb) = memory_file::write_full(&b, id, &slice_regions).unwrap();
    assert_eq!(sa.pages_written, sb.pages_written);
    assert!(sa.pages_scanned <= sb.pages_scanned);
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
}

fn dirty_bitmap(pages: usize, dirty: &[usize]) -> Vec<u64> {
    let mut words = vec![0u64; pages.div_ceil(64)];
    for &p in dirty {
        words[p / 64] |= 1 << (p % 64);
    }
    words
}

/// Base image, then a modified image and the pages that changed (some became zero).
fn base_and_next(pages: usize, seed: u64) -> (Vec<u8>, Vec<u8>, Vec<usize>) {
    let base = make_image(pages, seed);
    let mut next = base.clone();
    let mut rng = Rng::new(seed + 100);
    let mut dirty = Vec::new();
    for p in 0..pages {
        if rng.below(8) == 0 {
            let page = &mut next[p * PAGE..(p + 1) * PAGE];
            if rng.below(3) == 0 {
                page.fill(0);
            } else {
                rng.fill(page);
            }
            dirty.push(p);
        }
    }
    (base, next, dirty)
}

fn write_chain(dir: &Path, pages: usize) -> (Vec<u8>, [SnapshotId; 2], [std::path::PathBuf; 2]) {
    let (base, next, dirty) = base_and_next(pages, 3);
    let ids = [SnapshotId::random(), SnapshotId::random()];
    let paths = [dir.join("base.mem"), dir.join("diff.mem")];
    let regions = [GuestRegion {
        guest_addr: 0,
        data: RegionData::Slice(&base),
    }];
    memory_file::write_full(&paths[0], ids[0], &regions).unwrap();
    let regions = [GuestRegion {
        guest_addr: 0,
        data: RegionData::Slice(&next),
    }];
    let bm = dirty_bitmap(pages, &dirty);
    let (h, stats) = memory_file::write_diff(&paths[1], ids[1], ids[0], &regions, &[&bm]).unwrap();
    assert_eq!(h.kind, SnapshotKind::Diff);
    assert_eq!(h.base, Some(ids[0]));
    assert_eq!(stats.pages_scanned, dirty.len() as u64);
    assert!(
        stats.pages_written < dirty.len() as u64,
        "zeroed dirty pages stay holes"
    );
    (next, ids, paths)
}

#[test]
fn diff_restores_on_top_of_base() {
    let dir = tmp();
    let pages = 640;
    let (next, ids, paths) = write_chain(dir.as_path(), pages);
    let diff = MemoryFile::open(&paths[1]).unwrap();
    let present = diff.present_pages().unwrap();
    assert!(present.count_ones() > 0 && present.count_ones() < pages as u64);

    let chain = MemoryChain::open(&[&paths[0], &paths[1]]).unwrap();
    assert_eq!(chain.top().header().id, ids[1]);
    let mut dst = vec![0u8; next.len()];
    chain
        .restore_into(&mut dst, HoleFill::AssumeZeroed)
        .unwrap();
    assert!(dst == next);

    // Page by page through the chain (the page server's path) gives the same bytes.
    let mut buf = vec![0u8; PAGE * pages];
    chain.read_pages(0, &mut buf).unwrap();
    assert!(buf == next);
    for p in 0..pages as u64 {
        let zero = next[p as usize * PAGE..(p as usize + 1) * PAGE]
            .iter()
            .all(|&b| b == 0);
        if let PageLocation::Zero = chain.locate(p) {
            assert!(zero, "page {p} located as zero but has data");
        }
    }
    assert!(chain.read_pages(pages as u64, &mut buf[..PAGE]).is_err());

    // Matching state headers pass; others are refused.
    let meta = SnapshotMeta::diff(ids[1], ids[0], next.len() as u64);
    let state = state_file::parse_header(&state_file::encode(&meta, &()).unwrap()).unwrap();
    chain.check_state(&state).unwrap();
    let other = SnapshotMeta::diff(SnapshotId::random(), ids[0], next.len() as u64);
    let other = state_file::parse_header(&state_file::encode(&other, &()).unwrap()).unwrap();
    assert!(matches!(
        chain.check_state(&other),
        Err(Error::IdMismatch { .. })
    ));
    let bigger = SnapshotMeta::diff(ids[1], ids[0], next.len() as u64 + 4096);
    let bigger = state_file::parse_header(&state_file::encode(&bigger, &()).unwrap()).unwrap();
    assert!(matches!(
        chain.check_state(&bigger),
        Err(Error::GeometryMismatch(_))
    ));
}

#[test]
fn broken_chains_are_refused() {
    let dir = tmp();
    let (_, _, paths) = write_chain(dir.as_path(), 128);
    // Diff without its base.
    assert!(matches!(
        MemoryChain::open(&[&paths[1]]),
        Err(Error::MissingBase { .. })
    ));
    // Diff on top of another full snapshot.
    let other = dir.as_path().join("other.mem");
    let img = make_image(128, 9);
    memory_file::write_full(
        &other,
        SnapshotId::random(),
        &[GuestRegion {
            guest_addr: 0,
            data: RegionData::Slice(&img),
        }],
    )
    .unwrap();
    assert!(matches!(
        MemoryChain::open(&[&other, &paths[1]]),
        Err(Error::BaseMismatch { .. })
    ));
    // Two full files.
    assert!(matches!(
        MemoryChain::open(&[&paths[0], &other]),
        Err(Error::InvalidInput(_))
    ));
    // Same id chain but another geometry.
    let base = MemoryFile::open(&paths[0]).unwrap();
    let small = dir.as_path().join("small.mem");
    let small_img = make_image(64, 4);
    let bm = dirty_bitmap(64, &[1, 2]);
    memory_file::write_diff(
        &small,
        SnapshotId::random(),
        base.header().id,
        &[GuestRegion {
            guest_addr: 0,
            data: RegionData::Slice(&small_img),
        }],
        &[&bm],
    )
    .unwrap();
    assert!(matches!(
        MemoryChain::open(&[&paths[0], &small]),
        Err(Error::GeometryMismatch(_))
    ));
}

#[test]
fn corrupted_memory_files_give_one_clear_error_each() {
    let dir = tmp();
    let (_, _, paths) = write_chain(dir.as_path(), 256);
    let good = std::fs::read(&paths[1]).unwrap();
    let p = dir.as_path().join("bad.mem");
    let check = |bytes: &[u8], what: &str, ok: fn(&Error) -> bool| {
        std::fs::write(&p, bytes).unwrap();
        match MemoryFile::open(&p) {
            Err(e) => assert!(ok(&e), "{what}: unexpected error {e}"),
            Ok(_) => panic!("{what}: accepted"),
        }
    };
    let mut b = good.clone();
    b[0] = b'x';
    check(&b, "magic", |e| matches!(e, Error::NotASnapshot { .. }));
    let mut b = good.clone();
    b[8] = 9;
    check(&b, "version", |e| {
        matches!(e, Error::UnsupportedVersion { found: 9, .. })
    });
    let mut b = good.clone();
    b[50] ^= 1; // mem_size
    check(&b, "header bit flip", |e| {
        matches!(
            e,
            Error::ChecksumMismatch {
                section: "header",
                ..
            }
        )
    });
    let mut b = good.clone();
    b[128 + 24 + 3] ^= 0x10; // bitmap word
    check(&b, "bitmap bit flip", |e| {
        matches!(e, Error::ChecksumMismatch { .. })
    });
    check(&good[..good.len() - PAGE], "short image", |e| {
        matches!(e, Error::Truncated { .. })
    });
    check(&good[..60], "short header", |e| {
        matches!(e, Error::Truncated { .. })
    });
    let mut b = good.clone();
    b.extend_from_slice(&[0u8; PAGE]);
    check(&b, "long image", |e| matches!(e, Error::Corrupt { .. }));
    // The originals are untouched by all this.
    assert_eq!(std::fs::read(&paths[1]).unwrap(), good);
    MemoryChain::open(&[&paths[0], &paths[1]]).unwrap();
}

#[test]
fn bad_write_arguments_leave_existing_file_untouched() {
    let dir = tmp();
    let (_, ids, paths) = write_chain(dir.as_path(), 128);
    let before = std::fs::read(&paths[1]).unwrap();
    let img = make_image(128, 5);
    let regions = [GuestRegion {
        guest_addr: 0,
        data: RegionData::Slice(&img),
    }];
    let short = [0u64; 1]; // 128 pages need 2 words
    assert!(matches!(
        memory_file::write_diff(&paths[1], SnapshotId::random(), ids[0], &regions, &[&short]),
        Err(Error::InvalidInput(_))
    ));
    let unaligned = [GuestRegion {
        guest_addr: 0x800,
        data: RegionData::Slice(&img),
    }];
    assert!(matches!(
        memory_file::write_full(&paths[1], SnapshotId::random(), &unaligned),
        Err(Error::InvalidInput(_))
    ));
    let overlapping = [
        GuestRegion {
            guest_addr: 0,
            data: RegionData::Slice(&img),
        },
        GuestRegion {
            guest_addr: PAGE as u64,
            data: RegionData::Slice(&img),
        },
    ];
    assert!(matches!(
        memory_file::write_full(&paths[1], SnapshotId::random(), &overlapping),
        Err(Error::InvalidInput(_))
    ));
    assert_eq!(std::fs::read(&paths[1]).unwrap(), before);
    assert_eq!(std::fs::read_dir(dir.as_path()).unwrap().count(), 2);
}

#[test]
fn mostly_empty_4gib_image_is_fast() {
    let dir = tmp();
    let path = dir.as_path().join("big.mem");
    let size: usize = 4 << 30;
    // Guest memory: a 4 GiB memfd with 256 pages written here and there.
    let guest = Mapping::memfd(size, libc::MAP_SHARED);
    let mut rng = Rng::new(7);
    let mut touched = Vec::new();
    for _ in 0..256 {
        let p = rng.below((size / PAGE) as u64) as usize;
        guest.write_byte(p * PAGE + 100, 0x5a);
        touched.push(p);
    }
    let fd = guest.memfd_fd().unwrap().as_fd();
    let t = Instant::now();
    let (_, stats) = memory_file::write_full(
        &path,
        SnapshotId::random(),
        &[GuestRegion {
            guest_addr: 0,
            data: RegionData::Fd {
                fd,
                offset: 0,
                len: size as u64,
            },
        }],
    )
    .unwrap();
    let write_time = t.elapsed();
    touched.sort_unstable();
    touched.dedup();
    assert_eq!(stats.pages_written, touched.len() as u64);
    assert!(allocated_bytes(&path) < 8 << 20);

    let t = Instant::now();
    let f = MemoryFile::open(&path).unwrap();
    let mut dst = Mapping::anon(size);
    let read = f
        .read_into(dst.as_mut_slice(), HoleFill::AssumeZeroed)
        .unwrap();
    let read_time = t.elapsed();
    assert!(read < 8 << 20, "read {read} bytes");
    for &p in &touched {
        assert_eq!(dst.read_page(p)[100], 0x5a);
    }
    // Only the data pages were touched in the destination.
    assert!(dst.resident_pages() <= touched.len() * 2);
    eprintln!("4 GiB sparse image: write {write_time:?}, open+read {read_time:?}");
    assert!(
        write_time.as_secs() < 10 && read_time.as_secs() < 10,
        "write {write_time:?}, read {read_time:?}"
    );
}

#[test]
fn a_pending_file_is_invisible_until_committed_and_removed_if_dropped() {
    let dir = tmp();
    let path = dir.as_path().join("vm.mem");
    let img = make_image(1024, 7);
    let id = SnapshotId::random();
    let pending = memory_file::write_full_pending(&path, id, &two_regions(&img)).unwrap();
    assert!(!path.exists(), "not visible before commit");
    assert_eq!(pending.header().id, id);
    assert!(pending.stats().pages_written > 0);
    let (header, _) = pending.commit().unwrap();
    assert_eq!(header.id, id);
    assert_eq!(MemoryFile::open(&path).unwrap().header().id, id);

    // Dropped without commit: the old file stays, no temporary file is left.
    let other = SnapshotId::random();
    drop(memory_file::write_full_pending(&path, other, &two_regions(&img)).unwrap());
    assert_eq!(MemoryFile::open(&path).unwrap().header().id, id);
    assert_eq!(std::fs::read_dir(dir.as_path()).unwrap().count(), 1);
}

#[test]
fn a_pending_full_file_takes_a_later_layer_over_its_base() {
    let dir = tmp();
    let path = dir.as_path().join("vm.mem");
    let base = make_image(1024, 3);
    // The later image: pages 5..9 rewritten (one of them with zeros), page 1000 too.
    let mut later = base.clone();
    let mut layer_runs = Vec::new();
    for (first, n, byte) in [(5usize, 4usize, 0xabu8), (1000, 1, 0)] {
        later[first * PAGE..(first + n) * PAGE].fill(byte);
        layer_runs.push((first, n));
    }
    let id = SnapshotId::random();
    let mut pending = memory_file::write_full_pending(&path, id, &two_regions(&base)).unwrap();
    let before = pending.stats().pages_written;
    for &(first, n) in &layer_runs {
        pending
            .overwrite(
                (first * PAGE) as u64,
                &later[first * PAGE..(first + n) * PAGE],
            )
            .unwrap();
    }
    assert_eq!(pending.stats().pages_written, before + 5);
    // Out of the image, or unaligned: refused, nothing written.
    let img_len = base.len() as u64;
    for (off, len) in [
        (img_len, PAGE),
        (img_len - PAGE as u64, 2 * PAGE),
        (1, PAGE),
        (0, 100),
    ] {
        assert!(matches!(
            pending.overwrite(off, &vec![1u8; len]),
            Err(Error::InvalidInput(_))
        ));
    }
    pending.commit().unwrap();
    let f = MemoryFile::open(&path).unwrap();
    let mut dst = Mapping::anon(base.len());
    f.read_into(dst.as_mut_slice(), HoleFill::AssumeZeroed)
        .unwrap();
    assert!(dst.as_slice() == &later[..]);
}
