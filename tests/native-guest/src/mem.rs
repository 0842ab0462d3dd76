//! The memory functions the compiler expects from libc. Written with
//! `rep movsb`/`rep stosb` in asm so they cannot be "optimised" into calls to
//! themselves.

use core::arch::asm;

#[no_mangle]
pub unsafe extern "C" fn memcpy(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    asm!("rep movsb", inout("rcx") n => _, inout("rdi") dest => _, inout("rsi") src => _,
         options(nostack, preserves_flags));
    dest
}

#[no_mangle]
pub unsafe extern "C" fn memmove(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dest as usize).wrapping_sub(src as usize) >= n {
        // No harmful overlap: a forward copy is fine.
        return memcpy(dest, src, n);
    }
    // dest overlaps the tail of src: copy backwards (DF=1), then restore DF.
    asm!("std", "rep movsb", "cld",
         inout("rcx") n => _, inout("rdi") dest.add(n).wrapping_sub(1) => _,
         inout("rsi") src.add(n).wrapping_sub(1) => _, options(nostack));
    dest
}

#[no_mangle]
pub unsafe extern "C" fn memset(dest: *mut u8, c: i32, n: usize) -> *mut u8 {
    asm!("rep stosb", inout("rcx") n => _, inout("rdi") dest => _, in("al") c as u8,
         options(nostack, preserves_flags));
    dest
}

#[no_mangle]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    for i in 0..n {
        let (x, y) = (*a.add(i), *b.add(i));
        if x != y {
            return x as i32 - y as i32;
        }
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    memcmp(a, b, n)
}
