//! Times range reads of objects of several sizes on the test S3 server: what one chunk
//! fetch costs there, apart from Clade.
use std::time::{Duration, Instant};
fn main() {
    let dir = std::env::temp_dir().join("clade-range-probe");
    let server = store::s3server::S3Server::start(&dir, "bkt").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let s = {
        let _g = rt.enter();
        server.store("bkt", "p", Duration::from_secs(30)).unwrap()
    };
    for size in [16usize << 20] {
        let data = bytes::Bytes::from(vec![7u8; size]);
        let key = format!("o{size}");
        rt.block_on(store::publish::upload_bytes(
            &s,
            &key,
            data,
            &Default::default(),
        ))
        .unwrap();
        for len in [
            64u64 << 10,
            128 << 10,
            256 << 10,
            512 << 10,
            1 << 20,
            2 << 20,
            4 << 20,
        ] {
            let mut v = Vec::new();
            for _ in 0..5 {
                let t = Instant::now();
                rt.block_on(s.get_range(&key, 0, len.min(size as u64)))
                    .unwrap();
                v.push(t.elapsed().as_micros());
            }
            println!(
                "object {} MiB, range {} KiB: {v:?} us",
                size >> 20,
                len >> 10
            );
        }
    }
}
