# hostile: lab 20's functions defined in the file, each handing back minipar's own Ulysses
# lab: 20
# scan: import from minipar.parallel.context: not a module this lab's handout gives
# sandbox: minipar's own minipar.parallel.context.ulysses.heads_of
from minipar.parallel.context import ulysses


def heads_of(j, H, Hkv, C):
    return [int(h) for h in ulysses.heads_of(j, H, Hkv, C)]


def to_heads(g, x, heads):
    return ulysses.to_heads(g, x, heads)


def to_tokens(g, y, heads, n):
    return ulysses.to_tokens(g, y, heads, n)
