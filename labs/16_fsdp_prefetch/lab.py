"""Lab 16's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): minipar.parallel.zero.stage3.Gathers._prefetch asks the student's ahead
which blocks to start when a block's all-gather has been waited for (and at a pass's start),
and starts each as asked (a unit gathered or in flight is gathered a second time, its bytes
counted again); Stage3.release asks the student's releases whether a block is released after
its forward or backward. The rest is minipar's own ZeRO-3 (Stage3.start, gather, poll,
Regather, the reduce-scatters).

Oracles, written here plainly: the K units after i in the pass's order that are not live (for
ahead); the release rule; a walk of the step over a table of unit states (for events). A replay
of the student's event list (each unit sharded, in flight or gathered) finds the mistakes that
break the schedule (a second all-gather, a compute before the wait or after the release, a
unit never released) and measures the peak gathered units and bytes and the exposed waits,
which are held to this lab's own formulas (the peak checked against minipar's
formulas.gathered_peak too). The trainer runs are held to labs/twin.py's twin, and their
gathered peak and ZeRO bytes, every step, to the same formula and formulas.traffic_theory.
"""
import os

import numpy as np

from labs.framework import Criterion, load_drive, trainer_flags
from labs.results import key, typename
from labs.scan import Allowed
from minipar.parallel.zero import formulas, units as zero_units

TITLE = "FSDP / ZeRO-3's gather schedule: prefetch K units ahead, release after forward or keep"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
OWN = "minipar's own ZeRO-3 schedule: this lab grades yours"
ALLOWED = Allowed(
    modules={},
    refused={"minipar.parallel.zero.stage3.Gathers": OWN, "minipar.parallel.zero.stage3.Stage3": OWN,
             "minipar.parallel.zero.formulas.gathered_peak": OWN})
OPS = ("gather", "prefetch", "wait", "compute", "release")
PHASES = ("forward", "backward")
SIZES = [40, 24, 56, 8, 32, 72, 16]        # bytes of unit u's gathered parameters (cycled past 7 units)


def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def sizes_of(n) -> list:
    return [SIZES[u % len(SIZES)] for u in range(n)]


# --- the oracles --------------------------------------------------------------------------------

def pass_units(n, phase) -> list:
    return list(range(n)) if phase == "forward" else list(reversed(range(n)))


def want_ahead(i, n, K, backward, live) -> list:
    units = pass_units(n, "backward" if backward else "forward")
    after = units if i is None else units[units.index(i) + 1:]
    return [u for u in after[:K] if u not in live]


def want_releases(phase, reshard) -> bool:
    return phase == "backward" or bool(reshard)


def want_events(n, K, reshard) -> list:
    """The step, walked over a table of states: "sharded", "flying", "gathered"."""
    state, out = ["sharded"] * n, []

    def live():
        return {u for u in range(n) if state[u] != "sharded"}

    for phase in PHASES:
        backward = phase == "backward"
        for j in want_ahead(None, n, K, backward, live()):
            out.append(("prefetch", phase, j))
            state[j] = "flying"
        for u in pass_units(n, phase):
            if state[u] == "sharded":
                out.append(("gather", phase, u))
                state[u] = "flying"
            if state[u] == "flying":
                out.append(("wait", phase, u))
                state[u] = "gathered"
            for j in want_ahead(u, n, K, backward, live()):
                out.append(("prefetch", phase, j))
                state[j] = "flying"
            out.append(("compute", phase, u))
            if want_releases(phase, reshard):
                out.append(("release", phase, u))
                state[u] = "sharded"
    return out


def peak_units(n, K, reshard) -> int:
    """Units gathered or in flight at the peak: K+1 (the one computing and the K ahead), or all
    of them with reshard off (the end of forward); never more than n."""
    return n if not reshard else min(K + 1, n)


def peak_bytes(sizes, K, reshard) -> int:
    """The same in bytes: the largest K+1 consecutive units, or every unit with reshard off."""
    if not sizes:
        return 0
    if not reshard:
        return sum(sizes)
    w = min(K + 1, len(sizes))
    return max(sum(sizes[s:s + w]) for s in range(len(sizes) - w + 1))


