"""A Clade cluster on this machine (tests/e2b/cluster.py): three `clade serve --cluster`
nodes (a and b with the native test guest's template, c without: it creates from the
object store) and a pure gateway node (gw), each in its own network namespace, on one
PostgreSQL and one S3 server. Every request enters through a node that does not own the
sandbox. Run with tests/e2b/run_cluster.sh (root: namespaces, and PostgreSQL as user
postgres)."""

import hashlib
import io
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import threading
import time
import urllib.parse
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import KEY, REPO, Cluster, api  # noqa: E402

LEASE_MS = 2000
# The registry's rows of sandboxes that exist (a kill leaves a tombstone: state 'killed').
LIVE_ROWS = "SELECT id FROM clade_sandboxes WHERE state <> 'killed'"


@pytest.fixture(scope="module")
def cl():
    c = Cluster([("a", {}), ("b", {}), ("c", {}), ("gw", {"gateway": True})], lease_ms=LEASE_MS)
    try:
        c.start(templates_on=("a", "b"))
        yield c
    finally:
        c.close()


@pytest.fixture(autouse=True)
def no_sandbox_left(cl):
    """A test that failed halfway leaves no sandbox behind to fill the nodes of the next."""
    yield
    kill_all(cl)


def create(url, timeout=300, **extra):
    status, body, _ = api(url, "POST", "/sandboxes", {"templateID": "t", "timeout": timeout, **extra})
    assert status == 201, (status, body)
    return body["sandboxID"]


def health(url, sid):
    status, body, _ = api(url, "GET", "/health", headers={"E2b-Sandbox-Id": sid})
    return status


def info(url, sid):
    return api(url, "GET", f"/sandboxes/{sid}")


