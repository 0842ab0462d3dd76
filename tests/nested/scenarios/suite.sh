#!/bin/busybox sh
# shellcheck shell=dash disable=SC2089,SC2090  # CLADE_CMD is a command line for eval
# suite.sh: L1 scenario that runs several nested-tier scenarios in one outer boot (one
# build and one outer boot instead of one per scenario). scripts/test.sh uses it:
#
#   mkdir -p X/scenarios && cp tests/nested/scenarios/{agent-vsock,disk}.sh X/scenarios/
#   NESTED_L1_EXTRA=X tests/nested/run.sh --l1-test tests/nested/scenarios/suite.sh \
#       --disk build/rootfs/base.cdsk \
#       --expect '^NESTED-SCENARIO boot PASS' --expect '^NESTED-SCENARIO agent-vsock PASS' \
#       --expect '^NESTED-SCENARIO disk PASS'
#
# (disk.sh and fork.sh need the base layer as L1's /dev/vda: tests/nested/build-rootfs.sh,
# --disk.)
#
# Scenarios, in this order:
#   boot   the default scenario: $CLADE_CMD from outer-init.sh (the guest prints
#          CLADE-GUEST-READY and powers off); passes on that line and exit status 0.
#   NAME   each /scenarios/NAME.sh (put into the L1 root with NESTED_L1_EXTRA), run with
#          `timeout` (SCENARIO_TIMEOUT, or the file's own `# scenario-timeout: N` line);
#          passes on exit status 0.
# Prints `NESTED-SCENARIO <name> PASS|FAIL (exit <rc>, <seconds> s)` for each; exits with
# the number of failed scenarios.

SCENARIO_TIMEOUT=${SCENARIO_TIMEOUT:-300}
failed=0

# A line every 30 s while the suite runs, so the host (run.sh --stall) can tell a machine
# that has stopped from a scenario that is quietly working. A scenario may kill every
# `sleep` (sdk.sh's http_raw does): the loop goes on regardless (a line sooner).
(while :; do
    sleep 30
    echo "NESTED-HEARTBEAT $(cut -d' ' -f1 /proc/uptime)"
done) &
heartbeat=$!

uptime_s() { cut -d' ' -f1 /proc/uptime; }

# result NAME RC T0: the scenario's verdict line.
result() {
    verdict=PASS
    [ "$2" = 0 ] || { verdict=FAIL; failed=$((failed + 1)); }
    echo "NESTED-SCENARIO $1 $verdict (exit $2, $(awk -v a="$3" -v b="$(uptime_s)" 'BEGIN { printf "%.1f", b - a }') s)"
}

echo "NESTED-SCENARIO-START boot"
t0=$(uptime_s)
eval "timeout $SCENARIO_TIMEOUT $CLADE_CMD" >/tmp/boot.out 2>&1
rc=$?
cat /tmp/boot.out
if [ "$rc" = 0 ] && ! grep -q 'CLADE-GUEST-READY kernel=' /tmp/boot.out; then
    echo "boot: clade exited 0 without the guest's CLADE-GUEST-READY line"
    rc=1
fi
result boot "$rc" "$t0"

for f in /scenarios/*.sh; do
    [ -f "$f" ] || continue
    name=$(basename "$f" .sh)
    # With the nested machine's free memory, to tell a scenario slowed by memory pressure
    # from one slowed by the machine itself.
    echo "NESTED-SCENARIO-START $name ($(awk '/^MemAvailable:/ {printf "%d MiB available", $2 / 1024}' /proc/meminfo))"
    t0=$(uptime_s)
    limit=$(sed -n 's/^# scenario-timeout: \([0-9][0-9]*\)$/\1/p' "$f" | head -n 1)
    timeout "${limit:-$SCENARIO_TIMEOUT}" sh "$f"
    result "$name" "$?" "$t0"
    # A scenario ended by its timeout leaves what it started running: VM processes would
    # take the CPU (this machine has one) and files from the scenarios after it.
    left=$(pidof clade)
    if [ -n "$left" ]; then
        echo "NESTED-SCENARIO $name left clade processes running: $left; killing them"
        # shellcheck disable=SC2086  # a list of pids
        kill -9 $left 2>/dev/null
        sleep 1
    fi
done
kill "$heartbeat" 2>/dev/null
exit "$failed"
