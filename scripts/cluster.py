"""An emulated cluster on one machine: each host a network namespace, the hosts joined by a
bridge, every host's link rate-limited. MPI jobs run on it as on real hosts (docs/cluster.md).

    python scripts/cluster.py up [--hosts 2] [--ranks-per-host 2] [--rate 1gbit] [--burst 256kb]
    python scripts/cluster.py status
    python scripts/cluster.py run [--down-after] -- -n 4 python -m minipar.train --dp 2 --pp 2
    python scripts/cluster.py down          # removes everything named mpc-*, whoever left it

    import cluster                          # tests: sys.path.insert(0, "scripts")
    with cluster.Cluster(hosts=2, rate="1gbit") as c:
        p = c.mpirun(4, ["python", "-m", "minipar.train", "--dp", "2"], ppn=2, timeout=300)
        c.counters()                        # {"h0": (tx_bytes, rx_bytes), "h1": (...)}
        c.link_down("h1")                   # pull h1's cable; c.link_up("h1") plugs it back

What is built (prefix mpc-, hosts h0 .. h{N-1}):

    namespace mpc-sw    the switch: bridge br0, one port per host (named h0, h1, ...); the
                        egress of port hN is hN's downlink: tbf at `rate`
    namespace mpc-hN    the host: lo, and eth0 = 10.213.0.(10+N)/24, a veth whose other end
                        is the switch's port hN; eth0's egress is hN's uplink: tbf at `rate`
    /etc/netns/mpc-hN/  hosts (every host's name -> its address, and localhost) and an empty
                        resolv.conf: `ip netns exec` bind-mounts them over /etc's
    nothing else        no address, link or route in the machine's own namespace, so no
                        packet of the cluster can leave it, and none can come in

So each host has a full-duplex link of `rate`: a 1 Gbit/s NIC on a non-blocking switch.

How a job starts: mpiexec (MPICH's Hydra) runs inside h0's namespace under the hostname
h0, started by scripts/netns_exec exactly as it starts the other hosts' proxies, and the
command line is

    MINIPAR_CLUSTER_PREFIX=mpc- UCX_TLS=self,tcp scripts/netns_exec h0 \\
        mpiexec -launcher rsh -launcher-exec scripts/netns_exec -genvall -hosts h0:2,h1:2 -n 4 CMD

Hydra starts the proxy of a host that is not itself as if over ssh: `netns_exec [options]
h1 hydra_pmi_proxy --control-port h0:PORT ...`; netns_exec enters mpc-h1 with a UTS
namespace of its own named h1 (so socket.gethostname() and MPI_Get_processor_name say h1),
and the proxy calls back to h0, which mpc-h1's /etc/hosts resolves to 10.213.0.10.
-hosts h0:2,h1:2 puts ranks 0,1 on h0 and 2,3 on h1: neighbouring ranks share a host.

The traps this respects (measured here; tests/test_cluster.py checks the first with the
link counters):
- UCX, the mpich wheel's default netmod, sees one machine and moves "cross-host" messages
  through shared memory: 8 MiB from h0 to h1 moved h0's tx counter by 17 KB (set-up only)
  and took 8 ms. UCX_TLS=self,tcp in every rank's environment sends them through eth0
  (+8.44 MB on h0's tx and h1's rx, 76 ms at 1gbit).
- tbf's burst: at 1gbit, with four polling ranks on two cores, a burst of 64kb reached
  62 MB/s (median; 45-92), 256kb 108 MB/s (67-117), of 125. The default burst is 256kb.

Cleaning up: `down` (and a Cluster's exit, normal or not) kills every process still inside
its namespaces (they can only be the cluster's), deletes the namespaces (that removes the
veths and the bridge with them) and the /etc/netns directories. After each job, what is
left of that job on any host (marked by MINIPAR_CLUSTER_JOB in its environment) is killed.
`python scripts/cluster.py down` sweeps everything named with the prefix, including what a
killed process left behind.
Every command this script runs has a timeout; a job that outlives its own is killed, with
everything it started on every host.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETNS_EXEC = os.path.join(REPO, "scripts", "netns_exec")
PREFIX = "mpc-"                 # every name this script creates starts with it
SUBNET = "10.213.0"             # host hN is SUBNET.(10+N)/24
IFACE = "eth0"                  # each host's link, inside its namespace
SWITCH = "sw"                   # the switch's namespace: PREFIX + SWITCH
BRIDGE = "br0"                  # inside the switch's namespace
TBF_LATENCY = "50ms"            # how long a packet may queue in tbf before it is dropped
CMD_TIMEOUT = 30                # seconds, for every ip / tc / kill command
# What every rank of a job gets (the caller's env overrides; a value None removes the name):
RANK_ENV = {
    "UCX_TLS": "self,tcp",      # without it UCX takes shared memory between "hosts"
    "OMP_NUM_THREADS": "1",     # several ranks per core: one BLAS thread each
    "OPENBLAS_NUM_THREADS": "1",
}


class ClusterError(RuntimeError):
    """Building, using or removing the emulated cluster failed."""


def sh(*argv, timeout=CMD_TIMEOUT, check=True):
    """Run one command (a list of words) with a timeout; -> its stdout."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{shlex.join(argv)}` took more than {timeout} s") from None
    if check and p.returncode != 0:
        raise ClusterError(f"`{shlex.join(argv)}` exited {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, a missing tool, no permission); None if
    they can."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs `{tool}`, which is not installed"
    try:
        p = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True,
                           timeout=CMD_TIMEOUT)
    except subprocess.TimeoutExpired:
        return "`unshare --net --uts true` hung"
    if p.returncode != 0:
        return f"cannot create namespaces here: {p.stderr.strip() or 'unshare failed'}"
    return None


