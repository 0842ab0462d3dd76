#!/usr/bin/env bash
# test.sh: every test tier. Exit 0 only if all pass.
#   1. unit tests            (no KVM)                       cargo test, next to the code
#   2. native KVM tier       (project's bare-metal guest)   cargo test: tests/tests, vmm/tests
#   3. nested tier           (Debian kernel, nested KVM)    tests/nested/run.sh
# Set CLADE_SKIP_NESTED=1 to run only tiers 1 and 2.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
"$REPO_ROOT/scripts/setup.sh"

echo "== lint: cargo fmt --check, cargo clippy -D warnings"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

LOG="$REPO_ROOT/target/cargo-test.log"
mkdir -p "$REPO_ROOT/target"
echo "== tiers 1+2: unit and native KVM tests"
cargo test --workspace -- --nocapture 2>&1 | tee "$LOG"
# Totals over every test binary, for the closing summary line.
sum() { grep -E '^test result:' "$LOG" | grep -oE "[0-9]+ $1" | awk '{s += $1} END {print s + 0}'; }
passed=$(sum passed)
failed=$(sum failed)
grep -h 'native counting loop' "$LOG" || true

if [ "${CLADE_SKIP_NESTED:-0}" = 1 ]; then
    echo "== tier 3 (nested) skipped: CLADE_SKIP_NESTED=1"
else
    echo "== tier 3: nested (Debian kernel booted by clade under nested KVM in QEMU TCG)"
    if "$REPO_ROOT/tests/nested/run.sh"; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
    fi
fi
echo "all tiers: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
