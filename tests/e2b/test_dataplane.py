"""The e2b SDK (pinned in requirements.txt) against `clade serve`'s data plane.

TEST HARNESS: the service runs with `--test-host-agent`, so each sandbox is a host-run
`clade-agent --listen-unix` (commands run on this host, in a scratch directory) instead of
a VM. What is tested is the data plane: envd's Connect protocol and /files through the
SDK, translated to the agent protocol. Run with tests/e2b/run_dataplane.sh.
"""

import hashlib
import io
import os
import time

import pytest
from e2b import CommandExitException, Sandbox
from e2b.exceptions import NotFoundException, SandboxException

# "host-agent" under the harness; tests/e2b/run_nested.sh runs this file against Linux
# sandboxes too (template "debian", scratch inside the guest).
TEMPLATE = os.environ.get("CLADE_DP_TEMPLATE", "host-agent")
SCRATCH = os.environ.get("CLADE_DP_SCRATCH", "/tmp/clade-dp-scratch")


@pytest.fixture(scope="module")
def sb():
    # Auto-resume: a request wakes it from a pause (test_exposed_port_reached_...).
    s = Sandbox.create(
        TEMPLATE, timeout=600, lifecycle={"on_timeout": "pause", "auto_resume": True}
    )
    yield s
    try:
        s.kill()
    except Exception:
        pass


@pytest.fixture
def d(sb, request):
    path = f"{SCRATCH}/{request.node.name}"
    sb.commands.run(f"rm -rf {path} && mkdir -p {path}")
    return path


def test_run_stdout_stderr_exit_code(sb):
    r = sb.commands.run("echo hi; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "err\n", 0)
    with pytest.raises(CommandExitException) as e:
        sb.commands.run("echo out; echo bad >&2; exit 3")
    assert e.value.exit_code == 3
    assert e.value.stdout == "out\n" and e.value.stderr == "bad\n"


def test_envs_cwd_and_sandbox_env(sb, d):
    r = sb.commands.run("echo $FOO; pwd", envs={"FOO": "bar baz"}, cwd=d)
    assert r.stdout == f"bar baz\n{d}\n"
    # E2B's own variables: in a sandbox, which one, of which template; a command's own
    # value wins.
    r = sb.commands.run('echo "$E2B_SANDBOX $E2B_SANDBOX_ID $E2B_TEMPLATE_ID"')
    assert r.stdout == f"true {sb.sandbox_id} {TEMPLATE}\n", r
    r = sb.commands.run("echo $E2B_SANDBOX", envs={"E2B_SANDBOX": "mine"})
    assert r.stdout == "mine\n"


def test_streaming_callbacks_and_large_output(sb):
    chunks = []
    r = sb.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.1; done", on_stdout=chunks.append
    )
    assert "".join(chunks) == "line1\nline2\nline3\n" == r.stdout
    big = sb.commands.run("head -c 3000000 /dev/zero | tr '\\0' a")
    assert len(big.stdout) == 3_000_000


def test_stdin_send_and_close(sb):
    h = sb.commands.run("cat", background=True, stdin=True)
    h.send_stdin("hello ")
    h.send_stdin(b"world")
    h.close_stdin()
    r = h.wait()
    assert r.stdout == "hello world"


def wait_for_file(sb, path, seconds=30):
    """Waits until a command has got past its login shell's startup (it wrote `path`):
    a login shell killed or frozen during startup can leave pyenv's rehash lock behind on
    this host (the harness runs commands on the host), stalling later login shells."""
    deadline = time.time() + seconds
    while not sb.files.exists(path):
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_background_list_connect_kill(sb, d):
    h = sb.commands.run(f"touch {d}/up; echo started; sleep 30", background=True)
    wait_for_file(sb, f"{d}/up")
    pids = [p.pid for p in sb.commands.list()]
    assert h.pid in pids
    info = [p for p in sb.commands.list() if p.pid == h.pid][0]
    assert info.cmd == "/bin/bash" and info.args[-1] == f"touch {d}/up; echo started; sleep 30"
    h.disconnect()
    # The process outlives the stream that started it; reconnect by pid.
    h2 = sb.commands.connect(h.pid)
    assert sb.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as e:
        h2.wait()
    assert e.value.exit_code == -1 and "killed" in (e.value.error or "")
    # Gone from the table; killing again reports False.
    deadline = time.time() + 5
    while h.pid in [p.pid for p in sb.commands.list()] and time.time() < deadline:
        time.sleep(0.05)
    assert h.pid not in [p.pid for p in sb.commands.list()]
    assert sb.commands.kill(h.pid) is False