def rate_bytes_per_s(rate: str) -> float:
    """A tc rate ("1gbit", "100mbit", "125mbps") in bytes per second; tc's rates are SI."""
    m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit, gbit (or bps)")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * scale / (8 if m.group(3) == "bit" else 1)


def size_bytes(size: str) -> int:
    """A tc size ("256kb", "64k", "1mb", "1500") in bytes; tc's sizes are binary."""
    m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)b?", size.strip().lower())
    if not m:
        raise ValueError(f"size {size!r}: expected a number and b, kb or mb")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)])


# ---------------------------------------------------------------------------------------------
# What exists: namespaces, processes in them, /etc/netns directories.

def namespaces() -> list[str]:
    return [entry["name"] for entry in json.loads(sh("ip", "-j", "netns", "list") or "[]")]


def job_of(pid: int) -> bytes | None:
    """The MINIPAR_CLUSTER_JOB value in process pid's environment (None: none, or it is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    return next((v[len(b"MINIPAR_CLUSTER_JOB="):] for v in env if v.startswith(b"MINIPAR_CLUSTER_JOB=")), None)


def kill_inside(ns: str, job: str | None = None, wait: float = 5.0) -> list[int]:
    """SIGKILL the processes inside namespace ns: all of them, or only job's (those whose
    environment has MINIPAR_CLUSTER_JOB=job: mpiexec, the proxies and the ranks of one
    run_mpiexec). Waits up to `wait` s until they are gone; -> those that are not."""
    deadline = time.monotonic() + wait
    while True:
        pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).split()]
        if job is not None:
            pids = [p for p in pids if job_of(p) == job.encode()]
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def remove(names: list[str]):
    """Kill what runs inside the namespaces `names`, delete them and their /etc/netns
    directories. Goes on past errors, then raises them all."""
    errors = []
    for ns in names:
        try:
            left = kill_inside(ns)
            if left:
                errors.append(f"{ns}: processes {left} would not die")
        except ClusterError as e:
            errors.append(str(e))
    for ns in names:
        if ns in namespaces():
            try:
                sh("ip", "netns", "del", ns)
            except ClusterError as e:
                errors.append(str(e))
        shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)
    try:
        os.rmdir("/etc/netns")          # made by the first `up`; left alone while not empty
    except OSError:
        pass
    if errors:
        raise ClusterError("; ".join(errors))


def down(prefix: str = PREFIX):
    """Remove every namespace, /etc/netns directory and link whose name starts with prefix:
    this script's clusters, the tests' too, and whatever a killed run left behind."""
    names = [ns for ns in namespaces() if ns.startswith(prefix)]
    etc = [d for d in os.listdir("/etc/netns") if d.startswith(prefix)] if os.path.isdir("/etc/netns") else []
    remove(sorted(set(names) | set(etc)))
    for link in json.loads(sh("ip", "-j", "link", "show", check=False) or "[]"):
        if link["ifname"].startswith(prefix):       # none is ever made there: a sweep all the same
            sh("ip", "link", "del", link["ifname"], check=False)
    return names


# ---------------------------------------------------------------------------------------------
# The cluster.

class Cluster:
    """An emulated cluster: `hosts` namespaces on a switch, each link `rate` each way.

    with Cluster(hosts=2, rate="1gbit") as c: ...   builds it, and removes it on leaving
    Cluster.attach() -> the cluster `up` built (status, run); its exit leaves it up.

    prefix: the names it creates start with it (namespaces prefix+"h0", ..., prefix+"sw");
    two clusters with different prefixes are fully separate networks.
    """

    def __init__(self, hosts: int = 2, ranks_per_host: int = 2, rate: str = "1gbit",
                 burst: str = "256kb", prefix: str = PREFIX):
        if hosts < 1 or hosts > 200:
            raise ValueError(f"hosts must be 1..200, got {hosts}")
        rate_bytes_per_s(rate), size_bytes(burst)       # refuse a bad value before building
        self.hosts = [f"h{i}" for i in range(hosts)]
        self.ranks_per_host = ranks_per_host
        self.rate, self.burst, self.prefix = rate, burst, prefix
        self.owned = True               # leaving the `with` removes it

    @classmethod
    def attach(cls, prefix: str = PREFIX, ranks_per_host: int = 2) -> "Cluster":
        """The cluster that is up under `prefix` (hosts, rate and burst read from the system)."""
        found = sorted((int(m.group(1)) for ns in namespaces()
                        if (m := re.fullmatch(re.escape(prefix) + r"h(\d+)", ns))))
        if not found or prefix + SWITCH not in namespaces():
            raise ClusterError(f"no cluster is up under the prefix {prefix!r}")
        c = cls(hosts=len(found), ranks_per_host=ranks_per_host, prefix=prefix)
        tbf = c.qdisc(c.ns("h0"), IFACE)
        if tbf:
            c.rate = f"{tbf['rate'] * 8 / 1e6:g}mbit"
            c.burst = f"{round(tbf['burst'] / 1024)}kb"
        c.owned = False
        return c

    def ns(self, host: str) -> str:
        return self.prefix + host

    def address(self, host: str) -> str:
        return f"{SUBNET}.{10 + self.hosts.index(host)}"

    def names(self) -> list[str]:
        """The namespaces this cluster is made of."""
        return [self.ns(h) for h in self.hosts] + [self.prefix + SWITCH]

    def is_up(self) -> bool:
        return any(ns in namespaces() for ns in self.names())

    # --- building and removing -------------------------------------------------------------

    def up(self) -> "Cluster":
        """Build it; on any failure remove what was built and raise."""
        if self.is_up():
            raise ClusterError(f"a cluster is already up under {self.prefix!r}: "
                               f"`python scripts/cluster.py down --prefix {self.prefix}` first")
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self):
        switch = self.prefix + SWITCH
        for ns in self.names():
            sh("ip", "netns", "add", ns)
            # no IPv6: its router solicitations and neighbour discovery would add bytes
            # to the link counters that no MPI message sent
            for key in ("all", "default"):
                sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "-n", switch, "link", "set", BRIDGE, "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{self.address(h)} {h}\n" for h in self.hosts)
        for h in self.hosts:
            ns = self.ns(h)
            # one cable: eth0 in the host, port h on the switch
            sh("ip", "link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", h, "netns", switch)
            sh("ip", "-n", switch, "link", "set", h, "master", BRIDGE, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", IFACE)
            sh("ip", "-n", ns, "link", "set", IFACE, "up")
            self._tbf(ns, IFACE, "add")         # h's uplink
            self._tbf(switch, h, "add")         # h's downlink
            etc = os.path.join("/etc/netns", ns)
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(hosts_file)
            with open(os.path.join(etc, "resolv.conf"), "w") as f:
                f.write("# the emulated cluster has no name server: names are in /etc/hosts\n")

    def _tbf(self, ns, dev, verb):
        sh("tc", "-n", ns, "qdisc", verb, "dev", dev, "root", "tbf", "rate", self.rate,
           "burst", self.burst, "latency", TBF_LATENCY)

    def set_rate(self, rate: str, burst: str | None = None):
        """Change every link's rate (and burst) on the running cluster."""
        rate_bytes_per_s(rate)
        self.rate, self.burst = rate, burst or self.burst
        for h in self.hosts:
            self._tbf(self.ns(h), IFACE, "change")
            self._tbf(self.prefix + SWITCH, h, "change")

    def down(self):
        """Remove it: processes inside, namespaces (veths and bridge go with them), /etc/netns."""
        atexit.unregister(self.down)
        remove(self.names())

    def __enter__(self):
        self.up()
        atexit.register(self.down)      # for an exit that skips __exit__ (sys.exit in a thread...)
        return self

    def __exit__(self, *exc):
        if self.owned:
            self.down()

    # --- looking at it ---------------------------------------------------------------------

    def counters(self) -> dict[str, tuple[int, int]]:
        """{host: (tx_bytes, rx_bytes)} of each host's eth0, since the cluster was built."""
        out = {}
        for h in self.hosts:
            stats = json.loads(sh("ip", "-n", self.ns(h), "-j", "-s", "link", "show", "dev", IFACE))
            s = stats[0]["stats64"]
            out[h] = (s["tx"]["bytes"], s["rx"]["bytes"])
        return out

    def qdisc(self, ns, dev) -> dict | None:
        """The tbf options on dev in ns ({"rate": bytes/s, "burst": bytes, ...}), or None."""
        for q in json.loads(sh("tc", "-n", ns, "-j", "qdisc", "show", "dev", dev) or "[]"):
            if q.get("kind") == "tbf":
                return q["options"]
        return None

    def link_down(self, host: str):
        """Take host's eth0 down: nothing goes in or out any more, as with a pulled cable."""
        sh("ip", "-n", self.ns(host), "link", "set", IFACE, "down")

    def link_up(self, host: str):
        sh("ip", "-n", self.ns(host), "link", "set", IFACE, "up")

    def status(self) -> str:
        lines = [f"cluster {self.prefix}*: {len(self.hosts)} hosts on {self.prefix}{SWITCH}'s {BRIDGE}"]
        counters = self.counters()
        for h in self.hosts:
            up = self.qdisc(self.ns(h), IFACE)
            dn = self.qdisc(self.prefix + SWITCH, h)
            state = json.loads(sh("ip", "-n", self.ns(h), "-j", "link", "show", "dev", IFACE))[0]["operstate"]
            pids = sh("ip", "netns", "pids", self.ns(h), check=False).split()

            def rate(q):
                return f"{q['rate'] * 8 / 1e6:g} Mbit/s (burst {round(q['burst'] / 1024)} KiB)" if q else "unlimited"
            tx, rx = counters[h]
            lines.append(f"  {h:4} {self.address(h):13} {IFACE} {state:5} up {rate(up)}, down {rate(dn)}; "
                         f"tx {tx / 1e6:.1f} MB, rx {rx / 1e6:.1f} MB; {len(pids)} processes")
        return "\n".join(lines)

    # --- running jobs ----------------------------------------------------------------------

    def placement(self, ppn: int | None = None, hosts=None) -> list[str]:
        """Hydra's -hosts: [("h0", 2), ("h1", 1)] -> h0:2,h1:1; else ppn (default
        ranks_per_host) on every host. Hydra fills each host's slots before the next, so
        neighbouring ranks share a host."""
        if hosts is None:
            hosts = [(h, ppn or self.ranks_per_host) for h in self.hosts]
        unknown = [h for h, _ in hosts if h not in self.hosts]
        if unknown:
            raise ValueError(f"hosts {unknown} are not in the cluster ({', '.join(self.hosts)})")
        return ["-hosts", ",".join(f"{h}:{k}" for h, k in hosts)]

    def environment(self, env: dict | None = None, job: str = "") -> dict:
        """mpiexec's environment (every rank's, by -genvall): ours, RANK_ENV, then env."""
        out = dict(os.environ)
        out["MINIPAR_CLUSTER_JOB"] = job                        # marks the job's processes
        out["PATH"] = os.path.dirname(sys.executable) + os.pathsep + out.get("PATH", "")  # `python`: ours
        out["MINIPAR_CLUSTER_PREFIX"] = self.prefix             # which namespaces netns_exec enters
        for k, v in {**RANK_ENV, **(env or {})}.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = str(v)
        return out

    def mpiexec_argv(self, args: list[str]) -> list[str]:
        """The whole command line: netns_exec h0 mpiexec <launcher options> args."""
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        if not os.path.exists(mpiexec):
            mpiexec = shutil.which("mpiexec") or "mpiexec"
        inner = [mpiexec, "-launcher", "rsh", "-launcher-exec", NETNS_EXEC, "-genvall", *args]
        return [NETNS_EXEC, self.hosts[0], shlex.join(inner)]   # netns_exec, as ssh, runs a string

    def mpirun(self, n: int | None, argv: list[str], *, ppn: int | None = None, hosts=None,
               env: dict | None = None, timeout: float = 300, cwd: str = REPO, capture: bool = True,
               mpi_args: list[str] = ()) -> subprocess.CompletedProcess:
        """Run argv on n ranks (default: every slot of the placement); -> CompletedProcess
        (stdout and stderr as text if capture). A job still running after `timeout` seconds
        is killed on every host, then subprocess.TimeoutExpired is raised."""
        placement = self.placement(ppn, hosts)
        if n is None:
            n = sum(int(s.split(":")[1]) for s in placement[1].split(","))
        return self.run_mpiexec([*placement, *mpi_args, "-n", str(n), *argv], env=env,
                                timeout=timeout, cwd=cwd, capture=capture)

    def run_mpiexec(self, args: list[str], *, env=None, timeout: float = 300, cwd: str = REPO,
                    capture: bool = True) -> subprocess.CompletedProcess:
        """mpiexec with these arguments (placement included) inside the cluster."""
        argv = self.mpiexec_argv(args)
        job = f"{os.getpid()}-{time.monotonic_ns()}"
        pipe = subprocess.PIPE if capture else None
        proc = subprocess.Popen(argv, cwd=cwd, env=self.environment(env, job), stdout=pipe, stderr=pipe,
                                text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=CMD_TIMEOUT)
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from e
        except BaseException:           # Ctrl-C: the job goes with us
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=CMD_TIMEOUT)
            raise
        finally:
            # whatever the job left on any host (a proxy cut off from mpiexec, its ranks);
            # another job running on the cluster at the same time is not touched
            for h in self.hosts:
                kill_inside(self.ns(h), job)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# ---------------------------------------------------------------------------------------------
