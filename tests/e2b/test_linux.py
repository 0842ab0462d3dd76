"""The e2b SDK (pinned in requirements.txt) against `clade serve` with LINUX sandboxes.

The service runs inside the nested tier (tests/nested/scenarios/sdk.sh: Debian's kernel
and root disk under nested KVM in a QEMU-TCG machine); its port is forwarded to this host,
so the SDK talks to it unchanged. Template "debian" was built there with one setup command
(/root/template.txt). Run with tests/e2b/run_nested.sh, which starts both halves.

Everything runs 10-50x slower than on hardware under TCG: timeouts here are generous and
no latency is asserted (figures come from the native tier).
"""

import hashlib
import os
import socket
import subprocess
import threading
import time

import pytest
from e2b import CommandExitException, Sandbox
from e2b.api.client.models.sandbox_state import SandboxState
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException

TEMPLATE = "debian"
# Generous: every request may resume or restore a VM under emulation.
SLOW = {"request_timeout": 300}
CTL = os.environ.get("CLADE_NESTED_CTL", "127.0.0.1:39482")
# The nested machine's console log (its markers tell when a service restart is done).
NESTED_LOG = os.environ.get("CLADE_NESTED_LOG", "build/nested/nested.log")
# Set by run_nested.sh for its second pass: the service is a two-node cluster entered
# through its gateway node (which runs no sandboxes).
CLUSTER = os.environ.get("CLADE_NESTED_CLUSTER") == "1"
# The cluster's registry, as this host reaches it.
PG_URL = os.environ.get("CLADE_NESTED_PG_URL", "")


def create(**kw):
    kw.setdefault("timeout", 1800)
    return Sandbox.create(TEMPLATE, **kw, **SLOW)


def run(sb, cmd, **kw):
    kw.setdefault("timeout", 240)
    return sb.commands.run(cmd, request_timeout=300, **kw)


def control(line):
    """A one-line command to the scenario in the nested machine (restart, done ...)."""
    host, port = CTL.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(line.encode() + b"\n")


def console_count(marker):
    with open(NESTED_LOG, "rb") as f:
        return f.read().count(marker.encode())


def obey(line, answer, within, what):
    """Sends a control command and waits until the console shows `answer` once more."""
    before = console_count(answer)
    control(line)
    deadline = time.monotonic() + within
    while console_count(answer) == before:
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def restart_service():
    """Restarts `clade serve` in the nested machine and waits for the new one."""
    obey("restart", "SDK-SERVE-RESTARTED", 240, "the service did not come back")


def remove_template(name):
    """Removes template `name` and the build cache (the nested machine's /tmp is memory);
    no process may hold its files open after (a standby that opened it ahead is retired)."""
    obey(f"rm-template {name}", f"SDK-TEMPLATE-REMOVED {name} ", 120, "no answer to rm-template")
    with open(NESTED_LOG, "rb") as f:
        lines = f.read().decode(errors="replace").splitlines()
    end = max(i for i, ln in enumerate(lines) if f"SDK-TEMPLATE-REMOVED {name} " in ln)
    assert f"SDK-TEMPLATE-REMOVED {name} rc=0 held=0" in lines[end], "\n".join(lines[max(0, end - 8) : end + 1])


@pytest.fixture(scope="module")
def sb():
    s = create(metadata={"suite": "linux"}, envs={"GREETING": "hello from create"})
    yield s
    try:
        s.kill()
    except Exception:
        pass


@pytest.mark.skipif(not CLUSTER, reason="the cluster pass only")
def test_the_cluster_runs_it_on_n1_and_the_way_in_owns_nothing(sb):
    """The suite enters through node gw, which runs no sandboxes: its sandboxes are n1's
    (the registry says so), and every request of this suite crossed a hop."""

    def psql(sql):
        r = subprocess.run(["psql", "-qAtX", PG_URL, "-c", sql], check=True, capture_output=True, text=True)
        return [line.split("|") for line in r.stdout.splitlines() if line]

    assert psql(f"SELECT node, state FROM clade_sandboxes WHERE id = '{sb.sandbox_id}'") == [["n1", "running"]]
    nodes = dict(psql("SELECT name, takes_sandboxes FROM clade_nodes"))
    assert nodes == {"n1": "t", "gw": "f"}, nodes
    assert psql("SELECT count(*) FROM clade_sandboxes WHERE node = 'gw'") == [["0"]]
    assert run(sb, "echo through-the-gateway").stdout == "through-the-gateway\n"


