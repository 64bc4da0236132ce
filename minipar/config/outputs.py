"""What a run writes, checked before it writes anything: nothing minipar writes may destroy
what it did not create.

The outputs: --save DIR (and DIR.tmp, DIR.old, DIR.lock beside it), --log, --trace, --timeline. The
inputs: --data, --resume. Before any message, every rank checks (check(); ConfigError, one
line naming both paths, exit 2):

    an output that is an input (or a hard link to it), in one, or holding one  --data f --log f
    two outputs that are one, or one inside the other              --save out --log out/log.jsonl
    an output file that exists and is not a regular file           --trace /dev/null, a FIFO, a folder
    --save DIR that exists and is not a checkpoint minipar wrote   --save ., --save ~/thesis
    DIR.tmp or DIR.old that exist and are not minipar's            (a save removes them)
    DIR, DIR.tmp or DIR.old that is a link                         --save link-to-thesis
    DIR.tmp, DIR.old or DIR.lock that is another input or output   --save ck --log ck.lock

(A folder with no file in it at any depth is replaced: it holds nothing to lose.)

--save may name the --resume directory: the run continues that checkpoint, and replaces it
only atomically, with a newer complete one (checkpoint.save). A checkpoint folder is
minipar's when it holds MARKER (every save writes it first into DIR.tmp) or a meta.json with
a "format" (checkpoints written before the marker).

Then rank 0 takes the save lock (SaveLock): DIR.lock beside DIR, held with flock for the whole
run, so a second run saving to DIR stops at once with exit code 2, naming the first (its pid,
host and start). A lock whose process has died holds no flock and is taken over.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import stat
import tempfile

MARKER = "MINIPAR-CHECKPOINT"                    # the first file of every checkpoint folder
LOCK_SUFFIX = ".lock"


class OutputError(ValueError):
    """An output that would destroy something: one line, exit code 2 (config.ConfigError)."""


def real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def related(a: str, b: str) -> str | None:
    """'is' / 'is inside' / 'holds' when path a and path b are one, or one holds the other."""
    ra, rb = real(a), real(b)
    if ra == rb:
        return "is"
    try:
        if os.path.samefile(a, b):             # a hard link: another name of the same file
            return "is"
    except OSError:
        pass
    if ra.startswith(rb.rstrip(os.sep) + os.sep):
        return "is inside"
    if rb.startswith(ra.rstrip(os.sep) + os.sep):
        return "holds"
    return None


def is_minipar_checkpoint(path: str) -> bool:
    """A folder minipar wrote: MARKER in it, or a meta.json with a "format"."""
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    if os.path.isfile(os.path.join(path, MARKER)):
        return True
    try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
            return isinstance(json.load(f).get("format"), int)
    except (OSError, ValueError, AttributeError):
        return False


def holds_nothing(path: str) -> bool:
    """A folder with no file in it, at any depth (an empty folder a user made for --save, or
    a DIR.tmp cut off before its marker): replacing it destroys nothing."""
    for _, _, files in os.walk(path):
        if files:
            return False
    return True


def what_it_holds(path: str, limit: int = 4) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        return f"cannot be read: {e.strerror}"
    if not names:
        return "it is empty"
    shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
    return f"it holds {shown}"


def check_file_output(flag: str, path: str):
    """An output file: a new path, or a regular file (replaced in place); never a folder, a
    device, a FIFO or a socket."""
    if not os.path.lexists(path):
        return
    st = os.stat(path) if os.path.exists(path) else os.lstat(path)
    if stat.S_ISREG(st.st_mode):
        return
    kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
            else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
    raise OutputError(f"{flag} {path} is {kind}: minipar writes only a new file or a regular file")


def check_save_dir(path: str, resume: str | None = None):
    """--save DIR: replaced only if minipar wrote it (or it is the --resume directory, which the
    run continues); DIR.tmp and DIR.old likewise; the parent writable."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise OutputError(f"--save {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"--save {path}: directory {parent} is not writable")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise OutputError(f"--save {path} exists and is not a directory")
    if real(path) == real(os.getcwd()) or real(path) == os.sep:
        raise OutputError(f"--save {path} is the working directory ({what_it_holds(path)}): a save replaces its "
                          f"folder; name a new one, e.g. --save {os.path.join(path, 'checkpoint')}")
    for p, what in ((path, "--save"), (path + ".tmp", "--save's temporary"), (path + ".old", "--save's previous")):
        if os.path.islink(p):
            raise OutputError(f"{what} path {p} is a link (to {os.readlink(p)}): a save replaces its folder; "
                              f"name a new one")
        if os.path.isdir(p) and not is_minipar_checkpoint(p) and not holds_nothing(p) and \
                not (p == path and resume and real(resume) == real(path)):
            raise OutputError(f"{what} folder {p} exists and is not a checkpoint minipar wrote "
                              f"({what_it_holds(p)}): a save would replace it; name a new folder")
        if p != path and os.path.lexists(p) and not os.path.isdir(p):
            raise OutputError(f"{what} path {p} exists and is not a folder minipar wrote: a save would remove it")
    lock = path.rstrip(os.sep) + LOCK_SUFFIX
    if os.path.lexists(lock) and not SaveLock.is_ours(lock):
        raise OutputError(f"--save {path}: {lock} exists and is not minipar's save lock: a run would replace it")


