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
#   Then test_linux.py once more (but its service-restart test) against a two-node
#   cluster in the nested machine (the data plane suite through a gateway node runs in
#   the native cluster suite, tests/e2b/test_cluster.py),
#   entered through its gateway node, which owns no sandbox: PostgreSQL is started here
#   (tests/e2b/nested_pg.py, as user postgres) and reached from the nested machine
#   through run.sh --guestfwd; the scenario starts the nodes (`cluster-up`).
#   CLADE_NESTED_CLUSTER=0 leaves that pass out.
#   run_nested.sh --standalone --session
#       as above, but run tests/e2b/sdk_session.py (scripts/demo.sh's SDK session) instead
#       of the pytest suite.
#
# Env: CLADE_E2B_PORT (39481), CLADE_E2B_CTL_PORT (39482), CLADE_E2B_PORT_A (39483) and
# CLADE_E2B_PORT_B (39484: two more services, "hosts" A and B on one object store),
# CLADE_E2B_PORT_GW (39485: the cluster's gateway node): the host ends of the forwards;
# CLADE_E2B_PG_PORT (39486): the cluster's PostgreSQL here (run.sh --guestfwd 5432:it);
# CLADE_E2B_READY_TIMEOUT (2400 s): how long to wait for the service in the nested machine;
# CLADE_NESTED_PID: with --log, the process running the nested machine (stop waiting if it
# ends).
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${CLADE_E2B_PORT:-39481}
CTL=${CLADE_E2B_CTL_PORT:-39482}
PORT_A=${CLADE_E2B_PORT_A:-39483}
PORT_B=${CLADE_E2B_PORT_B:-39484}
PORT_GW=${CLADE_E2B_PORT_GW:-39485}
PG_PORT=${CLADE_E2B_PG_PORT:-39486}
CLUSTER=${CLADE_NESTED_CLUSTER:-1}
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
    # --stall: the nested machine has been seen to stop until a key press wakes it (see
    # tests/nested/run.sh); the scenario prints nothing while the suite runs here, so the
    # limit is the whole run's, and only the key presses matter. --scratch: the scenario's
    # state directories (templates, snapshots, the object store) outgrow a /tmp in memory.
    NESTED_MEM=${NESTED_MEM:-4G} tests/nested/run.sh --timeout 2700 --stall 2600 --scratch 8G \
        --disk build/rootfs/base.cdsk --disk build/rootfs/debian-image.tar \
        --forward "$PORT:8080" --forward "$CTL:8081" --forward "$PORT_A:8082" --forward "$PORT_B:8083" \
        --forward "$PORT_GW:8085" --guestfwd "5432:$PG_PORT" \
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
# control LINE: one command to the scenario; it may be between commands for a moment, so
# retry briefly.
control() {
    for _ in $(seq 30); do
        if { printf '%s\n' "$1" >"/dev/tcp/127.0.0.1/$CTL"; } 2>/dev/null; then return 0; fi
        sleep 1
    done
    return 1
}
PG_DIR=""
stop_pg() {
    if [ -n "$PG_DIR" ]; then
        python3 tests/e2b/nested_pg.py stop "$PG_DIR" || true
        rm -rf "$PG_DIR"
        PG_DIR=""
    fi
}
trap stop_pg EXIT
# passed FILE: the number of tests pytest's summary in FILE says passed.
passed() { { grep -oE '[0-9]+ passed' "$1" || true; } | tail -1 | awk '{print $1}'; }
rc=0
# tests/e2b/conftest.py ends the session early once the nested machine has ended.
export CLADE_NESTED_MACHINE_PID=${NESTED_PID:-${CLADE_NESTED_PID:-}}
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
        "$VENV/bin/pytest" -q --durations=12 ${CLADE_NESTED_TESTS:-tests/e2b/test_linux.py tests/e2b/test_dataplane.py \
        tests/e2b/test_network.py tests/e2b/test_move.py} "$@" 2>&1 | tee build/nested/sdk-single.out || rc=$?
    n_single=$(passed build/nested/sdk-single.out)
    n_cluster=0
    if [ "$CLUSTER" = 1 ]; then
        echo "== test_linux.py through a two-node cluster (gateway node gw, sandboxes on n1)"
        PG_DIR=$(mktemp -d /tmp/clade-nested-pg.XXXXXX)
        url=$(python3 tests/e2b/nested_pg.py start "$PG_DIR" "$PG_PORT")
        before=$(grep -a -c -E 'SDK-CLUSTER-(READY|FAILED)' "$LOG" || true)
        up=1
        control "cluster-up $url" || { echo "the scenario's control port did not answer"; rc=1; up=0; }
        t1=$SECONDS
        watched=${NESTED_PID:-${CLADE_NESTED_PID:-}}
        until [ "$up" = 0 ] || [ "$(grep -a -c -E 'SDK-CLUSTER-(READY|FAILED)' "$LOG" || true)" -gt "$before" ]; do
            if [ $((SECONDS - t1)) -gt 300 ]; then echo "the cluster did not come up in 300 s"; up=0; break; fi
            if [ -n "$watched" ] && ! kill -0 "$watched" 2>/dev/null; then
                echo "the nested machine ended before its cluster came up"
                up=0
                break
            fi
            sleep 1
        done
        if [ "$up" = 1 ] && grep -a -q SDK-CLUSTER-READY "$LOG"; then
            # shellcheck disable=SC2086
            E2B_API_URL=http://127.0.0.1:$PORT_GW E2B_SANDBOX_URL=http://127.0.0.1:$PORT_GW \
                CLADE_NESTED_CLUSTER=1 CLADE_NESTED_PG_URL=${url/10.0.2.100:5432/127.0.0.1:$PG_PORT} \
                CLADE_DP_TEMPLATE=debian CLADE_DP_SCRATCH=/tmp/clade-dp-scratch \
                CLADE_DP_XATTR_SCRATCH=/var/tmp/clade-dp-meta \
                "$VENV/bin/pytest" -q --durations=12 ${CLADE_NESTED_CLUSTER_TESTS:-tests/e2b/test_linux.py} \
                "$@" 2>&1 | tee build/nested/sdk-cluster.out || rc=1
            n_cluster=$(passed build/nested/sdk-cluster.out)
        else
            grep -a -A30 SDK-CLUSTER-FAILED "$LOG" | tail -n 30
            rc=1
        fi
    fi
    echo "e2b SDK on nested Linux: single host ${n_single:-0}, cluster ${n_cluster:-0}: $(( ${n_single:-0} + ${n_cluster:-0} )) passed"
fi
verdict=pass
[ "$rc" = 0 ] || verdict=fail
control "done $verdict" || true
if [ -n "$NESTED_PID" ]; then
    wait "$NESTED_PID" || rc=1
    tail -n 25 build/nested/run-sdk.out
fi
stop_pg
exit "$rc"
