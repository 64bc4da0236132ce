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
(p-1)/(m+p-1) of the step for GPipe and 1F1B in theory, (p-1)/p for the naive schedule
(schedules.bubble_theory). The executor walks its list and nothing else; beside it, a
StepObserver records when each forward and backward starts and ends (perf_counter,
relative to the stage's own step start; the stages start a step together to within the
optimizer step, since the previous step ended with all-reduces over the pp group). A
stage's span is from its first instruction to its last send completing, and the step's
makespan is the longest span. As in schedules.check, the bubble of a step is

    1 - (sum over stages of busy time) / (p * makespan)

i.e. the mean over stages of each stage's idle fraction of the makespan (the last stage,
done first, idles through the cool-down). `bubble_measured` in the summary is its mean
over the steps after the first.
The observer also tracks the bytes of saved activations (Tensor.saved_bytes of the
micro-batch graphs in flight): GPipe holds m micro-batches at its peak, 1F1B at most
p - stage. draw.py draws the timeline.

Data parallelism composes by synchronising gradients during the *last Backward instruction
of the stage's own list* (GPipe's is micro-batch 0, 1F1B's and naive's micro-batch m-1:
keying on "micro-batch m-1" would leave GPipe stages unsynchronised, picotron's trap).
"""
from __future__ import annotations

import time

import numpy as np

from minipar.autograd import backward_split
from minipar import comm, trace
from minipar.comm.protocol import TAG_P2P_GRAD
from minipar.model.contract import Model
from minipar.parallel.data_parallel import GradSync, NoSync
from minipar.model.gpt import GPTConfig, param_specs
from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.schedules import (COMPUTE, Backward, Forward, RecvActivation, RecvGrad,
                                                 SendActivation, SendGrad, WeightGrad, neighbour)
from minipar.parallel.tensor.tensor_parallel import local_size, tp_all_reduce
from minipar.optim.mixed_precision import backward_seed
from minipar.autograd.tensor import Tensor, no_grad


class PipelineStage(Model):
    """One stage of the model: a GPT or TensorParallelGPT built holding only the stage's
    parameters (its Parts.holds: minipar/parallel/parallelize.py), so named_parameters() (and
    the memory report) holds only the stage's. Forward in pieces: embed on the first stage,
    its blocks, head and loss on the last. Collective methods (state_dict, consolidate,
    grad_norm_sq, evaluate) run on every rank of the pp group (and the tp group)."""

    def __init__(self, inner, stage: int, n_stages: int, pp_group: comm.Group, n_chunks: int = 1):
        self.inner, self.cfg, self.parts = inner, inner.cfg, inner.parts
        self.stage, self.n_stages, self.group = stage, n_stages, pp_group
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.n_chunks = n_chunks                  # > 1: interleaved, chunks stage, stage + p, ...
        self.chunks = schedules.rank_layers(self.cfg.n_layer, stage, n_stages, n_chunks)
        self.stage_layers = [i for chunk in self.chunks for i in chunk]
        self.names = schedules.stage_param_names(self.cfg, stage, n_stages, n_chunks)
        self.tp_size, self.tp_rank = inner.tp_size, inner.tp_rank
        self.tp_group = inner.group if self.tp_size > 1 else None
        # the stage's names in stage order (with --ep, only the experts this rank holds)
        self.params = {n: inner.params[n] for n in self.names if n in inner.params}
        self.full_shapes = inner.full_shapes
        self.tied_copy = self.is_last and not self.is_first and self.cfg.tie_embeddings

    # --- parameters (interfaces.Model: named_parameters, parameters, num_params of the whole
    # model, num_local_params of this stage, zero_grad, state_dict, grad_norm_sq) -------------
    vocab_padded = property(lambda self: self.inner.vocab_padded)        # tensor-parallel stages
    vocab_per_rank = property(lambda self: self.inner.vocab_per_rank)

    @property
    def layers(self) -> list:
        """The blocks of this stage (of all its chunks)."""
        return self.stage_layers

    def shard(self, name: str, full: np.ndarray) -> np.ndarray:
        return self.inner.shard(name, full)

    def load_state_dict(self, state: dict):
        """Load this stage's tensors from a full canonical state (other names are ignored)."""
        missing = [n for n in self.names if n not in state]
        if missing:
            raise ValueError(f"state_dict mismatch: missing {missing[:4]}")
        self.check_shapes(state, self.names)
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
                if not (n == self.family.embedding and self.tied_copy):
                    comm.send(self.group, full[n], 0)
            return full
        for s in range(1, self.n_stages):
            for n in schedules.stage_param_names(self.cfg, s, self.n_stages, self.n_chunks):
                if not (n == self.family.embedding and s == self.n_stages - 1):
                    full[n] = comm.recv(self.group, s)
        return {n: full[n] for n, _, _ in param_specs(self.cfg)}     # canonical order

    def counts_in_norm(self, name: str) -> bool:
        """The last stage skips its copy of a tied token embedding; otherwise the layers'
        rule (tensor parallelism: a copy held on several tp ranks counts on one)."""
        if name == self.family.embedding and self.tied_copy:
            return False
        return self.inner.counts_in_norm(name)

    def reduce_norm_sq(self, local: float) -> float:
        """All-reduced over tp (tensor_parallel's ledger) and over pp."""
        total = np.array([local])
        if self.tp_size > 1:
            total = tp_all_reduce(self.tp_group, total, "sum", "grad_norm")
        return float(comm.all_reduce(self.group, total)[0]) if self.n_stages > 1 else float(total[0])

    # --- forward, this stage's piece ----------------------------------------------------------
    def ends(self, chunk: int = 0) -> tuple[bool, bool]:
        """(is chunk `chunk` the first virtual stage, the last?): the embedding is on rank 0's
        chunk 0, the head on rank p-1's last chunk."""
        return self.is_first and chunk == 0, self.is_last and chunk == self.n_chunks - 1

    def forward(self, x, targets=None, loss_denom=None, chunk: int = 0):
        """Chunk `chunk` of this stage (the whole stage without interleaving). The first
        virtual stage takes token ids (b, T), the others the activation (b, T, C) from the
        previous one. The last: the loss (with targets) or logits; the others: (b, T, C)."""
        first, last = self.ends(chunk)
        if first:
            with trace.layer("embed"):                                # --trace: a span each
                x = self.inner.run_embed(x)                           # (b, T, C)
        for i in self.chunks[chunk]:
            x = self.inner.run_block(i, x)
        if not last:
            return x
        with trace.layer("head"):
            logits = self.inner.run_head(x)                           # (b, T, V) or (b, T, Vp/tp)
            if targets is None:
                return logits
            return self.inner.loss(logits, targets, loss_denom)

    def evaluate(self, idx, targets) -> float:
        """The mean loss of (idx, targets) through every (virtual) stage, no graph; the same on
        every pp rank. Blocking sends are fine here: each message's receiver is already
        waiting for it, or will be once its own previous chunk is done."""
        p, V = self.n_stages, self.n_chunks
        with no_grad():
            for c in range(V):
                prev, nxt = (neighbour(self.stage, c, d, p, V) for d in (-1, +1))
                x = idx if prev is None else Tensor(comm.recv(self.group, prev[0]))
                out = self.forward(x, targets if nxt is None else None, chunk=c)
                if nxt is not None:
                    comm.send(self.group, out.data, nxt[0])
            loss = np.array([out.item()]) if self.is_last else np.zeros(1)
        return float(comm.broadcast(self.group, loss, self.n_stages - 1)[0]) if self.n_stages > 1 \
            else float(loss[0])


