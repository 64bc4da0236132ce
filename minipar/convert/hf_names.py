"""Hugging Face's names and layouts of minipar's parameters: one table entry per architecture
(Architecture), and the two maps that read it.

minipar names a parameter as Hugging Face does, without the base model's prefix
(model/family.py): GPT-2's `transformer.h.0.attn.c_attn.weight` is `h.0.attn.c_attn.weight`,
Llama's `model.layers.0.mlp.up_proj.weight` is `layers.0.mlp.up_proj.weight`; the head
`lm_head.weight` has no prefix on either side. The layouts:

    GPT2LMHeadModel    every tensor as it is: Hugging Face's Conv1D stores (in, out), as minipar does
    LlamaForCausalLM   every projection transposed: nn.Linear stores (out, in), minipar (in, out);
                       embed_tokens and lm_head are (V, C) on both sides, the norms (C,)

A tied head (tie_word_embeddings) is the embedding itself: save_pretrained writes it once, and so
does to_hf; from_hf accepts an `lm_head.weight` beside it only when it is bit for bit the embedding.

Checkpoints saved from a base model (GPT-2's on the Hub: `h.0.attn.c_attn.weight`) name their
tensors without the prefix; both spellings are read, as transformers reads them. Tensors that are
buffers, not parameters (GPT-2's causal masks `attn.bias` and `attn.masked_bias`, older Llamas'
`rotary_emb.inv_freq`), are skipped: minipar computes them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from minipar.model.families import FAMILIES

HEAD = "lm_head.weight"


class ConvertError(ValueError):
    """A conversion refused: one line naming the file, the field or tensor, and the value."""


@dataclass(frozen=True)
class Architecture:
    name: str                 # config.json's "architectures": "LlamaForCausalLM"
    model_type: str           # config.json's "model_type": "llama"
    family: str               # minipar's arch: "gpt2" or "llama"
    prefix: str               # the base model's prefix on every name but the head
    transposed: tuple = ()    # minipar names (regular expressions) stored transposed by Hugging Face
    buffers: tuple = ()       # Hugging Face names, without the prefix, that are not parameters

    def hf_name(self, name: str) -> str:
        return name if name == HEAD else self.prefix + name

    def is_transposed(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.transposed)

    def hf_shape(self, name: str, shape) -> tuple:
        return tuple(shape)[::-1] if self.is_transposed(name) else tuple(shape)


_LAYER = r"layers\.\d+\."
ARCHITECTURES = {a.name: a for a in (
    Architecture("GPT2LMHeadModel", "gpt2", "gpt2", "transformer.",
                 buffers=(r"h\.\d+\.attn\.bias", r"h\.\d+\.attn\.masked_bias")),
    Architecture("LlamaForCausalLM", "llama", "llama", "model.",
                 transposed=(_LAYER + r"self_attn\.[qkvo]_proj\.weight", _LAYER + r"mlp\.(gate|up|down)_proj\.weight"),
                 buffers=(_LAYER + r"self_attn\.rotary_emb\.inv_freq",)),
    # Mixtral's router (E, C) and experts w1 (gate), w3 (up): (F, C), w2 (down): (C, F), all
    # nn.Linear; minipar's names are these without `model.`, stored (in, out).
    Architecture("MixtralForCausalLM", "mixtral", "llama", "model.",
                 transposed=(_LAYER + r"self_attn\.[qkvo]_proj\.weight",
                             _LAYER + r"block_sparse_moe\.gate\.weight",
                             _LAYER + r"block_sparse_moe\.experts\.\d+\.w[123]\.weight"),
                 buffers=(_LAYER + r"self_attn\.rotary_emb\.inv_freq",)),
)}


def _some(names, k: int = 3) -> str:
    names = list(names)
    return ", ".join(names[:k]) + (f" ... ({len(names)} in all)" if len(names) > k else "")


def to_hf(arch: Architecture, state: dict, tied: bool) -> dict:
    """minipar's {name: array} -> Hugging Face's {name: array}, in the same order, each in
    Hugging Face's layout (a transposed one copied C-contiguous); a tied head is not written."""
    return {arch.hf_name(n): np.ascontiguousarray(a.T) if arch.is_transposed(n) else a
            for n, a in state.items() if not (tied and n == HEAD)}


def from_hf(arch: Architecture, tensors: dict, specs: list, tied: bool, where: str) -> dict:
    """Hugging Face's {name: array} -> minipar's {name: array} in the order of `specs`
    [(name, shape)], each in minipar's layout and its file's dtype. Refuses (ConvertError, one
    line naming `where` and the tensors) a tensor twice, a missing, an extra or a mis-shaped one."""
    ours, spelled = {}, {}
    for hf, a in tensors.items():
        name = hf[len(arch.prefix):] if hf.startswith(arch.prefix) and hf != HEAD else hf
        if any(re.fullmatch(p, name) for p in arch.buffers):
            continue
        if name in ours:
            raise ConvertError(f"{where} holds {name} twice: as {spelled[name]} and as {hf}")
        ours[name], spelled[name] = a, hf
    want = dict(specs)
    embedding = FAMILIES[arch.family].embedding
    if tied and HEAD in ours and HEAD not in want and embedding in ours:     # save_pretrained leaves it out
        e, h = ours[embedding], ours.pop(HEAD)
        if e.dtype != h.dtype or e.shape != h.shape or not np.array_equal(e, h):
            raise ConvertError(f"{where}: tie_word_embeddings is true but {HEAD} is not {arch.hf_name(embedding)}: "
                               f"a tied head is the embedding itself")
    missing = [arch.hf_name(n) for n in want if n not in ours]
    if missing:
        raise ConvertError(f"{where} lacks tensors of the model its config.json describes: {_some(missing)}")
    extra = [spelled[n] for n in ours if n not in want]
    if extra:
        raise ConvertError(f"{where} holds tensors that are not parameters of minipar's {arch.name}: {_some(extra)}")
    out = {}
    for name, shape in specs:
        a = ours[name]
        if tuple(a.shape) != arch.hf_shape(name, shape):
            raise ConvertError(f"{where}: tensor {spelled[name]} has shape {tuple(a.shape)}, the model its "
                               f"config.json describes needs {arch.hf_shape(name, shape)}")
        out[name] = np.ascontiguousarray(a.T) if arch.is_transposed(name) else a
    return out
