"""Hugging Face checkpoints, both ways (minipar/convert, docs/checkpoints.md).

The Hugging Face directories here are written by the test itself with safetensors' NumPy API,
their names and layouts spelled out below from transformers' GPT2LMHeadModel and
LlamaForCausalLM (not from minipar's tables), so no transformers is needed:

- round trips are bit-exact: Hugging Face -> minipar -> Hugging Face gives the same tensors
  (names, shapes, dtypes, bytes), float32 and bfloat16, one file and shards; a checkpoint a
  tp=2 run trained goes out and comes back as the same model.npz;
- a converted checkpoint resumes in the trainer on one process and on 4 ranks, and its first
  loss is the loss of the same weights computed directly;
- a converted Llama's logits equal a straight-line NumPy forward written here against the
  Hugging Face tensors themselves, (out, in) weights (so the transposes are right);
- every refusal is one line naming what is wrong, and a refused conversion writes nothing.
"""
import json
import math
import os
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from minipar.convert import cli, safetensors_io
from minipar.model.gpt import GPT, GPTConfig
from minipar.train import checkpoint, data

from trainer_runs import assert_main_exits_2, mpirun, read_log, run_tiny

pytestmark = pytest.mark.usefixtures("fixed_peak")
BF16 = np.dtype(ml_dtypes.bfloat16)


# --- Hugging Face directories, written by hand ------------------------------------------------

def gpt2_tensors(V=300, T=16, C=16, L=2, tied=True, prefix="transformer."):
    """GPT2LMHeadModel's state dict: Conv1D weights (in, out)."""
    t = {prefix + "wte.weight": (V, C), prefix + "wpe.weight": (T, C)}
    for i in range(L):
        h = f"{prefix}h.{i}."
        t.update({h + "ln_1.weight": (C,), h + "ln_1.bias": (C,), h + "attn.c_attn.weight": (C, 3 * C),
                  h + "attn.c_attn.bias": (3 * C,), h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
                  h + "ln_2.weight": (C,), h + "ln_2.bias": (C,), h + "mlp.c_fc.weight": (C, 4 * C),
                  h + "mlp.c_fc.bias": (4 * C,), h + "mlp.c_proj.weight": (4 * C, C), h + "mlp.c_proj.bias": (C,)})
    t.update({prefix + "ln_f.weight": (C,), prefix + "ln_f.bias": (C,)})
    if not tied:
        t["lm_head.weight"] = (V, C)
    return t


def gpt2_config(V=300, T=16, C=16, L=2, H=2, tied=True, **extra):
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": V, "n_positions": T,
            "n_embd": C, "n_layer": L, "n_head": H, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "tie_word_embeddings": tied, "resid_pdrop": 0.1, **extra}


def llama_tensors(V=260, C=16, H=4, Hkv=2, F=24, L=2, tied=False):
    """LlamaForCausalLM's state dict: nn.Linear weights (out, in)."""
    hs = C // H
    t = {"model.embed_tokens.weight": (V, C)}
    for i in range(L):
        h = f"model.layers.{i}."
        t.update({h + "input_layernorm.weight": (C,), h + "self_attn.q_proj.weight": (H * hs, C),
                  h + "self_attn.k_proj.weight": (Hkv * hs, C), h + "self_attn.v_proj.weight": (Hkv * hs, C),
                  h + "self_attn.o_proj.weight": (C, H * hs), h + "post_attention_layernorm.weight": (C,),
                  h + "mlp.gate_proj.weight": (F, C), h + "mlp.up_proj.weight": (F, C),
                  h + "mlp.down_proj.weight": (C, F)})
    t["model.norm.weight"] = (C,)
    if not tied:
        t["lm_head.weight"] = (V, C)
    return t


def mixtral_tensors(V=260, C=16, H=4, Hkv=2, F=24, L=2, E=4, tied=False):
    """MixtralForCausalLM's state dict: Llama's with each MLP a block_sparse_moe of E experts."""
    t = {n: s for n, s in llama_tensors(V, C, H, Hkv, F, L, tied).items() if ".mlp." not in n}
    for i in range(L):
        h = f"model.layers.{i}.block_sparse_moe."
        t[h + "gate.weight"] = (E, C)
        for e in range(E):
            t.update({h + f"experts.{e}.w1.weight": (F, C), h + f"experts.{e}.w2.weight": (C, F),
                      h + f"experts.{e}.w3.weight": (F, C)})
    return t


def mixtral_config(E=4, K=2, **kw):
    return {**llama_config(**kw), "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": E, "num_experts_per_tok": K, "router_jitter_noise": 0.0, "sliding_window": None}


def llama_config(V=260, C=16, H=4, Hkv=2, F=24, L=2, T=16, tied=False, **extra):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": C,
            "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": Hkv,
            "max_position_embeddings": T, "rms_norm_eps": 1e-5, "rope_theta": 500.0, "hidden_act": "silu",
            "tie_word_embeddings": tied, "attention_bias": False, "mlp_bias": False, "rope_scaling": None,
            "bos_token_id": 1, "eos_token_id": 2, **extra}


