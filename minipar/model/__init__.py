"""The single-process models, which know nothing of how they are split. Read in this order:

    gpt.py              GPT-2: GPTConfig, the canonical parameter names and shapes
                        (param_specs), the model top to bottom, its FLOPs per token
    moe.py              a mixture-of-experts MLP: router, top-k, capacity, the Switch
                        load-balancing loss
    contract.py         what every layout of the model offers the trainer (Model)

The parallel mechanisms (minipar/parallel) take these apart and put them back together.
"""
from minipar.model.gpt import GPT, GPTConfig, init_param, param_specs, train_flops_per_token

__all__ = ["GPT", "GPTConfig", "init_param", "param_specs", "train_flops_per_token"]
