"""The single-process models, which know nothing of how they are split. Read in this order:

    config.py           GPTConfig: the shape of a model of either family (arch), and how
                        every parameter is drawn (init_param)
    family.py           Family: what the rest of minipar may ask of a model family (its
                        names, where each sits, how tensor parallelism cuts it, the forward)
    gpt.py              GPT-2's family: the canonical names and shapes, the block top to
                        bottom, its FLOPs per token; and GPT, the single-process model of
                        either family
    llama.py            the Llama family: RMSNorm, rotary positions, grouped-query
                        attention, SwiGLU, no biases
    families.py         the families by arch
    moe.py              a mixture-of-experts MLP: router, top-k, capacity, the Switch
                        load-balancing loss
    contract.py         what every layout of the model offers the trainer (Model)

The parallel mechanisms (minipar/parallel) take these apart and put them back together.
"""
from minipar.model.gpt import GPT, GPTConfig, init_param, param_specs, train_flops_per_token

__all__ = ["GPT", "GPTConfig", "init_param", "param_specs", "train_flops_per_token"]