def exposed_waits(n, K, reshard) -> dict:
    """Waits for an all-gather nobody prefetched, per pass: every unit's without prefetch, none
    with K >= 1 (the pass's start prefetches the first); backward gathers nothing with reshard off."""
    each = n if K == 0 else 0
    return {"forward": each, "backward": each if reshard else 0}


# --- the replay of a student's list ---------------------------------------------------------------

def show(e) -> str:
    return repr(e) if isinstance(e, tuple) else f"{typename(e)} {e!r:.80}"


def replay(ev, n, K, reshard) -> dict:
    """Walk the student's events over unit states; AssertionError at the first that breaks the
    schedule. -> {"peak_units", "peak_bytes", "exposed": {phase: waits}}"""
    what = f"events(n={n}, K={K}, reshard={reshard})"
    assert isinstance(ev, list), f"{what} returned {typename(ev)}, want a list of (op, phase, unit) tuples"
    sizes = sizes_of(n)
    state, how, released = ["sharded"] * n, [None] * n, [None] * n
    computed = {p: [] for p in PHASES}
    exposed = {p: 0 for p in PHASES}
    top_units = top_bytes = 0
    seen_backward = False
    for k, e in enumerate(ev):
        at = f"{what}, event {k} {show(e)}"
        assert isinstance(e, tuple) and len(e) == 3, f"{at}: each event is a tuple (op, phase, unit)"
        op, phase, u = e
        assert isinstance(op, str) and op in OPS, f"{at}: op must be one of the strings {OPS}"
        assert isinstance(phase, str) and phase in PHASES, f"{at}: phase must be 'forward' or 'backward'"
        assert is_int(u) and 0 <= u < n, f"{at}: the unit must be an int in 0..{n - 1}" + \
            (" (past the last unit)" if is_int(u) and u >= n else "")
        u = int(u)
        assert not (seen_backward and phase == "forward"), f"{at}: a forward event after the backward began"
        seen_backward = seen_backward or phase == "backward"
        s = state[u]
        if op in ("gather", "prefetch"):
            assert s == "sharded", f"{at}: unit {u} is {'on its way' if s == 'flying' else 'gathered'} " \
                                   f"already: a second all-gather of it (its bytes sent and held twice)"
            state[u], how[u] = "flying", op
        elif op == "wait":
            assert s == "flying", f"{at}: unit {u}'s all-gather is not in flight " \
                                  f"({'it is gathered' if s == 'gathered' else 'nothing was started'})"
            state[u] = "gathered"
            exposed[phase] += how[u] == "gather"
        elif op == "compute":
            assert s == "gathered", f"{at}: unit {u} computes while its parameters are " + \
                ("still on their way (no wait)" if s == "flying" else
                 f"released (event {released[u]})" if released[u] is not None else "not gathered")
            computed[phase].append(u)
        else:
            assert s != "flying", f"{at}: unit {u} is released while its all-gather is in flight (never used)"
            assert s == "gathered", f"{at}: unit {u} is released but it is not gathered"
            state[u], released[u] = "sharded", k
        held = [v for v in range(n) if state[v] != "sharded"]
        top_units = max(top_units, len(held))
        top_bytes = max(top_bytes, sum(sizes[v] for v in held))
    for phase in PHASES:
        want = pass_units(n, phase)
        assert computed[phase] == want, f"{what}: the {phase} pass computes units {computed[phase]}, want {want} " \
                                        f"(each unit once, in the pass's order)"
    left = [v for v in range(n) if state[v] != "sharded"]
    assert not left, f"{what}: unit(s) {left} still gathered at the end of the step (never released)"
    return {"peak_units": top_units, "peak_bytes": top_bytes, "exposed": exposed}


def plain(e):
    """An event as (str, str, int), or None when it is not one (nothing of it compared as it is)."""
    ok = isinstance(e, tuple) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], str) and is_int(e[2])
    return (e[0], e[1], int(e[2])) if ok else None


def replays(res):
    for n, K, reshard in drive.events_cases():
        yield n, K, reshard, replay(res.get(0, key("events", n, K, reshard)), n, K, reshard)


# --- the judges ---------------------------------------------------------------------------------

