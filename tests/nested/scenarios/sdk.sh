#!/bin/busybox sh
# sdk.sh: L1 scenario (run.sh --l1-test, or one of suite.sh's): `clade serve` with a Linux
# template, for the pinned e2b SDK's pytest suite run on the HOST through a forwarded port
# (tests/e2b/run_nested.sh drives both halves):
#
#   tests/nested/build-rootfs.sh
#   tests/nested/run.sh --disk build/rootfs/base.cdsk --disk build/rootfs/debian-image.tar \
#       --forward 39481:8080 --forward 39482:8081 --l1-test tests/nested/scenarios/sdk.sh --expect SDK-SCENARIO-PASS
#   # meanwhile, on the host: tests/e2b/run_nested.sh --wait-log build/nested/nested.log
#
# Steps: bring up L1's NIC (QEMU user network, restrict=on: only the forwarded ports reach
# L1, L1 reaches nothing), make the "world" (a network namespace of this scenario's own
# behind a veth, 10.99.0.0/24 with HTTP servers at 10.99.0.2 and 10.99.0.3: what sandboxes
# reach through the service's NAT, or are kept from by their egress policy; nothing routed
# beyond it), build template "debian" with a network device (Debian's kernel, clade-agent
# as /init, root on an overlay of the Debian base layer /dev/vda, one setup command), start
# `clade serve` on 0.0.0.0:8080, print `NESTED-E2B-READY`, then obey one-line commands on
# the control port 8081 (each a new TCP connection):
#   restart       stop the service (SIGTERM) and start it again on the same state dir
#   lose-host     host A is lost: its service and VM processes are SIGKILLed, its
#                 networks removed and its whole state directory deleted (print
#                 SDK-HOST-LOST); its durable sandboxes live on in the object store
#   netns TAG     print `SDK-NETNS TAG <namespaces> <host veths>` (the service's)
#   kill-vmm ID   SIGKILL sandbox ID's VM process (the one with its files open), print
#                 `SDK-VMM-KILLED ID <count>`
#   rm-template NAME  remove template NAME (`clade template rm`; node n1's when it has it)
#                 and the build cache, print
#                 `SDK-TEMPLATE-REMOVED NAME rc=<rc> held=<n>` (n: its removed files that
#                 a process still holds open 10 s later; `SDK-HELD` lines name them)
#   build-base    build E2B's base template (`clade template build base`) into the suite's
#                 service, FROM the Debian image on /dev/vdb (build-rootfs.sh's OCI archive,
#                 run.sh's second --disk: nothing outside is reached from here); print its
#                 log's tail and `SDK-BASE-BUILT rc=<rc> <seconds> s`
#   build-vms TAG print, for each process of a template build's VM (`build.api` on its
#                 command line), `SDK-BUILD-VM TAG <pid> uid=… capeff=… nnp=… pidns=… kvm=0|1
#                 cgroup=…` (its status and cgroup), then `SDK-BUILD-VMS TAG <count>`
#   cluster-up URL  start a two-node cluster on the registry at URL (PostgreSQL on the
#                 host, reached through run.sh --guestfwd 5432:...): node "n1" on port 8084
#                 (its own state directory, the debian template linked in, networks
#                 `cc-`/`cch`) and node "gw" on port 8085 with no sandboxes, the way in;
#                 both on the same store (prefix s3://clade/cluster); print
#                 SDK-CLUSTER-READY (or SDK-CLUSTER-FAILED with the logs)
#   done pass|fail  the host's verdict: end with it
# After the verdict the service stops; then no sandbox network may be left but those of
# sandboxes still in the registry (the suite kills its sandboxes: none).
# Two more services stand for two hosts that keep paused sandboxes durable in one object
# store (the tests' S3 server, /usr/bin/clade-test-s3, on 127.0.0.1:9000 in this machine):
# "host A" on port 8082 (its own state directory, the debian template linked in) and
# "host B" on port 8083 (its own state directory, no templates); each has sandbox networks
# of its own names and addresses. The first service, the suite's, has no store.
# Prints SDK-SCENARIO-PASS or SDK-SCENARIO-FAIL; every VM is killed before it ends.
# scenario-timeout: 2100

