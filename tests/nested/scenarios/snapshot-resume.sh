#!/bin/busybox sh
# shellcheck shell=dash disable=SC2016  # single-quoted scripts expand in the guest's sh
# snapshot-resume.sh: L1 scenario (run.sh --l1-test): snapshot a running Linux guest
# (Debian's kernel, clade-agent as /init) and resume it with every memory backend.
# One `SNAP-CHECK-PASS <check>: <detail>` line per check; prints SNAP-SCENARIO-PASS and
# exits 0 when all pass, SNAP-SCENARIO-FAIL and exits 1 at the first failure.
#
#   tests/nested/run.sh --l1-test tests/nested/scenarios/snapshot-resume.sh \
#       --expect SNAP-SCENARIO-PASS --expect '^CLADE-EXIT 0$'
#
# The guest runs a background process appending a counter to /tmp/counter every 100 ms
# and has a file written through the agent; `clade snapshot` (full) through the API
# socket; the VM is killed. Then, for uffd, file and copy: `clade restore`, the file is
# there, the counter process still runs and continues where it was (the file is 1, 2, 3,
# ... with no restart), exec works, the agent sync gave the guest the current time; a
# diff snapshot of the resumed VM resumes too. Finally two resumes of the same snapshot run
# side by side, each with its own sockets and its own files.
#
# VM generation ID: the guest kernel's vmgenid driver is bound to clade's ACPI device
# (CLAD0001) at boot; every resumed guest's kernel logged its CRNG reseed for a VM fork
# (the ID changed and the generic event device's interrupt came), also with
# --no-agent-sync, where two resumes of one snapshot still read different random bytes.

CLADE=/bin/clade
SNAP=/tmp/snap
VMS=""

uptime_s() { cut -d' ' -f1 /proc/uptime; }
T=$(uptime_s)
fail() {
    echo "SNAP-SCENARIO-FAIL $*"
    for log in /tmp/guest.log /tmp/r-*.log; do
        [ -f "$log" ] || continue
        echo "---- $log ----"
        tail -n 40 "$log"
    done
    for p in $VMS; do kill "$p" 2>/dev/null; done
    exit 1
}
pass() {
    now=$(uptime_s)
    echo "SNAP-CHECK-PASS $1: $2 ($(awk -v a="$T" -v b="$now" 'BEGIN { printf "%.1f", b - a }') s)"
    T=$now
}
# gexec SOCK CMD...: run CMD in the guest behind SOCK, its stdout on ours.
gexec() {
    s=$1
    shift
    $CLADE exec -n "$s" -- "$@"
}
# wait_gone PID: wait for a clade process to end; its exit status.
wait_gone() { wait "$1"; }

# --- the original VM -------------------------------------------------------------------
$CLADE run --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem-mib 256 --vcpus 1 \
    --vsock /tmp/vsock.sock --api-sock /tmp/api.sock --serial-file /tmp/guest.log \
    --cmdline "console=ttyS0 panic=-1 quiet" &
VM=$!
VMS="$VM"
out=$($CLADE ping --wait 180 /tmp/vsock.sock) || fail "ping: rc $?: $out"
pass boot "$out"

# The kernel's vmgenid driver found the device (and nothing changed its ID yet).
RESEED="crng reseeded due to virtual machine fork"
b=$(gexec /tmp/vsock.sock ls /sys/bus/acpi/drivers/vmgenid) || fail "no vmgenid driver in sysfs"
case "$b" in *CLAD0001:00*) ;; *) fail "the vmgenid driver is not bound to CLAD0001:00: $b" ;; esac
n=$(gexec /tmp/vsock.sock sh -c "dmesg | grep -c '$RESEED'; true")
[ "$n" = 0 ] || fail "a VM-fork reseed before any resume: $n"
pass vmgenid "driver bound: $(echo "$b" | tr '\n' ' ')"

gexec /tmp/vsock.sock setsid sh -c \
    'i=0; while :; do i=$((i + 1)); echo $i >> /tmp/counter; sleep 0.1; done' \
    </dev/null >/dev/null 2>&1 &
gexec /tmp/vsock.sock sh -c 'echo written-before-the-snapshot > /tmp/marker' ||
    fail "writing the marker file"
sleep 2
n=$(gexec /tmp/vsock.sock sh -c 'wc -l < /tmp/counter') || fail "reading the counter"
[ "$n" -gt 3 ] || fail "the counter process is not counting: $n lines"
guest_t=$(gexec /tmp/vsock.sock date +%s)
pass "counter" "$n lines after 2 s; guest clock $guest_t, L1 clock $(date +%s)"

