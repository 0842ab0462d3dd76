//! Bounded fuzzing of the layer reader: a real layer with written blocks, then
//! truncations, bit flips, overwritten header bytes and random files. Opening must succeed
//! or give an error, never panic; what opens must read without panicking. Runs in CI.

use disk::ops::{self, CreateOptions};
use disk::{Disk, OpenOptions};

/// xorshift64*: deterministic pseudo-random numbers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

#[test]
fn mutated_layers_open_or_fail_cleanly() {
    let dir = std::env::temp_dir().join(format!("clade-disk-fuzz-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let layer = dir.join("layer.cdsk");
    ops::create(
        &layer,
        &CreateOptions {
            virtual_size: Some(4 << 20),
            ..Default::default()
        },
    )
    .unwrap();
    {
        let mut d = Disk::open(&layer, OpenOptions { read_only: false }).unwrap();
        for i in 0..16u64 {
            d.write_at(i * 200_000, &[i as u8 + 1; 5000]).unwrap();
        }
        d.flush().unwrap();
    }
    let original = std::fs::read(&layer).unwrap();
    let target = dir.join("fuzzed.cdsk");
    let mut rng = Rng(0x6469_736b_6675_7a7a);
    let rounds = 3000;
    let (mut opened, mut refused) = (0, 0);
    for _ in 0..rounds {
        let mut b = original.clone();
        match rng.below(4) {
            0 => b.truncate(rng.below(b.len() as u64) as usize),
            1 => {
                for _ in 0..1 + rng.below(8) {
                    let i = rng.below(b.len() as u64) as usize;
                    b[i] ^= 1 << rng.below(8);
                }
            }
            2 => {
                // The header and allocation table live at the front.
                let i = rng.below(b.len().min(8192) as u64) as usize;
                b[i] = rng.next() as u8;
            }
            _ => {
                b = (0..rng.below(16384)).map(|_| rng.next() as u8).collect();
            }
        }
        std::fs::write(&target, &b).unwrap();
        match Disk::open(&target, OpenOptions { read_only: true }) {
            Ok(d) => {
                opened += 1;
                let mut buf = vec![0u8; 65536];
                for off in [0u64, 200_000, 1 << 20, (4 << 20) - 65536] {
                    let _ = d.read_at(off, &mut buf);
                }
            }
            Err(_) => refused += 1,
        }
    }
    println!("disk layers: {rounds} inputs, {opened} opened, {refused} refused");
    assert!(
        refused > rounds / 2,
        "most mutations must be caught ({refused})"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
