#!/bin/busybox sh
# sdk.sh: L1 scenario (run.sh --l1-test, or one of suite.sh's): `clade serve` with a Linux
# template, for the pinned e2b SDK's pytest suite run on the HOST through a forwarded port
# (tests/e2b/run_nested.sh drives both halves):
#
#   tests/nested/build-rootfs.sh
#   tests/nested/run.sh --disk build/rootfs/base.cdsk --forward 39481:8080 --forward 39482:8081 \
#       --l1-test tests/nested/scenarios/sdk.sh --expect SDK-SCENARIO-PASS
#   # meanwhile, on the host: tests/e2b/run_nested.sh --wait-log build/nested/nested.log
#
# Steps: bring up L1's NIC (QEMU user network, restrict=on: only the forwarded ports reach
# L1, L1 reaches nothing), build template "debian" (Debian's kernel, clade-agent as /init,
# root on an overlay of the Debian base layer /dev/vda, one setup command), start
# `clade serve` on 0.0.0.0:8080, print `NESTED-E2B-READY`, then obey one-line commands on
# the control port 8081 (each a new TCP connection):
#   restart       stop the service (SIGTERM) and start it again on the same state dir
#   done pass|fail  the host's verdict: end with it
# Prints SDK-SCENARIO-PASS or SDK-SCENARIO-FAIL; every VM is killed before it ends.
# scenario-timeout: 1500

CLADE=/bin/clade
BASE=${DISK_BASE:-/dev/vda}
STATE=/tmp/sdk-state
PORT=8080
CTL=8081
KEY=nested-sdk-key
LOG=/tmp/sdk-serve.log
SERVE=""

uptime_s() { cut -d' ' -f1 /proc/uptime; }
# vm_pids: the clade processes of this scenario's sandboxes and template build.
vm_pids() {
    for d in /proc/[0-9]*; do
        grep -q "$STATE" "$d/cmdline" 2>/dev/null && echo "${d#/proc/}"
    done
}
cleanup() {
    [ -n "$SERVE" ] && kill "$SERVE" 2>/dev/null
    sleep 1
    for p in $(vm_pids); do kill -9 "$p" 2>/dev/null; done
}
fail() {
    echo "SDK-SCENARIO-FAIL $*"
    [ -f "$LOG" ] && { echo "---- $LOG (tail) ----"; tail -n 40 "$LOG"; }
    for f in "$STATE"/templates/*/build.log "$STATE"/templates/*/build.serial \
        "$STATE"/sandboxes/*/vm.log "$STATE"/sandboxes/*/serial*.log; do
        [ -f "$f" ] && { echo "---- $f (tail) ----"; tail -n 12 "$f"; }
    done
    cleanup
    exit 1
}
start_serve() {
    echo "---- serve started at $(uptime_s) ----" >>"$LOG"
    $CLADE serve --listen 0.0.0.0:$PORT --state-dir "$STATE" --api-key "$KEY" \
        --max-timeout 3600 >>"$LOG" 2>&1 &
    SERVE=$!
    i=0
    until grep -q listening "$LOG"; do
        i=$((i + 1))
        [ "$i" -gt 300 ] && fail "clade serve did not start"
        kill -0 "$SERVE" 2>/dev/null || fail "clade serve exited"
        sleep 0.1
    done
}
trap 'fail "interrupted"' INT TERM

[ -e "$BASE" ] || fail "no base layer at $BASE (run.sh --disk build/rootfs/base.cdsk)"
ip link set lo up || fail "lo up"
ip link set eth0 up || fail "eth0 up (run.sh --forward gives L1 a NIC)"
ip addr add 10.0.2.15/24 dev eth0 || fail "eth0 address"
rm -rf "$STATE" "$LOG"
mkdir -p "$STATE"

t0=$(uptime_s)
$CLADE template build debian --state-dir "$STATE" --kernel /guest/vmlinuz \
    --initrd /guest/initrd.cpio --disk "$BASE" --mem-mib 256 --vcpus 1 --agent-timeout 240 \
    --cmdline "console=ttyS0 panic=-1 quiet clade.root=/dev/vda" \
    --run 'echo made-by-the-template > /root/template.txt' || fail "template build"
echo "SDK-TEMPLATE debian built in $(awk -v a="$t0" -v b="$(uptime_s)" 'BEGIN { printf "%.1f", b - a }') s"

: >"$LOG"
start_serve
echo "NESTED-E2B-READY port=$PORT control=$CTL"
verdict=""
while [ -z "$verdict" ]; do
    cmd=$(nc -l -p "$CTL" </dev/null | head -n 1)
    case "$cmd" in
    restart)
        kill -TERM "$SERVE"
        wait "$SERVE"
        echo "SDK-SERVE-STOPPED rc=$?"
        start_serve
        echo "SDK-SERVE-RESTARTED"
        ;;
    "done pass") verdict=pass ;;
    "done fail") verdict=fail ;;
    *) echo "SDK-CONTROL ignored: '$cmd'" ;;
    esac
done
kill -TERM "$SERVE"
wait "$SERVE"
rc=$?
SERVE=""
echo "---- $LOG (tail) ----"
tail -n 15 "$LOG"
[ "$verdict" = pass ] || fail "the host's SDK suite failed"
[ "$rc" = 0 ] || fail "clade serve exited $rc on SIGTERM"
cleanup
echo "SDK-SCENARIO-PASS"
