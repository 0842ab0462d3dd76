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
