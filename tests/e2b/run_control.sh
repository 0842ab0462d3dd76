#!/usr/bin/env bash
# Runs tests/e2b/test_control.py: the pinned e2b SDK against `clade serve` with real VMs
# (templates of the native test guest; needs /dev/kvm). Builds clade, makes a venv under
# build/venv if missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build -q -p clade
GUEST=target/native-guest/release/native-guest
VENV=build/venv
if [ ! -x "$VENV/bin/pytest" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -r tests/e2b/requirements.txt pytest
fi
STATE=$(mktemp -d)
PORT=${CLADE_CP_PORT:-39418}
SERVE=""
cleanup() {
  if [ -n "$SERVE" ]; then kill "$SERVE" 2>/dev/null; wait "$SERVE" 2>/dev/null || true; fi
  # Sandbox VM processes outlive the service by design: end the ones of this run.
  for p in $(pgrep -f -- "$STATE/" || true); do kill "$p" 2>/dev/null || true; done
  rm -rf "$STATE"
}
trap cleanup EXIT
# The test guest's `vsock` step serves every agent connection (template build, each
# restore's agent sync, pings) until the sandbox is stopped.
STEPS=vsock
target/debug/clade template build native --kernel "$GUEST" --test-device --mem 64 \
  --cmdline "steps=$STEPS" --state-dir "$STATE"
CLADE_API_KEY=cp-test target/debug/clade serve --listen 127.0.0.1:$PORT --state-dir "$STATE" \
  >"$STATE/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq 50); do grep -q listening "$STATE/serve.log" && break; sleep 0.1; done
E2B_API_URL=http://127.0.0.1:$PORT E2B_SANDBOX_URL=http://127.0.0.1:$PORT E2B_API_KEY=cp-test \
  "$VENV/bin/pytest" -q -s tests/e2b/test_control.py "$@" || { tail -40 "$STATE/serve.log"; exit 1; }