def values(shapes: dict, dtype=np.float32, seed=0) -> dict:
    """Random tensors; norms' weights near 1 as trained ones are."""
    rng = np.random.default_rng(seed)
    out = {}
    for n, s in shapes.items():
        a = rng.standard_normal(s) * 0.2
        out[n] = (a + 1.0 if "norm" in n or "ln_" in n and n.endswith("weight") else a).astype(dtype)
    return out


def write_hf(d, config: dict, tensors: dict, shards: int = 1):
    """A model directory: config.json, and the tensors in one file or `shards` files with the index."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    names = list(tensors)
    if shards == 1:
        safetensors.numpy.save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        return str(d)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        safetensors.numpy.save_file({n: tensors[n] for n in part}, os.path.join(d, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}, f)
    return str(d)


def raw_tensors(d) -> dict:
    """{name: (safetensors dtype, shape, bytes)} of every tensor of a model directory."""
    files = [f for f in sorted(os.listdir(d)) if f.endswith(".safetensors")]
    out = {}
    for file in files:
        with safetensors.safe_open(os.path.join(d, file), framework="np") as f:
            for n in f.keys():
                assert n not in out, f"{n} twice"
                out[n] = (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape()), f.get_tensor(n).tobytes())
    return out


# --- running the converter ---------------------------------------------------------------------

def convert(capsys, *argv) -> str:
    cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert err == "", err
    return out


def refused(capsys, *argv) -> str:
    """The converter exits 2 with one line on stderr and prints nothing else; -> that line."""
    with pytest.raises(SystemExit) as e:
        cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "", (e.value.code, out, err)
    assert err.startswith("minipar.convert: error: ") and err.count("\n") == 1, err
    return err


def tree(root) -> list:
    """Every path under root with its size and modification time: what a refusal must not change."""
    out = []
    for d, dirs, files in os.walk(root):
        for x in sorted(dirs + files):
            p = os.path.join(d, x)
            st = os.lstat(p)
            out.append((os.path.relpath(p, root), st.st_size, st.st_mtime_ns))
    return sorted(out)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def model_npz(d) -> dict:
    with np.load(os.path.join(d, "model.npz"), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


# --- round trips --------------------------------------------------------------------------------

CASES = {                                   # (config, tensors, dtype, shards)
    "gpt2-tied-float32": (gpt2_config(), gpt2_tensors(), np.float32, 1),
    "gpt2-untied-bfloat16-sharded": (gpt2_config(tied=False), gpt2_tensors(tied=False), BF16, 3),
    "llama-gqa-untied-float32-sharded": (llama_config(), llama_tensors(), np.float32, 4),
    "llama-gqa-untied-bfloat16": (llama_config(), llama_tensors(), BF16, 1),
    "llama-mqa-tied-float32": (llama_config(Hkv=1, tied=True), llama_tensors(Hkv=1, tied=True), np.float32, 1),
    "llama-float16-sharded": (llama_config(), llama_tensors(), np.float16, 2),
    "mixtral-float32-sharded": (mixtral_config(), mixtral_tensors(), np.float32, 3),
    "mixtral-top1-bfloat16": (mixtral_config(E=3, K=1), mixtral_tensors(E=3), BF16, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_minipar_to_hf_is_bit_exact(case, tmp_path, capsys):
    config, shapes, dtype, shards = CASES[case]
    src = write_hf(tmp_path / "hf", config, values(shapes, dtype), shards)
    convert(capsys, "from-hf", src, tmp_path / "ck")
    state = model_npz(tmp_path / "ck")
    assert {a.dtype for a in state.values()} == {np.dtype(np.float32)}, "bfloat16 and float32 are held in float32"
    back = [] if dtype == np.float32 else ["--dtype", np.dtype(dtype).name]
    size = ["--max-shard-size", "4KB"] if shards > 1 else []
    out = convert(capsys, "to-hf", tmp_path / "ck", tmp_path / "back", *back, *size)
    assert raw_tensors(src) == raw_tensors(tmp_path / "back"), case
    files = sorted(os.listdir(tmp_path / "back"))
    if shards > 1:                          # save_pretrained's layout: numbered shards and their index
        index = read_json(tmp_path / "back" / "model.safetensors.index.json")
        shard_files = [f for f in files if f.endswith(".safetensors")]
        assert len(shard_files) > 1 and sorted(set(index["weight_map"].values())) == shard_files, files
        assert index["metadata"]["total_size"] == sum(len(b) for _, _, b in raw_tensors(src).values())
        for f in shard_files:                # at most 4KB of tensors, or one tensor larger than that
            with safetensors.safe_open(tmp_path / "back" / f, framework="np") as st:
                sizes = [st.get_tensor(n).nbytes for n in st.keys()]
            assert sum(sizes) <= 4000 or len(sizes) == 1, (f, sizes)
    else:
        assert files == ["config.json", "model.safetensors"], files
    written = read_json(tmp_path / "back" / "config.json")
    for key in ("architectures", "vocab_size", "tie_word_embeddings", "n_embd", "hidden_size", "num_key_value_heads",
                "intermediate_size", "rope_theta", "rms_norm_eps", "n_positions", "max_position_embeddings"):
        assert written.get(key) == config.get(key), (key, written.get(key), config.get(key))
    assert written["torch_dtype"] == np.dtype(dtype).name
    assert config["architectures"][0] in out, out
    if "num_local_experts" in config:
        assert (written["num_local_experts"], written["num_experts_per_tok"]) == \
            (config["num_local_experts"], config["num_experts_per_tok"])


def test_hub_gpt2_names_without_prefix_and_its_mask_buffers_are_read(tmp_path, capsys):
    """GPT-2 as the Hub stores it: names without `transformer.`, and the causal masks `attn.bias`
    and `attn.masked_bias` (buffers). Read as the same model; written back with the prefix."""
    shapes = gpt2_tensors(prefix="")
    t = values(shapes)
    t.update({f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 16, 16), np.float32)) for i in range(2)})
    t.update({f"h.{i}.attn.masked_bias": np.array(-1e4, np.float32) for i in range(2)})
    src = write_hf(tmp_path / "hub", gpt2_config(), t)
    convert(capsys, "from-hf", src, tmp_path / "ck")
    convert(capsys, "to-hf", tmp_path / "ck", tmp_path / "back")
    back = raw_tensors(tmp_path / "back")
    assert back == {"transformer." + n: v for n, v in raw_tensors(src).items() if ".attn.bias" not in n
                    and "masked_bias" not in n}


def test_hugging_face_cache_links_and_transformers_5_config_are_read(tmp_path, capsys):
    """The Hub's cache: a snapshot folder of links to blobs elsewhere. transformers 5 writes the
    rotary base inside rope_parameters, and dtype for torch_dtype."""
    config = {k: v for k, v in llama_config().items() if k not in ("rope_theta", "rope_scaling")}
    config.update(rope_parameters={"rope_type": "default", "rope_theta": 123.0}, dtype="float32")
    blobs = write_hf(tmp_path / "blobs", config, values(llama_tensors()))
    os.makedirs(tmp_path / "snapshot")
    for f in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(blobs, f), tmp_path / "snapshot" / f)
    convert(capsys, "from-hf", tmp_path / "snapshot", tmp_path / "ck")
    assert read_json(tmp_path / "ck" / "meta.json")["config"]["rope_theta"] == 123.0
    convert(capsys, "to-hf", tmp_path / "ck", tmp_path / "back")
    assert raw_tensors(tmp_path / "back") == raw_tensors(blobs)


def test_a_tied_head_written_beside_its_embedding_is_read_when_equal(tmp_path, capsys):
    t = values(llama_tensors(tied=True))
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    convert(capsys, "from-hf", write_hf(tmp_path / "hf", llama_config(tied=True), t), tmp_path / "ck")
    assert "lm_head.weight" not in model_npz(tmp_path / "ck")


def test_a_checkpoint_trained_on_tp2_goes_out_and_comes_back_identical(tmp_path, capsys):
    """minipar -> Hugging Face -> minipar: model.npz's arrays, float64, from a tp=2 run (k and v
    heads shared by the two ranks); and a float32 GPT-2 of one process."""
    d = tmp_path / "tp2"
    p = mpirun(2, "--arch", "llama", "--n-head", "2", "--n-kv-head", "1", "--multiple-of", "8", "--tp", "2",
               "--dtype", "float64", "--steps", "2", "--save", str(d))
    assert p.returncode == 0, p.stdout + p.stderr
    assert read_json(d / "meta.json")["layout"]["tp"] == 2
    run_tiny("--steps", "2", "--untied", "--save", str(tmp_path / "gpt2"))
    for ck in (d, tmp_path / "gpt2"):
        convert(capsys, "to-hf", ck, tmp_path / f"{ck.name}-hf")
        convert(capsys, "from-hf", tmp_path / f"{ck.name}-hf", tmp_path / f"{ck.name}-back")
        a, b = model_npz(ck), model_npz(tmp_path / f"{ck.name}-back")
        assert list(a) == list(b) and all(a[n].dtype == b[n].dtype and np.array_equal(a[n], b[n]) for n in a), ck
        assert read_json(tmp_path / f"{ck.name}-back" / "meta.json")["dtype"] == a[next(iter(a))].dtype.name
    # --dtype bfloat16 on the way out: ml_dtypes's rounding of every tensor, nothing else
    convert(capsys, "to-hf", d, tmp_path / "bf16", "--dtype", "bfloat16")
    convert(capsys, "from-hf", tmp_path / "bf16", tmp_path / "bf16-back", "--dtype", "float64")
    a, b = model_npz(d), model_npz(tmp_path / "bf16-back")
    assert all(np.array_equal(a[n].astype(BF16).astype(np.float64), b[n]) for n in a)


# --- the converted checkpoint trains ------------------------------------------------------------

def first_loss(ck, cfg: GPTConfig, batch_size: int, seed: int = 0) -> float:
    """The loss of step 0's batch under the checkpoint's weights, computed directly."""
    model = GPT(cfg, dtype=np.float64)
    model.load_state_dict(model_npz(ck))
    x, y = data.Sampler(data.load_tokens(None, cfg.block_size), cfg.block_size, batch_size, seed).batch(0)
    return float(model(x, y).data)


@pytest.mark.parametrize("family,layout", [("llama", ["--tp", "2", "--pp", "2"]),
                                           ("gpt2", ["--dp", "2", "--tp", "2", "--zero", "1"])])
def test_a_converted_checkpoint_resumes_on_one_process_and_on_four_ranks(family, layout, tmp_path, capsys):
    """From a float32 Hugging Face directory, converted to float64: step 0's loss on one process
    and on 4 ranks equals the loss of the weights computed directly, and step 1 (Adam's first
    step from zero moments) agrees between the two."""
    if family == "llama":
        config, shapes, size = llama_config(), llama_tensors(), ["--n-layer", "2", "--n-head", "4"]
    else:
        config, shapes, size = gpt2_config(), gpt2_tensors(), ["--n-layer", "2"]
    ck = tmp_path / "ck"
    out = convert(capsys, "from-hf", write_hf(tmp_path / "hf", config, values(shapes)), ck, "--dtype", "float64")
    assert f"python -m minipar.train --resume {ck} --dtype float64" in out, out
    meta = read_json(ck / "meta.json")
    assert meta["step"] == 0 and "seed" not in meta and "data" not in meta
    _, ostate, _ = checkpoint.load(str(ck))                  # Adam before its first step: step 0, m = v = 0
    assert ostate["step"] == 0 and not any(a.any() for k in ("m", "v") for a in ostate[k].values())
    flags = [*size, "--resume", str(ck), "--dtype", "float64", "--steps", "2", "--batch-size", "8"]
    run_tiny(*flags, "--log", str(tmp_path / "one.jsonl"))
    p = mpirun(4, *flags, *layout, "--log", str(tmp_path / "four.jsonl"))
    assert p.returncode == 0, p.stdout + p.stderr
    one, four = (read_log(tmp_path / f"{w}.jsonl")[0] for w in ("one", "four"))
    cfg = GPTConfig(**meta["config"])
    direct = first_loss(ck, cfg, 8)
    print(f"{family}: step 0 loss direct {direct:.15f}, one process {one[0]['loss']:.15f}, "
          f"4 ranks {four[0]['loss']:.15f}")
    assert [r["step"] for r in one] == [r["step"] for r in four] == [0, 1]
    np.testing.assert_allclose([one[0]["loss"], four[0]["loss"]], direct, rtol=1e-12)
    np.testing.assert_allclose([r["loss"] for r in four], [r["loss"] for r in one], rtol=1e-12)


def test_the_trainer_refuses_a_vocabulary_smaller_than_the_bytes(tmp_path, capsys):
    out = convert(capsys, "from-hf", write_hf(tmp_path / "hf", llama_config(V=100), values(llama_tensors(V=100))),
                  tmp_path / "ck")
    assert "fewer than the trainer's 256 byte tokens" in out
    assert_main_exits_2(["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--resume", str(tmp_path / "ck"),
                         "--steps", "1", "--sample", "0"],
                        ["vocabulary of 100 tokens does not hold the data's byte tokens"], capsys, "V=100")


# --- the transposes: a straight-line forward on Hugging Face's own tensors -----------------------

def hf_llama_logits(t: dict, cfg: dict, idx: np.ndarray) -> np.ndarray:
    """LlamaForCausalLM's forward as its modeling code computes it, on its (out, in) weights:
    y = x W^T for every projection, rotate_half rotary embedding, repeat_kv."""
    B, T = idx.shape
    C, H, Hkv, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    hs = C // H

    def linear(x, w):
        return x @ w.T

    def rmsnorm(x, w):
        return w * (x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps))

    inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, hs, 2) / hs)
    emb = np.concatenate([np.outer(np.arange(T), inv_freq)] * 2, axis=-1)     # (T, hs)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]

    def rotate_half(x):
        return np.concatenate([-x[..., hs // 2:], x[..., :hs // 2]], axis=-1)

    x = t["model.embed_tokens.weight"][idx]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rmsnorm(x, t[p + "input_layernorm.weight"])
        q = linear(a, t[p + "self_attn.q_proj.weight"]).reshape(B, T, H, hs).transpose(0, 2, 1, 3)
        k = linear(a, t[p + "self_attn.k_proj.weight"]).reshape(B, T, Hkv, hs).transpose(0, 2, 1, 3)
        v = linear(a, t[p + "self_attn.v_proj.weight"]).reshape(B, T, Hkv, hs).transpose(0, 2, 1, 3)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)          # repeat_kv
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs) + mask
        w = np.exp(s - s.max(-1, keepdims=True))
        y = (w / w.sum(-1, keepdims=True)) @ v                                         # (B, H, T, hs)
        x = x + linear(y.transpose(0, 2, 1, 3).reshape(B, T, C), t[p + "self_attn.o_proj.weight"])
        m = rmsnorm(x, t[p + "post_attention_layernorm.weight"])
        if p + "block_sparse_moe.gate.weight" in t:
            x = x + hf_mixtral_moe(t, p + "block_sparse_moe.", cfg, m)
            continue
        g = linear(m, t[p + "mlp.gate_proj.weight"])
        x = x + linear(g / (1 + np.exp(-g)) * linear(m, t[p + "mlp.up_proj.weight"]), t[p + "mlp.down_proj.weight"])
    head = t["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else t["lm_head.weight"]
    return linear(rmsnorm(x, t["model.norm.weight"]), head)


def hf_mixtral_moe(t: dict, pre: str, cfg: dict, m: np.ndarray) -> np.ndarray:
    """MixtralSparseMoeBlock as its modeling code computes it: router logits x W_g^T, softmax over
    all experts, the top k renormalised, each expert w2(silu(w1 x) * w3 x), weights (out, in)."""
    B, T, C = m.shape
    x = m.reshape(-1, C)
    z = x @ t[pre + "gate.weight"].T
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    K = cfg["num_experts_per_tok"]
    top = np.argsort(-p, axis=-1, kind="stable")[:, :K]
    w = np.take_along_axis(p, top, -1)
    w /= w.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        for k, e in enumerate(top[n]):
            q = f"{pre}experts.{e}."
            g = x[n] @ t[q + "w1.weight"].T
            y[n] += w[n, k] * ((g / (1 + np.exp(-g)) * (x[n] @ t[q + "w3.weight"].T)) @ t[q + "w2.weight"].T)
    return y.reshape(B, T, C)


def test_a_converted_mixtral_computes_the_logits_of_its_hugging_face_tensors(tmp_path, capsys):
    """The router and the experts' w1, w2, w3 come over transposed (w2 and the router are not
    square: a missed transpose fails on a shape; w1 and w3 are, here, so one is planted)."""
    config = mixtral_config(V=50, C=24, H=4, Hkv=2, F=24, L=2, T=12, E=3, K=2)
    t = values(mixtral_tensors(V=50, C=24, H=4, Hkv=2, F=24, L=2, E=3), np.float64, seed=4)
    convert(capsys, "from-hf", write_hf(tmp_path / "hf", config, t), tmp_path / "ck")
    meta = read_json(tmp_path / "ck" / "meta.json")
    cfg = GPTConfig(**meta["config"])
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_every, cfg.moe_router) == (3, 2, 1, "mixtral")
    model = GPT(cfg, dtype=np.float64)
    model.load_state_dict(model_npz(tmp_path / "ck"))
    idx = np.random.default_rng(2).integers(0, 50, (2, 12))
    got = model(idx).data
    np.testing.assert_allclose(got, hf_llama_logits(t, config, idx), rtol=1e-12, atol=1e-12)
    wrong = dict(t)
    wrong["model.layers.1.block_sparse_moe.experts.2.w1.weight"] = t["model.layers.1.block_sparse_moe.experts.2.w1.weight"].T.copy()
    assert not np.allclose(hf_llama_logits(wrong, config, idx), got, rtol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_a_converted_llama_computes_the_logits_of_its_hugging_face_tensors(tied, tmp_path, capsys):
    """float64 files: minipar's model from the converted checkpoint and the forward above on the
    files' own tensors agree to 1e-12. k_proj, v_proj, gate, up and down are not square here (a
    missed transpose fails on a shape); q_proj and o_proj are, and one of them left transposed
    changes the logits (the planted mistake at the end)."""
    config = llama_config(V=50, C=24, H=4, Hkv=2, F=40, L=2, T=12, tied=tied)
    t = values(llama_tensors(V=50, C=24, H=4, Hkv=2, F=40, L=2, tied=tied), np.float64, seed=3)
    convert(capsys, "from-hf", write_hf(tmp_path / "hf", config, t), tmp_path / "ck")
    meta = read_json(tmp_path / "ck" / "meta.json")
    assert meta["dtype"] == "float64"
    model = GPT(GPTConfig(**meta["config"]), dtype=np.float64)
    model.load_state_dict(model_npz(tmp_path / "ck"))
    idx = np.random.default_rng(1).integers(0, 50, (2, 12))
    want = hf_llama_logits(t, config, idx)
    got = model(idx).data
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    wrong = dict(t)                          # the check can fail: one projection not transposed back
    wrong["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"].T.copy()
    assert not np.allclose(hf_llama_logits(wrong, config, idx), got, rtol=1e-6)


# --- refusals: one line each, nothing written ---------------------------------------------------

CONFIG_REFUSALS = {
    "bert": ({"architectures": ["BertForMaskedLM"]}, 'architecture "BertForMaskedLM" is not one minipar reads'),
    "no-architectures": ({"architectures": None}, "architectures null must name one of"),
    "model-type": ({"model_type": "mistral"}, 'model_type "mistral" is not LlamaForCausalLM\'s'),
    "gpt2-n_inner": ({"n_inner": 100}, "n_inner 100: minipar's GPT-2 MLP is 4 x n_embd = 64 wide"),
    "gpt2-activation": ({"activation_function": "relu"}, 'activation_function "relu"'),
    "gpt2-exact-gelu": ({"activation_function": "gelu"}, 'activation_function "gelu"'),
    "gpt2-inverse-layer-idx": ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx true"),
    "gpt2-reorder-upcast": ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn true"),
    "gpt2-unscaled": ({"scale_attn_weights": False}, "scale_attn_weights false"),
    "gpt2-cross-attention": ({"add_cross_attention": True}, "add_cross_attention true"),
    "gpt2-missing-size": ({"n_embd": None}, "n_embd null must be a positive integer"),
    "gpt2-bad-eps": ({"layer_norm_epsilon": "tiny"}, 'layer_norm_epsilon "tiny" must be a positive number'),
    "llama-act": ({"hidden_act": "gelu"}, 'hidden_act "gelu": minipar\'s SwiGLU gates with silu'),
    "llama-attention-bias": ({"attention_bias": True}, "attention_bias true: minipar's Llama has no biases"),
    "llama-mlp-bias": ({"mlp_bias": True}, "mlp_bias true"),
    "llama3-rope": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 'rope_scaling "llama3": Llama 3.1\'s'),
    "llama3-rope-v5": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, 'rope_parameters "llama3"'),
    "linear-rope": ({"rope_scaling": {"type": "linear", "factor": 2.0}}, 'rope_scaling "linear"'),
    "head-dim": ({"head_dim": 8}, "head_dim 8: minipar's head size is hidden_size / num_attention_heads = 4"),
    "kv-heads": ({"num_key_value_heads": 3}, "num_key_value_heads 3: does not divide num_attention_heads 4"),
    "pretraining-tp": ({"pretraining_tp": 2}, "pretraining_tp 2"),
    "llama-not-a-size": ({"hidden_size": "16"}, 'hidden_size "16" must be a positive integer'),
    "llama-lacks-a-size": ({"num_hidden_layers": ...}, 'lacks "num_hidden_layers": minipar needs the model\'s sizes'),
    "odd-head": ({"hidden_size": 12, "num_attention_heads": 4, "num_key_value_heads": 4},
                 "head size n_embd/n_head = 12/4 = 3 must be even"),
    "mixtral-window": ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
                        "num_experts_per_tok": 2, "sliding_window": 4096}, "sliding_window 4096"),
    "mixtral-jitter": ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
                        "num_experts_per_tok": 2, "router_jitter_noise": 0.1}, "router_jitter_noise 0.1"),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_a_config_minipar_cannot_represent_is_refused_in_one_line(case, tmp_path, capsys):
    change, needle = CONFIG_REFUSALS[case]
    gpt2 = case.startswith("gpt2")
    config = {k: v for k, v in {**(gpt2_config() if gpt2 else llama_config()), **change}.items() if v is not ...}
    src = write_hf(tmp_path / "hf", config, values(gpt2_tensors() if gpt2 else llama_tensors()))
    before = tree(tmp_path)
    err = refused(capsys, "from-hf", src, tmp_path / "ck")
    assert needle in err and "config.json" in err, err
    assert tree(tmp_path) == before


def corrupt_header(path):
    """The header says a tensor's bytes end past the file."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4
    text = json.dumps(header).encode().ljust(n)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def edit_index(d, fn):
    p = os.path.join(d, "model.safetensors.index.json")
    index = read_json(p)
    fn(index)
    with open(p, "w") as f:
        json.dump(index, f)


