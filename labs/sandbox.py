"""Where a student's code runs: a child process the grader can always end, that can harm
nothing outside its scratch folder, and whose output cannot flood the grader.

Sandbox().run(argv, scratch, env, timeout) starts argv through labs/jail.py in a session and
process group of its own, with
  - resource limits on CPU seconds, address space, file size and process count;
  - a fresh scratch folder as its working directory, HOME and TMPDIR;
  - stdout and stderr read as they come, keeping the first and last few KiB of each and
    counting the rest (a 1.5 GB flood costs the grader a few KiB);
  - when the grader runs as root ("full" mode): an unprivileged uid of its own (one per
    grading slot), its own mount namespace with a root of its own that holds only the
    system's programs and libraries, Python, the repository (read-only, the labs' answers
    emptied) and its scratch folder, and its own network namespace (loopback only);
and, when the command ends or its time is up, every process it left behind is killed: in
full mode every process of its uid (a process can leave the session and the process group,
not its uid); otherwise every process whose parent chain leads back here (the grader is a
child subreaper, so orphans are re-parented to it and cannot slip away). Not root, or where
the namespaces or the uid cannot run Python, the mode is "partial" and mode_line() says so
in one line.
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from labs.framework import REPO

PR_SET_CHILD_SUBREAPER = 36
KEEP = 8 << 10                                   # bytes kept from each end of stdout and stderr
FIRST_UID = 59000                                # the sandbox uids: FIRST_UID + slot (no passwd entry)


@dataclass
class Limits:
    """Per process, except processes (per uid in full mode)."""
    cpu_seconds: int = 120
    memory_bytes: int = 3 << 30
    file_bytes: int = 256 << 20
    processes: int = 128
    tmp_bytes: int = 512 << 20                   # /tmp and /dev/shm in full mode


@dataclass
class Stream:
    """What a child printed on one stream: the first and last KEEP bytes, and the count."""
    head: bytearray = field(default_factory=bytearray)
    tail: collections.deque = field(default_factory=collections.deque)
    tail_bytes: int = 0
    total: int = 0

    def add(self, chunk: bytes):
        self.total += len(chunk)
        room = KEEP - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail.append(chunk)
            self.tail_bytes += len(chunk)
            while self.tail_bytes - len(self.tail[0]) >= KEEP:
                self.tail_bytes -= len(self.tail.popleft())

    def text(self) -> str:
        tail = b"".join(self.tail)[-KEEP:]
        dropped = self.total - len(self.head) - len(tail)
        middle = f"\n[... {dropped:,} bytes not kept ...]\n".encode() if dropped > 0 else b""
        return (bytes(self.head) + middle + tail).decode("utf-8", "replace")


@dataclass
class Outcome:
    returncode: int | None
    timed_out: bool
    seconds: float
    stdout: str
    stderr: str
    output_bytes: int
    leftovers: int                               # processes still alive when the command had ended

    def last_error_line(self) -> str:
        noise = ("[proxy:", "[mpiexec@", "[cli_", "[unset]", "===", "BAD TERMINATION", "YOU CAN IGNORE",
                 "This typically", "Please see", "PID ", "RUNNING AT", "EXIT CODE", "CLEANING UP")
        lines = [ln.strip() for ln in self.stderr.splitlines()
                 if ln.strip() and "Abort(" not in ln and "aborting" not in ln
                 and not ln.strip().lstrip("= ").startswith(noise)]
        return lines[-1] if lines else ""


def _read(pipe, stream: Stream):
    for chunk in iter(lambda: pipe.read1(65536), b""):
        stream.add(chunk)
    pipe.close()


def _set_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _proc_field(pid: int, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def processes_of_uid(uid: int) -> list[int]:
    out = []
    for pid in _pids():
        uids = _proc_field(pid, "Uid")
        if uids and int(uids.split()[0]) == uid:
            out.append(pid)
    return out


def descendants(root: int) -> list[int]:
    """Every live process whose parent chain reaches `root` (root itself left out)."""
    parent = {}
    for pid in _pids():
        pp = _proc_field(pid, "PPid")
        if pp is not None:
            parent[pid] = int(pp)
    out = []
    for pid in parent:
        p, hops = parent.get(pid), 0
        while p and p != root and hops < 512:
            p, hops = parent.get(p), hops + 1
        if p == root and pid != root:
            out.append(pid)
    return out


def _reap():
    """Collect the exit status of every finished child (orphans re-parented here)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _in_use(uid: int) -> bool:
    try:
        import pwd                               # noqa: PLC0415
        pwd.getpwuid(uid)
        return True
    except KeyError:
        pass
    return bool(processes_of_uid(uid))


