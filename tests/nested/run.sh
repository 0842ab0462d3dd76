#!/bin/bash
# run.sh: the nested tier's one entry point. Fetches Debian's kernel, builds the guest and
# outer initramfs, boots the outer VM under QEMU TCG (emulated AMD CPU with SVM), where
# `clade run` boots the same Debian kernel as a nested KVM guest running clade-agent as /init.
#
# PASS when the log has the guest's `CLADE-GUEST-READY` line and `CLADE-EXIT 0`.
# Exit 0 on PASS, 1 on FAIL.
#
# Usage: tests/nested/run.sh [options] [-- extra qemu-system-x86_64 arguments]
#   --timeout SECONDS   host timeout for the outer VM (default 600; env NESTED_TIMEOUT)
#   --stall SECONDS     end the outer VM early when its console has printed nothing for
#                       SECONDS (default 0: never; env NESTED_STALL). The L1 test must print
#                       now and then (suite.sh prints a heartbeat line every 30 s); the log
#                       of a machine so ended has a `NESTED-STALL` line at its end.
#                       Before that, from 45 s of silence, a key press is sent to the
#                       outer VM every 30 s (its keyboard interrupt; see stall_watch);
#                       each is noted (`NESTED-POKE`, and `NESTED-WOKEN` when the console
#                       then goes on) at the log's end
#   --skip-build        reuse build/nested/outer.cpio as it is (env NESTED_SKIP_BUILD=1)
#   --l1-test FILE      run FILE in the outer VM instead of the clade command (NESTED_L1_TEST)
#   --standin qemu      run QEMU/KVM instead of clade in the outer VM (NESTED_STANDIN)
#   --expect REGEX      required log line pattern (ERE); repeatable; replaces the defaults
#   --disk FILE         attach FILE read-only to the outer VM as a virtio disk (L1's /dev/vda;
#                       L1 loads virtio_pci and virtio_blk), e.g. build/rootfs/base.cdsk;
#                       repeatable: the second is /dev/vdb, and so on
#   --scratch SIZE      L1's /tmp on a writable disk of SIZE (e.g. 8G; env NESTED_SCRATCH),
#                       instead of memory: an empty ext4 file system made here in
#                       build/nested/scratch.img (sparse; made anew each run, deleted after),
#                       attached after the --disk ones (its L1 device is given to L1's
#                       /init as nested.scratch=). Its pages are L1's page cache, which L1
#                       can write back and drop, where a tmpfs's stay in L1's memory
#   --forward HOST:L1   forward the host's 127.0.0.1:HOST to L1's TCP port L1 (repeatable).
#                       Gives L1 a virtio-net NIC on QEMU's user network with restrict=on:
#                       L1 reaches nothing outside; only the forwarded ports reach L1 (its
#                       address is 10.0.2.15/24; scenarios bring eth0 up themselves).
#   --guestfwd L1:HOST  with --forward: L1's connections to 10.0.2.100:L1 reach the host's
#                       127.0.0.1:HOST (repeatable; each connection relayed by a `busybox
#                       nc` QEMU starts). Nothing else outside is reachable from L1.
#   -h, --help
# More environment (see build-outer.sh): NESTED_CLADE_CMD, NESTED_L1_EXTRA,
# NESTED_L1_TIMEOUT (inner; default: timeout - 60 s), NESTED_SKIP_CLADE; and for QEMU: NESTED_CPU
# (EPYC), NESTED_MEM (2G), NESTED_APPEND (added to the outer kernel command line).
# Outputs: build/nested/ (nested.log is the timestamped outer console).
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() { sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; }

TIMEOUT=${NESTED_TIMEOUT:-600}
STALL=${NESTED_STALL:-0}
SKIP_BUILD=${NESTED_SKIP_BUILD:-0}
EXPECT=()
QEMU_EXTRA=()
OUTER_DISKS=()
FORWARDS=()
GUESTFWDS=()
SCRATCH=${NESTED_SCRATCH:-}
while [ $# -gt 0 ]; do
    case "$1" in
    --timeout) TIMEOUT=${2:?--timeout needs a value}; shift 2 ;;
    --stall) STALL=${2:?--stall needs a value}; shift 2 ;;
    --skip-build) SKIP_BUILD=1; shift ;;
    --l1-test) export NESTED_L1_TEST=${2:?--l1-test needs a file}; shift 2 ;;
    --standin) export NESTED_STANDIN=${2:?--standin needs a value}; shift 2 ;;
    --expect) EXPECT+=("${2:?--expect needs a pattern}"); shift 2 ;;
    --disk) OUTER_DISKS+=("${2:?--disk needs a file}"); shift 2 ;;
    --scratch) SCRATCH=${2:?--scratch needs a size}; shift 2 ;;
    --forward) FORWARDS+=("${2:?--forward needs HOST:L1}"); shift 2 ;;
    --guestfwd) GUESTFWDS+=("${2:?--guestfwd needs L1:HOST}"); shift 2 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; QEMU_EXTRA=("$@"); break ;;
    *) usage >&2; die "unknown argument: $1" ;;
    esac
