"""A cluster whose links are encrypted and authenticated (tests/e2b/cluster.py with
tls=True): PostgreSQL with ssl=on taking TLS clients only, reached with
sslmode=verify-full; nodes serving HTTPS with certificates of the cluster CA and
verifying each other by it. Node a runs sandboxes, gw is a gateway with the cluster CA,
bad a gateway that trusts another CA. Run with tests/e2b/run_cluster.sh (root)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster, api  # noqa: E402


@pytest.fixture(scope="module")
def cl():
    c = Cluster([("a", {}), ("gw", {"gateway": True}), ("bad", {"gateway": True, "ca": "other-ca"})],
                tls=True)
    try:
        c.start(templates_on=("a",))
        yield c
    finally:
        c.close()


def test_nodes_hop_over_https_verified_to_the_cluster_ca(cl):
    gw, a = cl.nodes["gw"].url, cl.nodes["a"].url
    assert gw.startswith("https://") and a.startswith("https://")
    # Every node joined over TLS to PostgreSQL (verify-full) and advertises https://.
    assert {n: v["address"] for n, v in cl.nodes_json().items()} == {
        n: node.url for n, node in cl.nodes.items()}
    ssl_rows = cl.psql("SELECT bool_and(ssl), count(*) FROM pg_stat_ssl JOIN pg_stat_activity "
                       "USING (pid) WHERE usename = 'clade' AND pid <> pg_backend_pid()")
    assert ssl_rows[0][0] == "t" and int(ssl_rows[0][1]) >= 3, ssl_rows
    status, body, _ = api(gw, "POST", "/sandboxes", {"templateID": "t", "timeout": 300})
    assert status == 201, (status, body)
    sid = body["sandboxID"]
    assert cl.owner(sid)[0] == "a"
    status, body, _ = api(gw, "GET", f"/sandboxes/{sid}")
    assert status == 200 and body["state"] == "running", body
    # A node that trusts another CA cannot hop to a: the handshake fails, nothing is sent.
    status, body, _ = api(cl.nodes["bad"].url, "GET", f"/sandboxes/{sid}")
    assert status == 502 and "UnknownIssuer" in body["message"], (status, body)
    assert api(gw, "DELETE", f"/sandboxes/{sid}")[0] == 204
