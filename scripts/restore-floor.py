#!/usr/bin/env python3
"""Where a restored guest's first moments go, from the host kernel's own KVM tracepoints.

`clade bench restore` times a restore until the native guest answered a ping; its
`connect_ping` step (~0.7-1 ms on the project's machines, against ~60 us for a second
ping on the same connection) is mostly the restored guest's first run. This script shows
what that first run is made of, per restore, as the hypervisor sees it: it turns on the
`kvm`, `kvmmmu` and `sched` tracepoints (tracefs; root), runs `clade bench restore`, and
splits each restored vCPU's time from its first KVM event to its teardown by what ended
each stretch: a shadow page-table fault (`kvm_mmu_set_spte`: the hypervisor building its
page tables for a page the guest touched for the first time in this VM), an emulated
instruction (MMIO to the LAPIC or a virtio register, `hlt`), a KVM exit to the VMM
(MMIO the VMM handles: the vsock device's configuration), or the wait after a halt.

Tracing adds ~1-2 us to every event it records: the figures are an upper bound of each
part, and the benchmark's own p50 is higher while it runs (printed for comparison).

Usage: scripts/restore-floor.py [--clade PATH] [--json] [-- BENCH-RESTORE-ARGS...]
       (default bench arguments: -n 100 --baseline-n 0 --prefill)
"""

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys

TRACEFS = "/sys/kernel/tracing"
EVENTS = [
    "kvm/kvm_emulate_insn",
    "kvm/kvm_userspace_exit",
    "kvm/kvm_vcpu_wakeup",
    "kvmmmu/kvm_mmu_set_spte",
    "kvmmmu/kvm_mmu_get_page",
]
LINE = re.compile(r"\s*(.+?)-(\d+)\s+\[(\d+)\]\s+\S+\s+([\d.]+):\s+(\w+):(.*)")


def write(path, value):
    with open(os.path.join(TRACEFS, path), "w") as f:
        f.write(value)


def trace_bench(clade, bench_args):
    """Runs the benchmark with the tracepoints on; returns (its JSON, the trace text)."""
    if not os.path.isdir(os.path.join(TRACEFS, "events")):
        subprocess.run(["mount", "-t", "tracefs", "nodev", TRACEFS], check=True)
    for e in EVENTS:
        if not os.path.exists(os.path.join(TRACEFS, "events", e)):
            sys.exit(f"restore-floor: this kernel has no {e} tracepoint")
    write("tracing_on", "0")
    write("events/enable", "0")
    write("trace", "")
    write("buffer_size_kb", "65536")
    for e in EVENTS:
        write(f"events/{e}/enable", "1")
    write("tracing_on", "1")
    try:
        out = subprocess.run(
            [clade, "bench", "restore", "--json", *bench_args],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        ).stdout
    finally:
        write("tracing_on", "0")
        for e in EVENTS:
            write(f"events/{e}/enable", "0")
    with open(os.path.join(TRACEFS, "trace")) as f:
        text = f.read()
    write("trace", "")
    return json.loads(out), text


def kind_of(event, rest, prev):
    """What ended the stretch of vCPU time before `event`."""
    if prev is not None:
        pe, pr = prev
        if pe == "kvm_emulate_insn" and ":f4 " in pr:
            return "halted (hlt until an interrupt)"
        if pe == "kvm_userspace_exit" and "restart" not in pr:
            return "in the VMM (KVM exit handled in user space)"
    if event == "kvm_mmu_set_spte":
        return "shadow page fault (first touch of a page)"
    if event == "kvm_mmu_get_page":
        return "shadow page-table page built"
    if event == "kvm_emulate_insn":
        return "halt" if ":f4 " in rest else "emulated MMIO (LAPIC, virtio register)"
    if event == "kvm_userspace_exit":
        return "KVM exit to the VMM"
    return "other"


def analyse(text, skip):
    """Per restored vCPU (one thread each), the time from its first KVM event to its
    teardown, split by kind; the first `skip` restores (cold ones) are left out."""
    by_thread = collections.OrderedDict()
    for line in text.splitlines():
        m = LINE.match(line)
        if not m or m.group(1).strip() != "vcpu0" or not m.group(5).startswith("kvm"):
            continue
        by_thread.setdefault(int(m.group(2)), []).append(
            (float(m.group(4)) * 1e6, m.group(5), m.group(6))
        )
    restores = []
    for events in list(by_thread.values())[skip:]:
        end = next(
            (i for i, (_, e, r) in enumerate(events) if e == "kvm_userspace_exit" and "restart" in r),
            None,
        )
        if end is None:
            continue
        parts = collections.Counter()
        counts = collections.Counter()
        prev = None
        for (t0, e0, r0), (t1, e1, r1) in zip(events[:end], events[1 : end + 1]):
            k = kind_of(e1, r1, (e0, r0))
            parts[k] += t1 - t0
            counts[k] += 1
        restores.append(
            {"span_us": events[end][0] - events[0][0], "us": parts, "count": counts}
        )
    return restores


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clade", default="target/release/clade")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("bench_args", nargs="*")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("restore-floor: tracepoints need root")
    bench_args = a.bench_args or ["-n", "100", "--baseline-n", "0", "--prefill"]
    bench, text = trace_bench(a.clade, bench_args)
    restores = analyse(text, skip=2)
    if not restores:
        sys.exit("restore-floor: no restored vCPU in the trace (buffer too small?)")
    kinds = sorted({k for r in restores for k in r["us"]})
    n = len(restores)
    summary = {
        "restores": n,
        "bench_p50_us_traced": bench.get("p50_us"),
        "bench_connect_ping_p50_us_traced": bench.get("steps_p50_us", {}).get("connect_ping"),
        "vcpu_span_p50_us": round(statistics.median(r["span_us"] for r in restores), 1),
        "parts": {
            k: {
                "count_p50": statistics.median(r["count"][k] for r in restores),
                "us_p50": round(statistics.median(r["us"][k] for r in restores), 1),
                "us_mean": round(sum(r["us"][k] for r in restores) / n, 1),
            }
            for k in kinds
        },
    }
    if a.json:
        print(json.dumps(summary))
        return
    print(
        f"{n} restores (traced: bench p50 {summary['bench_p50_us_traced']} us, "
        f"connect_ping p50 {summary['bench_connect_ping_p50_us_traced']} us)"
    )
    print(
        f"restored vCPU, first KVM event -> teardown (after the ping and a second one): "
        f"p50 {summary['vcpu_span_p50_us']} us, of which:"
    )
    for k, v in sorted(summary["parts"].items(), key=lambda kv: -kv[1]["us_mean"]):
        print(
            f"  {k:48} {v['count_p50']:5.1f} x  p50 {v['us_p50']:7.1f} us  mean {v['us_mean']:7.1f} us"
        )


if __name__ == "__main__":
    main()
