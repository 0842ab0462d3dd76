#!/bin/busybox sh
# shellcheck shell=dash disable=SC2016  # single-quoted scripts expand in the guest's sh
# fork.sh: L1 scenario (run.sh --l1-test): fork a running Linux guest (Debian's kernel,
# clade-agent as /init, root on a virtio-blk overlay of the Debian base layer) into three
# child VM processes with `clade fork`.
#
#   tests/nested/build-rootfs.sh
#   tests/nested/run.sh --disk build/rootfs/base.cdsk \
#       --l1-test tests/nested/scenarios/fork.sh \
#       --expect FORK-SCENARIO-PASS --expect '^CLADE-EXIT 0$'
#
# Checks (one `FORK-CHECK-PASS <check>: <detail>` line each; FORK-SCENARIO-PASS at the
# end, FORK-SCENARIO-FAIL and exit 1 at the first failure):
#   boot      the parent boots on its overlay, root /dev/vda
#   setup     the parent writes /root/fork.txt and starts a background counter process
#   fork      `clade fork -n 3 --json` answers three children (API socket, vsock socket)
#             and that the parent moved onto its spare VM shell
#   child i   each child sees /root/fork.txt, its counter process still runs and counts
#             on from the parent's count, its hostname has the fork suffix, its kernel
#             logged a CRNG reseed for a VM fork (new VM generation ID; the parent none)
#   isolation the parent and every child write different content to /root/who.txt: each
#             reads back only its own
#   orphans   the parent is killed (SIGKILL): the children still answer
#   snapshot-resume  child 1 is snapshotted (its disk overlay frozen), SIGKILLed and
#             resumed on its own overlay (--disk-overlay): its synced /root/who.txt is
#             read from disk; its new write is not seen by child 2
#   stop      each child powers off; its process ends and removes its sockets
#
# It takes 150-190 s alone and in the suite; the nested machine has been seen to run it at
# a third of that speed for minutes (each child check 35 s instead of 10-15 s): its limit
# is 450 s, not the suite's 300.
# scenario-timeout: 450

CLADE=/bin/clade
BASE=${DISK_BASE:-/dev/vda}
P=/tmp/fork-p.cdsk
CMDLINE="console=ttyS0 panic=-1 quiet clade.root=/dev/vda"

