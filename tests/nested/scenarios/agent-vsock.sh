#!/bin/busybox sh
# shellcheck shell=dash disable=SC2016  # single-quoted scripts expand in the guest's sh
# agent-vsock.sh: L1 scenario (run.sh --l1-test): boot the nested guest (Debian's stock
# kernel, clade-agent as /init) with a vsock device and drive the agent through
# `clade ping/exec/cp/poweroff` over the VMM's vsock Unix socket (Firecracker convention,
# guest port 52). One `AGENT-CHECK-PASS <check>: <detail>` line per check; prints
# AGENT-SCENARIO-PASS and exits 0 when all pass, AGENT-SCENARIO-FAIL and exits 1 at the
# first failure.
#
#   tests/nested/run.sh --l1-test tests/nested/scenarios/agent-vsock.sh \
#       --expect AGENT-SCENARIO-PASS --expect '^CLADE-EXIT 0$'
#
# Checks: echo; exit codes 0, 1, 7 and 137 (SIGKILL); `ls /nonexistent` stderr and exit
# code identical to the same busybox run here; stdin (small, and 10 MiB of random bytes
# through the guest's sha256sum against L1's); --tty; 8 concurrent execs (each waits in the
# guest until all 8 run); 50 MiB of stdout (byte count and sha256 of a deterministic
# stream); 5 MiB file write/read round trip with checksums; malformed frames (`clade ping
# --garbage-frame`) get error replies and the agent still answers ping; power off.

SOCK=/tmp/vsock.sock
CLADE=/bin/clade
/bin/clade run --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem-mib 256 --vcpus 1 \
    --vsock "$SOCK" --serial-file /tmp/guest.log --cmdline "console=ttyS0 panic=-1 quiet" &
VM=$!

uptime_s() { cut -d' ' -f1 /proc/uptime; }
T=$(uptime_s)
fail() {
    echo "AGENT-SCENARIO-FAIL $*"
    echo "---- guest console ----"
    cat /tmp/guest.log
    kill "$VM" 2>/dev/null
    exit 1
}
# pass CHECK DETAIL: one line per passed check, with the seconds it took (emulated: slow).
pass() {
    now=$(uptime_s)
    echo "AGENT-CHECK-PASS $1: $2 ($(awk -v a="$T" -v b="$now" 'BEGIN { printf "%.1f", b - a }') s)"
    T=$now
}
sum() { sha256sum "$@" | cut -d' ' -f1; }

# --- reachability ----------------------------------------------------------------------
out=$($CLADE ping --wait 180 "$SOCK") || fail "ping: rc $?: $out"
pass ping "$out"

# --- exec: output, exit codes, stderr ----------------------------------------------------
out=$($CLADE exec -n "$SOCK" -- echo hello from the guest) || fail "echo: rc $?"
[ "$out" = "hello from the guest" ] || fail "echo: '$out'"
pass echo "'$out'"

out=$($CLADE exec -n "$SOCK" -- uname -r) || fail "uname: rc $?"
[ "$out" = "$(uname -r)" ] || fail "uname -r: '$out', L1 runs '$(uname -r)'"
pass uname "guest kernel $out (Debian's, as in L1)"

$CLADE exec -n "$SOCK" -- true
rc=$?; [ "$rc" = 0 ] || fail "true gave exit code $rc"
pass "exit 0" "true -> 0"
$CLADE exec -n "$SOCK" -- false
rc=$?; [ "$rc" = 1 ] || fail "false gave exit code $rc"
pass "exit 1" "false -> 1"
$CLADE exec -n "$SOCK" -- sh -c 'exit 7'
rc=$?; [ "$rc" = 7 ] || fail "exit 7 gave exit code $rc"
pass "exit 7" "sh -c 'exit 7' -> 7"
$CLADE exec -n "$SOCK" -- sh -c 'kill -9 $$'
rc=$?; [ "$rc" = 137 ] || fail "SIGKILL gave exit code $rc"
pass "exit 137" "sh -c 'kill -9 \$\$' -> 137 (128 + SIGKILL)"

# The guest runs the same busybox as L1: its stderr and status must be exactly L1's.
ls /nonexistent >/tmp/ls.l1.out 2>/tmp/ls.l1.err
l1_rc=$?
$CLADE exec -n "$SOCK" -- ls /nonexistent >/tmp/ls.out 2>/tmp/ls.err
rc=$?
if [ "$rc" != "$l1_rc" ] || [ "$rc" = 0 ]; then
    fail "ls /nonexistent: exit code $rc, L1 gives $l1_rc"
fi
[ ! -s /tmp/ls.out ] || fail "ls /nonexistent: stdout '$(cat /tmp/ls.out)'"
cmp -s /tmp/ls.err /tmp/ls.l1.err ||
    fail "ls /nonexistent: stderr '$(cat /tmp/ls.err)', L1 gives '$(cat /tmp/ls.l1.err)'"
pass "ls /nonexistent" "exit code $rc, stderr '$(cat /tmp/ls.err)'"

# --- stdin -------------------------------------------------------------------------------
out=$(echo hello-stdin | $CLADE exec "$SOCK" -- cat) || fail "cat: rc $?"
[ "$out" = hello-stdin ] || fail "cat: '$out'"
pass "stdin" "echo | cat -> '$out'"

