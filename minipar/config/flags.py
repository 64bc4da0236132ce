"""What a run is asked to do: the trainer's flags (docs/design.md §7), their defaults, and the
checks on them that need nothing but the flags themselves (ConfigError: one line naming the
values, exit 2). Both the trainer and the planner read them. The checks that read files (the
checkpoint, the data, the outputs) are the trainer's set-up: minipar/train/setup.py.
"""
from __future__ import annotations

import argparse
import math

import numpy as np

from minipar.optim import mixed_precision
from minipar.model.config import ROUTERS
from minipar.model.gpt import GPTConfig
from minipar.parallel.pipeline import schedules
from minipar.parallel.context.context_parallel import IMPLS as CP_IMPLS
from minipar.parallel.context.ring_attention import LAYOUTS
from minipar.parallel.context.ulysses import head_split

MODEL_DEFAULTS = dict(arch="gpt2", n_layer=4, n_head=4, n_embd=128, block_size=64,
                      moe_experts=0, moe_top_k=2, moe_every=1, moe_capacity_factor=0.0,
                      n_kv_head=0, ffn_hidden=0, ffn_multiplier=1.0, multiple_of=256, norm_eps=1e-5,
                      rope_theta=10000.0, moe_router=None, moe_shared_experts=0, moe_ffn_hidden=0)
LLAMA_ONLY = ("n_kv_head", "ffn_multiplier", "multiple_of", "rope_theta", "moe_shared_experts", "moe_ffn_hidden")
DTYPES = {"float32": np.float32, "float64": np.float64}


