"""The planner's four ways to attend side by side (plan/context.py, `python -m minipar.plan --cp C`):
each row's figures equal the formulas they come from, computed here again from the mechanisms'
own functions (context_parallel.step_traffic, activations.cp_attention_bytes), Ulysses' limit
is reported where the heads cannot take it, hybrid's U comes from the hosts, the slowest cp
rank is the one at a host's edge, and the cheapest is the least of the rows. The trainer's side
(the same figures measured): tests/test_plan_trainer.py and tests/mpi/test_cp_impl_activations.py."""
import json

import pytest

from minipar.parallel.context import context_parallel
from minipar.plan import activations, context as plan_context, hosts as plan_hosts, table
from minipar.plan.layout import itemsizes, rank_layer_count
from tests.test_plan import cli

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "64", "--batch-size", "8"]


def plan(*flags, hosts=None):
    args = table.build_parser().parse_args([*TINY, *flags])
    cfg, lay, params = table.resolve(args)
    hosts = hosts or plan_hosts.Hosts.from_args(args)
    lay = table.hybrid_layout(cfg, lay, hosts)
    return cfg, lay, table.plan(cfg, lay, params, hosts=hosts)


def rows_by_impl(r) -> dict:
    return {row["impl"]: row for row in r["cp_impls"]}


@pytest.mark.parametrize("flags", [["--cp", "4", "--dp", "2"], ["--cp", "2", "--tp", "2", "--recompute", "full"],
                                   ["--cp", "4", "--precision", "bf16", "--pp", "2", "--micro-batches", "2"]],
                         ids=["cp4-dp2", "cp2-tp2-full", "cp4-bf16-pp2"])
def test_each_row_is_its_formula_on_one_host(flags):
    cfg, lay, r = plan(*flags)
    rows = rows_by_impl(r)
    assert list(rows) == list(context_parallel.IMPLS)
    comp = itemsizes(lay)[1]
    for impl, row in rows.items():
        U = lay.cp if impl == "ulysses" else None
        if impl == "hybrid":
            U = lay.cp                                    # one host: every cp rank on it
            assert row["ulysses"] == U
        layers = max(rank_layer_count(cfg, stage, lay.pp, 1) for stage in range(lay.pp))
        want = context_parallel.step_traffic(layers, lay.micro_batches, lay.rows, cfg.block_size, lay.cp, cfg, lay.tp,
                                             comp, lay.recompute, impl, U)[1]
        assert row["bytes_per_step"] == want, impl
        assert row["inter_host"] == 0 and row["seconds"] is None, impl
        hs = cfg.head_size
        attn = activations.cp_attention_bytes(impl, lay.rows, cfg.block_size // lay.cp, lay.cp, cfg.n_head // lay.tp,
                                              cfg.n_head // lay.tp * hs, context_parallel.kv_width(cfg, lay.tp), hs,
                                              comp, U)[0]
        assert row["attention_per_layer"] == attn, impl
    # the all-gather keeps every token's K and V; Ulysses no o and no log-sum-exp
    assert rows["allgather"]["attention_per_layer"] > rows["ring"]["attention_per_layer"]
    assert rows["ulysses"]["attention_per_layer"] < rows["ring"]["attention_per_layer"]
    # untimed: the fewest bytes wins
    cheapest = [row for row in rows.values() if row["cheapest"]]
    assert len(cheapest) == 1
    assert cheapest[0]["bytes_per_step"] == min(row["bytes_per_step"] for row in rows.values())


def test_the_chosen_impl_is_the_main_tables():
    """--cp-impl allgather: the table's cp bytes and activations are the all-gather's row."""
    _, _, r = plan("--cp", "4", "--cp-impl", "allgather")
    row = rows_by_impl(r)["allgather"]
    assert r["comm"]["cp"] == row["bytes_per_step"]
    assert r["memory"]["activations"] == row["activations"]
    assert r["activations_per_layer"]["cp_formula"] == "d sbh/c (4 + 2/h + (15 + 2c)/t + a/ht)"
    _, _, ring = plan("--cp", "4")
    assert ring["comm"]["cp"] == rows_by_impl(ring)["ring"]["bytes_per_step"] != row["bytes_per_step"]


