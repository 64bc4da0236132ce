"""The emulated cluster (scripts/cluster.py, docs/cluster.md) is what it claims to be: hosts
with their own names, ranks placed two per host, messages between hosts on the link at the
link's rate, nothing left behind, and a lost host ends the job.

Each claim is checked with a number from outside the job: the bytes counted by each host's
eth0, the time a message takes against what the rate allows, what `ip netns list` shows.
"""
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from cluster_fixture import TEST_PREFIX, cluster, emulated  # noqa: F401  (cluster: the fixture)

REASON = emulated.unavailable()
if REASON:
    pytest.skip(REASON, allow_module_level=True)

REPO = emulated.REPO
SCRIPT = [sys.executable, os.path.join(REPO, "scripts", "cluster.py")]
MiB = 1 << 20
NBYTES = 8 * MiB

WHERE = """
import socket
from mpi4py import MPI
print(f"rank {MPI.COMM_WORLD.Get_rank()} on {MPI.Get_processor_name()} {socket.gethostname()}", flush=True)
"""

# src sends NBYTES to dst with minipar.comm; dst answers with one byte once it has them all:
# src's clock then spans the whole transfer, whatever the two ranks' clocks say.
TRANSFER = """
import sys, time
import numpy as np
from mpi4py import MPI
from minipar import comm
src, dst, nbytes = map(int, sys.argv[1:])
g = comm.Group(MPI.COMM_WORLD)
g.comm.Barrier()
if g.rank == src:
    t0 = time.perf_counter()
    comm.send(g, np.ones(nbytes, np.uint8), dst)
    comm.recv(g, dst)
    print(f"seconds {time.perf_counter() - t0:.6f}", flush=True)
elif g.rank == dst:
    assert comm.recv(g, src).nbytes == nbytes
    comm.send(g, np.zeros(1, np.uint8), src)
g.comm.Barrier()
"""

# Ranks 0 <-> 2 and 1 <-> 3 (h0 <-> h1) exchange 1 MiB, over and over, for at most 40 s.
EXCHANGE = """
import sys, time
import numpy as np
from mpi4py import MPI
from minipar import comm
g = comm.Group(MPI.COMM_WORLD)
partner = (g.rank + 2) % 4
x = np.ones(1 << 20, np.uint8)
t0, i = time.monotonic(), 0
while time.monotonic() - t0 < 40:
    h = comm.send_async(g, x, partner)
    comm.recv(g, partner)
    h.wait()
    i += 1
    if i == 5 and g.rank == 0:
        open(sys.argv[1], "w").close()
print(f"rank {g.rank}: 40 s of exchanges and no failure", flush=True)
"""


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster_jobs")
    for name, text in (("where", WHERE), ("transfer", TRANSFER), ("exchange", EXCHANGE)):
        (d / f"{name}.py").write_text(text)
    return d


def leftovers(prefix):
    """What exists under this prefix: namespaces, /etc/netns entries, links (root namespace),
    processes in the namespaces."""
    found = [f"netns {ns}" for ns in emulated.namespaces() if ns.startswith(prefix)]
    if os.path.isdir("/etc/netns"):
        found += [f"/etc/netns/{d}" for d in os.listdir("/etc/netns") if d.startswith(prefix)]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    found += [f"link {line.split(':')[1].strip()}" for line in links.splitlines()
              if line.split(":")[1].strip().startswith(emulated.PREFIX)]
    return found


