"""minipar across emulated hosts (scripts/cluster.py: network namespaces, a 1 Gbit/s link per
host): the hierarchical collectives equal NumPy with unequal ranks per host, on 2 and 3 hosts;
the bytes the ledger says crossed hosts are what the link's counters saw, to within the
protocols' overhead; and training with dp x tp across two hosts matches the single-process
twin in float64. Skipped, with one line, where namespaces cannot be made.
(tests/test_cluster.py checks the cluster itself: placement, rate, clean-up, a lost host.)
"""
import json
import os
import sys

import pytest

from cluster_fixture import TEST_PREFIX, cluster, emulated  # noqa: F401  (the fixture)
from minipar.comm.algorithms.hierarchical_alltoall import bytes_sent

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "tools", "hier_worker.py")
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "8",
        "--steps", "2", "--sample", "0", "--dtype", "float64", "--verify"]


def worker(c, hosts, n):
    p = c.mpirun(None, [sys.executable, WORKER, str(n)], hosts=hosts, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    [line] = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("n", [1, 1000, 100_000])
def test_hierarchical_equals_numpy_two_hosts_two_plus_one(cluster, n):
    rows = worker(cluster, [("h0", 2), ("h1", 1)], n)
    assert [r["host"] for r in rows] == ["h0", "h0", "h1"] and rows[0]["nodes"] == [0, 0, 1]
    assert all(r["ok"] for r in rows)


@pytest.fixture(scope="module")
def three_hosts():
    reason = emulated.unavailable()
    if reason:
        pytest.skip(reason)
    with emulated.Cluster(hosts=3, ranks_per_host=2, rate="1gbit", prefix=TEST_PREFIX + "3-") as c:
        yield c


def test_hierarchical_equals_numpy_three_hosts_two_plus_one_plus_one(three_hosts):
    rows = worker(three_hosts, [("h0", 2), ("h1", 1), ("h2", 1)], 100_000)
    assert [r["host"] for r in rows] == ["h0", "h0", "h1", "h2"] and rows[0]["nodes"] == [0, 0, 1, 2]
    assert all(r["ok"] for r in rows)


def test_the_ledgers_inter_host_bytes_are_what_the_link_carried(cluster):
    """2 hosts x 2 ranks, 4 MiB of float64 (all-reduce, reduce-scatter, all-gather, and the
    hierarchical all-to-all, equal and variable): what h0's ranks sent to h1 by the ledger,
    against h0's transmit counter, which also carries TCP/IP headers, UCX's own messages and
    the job's start-up: between 1.0 and 1.1 times."""
    before = cluster.counters()
    rows = worker(cluster, [("h0", 2), ("h1", 2)], 1 << 19)
    after = cluster.counters()
    for host, ranks in (("h0", rows[:2]), ("h1", rows[2:])):
        ledger = sum(r["sent_inter"] for r in ranks)
        tx = after[host][0] - before[host][0]
        # hierarchical per rank: all-reduce 2(N-1)/N n/k, reduce-scatter and all-gather half
        # that each (the all-gather's n: the gathered bytes, 4x x), N = k = 2
        n = 8 << 19
        B = [[(s + q) % 3 * 8 for q in range(4)] for s in range(4)]   # the worker's variable pieces
        for r in ranks:                 # + the all-to-all: (N-1)/N n, and the variable one by formula
            variable = bytes_sent((0, 0, 1, 1), r["rank"], B)[1] + bytes_sent((0, 0, 1, 1), r["rank"], 8)[1]
            assert r["sent_inter"] == n / 2 + n / 4 + 4 * n / 4 + n / 2 + variable, r
        assert 1.0 <= tx / ledger < 1.1, f"{host}: counter {tx} B, ledger {ledger} B"
        print(f"{host}: the link's counter {tx:,} B, the ledger {ledger:,} B, ratio {tx / ledger:.4f}")


@pytest.mark.parametrize("flags", [["--dp", "2", "--tp", "2"], ["--dp", "4"]], ids=["dp2xtp2", "dp4"])
def test_training_across_two_hosts_matches_the_twin(cluster, flags):
    p = cluster.mpirun(4, [sys.executable, "-m", "minipar.train", *TINY, *flags], ppn=2, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "hosts: 2, h0: ranks 0, 1; h1: ranks 2, 3" in p.stdout
    verdict = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=")]
    assert verdict and verdict[0].endswith("-> OK"), p.stdout[-2000:]
