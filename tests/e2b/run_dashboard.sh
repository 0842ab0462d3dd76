#!/usr/bin/env bash
# Runs tests/e2b/test_dashboard.py: the web dashboard of `clade serve` (/dashboard) in a real
# browser (Debian's chromium and chromedriver, headless, driven by Selenium) against
# `clade serve` with real VMs (templates of the native test guest; needs /dev/kvm). Builds
# clade, makes a venv under build/venv if missing (adds selenium to one that lacks it).
# Screenshots of each step go to $CLADE_ARTIFACTS (default target/dashboard-screenshots).
set -euo pipefail
cd "$(dirname "$0")/../.."
for tool in chromium chromedriver; do
  command -v "$tool" >/dev/null || {
    echo "run_dashboard: $tool is missing (apt-get install chromium chromium-driver fonts-dejavu-core)" >&2
    exit 1
  }
done
cargo build -q -p clade
GUEST=target/native-guest/release/native-guest
if [ ! -x "$GUEST" ]; then
  (cd tests/native-guest && env -u RUSTFLAGS CARGO_TARGET_DIR="$PWD/../../target/native-guest" \
    cargo build --release --quiet)
fi
VENV=build/venv
if [ ! -x "$VENV/bin/pytest" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -r tests/e2b/requirements.txt pytest
elif ! "$VENV/bin/python" -c 'import selenium' 2>/dev/null; then
  "$VENV/bin/pip" install -q -r tests/e2b/requirements.txt
fi
export CLADE_ARTIFACTS=${CLADE_ARTIFACTS:-$PWD/target/dashboard-screenshots}
STATE=$(mktemp -d)
PORT=${CLADE_DASH_PORT:-39421}
SERVE=""
cleanup() {
  if [ -n "$SERVE" ]; then kill "$SERVE" 2>/dev/null; wait "$SERVE" 2>/dev/null || true; fi
  # Sandbox VM processes outlive the service by design: end the ones of this run.
  for p in $(pgrep -f -- "$STATE/" || true); do kill "$p" 2>/dev/null || true; done
  rm -rf "$STATE"
}
trap cleanup EXIT
# The test guest's `vsock` step serves every agent connection until the sandbox is stopped.
target/debug/clade template build native --kernel "$GUEST" --test-device --mem 64 \
  --cmdline "steps=vsock" --state-dir "$STATE"
CLADE_API_KEY=dash-test target/debug/clade serve --listen 127.0.0.1:$PORT --state-dir "$STATE" \
  >"$STATE/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq 50); do grep -q listening "$STATE/serve.log" && break; sleep 0.1; done
E2B_API_URL=http://127.0.0.1:$PORT E2B_API_KEY=dash-test \
  "$VENV/bin/pytest" -q -s tests/e2b/test_dashboard.py "$@" || { tail -40 "$STATE/serve.log"; exit 1; }
echo "screenshots: $CLADE_ARTIFACTS"