out=$($CLADE snapshot /tmp/api.sock "$SNAP") || fail "snapshot: rc $?: $out"
pass snapshot "$out"
kill "$VM"
wait_gone "$VM"
VMS=""
if [ ! -f "$SNAP/state.snap" ] || [ ! -f "$SNAP/memory.mem" ]; then
    fail "snapshot files missing"
fi
ls -l "$SNAP"
# Time passes: the resumed guest's clock (kvmclock, restored) is only right if the agent
# sync after the resume sets it.
sleep 6

# reseeded SOCK NAME [MIN]: the resumed guest's kernel logged a CRNG reseed for a VM fork
# (its VM generation ID changed and it was told), at least MIN times (default 1: one resume).
reseeded() {
    n=0
    min=${3:-1}
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        n=$(gexec "$1" sh -c "dmesg | grep -c '$RESEED'; true")
        [ "$n" -ge "$min" ] && break
        sleep 0.5
    done
    [ "$n" -ge "$min" ] || fail "$2: $n times '$RESEED' in the guest's kernel log, not $min"
    pass "$2 vmgenid" "kernel: $RESEED ($n)"
}

# check_resumed SOCK NAME: the checks every resumed VM must pass.
check_resumed() {
    s=$1
    name=$2
    out=$($CLADE ping --wait 120 "$s") || fail "$name: ping: rc $?: $out"
    pass "$name ping" "$out"
    # A diff of a resumed VM is that VM's second resume.
    if [ "$name" = diff ]; then reseeded "$s" "$name" 2; else reseeded "$s" "$name"; fi
    m=$(gexec "$s" cat /tmp/marker) || fail "$name: cat /tmp/marker: rc $?"
    [ "$m" = written-before-the-snapshot ] || fail "$name: marker '$m'"
    pass "$name file" "/tmp/marker survived"
    c1=$(gexec "$s" sh -c 'wc -l < /tmp/counter') || fail "$name: counter"
    sleep 1
    c2=$(gexec "$s" sh -c 'wc -l < /tmp/counter') || fail "$name: counter"
    [ "$c2" -gt "$c1" ] || fail "$name: the counter process stopped ($c1 -> $c2 lines)"
    # Every line is its own line number: counting went on from where it was, no restart.
    gexec "$s" awk 'NR != $1 { print "line " NR ": " $0; bad = 1 } END { exit bad }' \
        /tmp/counter || fail "$name: the counter restarted or skipped"
    pass "$name counter" "$c1 -> $c2 lines, consecutive from 1"
    k=$(gexec "$s" uname -r) || fail "$name: exec uname: rc $?"
    [ "$k" = "$(uname -r)" ] || fail "$name: uname '$k'"
    g=$(gexec "$s" date +%s)
    l1=$(date +%s)
    d=$((g - l1))
    if [ "$d" -lt -3 ] || [ "$d" -gt 3 ]; then
        fail "$name: guest clock $g, L1 clock $l1 (agent sync?)"
    fi
    pass "$name exec+clock" "uname $k; guest clock $g vs L1 $l1"
    # The agent sync gave entropy and reseeded the CRNG before it set the clock (checked
    # above): from here on this clone's random bytes are its own.
    r=$(gexec "$s" sh -c 'head -c 16 /dev/urandom | od -An -tx1 | tr -d " \n"') ||
        fail "$name: reading /dev/urandom"
    echo "$r $name" >>/tmp/urandom-firsts
    pass "$name urandom" "$r"
}
rm -f /tmp/urandom-firsts

# --- each backend -------------------------------------------------------------------
for b in uffd file copy; do
    rm -f /tmp/r.sock /tmp/r.api
    $CLADE restore "$SNAP" --backend "$b" --vsock /tmp/r.sock --api-sock /tmp/r.api \
        --serial-file "/tmp/r-$b.log" &
    R=$!
    VMS="$R"
    check_resumed /tmp/r.sock "$b"
    if [ "$b" = uffd ]; then
        # A diff of the resumed VM, then resume that diff too.
        gexec /tmp/r.sock sh -c 'echo written-after-resume > /tmp/marker2' || fail "marker2"
        out=$($CLADE snapshot /tmp/r.api /tmp/snap-diff --diff) || fail "diff snapshot: $out"
        pass "diff snapshot" "$out"
    fi
    $CLADE poweroff /tmp/r.sock || fail "$b: poweroff: rc $?"
    wait_gone "$R"
    rc=$?
    [ "$rc" = 0 ] || fail "$b: clade restore exited $rc after the guest powered off"
    pass "$b poweroff" "clade restore exited 0"
