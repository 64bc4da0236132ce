"""The planner against the trainer: the same flags through `mpirun -n N python -m
minipar.train --log` and through minipar.plan, on tiny models.

For each layout the planner's figures for rank 0 (pp stage 0, dp rank 0, tp rank 0: the
rank that writes the log) must equal what the run measured:
- model states: the summary's `memory` (nbytes of the parameters, gradients and optimizer
  state rank 0 holds);
- bytes sent per step, per axis, from the ledger: `grad_sync_bytes` (dp; `zero_bytes`
  with --zero), `tp_bytes`, `pp_bytes`, `bytes_by_axis["cp"]` (ring attention),
  `bytes_by_axis["ep"]` (the all-to-alls) and the whole `comm_bytes`, on every step. The one
  estimate: with --ep and no --moe-capacity-factor the all-to-alls carry the rows the routing
  sent, which the planner takes to be balanced (within 10% here, the ratio printed); with a
  capacity they are the padded tensor, and equal;
- with --pp, the saved activations at peak of every stage (`peak_activation_bytes`):
  equal for tp = 1 (the planner counts what each op saves, walking each stage's
  instruction list: activations.peak_in_flight_bytes), whatever the schedule. With tp > 1 the
  vocabulary-parallel ops keep the ids of the tokens a tp rank owns, 8 bytes each, which
  depends on the data: the planner assumes ceil(N/tp) of N, within 5% here; given the
  count (tp rank 0 owns every token of the built-in corpus, which is ASCII, below
  ceil(256/tp) for tp = 2) activations.stage_bytes equals the measured peak exactly. A
  MoE layer's bytes depend on the routing where it drops (a capacity) or sends rows to
  other ranks (--ep without a capacity); the layouts with --pp here have neither, or a
  capacity of 2.0 (N slots per expert: nothing dropped), so they are equal too.
--sp, --recompute, --schedule, --virtual-stages, --cp, --cp-layout, --ep, the --moe-* shape
flags and the family's (--arch llama, --n-kv-head, --ffn-hidden, --tied) go to the planner as
they go to the trainer. The Llama layouts cross every split of the family: a key/value head
shared by the tp ranks (--n-kv-head 1 with --tp 2 or 4), --sp with its RMSNorm sums, the ring
with grouped-query heads beside --tp, ZeRO's units and the tied embed_tokens between pipeline
ends in bf16.
Every run's summary must also say that what it measured equals its own formula, line by line
(summary_formulas): each rank's memory, ZeRO's bytes, tp's all-reduces and elements
(megatron_count), sp's collectives by kind (sp_count), the ring's bytes (step_traffic).
Adding a layout is one line in LAYOUTS: (ranks, trainer flags). `make test` runs LAYOUTS;
scripts/plan_matrix.py also the MORE below (each a variant that LAYOUTS covers in kind).
"""
import os

import pytest

from minipar.plan import activations, layout, table
from minipar.train import data

from trainer_runs import TINY_MPI, mpirun, read_log

