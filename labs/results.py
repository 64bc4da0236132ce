"""What a criterion's child hands back to the grader, and how the grader reads it.

The child (labs/child.py) runs the student's code and records what it returned; it never
judges. Each rank writes, at the very end, two files into the results folder:

    rank{r}.npz    every array it recorded (np.savez, uncompressed)
    rank{r}.json   {"values": {key: encoded value}, "error": ..., "case": ..., "exit": ...}

and, before each case, `progress{r}` holds the case it is in (what a timeout names). The
.json is renamed into place last, so a rank that died half-way left no .json at all.

The grader (Results below) reads them as hostile input: regular files only (no link, FIFO or
device), sizes capped before anything is parsed, arrays with allow_pickle=False from an
uncompressed archive whose members' sizes are checked first, and JSON decoded into a small
closed set of types. A value the judge asks for and the rank did not record is never a pass:
it is the rank's recorded error, or "exited before returning its results".
"""
from __future__ import annotations

import io
import json
import os
import stat
import zipfile

import numpy as np

MAX_FILE_BYTES = 64 << 20            # one rank's .npz; the .json gets MAX_JSON_BYTES
MAX_JSON_BYTES = 8 << 20
MAX_DEPTH = 20                       # nesting of lists, tuples and dicts in one value
MAX_ITEMS = 100_000                  # elements of one list, tuple or dict
MAX_TEXT = 2000                      # characters of a string or a repr kept
WAITING = ("CommTimeout", "CollectiveMismatch")   # errors that follow another rank's failure


def key(*parts) -> str:
    """One key from its parts: key("rs", 3, 7, "float32") == "rs|3|7|float32"."""
    return "|".join(str(p) for p in parts)


class Opaque:
    """A returned value of a type the record does not carry (an object of the student's own
    class, a generator, ...): its type's name and a short repr, for the judge's message."""

    def __init__(self, typename: str, text: str):
        self.typename, self.text = typename, text

    def __repr__(self):
        return self.text

    def __eq__(self, other):
        return isinstance(other, Opaque) and (self.typename, self.text) == (other.typename, other.text)

    __hash__ = None


def typename(v) -> str:
    """The name of a recorded value's type (for an Opaque, the type it stands for): what a
    judge's message calls what the student returned."""
    return v.typename if isinstance(v, Opaque) else type(v).__name__


def described(v) -> str:
    """A returned value in a few words: 'an array of float64 (2, 3)', 'a tuple of 2',
    'Thing <Thing object>'."""
    if isinstance(v, np.ndarray):
        return f"an array of {v.dtype} {v.shape}"
    if isinstance(v, (tuple, list)):
        return f"a {type(v).__name__} of {len(v)}"
    return f"{typename(v)} {v!r:.80}"


# --- the child's side: encoding ------------------------------------------------------------

