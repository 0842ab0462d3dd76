#!/usr/bin/env bash
# move-host.sh: a sandbox moves hosts through object storage, on the native tier.
#
# Part 1, the library and CLI:
# "Host A" runs the bare-metal test guest (it fills 32 MiB of memory, prints its checksum,
# and counts to 2^32), snapshots it mid-loop, publishes the snapshot to an S3 server and is
# wiped: its VM killed and its snapshot directory deleted. "Host B" (its own chunk cache,
# nothing of the snapshot on it) resumes the published snapshot with `clade restore --store`:
# the guest finishes its loop and prints the same memory checksum. The S3 server is the one
# the tests use (build/tools/bin/clade-test-s3 on loopback); with CLADE_STORE (and AWS
# credentials, CLADE_STORE_ENDPOINT for an S3-compatible server) set, that store is used.
#
# Part 2, the service: `clade serve --store` on host A creates a sandbox of a template,
# pauses it (the pause is uploaded in the background; the sandbox's info says when it is
# durable), and host A is lost (service killed, state directory deleted); `clade serve` on
# host B (its own state directory, no templates, the same store) resumes it through the
# same HTTP API the e2b SDK uses, and its agent answers.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLADE="${CLADE:-$REPO_ROOT/target/release/clade}"
D=$(mktemp -d /tmp/clade-move.XXXXXX)
VM_PID=""
SERVES=""
# alive PID...: true while one of them runs.
alive() {
    for p in "$@"; do kill -0 "$p" 2>/dev/null && return 0; done
    return 1
}
# descendants: every process below this shell now, but the ones listing them.
descendants() {
    ps -e -o pid=,ppid= | awk -v top=$$ -v self="$BASHPID" '{ up[$1] = $2 }
        END { for (p in up) { q = p; while (q != top && q != self && (q in up)) q = up[q]
                              if (q == top && p != top) print p } }'
}
# Everything this script started ends with it, however it ends: done, failed (set -e) or
# stopped by a signal. EXIT runs on SIGTERM and SIGHUP too (bash runs it before dying of
# them, the step under way still running: it is ended here); on SIGINT the script exits
# once the step under way has ended. First each `clade serve`, by SIGTERM (its standby VM
# processes and networks end with it; SIGKILL after 10 s), then every process still below
# this shell (the step under way, the VM of part 1, the S3 server) and the sandbox VM
# processes the services leave (they outlive a service by design; here every one of them
# runs on files under $D). When this returns nothing of this run is left.
cleanup() {
    set +e
    trap '' INT TERM HUP
    # Out of the job table: no "Killed" line for each of them (they are still reaped).
    disown -a 2>/dev/null
    if [ -n "$SERVES" ]; then
        # shellcheck disable=SC2086
        kill $SERVES 2>/dev/null
        # shellcheck disable=SC2086
        for _ in $(seq 100); do alive $SERVES || break; sleep 0.1; done
        # shellcheck disable=SC2086
        kill -9 $SERVES 2>/dev/null
    fi
    for _ in $(seq 50); do
        mapfile -t left < <(descendants; pgrep -f -- "$D/")
        [ ${#left[@]} -eq 0 ] && break
        kill -9 "${left[@]}" 2>/dev/null
        sleep 0.1
    done
    rm -rf "$D"
}
trap cleanup EXIT
trap 'exit 130' INT

(cd "$REPO_ROOT/tests/native-guest" && env -u RUSTFLAGS -u CARGO_ENCODED_RUSTFLAGS \
    CARGO_TARGET_DIR="$REPO_ROOT/target/native-guest" cargo build --release --quiet)
GUEST="$REPO_ROOT/target/native-guest/release/native-guest"

if [ -z "${CLADE_STORE:-}" ]; then
    PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    mkdir -p "$D/s3/clade"
    "$REPO_ROOT/build/tools/bin/clade-test-s3" --host 127.0.0.1 --port "$PORT" \
        --access-key demo --secret-key demo-secret "$D/s3" &
    export AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo-secret AWS_REGION=us-east-1
    export CLADE_STORE="s3://clade/sandboxes" CLADE_STORE_ENDPOINT="http://127.0.0.1:$PORT"
    for _ in $(seq 100); do
        python3 -c "import socket; socket.create_connection(('127.0.0.1', $PORT))" 2>/dev/null && break
        sleep 0.05
    done
    echo "== object store: S3 server on 127.0.0.1:$PORT (tests/s3-server), bucket 'clade'"
else
    echo "== object store: $CLADE_STORE"
fi

echo "== host A: the sandbox runs, is snapshotted mid-computation and published"
"$CLADE" run --kernel "$GUEST" --test-device --mem 128 \
    --cmdline "steps=memfill:9:32,memsum,loop:32,memsum" \
    --api-sock "$D/a.api" --serial-file "$D/a.serial" 2>/dev/null &
VM_PID=$!
for _ in $(seq 400); do grep -q "step memsum ok" "$D/a.serial" 2>/dev/null && break; sleep 0.05; done
"$CLADE" snapshot "$D/a.api" "$D/host-a/snap"
kill -9 "$VM_PID"
wait "$VM_PID" 2>/dev/null || true
VM_PID=""
BEFORE=$(grep -m1 '^memsum ' "$D/a.serial")
ID=$("$CLADE" store publish "$D/host-a/snap")
echo "published snapshot $ID; guest memory before: $BEFORE"
rm -rf "$D/host-a"
echo "== host A is gone (its VM killed, its snapshot deleted)"

echo "== host B: resumes the sandbox from the store (empty cache; memory fetched lazily)"
START=$(date +%s%N)
CLADE_LOG=info "$CLADE" restore "$ID" --cache "$D/host-b-cache" --no-agent-sync \
    --serial-file "$D/b.serial" 2>"$D/b.log"
END=$(date +%s%N)
AFTER=$(grep -m1 '^memsum ' "$D/b.serial" || true)
grep -o 'published snapshot opened.*' "$D/b.log" | sed 's/\x1b\[[0-9;]*m//g' || true
echo "guest memory after:  $AFTER  (loop finished: $(grep -c 'loop 2^32 done' "$D/b.serial"))"
echo "host B: restore, rest of the 2^32 loop and exit: $(( (END - START) / 1000000 )) ms"
if [ "$BEFORE" != "$AFTER" ]; then
    echo "MOVE-HOST: FAIL (memory differs)"
    exit 1
fi
echo "MOVE-HOST: PASS (the sandbox continued on host B with its memory exactly as on host A)"

echo "== part 2: clade serve --store on host A and on host B"
"$CLADE" template build t --test-device --mem 64 --kernel "$GUEST" --cmdline steps=vsock \
    --state-dir "$D/state-a" >/dev/null
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# serve NAME: starts `clade serve --store` with state dir $D/state-NAME; its port in PORT.
serve() {
    PORT=$(free_port)
    CLADE_LOG=info CLADE_API_KEY=demo "$CLADE" serve --listen "127.0.0.1:$PORT" \
        --state-dir "$D/state-$1" >"$D/serve-$1.log" 2>&1 &
    SERVE_PID=$!
    SERVES="$SERVES $SERVE_PID"
    for _ in $(seq 200); do grep -qs listening "$D/serve-$1.log" && return; sleep 0.05; done
    echo "clade serve ($1) did not start"; cat "$D/serve-$1.log"; exit 1
}
api() { curl -sS -X "$1" -H 'X-API-KEY: demo' -H 'Content-Type: application/json' \
    ${3:+--data "$3"} "http://127.0.0.1:$PORT$2"; }
field() { python3 -c "import json,sys; print(json.load(sys.stdin).get('$1') or '')"; }
serve a
ID=$(api POST /sandboxes '{"templateID":"t","timeout":300}' | field sandboxID)
"$CLADE" ping "$D/state-a/sandboxes/$ID/vm.vsock" >/dev/null
api POST "/sandboxes/$ID/pause" >/dev/null
T0=$(date +%s%N)
until [ -n "$(api GET "/sandboxes/$ID" | field durableAt)" ]; do
    [ $(( ($(date +%s%N) - T0) / 1000000000 )) -lt 60 ] || { echo "never durable"; exit 1; }
    sleep 0.02
done
echo "host A: sandbox $ID paused; durable $(( ($(date +%s%N) - T0) / 1000000 )) ms after the pause returned"
{ kill -9 "$SERVE_PID"; wait "$SERVE_PID"; } 2>/dev/null || true
SERVES="${SERVES/ $SERVE_PID/}"
pkill -9 -f "$D/state-a/" 2>/dev/null || true
rm -rf "$D/state-a"
echo "host A is gone (its service and VMs killed, its state directory deleted)"
serve b
echo "host B sees it in the store: $(api GET "/sandboxes/$ID" | field state)"
T0=$(date +%s%N)
STATUS=$(api POST "/sandboxes/$ID/connect" '{"timeout":300}' | field sandboxID)
T1=$(date +%s%N)
[ "$STATUS" = "$ID" ] || { echo "resume on host B failed"; tail "$D/serve-b.log"; exit 1; }
"$CLADE" ping "$D/state-b/sandboxes/$ID/vm.vsock" >/dev/null
echo "host B: resumed it from the store in $(( (T1 - T0) / 1000000 )) ms (claim, take over, lazy restore); its agent answers"
api DELETE "/sandboxes/$ID" >/dev/null
echo "MOVE-HOST-SERVICE: PASS (paused on host A, resumed on host B through the store)"
