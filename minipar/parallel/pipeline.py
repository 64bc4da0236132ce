"""Pipeline parallelism: the layers cut into p stages, one per pp rank, and the batch into m
micro-batches that flow through them (GPipe, Huang et al. 2019; PipeDream-Flush / 1F1B,
Narayanan et al. 2021). The schedules themselves are data, in schedules.py; this file
holds a stage's part of the model and the executor that walks a schedule with MPI.

What is split:   the blocks, contiguously (schedules.partition: sizes differ by at most 1).
                 Stage 0 also holds wte and wpe, the last stage ln_f and the head. With
                 tied embeddings the last stage holds its own copy of wte.weight for the
                 head (Megatron's embedding group); both copies start equal (same seed and
                 name) and get the same summed gradient, so they stay equal.
                 With tp > 1 each stage is itself tensor-parallel (its TensorParallelGPT
                 shards); with dp > 1 each stage is replicated.
What is sent:    point-to-point on the pp group, between neighbouring stages only:
                 forward   the stage's output activation (B/(dp*m), T, C)  -> next stage
                 backward  the gradient of the stage's input, same shape   -> previous stage
                 Each is one message of b*T*C*s bytes (b = B/(dp*m) rows, s bytes per
                 element, 2 with --precision fp16/bf16) plus minipar.comm's 128-byte
                 header, so per step each stage boundary carries 2m messages,
                 2m*b*T*C*s = 2*(B/dp)*T*C*s bytes, whatever m.
                 Once per step after the last backward, the two ends exchange wte.weight's
                 gradient (tied embeddings only: V*C*s bytes each way, V/tp rows with tp),
                 and the last stage broadcasts the step's loss (8 bytes) over the pp group.
When:            as the schedule says. Sends are non-blocking (comm.send_async: 1F1B's
                 neighbours send to each other at the same moment and blocking sends of
                 large arrays would deadlock, schedules.py); their handles are kept until
                 the schedule ends. Receives block (with minipar.comm's timeout).

Every stage has m forwards and m backwards to do; the rest of its time is the bubble,
(p-1)/(m+p-1) of the step for GPipe and 1F1B in theory, (p-1)/p for the naive schedule.
The executor records when each forward and backward starts and ends (perf_counter,
relative to the stage's own step start; the stages start a step together to within the
optimizer step, since the previous step ended with all-reduces over the pp group). A
stage's span is from its first instruction to its last send completing, and the step's
makespan is the longest span. As in schedules.check, the bubble of a step is

    1 - (sum over stages of busy time) / (p * makespan)

i.e. the mean over stages of each stage's idle fraction of the makespan (the last stage,
done first, idles through the cool-down). `bubble_measured` in the summary is its mean
over the steps after the first.
It also tracks the bytes of saved activations (Tensor.saved_bytes of the micro-batch graphs
in flight): GPipe holds m micro-batches at its peak, 1F1B at most p - stage.

Data parallelism composes by synchronising gradients during the *last Backward instruction
of the stage's own list* (GPipe's is micro-batch 0, 1F1B's and naive's micro-batch m-1:
keying on "micro-batch m-1" would leave GPipe stages unsynchronised, picotron's trap).
"""
from __future__ import annotations

import math
import time

import numpy as np

from minipar import comm, ops
from minipar.model import GPTConfig, param_specs
from minipar.parallel import schedules
from minipar.parallel.schedules import (Backward, Forward, RecvActivation, RecvGrad, SendActivation,
                                        SendGrad)
from minipar.parallel.tensor_parallel import _all_reduce as tp_all_reduce, layout_of
from minipar.precision import backward_seed
from minipar.tensor import Tensor, no_grad