def test_commands_python_envs_and_exit_codes(sb):
    r = run(sb, "python3 -c 'import os; print(os.environ[\"GREETING\"], 6 * 7)'")
    assert r.stdout == "hello from create 42\n"
    assert run(sb, "cat /root/template.txt").stdout == "made-by-the-template\n"
    r = run(sb, "echo $X; pwd; id -u", envs={"X": "per-command"}, cwd="/tmp")
    assert r.stdout == "per-command\n/tmp\n0\n"
    with pytest.raises(CommandExitException) as e:
        run(sb, "echo out; echo bad >&2; exit 3")
    assert (e.value.exit_code, e.value.stdout, e.value.stderr) == (3, "out\n", "bad\n")
    assert run(sb, "grep -c . /proc/cpuinfo").exit_code == 0


def test_files_10mib_round_trip_with_checksums(sb):
    data = os.urandom(10 << 20)
    want = hashlib.sha256(data).hexdigest()
    sb.files.write("/root/big.bin", data, request_timeout=300)
    assert run(sb, "sha256sum /root/big.bin").stdout.split()[0] == want
    run(sb, "head -c 10485760 /dev/urandom > /root/from-guest.bin")
    theirs = run(sb, "sha256sum /root/from-guest.bin").stdout.split()[0]
    got = sb.files.read("/root/from-guest.bin", format="bytes", request_timeout=300)
    assert len(got) == 10 << 20 and hashlib.sha256(got).hexdigest() == theirs
    names = {e.name for e in sb.files.list("/root")}
    assert {"big.bin", "from-guest.bin", "template.txt"} <= names
    info = sb.files.get_info("/root/big.bin")
    assert info.size == 10 << 20 and info.type.value == "file"
    with pytest.raises(NotFoundException):
        sb.files.read("/root/nope")


def test_stdin_send_stream_and_close(sb):
    h = sb.commands.run("sha256sum", background=True, stdin=True, timeout=0, request_timeout=300)
    h.send_stdin("first ")
    sb.commands.stream_input(h.pid, ["second ", b"third"], timeout=120)
    h.close_stdin()
    r = h.wait()
    assert r.stdout.split()[0] == hashlib.sha256(b"first second third").hexdigest()


def test_pty_bash_with_resize(sb):
    from e2b.sandbox.commands.command_handle import PtySize

    out = bytearray()
    h = sb.pty.create(PtySize(rows=24, cols=80), request_timeout=300)
    sb.pty.resize(h.pid, PtySize(rows=40, cols=132))
    sb.pty.send_stdin(h.pid, b"stty size; echo pty-$((6*7)) $BASH_VERSION; exit 5\n")
    with pytest.raises(CommandExitException) as e:
        h.wait(on_pty=out.extend)
    assert e.value.exit_code == 5
    text = out.decode(errors="replace")
    assert "40 132" in text and "pty-42 5." in text, text


def test_pause_connect_keeps_files_and_a_running_process():
    s = create(metadata={"suite": "linux-pause"})
    try:
        run(s, "echo kept-across-pause > /root/pause.txt")
        # The count is replaced whole (a rename): `>` alone truncates before it writes, and
        # a read in between (or a pause) would see an empty file.
        h = s.commands.run(
            "i=0; while :; do i=$((i+1)); echo $i > /root/count.new; mv /root/count.new /root/count; echo tick$i; sleep 0.2; done",
            background=True,
            timeout=0,  # no command timeout: it runs until killed
            request_timeout=300,
        )
        time.sleep(2)
        before = int(run(s, "cat /root/count").stdout)
        s.pause(**SLOW)
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
        s2 = Sandbox.connect(s.sandbox_id, timeout=1800, **SLOW)
        assert run(s2, "cat /root/pause.txt").stdout == "kept-across-pause\n"
        # The background process was in the snapshot: it runs on and counts further.
        assert h.pid in [p.pid for p in s2.commands.list(request_timeout=300)]
        deadline = time.monotonic() + 60
        while int(run(s2, "cat /root/count").stdout) <= before:
            assert time.monotonic() < deadline, "the counter stopped across pause"
            time.sleep(0.5)
        # Re-attach to it after the resume: later output arrives.
        seen = []
        h2 = s2.commands.connect(h.pid, request_timeout=300)
        deadline = time.monotonic() + 60
        for out, _err, _pty in h2:
            if out:
                seen.append(out)
            if "tick" in "".join(seen) or time.monotonic() > deadline:
                break
        assert "tick" in "".join(seen)
        assert s2.commands.kill(h.pid, request_timeout=300) is True
    finally:
        Sandbox.kill(s.sandbox_id)


