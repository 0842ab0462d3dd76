//! Clade native test guest: a tiny bare-metal x86_64 program the VMM boots
//! directly in long mode. It runs the steps named on the kernel command line
//! (`steps=hello,pio,...`), reports each on COM1 and exits through the test
//! device's exit port with 0 (all ok), 1 (a step failed), 2 (bad command
//! line), 3 (panic) or 0x100+vector (CPU exception).
//!
//! Boot contract: see README.md.

#![no_std]
#![no_main]

#[macro_use]
mod serial;
mod agent;
mod apic;
mod clock;
mod cmdline;
mod interrupts;
mod io;
mod mem;
mod memtest;
mod steps;
mod testdev;
mod virtio;
mod vsock;

use core::arch::global_asm;

// Entry point. The VMM's RSP is not guaranteed to point at usable memory, so
// switch to our own stack first, then zero .bss (Rust statics rely on it; the
// stack lives there too, which is fine since nothing is on it yet).
global_asm!(
    r#"
    .section .text.start, "ax"
    .global _start
_start:
    cld
    mov r12, rsi                    // Linux boot_params ("zero page")
    lea rsp, [rip + boot_stack_top]
    xor ebp, ebp
    lea rdi, [rip + __bss_start]
    lea rcx, [rip + __bss_end]
    sub rcx, rdi
    xor eax, eax
    rep stosb
    mov rdi, r12
    call rust_main                  // never returns
2:  hlt
    jmp 2b

    .section .bss.boot_stack, "aw", @nobits
    .balign 16
boot_stack_bottom:
    .skip 65536
boot_stack_top:
"#
);

#[no_mangle]
extern "C" fn rust_main(boot_params: u64) -> ! {
    clock::init();
    serial::write_str("clade-native-guest: start\n");
    interrupts::init_idt();

    // SAFETY: the VMM passes a valid zero page (or 0) in RSI.
    let line = unsafe { cmdline::from_boot_params(boot_params) };
    let args = match cmdline::Args::parse(line) {
        Ok(args) => args,
        Err(msg) => {
            println!("clade-native-guest: bad command line: {}", msg);
            finish(2)
        }
    };
    interrupts::set_vif_cell(args.vif);
    // SAFETY: as above.
    unsafe { memtest::init(boot_params) };

    finish(steps::run(args.steps, args.vsock))
}

fn finish(code: u32) -> ! {
    println!("clade-native-guest: done {}", code);
    testdev::exit(code)
}

/// Referenced from libcore's (discarded) unwind tables even with
/// panic=abort; never called.
#[no_mangle]
extern "C" fn rust_eh_personality() {}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    println!("clade-native-guest: panic: {}", info);
    testdev::exit(3)
}
