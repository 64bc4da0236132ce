"""Lab 20 answered by minipar's own code (python -m labs.grade 20 --solution): the head lists
and the two all-to-alls of minipar/parallel/context/ulysses.py behind the lab's signatures.
They are called directly, not through the module's names, which the lab's seam replaces."""
from minipar.parallel.context import ulysses

_heads_of, _to_heads, _to_tokens = ulysses.heads_of, ulysses.to_heads, ulysses.to_tokens


def heads_of(j, H, Hkv, C):
    try:
        return [int(h) for h in _heads_of(j, H, Hkv, C)]
    except ValueError as e:         # the trainer adds the flags' values to head_split's line; so here
        raise ValueError(f"{e} (H={H}, Hkv={Hkv}, C={C})") from None


def to_heads(g, x, heads):
    return _to_heads(g, x, heads)


def to_tokens(g, y, heads, n):
    return _to_tokens(g, y, heads, n)
