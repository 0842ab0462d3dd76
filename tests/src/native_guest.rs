//! Builds the bare-metal native test guest (tests/native-guest) on demand.
//!
//! The guest has its own codegen and link flags (see its README), so it is built by a separate
//! cargo invocation into `target/native-guest`. Cargo's own freshness check makes repeated calls
//! cheap.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The repository root (this file is `tests/src/native_guest.rs`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|p| p.join("tests/native-guest/Cargo.toml").exists())
        .expect("repository root above CARGO_MANIFEST_DIR")
        .to_path_buf()
}

/// Path of the built guest ELF; builds it the first time it is asked for.
pub fn native_guest() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let root = repo_root();
        let target_dir = root.join("target/native-guest");
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["build", "--release", "--quiet"])
            .current_dir(root.join("tests/native-guest"))
            .env("CARGO_TARGET_DIR", &target_dir)
            // The guest's .cargo/config.toml flags must not be replaced by ours.
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("CARGO_BUILD_RUSTFLAGS")
            .status()
            .expect("running cargo to build the native test guest");
        assert!(status.success(), "building the native test guest failed");
        target_dir.join("release/native-guest")
    })
    .clone()
}
