"""scripts/bench_cp.py, its smallest form (--quick: C 64, T 256, B 2): one process and every
--cp-impl at cp 2 and 4, one row each, and every row's cp bytes per step equal to the trainer's
formula (ratio 1.000000: the bytes do not depend on the timing); on the emulated cluster (root,
tests/cluster_fixture.py's conditions) hybrid's two placements, and nothing of its cluster left
after it, or else one line saying the cluster rows are skipped; bad flags: one line, exit 2.
No figure of time is asserted."""
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "bench_cp.py")
sys.path.insert(0, os.path.join(REPO, "scripts"))
import cluster  # noqa: E402  (scripts/cluster.py)

IMPLS = ["ring", "ulysses", "allgather", "hybrid"]


def bench(*flags, timeout=240):
    """Run the script -> (exit code, stdout, stderr); past the timeout it gets SIGTERM (it then
    removes its cluster) and the test fails."""
    p = subprocess.Popen([sys.executable, SCRIPT, *flags], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        out, err = p.communicate(timeout=60)
        pytest.fail(f"bench_cp.py {' '.join(flags)} ran past {timeout} s:\n{err[-3000:]}")
    return p.returncode, out, err, p.pid


def table(out: str, head: str, row: str) -> list[tuple]:
    """The rows under the header that starts with `head` (then a line of dashes), each
    re.fullmatch(row, line).groups(), until a line that does not match."""
    lines = out.splitlines()
    i = next((k for k, line in enumerate(lines) if line.startswith(head)), None)
    assert i is not None, f"no table headed {head!r} in:\n{out}"
    assert set(lines[i + 1]) == {"-"}, lines[i + 1]
    rows = []
    for line in lines[i + 2:]:
        m = re.fullmatch(row, line)
        if not m:
            break
        rows.append(m.groups())
    return rows


NUMBER = r"\s+(-?[\d.,]+|-)"


def test_every_implementation_at_cp_2_and_4_beside_one_process():
    code, out, err, _ = bench("--quick", "--no-cluster")
    assert code == 0, err[-3000:]
    rows = table(out, "impl ", r"(-|\w+)\s+(\d)" + NUMBER * 9)
    assert [(r[0], int(r[1])) for r in rows] == [("-", 1)] + [(i, cp) for cp in (2, 4) for i in IMPLS], out
    for impl, cp, step, speedup, wait, sent, formula, ratio, act, act_formula, act_ratio in rows:
        assert float(step) > 0 and float(speedup) > 0 and float(wait) >= 0 and float(act) > 0, out
        if cp == "1":
            assert (float(speedup), sent, formula, ratio) == (1.0, "0", "0", "-"), out
        else:
            assert ratio == "1.000000" and sent == formula, (impl, cp, out)
        assert act_formula == "-" or float(act_formula) > 0, out
    assert "oversubscribed" in out or len(os.sched_getaffinity(0)) >= 4
    assert "cluster rows" not in out


def test_the_cluster_rows_and_nothing_left_of_the_cluster():
    why = cluster.unavailable()
    if why:
        pytest.skip(why)
    code, out, err, pid = bench("--quick", "--impls", "hybrid", "--steps", "1")
    assert code == 0, err[-3000:]
    rows = table(out, "impl      placement", r"(\w+)\s+(2x2|round robin)" + NUMBER * 7)
    assert [(r[0], r[1]) for r in rows] == [("hybrid", "2x2"), ("hybrid", "round robin")], out
    for row in rows:
        assert row[5] == "1.000000" and float(row[6]) > 0, out          # the ratio; bytes that crossed
    assert not [ns for ns in cluster.namespaces() if ns.startswith(f"mpc-b{pid}-")]
    assert not os.path.isdir("/etc/netns") or not [d for d in os.listdir("/etc/netns") if d.startswith(f"mpc-b{pid}-")]


NO_NAMESPACES = """
import sys
sys.path.insert(0, {scripts!r})
import cluster
cluster.unavailable = lambda: "no namespaces here (the test's stand-in)"
import bench_cp
sys.argv = ["bench_cp.py", "--quick", "--impls", "ring", "--steps", "1"]
bench_cp.main()
"""


def test_without_namespaces_one_line_says_the_cluster_rows_are_skipped():
    p = subprocess.run([sys.executable, "-c", NO_NAMESPACES.format(scripts=os.path.dirname(SCRIPT))], cwd=REPO,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "\ncluster rows skipped: no namespaces here (the test's stand-in)\n" in p.stdout, p.stdout
    rows = table(p.stdout, "impl ", r"(-|\w+)\s+(\d)" + NUMBER * 9)
    assert [r[:2] for r in rows] == [("-", "1"), ("ring", "2"), ("ring", "4")], p.stdout
    assert "placement" not in p.stdout


@pytest.mark.parametrize("flags", [["--steps", "0"], ["--steps", "nan"], ["--impls", "rings"],
                                   ["--rate", "fast"], ["--timeout", "inf"]])
def test_a_bad_flag_is_one_line_and_exit_2(flags):
    p = subprocess.run([sys.executable, SCRIPT, *flags], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout)
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith("bench_cp.py: error: "), p.stderr
