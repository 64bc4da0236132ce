"""The converter's output folder: checked before anything is read, written whole or not at all.

The converter writes only a new folder or an empty one (config/outputs.py's rule: nothing
minipar writes may destroy what it did not create, and a converter has no business replacing
even a checkpoint). Refused, in one line naming both paths when there are two:

    the output is the input, inside it, or holds it     from-hf hf hf/ck, to-hf ck ck
    the output is a link (even to an empty folder)      the link's target is not the converter's
    the output exists and is not a folder               a file, a FIFO, a device (/dev/null)
    the output is a folder with anything in it
    the parent folder is missing or not writable

Written: into a fresh hidden folder beside the output (tempfile.mkdtemp: a name nobody else
has), which then takes the output's place in one rename (an empty folder is replaced by it);
on any error the hidden folder is removed and nothing else was touched. A minipar checkpoint
is written by checkpoint.save, atomically in its own way (DIR.tmp, then renames).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile

from minipar.config import outputs
from minipar.convert.hf_names import ConvertError


def _kind(path: str) -> str:
    mode = os.stat(path).st_mode
    return ("a file" if stat.S_ISREG(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a folder")


def check(out: str, inp: str):
    """The output folder `out` of a conversion reading `inp` (module docstring)."""
    how = outputs.related(out, inp)
    if how:
        raise ConvertError(f"output {out} {how} the input {inp}: writing it would change the input")
    if os.path.islink(out):
        raise ConvertError(f"output {out} is a link (to {os.readlink(out)}): the converter writes a new folder")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConvertError(f"output {out} exists and is {_kind(out)}: the converter writes a new folder")
    if os.path.isdir(out) and os.listdir(out):
        raise ConvertError(f"output {out} exists and is not empty ({outputs.what_it_holds(out)}): "
                           f"the converter writes only a new or empty folder")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ConvertError(f"output {out}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConvertError(f"output {out}: folder {parent} is not writable")


@contextlib.contextmanager
def written_whole(out: str):
    """with written_whole(out) as tmp: write files into tmp; they become `out` in one rename."""
    parent, name = os.path.split(os.path.abspath(out))
    tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)                 # mkdtemp's folder is private (0700)
        yield tmp
        for f in os.listdir(tmp):                    # on disk before the rename makes them the output
            os.chmod(os.path.join(tmp, f), 0o666 & ~mask)            # as open() would have made them
            outputs.fsync_path(os.path.join(tmp, f))
        outputs.fsync_path(tmp)
        os.rename(tmp, out)                          # replaces an empty folder, never a full one
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise ConvertError(f"output {out} not written: {e.strerror}") from None
        raise
