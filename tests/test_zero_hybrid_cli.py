"""ZeRO hybrid sharding from the command line (`--zero 1|2|3 --shard-group S|host`,
minipar/parallel/zero/hybrid.py): ZeRO inside shard groups of S consecutive dp x cp ranks
(host: the ranks of one host), the shards replicated across the R groups and their gradients
all-reduced across the replicas once a step.

- Bad values stop every rank with exit code 2 and their error line, before training.
- Checkpoints reshard between hybrid and flat ZeRO both ways, the resumed steps equal to the
  uninterrupted run in the target layout (float64, 1e-12 relative); a hybrid save writes
  each shard once (the first replica's), the other ranks empty shards.
- On emulated hosts (tests/tools/fake_hosts.sh) `--shard-group host` passes --verify, and the
  bytes that cross hosts (only the replicas' all-reduce) equal their formula to the byte and
  are fewer than flat ZeRO's.
- --dry-run prints the hybrid layout and trains nothing.

Runs are subprocess `mpirun -n 4`s of the tiny model (trainer_runs.py; on emulated hosts,
test_fake_hosts.py's small one); argparse's refusals are checked in-process too.
"""
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from minipar.model.gpt import GPTConfig, param_specs
from minipar.parallel.zero.units import padded, unit_names
from minipar.train import checkpoint, trainer as train

from test_checkpoint_layouts import F64, assert_resumed_equals_uninterrupted, ok
from trainer_runs import MPIRUN, REPO, TINY_MPI, assert_exit_2_one_line, mpirun, read_log

FAKE = os.path.join(REPO, "tests", "tools", "fake_hosts.sh")
# test_fake_hosts.py's model: its larger units (wte: 128 KiB in float64) take the hierarchical
# reduce-scatters and all-gathers across hosts, so flat ZeRO is compared at its best
HOSTS_MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "8",
               "--steps", "2", "--sample", "0", "--dtype", "float64"]


def on_hosts(per_host, *flags, model=HOSTS_MODEL):
    """mpirun -n 4 fake_hosts.sh python -m minipar.train: ranks 0..K-1 on h0, K.. on h1 (K = per_host)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_COMM_TIMEOUT="60",
               MINIPAR_RANKS_PER_HOST=str(per_host))
    return subprocess.run([MPIRUN, "-n", "4", FAKE, sys.executable, "-m", "minipar.train", *model, *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- bad input

def not_a_divisor(S):
    return f"--shard-group {S} must be a whole number >= 1 that divides the 4 dp x cp ranks ZeRO shards over"


@pytest.mark.parametrize("flags,message", [
    (["--zero", "3", "--shard-group", "3"], not_a_divisor(3)),
    (["--zero", "1", "--shard-group", "0"], not_a_divisor(0)),
    (["--zero", "2", "--shard-group", "-2"], not_a_divisor(-2)),
    (["--shard-group", "2"], "--shard-group 2 is how ZeRO shards: it needs --zero 1, 2 or 3"),
])
def test_shard_group_that_cannot_cut_the_dp_ranks_exits_2_with_one_line(flags, message):
    """Checked in prepare() on every rank, before the grid: exit 2, the lowest rank's one line,
    no training output."""
    assert_exit_2_one_line(mpirun(4, *flags), message)


def not_a_number(text):
    return (f"python -m minipar.train: error: argument --shard-group: must be a whole number of ranks or 'host', "
            f"got {text!r}")


@pytest.mark.parametrize("text", ["nan", "2.0", "abc", "inf", "1e0", ""])
def test_shard_group_that_is_not_a_whole_number_is_refused_by_argparse(text, capsys):
    """argparse refuses it (before MPI is touched, the same on every rank): exit 2, and its
    error line is the last line, after the usage."""
    with pytest.raises(SystemExit) as e:
        train.main([*TINY_MPI, "--zero", "1", "--shard-group", text])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "", (e.value.code, out)
    assert err.splitlines()[-1] == not_a_number(text) and err.count("error:") == 1, err


def test_shard_group_nan_stops_every_rank_under_mpirun():
    """The same under mpirun: each of the 4 ranks parses its own flags, prints argparse's usage
    and the line, and exits 2; no rank trains."""
    p = mpirun(4, "--zero", "3", "--shard-group", "nan")
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.stderr.count(not_a_number("nan")) == 4 == p.stderr.count("error:"), p.stderr[-2000:]
    assert "Traceback" not in p.stderr and p.stdout == "", (p.stdout, p.stderr[-2000:])


def test_shard_group_host_with_unequal_hosts_exits_2_naming_the_counts():
    """K = 3 ranks per host on 4 ranks: h0 holds 3, h1 1, so no S fits both. Checked once the
    hosts are known (after the grid), the same on every rank: exit 2, every error line is the
    one naming the counts, no traceback, nothing trained. (Not assert_exit_2_one_line's single
    line: every rank meets the error on its own, prints it and aborts the job, so up to 4
    copies come, with MPI_Abort's notes.)"""
    p = on_hosts(3, "--zero", "1", "--shard-group", "host", model=TINY_MPI)
    message = ("minipar.train: error: --shard-group host needs as many ranks of each gradient group (dp x cp) on "
               "every host; the hosts hold [3, 1]: give --shard-group S")
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert p.stderr.count("error:") == p.stderr.count(message) >= 1, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == "", (p.stdout, p.stderr)


# ---------------------------------------------------------------- checkpoints

# n_embd 18: each block unit has n = 2 mod 4 elements, so 2 padding elements (index -1) per block
CK = [*F64, "--n-embd", "18"]
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=18, block_size=16)