def durable(cl, url, sid, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        status, body, _ = info(url, sid)
        assert status == 200, body
        if body.get("durableAt"):
            return body
        assert time.monotonic() < deadline, f"{sid} never durable: {body}"
        time.sleep(0.1)


def kill_all(cl):
    gw = cl.nodes["gw"].url
    for (sid,) in cl.psql(LIVE_ROWS):
        api(gw, "DELETE", f"/sandboxes/{sid}")


def test_creates_are_placed_and_every_request_goes_through_a_node_that_owns_nothing(cl):
    gw = cl.nodes["gw"].url
    ids = [create(gw, metadata={"suite": "cluster"}) for _ in range(4)]
    owners = {sid: cl.owner(sid)[0] for sid in ids}
    # The nodes with the template in their cache take them, spread by free memory.
    assert sorted(owners.values()) == ["a", "a", "b", "b"], owners
    for sid, owner in owners.items():
        other = cl.nodes["b" if owner == "a" else "a"].url
        for url in (gw, other, cl.nodes["c"].url):
            status, body, _ = info(url, sid)
            assert status == 200 and body["state"] == "running", body
            assert health(url, sid) == 204
    # Lists are every node's, merged and paged.
    seen, token = [], None
    while True:
        q = "/v2/sandboxes?limit=3&metadata=suite%3Dcluster" + (f"&nextToken={token}" if token else "")
        status, page, hdrs = api(gw, "GET", q)
        assert status == 200, page
        seen += [s["sandboxID"] for s in page]
        token = hdrs.get("x-next-token") or hdrs.get("X-Next-Token")
        if not token:
            break
    assert sorted(seen) == sorted(ids)
    # Paused through the gateway, resumed through a node that does not own it: it wakes
    # on the node it paused on (warm), which still owns it.
    sid = ids[0]
    owner, token0, _, _ = cl.owner(sid)
    assert api(gw, "POST", f"/sandboxes/{sid}/pause")[0] == 204
    assert info(gw, sid)[1]["state"] == "paused"
    assert api(cl.nodes["c"].url, "POST", f"/sandboxes/{sid}/connect", {"timeout": 300})[0] in (200, 201)
    assert cl.owner(sid)[:3] == [owner, token0, "running"]
    assert health(gw, sid) == 204
    for s in ids:
        assert api(gw, "DELETE", f"/sandboxes/{s}")[0] == 204
        assert info(gw, s)[0] == 404
        assert cl.owner(s) is None


def test_templates_are_listed_from_every_node_and_builds_go_to_one(cl):
    gw, c = cl.nodes["gw"].url, cl.nodes["c"].url
    # a and b both have template t: one row, whichever node is asked.
    for url in (gw, c):
        status, body, _ = api(url, "GET", "/templates")
        assert status == 200, body
        assert [t["templateID"] for t in body] == ["t"], body
    # The build API goes to the builder (a: the first live node that takes sandboxes),
    # which has t: its alias is found through nodes that do not have it.
    for url in (gw, c):
        status, body, _ = api(url, "GET", "/templates/aliases/t")
        assert status == 200 and body["templateID"] == "t", body
    assert api(gw, "GET", "/templates/aliases/none-such")[0] == 404
    # A build's files: the link asked of c, the upload and the check made through gw. The
    # link's token is the builder's own, so the upload lands only if both went there.
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        info_ = tarfile.TarInfo("hello.txt")
        payload = b"hello from a build context\n"
        info_.size = len(payload)
        tar.addfile(info_, io.BytesIO(payload))
    digest = hashlib.sha256(data.getvalue()).hexdigest()
    status, body, _ = api(c, "GET", f"/templates/t/files/{digest}")
    assert status == 201 and body["present"] is False, body
    link = urllib.parse.urlsplit(body["url"]).path
    req = urllib.request.Request(gw + link, data=data.getvalue(), method="PUT")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 201
    status, body, _ = api(gw, "GET", f"/templates/t/files/{digest}")
    assert status == 201 and body["present"] is True, body
    # Without the builder's token: refused there.
    status, body, _ = api(gw, "PUT", f"/build-files/{digest}/4102444800/not-the-token", headers={"X-API-KEY": ""})
    assert status == 400 and "not valid" in body["message"], (status, body)


def test_a_full_cluster_answers_503_and_creates_nothing(cl):
    gw = cl.nodes["gw"].url
    ids = [create(gw) for _ in range(9)]  # 3 nodes x 3 vCPUs, one each
    owners = sorted(cl.owner(s)[0] for s in ids)
    # c has no template of its own: it created its share from the object store.
    assert owners == ["a"] * 3 + ["b"] * 3 + ["c"] * 3, owners
    status, body, _ = api(gw, "POST", "/sandboxes", {"templateID": "t", "timeout": 300})
    assert status == 503, (status, body)
    assert "out of capacity" in body["message"], body
    assert len(cl.psql(LIVE_ROWS)) == 9
    kill_all(cl)
    assert cl.psql(LIVE_ROWS) == []


def test_creates_at_the_same_moment_never_pass_a_nodes_capacity(cl):
    """Twelve creates at once for nine places: each node holds room for what it starts, so
    placements made on the same figures cannot both take its last place; a node that
    finds it full hands the create to the next, and only what fits nowhere is refused."""
    gw, a = cl.nodes["gw"].url, cl.nodes["a"].url
    results = [None] * 12

    def one(i):
        # Two ways in: the gateway, and a node that itself takes sandboxes.
        results[i] = api(gw if i % 2 else a, "POST", "/sandboxes", {"templateID": "t", "timeout": 300})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    made = [b["sandboxID"] for s, b, _ in results if s == 201]
    refused = [b for s, b, _ in results if s == 503]
    assert len(made) == 9 and len(refused) == 3, [(s, b) for s, b, _ in results]
    for b in refused:
        assert "no room" in b["message"] or "out of capacity" in b["message"], b
    owners = sorted(cl.owner(s)[0] for s in made)
    assert owners == ["a"] * 3 + ["b"] * 3 + ["c"] * 3, owners
    for s in made:
        assert health(gw, s) == 204
    kill_all(cl)
    assert cl.psql(LIVE_ROWS) == []


def running_and_paused(cl, name):
    """Two sandboxes made on node `name`: one left running, one paused and in the store."""
    node, gw = cl.nodes[name], cl.nodes["gw"].url
    running = create(node.url)
    paused = create(node.url)
    assert cl.owner(running)[0] == name and cl.owner(paused)[0] == name
    assert api(node.url, "POST", f"/sandboxes/{paused}/pause")[0] == 204
    durable(cl, gw, paused)
    return running, paused


def test_a_killed_node_leaves_its_paused_sandboxes_resumable_and_its_running_ones_lost(cl):
    a, gw = cl.nodes["a"], cl.nodes["gw"].url
    running, paused = running_and_paused(cl, "a")
    vms = a.vm_pids(running)
    assert vms
    a.kill()
    cl.wait_lease_ended("a")
    status, body, _ = info(gw, running)
    assert status == 404 and "was lost" in body["message"], body
    # Paused and in the store: another node resumes it at once.
    status, body, _ = api(gw, "POST", f"/sandboxes/{paused}/connect", {"timeout": 300})
    assert status in (200, 201), body
    node, token, state, _ = cl.owner(paused)
    assert node in ("b", "c") and state == "running" and int(token) >= 2
    assert health(gw, paused) == 204
    # Node a comes back: it takes nothing back, and stops the VM of its lost sandbox.
    a.start()
    deadline = time.monotonic() + 10
    while a.vm_pids(running):
        assert time.monotonic() < deadline, "the lost sandbox's VM still runs on node a"
        time.sleep(0.1)
    assert "owned by another node now" in a.log_text()
    assert cl.owner(paused)[0] == node
    assert info(a.url, paused)[1]["state"] == "running"
    assert health(a.url, paused) == 204
    # A lost sandbox is removed by a kill.
    assert api(gw, "DELETE", f"/sandboxes/{running}")[0] == 204
    assert cl.owner(running) is None
    kill_all(cl)


def test_a_stopped_node_past_its_lease_touches_nothing_when_it_continues(cl):
    b, gw = cl.nodes["b"], cl.nodes["gw"].url
    # Times out while b is stopped: b's timeout sweep would kill it when b continues.
    expiring = create(b.url, timeout=3)
    paused = create(b.url)
    assert cl.owner(expiring)[0] == "b" and cl.owner(paused)[0] == "b"
    assert api(b.url, "POST", f"/sandboxes/{paused}/pause")[0] == 204
    durable(cl, gw, paused)
    b.stop()
    try:
        cl.wait_lease_ended("b")
        time.sleep(3)
        status, body, _ = api(gw, "POST", f"/sandboxes/{paused}/connect", {"timeout": 300})
        assert status in (200, 201), body
        taken_by = cl.owner(paused)[0]
        assert taken_by in ("a", "c")
        status, body, _ = info(gw, expiring)
        assert status == 404 and "was lost" in body["message"], body
    finally:
        b.cont()
    # b renews, finds its lease ended, rejoins and forgets what it lost; it kills nothing
    # of the sandbox that moved (its objects in the store, its VM on the other node).
    deadline = time.monotonic() + 15
    while "rejoined the cluster" not in b.log_text():
        assert time.monotonic() < deadline, b.log_text()[-3000:]
        time.sleep(0.1)
    time.sleep(1)
    assert not b.vm_pids(expiring) and not b.vm_pids(paused)
    assert cl.owner(paused)[0] == taken_by
    assert os.path.exists(os.path.join(cl.dir, "s3/clade/cluster/sandboxes", f"{paused}.json"))
    assert info(b.url, paused)[1]["state"] == "running"
    assert health(b.url, paused) == 204
    # And it still pauses and resumes where it is now.
    assert api(b.url, "POST", f"/sandboxes/{paused}/pause")[0] == 204
    assert api(b.url, "POST", f"/sandboxes/{paused}/connect", {"timeout": 300})[0] in (200, 201)
    assert cl.owner(paused)[0] == taken_by
    kill_all(cl)


def test_a_sandbox_killed_while_its_node_was_stopped_never_comes_back(cl):
    b, gw = cl.nodes["b"], cl.nodes["gw"].url
    running, paused = running_and_paused(cl, "b")
    obj = os.path.join(cl.dir, "s3/clade/cluster/sandboxes", f"{paused}.json")
    assert os.path.exists(obj)
    assert b.vm_pids(running)
    b.stop()
    try:
        cl.wait_lease_ended("b")
        # Both killed through the gateway while their owner is away.
        assert api(gw, "DELETE", f"/sandboxes/{running}")[0] == 204
        assert api(gw, "DELETE", f"/sandboxes/{paused}")[0] == 204
        assert not os.path.exists(obj)
        for sid in (running, paused):
            assert cl.owner(sid) is None
            # The kill left a tombstone, not a missing row.
            assert cl.psql(f"SELECT node, state FROM clade_sandboxes WHERE id = '{sid}'") == [["", "killed"]]
    finally:
        b.cont()
    deadline = time.monotonic() + 15
    while "rejoined the cluster" not in b.log_text():
        assert time.monotonic() < deadline, b.log_text()[-3000:]
        time.sleep(0.1)
    time.sleep(1)
    # b forgot both: no VM, nothing answered on b or through the gateway, not listed,
    # nothing put back in the registry or the store.
    deadline = time.monotonic() + 10
    while b.vm_pids(running):
        assert time.monotonic() < deadline, "the killed sandbox's VM still runs on node b"
        time.sleep(0.1)
    for sid in (running, paused):
        for url in (b.url, gw):
            status, body, _ = info(url, sid)
            assert status == 404, (url, sid, status, body)
        assert cl.owner(sid) is None
    status, body, _ = api(gw, "GET", "/sandboxes")
    assert status == 200 and not {running, paused} & {s["sandboxID"] for s in body}, body
    assert api(gw, "POST", f"/sandboxes/{paused}/connect", {"timeout": 300})[0] == 404
    assert not os.path.exists(obj)
    kill_all(cl)


def test_two_nodes_racing_to_resume_one_sandbox(cl):
    a, gw = cl.nodes["a"], cl.nodes["gw"].url
    sid = create(a.url)
    assert cl.owner(sid)[0] == "a"
    assert api(a.url, "POST", f"/sandboxes/{sid}/pause")[0] == 204
    durable(cl, gw, sid)
    a.kill()
    cl.wait_lease_ended("a")
    results = {}

    def resume(name):
        results[name] = api(cl.nodes[name].url, "POST", f"/sandboxes/{sid}/connect", {"timeout": 300})

    threads = [threading.Thread(target=resume, args=(n,)) for n in ("b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r[0] for r in results.values())
    # One resumes it; the other either lost the race (409) or came after and was
    # forwarded to the winner.
    assert statuses[0] in (200, 201) and statuses[1] in (200, 201, 409), results
    owner = cl.owner(sid)[0]
    running_on = [n for n in ("b", "c") if cl.nodes[n].vm_pids(sid)]
    assert running_on == [owner], (running_on, owner, results)
    assert health(gw, sid) == 204
    a.start()
    kill_all(cl)


def test_a_lost_node_with_checkpoints_brings_its_running_sandboxes_back(cl):
    a, gw = cl.nodes["a"], cl.nodes["gw"].url
    a.end()
    a.extra = ["--checkpoint-every", "1"]
    a.start()
    try:
        sid = create(a.url)
        assert cl.owner(sid)[0] == "a"
        deadline = time.monotonic() + 60
        while cl.psql(f"SELECT checkpointed FROM clade_sandboxes WHERE id = '{sid}'") != [["t"]]:
            assert time.monotonic() < deadline, "no checkpoint published"
            time.sleep(0.2)
        a.kill()
        cl.wait_lease_ended("a")
        # Any request brings it back from its checkpoint, on a node with room.
        status, body, _ = info(gw, sid)
        assert status == 200 and body["state"] == "running", body
        assert body.get("restoredFromCheckpoint"), body
        node, token, state, _ = cl.owner(sid)
        assert node in ("b", "c") and state == "running" and int(token) >= 2
        assert health(gw, sid) == 204
    finally:
        a.extra = []
        if a.proc.poll() is not None:
            a.start()
    # Node a took nothing back: the VM it had is stopped.
    deadline = time.monotonic() + 10
    while a.vm_pids(sid):
        assert time.monotonic() < deadline, "node a still runs the sandbox it lost"
        time.sleep(0.1)
    assert cl.owner(sid)[0] == node
    kill_all(cl)


def test_a_fork_beyond_its_node_goes_on_elsewhere_from_a_snapshot(cl):
    a, gw = cl.nodes["a"], cl.nodes["gw"].url
    parent = create(a.url, metadata={"suite": "fork"}, envVars={"FROM_PARENT": "yes"}, autoPause=True)
    assert cl.owner(parent)[0] == "a"
    # Node a has room for two more (3 vCPUs); four children: two there (copy-on-write),
    # two on other nodes from a snapshot of the parent in the store.
    status, body, _ = api(gw, "POST", f"/sandboxes/{parent}/fork", {"count": 4, "timeout": 300})
    assert status == 201, body
    kids = [c["sandbox"]["sandboxID"] for c in body]
    assert len(set(kids)) == 4
    owners = sorted(cl.owner(k)[0] for k in kids)
    assert owners.count("a") == 2 and all(o in ("a", "b", "c") for o in owners), owners
    for k in kids:
        assert health(gw, k) == 204
        assert info(gw, k)[1]["metadata"] == {"suite": "fork"}
        # Like their parent wherever they run: env vars, lifecycle, their own token.
        rec = cl.nodes[cl.owner(k)[0]].record(k)
        assert json.loads(rec["env_vars"]) == {"FROM_PARENT": "yes"}, rec
        assert rec["auto_pause"] == 1, rec
        assert rec["envd_token"] and rec["envd_token"] != cl.nodes["a"].record(parent)["envd_token"]
    # Nowhere with room for eight more: nothing is made.
    before = len(cl.psql(LIVE_ROWS))
    status, body, _ = api(gw, "POST", f"/sandboxes/{parent}/fork", {"count": 8, "timeout": 300})
    assert status == 503, body
    assert len(cl.psql(LIVE_ROWS)) == before
    kill_all(cl)


def test_a_drained_node_moves_its_running_sandboxes_and_takes_no_more(cl):
    b, gw = cl.nodes["b"], cl.nodes["gw"].url
    moving = create(b.url)
    idle = create(b.url)
    assert cl.owner(moving)[0] == "b" and cl.owner(idle)[0] == "b"
    assert api(b.url, "POST", f"/sandboxes/{idle}/pause")[0] == 204
    r = subprocess.run([os.environ.get("CLADE", os.path.join(REPO, "target/debug/clade")),
                        "node", "drain", "b", "--wait", "120"],
                       capture_output=True, text=True, env=dict(os.environ, CLADE_CLUSTER=cl.pg_url))
    assert r.returncode == 0, r.stderr + b.log_text()[-3000:]
    node, _, state, _ = cl.owner(moving)
    assert node in ("a", "c") and state == "running"
    assert not b.vm_pids(moving)
    assert health(gw, moving) == 204
    # The idle one stays paused, durable; a resume goes elsewhere.
    assert cl.owner(idle)[2:] == ["paused", "t"]
    assert api(gw, "POST", f"/sandboxes/{idle}/connect", {"timeout": 300})[0] in (200, 201)
    assert cl.owner(idle)[0] in ("a", "c")
    # No placement on a draining node.
    new = [create(gw) for _ in range(3)]
    assert all(cl.owner(s)[0] != "b" for s in new)
    kill_all(cl)


def test_the_dashboard_of_the_gateway_shows_the_nodes_and_every_nodes_sandboxes(cl):
    """In a real browser (Debian's chromium, as tests/e2b/test_dashboard.py): the dashboard
    of the gateway node, which runs no sandboxes, lists sandboxes of nodes a and c, pauses
    one of them through its button, and shows the nodes (b drained by the test before)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    gw, c = cl.nodes["gw"].url, cl.nodes["c"].url
    # Node a has room for three (b is drained): the fourth goes to c.
    made = {cl.owner(s)[0]: s for s in (create(gw) for _ in range(4))}
    assert set(made) == {"a", "c"}, made
    on_a, on_c = made["a"], made["c"]
    shots = pathlib.Path(os.environ.get("CLADE_ARTIFACTS", "target/dashboard-screenshots")) / "cluster"
    shots.mkdir(parents=True, exist_ok=True)
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=opts)
    wait = lambda cond, what: WebDriverWait(driver, 30, poll_frequency=0.25).until(  # noqa: E731
        lambda d: cond(d), message=what)
    rows = "return [...document.querySelectorAll(arguments[0])].map(r => r.dataset[arguments[1]]);"
    try:
        driver.get(gw + "/dashboard/login")
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.find_element(By.ID, "login").click()
        wait(lambda d: d.current_url.endswith("/dashboard"), "the dashboard after login")
        wait(lambda d: {on_a, on_c} <= set(d.execute_script(rows, "#sandbox-rows tr", "id")),
             "the sandboxes of nodes a and c listed on the gateway's dashboard")
        driver.save_screenshot(str(shots / "01-sandboxes.png"))
        # Pause the one on node c through the page (confirmed in the dialog).
        # (The list is drawn anew at each poll: a redraw between finding the button and
        # clicking it is retried.)
        pause = f'#sandbox-rows tr[data-id="{on_c}"] button[data-action="pause"]'

        def click_pause(d):
            try:
                d.find_element(By.CSS_SELECTOR, pause).click()
                return True
            except StaleElementReferenceException:
                return False

        wait(click_pause, "the pause button of the sandbox on c clicked")
        wait(lambda d: d.switch_to.alert, "a confirm dialog").accept()
        wait(lambda d: info(gw, on_c)[1]["state"] == "paused", "the sandbox on c paused")
        assert cl.owner(on_c)[2] == "paused"
        # The nodes tab: shown because the service is a node of a cluster.
        wait(lambda d: d.find_element(By.ID, "tab-nodes").is_displayed(), "the nodes tab")
        driver.find_element(By.ID, "tab-nodes").click()
        wait(lambda d: set(d.execute_script(rows, "#node-rows tr", "node")) == {"a", "b", "c", "gw"},
             "the four nodes listed")
        state = lambda n: driver.execute_script(  # noqa: E731
            "return document.querySelector(`#node-rows tr[data-node=\"${arguments[0]}\"] .node-state`).textContent;", n)
        assert state("gw") == "live (gateway)" and state("a") == "live", (state("gw"), state("a"))
        assert state("b") in ("drained", "draining"), state("b")
        driver.save_screenshot(str(shots / "02-nodes.png"))
    finally:
        driver.quit()
    # A service that is no node has no nodes view: GET /nodes is a 404 there (the
    # dashboard then hides the tab); here every node answers it.
    status, body, _ = api(c, "GET", "/nodes")
    assert status == 200 and len(body) == 4, body
    kill_all(cl)


def test_the_control_suite_through_the_gateway_node(cl):
    gw = cl.nodes["gw"].url
    env = dict(os.environ, E2B_API_URL=gw, E2B_SANDBOX_URL=gw, E2B_API_KEY=KEY, CLADE_TEMPLATE="t")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--tb=short", os.path.join(REPO, "tests/e2b/test_control.py")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout[-20000:]


def test_the_data_plane_suite_through_the_gateway_node(cl):
    """Commands, streams, stdin, PTYs, files, watches and exposed ports, every request
    through the gateway to a node whose sandboxes are host-run agents (the data-plane
    harness of test_dataplane.py)."""
    agent = os.path.join(os.path.dirname(os.environ.get("CLADE", os.path.join(REPO, "target/debug/clade"))), "clade-agent")
    cl.add_node("h", ["--test-host-agent", agent], vcpus=16, mem=65536)
    gw = cl.nodes["gw"].url
    env = dict(os.environ, E2B_API_URL=gw, E2B_SANDBOX_URL=gw, E2B_API_KEY=KEY)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
                        os.path.join(REPO, "tests/e2b/test_dataplane.py")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout[-20000:]
    # Its sandboxes were created on the agents' node (the gateway runs none).
    assert cl.nodes["h"].log_text().count(" created ") >= 5
    assert " created " not in cl.nodes["gw"].log_text()