class PipelineStage:
    """One stage of the model: a GPT or TensorParallelGPT with every parameter the stage
    does not own dropped, so named_parameters() (and the memory report) holds only the
    stage's. Forward in pieces: embed on the first stage, its blocks, head and loss on the
    last. Collective methods (state_dict, consolidate, grad_norm_sq, evaluate) run on every
    rank of the pp group (and the tp group)."""

    def __init__(self, inner, stage: int, n_stages: int, pp_group: comm.Group):
        self.inner, self.cfg, self.dtype = inner, inner.cfg, inner.dtype
        self.stage, self.n_stages, self.group = stage, n_stages, pp_group
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.layers = schedules.partition(self.cfg.n_layer, n_stages)[stage]
        self.names = schedules.stage_param_names(self.cfg, stage, n_stages)
        self.tp_group = getattr(inner, "group", None)
        self.tp_size, self.tp_rank = getattr(inner, "tp_size", 1), getattr(inner, "tp_rank", 0)
        inner.params = {n: inner.params[n] for n in self.names}      # drop the other stages'
        if self.tp_size > 1:                                          # and their tp layers
            for i in range(self.cfg.n_layer):
                if i not in self.layers:
                    inner.attn[i] = inner.mlp[i] = None
            if not self.is_first:
                inner.wte = None
        self.params = inner.params
        self.tied_copy = self.is_last and not self.is_first and self.cfg.tie_embeddings

    # --- parameters ---------------------------------------------------------------------------
    def named_parameters(self):
        return list(self.params.items())

    def parameters(self):
        return list(self.params.values())

    def num_params(self) -> int:
        """The whole model's canonical count (as GPT.num_params), not this stage's."""
        return sum(math.prod(shape) for _, shape, _ in param_specs(self.cfg))

    def num_local_params(self) -> int:
        return sum(p.size for p in self.params.values())

    vocab_padded = property(lambda self: self.inner.vocab_padded)        # tensor-parallel stages
    vocab_per_rank = property(lambda self: self.inner.vocab_per_rank)

    def zero_grad(self):
        for p in self.params.values():
            p.grad = None

    def shard(self, name: str, full: np.ndarray) -> np.ndarray:
        return self.inner.shard(name, full) if self.tp_size > 1 else full

    def load_state_dict(self, state: dict):
        """Load this stage's tensors from a full canonical state (other names are ignored)."""
        missing = [n for n in self.names if n not in state]
        if missing:
            raise ValueError(f"state_dict mismatch: missing {missing[:4]}")
        for n in self.names:
            want = next(s for name, s, _ in param_specs(self.cfg) if name == n)
            if tuple(state[n].shape) != tuple(want):
                raise ValueError(f"{n}: checkpoint shape {tuple(state[n].shape)} != model shape {tuple(want)}")
        for n, p in self.params.items():
            p.data[...] = self.shard(n, state[n])

    def consolidate(self, local: dict) -> dict:
        """{name: this rank's array} -> the full canonical model on pp rank 0 (the other
        ranks get their stage's full tensors). tp shards are gathered first (collective over
        tp), then every stage sends its tensors to stage 0, in name order (comm.send/recv).
        The last stage's copy of a tied wte is not sent: stage 0's is the same."""
        full = self.inner.consolidate(local) if self.tp_size > 1 else \
            {n: np.array(local[n], copy=True) for n in self.names}
        if self.n_stages == 1:
            return full
        if not self.is_first:
            for n in self.names:
                if not (n == "wte.weight" and self.tied_copy):
                    comm.send(self.group, full[n], 0)
            return full
        for s in range(1, self.n_stages):
            for n in schedules.stage_param_names(self.cfg, s, self.n_stages):
                if not (n == "wte.weight" and s == self.n_stages - 1):
                    full[n] = comm.recv(self.group, s)
        return {n: full[n] for n, _, _ in param_specs(self.cfg)}     # canonical order

    def state_dict(self) -> dict:
        """The full canonical model on pp rank 0 (collective over pp and tp)."""
        return self.consolidate({n: p.data for n, p in self.params.items()})

    def counts_in_norm(self, name: str) -> bool:
        """The last stage skips its copy of a tied wte; tp ranks other than 0 skip
        replicated parameters."""
        if name == "wte.weight" and self.tied_copy:
            return False
        return self.tp_rank == 0 or layout_of(name) != "replicated"

    def reduce_norm_sq(self, local: float) -> float:
        """All-reduced over tp (tensor_parallel's ledger) and over pp."""
        total = np.array([local])
        if self.tp_size > 1:
            total = tp_all_reduce(self.tp_group, total, "sum", "grad_norm")
        return float(comm.all_reduce(self.group, total)[0]) if self.n_stages > 1 else float(total[0])

    def grad_norm_sq(self) -> float:
        """Sum of squared gradients of the whole model, each parameter once (counts_in_norm)."""
        local = 0.0
        for name, p in self.params.items():
            if p.grad is not None and self.counts_in_norm(name):
                g64 = p.grad.ravel().astype(np.float64, copy=False)
                local += float(g64 @ g64)
        return self.reduce_norm_sq(local)

    # --- forward, this stage's piece ----------------------------------------------------------
    def forward(self, x, targets=None, loss_denom=None):
        """First stage: x is token ids (b, T); others: the activation (b, T, C) from the
        previous stage. Last stage: the loss (with targets) or logits; others: (b, T, C)."""
        if self.is_first:
            x = self.inner.embed(x)                                   # (b, T, C)
        for i in self.layers:
            x = self.inner.block(i, x)
        if not self.is_last:
            return x
        logits = self.inner.head(x)                                   # (b, T, V) or (b, T, Vp/tp)
        if targets is None:
            return logits
        if self.tp_size > 1:
            return self.inner.loss(logits, targets, loss_denom)
        return ops.cross_entropy(logits, targets, loss_denom)

    def evaluate(self, idx, targets) -> float:
        """The mean loss of (idx, targets) through every stage, no graph; the same on every
        pp rank. Blocking sends are fine here: every message goes one way."""
        prev, nxt = self.stage - 1, self.stage + 1
        with no_grad():
            x = idx if self.is_first else Tensor(comm.recv(self.group, prev))
            out = self.forward(x, targets)
            if not self.is_last:
                comm.send(self.group, out.data, nxt)
                loss = np.zeros(1)
            else:
                loss = np.array([out.item()])
        return float(comm.broadcast(self.group, loss, self.n_stages - 1)[0]) if self.n_stages > 1 \
            else float(loss[0])


