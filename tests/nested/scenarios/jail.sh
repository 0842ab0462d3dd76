#!/bin/busybox sh
# shellcheck shell=dash
# jail.sh: L1 scenario (run.sh --l1-test): a Linux guest (Debian's kernel, clade-agent as
# /init, root on a virtio-blk overlay of the Debian base layer) run, snapshotted, forked
# and restored by `clade --jail` with the system-call filter on, as uid/gid 65534, with
# cgroup v2 limits.
#
#   tests/nested/build-rootfs.sh
#   tests/nested/run.sh --disk build/rootfs/base.cdsk \
#       --l1-test tests/nested/scenarios/jail.sh \
#       --expect JAIL-SCENARIO-PASS --expect '^CLADE-EXIT 0$'
#
# Checks (one `JAIL-CHECK-PASS <check>: <detail>` line each; JAIL-SCENARIO-PASS at the end,
# JAIL-SCENARIO-FAIL and exit 1 at the first failure):
#   boot      the jailed VM boots on its overlay and its agent answers
#   confined  every thread of the VM process: uid/gid 65534, Seccomp 2, no capabilities,
#             no_new_privs, in a second PID namespace; its root has no /etc; it is in the
#             jail's cgroup with memory.max, pids.max and cpu.max set
#   snapshot  a snapshot through the API (under --files-root)
#   fork      two children, jailed alike, see the parent's file
#   stop      children and parent power off; the jail ends with status 0; its cgroup is gone
#   restore   the snapshot restored jailed (uffd backend): the file is there, confined too
#
# It takes 44-175 s; a run with the nested machine stopped for a while took 293 s of the
# suite's 300 (and one its jailed VM's agent missed the 300 s wait): its limit is 450 s.
# scenario-timeout: 450

CLADE=/bin/clade
BASE=${DISK_BASE:-/dev/vda}
J=/tmp/jail
CMDLINE="console=ttyS0 panic=-1 quiet clade.root=/dev/vda"
JAIL_ARGS="--uid 65534 --gid 65534 --jail-memory-max 1G --jail-pids-max 200 --jail-cpus 1"

