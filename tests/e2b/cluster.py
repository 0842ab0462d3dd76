"""A Clade cluster on this machine, for tests/e2b/test_cluster.py: PostgreSQL (Debian's
postgresql-15, run as the unprivileged user `postgres`), the S3 server of the tests
(build/tools/bin/clade-test-s3) and `clade serve --cluster` nodes, each in a network
namespace of its own, all joined by a bridge this harness creates (10.231.0.0/24: the
host is .1, node i is .(10+i)). Everything is removed at the end. Needs root.

`Cluster(..., tls=True)`: the cluster's links as a deployment should have them, with
certificates made here (openssl): PostgreSQL with ssl=on taking TLS clients only, reached
with sslmode=verify-full; each node serving HTTPS with a certificate of the cluster CA,
which every node verifies the others by. Without it nodes talk http:// across the bridge
(--cluster-plain-http)."""

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLADE = os.environ.get("CLADE", os.path.join(REPO, "target/debug/clade"))
GUEST = os.path.join(REPO, "target/native-guest/release/native-guest")
S3 = os.path.join(REPO, "build/tools/bin/clade-test-s3")
PG_BIN = "/usr/lib/postgresql/15/bin"
BRIDGE = "clclbr0"
HOST_IP = "10.231.0.1"
KEY = "cluster-key"
SECRET = "cluster-secret-0123456789"
PORT = 3000
# The cluster CA of a `tls=True` cluster: what api() trusts for https:// URLs.
TLS_CA = None


def sh(*args, check=True, env=None, cwd=None):
    return subprocess.run(args, check=check, capture_output=True, text=True, env=env, cwd=cwd)


