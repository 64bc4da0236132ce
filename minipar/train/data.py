"""Data for a byte-level GPT: the corpus, the tokenizer, and the global batch of each step.

Tokens are the UTF-8 bytes of the text, so V = 256 and there is nothing to train or ship:
`encode("héllo")` is 6 tokens, `decode` turns any token list back into text (bytes that do
not form valid UTF-8, as a half-trained model may produce, become U+FFFD).

The corpus is a UTF-8 text file (`--data FILE`) or, without one, the built-in text of
`minipar.train.corpus`: about 400 KB of generated English sentences about distributed training,
identical on every machine.

Sampling is stateless. The global batch of step `k` is B sequences of T tokens whose start
offsets are drawn by `np.random.default_rng([seed, k])`, then sliced:

    offsets = rng.integers(0, N - T, size=B)     # (B,) uniform in [0, N - T - 1]
    x[i] = tokens[offsets[i] : offsets[i] + T]   # (B, T)
    y[i] = tokens[offsets[i] + 1 : offsets[i] + T + 1]   # x shifted by one token

A data parallel rank asks for its rows `batch(k, lo, hi)` and a micro-batch for a slice of
those, so every split of the global batch over ranks and micro-batches sees exactly the
same sequences as one process does (the single-process twin stays exact), and resuming at
step k needs no saved RNG state: the step number is the data position.
"""

import functools
import hashlib
import math
import os

import numpy as np

from minipar.train import corpus

BUILTIN_NAME = "builtin"  # the data source the trainer prints when no --data file is given
VAL_FRACTION = 0.05       # the last 5% of the tokens are held out for split="val"


class DataError(ValueError):
    """Bad data: the message is one line that names the file and the size needed."""


@functools.lru_cache(maxsize=1)
def builtin_corpus() -> str:
    """The built-in text (about 400 KB, ASCII), generated once per process."""
    return corpus.generate()


def encode(text: str) -> np.ndarray:
    """Text -> its UTF-8 bytes as a (N,) uint8 array: byte-level tokens, V = 256."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens) -> str:
    """Tokens (any ints in [0, 256)) -> text; invalid UTF-8 becomes U+FFFD."""
    t = np.asarray(tokens).ravel()
    if t.size and (t.min() < 0 or t.max() > 255):
        raise ValueError(f"tokens must be bytes in [0, 255], got values in [{t.min()}, {t.max()}]")
    return bytes(t.astype(np.uint8)).decode("utf-8", errors="replace")


def _need(block_size):  # tokens needed for two distinct windows x, y of block_size + 1 bytes
    return block_size + 2


def load_tokens(path: str | None, block_size: int) -> np.ndarray:
    """The corpus as (N,) uint8 tokens: the built-in text if path is None, else a UTF-8 file.

    Raises DataError (one line, naming the file) if the file is missing, unreadable, empty,
    not UTF-8 (with the offset of the first bad byte) or shorter than block_size + 2 bytes.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    need = _need(block_size)
    if path is None:
        tokens = encode(builtin_corpus())
        if len(tokens) < need:
            raise DataError(f"{BUILTIN_NAME} corpus has {len(tokens)} bytes; "
                            f"--block-size {block_size} needs at least {need}")
        return tokens

    if os.path.exists(path) and not os.path.isdir(path) and not os.path.isfile(path):
        raise DataError(f"data file '{path}' is not a regular file (a FIFO, a socket or a device): "
                        f"minipar reads its data from a file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"data file '{path}' not found") from None
    except IsADirectoryError:
        raise DataError(f"data file '{path}' is a directory, not a text file") from None
    except OSError as e:
        raise DataError(f"data file '{path}' cannot be read: {e.strerror}") from None

    if not raw:
        raise DataError(f"data file '{path}' is empty (0 bytes); "
                        f"--block-size {block_size} needs at least {need} bytes")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file '{path}' is not UTF-8: byte 0x{raw[e.start]:02x} at offset "
                        f"{e.start} of {len(raw)} ({e.reason})") from None
    if len(raw) < need:
        raise DataError(f"data file '{path}' has {len(raw)} bytes; "
                        f"--block-size {block_size} needs at least {need} bytes")
    return np.frombuffer(raw, dtype=np.uint8).copy()


def tokens_digest(tokens: np.ndarray) -> str:
    """The first 16 hex digits of the tokens' sha256: a checkpoint records the data it trained on."""
    return hashlib.sha256(tokens.tobytes()).hexdigest()[:16]


def unigram_entropy(tokens) -> float:
    """Entropy in nats of the byte frequencies: the loss of the best model that sees no context.

    A uniform distribution over 256 bytes gives log(256) = 5.55; English text about 3.
    """
    t = np.asarray(tokens).ravel()
    if t.size == 0:
        raise ValueError("unigram_entropy of an empty token array")
    p = np.bincount(t, minlength=256) / t.size           # (V,)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


class Sampler:
    """The global batch of every step, as rows [lo, hi) of (B, T) arrays x and y.

    batch_size is the GLOBAL batch B in sequences. split="train" (the default) draws from
    the first 95% of the tokens and split="val" from the last 5%, when that 5% holds at
    least block_size + 2 tokens; with a shorter corpus both splits use all the tokens (so
    the val loss is then a train loss). Train offsets come from default_rng([seed, step]),
    val offsets from default_rng([seed, step, 1]).
    """

    def __init__(self, tokens, block_size, batch_size, seed, split="train"):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, "
                             f"got {tokens.ndim}-D {tokens.dtype}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        n, need = len(tokens), _need(block_size)
        if n < need:
            raise DataError(f"corpus has {n} tokens; "
                            f"--block-size {block_size} needs at least {need}")

        n_val = math.floor(n * VAL_FRACTION)
        if n_val >= need:  # long enough to hold out the tail
            tokens = tokens[: n - n_val] if split == "train" else tokens[n - n_val:]
        self.tokens = tokens                # (N,) the tokens this split draws from
        self.block_size, self.batch_size = block_size, batch_size
        self.seed, self.split = seed, split
        self.held_out = n_val >= need       # False: train and val both see everything

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of the whole global batch of `step`: (B,) int64, from (seed, step) only."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        key = [self.seed, step] if self.split == "train" else [self.seed, step, 1]
        rng = np.random.default_rng(key)
        return rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)

    def batch(self, step: int, lo: int = 0, hi: int | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        """Rows lo..hi-1 of the global batch of `step`: x, y int64 (hi - lo, T), y = x shifted."""
        hi = self.batch_size if hi is None else hi
        if not 0 <= lo <= hi <= self.batch_size:
            raise ValueError(f"rows [{lo}, {hi}) are not within "
                             f"the global batch of {self.batch_size}")
        starts = self.offsets(step)[lo:hi]                               # (b,)
        idx = starts[:, None] + np.arange(self.block_size + 1)           # (b, T+1)
        window = self.tokens[idx].astype(np.int64)                       # (b, T+1)
        return window[:, :-1].copy(), window[:, 1:].copy()               # x, y: (b, T) each
