"""Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", arXiv:2104.04473, section 2.2): --schedule interleaved
--virtual-stages V.

The layers are cut into p*V chunks (virtual stages) instead of p, and rank r holds V of them,
not adjacent: chunks r, r + p, r + 2p, ... A micro-batch therefore goes round the ranks V
times: rank p-1's chunk c sends its output to rank 0's chunk c + 1 (schedules.neighbour).
The embedding is on virtual stage 0 (rank 0), the head on virtual stage pV - 1 (rank p-1), as
without interleaving.

Why: a stage's forward and backward are 1/V as long, so the pipe fills and drains V times
faster. With F and B a rank's whole forward and backward of one micro-batch, each rank idles
(p-1)(F + B)/V per step instead of (p-1)(F + B): the bubble is (p-1)/(Vm) of the ideal step,
(p-1)/(Vm + p - 1) of the real one (schedules.bubble_theory's definition). The price: V times
as many point-to-point messages, pV - 1 boundaries a micro-batch crosses each way instead of
p - 1, and more micro-batches in flight on the first rank, by 1 + (p-1)/(pV) in the paper's
terms (counted exactly by schedule_check's peak_in_flight).

The order (Megatron-LM's): micro-batches go in groups of p. A rank's k-th forward is chunk
(k // p) mod V of micro-batch (k // pV) p + k mod p, so it forwards p micro-batches through
chunk 0, then the same p through chunk 1, ...; its k-th backward takes the chunks in reverse.
Rank r starts with 2(p - r - 1) + (V - 1) p forwards (warm-up; all of them when that is more
than the m V there are), then alternates one forward and one backward, then drains the rest.
The number of micro-batches must be a multiple of p.
"""
from __future__ import annotations

from minipar.parallel.pipeline.instructions import _backward, _check_numbers, _forward


def check_micro_batches(n_stages: int, n_micro: int, n_chunks: int):
    """ValueError unless the interleaved schedule can run p stages, m micro-batches, V chunks."""
    if n_stages < 2:
        raise ValueError(f"the interleaved schedule needs at least 2 pipeline stages, got {n_stages}")
    if n_chunks < 1:
        raise ValueError(f"virtual stages must be >= 1, got {n_chunks}")
    if n_micro % n_stages:
        raise ValueError(f"the interleaved schedule takes micro-batches in groups of the pipeline "
                         f"stages: {n_micro} micro-batches is not a multiple of {n_stages}")


def unit(k: int, n_stages: int, n_chunks: int, backward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of a rank's k-th forward (or backward) in Megatron-LM's order."""
    p, V = n_stages, n_chunks
    chunk = (k // p) % V
    return (V - 1 - chunk if backward else chunk), (k // (p * V)) * p + k % p


def interleaved(stage: int, n_stages: int, n_micro: int, n_chunks: int = 2) -> list:
    """The instructions of rank `stage` (see the module)."""
    _check_numbers(n_stages, n_micro, stage)
    check_micro_batches(n_stages, n_micro, n_chunks)
    p, V = n_stages, n_chunks
    total = n_micro * V
    warm = min(2 * (p - stage - 1) + (V - 1) * p, total)

    def fwd(k):
        chunk, mb = unit(k, p, V, backward=False)
        return _forward(stage, p, mb, chunk, V)

    def bwd(k):
        chunk, mb = unit(k, p, V, backward=True)
        return _backward(stage, p, mb, chunk, V)

    out = [ins for k in range(warm) for ins in fwd(k)]
    for k in range(total - warm):                                 # steady state: one F, one B
        out += fwd(warm + k) + bwd(k)
    for k in range(total - warm, total):                          # cool-down
        out += bwd(k)
    return out
