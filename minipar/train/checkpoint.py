"""Checkpoints (docs/design.md §9): sharded, atomic, readable on any layout. A checkpoint is a
directory DIR:

    meta.json              config, layout, the step to resume at, data position, seeds, the
                           loss scaler, and under "optimizer": Adam's step, the canonical
                           parameter list [name, shape] and the shard files with their sizes
    model.npz              the consolidated canonical model {name: array} (docs/design.md §2) in the
                           run's dtype (--precision fp16/bf16: the fp32 master weights)
    optim/rank-00003.npz   one per writing rank: the Adam state that rank holds, flat
                             index  (n,) int64  where each element sits in the canonical flat
                                                vector (below); -1 for padding
                             m, v   (n,)        Adam's moments (float32 with fp16/bf16)
                             step   ()          Adam's step count (the same in every shard)

The canonical flat vector is every parameter of meta.json's list (the order of
minipar.model.gpt.param_specs), each flattened in C order, concatenated: P elements. A rank
learns where its own elements sit by cutting an index tensor exactly as it cuts the
parameters (optimizer_shard, below): the tensor-parallel slice, the pipeline stage, the ZeRO
shard of a padded unit. So a shard is self-describing, and loading needs to know nothing of
the layout that wrote it: scatter every shard into full m and v,

    m_full[index[index >= 0]] = m[index >= 0]

and check that each of the P elements was covered. Copies (a LayerNorm replicated over tp,
the last pipeline stage's tied wte) are simply covered twice, with equal values. Every rank
of any layout then takes its own slice of m_full and v_full, as it does of model.npz.

Atomic, with many writers: every rank writes into DIR.tmp; then all ranks agree (an
all-gather of one status number each, minipar.comm) that every write succeeded; only then
does rank 0 write meta.json, the commit record, and swap DIR.tmp in with two renames
(DIR -> DIR.old, DIR.tmp -> DIR). A failure or a crash at any point leaves DIR, or between
the two renames DIR.old (which `load` falls back to), as the last good checkpoint. When a
write fails on any rank, that rank prints its traceback at once and every rank raises
SaveFailed (the trainer then ends the job).

Everything is read with allow_pickle=False, and every problem found while reading raises
CheckpointError naming the file and the mismatch.

The trainer's side is at the end of this file: canonical_state (the model as checkpoints and
--verify see it), optimizer_shard (this rank's shard and its index), save_run and restore.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import traceback

import numpy as np

from minipar.train import data
from minipar.config import outputs
from minipar.optim import mixed_precision
from minipar.model.gpt import param_specs
from minipar.parallel.expert import expert_parallel
from minipar.parallel.zero.optimizer import ShardedAdamW

FORMAT_VERSION = 2
READABLE_FORMATS = (FORMAT_VERSION,)
SHARD_DIR = "optim"
_SHARD_NAME = re.compile(r"optim/rank-\d{5,}\.npz")


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match the run."""


class NotFinite(CheckpointError):
    """A state with NaN or inf in it: never written, never loaded."""


def non_finite(arrays: dict) -> list[str]:
    """The names of the float arrays holding a NaN or an inf."""
    return [n for n, a in arrays.items()
            if np.asarray(a).dtype.kind == "f" and not np.isfinite(np.asarray(a)).all()]


def _first(names: list[str], k: int = 3) -> str:
    return ", ".join(names[:k]) + (" ..." if len(names) > k else "")


class SaveFailed(CheckpointError):
    """A save failed on some rank; raised on every rank. `rank`: the (lowest) failing rank.
    The checkpoint directory still holds the last good checkpoint."""

    def __init__(self, msg, rank: int):
        super().__init__(msg)
        self.rank = rank


def shard_name(rank: int) -> str:
    """The optimizer shard file of (world) rank `rank`, relative to the checkpoint directory."""
    return f"{SHARD_DIR}/rank-{rank:05d}.npz"