def answers() -> list[str]:
    """What the child never needs and a student would love to read: every lab's hand solution,
    minipar's reference behind the stub, the planted mistakes."""
    labs = os.path.join(REPO, "labs")
    out = []
    for d in sorted(os.listdir(labs)):
        for name in ("solution.py", "reference.py", "mutants"):
            path = os.path.join(labs, d, name)
            if d[:2].isdigit() and os.path.exists(path):
                out.append(path)
    return out


def uid_lock_path(uid: int) -> str:
    """The lock file that holds a sandbox uid while a grader uses it. One place per machine,
    whatever TMPDIR says: the uid is the machine's, and two graders with different TMPDIRs
    must not share one (each kills every process of its uid). /run is root's, as the full
    sandbox is; /tmp where there is no /run to write."""
    folder = "/run" if os.path.isdir("/run") and os.access("/run", os.W_OK) else "/tmp"
    return os.path.join(folder, f"minipar-sandbox-uid-{uid}.lock")


class Sandbox:
    """One grading slot. mode is "full" or "partial"; why says what a partial one lacks."""

    def __init__(self, slot: int = 0, limits: Limits | None = None, want_full: bool = True):
        self.limits = limits or Limits()
        self.subreaper = _set_subreaper()
        self.top = tempfile.mkdtemp(prefix="minipar-grade-")
        os.chmod(self.top, 0o711)
        self.root = os.path.join(self.top, "root")          # where each child's new root is mounted
        os.mkdir(self.root, 0o755)
        self.uid = None
        self.why = ""
        self.count = 0
        if not want_full:
            self.why = "asked to run without privilege separation"
        elif os.geteuid() != 0:
            self.why = "the grader is not root, so the child runs as this user and could write what this user can"
        elif not sys.platform.startswith("linux"):
            self.why = "not Linux: no namespaces"
        else:
            self.uid = self._claim_uid(FIRST_UID + slot)
            probe = self._probe()
            if probe:
                self.uid, self.why = None, f"the unprivileged child could not start ({probe})"
        if not self.subreaper and self.uid is None:
            self.why += "; no child subreaper, so a detached process could outlive its criterion"
        self.mode = "full" if self.uid is not None else "partial"

    def _claim_uid(self, uid: int) -> int:
        """The first free uid from `uid` on, held by a lock file for this sandbox's life: two
        graders at once never share a uid (each kills every process of its own)."""
        import fcntl                             # noqa: PLC0415
        while True:
            fd = os.open(uid_lock_path(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                uid += 1
                continue
            if _in_use(uid):
                os.close(fd)
                uid += 1
                continue
            self._lock = fd
            return uid

    def mode_line(self) -> str:
        if self.mode == "full":
            return (f"sandbox: full (uid {self.uid}, a root of its own, the repository read-only, no network, limits "
                    f"{self.limits.cpu_seconds} CPU s, {self.limits.memory_bytes >> 20} MiB, "
                    f"{self.limits.processes} processes)")
        return f"sandbox: partial: {self.why}"

    def needs(self) -> list[str]:
        paths = [REPO, sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))]
        return sorted({os.path.realpath(p) for p in paths})

    def _probe(self) -> str:
        """'' when Python, NumPy, mpi4py and minipar start as the sandbox uid, else why not."""
        folder = self.scratch()
        out = self.run([sys.executable, "-c", "import numpy, mpi4py.MPI, minipar.comm; print('ok')"],
                       folder, {}, timeout=60)
        if out.returncode == 0 and out.stdout.strip() == "ok":
            return ""
        return (out.last_error_line() or f"exit code {out.returncode}")[:300]

    def scratch(self) -> str:
        """A fresh folder for one child: its working directory, HOME and TMPDIR."""
        self.count += 1
        folder = os.path.join(self.top, f"c{self.count}")
        os.mkdir(folder, 0o700)
        for sub in ("home", "tmp", "results"):
            os.mkdir(os.path.join(folder, sub), 0o700)
        if self.uid is not None:
            for d in (folder, *(os.path.join(folder, s) for s in ("home", "tmp", "results"))):
                os.chown(d, self.uid, self.uid)
        return folder

    def config(self, scratch: str, env: dict) -> dict:
        lim = self.limits
        cfg = {"scratch": scratch, "env": env, "cpu_seconds": lim.cpu_seconds, "memory_bytes": lim.memory_bytes,
               "file_bytes": lim.file_bytes, "processes": lim.processes, "tmp_bytes": lim.tmp_bytes}
        if self.uid is not None:
            cfg.update(uid=self.uid, gid=self.uid, keep=self.needs(), hide=answers(), root=self.root)
        return cfg

    def base_env(self, scratch: str) -> dict:
        keep = ("PATH", "LANG", "LC_ALL", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
        env = {k: os.environ[k] for k in keep if k in os.environ}
        env.update(HOME=os.path.join(scratch, "home"), TMPDIR=os.path.join(scratch, "tmp"),
                   PYTHONPATH=REPO, PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        return env

    def run(self, argv: list[str], scratch: str, env: dict, timeout: float) -> Outcome:
        """Run argv in the sandbox, in `scratch`; every process it started is dead on return."""
        full_env = {**self.base_env(scratch), **env}
        cmd = [sys.executable, "-m", "labs.jail", json.dumps(self.config(scratch, full_env)), "--", *argv]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=scratch, env={**os.environ, "PYTHONPATH": REPO},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        out, err = Stream(), Stream()
        readers = [threading.Thread(target=_read, args=(proc.stdout, out), daemon=True),
                   threading.Thread(target=_read, args=(proc.stderr, err), daemon=True)]
        for t in readers:
            t.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill_group(proc.pid)
            proc.wait()
        seconds = time.monotonic() - start
        leftovers = self.kill_all(proc.pid)
        for t in readers:
            t.join(timeout=10)
        return Outcome(proc.returncode, timed_out, seconds, out.text(), err.text(), out.total + err.total,
                       leftovers)

    @staticmethod
    def _kill_group(pgid: int):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill_all(self, pgid: int) -> int:
        """Kill every process the child left: its process group, then (full mode) every process
        of its uid, or every descendant of the grader. -> how many were found alive."""
        found = set(processes_of_uid(self.uid) if self.uid is not None else descendants(os.getpid()))
        self._kill_group(pgid)
        for _ in range(200):
            alive = processes_of_uid(self.uid) if self.uid is not None else descendants(os.getpid())
            alive = [p for p in alive if _proc_field(p, "State") not in (None,) and
                     not (_proc_field(p, "State") or "").startswith("Z")]
            if not alive:
                break
            found.update(alive)
            if self.uid is not None:
                self._kill_as_uid()
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            _reap()
            time.sleep(0.01)
        # the dead are collected too: an orphan re-parented here after the last look would
        # otherwise outlive this grader as a zombie of its parent
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            _reap()
            rest = processes_of_uid(self.uid) if self.uid is not None else descendants(os.getpid())
            if not rest:
                break
            time.sleep(0.01)
        return len(found)

    def _kill_as_uid(self):
        """kill(-1, SIGKILL) as the sandbox uid: every process of that uid at once, however
        fast it forks (the caller itself excepted, which then exits)."""
        pid = os.fork()
        if pid == 0:
            try:
                os.setgid(self.uid)
                os.setuid(self.uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)

    def close(self):
        import shutil                            # noqa: PLC0415
        shutil.rmtree(self.top, ignore_errors=True)
        if getattr(self, "_lock", None) is not None:
            os.close(self._lock)
            self._lock = None
