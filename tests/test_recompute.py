"""--recompute selective and full (minipar/autograd/recompute.py): the same operations in the same
order, so in float64 every loss, gradient norm and weight is bit-identical (==) to
--recompute none, on one process and across dp, tp, pp and ZeRO; and the saved bytes drop
by exactly what each keeps no longer.
"""
import numpy as np
import pytest

from minipar.train import trainer as train
from minipar.train.checkpoint import canonical_state
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel.parallelize import parts
from trainer_runs import mpirun

FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
         "--steps", "3", "--sample", "0", "--dtype", "float64", "--micro-batches", "2"]


def run(mode):
    s = train.set_up(train.build_parser().parse_args(FLAGS + ["--recompute", mode]))
    rows = list(train.train_steps(s, 0, 3))
    return rows, canonical_state(s.model, s.opt)


@pytest.fixture(scope="module")
def baseline():
    return run("none")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_bit_identical_to_none_in_float64(mode, baseline):
    rows, state = run(mode)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in rows] == [r[key] for r in baseline[0]], key
    different = [name for name in state if not np.array_equal(state[name], baseline[1][name])]
    assert not different, different


def saved(mode, cfg, B=3):
    model = GPT(cfg, seed=0, dtype=np.float64, parts=parts(mode))
    idx = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, cfg.block_size))
    return model(idx, idx).saved_bytes()


def test_saved_bytes_drop_by_what_is_no_longer_kept():
    """selective: less by the softmax P of every layer, L * B * nh * T * T * 8 bytes; full:
    of each block, its input alone, B * T * C * 8 bytes, is kept."""
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=3, n_head=4, n_embd=32)
    B, T, C, L, nh = 3, 16, 32, 3, 4
    none, selective, full = (saved(m, cfg, B) for m in ("none", "selective", "full"))
    assert none - selective == L * B * nh * T * T * 8
    per_block = (none - saved("none", GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4,
                                                n_embd=32), B))
    assert none - full == L * (per_block - B * T * C * 8)


def test_full_recompute_hooks_fire_once_per_parameter():
    """Data parallelism's buckets start in the gradient hooks: with full recompute each
    parameter's hook still fires exactly once per backward, after its gradient is complete."""
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT(cfg, seed=0, dtype=np.float64, parts=parts("full"))
    fired = []
    for name, p in model.named_parameters():
        p.register_grad_hook(lambda t, name=name: fired.append(name))
    idx = np.random.default_rng(1).integers(0, 256, (2, 8))
    model(idx, idx).backward()
    assert sorted(fired) == sorted(name for name, _ in model.named_parameters())


@pytest.mark.parametrize("layout", [["--dp", "2", "--pp", "2", "--zero", "1", "--micro-batches", "2"],
                                    ["--dp", "2", "--tp", "2", "--zero", "2"]], ids=["dp2pp2zero1", "dp2tp2zero2"])
def test_across_ranks_the_weights_are_the_same_bits(layout):
    """The replicas' sha256 (the summary's digest of the final weights) is the same with and
    without full recomputation (scripts/verify_matrix.py runs --recompute with --verify)."""
    digests = []
    for mode in ("none", "full"):
        p = mpirun(4, *layout, "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--dtype", "float64",
                   "--steps", "2", "--recompute", mode)
        assert p.returncode == 0, p.stderr[-2000:]
        digests.append(p.stdout.split("weights sha256 ")[1].split(")")[0])
    assert len(set(digests)) == 1, digests


def test_added_flops_are_counted_exactly(monkeypatch):
    """Every matrix product that runs, counted as 2*M*N*K by wrapping the ops (as
    test_model counts train_flops_per_token), in one forward + backward: what each mode adds
    over none equals recompute.added_flops."""
    from minipar.autograd import attention, ops, recompute
    count = [0]

    def wrap(owner, name, flops):
        orig = getattr(owner, name)

        def counted(*args, **kw):
            out = orig(*args, **kw)
            count[0] += flops(out, *args)
            return out
        monkeypatch.setattr(owner, name, counted)

    wrap(ops.Linear, "forward", lambda out, self, x, w, *r: 2 * out.size * w.shape[0])
    wrap(ops.MatMul, "forward", lambda out, self, a, b: 2 * out.size * a.shape[-1])
    # the attention core: P = softmax(Q K^T) in _probs_t (forward, and selective's backward),
    # P V in the forward
    wrap(attention, "_probs_t", lambda out, q, k, T: 2 * out.size * q.shape[-1])
    wrap(ops.CausalSelfAttention, "forward", lambda out, self, qkv, nh, *r: 2 * out.size * out.shape[1])
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=3, n_head=2, n_embd=16)
    B, T, C, L = 2, 8, 16, 3
    counted = {}
    for mode in ("none", "selective", "full"):
        model = GPT(cfg, seed=0, dtype=np.float64, parts=parts(mode))
        idx = np.random.default_rng(0).integers(0, 256, (B, T))
        count[0] = 0
        model(idx, idx).backward()
        counted[mode] = count[0]
    for mode in ("selective", "full"):
        assert counted[mode] - counted["none"] == recompute.added_flops(L, B, T, C, mode), mode
