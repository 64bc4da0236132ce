"""minipar.parallel.pipeline.schedules: pipeline schedules as data, the checker, the bubble formula,
the layer partition and which parameters each stage holds; and minipar.show.draw's Gantt chart
of a schedule. Serial, no MPI."""

import dataclasses

import pytest

from minipar.show.draw import ascii_gantt
from minipar.model.gpt import GPTConfig, param_specs
from minipar.parallel.pipeline.schedules import (SCHEDULES, Backward, Forward, RecvActivation, RecvGrad,
                                                 ScheduleError, SendActivation, SendGrad, bubble_theory,
                                                 check, gpipe, naive, one_f_one_b, partition, schedule,
                                                 stage_param_names)

NAMES = ["naive", "gpipe", "1f1b"]       # the others (interleaved, zb-h1, zb-h2): tests/test_schedules_more.py
assert set(NAMES) < set(SCHEDULES)
SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 4, 8, 16)]


def ops(instructions):
    """The compute ops of a stage's list, as strings: ["F0", "F1", "B0", ...]."""
    return [str(i) for i in instructions if isinstance(i, (Forward, Backward))]


def edit(name, stage, fn):
    """A schedule equal to `name` except that stage's list is passed through fn."""
    def broken(s, p, m):
        ins = schedule(name, s, p, m)
        return fn(ins) if s == stage else ins
    return broken


# ---------------------------------------------------------------- instructions and schedules

