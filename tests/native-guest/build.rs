//! Link the guest as a static, non-PIE ELF at the address given in link.ld.
//!
//! Link args are emitted here (not in .cargo/config.toml) because they need the
//! absolute path of link.ld, and because `cargo:rustc-link-arg` applies only to
//! this package's binary, not to the build script itself.

use std::env;
use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let script = dir.join("link.ld");
    println!("cargo:rerun-if-changed={}", script.display());
    println!("cargo:rerun-if-changed=build.rs");

    // RUSTFLAGS from the environment silently replaces the flags in
    // .cargo/config.toml; without no-redzone, interrupt frames would corrupt
    // locals. Fail loudly instead of building a subtly broken guest.
    let flags = env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    for needed in ["relocation-model=static", "no-redzone=yes"] {
        if !flags.split('\x1f').any(|f| f.ends_with(needed)) {
            panic!(
                "native-guest: rustflag `-C {needed}` missing (got {flags:?}); \
                 build from tests/native-guest with RUSTFLAGS and \
                 CARGO_ENCODED_RUSTFLAGS unset"
            );
        }
    }

    for arg in [
        "-nostartfiles",
        "-nostdlib",
        "-static",
        "-no-pie",
        "-Wl,--build-id=none",
        "-Wl,-z,max-page-size=0x1000",
        "-Wl,-z,noexecstack",
        "-Wl,-z,norelro",
    ] {
        println!("cargo:rustc-link-arg={arg}");
    }
    println!("cargo:rustc-link-arg=-Wl,-T,{}", script.display());
}