def test_connect_unknown_pid(sb):
    with pytest.raises(SandboxException):
        sb.commands.connect(999999)


def test_files_round_trip_10mib(sb, d):
    data = os.urandom(10 << 20)
    want = hashlib.sha256(data).hexdigest()
    sb.files.write(f"{d}/big.bin", data)  # multipart
    got = sb.files.read(f"{d}/big.bin", format="bytes")
    assert hashlib.sha256(got).hexdigest() == want
    sb.files.write(f"{d}/big2.bin", io.BytesIO(data))  # octet-stream, streamed
    r = sb.commands.run(f"sha256sum {d}/big2.bin")
    assert r.stdout.split()[0] == want
    sb.files.write(f"{d}/gz.txt", "compressed " * 1000, gzip=True)
    assert sb.files.read(f"{d}/gz.txt") == "compressed " * 1000
    stream = sb.files.read(f"{d}/big.bin", format="stream")
    h = hashlib.sha256()
    for chunk in stream:
        h.update(chunk)
    assert h.hexdigest() == want


def test_write_files_many_and_parents(sb, d):
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    infos = sb.files.write_files(
        [WriteEntry(path=f"{d}/x/1.txt", data="one"), WriteEntry(path=f"{d}/y/z/2.txt", data=b"two")]
    )
    assert sorted(i.path for i in infos) == [f"{d}/x/1.txt", f"{d}/y/z/2.txt"]
    assert sb.files.read(f"{d}/y/z/2.txt") == "two"


def test_list_stat_mkdir_rename_remove(sb, d):
    assert sb.files.make_dir(f"{d}/sub/deeper") is True
    assert sb.files.make_dir(f"{d}/sub/deeper") is False
    sb.files.write(f"{d}/sub/f.txt", "12345")
    names = sorted(e.name for e in sb.files.list(d))
    assert names == ["sub"]
    deep = sorted(e.path for e in sb.files.list(d, depth=3))
    assert deep == [f"{d}/sub", f"{d}/sub/deeper", f"{d}/sub/f.txt"]
    info = sb.files.get_info(f"{d}/sub/f.txt")
    assert info.size == 5 and info.type.value == "file" and info.permissions == "-rw-r--r--"
    assert info.mode == 0o644
    sb.commands.run(f"chmod 755 {d}/sub")
    sub = sb.files.get_info(f"{d}/sub")
    assert sub.type.value == "dir" and sub.mode == 493, "permission bits, as E2B"
    moved = sb.files.rename(f"{d}/sub/f.txt", f"{d}/g.txt")
    assert moved.path == f"{d}/g.txt"
    assert sb.files.exists(f"{d}/g.txt") and not sb.files.exists(f"{d}/sub/f.txt")
    sb.files.remove(f"{d}/sub")
    assert not sb.files.exists(f"{d}/sub")
    # Removing what is not there is not an error (envd's RemoveAll).
    sb.files.remove(f"{d}/sub")
    sb.files.remove(f"{d}/never/was")


def test_missing_paths(sb, d):
    with pytest.raises(NotFoundException):
        sb.files.read(f"{d}/nope")
    with pytest.raises(NotFoundException):
        sb.files.get_info(f"{d}/nope")
    with pytest.raises(NotFoundException):
        sb.files.list(f"{d}/nope")
    with pytest.raises(NotFoundException):
        sb.files.rename(f"{d}/nope", f"{d}/other")


def test_pause_then_auto_resume():
    s = Sandbox.create(
        TEMPLATE, timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True}
    )
    try:
        s.commands.run(f"mkdir -p {SCRATCH} && echo kept > {SCRATCH}/pause.txt")
        s.pause()
        # A data-plane request for a paused sandbox with auto-resume resumes it first.
        assert s.commands.run(f"cat {SCRATCH}/pause.txt").stdout == "kept\n"
        assert s.get_info().state.value == "running"
    finally:
        s.kill()


