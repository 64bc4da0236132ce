"""python -m minipar.explain ulysses: Ulysses attention's four all-to-alls, read back from the run's
trace and checked against ulysses.py's formulas (head_split, kv_heads_of, ulysses_traffic); then
planted mistakes in the trace, each of which the reader must name, in red in the drawing, with
exit status 1.

One real run per P (mpirun under the launcher's timeout, about two seconds each); the planted
mistakes are edits of its trace, drawn without MPI.
"""
import copy
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from minipar.explain import cli as explain, ulysses
from minipar.parallel.context.ring_attention import positions
from minipar.parallel.context.ulysses import head_split, kv_heads_of, ulysses_traffic
from minipar.show import traceview
from test_explain import explained as explain_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_EXPLAIN_TIMEOUT="60")
B, H, HKV, HS, CHUNK = ulysses.ULY_SHAPE


def explained(p, tmp_path_factory):
    """`python -m minipar.explain ulysses --p P`, once per session -> (process, trace, out dir)."""
    return explain_run("ulysses", p, tmp_path_factory, env=ENV, timeout=120)


def all_to_alls(trace, rank):
    """A rank's all_to_all calls, in time order, straight from the trace."""
    return [e for e in sorted(traceview.spans(trace, "comm", rank), key=lambda e: e["ts"])
            if e["args"]["op"] == "all_to_all"]


def sends(event):
    return [m for m in event["args"]["messages"] if m[1] == "send"]


# --- the clean runs ---------------------------------------------------------------------------------

