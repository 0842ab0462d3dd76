#!/usr/bin/env bash
# test.sh: every test tier. Exit 0 only if all pass.
#   1. unit tests            (no KVM)                       cargo test, next to the code
#   2. native KVM tier       (project's bare-metal guest)   cargo test: tests/tests, clade/tests
#   3. nested tier           (Debian kernel, nested KVM)    tests/nested/run.sh, one outer
#                            boot running tests/nested/scenarios/suite.sh: scenarios "boot",
#                            "agent-vsock", "snapshot-resume", "image", "disk", "fork",
#                            "jail", "net" and "sdk"
#                            (each counts as one test; the last three need the Debian root
#                            filesystem of
#                            tests/nested/build-rootfs.sh, built once with debootstrap and
#                            cached under build/rootfs/)
#   +  the e2b SDK suites    (tests/e2b: pinned SDK in a venv against clade serve: the control
#                            plane with native test-guest VMs, the data plane through the
#                            host-agent harness, the web dashboard in headless chromium
#                            (Selenium), and test_linux.py with Linux sandboxes in
#                            the nested machine, through a forwarded port: scenario "sdk")
# Set CLADE_SKIP_NESTED=1 to run only tiers 1 and 2 (and the SDK suite).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
"$REPO_ROOT/scripts/setup.sh"

# Disk: the builds (debug tests, release, the nested tier's static release), the Debian
# kernel and root filesystem and the nested machine's images take about NEED_GIB together.
# Say so up front rather than fail half-way with ENOSPC.
NEED_GIB=6
free_gib=$(df -P -BG "$REPO_ROOT" | awk 'NR == 2 {sub("G", "", $4); print $4}')
if [ "${free_gib:-0}" -lt "$NEED_GIB" ]; then
    echo "== WARNING: ${free_gib}G free under $REPO_ROOT; a full run from a clean clone needs about ${NEED_GIB}G"
fi
# footprint: what this run left on disk (printed at the end, and when the run fails).
footprint() { echo "== disk: $(du -sh "$REPO_ROOT/target" "$REPO_ROOT/build" 2>/dev/null | awk '{printf "%s %s  ", $2, $1}')free $(df -P -h "$REPO_ROOT" | awk 'NR == 2 {print $4}')"; }
trap footprint EXIT

echo "== [${SECONDS} s] lint: cargo fmt --check, cargo clippy -D warnings"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

LOG="$REPO_ROOT/target/cargo-test.log"
mkdir -p "$REPO_ROOT/target"
echo "== [${SECONDS} s] tiers 1+2: unit and native KVM tests"
cargo test --workspace -- --nocapture 2>&1 | tee "$LOG"
# Totals over every test binary, for the closing summary line.
sum() { grep -E '^test result:' "$LOG" | grep -oE "[0-9]+ $1" | awk '{s += $1} END {print s + 0}'; }
passed=$(sum passed)
failed=$(sum failed)
grep -h 'native counting loop' "$LOG" || true

echo "== [${SECONDS} s] the embedding example (vmm/examples/embed.rs) on the native test guest"
# Built by the tests above (tests/src/native_guest.rs).
if cargo run --release --quiet -p vmm --example embed -- \
    "$REPO_ROOT/target/native-guest/release/native-guest" --test-guest; then
    passed=$((passed + 1))
    echo "example embed: PASS"
else
    failed=$((failed + 1))
    echo "example embed: FAIL"
fi

# pytest_failed LOG: failed tests plus errors in a pytest run's summary line (1 if none,
# e.g. a run that never started). Never fails itself: under `set -e -o pipefail` a grep
# that finds nothing would end this script before it prints what went wrong.
pytest_failed() {
    local line counts
    line=$(grep -E '(passed|failed|error).* in [0-9.]+s' "$1" 2>/dev/null | tail -1 || true)
    counts=$(echo "$line" | grep -oE '[0-9]+ (failed|errors?)' || true)
    echo "$counts" | awk '{s += $1} END {print (s > 0 ? s : 1)}'
}

echo "== [${SECONDS} s] the e2b SDK (pinned, tests/e2b/requirements.txt) against clade serve"
# The control plane with real VMs (templates of the native test guest), and the data plane
# through clade serve's --test-host-agent harness (each sandbox a host-run clade-agent, so
# commands, PTYs and files run without a Linux VM). Then the web dashboard (/dashboard) in
# headless chromium through Selenium, with native test-guest VMs (screenshots of each step
# in target/dashboard-screenshots), and `clade bench --report` (a real run's report checked
# and rendered in the same browser, tests/e2b/test_report.py; screenshots in
# target/report-screenshots). Then a cluster (tests/e2b/test_cluster.py): three nodes and
# a gateway, each in a network namespace, on PostgreSQL and the S3 server, with native
# test-guest VMs (placement, forwarding, lost and stopped nodes, racing resumes, a drain,
# and the control suite entered through the gateway).
for suite in control dataplane dashboard report cluster; do
    if "$REPO_ROOT/tests/e2b/run_$suite.sh" -p no:cacheprovider 2>&1 | tee "$REPO_ROOT/target/e2b-$suite.log"; then
        n=$(grep -oE '[0-9]+ passed' "$REPO_ROOT/target/e2b-$suite.log" | tail -1 | awk '{print $1}' || true)
        passed=$((passed + ${n:-0}))
        echo "e2b SDK $suite suite: PASS (${n:-0} tests)"
    else
        n=$(pytest_failed "$REPO_ROOT/target/e2b-$suite.log")
        failed=$((failed + ${n:-1}))
        echo "e2b SDK $suite suite: FAIL"
    fi
