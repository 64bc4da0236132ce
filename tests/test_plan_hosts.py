"""The planner across hosts (minipar/plan/hosts.py): bytes inside and across hosts, and time.

- Each algorithm walked message by message (plan_hosts.Placed) sends, with every rank on
  one host, what comm_bytes.py's formulas say (all_reduce_sent & co.), for every rank of p = 1..10
  and messages on both sides of every crossover; across N hosts of k ranks the hierarchical
  collectives follow hierarchical.py's table.
- Against the trainer: `mpirun -n N tests/tools/fake_hosts.sh python -m minipar.train` puts
  rank r on host h(r // K) (K = MINIPAR_RANKS_PER_HOST); the planner given the same flags and
  --ranks-per-host K must equal rank 0's log rows, exactly: "bytes_by_axis" and
  "inter_host_bytes_by_axis" ({ledger axis: bytes sent in the step}, to other hosts), on
  every step after the first; where a layout names an axis, the run's --trace shows the
  hierarchical algorithm on it. Adding a layout is one line of LAYOUTS.
- One host (the default): every across-host byte is 0 and the table is as it was.
- Bad host flags: one line, exit code 2.
"""
import json
import os
import subprocess
import sys

import pytest

from minipar.plan import comm_bytes, hosts as plan_hosts, table
from minipar.show import traceview
from minipar.comm.algorithms import hierarchical

from test_plan import cli
from test_plan_trainer import planner_flags
from trainer_runs import MPIRUN, REPO, TINY_MPI, read_log

FAKE = os.path.join(REPO, "tests", "tools", "fake_hosts.sh")
BIG = ["--n-embd", "64", "--bucket-mb", "16"]          # one 270 KB bucket: above 64 KiB, hierarchical
MOE = ["--moe-experts", "4", "--moe-top-k", "2", "--moe-capacity-factor", "1.5"]   # a capacity: exact bytes

# (ranks, ranks per host, trainer flags, the axis whose large collectives must run hierarchically
# (checked in the run's --trace) or None); ranks 0..K-1 on host h0, K..2K-1 on h1, ...
LAYOUTS = [
    (4, 2, ["--dp", "4", *BIG], "dp"),                                    # dp over 2 hosts x 2 ranks
    (4, 2, ["--dp", "2", "--tp", "2"], None),                             # tp inside a host, dp across
    (4, 1, ["--dp", "2", "--tp", "2"], None),                             # tp across hosts, flat
    (4, 2, ["--tp", "4", "--n-head", "4", "--n-embd", "128", "--dtype", "float64"], "tp"),  # Megatron's
    (4, 2, ["--dp", "2", "--pp", "2", "--n-layer", "2", "--micro-batches", "2",
            "--precision", "bf16"], None),                                # pp across; the world's flag
    (4, 2, ["--dp", "4", "--zero", "1", "--n-embd", "64"], "zero"),       # ZeRO's units: large and small
    (3, 2, ["--dp", "3", "--batch-size", "12", *BIG], "dp"),              # hosts of 2 + 1 ranks
    (4, 2, ["--dp", "2", "--cp", "2"], None),                             # the cp ring inside a host
    (4, 1, ["--dp", "2", "--cp", "2"], None),                             # every ring message across
    (4, 2, ["--dp", "4", "--ep", "4", *MOE], "ep"),                       # small all-to-alls: hierarchical
    (4, 1, ["--dp", "2", "--tp", "2", "--ep", "2", *MOE], None),          # the ep pair on two hosts: pairwise
    (4, 2, ["--arch", "llama", "--ffn-hidden", "24", "--n-head", "4", "--n-kv-head", "2", "--tp", "4"],
     None),                                                               # a shared KV head's sums inside a host
]


def run_plan(*flags):
    args = table.build_parser().parse_args(list(flags))
    cfg, lay, params = table.resolve(args)
    return table.plan(cfg, lay, params, args.device_tflops, plan_hosts.Hosts.from_args(args))


# ---------------------------------------------------------------- message by message

