//! Bounded fuzzing of what the store crate reads from others: manifests (from the store),
//! fetcher requests (from VM processes) and layouts (from the fetcher). Every input must be
//! accepted or refused with an error: never a panic, never an allocation sized by it.
//! Structure-aware mutations of a real manifest (numbers, runs, strings changed) as well as
//! byte-level ones. Runs in CI (seconds).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use store::cache::ChunkCache;
use store::fetcher::{FetcherThread, MAX_FRAME};
use store::location::StoreOptions;
use store::manifest::{chunks_for, layout_placements, Layout, Manifest};
use store::Store;

const ROUNDS: usize = 4000;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

fn sample() -> serde_json::Value {
    let z = "a".repeat(64);
    serde_json::json!({
        "format": "clade-snapshot", "version": 1,
        "id": "0123456789abcdef0123456789abcdef", "kind": "full", "base": null,
        "mem_size": 1u64 << 24,
        "state": {"sha256": z, "size": 10, "inline": "aGVsbG8gd29ybGQ="},
        "memory": {
            "head": {"sha256": z, "size": 4096},
            "data": {"sha256": z, "size": 3 * 4096, "name": "data/0123456789abcdef0123456789abcdef"},
            "runs": [[10, 2], [0, 1]],
            "chunk_size": 65536,
            "chunks": [z],
            "working_set_bytes": 8192
        },
        "working_set": null
    })
}

fn interesting(rng: &mut Rng) -> serde_json::Value {
    match rng.below(8) {
        0 => serde_json::json!(u64::MAX),
        1 => serde_json::json!(0),
        2 => serde_json::json!(-1),
        3 => serde_json::json!("../../../etc/passwd"),
        4 => serde_json::json!(null),
        5 => serde_json::json!([[u64::MAX, 2], [0, u64::MAX]]),
        6 => serde_json::json!(rng.below(1 << 40)),
        _ => serde_json::json!({"sha256": "x", "size": 1}),
    }
}

/// Replaces one value somewhere in the tree.
fn mutate_value(rng: &mut Rng, v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) if !m.is_empty() => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let k = &keys[rng.below(keys.len() as u64) as usize];
            let child = m.get_mut(k).unwrap();
            if rng.below(3) == 0 {
                *child = interesting(rng);
            } else {
                mutate_value(rng, child);
            }
        }
        serde_json::Value::Array(a) if !a.is_empty() => {
            let i = rng.below(a.len() as u64) as usize;
            if rng.below(4) == 0 {
                a.push(interesting(rng));
            } else {
                mutate_value(rng, &mut a[i]);
            }
        }
        other => *other = interesting(rng),
    }
}

#[test]
fn mutated_manifests_parse_or_fail_cleanly() {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let good = serde_json::to_vec(&sample()).unwrap();
    let m = Manifest::parse("k", &good).expect("the sample is valid");
    assert_eq!(m.chunk_count(), 1);
    let mut accepted = 0;
    for _ in 0..ROUNDS {
        let bytes = if rng.below(2) == 0 {
            let mut v = sample();
            for _ in 0..1 + rng.below(3) {
                mutate_value(&mut rng, &mut v);
            }
            serde_json::to_vec(&v).unwrap()
        } else {
            let mut b = good.clone();
            for _ in 0..1 + rng.below(6) {
                let i = rng.below(b.len() as u64) as usize;
                b[i] = rng.next() as u8;
            }
            b
        };
        if let Ok(m) = Manifest::parse("k", &bytes) {
            accepted += 1;
            // What a reader does with an accepted manifest must not panic either.
            let layout = Layout::of(&m);
            layout.check().unwrap();
            let p = layout_placements(&layout);
            let _ = chunks_for(&p, m.memory.chunk_size, 0, m.mem_size + 4096);
            let _ = layout.data_bitmap();
            for c in 0..m.chunk_count() {
                let (s, e) = m.chunk_range(c);
                assert!(s <= e && e <= m.memory.data.size);
            }
            for o in m.objects() {
                assert!(!o.key().contains(".."), "{}", o.key());
            }
        }
    }
    assert!(accepted > 0, "some mutations keep the manifest valid");
}

#[test]
fn garbage_layouts_are_refused() {
    let mut rng = Rng(77);
    for _ in 0..ROUNDS {
        let l = Layout {
            mem_size: rng.next() >> rng.below(64),
            head_size: rng.next() >> rng.below(64),
            chunk_size: rng.next() >> rng.below(64),
            runs: (0..rng.below(4))
                .map(|_| [rng.next() >> rng.below(64), rng.next() >> rng.below(64)])
                .collect(),
        };
        if l.check().is_ok() {
            let p = layout_placements(&l);
            let _ = chunks_for(&p, l.chunk_size, rng.next(), rng.next());
            let _ = l.data_bitmap();
        }
    }
}

#[test]
fn the_fetcher_answers_garbage_requests_with_errors() {
    let dir = std::env::temp_dir().join(format!("clade-fuzz-fetcher-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let store = Store::open("memory://b/p", &StoreOptions::default()).unwrap();
    let cache = ChunkCache::new(&dir.join("cache"), store, 1 << 20).unwrap();
    let f = FetcherThread::start(&dir.join("f.sock"), cache).unwrap();
    let mut rng = Rng(99);
    let requests: Vec<Vec<u8>> = vec![
        b"{}".to_vec(),
        b"not json".to_vec(),
        br#"{"op":"ensure","id":"0123456789abcdef0123456789abcdef","offset":0,"len":18446744073709551615}"#.to_vec(),
        br#"{"op":"prefetch","id":"zz","ranges":[[0,1]]}"#.to_vec(),
        br#"{"op":"open","id":"../../x"}"#.to_vec(),
        br#"{"op":"open","id":"0123456789abcdef0123456789abcdef"}"#.to_vec(),
        br#"{"op":"stats"}"#.to_vec(),
    ];
    let mut s = UnixStream::connect(f.socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let call = |s: &mut UnixStream, body: &[u8]| -> serde_json::Value {
        let mut out = (body.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(body);
        s.write_all(&out).unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut buf = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut buf).unwrap();
        serde_json::from_slice(&buf).unwrap()
    };
    for r in &requests {
        let a = call(&mut s, r);
        let ok = a["ok"].as_bool().unwrap();
        assert_eq!(ok, r.starts_with(br#"{"op":"stats"}"#), "{a}");
    }
    for _ in 0..200 {
        let mut r = requests[rng.below(requests.len() as u64) as usize].clone();
        let i = rng.below(r.len() as u64) as usize;
        r[i] = rng.next() as u8;
        let a = call(&mut s, &r);
        assert!(a["ok"].is_boolean(), "{a}");
    }
    // An oversized frame ends that connection, not the fetcher.
    let mut big = UnixStream::connect(f.socket()).unwrap();
    big.write_all(&((MAX_FRAME as u32) + 1).to_le_bytes())
        .unwrap();
    let mut b = [0u8; 1];
    big.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(big.read(&mut b).unwrap(), 0, "closed");
    let a = call(&mut s, br#"{"op":"stats"}"#);
    assert_eq!(a["ok"], true);
    drop(f);
    let _ = std::fs::remove_dir_all(&dir);
}