class ConfigError(ValueError):
    """Bad flags: reported as one line, exit code 2. quiet: another rank reports it.
    agreed: every rank already knows of it (agree_on_errors), so none needs aborting."""

    def __init__(self, msg, quiet=False):
        super().__init__(msg)
        self.quiet = quiet
        self.agreed = False

    @classmethod
    def everywhere(cls, msg, rank: int) -> "ConfigError":
        """An error every rank finds by itself from what all know (the hosts, after the grid):
        agreed without a message, and said once, by rank 0."""
        e = cls(msg, quiet=rank != 0)
        e.agreed = True
        return e


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        # allow_abbrev=False: a renamed flag must not match a prefix
        prog="python -m minipar.train", allow_abbrev=False,
        description="Train a small GPT-2 on a NumPy autograd engine, on one process or across "
                    "MPI ranks: mpirun -n 4 python -m minipar.train")
    g = p.add_argument_group("layout (world = dp * cp * tp * pp)")
    g.add_argument("--dp", type=int, metavar="D",
                   help="data-parallel replicas [world / (cp*tp*pp)]")
    g.add_argument("--cp", type=int, default=1, metavar="C",
                   help="context parallelism: each sequence split over C ranks, attention as --cp-impl "
                        "says; --block-size must divide by 2C, and with --sp T/C by --tp "
                        "(docs/context-parallel.md) [%(default)s]")
    g.add_argument("--cp-layout", choices=LAYOUTS, default=None,
                   help="--cp: which tokens each rank keeps, chunks i and 2C-1-i of 2C (zigzag: the "
                        "same causal work on every rank) or chunks 2i, 2i+1 [zigzag]")
    g.add_argument("--cp-impl", choices=CP_IMPLS, default=None,
                   help="--cp: how attention sees the whole sequence: ring (K, V passed round the cp "
                        "ranks), ulysses (an all-to-all from sequence shards to head shards and back: "
                        "cp must divide the heads of a tp rank), allgather (every rank gathers all "
                        "of K and V) or hybrid (Ulysses inside groups of --cp-ulysses ranks, the ring "
                        "across them) (docs/context-parallel.md) [ring]")
    g.add_argument("--cp-ulysses", type=int, default=None, metavar="U",
                   help="--cp-impl hybrid: Ulysses over U consecutive cp ranks (U divides --cp), the ring "
                        "over the --cp/U groups [the cp ranks of a host]")
    g.add_argument("--tp", type=int, default=1, metavar="T",
                   help="tensor-parallel ranks [%(default)s]")
    g.add_argument("--sp", action="store_true",
                   help="sequence parallelism inside the tp group: the norms, residual stream and "
                        "embeddings split along the sequence, which --tp must divide "
                        "(docs/sequence-parallel.md)")
    g.add_argument("--pp", type=int, default=1, metavar="P", help="pipeline stages [%(default)s]")
    g.add_argument("--ep", type=int, default=1, metavar="P",
                   help="expert parallelism: the MoE experts split over groups of P dp ranks, tokens "
                        "sent to them by all-to-all; P divides dp and --moe-experts (docs/moe.md) [%(default)s]")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, metavar="{0,1,2,3}",
                   help="ZeRO stage over the dp group: shard the optimizer state (1), and the "
                        "gradients (2), and the parameters (3); 0: plain data parallelism "
                        "[%(default)s]")
    g.add_argument("--shard-group", type=shard_group_value, nargs="?", const="host", default=None,
                   metavar="S|host",
                   help="--zero: hybrid sharding, ZeRO inside groups of S consecutive dp x cp ranks "
                        "(S divides dp x cp; host, or the flag alone: the ranks of a host), the shards replicated "
                        "across the groups and their gradients all-reduced across them once a "
                        "step (docs/zero.md) [all dp x cp ranks: flat ZeRO]")
    g.add_argument("--prefetch", type=int, default=None, metavar="K",
                   help="--zero 3: start the all-gathers of the next K blocks when a block's is "
                        "waited for, so that they travel while it computes (forward and backward) "
                        "[0]")
    g.add_argument("--reshard-after-forward", choices=("on", "off"), default=None,
                   help="--zero 3: release a block's gathered parameters after its forward (on), or "
                        "keep them until its backward (off: the whole model gathered at the end of "
                        "forward, and no all-gather in backward) [on]")
    g.add_argument("--qwz", type=int, default=None, metavar="B",
                   help="--zero 3, ZeRO++: all-gather the weights as int8 codes with a float32 scale "
                        "per block of B (docs/zero.md) [off]")
    g.add_argument("--qgz", type=int, default=None, metavar="B",
                   help="--zero 3, ZeRO++: reduce the gradients as int8 blocks of B by an all-to-all "
                        "inside the host, then across, instead of the reduce-scatter [off]")
    g.add_argument("--hpz", action="store_true",
                   help="--zero 3, ZeRO++: keep a secondary copy of the weights sharded inside the host, "
                        "so that backward's all-gathers stay on the host")
    g.add_argument("--dp-mode", choices=("bucketed", "naive"),
                   help="--zero 0: gradient all-reduce per bucket during backward, "
                        "or per parameter "
                        "after [bucketed]")
    g.add_argument("--bucket-mb", type=float, metavar="X",
                   help="--zero 0, bucketed: bucket size in MiB [1.0]")
    g.add_argument("--schedule", choices=tuple(schedules.SCHEDULES), default="1f1b",
                   help="pipeline schedule with --pp > 1: interleaved needs --virtual-stages, "
                        "zb-h1/zb-h2 split each backward into B and W (docs/pipeline.md) [%(default)s]")
    g.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="--schedule interleaved: model chunks per pipeline rank [%(default)s]")
    g.add_argument("--verify", action="store_true",
                   help="re-run the same steps on one process and compare "
                        "(exit 1 beyond tolerance)")
    g.add_argument("--dry-run", action="store_true",
                   help="check the flags, the layout, any checkpoint and the data, print the run's "
                        "description, and exit 0 without training or writing anything")
    m = p.add_argument_group(
        "model (unset: the checkpoint's value on --resume, else the default shown)")
    d = MODEL_DEFAULTS
    add_family_arguments(m)
    m.add_argument("--n-layer", type=int, metavar="L", help=f"transformer blocks [{d['n_layer']}]")
    m.add_argument("--n-head", type=int, metavar="H", help=f"attention heads [{d['n_head']}]")
    m.add_argument("--n-embd", type=int, metavar="C",
                   help=f"channels, divisible by H [{d['n_embd']}]")
    m.add_argument("--block-size", type=int, metavar="T",
                   help=f"context length [{d['block_size']}]")
    add_tie_arguments(m)
    add_moe_arguments(m)
    t = p.add_argument_group("training")
    t.add_argument("--moe-aux-coef", type=float, default=0.01, metavar="A",
                   help="MoE: weight of the load-balancing loss (Switch Transformer) [%(default)s]")
    t.add_argument("--moe-z-coef", type=float, default=0.0, metavar="Z",
                   help="MoE: weight of the router z-loss [%(default)s]")
    t.add_argument("--batch-size", type=int, metavar="B", default=16,
                   help="global batch B, in sequences [%(default)s]")
    t.add_argument("--micro-batches", type=int, metavar="M", default=1,
                   help="gradient accumulation: B is split into M [%(default)s]")
    t.add_argument("--steps", type=int, metavar="S", default=600,
                   help="the step number the run ends at (steps count from 0) [%(default)s]")
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate [%(default)s]")
    t.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                   help="[%(default)s]")
    t.add_argument("--warmup", type=int, default=20, help="linear warm-up steps [%(default)s]")
    t.add_argument("--min-lr", type=float, default=1e-4, help="cosine decays to this [%(default)s]")
    t.add_argument("--weight-decay", type=float, default=0.1, help="[%(default)s]")
    t.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the global gradient norm; 0 disables [%(default)s]")
    t.add_argument("--seed", type=int,
                   help="seeds init and data sampling [0; on --resume the checkpoint's]")
    t.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="[%(default)s]")
    t.add_argument("--precision", choices=tuple(mixed_precision.PRECISIONS), default="fp32",
                   help="fp16/bf16: 2-byte parameters, gradients and activations, fp32 compute and "
                        "master weights (needs --dtype float32) [%(default)s]")
    t.add_argument("--loss-scale", type=float, metavar="S",
                   help="fp16: initial loss scale of the dynamic scaler [65536 = 2^16]")
    t.add_argument("--loss-scale-window", type=int, metavar="N",
                   help="fp16: clean steps in a row before the scaler doubles its scale "
                        "(Megatron's --loss-scale-window, PyTorch's growth_interval) [2000]")
    t.add_argument("--max-skipped-steps", type=int, default=50, metavar="N",
                   help="fp16/bf16: stop the run (exit code 3) after more than N skipped steps in a row "
                        "(docs/debugging.md) [%(default)s]")
    t.add_argument("--min-loss-scale", type=float, default=1.0, metavar="S",
                   help="fp16: stop the run (exit code 3) when the loss scale falls below S "
                        "(Megatron's --min-loss-scale) [%(default)s]")
    t.add_argument("--max-memory", metavar="SIZE",
                   help="refuse a layout whose planned peak per rank is larger (8GiB, 512MiB, 2e9) "
                        "[this machine's memory / the ranks on it]")
    io = p.add_argument_group("data, checkpoints, output")
    io.add_argument("--data", metavar="FILE",
                    help="UTF-8 text to train on (default: the built-in corpus)")
    io.add_argument("--save", metavar="DIR",
                    help="write a checkpoint here at the end (and every --save-every)")
    io.add_argument("--save-every", type=int, default=0, metavar="N",
                    help="also checkpoint every N steps [%(default)s]")
    io.add_argument("--resume", metavar="DIR", help="continue exactly from this checkpoint")
    io.add_argument("--log", metavar="FILE.jsonl",
                    help="one JSON object per step, then a summary object")
    io.add_argument("--timeline", metavar="FILE.svg",
                    help="with --pp: draw the last step's pipeline timeline")
    t.add_argument("--attention", choices=("plain", "tiled"), default="plain",
                   help="how each process computes attention: plain (every score of a head at once, "
                        "T x T) or tiled (FlashAttention-2's blocks with an online softmax, no T x T array: "
                        "minipar/autograd/tiled_attention.py); --verify's twin attends plainly [%(default)s]")
    t.add_argument("--attn-block", type=int, default=None, metavar="B",
                   help="--attention tiled: queries and keys per block [32]")
    t.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                    help="activation recomputation: selective keeps all but the attention "
                         "softmax, full only each block's input (docs/recompute.md) [%(default)s]")
    io.add_argument("--trace", metavar="FILE.json",
                    help="every rank's spans and messages, for Perfetto or chrome://tracing "
                         "(docs/pictures.md)")
    io.add_argument("--eval-every", type=int, default=0, metavar="N",
                    help="also measure the validation loss every N steps (log rows' val_loss) "
                         "[0: at the end only]")
    io.add_argument("--log-every", type=int, default=0, metavar="N",
                    help="progress line every N steps (0: about 20 lines per run)")
    io.add_argument("--sample", type=int, default=200, metavar="N",
                    help="bytes of text to generate at the end [%(default)s]")
    return p


