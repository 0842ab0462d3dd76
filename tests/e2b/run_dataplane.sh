#!/usr/bin/env bash
# Runs tests/e2b/test_dataplane.py: the pinned e2b SDK against `clade serve` in its
# TEST HARNESS mode (--test-host-agent: sandboxes are host-run clade-agent processes, not
# VMs). Builds clade and clade-agent, makes a venv under build/venv if missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build -q -p clade -p guest-agent
VENV=build/venv
if [ ! -x "$VENV/bin/pytest" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -r tests/e2b/requirements.txt pytest
fi
STATE=$(mktemp -d)
chmod 755 "$STATE"  # the scratch dir below is reachable by another user (test_files_as_another_user)
PORT=${CLADE_DP_PORT:-39417}
export CLADE_DP_SCRATCH="$STATE/scratch"
target/debug/clade serve --listen 127.0.0.1:$PORT --state-dir "$STATE" --api-key dp-test \
  --test-host-agent target/debug/clade-agent >"$STATE/serve.log" 2>&1 &
SERVE=$!
trap 'kill $SERVE 2>/dev/null; wait $SERVE 2>/dev/null; rm -rf "$STATE"' EXIT
for _ in $(seq 50); do grep -q listening "$STATE/serve.log" && break; sleep 0.1; done
E2B_API_URL=http://127.0.0.1:$PORT E2B_SANDBOX_URL=http://127.0.0.1:$PORT E2B_API_KEY=dp-test \
  "$VENV/bin/pytest" -q tests/e2b/test_dataplane.py "$@" || { tail -30 "$STATE/serve.log"; exit 1; }