def test_ulysses_cp4_trace_is_four_all_to_alls_of_the_formulas_pieces(tmp_path_factory):
    """cp 4, H 8, Hkv 2: per rank 2 all-to-alls in forward and 2 in backward (by the layer spans),
    each sending C-1 pieces, one to every other rank, of B t (Hq + 2 kv) hs 8 bytes (q,k,v out, dq,
    dk, dv home) or B t Hq hs 8 (y home, dy out); ulysses_traffic's bytes in all."""
    proc, trace, _ = explained(4, tmp_path_factory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    C, t = 4, 2 * CHUNK
    Hq, kv = head_split(H, HKV, C)
    big, small = B * t * (Hq + 2 * kv) * HS * 8, B * t * Hq * HS * 8
    for r in range(C):                                          # the trace itself, before any reading
        calls = all_to_alls(trace, r)
        assert len(calls) == 4, (r, len(calls))
        spans = {e["args"]["pass"]: e for e in traceview.spans(trace, "layer", r)
                 if e["args"]["layer"] == "ulysses attention"}
        passes = [next(p for p, s in spans.items() if s["ts"] <= e["ts"] and e["end"] <= s["end"]) for e in calls]
        assert passes == ["forward", "forward", "backward", "backward"], passes
        for e, size in zip(calls, (big, small, small, big)):
            assert sorted(m[2] for m in sends(e)) == [q for q in range(C) if q != r], e["args"]
            assert {m[3] for m in sends(e)} == {size}, e["args"]
        assert sum(e["args"]["bytes_sent"] for e in calls) == ulysses_traffic(B * t, Hq, kv, HS, C, 8) == 4608
    pic = ulysses.uly_picture(trace)
    assert pic.problems == [], pic.problems
    assert pic.q_heads == [[2 * j, 2 * j + 1] for j in range(C)]
    assert pic.kv_heads == [[int(k) for k in kv_heads_of(j, HKV, C)] for j in range(C)] == [[0], [0], [1], [1]]
    for p in pic.pieces:
        s, d = p.src, p.dst
        want = {0: (s, (2 * d, d // 2)), 1: (d, (2 * s, 2 * s + 1)), 2: (s, (2 * d, 2 * d + 1)),
                3: (d, (2 * s, s // 2))}[p.call]
        assert (p.tokens, p.heads, p.read) == (*want, p.call in (0, 2)), (p, want)
    assert len(pic.pieces) == 4 * C * (C - 1)
    # a KV head copied to 2 ranks: each rank's dV of it is the sum of those two ranks' parts
    for (i, k), (got, parts) in pic.sums.items():
        assert [s for s, _, _ in parts] == [2 * k, 2 * k + 1], (i, k, parts)
        assert [wire for s, _, wire in parts] == [s != i for s, _, _ in parts]
        assert abs(got - sum(v for _, v, _ in parts)) <= 1e-9 * max(1, abs(got))
    assert proc.stdout.splitlines()[0] == pic.title
    assert "  rank 1: query heads [2, 3], KV head(s) [0], a copy also on rank(s) [0]" in proc.stdout
    assert "  position  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15" in proc.stdout
    assert "  rank     r0 r0 r1 r1 r2 r2 r3 r3 r3 r3 r2 r2 r1 r1 r0 r0" in proc.stdout


def test_ulysses_cp2_keeps_each_kv_head_on_one_rank(tmp_path_factory):
    """cp 2: Hkv = 2 = C, so each rank has its own KV head (no copy) and 4 query heads; each
    KV head's gradient at a rank's tokens comes from one rank, nothing to sum."""
    proc, trace, _ = explained(2, tmp_path_factory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pic = ulysses.uly_picture(trace)
    assert pic.problems == [], pic.problems
    assert pic.q_heads == [[0, 1, 2, 3], [4, 5, 6, 7]] and pic.kv_heads == [[0], [1]]
    assert all(len(parts) == 1 for _, parts in pic.sums.values()), pic.sums
    assert pic.sent == [(4, ulysses_traffic(B * 2 * CHUNK, 4, 1, HS, 2, 8))] * 2 == [(4, 2560)] * 2


def test_ulysses_svg_draws_every_rank_state_and_piece(tmp_path_factory):
    proc, _, out = explained(4, tmp_path_factory)
    root = ET.parse(os.path.join(out, "explain-ulysses-p4.svg")).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    texts = ["".join(t.itertext()) for t in root.iter(f"{ns}text")]
    assert texts[0] == proc.stdout.splitlines()[0]
    assert [t for t in texts if t.startswith("rank ") and t[5:].isdigit()] == [f"rank {r}" for r in range(4)] * 9
    assert texts.count("kept") == 4 * 4 and sum(t.endswith("*") for t in texts) == 2 * 12, texts
    assert "q2-3,kv0 [r0]" in texts and "dq2-3,dkv0 [r0]*" in texts
    assert "q2-3, kv0 (copy: r0)" in texts                      # under rank 1's grid after the first all-to-all
    assert not any(t.startswith("PROBLEM") for t in texts)
    # after the last all-to-all, each rank's KV rows hold two colours per cell: the parts summed
    halves = [r for r in root.iter(f"{ns}rect") if r.get("width") == f"{ulysses.CELL / 2:.1f}"]
    assert len(halves) == 4 * 4 * 2 * 2, len(halves)           # ranks x own tokens x KV heads, 2 halves each


# --- the planted mistakes ---------------------------------------------------------------------------

def _call(trace, rank, k):
    return all_to_alls(trace, rank)[k]["args"]


def _raw(trace, rank, k):
    """The trace's own event (not traceview's copy) of rank's k-th all-to-all."""
    ts = all_to_alls(trace, rank)[k]["ts"]
    return next(e for e in trace["traceEvents"] if e.get("cat") == "comm" and e["pid"] == rank and e["ts"] == ts)


def _send(trace, rank, k, dst):
    return next(m for m in sends(_raw(trace, rank, k)) if m[2] == dst)


def _marker(head, pos):
    return (head * 16 + pos + 1) / ulysses.ULY_MARK


def drop_backward_all_to_all(t):
    t["traceEvents"].remove(_raw(t, 2, 3))                      # rank 2's dq,dk,dv home, gone


def short_piece(t):
    _send(t, 0, 0, 1)[3] -= 64                                  # rank 0's q,k,v piece for rank 1: 448 B


def heads_to_the_wrong_rank(t):
    _send(t, 0, 0, 1)[4] = _marker(4, 0)                        # rank 1 gets query head 4 (rank 2's) first


def kv_head_not_copied(t):
    for s in (0, 2, 3):                                         # every q,k,v piece to rank 1: KV head 1, not 0
        m = _send(t, s, 0, 1)
        m[5] = _marker(1, int(positions(s, 4, 16)[-1]))


def kv_gradient_not_summed(t):
    meta = t["otherData"]["minipar"]
    meta["dv_home"][0][0] = _send(t, 1, 3, 0)[5]                # rank 0 kept rank 1's part alone


def piece_to_the_wrong_rank(t):
    m = _send(t, 0, 0, 1)
    m[2] = 2                                                    # rank 0's piece for rank 1 went to rank 2


def output_of_another_head(t):
    a, b = _send(t, 1, 1, 0), _send(t, 2, 1, 0)                 # y home to rank 0: ranks 1 and 2 swapped
    a[4:6], b[4:6] = b[4:6], a[4:6]


PLANTED = [
    (drop_backward_all_to_all, "rank 2: backward makes 1 all-to-all(s), not 2"),
    (drop_backward_all_to_all, "all-to-all 4 (backward dq,dk,dv home): rank 0 receives 512 B from rank 2, which "
                               "sent it nothing"),
    (short_piece, "all-to-all 1 (forward q,k,v to the heads): rank 0 sends 448 B to rank 1, not 512 B "
                  "(B t (Hq + 2 kv) hs 8)"),
    (short_piece, "rank 0 sends 12 pieces, 4544 B (its ledger: 4608 B); Ulysses sends 4 (C-1) = 12, "
                  "ulysses_traffic says 4608 B"),
    (heads_to_the_wrong_rank, "all-to-all 1 (forward q,k,v to the heads): rank 0 -> 1 carries query head 4 first; "
                              "head_split gives rank 1 query heads 2-3"),
    (kv_head_not_copied, "KV head 0 is copied to ranks [0]; kv_heads_of puts it on ranks [0, 1]"),
    (kv_head_not_copied, "rank 1 attends with query head 2, which reads KV head 0, without it (it has KV head(s) "
                         "[1])"),
    (kv_gradient_not_summed, "rank 0: the layer's dV of KV head 0 at position 15 is "),
    (piece_to_the_wrong_rank, "all-to-all 1 (forward q,k,v to the heads): rank 0 sends to ranks [2, 2, 3], not "
                              "once to each of [1, 2, 3]"),
    (piece_to_the_wrong_rank, "all-to-all 1 (forward q,k,v to the heads): rank 1 receives 512 B from rank 0, "
                              "which sent it nothing"),
    (piece_to_the_wrong_rank, "all-to-all 1 (forward q,k,v to the heads): rank 0 sends 512 B to rank 2, which "
                              "never receives it"),
    (output_of_another_head, "all-to-all 2 (forward y home): rank 1 -> 0 carries "),
]


def test_the_reader_checks_against_ulysses_own_formulas(tmp_path_factory, monkeypatch):
    """The clean trace against a kv_heads_of that deals the KV heads round-robin (rank j: head j mod
    Hkv) and a ulysses_traffic one byte off: the reader takes both from ulysses.py, so each
    disagreement with what went on the wire is named."""
    from minipar.parallel.context import ulysses as uly
    _, trace, _ = explained(4, tmp_path_factory)
    monkeypatch.setattr(uly, "kv_heads_of", lambda j, Hkv, C: [j % Hkv])
    problems = ulysses.uly_picture(trace).problems
    assert "KV head 0 is copied to ranks [0, 1]; kv_heads_of puts it on ranks [0, 2]" in problems, problems
    assert "all-to-all 1 (forward q,k,v to the heads): rank 0 -> 1 carries KV head 0 last; kv_heads_of gives " \
           "rank 1 KV head(s) [1]" in problems, problems
    monkeypatch.undo()
    monkeypatch.setattr(uly, "ulysses_traffic", lambda *a: 4609)
    assert ulysses.uly_picture(trace).problems == [
        f"rank {r} sends 12 pieces, 4608 B (its ledger: 4608 B); Ulysses sends 4 (C-1) = 12, ulysses_traffic "
        f"says 4609 B" for r in range(4)]


def drawn(trace, tmp_path, monkeypatch, capsys):
    """`python -m minipar.explain ulysses` with its run's trace replaced by `trace` (no mpirun, no
    PNG) -> (exit status, stdout, stderr, the SVG)."""
    def launch(p, argv):
        with open(argv[argv.index("--trace-file") + 1], "w") as f:
            json.dump(trace, f)
    monkeypatch.setattr(explain, "mpirun", launch)
    monkeypatch.setattr(explain, "write_png", lambda svg, path: None)
    status = explain.main(["ulysses", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    return status, out, err, (tmp_path / "explain-ulysses-p4.svg").read_text()


def test_the_clean_trace_drawn_by_the_command_exits_0(tmp_path_factory, tmp_path, monkeypatch, capsys):
    _, trace, _ = explained(4, tmp_path_factory)
    status, out, err, svg = drawn(trace, tmp_path, monkeypatch, capsys)
    assert status == 0 and err == "" and out.startswith("Ulysses attention (zigzag), cp=4, T=16"), (status, err)
    assert "PROBLEM" not in out + svg


@pytest.mark.parametrize("plant,line", PLANTED, ids=[f"{p.__name__}-{i}" for i, (p, _) in enumerate(PLANTED)])
def test_a_planted_mistake_is_a_problem_in_red_and_exit_1(plant, line, tmp_path_factory, tmp_path, monkeypatch,
                                                          capsys):
    """Each plant edits the clean run's trace; the command, given that trace in place of its run's,
    prints the PROBLEM line, draws it in red and exits 1."""
    _, trace, _ = explained(4, tmp_path_factory)
    planted = copy.deepcopy(trace)
    plant(planted)
    problems = ulysses.uly_picture(planted).problems
    hits = [p for p in problems if p.startswith(line)]
    assert hits, f"{line!r} not among:\n" + "\n".join(problems)
    if plant is output_of_another_head:                         # the values say whose output it is not
        assert "where Ulysses puts y at position 0, query head 2:" in hits[0], hits
    if plant is kv_gradient_not_summed:                         # the two parts on the wire and kept, named
        part = _send(trace, 1, 3, 0)[5]
        assert hits[0].startswith(f"{line}{part:.6g}; the parts sent home sum to ") and \
            f"(its own) + {part:.6g} (from rank 1) = " in hits[0], hits
    status, out, err, svg = drawn(planted, tmp_path, monkeypatch, capsys)
    assert status == 1
    assert f"PROBLEM: {hits[0]}" in out and f"minipar.explain: problem: {hits[0]}\n" in err, err
    assert 'fill="#c00000">PROBLEM: ' + hits[0].replace("->", "-&gt;") in svg


def test_png_has_the_svgs_size_and_is_not_blank(tmp_path_factory):
    pytest.importorskip("resvg_py")
    Image = pytest.importorskip("PIL.Image")
    _, _, out = explained(4, tmp_path_factory)
    root = ET.parse(os.path.join(out, "explain-ulysses-p4.svg")).getroot()
    with Image.open(os.path.join(out, "explain-ulysses-p4.png")) as im:
        assert im.size == (round(float(root.get("width"))), round(float(root.get("height"))))
        colours = im.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 20, colours


# --- the command line -------------------------------------------------------------------------------

@pytest.mark.parametrize("p", ["3", "8"])
def test_ulysses_ranks_it_cannot_draw_are_one_line_and_exit_2(p, capsys):
    assert explain.main(["ulysses", "--p", p]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"minipar.explain: error: --p {p}: ulysses splits 8 query heads and 2 key/value "
                                 "heads with the pairwise all-to-all; P must be 2 or 4\n"), err