def add_family_arguments(group):
    """The model family and the Llama family's shape flags (the trainer's and the planner's)."""
    d = MODEL_DEFAULTS
    group.add_argument("--arch", choices=("gpt2", "llama"),
                       help=f"the model family: GPT-2, or Llama (RMSNorm, rotary positions, SwiGLU, "
                            f"grouped-query attention, no biases; docs/llama.md) [{d['arch']}]")
    group.add_argument("--n-kv-head", type=int, metavar="K",
                       help="llama: key/value heads, dividing --n-head (1: multi-query) [--n-head]")
    group.add_argument("--ffn-hidden", type=int, metavar="F",
                       help="the MLP's width [gpt2: 4C; llama: Llama's rule from --ffn-multiplier and --multiple-of]")
    group.add_argument("--ffn-multiplier", type=float, metavar="X",
                       help=f"llama: ffn_dim_multiplier of Llama's rule, F = multiple-of x ceil(X int(8C/3) / "
                            f"multiple-of) [{d['ffn_multiplier']}]")
    group.add_argument("--multiple-of", type=int, metavar="N",
                       help=f"llama: Llama's rule rounds F up to a multiple of N [{d['multiple_of']}]")
    group.add_argument("--rope-theta", type=float, metavar="THETA",
                       help=f"llama: the rotary embedding's base (Llama 3: 500000) [{d['rope_theta']:g}]")
    group.add_argument("--norm-eps", type=float, metavar="EPS",
                       help=f"the epsilon of LayerNorm (gpt2) or RMSNorm (llama) [{d['norm_eps']:g}]")


