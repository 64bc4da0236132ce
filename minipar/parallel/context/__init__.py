"""Context parallelism: the sequence split over ranks.

    ring_attention.py   K and V passed around a ring, with the causal skip and the zig-zag split
    ulysses.py          all-to-alls from sequence shards to head shards and back (--cp-impl ulysses)
    allgather_attention.py  K and V gathered whole, their gradients reduce-scattered (--cp-impl allgather)
    packed.py           the ring's and the all-gather's attention on the packed projection
    context_parallel.py the model's attention and positions on a rank's share of the sequence
"""
