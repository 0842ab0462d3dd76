"""A Linux sandbox outlives its host (tests/nested/scenarios/sdk.sh's hosts A and B, two
`clade serve` on one object store): paused through the e2b SDK on host A, it becomes
durable in the store; host A is then lost (its service and VMs killed, its whole state
directory deleted), and host B (its own state directory, without the template) resumes
it: its file is there and its process runs on, counting from where it was."""

import json
import os
import time
import urllib.request

from e2b import Sandbox
from e2b.api.client.models.sandbox_state import SandboxState
from e2b.sandbox.sandbox_api import SandboxQuery
from test_linux import SLOW, console_count, control, create, run

URL_A = os.environ.get("CLADE_NESTED_URL_A", "http://127.0.0.1:39483")
URL_B = os.environ.get("CLADE_NESTED_URL_B", "http://127.0.0.1:39484")
KEY = os.environ.get("E2B_API_KEY", "nested-sdk-key")
# Programs of the Debian root, summed on host A and again on host B.
PROGRAMS = "/usr/bin/perl /usr/bin/python3.* /usr/bin/apt-get 2>/dev/null"


def info(url, sandbox_id):
    req = urllib.request.Request(f"{url}/sandboxes/{sandbox_id}", headers={"X-API-KEY": KEY})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_a_paused_sandbox_resumes_on_another_service_after_its_host_is_lost():
    s = create(metadata={"suite": "move"}, api_url=URL_A, sandbox_url=URL_A)
    run(s, "echo written-on-host-a > /root/moved.txt && sync")
    sums = run(s, f"md5sum {PROGRAMS} | sort").stdout
    assert len(sums.splitlines()) >= 2, sums
    h = s.commands.run(
        "i=0; while :; do i=$((i+1)); echo $i > /root/count.new; mv /root/count.new /root/count; sleep 0.2; done",
        background=True,
        timeout=0,
        request_timeout=300,
    )
    time.sleep(2)
    before = int(run(s, "cat /root/count").stdout)
    s.pause(**SLOW)
    # Durable once its pause (memory diff, disk layers, the template below them) is in
    # the store: uploaded in the background after the pause returned.
    deadline = time.monotonic() + 900
    while True:
        v = info(URL_A, s.sandbox_id)
        if v.get("durableAt"):
            break
        assert time.monotonic() < deadline, f"never durable: {v}"
        time.sleep(2)
    assert v["state"] == "paused"

    before_lost = console_count("SDK-HOST-LOST")
    control("lose-host")
    deadline = time.monotonic() + 120
    while console_count("SDK-HOST-LOST") == before_lost:
        assert time.monotonic() < deadline, "the host was not lost"
        time.sleep(0.5)

    # Host B has never seen it: it finds it in the store, by id and in its list.
    assert info(URL_B, s.sandbox_id)["state"] == "paused"
    query = SandboxQuery(metadata={"suite": "move"}, state=[SandboxState.PAUSED])
    paginator = Sandbox.list(query=query, api_url=URL_B)
    listed = []
    while paginator.has_next:
        listed.extend(x.sandbox_id for x in paginator.next_items())
    assert s.sandbox_id in listed, listed
    b = Sandbox.connect(s.sandbox_id, timeout=1800, api_url=URL_B, sandbox_url=URL_B, **SLOW)
    try:
        assert run(b, "cat /root/moved.txt").stdout == "written-on-host-a\n"
        # Its disk layers are read lazily on B: whole programs, read from the disk again
        # (the guest's page cache dropped), are what they were on A.
        run(b, "echo 3 > /proc/sys/vm/drop_caches", user="root")
        assert run(b, f"md5sum {PROGRAMS} | sort").stdout == sums
        assert h.pid in [p.pid for p in b.commands.list(request_timeout=300)]
        after = int(run(b, "cat /root/count").stdout)
        assert after >= before
        deadline = time.monotonic() + 120
        while int(run(b, "cat /root/count").stdout) <= after:
            assert time.monotonic() < deadline, "the moved process does not run on"
            time.sleep(0.5)
        assert info(URL_B, s.sandbox_id)["state"] == "running"
        # Paused and resumed on B (its own snapshot now, on the layers B reads lazily).
        run(b, "echo written-on-host-b > /root/b.txt && sync")
        b.pause(**SLOW)
        b = Sandbox.connect(s.sandbox_id, timeout=1800, api_url=URL_B, sandbox_url=URL_B, **SLOW)
        assert run(b, "cat /root/moved.txt /root/b.txt").stdout == (
            "written-on-host-a\nwritten-on-host-b\n"
        )
        run(b, "echo 3 > /proc/sys/vm/drop_caches", user="root")
        assert run(b, f"md5sum {PROGRAMS} | sort").stdout == sums
        assert run(b, "ls /usr/lib/python3*/ | wc -l").stdout.strip() != "0"
    finally:
        Sandbox.kill(s.sandbox_id, api_url=URL_B, sandbox_url=URL_B)
