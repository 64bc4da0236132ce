"""A model's shape, for either family (arch "gpt2" or "llama"), and how every parameter is drawn.

GPTConfig is the one record of a model's shape: the trainer, the planner, the checkpoints and
every layout read it. `cfg.family` is the family's description (model/family.py): its
canonical names, its block, its FLOPs. A field that one family does not use keeps its default
and is refused when set (GPT-2 has no KV heads of its own, no rotary base).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass

import numpy as np

ARCHS = ("gpt2", "llama")
ROUTERS = ("switch", "mixtral")


def is_moe_block(i: int, every: int) -> bool:
    """Is block i a mixture-of-experts block, with one every `every` blocks?"""
    return every > 0 and (i + 1) % every == 0


def llama_hidden(n_embd: int, multiplier: float, multiple_of: int) -> int:
    """Llama's MLP width from the model width C: 2/3 of 4C (so that SwiGLU's three matrices
    hold the parameters of GPT-2's two), times ffn_dim_multiplier, rounded up to a multiple of
    `multiple_of` (Meta's reference model.py; Llama 3 8B: C 4096, 1.3, 1024 -> 14336)."""
    hidden = int(2 * 4 * n_embd / 3)
    hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class GPTConfig:
    vocab_size: int = 256        # V: byte-level tokens
    block_size: int = 64         # T: longest context
    n_layer: int = 4             # L: transformer blocks
    n_head: int = 4              # H: attention (query) heads
    n_embd: int = 128            # C: channels; head size C/H
    tie_embeddings: bool | None = None   # logits use the token embedding's transpose; None: the
                                         # family's default (GPT-2 tied, Llama untied)
    moe_experts: int = 0         # E > 0: every moe_every-th block's MLP is E experts (moe.py)
    moe_top_k: int = 2           # K experts per token
    moe_every: int = 1           # block i is a MoE block when (i + 1) % moe_every == 0
    moe_capacity_factor: float = 0.0   # F: slots per expert ceil(F N K / E); 0: no dropping
    arch: str = "gpt2"           # the family: "gpt2" or "llama" (model/family.py)
    n_kv_head: int = 0           # llama: key/value heads Hkv (1: multi-query); 0: H (multi-head)
    ffn_hidden: int = 0          # the MLP's width; 0: the family's rule (GPT-2 4C, Llama llama_hidden)
    ffn_multiplier: float = 1.0  # llama: ffn_dim_multiplier of Llama's rule
    multiple_of: int = 256       # llama: the rule rounds up to a multiple of this
    norm_eps: float = 1e-5       # LayerNorm's (GPT-2) or RMSNorm's (Llama) epsilon
    rope_theta: float = 10000.0  # llama: the rotary base (Llama 3: 500000)
    moe_router: str | None = None      # the load-balancing loss: "switch" (per layer) or "mixtral"
                                       # (pooled over the MoE layers); None: the family's (gpt2
                                       # switch, llama mixtral)
    moe_shared_experts: int = 0  # llama: experts every token goes through (DeepSeekMoE)
    moe_ffn_hidden: int = 0      # each expert's width; 0: the MLP's (fine-grained experts: smaller)

    def __post_init__(self):
        if self.tie_embeddings is None:
            self.tie_embeddings = self.arch != "llama"
        if self.moe_router is None:
            self.moe_router = "mixtral" if self.arch == "llama" else "switch"

    def validate(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.n_kv_head < 0 or self.ffn_hidden < 0 or self.multiple_of < 1:
            raise ValueError(f"n_kv_head {self.n_kv_head} and ffn_hidden {self.ffn_hidden} must be >= 0, "
                             f"multiple_of {self.multiple_of} >= 1")
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0 and math.isfinite(self.rope_theta)
                and self.rope_theta > 1 and math.isfinite(self.ffn_multiplier) and self.ffn_multiplier > 0):
            raise ValueError(f"norm_eps {self.norm_eps} must be > 0, rope_theta {self.rope_theta} > 1, "
                             f"ffn_multiplier {self.ffn_multiplier} > 0, all finite")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.kv_heads}: each "
                             f"key/value head serves n_head/n_kv_head query heads")
        self.family.check(self)
        if self.moe_experts < 0 or self.moe_every < 1 or self.moe_capacity_factor < 0:
            raise ValueError(f"moe_experts {self.moe_experts} must be >= 0, moe_every {self.moe_every} >= 1, "
                             f"moe_capacity_factor {self.moe_capacity_factor} >= 0")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k {self.moe_top_k} must be between 1 and moe_experts {self.moe_experts}")
        if self.moe_router not in ROUTERS or self.moe_shared_experts < 0 or self.moe_ffn_hidden < 0:
            raise ValueError(f"moe_router {self.moe_router!r} must be one of {ROUTERS}, moe_shared_experts "
                             f"{self.moe_shared_experts} and moe_ffn_hidden {self.moe_ffn_hidden} >= 0")
        return self

    @property
    def family(self):
        """The family's description (model/family.py): names, block, FLOPs."""
        from minipar.model.families import FAMILIES       # the families import this module
        return FAMILIES[self.arch]

    @property
    def kv_heads(self) -> int:
        """Hkv: the key/value heads (H for multi-head attention)."""
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def hidden(self) -> int:
        """The MLP's (each expert's) width: ffn_hidden, or the family's rule."""
        return self.ffn_hidden or self.family.default_hidden(self)

    @property
    def expert_hidden(self) -> int:
        """Each expert's width: moe_ffn_hidden, or the MLP's."""
        return self.moe_ffn_hidden or self.hidden

    @property
    def moe_layers(self) -> int:
        """How many blocks are MoE blocks."""
        return sum(self.is_moe(i) for i in range(self.n_layer))

    def is_moe(self, i: int) -> bool:
        """Is block i a mixture-of-experts block?"""
        return self.moe_experts > 0 and is_moe_block(i, self.moe_every)

    def to_dict(self) -> dict:
        return asdict(self)


def init_param(name: str, shape, init, seed: int, dtype=np.float64) -> np.ndarray:
    """The full canonical tensor `name`, identical on every layout: drawn in float64 from
    a generator seeded by (seed, crc32(name)), then cast."""
    if init == "zeros":
        return np.zeros(shape, dtype=dtype)
    if init == "ones":
        return np.ones(shape, dtype=dtype)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape) * init).astype(dtype)