# child_pids: the fork children's clade processes.
child_pids() {
    for d in /proc/[0-9]*; do
        grep -q fork-child "$d/cmdline" 2>/dev/null && echo "${d#/proc/}"
    done
}
uptime_s() { cut -d' ' -f1 /proc/uptime; }
T=$(uptime_s)
PIDS=""
fail() {
    echo "FORK-SCENARIO-FAIL $*"
    for f in /tmp/fork-guest.log /tmp/forks/*.log /tmp/forks/*.serial; do
        [ -f "$f" ] || continue
        echo "---- $f ----"
        tail -n 30 "$f"
    done
    for p in $PIDS $(child_pids); do kill -9 "$p" 2>/dev/null; done
    exit 1
}
pass() {
    now=$(uptime_s)
    echo "FORK-CHECK-PASS $1: $2 ($(awk -v a="$T" -v b="$now" 'BEGIN { printf "%.1f", b - a }') s)"
    T=$now
}
gx() {
    s=$1
    shift
    $CLADE exec -n "$s" -- "$@"
}

[ -e "$BASE" ] || fail "no base layer at $BASE (run.sh --disk build/rootfs/base.cdsk)"
rm -rf /tmp/forks "$P"
mkdir -p /tmp/forks
$CLADE disk create --parent "$BASE" "$P" >/dev/null || fail "create the parent's overlay"

# --- the parent ------------------------------------------------------------------------
$CLADE run --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem-mib 256 --vcpus 1 \
    --vsock /tmp/fork-p.sock --api-sock /tmp/fork-p.api --disk "$P" \
    --serial-file /tmp/fork-guest.log --cmdline "$CMDLINE" &
PARENT=$!
PIDS="$PARENT"
$CLADE ping --wait 180 /tmp/fork-p.sock >/dev/null || fail "parent: agent did not answer"
out=$(gx /tmp/fork-p.sock sh -c 'grep " / " /proc/mounts') || fail "parent: mounts"
case "$out" in "/dev/vda / ext4 "*) ;; *) fail "parent root is not /dev/vda: $out" ;; esac
pass boot "parent on $P: $out"

gx /tmp/fork-p.sock sh -c 'echo written-before-the-fork > /root/fork.txt' ||
    fail "parent: write /root/fork.txt"
gx /tmp/fork-p.sock setsid sh -c \
    'i=0; while :; do i=$((i + 1)); echo $i >> /tmp/counter; sleep 0.1; done' \
    </dev/null >/dev/null 2>&1 &
sleep 2
n=$(gx /tmp/fork-p.sock sh -c 'wc -l < /tmp/counter') || fail "parent: counter"
[ "$n" -gt 3 ] || fail "parent: the counter does not count ($n lines)"
phost=$(gx /tmp/fork-p.sock hostname) || fail "parent: hostname"
RESEED="crng reseeded due to virtual machine fork"
k=$(gx /tmp/fork-p.sock sh -c "dmesg | grep -c '$RESEED'; true")
[ "$k" = 0 ] || fail "parent: a VM-fork reseed before any fork ($k)"
pass setup "/root/fork.txt written; counter at $n lines; hostname $phost"

# --- the fork --------------------------------------------------------------------------
# The parent process keeps a spare VM shell (built while idle): the fork moves the parent
# onto it instead of remapping its memory in the pause, and the answer says so.
out=$($CLADE fork /tmp/fork-p.api -n 3 --prefix /tmp/forks --json) || fail "clade fork: rc $?: $out"
KIDS=$(echo "$out" | grep -o '"vsock":"[^"]*"' | sed 's/^"vsock":"//; s/"$//')
[ "$(echo "$KIDS" | wc -l)" = 3 ] || fail "clade fork printed: $out"
echo "$out" | grep -q '"moved":true' || fail "the parent did not move onto its spare shell: $out"
rm -f /tmp/fork-urandom
[ "$(child_pids | wc -l)" = 3 ] || fail "not 3 fork-child processes: $(child_pids)"
pass fork "$(echo "$out" | tr '\n' ' ')"

i=0
for s in $KIDS; do
    i=$((i + 1))
    $CLADE ping --wait 60 "$s" >/dev/null || fail "child $i: ping"
    m=$(gx "$s" cat /root/fork.txt) || fail "child $i: cat /root/fork.txt"
    [ "$m" = written-before-the-fork ] || fail "child $i: /root/fork.txt is '$m'"
    c1=$(gx "$s" sh -c 'wc -l < /tmp/counter') || fail "child $i: counter"
    sleep 0.5
    c2=$(gx "$s" sh -c 'wc -l < /tmp/counter') || fail "child $i: counter"
    [ "$c2" -gt "$c1" ] || fail "child $i: the counter process stopped ($c1 -> $c2)"
    gx "$s" awk 'NR != $1 { bad = 1 } END { exit bad }' /tmp/counter ||
        fail "child $i: the counter restarted"
    h=""
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        h=$(gx "$s" hostname)
        [ "$h" != "$phost" ] && break
        sleep 0.5
    done
    case "$h" in *-f[0-9]*) ;; *) fail "child $i: hostname '$h' (parent $phost)" ;; esac
    n=$(gx "$s" sh -c "dmesg | grep -c '$RESEED'; true")
    [ "$n" = 1 ] || fail "child $i: $n times '$RESEED' in its kernel log, not 1"
    pass "child $i" "file there, counter $c1 -> $c2 consecutive, hostname $h, kernel reseeded"
    # The hostname is the sync's last step: entropy was added and the CRNG reseeded.
    r=$(gx "$s" sh -c 'head -c 16 /dev/urandom | od -An -tx1 | tr -d " \n"') ||
        fail "child $i: reading /dev/urandom"
    echo "$r" >>/tmp/fork-urandom
done
dup=$(sort /tmp/fork-urandom | uniq -d)
[ "$(wc -l </tmp/fork-urandom)" = 3 ] && [ -z "$dup" ] ||
    fail "fork children share random bytes: $(tr '\n' ';' </tmp/fork-urandom)"
pass urandom "3 children, 3 different first reads after their agent sync"
n=$(gx /tmp/fork-p.sock sh -c "dmesg | grep -c '$RESEED'; true")
[ "$n" = 0 ] || fail "parent: a VM-fork reseed after forking children ($n)"
pass vmgenid "each child's kernel reseeded once for the fork, the parent's not"

# --- isolation: same path, different content ----------------------------------------------
gx /tmp/fork-p.sock sh -c 'echo parent > /root/who.txt && sync' || fail "parent: write who"
i=0
for s in $KIDS; do
    i=$((i + 1))
    gx "$s" sh -c "echo child-$i > /root/who.txt && sync" || fail "child $i: write who"
done
w=$(gx /tmp/fork-p.sock cat /root/who.txt)
[ "$w" = parent ] || fail "parent reads who.txt as '$w'"
i=0
for s in $KIDS; do
    i=$((i + 1))
    w=$(gx "$s" cat /root/who.txt)
    [ "$w" = "child-$i" ] || fail "child $i reads who.txt as '$w'"
    # Dropping the page cache makes the guest read its disk again.
    w=$(gx "$s" sh -c 'echo 3 > /proc/sys/vm/drop_caches; cat /root/who.txt')
    [ "$w" = "child-$i" ] || fail "child $i reads who.txt from its disk as '$w'"
done
pass isolation "parent and 3 children each read back their own /root/who.txt"

# --- the parent dies ----------------------------------------------------------------------
kill -9 "$PARENT"
wait "$PARENT" 2>/dev/null
i=0
for s in $KIDS; do
    i=$((i + 1))
    out=$($CLADE ping "$s") || fail "child $i after the parent was killed: ping"
    w=$(gx "$s" cat /root/who.txt)
    [ "$w" = "child-$i" ] || fail "child $i after the parent was killed: who '$w'"
done
pass orphans "the parent was SIGKILLed; all 3 children answer"

# --- a child with a disk: snapshot, SIGKILL, resume ------------------------------------------
# Child 1 wrote /root/who.txt and synced: its disk overlay is frozen with the snapshot, the
# resume gets its own overlay on it and reads the file from disk.
S1=$(echo "$KIDS" | head -n 1)
A1=${S1%.vsock}.api
K1=""
for d in /proc/[0-9]*; do
    tr '\0' ' ' <"$d/cmdline" 2>/dev/null | grep -q -- "fork-child --api-sock $A1 " &&
        K1=${d#/proc/}
done
[ -n "$K1" ] || fail "child 1: no process serving $A1"
out=$(timeout 300 $CLADE snapshot "$A1" /tmp/forks/snap1 2>&1) || fail "child 1: snapshot: rc $?: $out"
kill -9 "$K1"
n=0
while kill -0 "$K1" 2>/dev/null; do
    n=$((n + 1))
    [ "$n" -lt 100 ] || fail "child 1 did not die"
    sleep 0.1
done
rm -f "$S1" "$A1"
$CLADE restore /tmp/forks/snap1 --backend uffd --vsock /tmp/forks/r1.vsock \
    --api-sock /tmp/forks/r1.api --disk-overlay /tmp/forks/r1.cdsk \
    --serial-file /tmp/forks/r1.serial 2>/tmp/forks/r1.log &
R1=$!
PIDS="$PIDS $R1"
$CLADE ping --wait 60 /tmp/forks/r1.vsock >/dev/null || fail "resumed child 1: ping"
w=$(gx /tmp/forks/r1.vsock sh -c 'echo 3 > /proc/sys/vm/drop_caches; cat /root/who.txt') ||
    fail "resumed child 1: cat who.txt"
[ "$w" = child-1 ] || fail "resumed child 1 reads who.txt from its disk as '$w'"
gx /tmp/forks/r1.vsock sh -c 'echo resumed > /root/who.txt && sync' ||
    fail "resumed child 1: write who"
w=$(gx "$(echo "$KIDS" | sed -n 2p)" cat /root/who.txt)
[ "$w" = child-2 ] || fail "child 2 sees who.txt as '$w' after the resume wrote it"
[ -f /tmp/forks/r1.cdsk ] || fail "no overlay /tmp/forks/r1.cdsk"
$CLADE poweroff /tmp/forks/r1.vsock >/dev/null || fail "resumed child 1: poweroff"
wait "$R1" 2>/dev/null
KIDS=$(echo "$KIDS" | tail -n +2)
pass "snapshot-resume" "child 1 snapshotted, SIGKILLed, resumed on /tmp/forks/r1.cdsk: who.txt is child-1"

i=0
for s in $KIDS; do
    i=$((i + 1))
    $CLADE poweroff "$s" >/dev/null || fail "child $i: poweroff"
done
# (Child 1 was snapshotted, killed and resumed above.)
for s in $KIDS; do
    n=0
    while [ -e "$s" ] || [ -e "${s%.vsock}.api" ]; do
        n=$((n + 1))
        [ "$n" -lt 300 ] || fail "$s: the child did not end after power off"
        sleep 0.1
    done
done
# A process ends just after it removed its sockets.
n=0
while [ -n "$(child_pids)" ]; do
    n=$((n + 1))
    [ "$n" -lt 50 ] || fail "fork-child processes left: $(child_pids)"
    sleep 0.1
done
pass stop "children powered off; their processes ended and their sockets are gone"
ls -l /tmp/forks /tmp/*.cdsk
# (the scenarios after this one need /tmp: it may be memory)
rm -rf /tmp/forks "$P"
echo FORK-SCENARIO-PASS
exit 0
