#!/bin/busybox sh
# shellcheck shell=dash disable=SC2016  # single-quoted scripts expand in the guest's sh
# disk.sh: L1 scenario (run.sh --l1-test): the nested guest boots with a virtio-blk disk,
# an overlay on the Debian base layer (tests/nested/build-rootfs.sh) that the outer VM has
# as /dev/vda, and clade-agent switches its root to it (clade.root=/dev/vda).
#
#   tests/nested/build-rootfs.sh
#   tests/nested/run.sh --disk build/rootfs/base.cdsk \
#       --l1-test tests/nested/scenarios/disk.sh \
#       --expect DISK-SCENARIO-PASS --expect '^CLADE-EXIT 0$'
#
# Checks (one `DISK-CHECK-PASS <check>: <detail>` line each; DISK-SCENARIO-PASS at the
# end, DISK-SCENARIO-FAIL and exit 1 at the first failure):
#   base      `clade disk info` validates the base; two overlays are created on it
#   root      the guest's / is /dev/vda (ext4), a Debian system
#   python    `python3 -c 'print(1+1)'` through `clade exec` prints 2
#   write     a file written and `sync`ed in the guest; the guest powers off (exit 0)
#   persist   a second boot on the same overlay finds the file
#   isolation two VMs at once, one per overlay of the same base: each sees its own writes
#             and not the other's
#   layers    afterwards both overlays and the base still validate (the base's frozen
#             table checksum included): the guests' writes stayed in the overlays

CLADE=/bin/clade
BASE=${DISK_BASE:-/dev/vda}
A=/tmp/a.cdsk
B=/tmp/b.cdsk
CMDLINE="console=ttyS0 panic=-1 quiet clade.root=/dev/vda"

uptime_s() { cut -d' ' -f1 /proc/uptime; }
T=$(uptime_s)
VMS=""
fail() {
    echo "DISK-SCENARIO-FAIL $*"
    for f in /tmp/guest-*.log; do
        [ -f "$f" ] || continue
        echo "---- $f ----"
        cat "$f"
    done
    for p in $VMS; do kill "$p" 2>/dev/null; done
    exit 1
}
pass() {
    now=$(uptime_s)
    echo "DISK-CHECK-PASS $1: $2 ($(awk -v a="$T" -v b="$now" 'BEGIN { printf "%.1f", b - a }') s)"
    T=$now
}

# boot NAME OVERLAY: start a VM on OVERLAY with its vsock at /tmp/NAME.sock; sets VM.
boot() {
    $CLADE run --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem-mib 256 --vcpus 1 \
        --vsock "/tmp/$1.sock" --disk "$2" --serial-file "/tmp/guest-$1.log" \
        --cmdline "$CMDLINE" &
    VM=$!
    VMS="$VMS $VM"
    $CLADE ping --wait 180 "/tmp/$1.sock" >/dev/null || fail "$1: agent did not answer"
    grep -q "CLADE-AGENT-ROOT /dev/vda ext4" "/tmp/guest-$1.log" ||
        fail "$1: the guest did not switch its root to /dev/vda"
}

# gx NAME CMD...: run CMD in VM NAME, output on stdout.
gx() {
    name=$1
    shift
    $CLADE exec -n "/tmp/$name.sock" -- "$@"
}

# halt NAME PID: power VM NAME off and check clade exits 0.
halt() {
    $CLADE poweroff "/tmp/$1.sock" >/dev/null || fail "$1: poweroff request failed"
    wait "$2"
    rc=$?
    [ "$rc" = 0 ] || fail "$1: clade exited $rc after power off"
}

# --- layers --------------------------------------------------------------------------------
[ -e "$BASE" ] || fail "no base layer at $BASE (run.sh --disk build/rootfs/base.cdsk)"
info=$($CLADE disk info "$BASE") || fail "disk info $BASE: $info"
case "$info" in *frozen*) ;; *) fail "base is not frozen: $info" ;; esac
$CLADE disk create --parent "$BASE" "$A" >/dev/null || fail "create overlay A"
$CLADE disk create --parent "$BASE" "$B" >/dev/null || fail "create overlay B"
pass base "$(echo "$info" | cut -c1-120)"

# --- first boot: root, python, a write --------------------------------------------------------
boot a "$A"
VM_A=$VM
out=$(gx a sh -c 'grep " / " /proc/mounts; cat /etc/debian_version') || fail "mounts: rc $?"
case "$out" in "/dev/vda / ext4 "*) ;; *) fail "root is not /dev/vda ext4: $out" ;; esac
pass root "$(echo "$out" | tr '\n' ' ')"

out=$(gx a python3 -c 'print(1+1)') || fail "python3: rc $? ($out)"
[ "$out" = 2 ] || fail "python3 printed '$out'"
pass python "python3 -c 'print(1+1)' -> $out"

gx a sh -c 'echo written-by-a > /root/persist.txt && sync' || fail "write: rc $?"
out=$(gx a cat /root/persist.txt)
[ "$out" = written-by-a ] || fail "read back '$out'"
halt a "$VM_A"
pass write "/root/persist.txt written, synced, guest powered off"

# --- second boot on the same overlay ---------------------------------------------------------
boot a "$A"
VM_A=$VM
out=$(gx a cat /root/persist.txt) || fail "persist: rc $? ($out)"
[ "$out" = written-by-a ] || fail "after reboot /root/persist.txt is '$out'"
pass persist "second boot on $A reads '$out'"

# --- a second VM on the other overlay, at the same time ---------------------------------------
boot b "$B"
VM_B=$VM
if gx b test -e /root/persist.txt; then fail "B sees A's /root/persist.txt"; fi
gx b sh -c 'echo written-by-b > /root/b-only.txt && sync' || fail "B write: rc $?"
if gx a test -e /root/b-only.txt; then fail "A sees B's /root/b-only.txt"; fi
out=$(gx b cat /root/b-only.txt)
[ "$out" = written-by-b ] || fail "B reads its own file as '$out'"
out=$(gx a python3 -c 'import os; print(sorted(f for f in os.listdir("/root") if f.endswith(".txt")))')
[ "$out" = "['persist.txt']" ] || fail "A's /root: $out"
out=$(gx b python3 -c 'import os; print(sorted(f for f in os.listdir("/root") if f.endswith(".txt")))')
[ "$out" = "['b-only.txt']" ] || fail "B's /root: $out"
halt a "$VM_A"
halt b "$VM_B"
pass isolation "two VMs on overlays of one base: A sees only persist.txt, B only b-only.txt"

# --- the layers afterwards --------------------------------------------------------------------
$CLADE disk info "$BASE" >/dev/null || fail "base no longer validates"
ia=$($CLADE disk info "$A") || fail "disk info A: $ia"
ib=$($CLADE disk info "$B") || fail "disk info B: $ib"
case "$ia" in *"$BASE"*frozen*) ;; *) fail "A's chain does not end in the frozen base: $ia" ;; esac
case "$(echo "$ia" | head -n1)" in *"writable"*) ;; *) fail "A's top is not a writable overlay: $ia" ;; esac
pass layers "A: $(echo "$ia" | head -n1 | sed 's/.*allocated=/allocated=/'); B: $(echo "$ib" | head -n1 | sed 's/.*allocated=/allocated=/')"

echo DISK-SCENARIO-PASS
exit 0
