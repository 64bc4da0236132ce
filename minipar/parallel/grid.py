"""The process grid: world = dp x tp x pp ranks, and one communicator per axis.

Rank order (docs/design.md §6): tp varies fastest, then dp, then pp,

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so tensor-parallel partners, which talk on every layer, are neighbouring ranks (on one
node in a real cluster), and pipeline stages, which talk least, are farthest apart.
Example, dp=2 tp=2 pp=2 (8 ranks):

    pp stage 0:  dp 0 -> ranks 0 1 (tp)   dp 1 -> ranks 2 3
    pp stage 1:  dp 0 -> ranks 4 5        dp 1 -> ranks 6 7
    dp groups: {0,2} {1,3} {4,6} {5,7}     pp groups: {0,4} {1,5} {2,6} {3,7}

`check_layout` validates a layout without any communication, so that every rank can
reject a bad one before the first message. `ProcessGrid` then builds the three groups
with Comm.Split (creating communicators is not a collective *operation* on data), each
tagged with its axis ("tp", "dp", "pp"; the whole world "world") so that minipar.comm's
ledger counts each axis's bytes where they are sent (comm.traffic_by_axis()).
"""
from __future__ import annotations

from dataclasses import dataclass

from minipar.comm import Group


class LayoutError(ValueError):
    """A layout that cannot run: the message names the numbers."""


def check_layout(world: int, dp: int | None, tp: int, pp: int) -> tuple[int, int, int]:
    """-> (dp, tp, pp). Unset dp is world / (tp * pp). Raises LayoutError, no communication."""
    for name, v in (("tp", tp), ("pp", pp)) + ((("dp", dp),) if dp is not None else ()):
        if v < 1:
            raise LayoutError(f"--{name} must be >= 1, got {v}")
    if dp is None:
        if world % (tp * pp):
            raise LayoutError(f"world size {world} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}")
        dp = world // (tp * pp)
    if world != dp * tp * pp:
        raise LayoutError(f"world size {world} != dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp}")
    return dp, tp, pp


@dataclass(frozen=True)
class Coords:
    dp: int
    tp: int
    pp: int


class ProcessGrid:
    """This rank's place in the dp x tp x pp grid, and its groups: tp_group, dp_group,
    pp_group (and world), tagged with their axis for the traffic ledger."""

    def __init__(self, comm, dp: int, tp: int = 1, pp: int = 1):
        world = comm.Get_size()
        check_layout(world, dp, tp, pp)
        self.comm, self.rank, self.world_size = comm, comm.Get_rank(), world
        self.dp_size, self.tp_size, self.pp_size = dp, tp, pp
        r = self.rank
        self.tp_rank = r % tp
        self.dp_rank = (r // tp) % dp
        self.pp_rank = r // (dp * tp)
        # Split: same color -> same group; key orders ranks inside it
        tp_comm = comm.Split(color=self.pp_rank * dp + self.dp_rank, key=self.tp_rank)
        dp_comm = comm.Split(color=self.pp_rank * tp + self.tp_rank, key=self.dp_rank)
        pp_comm = comm.Split(color=self.dp_rank * tp + self.tp_rank, key=self.pp_rank)
        self.tp_group = Group(tp_comm, axis="tp")
        self.dp_group = Group(dp_comm, axis="dp")
        self.pp_group = Group(pp_comm, axis="pp")
        self.world = Group(comm, axis="world")

    def rank_of(self, dp_rank: int, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.dp_size * self.tp_size + dp_rank * self.tp_size + tp_rank

    @property
    def coords(self) -> Coords:
        return Coords(self.dp_rank, self.tp_rank, self.pp_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        return f"dp={self.dp_size} tp={self.tp_size} pp={self.pp_size}"

    def __repr__(self):
        return (f"ProcessGrid(rank {self.rank}/{self.world_size}, {self.describe()}, "
                f"coords dp={self.dp_rank} tp={self.tp_rank} pp={self.pp_rank})")