def add_tie_arguments(group):
    t = group.add_mutually_exclusive_group()
    t.add_argument("--untied", action="store_true",
                   help="a separate lm_head.weight instead of the token embedding's transpose [llama's default]")
    t.add_argument("--tied", action="store_true",
                   help="the logits use the token embedding's transpose [gpt2's default]")


def resolve_model(args, meta: dict | None) -> GPTConfig:
    """Explicit flag > checkpoint > default; a flag that contradicts the checkpoint is an error
    (an --arch among them)."""
    saved = (meta or {}).get("config", {})
    if meta is not None:
        saved = {"arch": "gpt2", **saved}        # a checkpoint from before the families is GPT-2's
    values = {}
    for key, default in MODEL_DEFAULTS.items():
        flag = getattr(args, key)
        if flag is not None and key in saved and flag != saved[key]:
            raise ConfigError(f"--{key.replace('_', '-')} {flag} does not match the checkpoint "
                              f"{args.resume} ({key} = {saved[key]})")
        values[key] = flag if flag is not None else saved.get(key, default)
    tied = True if args.tied else False if args.untied else None          # None: the family's default
    if meta is not None:
        was = saved.get("tie_embeddings", True)
        if tied is not None and tied != was:
            raise ConfigError(f"--{'tied' if tied else 'untied'} does not match the checkpoint {args.resume} "
                              f"({'tied' if was else 'untied'} embeddings)")
        tied = was
    # the byte tokenizer's 256, or a checkpoint's own vocabulary (a converted model's: minipar.convert)
    return GPTConfig(vocab_size=int(saved.get("vocab_size", 256)), tie_embeddings=tied, **values)


def check_family(args, cfg: GPTConfig):
    """The family's flags: the Llama ones only with --arch llama, each in its range, and the
    shape the family can build (its heads, its rotary pairs)."""
    if cfg.arch == "gpt2":
        given = [f for f in LLAMA_ONLY if getattr(args, f, None) is not None]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} is a setting of the Llama family: it needs --arch llama")
        if args.ffn_hidden is not None and args.ffn_hidden != 4 * cfg.n_embd:
            raise ConfigError(f"--ffn-hidden {args.ffn_hidden}: GPT-2's MLP is 4 x --n-embd = {4 * cfg.n_embd} wide "
                              f"(another width needs --arch llama)")
    if cfg.n_kv_head < 0 or (cfg.n_kv_head and cfg.n_head % cfg.n_kv_head):
        raise ConfigError(f"--n-kv-head {cfg.n_kv_head} must divide --n-head {cfg.n_head} (each key/value head "
                          f"serves n_head/n_kv_head query heads)")
    if cfg.ffn_hidden < 0:
        raise ConfigError(f"--ffn-hidden {cfg.ffn_hidden} must be >= 1 (0: the family's rule)")
    if cfg.multiple_of < 1:
        raise ConfigError(f"--multiple-of {cfg.multiple_of} must be >= 1")
    for flag, v, low in (("norm_eps", cfg.norm_eps, 0.0), ("rope_theta", cfg.rope_theta, 1.0),
                         ("ffn_multiplier", cfg.ffn_multiplier, 0.0)):
        if not v > low:
            raise ConfigError(f"--{flag.replace('_', '-')} must be > {low:g}, got {v}")
    try:
        cfg.family.check(cfg)
    except ValueError as e:
        raise ConfigError(f"--arch {cfg.arch}: {e}") from None


