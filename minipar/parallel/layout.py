"""The layout of a run as one record (Layout): how many ranks along each axis (dp, cp, tp, pp,
and ep inside dp) and the flags that decide what each of them holds and sends (ZeRO stage,
micro-batches, batch, precision, schedule, ...). The trainer's set-up, the process grid and
the planner all read the same record; nothing changes it after it is made (`but` makes a
copy with some values changed).

`check_layout` validates the sizes against the world size without any communication, so
that every rank can reject a bad layout before the first message.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class LayoutError(ValueError):
    """A layout that cannot run: the message names the numbers."""


def check_layout(world: int, dp: int | None, tp: int, pp: int, cp: int = 1) -> tuple[int, int, int]:
    """-> (dp, tp, pp). Unset dp is world / (cp * tp * pp). Raises LayoutError, no
    communication."""
    for name, v in (("tp", tp), ("pp", pp), ("cp", cp)) + ((("dp", dp),) if dp is not None else ()):
        if v < 1:
            raise LayoutError(f"--{name} must be >= 1, got {v}")
    names, sizes = ("cp*tp*pp", f"{cp}*{tp}*{pp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")   # cp once used
    if dp is None:
        if world % (cp * tp * pp):
            raise LayoutError(f"world size {world} is not divisible by {names} = {sizes} = {cp * tp * pp}")
        dp = world // (cp * tp * pp)
    if world != dp * cp * tp * pp:
        raise LayoutError(f"world size {world} != dp*{names} = {dp}*{sizes} = {dp * cp * tp * pp}")
    return dp, tp, pp


@dataclass(frozen=True)
class Layout:
    """The layout flags (dp, cp, cp_layout, cp_impl, cp_ulysses, tp, pp, ep, zero, shard_group,
    prefetch, reshard_after_forward, qwz, hpz, qgz, micro_batches,
    batch_size, precision, dtype, schedule, virtual_stages, dp_mode, bucket_mb, sp, recompute),
    each defaulting to the trainer's default (cp_ulysses: hybrid's Ulysses degree, None until
    the hosts give it; shard_group: --zero's shard group, None flat, "host" until the hosts give
    it); rows = B/(dp*M), the micro-batch of one device (of
    T/cp tokens each with --cp)."""

    dp: int = 1
    cp: int = 1
    cp_layout: str | None = "zigzag"
    cp_impl: str | None = "ring"
    cp_ulysses: int | None = None
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    shard_group: int | str | None = None
    prefetch: int = 0
    reshard_after_forward: bool = True
    qwz: int = 0
    hpz: bool = False
    qgz: int = 0
    micro_batches: int = 1
    batch_size: int = 16
    precision: str = "fp32"
    dtype: str = "float32"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    dp_mode: str | None = "bucketed"
    bucket_mb: float | None = 1.0
    sp: bool = False
    recompute: str = "none"

    @classmethod
    def from_flags(cls, args, **changes) -> Layout:
        """The record of parsed flags (the trainer's or the planner's), with `changes` (dp=...,
        the resolved data-parallel size, when --dp was left unset) over them. A flag a tool does
        not have (the planner's parser lacks a few of the trainer's) takes the trainer's default."""
        return cls(**{**{f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(cls)}, **changes})

    @property
    def rows(self) -> int:
        return self.batch_size // (self.dp * self.micro_batches)

    @property
    def grad_ranks(self) -> int:
        """Ranks that sum each gradient (and ZeRO shards over): dp*cp."""
        return self.dp * self.cp

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def but(self, **changes) -> Layout:
        """A copy with some flags changed."""
        return dataclasses.replace(self, **changes)

    def check(self, world: int):
        """Raises LayoutError unless the layout fills `world` ranks (check_layout) and ep
        divides dp; no communication."""
        check_layout(world, self.dp, self.tp, self.pp, self.cp)
        if self.ep < 1 or self.dp % self.ep:
            raise LayoutError(f"--ep {self.ep} must divide dp = {self.dp}: expert groups are carved out of "
                              f"the dp group")
