#!/usr/bin/env bash
# Runs tests/e2b/test_linux.py, test_dataplane.py and test_network.py: the pinned e2b SDK on this host against `clade serve` with
# Linux sandboxes inside the nested tier (tests/nested/scenarios/sdk.sh), through ports
# that tests/nested/run.sh --forward maps to 127.0.0.1.
#
#   run_nested.sh --log build/nested/nested.log [pytest args]
#       the nested machine is started by someone else (scripts/test.sh runs the whole
#       nested suite, sdk.sh among its scenarios): wait for its NESTED-E2B-READY line in LOG,
#       run the suite, tell the scenario the verdict (`done pass|fail` on the control port).
#   run_nested.sh --standalone [pytest args]
#       start the nested machine with only the sdk scenario, then as above.
#   run_nested.sh --standalone --session
#       as above, but run tests/e2b/sdk_session.py (scripts/demo.sh's SDK session) instead
#       of the pytest suite.
#
# Env: CLADE_E2B_PORT (39481), CLADE_E2B_CTL_PORT (39482), CLADE_E2B_PORT_A (39483) and
# CLADE_E2B_PORT_B (39484: two more services, "hosts" A and B on one object store): the
# host ends of the forwards;
# CLADE_E2B_READY_TIMEOUT (2400 s): how long to wait for the service in the nested machine;
# CLADE_NESTED_PID: with --log, the process running the nested machine (stop waiting if it
# ends).
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${CLADE_E2B_PORT:-39481}
CTL=${CLADE_E2B_CTL_PORT:-39482}
PORT_A=${CLADE_E2B_PORT_A:-39483}
PORT_B=${CLADE_E2B_PORT_B:-39484}
READY_TIMEOUT=${CLADE_E2B_READY_TIMEOUT:-2400}
LOG=""
NESTED_PID=""
case "${1:-}" in
--log) LOG=${2:?--log needs a file}; shift 2 ;;
--standalone)
    shift
    tests/nested/build-rootfs.sh
    LOG=build/nested/nested.log
    mkdir -p build/nested
    rm -f "$LOG"
    NESTED_MEM=${NESTED_MEM:-4G} tests/nested/run.sh --timeout 2700 --disk build/rootfs/base.cdsk \
        --forward "$PORT:8080" --forward "$CTL:8081" --forward "$PORT_A:8082" --forward "$PORT_B:8083" \
        --l1-test tests/nested/scenarios/sdk.sh --expect SDK-SCENARIO-PASS \
        --expect '^CLADE-EXIT 0$' >build/nested/run-sdk.out 2>&1 &
    NESTED_PID=$!
    ;;
*) echo "usage: $0 --log FILE | --standalone [--session] [pytest args]" >&2; exit 2 ;;
esac
SESSION=0
if [ "${1:-}" = --session ]; then SESSION=1; shift; fi

VENV=build/venv
if [ ! -x "$VENV/bin/pytest" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q -r tests/e2b/requirements.txt pytest
fi

echo "waiting (up to ${READY_TIMEOUT}s) for clade serve in the nested machine ($LOG)"
t0=$SECONDS
until grep -a -q NESTED-E2B-READY "$LOG" 2>/dev/null; do
    if grep -a -q -E 'SDK-SCENARIO-FAIL|NESTED-SCENARIO sdk FAIL|NESTED-L1-DONE' "$LOG" 2>/dev/null; then
        echo "the nested sdk scenario ended before its service was ready:"
        grep -a -E 'SDK-|NESTED-SCENARIO sdk' "$LOG" | tail -n 20
        exit 1
    fi
    watched=${NESTED_PID:-${CLADE_NESTED_PID:-}}
    if [ -n "$watched" ] && ! kill -0 "$watched" 2>/dev/null; then
        echo "the nested machine ended before its service was ready; the end of $LOG:"
        tail -n 60 "$LOG" 2>/dev/null || true
        exit 1
    fi
    if [ $((SECONDS - t0)) -gt "$READY_TIMEOUT" ]; then
        echo "timed out waiting for NESTED-E2B-READY in $LOG; its end:"
        tail -n 60 "$LOG" 2>/dev/null || true
        exit 1
    fi
    sleep 2
done
echo "clade serve is up in the nested machine after $((SECONDS - t0)) s"
rc=0
export E2B_API_URL=http://127.0.0.1:$PORT E2B_SANDBOX_URL=http://127.0.0.1:$PORT \
    E2B_API_KEY=nested-sdk-key CLADE_NESTED_CTL=127.0.0.1:$CTL CLADE_NESTED_LOG=$LOG \
    CLADE_NESTED_URL_A=http://127.0.0.1:$PORT_A CLADE_NESTED_URL_B=http://127.0.0.1:$PORT_B
if [ "$SESSION" = 1 ]; then
    "$VENV/bin/python" tests/e2b/sdk_session.py || rc=$?
else
    # test_linux.py, and the data plane's whole suite (test_dataplane.py) on Linux
    # sandboxes too: template "debian", its scratch directory inside the guest.
    # CLADE_NESTED_TESTS: other test files (e.g. only tests/e2b/test_move.py).
    # shellcheck disable=SC2086
    CLADE_DP_TEMPLATE=debian CLADE_DP_SCRATCH=/tmp/clade-dp-scratch CLADE_DP_XATTR_SCRATCH=/var/tmp/clade-dp-meta \
        "$VENV/bin/pytest" -q ${CLADE_NESTED_TESTS:-tests/e2b/test_linux.py tests/e2b/test_dataplane.py \
        tests/e2b/test_network.py tests/e2b/test_move.py} "$@" || rc=$?
fi
verdict=pass
[ "$rc" = 0 ] || verdict=fail
# Tell the scenario; it may be between commands for a moment, so retry briefly.
for _ in $(seq 30); do
    if { printf 'done %s\n' "$verdict" >"/dev/tcp/127.0.0.1/$CTL"; } 2>/dev/null; then break; fi
    sleep 1
done
if [ -n "$NESTED_PID" ]; then
    wait "$NESTED_PID" || rc=1
    tail -n 25 build/nested/run-sdk.out
fi
exit "$rc"