CLADE=/bin/clade
BASE=${DISK_BASE:-/dev/vda}
# The Debian image E2B's base template is built FROM (build-base).
BASE_IMAGE=${BASE_IMAGE:-/dev/vdb}
STATE=/tmp/sdk-state
PORT=8080
CTL=8081
KEY=nested-sdk-key
LOG=/tmp/sdk-serve.log
SERVE=""
STATE_A=/tmp/sdk-state-a
PORT_A=8082
LOG_A=/tmp/sdk-serve-a.log
SERVE_A=""
STATE_B=/tmp/sdk-state-b
PORT_B=8083
LOG_B=/tmp/sdk-serve-b.log
SERVE_B=""
STATE_C1=/tmp/sdk-state-c1
LOG_C1=/tmp/sdk-serve-c1.log
SERVE_C1=""
STATE_GW=/tmp/sdk-state-gw
LOG_GW=/tmp/sdk-serve-gw.log
SERVE_GW=""
CLUSTER_SECRET=nested-cluster-secret-0123456789
S3=""
S3_PORT=9000
# The store both services share (the S3 server's credentials: store/src/s3server.rs).
export AWS_ACCESS_KEY_ID=clade-test AWS_SECRET_ACCESS_KEY=clade-test-secret AWS_REGION=us-east-1
STORE_ARGS="--store s3://clade/sdk --store-endpoint http://127.0.0.1:$S3_PORT"

