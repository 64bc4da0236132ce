"""minipar against Hugging Face transformers, in float64: logits, loss, every gradient and a few
AdamW steps, on a directory written by `python -m minipar.convert to-hf`.

    pip install torch --index-url https://download.pytorch.org/whl/cpu    # the CPU build (small)
    pip install -e '.[hf]'                                                # transformers, torch
    python scripts/compare_hf.py [--arch gpt2 llama mixtral] [--steps 3] [--checkpoint DIR]

For each family: a minipar model (random weights, norms and biases drawn too, or --checkpoint
DIR's, any layout's) is saved as a checkpoint and converted with to-hf; transformers'
GPT2LMHeadModel, LlamaForCausalLM or MixtralForCausalLM loads that directory with from_pretrained (float64, eager
attention), and both compute, on the same batch of the built-in corpus:

    logits (B, T, V); the loss, the mean cross-entropy over all B*T next-token targets;
    every parameter's gradient (Hugging Face's mapped back to minipar's names and layouts);
    --steps AdamW steps (minipar's AdamW against torch.optim.AdamW, weight decay on the
    tensors of two or more dimensions), the parameters compared after each.

The table gives each quantity's largest difference and largest value. Expected: GPT-2 agrees
to about 1e-12 (transformers computes it in float64 throughout); Llama to about 1e-7 of the
values' size, because stock transformers computes RMSNorm, the rotary tables and the attention
softmax in float32 even in a float64 model. The bfloat16 export (to-hf --dtype bfloat16) is
loaded too, and its tensors checked to be minipar's rounded. Exit code 1 when a difference
passes the family's tolerance. Not part of `make test`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ml_dtypes  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from minipar.convert import cli, hf_names  # noqa: E402
from minipar.model.gpt import GPT, GPTConfig, param_specs  # noqa: E402
from minipar.optim.adamw import AdamW  # noqa: E402
from minipar.train import checkpoint, data  # noqa: E402

SHAPES = {
    "gpt2": dict(arch="gpt2", vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64),
    "llama": dict(arch="llama", vocab_size=256, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                  ffn_hidden=160, rope_theta=10000.0, norm_eps=1e-5),
    "mixtral": dict(arch="llama", vocab_size=256, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                    ffn_hidden=96, rope_theta=10000.0, norm_eps=1e-5, moe_experts=4, moe_top_k=2),
}
TOLERANCE = {"gpt2": 1e-10, "llama": 1e-5, "mixtral": 1e-5}   # of the largest value, per quantity
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def random_state(cfg: GPTConfig, seed: int = 0) -> dict:
    """Every tensor drawn: weights N(0, 0.05), norm gains 1 + N(0, 0.1), biases N(0, 0.02)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape, init in param_specs(cfg):
        z = rng.standard_normal(shape)
        out[name] = 1 + 0.1 * z if init == "ones" else 0.02 * z if init == "zeros" else 0.05 * z
    return out


def write_checkpoint(d: str, cfg: GPTConfig, state: dict):
    zeros = {n: np.zeros_like(a) for n, a in state.items()}
    specs = [(n, a.shape) for n, a in state.items()]
    checkpoint.save(d, state, checkpoint.full_shard(specs, {"step": 0, "m": zeros, "v": zeros}),
                    {"config": cfg.to_dict(), "step": 0, "dtype": "float64", "precision": "fp32"})


def load_hf(d: str, dtype):
    """from_pretrained with eager attention (and, in transformers 5, eager experts: its grouped
    matrix products take no float64)."""
    try:                                              # transformers 5 says dtype, 4 torch_dtype
        return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="eager",
                                                                 experts_implementation="eager")
    except TypeError:
        return transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=dtype, attn_implementation="eager")


class Table:
    def __init__(self):
        self.rows, self.failed = [], []

    def add(self, arch: str, what: str, ours, theirs):
        ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
        diff, size = float(np.max(np.abs(ours - theirs))), float(np.max(np.abs(theirs)))
        ok = diff <= TOLERANCE[arch] * max(size, 1.0)
        self.rows.append((arch, what, diff, size, ok))
        if not ok:
            self.failed.append(f"{arch} {what}")

    def print(self):
        print(f"{'arch':6} {'quantity':58} {'max |diff|':>11} {'max |value|':>12}")
        for arch, what, diff, size, ok in self.rows:
            print(f"{arch:6} {what:58} {diff:11.2e} {size:12.3e}{'' if ok else '  <- over tolerance'}")


MOE = re.compile(r"layers\.(\d+)\.block_sparse_moe\.(gate|experts\.(\d+)\.(w[123]))\.weight")


def hf_tensor(params: dict, arch: hf_names.Architecture, name: str, grad: bool) -> np.ndarray:
    """Hugging Face's parameter (or its gradient) for minipar's `name`, in minipar's layout.
    transformers 5 holds a Mixtral block's experts fused in memory (it converts the files'
    w1/w2/w3 on loading): mlp.gate (E, C), mlp.experts.gate_up_proj (E, 2F, C) = [w1; w3] and
    mlp.experts.down_proj (E, C, F) = w2."""
    def read(hf_name):
        t = (params[hf_name].grad if grad else params[hf_name]).detach()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    if arch.hf_name(name) in params:
        a = read(arch.hf_name(name))
        return a.T if arch.is_transposed(name) else a
    i, what, e, w = MOE.fullmatch(name).groups()
    pre = f"model.layers.{i}.mlp."
    if what == "gate":
        return read(pre + "gate.weight").T
    e = int(e)
    if w == "w2":
        return read(pre + "experts.down_proj")[e].T
    gate_up = read(pre + "experts.gate_up_proj")[e]                 # (2F, C)
    F = gate_up.shape[0] // 2
    return (gate_up[:F] if w == "w1" else gate_up[F:]).T