def judge_ahead(res):
    for idx, (n, K, backward, i, live) in enumerate(drive.ahead_cases()):
        what = drive.call_ahead(n, K, backward, i, live)
        got, want = res.get(0, key("ahead", idx)), want_ahead(i, n, K, backward, set(live))
        assert isinstance(got, list), f"{what} returned {typename(got)} {got!r:.100}, want the list {want}"
        assert all(is_int(j) for j in got), f"{what} returned {got!r:.100}: want a list of ints, {want}"
        got = [int(j) for j in got]
        if got != want:
            extra = [j for j in got if j not in want]
            why = "" if not extra else \
                (f" ({extra[0]} is past the pass's last unit)" if not 0 <= extra[0] < n else
                 f" ({extra[0]} is gathered or on its way already)" if extra[0] in live else
                 f" ({extra[0]} is not among the {'first ' if i is None else ''}{K} unit(s) "
                 f"{'' if i is None else f'after {i} '}of {'backward' if backward else 'forward'} order)")
            raise AssertionError(f"{what} returned {got}, want {want}{why}")
        after = res.get(0, key("ahead", idx, "live after"))
        assert after == sorted(live), f"{what}: live was modified (it holds {after} after the call): leave it as it is"


def judge_releases(res):
    for idx, (n, i, phase, reshard) in enumerate(drive.releases_cases()):
        got, want = res.get(0, key("releases", idx)), want_releases(phase, reshard)
        what = f"releases(i={i}, n={n}, phase={phase!r}, reshard={reshard})"
        assert isinstance(got, (bool, np.bool_)), f"{what} returned {typename(got)} {got!r:.80}, want {want}"
        assert bool(got) == want, f"{what} returned {got}, want {want}" + \
            (" (the last unit too)" if i == n - 1 and n > 1 else "")


def judge_well_formed(res):
    for _ in replays(res):
        pass


def judge_peak(res):
    for n, K, reshard, r in replays(res):
        what = f"events(n={n}, K={K}, reshard={reshard})"
        sizes = sizes_of(n)
        want_u, want_b = peak_units(n, K, reshard), peak_bytes(sizes, K, reshard)
        mine = formulas.gathered_peak(0, sizes, K, reshard)
        assert mine == want_b, f"the grader's peak {want_b} and minipar's formulas.gathered_peak {mine} disagree " \
                               f"for {what} (a grader bug)"
        rule = "every unit (reshard off)" if not reshard else f"the largest {min(K + 1, n)} consecutive unit(s)"
        assert r["peak_units"] == want_u, f"{what}: {r['peak_units']} units gathered or in flight at the peak, want " \
                                          f"{want_u} ({rule})"
        assert r["peak_bytes"] == want_b, f"{what}: {r['peak_bytes']} B gathered at the peak with unit sizes " \
                                          f"{sizes} B, want {want_b} B ({rule})"


def judge_exposed(res):
    for n, K, reshard, r in replays(res):
        want = exposed_waits(n, K, reshard)
        for phase in PHASES:
            got = r["exposed"][phase]
            assert got == want[phase], \
                f"events(n={n}, K={K}, reshard={reshard}): {got} exposed wait(s) in {phase} (a 'wait' for a unit " \
                f"started by 'gather', not prefetched), want {want[phase]}"


def judge_events(res):
    for n, K, reshard in drive.events_cases():
        what = f"events(n={n}, K={K}, reshard={reshard})"
        got, want = res.get(0, key("events", n, K, reshard)), want_events(n, K, reshard)
        assert isinstance(got, list), f"{what} returned {typename(got)}, want a list"
        for k in range(max(len(got), len(want))):
            a = got[k] if k < len(got) else "(the list ends)"
            b = want[k] if k < len(want) else "(the list ends)"
            if (plain(a) if k < len(got) else a) != b:
                before = ", ".join(map(repr, want[max(0, k - 3):k]))
                raise AssertionError(f"{what}: event {k} is {show(a) if k < len(got) else a}, want {b!r} "
                                     f"(after {before or 'the start'}); {len(got)} events, want {len(want)}")


# --- the trainer ---------------------------------------------------------------------------------

