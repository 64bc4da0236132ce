"""minipar.train.data: built-in corpus, byte tokenizer, file loading errors, stateless global-batch sampler."""

import hashlib
import math
import time

import numpy as np
import pytest

from minipar.train import corpus
from minipar.train.data import (BUILTIN_NAME, DataError, Sampler, builtin_corpus, decode, encode, load_tokens,
                                unigram_entropy)

# The exact bytes of the built-in corpus. A recorded run (loss curve, checkpoint) is only
# reproducible with the same text, so a change to the grammar must update this on purpose.
CORPUS_SHA256 = "fdf1859c47e9e73802254efd1147349a473ffaabcac738ce96daca8ee431fb79"


# ---------------------------------------------------------------- built-in corpus

def test_builtin_corpus_is_deterministic_and_sized():
    t0 = time.perf_counter()
    a = corpus.generate()
    seconds = time.perf_counter() - t0
    b = corpus.generate()
    ha, hb = (hashlib.sha256(s.encode()).hexdigest() for s in (a, b))
    assert ha == hb, "two builds of the corpus differ"
    assert ha == CORPUS_SHA256, f"corpus bytes changed: sha256 {ha}, {len(a)} bytes"
    assert 300_000 <= len(a.encode()) <= 600_000, f"corpus is {len(a.encode())} bytes"
    assert a.isascii(), "the corpus should be ASCII (one character = one token)"
    assert seconds < 1.0, f"building the corpus took {seconds:.3f} s"


def test_builtin_corpus_is_cached_and_loaded_by_default():
    assert builtin_corpus() is builtin_corpus()
    assert builtin_corpus() == corpus.generate()
    tokens = load_tokens(None, block_size=64)
    np.testing.assert_array_equal(tokens, encode(builtin_corpus()))
    assert BUILTIN_NAME == "builtin"


def test_builtin_corpus_reads_as_sentences():
    text = builtin_corpus()
    paragraphs = text.strip().split("\n\n")
    assert len(paragraphs) > 500, f"only {len(paragraphs)} paragraphs"
    for p in paragraphs[:50]:
        assert p[0].isupper() and p.endswith("."), f"paragraph does not read as sentences: {p!r}"
    assert "{" not in text and "}" not in text, "an unfilled template slot leaked into the corpus"


def test_corpus_unigram_entropy_is_like_english():
    h = unigram_entropy(encode(builtin_corpus()))
    assert 2.0 < h < 4.0, f"unigram entropy of the corpus is {h:.3f} nats"


# ---------------------------------------------------------------- tokenizer

def test_encode_decode_round_trip():
    text = "rank 0 -> rank 1: héllo, 世界 🙂\n"
    t = encode(text)
    assert t.dtype == np.uint8 and t.shape == (len(text.encode("utf-8")),)
    assert decode(t) == text
    assert decode(t.astype(np.int64)) == text          # what a sampler produces
    assert decode(list(t)) == text
    assert decode([104, 0xFF, 105]) == "h\ufffdi"      # invalid UTF-8 is replaced, not raised
    with pytest.raises(ValueError, match=r"\[0, 255\], got values in \[300, 300\]"):
        decode([300])


# ---------------------------------------------------------------- load_tokens