def test_a_paused_sandbox_is_not_running():
    s = Sandbox.create(TEMPLATE, timeout=120)
    try:
        s.commands.run(f"mkdir -p {SCRATCH} && echo kept > {SCRATCH}/paused.txt")
        s.pause()
        assert s.is_running() is False
        with pytest.raises(SandboxException) as e:
            s.commands.run("true")
        assert "not running" in str(e.value) or "was not found" in str(e.value), e.value
        with pytest.raises(SandboxException):
            s.files.read(f"{SCRATCH}/paused.txt")
        # Its exposed ports too.
        import httpx

        port = httpx.get(
            os.environ["E2B_SANDBOX_URL"], headers={"Host": s.get_host(8000)}, timeout=10
        )
        assert port.status_code == 502 and "was not found" in port.json()["message"]
        assert s.get_info().state.value == "paused", "a request woke it"
        s2 = Sandbox.connect(s.sandbox_id, timeout=120)
        assert s2.files.read(f"{SCRATCH}/paused.txt") == "kept\n"
    finally:
        s.kill()


def test_killed_sandbox_is_not_running():
    s = Sandbox.create(TEMPLATE, timeout=120)
    s.kill()
    assert s.is_running() is False
    with pytest.raises(SandboxException):
        s.commands.run("true")
    with pytest.raises(SandboxException):
        s.files.write(f"{SCRATCH}/never.bin", os.urandom(1 << 20))


def test_pty_bash_with_resize(sb):
    from e2b.sandbox.commands.command_handle import PtySize

    out = bytearray()
    h = sb.pty.create(PtySize(rows=24, cols=80))
    sb.pty.resize(h.pid, PtySize(rows=40, cols=132))
    sb.pty.send_stdin(h.pid, b"stty size; echo pty-$((6*7)); exit 5\n")
    with pytest.raises(CommandExitException) as e:
        h.wait(on_pty=out.extend)
    assert e.value.exit_code == 5
    text = out.decode(errors="replace")
    assert "40 132" in text and "pty-42" in text, text


def test_background_process_survives_pause_and_resume():
    s = Sandbox.create(TEMPLATE, timeout=300)
    try:
        script = "i=0; while :; do i=$((i+1)); echo tick-$i; sleep 0.1; done"
        # timeout=0: a background command's own timeout would kill it (as in E2B).
        s.commands.run(f"mkdir -p {SCRATCH}")
        up = f"{SCRATCH}/pause-counter-up"
        s.files.remove(up) if s.files.exists(up) else None
        h = s.commands.run(f"touch {up}; {script}", background=True, timeout=0)
        wait_for_file(s, up)
        time.sleep(0.3)
        s.pause()
        s2 = Sandbox.connect(s.sandbox_id)
        assert s2.get_info().state.value == "running"
        procs = {p.pid: p for p in s2.commands.list()}
        assert h.pid in procs, procs
        assert procs[h.pid].args[-1] == f"touch {up}; {script}"
        # Re-attach: output produced from now on, counting on.
        h2 = s2.commands.connect(h.pid)
        got = []
        for stdout, _, _ in h2:
            if stdout:
                got.append(stdout)
                if "\n" in "".join(got):
                    break
        first = "".join(got).split("\n")[0]
        assert first.startswith("tick-") and int(first[5:]) > 1, got
        assert s2.commands.kill(h.pid) is True
        with pytest.raises(CommandExitException) as e:
            h2.wait()
        assert e.value.exit_code == -1 and "killed" in (e.value.error or "")
        assert h.pid not in [p.pid for p in s2.commands.list()]
    finally:
        s.kill()


def test_command_timeout_kills_the_process(sb, d):
    from e2b.exceptions import TimeoutException

    marker = f"{d}/pid"
    # Long enough for the login shell's startup (see wait_for_file).
    with pytest.raises(TimeoutException):
        sb.commands.run(f"echo $$ > {marker}; exec sleep 60", timeout=5)
    pid = int(sb.files.read(marker).strip())
    deadline = time.time() + 5
    while pid in [p.pid for p in sb.commands.list()] and time.time() < deadline:
        time.sleep(0.05)
    assert pid not in [p.pid for p in sb.commands.list()]
    # Really gone, not just off the list.
    with pytest.raises(CommandExitException):
        sb.commands.run(f"kill -0 {pid}")


def _wait_events(h, want, timeout=10):
    """Polls a watch handle until every (name, type) in `want` was seen."""
    got = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        got += [(e.name, e.type.value) for e in h.get_new_events()]
        if all(w in got for w in want):
            return got
        time.sleep(0.1)
    raise AssertionError(f"wanted {want}, got {got}")


