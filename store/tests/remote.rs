//! Publishing snapshots and reading them back lazily through a fetcher, on the in-memory
//! and local-directory backends; the faults: tampered, truncated and missing objects, a
//! store that does not answer, a full cache, eviction, a restart.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use snapshot::memory_file::{self, GuestRegion, MemoryChain, RegionData};
use snapshot::state_file::{self, SnapshotMeta};
use snapshot::SnapshotId;
use store::cache::ChunkCache;
use store::fetcher::{FetchClient, FetcherThread};
use store::location::StoreOptions;
use store::manifest::{self, Manifest};
use store::publish::{publish, PublishOptions, SnapshotDisk, SnapshotFiles};
use store::Store;

const PAGES: usize = 1024; // 4 MiB
const PAGE: usize = 4096;
const CHUNK: u64 = 64 << 10; // 16 pages

/// An image where about a third of the pages are zero, the rest distinct.
fn image(seed: u64) -> Vec<u8> {
    let mut img = vec![0u8; PAGES * PAGE];
    let mut x = seed | 1;
    for p in 0..PAGES {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if x.is_multiple_of(3) {
            continue;
        }
        for (i, b) in img[p * PAGE..(p + 1) * PAGE].iter_mut().enumerate() {
            *b = (x as usize).wrapping_add(i * 31) as u8;
        }
        img[p * PAGE..p * PAGE + 8].copy_from_slice(&(p as u64 ^ seed).to_le_bytes());
    }
    img
}

struct Snap {
    files: SnapshotFiles,
    id: SnapshotId,
    img: Vec<u8>,
}

fn write_full(dir: &Path, seed: u64) -> Snap {
    std::fs::create_dir_all(dir).unwrap();
    let img = image(seed);
    let id = SnapshotId::random();
    let mem = dir.join("memory.mem");
    memory_file::write_full(
        &mem,
        id,
        &[GuestRegion {
            guest_addr: 0,
            data: RegionData::Slice(&img),
        }],
    )
    .unwrap();
    let state = dir.join("state.snap");
    state_file::write(
        &state,
        &SnapshotMeta::full(id, img.len() as u64),
        &vec![seed; 10],
    )
    .unwrap();
    Snap {
        files: SnapshotFiles {
            state,
            memory: mem,
            working_set: None,
            disk: None,
        },
        id,
        img,
    }
}