class Encoder:
    """Turns returned values into JSON and a dict of arrays; never raises on a strange value
    (it becomes an Opaque), and never calls the student's code (no repr, no __eq__)."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}

    def array(self, a: np.ndarray) -> str:
        name = f"a{len(self.arrays)}"
        self.arrays[name] = a
        return name

    def encode(self, v, depth: int = 0):
        if depth > MAX_DEPTH:
            return {"opaque": "nesting", "repr": f"nested more than {MAX_DEPTH} deep"}
        if type(v) is bool:
            return {"bool": v}
        if type(v) is int:
            return {"int": str(v)}
        if type(v) is float:
            return {"float": repr(v)}
        if type(v) is str:
            return {"str": v[:MAX_TEXT]}
        if v is None:
            return {"none": True}
        if type(v) is np.ndarray and v.dtype.kind in "biufcUSM":   # a copy: the student may reuse it
            return {"ndarray": self.array(np.array(v, copy=True, order="C"))}
        if isinstance(v, np.generic) and type(v).__module__ == "numpy" and np.asarray(v).dtype.kind in "biufc":
            return {"npscalar": self.array(np.asarray(v))}
        if type(v) in (list, tuple):
            items = v[:MAX_ITEMS]
            return {type(v).__name__: [self.encode(x, depth + 1) for x in items],
                    **({"cut": len(v)} if len(v) > MAX_ITEMS else {})}
        if type(v) is dict and all(type(k) is str for k in v):
            return {"dict": {k[:MAX_TEXT]: self.encode(x, depth + 1) for k, x in list(v.items())[:MAX_ITEMS]}}
        # an object of the student's own: its type's name only (its __repr__ is never run)
        return {"opaque": type(v).__name__[:200], "repr": f"<{type(v).__name__[:200]} object>"}


def write(folder: str, rank: int, values: dict, arrays: dict, meta: dict):
    """rank{r}.npz, then rank{r}.json renamed into place last (the rank's "done")."""
    base = os.path.join(folder, f"rank{rank}")
    with open(base + ".npz.tmp", "wb") as f:
        np.savez(f, **arrays)
    os.replace(base + ".npz.tmp", base + ".npz")
    with open(base + ".json.tmp", "w", encoding="utf-8") as f:
        json.dump({**meta, "values": values}, f)
    os.replace(base + ".json.tmp", base + ".json")


# --- the grader's side: reading ------------------------------------------------------------

class Unreadable(ValueError):
    """A results file that is not what a child writes (too large, not a regular file, bad
    format): the criterion fails with this message."""


def read_capped(path: str, limit: int) -> bytes | None:
    """The bytes of a regular file at `path`, or None if there is nothing there; Unreadable
    for a link, a FIFO, a device or a file over `limit` bytes. Never blocks, never follows
    a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Unreadable(f"{os.path.basename(path)}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{os.path.basename(path)} is not a regular file")
        if st.st_size > limit:
            raise Unreadable(f"{os.path.basename(path)} holds {st.st_size:,} B, more than the {limit:,} B allowed")
        chunks, left = [], limit + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        data = b"".join(chunks)
        if len(data) > limit:
            raise Unreadable(f"{os.path.basename(path)} grew past {limit:,} B while read")
        return data
    finally:
        os.close(fd)


def load_arrays(data: bytes, limit: int = MAX_FILE_BYTES) -> dict:
    """The arrays of an uncompressed .npz held in `data` (allow_pickle=False)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = z.infolist()
            if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
                raise Unreadable("the arrays are compressed (a child writes them uncompressed)")
            if sum(i.file_size for i in infos) > limit:
                raise Unreadable("the arrays claim more bytes than allowed")
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {name: z[name] for name in z.files}
    except Unreadable:
        raise
    except Exception as e:                      # noqa: BLE001 - any damage is the child's
        raise Unreadable(f"the arrays cannot be read: {type(e).__name__}: {str(e)[:200]}") from None


def decode(v, arrays: dict, depth: int = 0):
    """The Python value an Encoder encoded; Unreadable for anything else."""
    if depth > MAX_DEPTH + 1 or not isinstance(v, dict) or len(v) not in (1, 2):
        raise Unreadable("a value is not in the results' format")
    kinds = [k for k in v if k not in ("cut", "repr")]
    if len(kinds) != 1:
        raise Unreadable("a value is not in the results' format")
    kind, x = kinds[0], v[kinds[0]]
    if kind == "bool" and type(x) is bool:
        return x
    if kind == "int" and type(x) is str and len(x) <= 5000:
        return int(x)
    if kind == "float" and type(x) is str:
        return float(x)
    if kind == "str" and type(x) is str:
        return x
    if kind == "none":
        return None
    if kind in ("ndarray", "npscalar") and type(x) is str and x in arrays:
        a = arrays[x]
        return a[()] if kind == "npscalar" and a.ndim == 0 else a
    if kind in ("list", "tuple") and type(x) is list:
        items = [decode(i, arrays, depth + 1) for i in x]
        return items if kind == "list" else tuple(items)
    if kind == "dict" and type(x) is dict:
        return {str(k): decode(i, arrays, depth + 1) for k, i in x.items()}
    if kind == "opaque" and type(x) is str and type(v.get("repr")) is str:
        return Opaque(x, v["repr"])
    raise Unreadable(f"a value of kind {kind!r} is not in the results' format")


class Unanswered(AssertionError):
    """A value the judge needs that a rank did not hand back: the criterion fails with this
    message (the rank's own error, or that it exited first)."""


class Results:
    """Every rank's record of one criterion's child, as the grader reads it.

    get(rank, key) -> the value; Unanswered when it is missing. The message names why: a rank
    with no record at all exited before returning its results (its last case from its
    progress file); otherwise a rank that recorded an error is named with its case."""

    def __init__(self, folder: str, ranks: int, exit_note: str = ""):
        self.folder, self.ranks, self.exit_note = folder, ranks, exit_note
        self.values: dict[int, dict] = {}
        self.meta: dict[int, dict] = {}
        self.damaged: dict[int, str] = {}
        for r in range(ranks):
            try:
                self._read(r)
            except Unreadable as e:
                self.damaged[r] = str(e)

    def _read(self, r: int):
        text = read_capped(os.path.join(self.folder, f"rank{r}.json"), MAX_JSON_BYTES)
        if text is None:
            return
        data = read_capped(os.path.join(self.folder, f"rank{r}.npz"), MAX_FILE_BYTES)
        if data is None:
            raise Unreadable(f"rank{r}.npz is missing beside rank{r}.json")
        try:
            meta = json.loads(text.decode("utf-8"))
        except (ValueError, RecursionError, UnicodeDecodeError) as e:
            raise Unreadable(f"rank{r}.json is not JSON: {type(e).__name__}") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("values"), dict):
            raise Unreadable(f"rank{r}.json is not in the results' format")
        arrays = load_arrays(data)
        try:
            self.values[r] = {str(k): decode(v, arrays) for k, v in meta.pop("values").items()}
        except RecursionError:
            raise Unreadable(f"rank{r}.json nests too deep") from None
        self.meta[r] = meta

    def progress(self, r: int) -> str:
        """The case rank r had begun last (its progress file), or ''."""
        try:
            data = read_capped(os.path.join(self.folder, f"progress{r}"), 4096)
        except Unreadable:
            return ""
        return data.decode("utf-8", "replace").strip() if data else ""

    def error(self, r: int) -> str | None:
        """Rank r's recorded error, as one line, or None."""
        e = self.meta.get(r, {}).get("error")
        if not e:
            return None
        return str(e)[:3 * MAX_TEXT]

    def complete(self) -> bool:
        return all(r in self.values for r in range(self.ranks))

    def why_missing(self, rank: int, what: str) -> str:
        """Why `what` of `rank` is not there, in one line."""
        for r in range(self.ranks):                         # damage first: it is deliberate
            if r in self.damaged:
                return f"rank {r}'s results are unreadable: {self.damaged[r]}"
        absent = [r for r in range(self.ranks) if r not in self.values]
        errors = [(r, self.error(r)) for r in range(self.ranks) if self.error(r)]
        # a rank that vanished makes the others time out: name the cause, not the echo
        hard = [(r, e) for r, e in errors if self.meta[r].get("error_type") not in WAITING]
        if hard or errors:
            r, e = (hard or errors)[0]
            left = f"; rank(s) {absent} left no results" if absent and not hard else ""
            return (f"rank {r}: {e}" if self.ranks > 1 else e) + left
        if absent:
            r = rank if rank in absent else absent[0]
            last = self.progress(r)
            who = f"rank {r} " if self.ranks > 1 else ""
            return (f"{who}exited before returning its results" + (f" (in the case {last})" if last else "")
                    + (f"; {self.exit_note}" if self.exit_note else ""))
        return f"rank {rank} returned no {what} (the results stop early: was the recorder tampered with?)"

    def get(self, rank: int, k: str):
        if rank in self.values and k in self.values[rank] and rank not in self.damaged:
            return self.values[rank][k]
        raise Unanswered(self.why_missing(rank, k))

    def has(self, rank: int, k: str) -> bool:
        return rank in self.values and k in self.values[rank]
