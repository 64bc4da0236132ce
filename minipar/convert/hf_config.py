"""config.json <-> GPTConfig: the fields that carry over, and the ones minipar refuses.

Read (from_hf): config.json's "architectures" picks the table entry (hf_names.ARCHITECTURES),
its "model_type", if any, must agree; the model's sizes must be there; a field that changes
the model and is absent takes the default of transformers' config class (Llama's rms_norm_eps
1e-6, GPT-2's layer_norm_epsilon 1e-5, ...). Every other field (token ids, dropout, use_cache,
dtype) leaves the weights' meaning alone and is not read. Refused, in one line naming the field
and its value, is any setting minipar's model does not compute:

    GPT2LMHeadModel    n_inner other than 4 n_embd; activation_function other than gelu_new
                       (or gelu_pytorch_tanh, the same tanh GELU); scale_attn_weights false;
                       scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn or
                       add_cross_attention true
    LlamaForCausalLM   hidden_act other than silu; attention_bias or mlp_bias true; a rope
                       scaling other than "default" (Llama 3.1's "llama3"); head_dim other than
                       hidden_size / num_attention_heads; num_key_value_heads not dividing
                       num_attention_heads; pretraining_tp other than 1
    MixtralForCausalLM the above, router_jitter_noise other than 0, a sliding_window; every
                       block a MoE block of num_local_experts SwiGLU experts of
                       intermediate_size, top num_experts_per_tok, Mixtral's router and loss

and whatever GPTConfig.validate refuses (an odd head size for the rotary embedding).

Written (to_hf): the same fields from GPTConfig, the dropouts 0 (minipar has none), the
rotary base as rope_theta with rope_scaling null (transformers 4 reads these; 5 also reads
them, into its rope_parameters), the special token ids null (minipar's byte tokens have none;
the class defaults, GPT-2's 50256, may lie outside the vocabulary), and torch_dtype, the dtype
of the weight files.
"""
from __future__ import annotations

import json
import math
import os

from minipar.convert.hf_names import ARCHITECTURES, Architecture, ConvertError
from minipar.model.config import GPTConfig

_MISSING = object()


class Fields:
    """config.json's object, read field by field; every refusal names the file."""

    def __init__(self, raw: dict, path: str):
        self.raw, self.path = raw, path

    def get(self, key: str, default=_MISSING, kind=int):
        """config.json's `key`, or `default` when absent (none: refused), checked to be of `kind`:
        int (> 0), float (finite, > 0), bool or str; a None default lets null through."""
        v = self.raw.get(key, default)
        if v is _MISSING:
            raise ConvertError(f'{self.path} lacks "{key}": minipar needs the model\'s sizes')
        return None if v is None and default is None else self.check(key, v, kind)

    def check(self, key: str, v, kind):
        ok = (isinstance(v, bool) if kind is bool else isinstance(v, str) if kind is str
              else isinstance(v, int) and not isinstance(v, bool) and v > 0 if kind is int
              else isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)
        if not ok:
            want = {bool: "true or false", str: "a string", int: "a positive integer"}.get(kind, "a positive number")
            raise ConvertError(f"{self.path}: {key} {json.dumps(v)} must be {want}")
        return v

    def refuse(self, key: str, value, why: str):
        raise ConvertError(f"{self.path}: {key} {json.dumps(value)}: {why}")


