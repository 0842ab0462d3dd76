"""An e2b SDK session against `clade serve`: the main job as an agent developer sees it.

Create a sandbox from template "debian", run commands, write a file, pause it (its VM
process ends; memory and disk are on disk), resume it with `connect` (a restore on the
request's path), check the file and the running process survived, fork it into two
children and show each is its own machine. Prints each step with its wall time.

Used by scripts/demo.sh through tests/e2b/run_nested.sh --session (E2B_API_URL,
E2B_SANDBOX_URL and E2B_API_KEY point at the service). Under the nested tier (QEMU TCG)
the times are emulated wall times, 10-50x a real host's; latencies come from the native
tier's `clade bench`.
"""

import sys
import time

from e2b import Sandbox

SLOW = {"request_timeout": 300}


def step(what, f):
    t = time.monotonic()
    r = f()
    print(f"  {what:<52} {(time.monotonic() - t) * 1000:9.1f} ms", flush=True)
    return r


def main():
    print("e2b SDK session against clade serve (template 'debian')")
    sb = step("Sandbox.create('debian')", lambda: Sandbox.create("debian", timeout=1800, **SLOW))
    try:
        r = step(
            "commands.run(python3 ...)",
            lambda: sb.commands.run("python3 -c 'import platform; print(platform.release())'",
                                    request_timeout=300),
        )
        print(f"    guest kernel: {r.stdout.strip()}")
        step("files.write('/root/notes.txt')", lambda: sb.files.write("/root/notes.txt", "remember me\n"))
        bg = step(
            "commands.run(counter, background=True)",
            lambda: sb.commands.run(
                "i=0; while :; do i=$((i+1)); echo $i > /root/count.new; mv /root/count.new /root/count; sleep 0.2; done",
                background=True, timeout=0, request_timeout=300),  # timeout=0: runs until killed
        )
        time.sleep(1)
        step("pause (snapshot; the VM process ends)", lambda: sb.pause(**SLOW))
        print(f"    state: {Sandbox.get_info(sb.sandbox_id).state.value}")
        sb2 = step("Sandbox.connect (resume on the request's path)",
                   lambda: Sandbox.connect(sb.sandbox_id, timeout=1800, **SLOW))
        notes = step("files.read('/root/notes.txt')", lambda: sb2.files.read("/root/notes.txt"))
        assert notes == "remember me\n", notes
        c1 = int(sb2.commands.run("cat /root/count", request_timeout=300).stdout)
        time.sleep(1)
        c2 = int(sb2.commands.run("cat /root/count", request_timeout=300).stdout)
        print(f"    file kept; background counter {c1} -> {c2} (still running: {c2 > c1})")
        assert c2 > c1
        kids = step("fork(count=2)", lambda: sb2.fork(count=2, timeout=1800, **SLOW))
        for i, k in enumerate(kids):
            k.commands.run(f"echo child-{i} > /root/who.txt", request_timeout=300)
        sb2.commands.run("echo parent > /root/who.txt", request_timeout=300)
        for i, k in enumerate(kids):
            who = k.commands.run("cat /root/who.txt; cat /root/notes.txt", request_timeout=300).stdout
            print(f"    child {i} ({k.sandbox_id}): {who.strip().replace(chr(10), ' | ')}")
            assert who == f"child-{i}\nremember me\n", who
            k.kill()
        sb2.commands.kill(bg.pid)
    finally:
        step("kill", lambda: Sandbox.kill(sb.sandbox_id))
    print("SDK-SESSION-PASS")


if __name__ == "__main__":
    sys.exit(main())