def unit_indices(cfg, N) -> list[np.ndarray]:
    """Each ZeRO unit's canonical flat indices in its flatten order, padded with -1 to a
    multiple of N (units.Unit)."""
    where, off = {}, 0
    for name, shape, _ in param_specs(cfg):
        where[name], off = np.arange(off, off + math.prod(shape)), off + math.prod(shape)
    out = []
    for names in unit_names([n for n, _, _ in param_specs(cfg)]):
        flat = np.concatenate([where[n] for n in names])
        out.append(np.concatenate([flat, np.full(padded(flat.size, N) - flat.size, -1)]))
    return out


def test_hybrid_zero3_saves_each_shard_once_and_flat_zero3_resumes_from_it(tmp_path):
    """--zero 3 --shard-group 2 on dp 4: ranks {0, 1} and {2, 3} are the shard groups, {0, 2}
    and {1, 3} the replicas. Only the first shard group writes: rank 0 the first half of every
    padded unit, rank 1 the second; ranks 2, 3 empty shards. Flat --zero 3 (quarters) resumes
    from it equal to its uninterrupted run."""
    d, a, b = str(tmp_path / "ck"), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    ok(mpirun(4, *CK, "--zero", "3", "--shard-group", "2", "--steps", "2", "--save", d))
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert meta["layout"] == {"dp": 4, "cp": 1, "tp": 1, "pp": 1, "zero": 3, "shard_group": 2}, meta["layout"]
    units = unit_indices(CFG, 4)
    assert sum(int((u < 0).sum()) for u in units) == 4              # the two blocks' padding
    halves = [np.concatenate([u[r * u.size // 2:(r + 1) * u.size // 2] for u in units]) for r in range(2)]
    assert meta["optimizer"]["shards"] == {checkpoint.shard_name(0): halves[0].size,
                                           checkpoint.shard_name(1): halves[1].size,
                                           checkpoint.shard_name(2): 0, checkpoint.shard_name(3): 0}, meta["optimizer"]
    for r in range(4):
        with np.load(os.path.join(d, checkpoint.shard_name(r))) as z:
            want = halves[r] if r < 2 else np.zeros(0, np.int64)
            np.testing.assert_array_equal(z["index"], want, err_msg=f"rank {r}'s shard index")
            assert z["m"].shape == z["v"].shape == want.shape and z["m"].dtype == np.float64
            assert np.all(z["v"][want >= 0] > 0) and np.all(z["m"][want < 0] == 0), f"rank {r}"
    ok(mpirun(4, *CK, "--zero", "3", "--steps", "4", "--resume", d, "--log", b))
    ok(mpirun(4, *CK, "--zero", "3", "--steps", "4", "--log", a))
    assert_resumed_equals_uninterrupted(b, a, 2, "zero3 S2 (hybrid) -> zero3 flat")


def test_flat_zero2_checkpoint_resumes_on_hybrid_zero2(tmp_path):
    """Flat --zero 2 shards (a quarter of every unit per rank) -> --zero 2 --shard-group 2,
    where every rank, the second replica's too, takes its half of each unit from them."""
    d, a, b = str(tmp_path / "ck"), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    ok(mpirun(4, *CK, "--zero", "2", "--steps", "2", "--save", d))
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert "shard_group" not in meta["layout"] and len(meta["optimizer"]["shards"]) == 4, meta
    ok(mpirun(4, *CK, "--zero", "2", "--shard-group", "2", "--steps", "4", "--resume", d, "--log", b))
    ok(mpirun(4, *CK, "--zero", "2", "--shard-group", "2", "--steps", "4", "--log", a))
    assert read_log(a)[1]["zero"]["R"] == read_log(b)[1]["zero"]["R"] == 2
    assert_resumed_equals_uninterrupted(b, a, 2, "zero2 flat -> zero2 S2 (hybrid)")


# ---------------------------------------------------------------- emulated hosts

def summary_of(p, log):
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return read_log(log)[1]


def test_zero3_by_host_verifies_and_sends_across_hosts_only_the_replicas_all_reduce(tmp_path):
    """2 hosts of 2 ranks: --shard-group host shards inside each host (N = 2, R = 2) and
    passes --verify. The bytes that left the host, measured by the ledger, equal the
    formula's (comm.sent) to the byte and are the shard's all-reduce across the 2 replicas
    alone: P_pad / 2 elements. Flat --zero 3 over the 4 ranks (its large units hierarchical)
    sends more across, also equal to its formula. Per rank the hybrid holds twice flat's
    model states (/2 instead of /4)."""
    hl, fl = str(tmp_path / "hybrid.jsonl"), str(tmp_path / "flat.jsonl")
    hp = on_hosts(2, "--zero", "3", "--shard-group", "host", "--verify", "--log", hl)
    hybrid = summary_of(hp, hl)
    flat = summary_of(on_hosts(2, "--zero", "3", "--log", fl), fl)
    assert hybrid["verify"]["ok"], hybrid["verify"]
    assert "hybrid: sharded inside groups of 2 (the ranks of a host), replicated across 2" in hp.stdout, hp.stdout
    zh, zf = hybrid["zero"], flat["zero"]
    assert (zh["N"], zh["R"], zf["N"], zf["R"]) == (2, 2, 4, 1), (zh, zf)
    for z in (zh, zf):
        assert z["bytes_per_step"] == z["theory_bytes_per_step"] > 0, z
        assert z["inter_host_bytes_per_step"] == z["theory_inter_host_bytes_per_step"] > 0, z
    assert zh["inter_host_bytes_per_step"] == zh["P_padded"] * 8 // 2, zh     # 2(R-1)/R x n_pad/N, R = N = 2
    assert zh["inter_host_bytes_per_step"] < zf["inter_host_bytes_per_step"], (zh, zf)
    across = zh["inter_host_bytes_per_step"], zf["inter_host_bytes_per_step"]
    print(f"bytes across hosts per step per rank: hybrid {across[0]:.0f}, flat {across[1]:.0f} "
          f"(ratio {across[0] / across[1]:.3f})")
    mh, mf = hybrid["memory"], flat["memory"]
    for k in ("params", "grads", "optimizer"):
        assert mh[k] == mh["formula"][k] == 2 * mf[k] == 2 * mf["formula"][k], (k, mh, mf)


def test_zero1_by_host_with_micro_batches_verifies_and_its_bytes_are_the_formula(tmp_path):
    """Stage 1 accumulates 2 micro-batches, reduce-scatters inside the host after the last and
    all-reduces the shard across the hosts: --verify holds, every byte count is its formula's."""
    log = str(tmp_path / "log.jsonl")
    s = summary_of(on_hosts(2, "--zero", "1", "--shard-group", "host", "--micro-batches", "2", "--verify",
                            "--log", log), log)
    z = s["zero"]
    assert s["verify"]["ok"] and (z["stage"], z["N"], z["R"]) == (1, 2, 2), (s["verify"], z)
    assert z["bytes_per_step"] == z["theory_bytes_per_step"] > 0, z
    assert z["inter_host_bytes_per_step"] == z["theory_inter_host_bytes_per_step"] == z["P_padded"] * 8 // 2, z


# ---------------------------------------------------------------- --dry-run

def test_dry_run_prints_the_hybrid_layout_and_trains_nothing():
    """The grid and the ZeRO units are built before the description, so the ZeRO line names
    the shard groups and the replicas; then the run stops: no step, no summary."""
    p = mpirun(4, "--zero", "3", "--shard-group", "2", "--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    zero = [line for line in p.stdout.splitlines() if line.startswith("  ZeRO stage 3 over 4 rank(s)")]
    assert len(zero) == 1 and "hybrid: sharded inside groups of 2, replicated across 2" in zero[0], p.stdout
    assert p.stdout.rstrip().endswith("dry run: the flags, the layout and the data check out on all 4 rank(s); "
                                      "nothing trained, nothing written"), p.stdout
    assert not re.search(r"^step +\d|^summary:", p.stdout, re.M), p.stdout
