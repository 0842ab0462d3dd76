//! Bounded fuzzing of the layer reader: real layers (a writable version-2 layer with written
//! blocks, the same layer frozen, so with both header slots in use, and a version-1 layer
//! as older builds wrote them), then truncations, bit flips, overwritten header bytes and
//! random files. Opening must succeed or give an error, never panic; what opens must read
//! without panicking; damage confined to one header slot of a layer whose two slots are
//! valid must never make it unopenable. Runs in CI; `CLADE_FUZZ_ROUNDS` sets the inputs
//! per layer (default 400).

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

fn rounds() -> usize {
    std::env::var("CLADE_FUZZ_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400)
}

fn write_blocks(path: &std::path::Path) {
    let mut d = Disk::open(path, OpenOptions { read_only: false }).unwrap();
    for i in 0..16u64 {
        d.write_at(i * 200_000, &[i as u8 + 1; 5000]).unwrap();
    }
    d.flush().unwrap();
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
    write_blocks(&layer);
    let writable = std::fs::read(&layer).unwrap();
    ops::freeze(&layer).unwrap();
    let frozen = std::fs::read(&layer).unwrap();
    // A version-1 layer: one header slot, the table at 4096.
    let v1 = dir.join("v1.cdsk");
    let mut h = disk::Header::new(4 << 20, disk::DEFAULT_BLOCK_SIZE, [5; 16], None).unwrap();
    h.version = disk::VERSION_1;
    h.sequence = 0;
    h.table_offset = disk::HEADER_SIZE;
    let mut b = h.encode();
    b.resize(h.data_offset as usize, 0);
    std::fs::write(&v1, &b).unwrap();
    write_blocks(&v1);
    ops::freeze(&v1).unwrap();
    let version1 = std::fs::read(&v1).unwrap();

    let target = dir.join("fuzzed.cdsk");
    let mut rng = Rng(0x6469_736b_6675_7a7a);
    let rounds = rounds();
    let (mut opened, mut refused) = (0, 0);
    let mut one_slot = 0;
    for (name, original) in [
        ("writable", &writable),
        ("frozen", &frozen),
        ("version 1", &version1),
    ] {
        for _ in 0..rounds {
            let mut b = original.clone();
            let mut slot_only = false;
            match rng.below(5) {
                0 => b.truncate(rng.below(b.len() as u64) as usize),
                1 => {
                    for _ in 0..1 + rng.below(8) {
                        let i = rng.below(b.len() as u64) as usize;
                        b[i] ^= 1 << rng.below(8);
                    }
                }
                2 => {
                    // The header slots and the allocation table live at the front.
                    let i = rng.below(b.len().min(12288) as u64) as usize;
                    b[i] = rng.next() as u8;
                }
                3 => {
                    // Damage confined to one header slot (a torn or scribbled write).
                    let slot = rng.below(2) as usize * 4096;
                    let from = slot + rng.below(4096) as usize;
                    let to = from + 1 + rng.below((slot + 4096 - from) as u64) as usize;
                    for x in &mut b[from..to] {
                        *x = rng.next() as u8;
                    }
                    slot_only = true;
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
                Err(e) => {
                    assert!(
                        !(slot_only && name == "frozen"),
                        "damage to one header slot of a layer with two made it unopenable: {e}"
                    );
                    refused += 1;
                }
            }
            one_slot += usize::from(slot_only && name == "frozen");
        }
    }
    let total = 3 * rounds;
    println!(
        "disk layers: {total} inputs ({rounds} per layer: writable, frozen, version 1), \
         {opened} opened, {refused} refused, {one_slot} one-slot damages of the frozen layer \
         all opened"
    );
    assert!(
        refused > total / 3,
        "most mutations must be caught ({refused})"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
