"""Lab 04 answered by minipar's own code (python -m labs.grade 04 --solution): the two classes
of minipar/parallel/data_parallel.py behind the lab's signatures. The one adaptation: the
trainer never freezes a parameter, so minipar's classes take every parameter they are given;
here they are given only those that require grad, as the lab's contract asks."""
from minipar.parallel import data_parallel


class DataParallelNaive(data_parallel.DataParallelNaive):

    def __init__(self, params, group):
        super().__init__([p for p in params if p.requires_grad], group)


class DataParallelBucketed(data_parallel.DataParallelBucketed):

    def __init__(self, params, group, bucket_mb=1.0):
        super().__init__([p for p in params if p.requires_grad], group, bucket_mb)
