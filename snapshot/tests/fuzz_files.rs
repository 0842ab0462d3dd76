//! Bounded fuzzing of the memory-file and working-set readers: truncations, bit flips,
//! byte overwrites and random bytes over real files. Every input must open cleanly or give
//! an error: never a panic, never a read outside the file. Runs in CI (a few thousand
//! inputs per format, seconds).

mod common;

use common::{make_image, Rng, PAGE};
use snapshot::memory_file::{self, GuestRegion, MemoryChain, MemoryFile, RegionData};
use snapshot::working_set::WorkingSet;
use snapshot::SnapshotId;
use vmm_sys_util::tempdir::TempDir;

const ROUNDS: usize = 3000;

fn mutate(rng: &mut Rng, original: &[u8]) -> Vec<u8> {
    let mut b = original.to_vec();
    match rng.below(5) {
        0 => b.truncate(rng.below(b.len() as u64 + 1) as usize),
        1 => {
            for _ in 0..1 + rng.below(8) {
                let i = rng.below(b.len() as u64) as usize;
                b[i] ^= 1 << rng.below(8);
            }
        }
        2 => {
            // Overwrite a header field-sized window near the start with random bytes.
            let i = rng.below(b.len().min(256) as u64) as usize;
            let n = (1 + rng.below(8) as usize).min(b.len() - i);
            rng.fill(&mut b[i..i + n]);
        }
        3 => {
            let extra = rng.below(4096) as usize;
            let mut tail = vec![0u8; extra];
            rng.fill(&mut tail);
            b.extend(tail);
        }
        _ => {
            let mut r = vec![0u8; rng.below(8192) as usize];
            rng.fill(&mut r);
            b = r;
        }
    }
    b
}

#[test]
fn mutated_memory_files_open_or_fail_cleanly() {
    let dir = TempDir::new_with_prefix("/tmp/clade-fuzz").unwrap();
    let image = make_image(64, 7);
    let path = dir.as_path().join("memory.mem");
    memory_file::write_full(
        &path,
        SnapshotId::random(),
        &[GuestRegion {
            guest_addr: 0,
            data: RegionData::Slice(&image),
        }],
    )
    .unwrap();
    let original = std::fs::read(&path).unwrap();
    let target = dir.as_path().join("fuzzed.mem");
    let mut rng = Rng::new(0x6d65_6d66);
    let (mut opened, mut refused) = (0, 0);
    for _ in 0..ROUNDS {
        std::fs::write(&target, mutate(&mut rng, &original)).unwrap();
        match MemoryFile::open(&target) {
            Ok(f) => {
                opened += 1;
                // What opened must also read back without panicking.
                if let Ok(chain) = MemoryChain::new(vec![f]) {
                    let mut out = vec![
                        0u8;
                        chain
                            .regions()
                            .iter()
                            .map(|r| r.size)
                            .sum::<u64>()
                            .min(1 << 24) as usize
                    ];
                    let _ = chain.restore_into(&mut out, memory_file::HoleFill::Zero);
                }
            }
            Err(_) => refused += 1,
        }
    }
    println!("memory file: {ROUNDS} inputs, {opened} opened, {refused} refused");
    assert!(
        refused > ROUNDS / 2,
        "most mutations must be caught ({refused})"
    );
    let _ = PAGE;
}

#[test]
fn mutated_working_sets_load_or_fail_cleanly() {
    let dir = TempDir::new_with_prefix("/tmp/clade-fuzz").unwrap();
    let id = SnapshotId::random();
    let ws = WorkingSet {
        id,
        page_count: 1024,
        pages: (0..300).map(|i| (i * 7) % 1024).collect(),
    };
    let path = dir.as_path().join("working_set.ws");
    ws.save(&path).unwrap();
    let original = std::fs::read(&path).unwrap();
    let mut rng = Rng::new(0x7773_6673);
    let (mut loaded, mut refused) = (0, 0);
    for _ in 0..ROUNDS {
        std::fs::write(&path, mutate(&mut rng, &original)).unwrap();
        match WorkingSet::load(&path, id, 1024) {
            Ok(w) => {
                loaded += 1;
                assert!(
                    w.pages.iter().all(|&p| p < 1024),
                    "page out of range accepted"
                );
            }
            Err(_) => refused += 1,
        }
    }
    println!("working set: {ROUNDS} inputs, {loaded} loaded, {refused} refused");
    // The same with both checksums repaired after the mutation, so that what lies behind
    // them (version, counts, id, page numbers, the length of the file) is what is tested.
    let (mut loaded_fixed, mut refused_fixed) = (0, 0);
    for _ in 0..ROUNDS {
        let mut b = mutate(&mut rng, &original);
        if b.len() >= 48 {
            let entries_crc = crc32fast::hash(&b[48..]);
            b[40..44].copy_from_slice(&entries_crc.to_le_bytes());
            let header_crc = crc32fast::hash(&b[..44]);
            b[44..48].copy_from_slice(&header_crc.to_le_bytes());
        }
        std::fs::write(&path, &b).unwrap();
        match WorkingSet::load(&path, id, 1024) {
            Ok(w) => {
                loaded_fixed += 1;
                assert!(
                    w.pages.iter().all(|&p| p < 1024),
                    "page out of range accepted"
                );
                assert!(w.pages.len() <= 1024, "more pages than the memory has");
            }
            Err(_) => refused_fixed += 1,
        }
    }
    println!(
        "working set, checksums repaired: {ROUNDS} inputs, {loaded_fixed} loaded, \
         {refused_fixed} refused"
    );
    assert!(loaded_fixed > 0, "no repaired input got past the checksums");
    assert!(
        refused > ROUNDS / 2,
        "most mutations must be caught ({refused})"
    );
}