uptime_s() { cut -d' ' -f1 /proc/uptime; }
# vm_pids [DIR]: the clade processes of this scenario's sandboxes and template build (of
# DIR's: a state directory, by default both services').
vm_pids() {
    for d in /proc/[0-9]*; do
        grep -q "${1:-/tmp/sdk-state}" "$d/cmdline" 2>/dev/null && echo "${d#/proc/}"
    done
}
# sandbox_vm_pids ID: the VM process of sandbox ID (it holds files of its directory open;
# a process from the standby pool has no other mark of its sandbox).
sandbox_vm_pids() {
    for p in $(vm_pids); do
        [ "$p" = "$SERVE" ] && continue
        ls -l "/proc/$p/fd" 2>/dev/null | grep -q "/sandboxes/$1/" && echo "$p"
    done
}
# The service's sandbox networks: namespaces (/run/netns/clade-<i>) and host veth ends.
netns_count() { ls /run/netns 2>/dev/null | grep -c -E '^(clade|ca|cb|cc)-'; }
veth_count() { ls /sys/class/net | grep -c -E '^(cl|ca|cb|cc)h[0-9]'; }
IP=/usr/sbin/ip   # iproute2 (run.sh stages it: NESTED_L1_BINS): busybox's has no netns
WORLD=""
WORLD_DNS=""
cleanup() {
    [ -n "$SERVE" ] && kill "$SERVE" 2>/dev/null
    [ -n "$SERVE_A" ] && kill "$SERVE_A" 2>/dev/null
    [ -n "$SERVE_B" ] && kill "$SERVE_B" 2>/dev/null
    [ -n "$SERVE_C1" ] && kill "$SERVE_C1" 2>/dev/null
    [ -n "$SERVE_GW" ] && kill "$SERVE_GW" 2>/dev/null
    sleep 1
    [ -n "$S3" ] && kill "$S3" 2>/dev/null
    for p in $(vm_pids); do kill -9 "$p" 2>/dev/null; done
    [ -n "$WORLD" ] && kill "$WORLD" 2>/dev/null
    [ -n "$WORLD_DNS" ] && kill "$WORLD_DNS" 2>/dev/null
    # The scenarios after this one need /tmp's space (memory, unless run.sh --scratch).
    rm -rf "$STATE" "$STATE_A" "$STATE_B" "$STATE_C1" "$STATE_GW" /tmp/s3 /tmp/world
}
# dump_threads: where each thread of the service and its VM processes waits (for a hang).
dump_threads() {
    for p in $(vm_pids); do
        echo "---- pid $p: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-100) ----"
        for t in /proc/"$p"/task/*; do
            echo "  $(cat "$t/comm" 2>/dev/null) $(cut -d' ' -f3 "$t/stat" 2>/dev/null) $(cat "$t/wchan" 2>/dev/null)"
        done
    done
}
fail() {
    echo "SDK-SCENARIO-FAIL $*"
    dump_threads
    [ -f "$LOG" ] && { echo "---- $LOG (tail) ----"; tail -n 40 "$LOG"; }
    [ -f "$LOG_A" ] && { echo "---- $LOG_A (tail) ----"; tail -n 40 "$LOG_A"; }
    [ -f "$LOG_B" ] && { echo "---- $LOG_B (tail) ----"; tail -n 40 "$LOG_B"; }
    [ -f "$LOG_C1" ] && { echo "---- $LOG_C1 (tail) ----"; tail -n 40 "$LOG_C1"; }
    [ -f "$LOG_GW" ] && { echo "---- $LOG_GW (tail) ----"; tail -n 40 "$LOG_GW"; }
    for f in "$STATE"/templates/*/build.log "$STATE"/templates/*/build.serial \
        "$STATE"/sandboxes/*/vm.log "$STATE"/sandboxes/*/serial*.log \
        "$STATE_A"/sandboxes/*/vm.log "$STATE_B"/sandboxes/*/vm.log \
        "$STATE_B"/sandboxes/*/serial*.log "$STATE_C1"/sandboxes/*/vm.log; do
        [ -f "$f" ] && { echo "---- $f (tail) ----"; tail -n 12 "$f"; }
    done
    cleanup
    exit 1
}
# start_on PORT STATE LOG [ARGS]: starts a service, waits until it listens; its pid in
# SERVED. Returns 1 (the reason in START_WHY) if it did not start.
start_on() {
    echo "---- serve started at $(uptime_s) ----" >>"$3"
    # shellcheck disable=SC2086
    CLADE_API_KEY="$KEY" $CLADE serve --listen 0.0.0.0:"$1" --state-dir "$2" \
        --max-timeout 3600 --net-dns 10.99.0.4 $4 >>"$3" 2>&1 &
    SERVED=$!
    i=0
    until [ "$(grep -c listening "$3")" -ge "$(grep -c '^---- serve started' "$3")" ]; do
        i=$((i + 1))
        [ "$i" -gt 300 ] && { START_WHY="clade serve on :$1 did not start"; return 1; }
        kill -0 "$SERVED" 2>/dev/null || { START_WHY="clade serve on :$1 exited"; return 1; }
        sleep 0.1
    done
}
# serve_on PORT STATE LOG [ARGS]: start_on, or the scenario fails.
serve_on() {
    start_on "$@" || fail "$START_WHY"
}
start_serve() {
    # With template builds (E2B's build API): Debian's kernel and Clade's initramfs.
    serve_on "$PORT" "$STATE" "$LOG" "--build-kernel /guest/vmlinuz --build-initrd /guest/initrd.cpio"
    SERVE=$SERVED
}
# cluster_up URL: nodes n1 and gw (see cluster-up above); 1 if either did not start.
cluster_up() {
    rm -rf "$STATE_C1" "$STATE_GW"
    mkdir -p "$STATE_C1/templates" "$STATE_GW"
    ln -s "$STATE/templates/debian" "$STATE_C1/templates/debian"
    : >"$LOG_C1"
    : >"$LOG_GW"
    # A long lease: this machine, emulated, can stop for many seconds (see scripts/test.sh),
    # and a node whose lease ran out meanwhile would have its running sandboxes reported
    # lost. Leases and fencing are tested on the native tier (tests/e2b/test_cluster.py).
    # The registry's URL (with its password) and the cluster secret in files of their own
    # (0600), not on the command line, where `ps` shows them to every local user.
    (umask 077 && printf '%s\n' "$1" >/tmp/cluster.url && printf '%s\n' "$CLUSTER_SECRET" >/tmp/cluster.secret)
    args="$STORE_ARGS --cluster-file /tmp/cluster.url --cluster-secret-file /tmp/cluster.secret --lease-ms 60000"
    # This machine has one CPU: by default a node commits no more vCPUs than it has, and
    # the suites run several sandboxes at once (oversubscribed here, as a host may be).
    start_on 8084 "$STATE_C1" "$LOG_C1" "$args --node-name n1 --advertise http://127.0.0.1:8084 --net on --net-name cc --net-range 10.203.0.0/16 --capacity-vcpus 64 --build-kernel /guest/vmlinuz --build-initrd /guest/initrd.cpio" ||
        { echo "$START_WHY"; return 1; }
    SERVE_C1=$SERVED
    start_on 8085 "$STATE_GW" "$LOG_GW" "$args --node-name gw --advertise http://127.0.0.1:8085 --no-sandboxes --net off" ||
        { echo "$START_WHY"; return 1; }
    SERVE_GW=$SERVED
}
trap 'fail "interrupted"' INT TERM
# A trap runs only once the shell's foreground command has ended: every step that waits on
# the service or a VM is bounded here (STEP_LIMIT seconds), so a hung one fails this
# scenario with the service's log instead of outliving suite.sh's timeout.
STEP_LIMIT=600

# octal NUMBER: the byte NUMBER (0-255) as a printf escape.
octal() { printf '\\%03o' "$1"; }
# http_raw REQUEST OUT: sends the file REQUEST (a whole HTTP/1.1 request with
# `Connection: close`) to the service with nc, the answer into OUT. (busybox wget posts
# text only: it stops at the first NUL.) nc ends when the service closes; its input is
# kept open meanwhile. Fails if the service has not closed within STEP_LIMIT seconds.
http_raw() {
    rm -f /tmp/http.done
    ( { cat "$1"; sleep 3600; } | { nc 127.0.0.1 "$PORT" >"$2"; touch /tmp/http.done; } ) &
    # (Shell variables are global: not t0, which the caller times with.)
    http_t0=$(uptime_s)
    i=0
    until [ -f /tmp/http.done ]; do
        i=$((i + 1))
        # The clock every second or so (a loop pass takes longer than 10 ms under TCG).
        if [ $((i % 100)) = 0 ] && [ "$(secs "$http_t0" "$(uptime_s)" | cut -d. -f1)" -gt "$STEP_LIMIT" ]; then
            killall nc sleep 2>/dev/null
            echo "http_raw $1: no end of the answer in ${STEP_LIMIT} s ($(wc -c <"$2") bytes)"
            return 1
        fi
        usleep 10000
    done
    killall sleep 2>/dev/null
    return 0
}
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

# throughput: an 8 MiB upload and an 8 MiB stdout stream, each through the data plane
# (HTTP, envd's protocol) and straight through the agent (`clade cp`, `clade exec`), on one
# sandbox of the template. Both run in this machine, so both are emulated alike: the
# ratio is the figure (times under TCG are not latencies; 32 MiB took 150 s of this
# machine's time for the same ratios).
throughput() {
    n=8388608
    out=$(timeout -s KILL "$STEP_LIMIT" wget -q -O - --header "X-API-KEY: $KEY" --header 'Content-Type: application/json' \
        --post-data '{"templateID":"debian","timeout":900}' "http://127.0.0.1:$PORT/sandboxes") ||
        { echo "create: no answer"; return 1; }
    id=$(echo "$out" | sed -n 's/.*"sandboxID":"\([^"]*\)".*/\1/p')
    # Secured, as every E2B sandbox: data-plane requests carry its envd access token.
    token=$(echo "$out" | sed -n 's/.*"envdAccessToken":"\([^"]*\)".*/\1/p')
    [ -n "$token" ] || { echo "create: no envdAccessToken in $out"; return 1; }
    vs="$STATE/sandboxes/$id/vm.vsock"
    head -c "$n" /dev/urandom >/tmp/blob
    want=$(sha256sum /tmp/blob | cut -d' ' -f1)

    t0=$(uptime_s)
    timeout -s KILL "$STEP_LIMIT" $CLADE cp /tmp/blob "$vs:/root/blob-cp" || { echo "clade cp failed"; return 1; }
    t1=$(uptime_s)
    printf 'POST /files?path=/root/blob-dp&username=root HTTP/1.1\r\nHost: sdk\r\nE2b-Sandbox-Id: %s\r\nX-Access-Token: %s\r\nContent-Type: application/octet-stream\r\nContent-Length: %s\r\nConnection: close\r\n\r\n' \
        "$id" "$token" "$n" >/tmp/up.req
    cat /tmp/blob >>/tmp/up.req
    t2=$(uptime_s)
    http_raw /tmp/up.req /tmp/up.resp || return 1
    t3=$(uptime_s)
    head -n 1 /tmp/up.resp | grep -q ' 200 ' || { head -c 400 /tmp/up.resp; return 1; }
    for f in blob-cp blob-dp; do
        got=$(timeout -s KILL "$STEP_LIMIT" $CLADE exec "$vs" -- sha256sum "/root/$f" | cut -d' ' -f1)
        [ "$got" = "$want" ] || { echo "upload $f: checksum $got, want $want"; return 1; }
    done
    echo "SDK-THROUGHPUT upload $((n >> 20)) MiB: clade cp $(secs "$t0" "$t1") s, data plane $(secs "$t2" "$t3") s, ratio $(awk -v a="$(secs "$t0" "$t1")" -v b="$(secs "$t2" "$t3")" 'BEGIN { printf "%.2f", b / a }')"

    # StartRequest{process: {cmd: "/bin/sh", args: ["-c", CMD]}} in protobuf, in a
    # Connect envelope (flags 0, length big-endian): envd's binary codec, as the SDK sends.
    cmd="head -c $n /dev/zero"
    inner_len=$((2 + 7 + 2 + 2 + 2 + ${#cmd}))
    msg_len=$((2 + inner_len))
    {
        printf 'POST /process.Process/Start HTTP/1.1\r\nHost: sdk\r\nE2b-Sandbox-Id: %s\r\nX-Access-Token: %s\r\nContent-Type: application/connect+proto\r\nContent-Length: %s\r\nConnection: close\r\n\r\n' \
            "$id" "$token" $((5 + msg_len))
        printf "$(octal 0)$(octal 0)$(octal 0)$(octal 0)$(octal "$msg_len")"
        printf "$(octal 10)$(octal "$inner_len")$(octal 10)$(octal 7)/bin/sh$(octal 18)$(octal 2)-c$(octal 18)$(octal ${#cmd})"
        printf '%s' "$cmd"
    } >/tmp/start.req
    t0=$(uptime_s)
    timeout -s KILL "$STEP_LIMIT" $CLADE exec "$vs" -- head -c "$n" /dev/zero >/tmp/exec.out ||
        { echo "clade exec failed"; return 1; }
    t1=$(uptime_s)
    http_raw /tmp/start.req /tmp/start.resp || return 1
    t2=$(uptime_s)
    got=$(wc -c </tmp/exec.out)
    [ "$got" = "$n" ] || { echo "clade exec gave $got bytes"; return 1; }
    got=$(wc -c </tmp/start.resp)
    [ "$got" -gt "$n" ] || { echo "the data plane's stream has $got bytes"; head -c 400 /tmp/start.resp; return 1; }
    echo "SDK-THROUGHPUT stdout $((n >> 20)) MiB: clade exec $(secs "$t0" "$t1") s, data plane $(secs "$t1" "$t2") s, ratio $(awk -v a="$(secs "$t0" "$t1")" -v b="$(secs "$t1" "$t2")" 'BEGIN { printf "%.2f", b / a }')"
    printf 'DELETE /sandboxes/%s HTTP/1.1\r\nHost: sdk\r\nX-API-KEY: %s\r\nConnection: close\r\n\r\n' "$id" "$KEY" >/tmp/del.req
    http_raw /tmp/del.req /tmp/del.resp || return 1
    rm -f /tmp/blob /tmp/up.req /tmp/up.resp /tmp/exec.out /tmp/start.resp
}

[ -e "$BASE" ] || fail "no base layer at $BASE (run.sh --disk build/rootfs/base.cdsk)"
ip link set lo up || fail "lo up"
ip link set eth0 up || fail "eth0 up (run.sh --forward gives L1 a NIC)"
ip addr add 10.0.2.15/24 dev eth0 || fail "eth0 address"
rm -rf "$STATE" "$LOG" "$STATE_A" "$LOG_A" "$STATE_B" "$LOG_B" /tmp/s3
mkdir -p "$STATE" "$STATE_A/templates" "$STATE_B" /tmp/s3/clade

[ -x /usr/bin/clade-test-s3 ] || fail "no /usr/bin/clade-test-s3 (scripts/setup.sh builds it; build-outer.sh stages it)"
/usr/bin/clade-test-s3 --host 127.0.0.1 --port "$S3_PORT" --access-key "$AWS_ACCESS_KEY_ID" \
    --secret-key "$AWS_SECRET_ACCESS_KEY" /tmp/s3 >/tmp/s3.log 2>&1 &
S3=$!
i=0
# (busybox nc has no -z: the listening socket is looked for in /proc/net/tcp, state 0A.)
s3_port_hex=$(printf '%04X' "$S3_PORT")
until awk -v p=":$s3_port_hex" '$4 == "0A" && substr($2, length($2) - 4) == p { f = 1 } END { exit !f }' /proc/net/tcp; do
    i=$((i + 1))
    [ "$i" -gt 600 ] && { cat /tmp/s3.log; fail "the S3 server did not listen"; }
    kill -0 "$S3" 2>/dev/null || { cat /tmp/s3.log; fail "the S3 server exited"; }
    sleep 0.1
done
echo "SDK-S3 127.0.0.1:$S3_PORT"

# The world: its own namespace, a veth to this machine, two addresses, one HTTP server.
[ -x "$IP" ] && [ -x /usr/sbin/nft ] || fail "no $IP or /usr/sbin/nft (NESTED_L1_BINS)"
mkdir -p /run/netns   # the initramfs has no /run
mkdir -p /tmp/world
echo "hello from the world" >/tmp/world/hello.txt
head -c 1048576 /dev/urandom >/tmp/world/blob
sha256sum /tmp/world/blob | cut -d' ' -f1 >/tmp/world/blob.sha256
$IP netns add world || fail "world namespace"
$IP link add wv0 type veth peer name wv1 netns world || fail "world veth"
$IP addr add 10.99.0.1/24 dev wv0 && $IP link set wv0 up || fail "world veth, this side"
$IP -n world addr add 10.99.0.2/24 dev wv1 && $IP -n world addr add 10.99.0.3/24 dev wv1 &&
    $IP -n world link set wv1 up && $IP -n world link set lo up &&
    $IP -n world route add default via 10.99.0.1 || fail "world addresses"
$IP netns exec world httpd -f -p 8000 -h /tmp/world &
WORLD=$!
# The world's DNS, the service's upstream (--net-dns): a.world.test is 10.99.0.2,
# b.world.test 10.99.0.3 (names under them too). dnsmasq looks its user up: L1 has no
# /etc/passwd of its own.
[ -x /usr/sbin/dnsmasq ] || fail "no /usr/sbin/dnsmasq (NESTED_L1_BINS)"
grep -q '^root:' /etc/passwd 2>/dev/null || echo 'root:x:0:0:root:/root:/bin/sh' >>/etc/passwd
grep -q '^root:' /etc/group 2>/dev/null || echo 'root:x:0:' >>/etc/group
$IP -n world addr add 10.99.0.4/24 dev wv1 || fail "world DNS address"
$IP netns exec world /usr/sbin/dnsmasq --keep-in-foreground --no-resolv --no-hosts \
    --conf-file=/dev/null --user=root --group=root --pid-file= --listen-address=10.99.0.4 \
    --bind-interfaces --address=/a.world.test/10.99.0.2 --address=/b.world.test/10.99.0.3 \
    --log-facility=- >>/tmp/world-dns.log 2>&1 &
WORLD_DNS=$!
echo "SDK-WORLD 10.99.0.2 10.99.0.3 port 8000, DNS 10.99.0.4"

t0=$(uptime_s)
timeout -s KILL "$STEP_LIMIT" $CLADE template build debian --state-dir "$STATE" --kernel /guest/vmlinuz --net \
    --initrd /guest/initrd.cpio --disk "$BASE" --mem-mib 256 --vcpus 1 --agent-timeout 240 \
    --cmdline "console=ttyS0 panic=-1 quiet clade.root=/dev/vda" \
    --run 'echo made-by-the-template > /root/template.txt' || fail "template build"
echo "SDK-TEMPLATE debian built in $(awk -v a="$t0" -v b="$(uptime_s)" 'BEGIN { printf "%.1f", b - a }') s"

: >"$LOG"
start_serve
# Hosts A and B: the same store, networks of their own (`ca-<i>`/`cah<i>`, `cb-`/`cbh`).
ln -s "$STATE/templates/debian" "$STATE_A/templates/debian"
: >"$LOG_A"
serve_on "$PORT_A" "$STATE_A" "$LOG_A" "$STORE_ARGS --net on --net-name ca --net-range 10.201.0.0/16"
SERVE_A=$SERVED
: >"$LOG_B"
serve_on "$PORT_B" "$STATE_B" "$LOG_B" "$STORE_ARGS --net on --net-name cb --net-range 10.202.0.0/16"
SERVE_B=$SERVED
throughput || fail "throughput"
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
    "netns "*) echo "SDK-NETNS ${cmd#netns } $(netns_count) $(veth_count)" ;;
    lose-host)
        kill -9 "$SERVE_A" 2>/dev/null
        wait "$SERVE_A" 2>/dev/null
        SERVE_A=""
        for p in $(vm_pids "$STATE_A/"); do kill -9 "$p" 2>/dev/null; done
        sleep 1
        # A lost host's sandbox networks are gone with it; here they are this machine's,
        # so they go now.
        for n in $(ls /run/netns 2>/dev/null | grep '^ca-'); do $IP netns del "$n"; done
        for v in $(ls /sys/class/net | grep '^cah[0-9]'); do $IP link del "$v" 2>/dev/null; done
        /usr/sbin/nft delete table ip ca 2>/dev/null
        rm -rf "$STATE_A"
        echo "SDK-HOST-LOST"
        ;;
    "kill-vmm "*)
        n=0
        for p in $(sandbox_vm_pids "${cmd#kill-vmm }"); do kill -9 "$p" 2>/dev/null && n=$((n + 1)); done
        echo "SDK-VMM-KILLED ${cmd#kill-vmm } $n"
        ;;
    "rm-template "*)
        # A template a test built (through E2B's build API) and the build cache go: this
        # machine's /tmp is memory, and later tests need it.
        name=${cmd#rm-template }
        # The suite's service, or the cluster's node n1 (where the cluster builds).
        dir=$STATE
        # (a template's builds: its own directory, and name@<build id> for tagged ones)
        if [ -n "$SERVE_C1" ]; then
            for b in "$STATE_C1/templates/$name" "$STATE_C1/templates/$name"@*; do
                [ -d "$b" ] && dir=$STATE_C1
            done
        fi
        $CLADE template rm "$name" --state-dir "$dir" >/dev/null 2>&1
        r=$?
        rm -rf "$dir/templates/.build-cache"
        # This machine's /tmp is memory: the removed template's files must not be held
        # open by anyone (a standby that opened it ahead is retired within a second).
        i=0
        while :; do
            held=$(for f in /proc/[0-9]*/fd/*; do
                l=$(readlink "$f" 2>/dev/null) || continue
                case "$l" in */templates/"$name"/*" (deleted)" | */templates/"$name"@*" (deleted)") echo "${f#/proc/} $l" ;; esac
            done)
            [ -z "$held" ] || [ "$i" -ge 20 ] && break
            i=$((i + 1))
            sleep 0.5
        done
        [ -n "$held" ] && echo "$held" | head -n 5 | sed 's/^/SDK-HELD /'
        # (and what takes the most of it)
        echo "SDK-TMP $(df -k /tmp | awk 'NR == 2 { print "used=" $3 "K free=" $4 "K" }')" \
            "$(du -sk /tmp/* 2>/dev/null | sort -rn | head -n 5 | awk '{ printf " %s=%dM", $2, $1 / 1024 }')"
        echo "SDK-TEMPLATE-REMOVED $name rc=$r held=$(echo "$held" | grep -c .)"
        ;;
    build-base)
        t0=$(uptime_s)
        r=0
        # (its build VM's network named apart from the running service's)
        if [ -b "$BASE_IMAGE" ]; then
            timeout -s KILL 1200 $CLADE template build base --state-dir "$STATE" \
                --build-arg "BASE=$BASE_IMAGE" --kernel /guest/vmlinuz --initrd /guest/initrd.cpio \
                --mem-mib 256 --vcpus 1 --agent-timeout 240 --net-name cbase --net-range 10.204.0.0/16 \
                >/tmp/base-build.log 2>&1 || r=$?
            tail -n 12 /tmp/base-build.log
        else
            echo "no base image at $BASE_IMAGE (run.sh --disk build/rootfs/debian-image.tar, the second)"
            r=1
        fi
        echo "SDK-BASE-BUILT rc=$r $(awk -v a="$t0" -v b="$(uptime_s)" 'BEGIN { printf "%.1f", b - a }') s"
        ;;
    "build-vms "*)
        tag=${cmd#build-vms }
        n=0
        for d in /proc/[0-9]*; do
            tr '\0' ' ' <"$d/cmdline" 2>/dev/null | grep -q '/build\.api ' || continue
            st=$(cat "$d/status" 2>/dev/null) || continue
            uid=$(echo "$st" | awk '/^Uid:/ { print $2 }')
            cap=$(echo "$st" | awk '/^CapEff:/ { print $2 }')
            nnp=$(echo "$st" | awk '/^NoNewPrivs:/ { print $2 }')
            pidns=$(echo "$st" | awk '/^NSpid:/ { print NF - 1 }')
            cg=$(grep -m1 -E ':memory:|^0::' "$d/cgroup" 2>/dev/null | cut -d: -f3)
            # kvm=1: the VM process itself (it holds /dev/kvm; a jail of the service is that
            # one process), not yet while it builds its jail. proc: the options of the
            # /proc mounted in its jail.
            kvm=0
            ls -l "$d/fd" 2>/dev/null | grep -q '/dev/kvm' && kvm=1
            proc=$(awk '$5 == "/proc" { print $NF }' "$d/mountinfo" 2>/dev/null | tr '\n' ';')
            echo "SDK-BUILD-VM $tag ${d#/proc/} uid=$uid capeff=$cap nnp=$nnp pidns=$pidns kvm=$kvm cgroup=$cg proc=${proc:-none}"
            n=$((n + 1))
        done
        echo "SDK-BUILD-VMS $tag $n"
        ;;
    "cluster-up "*)
        if cluster_up "${cmd#cluster-up }"; then
            echo "SDK-CLUSTER-READY n1=8084 gw=8085"
        else
            echo "SDK-CLUSTER-FAILED"
            tail -n 30 "$LOG_C1" "$LOG_GW"
        fi
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
rc_a=0
if [ -n "$SERVE_A" ]; then
    kill -TERM "$SERVE_A"
    wait "$SERVE_A"
    rc_a=$?
    SERVE_A=""