def test_fork_into_three_isolated_children(sb):
    run(sb, "echo before-fork > /root/fork.txt && sync")
    kids = sb.fork(count=3, timeout=1800, **SLOW)
    try:
        assert len(kids) == 3 and all(not isinstance(k, Exception) for k in kids), kids
        for i, k in enumerate(kids):
            assert run(k, "cat /root/fork.txt").stdout == "before-fork\n"
            run(k, f"echo child-{i} > /root/who.txt")
        run(sb, "echo parent > /root/who.txt")
        for i, k in enumerate(kids):
            assert run(k, "cat /root/who.txt").stdout == f"child-{i}\n"
        assert run(sb, "cat /root/who.txt").stdout == "parent\n"
    finally:
        for k in kids:
            if not isinstance(k, Exception):
                k.kill()
    assert sb.is_running()


def test_snapshot_then_create_from_it(sb):
    run(sb, "echo in-the-snapshot > /root/snap.txt && sync")
    snap = sb.create_snapshot(**SLOW)
    run(sb, "echo after-the-snapshot > /root/snap.txt")
    s = Sandbox.create(snap.snapshot_id, timeout=1800, **SLOW)
    try:
        assert run(s, "cat /root/snap.txt").stdout == "in-the-snapshot\n"
        assert run(sb, "cat /root/snap.txt").stdout == "after-the-snapshot\n"
    finally:
        s.kill()


def test_info_list_metrics_timeout_and_errors(sb):
    info = sb.get_info()
    assert info.state == SandboxState.RUNNING and info.metadata.get("suite") == "linux"
    listed = Sandbox.list(query=None, limit=100).next_items()
    assert sb.sandbox_id in {s.sandbox_id for s in listed}
    sb.set_timeout(1800)
    m = sb.get_metrics()
    assert m, "no metrics"
    assert m[-1].mem_total > 0 and m[-1].cpu_count >= 1
    with pytest.raises(NotFoundException):
        Sandbox.connect("doesnotexist0000000000000", timeout=10)
    with pytest.raises(SandboxException):
        Sandbox.create("no-such-template", timeout=10)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="wrong-key").next_items()


def boot_id(sb):
    return run(sb, "cat /proc/sys/kernel/random/boot_id").stdout.strip()


def test_filesystem_only_pause_keeps_the_disk_and_boots_anew():
    s = create(metadata={"suite": "linux-fs-pause"})
    try:
        first = boot_id(s)
        run(s, "echo kept-without-memory > /root/fs.txt")
        h = s.commands.run("sleep 100000", background=True, timeout=0, request_timeout=300)
        s.pause(mode="filesystem", **SLOW)
        assert not s.is_running(request_timeout=300)
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
        s2 = Sandbox.connect(s.sandbox_id, timeout=1800, **SLOW)
        # Its disk is there; its memory (and so its processes) is not: a new boot.
        assert run(s2, "cat /root/fs.txt").stdout == "kept-without-memory\n"
        second = boot_id(s2)
        assert second != first
        assert h.pid not in [p.pid for p in s2.commands.list(request_timeout=300)]
        # A full pause, then a reboot on resume: the memory is dropped, the disk kept.
        run(s2, "echo written-before-a-full-pause > /root/fs2.txt && sync")
        s2.pause(**SLOW)
        s3 = Sandbox.connect(s.sandbox_id, timeout=1800, on_resume="reboot", **SLOW)
        assert run(s3, "cat /root/fs2.txt").stdout == "written-before-a-full-pause\n"
        assert boot_id(s3) not in (first, second)
    finally:
        Sandbox.kill(s.sandbox_id)


