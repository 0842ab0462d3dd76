#!/usr/bin/env bash
# setup.sh: install what building and testing Clade needs on a fresh Debian machine.
# Idempotent and quick when everything is there. Sourced or run by demo.sh, test.sh, .ci/run.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

missing=()
while read -r pkg; do
    [ -n "$pkg" ] || continue
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done < "$REPO_ROOT/tests/nested/packages.txt"

if [ ${#missing[@]} -gt 0 ]; then
    echo "[setup] installing: ${missing[*]}" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi
command -v cargo >/dev/null || { echo "[setup] cargo not found: install a Rust toolchain (rustup)" >&2; exit 1; }

# The S3-compatible server the object-store tests and `clade bench restore|pause --store`
# start on loopback: tests/s3-server (the s3s-fs crate's S3 implementation with
# TCP_NODELAY on its connections; 0.14 is the last line this toolchain builds), built once
# into build/tools/bin.
S3_BIN="$REPO_ROOT/build/tools/bin/clade-test-s3"
S3_SRC="$REPO_ROOT/tests/s3-server"
S3_STAMP="$(cat "$S3_SRC/Cargo.toml" "$S3_SRC/Cargo.lock" "$S3_SRC/src/main.rs" | sha256sum | cut -c1-16)"
if [ "$(cat "$S3_BIN.stamp" 2>/dev/null)" != "$S3_STAMP" ] || [ ! -x "$S3_BIN" ]; then
    echo "[setup] building the test S3 server (tests/s3-server) into build/tools" >&2
    CARGO_TARGET_DIR="$REPO_ROOT/build/s3-server" cargo build --release --locked --quiet \
        --manifest-path "$S3_SRC/Cargo.toml" >&2
    mkdir -p "$(dirname "$S3_BIN")"
    cp "$REPO_ROOT/build/s3-server/release/clade-test-s3" "$S3_BIN"
    echo "$S3_STAMP" > "$S3_BIN.stamp"
fi