# --- the executor ---------------------------------------------------------------------------------

class PipelineEngine:
    """Runs one stage's instruction list for a training step and measures it."""

    def __init__(self, stage_model: PipelineStage, schedule: str, n_micro: int):
        self.model, self.schedule, self.n_micro = stage_model, schedule, n_micro
        s, p = stage_model.stage, stage_model.n_stages
        self.instructions = schedules.schedule(schedule, s, p, n_micro)
        backwards = [k for k, ins in enumerate(self.instructions) if isinstance(ins, Backward)]
        self.last_backward = backwards[-1]              # dp synchronises during this one
        self.steps = []                                 # per step: stats dict (see train_step)

    @property
    def bubble_theory(self) -> float:
        p, m = self.model.n_stages, self.n_micro
        return (p - 1) / p if self.schedule == "naive" else (p - 1) / (m + p - 1)

    def train_step(self, batches, loss_denom, dp=None, loss_scale: float = 1.0) -> float:
        """Forward and backward of every micro-batch in `batches` [(x, y), ...] as the
        schedule orders them; then dp's gradient sync, the tied-embedding gradient
        exchange, and the loss broadcast. Returns the sum of the micro-batch losses (each
        divided by loss_denom), identical on every pp rank. Gradients accumulate into .grad.
        loss_scale (fp16): the last stage seeds each backward with it instead of 1, so every
        gradient sent back through the pipe, and every .grad, is scaled by it."""
        m, g = self.model, self.model.group
        prev, nxt = m.stage - 1, m.stage + 1
        acts, grads = {}, {}          # received activations / output gradients, by micro-batch
        inputs, outputs = {}, {}      # the leaf input and the output (or loss) of each graph in flight
        saved = {}                    # saved-activation bytes of each graph in flight
        sends, timeline = [], []
        loss_sum, peak, per_mb = 0.0, 0, 0
        t0 = time.perf_counter()
        for k, ins in enumerate(self.instructions):
            mb = ins.mb
            if isinstance(ins, RecvActivation):
                acts[mb] = comm.recv(g, prev)
            elif isinstance(ins, RecvGrad):
                grads[mb] = comm.recv(g, nxt)
            elif isinstance(ins, Forward):
                start = time.perf_counter()
                x, y = batches[mb]
                if not m.is_first:            # the previous stage's output, as a leaf of this graph
                    x = inputs[mb] = Tensor(acts.pop(mb), requires_grad=True)
                out = outputs[mb] = m.forward(x, y if m.is_last else None, loss_denom)
                if m.is_last:
                    loss_sum += out.item()
                timeline.append(("F", mb, start - t0, time.perf_counter() - t0))
                saved[mb] = out.saved_bytes()
                per_mb = max(per_mb, saved[mb])
                peak = max(peak, sum(saved.values()))
            elif isinstance(ins, Backward):
                start = time.perf_counter()
                if dp is not None:
                    dp.sync_now(k == self.last_backward)
                out = outputs.pop(mb)
                out.backward(backward_seed(loss_scale) if m.is_last else grads.pop(mb))
                del saved[mb]
                timeline.append(("B", mb, start - t0, time.perf_counter() - t0))
            elif isinstance(ins, SendActivation):
                sends.append(comm.send_async(g, outputs[mb].data, nxt))
            elif isinstance(ins, SendGrad):
                sends.append(comm.send_async(g, inputs.pop(mb).grad, prev))
            for h in sends:                   # push the sends in flight along
                if not h.done:
                    h.test()
        for h in sends:
            h.wait()
        step_time = time.perf_counter() - t0
        busy = sum(end - start for _, _, start, end in timeline)
        if dp is not None:
            dp.finish()
        self.sync_tied_embedding(dp)
        if m.n_stages > 1:
            loss_sum = float(comm.broadcast(g, np.array([loss_sum]), m.n_stages - 1)[0])
        self.steps.append({"timeline": timeline, "step_time": step_time, "busy": busy,
                           "bubble": 1.0 - busy / step_time if step_time > 0 else 0.0,   # of its own span
                           "peak_activation_bytes": peak, "microbatch_activation_bytes": per_mb})
        return loss_sum

    def sync_tied_embedding(self, dp=None):
        """Megatron's embedding group: stage 0 and the last stage each add the other's
        wte.weight gradient, in place, so both copies stay equal. With ZeRO (dp.tied_grad)
        the gradient is already reduce-scattered over dp: the two stages' dp rank r hold
        the same shard of it (wte is a unit of its own), and exchange only that."""
        m = self.model
        if not m.cfg.tie_embeddings or m.n_stages == 1 or not (m.is_first or m.is_last):
            return
        w = m.params["wte.weight"]
        g = dp.tied_grad(w) if hasattr(dp, "tied_grad") else w.grad
        other = m.n_stages - 1 if m.is_first else 0
        h = comm.send_async(m.group, g, other)
        theirs = comm.recv(m.group, other)
        h.wait()
        g += theirs                                     # a + b == b + a: both copies equal

    def gather_stats(self, step: int = -1):
        """Stage 0 of the pp group gets every stage's stats (a list by stage): the timeline,
        times and bubble of `step`, the mean bubble of the steps after the first, the peak
        saved-activation bytes over all steps; the others get None. Collective over the pp
        group (each stage sends 2 small arrays)."""
        st = self.steps[step]
        rows = np.array([[0 if kind == "F" else 1, mb, a, b] for kind, mb, a, b in st["timeline"]])
        later = self.steps[1:] or self.steps            # the first step warms caches up
        nums = np.array([st["step_time"], st["busy"], st["peak_activation_bytes"],
                         st["microbatch_activation_bytes"], max(t["peak_activation_bytes"] for t in self.steps)]
                        + [t["busy"] for t in later] + [t["step_time"] for t in later], dtype=np.float64)
        m = self.model
        if m.stage != 0:
            comm.send(m.group, rows, 0)
            comm.send(m.group, nums, 0)
            return None
        out, busy, span = [], [], []
        for s in range(m.n_stages):
            r, n = (rows, nums) if s == 0 else (comm.recv(m.group, s), comm.recv(m.group, s))
            out.append({"timeline": [(s, "FB"[int(k)], int(mb), a, b) for k, mb, a, b in r],
                        "step_time": float(n[0]), "busy": float(n[1]),
                        "microbatch_activation_bytes": int(n[3]), "peak_activation_bytes": int(n[4])})
            busy.append(n[5:5 + len(later)])
            span.append(n[5 + len(later):])
        makespan = np.max(span, axis=0)                 # per step: the longest stage
        for s, st in enumerate(out):                    # idle fraction of the makespan, mean over steps
            st["bubble_mean"] = float(np.mean(1.0 - busy[s] / makespan))
        return out