def test_watch_dir_create_write_rename_remove(sb, d):
    h = sb.files.watch_dir(d)
    sb.commands.run(f"echo hello > {d}/a.txt")
    got = _wait_events(h, [("a.txt", "create"), ("a.txt", "write")])
    assert got.index(("a.txt", "create")) < got.index(("a.txt", "write"))
    sb.commands.run(f"mv {d}/a.txt {d}/b.txt && rm {d}/b.txt")
    _wait_events(h, [("a.txt", "rename"), ("b.txt", "create"), ("b.txt", "remove")])
    sb.commands.run(f"touch {d}/c && chmod 600 {d}/c")
    _wait_events(h, [("c", "chmod")])
    h.stop()
    with pytest.raises(SandboxException):
        h.get_new_events()


def test_watch_dir_recursive_sees_subdirectories(sb, d):
    sb.commands.run(f"mkdir -p {d}/sub")
    flat = sb.files.watch_dir(d)
    h = sb.files.watch_dir(d, recursive=True)
    sb.commands.run(
        f"echo x > {d}/sub/f.txt && mkdir -p {d}/new/deep && echo y > {d}/new/deep/g.txt"
    )
    _wait_events(h, [("sub/f.txt", "create"), ("new", "create"), ("new/deep/g.txt", "create")])
    names = [e.name for e in flat.get_new_events()]
    assert "new" in names and not any("/" in n for n in names), names
    h.stop()
    flat.stop()


def test_watch_dir_missing_path_and_file(sb, d):
    with pytest.raises(NotFoundException):
        sb.files.watch_dir(f"{d}/nope")
    sb.files.write(f"{d}/file", "x")
    with pytest.raises(SandboxException):
        sb.files.watch_dir(f"{d}/file")


def test_async_watch_dir_streams_events(sb, d):
    import asyncio

    from e2b import AsyncSandbox
    from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

    async def main():
        s = await AsyncSandbox.connect(sb.sandbox_id)
        events = []
        seen = asyncio.Event()

        def on_event(e):
            events.append((e.name, e.type))
            # Its write may come before the new directory is watched: the create is
            # reported either way.
            if (e.name, e.type) == ("s/deep.txt", FilesystemEventType.CREATE):
                seen.set()

        h = await s.files.watch_dir(d, on_event=on_event, recursive=True)
        await s.commands.run(f"mkdir {d}/s && echo hi > {d}/s/deep.txt")
        await asyncio.wait_for(seen.wait(), 10)
        await h.stop()
        with pytest.raises(SandboxException):
            await s.files.watch_dir(f"{d}/nope", on_event=on_event)
        return events

    events = asyncio.run(main())
    assert ("s", FilesystemEventType.CREATE) in events


def test_read_gzip_response(sb, d):
    text = "compressible " * 10000
    sb.files.write(f"{d}/t.txt", text)
    assert sb.files.read(f"{d}/t.txt", gzip=True) == text
    assert sb.files.read(f"{d}/t.txt", format="bytes", gzip=True) == text.encode()


def test_stream_input_in_order_then_close(sb):
    h = sb.commands.run("cat", background=True, stdin=True, timeout=0)
    sb.commands.stream_input(h.pid, ["hello ", b"streamed ", "world " * 1000])
    sb.commands.stream_input(h.pid, (f"{i}," for i in range(100)))
    sb.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "hello streamed " + "world " * 1000 + "".join(f"{i}," for i in range(100))
    with pytest.raises(NotFoundException):
        sb.commands.stream_input(999999, ["x"])


def test_symlink_info_has_its_target(sb, d):
    sb.commands.run(f"echo hi > {d}/real.txt && ln -s real.txt {d}/rel && ln -s {d}/real.txt {d}/abs")
    for name in ("rel", "abs"):
        info = sb.files.get_info(f"{d}/{name}")
        assert info.symlink_target == f"{d}/real.txt", info
        assert info.type.value == "symlink"
    listed = {e.name: e.symlink_target for e in sb.files.list(d)}
    assert listed == {"real.txt": None, "rel": f"{d}/real.txt", "abs": f"{d}/real.txt"}


