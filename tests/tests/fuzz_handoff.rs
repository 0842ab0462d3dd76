//! Native KVM tier: bounded fuzzing of the fork hand-over decoder (what a fork child reads
//! from its parent): a real frozen VM's hand-over bytes, truncated, bit-flipped, overwritten
//! and random. Decoding must succeed or fail with an error, never panic or map memory from
//! a nonsensical description.

use clade_tests::guest_config;

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
fn mutated_hand_overs_decode_or_fail_cleanly() {
    let mut c = guest_config("loop:34");
    c.mem_mib = 32;
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    let (frozen, _) = vmm::freeze(&mut vm).unwrap();
    let (bytes, files) = frozen.handoff().unwrap();
    let files: Vec<std::fs::File> = files.iter().map(|f| f.try_clone().unwrap()).collect();
    // The untouched hand-over decodes.
    let dup = || {
        files
            .iter()
            .map(|f| f.try_clone().unwrap())
            .collect::<Vec<_>>()
    };
    vmm::Frozen::from_handoff(&bytes, dup()).unwrap();
    let mut rng = Rng(0x0068_616e_646f_6666);
    let rounds = 2000;
    let (mut decoded, mut refused) = (0, 0);
    for _ in 0..rounds {
        let mut b = bytes.clone();
        match rng.below(4) {
            0 => b.truncate(rng.below(b.len() as u64) as usize),
            1 => {
                for _ in 0..1 + rng.below(8) {
                    let i = rng.below(b.len() as u64) as usize;
                    b[i] ^= 1 << rng.below(8);
                }
            }
            2 => {
                let i = rng.below(b.len().min(512) as u64) as usize;
                b[i] = rng.next() as u8;
            }
            _ => b = (0..rng.below(4096)).map(|_| rng.next() as u8).collect(),
        }
        match vmm::Frozen::from_handoff(&b, dup()) {
            Ok(_) => decoded += 1,
            Err(_) => refused += 1,
        }
    }
    println!("fork hand-over: {rounds} inputs, {decoded} decoded, {refused} refused");
    assert!(refused > rounds / 2, "{refused} refused");
    vm.shutdown();
}
