"""python -m minipar.explain: each drawing is read back from the data that went on the wire.

Every run below is the command a user types (it launches mpirun itself, under a timeout); the
tests then read its trace with collectives.collective_picture / megatron.mlp_picture /
pipeline.pipeline_picture and compare with the algorithms' own formulas (ring.py's docstring,
tree.py's tree, Megatron's f and g), and check that a planted mistake in a trace is reported.
"""
import copy
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from minipar.explain import cli as explain, collectives, gqa_tp, megatron, moe, pipeline, ring_attention
from minipar.show import traceview
from minipar.parallel.pipeline import schedules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
_RUNS = {}


def explained(what, p, tmp_path_factory, *flags, env=ENV, timeout=180):
    """Run `python -m minipar.explain WHAT --p P FLAGS` once per test session -> (process, trace,
    out dir)."""
    key = (what, p, *flags)
    if key not in _RUNS:
        out = str(tmp_path_factory.mktemp(f"explain-{what}-p{p}"))
        proc = subprocess.run([sys.executable, "-m", "minipar.explain", what, "--p", str(p), *flags, "--out", out],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        path = os.path.join(out, f"explain-{what}-p{p}.json")
        assert os.path.isfile(path), f"exit {proc.returncode}, no {path}:\n{proc.stdout}\n{proc.stderr}"
        _RUNS[key] = (proc, traceview.load(path), out)
    return _RUNS[key]


def ranks(mask):
    return {r for r in range(mask.bit_length()) if mask >> r & 1}


def messages(pic, rank, step):
    """{kind: [Message]} of one cell."""
    out = {"send": [], "recv": []}
    for kind, m in pic.cells.get((rank, step), []):
        out[kind].append(m)
    return out


# --- collectives ---------------------------------------------------------------------------------

def test_ring_all_reduce_cells_are_the_rings_piece_schedule(tmp_path_factory):
    """ring.py: reduce-scatter step s = 0..p-2 sends piece (r-s-1) % p and receives (r-s-2) % p,
    adding it in; all-gather step s sends (r-s) % p and receives (r-s-1) % p, copying it. A
    partial sum collects one rank per step: the one that sends it at step s holds ranks r-s..r."""
    proc, trace, _ = explained("ring-all-reduce", 4, tmp_path_factory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pic = collectives.collective_picture(trace)
    p, full = 4, 0b1111
    assert pic.problems == [] and pic.steps == list(range(1, 2 * (p - 1) + 1)), pic.problems
    for r in range(p):
        for s in range(p - 1):
            cell = messages(pic, r, s + 1)
            (send,), (recv,) = cell["send"], cell["recv"]
            got = (send.dst, collectives.piece_of(send, pic.off)[1], ranks(send.mask),
                   recv.src, collectives.piece_of(recv, pic.off)[1], recv.op, ranks(recv.mask))
            want = ((r + 1) % p, f"p{(r - s - 1) % p}", {(r - k) % p for k in range(s + 1)},
                    (r - 1) % p, f"p{(r - s - 2) % p}", "+=", {(r - 1 - k) % p for k in range(s + 1)})
            assert got == want, f"rank {r} reduce-scatter step {s}: {got} != {want}"
            assert len(ranks(send.mask)) == s + 1                           # one more rank per step
            cell = messages(pic, r, p + s)
            (send,), (recv,) = cell["send"], cell["recv"]
            got = (collectives.piece_of(send, pic.off)[1], send.mask,
                   collectives.piece_of(recv, pic.off)[1], recv.op, recv.mask)
            want = (f"p{(r - s) % p}", full, f"p{(r - s - 1) % p}", "=", full)
            assert got == want, f"rank {r} all-gather step {s}: {got} != {want}"
    text = proc.stdout
    assert text.startswith("ring all-reduce, p=4, 32 float64 = 256 B (8 per piece): 6 steps: "
                           "3 reduce-scatter (+=), then 3 all-gather (=)"), text
    row = next(line for line in text.splitlines() if line.startswith("rank 0 "))
    assert row.split()[2:5] == ["->1", "p3", "{0}"], row                 # step 1: own copy of piece r-1
    assert "<-3 p2 += {3}" in text.splitlines()[text.splitlines().index(row) + 1]


def test_recursive_doubling_p5_shows_the_fix_up(tmp_path_factory):
    """p = 5 is not a power of two: rank 4 (extra) first hands its x to rank 0, which adds it in;
    ranks 0..3 double; last, rank 0 hands the result back to rank 4. Both ends of every
    message must call it the same step (a trace whose ranks number steps differently draws
    an exchange in two columns)."""
    proc, trace, _ = explained("recursive-doubling", 5, tmp_path_factory)
    pic = collectives.collective_picture(trace)
    first, last = pic.steps[0], pic.steps[-1]
    mine = [(s, k, m) for s in pic.steps for k, m in pic.cells.get((4, s), [])]
    assert [(s, k, m.src, m.dst, ranks(m.mask)) for s, k, m in mine] == \
        [(first, "send", 4, 0, {4}), (last, "recv", 0, 4, {0, 1, 2, 3, 4})], mine
    assert mine[-1][2].op == "="
    (got,) = messages(pic, 0, first)["recv"]
    assert (got.src, got.op, ranks(got.mask)) == (4, "+=", {4})
    assert pic.problems == [], "\n".join(pic.problems)
    assert proc.returncode == 0, proc.stderr
    assert pic.columns[first].endswith("ranks {0,4}") and pic.columns[last].endswith("ranks {0,4}"), pic.columns
    assert all(pic.columns[s].endswith("ranks {0-3}") for s in pic.steps[1:-1]), pic.columns


def test_broadcast_tree_each_rank_receives_once(tmp_path_factory):
    """Binomial tree from rank 0: every other rank receives the header once and the data once,
    a copy of rank 0's x; rank 0 receives nothing."""
    proc, trace, _ = explained("broadcast", 4, tmp_path_factory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pic = collectives.collective_picture(trace)
    assert pic.problems == [], pic.problems
    for r in range(4):
        got = [m for s in pic.steps for k, m in pic.cells.get((r, s), []) if k == "recv"]
        if r == 0:
            assert got == []
            continue
        data = [m for m in got if m.mask is not None]
        assert len(data) == 1 and len(got) == 2, (r, got)
        assert (data[0].op, data[0].mask, data[0].lo, data[0].hi) == ("=", 1, 0, pic.n - 1), data


@pytest.mark.parametrize("what", ["reduce-scatter", "all-gather", "reduce"])
def test_other_collectives_replay_to_their_results(what, tmp_path_factory):
    """No problem in the replay: every message carried what its sender held, and each rank
    ended with the collective's result (collectives.end_state); the worker checked NumPy too."""
    proc, trace, out = explained(what, 4, tmp_path_factory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pic = collectives.collective_picture(trace)
    assert pic.problems == [] and len(pic.steps) == {"reduce": 2}.get(what, 3), (pic.problems, pic.steps)
    assert os.path.isfile(os.path.join(out, f"explain-{what}-p4.svg"))


# --- the planted mistakes --------------------------------------------------------------------------

def _message(trace, rank, step, kind="send"):
    for e in trace["traceEvents"]:
        if e.get("cat") == "comm" and e["pid"] == rank:
            for m in e["args"]["messages"]:
                if m[0] == step and m[1] == kind:
                    return e["args"]["messages"], m
    raise AssertionError(f"no {kind} of rank {rank} at step {step}")


def test_a_planted_mistake_is_reported(tmp_path_factory, tmp_path):
    """Three traces altered after the run: a partial sum that claims rank 2's input (it holds
    {0,1}), a value that is no sum of inputs, and a message nobody received. Each is named."""
    _, trace, _ = explained("ring-all-reduce", 4, tmp_path_factory)
    assert collectives.collective_picture(trace).problems == []
    wrong = copy.deepcopy(trace)                        # rank 1, step 2: piece 3 (elements 24..31) of
    _, m = _message(wrong, 1, 2)                        # x_0 + x_1; now its values say + x_2 too
    M = 2 ** 4
    m[4] += 25 * M + 4                                  # x_2[24] = (24+1)*M + 2**2
    m[5] += 32 * M + 4
    problems = collectives.collective_picture(wrong).problems
    assert any(p.startswith("step 2: rank 1 sends elements 24..31 with contributors {0-2} but holds {0,1}")
               for p in problems), problems
    garbled = copy.deepcopy(trace)
    _, m = _message(garbled, 2, 1)
    m[4] += 1.0                                         # (j+1)*M + 2**r + 1: rank bits that do not add up
    assert any(p.startswith("step 1: rank 2 -> 3:") for p in collectives.collective_picture(garbled).problems)
    lost = copy.deepcopy(trace)
    msgs, m = _message(lost, 3, 4, "recv")
    msgs.remove(m)
    problems = collectives.collective_picture(lost).problems     # the later ones pair up one step apart
    assert problems[0] == "rank 2 sends 64 B to rank 3 at its step 4; rank 3 receives 64 B at its step 5", problems
    assert "step 6: rank 2 sends to rank 3, which never receives it" in problems, problems
    path = str(tmp_path / "planted.json")
    with open(path, "w") as f:
        json.dump(wrong, f)
    assert explain.draw(path, str(tmp_path)) != []      # what the command's exit status 1 comes from
    assert "PROBLEM: step 2: rank 1 sends" in open(tmp_path / "explain-ring-all-reduce-p4.svg").read()


def test_pieces_are_the_rings():
    from minipar.comm.helpers import split_offsets
    for n, p in ((32, 4), (10, 3), (5, 5), (17, 16)):
        assert collectives.piece_offsets(n, p) == split_offsets(n, p), (n, p)


def test_decode_inverts_the_encoding():
    p, n = 5, 7
    for mask in (1, 0b10110, 0b11111):
        for j in range(n):
            v = sum((j + 1) * 2 ** p + 2 ** r for r in ranks(mask))
            assert collectives.decode(float(v), p, n) == (mask, j)
    for bad in (3.5, 2 * 2.0 ** p + 7, (n + 1) * 2.0 ** p + 1):      # 3 ranks cannot sum to 2*M
        with pytest.raises(ValueError):
            collectives.decode(bad, p, n)


# --- Megatron's MLP and 1F1B -------------------------------------------------------------------------

def test_megatron_mlp_all_reduces_once_in_g_forward_and_once_in_f_backward(tmp_path_factory):
    proc, trace, _ = explained("megatron-mlp", 2, tmp_path_factory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pic = megatron.mlp_picture(trace)
    assert pic.problems == [], pic.problems
    B, T, C = explain.MLP_SHAPE
    assert pic.columns[:5] == [("f", "forward"), ("c_fc", "forward"), ("gelu", "forward"), ("c_proj", "forward"),
                               ("g", "forward")] and pic.columns[-1] == ("f", "backward"), pic.columns
    assert pic.shapes["c_fc"] == [B, T, 4 * C // 2] and pic.shapes["g"] == [B, T, C]
    for r in range(2):
        calls = [(pic.columns[i], a) for (rank, i), cell in pic.cells.items() if rank == r for a in cell["comm"]]
        assert [c for c, _ in calls] == [("g", "forward"), ("f", "backward")], calls
        for _, a in calls:
            assert a["op"] == "all_reduce" and {m[3] for m in a["messages"]} == {B * T * C * 8}, a
            assert a["bytes_sent"] == B * T * C * 8                 # tp = 2: one exchange of the array
    assert "2 all-reduces: all-reduce of 192 B in g forward, all-reduce of 192 B in f backward" in proc.stdout


def test_1f1b_measured_timeline_theory_and_instructions(tmp_path_factory):
    proc, trace, out = explained("1f1b", 3, tmp_path_factory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pic = pipeline.pipeline_picture(trace)
    p, m = 3, 6
    assert pic["n_stages"] == p and pic["micro_batches"] == m
    assert pic["theory"] == schedules.bubble_theory("1f1b", p, m) and 0 < pic["bubble"] < 1
    assert f"bubble {pic['bubble']:.3f} (theory (p-1)/(m+p-1) = 0.250)" in proc.stdout
    assert sum(line.startswith("stage ") and "|" in line for line in proc.stdout.splitlines()) == 2 * p
    for s in range(p):                                  # the phases put back together are the schedule
        phases = pic["stages"][s]
        assert [name for name, _ in phases] == ["warm-up", "steady", "cool-down"]
        assert [i for _, ins in phases for i in ins] == schedules.schedule("1f1b", s, p, m)
        n_warm = sum(isinstance(i, schedules.Forward) for i in phases[0][1])
        assert n_warm == p - s - 1, (s, phases[0])
        mine = [(k, mb) for st, k, mb, _, _ in pic["timeline"] if st == s]
        assert mine == [(type(i).__name__[0], i.mb) for i in schedules.schedule("1f1b", s, p, m)
                        if isinstance(i, (schedules.Forward, schedules.Backward))]
    assert open(os.path.join(out, "explain-1f1b-p3.svg")).read().startswith("<svg")


# --- ring attention ----------------------------------------------------------------------------------

def _sends(trace, rank, op="send"):
    """A rank's point-to-point calls of one kind, in time order, straight from the trace."""
    return sorted((e for e in traceview.spans(trace, "comm", rank) if e["args"]["op"] == op), key=lambda e: e["ts"])


def test_ring_attention_messages_and_blocks_are_the_rings(tmp_path_factory):
    """ring_attention.py: forward step j = 0..C-2 sends the K, V of rank r-j to rank r+1; backward
    sends K, V, dK, dV of rank r-j, then dK, dV home: (C-1) + C messages a rank, ring_traffic's bytes.
    Every causal sub-block is computed once, 2C+1 of them on every rank under zig-zag."""
    from minipar.comm.protocol import HEADER_BYTES
    from minipar.parallel.context import ring_attention as ra
    proc, trace, _ = explained("ring-attention", 4, tmp_path_factory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    C, n = 4, 2 * 2 * 4 * 4                                             # RING_SHAPE: B H t hs, t = T/C = 4
    for r in range(C):                                                  # the trace itself, before any reading
        sends = _sends(trace, r)
        assert len(sends) == (C - 1) + C, (r, len(sends))
        assert [e["args"]["bytes_sent"] for e in sends] == [8 * 2 * n + HEADER_BYTES] * (C - 1) + \
            [8 * 4 * n + HEADER_BYTES] * (C - 1) + [8 * 2 * n + HEADER_BYTES], r
        assert {p for e in sends for p in e["args"]["peers"]} == {(r + 1) % C}
        assert len(_sends(trace, r, "recv")) == (C - 1) + C
    pic = ring_attention.ring_picture(trace)
    assert pic.problems == [], pic.problems
    for r in range(C):
        mine = [m for m in pic.messages if m.src == r]
        assert (len(mine), sum(m.nbytes for m in mine)) == ra.ring_traffic(n, C, 8)
        got = [(m.pas, m.step, m.carries, m.owner, m.read) for m in mine]
        want = [("forward", j, "K,V", (r - j) % C, True) for j in range(C - 1)] + \
               [("backward", j, "K,V,dK,dV", (r - j) % C, True) for j in range(C - 1)] + \
               [("backward", C - 1, "dK,dV", (r + 1) % C, False)]         # derived: home is the next rank
        assert got == want, f"rank {r}: {got} != {want}"
    c = pic.T // (2 * C)
    assert sorted(pic.cells) == [(a, b) for a in range(2 * C) for b in range(a + 1)]
    for (a, b), (r, j) in pic.cells.items():
        assert a in (r, 2 * C - 1 - r), (a, b, r)                      # zig-zag: rank r's queries
        assert b in ((r - j) % C, 2 * C - 1 - (r - j) % C), (a, b, r, j)  # the K, V of rank r - j
    assert pic.masked == {(a, a) for a in range(2 * C)} and c == 2
    assert pic.blocks["picture"] == [2 * C + 1] * C == pic.blocks["measured forward"]
    assert pic.balance["contiguous"][1] == [4 * r + 3 for r in range(C)]
    T = pic.T
    assert pic.balance["zigzag"][0] == [T * (T + 1) // (2 * C)] * C   # the same causal pairs on every rank
    assert pic.balance["contiguous"][0] == [4 * r * c * c + c * (2 * c + 1) for r in range(C)]


def test_ring_attention_svg_names_each_rank_and_step(tmp_path_factory):
    proc, _, out = explained("ring-attention", 4, tmp_path_factory)
    root = ET.parse(os.path.join(out, "explain-ring-attention-p4.svg")).getroot()
    texts = ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert texts[0] == proc.stdout.splitlines()[0]
    assert sorted(t.split(":")[0] for t in texts if t.startswith("rank ")) == [f"rank {r}" for r in range(4)], texts
    assert [texts.count(f"step {j}") for j in range(4)] == [2, 2, 2, 1], texts      # forward 0..2, backward 0..3
    assert texts.count("K,V[0]") == 3 and texts.count("dK,dV[0]*") == 1, texts     # every message, labelled
    # "rN": the 2 x 2C chunks of (a), and the 2C(2C+1)/2 computed sub-blocks of (b)
    assert sum(t.startswith("r") and t[1:].isdigit() for t in texts) == 2 * 8 + 8 * 9 // 2, texts
    assert not any(t.startswith("PROBLEM") for t in texts)
    zigzag, contiguous = texts.index("zig-zag"), texts.index("contiguous")       # (a): the two splits
    assert texts[zigzag + 1:zigzag + 9] == ["r0", "r1", "r2", "r3", "r3", "r2", "r1", "r0"], texts[zigzag:]
    assert texts[contiguous + 1:contiguous + 9] == ["r0", "r0", "r1", "r1", "r2", "r2", "r3", "r3"], texts


def _ring_send(trace, rank, step, pas="forward"):
    """The args of rank's send at ring step `step` of pass `pas` (forward: its first C-1 sends)."""
    C = trace["otherData"]["minipar"]["world"]
    sends = [e for e in trace["traceEvents"] if e.get("cat") == "comm" and e["pid"] == rank and e["ph"] in ("X", "b")
             and e["args"]["op"] == "send"]
    return sends[step if pas == "forward" else C - 1 + step]["args"]


def test_ring_attention_planted_mistakes_are_reported(tmp_path_factory, tmp_path, monkeypatch):
    """A K, V message that claims another rank's block, a dK, dV message that never went home,
    a rank's counted sub-blocks off by one, and a reader whose split gives chunk 1 to rank 0:
    each is named; the drawing says PROBLEM and the command would exit 1."""
    from minipar.parallel.context import ring_attention as ra
    _, trace, _ = explained("ring-attention", 4, tmp_path_factory)
    wrong = copy.deepcopy(trace)                    # rank 1, forward step 0: its own K, V (positions 2..13)
    payload = _ring_send(wrong, 1, 0)["messages"][1]
    payload[4:6] = [5 / 16, 12 / 16]                # now claims rank 2's block (positions 4..11)
    problems = ring_attention.ring_picture(wrong).problems
    assert "forward step 0: rank 1 passes on the block of rank 2 but holds rank 1's" in problems, problems
    assert "forward step 1: rank 2 passes on the block of rank 1 but holds rank 2's" in problems, problems
    assert any("computed twice" in p for p in problems) and any("computed by no rank" in p for p in problems)
    lost = copy.deepcopy(trace)
    args = _ring_send(lost, 2, 3, "backward")        # rank 2's dK, dV home
    args["peers"], args["messages"] = [0], [[s, k, 0, *rest] for s, k, _, *rest in args["messages"]]
    problems = ring_attention.ring_picture(lost).problems
    assert "backward step 3: rank 2 sends dK, dV of rank 3's block to rank 0, not home" in problems, problems
    assert "backward step 3: rank 2 sends to rank 0, which never receives it" in problems, problems
    counted = copy.deepcopy(trace)
    counted["otherData"]["minipar"]["blocks"][3][1] += 1
    problems = ring_attention.ring_picture(counted).problems
    assert problems == ["sub-blocks per rank: [9, 9, 9, 9] in the picture, [9, 9, 9, 10] by measured backward"]
    split = ra.positions

    def wrong_split(rank, C, T, layout="zigzag"):    # chunk 1 to rank 0, chunk 0 to rank 1
        mine = split(rank, C, T, layout)
        return mine + (2 if rank == 0 else -2 if rank == 1 else 0) * (mine < 2 * 2)
    monkeypatch.setattr(ra, "positions", wrong_split)
    problems = ring_attention.ring_picture(trace).problems
    assert any(p.startswith("forward step 0: rank 0 -> 1: no rank's block starts and ends at positions 0 and 15")
               for p in problems), problems
    monkeypatch.undo()
    path = str(tmp_path / "planted.json")
    with open(path, "w") as f:
        json.dump(wrong, f)
    assert explain.draw(path, str(tmp_path)) != []
    assert "PROBLEM: forward step 0: rank 1 passes on" in open(tmp_path / "explain-ring-attention-p4.svg").read()


# --- mixture of experts ------------------------------------------------------------------------------

def explained_moe(p, factor, tmp_path_factory):
    """`python -m minipar.explain moe-dispatch --p P --capacity-factor F`, once per session."""
    return explained("moe-dispatch", p, tmp_path_factory, "--capacity-factor", str(factor))


def _moe_all_to_alls(trace, rank):
    """A rank's all_to_all calls, in time order, straight from the trace."""
    return [e["args"] for e in sorted(traceview.spans(trace, "comm", rank), key=lambda e: e["ts"])
            if e["args"]["op"] == "all_to_all"]


def test_moe_dispatch_with_a_capacity_moves_each_kept_assignment_once(tmp_path_factory):
    """ep = 4, E = 4, top-2, 6 tokens a rank, capacity ceil(1.25 6 2 / 4) = 4: every all-to-all message
    is the capacity tensor's E/P cap rows (padded), each kept assignment sits in exactly one message to
    its expert's rank, a dropped one in none, and each rank sends expert_parallel.ep_bytes."""
    proc, trace, _ = explained_moe(4, 1.25, tmp_path_factory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    P, E, K, N, C, cap = 4, 4, 2, 6, 4, 4
    for r in range(P):                                                  # the trace itself, before any reading
        calls = _moe_all_to_alls(trace, r)
        assert len(calls) == 4 and {a["algorithm"] for a in calls} == {"pairwise exchange"}, calls
        for a in calls:
            sends = [m for m in a["messages"] if m[1] == "send"]
            assert sorted(m[2] for m in sends) == [q for q in range(P) if q != r]
            assert {m[3] for m in sends} == {E // P * cap * C * 8}, sends
            assert a["bytes_sent"] == (P - 1) * E // P * cap * C * 8
    pic = moe.moe_picture(trace)
    assert pic.problems == [] and pic.cap == cap and pic.calls == moe.MOE_CALLS[True], pic.problems
    seen = {}
    for (src, dst), per_expert in pic.rows.items():
        for i, rows in enumerate(per_expert):
            assert len(rows) == cap, (src, dst, rows)
            for slot, t in enumerate(rows):
                if t is not None:
                    seen.setdefault((t, dst * E // P + i), []).append(slot)
    for r, route in enumerate(pic.routing):
        for n in range(N):
            for k in range(K):
                e, t = int(route["choice"][n, k]), r * N + n
                want = [int(route["slot"][n, k])] if route["kept"][n, k] else []
                assert seen.pop((t, e), []) == want, (r, n, k)
    assert seen == {}, seen                                             # no row that no one routed
    assert sum(int((~route["kept"]).sum()) for route in pic.routing) == 6       # what the drawing shows
    assert all(b["total"] == b["ep_bytes"] == b["counted"] == 4 * (P - 1) * cap * C * 8 for b in pic.bytes.values())
    assert proc.stdout.startswith("MoE dispatch and combine, ep=4: E=4 experts (1 per rank), top-2, 6 tokens per "
                                  "rank, C=4 float64, capacity ceil(1.25·6·2/4) = 4 slots per expert"), proc.stdout
    # rank 2: t13, t14 take e1 with their first choice, then the second choices in token order fill it
    assert "    t16  e3 0.50 #0        e1 0.50 dropped" in proc.stdout.splitlines(), proc.stdout


def test_moe_dispatch_without_capacity_sends_exactly_the_kept_rows(tmp_path_factory):
    """--capacity-factor 0: no drops, variable all-to-alls (a row count first), and the counts of each
    expert's rows by source as a fifth all-to-all; each rank's bytes differ and equal ep_bytes."""
    proc, trace, _ = explained_moe(2, 0.0, tmp_path_factory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pic = moe.moe_picture(trace)
    assert pic.problems == [] and pic.cap is None and pic.calls == moe.MOE_CALLS[False], pic.problems
    assert all(route["kept"].all() for route in pic.routing)
    assert sum(len(pic.flat(s, d)) for s in range(2) for d in range(2)) == 2 * 6 * 2     # every assignment once
    for r in range(2):
        dispatch = _moe_all_to_alls(trace, r)[0]
        rows = len(pic.flat(r, 1 - r))
        assert [m[3] for m in dispatch["messages"] if m[1] == "send"] == [8, rows * 4 * 8], dispatch
        assert pic.bytes[r]["total"] == pic.bytes[r]["ep_bytes"] == pic.bytes[r]["counted"]
    assert pic.bytes[0]["dispatch"] != pic.bytes[1]["dispatch"]        # the load differs by rank


def test_moe_dispatch_planted_mistakes_are_reported(tmp_path_factory, tmp_path):
    """A dispatch message that names another token, a message one row short, a dropped assignment
    marked kept, and a layer count off by a byte: each is named; the drawing says PROBLEM in red and
    the command would exit 1."""
    _, trace, _ = explained_moe(4, 1.25, tmp_path_factory)
    assert moe.moe_picture(trace).problems == []
    wrong = copy.deepcopy(trace)                        # rank 0 -> 1: e1's rows start with t0
    _, m = _message(wrong, 0, 1)
    assert m[2] == 1 and m[4] == 1 / moe.MOE_MARK, m
    m[4] = 2 / moe.MOE_MARK                     # now the first row says t1
    problems = moe.moe_picture(wrong).problems
    assert problems == ["dispatch: rank 0 -> 1 carries t1, t4 first and last; its routing puts t0, t4 there"], problems
    short = copy.deepcopy(trace)
    _, m = _message(short, 3, 2)                        # rank 3's dispatch, round 2: to rank 1
    m[3] -= 32
    problems = moe.moe_picture(short).problems
    assert "dispatch: rank 3 sends 96 B to rank 1, not 128 B (4 rows of C = 4 float64)" in problems, problems
    assert "dispatch: rank 1 receives 128 B from rank 3, which sent it 96 B" in problems, problems
    kept = copy.deepcopy(trace)
    kept["otherData"]["minipar"]["routing"][2]["kept"][5][1] = True      # t17's e1: dropped, now kept
    problems = moe.moe_picture(kept).problems
    assert problems[0] == ("rank 2: token 5's choice 2 (expert 1) is kept; the claim order (moe.claim_slots) "
                           "drops it"), problems
    assert any(p.startswith("dispatch: rank 2 sends 128 B to rank 1, not 160 B") for p in problems), problems
    counted = copy.deepcopy(trace)
    counted["otherData"]["minipar"]["counted"][1] += 1
    problems = moe.moe_picture(counted).problems
    assert problems == ["rank 1 sends 1536 B in its all-to-alls; ep_bytes says 1536 B, the layer counted 1537 B"]
    path = str(tmp_path / "planted.json")
    with open(path, "w") as f:
        json.dump(wrong, f)
    assert explain.draw(path, str(tmp_path)) != []      # what the command's exit status 1 comes from
    svg = open(tmp_path / "explain-moe-dispatch-p4.svg").read()
    assert 'fill="#c00000">PROBLEM: dispatch: rank 0 -&gt; 1 carries t1, t4' in svg, svg[-600:]


def test_moe_dispatch_svg_shows_every_rank_message_and_drop(tmp_path_factory):
    proc, trace, out = explained_moe(4, 1.25, tmp_path_factory)
    root = ET.parse(os.path.join(out, "explain-moe-dispatch-p4.svg")).getroot()
    texts = ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert texts[0] == proc.stdout.splitlines()[0]
    assert sum(t.endswith(" dropped") and t.startswith("e") for t in texts) == 6, texts
    assert sum(t.startswith("128 B, read ") for t in texts) == 12 and texts.count("128 B *") == 12, texts
    assert [t for t in texts if t.startswith("rank ") and t[5:].isdigit()] == [f"rank {r}" for r in range(4)] * 4
    assert not any(t.startswith("PROBLEM") for t in texts)


# --- the files ----------------------------------------------------------------------------------

@pytest.mark.parametrize("what,p", [("ring-all-reduce", 4), ("megatron-mlp", 2), ("1f1b", 3)])
def test_svg_parses_with_a_row_per_rank_and_the_title(what, p, tmp_path_factory):
    proc, _, out = explained(what, p, tmp_path_factory)
    root = ET.parse(os.path.join(out, f"explain-{what}-p{p}.svg")).getroot()
    texts = ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")]
    label = "stage" if what == "1f1b" else "rank"
    assert sorted(t for t in texts if t.startswith(f"{label} ")) == [f"{label} {r}" for r in range(p)], texts
    assert texts[0] == proc.stdout.splitlines()[0], (texts[0], proc.stdout.splitlines()[0])


@pytest.mark.parametrize("what,p", [("ring-all-reduce", 4), ("megatron-mlp", 2), ("ring-attention", 4),
                                   ("moe-dispatch", 4)])
def test_png_has_the_svgs_size_and_is_not_blank(what, p, tmp_path_factory):
    pytest.importorskip("resvg_py")
    Image = pytest.importorskip("PIL.Image")
    _, _, out = explained_moe(4, 1.25, tmp_path_factory) if what == "moe-dispatch" else \
        explained(what, p, tmp_path_factory)
    root = ET.parse(os.path.join(out, f"explain-{what}-p{p}.svg")).getroot()
    with Image.open(os.path.join(out, f"explain-{what}-p{p}.png")) as im:
        assert im.size == (round(float(root.get("width"))), round(float(root.get("height"))))
        colours = im.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 20, colours        # text and coloured bands, not a blank page


# --- the command line ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [(["broadcastt"], "unknown WHAT 'broadcastt'"),
                                         (["ring-all-reduce", "--p", "1"], "--p 1: need 2 <= P <= 16"),
                                         (["reduce", "--p", "17"], "--p 17"),
                                         (["megatron-mlp", "--p", "3"], "--p 3"),
                                         (["ring-attention", "--p", "9"], "--p 9: ring-attention draws 2 <= P <= 8"),
                                         (["ring-attention", "--bytes", "64"], "--bytes 64"),
                                         (["moe-dispatch", "--p", "3"], "--p 3: moe-dispatch splits E = 4 experts"),
                                         (["gqa-tp", "--p", "3"], "--p 3: gqa-tp splits 8 query heads"),
                                         (["reduce", "--capacity-factor", "1"], "--capacity-factor 1 is for moe-"),
                                         (["moe-dispatch", "--capacity-factor", "-1"], "need 0 <= F <= 100"),
                                         (["ring-all-reduce", "--bytes", "12"], "--bytes 12")])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    assert explain.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("minipar.explain: error: ") and needle in err, err


def test_a_launch_that_outlives_its_timeout_is_killed_and_says_so(tmp_path):
    env = dict(ENV, MINIPAR_EXPLAIN_TIMEOUT="0.2")
    proc = subprocess.run([sys.executable, "-m", "minipar.explain", "reduce", "--out", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "did not finish within 0.2 s" in proc.stderr, proc.stderr
    time.sleep(0.2)
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(tmp_path).encode() in f.read():
                    left.append(pid)
        except OSError:
            pass
    assert left == [], f"processes left running: {left}"


def test_under_mpirun_the_ranks_are_the_workers(tmp_path):
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    proc = subprocess.run([mpirun, "-n", "2", sys.executable, "-m", "minipar.explain", "all-gather", "--out",
                           str(tmp_path)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ring all-gather, p=2,") == 1, proc.stdout      # rank 0 draws, once
    assert os.path.isfile(tmp_path / "explain-all-gather-p2.svg")


# --- grouped-query attention under tensor parallelism ----------------------------------------------

def test_gqa_tp_holdings_read_from_the_shards_and_the_shared_heads_sums(tmp_path_factory):
    """tp 4, H 8, Hkv 2: rank r holds query heads 2r, 2r+1 and key/value head r // 2, a copy on 2
    ranks, whose k_proj and v_proj gradients it sums with its partner (two all-reduces of one
    head's (C, hs) = (16, 2) float64 = 256 B); tp 2: each rank its own key/value head, no sum."""
    proc, trace, out = explained("gqa-tp", 4, tmp_path_factory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pic = gqa_tp.gqa_picture(trace)
    assert pic.problems == [], pic.problems
    assert pic.q_heads == [[2 * r, 2 * r + 1] for r in range(4)] and pic.kv_heads == [[r // 2] for r in range(4)]
    assert pic.sums == [[([r ^ 1], 256)] * 2 for r in range(4)], pic.sums
    assert "rank 2    .  .  .  . q4 q5  .  .     . k1    k_proj, v_proj gradients summed with rank 3: 2 " \
           "all-reduces of 256 B" in proc.stdout, proc.stdout
    root = ET.parse(os.path.join(out, "explain-gqa-tp-p4.svg")).getroot()
    texts = ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert texts[0] == proc.stdout.splitlines()[0] and [t for t in texts if t.startswith("rank ")] == \
        [f"rank {r}" for r in range(4)], texts
    proc2, trace2, _ = explained("gqa-tp", 2, tmp_path_factory)
    pic2 = gqa_tp.gqa_picture(trace2)
    assert proc2.returncode == 0 and pic2.problems == [] and pic2.sums == [[], []], (pic2.problems, pic2.sums)
    assert pic2.q_heads == [[0, 1, 2, 3], [4, 5, 6, 7]] and pic2.kv_heads == [[0], [1]]


def test_gqa_tp_planted_mistakes_are_reported(tmp_path_factory, tmp_path):
    """A shared head's sum missing on one rank, a sum over the wrong ranks, a query head held
    twice (and one never), a rank without the key/value head its query heads read: each named."""
    _, trace, _ = explained("gqa-tp", 4, tmp_path_factory)
    missing = copy.deepcopy(trace)
    missing["traceEvents"] = [e for e in missing["traceEvents"]
                              if not (e.get("cat") == "comm" and e["pid"] == 1 and len(e["args"]["group"]) == 2)]
    problems = gqa_tp.gqa_picture(missing).problems
    assert problems == ["rank 1 holds key/value heads [0] (also on ranks [0]): want two all-reduces of 256 B over "
                        "ranks [0], the trace shows []"], problems
    wide = copy.deepcopy(trace)
    for e in wide["traceEvents"]:
        if e.get("cat") == "comm" and e["pid"] == 2 and len(e["args"]["group"]) == 2:
            e["args"]["group"] = [0, 2, 3]
    assert any(p.startswith("rank 2 holds key/value heads [1] (also on ranks [3])")
               for p in gqa_tp.gqa_picture(wide).problems)
    twice = copy.deepcopy(trace)
    twice["otherData"]["minipar"]["q_heads"][1] = [1, 3]
    problems = gqa_tp.gqa_picture(twice).problems
    assert problems[0] == "the query heads held over the ranks are [0, 1, 1, 3, 4, 5, 6, 7], not each of 0..7 once"
    unread = copy.deepcopy(trace)
    unread["otherData"]["minipar"]["kv_heads"][3] = [0]
    problems = gqa_tp.gqa_picture(unread).problems
    assert "rank 3 holds query head 6, which reads key/value head 1, but not that head (it holds [0])" in problems
    path = str(tmp_path / "planted.json")
    with open(path, "w") as f:
        json.dump(missing, f)
    assert explain.draw(path, str(tmp_path)) != []
    svg = open(tmp_path / "explain-gqa-tp-p4.svg").read()
    assert 'fill="#c00000">PROBLEM: rank 1 holds key/value heads [0]' in svg
