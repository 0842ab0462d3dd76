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

# The S3-compatible server the object-store tests and `clade bench restore --store` start
# on loopback (s3s-fs from crates.io: a small real S3 server; 0.14 is the last line this
# toolchain builds). Built once into build/tools.
S3S_VERSION=0.14.1
S3S_BIN="$REPO_ROOT/build/tools/bin/s3s-fs"
if ! "$S3S_BIN" --version 2>/dev/null | grep -q "$S3S_VERSION"; then
    echo "[setup] building s3s-fs $S3S_VERSION (S3 server for tests) into build/tools" >&2
    cargo install s3s-fs --version "=$S3S_VERSION" --features binary --root "$REPO_ROOT/build/tools" --quiet >&2
fi
