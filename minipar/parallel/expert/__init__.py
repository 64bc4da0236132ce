"""Expert parallelism: experts spread over ranks, tokens sent by all-to-all.

    expert_parallel.py  placement, dispatch and combine, the bytes
"""