# --- the executor ---------------------------------------------------------------------------------

def microbatch_span(ins, stage: int):
    """--trace: a Forward, Backward or WeightGrad instruction as a span "forward mb 3" (args
    kind F, B or W, mb, stage, chunk)."""
    if trace.RECORDER is None or not isinstance(ins, COMPUTE):
        return trace.NOTHING
    what = {"F": "forward", "B": "backward", "W": "weight gradients"}[ins.short]
    return trace.span(f"{what} mb {ins.mb}" + (f" chunk {ins.chunk}" if ins.chunk else ""), "microbatch",
                      kind=ins.short, mb=ins.mb, stage=stage, chunk=ins.chunk)


def op_label(ins) -> str:
    """A timeline row's kind: F, B or W, and the chunk after it when it is not 0 ("F1")."""
    return ins.short + (str(ins.chunk) if ins.chunk else "")


class StepObserver:
    """What the executor measures of one training step, kept out of the schedule walk: the
    walk calls on_start / on_end around every instruction and on_step_end once its last send
    has completed. Measured: when each Forward and Backward starts and ends (perf_counter,
    seconds since the step began), and the saved-activation bytes (Tensor.saved_bytes) of the
    micro-batch graphs in flight, at their peak. Receives and sends are not timed: a stage
    waiting for its neighbour is idle, and idle time is what the bubble counts."""

    def __init__(self, split: bool = False, n_chunks: int = 1):
        self.split = split          # a split backward: a micro-batch's activations are kept until W
        self.n_chunks = n_chunks
        self.timeline = []          # (op_label, mb, start, end) of each op, in the order run
        self.saved = {}             # saved-activation bytes of each graph in flight, by micro-batch
        self.peak = 0               # the most bytes in flight at once
        self.per_mb = 0             # the most bytes one micro-batch's graph saved
        self.start = self.step_time = None
        self.t0 = time.perf_counter()

    def on_start(self, ins):
        if isinstance(ins, COMPUTE):
            self.start = time.perf_counter()

    def on_end(self, ins, out=None):
        """After ins ran; out: a Forward's graph (its output, or loss on the last stage).
        A micro-batch's saved bytes count from its F to its B, or with a split backward to
        its W (B frees part of them; W still needs the layers' inputs: counted whole)."""
        if not isinstance(ins, COMPUTE):
            return
        key = (ins.chunk, ins.mb)
        self.timeline.append((op_label(ins), ins.mb, self.start - self.t0, time.perf_counter() - self.t0))
        if isinstance(ins, Forward):
            self.saved[key] = out.saved_bytes()
            self.per_mb = max(self.per_mb, self.saved[key])
            self.peak = max(self.peak, sum(self.saved.values()))
        elif isinstance(ins, WeightGrad if self.split else Backward):
            del self.saved[key]

    def on_step_end(self):
        self.step_time = time.perf_counter() - self.t0

    def stats(self) -> dict:
        """The step's figures, as PipelineEngine.steps keeps them (gather_stats sends them on)."""
        busy = sum(end - start for _, _, start, end in self.timeline)
        ops = {k: sum(e - a for kind, _, a, e in self.timeline if kind[0] == k) for k in "FBW"}
        n_f = sum(1 for kind, *_ in self.timeline if kind[0] == "F")          # micro-batches x chunks
        return {"timeline": self.timeline, "step_time": self.step_time, "busy": busy,
                "bubble": 1.0 - busy / self.step_time if self.step_time > 0 else 0.0,   # of its own span
                "peak_activation_bytes": self.peak, "microbatch_activation_bytes": self.per_mb,
                # the stage's F, B and W of one whole micro-batch (all its chunks), in seconds
                "op_seconds": [ops[k] / max(n_f, 1) * self.n_chunks for k in "FBW"]}