def hf_grads(hf, arch: hf_names.Architecture, names) -> dict:
    """Hugging Face's gradients in minipar's names and layouts."""
    params = dict(hf.named_parameters())
    return {n: hf_tensor(params, arch, n, grad=True) for n in names}


def compare(family: str, steps: int, source: str | None, work: str, table: Table):
    if source:
        state, _, meta = checkpoint.load(source)
        cfg = GPTConfig(**{"arch": "gpt2", **meta["config"]}).validate()
        state = {n: a.astype(np.float64) for n, a in state.items()}
    else:
        cfg = GPTConfig(**SHAPES[family]).validate()
        state = random_state(cfg)
    name = family or cfg.arch
    ck, hf_dir = os.path.join(work, f"{name}-ck"), os.path.join(work, f"{name}-hf")
    write_checkpoint(ck, cfg, state)
    cli.main(["to-hf", ck, hf_dir])
    with open(os.path.join(hf_dir, "config.json")) as f:
        arch = hf_names.ARCHITECTURES[json.load(f)["architectures"][0]]
    hf = load_hf(hf_dir, torch.float64)
    hf.train()                                        # the dropouts are 0: train mode computes as eval
    model = GPT(cfg, dtype=np.float64)
    model.load_state_dict(state)
    names = [n for n, _ in model.named_parameters()]
    B, T = 4, cfg.block_size
    sampler = data.Sampler(data.load_tokens(None, T), T, B, seed=0)
    torch_params = dict(hf.named_parameters())
    decay = [p for p in torch_params.values() if p.ndim >= 2]
    rest = [p for p in torch_params.values() if p.ndim < 2]
    opt_hf = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                               lr=LR, betas=BETAS, eps=EPS)
    opt = AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    print(f"{cfg.arch}: {cfg.family.describe(cfg)} V={cfg.vocab_size} T={T}, "
          f"{'tied' if cfg.tie_embeddings else 'untied'}, batch {B} x {T}, {hf_dir} -> {type(hf).__name__}")
    for step in range(steps + 1):
        x, y = sampler.batch(step)
        model.zero_grad()
        opt_hf.zero_grad()
        loss = model(x, y)
        loss.backward()
        logits_hf = hf(input_ids=torch.from_numpy(x)).logits
        loss_hf = torch.nn.functional.cross_entropy(logits_hf.reshape(-1, cfg.vocab_size),
                                                    torch.from_numpy(y).reshape(-1))
        loss_hf.backward()
        tag = "" if step == 0 else f" after {step} AdamW step(s)"
        if step == 0:
            table.add(name, f"logits {tuple(logits_hf.shape)}", model(x).data, logits_hf.detach().numpy())
        table.add(name, "loss (mean over B*T targets)" + tag, loss.data, loss_hf.item())
        grads = hf_grads(hf, arch, names)
        if step == 0:
            for n, p in model.named_parameters():
                table.add(name, f"grad {n}", p.grad, grads[n])
        else:
            worst = max(names, key=lambda n: np.max(np.abs(model.params[n].grad - grads[n])))
            table.add(name, f"grads, worst: {worst}" + tag, model.params[worst].grad, grads[worst])
        if step == steps:
            break
        opt.step()
        opt_hf.step()
        ours = np.concatenate([model.params[n].data.ravel() for n in names])
        theirs = np.concatenate([hf_tensor(torch_params, arch, n, grad=False).ravel() for n in names])
        table.add(name, f"parameters after AdamW step {step + 1}", ours, theirs)
    bf16_dir = os.path.join(work, f"{name}-hf-bf16")
    cli.main(["to-hf", ck, bf16_dir, "--dtype", "bfloat16"])
    low = load_hf(bf16_dir, "auto")
    low_params = dict(low.named_parameters())
    same = all(np.array_equal(state[n].astype(ml_dtypes.bfloat16).astype(np.float32),   # minipar's layout both
                              hf_tensor(low_params, arch, n, grad=False)) for n in names)
    print(f"{cfg.arch}: from_pretrained({os.path.basename(bf16_dir)}): {type(low).__name__} in {low.dtype}, every "
          f"tensor minipar's rounded to bfloat16: {same}")
    if not same or low.dtype != torch.bfloat16:
        table.failed.append(f"{cfg.arch} bfloat16 export")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    p.add_argument("--steps", type=int, default=3, help="AdamW steps [%(default)s]")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="compare this checkpoint's model (its own family) instead of random ones")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    table = Table()
    print(f"minipar against transformers {transformers.__version__} (torch {torch.__version__}), float64, "
          f"eager attention")
    with tempfile.TemporaryDirectory() as work:
        for family in ([None] if args.checkpoint else args.arch):
            compare(family, args.steps, args.checkpoint, work, table)
    table.print()
    if table.failed:
        print(f"over tolerance: {', '.join(table.failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
