"""Point-to-point messages that carry their dtype and shape.

`send(g, x, dst)` / `recv(g, src)` carry dtype and shape in a 128-byte header message
followed by the payload message; both are counted in the ledger. `send_async` and
`recv_async` post the same messages and return a Handle (a pipeline's sends must not block).
"""
import numpy as np

from minipar.comm.calls import Call, Handle
from minipar.comm.errors import CommError
from minipar.comm.helpers import check_rank, flat
from minipar.comm.protocol import HEADER_BYTES, TAG_P2P, decode_header, encode_header


def send(g, x, dst, tag=TAG_P2P):
    """Send array x (any dtype and shape) to group rank dst; returns when x may be reused.
    tag: messages between two ranks arrive in order per tag (TAG_P2P, TAG_P2P_GRAD)."""
    dst = check_rank(g, dst, "dst")
    if dst == g.rank:
        raise ValueError(f"rank {g.rank} cannot send to itself")
    x = np.asarray(x)
    header, payload = encode_header(x), flat(x)
    call = Call(g, "send", 2, tag, "point-to-point")
    call.wait(call.isend(1, header, dst) + call.isend(2, payload, dst))
    call.done()


def recv(g, src, tag=TAG_P2P):
    """Receive the next array group rank src sent with send() (with the same tag)."""
    src = check_rank(g, src, "src")
    if src == g.rank:
        raise ValueError(f"rank {g.rank} cannot receive from itself")
    _check_not_receiving(g, src)
    call = Call(g, "recv", 2, tag, "point-to-point")
    header = np.empty(HEADER_BYTES, np.uint8)
    call.wait(call.irecv(1, header, src))
    dtype, shape = decode_header(header)
    out = np.empty(shape, dtype)
    call.wait(call.irecv(2, out.reshape(-1), src))
    call.done()
    return out


# Non-blocking point-to-point: the same two messages, posted at once and finished later.
# A pipeline needs them: in 1F1B's steady state neighbouring stages send to each other at
# the same moment (activation down, gradient up), and two blocking sends of large arrays
# (rendezvous) wait for each other forever. Messages between two ranks of a group arrive in
# the order they were posted, so send_async/recv_async mix freely with send/recv.

def _send_steps(call, header, payload, dst):
    yield call.isend(1, header, dst) + call.isend(2, payload, dst)


def send_async(g, x, dst, tag=TAG_P2P):
    """Start sending array x to group rank dst; returns a Handle (wait() returns None).
    Counted and traced as "send". Leave x alone until the handle is done: its memory is
    on the wire until then."""
    dst = check_rank(g, dst, "dst")
    if dst == g.rank:
        raise ValueError(f"rank {g.rank} cannot send to itself")
    x = np.asarray(x)
    header = encode_header(x)
    payload = flat(x)
    return _p2p_handle(g, "send", lambda call: _send_steps(call, header, payload, dst), tag)


def _recv_steps(call, src):
    try:
        header = np.empty(HEADER_BYTES, np.uint8)
        yield call.irecv(1, header, src)
        dtype, shape = decode_header(header)
        out = np.empty(shape, dtype)
        yield call.irecv(2, out.reshape(-1), src)
    finally:
        call.g.receiving.discard(src)
    return out


def _check_not_receiving(g, src):
    if src in g.receiving:
        raise CommError(f"rank {g.world_ranks[g.rank]}: a recv_async from rank {g.world_ranks[src]} "
                        f"is still pending; finish it first (its payload receive is posted only "
                        f"once its header has arrived, so a second receive would take that payload)")


def recv_async(g, src):
    """Start receiving the next array group rank src sends; returns a Handle whose wait()
    returns the new array. Counted as "recv". One at a time per source: until it is done,
    another recv or recv_async from src raises CommError."""
    src = check_rank(g, src, "src")
    if src == g.rank:
        raise ValueError(f"rank {g.rank} cannot receive from itself")
    _check_not_receiving(g, src)
    g.receiving.add(src)
    return _p2p_handle(g, "recv", lambda call: _recv_steps(call, src))


def _p2p_handle(g, name, steps, tag=TAG_P2P):
    call = Call(g, name, 2, tag, "point-to-point")
    return Handle(call, steps(call))