class PipelineEngine:
    """Runs one stage's instruction list for a training step (a StepObserver measures it)."""

    def __init__(self, stage_model: PipelineStage, schedule: str, n_micro: int):
        self.model, self.schedule, self.n_micro = stage_model, schedule, n_micro
        self.instructions = schedules.schedule(schedule, stage_model.stage, stage_model.n_stages, n_micro,
                                               stage_model.n_chunks)
        # zero-bubble schedules: Backward runs B only, WeightGrad W (backward_split.py)
        self.split = any(isinstance(ins, WeightGrad) for ins in self.instructions)
        # dp synchronises during the last instruction that makes each chunk's parameter
        # gradients (with interleaving a chunk's are complete before the rank's last backward)
        makes_grads = {ins.chunk: k for k, ins in enumerate(self.instructions)
                       if isinstance(ins, WeightGrad if self.split else Backward)}
        self.last_backward = set(makes_grads.values())
        self.steps = []                                 # per step: StepObserver.stats()

    @property
    def bubble_theory(self) -> float:
        return schedules.bubble_theory(self.schedule, self.model.n_stages, self.n_micro, self.model.n_chunks)

    def train_step(self, batches, loss_denom, sync: GradSync | None = None, loss_scale: float = 1.0) -> float:
        """Forward and backward of every micro-batch in `batches` [(x, y), ...] as the
        schedule orders them; then dp's gradient sync, the tied-embedding gradient
        exchange, and the loss broadcast. Returns the sum of the micro-batch losses (each
        divided by loss_denom), identical on every pp rank. Gradients accumulate into .grad.
        loss_scale (fp16): the last stage seeds each backward with it instead of 1, so every
        gradient sent back through the pipe, and every .grad, is scaled by it. sync: the dp
        group's gradient synchroniser (data_parallel.GradSync; None: one dp rank)."""
        sync = sync if sync is not None else NoSync(self.model.parameters())
        self.batches, self.loss_denom, self.sync, self.loss_scale = batches, loss_denom, sync, loss_scale
        # all by (chunk, micro-batch):
        self.acts, self.grads = {}, {}      # received activations / output gradients
        self.inputs, self.outputs = {}, {}  # the leaf input and the output (or loss) of each graph in flight
        self.pending = {}                   # split backward: what W still has to do (backward_split.PendingW)
        self.counts = {}                    # Mixtral's pooled counts received beside a message
        if self.pooled:
            self.model.moe.pools = {}
        self.sends, self.loss_sum = [], 0.0
        watch = StepObserver(self.split, self.model.n_chunks)
        stage = self.model.stage
        with trace.span("schedule", "pipeline", schedule=self.schedule, stage=stage):
            for k, ins in enumerate(self.instructions):    # warm-up, steady state, cool-down: schedules.py
                watch.on_start(ins)
                with microbatch_span(ins, stage):
                    out = self.run(k, ins)
                watch.on_end(ins, out)
                self.push_sends()
            with trace.span("wait for sends", "wait"):
                self.wait_sends()
            watch.on_step_end()
        with trace.span("wait for gradient sync", "wait"):
            sync.finish()
        self.sync_tied_embedding(sync)
        self.steps.append(watch.stats())
        return self.broadcast_loss()

    def run(self, k: int, ins):
        """Execute instruction k of this stage's list, `ins`. Returns a Forward's graph (its
        output, or the loss on the last stage), else None. Messages go to the neighbouring
        virtual stage (schedules.neighbour: the next or previous rank, or round the ring with
        interleaving); gradients on their own tag, so that with interleaving on 2 ranks an
        activation and a gradient between the same two ranks never take each other's place."""
        model, group, key = self.model, self.model.group, (ins.chunk, ins.mb)
        p, V = model.n_stages, model.n_chunks
        prev, nxt = (neighbour(model.stage, ins.chunk, d, p, V) for d in (-1, +1))
        pooled = self.pooled                    # Mixtral's counts travel beside each message
        if isinstance(ins, RecvActivation):
            self.acts[key] = comm.recv(group, prev[0])
            if pooled:
                self.counts[key] = comm.recv(group, prev[0])
        elif isinstance(ins, RecvGrad):
            self.grads[key] = comm.recv(group, nxt[0], tag=TAG_P2P_GRAD)
            if pooled:
                self.counts[key] = comm.recv(group, nxt[0], tag=TAG_P2P_GRAD)
        elif isinstance(ins, Forward):
            self.take_counts(key, ins.mb)
            x, y = self.batches[ins.mb]
            if prev is not None:                # the previous stage's output, as a leaf of this graph
                x = self.inputs[key] = Tensor(self.acts.pop(key), requires_grad=True)
            out = self.outputs[key] = model.forward(x, y if nxt is None else None, self.loss_denom, ins.chunk)
            if nxt is None:
                self.loss_sum += out.item()
            return out
        elif isinstance(ins, Backward):
            self.take_counts(key, ins.mb)
            out = self.outputs.pop(key)
            seed = backward_seed(self.loss_scale) if nxt is None else self.grads.pop(key)
            if self.split:                      # B: the input's gradient now, W later
                seed = np.ones_like(out.data) if seed is None else seed
                self.pending[key] = backward_split.backward_b(out, seed, [] if prev is None else [self.inputs[key]])
            else:
                self.sync.sync_now(k in self.last_backward)
                out.backward(seed)
        elif isinstance(ins, WeightGrad):
            self.sync.sync_now(k in self.last_backward)
            self.pending.pop(key).run()
        elif isinstance(ins, SendActivation):
            self.sends.append(comm.send_async(group, self.outputs[key].data, nxt[0]))
            if pooled:
                self.sends.append(comm.send_async(group, self.counts_of(ins.mb), nxt[0]))
        elif isinstance(ins, SendGrad):
            self.sends.append(comm.send_async(group, self.inputs.pop(key).grad, prev[0], tag=TAG_P2P_GRAD))
            if pooled:
                self.sends.append(comm.send_async(group, self.counts_of(ins.mb), prev[0], tag=TAG_P2P_GRAD))
        return None

    @property
    def pooled(self) -> bool:
        """Mixtral's load-balancing loss needs every MoE block's counts of a micro-batch: each
        activation message is followed by the counts of the blocks before (the pool so far),
        each gradient message by the whole model's (moe.MoESettings.pooled); (groups, E) int64."""
        return self.model.moe is not None and self.model.moe.pooled

    def counts_of(self, mb: int) -> np.ndarray:
        """Micro-batch mb's pooled counts so far (the whole model's once its last stage has run)."""
        return self.model.moe.pools[mb].counts_array(self.model.moe.experts)

    def take_counts(self, key, mb: int):
        """Before a forward or backward of micro-batch mb: its pool in use, with the counts that
        came beside the message it starts from (the blocks before, or the whole model's)."""
        if self.pooled:
            self.model.moe.use_pool(mb)
            if key in self.counts:
                self.model.moe.pool.set_counts(self.counts.pop(key))

    def push_sends(self):
        """Push the sends in flight along (MPI progresses only inside calls)."""
        for h in self.sends:
            if not h.done:
                h.test()

    def wait_sends(self):
        for h in self.sends:
            h.wait()
        self.sends = []

    def broadcast_loss(self) -> float:
        """The last stage's loss sum, to every stage (8 bytes over the pp group)."""
        model = self.model
        if model.n_stages == 1:
            return self.loss_sum
        return float(comm.broadcast(model.group, np.array([self.loss_sum]), model.n_stages - 1)[0])

    def sync_tied_embedding(self, sync: GradSync):
        """Megatron's embedding group: stage 0 and the last stage each add the other's
        wte.weight gradient, in place, so both copies stay equal. With ZeRO (Zero.tied_grad)
        the gradient is already reduce-scattered over dp: the two stages' dp rank r hold
        the same shard of it (wte is a unit of its own), and exchange only that."""
        model = self.model
        if not model.cfg.tie_embeddings or model.n_stages == 1 or not (model.is_first or model.is_last):
            return
        w = model.params[model.family.embedding]
        grad = sync.tied_grad(w)
        other = model.n_stages - 1 if model.is_first else 0
        with trace.span("tied embedding exchange", "pipeline"):
            h = comm.send_async(model.group, grad, other)
            theirs = comm.recv(model.group, other)
            h.wait()
        grad += theirs                                  # a + b == b + a: both copies equal

    def gather_stats(self, step: int = -1):
        """Stage 0 of the pp group gets every stage's stats (a list by stage): the timeline,
        times and bubble of `step`, the mean bubble of the steps after the first, the peak
        saved-activation bytes over all steps, the mean F, B and W of one micro-batch over
        the steps after the first (op_seconds); the others get None. Collective over the pp
        group (each stage sends 2 small arrays)."""
        this = self.steps[step]
        rows = np.array([[_code(kind), mb, a, b] for kind, mb, a, b in this["timeline"]])
        later = self.steps[1:] or self.steps            # the first step warms caches up
        nums = np.array([this["step_time"], this["busy"], this["peak_activation_bytes"],
                         this["microbatch_activation_bytes"], max(st["peak_activation_bytes"] for st in self.steps)]
                        + list(np.mean([st["op_seconds"] for st in later], axis=0))
                        + [st["busy"] for st in later] + [st["step_time"] for st in later], dtype=np.float64)
        model = self.model
        if model.stage != 0:
            comm.send(model.group, rows, 0)
            comm.send(model.group, nums, 0)
            return None
        out, busy, span = [], [], []
        for stage in range(model.n_stages):
            their_rows, their_nums = (rows, nums) if stage == 0 else \
                (comm.recv(model.group, stage), comm.recv(model.group, stage))
            out.append({"timeline": [(stage, _label(int(k)), int(mb), a, b) for k, mb, a, b in their_rows],
                        "step_time": float(their_nums[0]), "busy": float(their_nums[1]),
                        "microbatch_activation_bytes": int(their_nums[3]),
                        "peak_activation_bytes": int(their_nums[4]),
                        "op_seconds": [float(t) for t in their_nums[5:8]]})     # F, B, W
            busy.append(their_nums[8:8 + len(later)])
            span.append(their_nums[8 + len(later):])
        makespan = np.max(span, axis=0)                 # per step: the longest stage
        for stage, st in enumerate(out):                # idle fraction of the makespan, mean over steps
            st["bubble_mean"] = float(np.mean(1.0 - busy[stage] / makespan))
        return out