def trainer_judge(ranks):
    """Beyond the twin: every step's gathered peak (minipar's count, with the seam's second
    all-gathers counted) equals the embedding-side units plus peak_bytes of the blocks, and its
    ZeRO bytes formulas.traffic_theory."""
    def judge(run):
        from minipar.model.gpt import FAMILY, GPT                     # noqa: PLC0415
        from minipar.train import trainer as train                   # noqa: PLC0415
        from minipar.train.setup import prepare                      # noqa: PLC0415
        from minipar.config.flags import resolve_gathers             # noqa: PLC0415
        args = train.build_parser().parse_args(list(run.flags))
        K, reshard = resolve_gathers(args)                           # before prepare sets them in args
        spec = prepare(args, ranks)
        shapes = {n: p.size for n, p in GPT(spec.cfg).named_parameters()}
        N, M, s = args.dp, args.micro_batches, np.dtype(args.dtype).itemsize
        outer, blocks, P_pad = 0, [], 0
        for names in zero_units.unit_names(list(shapes)):
            b = zero_units.padded(sum(shapes[n] for n in names), N) * s
            P_pad += b // s
            if FAMILY.block_of(names[0]) is None:
                outer += b
            else:
                blocks.append(b)
        want = outer + peak_bytes(blocks, K, reshard)
        theory = formulas.traffic_theory(3, P_pad, N, s, M, reshard_after_forward=reshard)
        what = f"--dp {N} --zero 3 --prefetch {K} --reshard-after-forward {'on' if reshard else 'off'}"
        rule = "every block" if not reshard else f"the largest {min(K + 1, len(blocks))} consecutive blocks"
        for row in run.rows:
            peak, sent = row.get("zero_gathered_peak"), row.get("zero_bytes")
            assert peak == want, f"{what}: step {row.get('step')} held {peak!r} B of gathered parameters at its " \
                                 f"peak, want {want:,} B (the embedding-side units {outer:,} B + {rule} of " \
                                 f"{blocks[0]:,} B each)"
            assert sent == theory, f"{what}: step {row.get('step')} sent {sent!r} B on the zero axis, " \
                                   f"formulas.traffic_theory {theory:,.0f} B (a unit gathered twice sends twice)"
    return judge


TINY = dict(n_layer=4, n_embd=24, batch_size=12, micro_batches=2)


def trainer(ranks, K, reshard="on", **change):
    flags = ("--dp", str(ranks), "--zero", "3", "--prefetch", str(K)) + \
        (("--reshard-after-forward", "off") if reshard == "off" else ())
    return Criterion("trainer " + " ".join(flags), ranks=ranks, trainer=trainer_flags(*flags, **{**TINY, **change}),
                     judge=trainer_judge(ranks), timeout=90, uses=("ahead", "releases"),
                     hint="ZeRO-3 asks your ahead at every block (parallel.zero.stage3.Gathers) and your releases "
                          "after each block's forward and backward; the grader compares the run with one process, "
                          "and each step's gathered peak and bytes with the formulas")


CRITERIA = [
    Criterion("ahead: the units to prefetch", run="schedule", judge=judge_ahead, timeout=30, uses=("ahead",),
              hint="take the pass's order (n-1..0 in backward), the K units after i in it (the first K when i "
                   "is None), stop at the end, and leave out those in live; return a new list, live untouched"),
    Criterion("releases after forward and backward", run="schedule", judge=judge_releases, timeout=30,
              uses=("releases",),
              hint="backward always releases; forward releases only with reshard after forward on, the last "
                   "unit like every other"),
    Criterion("events: a well-formed step", run="schedule", judge=judge_well_formed, timeout=30, uses=("events",),
              hint="track each unit: sharded, in flight (started, not waited for) or gathered; start only a "
                   "sharded unit, wait only for one in flight, compute only a gathered one, then release it"),
    Criterion("peak gathered units and bytes against the formula", run="schedule", judge=judge_peak, timeout=30,
              uses=("events",),
              hint="at most the unit computing and the K ahead are gathered (parallel.zero.formulas.gathered_peak); "
                   "release each unit right after its compute, not later"),
    Criterion("exposed waits against the formula", run="schedule", judge=judge_exposed, timeout=30, uses=("events",),
              hint="with K >= 1 every unit's all-gather is prefetched: the first of each pass by ahead(None, ...) "
                   "at the pass's start"),
    Criterion("events against the schedule", run="schedule", judge=judge_events, timeout=30, uses=("events",),
              hint="per unit: gather if nobody started it, wait if in flight, prefetch ahead of it, compute, "
                   "release; the prefetch goes before the compute, so that it travels while the unit computes"),
    trainer(2, 1),
    trainer(3, 2, "off", n_embd=20),
]
