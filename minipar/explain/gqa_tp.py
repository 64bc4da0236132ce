"""Grouped-query attention under tensor parallelism in python -m minipar.explain (gqa-tp, tp 4;
P must divide the 8 query heads, and divide the 2 key/value heads or be divided by them): which
query and key/value heads each tp rank holds, and where the gradients of a shared key/value head
are summed.

The run: a one-block Llama (H = 8 query heads, Hkv = 2 key/value heads) split over the P ranks
by minipar's own TensorParallelGPT, one forward and backward of a batch; checked against the
single-process model (loss and every gradient at 1e-12). What each rank holds is read from its
data, not from the formula: each hs-wide column block of its q_proj and k_proj shard is matched
against the canonical tensors' head blocks. The trace gives the all-reduces; those over a
proper subset of the tp group (the trace names each call's group) are the shared key/value
heads' gradient sums (tensor_parallel's kind kv_grads). The drawing: a row per rank, its query
heads coloured by the key/value head they read, its key/value heads, and the sums with the
ranks it shares a head with.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar.show.draw import _esc
from minipar.explain.common import BOLD, CHAR_W, LINE_H, PAD, WHATS, ExplainError, colour, svg_end

GQA_SHAPE = dict(arch="llama", vocab_size=16, block_size=4, n_layer=1, n_head=8, n_kv_head=2, n_embd=16,
                 ffn_hidden=8, rope_theta=100.0)
GQA_B = 2


def gqa_ranks_ok(p: int) -> bool:
    H, Hkv = GQA_SHAPE["n_head"], GQA_SHAPE["n_kv_head"]
    return H % p == 0 and (Hkv % p == 0 or p % Hkv == 0)


# --- the worker (under mpirun) --------------------------------------------------------------------
def heads_held(local: np.ndarray, canonical: np.ndarray, hs: int) -> list[int]:
    """The canonical head of each hs-wide column block of `local` (-1: no head matches)."""
    n = canonical.shape[1] // hs
    out = []
    for b in range(local.shape[1] // hs):
        block = local[:, b * hs:(b + 1) * hs]
        match = [j for j in range(n) if np.array_equal(block, canonical[:, j * hs:(j + 1) * hs])]
        out.append(match[0] if len(match) == 1 else -1)
    return out


def work_gqa(group, path: str):
    """The one-block Llama on this tp rank, forward and backward, traced; its holdings read
    from its shards; checked against the single-process model."""
    from minipar import comm                                                    # noqa: PLC0415
    from minipar.model.gpt import GPT, GPTConfig                                # noqa: PLC0415
    from minipar.parallel.tensor.tensor_parallel import TensorParallelGPT       # noqa: PLC0415
    from minipar.show import tracing                                            # noqa: PLC0415
    cfg = GPTConfig(**GQA_SHAPE)
    p, r, hs = group.size, group.rank, cfg.head_size
    model = TensorParallelGPT(cfg, group, seed=0, dtype=np.float64)
    twin = GPT(cfg, seed=0, dtype=np.float64)
    full = {n: t.data for n, t in twin.named_parameters()}
    q, k = "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight"
    mine = heads_held(model.params[q].data, full[q], hs) + heads_held(model.params[k].data, full[k], hs)
    every = comm.all_gather(group, np.array(mine, dtype=np.int64)).reshape(p, -1).tolist()   # before the trace
    nq = cfg.n_head // p
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, GQA_B, cfg.block_size))
    tracing.start(group, f"rank {r} dp0 tp{r} pp0", peek=True)
    loss = model(ids[0], ids[1])
    loss.backward()
    tracing.finish(group, path, {"what": "gqa-tp", "H": cfg.n_head, "Hkv": cfg.kv_heads, "hs": hs,
                                 "C": cfg.n_embd, "q_heads": [row[:nq] for row in every],
                                 "kv_heads": [row[nq:] for row in every]})
    ref = twin(ids[0], ids[1])
    ref.backward()
    if abs(loss.item() - ref.item()) > 1e-12 * abs(ref.item()):
        raise ExplainError(f"rank {r}: gqa-tp loss {loss.item()!r} differs from one process's {ref.item()!r}")
    for name, t in model.named_parameters():
        want = model.shard(name, twin.params[name].grad)
        if not np.allclose(t.grad, want, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(want).max())):
            raise ExplainError(f"rank {r}: gqa-tp gradient of {name} differs from one process's by "
                               f"{np.abs(t.grad - want).max():.3g}")


# --- what the trace says ----------------------------------------------------------------------------
@dataclass
class GQAPicture:
    p: int
    H: int
    Hkv: int
    q_heads: list               # rank -> the query heads it holds
    kv_heads: list              # rank -> the key/value heads it holds
    sums: list                  # rank -> [(peers, bytes)] of its all-reduces over part of the tp group
    title: str
    problems: list


def gqa_picture(trace: dict) -> GQAPicture:
    """The holdings (from the run's meta), the partial-group all-reduces (from the trace), and
    what is wrong with them: a query head held twice or never, a query head on a rank without
    the key/value head it reads, a shared head whose gradient is not summed over exactly the
    ranks that hold it (two sums: k_proj and v_proj, of one head's (C, hs) each)."""
    from minipar.show import traceview                                          # noqa: PLC0415
    meta = trace["otherData"]["minipar"]
    p, H, Hkv, hs, C = meta["world"], meta["H"], meta["Hkv"], meta["hs"], meta["C"]
    q_heads, kv_heads, problems = meta["q_heads"], meta["kv_heads"], []
    g = H // Hkv
    held = sorted(h for heads in q_heads for h in heads)
    if held != list(range(H)):
        problems.append(f"the query heads held over the ranks are {held}, not each of 0..{H - 1} once")
    sums = []
    for r in range(p):
        sums.append([(sorted(set(c["args"]["group"]) - {r}), max(m[3] for m in c["args"]["messages"]))
                     for c in sorted(traceview.spans(trace, "comm", r), key=lambda e: e["ts"])
                     if c["args"]["op"] == "all_reduce" and len(c["args"].get("group", range(p))) < p])
        for h in q_heads[r]:
            if h // g not in kv_heads[r]:
                problems.append(f"rank {r} holds query head {h}, which reads key/value head {h // g}, "
                                f"but not that head (it holds {kv_heads[r]})")
    for r in range(p):
        holders = sorted({s for j in kv_heads[r] for s in range(p) if j in kv_heads[s]} - {r})
        want = [(holders, C * hs * 8)] * 2 if holders else []
        if sums[r] != want:
            should = f"two all-reduces of {C * hs * 8} B over ranks {holders}" if holders else "no sum"
            problems.append(f"rank {r} holds key/value heads {kv_heads[r]} (also on ranks {holders}): want {should}, "
                            f"the trace shows {sums[r]}")
    share = max(1, p // Hkv)
    head = (f"{WHATS['gqa-tp'].title}, tp={p}, H={H} query heads, Hkv={Hkv} key/value heads "
            + (f"(each on {share} ranks: gradients summed over them)" if share > 1 else f"({Hkv // p} per rank)"))
    return GQAPicture(p, H, Hkv, q_heads, kv_heads, sums, head, problems)


# --- the drawing ----------------------------------------------------------------------------------
def _sum_line(pic, r) -> str:
    if not pic.sums[r]:
        return "no sum: its key/value heads are its own"
    peers = sorted({q for peers, _ in pic.sums[r] for q in peers})
    return (f"k_proj, v_proj gradients summed with rank{'s' if len(peers) > 1 else ''} "
            f"{','.join(map(str, peers))}: {len(pic.sums[r])} all-reduces of {pic.sums[r][0][1]} B")


def gqa_text(pic) -> str:
    g = pic.H // pic.Hkv
    out = [pic.title, ""]
    label = len(f"rank {pic.p - 1}") + 3
    out.append(" " * label + "query heads".ljust(3 * pic.H + 3) + "kv heads".ljust(3 * pic.Hkv + 3) + "gradients")
    for r in range(pic.p):
        q = "".join((f"q{h}" if h in pic.q_heads[r] else " .").ljust(3) for h in range(pic.H))
        kv = "".join((f"k{j}" if j in pic.kv_heads[r] else " .").ljust(3) for j in range(pic.Hkv))
        out.append(f"rank {r}".ljust(label) + q + "   " + kv + "   " + _sum_line(pic, r))
    out += ["", f"query head h reads key/value head h // {g}; a key/value head on several ranks gets its "
                "gradient from each one's query heads, summed over those ranks (kv_grads)"]
    out += [f"PROBLEM: {line}" for line in pic.problems]
    return "\n".join(out)


def gqa_svg(pic) -> str:
    g, sq = pic.H // pic.Hkv, 26
    left, top = 70, 70
    x_kv = left + pic.H * sq + 30
    x_sum = x_kv + pic.Hkv * sq + 30
    width = max(x_sum + 72 * CHAR_W, 20 + len(pic.title) * CHAR_W * 14 / 12)
    row_h = sq + 2 * PAD
    height = top + pic.p * row_h + 80 + 18 * len(pic.problems)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'font-family="DejaVu Sans Mono, monospace" font-size="12">',
           f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
           f'<text x="10" y="22" font-size="14" font-weight="bold">{_esc(pic.title)}</text>',
           f'<text x="{left}" y="{top - 12}" font-weight="bold">query heads</text>',
           f'<text x="{x_kv}" y="{top - 12}" font-weight="bold">kv heads</text>',
           f'<text x="{x_sum}" y="{top - 12}" font-weight="bold">gradients of the kv heads</text>']
    for r in range(pic.p):
        y = top + r * row_h
        out.append(f'<text x="10" y="{y + sq / 2 + 4:.0f}" font-weight="bold">rank {r}</text>')
        for h in range(pic.H):
            mine = h in pic.q_heads[r]
            fill = colour(h // g, pic.Hkv) if mine else "white"
            out.append(f'<rect x="{left + h * sq}" y="{y}" width="{sq - 3}" height="{sq - 3}" fill="{fill}" '
                       f'fill-opacity="0.7" stroke="#999999"/>')
            if mine:
                out.append(f'<text x="{left + h * sq + 3}" y="{y + 17}"{BOLD}>q{h}</text>')
        for j in range(pic.Hkv):
            mine = j in pic.kv_heads[r]
            fill = colour(j, pic.Hkv) if mine else "white"
            out.append(f'<rect x="{x_kv + j * sq}" y="{y}" width="{sq - 3}" height="{sq - 3}" fill="{fill}" '
                       f'stroke="#333333"/>')
            if mine:
                out.append(f'<text x="{x_kv + j * sq + 3}" y="{y + 17}"{BOLD}>k{j}</text>')
        out.append(f'<text x="{x_sum}" y="{y + 17}">{_esc(_sum_line(pic, r))}</text>')
    y = top + pic.p * row_h + 24
    out.append(f'<text x="10" y="{y}">a query head has the colour of the key/value head it reads (h // {g}); '
               f'a key/value head held by several ranks has its gradient summed over them</text>')
    out.append(f'<text x="10" y="{y + LINE_H}">read from the run: each rank\'s shards matched against the '
               f'canonical heads; the sums are the trace\'s all-reduces over part of the tp group</text>')
    return svg_end(out, y + 2 * LINE_H + PAD, pic.problems)
