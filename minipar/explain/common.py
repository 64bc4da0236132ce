"""What the pictures of python -m minipar.explain share: the table of pictures (WHATS: each
WHAT's title, its default number of ranks and, for a collective, the phases its receives
mark), the errors the command prints in one line, and the drawings' palette, sizes and SVG
text. Every picture is drawn twice, as fixed-width text for the terminal and as a hand-written
SVG (like draw.timeline_svg: no matplotlib).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from minipar.show.draw import _esc


ROOT = 0                        # broadcast's and reduce's root


@dataclass(frozen=True)
class Spec:
    title: str                  # what the drawing's title calls it
    default_p: int
    algorithm: str = ""         # the trace's name for it (Group.begin's algorithm)
    phases: dict = field(default_factory=dict)      # a receive's op -> the phase it marks


WHATS = {
    "ring-all-reduce": Spec("ring all-reduce", 4, "ring", {"+=": "reduce-scatter", "=": "all-gather"}),
    "reduce-scatter": Spec("ring reduce-scatter", 4, "ring", {"+=": "reduce-scatter"}),
    "all-gather": Spec("ring all-gather", 4, "ring", {"=": "all-gather"}),
    "recursive-doubling": Spec("recursive-doubling all-reduce", 5, "recursive doubling",
                               {"+=": "reduce", "=": "copy back"}),
    "broadcast": Spec(f"binomial-tree broadcast from rank {ROOT}", 4, "binomial tree",
                      {"hdr": "header", "=": "data"}),
    "reduce": Spec(f"binomial-tree reduce to rank {ROOT}", 4, "binomial tree", {"+=": "reduce"}),
    "megatron-mlp": Spec("Megatron MLP", 2),
    "1f1b": Spec("1F1B pipeline", 4),
    "ring-attention": Spec("ring attention", 4),
    "moe-dispatch": Spec("MoE dispatch and combine", 4),
    "gqa-tp": Spec("grouped-query attention under tensor parallelism", 4),
    "ulysses": Spec("Ulysses attention", 4),
    "fsdp": Spec("ZeRO-3's all-gathers and reduce-scatters", 4),
    "hsdp": Spec("hybrid sharding's shard and replica groups", 4),
}
COLLECTIVES = [w for w, s in WHATS.items() if s.algorithm]


class ExplainError(Exception):
    """Something the user should read in one line (exit 1)."""


class UsageError(ExplainError):
    """Bad arguments (exit 2)."""


# --- the drawings: colours, sizes, text -----------------------------------------------------------
PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6",
           "#9d755d", "#bab0ac"]
WHOLE, HEADER, RANGE = "#8c8c8c", "#d9d9d9", "#c7a76c"        # whole array, dtype/shape header, other
CHAR_W, LINE_H, PAD, SQ = 7.2, 18, 6, 8                         # monospace 12 px: a character's width
BOLD = ' font-weight="bold"'


def colour(index: int, p: int) -> str:
    """Piece k's colour; -1 the whole array, -2 a header, -3 any other element range."""
    if index >= 0:
        return PALETTE[index] if p <= len(PALETTE) else f"hsl({round(360 * index / p)},55%,55%)"
    return {-1: WHOLE, -2: HEADER}.get(index, RANGE)


def _text(x, y, text, extra=""):
    return f'<text x="{x:.1f}" y="{y:.1f}"{extra}>{_esc(text)}</text>'


def svg_end(out: list, y, problems) -> str:
    """The drawing `out` (lines of SVG) finished: the check's problems in red from y down, 18 px
    apart, then the closing tag."""
    out += [f'<text x="10" y="{y + 18 * i}" fill="#c00000">PROBLEM: {_esc(line)}</text>'
            for i, line in enumerate(problems)]
    return "\n".join(out + ["</svg>"]) + "\n"