@pytest.mark.parametrize(
    "on_timeout,reboots",
    [("pause", False), ({"action": "pause", "mode": "filesystem"}, True)],
    ids=["full", "filesystem"],
)
def test_timeout_pauses_with_lifecycle_pause_then_wakes(on_timeout, reboots):
    s = create(timeout=20, lifecycle={"on_timeout": on_timeout})
    try:
        first = boot_id(s)
        run(s, "echo still-here > /root/t.txt")
        deadline = time.monotonic() + 240
        while Sandbox.get_info(s.sandbox_id).state != SandboxState.PAUSED:
            assert time.monotonic() < deadline, "not paused after its timeout"
            time.sleep(1)
        s2 = Sandbox.connect(s.sandbox_id, timeout=1800, **SLOW)
        assert run(s2, "cat /root/t.txt").stdout == "still-here\n"
        # A filesystem-only pause dropped the memory: the wake was a new boot.
        assert (boot_id(s2) != first) == reboots
    finally:
        Sandbox.kill(s.sandbox_id)


@pytest.mark.skipif(CLUSTER, reason="restarts the single host's service (the control port's restart)")
def test_service_restart_keeps_running_and_paused_sandboxes():
    a = create(metadata={"suite": "restart-running"})
    b = create(metadata={"suite": "restart-paused"})
    try:
        run(a, "echo a-survives > /root/r.txt")
        run(b, "echo b-survives > /root/r.txt")
        b.pause(**SLOW)
        restart_service()
        # The SDK's pooled keep-alive connections went to the old process: the first
        # request on each fails with a reset (the client does not retry it). Use each
        # pool until requests go through, as a client of a restarted server does.
        deadline = time.monotonic() + 60
        ok = 0
        while ok < 3:
            try:
                Sandbox.get_info(a.sandbox_id)
                run(a, "true")
                ok += 1
            except Exception:
                ok = 0
                assert time.monotonic() < deadline, "the restarted service does not answer"
                time.sleep(0.5)
        assert Sandbox.get_info(a.sandbox_id).state == SandboxState.RUNNING
        assert Sandbox.get_info(b.sandbox_id).state == SandboxState.PAUSED
        assert run(a, "cat /root/r.txt").stdout == "a-survives\n"
        b2 = Sandbox.connect(b.sandbox_id, timeout=1800, **SLOW)
        assert run(b2, "cat /root/r.txt").stdout == "b-survives\n"
    finally:
        for s in (a, b):
            try:
                Sandbox.kill(s.sandbox_id)
            except Exception:
                pass


def test_watch_dir_sees_what_a_command_writes(sb):
    from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

    run(sb, "rm -rf /root/watched && mkdir -p /root/watched/sub")
    w = sb.files.watch_dir("/root/watched", recursive=True, request_timeout=300)
    try:
        run(sb, "echo one > /root/watched/a.txt && echo two > /root/watched/sub/b.txt"
                " && mv /root/watched/a.txt /root/watched/c.txt && rm /root/watched/c.txt")
        seen = []
        deadline = time.monotonic() + 60
        want = {
            ("a.txt", FilesystemEventType.CREATE),
            ("a.txt", FilesystemEventType.WRITE),
            ("sub/b.txt", FilesystemEventType.CREATE),
            ("a.txt", FilesystemEventType.RENAME),
            ("c.txt", FilesystemEventType.REMOVE),
        }
        while not want <= {(e.name, e.type) for e in seen}:
            assert time.monotonic() < deadline, f"events so far: {seen}"
            time.sleep(0.5)
            seen.extend(w.get_new_events())
    finally:
        w.stop()


def test_files_as_another_user_are_theirs_and_checked(sb):
    run(sb, "rm -rf /tmp/u && mkdir -m 777 /tmp/u && echo secret > /tmp/u/root-only"
            " && chmod 600 /tmp/u/root-only")
    sb.files.write("/tmp/u/mine.txt", "by nobody", user="nobody")
    assert run(sb, "stat -c %U /tmp/u/mine.txt").stdout == "nobody\n"
    assert sb.files.read("/tmp/u/mine.txt", user="nobody") == "by nobody"
    with pytest.raises(SandboxException) as e:
        sb.files.read("/tmp/u/root-only", user="nobody")
    assert "ermission" in str(e.value), e.value
    assert sb.files.read("/tmp/u/root-only") == "secret\n"