done
[ -f "$SNAP/working_set.ws" ] && pass "working set" "$(ls -l "$SNAP/working_set.ws")"

# Without the agent sync the guest's clock lags by the time the snapshot spent on disk; its
# CRNG is still reseeded, by the kernel itself (VM generation ID): two such resumes of one
# snapshot read different random bytes.
rm -f /tmp/nosync-urandom
for b in file copy; do
    rm -f /tmp/r.sock /tmp/r.api
    $CLADE restore "$SNAP" --backend "$b" --no-agent-sync --vsock /tmp/r.sock \
        --api-sock /tmp/r.api --serial-file "/tmp/r-nosync-$b.log" &
    R=$!
    VMS="$R"
    $CLADE ping --wait 120 /tmp/r.sock >/dev/null || fail "no-sync $b: ping"
    g=$(gexec /tmp/r.sock date +%s)
    l1=$(date +%s)
    [ $((l1 - g)) -ge 5 ] || fail "no-sync $b: guest clock $g, L1 $l1: expected a lag of >= 5 s"
    pass "clock without agent sync ($b)" "guest $g lags L1 $l1 by $((l1 - g)) s"
    reseeded /tmp/r.sock "no-sync $b"
    r=$(gexec /tmp/r.sock sh -c 'head -c 16 /dev/urandom | od -An -tx1 | tr -d " \n"') ||
        fail "no-sync $b: reading /dev/urandom"
    echo "$r" >>/tmp/nosync-urandom
    $CLADE poweroff /tmp/r.sock || fail "no-sync $b: poweroff"
    wait_gone "$R"
done
[ "$(sort -u /tmp/nosync-urandom | wc -l)" = 2 ] ||
    fail "resumes without the agent share random bytes: $(tr '\n' ';' </tmp/nosync-urandom)"
pass "urandom without agent sync" "$(tr '\n' ' ' </tmp/nosync-urandom)"

rm -f /tmp/r.sock /tmp/r.api
$CLADE restore /tmp/snap-diff --vsock /tmp/r.sock --api-sock /tmp/r.api \
    --serial-file /tmp/r-diff.log &
R=$!
VMS="$R"
check_resumed /tmp/r.sock diff
m=$(gexec /tmp/r.sock cat /tmp/marker2) || fail "diff: marker2"
[ "$m" = written-after-resume ] || fail "diff: marker2 '$m'"
pass "diff file" "/tmp/marker2 written after the first resume is there"
$CLADE poweroff /tmp/r.sock || fail "diff: poweroff"
wait_gone "$R"

# --- two resumes of one snapshot, side by side -------------------------------------------
$CLADE restore "$SNAP" --backend uffd --vsock /tmp/a.sock --api-sock /tmp/a.api \
    --serial-file /tmp/r-a.log &
A=$!
$CLADE restore "$SNAP" --backend file --vsock /tmp/b.sock --api-sock /tmp/b.api \
    --serial-file /tmp/r-b.log &
B=$!
VMS="$A $B"
check_resumed /tmp/a.sock A
check_resumed /tmp/b.sock B
gexec /tmp/a.sock sh -c 'echo I am A > /tmp/who' || fail "A: write"
gexec /tmp/b.sock sh -c 'echo I am B > /tmp/who' || fail "B: write"
wa=$(gexec /tmp/a.sock cat /tmp/who)
wb=$(gexec /tmp/b.sock cat /tmp/who)
if [ "$wa" != "I am A" ] || [ "$wb" != "I am B" ]; then
    fail "side by side: A '$wa', B '$wb'"
fi
pass "side by side" "each VM has its own /tmp/who"
$CLADE poweroff /tmp/a.sock || fail "A: poweroff"
$CLADE poweroff /tmp/b.sock || fail "B: poweroff"
wait_gone "$A"
wait_gone "$B"
# Every clone of the one snapshot read different random bytes after its agent sync.
n=$(wc -l </tmp/urandom-firsts)
dup=$(cut -d' ' -f1 /tmp/urandom-firsts | sort | uniq -d)
[ "$n" -ge 6 ] && [ -z "$dup" ] ||
    fail "clones share random bytes: $(tr '\n' ';' </tmp/urandom-firsts)"
pass "urandom" "$n clones, $n different first reads"
echo "SNAP-SCENARIO-PASS"
