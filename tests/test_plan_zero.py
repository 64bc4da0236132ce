"""The planner's ZeRO shard groups (--shard-group S|host, minipar/plan/shards.py): hybrid
sharding's memory and bytes held to ZeRO's own formulas and to the trainer.

- memory: zero.formula with S in place of N, each unit padded to a multiple of N = dp*cp
  (units.unit_names of param_specs, units.padded), for every stage and S; --params too; the
  trainer's memory check counts an unresolved "host" flat and a number as S;
- bytes on one host: formulas.traffic_theory(stage, P_pad, S, s, M, R) where every shard is
  above 64 KiB (the bandwidth algorithms); across hosts: the planner's message walk
  (hosts.Placed) equals comm.sent, the trainer's formula, inside and across, for every S;
- the comparison: its candidates, its rows equal to the plan of that shard group, the
  recommendation (least time among those that fit --memory-budget), the table;
- the trainer: one `mpirun -n 4` on emulated hosts of 2 ranks (tests/tools/fake_hosts.sh),
  --zero 3 --shard-group host: the planner's memory, ZeRO bytes and bytes across hosts equal
  the summary's and the log rows';
- bad flags: one line, exit code 2.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minipar.comm import sent as comm_sent
from minipar.config import flags as config
from minipar.model.gpt import GPTConfig, param_specs
from minipar.parallel.zero import formulas, units as zero_units
from minipar.plan import memory, shards, table

from test_plan import cli
from trainer_runs import MPIRUN, REPO, TINY_MPI, read_log

FAKE = os.path.join(REPO, "tests", "tools", "fake_hosts.sh")
SMALL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "18", "--block-size", "16", "--batch-size", "32"]
BIG = ["--n-layer", "2", "--n-head", "4", "--n-embd", "256", "--block-size", "256", "--batch-size", "32"]


def plan_json(capsys, *flags) -> dict:
    code, out, err = cli(capsys, *flags, "--json")
    assert code == 0, err
    return json.loads(out)


def padded_units(flags, N) -> tuple[int, int]:
    """(P, P_pad) of a one-stage, tp 1 device, from the model's names: the trainer's units."""
    cfg, _, _ = table.resolve(table.build_parser().parse_args(list(flags)))
    size = {n: int(np.prod(shape)) for n, shape, _ in param_specs(cfg)}
    units = zero_units.unit_names(list(size), cfg.family)
    return sum(size.values()), sum(zero_units.padded(sum(size[n] for n in u), N) for u in units)


# ---------------------------------------------------------------- memory

@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_is_the_formula_with_S(capsys, stage):
    P, P_pad = padded_units(SMALL, 8)
    assert P_pad > P                                       # the padding to N = 8 shows
    seen = {}
    for S in (1, 2, 4, 8):
        flags = [*SMALL, "--dp", "8", "--zero", str(stage), "--dtype", "float64"]
        r = plan_json(capsys, *flags, *(["--shard-group", str(S)] if S < 8 else []))
        mem = r["memory_per_stage"][0]
        f = formulas.formula(stage, P, P_pad, S, 8, 16)
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (f["params"], f["grads"], f["optimizer"]), S
        assert mem["params_padded"] == P_pad
        seen[S] = mem["model_states"]
    assert seen[1] > seen[2] > seen[4] > seen[8], seen    # every S counts


def test_params_alone_shards_over_S(capsys):
    r = plan_json(capsys, "--params", "1000003", "--dp", "8", "--zero", "3", "--shard-group", "2")
    P_pad = zero_units.padded(1000003, 8)
    assert r["memory"]["model_states"] == 16 * P_pad // 2 and P_pad % 2 == 0


def test_memory_check_counts_host_flat_and_a_number_as_S():
    """check_fits before the hosts are known: "host" as flat ZeRO, S as S."""
    cfg, lay, _ = table.resolve(table.build_parser().parse_args([*SMALL, "--dp", "8", "--zero", "3"]))
    flat, one = memory.peak_memory(cfg, lay), memory.peak_memory(cfg, lay.but(shard_group=1))
    assert memory.peak_memory(cfg, lay.but(shard_group="host")) == flat < one
    args = config.build_parser().parse_args(["--max-memory", str((flat + one) // 2)])
    memory.check_fits(args, cfg, lay.but(shard_group="host"))
    with pytest.raises(config.ConfigError, match="needs .* per rank by the planner's count"):
        memory.check_fits(args, cfg, lay.but(shard_group=1))


# ---------------------------------------------------------------- bytes

@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_host_bytes_are_the_closed_form(capsys, stage):
    """Every shard above 64 KiB: reduce-scatters and all-gathers (S-1)/S, the replicas'
    all-reduce 2(R-1)/R of the shard (formulas.traffic_theory)."""
    _, P_pad = padded_units(BIG, 8)
    for S in (1, 2, 4, 8):
        r = plan_json(capsys, *BIG, "--dp", "8", "--zero", str(stage), "--micro-batches", "2",
                      *(["--shard-group", str(S)] if S < 8 else []))
        want = formulas.traffic_theory(stage, P_pad, S, 4, 2, 8 // S)
        assert r["comm_per_stage"][0]["dp"] == pytest.approx(want, rel=1e-12), S


def test_the_tied_embedding_exchange_is_the_shard_of_S(capsys):
    """--pp: the two ends swap their ZeRO shard of wte's gradient (stage.sync_tied_embedding,
    sync.tied_grad): n_pad/S elements, not n_pad/N."""
    flags = [*SMALL, "--dp", "4", "--pp", "2", "--zero", "1", "--micro-batches", "2", "--dtype", "float64"]
    n_pad = zero_units.padded(256 * 18, 4)
    flat = plan_json(capsys, *flags)["comm_per_stage"][0]["pp"]
    for S in (1, 2):
        pp = plan_json(capsys, *flags, "--shard-group", str(S))["comm_per_stage"][0]["pp"]
        assert pp - flat == 8 * (n_pad // S - n_pad // 4) > 0, S


class Stand:
    """A group as comm.sent reads it: world ranks on hosts of K."""

    def __init__(self, world_ranks, rank, K):
        first = {}
        self.nodes = tuple(first.setdefault(w // K, len(first)) for w in world_ranks)
        self.size, self.rank, self.n_nodes, self.node = len(self.nodes), rank, len(first), self.nodes[rank]
        self.remote = tuple(n != self.node for n in self.nodes)


@pytest.mark.parametrize("model,tp", [(SMALL, 1), (BIG, 1), (BIG, 2)])
def test_across_hosts_equals_comm_sent(capsys, model, tp):
    """dp 16 on hosts of 4 ranks (tp 2: dp 8, 2 of a gradient group on a host): the planner's
    walk inside and across equals the trainer's formula, comm.sent of formulas.calls_of, for
    every S; the hierarchical, direct, ring, Bruck and doubling algorithms all meet."""
    N = 16 // tp
    cfg, _, _ = table.resolve(table.build_parser().parse_args([*model, "--tp", str(tp)]))
    from minipar.plan.layout import device_tensors, zero_units as plan_units
    for S in shards.candidates(N, None):
        r = plan_json(capsys, *model, "--world", "16", "--tp", str(tp), "--zero", "2", "--micro-batches", "2",
                      "--ranks-per-host", "4", *(["--shard-group", str(S)] if S < N else []))
        _, lay, _ = table.resolve(table.build_parser().parse_args([*model, "--world", "16", "--tp", str(tp),
                                                                   "--zero", "2"]))
        units = plan_units(device_tensors(cfg, lay, 0), N, cfg.family)
        grad = [d * tp for d in range(N)]                 # the gradient group of rank 0
        shard, replicas = Stand(grad[:S], 0, 4), Stand(grad[::S], 0, 4)
        inside = across = 0
        for n in units:
            unit = type("U", (), {"n_pad": n, "shard_size": n // S, "group": shard,
                                  "replicas": replicas if S < N else None})
            for op, group, x, calls in formulas.calls_of(2, unit, 4, 2):
                a, b = comm_sent.sent(op, group, x)
                inside, across = inside + calls * a, across + calls * b
        row = r["comm_per_stage"][0]
        assert (row["dp"] - row["inter_host"]["dp"], row["inter_host"]["dp"]) == (inside, across), (S, tp)


# ---------------------------------------------------------------- the comparison

def test_candidates_are_whole_hosts_or_part_of_one():
    assert shards.candidates(12, 4) == [1, 2, 4, 12]       # not 3 (splits a host unevenly) nor 6
    assert shards.candidates(16, 1) == [1, 2, 4, 8, 16]
    assert shards.candidates(6, None) == [1, 2, 3, 6]


LINKS = ["--ranks-per-host", "4", "--inter-node-gbps", "10", "--intra-node-gbps", "100",
         "--inter-node-latency-us", "5"]


def test_each_row_is_the_plan_of_its_shard_group(capsys):
    flags = [*BIG, "--dp", "16", "--zero", "3", "--micro-batches", "2", *LINKS]
    c = plan_json(capsys, *flags)["zero_shard_groups"]
    assert [row["S"] for row in c["rows"]] == [1, 2, 4, 8, 16] and c["host_ranks"] == 4 and c["current"] == 16
    for row in c["rows"]:
        r = plan_json(capsys, *flags, "--shard-group", str(row["S"]))
        dp, mem = r["comm_per_stage"][0], r["memory"]
        assert (row["intra"], row["inter"]) == (dp["dp"] - dp["inter_host"]["dp"], dp["inter_host"]["dp"])
        assert row["seconds"] == pytest.approx(dp["seconds"]["dp"], rel=1e-12)
        assert (row["model_states"], row["peak"]) == (mem["model_states"], mem["total"])
    host = plan_json(capsys, *flags, "--shard-group", "host")
    assert host["layout"]["shard_group"] == 4 and host["zero_shard_groups"]["current"] == 4


def test_the_recommended_is_the_fastest_that_fits(capsys):
    """Without a budget S = 1 (a whole copy on every rank, one all-reduce) sends least; with a
    budget that S = 1 and 2 exceed, a host's shard group: only its all-reduce crosses."""
    flags = [*BIG, "--dp", "16", "--zero", "3", "--micro-batches", "2", *LINKS]
    rows = plan_json(capsys, *flags)["zero_shard_groups"]["rows"]
    assert [row["recommended"] for row in rows] == [True, False, False, False, False]
    assert rows[0]["seconds"] == min(row["seconds"] for row in rows)
    by_S = {row["S"]: row for row in rows}
    budget = (by_S[2]["peak"] + by_S[4]["peak"]) // 2      # S = 1, 2 no longer fit; 4, 8, 16 do
    c = plan_json(capsys, *flags, "--memory-budget", str(budget))["zero_shard_groups"]
    assert [row["fits"] for row in c["rows"]] == [False, False, True, True, True]
    assert c["recommended"] == 4 and by_S[4]["seconds"] < min(by_S[8]["seconds"], by_S[16]["seconds"])
    _, out, _ = cli(capsys, *flags, "--memory-budget", str(budget))
    line = next(s for s in out.splitlines() if "< recommended" in s)
    assert line.split()[:2] == ["4", "4"] and "1 host" in line, line
    assert "recommended: --shard-group 4 (host): the least ZeRO time on the links, of those whose peak fits" in out
    code, out, _ = cli(capsys, *flags, "--memory-budget", "1000")
    assert code == 0 and "recommended: none: no shard group's peak fits" in out
    _, out, _ = cli(capsys, *BIG, "--dp", "16", "--zero", "3")
    assert "shard groups" not in out                       # no hosts, no --shard-group: no table