def test_instructions_print_short_and_are_frozen():
    got = [str(c(3)) for c in (Forward, Backward, SendActivation, RecvActivation, SendGrad, RecvGrad)]
    assert got == ["F3", "B3", "SendAct(3)", "RecvAct(3)", "SendGrad(3)", "RecvGrad(3)"]
    assert Forward(1) != Backward(1) and Forward(1) == Forward(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Forward(1).mb = 2


def test_compute_order_of_each_schedule():
    assert ops(naive(0, 4, 3)) == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert ops(gpipe(2, 4, 4)) == ["F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0"]
    # 1F1B on p=4: stage s warms up with p-s-1 forwards, then alternates, then drains
    assert ops(one_f_one_b(0, 4, 8)) == ("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7").split()
    assert ops(one_f_one_b(2, 4, 8)) == ("F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7").split()
    assert ops(one_f_one_b(3, 4, 8)) == ("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7").split()
    assert ops(one_f_one_b(0, 4, 2)) == ["F0", "F1", "B0", "B1"]         # warm-up capped at m
    assert schedule("1f1b", 1, 4, 8) == one_f_one_b(1, 4, 8)


@pytest.mark.parametrize("name", NAMES)
def test_messages_sit_next_to_their_ops_and_not_past_the_ends(name):
    for p in (1, 2, 4):
        for s in range(p):
            ins = schedule(name, s, p, 4)
            kinds = {type(i) for i in ins}
            if s == 0:
                assert not kinds & {RecvActivation, SendGrad}, f"{name} stage 0: {ins}"
            if s == p - 1:
                assert not kinds & {SendActivation, RecvGrad}, f"{name} last stage {s}: {ins}"
            for k, i in enumerate(ins):
                nxt, prev = ins[k + 1] if k + 1 < len(ins) else None, ins[k - 1] if k else None
                need = {RecvActivation: (nxt, Forward), RecvGrad: (nxt, Backward),
                        SendActivation: (prev, Forward), SendGrad: (prev, Backward)}.get(type(i))
                if need:
                    assert need[0] == need[1](i.mb), f"{name} stage {s}: {i} next to {need[0]} in {ins}"


def test_schedule_rejects_bad_names_and_numbers():
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'.*naive, gpipe, 1f1b"):
        schedule("pipedream", 0, 2, 2)
    with pytest.raises(ValueError, match="n_stages must be an integer >= 1, got 0"):
        schedule("gpipe", 0, 0, 2)
    with pytest.raises(ValueError, match="n_micro must be an integer >= 1, got 0"):
        schedule("1f1b", 0, 2, 0)
    with pytest.raises(ValueError, match=r"stage must be in 0\.\.3 for 4 stages, got 4"):
        schedule("naive", 4, 4, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        check(2, 2, "GPipe")
    with pytest.raises(ValueError, match="n_micro must be"):
        check(2, 0, "gpipe")


# ---------------------------------------------------------------- the checker accepts

@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_passes_the_eager_check(name):
    for p, m in SIZES:
        r = check(p, m, name)
        assert r.ok and r.n_stages == p and r.n_micro == m
        assert len(r.timeline) == 2 * p * m, f"{name} p={p} m={m}"
        assert r.busy == [3.0 * m] * p, f"{name} p={p} m={m}: busy {r.busy}"     # F=1, B=2


@pytest.mark.parametrize("name", ["naive", "gpipe"])
def test_naive_and_gpipe_pass_with_rendezvous_sends(name):
    for p, m in SIZES:
        assert check(p, m, name, rendezvous=True).ok
        # a send that waits for its receiver costs nothing here: nobody sends early
        assert check(p, m, name, rendezvous=True).makespan == check(p, m, name).makespan


def test_1f1b_deadlocks_with_rendezvous_sends_from_p2_m2():
    """Steady state: stage s sends an activation down while s+1 sends a gradient up; two
    blocking sends facing each other. Fine on one stage or one micro-batch."""
    for p, m in SIZES:
        if p == 1 or m == 1:
            assert check(p, m, "1f1b", rendezvous=True).ok
        else:
            with pytest.raises(ScheduleError, match="deadlocks"):
                check(p, m, "1f1b", rendezvous=True)
    with pytest.raises(ScheduleError) as e:
        check(2, 2, "1f1b", rendezvous=True)
    assert str(e.value) == (
        "1f1b p=2 m=2 deadlocks (rendezvous sends): "
        "stage 0 at instruction 3 (SendAct(1)) waits for stage 1 (at instruction 3 (SendGrad(0))) "
        "to post RecvAct(1); stage 1 at instruction 3 (SendGrad(0)) waits for stage 0 "
        "(at instruction 3 (SendAct(1))) to post RecvGrad(0)")


def test_timeline_respects_every_dependency():
    for name in NAMES:
        for p, m in [(1, 3), (2, 4), (4, 8), (3, 5)]:
            r = check(p, m, name, forward_time=1.0, backward_time=2.5)
            t = {(s, k, mb): (a, b) for s, k, mb, a, b in r.timeline}
            for s in range(p):
                row = [x for x in r.timeline if x[0] == s]
                assert all(x[4] <= y[3] for x, y in zip(row, row[1:])), f"{name} stage {s} overlaps"
                for mb in range(m):
                    assert t[s, "F", mb][1] <= t[s, "B", mb][0]
                    if s > 0:
                        assert t[s - 1, "F", mb][1] <= t[s, "F", mb][0]
                    if s < p - 1:
                        assert t[s + 1, "B", mb][1] <= t[s, "B", mb][0]
            assert r.makespan == max(x[4] for x in r.timeline)


def test_timeline_of_gpipe_p2_m2():
    r = check(2, 2, "gpipe")
    assert r.timeline == [(0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (0, "B", 1, 5, 7), (0, "B", 0, 7, 9),
                          (1, "F", 0, 1, 2), (1, "F", 1, 2, 3), (1, "B", 1, 3, 5), (1, "B", 0, 5, 7)]
    assert (r.makespan, r.busy) == (9, [6, 6])


# ---------------------------------------------------------------- bubble and memory

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(name):
    for p, m in SIZES:
        theory = (p - 1) / (m + p - 1)
        r = check(p, m, name, backward_time=1.0)                      # uniform: F = B
        assert r.makespan == 2 * (m + p - 1), f"{name} p={p} m={m}"
        assert r.bubble == pytest.approx(theory, abs=1e-12), f"{name} p={p} m={m}: {r.bubble}"
        assert r.bubble_theory == pytest.approx(theory, abs=1e-15)
        assert bubble_theory(name, p, m) == pytest.approx(r.bubble, abs=1e-12)   # the formula the others use
        # B = 2F: the same fraction (each direction fills and drains in p-1 of its own slots)
        assert check(p, m, name).bubble == pytest.approx(theory, abs=1e-12), f"{name} p={p} m={m}"


def test_naive_bubble_is_p_minus_1_over_p():
    for p, m in SIZES:
        for tb in (1.0, 2.0):
            r = check(p, m, "naive", backward_time=tb)
            assert r.bubble == pytest.approx((p - 1) / p, abs=1e-12), f"p={p} m={m} B={tb}"
            assert bubble_theory("naive", p, m) == pytest.approx(r.bubble, abs=1e-12)
            assert r.makespan == m * p * (1.0 + tb)


def test_activations_in_flight():
    for p, m in SIZES:
        one = check(p, m, "1f1b").peak_in_flight
        assert all(one[s] <= p - s for s in range(p)), f"p={p} m={m}: {one}"
        assert one == [min(p - s, m) for s in range(p)], f"p={p} m={m}: {one}"
        assert check(p, m, "gpipe").peak_in_flight == [m] * p
        assert check(p, m, "naive").peak_in_flight == [1] * p


# ---------------------------------------------------------------- the checker rejects

def test_rejects_a_gradient_that_never_comes():
    """GPipe p=2 m=2, stage 0 waits for micro-batch 1's gradient before sending micro-batch 1."""
    def swap(ins):                         # F0 SendAct0 F1 SendAct1 RecvGrad1 ... -> swap 3, 4
        ins[3], ins[4] = ins[4], ins[3]
        return ins
    with pytest.raises(ScheduleError) as e:
        check(2, 2, edit("gpipe", 0, swap))
    msg = str(e.value)
    assert "stage 0 at instruction 3 (RecvGrad(1)) waits for SendGrad(1) from stage 1" in msg, msg
    assert "stage 1 at instruction 2 (RecvAct(1)) waits for SendAct(1) from stage 0" in msg, msg


def test_rejects_a_missing_backward():
    for name in NAMES:
        with pytest.raises(ScheduleError, match=r"stage 0 never runs Backward of micro-batch\(es\) \[2\]"):
            check(3, 4, edit(name, 0, lambda ins: [i for i in ins if i != Backward(2)]))
        # on a middle stage: stage 0 then waits for a gradient that never comes (naive, 1f1b)
        # or gets micro-batch 1's instead (gpipe sends gradients in reverse order)
        with pytest.raises(ScheduleError, match=r"stage 0,? (at )?instruction \d+ \(RecvGrad\(2\)\)"):
            check(3, 4, edit(name, 1, lambda ins: [i for i in ins if i not in (Backward(2), SendGrad(2))]))


def test_rejects_messages_out_of_order():
    # stage 1 expects micro-batch 1 first, stage 0 sends micro-batch 0 first
    def reorder(ins):
        return [type(i)(1 - i.mb) if isinstance(i, (RecvActivation, Forward)) else i for i in ins]
    with pytest.raises(ScheduleError, match=r"stage 1, instruction 0 \(RecvAct\(1\)\): expected act of "
                                            r"micro-batch 1 from stage 0, but the next message is micro-batch 0"):
        check(2, 2, edit("gpipe", 1, reorder))
    with pytest.raises(ScheduleError, match="stage 1, instruction 0"):
        check(2, 2, edit("gpipe", 1, reorder), rendezvous=True)


@pytest.mark.parametrize("fn, message", [
    (lambda ins: [RecvActivation(0)] + ins, r"stage 0, instruction 0 \(RecvAct\(0\)\): the first stage has no previous"),
    (lambda ins: [Backward(0)] + ins, r"stage 0, instruction 0 \(B0\): backward of micro-batch 0 before its forward"),
    (lambda ins: ins[:1] + ins, r"stage 0, instruction 1 \(F0\): micro-batch 0 already forwarded"),
    (lambda ins: ins[:2] + [SendActivation(0)] + ins[2:], r"stage 0, instruction 2 \(SendAct\(0\)\): micro-batch 0 already sent"),
    (lambda ins: [SendActivation(1)] + ins, r"stage 0, instruction 0 \(SendAct\(1\)\): sends micro-batch 1 before its Forward"),
    (lambda ins: ins + [Forward(7)], r"instruction 8 \(F7\): micro-batch 7 is not in 0\.\.1"),
    (lambda ins: ins + ["F0"], r"stage 0, instruction 8 \(F0\): not an instruction"),
])
def test_rejects_illegal_instructions_on_stage_0(fn, message):
    with pytest.raises(ScheduleError, match=message):
        check(2, 2, edit("gpipe", 0, fn))


def test_rejects_ops_before_their_inputs_arrive():
    with pytest.raises(ScheduleError, match=r"stage 1, instruction 0 \(F0\): forward before RecvAct\(0\)"):
        check(2, 1, edit("gpipe", 1, lambda ins: [i for i in ins if i != RecvActivation(0)]))
    with pytest.raises(ScheduleError, match=r"stage 0, instruction 2 \(B0\): backward before RecvGrad\(0\)"):
        check(2, 1, edit("gpipe", 0, lambda ins: [i for i in ins if i != RecvGrad(0)]))
    with pytest.raises(ScheduleError, match=r"stage 1, instruction 2 \(SendAct\(0\)\): the last stage has no next"):
        check(2, 1, edit("gpipe", 1, lambda ins: ins[:2] + [SendActivation(0)] + ins[2:]))


# ---------------------------------------------------------------- the Gantt chart

def test_gantt_of_1f1b_p2_m3():
    chart = ascii_gantt(check(2, 3, "1f1b").timeline, 2)
    assert chart == ("stage 0 |F0F1....B0--F2B1--..B2--\n"
                     "stage 1 |..F0B0--F1B1--F2B2--....")
    assert chart == ascii_gantt(check(2, 3, "1f1b").timeline, 2)            # deterministic


def test_gantt_rows_widths_and_scaling():
    for name in NAMES:
        r = check(4, 8, name)
        rows = ascii_gantt(r.timeline, 4, width=100).splitlines()
        assert len(rows) == 4 and all(row.startswith(f"stage {s} |") for s, row in enumerate(rows))
        cells = 2 if 2 * r.makespan <= 100 else 1                   # naive: 96 units -> 1 cell
        assert {len(row) for row in rows} == {len("stage 0 |") + cells * int(r.makespan)}
        if name == "naive":                     # one cell per unit: F is its micro-batch only
            assert rows[0].startswith("stage 0 |0.........B01.........B1"), rows[0]
    # measured seconds: scaled to the width, from the earliest start
    secs = [(s, k, mb, 10.0 + a * 0.013, 10.0 + b * 0.013) for s, k, mb, a, b in check(3, 12, "1f1b").timeline]
    rows = ascii_gantt(secs, 3, width=150).splitlines()                   # 42 units, 3.6 cells each
    assert len(rows) == 3 and {len(row) for row in rows} == {len("stage 0 |") + 150}
    assert rows[0][len("stage 0 |"):].startswith("F0") and rows[2].endswith("..."), rows
    assert "Fa" in rows[0] and "Bb" in rows[0], "micro-batches 10 and 11 are drawn as a and b"
    many = ascii_gantt(check(2, 2, "gpipe").timeline, 12)                 # rows for idle stages too
    assert len(many.splitlines()) == 12 and many.splitlines()[11] == "stage 11 |" + "." * 18


# ---------------------------------------------------------------- layers and parameters

def test_partition_is_contiguous_balanced_and_spares_the_ends():
    assert [len(r) for r in partition(6, 4)] == [1, 2, 2, 1]
    assert [len(r) for r in partition(5, 4)] == [1, 1, 2, 1]
    assert [len(r) for r in partition(7, 4)] == [1, 2, 2, 2]
    assert [len(r) for r in partition(3, 2)] == [1, 2]
    assert partition(4, 1) == [range(0, 4)]
    assert partition(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    for L in range(1, 13):
        for p in range(1, L + 1):
            parts = partition(L, p)
            sizes = [len(r) for r in parts]
            assert [i for r in parts for i in r] == list(range(L)), f"L={L} p={p}: {parts}"
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1, f"L={L} p={p}: {sizes}"
            assert sizes[0] == min(sizes), f"L={L} p={p}: the first stage got an extra layer {sizes}"
            if p > 2 and L % p <= p - 2:
                assert sizes[-1] == min(sizes), f"L={L} p={p}: the last stage got an extra layer {sizes}"


def test_partition_errors_name_the_numbers():
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 pipeline stages"):
        partition(3, 4)
    with pytest.raises(ValueError, match="n_stages must be an integer >= 1, got 0"):
        partition(3, 0)
    with pytest.raises(ValueError, match="n_layer must be an integer >= 1, got 0"):
        partition(0, 1)


@pytest.mark.parametrize("tied", [True, False])
def test_stage_param_names_cover_the_model(tied):
    cfg = GPTConfig(n_layer=5, tie_embeddings=tied)
    canonical = [name for name, _, _ in param_specs(cfg)]
    assert stage_param_names(cfg, 0, 1) == canonical
    for p in (2, 3, 4, 5):
        per_stage = [stage_param_names(cfg, s, p) for s in range(p)]
        assert set().union(*per_stage) == set(canonical), f"p={p}"
        for names in per_stage:
            assert names == [n for n in canonical if n in names], "model order"
        holders = {n: [s for s in range(p) if n in per_stage[s]] for n in canonical}
        for n, stages in holders.items():
            want = [0, p - 1] if (n == "wte.weight" and tied) else stages[:1]
            assert stages == want, f"p={p} tied={tied}: {n} on stages {stages}"
        assert holders["wpe.weight"] == [0] and holders["ln_f.weight"] == [p - 1]
        for s, layers in enumerate(partition(5, p)):
            assert {n.split(".")[1] for n in per_stage[s] if n.startswith("h.")} == {str(i) for i in layers}
    if not tied:
        assert "lm_head.weight" in stage_param_names(cfg, 2, 3) and "wte.weight" not in stage_param_names(cfg, 2, 3)
    with pytest.raises(ValueError, match=r"stage must be in 0\.\.2 for 3 stages, got 3"):
        stage_param_names(cfg, 3, 3)
    with pytest.raises(ValueError, match="cannot split 5 layers into 6"):
        stage_param_names(cfg, 0, 6)
