"""The e2b SDK (pinned in requirements.txt) against `clade serve`'s control plane, with
real VMs: every sandbox is a `clade restore` of a template built from the project's
native test guest (which answers the agent's Hello and Ping only, so no commands here:
the data plane is tested in test_dataplane.py). Run with tests/e2b/run_control.sh.
"""

import json
import os
import time

import pytest
from e2b import Sandbox
from e2b.api.client.models.sandbox_state import SandboxState
from e2b.exceptions import (
    AuthenticationException,
    NotFoundException,
    SandboxException,
)
from e2b.sandbox.sandbox_api import SandboxQuery

TEMPLATE = os.environ.get("CLADE_TEMPLATE", "native")


def ids(sandboxes):
    return {s.sandbox_id for s in sandboxes}


def listed(query=None):
    """Every sandbox the list returns, across pages."""
    out = []
    paginator = Sandbox.list(query=query, limit=2)
    while paginator.has_next:
        out.extend(paginator.next_items())
    return out


def test_create_info_list_and_kill():
    s = Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": "control", "n": "1"})
    try:
        info = s.get_info()
        assert info.sandbox_id == s.sandbox_id
        assert info.state == SandboxState.RUNNING
        assert info.metadata.get("suite") == "control"
        assert s.sandbox_id in ids(listed(SandboxQuery(metadata={"suite": "control"})))
        assert s.sandbox_id not in ids(listed(SandboxQuery(metadata={"suite": "other"})))
        assert s.sandbox_id not in ids(listed(SandboxQuery(state=[SandboxState.PAUSED])))
        s.set_timeout(300)
    finally:
        s.kill()
    with pytest.raises(NotFoundException):
        Sandbox.get_info(s.sandbox_id)


def test_pause_and_connect():
    s = Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": "pause"})
    try:
        s.pause()
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
        paused = listed(SandboxQuery(state=[SandboxState.PAUSED]))
        assert s.sandbox_id in ids(paused)
        t = time.monotonic()
        again = Sandbox.connect(s.sandbox_id, timeout=120)
        wake_ms = (time.monotonic() - t) * 1000
        print(f"connect of a paused sandbox: {wake_ms:.1f} ms (SDK, HTTP included)")
        assert again.sandbox_id == s.sandbox_id
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.RUNNING
    finally:
        Sandbox.kill(s.sandbox_id)


def test_fork_makes_new_running_sandboxes():
    s = Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": "fork"})
    try:
        kids = s.fork(count=3, timeout=120)
        assert len(kids) == 3
        for k in kids:
            assert not isinstance(k, Exception), k
        kid_ids = {k.sandbox_id for k in kids}
        assert len(kid_ids) == 3 and s.sandbox_id not in kid_ids
        running = ids(listed(SandboxQuery(state=[SandboxState.RUNNING])))
        assert kid_ids <= running and s.sandbox_id in running
        for k in kids:
            k.kill()
        # The parent is untouched by its children's end.
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.RUNNING
    finally:
        s.kill()


def test_timeout_kills():
    s = Sandbox.create(TEMPLATE, timeout=2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            Sandbox.get_info(s.sandbox_id)
        except NotFoundException:
            return
        time.sleep(0.25)
    pytest.fail("the sandbox outlived its timeout")


def test_timeout_pauses_with_lifecycle_pause():
    s = Sandbox.create(TEMPLATE, timeout=2, lifecycle={"on_timeout": "pause"})
    try:
        deadline = time.monotonic() + 20
        while Sandbox.get_info(s.sandbox_id).state != SandboxState.PAUSED:
            assert time.monotonic() < deadline, "not paused after its timeout"
            time.sleep(0.25)
        Sandbox.connect(s.sandbox_id, timeout=60)
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.RUNNING
    finally:
        Sandbox.kill(s.sandbox_id)


def test_errors_map_to_sdk_exceptions():
    with pytest.raises(NotFoundException):
        Sandbox.connect("doesnotexist0000000000000", timeout=10)
    with pytest.raises(SandboxException):
        Sandbox.create("no-such-template", timeout=10)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="wrong-key").next_items()


def all_snapshots(**kw):
    out = []
    paginator = Sandbox.list_snapshots(limit=1, **kw)
    while paginator.has_next:
        out.extend(paginator.next_items())
    return out


