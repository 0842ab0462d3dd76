"""The e2b SDK (pinned in requirements.txt) against `clade serve`'s control plane, with
real VMs: every sandbox is a `clade restore` of a template built from the project's
native test guest (which answers the agent's Hello and Ping only, so no commands here:
the data plane is tested in test_dataplane.py). Run with tests/e2b/run_control.sh.
"""

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
