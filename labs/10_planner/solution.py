"""Lab 10, solved by hand as a student would: each formula written out term by term
(minipar's own are model.param_specs, zero.formula and flops.flop_components)."""


def param_count(V, T, L, C, tied=True):
    embeddings = V * C + T * C                       # wte, wpe
    layer_norm = C + C                               # weight and bias
    attention = (C * 3 * C + 3 * C) + (C * C + C)    # c_attn, c_proj (weights and biases)
    mlp = (C * 4 * C + 4 * C) + (4 * C * C + C)      # c_fc, c_proj
    block = 2 * layer_norm + attention + mlp         # = 12 C^2 + 13 C
    head = 0 if tied else V * C                      # tied: the logits reuse wte
    return embeddings + L * block + layer_norm + head


FP32 = 4


def optimizer_bytes_per_param(mixed, itemsize):
    if mixed:
        return FP32 + FP32 + FP32                    # master weights, m, v
    return 2 * itemsize                              # m, v in the parameters' dtype


def model_state_bytes(P, itemsize, K, zero_stage, N):
    params = grads = itemsize * P
    optimizer = K * P
    if zero_stage >= 1:                              # ZeRO-1: optimizer state sharded
        optimizer //= N
    if zero_stage >= 2:                              # ZeRO-2: + gradients
        grads //= N
    if zero_stage >= 3:                              # ZeRO-3: + parameters
        params //= N
    return {"params": params, "grads": grads, "optimizer": optimizer}


def forward_flops(T, C, H, V, L):
    layer = {
        "kqv_projections": 2 * 3 * T * C * C,
        "key_query_logits": 2 * T * T * C,
        "softmax": 3 * H * T * T,
        "softmax_value": 2 * T * T * C,
        "final_linear": 2 * T * C * C,
        "dense": 2 * T * (C * 4 * C + 4 * C * C),
    }
    flops = {"embeddings": 2 * T * V * C}
    for name, count in layer.items():
        flops[name] = L * count
    flops["logits"] = 2 * T * C * V
    flops["total"] = sum(flops.values())
    return flops


def mfu_flops_per_token(T, C, H, V, L):
    f = forward_flops(T, C, H, V, L)
    matmuls = f["total"] - f["embeddings"] - f["softmax"]
    return 3 * matmuls / T                           # forward + backward (2x forward)


def six_nd(N, D):
    return 6.0 * N * D
