#!/bin/busybox sh
# shellcheck shell=dash disable=SC2016  # single-quoted scripts expand in the guest's sh
# balloon.sh: L1 scenario (run.sh --l1-test): a Linux guest (Debian's kernel, clade-agent
# as /init) with `clade run --balloon` gives the memory it frees back to the host through
# free page reporting. One `BALLOON-CHECK-PASS <check>: <detail>` line per check; prints
# BALLOON-SCENARIO-PASS and exits 0 when all pass, BALLOON-SCENARIO-FAIL and exits 1 at the
# first failure.
#
#   tests/nested/run.sh --l1-test tests/nested/scenarios/balloon.sh \
#       --expect BALLOON-SCENARIO-PASS --expect '^CLADE-EXIT 0$'
#
# The guest's virtio_balloon module (from its initramfs' load-order) binds the device; the
# guest writes 512 MiB to its /tmp (a tmpfs: guest RAM the host backs as it is touched),
# which the VM process's RSS must show; after `rm`, the RSS must drop by at least 80 % of
# 512 MiB within BALLOON_WAIT seconds (default 10; Linux reports free 2 MiB blocks about
# 2 s after they are freed).
# scenario-timeout: 300

CLADE=/bin/clade
WAIT=${BALLOON_WAIT:-10}
VM=""

uptime_s() { cut -d' ' -f1 /proc/uptime; }
T=$(uptime_s)
fail() {
    echo "BALLOON-SCENARIO-FAIL $*"
    [ -f /tmp/balloon-guest.log ] && tail -n 40 /tmp/balloon-guest.log
    [ -n "$VM" ] && kill "$VM" 2>/dev/null
    exit 1
}
pass() {
    now=$(uptime_s)
    echo "BALLOON-CHECK-PASS $1: $2 ($(awk -v a="$T" -v b="$now" 'BEGIN { printf "%.1f", b - a }') s)"
    T=$now
}
gexec() { $CLADE exec -n /tmp/balloon.sock -- "$@"; }
# The VM process's resident memory, in MiB.
rss_mib() { awk '/^VmRSS:/ { printf "%d", $2 / 1024 }' "/proc/$VM/status"; }

rm -f /tmp/balloon.sock
$CLADE run --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem-mib 1280 --vcpus 1 \
    --balloon --vsock /tmp/balloon.sock --serial-file /tmp/balloon-guest.log \
    --cmdline "console=ttyS0 panic=-1 quiet" &
VM=$!
out=$($CLADE ping --wait 180 /tmp/balloon.sock) || fail "ping: rc $?: $out"
pass boot "$out"

drv=$(gexec ls /sys/bus/virtio/drivers/virtio_balloon) || fail "no virtio_balloon driver"
case "$drv" in *virtio*) ;; *) fail "virtio_balloon is bound to no device: $drv" ;; esac
pass driver "virtio_balloon bound: $(echo "$drv" | tr '\n' ' ')"

before=$(rss_mib)
gexec dd if=/dev/zero of=/tmp/balloon.fill bs=1M count=512 2>&1 || fail "dd in the guest"
full=$(rss_mib)
[ $((full - before)) -ge 450 ] || fail "512 MiB written in the guest, RSS $before -> $full MiB"
pass fill "RSS $before -> $full MiB after the guest wrote 512 MiB"

gexec rm /tmp/balloon.fill || fail "rm in the guest"
t0=$(uptime_s)
now=$full
for _ in $(seq $((WAIT * 4))); do
    now=$(rss_mib)
    [ $((full - now)) -ge 410 ] && break
    sleep 0.25
done
took=$(awk -v a="$t0" -v b="$(uptime_s)" 'BEGIN { printf "%.1f", b - a }')
[ $((full - now)) -ge 410 ] ||
    fail "the guest freed 512 MiB: RSS $full -> $now MiB after $took s (want >= 410 MiB back)"
pass return "RSS $full -> $now MiB $took s after the guest freed 512 MiB"

kill "$VM"
wait "$VM"
echo "BALLOON-SCENARIO-PASS"
exit 0
