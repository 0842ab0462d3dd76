#!/usr/bin/env bash
# demo.sh: Clade's main job, end to end: boot a sandbox (Debian's stock kernel with the Clade
# agent as /init), run commands in it through the agent (`clade exec` over virtio-vsock),
# power it off (tests/nested/scenarios/demo.sh), and report latencies measured natively.
#
# Where the host has hardware virtualization (VMX/SVM), clade boots the sandbox directly.
# This project's development machines have only a software hypervisor behind /dev/kvm that
# cannot boot ordinary Linux guests, so there the same sandbox runs inside the nested tier
# (QEMU TCG + nested KVM): slow, and said so. Latency figures always come from the native
# tier (the project's bare-metal guest on this host's KVM), never from emulation.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
"$REPO_ROOT/scripts/setup.sh"
# shellcheck source-path=SCRIPTDIR source=../tests/nested/lib.sh
. "$REPO_ROOT/tests/nested/lib.sh"

echo "== building clade (release; the native test guest is built into it)"
cargo build --release -q -p clade --bin clade
CLADE="$REPO_ROOT/target/release/clade"

SANDBOX="$NESTED_DIR/scenarios/demo.sh"
if grep -qwE 'vmx|svm' /proc/cpuinfo && [ -r /dev/kvm ] && [ -w /dev/kvm ]; then
    echo "== hardware KVM: booting the sandbox directly and running commands in it"
    "$NESTED_DIR/fetch-kernel.sh" >/dev/null
    "$NESTED_DIR/build-guest-initramfs.sh" >/dev/null
    load_kernel_env
    DEMO_DIR=$(mktemp -d /tmp/clade-demo.XXXXXX)
    CLADE="$CLADE" DEMO_KERNEL="$KVMLINUZ" DEMO_INITRD="$GUEST_CPIO" DEMO_DIR="$DEMO_DIR" \
        sh "$SANDBOX"
    echo "== the e2b SDK session (tests/e2b/sdk_session.py) against clade serve, Linux template"
    tests/nested/build-rootfs.sh >/dev/null
    STATE="$DEMO_DIR/serve"
    "$CLADE" template build debian --state-dir "$STATE" --kernel "$KVMLINUZ" \
        --initrd "$GUEST_CPIO" --disk "$REPO_ROOT/build/rootfs/base.cdsk" \
        --cmdline "console=ttyS0 panic=-1 quiet clade.root=/dev/vda"
    CLADE_API_KEY=demo-key "$CLADE" serve --listen 127.0.0.1:39481 --state-dir "$STATE" \
        >"$DEMO_DIR/serve.log" 2>&1 &
    SERVE=$!
    for _ in $(seq 100); do grep -q listening "$DEMO_DIR/serve.log" && break; sleep 0.1; done
    [ -x build/venv/bin/python ] || { python3 -m venv build/venv &&
        build/venv/bin/pip install -q -r tests/e2b/requirements.txt pytest; }
    E2B_API_URL=http://127.0.0.1:39481 E2B_SANDBOX_URL=http://127.0.0.1:39481 \
        E2B_API_KEY=demo-key build/venv/bin/python tests/e2b/sdk_session.py
    kill "$SERVE"
    wait "$SERVE" || true
    rm -rf "$DEMO_DIR"
else
    echo "== this host's /dev/kvm cannot boot Linux guests (no VMX/SVM: software PVM hypervisor)."
    echo "== Running the same sandbox inside the nested tier instead (QEMU TCG + nested KVM: slow;"
    echo "== times printed there are emulated wall times, not latencies)."
    "$NESTED_DIR/run.sh" --l1-test "$SANDBOX" --expect DEMO-SANDBOX-PASS --expect '^CLADE-EXIT 0$'
    echo "== the e2b SDK session (tests/e2b/sdk_session.py) on this host, against clade serve in"
    echo "== the nested machine (Linux template; port forwarded to 127.0.0.1)"
    tests/e2b/run_nested.sh --standalone --session
fi

echo "== a sandbox moves hosts through object storage (native tier, scripts/move-host.sh)"
CLADE="$CLADE" "$REPO_ROOT/scripts/move-host.sh"

echo "== latencies (native tier: the bare-metal test guest embedded in clade, on this host's KVM)"
# `clade bench all` runs, one after the other (`clade bench all --list` prints them):
#   boot; the agent's round trip over virtio-vsock; snapshot cost; restore-to-first-ping
#   (uffd + VM shell pool, against the eager-copy baseline); live fork into 10 children;
#   `clade fork -n 3` of a VM process, children started at the fork against children
#   waiting (`--fork-spares`); the sandbox host as the e2b SDK sees it (clade serve over
#   HTTP, create and wake with 1 and with 100 paused sandboxes); and snapshots in object
#   storage (the test S3 server on loopback): restore with a cold and a warm cache against
#   a local one, pause until durable against the raw upload to the same server; and a
#   cluster (PostgreSQL, the S3 server, two `clade serve --cluster` nodes): the data plane,
#   create and wake asked of the owner node and through the other node, what the hop adds.
# It prints each scenario's figures and writes a report with plots of every distribution
# against its same-run baseline (open its index.html in a browser).
REPORT_DIR="$REPO_ROOT/build/bench-report"
rm -rf "$REPORT_DIR"
timeout 1800 "$CLADE" bench all --report "$REPORT_DIR"
echo "== bench report: $REPORT_DIR/index.html (plots as SVG and PNG beside it, every sample in report.json;"
echo "== compare two runs with: clade bench compare DIR_A DIR_B)"