def tensor_case(case, d):
    """Spoil the (sharded, for the index cases) Llama directory d; -> the message's needle."""
    single = os.path.join(d, "model.safetensors")
    shard = os.path.join(d, "model-00002-of-00002.safetensors")
    t = values(llama_tensors())
    if case == "missing":
        del t["model.layers.1.mlp.up_proj.weight"]
        write_hf(d, llama_config(), t)
        return "lacks tensors of the model its config.json describes: model.layers.1.mlp.up_proj.weight"
    if case == "extra":
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(16, np.float32)
        write_hf(d, llama_config(), t)
        return "not parameters of minipar's LlamaForCausalLM: model.layers.0.self_attn.q_proj.bias"
    if case == "mis-shaped":                 # k_proj stored (in, out), minipar's way, not nn.Linear's
        k = "model.layers.0.self_attn.k_proj.weight"
        t[k] = np.ascontiguousarray(t[k].T)
        write_hf(d, llama_config(), t)
        return "tensor model.layers.0.self_attn.k_proj.weight has shape (16, 8), the model its config.json describes " \
               "needs (8, 16)"
    if case == "twice":
        t["layers.0.input_layernorm.weight"] = t["model.layers.0.input_layernorm.weight"]
        write_hf(d, llama_config(), t)
        return "holds layers.0.input_layernorm.weight twice"
    if case == "tied-head-differs":
        t = values(llama_tensors(tied=True))
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1
        write_hf(d, llama_config(tied=True), t)
        return "tie_word_embeddings is true but lm_head.weight is not model.embed_tokens.weight"
    if case == "integer":
        t["model.norm.weight"] = np.ones(16, np.int64)
        write_hf(d, llama_config(), t)
        return "tensor model.norm.weight is I64: minipar reads F64, F32, F16 and BF16 tensors"
    if case == "nan":
        t["model.layers.1.self_attn.v_proj.weight"][3, 4] = np.nan
        write_hf(d, llama_config(), t)
        return "tensor model.layers.1.self_attn.v_proj.weight holds NaN or inf"
    if case == "float64-too-big":
        t = values(llama_tensors(), np.float64)
        t["model.norm.weight"][0] = 1e300
        write_hf(d, llama_config(), t)
        return "beyond float32's range"
    if case == "header-lies":
        write_hf(d, llama_config(), t)
        corrupt_header(single)
        return "model.safetensors is not a valid safetensors file: Error while deserializing header"
    if case == "truncated":
        write_hf(d, llama_config(), t)
        os.truncate(single, os.path.getsize(single) - 10)
        return "model.safetensors is not a valid safetensors file"
    if case == "flax":
        write_hf(d, llama_config(), {})
        safetensors.numpy.save_file(t, single, metadata={"format": "flax"})
        return "was written by flax"
    if case == "both":
        write_hf(d, llama_config(), t)
        write_hf(d + "-2", llama_config(), t, shards=2)
        index = "model.safetensors.index.json"
        os.rename(os.path.join(d + "-2", index), os.path.join(d, index))
        return "holds both model.safetensors and model.safetensors.index.json"
    if case == "pickle-only":
        write_hf(d, llama_config(), t)
        os.rename(single, os.path.join(d, "pytorch_model.bin"))
        return "holds neither model.safetensors nor model.safetensors.index.json (it holds pytorch_model.bin: " \
               "minipar reads safetensors only"
    if case == "no-config":
        write_hf(d, llama_config(), t)
        os.unlink(os.path.join(d, "config.json"))
        return "config.json is missing"
    if case == "config-not-json":
        write_hf(d, llama_config(), t)
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write("{'vocab_size': 3")
        return "config.json cannot be read as JSON"
    write_hf(d, llama_config(), t, shards=2)
    if case == "index-missing-shard":
        os.unlink(shard)
        return "names model-00002-of-00002.safetensors, which is missing"
    if case == "index-outside":
        edit_index(d, lambda i: i["weight_map"].update({"model.norm.weight": "../model-00002-of-00002.safetensors"}))
        return "names '../model-00002-of-00002.safetensors' for model.norm.weight: a shard is a .safetensors file"
    if case == "index-wrong-file":
        edit_index(d, lambda i: i["weight_map"].update({"model.norm.weight": "model-00001-of-00002.safetensors"}))
        return "model.safetensors.index.json puts model.norm.weight in model-00001-of-00002.safetensors, which does not"
    if case == "index-unlisted":
        edit_index(d, lambda i: i["weight_map"].pop("model.norm.weight"))
        return "holds model.norm.weight, which model.safetensors.index.json does not put there"
    if case == "index-not-an-index":
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            f.write('{"weight_map": [1, 2]}')
        return "is not an index"
    raise AssertionError(case)


