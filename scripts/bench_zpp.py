"""ZeRO++'s quantized messages against exact ZeRO-3, on a `make run`-sized training:

    python scripts/bench_zpp.py                       # the default model, 600 steps, 4 ranks: ~10 min on 2 cores
    python scripts/bench_zpp.py --steps 100 --out /tmp/zpp
    python scripts/bench_zpp.py --quick               # 2 layers, 30 steps: the smoke test

Two runs of `mpirun -n 4 python -m minipar.train --dp 4 --zero 3` on the same data and seed,
one exact and one with --qwz B --qgz B (int8 codes in blocks of B, default 256; --hpz beside
them when --hpz is given), each logged; then the table, and the loss curves of both drawn
on the same axes by `python -m minipar.plot` into --out (loss.svg, loss.png).

The table, every --every steps: each run's loss, their difference, and the difference
relative to the exact loss. Below it: the largest relative difference over the run, the
final losses, the bytes ZeRO sent per step (each run's ledger beside its formula: any ratio
but 1 exits 1), and their ratio, which is the point of ZeRO++. The distance is what
quantization costs this model; --verify judges a run with these flags at one code step,
1/127 relative (minipar/train/verify.py), and this is the distance over a whole training.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
QUICK = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "32"]


def train(out: str, name: str, flags: list[str], a) -> tuple[list[dict], dict]:
    log = os.path.join(out, f"{name}.jsonl")
    cmd = [os.path.join(os.path.dirname(sys.executable), "mpirun"), "-n", "4", sys.executable, "-m", "minipar.train",
           "--dp", "4", "--zero", "3", "--steps", str(a.steps), "--sample", "0", "--log", log, "--log-every",
           str(max(1, a.steps // 10)), *(QUICK if a.quick else []), *flags]
    print(f"# {name}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **ENV), stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=a.timeout)
    if p.returncode:
        sys.exit(f"bench_zpp: the {name} run failed (exit {p.returncode}): {(p.stderr.strip() or 'no output')[-500:]}")
    with open(log) as f:
        *rows, summary = [json.loads(line) for line in f]
    return rows, summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="[600; --quick 30]")
    ap.add_argument("--block", type=int, default=256, metavar="B", help="--qwz and --qgz block [256]")
    ap.add_argument("--hpz", action="store_true", help="--hpz too")
    ap.add_argument("--every", type=int, default=None, help="table rows every N steps [steps/10]")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "zpp"), help="logs and plots [runs/zpp]")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600)
    a = ap.parse_args(argv)
    a.steps = a.steps or (30 if a.quick else 600)
    if a.steps < 1 or a.block < 1 or not a.timeout > 0:
        ap.error(f"--steps {a.steps} and --block {a.block} must be >= 1, --timeout > 0")
    every = a.every or max(1, a.steps // 10)
    os.makedirs(a.out, exist_ok=True)
    zpp = ["--qwz", str(a.block), "--qgz", str(a.block)] + (["--hpz"] if a.hpz else [])
    exact, s_exact = train(a.out, "exact", [], a)
    quant, s_quant = train(a.out, "zeropp", zpp, a)
    label = f"qwZ+qgZ B={a.block}" + (" +hpZ" if a.hpz else "")
    print(f"ZeRO-3 on 4 ranks, exact and {label}: {a.steps} steps; loss every {every} steps")
    head = f"{'step':>5} {'exact':>9} {label:>16} {'diff':>10} {'rel':>9}"
    print(head + "\n" + "-" * len(head))
    rel = []
    for r, q in zip(exact, quant):
        d = q["loss"] - r["loss"]
        rel.append(abs(d) / abs(r["loss"]))
        if r["step"] % every == 0 or r["step"] == a.steps - 1:
            print(f"{r['step']:5d} {r['loss']:9.4f} {q['loss']:16.4f} {d:+10.4f} {rel[-1]:9.2e}")
    ze, zq = s_exact["zero"], s_quant["zero"]
    print(f"largest relative loss difference {max(rel):.3e} (step {rel.index(max(rel))}); mean {sum(rel) / len(rel):.3e}; "
          f"final losses {exact[-1]['loss']:.4f} exact, {quant[-1]['loss']:.4f} {label}")
    print(f"ZeRO bytes per step and rank: exact {ze['bytes_per_step']:,.0f} (formula {ze['theory_bytes_per_step']:,.0f}), "
          f"{label} {zq['bytes_per_step']:,.0f} (formula {zq['theory_bytes_per_step']:,.0f}): "
          f"{ze['bytes_per_step'] / zq['bytes_per_step']:.2f}x fewer")
    p = subprocess.run([sys.executable, "-m", "minipar.plot", os.path.join(a.out, "exact.jsonl"),
                        os.path.join(a.out, "zeropp.jsonl"), "--label", "exact ZeRO-3", label, "--out", a.out],
                       cwd=ROOT, capture_output=True, text=True)
    print(f"loss curves: {os.path.join(a.out, 'loss.svg')}" if p.returncode == 0 else
          f"(no plots: {(p.stderr.strip() or p.stdout.strip()).splitlines()[-1]})")
    if ze["bytes_per_step"] != ze["theory_bytes_per_step"] or zq["bytes_per_step"] != zq["theory_bytes_per_step"]:
        sys.exit("bench_zpp: a run's bytes differ from its formula")


if __name__ == "__main__":
    main()