MOE = ["--moe-experts", "4", "--moe-top-k", "2", "--n-layer", "2"]
LLAMA = ["--arch", "llama", "--ffn-hidden", "24"]                 # H = 2 heads of 8 (TINY_MPI), F = 24
LAYOUTS = [
    (1, ["--dtype", "float64", "--micro-batches", "2"]),
    (4, ["--n-embd", "32", "--bucket-mb", "0.1", "--dtype", "float64"]),   # dp4: direct (1.5b), doubling (2b)
    (3, ["--tp", "3", "--n-head", "3", "--n-embd", "24", "--dtype", "float64"]),   # V padded; p = 3 fix-up
    (2, ["--zero", "3", "--dtype", "float64", "--micro-batches", "2"]),
    (4, ["--dtype", "float64", "--dp", "2", "--tp", "2", "--sp", "--recompute", "full", "--zero", "1"]),
    # a schedule past 1F1B: W frees a micro-batch (zb)
    (4, ["--dtype", "float64", "--dp", "2", "--pp", "2", "--n-layer", "2", "--micro-batches", "4",
         "--schedule", "zb-h2", "--zero", "1"]),
    (4, ["--dtype", "float64", "--cp", "2", "--dp", "2", "--micro-batches", "2"]),   # the ring; grads over dp x cp
    # the other ways to attend: Ulysses' head shards, the all-gather's K and V (peak activations over 2 stages)
    (4, ["--dtype", "float64", *LLAMA, "--n-kv-head", "1", "--cp", "2", "--cp-impl", "allgather", "--pp", "2",
         "--n-layer", "2", "--micro-batches", "2"]),
    (4, ["--dtype", "float64", "--n-head", "4", "--tp", "2", "--sp", "--cp", "2", "--cp-impl", "ulysses"]),  # sp on T/cp
    # Llama: one key/value head on both tp ranks, --sp, 2 stages (peak activations, given the owned ids)
    (4, ["--dtype", "float64", *LLAMA, "--n-kv-head", "1", "--tp", "2", "--sp", "--pp", "2", "--n-layer", "2",
         "--micro-batches", "2"]),
    (4, ["--dtype", "float64", *LLAMA, "--n-head", "4", "--n-kv-head", "1", "--tp", "4"]),   # its sums over 4
    (4, ["--precision", "bf16", *LLAMA, "--tied", "--dp", "2", "--zero", "1", "--pp", "2", "--n-layer", "2",
         "--micro-batches", "2"]),                          # Llama's ZeRO units; embed_tokens between the ends
    # Llama's MoE: SwiGLU experts 16 wide and a shared one over ep 2 (capacity: every message padded);
    # Mixtral's pooled loss over 2 stages: each message followed by its (1, E) counts ((0, E) before a MoE block)
    (4, ["--dtype", "float64", *LLAMA, *MOE, "--moe-ffn-hidden", "16", "--moe-shared-experts", "1", "--dp", "4",
         "--ep", "2", "--moe-capacity-factor", "1.0"]),
    (4, ["--dtype", "float64", *LLAMA, *MOE, "--moe-every", "2", "--dp", "2", "--pp", "2", "--micro-batches", "2"]),
]
# The rest of the matrix: `python scripts/plan_matrix.py` (MINIPAR_PLAN_MATRIX=all) runs them too.
MORE = [
    # moved from LAYOUTS to keep `make test` under 10 minutes; each covered in kind there: 1F1B in bf16
    # (ZB-H2 in float64, bf16 by the Llama tied run), ZeRO-2 under a pipeline in fp16, interleaved over
    # tp x pp (the Llama dp x pp one below), Ulysses over pp (Ulysses with sp), MoE over ep x pp
    # (Llama's MoE over ep and over pp)
    (2, ["--precision", "bf16", "--pp", "2", "--n-layer", "2", "--micro-batches", "4"]),     # 1f1b
    (4, ["--zero", "2", "--pp", "2", "--n-layer", "2", "--micro-batches", "2", "--precision", "fp16"]),
    (4, ["--dtype", "float64", "--tp", "2", "--pp", "2", "--n-layer", "4", "--micro-batches", "2",
         "--schedule", "interleaved", "--virtual-stages", "2"]),
    (4, ["--dtype", "float64", "--cp", "2", "--cp-impl", "ulysses", "--pp", "2", "--n-layer", "2",
         "--micro-batches", "2"]),
    (4, ["--dtype", "float64", *MOE, "--dp", "2", "--ep", "2", "--pp", "2", "--micro-batches", "2",
         "--moe-capacity-factor", "2.0"]),   # capacity 2.0 = N slots: every message padded, nothing dropped
    # covered in kind in LAYOUTS: dp by dp4, tp by the Llama tp 4, tp x pp x sp by the Llama one, the
    # ring's shared KV head by the all-gather's
    (2, ["--dtype", "float64", "--micro-batches", "2"]),                                   # dp2
    (2, ["--dtype", "float64", "--tp", "2"]),
    (4, ["--dtype", "float64", "--tp", "2", "--pp", "2", "--n-layer", "2", "--sp", "--micro-batches", "2"]),
    (4, ["--dtype", "float64", *LLAMA, "--n-kv-head", "1", "--cp", "2", "--tp", "2"]),        # the ring's KV head
    (2, ["--dtype", "float64", "--pp", "2", "--n-layer", "2", "--micro-batches", "2", "--schedule", "gpipe"]),
    (4, ["--tp", "2", "--pp", "2", "--n-layer", "4", "--recompute", "full", "--micro-batches", "2"]),
    (4, ["--dtype", "float64", "--dp", "2", "--tp", "2", "--untied", "--micro-batches", "2"]),
    (2, ["--precision", "fp16", "--bucket-mb", "0.01"]),                  # dp2, 2-byte buckets, several
    (3, ["--n-embd", "32", "--batch-size", "12"]),        # dp3: one bucket, uneven array_split pieces
    (4, ["--tp", "2", "--pp", "2", "--n-layer", "2", "--micro-batches", "2", "--dtype", "float64"]),
    (2, ["--zero", "1", "--dtype", "float64"]),
    (2, ["--zero", "2", "--dtype", "float64", "--micro-batches", "2"]),
    (4, ["--zero", "3", "--tp", "2", "--dtype", "float64"]),
    (3, ["--zero", "1", "--batch-size", "12", "--precision", "bf16"]),     # wte, the block padded for N = 3
    (2, ["--dtype", "float64", "--tp", "2", "--sp"]),
    (2, ["--dtype", "float64", "--pp", "2", "--n-layer", "2", "--micro-batches", "4", "--schedule", "zb-h1"]),
    (2, ["--dtype", "float64", "--pp", "2", "--n-layer", "4", "--micro-batches", "4", "--schedule", "interleaved",
         "--virtual-stages", "2"]),
    (4, ["--dtype", "float64", "--cp", "2", "--tp", "2"]),                 # tp's messages of b*T/cp*C; n/tp
    (4, ["--dtype", "float64", "--cp", "2", "--pp", "2", "--n-layer", "2", "--micro-batches", "2",
         "--recompute", "full", "--zero", "1"]),          # peak activations with cp; the ring twice; ZeRO over cp
    (4, ["--precision", "bf16", "--cp", "4", "--cp-layout", "contiguous"]),   # the ring in fp32
    (4, ["--dtype", "float64", "--cp", "4", "--cp-impl", "hybrid", "--cp-ulysses", "2"]),   # Ulysses 2 x ring 2
    (4, ["--dtype", "float64", *LLAMA, "--n-head", "4", "--n-kv-head", "1", "--cp", "2", "--cp-impl", "ulysses", "--tp", "2",
         "--recompute", "full"]),                          # the KV head copied; the all-to-alls' forward twice
    (4, ["--precision", "bf16", "--cp", "4", "--cp-impl", "allgather", "--pp", "1"]),   # gathered in fp32
    (2, ["--dtype", "float64", *MOE, "--ep", "2", "--moe-capacity-factor", "1.0"]),    # drops; bytes still static
    (4, ["--dtype", "float64", *MOE, "--dp", "4", "--ep", "2", "--micro-batches", "2"]),   # a2a: balanced estimate
    (2, ["--dtype", "float64", *MOE, "--tp", "2"]),        # MoE blocks replicated over tp: attention's f, g only
    (2, ["--dtype", "float64", *MOE, "--zero", "2", "--micro-batches", "2"]),   # every expert in its block's unit
    (4, ["--dtype", "float64", *MOE, "--dp", "4", "--ep", "2", "--zero", "1", "--moe-capacity-factor", "1.0"]),
    (4, ["--precision", "bf16", *MOE, "--dp", "4", "--ep", "2", "--zero", "3", "--micro-batches", "2",
         "--moe-capacity-factor", "1.5"]),                # expert units gathered over their 2 replicas
    (4, ["--dtype", "float64", *MOE, "--dp", "2", "--ep", "2", "--tp", "2", "--moe-capacity-factor", "1.0"]),   # ep x tp
    (2, ["--precision", "bf16", *MOE, "--moe-every", "2", "--pp", "2", "--micro-batches", "2"]),   # experts unplaced
    (4, ["--dtype", "float64", *MOE, "--dp", "2", "--ep", "2", "--pp", "2", "--micro-batches", "2",
         "--recompute", "full", "--moe-capacity-factor", "2.0"]),     # 6 all-to-alls per layer and micro-batch
    (2, ["--dtype", "float64", *LLAMA, "--tp", "2", "--sp"]),
    (4, ["--dtype", "float64", *LLAMA, "--n-kv-head", "1", "--cp", "2", "--pp", "2", "--n-layer", "2",
         "--micro-batches", "2", "--recompute", "selective"]),          # peak activations with the ring
    (4, ["--dtype", "float64", *LLAMA, "--n-kv-head", "1", "--tp", "2", "--pp", "2", "--n-layer", "2",
         "--micro-batches", "2", "--recompute", "full"]),
    (4, ["--precision", "fp16", *LLAMA, "--n-head", "4", "--n-kv-head", "2", "--tp", "2", "--dp", "2", "--zero", "3",
         "--micro-batches", "2"]),
    (4, ["--dtype", "float64", *LLAMA, "--pp", "2", "--n-layer", "4", "--micro-batches", "4", "--dp", "2",
         "--schedule", "interleaved", "--virtual-stages", "2"]),
]
if os.environ.get("MINIPAR_PLAN_MATRIX") == "all":
    LAYOUTS = LAYOUTS + MORE