fn write_diff(dir: &Path, base: &Snap) -> Snap {
    std::fs::create_dir_all(dir).unwrap();
    let mut img = base.img.clone();
    let mut dirty = vec![0u64; PAGES / 64];
    for p in (0..PAGES).step_by(7) {
        dirty[p / 64] |= 1 << (p % 64);
        let fill = if p % 2 == 0 { 0 } else { 0xa5 };
        img[p * PAGE..(p + 1) * PAGE].fill(fill);
    }
    let id = SnapshotId::random();
    let mem = dir.join("memory.mem");
    memory_file::write_diff(
        &mem,
        id,
        base.id,
        &[GuestRegion {
            guest_addr: 0,
            data: RegionData::Slice(&img),
        }],
        &[&dirty],
    )
    .unwrap();
    let state = dir.join("state.snap");
    state_file::write(
        &state,
        &SnapshotMeta::diff(id, base.id, img.len() as u64),
        &vec![1u8; 3],
    )
    .unwrap();
    Snap {
        files: SnapshotFiles {
            state,
            memory: mem,
            working_set: None,
            disk: None,
        },
        id,
        img,
    }
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("clade-store-{name}-{}", SnapshotId::random()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn opts() -> PublishOptions {
    PublishOptions {
        chunk_size: CHUNK,
        ..Default::default()
    }
}

fn read_all(client: &Arc<FetchClient>, id: SnapshotId) -> store::Result<Vec<u8>> {
    let remote = client.open(id)?;
    let chain = MemoryChain::new(remote.memory_files()?)?;
    let mut buf = vec![0u8; PAGES * PAGE];
    chain.read_pages(0, &mut buf)?;
    Ok(buf)
}

fn fetcher(root: &Path, store: &Store, limit: u64) -> FetcherThread {
    let cache = ChunkCache::new(&root.join("cache"), store.clone(), limit).unwrap();
    FetcherThread::start(
        &root.join(format!("f-{}.sock", SnapshotId::random())),
        cache,
    )
    .unwrap()
}

fn client(f: &FetcherThread) -> Arc<FetchClient> {
    FetchClient::connect(f.socket(), Duration::from_secs(20)).unwrap()
}

#[test]
fn full_and_diff_are_read_back_exactly_and_lazily() {
    let dir = tmp("roundtrip");
    let store = Store::open(
        &format!("file://{}/store", dir.display()),
        &StoreOptions::default(),
    )
    .unwrap();
    let base = write_full(&dir.join("base"), 7);
    let diff = write_diff(&dir.join("diff"), &base);
    let rt = rt();
    assert!(
        rt.block_on(publish(&store, &diff.files, &opts())).is_err(),
        "a diff is published only after its base"
    );
    let (m, r) = rt.block_on(publish(&store, &base.files, &opts())).unwrap();
    // The memory data; the state file and memory header are small: in the manifest.
    assert_eq!(r.objects_uploaded, 1);
    assert!(m.state.inline.is_some() && m.memory.head.inline.is_some());
    // Only data pages are uploaded (about two thirds of the image).
    assert!(
        m.memory.data.size < (PAGES * PAGE) as u64 * 3 / 4,
        "{}",
        m.memory.data.size
    );
    let (_, r2) = rt.block_on(publish(&store, &base.files, &opts())).unwrap();
    assert_eq!(
        (r2.objects_uploaded, r2.objects_reused),
        (0, 1),
        "publishing again reuses"
    );
    rt.block_on(publish(&store, &diff.files, &opts())).unwrap();

    let f = fetcher(&dir, &store, 1 << 30);
    let c = client(&f);
    // One page: one chunk fetched, not the image.
    let remote = c.open(base.id).unwrap();
    let chain = MemoryChain::new(remote.memory_files().unwrap()).unwrap();
    let before = c.stats().unwrap();
    let mut page = vec![0u8; PAGE];
    let p = (0..PAGES).find(|&p| base.img[p * PAGE] != 0).unwrap() as u64;
    chain.read_pages(p, &mut page).unwrap();
    assert_eq!(
        &page[..],
        &base.img[p as usize * PAGE..(p as usize + 1) * PAGE]
    );
    let after = c.stats().unwrap();
    assert_eq!(after.chunks_fetched - before.chunks_fetched, 1);
    assert!(after.bytes_fetched - before.bytes_fetched <= CHUNK);

    assert!(read_all(&c, base.id).unwrap() == base.img, "base differs");
    assert!(
        read_all(&c, diff.id).unwrap() == diff.img,
        "diff chain differs"
    );
    // Everything is local now: reading again fetches nothing.
    let s1 = c.stats().unwrap();
    assert!(read_all(&client(&f), diff.id).unwrap() == diff.img);
    assert_eq!(c.stats().unwrap().bytes_fetched, s1.bytes_fetched);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tampered_truncated_and_missing_objects_are_errors_naming_the_object() {
    let dir = tmp("faults");
    let store = Store::open("memory://b/p", &StoreOptions::default()).unwrap();
    let s = write_full(&dir.join("s"), 3);
    let rt = rt();
    let (m, _) = rt.block_on(publish(&store, &s.files, &opts())).unwrap();
    let data_key = m.memory.data.key();
    let good = rt.block_on(store.get(&data_key)).unwrap();

    // One flipped byte in the second chunk.
    let mut bad = good.to_vec();
    bad[CHUNK as usize + 5] ^= 1;
    rt.block_on(store.put(&data_key, Bytes::from(bad))).unwrap();
    let f = fetcher(&dir, &store, 1 << 30);
    let err = read_all(&client(&f), s.id).unwrap_err().to_string();
    assert!(
        err.contains(&store.key(&data_key)) && err.contains("checksum"),
        "{err}"
    );
    drop(f);

    // Truncated.
    rt.block_on(store.put(&data_key, good.slice(..good.len() - 4096)))
        .unwrap();
    let f = fetcher(&tmp("faults2"), &store, 1 << 30);
    let err = read_all(&client(&f), s.id).unwrap_err().to_string();
    assert!(err.contains(&store.key(&data_key)), "{err}");
    drop(f);

    // Missing.
    rt.block_on(store.delete(&data_key)).unwrap();
    let f = fetcher(&tmp("faults3"), &store, 1 << 30);
    let err = read_all(&client(&f), s.id).unwrap_err().to_string();
    assert!(
        err.contains(&store.key(&data_key)) && err.contains("does not exist"),
        "{err}"
    );
    drop(f);

    // A state file altered inside the manifest fails the open.
    let mk = manifest::manifest_key(s.id);
    let mut mm: Manifest = serde_json::from_slice(&rt.block_on(store.get(&mk)).unwrap()).unwrap();
    let mut text = mm.state.inline.clone().unwrap().into_bytes();
    text[10] = if text[10] == b'A' { b'B' } else { b'A' };
    mm.state.inline = Some(String::from_utf8(text).unwrap());
    rt.block_on(store.put(&mk, Bytes::from(serde_json::to_vec(&mm).unwrap())))
        .unwrap();
    let f = fetcher(&tmp("faults4"), &store, 1 << 30);
    let err = client(&f).open(s.id).unwrap_err().to_string();
    assert!(
        err.contains(&store.key(&m.state.key())) && err.contains("checksum"),
        "{err}"
    );
    rt.block_on(store.put(&mk, Bytes::from(m.to_bytes())))
        .unwrap();
    // An unknown snapshot.
    let err = client(&f)
        .open(SnapshotId::random())
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not exist"), "{err}");
    // A tampered manifest.
    let mk = manifest::manifest_key(s.id);
    let mut mm: Manifest = serde_json::from_slice(&rt.block_on(store.get(&mk)).unwrap()).unwrap();
    mm.memory.runs.push([PAGES as u64 + 5, 1]);
    rt.block_on(store.put(&mk, Bytes::from(serde_json::to_vec(&mm).unwrap())))
        .unwrap();
    let err = client(&f).open(s.id).unwrap_err().to_string();
    assert!(err.contains("manifest"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_store_that_does_not_answer_is_an_error_in_bounded_time() {
    // A loopback server that accepts and never answers.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let _held = std::thread::spawn(move || {
        let mut conns = Vec::new();
        for c in l.incoming().flatten() {
            conns.push(c);
        }
    });
    // SAFETY-free: these tests set the same values everywhere; explicit credentials keep
    // the S3 client from looking for instance credentials off this machine.
    std::env::set_var("AWS_ACCESS_KEY_ID", "test");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "testsecret");
    let store = Store::open(
        "s3://bucket/prefix",
        &StoreOptions {
            endpoint: Some(format!("http://127.0.0.1:{port}")),
            timeout: Duration::from_secs(2),
        },
    )
    .unwrap();
    let dir = tmp("silent");
    let f = fetcher(&dir, &store, 1 << 30);
    let t = Instant::now();
    let err = client(&f)
        .open(SnapshotId::random())
        .unwrap_err()
        .to_string();
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t.elapsed()
    );
    // The error names the object asked for (whether the client's own time limit or the
    // crate's bound fired first).
    assert!(err.contains("prefix/snapshots/"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cache_evicts_least_recently_used_refuses_when_full_and_survives_restart() {
    let dir = tmp("cache");
    let store = Store::open("memory://b/c", &StoreOptions::default()).unwrap();
    let a = write_full(&dir.join("a"), 11);
    let b = write_full(&dir.join("b"), 12);
    let rt = rt();
    let (ma, _) = rt.block_on(publish(&store, &a.files, &opts())).unwrap();
    rt.block_on(publish(&store, &b.files, &opts())).unwrap();
    let limit = ma.memory.data.size + CHUNK; // room for one snapshot and a bit
    let f = fetcher(&dir, &store, limit);

    // A held open, fully read; B cannot fit while A is in use.
    let ca = client(&f);
    let ra = ca.open(a.id).unwrap();
    let chain_a = MemoryChain::new(ra.memory_files().unwrap()).unwrap();
    let mut buf = vec![0u8; PAGES * PAGE];
    chain_a.read_pages(0, &mut buf).unwrap();
    assert!(buf == a.img);
    let err = read_all(&client(&f), b.id).unwrap_err().to_string();
    assert!(err.contains("cache is full"), "{err}");

    // Once A's user is gone, B evicts A's least recently used chunks.
    drop(chain_a);
    drop(ra);
    drop(ca);
    std::thread::sleep(Duration::from_millis(100));
    assert!(read_all(&client(&f), b.id).unwrap() == b.img);
    let st = f.cache().stats();
    assert!(st.chunks_evicted > 0 && st.bytes_held <= limit, "{st:?}");
    // A is fetched again where it was evicted, exactly.
    assert!(read_all(&client(&f), a.id).unwrap() == a.img);
    drop(f);

    // A restart keeps what is cached; a chunk damaged on disk is dropped and fetched again.
    let memfile = dir
        .join("cache/snapshots")
        .join(a.id.to_string())
        .join("memory.mem");
    let head = ma.memory.head.size;
    let first_data = ma.memory.runs[0][0] * PAGE as u64;
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&memfile)
            .unwrap();
        f.write_all_at(&[0xff; 16], head + first_data + 100)
            .unwrap();
    }
    let cache = ChunkCache::new(&dir.join("cache"), store.clone(), limit).unwrap();
    let held = cache.stats().bytes_held;
    assert!(
        held > 0,
        "the restarted cache holds what was fetched before"
    );
    let f = FetcherThread::start(&dir.join("f2.sock"), cache).unwrap();
    assert!(read_all(&client(&f), a.id).unwrap() == a.img);
    let st = f.cache().stats();
    assert!(st.chunks_fetched >= 1, "{st:?}");
    assert!(
        st.bytes_fetched < ma.memory.data.size,
        "only the damaged chunk again: {st:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn concurrent_misses_of_one_chunk_fetch_it_once() {
    let dir = tmp("dedup");
    let store = Store::open("memory://b/d", &StoreOptions::default()).unwrap();
    let s = write_full(&dir.join("s"), 5);
    let rt = rt();
    let (m, _) = rt.block_on(publish(&store, &s.files, &opts())).unwrap();
    let f = fetcher(&dir, &store, 1 << 30);
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let c = client(&f);
            let id = s.id;
            std::thread::spawn(move || read_all(&c, id).unwrap())
        })
        .collect();
    for t in threads {
        assert!(t.join().unwrap() == s.img);
    }
    let st = f.cache().stats();
    assert_eq!(st.chunks_fetched, m.chunk_count(), "{st:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same round trip against a real S3 server (s3s-fs on loopback), and what happens
/// when that server goes away mid-restore.
#[test]
fn s3_server_round_trip_and_a_server_that_goes_away() {
    let dir = tmp("s3");
    let mut server = store::s3server::S3Server::start(&dir.join("s3"), "clade").unwrap();
    let store = server
        .store("clade", "snaps", Duration::from_secs(3))
        .unwrap();
    let base = write_full(&dir.join("base"), 21);
    let diff = write_diff(&dir.join("diff"), &base);
    let rt = rt();
    let (mb, _) = rt.block_on(publish(&store, &base.files, &opts())).unwrap();
    let (md, _) = rt.block_on(publish(&store, &diff.files, &opts())).unwrap();
    let keys = rt.block_on(store.list("")).unwrap();
    assert!(keys.contains(&manifest::manifest_key(diff.id)), "{keys:?}");
    assert!(keys.contains(&md.memory.data.key()), "{keys:?}");

    // Each fetcher has its own client (an HTTP client's connections belong to the
    // runtime that made them: the publishing runtime here is not the fetcher's).
    let fetch_store = || {
        server
            .store("clade", "snaps", Duration::from_secs(3))
            .unwrap()
    };
    let f = fetcher(&dir, &fetch_store(), 1 << 30);
    assert!(read_all(&client(&f), diff.id).unwrap() == diff.img);
    // Another host (its own cache) opens the diff; the server dies after the first page.
    let f2 = fetcher(&dir.join("host2"), &fetch_store(), 1 << 30);
    let c2 = client(&f2);
    let remote = c2.open(base.id).unwrap();
    let chain = MemoryChain::new(remote.memory_files().unwrap()).unwrap();
    let mut page = vec![0u8; PAGE];
    let p = (0..PAGES).find(|&p| base.img[p * PAGE] != 0).unwrap();
    chain.read_pages(p as u64, &mut page).unwrap();
    server.kill();
    let t = Instant::now();
    let mut buf = vec![0u8; PAGES * PAGE];
    let err = chain.read_pages(0, &mut buf).unwrap_err().to_string();
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    assert!(err.contains(&store.key(&mb.memory.data.key())), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn deleting_keeps_what_others_need_and_leaves_nothing_behind() {
    use store::publish::delete;
    use store::sweep::delete_with;
    let dir = tmp("delete");
    let store = Store::open(
        &format!("file://{}/store", dir.display()),
        &StoreOptions::default(),
    )
    .unwrap();
    let base = write_full(&dir.join("base"), 31);
    let diff = write_diff(&dir.join("diff"), &base);
    let rt = rt();
    rt.block_on(publish(&store, &base.files, &opts())).unwrap();
    rt.block_on(publish(&store, &diff.files, &opts())).unwrap();
    let err = rt
        .block_on(delete(&store, base.id))
        .unwrap_err()
        .to_string();
    assert!(err.contains("is the base of"), "{err}");
    rt.block_on(delete_with(&store, diff.id, Duration::ZERO))
        .unwrap();
    // The base is whole and restorable.
    let f = fetcher(&dir, &store, 1 << 30);
    assert!(read_all(&client(&f), base.id).unwrap() == base.img);
    assert!(client(&f).open(diff.id).is_err());
    drop(f);
    rt.block_on(delete_with(&store, base.id, Duration::ZERO))
        .unwrap();
    assert_eq!(rt.block_on(store.list("")).unwrap(), Vec::<String>::new());
    assert!(matches!(
        rt.block_on(delete(&store, base.id)),
        Err(store::Error::Missing { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A frozen disk chain in `dir`: a 12 MiB base imported from a raw image, a middle layer
/// and a top layer, each with writes of its own. Returns the layers (top first) and the
/// disk's content.
fn disk_chain(dir: &Path) -> (Vec<PathBuf>, Vec<u8>) {
    use disk::ops::{self, CreateOptions};
    std::fs::create_dir_all(dir).unwrap();
    let mut raw = image(11);
    raw.extend(image(12));
    raw.extend(image(13));
    std::fs::write(dir.join("base.raw"), &raw).unwrap();
    let base = dir.join("base.cdsk");
    ops::import_raw(&dir.join("base.raw"), &base, None).unwrap();
    let mut below = base.clone();
    let mut layers = vec![base];
    for (name, seed) in [("mid.cdsk", 21u8), ("top.cdsk", 22u8)] {
        let p = dir.join(name);
        ops::create(
            &p,
            &CreateOptions {
                parent: Some(below.clone()),
                ..Default::default()
            },
        )
        .unwrap();
        {
            let mut d = disk::Disk::open(&p, disk::OpenOptions::default()).unwrap();
            d.write_at(u64::from(seed) * 100_003, &vec![seed; 300_000])
                .unwrap();
            d.flush().unwrap();
        }
        ops::freeze(&p).unwrap();
        layers.push(p.clone());
        below = p;
    }
    layers.reverse();
    (layers.clone(), disk_content(&layers[0]))
}

fn disk_content(top: &Path) -> Vec<u8> {
    read_disk(top, None).unwrap()
}

/// A disk's whole content, its layers read lazily through `sources`.
fn read_disk(top: &Path, sources: Option<&disk::remote::Sources>) -> disk::Result<Vec<u8>> {
    let d = disk::Disk::open_with_sources(top, disk::OpenOptions { read_only: true }, sources)?;
    let mut buf = vec![0u8; d.virtual_size() as usize];
    d.read_at(0, &mut buf)?;
    Ok(buf)
}

/// The names in a cache's `layers/` ending in `ext`, sorted.
fn layer_files(dir: &Path, ext: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(ext))
        .collect();
    names.sort();
    names
}

fn with_disk(mut s: Snap, layer: &Path) -> Snap {
    s.files.disk = Some(SnapshotDisk {
        layer: layer.to_path_buf(),
        read_only: false,
    });
    s
}

#[test]
fn a_snapshot_with_a_disk_is_restored_elsewhere_with_its_layer_chain() {
    let dir = tmp("disk");
    let store = Store::open(
        &format!("file://{}/store", dir.display()),
        &StoreOptions::default(),
    )
    .unwrap();
    let host_a = dir.join("host-a");
    let (layers, content) = disk_chain(&host_a.join("disk"));
    let mid_content = disk_content(&layers[1]);
    // The base snapshot saved the middle layer; the diff on it the top one.
    let base = with_disk(write_full(&host_a.join("base"), 5), &layers[1]);
    let diff = with_disk(write_diff(&host_a.join("diff"), &base), &layers[0]);
    // Small parts: the base layer (12 MiB) goes up in several.
    let o = PublishOptions {
        part_size: 1 << 20,
        ..opts()
    };
    let rt = rt();
    let (bm, br) = rt.block_on(publish(&store, &base.files, &o)).unwrap();
    let bd = bm.disk.clone().unwrap();
    assert_eq!(bd.layers.len(), 2);
    assert_eq!(
        br.objects_uploaded, 5,
        "memory data, two layers and their chunk checksums"
    );
    assert!(bd.layers.iter().all(|l| l.chunks.is_some()));
    let (dm, dr) = rt.block_on(publish(&store, &diff.files, &o)).unwrap();
    let dd = dm.disk.clone().unwrap();
    assert_eq!(dd.layers.len(), 3);
    assert_eq!(
        dd.layers[1..],
        bd.layers[..],
        "the base's layers are reused"
    );
    assert_eq!(
        dr.objects_uploaded, 3,
        "memory data, the top layer and its chunk checksums"
    );
    assert!(dr.objects_reused >= 2);
    for l in &dd.layers {
        let size = rt.block_on(store.size(&l.object.key())).unwrap();
        assert_eq!(size, Some(l.object.size));
    }
    // A layer that is not frozen is not published.
    let open_top = host_a.join("disk").join("open.cdsk");
    disk::ops::create(
        &open_top,
        &disk::ops::CreateOptions {
            parent: Some(layers[0].clone()),
            ..Default::default()
        },
    )
    .unwrap();
    let other = with_disk(write_full(&host_a.join("other"), 6), &open_top);
    let err = rt
        .block_on(publish(&store, &other.files, &o))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not frozen") && err.contains("open.cdsk"),
        "{err}"
    );

    // The host that took them is gone.
    std::fs::remove_dir_all(&host_a).unwrap();
    let f = fetcher(&dir.join("host-b"), &store, 1 << 30);
    let c = client(&f);
    let remote = c.open(diff.id).unwrap();
    let rd = remote.disk.clone().unwrap();
    assert!(!rd.read_only && rd.layer.is_absolute());
    assert_eq!(
        rd.layer,
        std::path::absolute(dir.join("host-b/cache/layers"))
            .unwrap()
            .join(format!("{}.cdsk", dd.layers[0].id))
    );
    // Read lazily: the open brought each layer's header and table, not its data (the
    // base alone is 12 MiB).
    let opened = c.stats().unwrap();
    assert!(
        opened.bytes_fetched < 4 << 20,
        "{} bytes fetched by the open",
        opened.bytes_fetched
    );
    assert!(disk::remote::is_filled_on_demand(&rd.layer));
    // Without the fetcher, its data cannot be read (never the zeros of holes).
    let e = read_disk(&rd.layer, None).unwrap_err();
    assert!(matches!(e, disk::Error::Unfilled { .. }), "{e}");
    let sources = store::fetcher::FetcherLayers::sources(Arc::clone(&c));
    assert!(
        read_disk(&rd.layer, Some(&sources)).unwrap() == content,
        "disk content differs"
    );
    // Read again: all there, nothing fetched.
    let before = c.stats().unwrap();
    assert!(read_disk(&rd.layer, Some(&sources)).unwrap() == content);
    assert_eq!(c.stats().unwrap().bytes_fetched, before.bytes_fetched);
    let d = disk::Disk::open(&rd.layer, disk::OpenOptions { read_only: true }).unwrap();
    let ids: Vec<String> = d
        .layers()
        .iter()
        .map(|l| disk::id_hex(&l.header().layer_id))
        .collect();
    let want: Vec<String> = dd.layers.iter().map(|l| l.id.clone()).collect();
    assert_eq!(ids, want);
    assert!(d.layers().iter().all(|l| l.header().frozen()));
    // Each child names its parent by file name, beside it.
    let pref = d.layers()[0].header().parent.clone().unwrap();
    assert_eq!(pref.path, PathBuf::from(format!("{}.cdsk", want[1])));
    drop(d);
    assert!(read_all(&c, diff.id).unwrap() == diff.img);
    // The base snapshot's disk is the middle layer, already here: nothing downloaded.
    let before = c.stats().unwrap();
    let remote = c.open(base.id).unwrap();
    let after = c.stats().unwrap();
    assert_eq!(after.bytes_fetched, before.bytes_fetched);
    let rb = remote.disk.unwrap();
    assert!(read_disk(&rb.layer, Some(&sources)).unwrap() == mid_content);
    // Overlays go on the cached layer as on any frozen layer.
    let ov = dir.join("overlay.cdsk");
    disk::ops::create(
        &ov,
        &disk::ops::CreateOptions {
            parent: Some(rd.layer.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(read_disk(&ov, Some(&sources)).unwrap() == content);
    // Nothing half-downloaded is left: three layers, each with its entry, checksums and
    // presence map.
    let ldir = dir.join("host-b/cache/layers");
    assert_eq!(
        layer_files(&ldir, "").len(),
        12,
        "{:?}",
        layer_files(&ldir, "")
    );
    assert_eq!(layer_files(&ldir, ".cdsk").len(), 3);

    // A snapshot made on this host on the cached layers is published from their entries
    // (their files here are not the objects: relinked, and read lazily).
    {
        let mut d =
            disk::Disk::open_with_sources(&ov, disk::OpenOptions::default(), Some(&sources))
                .unwrap();
        d.write_at(7, b"host b").unwrap();
        d.flush().unwrap();
    }
    disk::ops::freeze(&ov).unwrap();
    let again = with_disk(write_full(&dir.join("b-snap"), 8), &ov);
    let (am, ar) = rt.block_on(publish(&store, &again.files, &o)).unwrap();
    let ad = am.disk.unwrap();
    assert_eq!(ad.layers[1..], dd.layers[..]);
    assert_eq!(
        ar.objects_uploaded, 3,
        "memory data, the new layer and its checksums"
    );

    // Made whole: an ordinary layer file from then on, still published from its entry.
    let mid = ldir.join(format!("{}.cdsk", dd.layers[1].id));
    c.complete_layer(&dd.layers[1].id).unwrap();
    assert!(!disk::remote::is_filled_on_demand(&mid));
    assert!(read_disk(&mid, Some(&sources)).unwrap() == mid_content);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_tampered_disk_layer_is_an_error_naming_it() {
    let dir = tmp("disk-faults");
    let store = Store::open("memory://b/disk", &StoreOptions::default()).unwrap();
    let (layers, _) = disk_chain(&dir.join("disk"));
    let s = with_disk(write_full(&dir.join("s"), 9), &layers[0]);
    let rt = rt();
    let (m, _) = rt.block_on(publish(&store, &s.files, &opts())).unwrap();
    let d = m.disk.clone().unwrap();
    let key = d.layers[0].object.key();
    let good = rt.block_on(store.get(&key)).unwrap();
    // Its header tampered with: the open fails, naming the object and the layer.
    let mut bad = good.to_vec();
    bad[100] ^= 1;
    rt.block_on(store.put(&key, Bytes::from(bad))).unwrap();
    let f = fetcher(&dir.join("h1"), &store, 1 << 30);
    let err = client(&f).open(s.id).unwrap_err().to_string();
    assert!(
        err.contains(&store.key(&key)) && err.contains("checksum") && err.contains(&d.layers[0].id),
        "{err}"
    );
    // Neither the layer nor its download is left in the cache; its parents are (verified).
    let layers_dir = dir.join("h1/cache/layers");
    let mut want = vec![
        format!("{}.cdsk", d.layers[1].id),
        format!("{}.cdsk", d.layers[2].id),
    ];
    want.sort();
    assert_eq!(layer_files(&layers_dir, ".cdsk"), want);
    assert!(layer_files(&layers_dir, ".tmp").is_empty());
    // Repaired in the store: the same cache completes the chain.
    rt.block_on(store.put(&key, good)).unwrap();
    let c = client(&f);
    let remote = c.open(s.id).unwrap();
    let top = remote.disk.unwrap().layer;
    // The base's data (12 MiB, not read yet) tampered with at its end: reading that data
    // is an error naming the object, never other bytes.
    let bkey = d.layers[2].object.key();
    let bgood = rt.block_on(store.get(&bkey)).unwrap();
    let mut bad = bgood.to_vec();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    rt.block_on(store.put(&bkey, Bytes::from(bad))).unwrap();
    let sources = store::fetcher::FetcherLayers::sources(Arc::clone(&c));
    let err = read_disk(&top, Some(&sources)).unwrap_err().to_string();
    assert!(
        err.contains(&store.key(&bkey)) && err.contains("checksum"),
        "{err}"
    );
    // Repaired: the same cache reads it all.
    rt.block_on(store.put(&bkey, bgood)).unwrap();
    assert!(read_disk(&top, Some(&sources)).unwrap() == disk_content(&layers[0]));
    drop(f);

    // A manifest whose chain is not the layers' own (parent and grandparent swapped) is
    // refused when the layers are linked.
    let mk = manifest::manifest_key(s.id);
    let mut mm = m.clone();
    mm.disk.as_mut().unwrap().layers.swap(1, 2);
    rt.block_on(store.put(&mk, Bytes::from(mm.to_bytes())))
        .unwrap();
    let f = fetcher(&dir.join("h2"), &store, 1 << 30);
    let err = client(&f).open(s.id).unwrap_err().to_string();
    assert!(err.contains("parent"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A write-if-absent is atomic on the S3 server: of many hosts writing the same claim at
/// once, exactly one succeeds (what `clade serve --store` relies on so that a paused
/// sandbox is resumed once).
#[test]
fn of_concurrent_writes_if_absent_exactly_one_succeeds() {
    let dir = tmp("claims");
    let mut server = store::s3server::S3Server::start(&dir.join("s3"), "clade").unwrap();
    for round in 0..5 {
        let key = format!("claims/sandbox/{round}");
        let winners: Vec<bool> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|i| {
                    let (server, key) = (&server, &key);
                    s.spawn(move || {
                        let rt = rt();
                        let store = {
                            let _g = rt.enter();
                            server
                                .store("clade", "p", std::time::Duration::from_secs(10))
                                .unwrap()
                        };
                        rt.block_on(store.put_if_absent(key, format!("host-{i}").into()))
                            .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(
            winners.iter().filter(|w| **w).count(),
            1,
            "round {round}: {winners:?}"
        );
    }
    server.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A publish that uploaded the memory data but not the manifest (the store went away),
/// then a restore that recorded a new working set (another packing order), then the
/// publish again: the data goes to another object, and what is read back is exact (the
/// first upload's bytes, in the old order, are never read against the new chunk
/// checksums).
#[test]
fn a_publish_retried_after_the_working_set_changed_reads_back_exactly() {
    let dir = tmp("reorder");
    let store = Store::open(
        &format!("file://{}/store", dir.display()),
        &StoreOptions::default(),
    )
    .unwrap();
    let mut snap = write_full(&dir.join("s"), 31);
    let pages = (snap.img.len() / PAGE) as u64;
    let ws_path = dir.join("s").join("working_set.ws");
    let ws = |order: Vec<u64>| {
        snapshot::working_set::WorkingSet {
            id: snap.id,
            page_count: pages,
            pages: order,
        }
        .save(&ws_path)
        .unwrap()
    };
    ws((0..pages).step_by(3).collect());
    snap.files.working_set = Some(ws_path.clone());
    let rt = rt();
    let (first, _) = rt.block_on(publish(&store, &snap.files, &opts())).unwrap();
    // As if its manifest never made it.
    rt.block_on(store.delete(&manifest::manifest_key(snap.id)))
        .unwrap();
    ws((0..pages).rev().step_by(2).collect());
    let (second, _) = rt.block_on(publish(&store, &snap.files, &opts())).unwrap();
    assert_ne!(first.memory.data.key(), second.memory.data.key());
    assert_ne!(first.memory.runs, second.memory.runs);
    let f = fetcher(&dir, &store, 1 << 30);
    assert!(read_all(&client(&f), snap.id).unwrap() == snap.img);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A snapshot with a working set is opened in one round trip: its manifest and its lead
/// object (the working set's chunks) at once, those chunks present from the start. A lead
/// object that is missing, tampered with or of another packing order costs only speed:
/// the chunks come from the data object and memory reads back exactly.
#[test]
fn the_lead_object_opens_in_one_round_trip_and_a_bad_one_only_costs_speed() {
    let dir = tmp("lead");
    let store = Store::open(
        &format!("file://{}/store", dir.display()),
        &StoreOptions::default(),
    )
    .unwrap();
    let mut snap = write_full(&dir.join("s"), 41);
    let pages = (snap.img.len() / PAGE) as u64;
    let ws_path = dir.join("s").join("working_set.ws");
    snapshot::working_set::WorkingSet {
        id: snap.id,
        page_count: pages,
        // 40 pages, about 27 of them data: two chunks of 16 pages.
        pages: (0..pages).step_by(25).collect(),
    }
    .save(&ws_path)
    .unwrap();
    snap.files.working_set = Some(ws_path);
    let rt = rt();
    let (m, _) = rt.block_on(publish(&store, &snap.files, &opts())).unwrap();
    let lead = m.memory.lead.clone().expect("a lead object");
    assert_eq!(lead.key(), manifest::lead_key(snap.id));
    let ws_chunks = m.working_set_chunks();
    assert!(ws_chunks >= 2, "{ws_chunks}");
    assert_eq!(lead.size, m.chunk_range(ws_chunks - 1).1);

    // Good: two requests (manifest and lead), the working set's chunks present.
    let open = |name: &str| {
        let f = fetcher(&dir.join(name), &store, 1 << 30);
        let c = client(&f);
        let r = c.open(snap.id).unwrap();
        let st = c.stats().unwrap();
        drop(r);
        let present = std::fs::read(
            dir.join(name)
                .join("cache/snapshots")
                .join(snap.id.to_string())
                .join(store::cache::PRESENT_FILE),
        )
        .unwrap();
        let img = read_all(&c, snap.id).unwrap();
        (st, present, img)
    };
    let (st, present, img) = open("good");
    assert_eq!(st.requests, 2, "{st:?}");
    assert!(
        present[..ws_chunks as usize].iter().all(|&p| p == 1),
        "{present:?}"
    );
    assert!(present[ws_chunks as usize..].iter().all(|&p| p == 0));
    assert!(img == snap.img);

    // Tampered (same size, one byte changed): ignored, the chunks read from the data.
    let key = lead.key();
    let mut bytes = rt.block_on(store.get(&key)).unwrap().to_vec();
    bytes[100] ^= 0xff;
    rt.block_on(store.put(&key, Bytes::from(bytes))).unwrap();
    let (st, present, img) = open("tampered");
    assert!(st.requests > 2, "{st:?}");
    assert!(present[..ws_chunks as usize].iter().all(|&p| p == 1));
    assert!(img == snap.img);

    // Truncated: ignored likewise.
    let b = rt.block_on(store.get(&key)).unwrap();
    rt.block_on(store.put(&key, b.slice(..b.len() / 2)))
        .unwrap();
    let (_, _, img) = open("truncated");
    assert!(img == snap.img);

    // Missing.
    rt.block_on(store.delete(&key)).unwrap();
    let (_, present, img) = open("missing");
    assert!(present[..ws_chunks as usize].iter().all(|&p| p == 1));
    assert!(img == snap.img);

    // Deleting the snapshot deletes its lead object too.
    rt.block_on(store.put(&key, Bytes::from_static(b"lead")))
        .unwrap();
    rt.block_on(store::sweep::delete_with(&store, snap.id, Duration::ZERO))
        .unwrap();
    assert!(rt.block_on(store.size(&key)).unwrap().is_none());
    let _ = std::fs::remove_dir_all(&dir);
}

/// An in-memory store that runs a chosen step (a delete, as another host would) right
/// before a chosen object is written, and can refuse to serve chosen objects: publish and
/// delete interleaved deliberately.
mod hooked {
    use std::collections::HashSet;
    use std::fmt;
    use std::sync::Mutex;

    use futures::future::BoxFuture;
    use futures::stream::BoxStream;
    use object_store::memory::InMemory;
    use object_store::path::Path;
    use object_store::{
        CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
        PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
    };

    type Hook = Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>;

    #[derive(Default)]
    pub struct Hooked {
        inner: InMemory,
        before_put: Mutex<Option<(String, Hook)>>,
        pub unserved: Mutex<HashSet<String>>,
    }

    impl Hooked {
        /// Runs `hook` once, right before object `key` is first written.
        pub fn before_put(&self, key: &str, hook: Hook) {
            *self.before_put.lock().unwrap() = Some((key.to_string(), hook));
        }

        /// Whether the hook has run.
        pub fn hook_ran(&self) -> bool {
            self.before_put.lock().unwrap().is_none()
        }
    }

    impl fmt::Debug for Hooked {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("Hooked")
        }
    }

    impl fmt::Display for Hooked {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("Hooked")
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for Hooked {
        async fn put_opts(
            &self,
            location: &Path,
            payload: PutPayload,
            opts: PutOptions,
        ) -> Result<PutResult> {
            let hook = {
                let mut h = self.before_put.lock().unwrap();
                match h.as_ref() {
                    Some((k, _)) if k == location.as_ref() => h.take().map(|(_, f)| f),
                    _ => None,
                }
            };
            if let Some(f) = hook {
                f().await;
            }
            self.inner.put_opts(location, payload, opts).await
        }

        async fn put_multipart_opts(
            &self,
            location: &Path,
            opts: PutMultipartOptions,
        ) -> Result<Box<dyn MultipartUpload>> {
            self.inner.put_multipart_opts(location, opts).await
        }

        async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
            if self.unserved.lock().unwrap().contains(location.as_ref()) {
                return Err(object_store::Error::Generic {
                    store: "hooked",
                    source: "permission denied".into(),
                });
            }
            self.inner.get_opts(location, options).await
        }

        fn delete_stream(
            &self,
            locations: BoxStream<'static, Result<Path>>,
        ) -> BoxStream<'static, Result<Path>> {
            self.inner.delete_stream(locations)
        }

        fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
            self.inner.list(prefix)
        }

        async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
            self.inner.list_with_delimiter(prefix).await
        }

        async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
            self.inner.copy_opts(from, to, options).await
        }
    }
}

/// Every object manifest `m` names is in the store, with its size.
fn whole(rt: &tokio::runtime::Runtime, store: &Store, m: &Manifest) -> bool {
    m.objects()
        .iter()
        .all(|o| o.inline.is_some() || rt.block_on(store.size(&o.key())).unwrap() == Some(o.size))
}

/// Two fork siblings' snapshots name the same frozen disk layers. A's delete (by another
/// host) runs while B's publish, which found those layers in the store and did not upload
/// them, is under way: right before B writes its manifest, and right before it marks a
/// reused layer. B is whole afterwards and reads back; A's own objects still go once the
/// grace period has passed.
#[test]
fn a_delete_racing_a_publish_that_reused_objects_leaves_the_new_snapshot_whole() {
    use store::sweep::{delete_with, sweep, touch_key};
    let grace = Duration::from_secs(4);
    for when in ["manifest", "touch"] {
        let dir = tmp(&format!("race-{when}"));
        let hooked = Arc::new(hooked::Hooked::default());
        let store = Store::from_object_store(hooked.clone(), "");
        let (layers, _) = disk_chain(&dir.join("disk"));
        let a = with_disk(write_full(&dir.join("a"), 41), &layers[0]);
        let b = with_disk(write_full(&dir.join("b"), 42), &layers[0]);
        let rt = rt();
        let (ma, _) = rt.block_on(publish(&store, &a.files, &opts())).unwrap();
        // A's objects are older than the grace period when the delete runs.
        std::thread::sleep(grace + Duration::from_millis(200));
        let layer = ma.disk.as_ref().unwrap().layers[0].object.key();
        let at = match when {
            "manifest" => manifest::manifest_key(b.id),
            _ => touch_key(&layer),
        };
        let (s, id) = (store.clone(), a.id);
        hooked.before_put(
            &at,
            Box::new(move || {
                Box::pin(async move {
                    delete_with(&s, id, grace).await.unwrap();
                })
            }),
        );
        let (mb, _) = rt.block_on(publish(&store, &b.files, &opts())).unwrap();
        assert!(hooked.hook_ran(), "{when}");
        assert!(rt
            .block_on(store.size(&manifest::manifest_key(a.id)))
            .unwrap()
            .is_none());
        assert_eq!(
            ma.disk.as_ref().unwrap().layers,
            mb.disk.as_ref().unwrap().layers,
            "siblings share their layers"
        );
        assert!(whole(&rt, &store, &mb), "{when}: B names a missing object");
        let f = fetcher(&dir, &store, 1 << 30);
        assert!(read_all(&client(&f), b.id).unwrap() == b.img, "{when}");
        drop(f);
        // Later: what only A named goes, B stays whole.
        std::thread::sleep(grace + Duration::from_millis(200));
        rt.block_on(sweep(&store, grace)).unwrap();
        let a_data = ma.memory.data.key();
        assert!(
            rt.block_on(store.size(&a_data)).unwrap().is_none(),
            "{when}"
        );
        assert!(
            rt.block_on(store.list("deleted")).unwrap().is_empty(),
            "{when}"
        );
        assert!(whole(&rt, &store, &mb), "{when}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A manifest that does not parse blocks no other snapshot's delete and loses nothing it
/// names; one the store does not serve holds deletes back (nothing is deleted) until it is
/// served again, then they complete.
#[test]
fn an_unreadable_manifest_blocks_no_other_delete_and_keeps_what_it_names() {
    use store::sweep::{delete_with, sweep};
    let dir = tmp("unreadable");
    let hooked = Arc::new(hooked::Hooked::default());
    let store = Store::from_object_store(hooked.clone(), "");
    let (layers, _) = disk_chain(&dir.join("disk"));
    let a = with_disk(write_full(&dir.join("a"), 51), &layers[0]);
    let b = with_disk(write_full(&dir.join("b"), 52), &layers[0]);
    let c = write_full(&dir.join("c"), 53);
    let rt = rt();
    let (ma, _) = rt.block_on(publish(&store, &a.files, &opts())).unwrap();
    let (mb, _) = rt.block_on(publish(&store, &b.files, &opts())).unwrap();
    let (mc, _) = rt.block_on(publish(&store, &c.files, &opts())).unwrap();

    // B's manifest garbled: A's delete goes through, B's objects (the shared layers) stay.
    let kb = manifest::manifest_key(b.id);
    let good = rt.block_on(store.get(&kb)).unwrap();
    let mut bad = b"{garbled".to_vec();
    bad.extend_from_slice(&good);
    rt.block_on(store.put(&kb, Bytes::from(bad))).unwrap();
    rt.block_on(delete_with(&store, a.id, Duration::ZERO))
        .unwrap();
    assert!(rt
        .block_on(store.size(&manifest::manifest_key(a.id)))
        .unwrap()
        .is_none());
    assert!(rt
        .block_on(store.size(&ma.memory.data.key()))
        .unwrap()
        .is_none());
    assert!(whole(&rt, &store, &mb));
    rt.block_on(store.put(&kb, good)).unwrap();
    let f = fetcher(&dir, &store, 1 << 30);
    assert!(read_all(&client(&f), b.id).unwrap() == b.img);
    drop(f);

    // C's manifest not served: B's delete deletes nothing yet, B stays whole.
    let kc = manifest::manifest_key(c.id);
    hooked.unserved.lock().unwrap().insert(store.key(&kc));
    let r = rt
        .block_on(delete_with(&store, b.id, Duration::ZERO))
        .unwrap();
    assert_eq!(r.objects_deleted, 0, "{r:?}");
    assert!(whole(&rt, &store, &mb));
    // Served again: the next sweep completes B's delete.
    hooked.unserved.lock().unwrap().clear();
    rt.block_on(sweep(&store, Duration::ZERO)).unwrap();
    assert!(rt.block_on(store.size(&kb)).unwrap().is_none());
    for o in mb.objects().iter().filter(|o| o.inline.is_none()) {
        assert!(
            rt.block_on(store.size(&o.key())).unwrap().is_none(),
            "{}",
            o.key()
        );
    }
    assert!(whole(&rt, &store, &mc));
    let f = fetcher(&dir, &store, 1 << 30);
    assert!(read_all(&client(&f), c.id).unwrap() == c.img);
    drop(f);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A killed sandbox's snapshots go together, base listed first: both manifests at once
/// (the diff's before its base's), their objects once the grace period allows.
#[test]
fn a_chain_deleted_together_goes_whole() {
    use store::publish::delete_all;
    use store::sweep::sweep;
    let dir = tmp("delete-all");
    let store = Store::open(
        &format!("file://{}/store", dir.display()),
        &StoreOptions::default(),
    )
    .unwrap();
    let base = write_full(&dir.join("base"), 61);
    let diff = write_diff(&dir.join("diff"), &base);
    let rt = rt();
    rt.block_on(publish(&store, &base.files, &opts())).unwrap();
    rt.block_on(publish(&store, &diff.files, &opts())).unwrap();
    let r = rt
        .block_on(delete_all(&store, &[base.id, diff.id]))
        .unwrap();
    assert_eq!(r.objects_deleted, 2, "the two manifests: {r:?}");
    assert!(rt.block_on(store.list("snapshots")).unwrap().is_empty());
    assert!(r.objects_deferred > 0, "young objects wait: {r:?}");
    rt.block_on(sweep(&store, Duration::ZERO)).unwrap();
    assert_eq!(rt.block_on(store.list("")).unwrap(), Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&dir);
}

/// On the S3 server: a delete keeps a young object (the store's own clock says so), a
/// later sweep past the grace period removes what only the deleted snapshot named, and a
/// fork sibling sharing its disk layers stays whole throughout.
#[test]
fn on_s3_a_delete_keeps_young_objects_and_a_siblings_layers() {
    use store::sweep::{delete, delete_with, sweep};
    let dir = tmp("s3-delete");
    let server = store::s3server::S3Server::start(&dir.join("s3"), "clade").unwrap();
    let store = server
        .store("clade", "snaps", Duration::from_secs(10))
        .unwrap();
    let (layers, _) = disk_chain(&dir.join("disk"));
    let a = with_disk(write_full(&dir.join("a"), 71), &layers[0]);
    let b = with_disk(write_full(&dir.join("b"), 72), &layers[0]);
    let rt = rt();
    let (ma, _) = rt.block_on(publish(&store, &a.files, &opts())).unwrap();
    let (mb, _) = rt.block_on(publish(&store, &b.files, &opts())).unwrap();
    let r = rt.block_on(delete(&store, a.id)).unwrap();
    assert_eq!(r.objects_deleted, 1, "only the manifest: {r:?}");
    assert!(r.objects_deferred > 0, "{r:?}");
    assert!(whole(&rt, &store, &ma), "young: kept");
    assert!(rt
        .block_on(store.size(&ma.memory.data.key()))
        .unwrap()
        .is_some());
    rt.block_on(sweep(&store, Duration::ZERO)).unwrap();
    assert!(rt
        .block_on(store.size(&ma.memory.data.key()))
        .unwrap()
        .is_none());
    assert!(rt.block_on(store.list("deleted")).unwrap().is_empty());
    assert!(whole(&rt, &store, &mb));
    rt.block_on(delete_with(&store, b.id, Duration::ZERO))
        .unwrap();
    assert_eq!(rt.block_on(store.list("")).unwrap(), Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A full snapshot in `dir/s<seed>` with a recorded working set of about two chunks (so
/// that, published, it has a lead object): what the fault tests below open.
fn with_working_set(dir: &Path, seed: u64) -> Snap {
    let mut snap = write_full(&dir.join(format!("s{seed}")), seed);
    let pages = (snap.img.len() / PAGE) as u64;
    let ws_path = dir.join(format!("s{seed}")).join("working_set.ws");
    snapshot::working_set::WorkingSet {
        id: snap.id,
        page_count: pages,
        pages: (0..pages).step_by(25).collect(),
    }
    .save(&ws_path)
    .unwrap();
    snap.files.working_set = Some(ws_path);
    snap
}

/// A working-set chunk that fails its checksum in the store (the lead object's copy and
/// the data object's alike): every open fails promptly with a checksum error naming the
/// data object, the retry on the same cache as the first (it used to find the snapshot's
/// directory marked opened and verified, pass, and leave the VM to fault on the chunk),
/// also after a restart of the cache; once the bytes are back, an open succeeds, the
/// working set's chunks are present and memory reads back exactly.
#[test]
fn an_open_retried_after_a_working_set_chunk_failed_fails_again_until_the_store_is_whole() {
    let dir = tmp("ws-fault");
    let store = Store::open(
        &format!("file://{}/store", dir.display()),
        &StoreOptions::default(),
    )
    .unwrap();
    let snap = with_working_set(&dir, 43);
    let rt = rt();
    let (m, _) = rt.block_on(publish(&store, &snap.files, &opts())).unwrap();
    let ws_chunks = m.working_set_chunks();
    assert!(ws_chunks >= 2, "{ws_chunks}");
    let (data_key, lead_key) = (m.memory.data.key(), m.memory.lead.clone().unwrap().key());
    let good: Vec<(String, Bytes)> = [&data_key, &lead_key]
        .iter()
        .map(|k| (k.to_string(), rt.block_on(store.get(k)).unwrap()))
        .collect();
    // One byte of the second chunk flipped, in both copies.
    for (k, b) in &good {
        let mut bad = b.to_vec();
        bad[CHUNK as usize + 17] ^= 0x40;
        rt.block_on(store.put(k, Bytes::from(bad))).unwrap();
    }
    let f = fetcher(&dir, &store, 1 << 30);
    let c = client(&f);
    for attempt in 0..3 {
        let t = Instant::now();
        let err = c.open(snap.id).unwrap_err().to_string();
        assert!(
            err.contains(&store.key(&data_key))
                && err.contains("chunk 1 ")
                && err.contains("checksum"),
            "attempt {attempt}: {err}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "attempt {attempt}: {:?}",
            t.elapsed()
        );
    }
    // The same after a restart (the directory is loaded from disk).
    drop((c, f));
    let f = fetcher(&dir, &store, 1 << 30);
    let err = client(&f).open(snap.id).unwrap_err().to_string();
    assert!(err.contains("checksum"), "after a restart: {err}");

    // Whole again: opened, the working set present, memory exact.
    for (k, b) in &good {
        rt.block_on(store.put(k, b.clone())).unwrap();
    }
    let c = client(&f);
    c.open(snap.id).unwrap();
    let present = std::fs::read(
        dir.join("cache/snapshots")
            .join(snap.id.to_string())
            .join(store::cache::PRESENT_FILE),
    )
    .unwrap();
    assert!(
        present[..ws_chunks as usize].iter().all(|&p| p == 1),
        "{present:?}"
    );
    assert!(read_all(&c, snap.id).unwrap() == snap.img);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The open a restore makes checks that the store has every object the snapshot may still
/// read from it: a deleted memory data object (whose working set the lead object alone
/// brings, so a plain open succeeds) is an error naming it, for the snapshot itself and
/// for a base of its chain; a truncated one too; a deleted disk layer as well. A snapshot
/// wholly in the cache needs nothing from the store; the check costs one request per
/// object, made at once.
#[test]
fn an_open_for_a_restore_refuses_a_snapshot_whose_objects_are_gone() {
    let dir = tmp("exists");
    let store = Store::open(
        &format!("file://{}/store", dir.display()),
        &StoreOptions::default(),
    )
    .unwrap();
    let base = with_working_set(&dir, 47);
    let diff = write_diff(&dir.join("diff"), &base);
    let rt = rt();
    let (bm, _) = rt.block_on(publish(&store, &base.files, &opts())).unwrap();
    let (dm, _) = rt.block_on(publish(&store, &diff.files, &opts())).unwrap();
    let aside = |key: &str| {
        let b = rt.block_on(store.get(key)).unwrap();
        rt.block_on(store.delete(key)).unwrap();
        b
    };
    let missing =
        |err: &str, key: &str| err.contains(&format!("object {} does not exist", store.key(key)));

    // The base's data object gone: its working set comes from the lead object, so a plain
    // open passes (what a restore did before: its VM died at its first read of the rest),
    // a checked one does not; the diff above it neither.
    let bkey = bm.memory.data.key();
    let bdata = aside(&bkey);
    let f = fetcher(&dir.join("a"), &store, 1 << 30);
    let c = client(&f);
    c.open(base.id).unwrap();
    let s0 = c.stats().unwrap();
    let err = c.open_checked(base.id).unwrap_err().to_string();
    assert!(
        missing(&err, &bkey) && err.contains(&base.id.to_string()),
        "{err}"
    );
    assert_eq!(c.stats().unwrap().requests - s0.requests, 1, "one HEAD");
    let err = c.open_checked(diff.id).unwrap_err().to_string();
    assert!(
        missing(&err, &bkey) && !err.contains(&dm.memory.data.key()),
        "{err}"
    );
    // Both gone: both named, in one answer.
    let dkey = dm.memory.data.key();
    let ddata = aside(&dkey);
    let err = c.open_checked(diff.id).unwrap_err().to_string();
    assert!(missing(&err, &bkey) && missing(&err, &dkey), "{err}");
    // Truncated: its size is not the manifest's.
    rt.block_on(store.put(&dkey, ddata.slice(..ddata.len() - 4096)))
        .unwrap();
    rt.block_on(store.put(&bkey, bdata.clone())).unwrap();
    let err = c.open_checked(diff.id).unwrap_err().to_string();
    assert!(
        err.contains(&format!(
            "object {} is {} bytes",
            store.key(&dkey),
            ddata.len() - 4096
        )),
        "{err}"
    );
    // Whole again: it opens and reads back exactly.
    rt.block_on(store.put(&dkey, ddata.clone())).unwrap();
    c.open_checked(diff.id).unwrap();
    assert!(read_all(&c, diff.id).unwrap() == diff.img);
    // Every chunk is cached now: the check asks the store nothing, and passes even with
    // the objects gone (nothing will be read from them).
    aside(&bkey);
    aside(&dkey);
    let s1 = c.stats().unwrap();
    c.open_checked(diff.id).unwrap();
    assert_eq!(c.stats().unwrap().requests, s1.requests);
    rt.block_on(store.put(&bkey, bdata)).unwrap();
    rt.block_on(store.put(&dkey, ddata)).unwrap();
    drop((c, f));

    // A disk layer read lazily, gone from the store: named.
    let (layers, _) = disk_chain(&dir.join("disk"));
    let with = with_disk(write_full(&dir.join("d"), 48), &layers[0]);
    let (wm, _) = rt.block_on(publish(&store, &with.files, &opts())).unwrap();
    let layer = wm.disk.as_ref().unwrap().layers[1].object.key();
    let f = fetcher(&dir.join("b"), &store, 1 << 30);
    let c = client(&f);
    c.open_checked(with.id).unwrap();
    aside(&layer);
    let err = c.open_checked(with.id).unwrap_err().to_string();
    assert!(missing(&err, &layer), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