def free_port():
    s = socket.socket()
    s.bind((HOST_IP, 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_port(host, port, what, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} on {host}:{port} did not start")
            time.sleep(0.05)


def openssl(d, *args):
    sh("openssl", *args, cwd=d)


def make_ca(d, name):
    """A CA in D: NAME.key, NAME.pem."""
    openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-days", "2", "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")


def make_cert(d, name, ip, ca="ca"):
    """A server certificate for IP in D, signed by CA: NAME.key, NAME.pem."""
    openssl(d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
    with open(os.path.join(d, f"{name}.ext"), "w") as f:
        f.write(f"subjectAltName=IP:{ip}\nextendedKeyUsage=serverAuth\n")
    openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem")
    return os.path.join(d, f"{name}.pem"), os.path.join(d, f"{name}.key")


def start_postgres(parent, listen, port, clients, tls=None):
    """PostgreSQL (Debian's postgresql-15) in PARENT/pg, run as the unprivileged user
    `postgres`, listening on LISTEN:PORT for CLIENTS (a CIDR) with a scram password.
    TLS=(cert, key, ca): ssl=on, TCP clients over TLS only, the URL says verify-full.
    Returns (its directory, a URL for user clade)."""
    d = os.path.join(parent, "pg")
    os.mkdir(d)
    shutil.chown(d, "postgres", "postgres")
    pw = os.path.join(d, "pw")
    with open(pw, "w") as f:
        f.write("clade-pg-password\n")
    shutil.chown(pw, "postgres", "postgres")
    sh("runuser", "-u", "postgres", "--", f"{PG_BIN}/initdb", "-D", f"{d}/data", "-U", "clade",
       "--auth-local=peer", "--auth-host=scram-sha-256", f"--pwfile={pw}")
    opts, query = "", ""
    if tls:
        cert, key, ca = tls
        for src, dst in ((cert, "server.pem"), (key, "server.key")):
            shutil.copy(src, os.path.join(d, dst))
            shutil.chown(os.path.join(d, dst), "postgres", "postgres")
        os.chmod(os.path.join(d, "server.key"), 0o600)
        opts = f" -c ssl=on -c ssl_cert_file={d}/server.pem -c ssl_key_file={d}/server.key"
        query = f"?sslmode=verify-full&sslrootcert={ca}"
        # TCP clients over TLS only.
        with open(f"{d}/data/pg_hba.conf", "w") as f:
            f.write(f"local all all peer\nhostssl all all {clients} scram-sha-256\n")
    else:
        with open(f"{d}/data/pg_hba.conf", "a") as f:
            f.write(f"host all all {clients} scram-sha-256\n")
    sh("runuser", "-u", "postgres", "--", f"{PG_BIN}/pg_ctl", "-D", f"{d}/data", "-l", f"{d}/log",
       "-w", "-o", f"-k {d} -c listen_addresses={listen} -p {port} -c fsync=off{opts}", "start")
    return d, f"postgres://clade:clade-pg-password@{listen}:{port}/postgres{query}"


def stop_postgres(d):
    sh("runuser", "-u", "postgres", "--", f"{PG_BIN}/pg_ctl", "-D", f"{d}/data", "-m", "immediate",
       "stop", check=False)


class Node:
    def __init__(self, cluster, name, index, gateway=False, vcpus=3, mem=1024, ca="ca"):
        self.cluster = cluster
        self.name = name
        self.ns = f"clcl-{name}"
        self.ip = f"10.231.0.{10 + index}"
        self.url = f"{'https' if cluster.tls else 'http'}://{self.ip}:{PORT}"
        # The CA this node verifies other nodes by (a test may give it a wrong one).
        self.ca = ca
        self.state = os.path.join(cluster.dir, f"state-{name}")
        self.log = os.path.join(cluster.dir, f"serve-{name}.log")
        self.gateway = gateway
        self.vcpus = vcpus
        self.mem = mem
        self.proc = None
        # More `clade serve` arguments (a test may restart a node with others).
        self.extra = []

    def start(self):
        args = [
            # nsenter, not `ip netns exec`: that one mounts a sysfs of the namespace over
            # /sys, hiding the cgroup hierarchies the sandboxes' limits live in.
            "nsenter", f"--net=/run/netns/{self.ns}", CLADE, "serve",
            "--listen", f"{self.ip}:{PORT}", "--state-dir", self.state,
            "--store", "s3://clade/cluster", "--store-endpoint", self.cluster.s3_url,
            "--node-name", self.name, "--lease-ms", str(self.cluster.lease_ms),
            "--capacity-vcpus", str(self.vcpus), "--capacity-mem", str(self.mem),
            "--net", "off", "--standby", "0",
        ]
        if self.gateway:
            args.append("--no-sandboxes")
        if self.cluster.tls:
            cert, key = make_cert(self.cluster.certs, f"node-{self.name}", self.ip)
            args += ["--tls-cert", cert, "--tls-key", key,
                     "--cluster-ca", os.path.join(self.cluster.certs, f"{self.ca}.pem")]
        else:
            args.append("--cluster-plain-http")
        args += self.extra
        # The secrets through the environment, never the command line (`ps` shows it to
        # every local user).
        env = dict(os.environ, CLADE_LOG="info", CLADE_API_KEY=KEY, CLADE_CLUSTER=self.cluster.pg_url,
                   CLADE_CLUSTER_SECRET=SECRET, **self.cluster.s3_env)
        # The log is appended to: this start's lines are those after `before`.
        before = os.path.getsize(self.log) if os.path.exists(self.log) else 0
        self.proc = subprocess.Popen(args, stdout=open(self.log, "a"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while "of the cluster (reached at" not in open(self.log).read()[before:]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node {self.name} did not start:\n" + open(self.log).read()[-3000:])
            time.sleep(0.05)

    def kill(self):
        """SIGKILL: the service dies at once (its VM processes run on)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        self.proc.send_signal(signal.SIGSTOP)

    def cont(self):
        self.proc.send_signal(signal.SIGCONT)

    def end(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def vm_pids(self, sandbox_id):
        """The VM processes of one sandbox on this node."""
        r = sh("pgrep", "-f", f"{self.state}/sandboxes/{sandbox_id}/", check=False)
        return [int(p) for p in r.stdout.split()]

    def record(self, sandbox_id):
        """Sandbox SANDBOX_ID's row in this node's own registry (SQLite), as a dict."""
        import sqlite3

        db = sqlite3.connect(f"file:{self.state}/registry.sqlite?mode=ro", uri=True)
        db.row_factory = sqlite3.Row
        try:
            row = db.execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
            return dict(row) if row else None
        finally:
            db.close()

    def log_text(self):
        return open(self.log, errors="replace").read()


class Cluster:
    def __init__(self, nodes, lease_ms=2000, tls=False):
        global TLS_CA
        self.dir = tempfile.mkdtemp(prefix="clade-cluster.", dir="/tmp")
        os.chmod(self.dir, 0o755)
        self.tls = tls
        if tls:
            self.certs = os.path.join(self.dir, "certs")
            os.mkdir(self.certs)
            make_ca(self.certs, "ca")
            make_ca(self.certs, "other-ca")
            TLS_CA = os.path.join(self.certs, "ca.pem")
        self.lease_ms = lease_ms
        self.procs = []
        self.nodes = {}
        self._net_up(len(nodes))
        self._postgres()
        self._s3()
        for i, (name, opts) in enumerate(nodes, start=1):
            self.nodes[name] = Node(self, name, i, **opts)

    # -- set-up -----------------------------------------------------------------------
    def _net_up(self, n):
        self._net_down(n + 2)
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        self.netns = []

    def add_netns(self, node):
        ns, veth = node.ns, f"clclv{node.ip.split('.')[-1]}"
        sh("ip", "netns", "add", ns)
        self.netns.append(ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", veth, "master", BRIDGE, "up")
        sh("ip", "-n", ns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _net_down(self, n):
        for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
            ns = line.split()[0] if line.split() else ""
            if ns.startswith("clcl-"):
                sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", BRIDGE, check=False)

    def _postgres(self):
        tls = None
        if self.tls:
            cert, key = make_cert(self.certs, "pg", HOST_IP)
            tls = (cert, key, os.path.join(self.certs, "ca.pem"))
        self.pg_dir, self.pg_url = start_postgres(self.dir, HOST_IP, free_port(), "10.231.0.0/24", tls)

    def _s3(self):
        os.makedirs(os.path.join(self.dir, "s3/clade"))
        port = free_port()
        p = subprocess.Popen([S3, "--host", HOST_IP, "--port", str(port), "--access-key", "demo",
                              "--secret-key", "demo-secret", os.path.join(self.dir, "s3")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        wait_port(HOST_IP, port, "the S3 server")
        self.s3_url = f"http://{HOST_IP}:{port}"
        self.s3_env = {"AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo-secret",
                       "AWS_REGION": "us-east-1"}

    def build_template(self, node, name="t"):
        sh(CLADE, "template", "build", name, "--test-device", "--mem", "64", "--kernel", GUEST,
           "--cmdline", "steps=vsock", "--state-dir", node.state)

    def add_node(self, name, extra=(), **opts):
        """A node that joins later (its namespace made now), started."""
        node = Node(self, name, len(self.nodes) + 1, **opts)
        node.extra = list(extra)
        self.nodes[name] = node
        self.add_netns(node)
        node.start()
        return node

    def start(self, templates_on=()):
        for node in self.nodes.values():
            self.add_netns(node)
            if node.name in templates_on:
                self.build_template(node)
        for node in self.nodes.values():
            node.start()

    def close(self):
        for node in self.nodes.values():
            node.end()
        # Sandbox VM processes outlive the service by design: end the ones of this run.
        sh("pkill", "-9", "-f", f"{self.dir}/", check=False)
        for p in self.procs:
            p.terminate()
            p.wait()
        stop_postgres(self.pg_dir)
        self._net_down(len(self.nodes) + 2)
        if os.environ.get("CLADE_KEEP_CLUSTER"):
            print(f"cluster files kept in {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- asking it --------------------------------------------------------------------
    def psql(self, sql):
        r = sh("psql", "-qAtX", self.pg_url, "-c", sql)
        return [line.split("|") for line in r.stdout.splitlines() if line]

    def owner(self, sandbox_id):
        """Sandbox SANDBOX_ID's row in the registry (None: none, or its tombstone)."""
        rows = self.psql(
            f"SELECT node, token, state, durable FROM clade_sandboxes WHERE id = '{sandbox_id}' AND state <> 'killed'"
        )
        return rows[0] if rows else None

    def nodes_json(self):
        r = sh(CLADE, "node", "ls", "--json", env=dict(os.environ, CLADE_CLUSTER=self.pg_url))
        return {n["name"]: n for n in json.loads(r.stdout)}

    def wait_lease_ended(self, name, timeout=30):
        deadline = time.monotonic() + timeout
        while self.nodes_json()[name]["live"]:
            assert time.monotonic() < deadline, f"node {name}'s lease never ended"
            time.sleep(0.2)


def api(url, method, path, body=None, headers=None, timeout=120):
    """One request: (status, parsed JSON body or text, headers)."""
    data = json.dumps(body).encode() if body is not None else None
    h = {"X-API-KEY": KEY, "Content-Type": "application/json"}
    h.update(headers or {})
    req = urllib.request.Request(url + path, data=data, method=method, headers=h)
    try:
        ctx = ssl.create_default_context(cafile=TLS_CA) if url.startswith("https") else None
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            raw, status, hdrs = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, hdrs = e.read(), e.code, dict(e.headers)
    try:
        return status, json.loads(raw) if raw else None, hdrs
    except ValueError:
        return status, raw.decode(errors="replace"), hdrs
