#!/usr/bin/env bash
# test.sh: every test tier. Exit 0 only if all pass.
#   1. unit tests            (no KVM)                       cargo test, next to the code
#   2. native KVM tier       (project's bare-metal guest)   cargo test: tests/tests, clade/tests
#   +  the e2b SDK suites    (tests/e2b: the pinned SDK in a venv against clade serve with
#                            native test-guest VMs: control plane, data plane, dashboard,
#                            bench report, cluster)
#   3. nested tier           (Debian kernel, nested KVM)    tests/nested/run.sh: clade in a
#                            QEMU-TCG machine running tests/nested/scenarios/suite.sh
# docs/testing.md says what each runs and how to run one alone.
#
# The nested tier runs beside the others: QEMU's emulation uses one CPU, and the machine
# has more. Its static build and Debian root start first (the rest of the build runs at a
# lower priority meanwhile); then machine "sdk" boots and runs the sdk scenario (with the
# host's SDK suite, tests/e2b/test_linux.py and friends, through forwarded ports) while
# tiers 1 and 2 and the SDK suites run here; once they are done, machine "scenarios" runs
# every other scenario on the CPU they leave. The stage times are printed at the end.
# Set CLADE_SKIP_NESTED=1 to run only tiers 1 and 2 (and the SDK suites).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
T0=$(date +%s)
mkdir -p "$REPO_ROOT/target"
STAGES="$REPO_ROOT/target/test-stages.txt"
: >"$STAGES"
# clock: seconds since this script started (the same clock in the background job).
clock() { echo $(($(date +%s) - T0)); }
# stage NAME CMD...: runs CMD and notes NAME's start, end and exit status in $STAGES.
stage() {
    local name=$1 t rc=0
    shift
    t=$(clock)
    echo "== [$t s] $name"
    "$@" || rc=$?
    printf '%s\t%s\t%s\t%s\n' "$t" "$(clock)" "$rc" "$name" >>"$STAGES"
    return "$rc"
}
print_stages() {
    echo "== stages (seconds since the start; the nested tier's ran beside the others)"
    printf '  %6s %6s %6s  %s\n' start end took stage
    sort -n "$STAGES" | while IFS=$'\t' read -r s e rc name; do
        printf '  %6s %6s %6s  %s%s\n' "$s" "$e" "$((e - s))" "$name" "$([ "$rc" = 0 ] || echo " (exit $rc)")"
    done
}

stage "setup (scripts/setup.sh)" "$REPO_ROOT/scripts/setup.sh"

# Disk: the builds (debug tests, release, the nested tier's static release), the Debian
# kernel and root filesystem and the nested machines' images take about NEED_GIB together.
# Say so up front rather than fail half-way with ENOSPC.
NEED_GIB=7
free_gib=$(df -P -BG "$REPO_ROOT" | awk 'NR == 2 {sub("G", "", $4); print $4}')
if [ "${free_gib:-0}" -lt "$NEED_GIB" ]; then
    echo "== WARNING: ${free_gib}G free under $REPO_ROOT; a full run from a clean clone needs about ${NEED_GIB}G"
fi
NESTED_JOB=""
# footprint: what this run left on disk (printed at the end, and when the run fails).
footprint() { echo "== disk: $(du -sh "$REPO_ROOT/target" "$REPO_ROOT/build" 2>/dev/null | awk '{printf "%s %s  ", $2, $1}')free $(df -P -h "$REPO_ROOT" | awk 'NR == 2 {print $4}')"; }
# kill_tree PID: PID and every process below it (children first are found, then all end).
kill_tree() {
    local c
    for c in $(pgrep -P "$1" 2>/dev/null || true); do kill_tree "$c"; done
    kill -TERM "$1" 2>/dev/null || true
}
on_exit() {
    # A run that ends early (a failed lint) takes its nested machines with it.
    if [ -n "$NESTED_JOB" ] && kill -0 "$NESTED_JOB" 2>/dev/null; then
        kill_tree "$NESTED_JOB"
    fi
    footprint
}
trap on_exit EXIT

