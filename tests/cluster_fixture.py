"""The emulated cluster of scripts/cluster.py as a pytest fixture (docs/cluster.md).

    from cluster_fixture import cluster        # noqa: F401  (pytest finds the fixture by name)

    def test_something(cluster):               # 2 hosts (h0, h1), each link 1 Gbit/s each way
        p = cluster.mpirun(4, [sys.executable, "-m", "minipar.train", ...], ppn=2, timeout=120)
        assert p.returncode == 0, p.stderr
        cluster.counters()                     # {"h0": (tx_bytes, rx_bytes), "h1": (...)}

One cluster per test module, built before its first test and removed after its last. Its
names start with mpc-t<pid>- (this pytest process), so it never collides with a cluster
that `python scripts/cluster.py up` built or with another pytest run; a cluster left by a
pytest that was killed is removed by the next one. Where namespaces cannot be made (not
root, no `ip`, `tc` or `unshare`) every test that asks for it is skipped, with one line
saying why.
"""
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import cluster as emulated  # noqa: E402  (scripts/cluster.py)

TEST_PREFIX = f"{emulated.PREFIX}t{os.getpid()}-"


def remove_stale_test_clusters():
    """Remove the clusters of pytest processes that are gone (killed before their teardown)."""
    for ns in emulated.namespaces():
        m = re.match(re.escape(emulated.PREFIX) + r"t(\d+)-", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            emulated.down(m.group(0))


@pytest.fixture(scope="module")
def cluster():
    """A started 2-host cluster (2 ranks per host, 1gbit, burst 256kb): an emulated.Cluster."""
    reason = emulated.unavailable()
    if reason:
        pytest.skip(reason)
    remove_stale_test_clusters()
    with emulated.Cluster(hosts=2, ranks_per_host=2, rate="1gbit", burst="256kb", prefix=TEST_PREFIX) as c:
        yield c
