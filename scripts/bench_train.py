"""Benchmark full training steps (forward, backward, AdamW) in float32 on one BLAS thread.

    python scripts/bench_train.py [--steps N] [--configs small,medium,llama-small,llama-medium]

For each config it prints tokens/s and MFU = model FLOPs per second (median step) / the
float32 matmul peak that this same process measures between the steps (the median of
three measurements: same BLAS, same thread, same load). The configs run in one loop, a
step of each in turn, so a config and its twin are timed under the same load.
Model FLOPs per token are minipar.model.gpt.train_flops_per_token: 3x the forward matmuls.
Targets: MFU >= 0.40 on small, >= 0.60 on medium. The Llama configs (--arch llama: RMSNorm,
rotary positions, SwiGLU, grouped-query attention with 2 key/value heads) have their GPT-2
twin's shape and about its parameters (SwiGLU's width by Llama's rule, 8C/3 rounded up to a
multiple of 64); their target is the twin's MFU measured in the same run (when the twin runs
too), else the twin's target.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")        # before numpy loads its BLAS
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from minipar.model.gpt import GPT, GPTConfig, train_flops_per_token  # noqa: E402
from minipar.optim.adamw import AdamW  # noqa: E402
from minipar.plan.peak import keep_freed_memory, matmul_peak_flops  # noqa: E402

CONFIGS = {  # name: (L, H, C, T, B, MFU target, the family's fields)
    "small": (4, 4, 128, 64, 16, 0.40, {}),
    "medium": (6, 6, 384, 128, 8, 0.60, {}),
    "llama-small": (4, 4, 128, 64, 16, 0.40, dict(arch="llama", n_kv_head=2, multiple_of=64)),
    "llama-medium": (6, 6, 384, 128, 8, 0.60, dict(arch="llama", n_kv_head=2, multiple_of=64)),
}


def build(name):
    """The config's model, optimizer and one training step on a fixed batch."""
    L, H, C, T, B, target, family = CONFIGS[name]
    cfg = GPTConfig(vocab_size=256, block_size=T, n_layer=L, n_head=H, n_embd=C, **family)
    model = GPT(cfg, seed=0, dtype=np.float32)
    opt = AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (B, T)), rng.integers(0, 256, (B, T))

    def step():
        opt.zero_grad()
        model(x, y).backward()
        opt.step()

    shape = f"L={L} H={H} C={C} T={T} B={B}" + (f" Hkv={cfg.kv_heads} F={cfg.hidden}" if family else "")
    return dict(name=name, cfg=shape, params=model.num_params(), step=step, target=target,
                flops=train_flops_per_token(cfg, T) * B * T, tokens=B * T)


def bench(names, steps):
    """All configs in one loop, one step of each in turn, so that a config and its twin meet
    the same load; the peak is measured between rounds, three times, and shared."""
    runs = [build(name) for name in names]
    for r in runs:
        for _ in range(3):
            r["step"]()
        r["times"] = []
    peaks = []
    for i in range(steps):
        if i % max(1, steps // 3) == 0:
            peaks.append(matmul_peak_flops(np.float32))
        for r in runs:
            t0 = time.perf_counter()
            r["step"]()
            r["times"].append(time.perf_counter() - t0)
    peak = statistics.median(peaks)
    for r in runs:
        med, best = statistics.median(r["times"]), min(r["times"])
        r.update(ms=med * 1e3, tok_s=r["tokens"] / med, mfu=r["flops"] / med / peak,
                 mfu_best=r["flops"] / best / peak, peak=peak)
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per config (median reported)")
    ap.add_argument("--configs", default="small,medium,llama-small,llama-medium")
    args = ap.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or args.steps < 1:
        ap.error(f"--configs {args.configs!r}: unknown {unknown} (known: {','.join(CONFIGS)})" if unknown
                 else f"--steps {args.steps}: at least 1")
    keep_freed_memory()
    print(f"numpy {np.__version__}, float32, OMP/OPENBLAS threads = {os.environ['OPENBLAS_NUM_THREADS']}")
    hdr = (f"{'config':12s} {'shape':44s} {'params':>9s} {'ms/step':>8s} {'tok/s':>8s} {'peak GF/s':>9s} "
           f"{'MFU':>6s} {'best':>6s} {'target':>6s}")
    print(hdr)
    print("-" * len(hdr))
    runs = bench(names, args.steps)
    measured, ok = {r["name"]: r["mfu"] for r in runs}, True
    for r in runs:
        name = r["name"]
        twin = name.removeprefix("llama-")
        target = measured.get(twin, r["target"]) if name != twin else r["target"]   # the GPT-2 twin's MFU
        met = r["mfu"] >= target
        ok &= met
        print(f"{name:12s} {r['cfg']:44s} {r['params']:9,d} {r['ms']:8.1f} {r['tok_s']:8.0f} "
              f"{r['peak'] / 1e9:9.1f} {r['mfu']:6.3f} {r['mfu_best']:6.3f} {target:6.3f} {'ok' if met else 'MISSED'}")
    print("MFU = 3 x forward matmul FLOPs per step / median step time / measured fp32 matmul peak")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