def test_ulysses_beyond_the_heads_cannot_run():
    """4 heads: Ulysses over 8 ranks cannot run (head_split's line), the others can."""
    _, _, r = plan("--cp", "8")
    rows = rows_by_impl(r)
    assert not rows["ulysses"]["runs"]
    assert "4 heads (after tp) are not divisible by 8" in rows["ulysses"]["why_not"]
    assert rows["ring"]["runs"] and rows["allgather"]["runs"]
    assert rows["hybrid"]["runs"] is False                # one host: U = 8, the same limit
    assert not rows["ulysses"]["cheapest"]


def test_hybrid_takes_its_degree_from_the_hosts_and_times_the_link(capsys):
    """cp 8 on 2 hosts of 4: hybrid is Ulysses over the 4 ranks of a host, the ring across; the
    ring's slowest rank is the last of a host (everything it sends crosses)."""
    flags = [*TINY, "--cp", "8", "--n-head", "8", "--ranks-per-host", "4", "--inter-node-gbps", "10",
             "--intra-node-gbps", "100", "--inter-node-latency-us", "5"]
    code, out, err = cli(capsys, *flags, "--json")
    assert code == 0, err
    r = json.loads(out)
    rows = rows_by_impl(r)
    assert rows["hybrid"]["ulysses"] == 4
    assert rows["ring"]["inter_host"] == rows["ring"]["bytes_per_step"] > 0       # rank 3 -> rank 4
    assert 0 < rows["hybrid"]["inter_host"] < rows["hybrid"]["bytes_per_step"]
    hosts = plan_hosts.Hosts(4, 10.0, 100.0, 5.0)
    for row in rows.values():
        t = plan_hosts.Traffic(row["bytes_per_step"] - row["inter_host"], row["inter_host"],
                               row["inter_host_messages"])
        assert row["seconds"] == pytest.approx(hosts.seconds(t), rel=1e-12)
    best = min(rows.values(), key=lambda row: row["seconds"])
    assert best["cheapest"] and sum(row["cheapest"] for row in rows.values()) == 1
    code, out, _ = cli(capsys, *flags)
    assert f"cheapest: {best['impl']}, the least time under the link model" in out
    assert "hybrid U=4" in out and "<- cheapest" in out


@pytest.mark.parametrize("flags,message", [
    (["--cp", "4", "--cp-impl", "hybrid", "--ranks-per-host", "3"], "are not in equal runs"),
    (["--cp", "4", "--cp-impl", "hybrid", "--cp-ulysses", "3"], "--cp-ulysses 3 must divide --cp 4"),
    (["--cp", "4", "--n-head", "2", "--n-embd", "32", "--cp-impl", "ulysses"], "2 heads (after tp) are not divisible"),
    (["--cp-impl", "ring"], "it needs --cp > 1"),
    (["--cp", "2", "--cp-ulysses", "2"], "is the Ulysses degree of --cp-impl hybrid"),
], ids=["hybrid-uneven-hosts", "hybrid-U", "ulysses-heads", "no-cp", "ulysses-without-hybrid"])
def test_layouts_an_impl_cannot_run_are_one_line(capsys, flags, message):
    code, out, err = cli(capsys, *TINY, *flags)
    assert code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and err.startswith("minipar.plan: error: ") and message in err, err


def test_ulysses_key_value_head_limit():
    """Llama, 6 query heads and 3 KV heads on cp 2: the query heads split, the KV heads neither
    split over 2 ranks nor copy evenly to them, so Ulysses (and hybrid over both) cannot run."""
    _, _, r = plan("--arch", "llama", "--n-head", "6", "--n-kv-head", "3", "--n-embd", "24", "--ffn-hidden", "32",
                   "--cp", "2")
    rows = rows_by_impl(r)
    assert "whole key/value heads: 3 (after tp) neither divides nor is divided by 2" in rows["ulysses"]["why_not"]
    assert not rows["hybrid"]["runs"] and rows["ring"]["runs"] and rows["allgather"]["runs"]
    _, _, r = plan("--arch", "llama", "--n-head", "8", "--n-kv-head", "2", "--n-embd", "32", "--ffn-hidden", "32",
                   "--cp", "4")
    rows = rows_by_impl(r)                                # 2 KV heads on 4 ranks: each copied to 2
    assert rows["ulysses"]["runs"] and rows["ulysses"]["attention_per_layer"] == activations.cp_attention_bytes(
        "ulysses", 8, 16, 4, 8, 8 * 4, 2 * 4, 4, 4)[0]   # rows 8, T/C 16, H 8 of hs 4, fp32
