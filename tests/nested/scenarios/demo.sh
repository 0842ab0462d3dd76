#!/bin/busybox sh
# shellcheck shell=dash disable=SC2016  # the single-quoted commands run in the guest
# demo.sh: the sandbox part of scripts/demo.sh. Boots Debian's stock kernel with
# clade-agent as /init and a vsock device, runs commands in the sandbox through the agent
# (`clade exec`), prints their output, powers the sandbox off. Prints DEMO-SANDBOX-PASS and
# exits 0 on success; DEMO-SANDBOX-FAIL, the guest console and exit 1 otherwise.
#
# In the nested tier's outer VM (the defaults below are its paths):
#   tests/nested/run.sh --l1-test tests/nested/scenarios/demo.sh \
#       --expect DEMO-SANDBOX-PASS --expect '^CLADE-EXIT 0$'
# Directly on a host with hardware KVM (what scripts/demo.sh does there):
#   CLADE=target/release/clade DEMO_KERNEL=vmlinuz DEMO_INITRD=guest.cpio \
#       DEMO_DIR=/tmp/somewhere sh tests/nested/scenarios/demo.sh

CLADE=${CLADE:-/bin/clade}
KERNEL=${DEMO_KERNEL:-/guest/vmlinuz}
INITRD=${DEMO_INITRD:-/guest/initrd.cpio}
DIR=${DEMO_DIR:-/tmp}
SOCK=$DIR/demo-vsock.sock
API=$DIR/demo-api.sock
SNAP=$DIR/demo-snapshot
LOG=$DIR/demo-guest.log
OUT=$DIR/demo-exec.out

say() { echo "DEMO: $*"; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }

rm -rf "$SOCK" "$API" "$LOG" "$SNAP"
t0=$(uptime_s)
say "\$ clade run --kernel $KERNEL --initrd $INITRD --mem 256 --vsock $SOCK --api-sock $API ..."
"$CLADE" run --kernel "$KERNEL" --initrd "$INITRD" --mem 256 --vcpus 1 --vsock "$SOCK" \
    --api-sock "$API" --serial-file "$LOG" --cmdline "console=ttyS0 panic=-1 quiet" &
VM=$!

fail() {
    echo "DEMO-SANDBOX-FAIL $*"
    echo "---- guest console ----"
    cat "$LOG"
    kill "$VM" 2>/dev/null
    exit 1
}

# exec_show DESCRIPTION COMMAND...: run COMMAND in the sandbox, print its output indented.
exec_show() {
    say "\$ clade exec $SOCK -- $1"
    shift
    "$CLADE" exec -n "$SOCK" -- "$@" >"$OUT" 2>&1 || fail "clade exec $*: rc $?: $(cat "$OUT")"
    sed 's/^/    /' "$OUT"
}

"$CLADE" ping --wait 180 "$SOCK" >"$OUT" 2>&1 || fail "the agent did not answer: $(cat "$OUT")"
t1=$(uptime_s)
say "guest console: $(grep -a -E 'CLADE-GUEST-READY|CLADE-AGENT-MODULES' "$LOG" | tr -d '\r' | tr '\n' ' ')"
say "agent answers $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }') s after clade run: $(cat "$OUT")"

exec_show "uname -a" uname -a
exec_show "sh -c 'cat /proc/cpuinfo | head'" sh -c 'cat /proc/cpuinfo | head'
exec_show "sh -c 'id; nproc; free -m'" sh -c 'id; nproc; free -m'

# Fork: two children of the running sandbox, each its own clade process with its own sockets.
exec_show "sh -c 'echo parent > /tmp/who'" sh -c 'echo parent > /tmp/who'
say "\$ clade fork $API -n 2 --prefix $DIR/forks"
mkdir -p "$DIR/forks"
"$CLADE" fork "$API" -n 2 --prefix "$DIR/forks" >"$OUT" 2>&1 || fail "fork: rc $?: $(cat "$OUT")"
sed 's/^/    /' "$OUT"
KIDS=$(awk '{ print $2 }' "$OUT")
k=0
for s in $KIDS; do
    k=$((k + 1))
    "$CLADE" ping --wait 60 "$s" >/dev/null 2>&1 || fail "fork child $k does not answer"
    "$CLADE" exec -n "$s" -- sh -c "echo child$k > /tmp/who; hostname; cat /tmp/who" >"$OUT" 2>&1 ||
        fail "exec in fork child $k: $(cat "$OUT")"
    say "fork child $k ($s): $(tr '\n' ' ' <"$OUT")"
    "$CLADE" poweroff "$s" >/dev/null 2>&1 || fail "poweroff fork child $k"
done
"$CLADE" exec -n "$SOCK" -- cat /tmp/who >"$OUT" 2>&1 || fail "exec in the parent after the fork"
grep -q '^parent$' "$OUT" || fail "the parent sees a child's write: $(cat "$OUT")"
say "parent still sees its own /tmp/who: $(cat "$OUT")"

# Persist: write state, snapshot, stop the VM, resume it from the snapshot.
exec_show "sh -c 'echo installed-once > /tmp/state; cat /tmp/state'" \
    sh -c 'echo installed-once > /tmp/state; cat /tmp/state'
say "\$ clade snapshot $API $SNAP"
"$CLADE" snapshot "$API" "$SNAP" >"$OUT" 2>&1 || fail "snapshot: rc $?: $(cat "$OUT")"
sed 's/^/    /' "$OUT"
kill "$VM"
wait "$VM"
say "original VM stopped; \$ clade restore $SNAP --backend uffd --vsock $SOCK --api-sock $API"
rm -f "$SOCK" "$API"
t0=$(uptime_s)
"$CLADE" restore "$SNAP" --backend uffd --vsock "$SOCK" --api-sock "$API" \
    --serial-file "$LOG.resumed" &
VM=$!
"$CLADE" ping --wait 120 "$SOCK" >"$OUT" 2>&1 || fail "resumed VM: no ping: $(cat "$OUT")"
t1=$(uptime_s)
say "resumed; agent answers $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }') s after clade restore (emulated wall time)"
exec_show "cat /tmp/state" cat /tmp/state
grep -q installed-once "$OUT" || fail "the file written before the snapshot is gone"

say "\$ clade poweroff $SOCK"
"$CLADE" poweroff "$SOCK" || fail "poweroff: rc $?"
wait "$VM"
rc=$?
[ "$rc" = 0 ] || fail "clade restore exited $rc after the guest powered off"
say "sandbox powered off; clade exited 0"
rm -rf "$SNAP" "$DIR/forks"
rm -f "$OUT"
echo "DEMO-SANDBOX-PASS"
