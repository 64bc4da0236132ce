"""minipar: a from-scratch NumPy + MPI reference implementation of LLM distributed training."""

__version__ = "0.1.0"
