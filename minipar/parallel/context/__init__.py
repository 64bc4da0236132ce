"""Context parallelism: the sequence split over ranks.

    ring_attention.py   K and V passed around a ring, with the causal skip and the zig-zag split
    context_parallel.py the model's attention and positions on a rank's share of the sequence
"""