def test_file_metadata_on_the_guests_disk():
    s = create(metadata={"suite": "linux-metadata"})
    try:
        w = s.files.write("/root/meta.txt", "m\n", metadata={"Kind": "report"}, **SLOW)
        assert w.metadata == {"kind": "report"}
        run(s, "python3 -c \"import os; os.setxattr('/root/meta.txt', 'user.e2b.by', b'guest')\"")
        assert s.files.get_info("/root/meta.txt", **SLOW).metadata == {"kind": "report", "by": "guest"}
        assert s.files.get_info("/root", **SLOW).mode == 0o700
    finally:
        Sandbox.kill(s.sandbox_id)


def build_vms(tag):
    """The template build VM processes in the nested machine, asked by control: a dict of
    their status (uid, capeff, nnp, pidns: PID namespace levels, kvm: 1 if it holds
    /dev/kvm, cgroup, proc: the options of the /proc mounted in its jail) each."""
    control(f"build-vms {tag}")
    deadline = time.monotonic() + 60
    while console_count(f"SDK-BUILD-VMS {tag} ") == 0:
        assert time.monotonic() < deadline, "no answer to the build-vms command"
        time.sleep(0.3)
    with open(NESTED_LOG, "rb") as f:
        lines = f.read().decode(errors="replace").splitlines()
    mark = f"SDK-BUILD-VM {tag} "
    return [
        dict(kv.split("=", 1) for kv in ln.split(mark, 1)[1].split()[1:])
        for ln in lines
        if mark in ln
    ]


WORLD_HELLO = "http://10.99.0.2:8000/hello.txt"  # sdk.sh's server in a namespace of its own


@pytest.mark.skipif(CLUSTER, reason="a node's jail, not the cluster's: the standalone pass checks it")
def test_a_template_build_vm_is_jailed_and_limited():
    """Issue 40: the VM a template build runs in (E2B's build API, what tenants send) is
    jailed as a sandbox's: not root, no capabilities, no_new_privs, a PID namespace of its
    own, a cgroup of the service's. Read from /proc while its RUN step runs.
    Issue 36: that VM has a network (its RUN step fetches a file from the scenario's own
    server), and so do the sandboxes of the template it makes."""
    from e2b import Template

    fetch = (
        "mkdir -p /srv && python3 -c \"import urllib.request as u; "
        f"open('/srv/fetched.txt', 'w').write(u.urlopen('{WORLD_HELLO}', timeout=30).read().decode())\""
    )
    t = Template().from_template(TEMPLATE).run_cmd(f"{fetch} && sleep 15")
    out = {}

    def build():
        try:
            out["info"] = Template.build(t, "sdk-jailed", cpu_count=1, memory_mb=256)
        except Exception as e:  # reported below
            out["error"] = e

    th = threading.Thread(target=build)
    th.start()
    # Every process of the build VM but the service's own is the VM's user: the VM process
    # (it holds /dev/kvm, kvm=1), alone (a jail of the service is one process), in the
    # host's PID namespace with a /proc that shows it only itself. Sampled until the VM
    # process itself is seen.
    seen, i = [], 0
    nonce = os.urandom(3).hex()
    while th.is_alive() and not any(v.get("kvm") == "1" for v in seen):
        i += 1
        seen = [v for v in build_vms(f"{nonce}-{i}") if v.get("uid") != "0"]
        if not any(v.get("kvm") == "1" for v in seen):
            time.sleep(1)
    th.join(900)
    assert not th.is_alive(), "the build did not end"
    assert "error" not in out, out.get("error")
    assert any(v.get("kvm") == "1" for v in seen), (
        f"no build VM process (holding /dev/kvm) ran as another user than root during the build: {seen}"
    )
    for v in seen:
        assert int(v["uid"]) >= 2_000_000, v
        assert v["capeff"] == "0000000000000000", v
        assert v["nnp"] == "1", v
        if v["kvm"] == "1":
            assert v["pidns"] == "1", v
            assert "hidepid=invisible" in v["proc"], v
        assert "/clade/s-" in v["cgroup"], v
    sb = Sandbox.create("sdk-jailed", timeout=600, **SLOW)
    try:
        assert run(sb, "cat /srv/fetched.txt").stdout == "hello from the world\n"
        again = run(sb, f"python3 -c \"import urllib.request as u; print(u.urlopen('{WORLD_HELLO}', timeout=30).read().decode(), end='')\"")
        assert again.stdout == "hello from the world\n", again
    finally:
        sb.kill()
    remove_template("sdk-jailed")


