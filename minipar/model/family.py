"""A model family: what the rest of minipar may ask of GPT-2 (model/gpt.py) or Llama
(model/llama.py) without knowing which it is.

A family names its parameters (Hugging Face's names without the base model's prefix, so
GPT-2's `transformer.h.0.attn.c_attn.weight` is `h.0.attn.c_attn.weight` and Llama's
`model.layers.0.self_attn.q_proj.weight` is `layers.0.self_attn.q_proj.weight`), says where
each one sits (the embedding, a block, the end), how tensor parallelism cuts it, and computes
the three pieces of the forward that a pipeline can cut between: embed, block, final.

The forward is written once per family, against the layers a layout gives the model
(`model.split`, model/contract.py): one process's plain linear layers, or tensor or sequence
parallelism's. So a family never knows how it is split, and a layout never knows the family.
"""
from __future__ import annotations

import re

PLACES = ("embedding", "positions", "block", "final", "head")


class Family:
    """The naming and placement that every family shares; a family fills in the rest."""

    name: str                   # "gpt2", "llama": the config's arch
    embedding: str              # the token embedding (V, C), the tied head's weight
    positions: str | None       # learned position embedding (T, C), or None (rotary)
    block_word: str             # "h" or "layers": block i's names start with f"{block_word}.{i}."
    final_names: tuple          # the final norm's parameters
    head = "lm_head.weight"     # the untied head (V, C)

    moe_word: str               # a MoE block's names: f"{block}{moe_word}.{router}" and its experts'
    router_word: str            # "router" (GPT-2), "gate" (Mixtral)

    def __init__(self):
        self.block_re = re.compile(rf"{re.escape(self.block_word)}\.(\d+)\.")
        block, moe = re.escape(self.block_word), re.escape(self.moe_word)
        self.expert_re = re.compile(rf"{block}\.(\d+)\.{moe}\.experts\.(\d+)\.")

    # --- where a name sits --------------------------------------------------------------------
    def block_prefix(self, i: int) -> str:
        return f"{self.block_word}.{i}."

    def block_of(self, name: str) -> int | None:
        """Block index of a block's parameter, None for the others."""
        m = self.block_re.match(name)
        return int(m.group(1)) if m else None

    def place(self, name: str) -> str:
        """One of PLACES: what part of the model `name` belongs to."""
        if self.block_of(name) is not None:
            return "block"
        if name == self.embedding:
            return "embedding"
        if name == self.positions:
            return "positions"
        if name in self.final_names:
            return "final"
        if name == self.head:
            return "head"
        raise ValueError(f"{name!r} is not a {self.name} parameter")

    # --- a MoE block's names -----------------------------------------------------------------
    def router_name(self, i: int) -> str:
        """Block i's router weight (C, E)."""
        return f"{self.block_prefix(i)}{self.moe_word}.{self.router_word}.weight"

    def expert_prefix(self, i: int, e: int) -> str:
        return f"{self.block_prefix(i)}{self.moe_word}.experts.{e}."

    def shared_prefix(self, i: int, s: int) -> str:
        """Block i's shared expert s (DeepSeekMoE: every token goes through it)."""
        return f"{self.block_prefix(i)}{self.moe_word}.shared_experts.{s}."

    def expert_of(self, name: str) -> tuple[int, int] | None:
        """(block, expert) of a routed expert's parameter, None for every other parameter (a
        shared expert's included: every rank holds those)."""
        m = self.expert_re.match(name)
        return (int(m.group(1)), int(m.group(2))) if m else None

    def expert_specs(self, cfg, prefix: str) -> list:
        """[(name, shape, init)] of one expert's MLP under `prefix`."""
        raise NotImplementedError

    def expert_mlp(self, P: dict, prefix: str, x):
        """One expert's MLP on the rows x (M, C) routed to it."""
        raise NotImplementedError

    def moe_specs(self, cfg, i: int) -> list:
        """Block i's MoE part: the router, every routed expert, every shared expert."""
        specs = [(self.router_name(i), (cfg.n_embd, cfg.moe_experts), 0.02)]
        for e in range(cfg.moe_experts):
            specs += self.expert_specs(cfg, self.expert_prefix(i, e))
        for k in range(cfg.moe_shared_experts):
            specs += self.expert_specs(cfg, self.shared_prefix(i, k))
        return specs

    def describe(self, cfg) -> str:
        """The shape in a few words, for the start-up line: "GPT L=4 H=4 C=128"."""
        return f"GPT L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd}"

    def head_weight(self, cfg) -> str:
        """The weight the logits use: the embedding's transpose when tied."""
        return self.embedding if cfg.tie_embeddings else self.head

    # --- what a family provides -------------------------------------------------------------
    def check(self, cfg):
        """Refuse a config this family cannot build (ValueError, one line)."""
        raise NotImplementedError

    def default_hidden(self, cfg) -> int:
        raise NotImplementedError

    def param_specs(self, cfg) -> list:
        """[(canonical name, shape, init)] in model order; init is a std, "zeros" or "ones"."""
        raise NotImplementedError

    def split_kind(self, name: str) -> str:
        """How tensor parallelism cuts `name`: vocab, qkv, column, kv, row or replicated
        (parallel/tensor/tensor_parallel.py)."""
        raise NotImplementedError

    def embed(self, model, idx):
        raise NotImplementedError

    def block(self, model, i: int, x):
        raise NotImplementedError

    def final(self, model, x):
        """The final norm and the logits (the layout's: maybe a vocabulary shard)."""
        raise NotImplementedError

    def train_flops_per_token(self, cfg, t: int | None = None) -> float:
        raise NotImplementedError
