"""Sandbox networking through the pinned e2b SDK, on LINUX sandboxes in the nested tier.

tests/nested/scenarios/sdk.sh builds template "debian" with a network device and makes a
"world": a network namespace of its own in the nested machine, 10.99.0.2 and 10.99.0.3
serving HTTP on port 8000 (the same files: hello.txt, a 1 MiB blob and its SHA-256), and
its DNS at 10.99.0.4 (the service's --net-dns: a.world.test and b.world.test are the two).
Sandboxes reach it through their own namespace and the service's NAT, or are kept from it
by their egress policy. No address outside the nested machine is ever used. Run with
tests/e2b/run_nested.sh (with test_linux.py and test_dataplane.py).
"""

import os
import time

import httpx
import pytest
from e2b import Sandbox
from e2b.sandbox.network import ALL_TRAFFIC

from test_linux import NESTED_LOG, SLOW, TEMPLATE, console_count, control, run

WORLD_A = "10.99.0.2"
WORLD_B = "10.99.0.3"
# A blocked connection must fail, not hang the suite: short, but generous for TCG.
FETCH = (
    "import hashlib, sys, urllib.request; "
    "d = urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])).read(); "
    "print(len(d), hashlib.sha256(d).hexdigest())"
)


def create(**kw):
    kw.setdefault("timeout", 1800)
    return Sandbox.create(TEMPLATE, **kw, **SLOW)


def fetch(sb, ip, path="blob", timeout=20):
    """(ok, output) of an HTTP GET from inside the sandbox."""
    try:
        r = run(sb, f"python3 -c '{FETCH}' http://{ip}:8000/{path} {timeout}")
        return True, r.stdout
    except Exception as e:  # CommandExitException: the fetch failed in the guest
        return False, str(e)


def reaches(sb, ip):
    ok, _ = fetch(sb, ip, "hello.txt", timeout=8)
    return ok


def netns_counts(tag):
    """(namespaces, host veths) of the service in the nested machine, asked by control."""
    before = console_count(f"SDK-NETNS {tag} ")
    control(f"netns {tag}")
    deadline = time.monotonic() + 60
    while console_count(f"SDK-NETNS {tag} ") == before:
        assert time.monotonic() < deadline, "no answer to the netns command"
        time.sleep(0.3)
    with open(NESTED_LOG, "rb") as f:
        lines = f.read().decode(errors="replace").splitlines()
    line = [ln for ln in lines if f"SDK-NETNS {tag} " in ln][-1]
    n, v = line.split(f"SDK-NETNS {tag} ", 1)[1].split()[:2]
    return int(n), int(v)


@pytest.fixture(scope="module")
def sb():
    s = create(metadata={"suite": "network"})
    yield s
    try:
        s.kill()
    except Exception:
        pass


def test_download_through_nat_same_checksum(sb):
    ok, out = fetch(sb, WORLD_A)
    assert ok, out
    size, digest = out.split()
    assert size == "1048576"
    # The world's own checksum of the blob (the body of blob.sha256).
    want = run(
        sb,
        "python3 -c 'import urllib.request as u; "
        f"print(u.urlopen(\"http://{WORLD_A}:8000/blob.sha256\", timeout=20).read().decode().strip())'",
    ).stdout.strip()
    assert digest == want, (digest, want)
    assert reaches(sb, WORLD_B)


def test_deny_all_blocks_egress():
    s = create(allow_internet_access=False)
    try:
        assert not reaches(s, WORLD_A)
        assert not reaches(s, WORLD_B)
        # The sandbox itself works: only its egress is cut.
        assert run(s, "echo alive").stdout == "alive\n"
    finally:
        s.kill()


def test_cidr_allow_list_permits_one_server_and_blocks_another():
    s = create(network={"deny_out": [ALL_TRAFFIC], "allow_out": [WORLD_A]})
    try:
        assert reaches(s, WORLD_A)
        assert not reaches(s, WORLD_B)
    finally:
        s.kill()


def test_deny_list_blocks_only_what_it_names():
    s = create(network={"deny_out": [f"{WORLD_B}/32"]})
    try:
        assert reaches(s, WORLD_A)
        assert not reaches(s, WORLD_B)
    finally:
        s.kill()


def test_policy_changed_on_a_running_sandbox(sb):
    assert reaches(sb, WORLD_A)
    sb.update_network({"deny_out": [ALL_TRAFFIC]})
    assert not reaches(sb, WORLD_A)
    sb.update_network({})
    assert reaches(sb, WORLD_A)


