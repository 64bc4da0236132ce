"""The optimizer and what it needs. Read in this order:

    adamw.py            AdamW's update (PyTorch's arithmetic), gradient norm and clipping,
                        the learning-rate schedule
    mixed_precision.py  fp16/bf16 training: fp32 master weights, dynamic loss scaling
"""
from minipar.optim.adamw import (AdamW, adamw_update, clip_coef, clip_grad_norm, grad_norm, lr_at,
                                 sum_of_squares)

__all__ = ["AdamW", "adamw_update", "clip_coef", "clip_grad_norm", "grad_norm", "lr_at", "sum_of_squares"]
