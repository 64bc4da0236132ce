"""What labs 07 (1F1B) and 18 (ZB-H1) check alike in one stage's instruction list: each kind
once per micro-batch where the stage needs it and never where it cannot have it, each pair in
its order (ORDER), and each message right beside its op (BESIDE). Each lab keeps its own kinds,
orders and reasons; the counting and its messages live here once.
"""
from __future__ import annotations

from minipar.parallel.pipeline.schedules import RecvActivation, RecvGrad, SendActivation, SendGrad


def needed(kind, s: int, p: int) -> bool:
    """Does stage s of p hold one `kind` instruction per micro-batch? (A Recv or Send only
    where the previous or next stage exists; every op always.)"""
    if kind in (RecvActivation, SendGrad):
        return s > 0
    if kind in (SendActivation, RecvGrad):
        return s < p - 1
    return True


def check_placed(prog, at: dict, kinds, order, beside, m: int, s: int, p: int, what: str, context: str,
                 not_here, missing):
    """AssertionError naming the first item out of place. `at` maps (kind, mb) to the items
    it is at; not_here(kind, mb, k) and missing(kind, mb) give the reason for a kind at a
    stage that cannot have it and for one that is absent."""
    for kind in kinds:
        want = 1 if needed(kind, s, p) else 0
        for mb in range(m):
            ks = at.get((kind, mb), [])
            if len(ks) == want:
                continue
            if want == 0:
                problem = f"{kind(mb)} at item {ks[0]}, but {not_here(kind, s)}"
            elif not ks:
                problem = f"no {kind(mb)}{missing(kind, s)}"
            else:
                problem = f"{kind(mb)} {len(ks)} times (items {ks}), once wanted"
            raise AssertionError(f"{what}: {problem}{context}")
    for first, then, why in order:
        for mb in range(m):
            a, b = at.get((first, mb)), at.get((then, mb))
            if a and b and a[0] > b[0]:
                raise AssertionError(f"{what}: {first(mb)} at item {a[0]} comes after {then(mb)} "
                                     f"at item {b[0]}: {why}{context}")
    for k, ins in enumerate(prog):
        if type(ins) in beside:
            op, step, why = beside[type(ins)]
            j = at[(op, int(ins.mb))][0]
            if j != k + step:
                where = "right before" if step > 0 else "right after"
                raise AssertionError(f"{what}: {ins} at item {k} is not {where} {op(int(ins.mb))} (item {j}): "
                                     f"{why}{context}")
