#!/bin/busybox sh
# shellcheck shell=dash
# agent-vsock.sh: L1 scenario (run.sh --l1-test): boot the nested guest with a vsock device
# and drive its clade-agent through `clade ping/exec/cp` over the VMM's vsock Unix socket
# (Firecracker convention, guest port 52). Prints AGENT-SCENARIO-PASS, exits 0 on success.
#
#   tests/nested/run.sh --l1-test tests/nested/scenarios/agent-vsock.sh \
#       --expect AGENT-SCENARIO-PASS --expect '^CLADE-EXIT 0$'

SOCK=/tmp/vsock.sock
/bin/clade run --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem-mib 256 --vcpus 1 \
    --vsock "$SOCK" --serial-file /tmp/guest.log --cmdline "console=ttyS0 panic=-1 quiet" &
VM=$!

fail() {
    echo "AGENT-SCENARIO-FAIL $*"
    echo "---- guest console ----"
    cat /tmp/guest.log
    kill "$VM" 2>/dev/null
    exit 1
}
step() { echo "AGENT-SCENARIO-STEP $*"; }

step ping
/bin/clade ping --wait 180 "$SOCK" || fail "ping"

step "exec uname"
out=$(/bin/clade exec -n "$SOCK" -- uname -r) || fail "exec uname: rc $?"
[ "$out" = "$(uname -r)" ] || fail "uname: '$out'"

step "exec exit codes"
/bin/clade exec -n "$SOCK" -- sh -c 'exit 7'
rc=$?; [ "$rc" = 7 ] || fail "exit 7 gave $rc"
/bin/clade exec -n "$SOCK" -- sh -c 'kill -9 $$'
rc=$?; [ "$rc" = 137 ] || fail "SIGKILL gave $rc"
err=$(/bin/clade exec -n "$SOCK" -- ls /nonexistent 2>&1 >/dev/null)
rc=$?; [ "$rc" != 0 ] || fail "ls /nonexistent gave 0"
case "$err" in *nonexistent*) ;; *) fail "ls stderr: '$err'" ;; esac

step "exec stdin"
out=$(echo hello-stdin | /bin/clade exec "$SOCK" -- cat) || fail "cat: rc $?"
[ "$out" = hello-stdin ] || fail "cat: '$out'"

step "cp 5 MiB"
dd if=/dev/urandom of=/tmp/up.bin bs=1024 count=5120 2>/dev/null
/bin/clade cp /tmp/up.bin "$SOCK:/tmp/up.bin" || fail "cp up"
local_sum=$(sha256sum /tmp/up.bin | cut -d' ' -f1)
guest_sum=$(/bin/clade exec -n "$SOCK" -- sha256sum /tmp/up.bin | cut -d' ' -f1)
[ "$local_sum" = "$guest_sum" ] || fail "checksum guest '$guest_sum' host '$local_sum'"
/bin/clade cp "$SOCK:/tmp/up.bin" /tmp/down.bin || fail "cp down"
cmp /tmp/up.bin /tmp/down.bin || fail "round trip differs"

step "exec --tty"
out=$(/bin/clade exec -t -n "$SOCK" -- sh -c 'tty; stty size') || fail "tty: rc $?"
case "$out" in /dev/pts/*"24 80"*) ;; *) fail "tty: '$out'" ;; esac

step "8 concurrent execs"
i=0
while [ $i -lt 8 ]; do
    /bin/clade exec -n "$SOCK" -- sh -c "sleep 1; echo job$i" >/tmp/job$i.out &
    i=$((i + 1))
done
wait_jobs() {
    i=0
    while [ $i -lt 8 ]; do
        n=0
        while [ "$(cat /tmp/job$i.out 2>/dev/null)" != "job$i" ]; do
            n=$((n + 1))
            [ $n -lt 600 ] || fail "job$i: '$(cat /tmp/job$i.out)'"
            sleep 0.1
        done
        i=$((i + 1))
    done
}
wait_jobs

step "50 MiB stdout"
n=$(/bin/clade exec -n "$SOCK" -- head -c 52428800 /dev/zero | wc -c) || fail "big stdout: rc $?"
[ "$n" = 52428800 ] || fail "big stdout: $n bytes"

step "power off"
/bin/clade poweroff "$SOCK" || fail "poweroff: rc $?"
wait "$VM"
rc=$?
[ "$rc" = 0 ] || fail "clade run exit $rc after guest poweroff"
echo "AGENT-SCENARIO-PASS"
