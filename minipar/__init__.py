"""minipar: a from-scratch NumPy + MPI reference implementation of LLM distributed training.

The packages, in the order a reader meets them (each __init__.py says what it holds and in
which order to read it; docs/design.md §2 lists every module):

    trace/      the recorder every layer reports spans and messages to (off by default)
    autograd/   Tensor, the ops, dtypes, split backward (B/W), recomputation
    comm/       collectives written on point-to-point messages; algorithms/ holds one per file
    optim/      AdamW, clipping, the learning-rate schedule, mixed precision
    model/      the single-process models: GPT-2 and its mixture of experts
    parallel/   the grid and each way of splitting the work: data, zero/, tensor/, pipeline/,
                context/, expert/
    config/     the trainer's flags and their checks; the files a run may write
    plan/       every figure a layout implies, by formula (python -m minipar.plan)
    show/       a trace written and read back; ASCII and SVG drawings
    train/      set-up, the loop, checkpoints, --verify, the summary (python -m minipar.train)
    convert/    Hugging Face checkpoints, both ways (python -m minipar.convert)
    explain/    each mechanism drawn from a real run (python -m minipar.explain)
    plot/       curves and timelines of finished runs (python -m minipar.plot)

Kept import paths: minipar.tensor and minipar.ops name autograd/tensor.py and autograd/ops.py.
"""
import sys

from minipar.autograd import ops, tensor

sys.modules[__name__ + ".tensor"] = tensor
sys.modules[__name__ + ".ops"] = ops

__version__ = "0.1.0"