def _write(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_load_tokens_reads_bytes(tmp_path):
    text = "héllo world, this is enough text\n"
    path = _write(tmp_path, "ok.txt", text.encode())
    t = load_tokens(path, block_size=8)
    np.testing.assert_array_equal(t, encode(text))
    assert t.dtype == np.uint8


def test_load_tokens_missing_file(tmp_path):
    path = str(tmp_path / "x.txt")
    with pytest.raises(DataError) as e:
        load_tokens(path, block_size=8)
    assert str(e.value) == f"data file '{path}' not found"


def test_load_tokens_directory(tmp_path):
    with pytest.raises(DataError, match="directory"):
        load_tokens(str(tmp_path), block_size=8)


def test_load_tokens_empty_file(tmp_path):
    path = _write(tmp_path, "empty.txt", b"")
    with pytest.raises(DataError) as e:
        load_tokens(path, block_size=8)
    msg = str(e.value)
    assert path in msg and "empty" in msg and "--block-size 8" in msg and "10" in msg, msg
    assert "\n" not in msg


def test_load_tokens_too_short(tmp_path):
    path = _write(tmp_path, "short.txt", b"x" * 9)     # block_size + 2 = 10 needed
    with pytest.raises(DataError) as e:
        load_tokens(path, block_size=8)
    msg = str(e.value)
    assert path in msg and "9 bytes" in msg and "--block-size 8" in msg and "at least 10" in msg, msg
    assert "\n" not in msg
    path = _write(tmp_path, "just.txt", b"x" * 10)     # exactly enough
    assert len(load_tokens(path, block_size=8)) == 10


def test_load_tokens_bad_utf8(tmp_path):
    path = _write(tmp_path, "latin1.txt", "café au lait, s'il vous plaît".encode("latin-1"))
    with pytest.raises(DataError) as e:
        load_tokens(path, block_size=4)
    msg = str(e.value)
    assert path in msg and "UTF-8" in msg and "offset 3" in msg and "0xe9" in msg, msg
    assert "\n" not in msg


def test_load_tokens_bad_block_size():
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        load_tokens(None, block_size=0)


def test_builtin_too_short_for_block_size():
    n = len(builtin_corpus())
    with pytest.raises(DataError, match=f"{BUILTIN_NAME} corpus has {n} bytes"):
        load_tokens(None, block_size=n)


# ---------------------------------------------------------------- unigram entropy

def test_unigram_entropy():
    assert unigram_entropy(np.arange(256, dtype=np.uint8)) == pytest.approx(math.log(256), abs=1e-12)
    assert unigram_entropy(np.repeat(np.arange(256), 3)) == pytest.approx(math.log(256), abs=1e-12)
    assert unigram_entropy(encode("aaaa")) == 0.0
    assert unigram_entropy(encode("abab")) == pytest.approx(math.log(2), abs=1e-12)
    with pytest.raises(ValueError):
        unigram_entropy(np.array([], dtype=np.uint8))


# ---------------------------------------------------------------- Sampler

@pytest.fixture(scope="module")
def tokens():
    return load_tokens(None, block_size=16)


def test_sampler_shapes_and_shift(tokens):
    T, B = 16, 12
    s = Sampler(tokens, block_size=T, batch_size=B, seed=0)
    x, y = s.batch(3)
    assert x.shape == (B, T) and y.shape == (B, T), (x.shape, y.shape)
    assert x.dtype == np.int64 and y.dtype == np.int64
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    for i, o in enumerate(s.offsets(3)):             # rows are the windows at the offsets
        np.testing.assert_array_equal(x[i], tokens[o:o + T], err_msg=f"row {i} offset {o}")
        np.testing.assert_array_equal(y[i], tokens[o + 1:o + T + 1], err_msg=f"row {i} offset {o}")
    x[:] = -1                                          # x and y are independent arrays
    assert (y >= 0).all()


@pytest.mark.parametrize("parts", [[0, 8], [0, 1, 8], [0, 4, 8], [0, 2, 4, 6, 8], [0, 3, 3, 7, 8],
                                   list(range(9))])
def test_sampler_split_invariance(tokens, parts):
    s = Sampler(tokens, block_size=16, batch_size=8, seed=5)
    for step in (0, 1, 17):
        x, y = s.batch(step)
        xs, ys = zip(*(s.batch(step, lo, hi) for lo, hi in zip(parts[:-1], parts[1:])))
        np.testing.assert_array_equal(np.concatenate(xs), x, err_msg=f"step {step} parts {parts}")
        np.testing.assert_array_equal(np.concatenate(ys), y, err_msg=f"step {step} parts {parts}")


def test_sampler_determinism(tokens):
    a = Sampler(tokens, block_size=16, batch_size=8, seed=1)
    b = Sampler(tokens, block_size=16, batch_size=8, seed=1)   # e.g. a resumed run
    c = Sampler(tokens, block_size=16, batch_size=8, seed=2)
    np.testing.assert_array_equal(a.batch(7)[0], b.batch(7)[0])
    np.testing.assert_array_equal(a.batch(7)[0], a.batch(7)[0])
    assert not np.array_equal(a.batch(7)[0], a.batch(8)[0]), "steps 7 and 8 gave the same batch"
    assert not np.array_equal(a.batch(7)[0], c.batch(7)[0]), "seeds 1 and 2 gave the same batch"
    # the offsets are a function of (seed, step) only, not of the batch size
    np.testing.assert_array_equal(a.offsets(7), np.random.default_rng([1, 7]).integers(
        0, len(a.tokens) - 16, size=8))


def test_sampler_offsets_cover_the_range():
    T, n = 4, 10                                       # offsets in [0, n - T - 1] = [0, 5]
    s = Sampler(np.arange(n), block_size=T, batch_size=50, seed=0)
    seen = np.concatenate([s.offsets(k) for k in range(20)])
    assert seen.min() == 0 and seen.max() == n - T - 1, (seen.min(), seen.max())
    x, y = s.batch(0)
    assert y.max() <= n - 1


def test_sampler_val_split_holds_out_the_tail():
    n, T = 10_000, 16
    n_val = n // 20
    tokens = np.arange(n)                              # token value = its position
    train = Sampler(tokens, T, batch_size=64, seed=0)
    val = Sampler(tokens, T, batch_size=64, seed=0, split="val")
    assert train.held_out and val.held_out
    for k in range(10):
        _, ty = train.batch(k)
        vx, vy = val.batch(k)
        assert ty.max() < n - n_val, f"train step {k} reads held-out token {ty.max()}"
        assert vx.min() >= n - n_val and vy.max() <= n - 1, (vx.min(), vy.max())
    assert not np.array_equal(train.offsets(0), val.offsets(0))


def test_sampler_val_split_short_corpus_uses_everything():
    tokens = np.arange(200)                            # 5% = 10 tokens < T + 2
    train = Sampler(tokens, 16, batch_size=4, seed=0)
    val = Sampler(tokens, 16, batch_size=4, seed=0, split="val")
    assert not val.held_out and len(val.tokens) == len(train.tokens) == 200


def test_sampler_validation():
    t = np.zeros(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        Sampler(t, block_size=8, batch_size=0, seed=0)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        Sampler(t, block_size=0, batch_size=4, seed=0)
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        Sampler(t, block_size=8, batch_size=4, seed=-1)
    with pytest.raises(ValueError, match="split"):
        Sampler(t, block_size=8, batch_size=4, seed=0, split="test")
    with pytest.raises(DataError, match="100 tokens.*--block-size 99 needs at least 101"):
        Sampler(t, block_size=99, batch_size=4, seed=0)
    s = Sampler(t, block_size=8, batch_size=4, seed=0)
    with pytest.raises(ValueError, match=r"rows \[2, 5\) .* global batch of 4"):
        s.batch(0, 2, 5)
    with pytest.raises(ValueError, match=r"rows \[3, 2\)"):
        s.batch(0, 3, 2)
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        s.batch(-1)
    assert s.batch(0, 2, 2)[0].shape == (0, 8)