def test_ranked_by_time_on_the_links_else_by_bytes_across(capsys):
    """A slow link inside hosts (1 Gbit/s) makes S = 8 quicker than a host's S = 4, which
    sends fewer bytes across: the time decides; without a bandwidth flag, the bytes across."""
    flags = [*SMALL, "--dp", "16", "--zero", "1", "--ranks-per-host", "4"]
    timed = plan_json(capsys, *flags, "--inter-node-gbps", "10", "--intra-node-gbps", "1")["zero_shard_groups"]
    by_time = min(timed["rows"], key=lambda row: row["seconds"])["S"]
    by_bytes = min(timed["rows"], key=lambda row: (row["inter"], row["bytes"]))["S"]
    assert (timed["ranked_by"], timed["recommended"], by_time, by_bytes) == ("seconds", 8, 8, 4)
    untimed = plan_json(capsys, *flags)["zero_shard_groups"]
    assert (untimed["ranked_by"], untimed["recommended"]) == ("bytes", 4)
    assert all(row["seconds"] is None for row in untimed["rows"])


# ---------------------------------------------------------------- against the trainer

@pytest.mark.parametrize("extra", [["--shard-group", "host"], ["--qwz", "64", "--qgz", "64", "--hpz"],
                                   ["--shard-group", "host", "--qwz", "32", "--qgz", "128"]],
                         ids=["hybrid", "flat zero++", "hybrid zero++"])