def check_paths(outputs: list, inputs: list, save_resume: str | None = None):
    """outputs, inputs: [(flag, path)]. Every output against every input and against the
    others, then each output on its own (a folder for --save, a file otherwise). save_resume:
    the --resume folder that --save may name."""
    for flag, path in outputs:
        for iflag, ipath in inputs:
            how = related(path, ipath)
            if how and not (flag == "--save" and iflag == "--resume" and how == "is"):
                raise OutputError(f"{flag} {path} {how} {iflag} {ipath}: writing it would destroy an input")
    for i, (flag, path) in enumerate(outputs):
        for oflag, opath in outputs[i + 1:]:
            how = related(path, opath)
            if how:
                raise OutputError(f"{flag} {path} {how} {oflag} {opath}: two outputs in one place")
    for flag, path in outputs:
        if flag == "--save":
            check_save_dir(path, save_resume)
        else:
            check_file_output(flag, path)


def check(args):
    """The trainer's outputs against its inputs and each other (module docstring). --save DIR
    writes DIR.tmp, DIR.old and DIR.lock beside DIR: they are outputs too."""
    outputs = [(f, p) for f, p in (("--save", args.save), ("--log", args.log), ("--trace", args.trace),
                                   ("--timeline", args.timeline)) if p]
    inputs = [(f, p) for f, p in (("--data", args.data), ("--resume", args.resume)) if p]
    check_paths(outputs, inputs, args.resume)
    if args.save:
        beside = [(f"--save's {what}", args.save.rstrip(os.sep) + suffix)
                  for what, suffix in (("temporary", ".tmp"), ("previous", ".old"), ("lock", LOCK_SUFFIX))]
        for flag, path in beside:
            for oflag, opath in inputs + [o for o in outputs if o[0] != "--save"]:
                how = related(path, opath)
                if how:
                    raise OutputError(f"{flag} {path} {how} {oflag} {opath}: a save would remove it")


@contextlib.contextmanager
def replaced_atomically(path: str):
    """with replaced_atomically(path) as f: f.write(...): the text goes to a new temporary file
    beside `path` (a name no one else has: nothing of the user's is overwritten), which then
    takes path's place in one rename; on any error it is removed and `path` is untouched."""
    folder, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class SaveLock:
    """DIR.lock, flock-ed by rank 0 for the whole run: one run saves to DIR at a time."""

    def __init__(self, directory: str):
        self.path = directory.rstrip(os.sep) + LOCK_SUFFIX
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise OutputError(f"--save {directory}: its lock {self.path} cannot be made: {e.strerror}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 4096, 0).decode("utf-8", "replace").strip().replace("\n", "; ")
            os.close(self.fd)
            raise OutputError(f"--save {directory} is being written by another run ({holder or 'holder unknown'}); "
                              f"wait for it or save elsewhere") from None
        note = (f"minipar save lock: pid {os.getpid()} on {socket.gethostname()}, "
                f"since {datetime.datetime.now().isoformat(timespec='seconds')}\n")
        with contextlib.suppress(OSError):          # who holds it, for the message above; a
            os.ftruncate(self.fd, 0)                 # full disk leaves the lock without it
            os.pwrite(self.fd, note.encode(), 0)

    @staticmethod
    def is_ours(path: str) -> bool:
        """A lock file of minipar's (or an empty one: a run that died as it made it)."""
        if not os.path.isfile(path) or os.path.islink(path):
            return False
        try:
            with open(path, "rb") as f:
                head = f.read(64)
        except OSError:
            return False
        return head == b"" or head.startswith(b"minipar save lock")

    def release(self):
        """At the run's end: the lock file goes, then the lock."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def fsync_path(path: str):
    """Flush a file or a folder (its entries: a rename into it), opened by name, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