def full_shard(params, optim_state: dict) -> dict:
    """The shard of a process that holds the whole optimizer state in canonical form
    {"step", "m": {name: array}, "v": {...}}: index 0..P-1. params: [(name, shape)]."""
    names = [n for n, _ in params]
    P = sum(math.prod(s) for _, s in params)
    return {"step": int(optim_state["step"]), "index": np.arange(P, dtype=np.int64),
            "m": np.concatenate([np.ravel(optim_state["m"][n]) for n in names]),
            "v": np.concatenate([np.ravel(optim_state["v"][n]) for n in names])}


# ------------------------------------------------------------------------------ writing

def _write_npz(path: str, arrays: dict):
    with open(path, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())


def save(directory: str, model_state: dict | None, shard: dict | None, meta: dict | None, group=None):
    """Write checkpoint `directory` atomically. Collective over `group` (a minipar.comm
    Group: every rank calls; None or one rank: this process alone).

    model_state  on group rank 0: {canonical name: full array}, in canonical order (its names
                 and shapes define the flat vector the shard indices point into)
    shard        {"step", "index", "m", "v"}: this rank's optimizer state (module docstring),
                 or None if this rank writes none. Rank 0 always writes one.
    meta         on group rank 0: config, step, layout, ... ("format", "optimizer" are added)
    Ranks other than 0 may pass None for model_state and meta.

    One process: an exception is raised as it is, and DIR is untouched. Several: the failing
    rank prints its traceback, then every rank raises SaveFailed. Either way the half-written
    DIR.tmp is removed."""
    directory = os.path.abspath(directory)
    tmp = directory + ".tmp"
    rank = group.rank if group is not None else 0
    bad = non_finite({**(model_state or {}), **({f"optimizer {k}": shard[k] for k in ("m", "v")} if shard else {})})
    if group is not None and group.size > 1:       # every rank learns whether any holds a NaN (int32:
        from minipar import comm                   # noqa: PLC0415 - the step's skip flag is the one
        with comm.untracked():                     # int64 max all-reduce; lab 09's seam finds it so)
            anywhere = int(comm.all_reduce(group, np.array([len(bad)], dtype=np.int32), op="max")[0])
    else:
        anywhere = len(bad)
    if anywhere:
        raise NotFinite(f"checkpoint {directory} not written: " + (
            f"{len(bad)} tensor(s) hold NaN or inf ({_first(bad)})"
            if bad else "another rank's tensors hold NaN or inf") + f"; {directory} keeps the last good checkpoint")

    def create():                                  # rank 0: a fresh DIR.tmp/optim, marked minipar's
        for p in (tmp, directory + ".old", directory):   # what a save replaces must be minipar's
            if os.path.islink(p) or os.path.lexists(p) and not (outputs.is_minipar_checkpoint(p) or
                                                                os.path.isdir(p) and outputs.holds_nothing(p)):
                raise CheckpointError(f"{p} exists and is not a checkpoint minipar wrote: not replaced")
        _remove(tmp)
        made.append(tmp)
        os.makedirs(os.path.join(tmp, SHARD_DIR))
        with open(os.path.join(tmp, outputs.MARKER), "w") as f:
            f.write("a checkpoint folder written by minipar (python -m minipar.train --save)\n")
        return 0

    def write():                                   # every rank: its shard; rank 0: the model
        if rank == 0:
            if shard is None:
                raise ValueError("rank 0 must write an optimizer shard: it carries Adam's step")
            _write_npz(os.path.join(tmp, "model.npz"), model_state)
        if shard is None:
            return 0
        index, m, v = (np.ravel(shard[k]) for k in ("index", "m", "v"))
        if not index.size == m.size == v.size:
            raise ValueError(f"optimizer shard of rank {rank}: index {index.size}, m {m.size}, "
                             f"v {v.size} elements")
        _write_npz(os.path.join(tmp, shard_name(rank)), {
            "index": index.astype(np.int64, copy=False), "m": m, "v": v,
            "step": np.asarray(shard["step"], dtype=np.int64)})
        return 1 + index.size                      # 0: no shard; else 1 + its elements

    def commit():                                  # rank 0: the commit record, then the swap
        params = [[n, list(np.shape(a))] for n, a in model_state.items()]
        optimizer = {"step": int(shard["step"]), "dtype": np.asarray(shard["m"]).dtype.name,
                     "elements": sum(math.prod(s) for _, s in params), "params": params,
                     "shards": {shard_name(r): n - 1 for r, n in enumerate(written) if n}}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            f.write(_dumps({**meta, "format": FORMAT_VERSION, "optimizer": optimizer}))
            f.flush()
            os.fsync(f.fileno())
        outputs.fsync_path(os.path.join(tmp, SHARD_DIR))
        outputs.fsync_path(tmp)
        _swap(directory)
        return 0

    made = []                                      # rank 0: DIR.tmp is this save's own
    try:
        _together(group, directory, "create " + tmp, create if rank == 0 else None)
        written = _together(group, directory, "write its files into " + tmp, write)
        _together(group, directory, "commit " + tmp, commit if rank == 0 else None)
    except Exception:                              # every rank is past its writes: rank 0 removes
        if made:                                   # the half-written DIR.tmp (a full disk's space)
            _remove(tmp)
        raise


