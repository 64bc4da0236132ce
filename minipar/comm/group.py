"""Group: the ranks that talk to each other, on a communicator of minipar's own.

- `Group(mpi_comm)` wraps a communicator (world or a sub-group, any size, 1 included). It
  duplicates it, so minipar's messages can never be confused with anyone else's.
- `MINIPAR_DEBUG=1`: before each collective the ranks all-gather a short description of the
  call (operation, dtype, shape, root, op, call number) and every rank raises
  `CollectiveMismatch` listing what each rank called if they differ.
"""
import os
import socket

import numpy as np
from mpi4py import MPI

from minipar.comm.calls import Call
from minipar.comm.errors import CollectiveMismatch, abort_on_error
from minipar.comm.protocol import HOST_BYTES, TAG_CYCLE, TAG_DEBUG, TAG_TOPOLOGY


def _env_flag(name):
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


class Group:
    """A set of ranks that talk to each other: wraps (a duplicate of) an mpi4py communicator.

    g.rank, g.size    this process's rank in the group, and the group size
    g.comm            the duplicated communicator (safe to use for MPI's own calls in tests)
    g.world_ranks     world rank of each group rank (what the trace prints)
    g.axis            the ledger category of its messages (traffic_by_axis): the parallelism
                      axis, "dp", "tp", "pp" (ProcessGrid's groups), "world"...; None: untagged
    g.with_axis(a)    the same group, its messages counted under axis a (see with_axis)
    g.nodes           the host of each group rank, numbered 0, 1, ... in order of first
                      appearance; g.node, g.n_nodes; g.local_ranks (the group ranks on this
                      rank's host) and g.local_rank (this rank's index among them)
    debug, trace, timeout default to MINIPAR_DEBUG, MINIPAR_TRACE, MINIPAR_COMM_TIMEOUT;
    host (the name this rank reports) to MINIPAR_HOST, else socket.gethostname().

    Which ranks share a host is learnt when the group is made: the ranks pass their host
    names round a ring (p-1 steps of HOST_BYTES; set-up, like the communicator's Dup, so not
    in the ledger). Every message is then also counted as inter-host or not (the ledger's
    bytes_sent_inter, bytes_recv_inter), and a group that spans hosts uses the hierarchical
    algorithms (hierarchical.py) for large messages.
    """

    def __init__(self, comm, *, axis=None, debug=None, trace=None, timeout=None, host=None):
        self.comm = comm.Dup()          # a message space of our own (creating one is allowed)
        self.axis = axis
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        mine, world = self.comm.Get_group(), MPI.COMM_WORLD.Get_group()
        ranks = mine.Translate_ranks(list(range(self.size)), world)
        mine.Free()
        world.Free()
        self.world_ranks = [w if w != MPI.UNDEFINED else r for r, w in enumerate(ranks)]
        self.debug = _env_flag("MINIPAR_DEBUG") if debug is None else bool(debug)
        self.trace = _env_flag("MINIPAR_TRACE") if trace is None else bool(trace)
        self.timeout = float(os.environ.get("MINIPAR_COMM_TIMEOUT", "600")) if timeout is None \
            else float(timeout)
        self.calls = 0                  # collective calls so far: tag and debug call number
        self._scratch = [None, None]    # receive buffers reused by blocking calls: scratch()
        self._views = {}                # (slot, shape, dtype) -> view of a scratch buffer
        self.receiving = set()          # sources with a recv_async in flight (one at a time)
        if MPI.COMM_WORLD.Get_size() > 1:
            abort_on_error()
        self.host = host or os.environ.get("MINIPAR_HOST") or socket.gethostname()
        self.remote = (False,) * self.size           # until the hosts are known
        self.set_nodes(_exchange_hosts(self))

    @classmethod
    def split(cls, comm, color: int, key: int, **kw) -> "Group":
        """Group(comm.Split(color, key)), the split communicator freed once the Group has its
        own duplicate (a process may hold only so many: MPICH's 2048)."""
        sub = comm.Split(color=color, key=key)
        try:
            return cls(sub, **kw)
        finally:
            sub.Free()

    def set_nodes(self, hosts):
        """The topology from every group rank's host name (in group order)."""
        first = {}
        self.nodes = tuple(first.setdefault(h, len(first)) for h in hosts)
        self.hosts = tuple(first)                       # the host names, by node number
        self.n_nodes = len(first)
        self.node = self.nodes[self.rank]
        self.local_ranks = tuple(q for q, n in enumerate(self.nodes) if n == self.node)
        self.local_rank = self.local_ranks.index(self.rank)
        self.remote = tuple(n != self.node for n in self.nodes)    # is group rank q on another host?

    def with_axis(self, axis):
        """This group with its messages counted under `axis` in the ledger: a view (AxisView)
        that shares everything else with g (communicator, call counter and hence tags,
        scratch buffers, pending receives, debug/trace/timeout), so calls on the view and on
        g interleave like calls on g alone. E.g. ZeRO talks on the dp group's ranks but is
        counted apart:

            zero_group = grid.dp_group.with_axis("zero")
        """
        return AxisView(self, axis)

    def __repr__(self):
        axis = "" if self.axis is None else f"axis={self.axis!r}, "
        return f"Group({axis}rank={self.rank}, size={self.size}, world_ranks={self.world_ranks})"

    def begin(self, name, nsteps, describe=None, algorithm=None):
        """Start collective call `name`: a fresh Call, after the debug agreement if enabled.

        describe: a string of everything the ranks must agree on (dtype, shape, op, root...).
        algorithm: its name in a --trace ("ring", "recursive doubling", ...).
        """
        self.calls += 1
        if self.debug and self.size > 1:
            _agree(self, f"{name}({describe or ''})")
        return Call(self, name, nsteps, self.calls % TAG_CYCLE, algorithm)

    def scratch(self, slot, shape, dtype):
        """Buffer `slot` (0 or 1) viewed as an array of `shape` and `dtype`, reused from call to
        call: what blocking collectives receive into before reducing.

        A fresh np.empty per call is cheap for small messages but, for large ones, is
        page-faulted in again on every call once it is above glibc's mmap threshold (e.g. the
        64 MiB receive buffer of a reduce-scatter of 64 MiB): about a tenth of the call. Each
        slot grows to the largest size asked for and is kept for the life of the Group (its
        axis views use the same). Only blocking calls use it (one at a time); a Handle's
        buffers are its own, since several may be in flight at once.
        """
        key = (slot, shape, dtype)
        view = self._views.get(key)             # the same shapes come back call after call
        if view is None:
            dtype = np.dtype(dtype)
            n = dtype.itemsize
            for d in shape:
                n *= d
            buf = self._scratch[slot]
            if buf is None or buf.nbytes < n:
                buf = self._scratch[slot] = np.empty(max(n, 64), np.uint8)
                self._views.clear()             # views of the old, smaller buffer
            if len(self._views) > 64:
                self._views.clear()
            view = self._views[key] = buf[:n].view(dtype).reshape(shape)
        return view


