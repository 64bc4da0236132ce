"""The summary's ZeRO figures (docs/design.md §8's `zero`), from what any ZeRO synchroniser
gives: its traffic_theory(M), its dtype, its memory_report() and the step rows.
"""
from __future__ import annotations

import numpy as np

from minipar.comm.ledger import human_bytes


def summary(sync, mem: dict, rows_log: list, micro_batches: int, plain_dp_bytes: float,
            hosts: int = 1) -> tuple[dict, list[str]]:
    """What ZeRO sent per step (the rows' zero_bytes) beside sync.traffic_theory and what
    plain data parallelism would have sent (plain_dp_bytes: data_parallel.grad_sync_theory),
    and the wait for its reduce-scatters after backward. mem: sync.memory_report(). Across
    hosts (hosts > 1), the bytes that left the host beside sync.traffic_split's."""
    M, stage, theory = micro_batches, mem["zero"]["stage"], plain_dp_bytes
    exposed = float(np.mean([r["exposed_comm_s"] for r in rows_log]))
    z = {**mem["zero"], "bytes_per_step": float(np.mean([r["zero_bytes"] for r in rows_log])),
         "theory_bytes_per_step": sync.traffic_theory(M), "plain_dp_bytes_per_step": theory}
    ratio = (z["bytes_per_step"] / z["theory_bytes_per_step"] if z["theory_bytes_per_step"]
             else float("nan"))
    calls = {1: "reduce-scatter + all-gather", 2: f"{M} reduce-scatter(s) + all-gather",
             3: f"{M} x ({'2 all-gathers' if sync.reshard_after_forward else '1 all-gather'} + reduce-scatter)"}[stage]
    size = z["P_padded"] * sync.dtype.itemsize
    R = z.get("R", 1)
    replicas = (f" + an all-reduce across R = {R} replicas of the {human_bytes(size / z['N'])} shard, "
                f"2(R-1)/R x it" if R > 1 else "")
    wire = getattr(sync, "wire", None)
    theory_text = (f"theory {calls} of (N-1)/N x {human_bytes(size)}"
                   f"{' inside a shard group of N = ' + str(z['N']) if R > 1 else ''}{replicas}")
    if wire is not None and wire.on:              # ZeRO++: the calls of formulas.calls_of
        z["zpp"] = {"qwz": wire.qwz, "hpz": wire.hpz, "qgz": wire.qgz}
        theory_text = ("theory, ZeRO++ (" + ", ".join(
            x for x in (f"qwZ int8 blocks of {wire.qwz}" if wire.qwz else "", "hpZ" if wire.hpz else "",
                        f"qgZ int8 blocks of {wire.qgz}" if wire.qgz else "") if x)
            + f"; plain ZeRO would send {human_bytes(plain_zero_bytes(sync, M))})")
    lines = [f"  ZeRO {stage}: sent {human_bytes(z['bytes_per_step'])}/step per rank; "
             f"{theory_text} = {human_bytes(z['theory_bytes_per_step'])} (ratio {ratio:.3f}); "
             f"plain data parallelism would send {human_bytes(theory)}"
             + (f" (x{z['bytes_per_step'] / theory:.2f})" if theory else "")
             + f"; waiting for reduce-scatters{' and all-reduces' if R > 1 else ''} after backward "
               f"{exposed * 1e3:.1f} ms/step"]
    if getattr(sync, "tracks_gathers", False):
        lines.append(_gathers(sync, z, rows_log))
    if hosts > 1:                   # the bytes that cross hosts, beside the formula's (comm.sent)
        split = sync.traffic_split(M)
        z["inter_host_bytes_per_step"] = float(np.mean([r["inter_host_bytes_by_axis"].get("zero", 0)
                                                        for r in rows_log]))
        z["theory_inter_host_bytes_per_step"] = split["across"]
        across = split["across"]
        lines.append(f"  ZeRO {stage} across {hosts} hosts: sent {human_bytes(z['inter_host_bytes_per_step'])}/step "
                     f"per rank to other hosts; formula {human_bytes(across)} (ratio "
                     + (f"{z['inter_host_bytes_per_step'] / across:.3f}" if across else "-")
                     + f"), and {human_bytes(split['inside'])} inside the host")
    return z, lines


def plain_zero_bytes(sync, M: int) -> float:
    """What the same units would send per step without ZeRO++ (calls_of without its wire)."""
    from minipar.comm.sent import sent
    from minipar.parallel.zero.formulas import calls_of
    return sum(sum(sent(op, g, x)) * n for u in sync.units
               for op, g, x, n in calls_of(sync.stage, u, sync.dtype.itemsize, M, sync.reshard_after_forward))


def _gathers(sync, z: dict, rows_log: list) -> str:
    """Stage 3's gathers: the exposed waits (forward, backward) and the gathered peak beside
    formulas.gathered_peak, into z; -> the line."""
    waits = {ph: float(np.mean([r["zero_gather_wait_s"][ph] for r in rows_log])) for ph in ("forward", "backward")}
    peak, formula = max(r["zero_gathered_peak"] for r in rows_log), sync.gathered_formula()
    z.update(prefetch=sync.prefetch, reshard_after_forward=sync.reshard_after_forward, gather_wait_s=waits,
             gathered_peak_bytes=peak, gathered_peak_formula=formula)
    kept = ("the embedding-side units + every block (reshard after forward off)" if not sync.reshard_after_forward
            else f"the embedding-side units + the largest {sync.prefetch + 1} consecutive block(s)")
    line = (f"  ZeRO 3 gathers: prefetch {sync.prefetch}, reshard after forward "
            f"{'on' if sync.reshard_after_forward else 'off'}; waiting for all-gathers {waits['forward'] * 1e3:.1f} ms "
            f"in forward, {waits['backward'] * 1e3:.1f} ms in backward per step; gathered at the peak "
            f"{human_bytes(peak)}, formula {kept} = {human_bytes(formula)} (ratio "
            + (f"{peak / formula:.3f})" if formula else "-)"))
    if sync.wire.hpz:
        held, want = max(r["zero_secondary_peak"] for r in rows_log), sync.secondary_formula()
        z.update(secondary_peak_bytes=held, secondary_peak_formula=want)
        line += (f"; hpZ's secondary shards held {human_bytes(held)}, formula every unit's n_pad/k = "
                 f"{human_bytes(want)} (ratio {held / want:.3f})")
    return line