TENSOR_CASES = ["missing", "extra", "mis-shaped", "twice", "tied-head-differs", "integer", "nan", "float64-too-big",
                "header-lies", "truncated", "flax", "both", "pickle-only", "no-config", "config-not-json",
                "index-missing-shard", "index-outside", "index-wrong-file", "index-unlisted", "index-not-an-index"]


@pytest.mark.parametrize("case", TENSOR_CASES)
def test_bad_weight_files_are_refused_in_one_line(case, tmp_path, capsys):
    d = str(tmp_path / "hf")
    needle = tensor_case(case, d)
    flags = ["--dtype", "float32"] if case == "float64-too-big" else []
    before = tree(tmp_path)
    err = refused(capsys, "from-hf", d, tmp_path / "ck", *flags)
    assert needle in err, err
    assert tree(tmp_path) == before


def output_case(case, tmp_path, inp: str):
    """-> (the output path, the needle) of an output problem, made under tmp_path."""
    out = tmp_path / "out"
    if case == "non-empty":
        out.mkdir()
        (out / "thesis.tex").write_text("years of work")
        return out, "exists and is not empty (it holds thesis.tex): the converter writes only a new or empty folder"
    if case == "the-input":
        return inp, "is the input"
    if case == "inside-the-input":
        return os.path.join(inp, "sub"), "is inside the input"
    if case == "holds-the-input":
        return os.path.dirname(inp), "holds the input"
    if case == "fifo":
        os.mkfifo(out)
        return out, "exists and is a FIFO"
    if case == "device":
        return "/dev/null", "exists and is a device"
    if case == "file":
        out.write_text("notes")
        return out, "exists and is a file"
    if case == "link-to-empty-folder":
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", out)
        return out, "is a link (to"
    if case == "dangling-link":
        os.symlink(tmp_path / "nowhere", out)
        return out, "is a link (to"
    if case == "link-into-the-input":
        os.symlink(inp, tmp_path / "door")
        return tmp_path / "door" / "new", "is inside the input"
    if case == "no-parent":
        return tmp_path / "no" / "such" / "out", "does not exist"
    raise AssertionError(case)


