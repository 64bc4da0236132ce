"""The traffic ledger: what this process sent and received, per operation and per group axis.

Every message is counted in a per-process ledger twice: under the name of the top-level
call (`traffic()`: all_reduce, send, ...) and under the axis of the group it was sent on
(`traffic_by_axis()`: "dp", "tp", "pp", "zero", "world", None for an untagged group);
`reset_traffic()` clears both. Each call's counts go to both, so for every field
(calls, bytes_sent, bytes_recv) the axes sum to the same total as the operations. The axis
is a label given where the group is made (`Group(comm, axis="dp")`, or `g.with_axis("zero")`
for the same group's messages under another label): the bytes of each parallelism axis
are tagged where they are sent, not guessed afterwards from operation names.

Beside them, what a mechanism counts of its own messages (`count(owner, kind, **fields)`,
read with `counts(owner)`, cleared with `reset_counts(owner)`): tensor parallelism's calls,
elements and bytes by kind (f, g, cross_entropy, grad_norm), ring attention's seconds
waited. `with window() as w:` reads all of it over a block of code: what was sent inside
it, by axis, up to a mark, and how much a count grew (a training step's row).
"""
from minipar import trace as _trace

# The ledger: {key: {"calls", "bytes_sent", "bytes_recv", "seconds"}} for this process, kept
# twice: by top-level operation and by the axis of the group (Group.axis). Every finished
# call adds its counts to one entry of each, so the two always have the same totals.

_LEDGER = {}        # op -> [calls, bytes_sent, bytes_recv, seconds, bytes_sent_inter, bytes_recv_inter]
_AXES = {}          # axis -> the same fields: the same calls, by axis
_FIELDS = ("calls", "bytes_sent", "bytes_recv", "seconds", "bytes_sent_inter", "bytes_recv_inter")
_COUNTS = {}        # (owner, kind) -> {field: total}: a mechanism's own counts (count())


def traffic():
    """What this process sent and received, per top-level operation (a copy)."""
    return {name: dict(zip(_FIELDS, entry)) for name, entry in _LEDGER.items()}


def traffic_by_axis():
    """What this process sent and received, per axis of the group it went through (a copy):
    {axis: {"calls", "bytes_sent", "bytes_recv", "seconds"}}; axis None for untagged groups."""
    return {axis: dict(zip(_FIELDS, entry)) for axis, entry in _AXES.items()}


def reset_traffic():
    """Clear the ledger: by operation and by axis."""
    _LEDGER.clear()
    _AXES.clear()


class untracked:
    """with comm.untracked(): ... -> messages sent inside are left out of the ledger (and
    of a --trace): the trace's own clock ping-pong and gathering (minipar/trace/__init__.py)."""

    def __enter__(self):
        self.saved = ({k: list(v) for k, v in _LEDGER.items()}, {k: list(v) for k, v in _AXES.items()},
                      {k: dict(v) for k, v in _COUNTS.items()})
        self.rec = _trace.install(None)

    def __exit__(self, *exc):
        for ledger, saved in zip((_LEDGER, _AXES, _COUNTS), self.saved):
            ledger.clear()
            ledger.update(saved)
        _trace.install(self.rec)


def account(name, axis, sent, recvd, seconds, sent_inter, recvd_inter):
    """One finished call, added to both ledgers: under its operation and under its axis."""
    for ledger, key in ((_LEDGER, name), (_AXES, axis)):
        e = ledger.get(key)
        if e is None:
            ledger[key] = [1, sent, recvd, seconds, sent_inter, recvd_inter]
        else:
            e[0] += 1
            e[1] += sent
            e[2] += recvd
            e[3] += seconds
            e[4] += sent_inter
            e[5] += recvd_inter



def count(owner: str, kind: str, **fields):
    """Add `fields` ({name: number}) to the counts of `owner` (a mechanism: "tp", "ring")
    under `kind`: what the mechanism counts of its own messages, beside the ledger."""
    e = _COUNTS.setdefault((owner, kind), {})
    for name, n in fields.items():
        e[name] = e.get(name, 0) + n


def counts(owner: str) -> dict:
    """{kind: {field: total}} that `owner` has counted in this process (a copy)."""
    return {kind: dict(v) for (o, kind), v in _COUNTS.items() if o == owner}


def reset_counts(owner: str):
    """Clear the counts of `owner`."""
    for key in [k for k in _COUNTS if k[0] == owner]:
        del _COUNTS[key]


def _now() -> tuple:
    """The ledger as a window reads it: bytes sent in all, and by axis, in all and across
    hosts; every count's totals."""
    return (sum(e[1] for e in _LEDGER.values()), {axis: e[1] for axis, e in _AXES.items()},
            {axis: e[4] for axis, e in _AXES.items()}, {k: dict(v) for k, v in _COUNTS.items()})


def _grown(start: dict, end: dict) -> dict:
    """{axis: end - start}, in the order of `end` (the ledger's), zeros kept."""
    return {axis: n - start.get(axis, 0) for axis, n in end.items()}


class window:
    """with comm.window() as w: ... -> what this process sent inside the block, read after it:
        w.sent                  bytes sent in all
        w.sent_by_axis          {axis: bytes sent} (every axis of the ledger, zeros too)
        w.inter_host_by_axis    the same, of the bytes that left the host
        w.mark(name)            inside the block: remember the ledger now; then
        w.sent_until(name)      {axis: bytes sent} from the start of the block up to the mark
        w.counted(owner, field) how much `field` of owner's counts (count()) grew
        w.counted_kind(owner, kind, field)  the same, of one kind of owner's counts
    """

    def __enter__(self):
        self._start, self._marks = _now(), {}
        return self

    def mark(self, name: str):
        self._marks[name] = _now()

    def __exit__(self, *exc):
        self._end = _now()

    @property
    def sent(self) -> int:
        return self._end[0] - self._start[0]

    @property
    def sent_by_axis(self) -> dict:
        return _grown(self._start[1], self._end[1])

    @property
    def inter_host_by_axis(self) -> dict:
        return _grown(self._start[2], self._end[2])

    def sent_until(self, name: str) -> dict:
        return _grown(self._start[1], self._marks[name][1])

    def counted(self, owner: str, field: str):
        def total(snapshot):
            return sum(v.get(field, 0) for (o, _), v in snapshot[3].items() if o == owner)
        return total(self._end) - total(self._start)

    def counted_kind(self, owner: str, kind: str, field: str):
        """How much `field` of owner's counts of one kind grew."""
        def total(snapshot):
            return snapshot[3].get((owner, kind), {}).get(field, 0)
        return total(self._end) - total(self._start)


def human_bytes(n: float) -> str:
    """n bytes as people read them: "512 B", "1.67 MiB" (the summary's and the planner's lines)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