def test_planner_equals_the_trainer_on_two_hosts(capsys, tmp_path, extra):
    """--dp 4 --zero 3 on hosts of 2, --shard-group host (shard groups of 2, replicated twice)
    and ZeRO++ (qwZ's codes, hpZ's all-gathers inside the host, qgZ's all-to-alls); C = 18 pads
    the blocks to a multiple of 4."""
    flags = ["--n-embd", "18", "--dtype", "float64", "--dp", "4", "--zero", "3", "--micro-batches", "2", *extra]
    hybrid = "--shard-group" in extra
    log = str(tmp_path / "log.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_COMM_TIMEOUT="60",
               MINIPAR_RANKS_PER_HOST="2")
    p = subprocess.run([MPIRUN, "-n", "4", FAKE, sys.executable, "-m", "minipar.train", *TINY_MPI, *flags,
                        "--steps", "2", "--log", log], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    rows, summary = read_log(log)
    z = summary["zero"]
    assert (z["N"], z["R"]) == ((2, 2) if hybrid else (4, 1)) and z["P_padded"] > z["P"]
    r = plan_json(capsys, *TINY_MPI[:-4], *flags, "--ranks-per-host", "2")      # without --steps, --sample
    mem, row = r["memory_per_stage"][0], r["comm_per_stage"][0]
    assert {k: mem[k] for k in ("params", "grads", "optimizer")} == {k: summary["memory"][k] for k in
                                                                     ("params", "grads", "optimizer")}
    assert row["dp"] == z["bytes_per_step"] == z["theory_bytes_per_step"]
    assert row["inter_host"]["dp"] == z["inter_host_bytes_per_step"] == z["theory_inter_host_bytes_per_step"] > 0
    for step in rows[1:]:
        assert (step["bytes_by_axis"], step["inter_host_bytes_by_axis"]) == (row["bytes_by_axis"],
                                                                             row["inter_host_bytes_by_axis"])
    c = r["zero_shard_groups"]
    assert c["current"] == (2 if hybrid else 4)
    if extra == ["--shard-group", "host"]:
        assert {row["S"]: row["inter"] for row in c["rows"]}[2] == z["inter_host_bytes_per_step"]


# ---------------------------------------------------------------- bad flags

@pytest.mark.parametrize("flags,message", [
    (["--dp", "4", "--zero", "1", "--shard-group", "3"],
     "--shard-group 3 must be a whole number >= 1 that divides the 4 dp x cp ranks"),
    (["--dp", "4", "--zero", "1", "--shard-group", "0"], "--shard-group 0 must be a whole number >= 1"),
    (["--dp", "4", "--shard-group", "2"], "--shard-group 2 is how ZeRO shards: it needs --zero 1, 2 or 3"),
    (["--dp", "4", "--shard-group", "two"], "argument --shard-group: must be a whole number of ranks or 'host'"),
    (["--dp", "4", "--zero", "1", "--shard-group", "host"],
     "--shard-group host shards over the ranks of a host: give --ranks-per-host K"),
    (["--dp", "3", "--batch-size", "12", "--zero", "1", "--shard-group", "host", "--ranks-per-host", "2"],
     "--shard-group host needs as many ranks of each gradient group (dp x cp) on every host; the hosts hold [2, 1]"),
    (["--dp", "2", "--pp", "3", "--n-layer", "3", "--zero", "1", "--shard-group", "host", "--ranks-per-host", "3"],
     "--shard-group host: the pipeline stages' gradient groups sit differently on hosts of 3 ranks"),
    (["--moe-experts", "4", "--moe-top-k", "2", "--dp", "12", "--ep", "2", "--batch-size", "12", "--zero", "1",
      "--shard-group", "3"], "--shard-group 3: the shard groups hold unequal numbers [1, 1, 2, 2] of the 6 ranks"),
    (["--params", "1e6", "--dp", "4", "--zero", "2", "--shard-group", "8"],
     "--shard-group 8 must be a whole number >= 1 that divides the 4 dp x cp ranks"),
])
def test_bad_shard_group_flags_exit_2_with_one_line(capsys, flags, message):
    code, out, err = cli(capsys, *flags)
    assert code == 2 and out == "", (code, out)
    assert err.count("\n") == 1 and err.startswith("minipar.plan: error: ") and message in err, err


# ---------------------------------------------------------------- ZeRO-3's gathers

@pytest.mark.parametrize("K,reshard", [(0, "on"), (1, "on"), (2, "on"), (9, "on"), (0, "off")])
def test_the_gathered_peak_is_the_formulas(capsys, K, reshard):
    """--prefetch K, --reshard-after-forward: the planner's gathered bytes are
    formulas.gathered_peak of the device's units (C = 18: padding to N matters), and count in
    its total; reshard off drops backward's all-gathers from the bytes."""
    base = ["--n-layer", "4", "--n-embd", "18", "--n-head", "2", "--dp", "4", "--zero", "3", "--micro-batches", "2"]
    r = plan_json(capsys, *base, "--prefetch", str(K), "--reshard-after-forward", reshard)
    cfg = GPTConfig(n_layer=4, n_embd=18, n_head=2)
    size = {n: int(np.prod(shape)) for n, shape, _ in param_specs(cfg)}
    units = zero_units.unit_names(list(size), cfg.family)
    b = [zero_units.padded(sum(size[n] for n in u), 4) * 4 for u in units]      # float32 bytes
    expect = formulas.gathered_peak(b[0] + b[-1], b[1:-1], K, reshard == "on")
    mem = r["memory_per_stage"][0]
    assert mem["gathered"] == expect and mem["total"] == mem["model_states"] + mem["activations"] + expect
    calls = (2 if reshard == "on" else 1) * 2 + 2                # all-gathers and reduce-scatters of M = 2
    assert r["comm_per_stage"][0]["dp"] == calls * 3 / 4 * sum(b)


def test_the_planners_gathers_are_the_trainers(tmp_path):
    """One run of the trainer, --prefetch 1 --reshard-after-forward off: its measured gathered
    peak and ZeRO bytes are the planner's."""
    flags = ["--zero", "3", "--prefetch", "1", "--reshard-after-forward", "off", "--micro-batches", "2"]
    log = str(tmp_path / "log.jsonl")
    p = subprocess.run([MPIRUN, "-n", "4", sys.executable, "-m", "minipar.train", *TINY_MPI, "--n-layer", "3", *flags,
                        "--log", log], cwd=REPO, capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-2000:]
    z = read_log(log)[1]["zero"]
    args = table.build_parser().parse_args([*TINY_MPI[:8], "--n-layer", "3", "--batch-size", "8", "--dp", "4",
                                            *flags])
    cfg, lay, _ = table.resolve(args)
    r = table.plan(cfg, lay)
    assert z["gathered_peak_bytes"] == z["gathered_peak_formula"] == r["memory_per_stage"][0]["gathered"]
    assert z["bytes_per_step"] == z["theory_bytes_per_step"] == r["comm_per_stage"][0]["dp"]
