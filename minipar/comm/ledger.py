"""The traffic ledger: what this process sent and received, per operation and per group axis.

Every message is counted in a per-process ledger twice: under the name of the top-level
call (`traffic()`: all_reduce, send, ...) and under the axis of the group it was sent on
(`traffic_by_axis()`: "dp", "tp", "pp", "zero", "world", None for an untagged group);
`reset_traffic()` clears both. Each call's counts go to both, so for every field
(calls, bytes_sent, bytes_recv) the axes sum to the same total as the operations. The axis
is a label given where the group is made (`Group(comm, axis="dp")`, or `g.with_axis("zero")`
for the same group's messages under another label): the bytes of each parallelism axis
are tagged where they are sent, not guessed afterwards from operation names.
"""
from minipar import trace as _trace

# The ledger: {key: {"calls", "bytes_sent", "bytes_recv", "seconds"}} for this process, kept
# twice: by top-level operation and by the axis of the group (Group.axis). Every finished
# call adds its counts to one entry of each, so the two always have the same totals.

_LEDGER = {}        # op -> [calls, bytes_sent, bytes_recv, seconds, bytes_sent_inter, bytes_recv_inter]
_AXES = {}          # axis -> the same fields: the same calls, by axis
_FIELDS = ("calls", "bytes_sent", "bytes_recv", "seconds", "bytes_sent_inter", "bytes_recv_inter")


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
        self.saved = ({k: list(v) for k, v in _LEDGER.items()}, {k: list(v) for k, v in _AXES.items()})
        self.rec, _trace.RECORDER = _trace.RECORDER, None

    def __exit__(self, *exc):
        for ledger, saved in zip((_LEDGER, _AXES), self.saved):
            ledger.clear()
            ledger.update(saved)
        _trace.RECORDER = self.rec


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

