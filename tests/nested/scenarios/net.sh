#!/bin/busybox sh
# net.sh: L1 scenario (run.sh --l1-test): a Linux guest (Debian's kernel, clade-agent as
# /init with `clade.net=`, root on an overlay of the Debian base layer) on clade's
# virtio-net device over a TAP that clade creates in the nested machine; the addresses are
# this scenario's own (10.10.0.0/24 on the TAP, nothing routed anywhere else).
#
#   tests/nested/build-rootfs.sh
#   tests/nested/run.sh --disk build/rootfs/base.cdsk \
#       --l1-test tests/nested/scenarios/net.sh --expect NET-SCENARIO-PASS
#
# Checks (one `NET-CHECK-PASS <check>: <detail>` line each):
#   up        the guest's agent configured eth0 (CLADE-AGENT-NET) and answers
#   download  the guest fetches a 4 MiB file from an HTTP server on the TAP's host side
#             (python3 urllib), same SHA-256
#   upload    the host side fetches a file from `python3 -m http.server` in the guest
#   throughput  32 MiB guest -> host over the TAP and over vsock: NET-THROUGHPUT line
#   restore   snapshot, SIGKILL, restore onto a new TAP of the same name: the guest's
#             network works again without any change inside it (download again)
#   stop      power off: the TAP is gone with the VM process
#   own       `clade run --net auto`: the VM's own network (namespace, NAT, DNS on its
#             gateway) made by clade, the guest's address given on its command line; the
#             guest downloads the file from a server in a "world" namespace of this
#             scenario's own through the NAT; power off: the namespace is gone