# The command line.

PLACEMENT_FLAGS = ("-hosts", "-host", "-f", "-hostfile", "-machinefile")


def cli_run(args) -> int:
    """`run -- <mpiexec args>`: bring the cluster up if needed, run, maybe take it down."""
    mpi = args.mpi[1:] if args.mpi[:1] == ["--"] else args.mpi
    if not mpi:
        print("cluster.py run: nothing to run; e.g. run -- -n 4 python -m minipar.train --dp 2 --pp 2",
              file=sys.stderr)
        return 2
    probe = Cluster(args.hosts, args.ranks_per_host, args.rate, args.burst, args.prefix)
    c = Cluster.attach(args.prefix, args.ranks_per_host) if probe.is_up() else probe.up()
    try:
        if not any(a in PLACEMENT_FLAGS for a in mpi):
            mpi = (["-hosts", ",".join(c.hosts)] if "-ppn" in mpi else c.placement()) + mpi
        print(f"cluster.py: {shlex.join(c.mpiexec_argv(mpi))}", file=sys.stderr)
        return c.run_mpiexec(mpi, timeout=args.timeout, capture=False).returncode
    except subprocess.TimeoutExpired:
        print(f"cluster.py: the job ran past --timeout {args.timeout:g} s and was killed", file=sys.stderr)
        return 124
    finally:
        if args.down_after:
            c.down()


