//! IDT, interrupt entry stubs and dispatch, and enabling/disabling interrupts
//! (sti/cli on hardware KVM, the "virtual interrupt flag" cell under PVM).
//!
//! Every vector gets a stub, so an exception (vector < 32) is reported on
//! serial and ends the VM with 0x100 + vector instead of turning into a silent
//! triple fault; an external interrupt without a handler is logged and EOI'd.
//!
//! [`wait_for_interrupt`] is the idle primitive: enable interrupts and halt, without losing
//! a wake-up that arrives between the two. With `sti` the CPU's one-instruction interrupt
//! shadow makes `sti; hlt` atomic. The PVM hypervisor's virtual interrupt flag is a plain
//! memory write with no such shadow, so an interrupt may be taken after it and before the
//! `hlt`; the dispatcher then moves the saved RIP past the `hlt` (a restartable sequence,
//! as some kernels do for their idle loops), and the guest returns from the interrupt to
//! the instruction after it instead of halting until the next one.

use crate::apic;
use crate::testdev;
use core::arch::{asm, global_asm};
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

pub const VEC_SPURIOUS: u8 = 0xFF;

/// 64-bit code selector from the boot contract. Deliberately not read from CS:
/// under the PVM hypervisor, guest "kernel" code runs in hardware user mode
/// and `mov ax, cs` returns the host's user selector (0x33), which would make
/// every gate invalid.
const KERNEL_CS: u64 = 0x8;

/// Register state saved by the entry stubs (lowest address first).
#[repr(C)]
struct Frame {
    rbp: u64,
    r11: u64,
    r10: u64,
    r9: u64,
    r8: u64,
    rdi: u64,
    rsi: u64,
    rdx: u64,
    rcx: u64,
    rax: u64,
    vector: u64,
    error: u64, // CPU error code, or 0 pushed by the stub
    rip: u64,
    cs: u64,
    rflags: u64,
    rsp: u64,
    ss: u64,
}

// 256 stubs, 16 bytes apart (each is at most 12 bytes). Each pushes a dummy error code (unless the CPU
// pushes one for that vector) and the vector number, then jumps to the common
// path, which saves the caller-saved GPRs and the FPU/SSE state (Rust code
// uses SSE registers; the interrupted code expects them preserved), calls
// `interrupt_dispatch` with a 16-byte aligned stack, and returns with iretq.
global_asm!(
    r#"
    .section .text.isr, "ax"
    .balign 16
    .global isr_stubs
isr_stubs:
    .set vec, 0
    .rept 256
    .balign 16
    .if (vec == 8) || ((vec >= 10) && (vec <= 14)) || (vec == 17) || (vec == 21) || (vec == 29) || (vec == 30)
    .else
    pushq $0
    .endif
    pushq $vec
    jmp isr_common
    .set vec, vec + 1
    .endr

isr_common:
    push %rax
    push %rcx
    push %rdx
    push %rsi
    push %rdi
    push %r8
    push %r9
    push %r10
    push %r11
    push %rbp
    mov %rsp, %rbp
    and $-16, %rsp
    sub $512, %rsp
    fxsave64 (%rsp)
    cld
    mov %rbp, %rdi
    call interrupt_dispatch
    fxrstor64 (%rsp)
    mov %rbp, %rsp
    pop %rbp
    pop %r11
    pop %r10
    pop %r9
    pop %r8
    pop %rdi
    pop %rsi
    pop %rdx
    pop %rcx
    pop %rax
    add $16, %rsp
    iretq
"#,
    options(att_syntax)
);

const STUB_SIZE: u64 = 16;

// The idle sequence: enable interrupts (VIF cell in rdi, or sti if rdi is 0), halt, return
// with interrupts still enabled (the caller disables them). Between `idle_window_start` and
// `idle_window_end` an interrupt means "do not halt": see `skip_halt`.
global_asm!(
    r#"
    .section .text.idle, "ax"
    .global idle_halt
idle_halt:
    test rdi, rdi
    jz 2f
    .global idle_window_start
idle_window_start:
    mov byte ptr [rdi], 1
    hlt
    .global idle_window_end
idle_window_end:
    ret
2:  sti
    hlt
    ret
"#
);

extern "C" {
    static isr_stubs: u8;
    static idle_window_start: u8;
    static idle_window_end: u8;
    fn idle_halt(vif_cell: u64);
}

#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct Gate([u64; 2]);

static mut IDT: [Gate; 256] = [Gate([0; 2]); 256];

/// Handlers for vectors >= 32, registered with `set_handler` (0 = none).
static HANDLERS: [AtomicUsize; 256] = [const { AtomicUsize::new(0) }; 256];

/// Guest-physical address of the PVM VIF cell, 0 when sti/cli are used.
static VIF_CELL: AtomicU64 = AtomicU64::new(0);