CLADE=/bin/clade
BASE=${DISK_BASE:-/dev/vda}
D=/tmp/net
TAP=ctap0
CMDLINE="console=ttyS0 panic=-1 quiet clade.root=/dev/vda clade.net=10.10.0.2/24,10.10.0.1"
VM=""
HTTPD=""
uptime_s() { cut -d' ' -f1 /proc/uptime; }
T=$(uptime_s)
fail() {
    echo "NET-SCENARIO-FAIL $*"
    for c in rx_packets tx_packets rx_dropped tx_dropped; do
        echo "$TAP $c: $(cat /sys/class/net/$TAP/statistics/$c 2>/dev/null)"
    done
    ip neigh 2>/dev/null
    for f in "$D"/*.log "$D"/*.serial; do
        [ -f "$f" ] && { echo "---- $f ----"; tail -n 25 "$f"; }
    done
    [ -n "$VM" ] && kill -9 "$VM" 2>/dev/null
    [ -n "$HTTPD" ] && kill "$HTTPD" 2>/dev/null
    exit 1
}
pass() {
    now=$(uptime_s)
    echo "NET-CHECK-PASS $1: $2 ($(awk -v a="$T" -v b="$now" 'BEGIN { printf "%.1f", b - a }') s)"
    T=$now
}
gx() { $CLADE exec -n "$D/vm.sock" -- "$@"; }
# tap_up: give the TAP (made by the VM process) the host side's address.
tap_up() {
    i=0
    until [ -e /sys/class/net/$TAP ]; do
        i=$((i + 1))
        [ "$i" -gt 200 ] && fail "$TAP did not appear"
        sleep 0.05
    done
    # The same MAC on every TAP, as every restored or forked copy of a sandbox sees the
    # same host side: the guest's neighbour entry for 10.10.0.1 stays right.
    ip link set $TAP address 02:00:0a:0a:00:01 || fail "MAC of $TAP"
    ip addr add 10.10.0.1/24 dev $TAP || fail "address on $TAP"
    ip link set $TAP up || fail "$TAP up"
}
# fetch [HOST]: the SHA-256 of the blob the guest downloads from HOST:8000 (the TAP's side).
fetch() {
    gx python3 -c "import hashlib, urllib.request; print(hashlib.sha256(urllib.request.urlopen('http://${1:-10.10.0.1}:8000/blob', timeout=60).read()).hexdigest())"
}
# power_off WHAT: powers the VM off through its agent and waits for its process to end.
power_off() {
    $CLADE poweroff "$D/vm.sock" >/dev/null 2>&1
    i=0
    while kill -0 "$VM" 2>/dev/null; do
        i=$((i + 1))
        [ "$i" -gt 200 ] && fail "$1: did not power off"
        sleep 0.1
    done
}

[ -e "$BASE" ] || fail "no base layer at $BASE"
[ -c /dev/net/tun ] || fail "no /dev/net/tun (run.sh loads tun in the nested machine)"
rm -rf "$D"
mkdir -p "$D/www"
head -c 4194304 /dev/urandom >"$D/www/blob"
want=$(sha256sum "$D/www/blob" | cut -d' ' -f1)
$CLADE disk create --parent "$BASE" "$D/vm.cdsk" >/dev/null || fail "overlay"

$CLADE run --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem 256 --vcpus 1 \
    --vsock "$D/vm.sock" --api-sock "$D/vm.api" --disk "$D/vm.cdsk" --net "tap=$TAP" \
    --serial-file "$D/vm.serial" --cmdline "$CMDLINE" 2>"$D/vm.log" &
VM=$!
tap_up
httpd -f -p 10.10.0.1:8000 -h "$D/www" &
HTTPD=$!
$CLADE ping --wait 180 "$D/vm.sock" >/dev/null || fail "agent did not answer"
grep -q "CLADE-AGENT-NET eth0 10.10.0.2/24" "$D/vm.serial" || fail "no CLADE-AGENT-NET line"
pass up "$(gx cat /sys/class/net/eth0/address) $(grep -o 'CLADE-AGENT-NET.*' "$D/vm.serial")"

got=$(fetch) || fail "download: $got"
[ "$got" = "$want" ] || fail "download: sha256 $got, want $want"
pass download "4 MiB, sha256 $want"

gx sh -c 'cd /root && head -c 1048576 /dev/urandom > g.bin && sha256sum g.bin' >"$D/g.sum" || fail "guest file"
gx sh -c 'cd /root && exec python3 -m http.server 8001 --bind 10.10.0.2 >/dev/null 2>&1' &
i=0
until wget -q -O "$D/g.bin" http://10.10.0.2:8001/g.bin 2>/dev/null; do
    i=$((i + 1))
    [ "$i" -gt 60 ] && fail "upload: the guest's server did not answer"
    sleep 0.5
done
[ "$(sha256sum "$D/g.bin" | cut -d' ' -f1)" = "$(cut -d' ' -f1 "$D/g.sum")" ] || fail "upload: checksum"
pass upload "1 MiB from the guest's http.server"

# Throughput guest -> host, the same 32 MiB file through the TAP (HTTP from the guest's
# server) and through vsock (the agent's file read, `clade cp`), in this machine alike:
# the ratio is the figure (times under TCG are not throughputs).
gx sh -c 'head -c 33554432 /dev/urandom > /root/t.bin' || fail "throughput: guest file"
t0=$(uptime_s)
wget -q -O "$D/t-tap.bin" http://10.10.0.2:8001/t.bin || fail "throughput: HTTP over the TAP"
t1=$(uptime_s)
$CLADE cp "$D/vm.sock:/root/t.bin" "$D/t-vsock.bin" || fail "throughput: clade cp over vsock"
t2=$(uptime_s)
cmp -s "$D/t-tap.bin" "$D/t-vsock.bin" || fail "throughput: the two copies differ"
rm -f "$D/t-tap.bin" "$D/t-vsock.bin"
tap_s=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
vsock_s=$(awk -v a="$t1" -v b="$t2" 'BEGIN { printf "%.2f", b - a }')
echo "NET-THROUGHPUT guest->host 32 MiB: TAP (HTTP) $tap_s s, vsock (clade cp) $vsock_s s, TAP/vsock time ratio $(awk -v a="$tap_s" -v b="$vsock_s" 'BEGIN { printf "%.2f", a / b }')"
pass throughput "32 MiB both ways identical"

$CLADE snapshot "$D/vm.api" "$D/snap" >/dev/null || fail "snapshot"
kill -9 "$VM"
wait "$VM" 2>/dev/null
i=0
while [ -e /sys/class/net/$TAP ]; do
    i=$((i + 1))
    [ "$i" -gt 100 ] && fail "$TAP outlived its VM process"
    sleep 0.05
done
rm -f "$D/vm.sock" "$D/vm.api"
$CLADE restore "$D/snap" --vsock "$D/vm.sock" --api-sock "$D/vm.api" --net "tap=$TAP" \
    --disk-overlay "$D/vm2.cdsk" --serial-file "$D/vm2.serial" 2>"$D/vm2.log" &
VM=$!
tap_up
$CLADE ping --wait 120 "$D/vm.sock" >/dev/null || fail "restored: agent did not answer"
got=$(fetch) || fail "restored: download: $got"
[ "$got" = "$want" ] || fail "restored: sha256 $got"
pass restore "the same guest address on a new TAP, no change in the guest"

power_off stop
[ -e /sys/class/net/$TAP ] && fail "$TAP outlived the VM"
kill "$HTTPD" 2>/dev/null
pass stop "powered off; $TAP gone"

# own: a network of the VM's own. The "world" is a namespace with a veth to this machine
# (10.98.0.1 here, 10.98.0.2 there): sandboxes' NAT reaches it, nothing reaches further.
IP=/usr/sbin/ip # iproute2 (run.sh stages it: NESTED_L1_BINS): busybox's has no netns
mkdir -p /run/netns # the initramfs has no /run
$IP netns add networld || fail "own: world namespace"
$IP link add nwv0 type veth peer name nwv1 netns networld || fail "own: world veth"
$IP addr add 10.98.0.1/24 dev nwv0 && $IP link set nwv0 up || fail "own: world veth here"
$IP -n networld addr add 10.98.0.2/24 dev nwv1 && $IP -n networld link set nwv1 up &&
    $IP -n networld link set lo up && $IP -n networld route add default via 10.98.0.1 ||
    fail "own: world addresses"
$IP netns exec networld httpd -f -p 8000 -h "$D/www" &
HTTPD=$!
$CLADE disk create --parent "$BASE" "$D/vm3.cdsk" >/dev/null || fail "own: overlay"
rm -f "$D/vm.sock" "$D/vm.api"
$CLADE run --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem 256 --vcpus 1 \
    --vsock "$D/vm.sock" --api-sock "$D/vm.api" --disk "$D/vm3.cdsk" --net auto \
    --serial-file "$D/vm3.serial" --cmdline "console=ttyS0 panic=-1 quiet clade.root=/dev/vda" \
    2>"$D/vm3.log" &
VM=$!
$CLADE ping --wait 180 "$D/vm.sock" >/dev/null || fail "own: agent did not answer"
grep -q "CLADE-AGENT-NET eth0 172.16.0.2/30" "$D/vm3.serial" || fail "own: no CLADE-AGENT-NET line"
ns=$(ls /run/netns | grep '^cladevm-') || fail "own: no namespace cladevm-*"
got=$(fetch 10.98.0.2) || fail "own: download through the NAT: $got"
[ "$got" = "$want" ] || fail "own: sha256 $got, want $want"
power_off own
[ -e "/run/netns/$ns" ] && fail "own: $ns outlived the VM"
kill "$HTTPD" 2>/dev/null
$IP netns del networld
pass own "$ns: 4 MiB from the world through its NAT, same sha256; removed at power off"
# (the scenarios after this one need /tmp: it may be memory)
rm -rf "$D"
echo "NET-SCENARIO-PASS"
