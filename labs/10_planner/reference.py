"""Lab 10 answered by minipar's own code (python -m labs.grade 10 --solution): model.param_specs,
mixed_precision.optimizer_bytes_per_param, zero.formula (unpadded: P_pad = P), the planner's
flops.flop_components and model.train_flops_per_token, behind the lab's signatures."""
import math

from minipar.plan import flops
from minipar.optim import mixed_precision
from minipar.model.gpt import GPTConfig, param_specs, train_flops_per_token
from minipar.parallel.zero import formulas as zero


def config(V, T, L, C, H=1, tied=True):
    return GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C, tie_embeddings=tied)


def param_count(V, T, L, C, tied=True):
    return sum(math.prod(shape) for _, shape, _ in param_specs(config(V, T, L, C, tied=tied)))


def optimizer_bytes_per_param(mixed, itemsize):
    return mixed_precision.optimizer_bytes_per_param(mixed, itemsize)


def model_state_bytes(P, itemsize, K, zero_stage, N):
    f = zero.formula(zero_stage, P, P, N, itemsize, K)
    return {key: f[key] for key in ("params", "grads", "optimizer")}


def forward_flops(T, C, H, V, L):
    components = flops.flop_components(config(V, T, L, C, H))
    return {**components, "total": sum(components.values())}


def mfu_flops_per_token(T, C, H, V, L):
    return train_flops_per_token(config(V, T, L, C, H))


def six_nd(N, D):
    return 6 * N * D