uptime_s() { cut -d' ' -f1 /proc/uptime; }
T=$(uptime_s)
PIDS=""
fail() {
    echo "JAIL-SCENARIO-FAIL $*"
    for f in $J/*.log $J/vm/*.serial $J/vm/kids/*.log $J/r/*.serial; do
        [ -f "$f" ] || continue
        echo "---- $f ----"
        tail -n 30 "$f"
    done
    for p in $PIDS; do kill -9 "$p" 2>/dev/null; done
    exit 1
}
pass() {
    now=$(uptime_s)
    echo "JAIL-CHECK-PASS $1: $2 ($(awk -v a="$T" -v b="$now" 'BEGIN { printf "%.1f", b - a }') s)"
    T=$now
}
gx() {
    s=$1
    shift
    $CLADE exec -n "$s" -- "$@"
}
# pid_of TEXT: the process running as 65534 whose command line contains TEXT.
pid_of() {
    for d in /proc/[0-9]*; do
        tr '\0' ' ' <"$d/cmdline" 2>/dev/null | grep -q -- "$1" || continue
        grep -q '^Uid:[[:space:]]*65534[[:space:]]' "$d/status" 2>/dev/null || continue
        # The VM process holds /dev/kvm; the jail's keeper (also 65534 now) does not.
        ls -l "$d/fd" 2>/dev/null | grep -q 'kvm' && echo "${d#/proc/}"
    done
}
# confined PID NAME: every thread of PID is jailed and filtered.
confined() {
    p=$1
    [ -n "$p" ] || fail "$2: no process"
    n=0
    for t in /proc/"$p"/task/*; do
        # A thread that ended since the listing (a fork child's short-lived helpers) is
        # no longer anything to check.
        if ! st=$(cat "$t/status" 2>/dev/null); then
            [ -e "$t" ] && fail "$2: thread $t: its status cannot be read"
            continue
        fi
        n=$((n + 1))
        echo "$st" | grep -q '^Uid:[[:space:]]*65534[[:space:]]*65534[[:space:]]*65534[[:space:]]*65534$' ||
            fail "$2: thread $t uid: $(echo "$st" | grep ^Uid)"
        echo "$st" | grep -q '^Gid:[[:space:]]*65534[[:space:]]*65534[[:space:]]*65534[[:space:]]*65534$' ||
            fail "$2: thread $t gid: $(echo "$st" | grep ^Gid)"
        echo "$st" | grep -q '^Seccomp:[[:space:]]*2$' || fail "$2: thread $t: $(echo "$st" | grep ^Seccomp)"
        echo "$st" | grep -q '^CapEff:[[:space:]]*0000000000000000$' || fail "$2: thread $t has capabilities"
        echo "$st" | grep -q '^NoNewPrivs:[[:space:]]*1$' || fail "$2: thread $t: no no_new_privs"
        [ "$(echo "$st" | grep ^NSpid: | wc -w)" = 3 ] ||
            fail "$2: thread $t not in a second PID namespace: $(echo "$st" | grep ^NSpid)"
    done
    [ -e /proc/"$p"/root/dev/kvm ] || fail "$2: no /dev/kvm in its root"
    [ -e /proc/"$p"/root/etc ] && fail "$2: the host's /etc is visible in its root"
    CONFINED_THREADS=$n
}

[ -e "$BASE" ] || fail "no base layer at $BASE (run.sh --disk build/rootfs/base.cdsk)"
if [ ! -e /sys/fs/cgroup/cgroup.controllers ]; then
    mkdir -p /sys/fs/cgroup
    mount -t cgroup2 none /sys/fs/cgroup || fail "mount cgroup2"
fi
rm -rf $J
mkdir -p $J/vm $J/r
$CLADE disk create --parent "$BASE" $J/vm/p.cdsk >/dev/null || fail "create the overlay"
chown -R 65534:65534 $J/vm $J/r

# --- the jailed VM ----------------------------------------------------------------------
# shellcheck disable=SC2086  # JAIL_ARGS is a list of arguments
$CLADE run --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem-mib 256 --vcpus 1 \
    --vsock $J/vm/v.sock --api-sock $J/vm/api.sock --disk $J/vm/p.cdsk \
    --serial-file $J/vm/guest.serial --files-root $J/vm --cmdline "$CMDLINE" \
    --jail $J/root $JAIL_ARGS 2>$J/run.log &
OUTER=$!
PIDS="$OUTER"
$CLADE ping --wait 300 $J/vm/v.sock >/dev/null || fail "the jailed VM's agent did not answer"
out=$(gx $J/vm/v.sock sh -c 'grep " / " /proc/mounts') || fail "mounts"
case "$out" in "/dev/vda / ext4 "*) ;; *) fail "root is not /dev/vda: $out" ;; esac
gx $J/vm/v.sock sh -c 'echo written-in-the-jail > /root/jail.txt && sync' || fail "write /root/jail.txt"
pass boot "jailed VM on $J/vm/p.cdsk: $out"

VM=$(pid_of "$J/vm/api.sock")
[ "$(echo "$VM" | wc -w)" = 1 ] || fail "not one VM process as 65534: '$VM'"
confined "$VM" "VM"
cg=$(cut -d: -f3 /proc/"$VM"/cgroup)
case "$cg" in /clade/jail-root-*) ;; *) fail "VM cgroup '$cg'" ;; esac
CG=/sys/fs/cgroup$cg
[ "$(cat "$CG/memory.max")" = 1073741824 ] || fail "memory.max $(cat "$CG/memory.max")"
[ "$(cat "$CG/pids.max")" = 200 ] || fail "pids.max $(cat "$CG/pids.max")"
[ "$(cat "$CG/cpu.max")" = "100000 100000" ] || fail "cpu.max $(cat "$CG/cpu.max")"
pass confined "$CONFINED_THREADS threads of pid $VM: uid/gid 65534, Seccomp 2, no caps; cgroup $cg: memory.max 1G, pids.max 200, cpu.max 1 CPU"

# --- snapshot and fork ------------------------------------------------------------------
out=$(timeout 300 $CLADE snapshot $J/vm/api.sock $J/vm/snap 2>&1) || fail "snapshot: rc $?: $out"
pass snapshot "$out"
out=$($CLADE fork $J/vm/api.sock -n 2 --prefix $J/vm/kids) || fail "clade fork: rc $?: $out"
[ "$(echo "$out" | wc -l)" = 2 ] || fail "clade fork printed: $out"
KIDS=$(echo "$out" | awk '{ print $2 }')
i=0
for s in $KIDS; do
    i=$((i + 1))
    $CLADE ping --wait 60 "$s" >/dev/null || fail "child $i: ping"
    m=$(gx "$s" cat /root/jail.txt) || fail "child $i: cat /root/jail.txt"
    [ "$m" = written-in-the-jail ] || fail "child $i: /root/jail.txt is '$m'"
    K=$(pid_of "fork-child --api-sock ${s%.vsock}.api")
    confined "$K" "child $i"
done
pass fork "2 children, jailed alike ($CONFINED_THREADS threads each checked), see the parent's file"

# --- stop ----------------------------------------------------------------------------------
for s in $KIDS; do $CLADE poweroff "$s" >/dev/null || fail "poweroff $s"; done
$CLADE poweroff $J/vm/v.sock >/dev/null || fail "poweroff the parent"
wait "$OUTER"
rc=$?
PIDS=""
[ "$rc" = 0 ] || fail "the jailed VM ended with status $rc"
[ -z "$(pid_of "$J/")" ] || fail "processes left in the jail: $(pid_of "$J/")"
[ -d "$CG" ] && fail "cgroup $CG left behind"
pass stop "children and parent powered off; the jail ended with status 0; cgroup removed"

# --- restore, jailed -----------------------------------------------------------------------
# shellcheck disable=SC2086
$CLADE restore $J/vm/snap --backend uffd --vsock $J/r/v.sock --api-sock $J/r/api.sock \
    --files-root $J/r --disk-overlay $J/r/o.cdsk --serial-file $J/r/guest.serial \
    --jail $J/root $JAIL_ARGS 2>$J/restore.log &
OUTER=$!
PIDS="$OUTER"
$CLADE ping --wait 60 $J/r/v.sock >/dev/null || fail "restored: ping"
m=$(gx $J/r/v.sock sh -c 'echo 3 > /proc/sys/vm/drop_caches; cat /root/jail.txt') ||
    fail "restored: cat /root/jail.txt"
[ "$m" = written-in-the-jail ] || fail "restored: /root/jail.txt is '$m'"
confined "$(pid_of "$J/r/api.sock")" "restored VM"
$CLADE poweroff $J/r/v.sock >/dev/null || fail "restored: poweroff"
wait "$OUTER"
rc=$?
PIDS=""
[ "$rc" = 0 ] || fail "the restored jailed VM ended with status $rc"
pass restore "uffd restore in the jail: file there, $CONFINED_THREADS threads confined, status 0"
# (the scenarios after this one need /tmp: it may be memory; nothing is mounted in the
# jail outside the VM processes' own mount namespaces, but a mount left there is kept)
grep -q " $J" /proc/mounts || rm -rf "$J"
echo JAIL-SCENARIO-PASS
exit 0