def test_snapshot_then_new_sandboxes_from_it():
    s = Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": "snapshot"})
    made = [s]
    try:
        assert s.is_running()
        snap = s.create_snapshot()
        assert snap.snapshot_id.endswith(":default")
        assert snap.names == [snap.snapshot_id]
        # The source runs on, and its agent still answers.
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.RUNNING
        assert s.is_running()
        named = s.create_snapshot(name="cp-snap")
        assert named.snapshot_id == "cp-snap:default"
        # Listed (paged, one a page), newest first, filtered by source sandbox.
        mine = [x.snapshot_id for x in all_snapshots(sandbox_id=s.sandbox_id)]
        assert mine == [named.snapshot_id, snap.snapshot_id]
        assert all_snapshots(sandbox_id="doesnotexist0000000000") == []

        kid = Sandbox.create(snap.snapshot_id, timeout=120)
        made.append(kid)
        assert kid.sandbox_id != s.sandbox_id
        assert kid.is_running(), "a sandbox restored from the snapshot answers"
        kid2 = Sandbox.create("cp-snap", timeout=120)
        made.append(kid2)
        assert kid2.is_running()

        # A snapshot outlives its source; a paused sandbox can be snapshotted too.
        s.kill()
        kid3 = Sandbox.create(snap.snapshot_id, timeout=120)
        made.append(kid3)
        assert kid3.is_running()
        kid3.pause()
        from_paused = Sandbox.create_snapshot(kid3.sandbox_id)
        assert Sandbox.get_info(kid3.sandbox_id).state == SandboxState.PAUSED
        kid4 = Sandbox.create(from_paused.snapshot_id, timeout=120)
        made.append(kid4)
        assert kid4.is_running()

        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        with pytest.raises(SandboxException):
            Sandbox.create(snap.snapshot_id, timeout=10)
        # Its sandboxes keep running.
        assert kid.is_running()
        assert Sandbox.delete_snapshot(named.snapshot_id) is True
        assert Sandbox.delete_snapshot(from_paused.snapshot_id) is True
    finally:
        for x in made:
            try:
                Sandbox.kill(x.sandbox_id)
            except Exception:
                pass


def test_snapshot_errors():
    with pytest.raises(NotFoundException):
        Sandbox.create_snapshot("doesnotexist0000000000000")
    assert Sandbox.delete_snapshot("snap-doesnotexist") is False


def test_logs_and_metrics():
    from e2b.api.client.api.sandboxes import (
        get_sandboxes_sandbox_id_logs,
        get_v_2_sandboxes_sandbox_id_logs,
    )
    from e2b.api.client.models import SandboxLogs, SandboxLogsV2Response
    from e2b.connection_config import ConnectionConfig
    from e2b.sandbox_sync.paginator import get_api_client

    s = Sandbox.create(TEMPLATE, timeout=120)
    try:
        client = get_api_client(ConnectionConfig())
        # The VM process logs its restore once its answer is out, off the create's path:
        # the line may come a moment after the create returned.
        deadline = time.monotonic() + 5
        while True:
            r = get_sandboxes_sandbox_id_logs.sync(s.sandbox_id, client=client)
            assert isinstance(r, SandboxLogs), r
            if r.logs or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert r.logs, "the VM's console and log have lines"
        assert len(r.logs) == len(r.log_entries)
        assert all(x.line for x in r.logs)
        r = get_sandboxes_sandbox_id_logs.sync(s.sandbox_id, client=client, limit=1)
        assert len(r.logs) == 1
        r2 = get_v_2_sandboxes_sandbox_id_logs.sync(s.sandbox_id, client=client)
        assert isinstance(r2, SandboxLogsV2Response), r2
        assert r2.logs
        r = get_sandboxes_sandbox_id_logs.sync_detailed("doesnotexist0000000000", client=client)
        assert r.status_code == 404

        first = s.get_metrics()
        assert len(first) >= 1
        m = first[-1]
        assert m.cpu_count == 1
        assert 0 <= m.cpu_used_pct <= 100
        assert m.mem_total == 64 * 1024 * 1024
        assert m.mem_used > 0
        time.sleep(0.3)
        # Recent, not a lifetime average: an idle guest's figure stays low.
        again = s.get_metrics()[-1]
        assert 0 <= again.cpu_used_pct <= 100
    finally:
        s.kill()


def test_a_paused_sandbox_is_paused_unless_it_auto_resumes():
    s = Sandbox.create(TEMPLATE, timeout=120, lifecycle={"on_timeout": "pause"})
    try:
        assert s.is_running() is True
        assert s.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        s.pause()
        # Not running, and asking does not wake it.
        for _ in range(3):
            assert s.is_running() is False
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
        Sandbox.connect(s.sandbox_id, timeout=60)
        assert s.is_running() is True
    finally:
        s.kill()
    a = Sandbox.create(
        TEMPLATE, timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True}
    )
    try:
        assert a.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        a.pause()
        assert Sandbox.get_info(a.sandbox_id).state == SandboxState.PAUSED
        # Any request for it wakes it first.
        assert a.is_running() is True
        assert Sandbox.get_info(a.sandbox_id).state == SandboxState.RUNNING
    finally:
        a.kill()