def local_param_count(cfg: GPTConfig, stage: int, n_stages: int, tp: int = 1) -> int:
    """Parameters one rank of `stage` holds, by formula: the stage's canonical tensors
    (schedules.stage_param_names), split ones / tp, vocabulary ones padded to
    Vp = tp * ceil(V / tp) rows first (tensor_parallel's layout)."""
    Vp = -(-cfg.vocab_size // tp) * tp
    names = set(schedules.stage_param_names(cfg, stage, n_stages))
    total = 0
    for name, shape, _ in param_specs(cfg):
        if name not in names:
            continue
        kind = layout_of(name) if tp > 1 else "replicated"
        if kind == "vocab":
            total += Vp * shape[1] // tp
        elif kind == "replicated":
            total += math.prod(shape)
        else:
            total += math.prod(shape) // tp
    return total


def megatron_count_stage(cfg: GPTConfig, stage: int, n_stages: int, rows: int, t: int) -> tuple[int, int]:
    """tensor_parallel.megatron_count for one pipeline stage: 4 all-reduces per block of
    rows*t*C elements, the embedding's g on the first stage, the head's f and the
    cross-entropy's three of rows*t on the last."""
    L, C = len(schedules.partition(cfg.n_layer, n_stages)[stage]), cfg.n_embd
    calls, elems = 4 * L, 4 * L * rows * t * C
    if stage == 0:
        calls, elems = calls + 1, elems + rows * t * C
    if stage == n_stages - 1:
        calls, elems = calls + 4, elems + rows * t * C + 3 * rows * t
    return calls, elems


# --- the timeline as an SVG -----------------------------------------------------------------------

def timeline_svg(timeline, n_stages: int, title: str = "", width: int = 960) -> str:
    """A hand-written SVG of [(stage, "F"/"B", mb, start, end)]: one row per stage, a rect
    per forward (blue) and backward (green) labelled with its micro-batch, a time axis in ms."""
    row_h, left, top = 28, 70, 30
    t_end = max((r[4] for r in timeline), default=1.0) or 1.0
    scale = (width - left - 20) / t_end
    height = top + n_stages * row_h + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13">{_esc(title)}</text>']
    for s in range(n_stages):
        y = top + s * row_h
        out.append(f'<text x="8" y="{y + 17}">stage {s}</text>')
        out.append(f'<rect x="{left}" y="{y + 2}" width="{t_end * scale:.1f}" height="{row_h - 4}" '
                   f'fill="#eeeeee"/>')
    for s, kind, mb, a, b in timeline:
        y, x, w = top + s * row_h, left + a * scale, max((b - a) * scale, 0.5)
        color = "#4c78a8" if kind == "F" else "#54a24b"
        out.append(f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{row_h - 4}" fill="{color}" '
                   f'stroke="white" stroke-width="0.5"><title>{kind}{mb} {a * 1e3:.2f}-{b * 1e3:.2f} ms'
                   f'</title></rect>')
        if w >= 14:
            out.append(f'<text x="{x + w / 2:.1f}" y="{y + 18}" text-anchor="middle" fill="white">'
                       f'{kind}{mb}</text>')
    y = top + n_stages * row_h + 16
    for k in range(6):
        t = t_end * k / 5
        out.append(f'<text x="{left + t * scale:.1f}" y="{y}" text-anchor="middle">{t * 1e3:.1f} ms</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
