"""The schedules past 1F1B as data: interleaved 1F1B (parallel/interleaved.py) and ZB-H1, ZB-H2
(parallel/zero_bubble.py). Each passes the checker for p = 1..8 (interleaved: 2..8) and m up to
32, with its in-flight peak and its bubble held to the theory; messages per micro-batch;
the theory with unequal F, B, W against the checker's simulation. Serial, no MPI."""
import pytest

from minipar.parallel.pipeline import interleaved, zero_bubble
from minipar.parallel.pipeline.schedules import (Backward, Forward, RecvActivation, SendActivation, SendGrad,
                                                 WeightGrad, bubble_theory, check, schedule)


def compute(ins):
    return [str(i) for i in ins if isinstance(i, (Forward, Backward, WeightGrad))]


@pytest.mark.parametrize("V", [1, 2, 3, 4])
def test_interleaved_passes_the_checker_and_the_theory(V):
    """Every p = 2..8 and m = p, 2p, ... <= 32: no deadlock, bubble (p-1)/(Vm+p-1) of the step
    ((p-1)/(Vm) of the ideal), first rank's peak in flight (in chunk-micro-batches, V per
    micro-batch) pV when m = p (all forwards first) and otherwise 1F1B's p times
    1 + (p-1)/(pV) (Narayanan et al. 2021)."""
    for p in range(2, 9):
        for m in range(p, 33, p):
            r = check(p, m, "interleaved", virtual=V)
            assert abs(r.bubble - (p - 1) / (V * m + p - 1)) < 1e-12, (p, m, V, r.bubble)
            assert r.bubble == pytest.approx(bubble_theory("interleaved", p, m, V), abs=1e-12)
            want = p * V if m == p else p * V + p - 1                      # = pV (1 + (p-1)/(pV))
            assert r.peak_in_flight[0] == want, (p, m, V, r.peak_in_flight)


@pytest.mark.parametrize("V", [2, 3])
def test_interleaved_messages_per_micro_batch(V):
    """A micro-batch crosses pV - 1 boundaries each way (p - 1 without interleaving): the
    sends of all ranks together."""
    p, m = 4, 8
    sends = {SendActivation: 0, SendGrad: 0}
    for s in range(p):
        for i in schedule("interleaved", s, p, m, V):
            if type(i) in sends:
                sends[type(i)] += 1
    assert sends == {SendActivation: m * (p * V - 1), SendGrad: m * (p * V - 1)}


def test_interleaved_order_and_the_wrap_around():
    """Rank 0 of p = 2, V = 2, m = 4: forwards of micro-batches 0, 1 through chunk 0, then
    chunk 1, ...; rank 1's chunk 0 sends to rank 0's chunk 1."""
    assert compute(interleaved.interleaved(0, 2, 4, 2))[:6] == ["F0", "F1", "F0@1", "F1@1", "F2", "B0@1"]
    ins = interleaved.interleaved(1, 2, 4, 2)
    assert SendActivation(0, 0) in ins and SendActivation(0, 1) not in ins     # the last chunk sends nothing
    assert RecvActivation(0, 1) in interleaved.interleaved(0, 2, 4, 2)


@pytest.mark.parametrize("p, m, V, message", [
    (4, 6, 2, "6 micro-batches is not a multiple of 4"),
    (1, 4, 2, "at least 2 pipeline stages, got 1"),
])
def test_interleaved_refuses_what_it_cannot_run(p, m, V, message):
    with pytest.raises(ValueError, match=message):
        schedule("interleaved", 0, p, m, V)


def test_virtual_stages_are_for_the_interleaved_schedule_only():
    with pytest.raises(ValueError, match="virtual stages \\(2\\) are for the interleaved schedule, not 1f1b"):
        schedule("1f1b", 0, 2, 4, 2)


@pytest.mark.parametrize("name, limit", [("zb-h1", lambda p: p), ("zb-h2", lambda p: 2 * p - 1)])
def test_zero_bubble_passes_the_checker_and_the_theory(name, limit):
    """p = 1..8, m = 1..32: no deadlock; every micro-batch through F, B and W once; at most p
    (ZB-H1, 1F1B's peak) or 2p - 1 (ZB-H2) micro-batches in flight from F to W; with
    F = B = W the bubble is (p-1)/(3m+p-1) once m >= p."""
    for p in range(1, 9):
        for m in range(1, 33):
            r = check(p, m, name)
            assert max(r.peak_in_flight) == min(limit(p), m) or p == 1, (name, p, m, r.peak_in_flight)
            assert sum(1 for row in r.timeline if row[1] == "W") == p * m
            if m >= p:
                assert abs(r.bubble - (p - 1) / (3 * m + p - 1)) < 1e-12, (name, p, m, r.bubble)


def test_zb_h1_orders():
    """Stage s of p = 4: 1F1B's warm-up, s pairs F B with the W left, then F B W, then the
    drain with the W's left behind last."""
    assert compute(zero_bubble.zb_h1(0, 4, 6)) == ("F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5").split()
    assert compute(zero_bubble.zb_h1(2, 4, 6)) == ("F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5").split()


@pytest.mark.parametrize("times", [(1.0, 1.0, 1.0), (1.0, 1.2, 0.6), (1.0, 2.0, 1.0), (1.0, 0.8, 1.2)])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "interleaved"])
def test_idle_theory_with_unequal_times_equals_the_simulation(name, times):
    """The checker's simulation of the schedule with F, B, W of unequal lengths idles each
    stage exactly zero_bubble.idle_theory: (p-1)(F+B+W) for 1F1B (B+W its whole backward),
    /V interleaved, (p-1)(F + max(B-W, 0)) ZB-H1, (p-1)F ZB-H2 (m >= 2p - 1 here)."""
    f, b, w = times
    for p, m in ((2, 8), (4, 8), (4, 12), (8, 16)):
        V = 2 if name == "interleaved" else 1
        # a chunk's F, B, W are 1/V of the rank's
        r = check(p, m, name, virtual=V, forward_time=f / V, backward_time=(b + w) / V, weight_time=w / V
                  if name.startswith("zb") else None)
        idle = r.makespan - m * (f + b + w)
        assert idle == pytest.approx(zero_bubble.idle_theory(name, p, m, f, b, w, V), abs=1e-9), (p, m)
        assert r.bubble == pytest.approx(zero_bubble.bubble_from_times(name, p, m, f, b, w, V), abs=1e-9)