def test_lifecycle_combinations_e2b_refuses_are_refused():
    from e2b.api.client.api.sandboxes import post_sandboxes
    from e2b.api.client.models import NewSandbox
    from e2b.connection_config import ConnectionConfig
    from e2b.sandbox_sync.paginator import get_api_client

    client = get_api_client(ConnectionConfig())
    for extra in (
        {"autoResume": {"enabled": True}},
        {"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}},
        {"autoPause": False, "autoPauseMemory": True},
    ):
        body = NewSandbox.from_dict({"templateID": TEMPLATE, **extra})
        r = post_sandboxes.sync_detailed(client=client, body=body)
        assert r.status_code == 400, (extra, r.content)
    # The SDK refuses them itself too.
    with pytest.raises(Exception):
        Sandbox.create(TEMPLATE, lifecycle={"on_timeout": "kill", "auto_resume": True})


def test_timeout_zero_applies_the_timeout_action_now():
    p = Sandbox.create(TEMPLATE, timeout=120, lifecycle={"on_timeout": "pause"})
    k = Sandbox.create(TEMPLATE, timeout=120)
    try:
        p.set_timeout(0)
        assert Sandbox.get_info(p.sandbox_id).state == SandboxState.PAUSED
        k.set_timeout(0)
        with pytest.raises(NotFoundException):
            Sandbox.get_info(k.sandbox_id)
        assert k.is_running() is False
    finally:
        for s in (p, k):
            try:
                Sandbox.kill(s.sandbox_id)
            except Exception:
                pass


def test_filesystem_only_pause_and_reboot_on_resume():
    from e2b.api.client.api.sandboxes import get_sandboxes_sandbox_id
    from e2b.connection_config import ConnectionConfig
    from e2b.sandbox_sync.paginator import get_api_client

    client = get_api_client(ConnectionConfig())

    def pause_mode(sid):
        r = get_sandboxes_sandbox_id.sync_detailed(sid, client=client)
        return json.loads(r.content).get("pauseMode")

    s = Sandbox.create(TEMPLATE, timeout=120)
    t = Sandbox.create(
        TEMPLATE, timeout=120, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}}
    )
    try:
        # Memory dropped: not running, nothing wakes it but a connect, which boots it.
        s.pause(mode="filesystem")
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
        assert pause_mode(s.sandbox_id) == "filesystem"
        assert s.is_running() is False
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
        s2 = Sandbox.connect(s.sandbox_id)
        assert s2.is_running() is True
        # A full pause (strict: its agent answers), then a reboot on resume.
        assert s2.pause(strict=True) is True
        assert pause_mode(s.sandbox_id) == "full"
        s3 = Sandbox.connect(s.sandbox_id, on_resume="reboot")
        assert s3.is_running() is True
        # A timeout that pauses filesystem-only.
        t.set_timeout(0)
        assert Sandbox.get_info(t.sandbox_id).state == SandboxState.PAUSED
        assert pause_mode(t.sandbox_id) == "filesystem"
        assert Sandbox.connect(t.sandbox_id).is_running() is True
    finally:
        for x in (s, t):
            try:
                Sandbox.kill(x.sandbox_id)
            except Exception:
                pass


def test_lists_are_newest_first():
    older = Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": "order"})
    time.sleep(0.01)
    newer = Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": "order"})
    try:
        got = [x.sandbox_id for x in listed(SandboxQuery(metadata={"suite": "order"}))]
        assert got == [newer.sandbox_id, older.sandbox_id]
    finally:
        older.kill()
        newer.kill()