done
if [ ${#EXPECT[@]} -eq 0 ]; then
    EXPECT=('CLADE-GUEST-READY kernel=' '^CLADE-EXIT 0$')
fi
case "$TIMEOUT" in '' | *[!0-9]*) die "timeout must be a number of seconds, got '$TIMEOUT'" ;; esac
case "$STALL" in '' | *[!0-9]*) die "stall must be a number of seconds, got '$STALL'" ;; esac
# The inner (L1) timeout must fire first so a hung clade still gives CLADE-EXIT and the
# outer VM's log; leave time for the outer boot.
if [ -z "${NESTED_L1_TIMEOUT:-}" ]; then
    export NESTED_L1_TIMEOUT=$((TIMEOUT > 120 ? TIMEOUT - 60 : TIMEOUT / 2))
fi

case "$SCRATCH" in '' | [0-9]*[GM]) ;; *) die "--scratch wants a size such as 8G, got '$SCRATCH'" ;; esac
if [ ${#OUTER_DISKS[@]} -gt 0 ]; then
    for d in "${OUTER_DISKS[@]}"; do
        [ -f "$d" ] || die "--disk $d: no such file"
        # QEMU sees a raw file's size rounded down to whole sectors.
        [ $(($(stat -c %s "$d") % 512)) = 0 ] || die "--disk $d: its size is not a multiple of 512"
    done
    export NESTED_L1_MODULES="${NESTED_L1_MODULES:+$NESTED_L1_MODULES }virtio_pci virtio_blk"
fi
if [ -n "$SCRATCH" ]; then
    # (after the --disk ones, whose order scenarios rely on: /dev/vda, /dev/vdb, ...)
    [ ${#OUTER_DISKS[@]} -gt 0 ] || export NESTED_L1_MODULES="${NESTED_L1_MODULES:+$NESTED_L1_MODULES }virtio_pci virtio_blk"
    export NESTED_L1_MODULES="$NESTED_L1_MODULES ext4"
fi

# Sandbox networking in L1 (a VM's TAP; clade serve's namespaces, NAT and egress policy;
# scenarios' own set-up): TUN/TAP, veth, nftables with NAT and conntrack, and the `nft`
# and iproute2 `ip` programs (busybox's ip has no netns). crc32c_generic first: libcrc32c
# (under nf_conntrack and nf_tables) needs a crc32c algorithm when it loads, and L1 has no
# modprobe to fetch one on demand.
export NESTED_L1_MODULES="${NESTED_L1_MODULES:+$NESTED_L1_MODULES }crc32c_generic tun veth nf_tables nft_chain_nat nft_nat nft_masq nft_ct"
export NESTED_L1_BINS="${NESTED_L1_BINS:-nft ip dnsmasq mkfs.ext4 debugfs script}"

NETDEV=""
if [ ${#FORWARDS[@]} -gt 0 ]; then
    NETDEV="user,id=n0,restrict=on,net=10.0.2.0/24"
    for f in "${FORWARDS[@]}"; do
        case "$f" in
        [0-9]*:[0-9]*) ;;
        *) die "--forward wants HOSTPORT:L1PORT, got '$f'" ;;
        esac
        NETDEV+=",hostfwd=tcp:127.0.0.1:${f%%:*}-10.0.2.15:${f##*:}"
    done
    # restrict=on still lets L1 reach a guestfwd's address and port, and only those.
    for f in "${GUESTFWDS[@]}"; do
        case "$f" in
        [0-9]*:[0-9]*) ;;
        *) die "--guestfwd wants L1PORT:HOSTPORT, got '$f'" ;;
        esac
        require_cmd busybox busybox-static
        NETDEV+=",guestfwd=tcp:10.0.2.100:${f%%:*}-cmd:$(command -v busybox) nc 127.0.0.1 ${f##*:}"
    done
    export NESTED_L1_MODULES="${NESTED_L1_MODULES:+$NESTED_L1_MODULES }virtio_pci virtio_net"
elif [ ${#GUESTFWDS[@]} -gt 0 ]; then
    die "--guestfwd needs --forward (the user network)"
fi

require_cmd qemu-system-x86_64 qemu-system-x86
require_cmd timeout coreutils
mkdir -p "$NESTED_OUT"
LOG="$NESTED_OUT/nested.log"

# --- build -----------------------------------------------------------------------------
T_BUILD0=$(now)
if [ "$SKIP_BUILD" = 1 ]; then
    log "--skip-build: reusing $OUTER_CPIO"
    [ -f "$OUTER_CPIO" ] || die "$OUTER_CPIO missing; run without --skip-build"
else
    "$NESTED_DIR/fetch-kernel.sh" >/dev/null
    "$NESTED_DIR/build-guest-initramfs.sh"
    "$NESTED_DIR/build-outer.sh"
fi
load_kernel_env
T_BUILD1=$(now)

# --- boot the outer VM -----------------------------------------------------------------
APPEND="console=ttyS0 panic=-1 quiet${NESTED_APPEND:+ $NESTED_APPEND}"
SCRATCH_IMG="$NESTED_OUT/scratch.img"
rm -f "$SCRATCH_IMG"
SCRATCH_DRIVE=()
if [ -n "$SCRATCH" ]; then
    require_cmd mkfs.ext4 e2fsprogs
    truncate -s "$SCRATCH" "$SCRATCH_IMG"
    mkfs.ext4 -q -F -m 0 -L scratch "$SCRATCH_IMG"
    letters=abcdefghijklmnopqrstuvwxyz
    SCRATCH_DEV=/dev/vd${letters:${#OUTER_DISKS[@]}:1}
    APPEND+=" nested.scratch=$SCRATCH_DEV"
    SCRATCH_DRIVE=(-drive "file=${SCRATCH_IMG//,/,,},format=raw,if=virtio,cache=unsafe")
    log "scratch: $SCRATCH_DEV ($SCRATCH, ext4) is L1's /tmp"
fi
QEMU=(qemu-system-x86_64 -accel tcg -cpu "${NESTED_CPU:-EPYC}" -m "${NESTED_MEM:-2G}" -smp 1
    -nographic -no-reboot -kernel "$KVMLINUZ" -initrd "$OUTER_CPIO" -append "$APPEND")
for d in "${OUTER_DISKS[@]}"; do
    # A comma in a -drive file name is written as two.
    QEMU+=(-drive "file=${d//,/,,},format=raw,if=virtio,readonly=on")
done
QEMU+=("${SCRATCH_DRIVE[@]}")
if [ -n "$NETDEV" ]; then
    QEMU+=(-netdev "$NETDEV" -device virtio-net-pci,netdev=n0)
fi
# The stall watch's way in: QEMU's monitor on a socket (the serial console stays on stdio).
MONITOR="$NESTED_OUT/monitor.sock"
if [ "$STALL" -gt 0 ]; then
    rm -f "$MONITOR"
    QEMU+=(-monitor "unix:$MONITOR,server=on,wait=off")
fi
QEMU+=("${QEMU_EXTRA[@]}")
log "booting outer VM (timeout ${TIMEOUT}s): ${QEMU[*]}"
log "console log: $LOG"

# Prefix each console line with seconds since QEMU start; drop the serial CRs.
stamp() {
    local t0=$1 line now_us
    while IFS= read -r line || [ -n "$line" ]; do
        now_us=${EPOCHREALTIME/./}
        printf '[%7.2f] %s\n' "$(((now_us - t0) / 10000))e-2" "${line//$'\r'/}"
    done
}

# stall_watch: nudges, then ends, an outer VM whose console has gone quiet. Its kernel
# (one vCPU under TCG) has been seen to stop for minutes, even while idle (`soft lockup
# ... [swapper/0:0]`: its CPU halted and no timer interrupt woke it), and to go on by
# itself later. Any interrupt wakes a halted CPU, and one taken while the nested guest
# runs brings L1 back to its own kernel; so from POKE_AFTER seconds of silence (the suite
# prints a heartbeat every 30 s) the watch presses a key on the outer VM's keyboard
# (QEMU monitor `sendkey shift`: an i8042 interrupt that types nothing), again every 30 s,
# and notes each press and whether the console went on after it. At $STALL seconds of
# silence it ends the VM (through its `timeout`, a child of this shell): waiting out
# --timeout would leave no time to run the tier again. A workaround for the emulator, not
# for anything under test: every press is in the log.
POKE_AFTER=45
stall_watch() {
    local parent=$1 t0=$2 size last_size=-1 last_t=$SECONDS poked_at=0 last_poke=0 quiet
    while sleep 5; do
        size=$(stat -c %s "$LOG" 2>/dev/null || echo 0)
        if [ "$size" != "$last_size" ]; then
            if [ "$poked_at" -gt 0 ]; then
                printf '[%7s] NESTED-WOKEN: the console went on %s s after the first key press (%s s quiet)\n' \
                    "$(since "$t0")" "$((SECONDS - poked_at))" "$((SECONDS - last_t))" >>"$STALL_NOTE"
                poked_at=0
            fi
            last_size=$size
            last_t=$SECONDS
            continue
        fi
        quiet=$((SECONDS - last_t))
        if [ "$quiet" -ge "$STALL" ]; then
            printf 'NESTED-STALL: the outer VM printed nothing for %s s; ending it\n' "$quiet" |
                tee -a "$STALL_NOTE" >&2
            pkill -TERM -P "$parent" -x timeout || true
            return
        fi
        if [ "$quiet" -ge "$POKE_AFTER" ] && [ $((SECONDS - last_poke)) -ge 30 ]; then
            last_poke=$SECONDS
            [ "$poked_at" -gt 0 ] || poked_at=$SECONDS
            printf '[%7s] NESTED-POKE: %s s quiet; a key press sent (%s)\n' "$(since "$t0")" \
                "$quiet" "$(monitor_cmd "sendkey shift" 2>&1 && echo ok)" >>"$STALL_NOTE"
        fi
    done
}

# since T0_US: seconds (two decimals) since T0_US (µs), as the log's stamps.
since() {
    local now_us=${EPOCHREALTIME/./}
    printf '%d.%02d' "$(((now_us - $1) / 1000000))" "$((((now_us - $1) / 10000) % 100))"
}

# monitor_cmd CMD: one command to the outer VM's QEMU monitor ($MONITOR).
monitor_cmd() {
    python3 - "$MONITOR" "$1" <<'PY'
import socket, sys, time
try:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(sys.argv[1])
    s.sendall((sys.argv[2] + "\n").encode())
    time.sleep(0.2)
    s.close()
except OSError as e:
    sys.exit(f"monitor {sys.argv[1]}: {e}")
PY
}

T_QEMU0=$(now)
# The watcher's verdict, added to the log once QEMU's own last lines are in it.
STALL_NOTE="$NESTED_OUT/stall-note"
rm -f "$STALL_NOTE"
WATCH_PID=""
T0_US=${EPOCHREALTIME/./}
if [ "$STALL" -gt 0 ]; then
    stall_watch "$$" "$T0_US" &
    WATCH_PID=$!
fi
set +e
timeout --kill-after=10 "$TIMEOUT" "${QEMU[@]}" </dev/null 2>&1 | stamp "$T0_US" | tee "$LOG"
QEMU_RC=${PIPESTATUS[0]}
set -e
rm -f "$SCRATCH_IMG"
if [ -n "$WATCH_PID" ]; then
    kill "$WATCH_PID" 2>/dev/null || true
    wait "$WATCH_PID" 2>/dev/null || true
    if [ -f "$STALL_NOTE" ]; then
        cat "$STALL_NOTE" >>"$LOG"
    fi
fi
T_QEMU1=$(now)

# --- verdict ---------------------------------------------------------------------------
# The log without the timestamp prefix, for anchored patterns.
BODY=$(sed -E 's/^\[ *[0-9.]+\] //' "$LOG")
missing=()
for re in "${EXPECT[@]}"; do
    grep -a -q -E -- "$re" <<<"$BODY" || missing+=("$re")
done

# When (seconds since QEMU start) a marker first appeared.
at() {
    local t
    t=$(grep -a -m1 -E -- "$1" "$LOG" | sed -E 's/^\[ *([0-9.]+)\].*/\1s/' || true)
    echo "${t:--}"
}

echo
echo "---- nested tier summary ----"
echo "kernel: $KVER   cpu: ${NESTED_CPU:-EPYC}   log: $LOG"
printf 'wall: build=%ss  qemu_run=%ss  total=%ss  (qemu rc=%s%s)\n' \
    "$(elapsed "$T_BUILD0" "$T_BUILD1")" "$(elapsed "$T_QEMU0" "$T_QEMU1")" \
    "$(elapsed "$T_BUILD0" "$T_QEMU1")" "$QEMU_RC" \
    "$([ "$QEMU_RC" = 124 ] || [ "$QEMU_RC" = 137 ] && echo ", TIMED OUT after ${TIMEOUT}s")"
if [ -f "$STALL_NOTE" ]; then cat "$STALL_NOTE"; fi
echo "since qemu start: L1 init=$(at NESTED-L1-INIT) kvm ready=$(at NESTED-KVM-READY)" \
    "guest ready=$(at CLADE-GUEST-READY) clade exit=$(at '^\[ *[0-9.]+\] CLADE-EXIT')" \
    "L1 done=$(at NESTED-L1-DONE)"
grep -a -E 'CLADE-GUEST-READY|CLADE-AGENT-|CLADE-EXIT|NESTED-L1-TIME|NESTED-L1-FAIL|clade-agent: error|^clade: ' <<<"$BODY" || true

if [ ${#missing[@]} -eq 0 ]; then
    echo "NESTED PASS"
    exit 0
fi
for re in "${missing[@]}"; do echo "missing in log: /$re/"; done
echo "NESTED FAIL (see $LOG)"
exit 1
