"""Lab 13 answered by minipar's own code (python -m labs.grade 13 --solution):
minipar/parallel/context/ring_attention.py behind the lab's signatures. Its ring talks with
comm.send_async/recv_async (a header message beside each payload), not one Call: the bytes
criterion counts the payload (lab.py says how)."""
from minipar.parallel.context import ring_attention as ra


def positions(rank, C, T, layout="zigzag"):
    return ra.positions(rank, C, T, layout)


def block_attention(q, k, v, mask=None):
    return ra.partial_attention(q, k, v, mask)


def merge(o1, lse1, o2, lse2):
    return ra.merge(o1, lse1, o2, lse2)


def plan(rank, owner, C, layout="zigzag"):
    T = 4 * C                      # two tokens a chunk (one would need no mask on the diagonal)
    grid = [["skip", "skip"], ["skip", "skip"]]
    for a, b, mask in ra.sub_blocks(ra.positions(rank, C, T, layout), ra.positions(owner, C, T, layout)):
        grid[a.start // 2][b.start // 2] = "full" if mask is None else "diagonal"
    return grid


def ring_attention(g, q, k, v, layout="zigzag"):
    f = ra.RingAttention()
    o = f.forward(q, k, v, g, layout)
    return o, f.saved[-1]