class AxisView(Group):
    """Group.with_axis(axis): a group under another axis label. Its own attributes are `axis`
    and `group` (the Group it views); every other attribute is read from and written to that
    group, so both use one communicator, one call counter (collective tags never collide),
    the same scratch buffers, pending receives and settings. The methods are Group's, so a
    call started on the view is a Call of the view and counted under its axis.

    Plain Groups pay nothing for the forwarding (__getattr__): it runs on views only.
    """

    def __init__(self, group, axis):
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "axis", axis)

    def __getattr__(self, name):                # only for names the view does not have
        if name == "group":                     # not set yet (copy.copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.group, name)

    def __setattr__(self, name, value):         # e.g. g.calls += 1 in begin(): the group's
        if name == "axis":
            object.__setattr__(self, name, value)
        else:
            setattr(self.group, name, value)

    def with_axis(self, axis):
        return AxisView(self.group, axis)


def _exchange_hosts(g):
    """Every group rank's host name, in group order: a ring all-gather of HOST_BYTES each on
    g's communicator, polled like every wait (a Call never done(): not in the ledger)."""
    p, r = g.size, g.rank
    table = np.zeros((p, HOST_BYTES), np.uint8)
    raw = g.host.encode()[:HOST_BYTES]
    table[r, :len(raw)] = np.frombuffer(raw, np.uint8)
    if p > 1:
        call = Call(g, "topology", p - 1, TAG_TOPOLOGY)
        right, left = (r + 1) % p, (r - 1) % p
        for s in range(p - 1):
            call.wait(call.sendrecv(s + 1, table[(r - s) % p], right, table[(r - s - 1) % p], left))
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in table]


# --------------------------------------------------------------------------------------------
# MINIPAR_DEBUG: agree on the call before making it.

_DESC_BYTES = 256


def _agree(g, what):
    """All-gather every rank's description of the call (a ring, p-1 steps of 256 B) and
    raise on every rank if they differ. Counted in the ledger as "debug_check"."""
    text = f"call #{g.calls}: {what}"
    mine = np.zeros(_DESC_BYTES, np.uint8)
    raw = text.encode()[:_DESC_BYTES]
    mine[:len(raw)] = np.frombuffer(raw, np.uint8)
    p, r = g.size, g.rank
    table = np.empty((p, _DESC_BYTES), np.uint8)
    table[r] = mine
    call = Call(g, "debug_check", p - 1, TAG_DEBUG, "ring")
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):                      # ring all-gather: pass along what came in
        reqs = call.sendrecv(s + 1, table[(r - s) % p], right, table[(r - s - 1) % p], left)
        call.wait(reqs)
    call.done()
    texts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in table]
    if len(set(texts)) > 1:
        w = g.world_ranks
        lines = "\n".join(f"  rank {i} (world {w[i]}): {t}" for i, t in enumerate(texts))
        raise CollectiveMismatch(
            f"MINIPAR_DEBUG: the {p} ranks of group {w} disagree on collective call "
            f"#{g.calls}:\n{lines}")