dd if=/dev/urandom of=/tmp/in.bin bs=1048576 count=10 2>/dev/null
[ "$(wc -c </tmp/in.bin)" = 10485760 ] || fail "could not make 10 MiB of input"
out=$($CLADE exec "$SOCK" -- sha256sum </tmp/in.bin) || fail "stdin sha256sum: rc $?"
guest_sum=${out%% *}
l1_sum=$(sum /tmp/in.bin)
[ "$guest_sum" = "$l1_sum" ] || fail "10 MiB stdin: guest sha256 '$guest_sum', L1 '$l1_sum'"
pass "10 MiB stdin" "guest sha256sum = L1 sha256sum = $l1_sum"
rm -f /tmp/in.bin

# --- tty -----------------------------------------------------------------------------------
out=$($CLADE exec -t -n "$SOCK" -- sh -c 'tty; stty size') || fail "tty: rc $?"
case "$out" in /dev/pts/*"24 80"*) ;; *) fail "tty: '$out'" ;; esac
pass "tty" "$(echo "$out" | tr -d '\r' | tr '\n' ' ')"

# --- 8 concurrent execs ------------------------------------------------------------------
# Each job registers in the guest and waits there until all 8 have, so the check passes
# only if the 8 really run at the same time.
BARRIER='mkdir -p /tmp/barrier && touch /tmp/barrier/$0 && n=0 &&
while [ "$(ls /tmp/barrier | wc -l)" -lt 8 ]; do
    n=$((n + 1)); [ $n -lt 1200 ] || exit 3; sleep 0.1
done; echo job$0'
pids=""
i=0
while [ $i -lt 8 ]; do
    (
        $CLADE exec -n "$SOCK" -- sh -c "$BARRIER" $i >/tmp/job$i.out 2>&1
        echo $? >/tmp/job$i.rc
    ) &
    pids="$pids $!"
    i=$((i + 1))
done
for p in $pids; do wait "$p"; done
i=0
while [ $i -lt 8 ]; do
    [ "$(cat /tmp/job$i.rc)" = 0 ] || fail "job$i: exit code $(cat /tmp/job$i.rc): $(cat /tmp/job$i.out)"
    [ "$(cat /tmp/job$i.out)" = "job$i" ] || fail "job$i: '$(cat /tmp/job$i.out)'"
    i=$((i + 1))
done
pass "8 concurrent execs" "all 8 met in the guest, exit codes 0, outputs job0..job7"

# --- files ---------------------------------------------------------------------------------
dd if=/dev/urandom of=/tmp/up.bin bs=1024 count=5120 2>/dev/null
$CLADE cp /tmp/up.bin "$SOCK:/tmp/up.bin" || fail "cp up: rc $?"
l1_sum=$(sum /tmp/up.bin)
guest_sum=$($CLADE exec -n "$SOCK" -- sha256sum /tmp/up.bin) || fail "guest sha256sum: rc $?"
guest_sum=${guest_sum%% *}
[ "$l1_sum" = "$guest_sum" ] || fail "cp up: guest sha256 '$guest_sum', L1 '$l1_sum'"
$CLADE cp "$SOCK:/tmp/up.bin" /tmp/down.bin || fail "cp down: rc $?"
down_sum=$(sum /tmp/down.bin)
[ "$down_sum" = "$l1_sum" ] || fail "cp down: sha256 '$down_sum', sent '$l1_sum'"
pass "5 MiB file round trip" "write + read back, sha256 $l1_sum on L1, in the guest, after"
rm -f /tmp/up.bin /tmp/down.bin

# --- 50 MiB of stdout ----------------------------------------------------------------------
# A deterministic stream both sides can produce with one `cat`: 49 copies of a random block
# of 257 x 4099 bytes (no multiple of any power-of-two chunk size, so lost, repeated or
# reordered chunks change the hash) and the start of a 50th, 52428800 bytes in all.
dd if=/dev/urandom of=/tmp/seed.bin bs=4099 count=257 2>/dev/null
head -c $((52428800 - 49 * 257 * 4099)) /tmp/seed.bin >/tmp/tail.bin
$CLADE cp /tmp/seed.bin "$SOCK:/tmp/seed.bin" || fail "cp seed: rc $?"
$CLADE cp /tmp/tail.bin "$SOCK:/tmp/tail.bin" || fail "cp tail: rc $?"
files=""
i=0
while [ $i -lt 49 ]; do files="$files /tmp/seed.bin"; i=$((i + 1)); done
files="$files /tmp/tail.bin"
# shellcheck disable=SC2086  # $files is a list of words
$CLADE exec -n "$SOCK" -- cat $files >/tmp/big.out || fail "50 MiB stdout: rc $?"
n=$(stat -c %s /tmp/big.out)
[ "$n" = 52428800 ] || fail "50 MiB stdout: $n bytes"
got=$(sum /tmp/big.out)
rm -f /tmp/big.out
# shellcheck disable=SC2086
cat $files >/tmp/want.out
want=$(sum /tmp/want.out)
rm -f /tmp/want.out
[ "$got" = "$want" ] || fail "50 MiB stdout: sha256 '$got', expected '$want'"
pass "50 MiB stdout" "$n bytes, sha256 $got as expected"

# --- malformed frames ---------------------------------------------------------------------
out=$($CLADE ping --garbage-frame "$SOCK" 2>&1) || fail "garbage frame: rc $?: $out"
echo "$out" | sed 's/^/    /'
case "$out" in *"connection closed by the agent"*"fresh connection -> pong"*) ;;
*) fail "garbage frame: '$out'" ;; esac
pass "garbage frame" "error replies (see above); the agent still answers ping"

# --- power off -----------------------------------------------------------------------------
$CLADE poweroff "$SOCK" || fail "poweroff: rc $?"
wait "$VM"
rc=$?
[ "$rc" = 0 ] || fail "clade run exit $rc after guest poweroff"
pass "power off" "clade run exited 0"
echo "AGENT-SCENARIO-PASS"
