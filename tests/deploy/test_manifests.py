"""deploy/kubernetes and deploy/nomad, checked offline: the files parse (PyYAML, python-hcl2)
and carry what a Clade node needs (/dev/kvm, privileges, the registry, secret, API key and
store from a Secret or variables, a drain before a node stops), and every flag they pass to
`clade` is one `clade` accepts (its --help). Run with tests/e2b/run_cluster.sh."""

import os
import re
import subprocess

import hcl2
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLADE = os.environ.get("CLADE", os.path.join(REPO, "target/debug/clade"))
NEEDED_ENV = {"CLADE_CLUSTER", "CLADE_CLUSTER_SECRET", "CLADE_API_KEY", "CLADE_STORE"}


def help_of(*cmd):
    return subprocess.run([CLADE, *cmd, "--help"], check=True, capture_output=True, text=True).stdout


def flags_ok(args, *cmd):
    """Every --flag in args is one `clade CMD` documents."""
    text = help_of(*cmd)
    for a in args:
        m = re.match(r"(--[a-z0-9-]+)", a)
        if m:
            assert re.search(rf"{m.group(1)}\b", text), f"clade {' '.join(cmd)} has no {m.group(1)}"


def env_documented(names):
    text = help_of("serve")
    for n in names:
        assert re.search(rf"env: {n}[=\]]", text), f"clade serve reads no {n}"


def k8s():
    with open(os.path.join(REPO, "deploy/kubernetes/clade.yaml")) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    return {d["kind"]: d for d in docs}


def test_kubernetes_daemonset_runs_a_kvm_node_from_the_secret():
    docs = k8s()
    ds = docs["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][-1] == "serve"
    flags_ok(c["args"], "serve")
    env = {e["name"]: e for e in c["env"]}
    assert NEEDED_ENV <= set(env), set(env)
    for n in NEEDED_ENV:
        assert env[n]["valueFrom"]["secretKeyRef"]["name"] == "clade"
    env_documented(NEEDED_ENV)
    assert c["securityContext"]["privileged"] is True
    assert pod["hostNetwork"] is True
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert vols[mounts["/dev/kvm"]]["hostPath"]["path"] == "/dev/kvm"
    # A drain before the pod stops (and time for it).
    pre = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert "clade node drain" in pre
    flags_ok(re.findall(r"--[a-z-]+", pre), "node", "drain")
    assert pod["terminationGracePeriodSeconds"] >= 600
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_kubernetes_service_reaches_the_nodes():
    docs = k8s()
    svc, ds = docs["Service"], docs["DaemonSet"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p for p in ds["spec"]["template"]["spec"]["containers"][0]["ports"]}
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in ports
    with open(os.path.join(REPO, "deploy/kubernetes/secret.example.yaml")) as f:
        secret = yaml.safe_load(f)
    keys = set(secret["stringData"])
    for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref and not ref.get("optional"):
            assert ref["key"] in keys, ref


def unquote(v):
    return v.strip('"') if isinstance(v, str) else v


def test_nomad_system_job_runs_a_node_on_every_kvm_client():
    with open(os.path.join(REPO, "deploy/nomad/clade.nomad.hcl")) as f:
        job = hcl2.load(f)
    ((name, spec),) = job["job"][0].items()
    assert unquote(name) == "clade"
    assert unquote(spec["type"]) == "system"
    ((_, group),) = spec["group"][0].items()
    ((_, task),) = group["task"][0].items()
    cfg = task["config"][0]
    assert unquote(cfg["command"]).endswith("/clade")
    args = [unquote(a) for a in cfg["args"]]
    assert args[0] == "serve"
    flags_ok(args, "serve")
    data = unquote(task["template"][0]["data"])
    for n in NEEDED_ENV:
        assert f"{n}=" in data, n
    env_documented(NEEDED_ENV)
    assert unquote(task["kill_timeout"]) == "600s"