fi
kill -TERM "$SERVE_B"
wait "$SERVE_B"
rc_b=$?
SERVE_B=""
# The cluster's nodes, when the host started them: the gateway first, then n1.
rc_c=0
for v in SERVE_GW SERVE_C1; do
    eval "p=\$$v"
    [ -n "$p" ] || continue
    kill -TERM "$p"
    wait "$p" || rc_c=$?
    eval "$v=''"
done
for l in "$LOG" "$LOG_A" "$LOG_B" "$LOG_C1" "$LOG_GW"; do
    [ -f "$l" ] || continue
    echo "---- $l (tail) ----"
    tail -n 15 "$l"
done
[ "$verdict" = pass ] || fail "the host's SDK suite failed"
[ "$rc" = 0 ] || fail "clade serve exited $rc on SIGTERM"
[ "$rc_a" = 0 ] || fail "host A's clade serve exited $rc_a on SIGTERM"
[ "$rc_b" = 0 ] || fail "host B's clade serve exited $rc_b on SIGTERM"
[ "$rc_c" = 0 ] || fail "a cluster node's clade serve exited $rc_c on SIGTERM"
# Every sandbox was killed by the suite, and the pool goes with the service.
left=$(netns_count)
[ "$left" = 0 ] || { ls /run/netns; fail "$left sandbox network namespaces left"; }
[ "$(veth_count)" = 0 ] || { ls /sys/class/net; fail "sandbox veths left"; }
echo "SDK-NETNS-CLEAN"
cleanup
echo "SDK-SCENARIO-PASS"