def cli(*args, timeout=60):
    return subprocess.run([*SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ nothing is left behind

def test_up_then_down_leaves_nothing_behind():
    prefix = TEST_PREFIX + "cli-"
    try:
        up = cli("up", "--prefix", prefix, "--hosts", "3", "--rate", "100mbit")
        assert up.returncode == 0, up.stderr
        assert sorted(leftovers(prefix)) == sorted(
            [f"netns {prefix}{n}" for n in ("sw", "h0", "h1", "h2")] +
            [f"/etc/netns/{prefix}h{i}" for i in range(3)]), leftovers(prefix)
        with open(f"/etc/netns/{prefix}h2/hosts") as f:
            assert f.read().split() == ["127.0.0.1", "localhost", "10.213.0.10", "h0",
                                        "10.213.0.11", "h1", "10.213.0.12", "h2"]
        status = cli("status", "--prefix", prefix)
        assert status.returncode == 0 and status.stdout.count("up 100 Mbit/s") == 3, status.stdout
        again = cli("up", "--prefix", prefix)
        assert again.returncode == 1 and "already up" in again.stderr, again.stderr
    finally:
        down = cli("down", "--prefix", prefix)
    assert down.returncode == 0, down.stderr
    assert leftovers(prefix) == []


def test_a_failing_run_with_down_after_leaves_nothing_behind():
    prefix = TEST_PREFIX + "fail-"
    try:
        p = cli("run", "--prefix", prefix, "--down-after", "--", "-n", "4",
                "python", "-c", "raise SystemExit(3)")
        assert p.returncode != 0, (p.stdout, p.stderr)
        assert "-launcher rsh -launcher-exec" in p.stderr and "-hosts h0:2,h1:2" in p.stderr, p.stderr
        assert leftovers(prefix) == []
    finally:
        emulated.down(prefix)


def test_an_exception_inside_the_with_block_leaves_nothing_behind():
    prefix = TEST_PREFIX + "raise-"
    with pytest.raises(RuntimeError, match="the test failed"):
        with emulated.Cluster(hosts=2, prefix=prefix) as c:
            failed = c.mpirun(2, [sys.executable, "-c", "raise SystemExit(3)"], ppn=1, timeout=60)
            assert failed.returncode != 0
            assert len(leftovers(prefix)) == 5, leftovers(prefix)
            raise RuntimeError("the test failed")
    assert leftovers(prefix) == []


def pids_inside(cluster, host):
    return subprocess.run(["ip", "netns", "pids", cluster.ns(host)], capture_output=True, text=True,
                          timeout=30).stdout.split()


def test_a_job_past_its_timeout_is_killed_on_every_host_and_only_it(cluster):
    bystander = subprocess.Popen(["ip", "netns", "exec", cluster.ns("h1"), "sleep", "60"])
    try:
        t0 = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            cluster.mpirun(4, ["sleep", "60"], timeout=2)
        assert time.monotonic() - t0 < 10
        assert bystander.poll() is None, "the cleanup of one job killed a process that was not its own"
    finally:
        bystander.kill()
        bystander.wait(timeout=30)
    for h in cluster.hosts:
        assert pids_inside(cluster, h) == [], f"processes left on {h}"


# ------------------------------------------------------------------ hosts and placement

def where(cluster, scripts, **placement):
    p = cluster.mpirun(None, [sys.executable, str(scripts / "where.py")], timeout=60, **placement)
    assert p.returncode == 0, p.stderr
    seen = {}
    for rank, processor, hostname in re.findall(r"rank (\d+) on (h\d+) (h\d+)", p.stdout):
        assert processor == hostname, p.stdout
        seen[int(rank)] = hostname
    return seen


def test_neighbouring_ranks_share_a_host(cluster, scripts):
    assert where(cluster, scripts, ppn=2) == {0: "h0", 1: "h0", 2: "h1", 3: "h1"}
    assert where(cluster, scripts, hosts=[("h0", 2), ("h1", 1)]) == {0: "h0", 1: "h0", 2: "h1"}


# ------------------------------------------------------------------ bytes on the link

def transfer(cluster, scripts, src, dst, env=None):
    """Send NBYTES from rank src to rank dst (4 ranks, 2 per host): -> (seconds the transfer
    took on src's clock, {host: (tx, rx) bytes counted during the job})."""
    before = cluster.counters()
    p = cluster.mpirun(4, [sys.executable, str(scripts / "transfer.py"), str(src), str(dst), str(NBYTES)],
                       ppn=2, env=env, timeout=60)
    after = cluster.counters()
    assert p.returncode == 0, p.stderr
    seconds = float(re.search(r"seconds (\S+)", p.stdout).group(1))
    return seconds, {h: (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after}


def assert_on_the_link(delta, what):
    most = NBYTES * 1.1 + MiB            # the payload, its TCP/IP headers, MPI's set-up
    tx, rx = delta["h0"][0], delta["h1"][1]
    assert NBYTES <= tx <= most and NBYTES <= rx <= most, \
        f"{what}: h0 sent {tx} B and h1 received {rx} B; expected {NBYTES} .. {most:.0f}"


def test_bytes_between_hosts_cross_the_link_at_its_rate(cluster, scripts, capsys):
    seconds, delta = transfer(cluster, scripts, 0, 2)
    assert_on_the_link(delta, "rank 0 (h0) -> rank 2 (h1)")
    # two token buckets in series let through at most burst + rate * t bytes in t seconds
    fastest = (NBYTES - emulated.size_bytes(cluster.burst)) / emulated.rate_bytes_per_s(cluster.rate)
    fast = NBYTES / seconds / 1e6
    with capsys.disabled():
        print(f"\n  8 MiB h0 -> h1 at {cluster.rate}: {seconds * 1e3:.0f} ms, {fast:.0f} MB/s "
              f"(h0 tx +{delta['h0'][0]} B, h1 rx +{delta['h1'][1]} B)")
    assert seconds >= fastest, f"{seconds * 1e3:.1f} ms < {fastest * 1e3:.1f} ms: faster than {cluster.rate}"

    saved = cluster.rate
    cluster.set_rate("100mbit")
    try:
        seconds, delta = transfer(cluster, scripts, 0, 2)
    finally:
        cluster.set_rate(saved)
    slow = NBYTES / seconds / 1e6
    with capsys.disabled():
        print(f"  8 MiB h0 -> h1 at 100mbit: {seconds * 1e3:.0f} ms, {slow:.1f} MB/s")
    assert_on_the_link(delta, "at 100mbit")
    assert slow <= 12.5 * NBYTES / (NBYTES - emulated.size_bytes(cluster.burst)), f"{slow:.1f} MB/s at 100mbit"
    assert slow < fast / 3, f"100mbit: {slow:.1f} MB/s, 1gbit: {fast:.1f} MB/s"


def test_bytes_within_a_host_stay_off_the_link(cluster, scripts):
    _, delta = transfer(cluster, scripts, 0, 1)
    assert delta["h0"][0] < MiB and delta["h0"][1] < MiB, f"rank 0 -> 1 (both on h0): {delta}"


def test_without_ucx_tls_the_bytes_between_hosts_bypass_the_link(cluster, scripts, capsys):
    """The trap scripts/cluster.py sets UCX_TLS=self,tcp for: UCX sees one machine and uses
    shared memory between "hosts", so the link (and its rate) is never used."""
    seconds, delta = transfer(cluster, scripts, 0, 2, env={"UCX_TLS": None})
    with capsys.disabled():
        print(f"\n  8 MiB h0 -> h1 without UCX_TLS: {seconds * 1e3:.0f} ms, h0 tx +{delta['h0'][0]} B")
    assert delta["h0"][0] < MiB and delta["h1"][1] < MiB, f"without UCX_TLS: {delta}"


# ------------------------------------------------------------------ a host lost mid-run

def test_a_lost_host_ends_the_job_with_a_comm_timeout(cluster, scripts, tmp_path):
    started = tmp_path / "started"
    cut = {}

    def pull_the_cable():
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        cut["at"] = time.monotonic()
        cluster.link_down("h1")

    puller = threading.Thread(target=pull_the_cable, daemon=True)
    puller.start()
    try:
        p = cluster.mpirun(4, [sys.executable, str(scripts / "exchange.py"), str(started)], ppn=2,
                           env={"MINIPAR_COMM_TIMEOUT": "4"}, timeout=60)
        ended = time.monotonic()
    finally:
        puller.join(timeout=70)
        cluster.link_up("h1")
    assert "at" in cut and started.exists(), f"the job never got going:\n{p.stderr[-2000:]}"
    assert pids_inside(cluster, "h1") == [], "the ranks cut off on h1 are still running"
    assert p.returncode != 0, p.stdout
    assert ended - cut["at"] < 30, f"the job took {ended - cut['at']:.1f} s to end after h1 went"
    assert re.search(r"CommTimeout: rank [01]: .* gave up after [4-9]\.\d s waiting to .*rank [23]\b",
                     p.stderr), p.stderr[-3000:]