def _dumps(meta: dict) -> str:
    """meta.json's text: indented, keys sorted, one line per [name, shape] of the parameter list."""
    text = json.dumps(meta, indent=1, sort_keys=True)
    return re.sub(r'\[\s*("[^"]*"),\s*\[([\d,\s]*)\]\s*\]',
                  lambda m: f"[{m.group(1)}, [{', '.join(m.group(2).replace(',', ' ').split())}]]", text) + "\n"


def _swap(directory: str):
    """DIR.tmp becomes DIR by two renames; a crash between them leaves DIR.old."""
    tmp, old = directory + ".tmp", directory + ".old"
    if os.path.exists(directory):                   # only now may an older DIR.old go
        _remove(old)
        os.rename(directory, old)
    os.rename(tmp, directory)
    outputs.fsync_path(os.path.dirname(directory))
    _remove(old)


def _remove(path: str):
    """Remove a checkpoint folder, its marker last: a kill part-way leaves a folder still
    recognised as minipar's (outputs.MARKER), which the next save may replace."""
    if not os.path.isdir(path) or os.path.islink(path):
        return
    for entry in sorted(os.listdir(path), key=lambda e: e == outputs.MARKER):
        p = os.path.join(path, entry)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(p)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def describe_error(e: BaseException) -> str:
    """An OSError as 'No space left on device (ENOSPC): FILE'; anything else as its message."""
    if isinstance(e, OSError) and e.errno is not None:
        import errno as _errno                       # noqa: PLC0415
        name = _errno.errorcode.get(e.errno, str(e.errno))
        return f"{e.strerror} ({name})" + (f": {e.filename}" if e.filename else "")
    return str(e)


