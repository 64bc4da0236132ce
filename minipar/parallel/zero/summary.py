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
             3: f"{M} x (2 all-gathers + reduce-scatter)"}[stage]
    size = z["P_padded"] * sync.dtype.itemsize
    R = z.get("R", 1)
    replicas = (f" + an all-reduce across R = {R} replicas of the {human_bytes(size / z['N'])} shard, "
                f"2(R-1)/R x it" if R > 1 else "")
    lines = [f"  ZeRO {stage}: sent {human_bytes(z['bytes_per_step'])}/step per rank; "
             f"theory {calls} of "
             f"(N-1)/N x {human_bytes(size)}{' inside a shard group of N = ' + str(z['N']) if R > 1 else ''}"
             f"{replicas} = {human_bytes(z['theory_bytes_per_step'])} (ratio {ratio:.3f}); "
             f"plain data parallelism would send {human_bytes(theory)}"
             + (f" (x{z['bytes_per_step'] / theory:.2f})" if theory else "")
             + f"; waiting for reduce-scatters{' and all-reduces' if R > 1 else ''} after backward "
               f"{exposed * 1e3:.1f} ms/step"]
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