def test_domains_are_allowed_through_dns_and_cannot_be_denied():
    # A denied domain is refused, not ignored (any name may resolve to the same address).
    with pytest.raises(Exception) as e:
        create(network={"deny_out": ["example.org"]})
    assert "example.org" in str(e.value) or "400" in str(e.value)
    # Everything denied but one name: the world's DNS (sdk.sh) says a.world.test is
    # WORLD_A and b.world.test is WORLD_B. Before any lookup neither address passes; the
    # allowed name resolves through the sandbox's gateway and its address passes from
    # then on; the other name is refused by the gateway, its address stays blocked.
    s = create(network={"deny_out": [ALL_TRAFFIC], "allow_out": ["a.world.test"]})
    try:
        assert not reaches(s, WORLD_A), "before the name resolved"
        ok, out = fetch(s, "a.world.test")
        assert ok, out
        assert reaches(s, WORLD_A), "what the allowed name resolved to"
        assert not reaches(s, "b.world.test"), "a name not allowed"
        assert not reaches(s, WORLD_B)
        r = run(s, "python3 -c 'import socket; print(socket.gethostbyname(\"a.world.test\"))'")
        assert r.stdout.strip() == WORLD_A, r.stdout
        # A new policy forgets what was learned.
        s.update_network({"deny_out": [ALL_TRAFFIC]})
        assert not reaches(s, WORLD_A), "learned addresses go with the policy"
    finally:
        s.kill()


def test_network_survives_pause_resume_and_each_fork_child_has_its_own():
    s = create(
        network={"deny_out": [f"{WORLD_B}/32"]},
        lifecycle={"on_timeout": "pause", "auto_resume": True},
    )
    kids = []
    try:
        assert reaches(s, WORLD_A)
        s.pause()
        # Resumed by the command (auto-resume): same address inside, new VM process on the
        # same TAP.
        assert reaches(s, WORLD_A)
        assert not reaches(s, WORLD_B), "the policy survives a pause"
        kids = s.fork(count=3, timeout=1800, **SLOW)
        assert all(isinstance(k, Sandbox) for k in kids), kids
        # The parent's VM process moved onto its spare VM shell at the fork (when it had
        # one): its network device goes on on the new mapping of its memory.
        assert reaches(s, WORLD_A), "the parent's network after the fork"
        assert not reaches(s, WORLD_B), "the parent's policy after the fork"
        for k in kids:
            assert reaches(k, WORLD_A)
            assert not reaches(k, WORLD_B), "children get the parent's policy"
        # Each child has its own network: the same port in every child, each reached at
        # its own outer address through the service's port routing.
        base = os.environ["E2B_SANDBOX_URL"]
        for i, k in enumerate(kids):
            run(k, f"mkdir -p /tmp/www && echo child-{i} > /tmp/www/who.txt")
            k.commands.run("cd /tmp/www && exec python3 -m http.server 8123", background=True, request_timeout=300)
        for i, k in enumerate(kids):
            deadline = time.monotonic() + 120
            while True:
                r = httpx.get(f"{base}/who.txt", headers={"Host": k.get_host(8123)}, timeout=60)
                if r.status_code == 200 or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert (r.status_code, r.text) == (200, f"child-{i}\n")
    finally:
        for k in kids:
            try:
                k.kill()
            except Exception:
                pass
        s.kill()


def test_networks_go_with_their_sandboxes_and_a_killed_vmm():
    n0, v0 = netns_counts("before")
    s = create()
    assert reaches(s, WORLD_A)
    n1, v1 = netns_counts("created")
    # One more held network (the pool refills to its size in the background: allow it).
    assert n1 >= n0 and v1 >= v0
    s.kill()
    # A sandbox whose VM process is SIGKILLed shows as crashed; killing it removes its
    # network too.
    t = create()
    control(f"kill-vmm {t.sandbox_id}")
    deadline = time.monotonic() + 60
    while console_count(f"SDK-VMM-KILLED {t.sandbox_id} ") == 0:
        assert time.monotonic() < deadline, "no answer to kill-vmm"
        time.sleep(0.3)
    assert console_count(f"SDK-VMM-KILLED {t.sandbox_id} 1") == 1, "its VM process was found"
    deadline = time.monotonic() + 60
    while t.is_running(request_timeout=300):
        assert time.monotonic() < deadline, "a SIGKILLed sandbox still shows as running"
        time.sleep(1)
    t.kill()
    n2, v2 = netns_counts("after")
    assert (n2, v2) == (n0, v0), f"before {(n0, v0)}, after kills {(n2, v2)}"


def test_the_guests_resolver_is_its_gateway(sb):
    # The agent wrote it from the template's kernel command line (clade.dns=): the
    # service's DNS forwarder on the gateway, the same in every sandbox.
    assert run(sb, "cat /etc/resolv.conf").stdout == "nameserver 172.16.0.1\n"