def test_one_host_walk_equals_the_formulas():
    """Placed on one host sends what comm_bytes.Flat's closed forms say, for every rank."""
    for p in range(1, 11):
        for n in (0, 1, 7, 8 * 1024 // 8 + 1, 64 * 1024 // 8, 64 * 1024 // 8 + 1, 100_003):
            for itemsize in (2, 8):
                for r in range(p):
                    g, f = plan_hosts.Placed(range(p), r, p), comm_bytes.Flat(p, r)
                    case = (p, n, itemsize, r)
                    assert g.all_reduce(n, itemsize) == plan_hosts.Traffic(f.all_reduce(n, itemsize)), case
                    assert g.reduce_scatter(n, itemsize).bytes == f.reduce_scatter(n, itemsize), case
                    assert g.all_gather(n, itemsize).bytes == f.all_gather(n, itemsize), case
                    assert g.all_reduce(n, itemsize).inter == 0, case
        for root in range(p):
            for nbytes in (8, 9 << 20):                   # the binomial tree; the pipelined chain
                for r in range(p):
                    got = plan_hosts.Placed(range(p), r, p).broadcast(nbytes // 8, 8, root).bytes
                    assert got == comm_bytes.broadcast_sent(nbytes, p, r, root), (p, root, nbytes, r)


@pytest.mark.parametrize("N,k", [(2, 2), (2, 4), (4, 2), (3, 3)])
def test_hierarchical_follows_its_table(N, k):
    """n bytes on N hosts of k ranks, per rank: all-reduce 2(k-1)/k n inside and
    2(N-1)/N n/k across; reduce-scatter and all-gather half of each (hierarchical.py)."""
    p, n = N * k, 2 ** 16 * 9                              # 9 * 2^16 elements: every piece equal
    for r in range(p):
        g = plan_hosts.Placed(range(p), r, k)
        assert (N, p) == (g.n_nodes, g.size)
        ar, rs, ag = g.all_reduce(n, 4), g.reduce_scatter(n, 4), g.all_gather(n // p, 4)
        b = 4 * n
        assert (ar.intra, ar.inter) == (2 * (k - 1) * b // k, 2 * (N - 1) * b // (N * k)), (r, ar)
        assert (rs.intra, rs.inter) == ((k - 1) * b // k, (N - 1) * b // (N * k)), (r, rs)
        assert (ag.intra, ag.inter) == ((k - 1) * b // k, (N - 1) * b // (N * k)), (r, ag)
        assert len(hierarchical.pieces_of(g, r)) == N        # its own and one per other host
        assert ar.inter_messages == 2 * (N - 1), (r, ar)   # to the N-1 owners, then the N-1 deputies


def test_flat_algorithms_cross_where_their_peers_are():
    """Groups that take the flat algorithms: one rank per host (direct exchange, all of it
    across), small messages (recursive doubling: the rounds whose partner is on the other
    host), hosts of 2 + 1 (the fix-up partner across)."""
    one_each = plan_hosts.Placed([0, 2], 0, 2)               # a dp group of dp2 x tp2 on hosts of 2
    assert one_each.n_nodes == 2 and one_each.all_reduce(10_000, 8) == plan_hosts.Traffic(0, 80_000, 2)
    small = plan_hosts.Placed(range(4), 0, 2).all_reduce(8, 8)     # recursive doubling: r^1 inside, r^2 across
    assert small == plan_hosts.Traffic(8 * 8, 8 * 8, 1)
    uneven = plan_hosts.Placed(range(3), 0, 2)               # 2 + 1: the fix-up partner, rank 2, is across
    assert uneven.all_reduce(1, 8) == plan_hosts.Traffic(8, 8, 1)


# ---------------------------------------------------------------- against the trainer

def fake_hosts_run(n, K, flags, log, trace=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_COMM_TIMEOUT="60",
               MINIPAR_RANKS_PER_HOST=str(K))
    cmd = [MPIRUN, "-n", str(n), FAKE, sys.executable, "-m", "minipar.train", *TINY_MPI, *flags,
           "--steps", "2", "--log", log] + (["--trace", trace] if trace else [])
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("n,K,flags,hier", LAYOUTS, ids=[f"{n}r K={K} " + " ".join(f) for n, K, f, _ in LAYOUTS])
def test_across_host_bytes_equal_what_the_trainer_measures(n, K, flags, hier, tmp_path):
    log, trace = str(tmp_path / "log.jsonl"), str(tmp_path / "trace.json")
    p = fake_hosts_run(n, K, flags, log, trace if hier else None)
    assert p.returncode == 0, p.stderr[-3000:]
    rows, summary = read_log(log)
    assert len(rows) == 2 and summary["hosts"]["rank_host"] == [f"h{r // K}" for r in range(n)]
    r = run_plan(*planner_flags(n, flags), "--ranks-per-host", str(K))
    mine = r["comm_per_stage"][0]                         # rank 0: stage 0, dp rank 0, tp rank 0
    for row in rows[1:]:
        got = {"bytes": row["bytes_by_axis"], "inter": row["inter_host_bytes_by_axis"]}
        want = {"bytes": mine["bytes_by_axis"], "inter": mine["inter_host_bytes_by_axis"]}
        assert got == want, (row["step"], got, want)
        assert row["comm_bytes"] == mine["bytes_per_step"]
    assert sum(mine["inter_host_bytes_by_axis"].values()) == mine["inter_host"]["bytes_per_step"] > 0
    if hier:
        spans = traceview.spans(traceview.load(trace), "comm")
        assert any(e["args"]["algorithm"] == "hierarchical" and e["args"]["axis"] == hier for e in spans)
    tp_spans = summary["hosts"]["tp_spans_hosts"]
    assert (r["hosts"]["tp_spans_hosts"] is not None) == tp_spans
    if tp_spans:
        note = r["hosts"]["tp_spans_hosts"]
        assert note["rank"] == 0 and note["inter_host_tp_bytes"] == rows[-1]["inter_host_bytes_by_axis"]["tp"]
        assert any("the tp group spans hosts" in line for line in r["notes"])


# ---------------------------------------------------------------- one host; the table; the flags

def test_one_host_sends_nothing_across():
    for flags in (["--dp", "4"], ["--dp", "2", "--tp", "2", "--pp", "2", "--n-layer", "2", "--precision", "fp16"],
                  ["--dp", "4", "--zero", "3", "--ranks-per-host", "4"]):
        r = run_plan(*flags)
        assert r["hosts"]["n_hosts"] == 1 and r["hosts"]["inter_bytes_total"] == 0, flags
        for row in r["comm_per_stage"]:
            assert set(row["inter_host"].values()) == {0} and row["inter_host_bytes_by_axis"] == {}, flags
            assert sum(row["bytes_by_axis"].values()) == row["bytes_per_step"], flags


def test_one_host_table_is_unchanged(capsys):
    """No host flag: no host lines; --ranks-per-host alone: the placement and across-host rows."""
    _, out, _ = cli(capsys, "--dp", "2", "--pp", "2")
    assert "hosts:" not in out and "across hosts" not in out and "comm time" not in out
    _, out, _ = cli(capsys, "--dp", "2", "--pp", "2", "--ranks-per-host", "3")
    assert "  hosts: 2, 3 ranks each, the last 1 (rank r on host r // 3)" in out
    assert "sent across hosts" in out and "comm time" not in out


def test_time_is_bytes_over_bandwidth_plus_latency(capsys):
    flags = ["--dp", "4", *BIG, "--ranks-per-host", "2"]
    r = run_plan(*flags, "--inter-node-gbps", "10", "--intra-node-gbps", "100", "--inter-node-latency-us", "5")
    row = r["comm_per_stage"][0]
    dp_inter, dp_msgs = row["inter_host"]["dp"], row["inter_host_messages"]["dp"]
    want = (row["dp"] - dp_inter) * 8 / 100e9 + dp_inter * 8 / 10e9 + dp_msgs * 5e-6
    assert row["seconds"]["dp"] == pytest.approx(want, rel=1e-12) and dp_msgs == 2    # hierarchical: 2 across
    assert row["seconds"]["per_step"] == pytest.approx(sum(row["seconds"][a] for a in plan_hosts.AXES))
    assert r["hosts"]["link_seconds"] == pytest.approx(row["inter_host"]["bytes_per_step"] * 8 / 10e9
                                                       + row["inter_host_messages"]["per_step"] * 5e-6)
    code, out, _ = cli(capsys, *flags, "--inter-node-gbps", "10")
    assert code == 0 and "comm time per step" in out and "bytes inside hosts (no --intra-node-gbps) not timed" in out
    code, out, _ = cli(capsys, *flags, "--inter-node-gbps", "10", "--json")
    assert json.loads(out)["hosts"]["seconds"] == pytest.approx(json.loads(out)["hosts"]["link_seconds"])


def test_tp_across_hosts_is_a_note(capsys):
    code, out, _ = cli(capsys, "--dp", "2", "--tp", "2", "--ranks-per-host", "3")
    assert code == 0
    assert ("note: the tp group spans hosts (1 of 2 tp groups; the first, ranks 2, 3, on hosts 0, 1)"
            in out), out
    _, out, _ = cli(capsys, "--dp", "2", "--tp", "2", "--ranks-per-host", "2")
    assert "tp group spans" not in out


@pytest.mark.parametrize("flags,message", [
    (["--ranks-per-host", "0"], "--ranks-per-host must be >= 1, got 0"),
    (["--ranks-per-host", "two"], "argument --ranks-per-host: invalid int value"),
    (["--inter-node-gbps", "0"], "--inter-node-gbps must be > 0 (Gbit/s), got 0"),
    (["--intra-node-gbps", "-5"], "--intra-node-gbps must be > 0 (Gbit/s), got -5"),
    (["--inter-node-gbps", "nan"], "--inter-node-gbps must be > 0 (Gbit/s), got nan"),
    (["--inter-node-gbps", "10", "--inter-node-latency-us", "-1"], "--inter-node-latency-us must be >= 0, got -1"),
    (["--inter-node-latency-us", "3"], "--inter-node-latency-us needs --inter-node-gbps"),
])
def test_bad_host_flags_exit_2_with_one_line(capsys, flags, message):
    code, out, err = cli(capsys, "--dp", "4", *flags)
    assert code == 2 and out == "", (code, out)
    assert err.count("\n") == 1 and err.startswith("minipar.plan: error: ") and message in err, err