TRAINER_ONLY = {"--steps", "--sample", "--log", "--moe-aux-coef", "--moe-z-coef"}   # valued flags the planner has not


def planner_flags(n: int, flags: list) -> list:
    """The trainer's flags as the planner takes them: trainer-only ones dropped (argparse
    keeps the last of a repeated flag, as the trainer does), dp made explicit."""
    out, it = [], iter(TINY_MPI + flags)
    for f in it:
        if f in TRAINER_ONLY:
            next(it)
        else:
            out.append(f)
    args = table.build_parser().parse_args(out)
    return out if "--dp" in out else out + ["--dp", str(n // (args.cp * args.tp * args.pp))]


@pytest.mark.parametrize("n,flags", LAYOUTS, ids=[" ".join(f) for _, f in LAYOUTS])
def test_planner_equals_what_the_trainer_measures(n, flags, tmp_path):
    log = str(tmp_path / "log.jsonl")
    p = mpirun(n, *flags, "--steps", "3", "--log", log)
    assert p.returncode == 0, p.stdout + p.stderr
    rows, summary = read_log(log)
    cfg, lay, _ = table.resolve(table.build_parser().parse_args(planner_flags(n, flags)))
    r = table.plan(cfg, lay)
    assert r["params"] == summary["params_count"]
    mem = r["memory_per_stage"][0]
    for key in ("params", "grads", "optimizer"):
        assert mem[key] == summary["memory"][key], (key, mem, summary["memory"])
    c = r["comm_per_stage"][0]
    dp_key = "zero_bytes" if lay.zero else "grad_sync_bytes"
    estimated = lay.ep > 1 and not cfg.moe_capacity_factor          # the all-to-alls: balanced routing's
    for row in rows:
        got = {"dp": row[dp_key], "tp": row["tp_bytes"], "pp": row["pp_bytes"],
               "cp": row["bytes_by_axis"].get("cp", 0), "ep": row["bytes_by_axis"].get("ep", 0),
               "bytes_per_step": row["comm_bytes"]}
        if estimated:
            ep = got.pop("ep")
            got["bytes_per_step"] -= ep
            print(f"step {row['step']}: all-to-all bytes {ep:,}, planner's balanced estimate {c['ep']:,} "
                  f"({c['ep'] / ep:.3f})")
            assert abs(c["ep"] / ep - 1) < 0.1, (ep, c["ep"])
            assert got == {**{k: c[k] for k in got}, "bytes_per_step": c["bytes_per_step"] - c["ep"]}, (got, c)
        else:
            assert got == {k: c[k] for k in got}, (row["step"], got, c)
    assert summary_formulas(summary, cfg) == [], summary_formulas(summary, cfg)
    if lay.pp > 1:
        measured = summary["pipeline"]["peak_activation_bytes"]
        est = [m["activations"] for m in r["memory_per_stage"]]
        if lay.tp == 1:
            assert est == measured
        else:
            ratios = [e / m for e, m in zip(est, measured)]         # 0.997 for the tp2 x pp2 layouts
            print(f"est/measured peak activations by stage: {ratios} ({est} vs {measured} bytes)")
            assert all(abs(r - 1) < 0.05 for r in ratios), (ratios, est, measured)
            assert owned_peaks(cfg, lay, r) == measured, (est, measured)


def summary_formulas(summary, cfg) -> list:
    """[(what, measured, formula)] of every line of the summary whose measured figure is not
    its own formula's (the rest, ratios and times, are not claims of equality); tp's counts a
    MoE block's 2 all-reduces (its MLP whole on every tp rank), as the planner's tp bytes do."""
    pairs = [(f"rank {m['rank']} {k}", m[k], m["formula"][k]) for m in summary["memory_per_rank"]
             for k in ("params", "grads", "optimizer")]
    if summary.get("zero"):
        pairs.append(("zero bytes", summary["zero"]["bytes_per_step"], summary["zero"]["theory_bytes_per_step"]))
    tp = summary.get("tensor_parallel")
    if tp and not tp["sequence_parallel"]:
        pairs += [("tp calls", tp["all_reduces_per_step"], tp["megatron_all_reduces_per_step"]),
                  ("tp elements", tp["elements_per_step"], tp["megatron_elements_per_step"])]
    if tp and tp["sequence_parallel"]:
        pairs += [(f"sp {k} {w}", v[w], v["formula_" + w]) for k, v in tp["by_kind"].items()
                  for w in ("calls", "elements")]
    if summary.get("context_parallel"):
        cp = summary["context_parallel"]
        pairs.append(("cp bytes", cp["bytes_per_step"], cp["theory_bytes_per_step"]))
    return [p for p in pairs if p[1] != p[2]]


def owned_peaks(cfg, lay, r) -> list:
    """The saved bytes at peak of each stage on tp rank 0, given the ids it owns: every one
    of a micro-batch's N tokens and targets, since the built-in corpus (all the runs here
    train on it) has no byte at or above ceil(V/tp), where rank 1's vocabulary slice starts."""
    first_foreign = -(-cfg.vocab_size // lay.tp)
    assert data.load_tokens(None, cfg.block_size).max() < first_foreign, "not every token on tp rank 0"
    itemsize, compute_itemsize, _ = layout.itemsizes(lay)
    N = lay.rows * cfg.block_size // lay.cp
    return [activations.peak_in_flight_bytes(cfg, lay.schedule, stage, lay.pp, layout.chunks(lay), lay.micro_batches,
                                             lay.tp, lay.rows, itemsize, compute_itemsize, lay.sp, lay.recompute,
                                             owned=(N, N), cp=lay.cp, cp_impl=lay.cp_impl,
                                             cp_ulysses=lay.cp_ulysses)[0]
            for stage in range(lay.pp)]


def test_planner_flags_keep_sp_and_recompute():
    flags = planner_flags(4, ["--tp", "2", "--sp", "--recompute", "full", "--steps", "3", "--log", "x.jsonl"])
    args = table.build_parser().parse_args(flags)
    assert (args.sp, args.recompute, args.tp, args.dp) == (True, "full", 2, 2), flags
