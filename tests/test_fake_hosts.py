"""The trainer across hosts, emulated by naming each rank's host (tests/tools/fake_hosts.sh sets
MINIPAR_HOST): ranks 0, 1 on h0 and 2, 3 on h1. The dp group then spans hosts and its large
all-reduces run hierarchically; the result still equals the single-process twin, and the
log counts the bytes that left each host. (tests/test_cluster*.py run real network
namespaces where the machine allows it.)
"""
import os
import subprocess
import sys

from minipar.parallel.context import context_parallel
from minipar.plan import context as plan_context, hosts as plan_hosts, table
from minipar.show import traceview
from trainer_runs import MPIRUN, REPO, read_log

FAKE = os.path.join(REPO, "tests", "tools", "fake_hosts.sh")
MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "8",
         "--steps", "2", "--sample", "0", "--dtype", "float64"]


def run(tmp_path, *flags, per_host=2):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_COMM_TIMEOUT="60",
               MINIPAR_RANKS_PER_HOST=str(per_host))
    log, trace = str(tmp_path / "log.jsonl"), str(tmp_path / "trace.json")
    p = subprocess.run([MPIRUN, "-n", "4", FAKE, sys.executable, "-m", "minipar.train", *MODEL, *flags,
                        "--log", log, "--trace", trace], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout, read_log(log), traceview.load(trace)


def test_dp_across_two_hosts_is_hierarchical_and_exact(tmp_path):
    out, (rows, summary), t = run(tmp_path, "--dp", "4", "--verify")
    assert "hosts: 2, h0: ranks 0, 1; h1: ranks 2, 3" in out
    assert "dp group of rank 0: 4 ranks on 2 hosts: its all-reduces" in out
    assert summary["verify"]["ok"] and summary["verify"]["param_rel"] < 1e-12, summary["verify"]
    assert any(e["args"]["algorithm"] == "hierarchical" and e["args"]["axis"] == "dp"
               for e in traceview.spans(t, "comm"))
    assert traceview.audit(t) == []
    row = rows[-1]
    assert 0 < row["inter_host_bytes_by_axis"]["dp"] < row["bytes_by_axis"]["dp"]
    assert summary["hosts"]["rank_host"] == ["h0", "h0", "h1", "h1"]
    assert not summary["hosts"]["tp_spans_hosts"]


def test_tp_across_hosts_warns_and_is_measured(tmp_path):
    out, (rows, summary), _ = run(tmp_path, "--dp", "2", "--tp", "2", per_host=1)
    assert "warning: the tp group of rank 0 spans hosts h0, h1" in out
    assert summary["hosts"]["tp_spans_hosts"]
    assert rows[-1]["inter_host_bytes_by_axis"]["tp"] == rows[-1]["bytes_by_axis"]["tp"] > 0


def test_cp_sits_inside_a_host_and_dp_across(tmp_path):
    """The grid's order puts cp next to tp: with 2 ranks per host, dp 2 x cp 2 keeps each cp
    ring inside a host (no ring byte crosses the link, no warning) and only the gradient sum
    over dp x cp crosses it; --verify holds."""
    out, (rows, summary), t = run(tmp_path, "--dp", "2", "--cp", "2", "--verify")
    assert "warning" not in out and summary["verify"]["ok"], out
    row = rows[-1]
    assert row["bytes_by_axis"]["cp"] > 0 and "cp" not in row["inter_host_bytes_by_axis"], row
    assert row["inter_host_bytes_by_axis"]["dp"] > 0
    assert traceview.audit(t) == []


def test_ep_across_hosts_takes_the_hierarchical_all_to_all(tmp_path):
    """dp 4 x ep 4 on 2 hosts: the ep group spans them, so the capacity path's equal
    all-to-alls (E cap rows of 32 float64s: 48 KiB, under the crossover) run hierarchically
    (hierarchical_alltoall.py); every step's ep bytes still equal ep_bytes (which asks
    hierarchical_alltoall.bytes_sent), and --verify holds."""
    out, (rows, summary), t = run(tmp_path, "--dp", "4", "--ep", "4", "--moe-experts", "4", "--moe-top-k", "2",
                                  "--moe-capacity-factor", "1.5", "--n-embd", "32", "--verify")
    assert summary["verify"]["ok"], out
    for row in rows:
        assert row["bytes_by_axis"]["ep"] == row["ep_theory_bytes"] > 0, row
        assert 0 < row["inter_host_bytes_by_axis"]["ep"] < row["bytes_by_axis"]["ep"]
    algorithms = {e["args"]["algorithm"] for e in traceview.spans(t, "comm") if e["args"]["axis"] == "ep"}
    assert "hierarchical" in algorithms, algorithms     # (validation's larger batches: pairwise)
    assert traceview.audit(t) == []


def test_hybrid_cp_is_ulysses_inside_a_host_and_the_ring_across(tmp_path):
    """--cp-impl hybrid without --cp-ulysses: Ulysses over the 2 cp ranks of each host, the ring
    between the 2 hosts, equal to the twin, its bytes the formula's."""
    out, (rows, summary), t = run(tmp_path, "--cp", "4", "--cp-impl", "hybrid", "--verify")
    cp = summary["context_parallel"]
    assert summary["verify"]["ok"] and cp["impl"] == "hybrid", summary["verify"]
    assert "Ulysses' all-to-alls over U = 2 ranks" in out and "the ring over C/U = 2" in out
    assert cp["bytes_per_step"] == cp["theory_bytes_per_step"] > 0
    assert 0 < rows[-1]["inter_host_bytes_by_axis"]["cp"] < rows[-1]["bytes_by_axis"]["cp"]


def test_ulysses_across_hosts_is_hierarchical_and_its_bytes_are_the_formula(tmp_path):
    """--cp-impl ulysses over 4 ranks on 2 hosts: its small all-to-alls run hierarchically
    (comm.all_to_all_algorithm), which sends more inside a host than pairwise would; the
    summary's formula asks the same dispatcher (context_parallel.Sent), so its bytes are the
    ledger's to the byte, and the planner's (placed on the same hosts) equal them too."""
    out, (rows, summary), t = run(tmp_path, "--cp", "4", "--n-head", "4", "--cp-impl", "ulysses", "--verify")
    cp = summary["context_parallel"]
    assert summary["verify"]["ok"], summary["verify"]
    assert any(e["args"]["algorithm"] == "hierarchical" and e["args"]["axis"] == "cp"
               for e in traceview.spans(t, "comm"))
    assert cp["bytes_per_step"] == cp["theory_bytes_per_step"] > 0
    args = table.build_parser().parse_args([*MODEL[:-6], "--dtype", "float64", "--n-head", "4", "--cp", "4", "--cp-impl", "ulysses"])
    cfg, lay, _ = table.resolve(args)
    one_host = context_parallel.step_traffic(2, 1, 8, 32, 4, cfg, 1, 8, impl="ulysses")[1]
    assert cp["theory_bytes_per_step"] != one_host        # the hierarchy's, not the one-host formula's
    planned = plan_context.compare(cfg, lay, plan_hosts.Hosts(2))
    assert {r["impl"]: r for r in planned}["ulysses"]["bytes_per_step"] == cp["bytes_per_step"]