def test_metrics_are_a_time_series():
    import datetime

    from e2b.api.client.api.sandboxes import get_sandboxes_metrics
    from e2b.connection_config import ConnectionConfig
    from e2b.sandbox_sync.paginator import get_api_client

    s = Sandbox.create(TEMPLATE, timeout=120)
    other = Sandbox.create(TEMPLATE, timeout=120)
    try:
        created = datetime.datetime.now(datetime.timezone.utc)
        # The service samples every 5 s; a VM's series starts at its second round.
        deadline = time.monotonic() + 30
        while len(series := s.get_metrics()) < 3:
            assert time.monotonic() < deadline, f"no series: {series}"
            time.sleep(1)
        stamps = [m.timestamp for m in series]
        assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
        assert all(m.mem_total == 64 * 1024 * 1024 for m in series)
        # A range before the sandbox existed holds nothing.
        before = created - datetime.timedelta(hours=1)
        assert s.get_metrics(start=before - datetime.timedelta(minutes=5), end=before) == []
        # A range in its past holds only what was sampled then.
        first = series[0].timestamp
        early = s.get_metrics(start=first, end=first)
        assert early and all(abs((m.timestamp - first).total_seconds()) < 1 for m in early)
        with pytest.raises(Exception):
            s.get_metrics(start=created, end=before)
        client = get_api_client(ConnectionConfig())
        r = get_sandboxes_metrics.sync_detailed(
            client=client, sandbox_ids=[s.sandbox_id, other.sandbox_id, "doesnotexist00000000"]
        )
        assert r.status_code == 200, r.content
        many = r.parsed.sandboxes
        assert set(many) == {s.sandbox_id, other.sandbox_id}, many
        assert many[s.sandbox_id]["memTotal"] == 64 * 1024 * 1024
    finally:
        s.kill()
        other.kill()


def test_what_is_not_served_fails_as_documented():
    """docs/e2b-compat.md lists what the pinned SDK has that this host does not serve, and
    the error each gets: a 404 "no such endpoint", raised as the SDK's own exception."""
    from e2b import Secret, Volume
    from e2b.exceptions import SecretException, VolumeException

    with pytest.raises(VolumeException, match="404: no such endpoint"):
        Volume.create("v1")
    with pytest.raises(VolumeException, match="404: no such endpoint"):
        Volume.list()
    with pytest.raises(SecretException, match="404: no such endpoint"):
        Secret.list().next_items()


def api(method, path, body=None):
    """A raw request to the API (what the SDK's generated client sends)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        os.environ["E2B_API_URL"] + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"X-API-Key": os.environ["E2B_API_KEY"], "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
            return r.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_template_tags_and_settings_as_e2b_has_them():
    """E2B's tags: `name` is `name:default`; tags put on a build (by tag or by its build
    id) create sandboxes of that build; `default` cannot be removed; removing an absent
    tag is no error; a tag that is not there is a clear error. `PATCH /templates/{id}`
    records `public`, shown in the list with every tag among the names."""
    from e2b import Template
    from e2b.exceptions import TemplateException

    tags = Template.get_tags(TEMPLATE)
    assert [t.tag for t in tags] == ["default"], tags
    build_id = tags[0].build_id
    info = Template.assign_tags(f"{TEMPLATE}:default", ["v1", "stable"])
    assert (info.build_id, sorted(info.tags)) == (build_id, ["stable", "v1"])
    made = []
    try:
        for ref in (f"{TEMPLATE}:v1", f"{TEMPLATE}:{build_id}", f"{TEMPLATE}:default"):
            s = Sandbox.create(ref, timeout=60)
            made.append(s)
            assert s.get_info().template_id == TEMPLATE, ref
        with pytest.raises(SandboxException, match="not found"):
            Sandbox.create(f"{TEMPLATE}:no-such-tag", timeout=10)
        with pytest.raises(TemplateException):
            Template.assign_tags(f"{TEMPLATE}:no-such-tag", "x")
        listed_tags = {t.tag: t.build_id for t in Template.get_tags(TEMPLATE)}
        assert listed_tags == {"default": build_id, "v1": build_id, "stable": build_id}
        Template.remove_tags(TEMPLATE, ["stable", "never-assigned"])
        assert {t.tag for t in Template.get_tags(TEMPLATE)} == {"default", "v1"}
        with pytest.raises(TemplateException, match="cannot be removed"):
            Template.remove_tags(TEMPLATE, "default")
        with pytest.raises(TemplateException):
            Template.get_tags("no-such-template")
        # Template settings: public is recorded and listed; the answer names every tag.
        status, v = api("PATCH", f"/templates/{TEMPLATE}", {"public": True})
        assert status == 200 and sorted(v["names"]) == [f"{TEMPLATE}:default", f"{TEMPLATE}:v1"], v
        status, rows = api("GET", "/templates")
        row = next(r for r in rows if r["templateID"] == TEMPLATE)
        assert row["public"] is True and row["buildID"] == build_id, row
        assert f"{TEMPLATE}:v1" in row["names"], row
        status, v = api("PATCH", "/v2/templates/no-such-template", {"public": True})
        assert status == 404, v
    finally:
        for s in made:
            s.kill()
        Template.remove_tags(TEMPLATE, ["v1", "stable"])
        api("PATCH", f"/templates/{TEMPLATE}", {"public": False})
    assert [t.tag for t in Template.get_tags(TEMPLATE)] == ["default"]