done

if [ "${CLADE_SKIP_NESTED:-0}" = 1 ]; then
    echo "== [${SECONDS} s] tier 3 (nested) skipped: CLADE_SKIP_NESTED=1"
else
    echo "== [${SECONDS} s] tier 3: nested (Debian kernel booted by clade under nested KVM in QEMU TCG)"
    # One outer boot runs every scenario (tests/nested/scenarios/suite.sh): "boot" (the
    # default: the guest reaches its agent and powers off) and each file staged below.
    # Each scenario counts as one test.
    # shellcheck source-path=SCRIPTDIR source=../tests/nested/lib.sh
    . "$REPO_ROOT/tests/nested/lib.sh"
    SCENARIOS=(boot agent-vsock snapshot-resume image)
    # The disk scenarios need the sandbox root filesystem as the outer VM's /dev/vda.
    disk_args=()
    if "$REPO_ROOT/tests/nested/build-rootfs.sh"; then
        SCENARIOS+=(disk fork jail net sdk)
        # sdk: clade serve with a Linux template in the nested machine; the SDK suite
        # (tests/e2b/test_linux.py) runs here, through these forwarded ports.
        disk_args=(--disk "$REPO_ROOT/build/rootfs/base.cdsk" --disk "$REPO_ROOT/build/rootfs/debian-image.tar" --forward 39481:8080 --forward 39482:8081 --forward 39483:8082 --forward 39484:8083 --forward 39485:8085 --guestfwd 5432:39486)
    else
        echo "nested scenarios disk, fork, jail, net, sdk: FAIL (tests/nested/build-rootfs.sh failed)"
        failed=$((failed + 5))
    fi
    # nested_run LIMIT SCENARIO...: boots the nested machine once (at most LIMIT seconds)
    # to run these scenarios ("boot", the default, always runs first: suite.sh), with the
    # SDK suite beside it when sdk is one of them. Sets nested_ok (the scenarios that
    # passed; sdk only with its SDK suite), nested_unfinished (those with no result
    # line), nested_sdk_passed (that suite's passed tests), nested_stopped (1 when the
    # machine itself stopped: its kernel's "soft lockup" or RCU "self-detected stall", or
    # run.sh's NESTED-STALL) and nested_timed_out (1 when it ran out of LIMIT).
    nested_run() {
        local limit=$1 s line n extra="$NESTED_OUT/suite-l1" expects=() sdk_ok=1
        shift
        nested_ok=() nested_unfinished=() nested_sdk_passed=0 nested_stopped=0 nested_timed_out=0
        rm -rf "$extra"
        mkdir -p "$extra/scenarios"
        for s in "$@"; do
            [ "$s" = boot ] || cp "$REPO_ROOT/tests/nested/scenarios/$s.sh" "$extra/scenarios/"
            expects+=(--expect "^NESTED-SCENARIO $s PASS")
        done
        rm -f "$NESTED_OUT/nested.log"
        # --scratch: L1's /tmp on a disk; the sdk scenario's state directories (templates,
        # snapshots, paused sandboxes, the object store) outgrow a /tmp in L1's memory.
        NESTED_MEM=4G NESTED_L1_EXTRA="$extra" "$REPO_ROOT/tests/nested/run.sh" --timeout "$limit" --stall 300 --scratch 8G \
            --l1-test "$REPO_ROOT/tests/nested/scenarios/suite.sh" "${disk_args[@]}" \
            "${expects[@]}" --expect '^CLADE-EXIT 0$' >"$NESTED_OUT/suite.out" 2>&1 &
        local nested_pid=$!
        if [[ " $* " == *" sdk "* ]]; then
            echo "== [${SECONDS} s] the e2b SDK against Linux sandboxes (tests/e2b/test_linux.py, nested scenario sdk)"
            if CLADE_NESTED_PID=$nested_pid "$REPO_ROOT/tests/e2b/run_nested.sh" --log "$NESTED_OUT/nested.log" -p no:cacheprovider \
                2>&1 | tee "$REPO_ROOT/target/e2b-linux.log"; then
                n=$(grep -oE '[0-9]+ passed' "$REPO_ROOT/target/e2b-linux.log" | tail -1 | awk '{print $1}' || true)
                nested_sdk_passed=${n:-0}
                echo "e2b SDK linux suite: PASS (${n:-0} tests)"
            else
                sdk_ok=0
                echo "e2b SDK linux suite: FAIL"
            fi
        fi
        wait "$nested_pid" || true
        cat "$NESTED_OUT/suite.out"
        for s in "$@"; do
            line=$(grep -a -m1 -E "^\[ *[0-9.]+\] NESTED-SCENARIO $s (PASS|FAIL)" \
                "$NESTED_OUT/nested.log" 2>/dev/null | sed -E 's/^\[ *[0-9.]+\] //' || true)
            echo "nested scenario $s: ${line:-NESTED-SCENARIO $s: no result (see $NESTED_OUT/nested.log)}"
            if [[ "$line" == *" PASS"* ]] && { [ "$s" != sdk ] || [ "$sdk_ok" = 1 ]; }; then
                nested_ok+=("$s")
            elif [ -z "$line" ]; then
                nested_unfinished+=("$s")
            fi
        done
        if grep -a -q -E "$STOPPED" "$NESTED_OUT/nested.log"; then
            nested_stopped=1
        fi
        if grep -a -q "TIMED OUT after" "$NESTED_OUT/suite.out"; then
            nested_timed_out=1
        fi
    }
    # The whole suite takes about 2300-2600 s here (the sdk scenario alone about 1900 s:
    # the SDK suites on one host, about 1350 s, then test_linux.py through a two-node
    # cluster); 3000 s bounds a hung one inside CI's 90 minutes, and run.sh ends a machine
    # that has printed nothing (not even suite.sh's heartbeat) for 300 s sooner.
    STOPPED="soft lockup|self-detected stall|NESTED-STALL"
    todo=("${SCENARIOS[@]}")
    nested_run 3000 "${todo[@]}"
    done_ok=("${nested_ok[@]}")
    sdk_passed=$nested_sdk_passed
    # The nested machine's own kernel (L1, under QEMU TCG emulating SVM, one vCPU) has been
    # seen to stop for minutes while running a nested guest: a fault below clade (L1's KVM
    # or the emulation), not of what is tested. Its console then says "soft lockup" or
    # "self-detected stall" when it comes back, or run.sh ends the machine for printing
    # nothing (NESTED-STALL); or the stops only slow it and it runs out of its time limit.
    # After a run that stopped, the scenarios that did not pass in it run once more in a
    # new machine; after one that ran out of time, those it never finished. Its logs are
    # set aside as *-lockup.*, and the rerun happens if CI's 90 minutes leave it room: its
    # limit is what is left of 85 minutes, at most 2400 s and at least 600 s (2100 s if sdk
    # is among them). A scenario
    # that failed in a run that neither stopped nor ran out of time is not rerun.
    left=()
    if [ "$nested_stopped" = 1 ]; then
        for s in "${todo[@]}"; do
            [[ " ${done_ok[*]} " == *" $s "* ]] || left+=("$s")
        done
    elif [ "$nested_timed_out" = 1 ]; then
        left=("${nested_unfinished[@]}")
    fi
    room=$((5100 - SECONDS))
    # The sdk scenario alone needs about 1900 s: rerun where it cannot finish, it would only
    # use CI's time up.
    if [[ " ${left[*]} " == *" sdk "* ]] && [ "$room" -lt 2100 ]; then
        echo "== [${SECONDS} s] sdk is not run again: ${room} s left, it needs about 2100"
        kept=()
        for s in "${left[@]}"; do [ "$s" = sdk ] || kept+=("$s"); done
        left=("${kept[@]}")
    fi
    if [ ${#left[@]} -gt 0 ]; then
        echo "== [${SECONDS} s] the nested machine stopped or ran out of time in this run:"
        grep -a -h -E "$STOPPED|NESTED-POKE|NESTED-WOKEN|TIMED OUT after" \
            "$NESTED_OUT/nested.log" "$NESTED_OUT/suite.out" || true
        if [ "$room" -ge 600 ]; then
            echo "== [${SECONDS} s] not passed: ${left[*]}; they run again in a new nested machine (at most $((room < 2400 ? room : 2400)) s)"
            cp "$NESTED_OUT/nested.log" "$NESTED_OUT/nested-lockup.log"
            cp "$REPO_ROOT/target/e2b-linux.log" "$REPO_ROOT/target/e2b-linux-lockup.log" 2>/dev/null || true
            nested_run "$((room < 2400 ? room : 2400))" "${left[@]}"
            done_ok+=("${nested_ok[@]}")
            [[ " ${left[*]} " == *" sdk "* ]] && sdk_passed=$nested_sdk_passed
        else
            echo "== [${SECONDS} s] no rerun: ${room} s left of the 85 minutes this script allows itself"
        fi
    fi
    for s in "${todo[@]}"; do
        if [[ " ${done_ok[*]} " == *" $s "* ]]; then
            passed=$((passed + 1))
        else
            failed=$((failed + 1))
            echo "nested scenario $s: FAIL"
        fi
    done
    passed=$((passed + sdk_passed))
    if [[ " ${todo[*]} " == *" sdk "* ]] && [[ " ${done_ok[*]} " != *" sdk "* ]] && [ "$sdk_passed" = 0 ]; then
        n=$(pytest_failed "$REPO_ROOT/target/e2b-linux.log")
        failed=$((failed + ${n:-1}))
    fi
fi
echo "all tiers: $passed passed, $failed failed ($SECONDS s)"
[ "$failed" -eq 0 ]
