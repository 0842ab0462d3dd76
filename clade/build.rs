//! Builds the bare-metal native test guest (tests/native-guest) and copies its ELF to
//! `$OUT_DIR/native-guest`, where `clade bench` embeds it (`include_bytes!`), so that
//! `cargo build --release && target/release/clade bench ping` needs no other step.
//!
//! The guest is its own cargo workspace with its own codegen flags
//! (tests/native-guest/.cargo/config.toml) and link arguments (its build.rs); it is built by
//! a separate cargo invocation run from its directory, with every variable that would
//! replace those flags, redirect its output or change its target removed.

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Files of the guest whose change rebuilds it (directories are scanned recursively).
const GUEST_INPUTS: &[&str] = &[
    "src",
    "Cargo.toml",
    "Cargo.lock",
    "build.rs",
    "link.ld",
    ".cargo/config.toml",
];

/// Variables of this (outer) build that must not reach the guest's cargo: they would
/// replace the guest's rustflags (its build.rs then refuses to build), put its output
/// elsewhere, build it for another target, or run a wrapper (clippy) over it.
const REMOVED_ENV: &[&str] = &[
    "RUSTFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "CARGO_BUILD_RUSTFLAGS",
    "CARGO_TARGET_DIR",
    "CARGO_BUILD_TARGET",
    "RUSTC_WORKSPACE_WRAPPER",
    "CLIPPY_ARGS",
];

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let guest_dir = manifest_dir.join("../tests/native-guest");

    for input in GUEST_INPUTS {
        println!("cargo:rerun-if-changed={}", guest_dir.join(input).display());
    }
    println!("cargo:rerun-if-changed=build.rs");

    if !guest_dir.join("Cargo.toml").is_file() {
        fail(&format!(
            "the native test guest's sources are missing ({} has no Cargo.toml); \
             `clade bench` embeds that guest and is built from the Clade repository",
            guest_dir.display()
        ));
    }

    let target_dir = out_dir.join("native-guest-target");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(&cargo);
    for var in REMOVED_ENV {
        cmd.env_remove(var);
    }
    cmd.args(["build", "--release"])
        .current_dir(&guest_dir)
        .env("CARGO_TARGET_DIR", &target_dir)
        // Cargo reads directives from this script's stdout: keep the guest build's output
        // out of it.
        .stdout(Stdio::from(std::io::stderr()));
    let status = match cmd.status() {
        Ok(s) => s,
        Err(e) => fail(&format!(
            "cannot run {} to build the native test guest: {e}",
            Path::new(&cargo).display()
        )),
    };
    if !status.success() {
        fail(&format!(
            "building the native test guest failed ({status}); its cargo output is above. \
             Reproduce with `cd tests/native-guest && env -u RUSTFLAGS -u CARGO_ENCODED_RUSTFLAGS \
             cargo build --release`"
        ));
    }

    let elf = target_dir.join("release/native-guest");
    let dest = out_dir.join("native-guest");
    if let Err(e) = std::fs::copy(&elf, &dest) {
        fail(&format!(
            "copying the native test guest {} to {}: {e}",
            elf.display(),
            dest.display()
        ));
    }
}

/// Ends the build with `msg` (cargo shows a build script's output when it fails).
fn fail(msg: &str) -> ! {
    eprintln!("error: clade build script: {msg}");
    println!("cargo:warning=clade: {msg}");
    std::process::exit(1);
}