def test_template_build_through_the_sdk(tmp_path):
    """E2B's template build API: `Template.build` on a template of this host, a COPY of a
    file from the build context, ENV, WORKDIR, a RUN that reads both, a start command with
    its ready check; a sandbox of the new template has the files and the process running.
    A step that fails fails the build with its output; nothing is registered."""
    from e2b import Template
    from e2b.exceptions import BuildException

    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "hello.txt").write_text("hello from the build context\n")
    t = (
        Template(file_context_path=str(tmp_path))
        .from_template(TEMPLATE)
        .copy("app/hello.txt", "/srv/")
        .set_envs({"BUILT": "yes"})
        .set_workdir("/srv")
        .run_cmd("cat hello.txt > copied.txt && echo $BUILT > env.txt && pwd > cwd.txt")
        .set_start_cmd("sleep 4242424", "test -f /srv/copied.txt")
    )
    logs = []
    info = Template.build(
        t, "sdk-built", cpu_count=1, memory_mb=256, on_build_logs=logs.append
    )
    text = "\n".join(e.message for e in logs)
    assert info.template_id == "sdk-built", text
    assert "2 steps, 0 cached, 2 run" in text, text
    assert Template.exists("sdk-built")
    assert not Template.exists("no-such-template-here")
    sb = Sandbox.create("sdk-built", timeout=600, **SLOW)
    try:
        assert run(sb, "cat /srv/copied.txt").stdout == "hello from the build context\n"
        assert run(sb, "cat /srv/env.txt").stdout == "yes\n"
        assert run(sb, "cat /srv/cwd.txt").stdout == "/srv\n"
        # A command that names no cwd starts in the template's (envd's default workdir).
        assert run(sb, "pwd").stdout == "/srv\n"
        # The template's own file is there (built on it), and its start command runs.
        assert run(sb, "cat /root/template.txt").stdout == "made-by-the-template\n"
        procs = run(sb, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        assert "sleep 4242424" in procs, procs
    finally:
        sb.kill()
    # The same build again with a tag: its steps come from the cache, and it is kept beside
    # the first (E2B's tags): `name` still means the first, `name:v2` the new one.
    logs.clear()
    info2 = Template.build(
        t, "sdk-built:v2", cpu_count=1, memory_mb=256, on_build_logs=logs.append
    )
    text = "\n".join(e.message for e in logs)
    assert "2 cached, 0 run" in text, text
    tags = {x.tag: x.build_id for x in Template.get_tags("sdk-built")}
    assert tags == {"default": info.build_id, "v2": info2.build_id}, tags
    assert info.build_id != info2.build_id
    first = Sandbox.create("sdk-built", timeout=600, **SLOW)
    try:
        second = Sandbox.create("sdk-built:v2", timeout=600, **SLOW)
        try:
            assert second.get_info().template_id == "sdk-built"
            assert run(second, "cat /srv/copied.txt").stdout == "hello from the build context\n"
            # Two builds, two disks: what one's sandbox writes the other's never sees.
            run(second, "echo second > /srv/mine.txt")
            assert run(first, "cat /srv/mine.txt 2>&1 || echo absent").stdout.strip().endswith("absent")
        finally:
            second.kill()
    finally:
        first.kill()
    # `default` moved to the second build: `name` means it, and the first, which no tag
    # means and no sandbox uses any more, is removed.
    Template.assign_tags("sdk-built:v2", "default")
    tags = {x.tag: x.build_id for x in Template.get_tags("sdk-built")}
    assert tags == {"default": info2.build_id, "v2": info2.build_id}, tags
    third = Sandbox.create("sdk-built", timeout=600, **SLOW)
    third.kill()
    with pytest.raises(Exception, match="not found"):
        Sandbox.create(f"sdk-built:{info.build_id}", timeout=60, **SLOW)
    bad = Template().from_template(TEMPLATE).run_cmd("echo build-fails-here; exit 7")
    with pytest.raises(BuildException) as e:
        Template.build(bad, "sdk-broken", cpu_count=1, memory_mb=256)
    assert "exit code 7" in str(e.value) and "build-fails-here" in str(e.value), str(e.value)
    assert not Template.exists("sdk-broken")
    with pytest.raises(BuildException):
        Template.build(Template().from_template("no-such-template"), "sdk-none", memory_mb=256)
    # The nested machine's /tmp is memory: the template and the build cache go.
    remove_template("sdk-built")
    assert not Template.exists("sdk-built")


def build_base():
    """Builds E2B's base template in the nested machine (`clade template build base`, the
    scenario's build-base); fails with the build's output unless it succeeded."""
    obey("build-base", "SDK-BASE-BUILT ", 1500, "the base template build did not end")
    with open(NESTED_LOG, "rb") as f:
        lines = f.read().decode(errors="replace").splitlines()
    end = max(i for i, ln in enumerate(lines) if "SDK-BASE-BUILT " in ln)
    assert "SDK-BASE-BUILT rc=0 " in lines[end], "\n".join(lines[max(0, end - 14) : end + 1])


@pytest.mark.skipif(CLUSTER, reason="what the base template holds: the standalone pass checks it")
def test_the_base_template_runs_code_written_for_e2bs_base():
    """Issue 36: `clade template build base`, FROM the Debian image build-rootfs.sh makes
    (nothing outside is reached from the nested machine), is what code written for E2B's
    base template expects: commands run as `user` (uid 1000) in /home/user, relative paths
    are its home's, files written through the SDK are its own, sudo needs no password,
    curl reaches a server (in the scenario's own namespace), git, pip and venv work;
    user="root" is root. E2B template code on E2B's base image builds on it."""
    build_base()
    sb = Sandbox.create("base", timeout=600, **SLOW)
    try:
        r = run(sb, 'id -un; id -u; pwd; echo "$HOME"')
        assert r.stdout == "user\n1000\n/home/user\n/home/user\n", r
        sb.files.write("notes/plan.txt", "step one\n", **SLOW)
        r = run(sb, "cat notes/plan.txt; stat -c %U:%G /home/user/notes/plan.txt /home/user/notes")
        assert r.stdout == "step one\nuser:user\nuser:user\n", r
        assert sb.files.read("notes/plan.txt", **SLOW) == "step one\n"
        assert run(sb, "sudo -n id -u").stdout == "0\n"
        # (a command that names no cwd starts in the template's WORKDIR, whoever runs it,
        # as envd's default workdir does; root's home is still its own)
        assert run(sb, 'id -un; pwd; echo "$HOME"', user="root").stdout == "root\n/home/user\n/root\n"
        assert run(sb, "pwd", cwd="/tmp").stdout == "/tmp\n"
        assert run(sb, f"curl -fsS --max-time 60 {WORLD_HELLO}").stdout == "hello from the world\n"
        r = run(
            sb,
            "git init -q repo && cd repo && git -c user.email=u@example.test -c user.name=u "
            "commit -q --allow-empty -m first && git log --format=%s && stat -c %U .git",
        )
        assert r.stdout == "first\nuser\n", r
        r = run(sb, "python3 -m pip --version && python3 -m venv venv && venv/bin/python -c 'import sys; print(sys.prefix)'")
        assert r.stdout.splitlines()[-1] == "/home/user/venv", r
    finally:
        sb.kill()
    # E2B template code on E2B's base image (the SDK's default base) builds on this
    # template: no registry is reached.
    from e2b import Template

    t = Template().from_base_image().run_cmd("whoami > /home/user/built-by.txt")
    logs = []
    Template.build(t, "on-base", cpu_count=1, memory_mb=256, on_build_logs=logs.append)
    text = "\n".join(e.message for e in logs)
    assert "built on this host's template base" in text, text
    sb = Sandbox.create("on-base", timeout=600, **SLOW)
    try:
        r = run(sb, "id -un; pwd; cat built-by.txt; stat -c %U built-by.txt")
        assert r.stdout == "user\n/home/user\nuser\nuser\n", r
    finally:
        sb.kill()
    remove_template("on-base")
    remove_template("base")