@pytest.mark.skipif(os.geteuid() != 0, reason="the harness's agent must be root to act as another user")
def test_files_as_another_user_are_theirs_and_checked(sb, d):
    sb.commands.run(f"chmod 777 {d} && echo secret > {d}/root-only && chmod 600 {d}/root-only")
    info = sb.files.write(f"{d}/mine.txt", "by nobody", user="nobody")
    assert info.path == f"{d}/mine.txt"
    assert sb.files.get_info(f"{d}/mine.txt", user="nobody").owner == "nobody"
    assert sb.files.make_dir(f"{d}/nobodys", user="nobody") is True
    assert sb.files.get_info(f"{d}/nobodys").owner == "nobody"
    assert sb.files.read(f"{d}/mine.txt", user="nobody") == "by nobody"
    with pytest.raises(SandboxException) as e:
        sb.files.read(f"{d}/root-only", user="nobody")
    assert "ermission" in str(e.value), e.value
    with pytest.raises(SandboxException):
        sb.files.write(f"{d}/root-only", "overwrite", user="nobody")
    assert sb.files.read(f"{d}/root-only") == "secret\n"


def test_exposed_port_reached_through_the_service(sb, d):
    """A server a sandbox process listens on is reached through the service: by the
    `<port>-<id>.<domain>` host name `get_host` gives, and by the routing headers; a port
    nobody listens on is E2B's 502; a paused sandbox wakes for such a request."""
    import httpx

    base = os.environ["E2B_SANDBOX_URL"]
    # The harness's "guest" is this host: a port of its own, not a fixed one.
    port = 20000 + os.getpid() % 20000
    sb.files.write(f"{d}/www/hello.txt", "hello from the sandbox\n")
    h = sb.commands.run(
        f"cd {d}/www && exec python3 -m http.server {port}", background=True
    )
    try:
        host = sb.get_host(port)
        assert host.startswith(f"{port}-{sb.sandbox_id}.")
        deadline = time.time() + 30
        while True:
            r = httpx.get(f"{base}/hello.txt", headers={"Host": host}, timeout=10)
            if r.status_code == 200 or time.time() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        assert r.text == "hello from the sandbox\n"
        by_headers = httpx.get(
            f"{base}/hello.txt?x=1",
            headers={"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": str(port)},
            timeout=10,
        )
        assert by_headers.status_code == 200 and by_headers.text == r.text
        missing = httpx.get(f"{base}/nope", headers={"Host": host}, timeout=10)
        assert missing.status_code == 404
        closed = httpx.get(
            f"{base}/", headers={"Host": sb.get_host(port + 1)}, timeout=10
        )
        assert closed.status_code == 502, closed.text
        assert f"port {port + 1} is not open" in closed.json()["message"]
        unknown = httpx.get(
            f"{base}/", headers={"Host": f"{port}-nosuchsandbox.example.org"}, timeout=10
        )
        assert unknown.status_code == 502
        # Wake on request (the sandbox has auto-resume): the server is part of the paused
        # sandbox, and comes back with it.
        sb.pause()
        woken = httpx.get(f"{base}/hello.txt", headers={"Host": host}, timeout=60)
        assert woken.status_code == 200 and woken.text == r.text, (woken.status_code, woken.text)
        assert sb.get_info().state.value == "running"
    finally:
        h.kill()


def test_a_command_streaming_when_its_sandbox_is_killed_ends_as_killed():
    import threading

    from e2b.exceptions import SandboxNotRunningException

    s = Sandbox.create(TEMPLATE, timeout=120)
    try:
        h = s.commands.run("echo started; sleep 60", background=True)
        killer = threading.Timer(1.0, lambda: Sandbox.kill(s.sandbox_id))
        killer.start()
        with pytest.raises(SandboxNotRunningException) as e:
            h.wait()
        killer.join()
        assert "killed or reached its end of life" in str(e.value), e.value
    finally:
        try:
            s.kill()
        except Exception:
            pass


