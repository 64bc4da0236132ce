# hostile: lab 13's functions defined in the file, each handing back minipar's own ring attention
# lab: 13
# scan: import from minipar.parallel.context: not a module this lab's handout gives
# sandbox: minipar's own minipar.parallel.context.ring_attention.positions was called
from minipar.parallel.context import ring_attention as ra


def positions(rank, C, T, layout="zigzag"):
    return ra.positions(rank, C, T, layout)


def block_attention(q, k, v, mask=None):
    return ra.partial_attention(q, k, v, mask)


def merge(o1, lse1, o2, lse2):
    return ra.merge(o1, lse1, o2, lse2)


def plan(rank, owner, C, layout="zigzag"):
    grid = [["skip", "skip"], ["skip", "skip"]]
    for a, b, mask in ra.sub_blocks(ra.positions(rank, C, 4 * C, layout), ra.positions(owner, C, 4 * C, layout)):
        grid[a.start // 2][b.start // 2] = "full" if mask is None else "diagonal"
    return grid


def ring_attention(g, q, k, v, layout="zigzag"):
    f = ra.RingAttention()
    o = f.forward(q, k, v, g, layout)
    return o, f.saved[-1]
