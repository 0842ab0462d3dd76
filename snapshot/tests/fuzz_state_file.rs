//! Property-style fuzzing of the state-file decoder: truncations, bit flips, byte
//! overwrites and random bytes, both with and without re-fixed checksums (so the payload
//! decoder itself is exercised). Every input must give an error (never a panic), and no
//! single allocation may exceed a bound tied to the input size, whatever the lengths
//! inside the input say.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use common::Rng;
use serde::{Deserialize, Serialize};
use snapshot::state_file::{self, Expect, SnapshotMeta, HEADER_LEN};
use snapshot::{CpuCheck, Error, SnapshotId};

/// Records the largest single allocation while armed.
struct Counting;

static ARMED: AtomicBool = AtomicBool::new(false);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only records sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) {
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        }
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) {
            LARGEST.fetch_max(new_size, Ordering::Relaxed);
        }
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A state shaped like the VMM's: nested vectors, strings, maps, options, enums, arrays.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct VcpuState {
    regs: [u64; 18],
    msrs: Vec<(u32, u64)>,
    xsave: Vec<u32>,
    lapic: Vec<u8>,
    mp_state: u32,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum DeviceState {
    Serial {
        ier: u8,
        lcr: u8,
        fifo: Vec<u8>,
    },
    Virtio {
        features: u64,
        queues: Vec<(u64, u64, u64, u16)>,
        config: Vec<u8>,
    },
    Rtc(Option<u64>),
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct VmState {
    vcpus: Vec<VcpuState>,
    devices: std::collections::BTreeMap<String, DeviceState>,
    clock: u64,
    name: String,
}

fn sample_state() -> VmState {
    let vcpu = |i: u64| VcpuState {
        regs: [i; 18],
        msrs: (0..20).map(|k| (0xc000_0080 + k, k as u64 * i)).collect(),
        xsave: (0..1024).collect(),
        lapic: vec![i as u8; 1024],
        mp_state: 0,
    };
    let mut devices = std::collections::BTreeMap::new();
    devices.insert(
        "serial0".to_string(),
        DeviceState::Serial {
            ier: 1,
            lcr: 3,
            fifo: b"hello".to_vec(),
        },
    );
    devices.insert(
        "vsock".to_string(),
        DeviceState::Virtio {
            features: 1 << 32,
            queues: vec![(0x1000, 0x2000, 0x3000, 256); 3],
            config: vec![3, 0, 0, 0, 0, 0, 0, 0],
        },
    );
    devices.insert("rtc".to_string(), DeviceState::Rtc(Some(5)));
    VmState {
        vcpus: vec![vcpu(1), vcpu(2)],
        devices,
        clock: 123_456_789,
        name: "sandbox".into(),
    }
}

fn expect() -> Expect {
    Expect {
        cpu_check: CpuCheck::Ignore,
        ..Expect::default()
    }
}

/// Recompute both checksums so a mutated payload reaches the decoder.
fn fix_checksums(bytes: &mut [u8]) {
    if bytes.len() < HEADER_LEN {
        return;
    }
    let payload_len = (bytes.len() - HEADER_LEN) as u64;
    bytes[80..88].copy_from_slice(&payload_len.to_le_bytes());
    let crc = crc32fast::hash(&bytes[HEADER_LEN..]);
    bytes[88..92].copy_from_slice(&crc.to_le_bytes());
    let crc = crc32fast::hash(&bytes[..124]);
    bytes[124..128].copy_from_slice(&crc.to_le_bytes());
}

fn mutate(rng: &mut Rng, good: &[u8]) -> Vec<u8> {
    let mut b = good.to_vec();
    match rng.below(6) {
        0 => b.truncate(rng.below(good.len() as u64) as usize),
        1 => {
            for _ in 0..=rng.below(8) {
                let i = rng.below(b.len() as u64) as usize;
                b[i] ^= 1 << rng.below(8);
            }
        }
        2 => {
            let i = rng.below(b.len() as u64) as usize;
            let v = [0x00, 0xff, 0x7f, 0x80][rng.below(4) as usize];
            let n = (1 + rng.below(16) as usize).min(b.len() - i);
            b[i..i + n].fill(v);
        }
        3 => {
            let extra = rng.below(64) as usize;
            for _ in 0..extra {
                b.push(rng.next_u64() as u8);
            }
        }
        4 => {
            let n = rng.below(4096) as usize;
            b = vec![0; n];
            rng.fill(&mut b);
        }
        _ => {
            // Payload-only mutation: a varint length turned huge.
            let i = HEADER_LEN + rng.below((b.len() - HEADER_LEN) as u64) as usize;
            b[i] = 0xff;
            if i + 1 < b.len() {
                b[i + 1] = 0xff;
            }
        }
    }
    b
}

#[test]
fn mutated_state_files_never_panic_and_allocate_boundedly() {
    let meta = SnapshotMeta::full(SnapshotId::random(), 1 << 30);
    let good = state_file::encode(&meta, &sample_state()).unwrap();
    let (_, back): (_, VmState) = state_file::decode_from_bytes(&good, &expect()).unwrap();
    assert_eq!(back, sample_state());

    let mut rng = Rng::new(0xc1ade);
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    let mut largest = 0usize;
    let iterations = 20_000;
    for i in 0..iterations {
        let mut input = mutate(&mut rng, &good);
        let fixed = i % 2 == 0;
        if fixed {
            fix_checksums(&mut input);
        }
        LARGEST.store(0, Ordering::Relaxed);
        ARMED.store(true, Ordering::Relaxed);
        let r = std::panic::catch_unwind(|| {
            state_file::decode_from_bytes::<VmState>(&input, &expect()).map(|_| ())
        });
        ARMED.store(false, Ordering::Relaxed);
        let r = r.unwrap_or_else(|_| panic!("decoder panicked on input #{i}: {input:02x?}"));
        let big = LARGEST.load(Ordering::Relaxed);
        largest = largest.max(big);
        // serde caps preallocation at 1 MiB per collection; the decoded data itself is
        // bounded by the input length.
        assert!(
            big <= (1 << 20) + 8 * input.len(),
            "input #{i} ({} bytes) made a {big}-byte allocation",
            input.len()
        );
        if !fixed && input != good {
            assert!(
                r.is_err(),
                "mutated input #{i} accepted without fixed checksums"
            );
        }
        let key = match &r {
            Ok(()) => "Ok (checksums re-fixed, payload still decodes)",
            Err(e) => {
                // Errors render without panicking.
                let _ = e.to_string();
                name(e)
            }
        };
        *counts.entry(key.to_string()).or_default() += 1;
    }
    eprintln!("largest allocation {largest} bytes; outcomes: {counts:?}");
    // Both the framing checks and the decoder were reached.
    assert!(
        counts.get("Decode").copied().unwrap_or(0) > 100,
        "decoder rarely reached: {counts:?}"
    );
    for expected in ["NotASnapshot", "Truncated", "ChecksumMismatch", "Corrupt"] {
        assert!(counts.contains_key(expected), "no {expected}: {counts:?}");
    }
}

fn name(e: &Error) -> &'static str {
    match e {
        Error::NotASnapshot { .. } => "NotASnapshot",
        Error::UnsupportedVersion { .. } => "UnsupportedVersion",
        Error::Truncated { .. } => "Truncated",
        Error::ChecksumMismatch { .. } => "ChecksumMismatch",
        Error::Corrupt { .. } => "Corrupt",
        Error::Decode(_) => "Decode",
        Error::TooLarge { .. } => "TooLarge",
        Error::WrongHostCpu { .. } => "WrongHostCpu",
        Error::WrongKind { .. } => "WrongKind",
        _ => "other",
    }
}

#[test]
fn every_truncation_and_single_bit_flip_is_an_error() {
    let meta = SnapshotMeta::full(SnapshotId::random(), 0);
    let good = state_file::encode(&meta, &sample_state()).unwrap();
    for cut in 0..good.len() {
        assert!(
            state_file::decode_from_bytes::<VmState>(&good[..cut], &expect()).is_err(),
            "truncation to {cut} accepted"
        );
    }
    // Every bit of the header, and a sample of payload bits.
    let bits: Vec<usize> = (0..HEADER_LEN * 8)
        .chain((HEADER_LEN * 8..good.len() * 8).step_by(97))
        .collect();
    for bit in bits {
        let mut b = good.clone();
        b[bit / 8] ^= 1 << (bit % 8);
        assert!(
            state_file::decode_from_bytes::<VmState>(&b, &expect()).is_err(),
            "bit flip {bit} accepted"
        );
    }
}