OUTPUT_CASES = ["non-empty", "the-input", "inside-the-input", "holds-the-input", "fifo", "device", "file",
                "link-to-empty-folder", "dangling-link", "link-into-the-input", "no-parent"]


@pytest.fixture(scope="module")
def ready(tmp_path_factory):
    """A Llama directory and its converted checkpoint, shared by the output cases."""
    root = tmp_path_factory.mktemp("ready")
    hf = write_hf(root / "hf", llama_config(), values(llama_tensors()))
    cli.main(["from-hf", hf, str(root / "ck")])
    return hf, str(root / "ck")


@pytest.mark.parametrize("direction", ["from-hf", "to-hf"])
@pytest.mark.parametrize("case", OUTPUT_CASES)
def test_an_output_that_would_destroy_something_is_refused(case, direction, tmp_path, capsys, ready):
    inp = ready[0] if direction == "from-hf" else ready[1]
    capsys.readouterr()
    out, needle = output_case(case, tmp_path, inp)
    before, inputs = tree(tmp_path), tree(os.path.dirname(inp))
    err = refused(capsys, direction, inp, out)
    assert needle in err and str(out) in err, err
    assert tree(tmp_path) == before and tree(os.path.dirname(inp)) == inputs


@pytest.mark.parametrize("direction", ["from-hf", "to-hf"])
def test_an_empty_folder_is_written_into(direction, tmp_path, capsys, ready):
    (tmp_path / "out").mkdir()
    convert(capsys, direction, ready[0] if direction == "from-hf" else ready[1], tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["out"], os.listdir(tmp_path)      # no temporary folder left behind
    assert os.path.isfile(tmp_path / "out" / ("meta.json" if direction == "from-hf" else "config.json"))


def test_from_hf_refuses_a_leftover_beside_its_output(tmp_path, capsys, ready):
    (tmp_path / "ck.tmp").mkdir()
    (tmp_path / "ck.tmp" / "x").write_text("?")
    assert "ck.tmp exists" in refused(capsys, "from-hf", ready[0], tmp_path / "ck")
    assert not os.path.lexists(tmp_path / "ck")


def test_to_hf_refusals(tmp_path, capsys, ready):
    """A missing or corrupt checkpoint (the trainer's loader's message), a value beyond the new
    dtype's range, a size that is not one, a GPT-2 mixture of experts: one line, nothing written."""
    hf, ck = ready
    bad = tmp_path / "bad"
    os.makedirs(bad / "optim")
    for f in ("meta.json", "model.npz", "optim/rank-00000.npz", "MINIPAR-CHECKPOINT"):
        os.link(os.path.join(ck, f), bad / f)
    big = tmp_path / "big"
    state = model_npz(ck)
    state["norm.weight"] = state["norm.weight"] * 0 + 1e6
    meta = read_json(os.path.join(ck, "meta.json"))
    zeros = {n: np.zeros_like(a) for n, a in state.items()}
    checkpoint.save(str(big), state, checkpoint.full_shard([(n, a.shape) for n, a in state.items()],
                                                           {"step": 0, "m": zeros, "v": zeros}),
                    {k: v for k, v in meta.items() if k not in ("format", "optimizer")})
    moe = tmp_path / "moe"
    run_tiny("--steps", "1", "--moe-experts", "2", "--save", str(moe))
    llama = ["--arch", "llama", "--n-head", "4", "--moe-experts", "2", "--steps", "1"]
    shared, every2, switch1 = tmp_path / "shared", tmp_path / "every2", tmp_path / "switch1"
    run_tiny(*llama, "--moe-shared-experts", "1", "--save", str(shared))
    run_tiny(*llama, "--n-layer", "2", "--moe-every", "2", "--save", str(every2))
    run_tiny(*llama, "--moe-top-k", "1", "--moe-router", "switch", "--save", str(switch1))
    capsys.readouterr()
    cases = [((shared,), "moe_shared_experts 1: Mixtral has no shared experts"),
             ((every2,), "moe_every 2: Mixtral has experts in every block"),
             ((switch1,), "moe_router switch with moe_top_k 1"),((tmp_path / "nothing",), "checkpoint directory"),
             ((big, "--dtype", "float16"), "model.norm.weight holds values beyond float16's range (|x| up to 1e+06)"),
             ((ck, "--max-shard-size", "lots"), "--max-shard-size 'lots' is not a size"),
             ((moe,), "moe_experts 2: minipar's GPT-2 with a mixture of experts has no Hugging Face architecture")]
    for args, needle in cases:
        before = tree(tmp_path)
        err = refused(capsys, "to-hf", args[0], tmp_path / "out", *args[1:])
        assert needle in err, (args, err)
        assert tree(tmp_path) == before
    os.unlink(bad / "model.npz")
    (bad / "model.npz").write_bytes(b"not a zip")
    assert "model.npz is corrupt" in refused(capsys, "to-hf", bad, tmp_path / "out")
    assert not os.path.lexists(tmp_path / "out")


def test_sizes():
    assert safetensors_io.parse_size("5GB") == 5 * 10**9 and safetensors_io.parse_size("2GiB") == 2 * 2**30
    assert safetensors_io.parse_size("4kb") == 4000 and safetensors_io.parse_size("123") == 123
    t = {"a": np.zeros(10, np.float32), "b": np.zeros(20, np.float32), "c": np.zeros(5, np.float32)}
    assert safetensors_io.shards(t, 60) == [["a"], ["b"], ["c"]]        # b (80 bytes) alone: over the limit
    assert safetensors_io.shards(t, 100) == [["a"], ["b", "c"]]
    assert safetensors_io.shards(t, 120) == [["a", "b"], ["c"]]
    assert safetensors_io.shards(t, 10**9) == [["a", "b", "c"]]


def test_the_command_runs_as_a_module(tmp_path):
    """python -m minipar.convert, as a user runs it: a refusal is its one line and exit code 2."""
    import subprocess                                                     # noqa: PLC0415
    import sys                                                            # noqa: PLC0415
    p = subprocess.run([sys.executable, "-m", "minipar.convert", "from-hf", str(tmp_path / "none"),
                        str(tmp_path / "ck")], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    assert p.stderr == f"minipar.convert: error: input {tmp_path / 'none'} is not a folder: a Hugging Face " \
                       f"model directory is\n", p.stderr
