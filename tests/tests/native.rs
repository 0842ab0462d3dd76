//! Native KVM tier: the project's bare-metal guest on this machine's KVM, through the same
//! VMM code path that boots Linux.

use std::time::{Duration, Instant};

use clade_tests::{guest_config, run_to_end};
use vmm::VmExit;

const T: Duration = Duration::from_secs(30);

#[test]
fn guest_exercises_pio_mmio_and_interrupt_wakeup_from_hlt() {
    let (status, out) = run_to_end(guest_config("hello,pio,mmio,hlt"), T);
    assert_eq!(status, VmExit::TestExit(0), "serial:\n{out}");
    assert!(out.starts_with("clade-native-guest: start\n"), "{out}");
    for step in ["hello", "pio", "mmio", "hlt"] {
        assert!(out.contains(&format!("step {step} ok")), "{step}: {out}");
    }
}

#[test]
fn counting_loop_runs_at_native_speed() {
    // 2^28 iterations: ~0.09 s native, ~380 s under this host's instruction emulation.
    let mut vm = vmm::boot(guest_config("loop:28")).unwrap();
    let t = Instant::now();
    vm.start().unwrap();
    let status = vm.wait_timeout(T).unwrap().expect("guest finished");
    let elapsed = t.elapsed();
    let out = String::from_utf8_lossy(&vm.serial_output().unwrap()).to_string();
    assert_eq!(status, VmExit::TestExit(0), "{out}");
    assert!(out.contains("loop 2^28 done"), "{out}");
    println!(
        "native counting loop: 2^28 iterations in {:.3} s (pvm_native={})",
        elapsed.as_secs_f64(),
        vm.pvm_native()
    );
    assert!(
        elapsed < Duration::from_secs(2),
        "2^28 iterations took {elapsed:?}: the guest is not running natively"
    );
}

#[test]
fn failing_step_and_unknown_step_give_their_result_codes() {
    let (status, out) = run_to_end(guest_config("hello,no-such-step"), T);
    assert_eq!(status, VmExit::TestExit(2), "{out}");
    assert_eq!(status.exit_code(), 2);
}

#[test]
fn several_vcpus_boot_with_the_bsp_running_the_guest() {
    let mut c = guest_config("hello,hlt");
    c.vcpus = 4;
    let (status, out) = run_to_end(c, T);
    assert_eq!(status, VmExit::TestExit(0), "{out}");
}

#[test]
fn large_memory_boots() {
    // 16 GiB: RAM is split around the 32-bit MMIO gap; pages are allocated lazily.
    let mut c = guest_config("hello,mmio");
    c.mem_mib = 16 << 10;
    if vmm::host_mem_mib().unwrap() < c.mem_mib {
        c.mem_mib = 4 << 10;
    }
    let (status, out) = run_to_end(c, T);
    assert_eq!(status, VmExit::TestExit(0), "{out}");
}

#[test]
fn pause_stops_the_guest_and_resume_continues_it() {
    // 2^31 iterations take ~0.7 s natively.
    let mut vm = vmm::boot(guest_config("loop:31")).unwrap();
    let t = Instant::now();
    vm.start().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    vm.pause().unwrap();
    assert!(vm.pause().is_err(), "pausing twice is a state error");
    let paused_for = Duration::from_millis(1500);
    assert_eq!(
        vm.wait_timeout(paused_for).unwrap(),
        None,
        "paused guest finished"
    );
    vm.unpause().unwrap();
    let status = vm.wait_timeout(T).unwrap().expect("resumed guest finishes");
    assert_eq!(status, VmExit::TestExit(0));
    assert!(t.elapsed() >= paused_for);
    assert!(vm.unpause().is_err(), "an ended VM cannot run again");
}

fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
fn shutdown_stops_a_busy_guest_and_leaves_no_threads() {
    let before = thread_count();
    {
        let mut c = guest_config("loop:50");
        c.vcpus = 2;
        let mut vm = vmm::boot(c).unwrap();
        vm.start().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        assert_eq!(vm.shutdown(), VmExit::Stopped);
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "stop took {:?}",
            t.elapsed()
        );
    }
    // Other tests run in parallel threads; allow them, but our two vCPU threads must be gone.
    let after = thread_count();
    assert!(
        after <= before + 8,
        "threads before {before}, after {after}"
    );
}