def shard_group_value(text: str):
    """--shard-group's value: "host", or a whole number of ranks (argparse's type)."""
    if text.strip().lower() == "host":
        return "host"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of ranks or 'host', got {text!r}") from None


def check_shard_group(args, grad_ranks: int):
    """--shard-group needs --zero; a number of ranks must be >= 1 and divide the dp x cp
    ranks ZeRO shards over (grad_ranks). "host" is checked once the hosts are known
    (zero.hybrid.host_shard_size)."""
    S = args.shard_group
    if S is None:
        return
    if not args.zero:
        raise ConfigError(f"--shard-group {S} is how ZeRO shards: it needs --zero 1, 2 or 3")
    if S != "host" and (S < 1 or grad_ranks % S):
        raise ConfigError(f"--shard-group {S} must be a whole number >= 1 that divides the {grad_ranks} dp x cp "
                          f"ranks ZeRO shards over")


def resolve_gathers(args) -> tuple[int, bool]:
    """--prefetch and --reshard-after-forward belong to ZeRO-3's gathers: refused without
    --zero 3, K >= 0. -> (prefetch, reshard_after_forward); args is not changed."""
    for flag, v in (("--prefetch", args.prefetch), ("--reshard-after-forward", args.reshard_after_forward)):
        if v is not None and args.zero != 3:
            raise ConfigError(f"{flag} {v} is about ZeRO-3's all-gathers of the parameters: it needs --zero 3, "
                              f"got --zero {args.zero}")
    K = 0 if args.prefetch is None else args.prefetch
    if K < 0:
        raise ConfigError(f"--prefetch must be a whole number >= 0 of blocks gathered ahead, got {K}")
    return K, args.reshard_after_forward != "off"


MAX_QUANT_BLOCK = 1 << 20


def resolve_zpp(args) -> tuple[int, bool, int]:
    """ZeRO++'s flags: ZeRO-3 only; block sizes whole numbers 1..2^20; --hpz serves backward's
    all-gathers, which --reshard-after-forward off does not make. -> (qwz, hpz, qgz), 0 off."""
    given = [f for f, v in (("--qwz", args.qwz), ("--qgz", args.qgz), ("--hpz", args.hpz or None)) if v is not None]
    if given and args.zero != 3:
        raise ConfigError(f"{given[0]} is ZeRO++, which shrinks ZeRO-3's messages: it needs --zero 3, got "
                          f"--zero {args.zero}")
    for flag, B in (("--qwz", args.qwz), ("--qgz", args.qgz)):
        if B is not None and not 1 <= B <= MAX_QUANT_BLOCK:
            raise ConfigError(f"{flag} {B}: the quantization block must be a whole number from 1 to "
                              f"{MAX_QUANT_BLOCK} (each block of B numbers shares one float32 scale)")
    if args.hpz and args.reshard_after_forward in (False, "off"):
        raise ConfigError("--hpz keeps a host-local copy for backward's all-gathers; --reshard-after-forward off "
                          "keeps the weights gathered and makes none")
    return args.qwz or 0, bool(args.hpz), args.qgz or 0


def check_numbers(args):
    """Every number a flag gives is finite: NaN passes every `<= 0` check (NaN is not > 0, nor
    <= 0), and inf every upper bound."""
    for name, v in vars(args).items():
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {v}")