def _together(group, directory: str, what: str, fn) -> list:
    """Run fn on this rank (None: nothing to do here), then agree with every rank of the
    group: -> every rank's result (ints >= 0), in rank order. If fn raised on any rank, every
    rank raises SaveFailed; the failing one has printed its traceback first, before the
    agreement lets any rank go on (and perhaps end the job)."""
    from minipar import comm                       # only saves talk: loading needs no MPI
    if group is None or group.size == 1:
        return [fn() if fn is not None else 0]       # one process: its exception as it is
    error = None
    try:
        mine = fn() if fn is not None else 0
    except Exception as e:                           # reported here, then SaveFailed everywhere
        error, mine = e, -1
        me = group.world_ranks[group.rank]
        if isinstance(e, (OSError, CheckpointError)):  # a full disk, an I/O error: one line
            sys.stderr.write(f"[rank {me}] checkpoint {directory} not written: this rank failed to {what}: "
                             f"{describe_error(e)}; {directory} keeps the last good checkpoint\n")
        else:                                        # a bug: the whole stack
            frames = traceback.extract_stack()[:-1] + traceback.extract_tb(e.__traceback__)
            text = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) \
                + "".join(traceback.format_exception_only(type(e), e))
            sys.stderr.write("".join(f"[rank {me}] {line}\n" for line in text.splitlines()))
            sys.stderr.write(f"[rank {me}] checkpoint {directory} not written: this rank failed to {what}; "
                             f"{directory} keeps the last good checkpoint\n")
        sys.stderr.flush()
    status = comm.all_gather(group, np.array([mine], dtype=np.int64))
    failed = [r for r, s in enumerate(status.tolist()) if s < 0]
    if failed:
        r = group.world_ranks[failed[0]]
        raise SaveFailed(f"checkpoint {directory} not written: rank {r} failed to {what} (its traceback "
                         f"is above); {directory} keeps the last good checkpoint", r) from error
    return status.tolist()


# ------------------------------------------------------------------------------ reading