# The SDK's venv, made once here: the suites below and the nested tier's host side (which
# runs beside them) would otherwise race to make it.
VENV="$REPO_ROOT/build/venv"
if [ ! -x "$VENV/bin/pytest" ]; then
    stage "venv (build/venv: tests/e2b/requirements.txt)" bash -c \
        "python3 -m venv '$VENV' && '$VENV/bin/pip' install -q -r '$REPO_ROOT/tests/e2b/requirements.txt' pytest"
fi

stage "lint: cargo fmt --check" cargo fmt --all -- --check

# pytest_failed LOG: failed tests plus errors in a pytest run's summary line (1 if none,
# e.g. a run that never started). Never fails itself: under `set -e -o pipefail` a grep
# that finds nothing would end this script before it prints what went wrong.
pytest_failed() {
    local line counts
    line=$(grep -E '(passed|failed|error).* in [0-9.]+s' "$1" 2>/dev/null | tail -1 || true)
    counts=$(echo "$line" | grep -oE '[0-9]+ (failed|errors?)' || true)
    echo "$counts" | awk '{s += $1} END {print (s > 0 ? s : 1)}'
}

# --- tier 3, in the background ---------------------------------------------------------
NESTED_RUNS="$REPO_ROOT/build/nested-runs"
NATIVE_DONE="$NESTED_RUNS/native-done"
if [ "${CLADE_SKIP_NESTED:-0}" != 1 ]; then
    # shellcheck source-path=SCRIPTDIR source=../tests/nested/lib.sh
    . "$REPO_ROOT/tests/nested/lib.sh"
    rm -rf "$NESTED_RUNS"
    mkdir -p "$NESTED_RUNS"
    SDK_SCENARIOS=(sdk)
    OTHER_SCENARIOS=(agent-vsock snapshot-resume image disk fork jail net)
    DISKS=(--disk "$REPO_ROOT/build/rootfs/base.cdsk" --disk "$REPO_ROOT/build/rootfs/debian-image.tar")
    # sdk: clade serve with a Linux template in the nested machine; the SDK suite
    # (tests/e2b/test_linux.py, ...) runs here, through these forwarded ports.
    SDK_NET=(--forward 39481:8080 --forward 39482:8081 --forward 39483:8082 --forward 39484:8083 --forward 39485:8085 --guestfwd 5432:39486)
    # nested_run OUT LIMIT SCENARIO...: boots a nested machine (its files under OUT, at
    # most LIMIT seconds) to run these scenarios ("boot", the default, always runs first:
    # suite.sh), with the SDK suite beside it when sdk is one of them. Writes OUT/result.sh:
    # nested_ok (the scenarios that passed; sdk only with its SDK suite), nested_unfinished
    # (those with no result line), nested_sdk_passed (that suite's passed tests),
    # nested_stopped (1 when the machine itself stopped: its kernel's "soft lockup" or RCU
    # "self-detected stall", or run.sh's NESTED-STALL) and nested_timed_out (1 when it ran
    # out of LIMIT).
    nested_run() {
        local out=$1 limit=$2 s line n extra expects=() sdk_ok=1 net=() ok=() unfinished=() sdk_passed=0
        shift 2
        extra="$out/suite-l1"
        rm -rf "$extra" "$out/result.sh"
        mkdir -p "$extra/scenarios"
        for s in "$@"; do
            [ "$s" = boot ] || cp "$REPO_ROOT/tests/nested/scenarios/$s.sh" "$extra/scenarios/"
            expects+=(--expect "^NESTED-SCENARIO $s PASS")
            if [ "$s" = sdk ]; then net=("${SDK_NET[@]}"); fi
        done
        # The Debian kernel package: fetched once, into build/nested.
        if [ "$out" != "$REPO_ROOT/build/nested" ]; then
            mkdir -p "$out" "$REPO_ROOT/build/nested/deb"
            ln -sfn "$REPO_ROOT/build/nested/deb" "$out/deb"
        fi
        rm -f "$out/nested.log"
        # --scratch: L1's /tmp on a disk; the sdk scenario's state directories (templates,
        # snapshots, paused sandboxes, the object store) outgrow a /tmp in L1's memory.
        NESTED_OUT="$out" NESTED_MEM=4G NESTED_L1_EXTRA="$extra" "$REPO_ROOT/tests/nested/run.sh" --timeout "$limit" --stall 300 --scratch 8G \
            --l1-test "$REPO_ROOT/tests/nested/scenarios/suite.sh" "${DISKS[@]}" "${net[@]}" \
            "${expects[@]}" --expect '^CLADE-EXIT 0$' >"$out/suite.out" 2>&1 &
        local nested_pid=$!
        if [ ${#net[@]} -gt 0 ]; then
            echo "== [$(clock) s] the e2b SDK against Linux sandboxes (tests/e2b/test_linux.py, nested scenario sdk)"
            if CLADE_NESTED_PID=$nested_pid "$REPO_ROOT/tests/e2b/run_nested.sh" --log "$out/nested.log" -p no:cacheprovider \
                2>&1 | tee "$REPO_ROOT/target/e2b-linux.log"; then
                n=$(grep -oE '[0-9]+ passed' "$REPO_ROOT/target/e2b-linux.log" | tail -1 | awk '{print $1}' || true)
                sdk_passed=${n:-0}
                echo "e2b SDK linux suite: PASS (${n:-0} tests)"
            else
                sdk_ok=0
                echo "e2b SDK linux suite: FAIL"
            fi
        fi
        wait "$nested_pid" || true
        cat "$out/suite.out"
        for s in "$@"; do
            line=$(grep -a -m1 -E "^\[ *[0-9.]+\] NESTED-SCENARIO $s (PASS|FAIL)" \
                "$out/nested.log" 2>/dev/null | sed -E 's/^\[ *[0-9.]+\] //' || true)
            echo "nested scenario $s: ${line:-NESTED-SCENARIO $s: no result (see $out/nested.log)}"
            if [[ "$line" == *" PASS"* ]] && { [ "$s" != sdk ] || [ "$sdk_ok" = 1 ]; }; then
                ok+=("$s")
            elif [ -z "$line" ]; then
                unfinished+=("$s")
            fi
        done
        {
            echo "nested_ok=(${ok[*]})"
            echo "nested_unfinished=(${unfinished[*]})"
            echo "nested_sdk_passed=$sdk_passed"
            echo "nested_stopped=$(grep -a -q -E "$STOPPED" "$out/nested.log" 2>/dev/null && echo 1 || echo 0)"
            echo "nested_timed_out=$(grep -a -q "TIMED OUT after" "$out/suite.out" && echo 1 || echo 0)"
        } >"$out/result.sh"
    }
    STOPPED="soft lockup|self-detected stall|NESTED-STALL"
    # nested_tier: the build, then machine "sdk" (boot and sdk, about 1500 s here: the SDK
    # suites on one host, then test_linux.py through a two-node cluster) at once, and
    # machine "scenarios" (boot and the rest, about 600 s) once tiers 1 and 2 are done.
    # Writes build/nested-runs/{build-failed,sdk/,scenarios/}.
    nested_tier() {
        if ! stage "tier 3 build: static clade and agent, Debian kernel, root filesystem (tests/nested/build-rootfs.sh)" \
            bash -c "'$REPO_ROOT/tests/nested/build-rootfs.sh' && '$NESTED_DIR/fetch-kernel.sh' >/dev/null && NESTED_OUT='$REPO_ROOT/build/nested' '$NESTED_DIR/build-guest-initramfs.sh'"; then
            touch "$NESTED_RUNS/build-failed"
            return
        fi
        stage "tier 3 machine sdk: scenarios boot sdk" nested_run "$REPO_ROOT/build/nested" 2700 boot "${SDK_SCENARIOS[@]}" &
        local sdk_job=$!
        while [ ! -e "$NATIVE_DONE" ]; do sleep 5; done
        stage "tier 3 machine scenarios: boot ${OTHER_SCENARIOS[*]}" nested_run "$NESTED_RUNS/scenarios" 1800 boot "${OTHER_SCENARIOS[@]}" || true
        wait "$sdk_job" || true
    }
    echo "== [$(clock) s] tier 3 (nested) starts in the background: its output is in target/nested-tier.log, printed at the end"
    nested_tier >"$REPO_ROOT/target/nested-tier.log" 2>&1 &
    NESTED_JOB=$!
fi

# --- tiers 1 and 2, and the SDK suites ---------------------------------------------------
# Builds run at a lower priority than the nested tier's: its machine is the longest stage.
stage "lint: cargo clippy -D warnings" nice -n 10 cargo clippy --workspace --all-targets --quiet -- -D warnings

LOG="$REPO_ROOT/target/cargo-test.log"
stage "tiers 1+2 build (cargo test --no-run)" nice -n 10 cargo test --workspace --no-run --quiet
stage "tiers 1+2: unit and native KVM tests" bash -c "set -o pipefail; cargo test --workspace --no-fail-fast -- --nocapture 2>&1 | tee '$LOG'" || true
# Totals over every test binary, for the closing summary line.
sum() { grep -E '^test result:' "$LOG" | grep -oE "[0-9]+ $1" | awk '{s += $1} END {print s + 0}'; }
passed=$(sum passed)
failed=$(sum failed)
if ! grep -q -E '^test result:' "$LOG" || grep -q -E '^error(\[|:)' "$LOG"; then
    # A build or a test binary that did not run counts as a failure, not as nothing.
    failed=$((failed + 1))
fi
grep -h 'native counting loop' "$LOG" || true

# Built by the tests above (tests/src/native_guest.rs).
if stage "the embedding example (vmm/examples/embed.rs) on the native test guest" \
    cargo run --release --quiet -p vmm --example embed -- \
    "$REPO_ROOT/target/native-guest/release/native-guest" --test-guest; then
    passed=$((passed + 1))
    echo "example embed: PASS"
else
    failed=$((failed + 1))
    echo "example embed: FAIL"
fi

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
    if stage "the e2b SDK (pinned, tests/e2b/requirements.txt): $suite suite" bash -c \
        "set -o pipefail; '$REPO_ROOT/tests/e2b/run_$suite.sh' -p no:cacheprovider 2>&1 | tee '$REPO_ROOT/target/e2b-$suite.log'"; then
        n=$(grep -oE '[0-9]+ passed' "$REPO_ROOT/target/e2b-$suite.log" | tail -1 | awk '{print $1}' || true)
        passed=$((passed + ${n:-0}))
        echo "e2b SDK $suite suite: PASS (${n:-0} tests)"
    else
        n=$(pytest_failed "$REPO_ROOT/target/e2b-$suite.log")
        failed=$((failed + ${n:-1}))
        echo "e2b SDK $suite suite: FAIL"
    fi
done

# --- tier 3's results --------------------------------------------------------------------
if [ "${CLADE_SKIP_NESTED:-0}" = 1 ]; then
    echo "== [$(clock) s] tier 3 (nested) skipped: CLADE_SKIP_NESTED=1"
else
    touch "$NATIVE_DONE"
    echo "== [$(clock) s] tiers 1 and 2 are done; waiting for tier 3 (nested)"
    wait "$NESTED_JOB" || true
    NESTED_JOB=""
    echo "== [$(clock) s] tier 3 (nested): its output (target/nested-tier.log)"
    cat "$REPO_ROOT/target/nested-tier.log"
    todo=(boot "${SDK_SCENARIOS[@]}" "${OTHER_SCENARIOS[@]}")
    done_ok=()
    sdk_passed=0
    left=()
    if [ -e "$NESTED_RUNS/build-failed" ]; then
        echo "nested tier: FAIL (its build failed: see above)"
    else
        # Each machine's verdict; boot passes if it passed in both.
        boot_ok=1
        for run in "$REPO_ROOT/build/nested" "$NESTED_RUNS/scenarios"; do
            nested_ok=() nested_unfinished=() nested_sdk_passed=0 nested_stopped=0 nested_timed_out=0
            if [ -f "$run/result.sh" ]; then
                # shellcheck source=/dev/null
                . "$run/result.sh"
            else
                echo "nested machine $run: no result"
                nested_stopped=1
            fi
            [[ " ${nested_ok[*]} " == *" boot "* ]] || boot_ok=0
            for s in "${nested_ok[@]}"; do [ "$s" = boot ] || done_ok+=("$s"); done
            [ "$run" = "$REPO_ROOT/build/nested" ] && sdk_passed=$nested_sdk_passed
            # The nested machine's own kernel (L1, under QEMU TCG emulating SVM, one vCPU)
            # has been seen to stop for minutes while running a nested guest: a fault below
            # clade (L1's KVM or the emulation), not of what is tested. Its console then
            # says "soft lockup" or "self-detected stall" when it comes back, or run.sh ends
            # the machine for printing nothing (NESTED-STALL); or the stops only slow it and
            # it runs out of its time limit. The scenarios that did not pass in a machine
            # that stopped (or that one that ran out of time never finished) run once more
            # in a new machine, if CI's 90 minutes leave it room. A scenario that failed in
            # a machine that neither stopped nor ran out of time is not rerun.
            if [ "$run" = "$REPO_ROOT/build/nested" ]; then mine=(boot "${SDK_SCENARIOS[@]}"); else mine=(boot "${OTHER_SCENARIOS[@]}"); fi
            if [ "$nested_stopped" = 1 ]; then
                for s in "${mine[@]}"; do
                    [ "$s" = boot ] && continue
                    [[ " ${nested_ok[*]} " == *" $s "* ]] || left+=("$s")
                done
            elif [ "$nested_timed_out" = 1 ]; then
                for s in "${nested_unfinished[@]}"; do [ "$s" = boot ] || left+=("$s"); done
            fi
            if [ "$nested_stopped" = 1 ] || [ "$nested_timed_out" = 1 ]; then
                grep -a -h -E "$STOPPED|NESTED-POKE|NESTED-WOKEN|TIMED OUT after" \
                    "$run/nested.log" "$run/suite.out" 2>/dev/null || true
                cp "$run/nested.log" "$run/nested-lockup.log" 2>/dev/null || true
            fi
        done
        [ "$boot_ok" = 1 ] && done_ok+=(boot)
        # Room for a rerun: what is left of 85 minutes, at most 2400 s; the sdk scenario
        # alone needs about 1600 s, and is left out where it cannot finish.
        room=$((5100 - $(clock)))
        if [[ " ${left[*]} " == *" sdk "* ]] && [ "$room" -lt 1800 ]; then
            echo "== [$(clock) s] sdk is not run again: ${room} s left, it needs about 1800"
            kept=()
            for s in "${left[@]}"; do [ "$s" = sdk ] || kept+=("$s"); done
            left=("${kept[@]}")
        fi
        if [ ${#left[@]} -gt 0 ]; then
            if [ "$room" -ge 600 ]; then
                echo "== [$(clock) s] not passed where the nested machine stopped or ran out of time: ${left[*]}; they run again in a new nested machine (at most $((room < 2400 ? room : 2400)) s)"
                cp "$REPO_ROOT/target/e2b-linux.log" "$REPO_ROOT/target/e2b-linux-lockup.log" 2>/dev/null || true
                stage "tier 3 rerun: boot ${left[*]}" nested_run "$NESTED_RUNS/rerun" "$((room < 2400 ? room : 2400))" boot "${left[@]}" || true
                nested_ok=() nested_sdk_passed=0
                # shellcheck source=/dev/null
                [ -f "$NESTED_RUNS/rerun/result.sh" ] && . "$NESTED_RUNS/rerun/result.sh"
                for s in "${nested_ok[@]}"; do [ "$s" = boot ] || done_ok+=("$s"); done
                [[ " ${left[*]} " == *" sdk "* ]] && sdk_passed=$nested_sdk_passed
            else
                echo "== [$(clock) s] no rerun of ${left[*]}: ${room} s left of the 85 minutes this script allows itself"
            fi
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
    if [[ " ${done_ok[*]} " != *" sdk "* ]] && [ "$sdk_passed" = 0 ]; then
        n=$(pytest_failed "$REPO_ROOT/target/e2b-linux.log")
        failed=$((failed + ${n:-1}))
    fi
fi
print_stages
echo "all tiers: $passed passed, $failed failed ($(clock) s)"
[ "$failed" -eq 0 ]