def test_secured_sandbox_tokens_and_signed_urls(sb, d):
    import httpx

    base = os.environ["E2B_SANDBOX_URL"]
    token = sb._envd_access_token
    assert token, "every sandbox is secured, as E2B's"
    route = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "49983"}
    json_body = {"path": d}
    for headers, want in (
        ({}, 401),
        ({"X-Access-Token": "not-the-token"}, 401),
        ({"X-Access-Token": token}, 200),
    ):
        r = httpx.post(
            f"{base}/filesystem.Filesystem/Stat",
            json=json_body,
            headers={**route, "Content-Type": "application/json", **headers},
            timeout=30,
        )
        assert r.status_code == want, (headers, r.text)
    # The health probe needs no token.
    assert httpx.get(f"{base}/health", headers=route, timeout=30).status_code == 204

    # Signed URLs work without the token, for what they were signed for.
    up = sb.upload_url(f"{d}/signed.txt")
    assert "signature=" in up
    r = httpx.post(up, files={"file": ("signed.txt", b"signed upload\n")}, headers=route, timeout=30)
    assert r.status_code == 200, r.text
    down = sb.download_url(f"{d}/signed.txt", use_signature_expiration=120)
    r = httpx.get(down, headers=route, timeout=30)
    assert (r.status_code, r.text) == (200, "signed upload\n")
    expired = sb.download_url(f"{d}/signed.txt", use_signature_expiration=-10)
    assert httpx.get(expired, headers=route, timeout=30).status_code == 401
    altered = down.replace("signed.txt", "other.txt")
    assert httpx.get(altered, headers=route, timeout=30).status_code == 401
    longer = down.replace("signature_expiration=", "signature_expiration=9")
    assert httpx.get(longer, headers=route, timeout=30).status_code == 401
    # A URL signed with another sandbox's token is refused.
    other = Sandbox.create(TEMPLATE, timeout=60)
    try:
        foreign = other.download_url(f"{d}/signed.txt")
        assert httpx.get(foreign, headers=route, timeout=30).status_code == 401
    finally:
        other.kill()


def test_private_traffic_needs_the_traffic_token_and_a_mask_sets_the_host(d):
    import httpx

    base = os.environ["E2B_SANDBOX_URL"]
    s = Sandbox.create(
        TEMPLATE,
        timeout=120,
        network={"allow_public_traffic": False, "mask_request_host": "${PORT}-masked.example.org"},
    )
    port = 20000 + (os.getpid() + 7) % 20000
    server = (
        "import http.server\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        b = self.headers.get('Host', '').encode()\n"
        "        self.send_response(200); self.send_header('Content-Length', str(len(b))); self.end_headers(); self.wfile.write(b)\n"
        f"http.server.HTTPServer(('0.0.0.0', {port}), H).serve_forever()\n"
    )
    try:
        token = s.traffic_access_token
        assert token
        s.files.write(f"{d}/host_echo.py", server)
        h = s.commands.run(f"exec python3 {d}/host_echo.py", background=True)
        host = s.get_host(port)
        r = httpx.get(f"{base}/", headers={"Host": host}, timeout=10)
        assert r.status_code == 403, r.text
        assert "e2b-traffic-access-token" in r.json()["message"]
        bad = httpx.get(f"{base}/", headers={"Host": host, "e2b-traffic-access-token": "x"}, timeout=10)
        assert bad.status_code == 403
        deadline = time.time() + 30
        while True:
            r = httpx.get(f"{base}/", headers={"Host": host, "e2b-traffic-access-token": token}, timeout=10)
            if r.status_code == 200 or time.time() > deadline:
                break
            time.sleep(0.2)
        assert (r.status_code, r.text) == (200, f"{port}-masked.example.org")
        h.kill()
    finally:
        s.kill()


def test_file_metadata_is_kept_as_envd_keeps_it(sb, d):
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    # A filesystem with user extended attributes: the guest's /tmp is a tmpfs, which has
    # none before Linux 6.6 (run_nested.sh names a directory on the guest's disk).
    if os.environ.get("CLADE_DP_XATTR_SCRATCH"):
        d = os.environ["CLADE_DP_XATTR_SCRATCH"]
        sb.commands.run(f"rm -rf {d} && mkdir -p {d}")

    w = sb.files.write(f"{d}/m.txt", "with metadata\n", metadata={"Owner": "ann", "stage": "1"})
    assert w.metadata == {"owner": "ann", "stage": "1"}, "keys lowercased"
    assert sb.files.get_info(f"{d}/m.txt").metadata == {"owner": "ann", "stage": "1"}
    # Several files at once: the same map on each.
    many = sb.files.write_files(
        [WriteEntry(path=f"{d}/x.txt", data="x"), WriteEntry(path=f"{d}/y.txt", data="y")],
        metadata={"batch": "7"},
    )
    assert [m.metadata for m in many] == [{"batch": "7"}, {"batch": "7"}]
    listed = {e.name: e.metadata for e in sb.files.list(d)}
    assert listed["x.txt"] == {"batch": "7"} and listed["m.txt"] == {"owner": "ann", "stage": "1"}
    # It moves with the file.
    moved = sb.files.rename(f"{d}/m.txt", f"{d}/n.txt")
    assert moved.metadata == {"owner": "ann", "stage": "1"}
    # Overwritten without it: cleared.
    sb.files.write(f"{d}/n.txt", "no metadata now\n")
    assert not sb.files.get_info(f"{d}/n.txt").metadata
    # Set by a program through the same extended attributes envd uses.
    sb.commands.run(
        f"python3 -c \"import os; os.setxattr('{d}/x.txt', 'user.e2b.by', b'program')\""
    )
    assert sb.files.get_info(f"{d}/x.txt").metadata == {"batch": "7", "by": "program"}
    # Other user attributes are not metadata.
    sb.commands.run(
        f"python3 -c \"import os; os.setxattr('{d}/y.txt', 'user.other', b'z')\""
    )
    assert sb.files.get_info(f"{d}/y.txt").metadata == {"batch": "7"}