def build_parser():
    p = argparse.ArgumentParser(description="An emulated multi-host cluster on one machine "
                                            "(network namespaces); docs/cluster.md.")
    sub = p.add_subparsers(dest="command", required=True)

    def shape(q):
        q.add_argument("--hosts", type=int, default=2, help="how many hosts (default 2)")
        q.add_argument("--ranks-per-host", type=int, default=2,
                       help="slots per host when the job gives no placement (default 2)")
        q.add_argument("--rate", default="1gbit", help="each host's link, each way (tc rate; default 1gbit)")
        q.add_argument("--burst", default="256kb", help="tbf's bucket (default 256kb; 64kb starves)")

    for name, text in (("up", "build the cluster"), ("down", "remove it (everything named PREFIX*)"),
                       ("status", "hosts, rates, counters"), ("run", "run mpiexec on it")):
        q = sub.add_parser(name, help=text)
        q.add_argument("--prefix", default=PREFIX, help=f"names start with it (default {PREFIX})")
        if name in ("up", "run"):
            shape(q)
        if name == "run":
            q.add_argument("--down-after", action="store_true", help="take the cluster down afterwards")
            q.add_argument("--timeout", type=float, default=3600, help="kill the job after this (s)")
            q.add_argument("mpi", nargs=argparse.REMAINDER, help="-- then mpiexec's arguments")
    return p


def interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    reason = unavailable() if args.command in ("up", "run") else None
    if reason:
        print(f"cluster.py: {reason}", file=sys.stderr)
        return 1
    # SIGTERM as Ctrl-C: the `finally`s run, so --down-after and a half-built cluster clean up
    signal.signal(signal.SIGTERM, interrupt)
    try:
        if args.command == "up":
            c = Cluster(args.hosts, args.ranks_per_host, args.rate, args.burst, args.prefix).up()
            print(c.status())
        elif args.command == "down":
            gone = down(args.prefix)
            print(f"removed {', '.join(gone)}" if gone else f"nothing named {args.prefix}* was up")
        elif args.command == "status":
            print(Cluster.attach(args.prefix).status())
        else:
            return cli_run(args)
    except ClusterError as e:
        print(f"cluster.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