def _read_npz(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {e.strerror}") from None
    try:
        with f, np.load(f, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as e:                        # zipfile.BadZipFile, ValueError, OSError ...
        raise CheckpointError(f"checkpoint file {path} is corrupt: {type(e).__name__}: {e}") from None


def _read_meta(directory: str) -> dict:
    path = os.path.join(directory, "meta.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or "config" not in meta:
        raise CheckpointError(f"checkpoint file {path} is corrupt: not a minipar checkpoint "
                              f"(needs an object with 'step' and 'config')")
    if meta.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"checkpoint file {path} has format {meta.get('format')!r}, "
                              f"this minipar reads formats {', '.join(map(str, READABLE_FORMATS))}")
    return meta


def check_model(directory: str, model_state: dict, params) -> None:
    """model.npz holds exactly `params` [(name, shape)]: else CheckpointError naming the
    file, the tensor and both shapes."""
    path = os.path.join(directory, "model.npz")
    want = {n: tuple(s) for n, s in params}
    missing = [n for n in want if n not in model_state]
    extra = [n for n in model_state if n not in want]
    if missing or extra:
        raise CheckpointError(f"checkpoint file {path} does not match the model: "
                              + (f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
                                 if missing else "")
                              + ("; " if missing and extra else "")
                              + (f"unexpected {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"
                                 if extra else ""))
    for n, shape in want.items():
        if tuple(model_state[n].shape) != shape:
            raise CheckpointError(f"checkpoint file {path} does not match the model: {n} has shape "
                                  f"{tuple(model_state[n].shape)}, the model's is {shape}")


def load(directory: str):
    """-> (model_state, optim_state, meta): the canonical model {name: array}, the canonical
    optimizer state {"step", "m": {name: array}, "v": {...}} rebuilt from the shards, and
    meta.json, with "loaded_from": the folder read (DIR.old when a save was cut off between
    its two renames). Raises CheckpointError naming the file and the problem (NotFinite for
    a NaN or an inf in any tensor). Sends no message."""
    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        if os.path.isdir(directory + ".old"):        # crashed between the two renames of save()
            directory += ".old"                      # meta["loaded_from"] says so (the trainer prints it)
        else:
            raise CheckpointError(f"checkpoint directory {directory} not found")
    meta = _read_meta(directory)
    meta["loaded_from"] = directory
    model_state = _read_npz(os.path.join(directory, "model.npz"))
    optim_state = _load_shards(directory, meta, model_state)
    bad = non_finite({**model_state, **{f"optimizer m {n}": a for n, a in optim_state["m"].items()},
                      **{f"optimizer v {n}": a for n, a in optim_state["v"].items()}})
    if bad:
        raise NotFinite(f"checkpoint {directory} holds NaN or inf in {len(bad)} tensor(s) ({_first(bad)}): not loaded")
    return model_state, optim_state, meta


def _optimizer_toc(directory: str, meta: dict):
    """meta.json's "optimizer" entry, checked: -> (step, [(name, shape)], {file: elements})."""
    path = os.path.join(directory, "meta.json")
    info = meta.get("optimizer")
    try:
        step, params, shards = info["step"], info["params"], info["shards"]
        params = [(str(n), tuple(int(d) for d in s)) for n, s in params]
        ok = isinstance(step, int) and isinstance(shards, dict) and shards and all(
            isinstance(f, str) and _SHARD_NAME.fullmatch(f) and isinstance(k, int) for f, k in shards.items())
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its 'optimizer' entry needs 'step', "
                              f"'params' [[name, shape], ...] and 'shards' {{\"optim/rank-NNNNN.npz\": elements}}")
    return step, params, shards


def _load_shards(directory: str, meta: dict, model_state: dict) -> dict:
    """Scatter every shard into the canonical flat m and v; check coverage."""
    step, params, shards = _optimizer_toc(directory, meta)
    check_model(directory, model_state, params)
    sizes = [math.prod(s) for _, s in params]
    P = sum(sizes)
    m_full = v_full = None
    covered = np.zeros(P, dtype=bool)
    for name, listed in shards.items():
        path = os.path.join(directory, name)
        z = _read_npz(path)
        lacking = [k for k in ("index", "m", "v", "step") if k not in z]
        if lacking:
            raise CheckpointError(f"checkpoint file {path} is corrupt: no {', '.join(map(repr, lacking))} array")
        index, m, v = z["index"], z["m"], z["v"]
        if index.ndim != 1 or m.ndim != 1 or v.ndim != 1 or not np.issubdtype(index.dtype, np.integer) \
                or not np.issubdtype(m.dtype, np.floating) or not np.issubdtype(v.dtype, np.floating):
            raise CheckpointError(f"checkpoint file {path} is corrupt: needs 1-D arrays, an integer index "
                                  f"and floating m and v; has index {index.dtype}{index.shape}, "
                                  f"m {m.dtype}{m.shape}, v {v.dtype}{v.shape}")
        if not index.size == m.size == v.size == listed:
            raise CheckpointError(f"checkpoint file {path} does not add up: index has {index.size:,} elements, "
                                  f"m {m.size:,}, v {v.size:,}; meta.json lists {listed:,}")
        if z["step"].shape != () or int(z["step"]) != step:
            raise CheckpointError(f"checkpoint file {path} is from another save: Adam step {z['step']}, "
                                  f"meta.json says {step}")
        if index.size and (index.min() < -1 or index.max() >= P):
            raise CheckpointError(f"checkpoint file {path} is corrupt: index values run from {index.min()} to "
                                  f"{index.max()}, outside -1 .. {P - 1} (P = {P:,} parameters)")
        if m_full is None:
            m_full, v_full = np.zeros(P, dtype=m.dtype), np.zeros(P, dtype=v.dtype)
        if m.dtype != m_full.dtype or v.dtype != v_full.dtype:
            raise CheckpointError(f"checkpoint file {path} holds {m.dtype}/{v.dtype} moments, the other "
                                  f"shards {m_full.dtype}/{v_full.dtype}")
        real = index >= 0                           # -1: padding (tp vocabulary rows, ZeRO units)
        m_full[index[real]], v_full[index[real]] = m[real], v[real]
        covered[index[real]] = True
    if not covered.all():
        first = int(np.argmin(covered))
        off = 0
        for (n, shape), size in zip(params, sizes):
            if first < off + size:
                break
            off += size
        where = [int(i) for i in np.unravel_index(first - off, shape)] if shape else []
        raise CheckpointError(f"checkpoint {directory} is incomplete: its {len(shards)} optimizer shard(s) "
                              f"cover {int(covered.sum()):,} of {P:,} elements; none holds {n}{where}")
    out = {"step": step, "m": {}, "v": {}}
    off = 0
    for (n, shape), size in zip(params, sizes):
        out["m"][n] = m_full[off:off + size].reshape(shape)
        out["v"][n] = v_full[off:off + size].reshape(shape)
        off += size
    return out


# ------------------------------------------------------------------------------ the trainer's side

def local_state(model, opt, kind: str) -> dict:
    """{canonical name: this rank's (tp slice, pp stage) array} of "params" (the fp32 master
    weights with --precision fp16/bf16), "m" or "v". With ZeRO, gathered from the dp
    group's shards (collective over dp)."""
    names = [n for n, _ in model.named_parameters()]
    if isinstance(opt, ShardedAdamW):
        return opt.gather_local("master" if kind == "params" and opt.mixed else kind)
    if kind == "params":
        if isinstance(opt, mixed_precision.MixedPrecisionAdamW):
            return dict(zip(names, opt.master))
        return {n: p.data for n, p in model.named_parameters()}
    return dict(zip(names, getattr(opt, kind)))


def canonical_state(model, opt) -> dict:
    """The model as checkpoints and --verify see it: {canonical name: full array}. With
    --precision fp16/bf16 that is the fp32 master weights (the 2-byte parameters are their
    rounding). Collective over tp and pp (and dp with ZeRO), like model.state_dict()."""
    return model.consolidate(expert_parallel.gather_experts(model, local_state(model, opt, "params")))


def optimizer_shard(model, opt) -> dict:
    """This rank's Adam state for its shard file: m and v flat, exactly as this rank holds
    them, and `index`: where each element sits in the canonical flat vector (every parameter
    of param_specs, C order, concatenated), -1 for padding. No communication.

    The index comes from cutting an index tensor the way the parameters are cut: for each
    local parameter, model.shard (the tp slice; the whole tensor on one rank) of the tensor
    1..size shifted by the parameter's canonical offset, minus 1, so tensor parallelism's
    zero padding of the vocabulary rows comes out as -1; with ZeRO each unit is then
    flattened and padded like the parameters (Unit.flatten, zeros -> -1 again) and cut to
    this rank's [lo, hi). With hybrid sharding only the first replica of a shard writes it
    (the others hold the same)."""
    where, off = {}, 0                                  # {name: (canonical offset, full shape)}
    for name, shape, _ in param_specs(model.cfg):
        where[name], off = (off, shape), off + math.prod(shape)
    index = {}                                          # {name: this rank's slice of 1 + index}
    for name, _ in model.named_parameters():
        start, shape = where[name]
        full = np.arange(start + 1, start + math.prod(shape) + 1, dtype=np.int64).reshape(shape)
        index[name] = np.asarray(model.shard(name, full))
    if isinstance(opt, ShardedAdamW):                      # its flat shard of every unit (hybrid: the first replica's)
        parts = [(u.flatten([index[n] for n in u.names])[u.lo:u.hi], u.m, u.v) for u in opt.units
                 if u.replicas is None or u.replicas.rank == 0]
        if not parts:                                      # a later replica of every unit: an empty shard
            parts = [(np.zeros(0, np.int64), u.m[:0], u.v[:0]) for u in opt.units[:1]]
    else:
        parts = [(index[n].ravel(), m.ravel(), v.ravel())
                 for (n, _), m, v in zip(model.named_parameters(), opt.m, opt.v)]
    return {"step": opt.step_count, "index": np.concatenate([i for i, _, _ in parts]) - 1,
            "m": np.concatenate([m for _, m, _ in parts]), "v": np.concatenate([v for _, _, v in parts])}


def save_run(path: str, session, next_step: int):
    """A training session's checkpoint (s: train.Session), called on every rank. model.npz:
    the canonical model, consolidated on rank 0 (collective: tp all-gathers, pp sends to
    stage 0, ZeRO all-gathers over dp). The optimizer: each rank writes the shard it holds
    (optimizer_shard), with ZeRO every rank, without it dp rank 0 (cp rank 0) of each (tp, pp) position
    (its dp replicas hold the same). Then save() agrees that every write succeeded before
    rank 0 commits."""
    model, opt, args, grid = session.model, session.opt, session.args, session.grid
    state = canonical_state(model, opt)
    writes = isinstance(opt, ShardedAdamW) or (grid.dp_rank // grid.ep_size == 0 and grid.cp_rank == 0)
    shard = optimizer_shard(model, opt) if writes else None
    meta = None
    if grid.rank == 0:
        state = {n: state[n] for n, _, _ in param_specs(session.cfg)}          # canonical order
        scaler = opt.scaler if isinstance(opt, (ShardedAdamW, mixed_precision.MixedPrecisionAdamW)) else None
        tokens = session.spec.tokens
        meta = {"config": session.cfg.to_dict(), "step": next_step, "dtype": args.dtype, "precision": args.precision,
                **({"loss_scaler": scaler.state_dict()} if scaler is not None else {}),
                "layout": {"dp": grid.dp_size, "cp": grid.cp_size, "tp": grid.tp_size, "pp": grid.pp_size,
                           "zero": args.zero, **({"shard_group": grid.layout.shard_group}
                                                 if grid.layout.shard_group is not None else {})},
                "data": {"source": args.data or data.BUILTIN_NAME, "tokens": int(len(tokens)),
                         "sha256_16": data.tokens_digest(tokens), "position": next_step},
                "seed": args.seed, "batch_size": args.batch_size}
    save(path, state if grid.rank == 0 else None, shard, meta, grid.world)


def restore(model, opt, state: dict, ostate: dict, path: str):
    """Load a checkpoint's canonical model and optimizer state into this rank's model and
    plain optimizer (before ZeRO shards it): each takes its own slice (model.shard)."""
    try:
        model.load_state_dict(state)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}/model.npz does not match the model: {e}") from None
    names = [n for n, _ in model.named_parameters()]
    missing = [n for n in names if n not in ostate["m"] or n not in ostate["v"]]
    if missing:
        raise CheckpointError(f"checkpoint {path}: the optimizer state lacks {missing[:3]}")
    opt.step_count = ostate["step"]
    for n, m, v in zip(names, opt.m, opt.v):
        m[...], v[...] = model.shard(n, ostate["m"][n]), model.shard(n, ostate["v"][n])
    if isinstance(opt, mixed_precision.MixedPrecisionAdamW):         # model.npz holds the fp32 master weights
        opt.load_master([model.shard(n, state[n]) for n in names])


def summary(directory: str, step: int, *, world: int, zero: int, grad_ranks: int, cp: int,
            replicas: int = 1) -> tuple[None, list[str]]:
    """The summary's checkpoint line (no figures): where the run's last checkpoint went and
    who wrote its optimizer shards (save_run: every rank with ZeRO, else dp rank 0, and cp
    rank 0, of each (tp, pp); grad_ranks: dp x cp; replicas: hybrid ZeRO's R, whose later
    replicas write empty shards)."""
    writers = world if zero else world // grad_ranks
    who = ("one process" if world == 1 else
           f"every rank, the {world // replicas} of the first shard group(s) holding the state (the other "
           f"replicas' shards are empty)" if replicas > 1 else "every rank" if writers == world
           else "dp rank 0 of each (tp, pp)" if cp == 1 else "dp rank 0, cp rank 0 of each (tp, pp)")
    return None, [f"  checkpoint: {directory} (step {step}): model.npz and "
                  f"{writers} optimizer shard(s) in "
                  f"{directory}/optim, written by {who}"]
