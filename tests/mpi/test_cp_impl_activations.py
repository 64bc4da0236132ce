"""Activation memory of each way a cp group attends (--cp-impl): what one attention call keeps
equals activations.cp_attention_bytes, and a whole model's forward (GPT-2 and Llama with
grouped-query attention, KV heads copied under Ulysses) equals activations.stage_bytes and
layer_bytes with cp_impl, to the byte (Tensor.saved_bytes). Run under mpirun -n 4: cp 2 and
4 on the `groups` fixture's blocks of ranks, hybrid at cp 4 with U = 2 and U = 1.

What the formulas say (activations.py's second table): the ring keeps q, k, v, o and the
log-sum-exp of its tokens; the all-gather the gathered K and V of every token; Ulysses q, k, v
of its heads over the whole sequence (no o, no log-sum-exp); hybrid the ring's on its Ulysses
group's tokens. None keeps a t x T mask or an index array beside them.
"""
import numpy as np
import pytest

from minipar.autograd.tensor import Tensor
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel.context.context_parallel import ContextSplit
from minipar.parallel.parallelize import parts
from minipar.plan import activations

V, T, HS, B = 97, 16, 4, 2
DTYPES = {"float64": (np.float64, 8, 8), "float32": (np.float32, 4, 4), "float16": (np.float16, 2, 4)}
IMPLS = [("ring", None), ("ulysses", None), ("allgather", None), ("hybrid", 2), ("hybrid", 1)]


def split_of(groups, cp, impl, U, H, Hkv):
    """The cp group's ContextSplit for impl (hybrid: Ulysses over U), or a skip: too few ranks,
    or heads Ulysses cannot take (ulysses.head_split; its errors: test_cp_impls.py)."""
    g = groups[cp]
    if g.size != cp:
        pytest.skip(f"needs {cp} ranks")
    D = cp if impl == "ulysses" else U if impl == "hybrid" else None
    if D is not None and (H % D or (Hkv % D and D % Hkv)):
        pytest.skip("Ulysses cannot take these heads")
    return ContextSplit(g, "zigzag", impl, U if impl == "hybrid" else None)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (4, 1), (2, 2)], ids=["mha", "gqa", "mqa", "two-heads"])
@pytest.mark.parametrize("impl,U", IMPLS, ids=[f"{i}{u or ''}" for i, u in IMPLS])
@pytest.mark.parametrize("cp", [2, 4])
def test_one_call_keeps_the_formula(groups, cp, impl, U, H, Hkv, dtype):
    split = split_of(groups, cp, impl, U, H, Hkv)
    dt, s, c = DTYPES[dtype]
    t = T // cp
    x = Tensor(np.random.default_rng(0).standard_normal((B, t, (H + 2 * Hkv) * HS)).astype(dt), requires_grad=True)
    y = split.attention(x, H, Hkv)
    want, _ = activations.cp_attention_bytes(impl, B, t, cp, H, H * HS, Hkv * HS, HS, c, split.ulysses)
    assert y.saved_bytes() == want, f"cp={cp} rank {split.group.rank} {impl} U={split.ulysses} H={H} Hkv={Hkv} {dtype}"


def config(arch, n_layer, n_head, n_kv_head):
    extra = dict(arch="llama", n_kv_head=n_kv_head, ffn_hidden=40) if arch == "llama" else {}
    return GPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=n_head, n_embd=n_head * 6, **extra)


@pytest.mark.parametrize("dtype", ["float64", "float16"])
@pytest.mark.parametrize("arch,H,Hkv", [("gpt2", 4, 4), ("gpt2", 1, 1), ("llama", 4, 2), ("llama", 4, 1)],
                         ids=["gpt2", "gpt2-one-head", "llama-gqa", "llama-mqa"])
@pytest.mark.parametrize("impl,U", IMPLS, ids=[f"{i}{u or ''}" for i, u in IMPLS])
@pytest.mark.parametrize("cp", [2, 4])
def test_a_model_keeps_the_formula(groups, cp, impl, U, arch, H, Hkv, dtype):
    """3 layers less 2 is one layer's bytes (block_bytes); 3 layers the stage's (stage_bytes).
    One head (GPT-2): the ring's and the all-gather's c_proj input is a view of their o."""
    split = split_of(groups, cp, impl, U, H, Hkv)
    dt, s, c = DTYPES[dtype]
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, V, size=(2, B, T))
    got = {}
    for n in (2, 3):
        model = GPT(config(arch, n, H, Hkv), seed=0, dtype=dt, parts=parts("none", context=split))
        got[n] = model(split.local(x), split.local(y), loss_denom=B * T).saved_bytes()
    where = f"cp={cp} rank {split.group.rank} {impl} U={split.ulysses} {arch} H={H} Hkv={Hkv} {dtype}"
    kw = dict(cp=cp, cp_impl=impl, cp_ulysses=split.ulysses)
    assert got[3] == activations.stage_bytes(config(arch, 3, H, Hkv), 0, 1, 1, B, s, c, False, "none", **kw), where
    assert got[3] - got[2] == activations.block_bytes(config(arch, 3, H, Hkv), B, 1, s, c, False, "none", **kw), where