/// Fill all 256 IDT entries with 64-bit interrupt gates (interrupts stay
/// disabled inside handlers) and load the IDT.
pub fn init_idt() {
    let stubs = core::ptr::addr_of!(isr_stubs) as u64;
    // SAFETY: single CPU, interrupts are disabled while the IDT is written.
    let idt = unsafe { &mut *core::ptr::addr_of_mut!(IDT) };
    for (vec, gate) in idt.iter_mut().enumerate() {
        let h = stubs + vec as u64 * STUB_SIZE;
        let low = (h & 0xffff)
            | KERNEL_CS << 16
            | 0x8e << 40 // present, DPL 0, 64-bit interrupt gate
            | ((h >> 16) & 0xffff) << 48;
        *gate = Gate([low, h >> 32]);
    }
    #[repr(C, packed)]
    struct Idtr {
        limit: u16,
        base: u64,
    }
    let idtr = Idtr {
        limit: core::mem::size_of_val(idt) as u16 - 1,
        base: idt.as_ptr() as u64,
    };
    // SAFETY: the IDT is a static and the stubs exist for all vectors.
    unsafe { asm!("lidt [{}]", in(reg) &idtr, options(readonly, nostack, preserves_flags)) };
}

/// Install `handler` for an external interrupt vector; the dispatcher sends
/// the local APIC EOI after it returns.
pub fn set_handler(vector: u8, handler: fn()) {
    assert!(vector >= 32);
    HANDLERS[vector as usize].store(handler as usize, Ordering::Release);
}

pub fn clear_handler(vector: u8) {
    HANDLERS[vector as usize].store(0, Ordering::Release);
}

/// An interrupt taken inside the idle window, before its `hlt` ran, resumes after the
/// `hlt`: the wake-up it brings is not lost.
fn skip_halt(frame: &mut Frame) {
    let start = core::ptr::addr_of!(idle_window_start) as u64;
    let end = core::ptr::addr_of!(idle_window_end) as u64;
    if (start..end).contains(&frame.rip) {
        frame.rip = end;
    }
}

#[no_mangle]
extern "C" fn interrupt_dispatch(frame: &mut Frame) {
    let vector = frame.vector as u8;
    if vector >= 32 {
        skip_halt(frame);
    }
    let handler = HANDLERS[vector as usize].load(Ordering::Acquire);
    if vector >= 32 && handler != 0 {
        // SAFETY: only `fn()` values are stored by set_handler.
        let handler: fn() = unsafe { core::mem::transmute(handler) };
        handler();
        apic::eoi();
        return;
    }
    if vector == VEC_SPURIOUS {
        return; // spurious: no EOI
    }
    if vector >= 32 {
        // No handler (any more): e.g. a device edge or timer tick that was
        // already in flight when a step unregistered its handler. Harmless.
        println!("ignored interrupt {}", vector);
        apic::eoi();
        return;
    }
    println!(
        "exception {} rip={:#x} err={:#x}",
        vector, frame.rip, frame.error
    );
    testdev::exit(0x100 + vector as u32)
}

/// Select how interrupts are enabled: through the PVM VIF cell at `cell`
/// (byte 0 = interrupt enable, written by us; byte 1 = pending, written by the
/// hypervisor), or with sti/cli if None.
pub fn set_vif_cell(cell: Option<u64>) {
    VIF_CELL.store(cell.unwrap_or(0), Ordering::Relaxed);
}

pub fn enable() {
    match VIF_CELL.load(Ordering::Relaxed) {
        // SAFETY: sti only allows interrupts, whose handlers are installed.
        0 => unsafe { asm!("sti", options(nomem, nostack)) },
        // SAFETY: the VMM gave us this cell's address on the command line.
        cell => unsafe { core::ptr::write_volatile(cell as *mut u8, 1) },
    }
}

/// Enables interrupts, halts until one has been handled (or returns at once if one was
/// handled since enabling), and disables them again. The caller checks, with interrupts
/// disabled, that it has nothing to do before calling: an interrupt that arrives after that
/// check is then taken here and ends the halt, whenever it arrives.
pub fn wait_for_interrupt() {
    // SAFETY: enabling interrupts runs registered handlers, which save and restore all the
    // state the interrupted code uses; the VIF cell (if any) is the VMM's, as in enable().
    unsafe { idle_halt(VIF_CELL.load(Ordering::Relaxed)) };
    disable();
}

pub fn disable() {
    match VIF_CELL.load(Ordering::Relaxed) {
        // SAFETY: cli has no memory effects.
        0 => unsafe { asm!("cli", options(nomem, nostack)) },
        // SAFETY: as in enable().
        cell => unsafe { core::ptr::write_volatile(cell as *mut u8, 0) },
    }
}