def test_watch_events_carry_entries_when_asked(sb, d):
    h = sb.files.watch_dir(d, include_entry=True)
    sb.files.write(f"{d}/e.txt", "entry\n")
    sb.commands.run(f"rm {d}/e.txt")
    deadline = time.time() + 20
    events = []
    while time.time() < deadline and not any(e.type.value == "remove" for e in events):
        events.extend(h.get_new_events())
        time.sleep(0.1)
    h.stop()
    created = [e for e in events if e.name == "e.txt" and e.type.value == "create"]
    assert created, events
    removed = [e for e in events if e.type.value == "remove"]
    assert removed and removed[0].entry is None
    with_entry = [e for e in events if e.entry is not None]
    assert with_entry, events
    assert all(e.entry.name == "e.txt" and e.entry.path == f"{d}/e.txt" for e in with_entry)


@pytest.mark.skipif(
    "CLADE_TLS_DOMAIN" not in os.environ,
    reason="needs the HTTPS service tests/e2b/run_dataplane.sh starts (always there)",
)
def test_https_domain_and_get_host(d):
    """`clade serve --domain D --tls-cert --tls-key`: the API, the data plane and exposed
    ports over HTTPS on `<port>-<id>.D` names (resolved here to this host, as a wildcard
    DNS record would), with a certificate the test's own CA signed."""
    import socket
    import ssl

    import httpx

    domain = os.environ["CLADE_TLS_DOMAIN"]
    tls_port = int(os.environ["CLADE_TLS_PORT"])
    ca = ssl.create_default_context(cafile=os.environ["CLADE_TLS_CA"])
    real = socket.getaddrinfo

    def resolve(host, *a, **kw):
        if isinstance(host, str) and (host == domain or host.endswith("." + domain)):
            host = "127.0.0.1"
        return real(host, *a, **kw)

    socket.getaddrinfo = resolve
    try:
        # The SDK's clients resolve names with a DNS client of their own: they reach the
        # API by address (the certificate names 127.0.0.1 too); names under the domain are
        # fetched below with httpx, which resolves through `resolve`.
        api = f"https://127.0.0.1:{tls_port}"
        s = Sandbox.create(TEMPLATE, timeout=120, api_url=api, sandbox_url=api)
        try:
            assert s.sandbox_domain == domain
            assert s.commands.run("echo over-tls").stdout == "over-tls\n"
            port = 20000 + (os.getpid() + 13) % 20000
            s.files.write(f"{d}/tls/hello.txt", "hello over https\n")
            h = s.commands.run(f"cd {d}/tls && exec python3 -m http.server {port}", background=True)
            host = s.get_host(port)
            assert host == f"{port}-{s.sandbox_id}.{domain}"
            deadline = time.time() + 30
            while True:
                r = httpx.get(f"https://{host}:{tls_port}/hello.txt", verify=ca, timeout=10)
                if r.status_code == 200 or time.time() > deadline:
                    break
                time.sleep(0.2)
            assert (r.status_code, r.text) == (200, "hello over https\n")
            # The certificate is checked for real: a name it does not cover fails.
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"https://localhost:{tls_port}/hello.txt", verify=ca, timeout=10)
            h.kill()
        finally:
            s.kill()
    finally:
        socket.getaddrinfo = real