def read(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{path} is {'not a regular file' if os.path.exists(path) else 'missing'}: "
                           f"a Hugging Face model directory has a config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConvertError(f"{path} is not a JSON object")
    return raw


def architecture(raw: dict, path: str) -> Architecture:
    names = raw.get("architectures")
    if not (isinstance(names, list) and len(names) == 1 and isinstance(names[0], str)):
        raise ConvertError(f"{path}: architectures {json.dumps(names)} must name one of {', '.join(ARCHITECTURES)}")
    if names[0] not in ARCHITECTURES:
        raise ConvertError(f"{path}: architecture {json.dumps(names[0])} is not one minipar reads "
                           f"({', '.join(ARCHITECTURES)})")
    arch = ARCHITECTURES[names[0]]
    if raw.get("model_type", arch.model_type) != arch.model_type:
        raise ConvertError(f"{path}: model_type {json.dumps(raw['model_type'])} is not {arch.name}'s "
                           f"({json.dumps(arch.model_type)})")
    return arch


def _gpt2(f: Fields) -> dict:
    C = f.get("n_embd")
    if f.get("n_inner", None) not in (None, 4 * C):
        f.refuse("n_inner", f.raw["n_inner"], f"minipar's GPT-2 MLP is 4 x n_embd = {4 * C} wide")
    act = f.get("activation_function", "gelu_new", str)
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        f.refuse("activation_function", act, "minipar's GPT-2 computes the tanh GELU, gelu_new")
    if not f.get("scale_attn_weights", True, bool):
        f.refuse("scale_attn_weights", False, "minipar's attention divides the scores by sqrt(head size)")
    for key, why in (("scale_attn_by_inverse_layer_idx", "minipar does not scale a layer's scores by 1/(layer+1)"),
                     ("reorder_and_upcast_attn", "minipar computes attention in one order, in the run's dtype"),
                     ("add_cross_attention", "minipar's GPT-2 has no cross-attention")):
        if f.get(key, False, bool):
            f.refuse(key, True, why)
    return dict(vocab_size=f.get("vocab_size"), block_size=f.get("n_positions"), n_layer=f.get("n_layer"),
                n_head=f.get("n_head"), n_embd=C, norm_eps=float(f.get("layer_norm_epsilon", 1e-5, float)),
                tie_embeddings=f.get("tie_word_embeddings", True, bool))


def _rope_theta(f: Fields) -> float:
    """The rotary base, from transformers 5's rope_parameters or 4's rope_theta and rope_scaling."""
    params = f.raw.get("rope_parameters")
    scaling = params if isinstance(params, dict) else f.raw.get("rope_scaling")
    key = "rope_parameters" if isinstance(params, dict) else "rope_scaling"
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind == "llama3":
            f.refuse(key, kind, "Llama 3.1's rope scaling (frequencies rescaled for long contexts) is not "
                                "representable in minipar, whose rotary embedding is the plain one")
        if kind != "default":
            f.refuse(key, kind, "minipar's rotary embedding is the plain one (rope_type default)")
    if isinstance(params, dict):
        return float(f.check("rope_parameters' rope_theta", params.get("rope_theta", 10000.0), float))
    return float(f.get("rope_theta", 10000.0, float))


def _llama(f: Fields, arch: Architecture) -> dict:
    C, H = f.get("hidden_size"), f.get("num_attention_heads")
    Hkv = f.get("num_key_value_heads", None) or H
    if C % H:
        f.refuse("hidden_size", C, f"is not a multiple of num_attention_heads {H}")
    if H % Hkv:
        f.refuse("num_key_value_heads", Hkv, f"does not divide num_attention_heads {H}")
    if f.get("head_dim", None) not in (None, C // H):
        f.refuse("head_dim", f.raw["head_dim"], f"minipar's head size is hidden_size / num_attention_heads = {C // H}")
    act = f.get("hidden_act", "silu", str)
    if act != "silu":
        f.refuse("hidden_act", act, "minipar's SwiGLU gates with silu")
    for key in ("attention_bias", "mlp_bias"):
        if f.get(key, False, bool):
            f.refuse(key, True, "minipar's Llama has no biases")
    if f.raw.get("pretraining_tp", 1) not in (None, 1):
        f.refuse("pretraining_tp", f.raw["pretraining_tp"], "minipar computes each projection as one matrix (1)")
    out = dict(vocab_size=f.get("vocab_size"), block_size=f.get("max_position_embeddings", 2048),
               n_layer=f.get("num_hidden_layers"), n_head=H, n_kv_head=Hkv, n_embd=C,
               ffn_hidden=f.get("intermediate_size"), norm_eps=float(f.get("rms_norm_eps", 1e-6, float)),
               rope_theta=_rope_theta(f), tie_embeddings=f.get("tie_word_embeddings", False, bool))
    if arch.name == "MixtralForCausalLM":
        if f.raw.get("router_jitter_noise", 0.0) not in (0, 0.0):
            f.refuse("router_jitter_noise", f.raw["router_jitter_noise"], "minipar's router adds no noise")
        if f.raw.get("sliding_window") is not None:
            f.refuse("sliding_window", f.raw["sliding_window"], "minipar's attention sees the whole context")
        out.update(moe_experts=f.get("num_local_experts"), moe_top_k=f.get("num_experts_per_tok"), moe_every=1,
                   moe_router="mixtral")
    return out


def from_hf(raw: dict, path: str, block_size: int | None = None) -> tuple[Architecture, GPTConfig]:
    """config.json's object -> (its table entry, the GPTConfig of the same model), or
    ConvertError. block_size: Llama's context for minipar (its max_position_embeddings is only
    a limit: no tensor depends on it); GPT-2's is its position table's rows, n_positions."""
    arch, f = architecture(raw, path), Fields(raw, path)
    fields = _gpt2(f) if arch.family == "gpt2" else _llama(f, arch)
    if block_size is not None:
        if arch.family == "gpt2" and block_size != fields["block_size"]:
            raise ConvertError(f"--block-size {block_size}: GPT-2's context is its position table's "
                               f"{fields['block_size']} rows (n_positions)")
        fields["block_size"] = block_size
    try:
        return arch, GPTConfig(arch=arch.family, **fields).validate()
    except ValueError as e:
        raise ConvertError(f"{path}: {e}") from None


def to_hf(cfg: GPTConfig, dtype: str) -> dict:
    """The config.json of cfg's model (GPTConfig.validate has passed), weights in `dtype`."""
    if cfg.moe_experts:
        if cfg.arch == "gpt2":
            raise ConvertError(f"moe_experts {cfg.moe_experts}: minipar's GPT-2 with a mixture of experts has no "
                               f"Hugging Face architecture")
        mixtral_can(cfg)
    if cfg.arch == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
                "n_positions": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": 0.02, "bos_token_id": None,
                "eos_token_id": None, "torch_dtype": dtype}
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.n_embd, "intermediate_size": cfg.hidden, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
            "hidden_act": "silu", "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
            "mlp_bias": False, "pretraining_tp": 1, "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": None, "torch_dtype": dtype}
    if not cfg.moe_experts:
        return llama
    for key in ("mlp_bias", "pretraining_tp", "head_dim"):
        del llama[key]
    return {**llama, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": cfg.expert_hidden, "num_local_experts": cfg.moe_experts,
            "num_experts_per_tok": cfg.moe_top_k, "router_jitter_noise": 0.0, "sliding_window": None,
            "output_router_logits": False, "router_aux_loss_coef": 0.02}


def mixtral_can(cfg: GPTConfig):
    """A Llama mixture of experts that MixtralForCausalLM computes: every block a MoE block, no
    shared experts, and a router whose weights are renormalised (Mixtral's; Switch's top-1 is not)."""
    if cfg.moe_every != 1:
        raise ConvertError(f"moe_every {cfg.moe_every}: Mixtral has experts in every block")
    if cfg.moe_shared_experts:
        raise ConvertError(f"moe_shared_experts {cfg.moe_shared_experts}: Mixtral has no shared experts "
                           f"(DeepSeekMoE's)")
    if cfg.moe_router == "switch" and cfg.moe_top_k == 1:
        raise ConvertError("moe_router switch with moe_top_k 1: its one weight is the router's probability, "
                           "Mixtral renormalises it to 1")