def validate(args, cfg: GPTConfig):
    for flag in ("n_layer", "n_head", "n_embd", "block_size"):
        if getattr(cfg, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, "
                              f"got {getattr(cfg, flag)}")
    for flag in ("batch_size", "micro_batches", "steps"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, "
                              f"got {getattr(args, flag)}")
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"--n-embd {cfg.n_embd} is not divisible by --n-head {cfg.n_head}")
    check_family(args, cfg)
    if args.batch_size % args.micro_batches:
        raise ConfigError(f"--batch-size {args.batch_size} is not divisible by "
                          f"--micro-batches {args.micro_batches}")
    if args.lr <= 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}")
    if args.max_skipped_steps < 1:
        raise ConfigError(f"--max-skipped-steps must be >= 1, got {args.max_skipped_steps}")
    if args.min_loss_scale <= 0:
        raise ConfigError(f"--min-loss-scale must be > 0, got {args.min_loss_scale}")
    if args.precision == "fp16" and args.loss_scale is not None and 0 < args.loss_scale < args.min_loss_scale:
        raise ConfigError(f"--loss-scale {args.loss_scale:g} is below --min-loss-scale {args.min_loss_scale:g}: "
                          f"the run would stop at its first skipped step")
    for flag in ("min_lr", "grad_clip", "warmup", "save_every", "weight_decay", "seed", "log_every",
                 "sample", "eval_every"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.precision != "fp32" and args.dtype != "float32":
        raise ConfigError(f"--precision {args.precision} needs --dtype float32 "
                          f"(its master weights and "
                          f"optimizer state are float32), got --dtype {args.dtype}")
    if args.loss_scale is not None:
        if args.precision != "fp16":
            raise ConfigError(
                f"--loss-scale is for --precision fp16 (got --precision {args.precision}: "
                f"{'bf16 needs no loss scaling' if args.precision == 'bf16' else 'no scaling'})")
        if not (math.isfinite(args.loss_scale) and args.loss_scale > 0):
            raise ConfigError(f"--loss-scale must be a finite number > 0, got {args.loss_scale}")
    if args.loss_scale_window is not None:
        if args.precision != "fp16":
            raise ConfigError(f"--loss-scale-window is for --precision fp16 (got --precision {args.precision})")
        if args.loss_scale_window < 1:
            raise ConfigError(f"--loss-scale-window must be >= 1, got {args.loss_scale_window}")


def check_split(cfg: GPTConfig | None, dp: int, tp: int, pp: int, batch_size: int,
                micro_batches: int):
    """Can the model and the batch be cut this way? (The trainer and the planner both ask.)
    cfg None: the model's shape is unknown, only the batch is checked."""
    if cfg is not None and pp > cfg.n_layer:
        raise ConfigError(f"--pp {pp} is more than --n-layer {cfg.n_layer}: "
                          f"every pipeline stage needs "
                          f"at least one layer")
    if cfg is not None and cfg.n_head % tp:
        raise ConfigError(f"--n-head {cfg.n_head} is not divisible by --tp {tp}: "
                          f"each tensor-parallel "
                          f"rank needs whole heads")
    if cfg is not None and cfg.hidden % tp:
        raise ConfigError(f"the MLP's width {cfg.hidden} (--ffn-hidden, or the family's rule) is not divisible by "
                          f"--tp {tp}: each tensor-parallel rank needs an equal share of its columns")
    if cfg is not None and cfg.kv_heads % tp and tp % cfg.kv_heads:
        raise ConfigError(f"--n-kv-head {cfg.kv_heads} and --tp {tp}: tensor parallelism needs --tp to divide "
                          f"--n-kv-head (each rank its own key/value heads) or --n-kv-head to divide --tp (each "
                          f"key/value head held by tp/n_kv_head ranks)")
    if batch_size % (dp * micro_batches):
        raise ConfigError(f"--batch-size {batch_size} is not divisible by dp*micro-batches = "
                          f"{dp}*{micro_batches} = {dp * micro_batches}")


def check_schedule(cfg: GPTConfig | None, pp: int, schedule: str, virtual: int, micro_batches: int):
    """--schedule and --virtual-stages: can this pipeline run them? (the trainer and the planner)"""
    if virtual < 1:
        raise ConfigError(f"--virtual-stages must be >= 1, got {virtual}")
    if virtual > 1 and schedule != "interleaved":
        raise ConfigError(f"--virtual-stages {virtual} is for --schedule interleaved, not {schedule}")
    if virtual > 1 and pp == 1:
        raise ConfigError(f"--virtual-stages {virtual} cuts a pipeline's stages into chunks: it needs --pp > 1")
    if schedule != "interleaved" or pp == 1:
        return
    if micro_batches % pp:
        raise ConfigError(f"--schedule interleaved takes micro-batches in groups of --pp {pp}: "
                          f"--micro-batches {micro_batches} is not a multiple of {pp}")
    if cfg is not None and cfg.n_layer < pp * virtual:
        raise ConfigError(f"--schedule interleaved cuts the layers into --pp x --virtual-stages = "
                          f"{pp} x {virtual} = {pp * virtual} chunks: --n-layer {cfg.n_layer} is too few")


def check_sequence_split(cfg: GPTConfig | None, tp: int, sp: bool):
    """--sp splits every sequence into tp pieces: the sequence length must divide (no padding)."""
    if sp and cfg is not None and cfg.block_size % tp:
        raise ConfigError(f"--sp splits each sequence over --tp {tp}: --block-size "
                          f"{cfg.block_size} is not divisible by {tp}")


def add_moe_arguments(group, capacity_note: str = "later assignments dropped; 0: no dropping"):
    """The mixture-of-experts model flags (the trainer's and the planner's)."""
    d = MODEL_DEFAULTS
    group.add_argument("--moe-experts", type=int, metavar="E",
                       help=f"mixture of experts: E expert MLPs and a router in MoE blocks; 0: none "
                            f"(docs/moe.md) [{d['moe_experts']}]")
    group.add_argument("--moe-top-k", type=int, metavar="K", help=f"experts per token [{d['moe_top_k']}]")
    group.add_argument("--moe-every", type=int, metavar="N",
                       help=f"block i is a MoE block when (i + 1) %% N == 0 [{d['moe_every']}]")
    group.add_argument("--moe-capacity-factor", type=float, metavar="F",
                       help=f"slots per expert ceil(F x tokens x K / E) per routing group (a dp rank's "
                            f"micro-batch); {capacity_note} [{d['moe_capacity_factor']}]")
    group.add_argument("--moe-router", choices=ROUTERS,
                       help="the load-balancing loss: switch (per MoE layer, Switch Transformer's) or mixtral "
                            "(pooled over every MoE layer, Mixtral's; its weights always renormalised) "
                            "[gpt2: switch, llama: mixtral]")
    group.add_argument("--moe-shared-experts", type=int, metavar="S",
                       help=f"llama: experts every token goes through besides its K routed ones (DeepSeekMoE) "
                            f"[{d['moe_shared_experts']}]")
    group.add_argument("--moe-ffn-hidden", type=int, metavar="F",
                       help="llama: each expert's width; smaller than the MLP's makes fine-grained experts "
                            "(DeepSeekMoE) [the MLP's]")


def check_context_split(cfg: GPTConfig | None, args) -> str:
    """--cp cuts every sequence into 2 x cp chunks (no padding); --cp-layout needs --cp > 1;
    with --sp the tp ranks split each cp rank's T/cp tokens, so tp must divide them.
    -> --cp-layout, zigzag when not given (args is not changed)."""
    cp = args.cp
    if args.cp_layout is not None and cp == 1:
        raise ConfigError(f"--cp-layout {args.cp_layout} places the tokens of a cp group: it needs --cp > 1")
    cp_layout = args.cp_layout or "zigzag"
    if cp == 1:
        return cp_layout
    if cfg is not None and cfg.block_size % (2 * cp):
        raise ConfigError(f"--cp {cp} cuts each sequence into 2 x cp = {2 * cp} chunks: --block-size "
                          f"{cfg.block_size} is not divisible by {2 * cp}")
    tp = getattr(args, "tp", 1)
    if args.sp and tp > 1 and cfg is not None and (cfg.block_size // cp) % tp:
        raise ConfigError(f"--sp splits each cp rank's {cfg.block_size // cp} tokens (--block-size "
                          f"{cfg.block_size} / --cp {cp}) over --tp {tp}: {cfg.block_size // cp} is not "
                          f"divisible by {tp}")
    return cp_layout


def resolve_attention(args) -> int | None:
    """--attn-block belongs to --attention tiled and is >= 1; tiled attention is one process's
    (not --cp, whose ranks attend by their own implementation). -> the block size (None with
    plain attention); args is not changed."""
    if args.attn_block is not None and args.attention != "tiled":
        raise ConfigError(f"--attn-block {args.attn_block} is the block size of --attention tiled, "
                          f"got --attention {args.attention}")
    block = 32 if args.attn_block is None else args.attn_block
    if block < 1:
        raise ConfigError(f"--attn-block must be a whole number >= 1 of queries and keys, got {block}")
    if args.attention == "tiled" and args.cp > 1:
        raise ConfigError(f"--attention tiled is how one process attends: --cp {args.cp} attends as "
                          f"--cp-impl says")
    return block if args.attention == "tiled" else None


def check_cp_impl(cfg: GPTConfig, args, tp: int) -> str:
    """--cp-impl needs --cp > 1; ulysses gives each cp rank whole query heads and whole key and
    value heads of its tp rank's (ulysses.head_split). -> the implementation, ring when not
    given (args is not changed)."""
    impl = args.cp_impl or "ring"
    if args.cp_impl is not None and args.cp == 1:
        raise ConfigError(f"--cp-impl {args.cp_impl} is how a cp group attends: it needs --cp > 1")
    U = args.cp if impl == "ulysses" else args.cp_ulysses
    if args.cp_ulysses is not None and impl != "hybrid":
        raise ConfigError(f"--cp-ulysses {args.cp_ulysses} is the Ulysses degree of --cp-impl hybrid, "
                          f"not of --cp-impl {impl}")
    if U is not None and args.cp > 1:
        if U < 1 or args.cp % U:
            raise ConfigError(f"--cp-ulysses {U} must divide --cp {args.cp}")
        try:
            head_split(cfg.n_head // tp, max(1, cfg.kv_heads // tp), U)
        except ValueError as e:
            raise ConfigError(f"{e} (--n-head {cfg.n_head}, {cfg.kv_heads} key/value heads, --tp {tp})") from None
    return impl


MAX_EXPERTS = 1024                       # per MoE block: each expert is its own 4 tensors


def check_moe(cfg: GPTConfig, args, dp: int):
    """The mixture-of-experts flags: consistent, and a layout MoE runs on (not yet --cp or
    --sp)."""
    E, K, ep = cfg.moe_experts, cfg.moe_top_k, args.ep
    if ep < 1:
        raise ConfigError(f"--ep must be >= 1, got {ep}")
    if ep > 1 and E == 0:
        raise ConfigError(f"--ep {ep} splits the experts of a mixture of experts: it needs --moe-experts > 0")
    if E == 0:
        given = [f for f in ("moe_top_k", "moe_every", "moe_capacity_factor", "moe_router", "moe_shared_experts",
                             "moe_ffn_hidden") if getattr(args, f, None) is not None]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} is for a mixture of experts: it needs --moe-experts > 0")
        return
    if E > MAX_EXPERTS:
        raise ConfigError(f"--moe-experts {E} is more than {MAX_EXPERTS}: minipar holds each expert as tensors of "
                          f"its own, and so many would take minutes to build (DeepSeek-V3 has 256)")
    if E < 0 or not 1 <= K <= E:
        raise ConfigError(f"--moe-top-k {K} must be between 1 and --moe-experts {E}")
    if cfg.moe_every < 1 or cfg.moe_every > cfg.n_layer:
        raise ConfigError(f"--moe-every {cfg.moe_every} must be between 1 and --n-layer {cfg.n_layer} "
                          f"(block i is a MoE block when (i + 1) % N == 0)")
    for flag, v in (("--moe-capacity-factor", cfg.moe_capacity_factor), ("--moe-aux-coef", args.moe_aux_coef),
                    ("--moe-z-coef", args.moe_z_coef)):
        if not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"{flag} must be a finite number >= 0, got {v}")
    if args.cp > 1 or args.sp:
        flag = f"--cp {args.cp}" if args.cp > 1 else "--sp"
        raise ConfigError(f"--moe-experts does not combine with {flag} yet (docs/moe.md)")
    if cfg.moe_shared_experts < 0 or cfg.moe_ffn_hidden < 0:
        raise ConfigError(f"--moe-shared-experts {cfg.moe_shared_experts} and --moe-ffn-hidden {cfg.moe_ffn_hidden} "
                          f"must be >= 0")
    if dp % ep or E % ep:
        raise ConfigError(f"--ep {ep} must divide both dp = {dp} (its groups are carved out of the dp group) "
                          f"and --moe-experts {E} (E/ep experts per rank)")


def resolve_dp_flags(args) -> tuple[str, float]:
    """--dp-mode and --bucket-mb belong to plain data parallelism: refused with --zero, else
    their defaults (bucketed, 1 MiB) when not given. -> (dp_mode, bucket_mb); args is not
    changed."""
    if args.zero and (args.dp_mode is not None or args.bucket_mb is not None):
        flag = "--dp-mode" if args.dp_mode is not None else "--bucket-mb"
        raise ConfigError(f"{flag} is for plain data parallelism; --zero {args.zero} replaces "
                          f"the gradient all-reduce by its own reduce-scatters, unit by unit "
                          f"(wte, each block, the rest)")
    bucket_mb = 1.0 if args.bucket_mb is None else args.bucket_mb
    if bucket_mb <= 0:
        raise ConfigError(f"--bucket-mb must be > 0, got {bucket_mb}")
    return args.dp_mode or "bucketed", bucket_mb