def _code(label: str) -> int:
    """A timeline kind (op_label: "F", "B", "W", with the chunk after it) as one number to send."""
    return "FBW".index(label[0]) + 3 * int(label[1:] or 0)


def _label(code: int) -> str:
    kind, chunk = "FBW"[code % 3], code // 3
    return kind + (str(chunk) if chunk else "")


# --- what a stage holds and sends, by formula (the planner and the summary use these) -------------

def local_tensors(cfg: GPTConfig, stage: int, n_stages: int, tp: int = 1, n_chunks: int = 1) -> list:
    """[(canonical name, elements on one rank)] of a stage, model order: the stage's tensors
    (schedules.stage_param_names; the last stage keeps a copy of a tied wte), each as
    tensor parallelism cuts it (tensor_parallel.local_size: split ones / tp, vocabulary
    ones padded to Vp = tp * ceil(V / tp) rows first). n_chunks: interleaved, the rank's chunks."""
    names = set(schedules.stage_param_names(cfg, stage, n_stages, n_chunks))
    return [(name, local_size(name, shape, tp, cfg)) for name, shape, _ in param_specs(cfg) if name in names]


def local_param_count(cfg: GPTConfig, stage: int, n_stages: int, tp: int = 1, n_chunks: int = 1) -> int:
    """Parameters one rank of `stage` holds, by formula (what num_local_params() must measure)."""
    return sum(n for _, n in local_tensors(cfg, stage, n_stages, tp, n_chunks))
