"""The hostile corpus: student files that try to fool, hang, flood or harm the grader.

    python tests/hostile/corpus.py [FILE ...] [--no-solution]

Each file's header says what it tries and what must stop it:

    # hostile: what it tries
    # lab: 02
    # scan: the reason the scan refuses it ("passes": the scan cannot see it)
    # sandbox: the reason its first failing criterion gives when run without the scan

Every file is graded twice through `python -m labs.grade`: as a student's file (the scan
first), and with --no-scan, which proves what the sandbox and the out-of-process verdict hold
alone (this second run happens only with the full sandbox, as root: without it a file that
deletes or writes would really do so). After each file: its verdict fails with the named
reason, within its criteria's timeouts; no process is left; nothing outside the scratch
folder was written (the repository's minipar/ and labs/, the markers the files try to leave);
the --json report is the grader's, even seconds later; and (unless --no-solution) the lab's
hand solution still passes every criterion. Prints a table: file, reason, seconds.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

from labs.classroom import tree_digest  # noqa: E402
from labs.sandbox import FIRST_UID, processes_of_uid, uid_lock_path  # noqa: E402

MARKER = "minipar-hostile-marker"
MARKER_FILES = [f"/tmp/{MARKER}", f"/root/.{MARKER}", os.path.join(REPO, MARKER)]
MAX_GRADER_RSS_MB = 400            # the grader holds a few KiB of a 1.5 GB flood, not the flood


@dataclass
class Case:
    path: str
    tries: str
    lab: str
    scan: str
    sandbox: str


@dataclass
class Outcome:
    ok: bool
    reason: str
    seconds: float
    problems: list


def cases(names=()) -> list[Case]:
    out = []
    for name in sorted(os.listdir(HERE)):
        if not name.endswith(".py") or name in ("corpus.py", "__init__.py") or (names and name not in names):
            continue
        with open(os.path.join(HERE, name), "rb") as f:
            head = f.read(2000).decode("utf-8", "replace")
        fields = dict(re.findall(r"^# (hostile|lab|scan|sandbox): (.*)$", head, re.M))
        out.append(Case(os.path.join(HERE, name), fields["hostile"], fields["lab"], fields["scan"],
                        fields["sandbox"]))
    return out


def full_sandbox() -> bool:
    """Asked of a child process: a Sandbox makes its process a child subreaper, which this one,
    that waits for nobody's orphans, must not become."""
    code = "from labs.sandbox import Sandbox; s = Sandbox(); print(s.mode); s.close()"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": REPO})
    return p.stdout.strip() == "full"


class Listener:
    """A TCP server on this machine's loopback that counts connections (network_probe.py's target)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        self.stop = False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
                self.hits += 1
                conn.close()
            except OSError:
                pass

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close()


def leftovers() -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if MARKER.encode() in f.read():
                    found.append(f"process {pid} ({MARKER})")
        except OSError:
            pass
    for uid in range(FIRST_UID, FIRST_UID + 16):
        if not held_by_a_grader(uid):
            found += [f"process {p} of sandbox uid {uid}" for p in processes_of_uid(uid) if not zombie(p)]
    return found


def zombie(pid: int) -> bool:
    """Dead, waiting for its parent to collect it: nothing runs."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def held_by_a_grader(uid: int) -> bool:
    """Is a grader running now with this sandbox uid (another grading, not the one checked)?"""
    import fcntl
    try:
        fd = os.open(uid_lock_path(uid), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def grade(case: Case, scanned: bool, port: int, student_path: str | None = None) -> tuple:
    """(the report, seconds, the grader's output, the largest resident size in MB of the
    grader and its children) of one grading (--first-failure, but for the hand solution)."""
    with tempfile.TemporaryDirectory(prefix="minipar-hostile-") as tmp:
        report = os.path.join(tmp, "report.json")
        path = student_path or os.path.join(tmp, os.path.basename(case.path))
        if student_path is None:
            with open(case.path, "rb") as f:
                data = f.read()
            data = data.replace(b"@REPORT@", report.encode()).replace(b"@PORT@", str(port).encode())
            with open(path, "wb") as f:
                f.write(data)
        cmd = [sys.executable, "-m", "labs.grade", case.lab, "--student", path, "--json", report]
        cmd += [] if student_path else ["--first-failure"]
        cmd += [] if scanned else ["--no-scan"]
        start = time.monotonic()
        with open(os.path.join(tmp, "out"), "w+b") as out:
            p = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONPATH": REPO})
            _, _, usage = os.wait4(p.pid, 0)     # the grader and every process it waited for
            seconds = time.monotonic() - start
            out.seek(0)
            output = out.read().decode("utf-8", "replace")
        if "rewrite" in case.path:
            time.sleep(6)                  # the detached process would write after 4 s
        with open(report, encoding="utf-8") as f:
            return json.load(f), seconds, output, usage.ru_maxrss / 1024


def check(case: Case, scanned: bool, port: int, listener: Listener) -> Outcome:
    digest = tree_digest()
    problems = []
    try:
        report, seconds, output, rss = grade(case, scanned, port)
    except (ValueError, OSError, KeyError) as e:
        return Outcome(False, f"no report: {type(e).__name__}: {e}", 0.0, [f"the report is damaged: {e}"])
    first = next((c for c in report.get("criteria", []) if c.get("status") == "fail"), None)
    want = case.scan if scanned and case.scan != "passes" else case.sandbox
    reason = f"{first['name']}: {first['message']}" if first else "PASSED"
    if first is None:
        problems.append("it passed")
    elif want not in first["message"]:
        problems.append(f"want the reason {want!r}")
    if scanned and case.scan != "passes" and first and first["name"] != "scan: imports and names":
        problems.append("the scan did not refuse it")
    if report.get("passed", 0) >= report.get("total", 1) or "criteria" not in report:
        problems.append(f"the report says {report.get('passed')}/{report.get('total')}")
    problems += leftovers()
    problems += [f"{m} exists" for m in MARKER_FILES if os.path.lexists(m)]
    if tree_digest() != digest:
        problems.append("minipar/ or labs/ changed")
    if listener.hits:
        problems.append(f"{listener.hits} connection(s) reached this machine's loopback")
    if rss > MAX_GRADER_RSS_MB:
        problems.append(f"a process of the grading held {rss:.0f} MB")
    return Outcome(not problems, reason, seconds, problems)


def solution_passes(lab: str) -> list[str]:
    from labs import framework             # noqa: PLC0415
    path = os.path.join(framework.find(lab), "solution.py")
    report, *_ = grade(Case(path, "", lab, "", ""), True, 0, student_path=path)
    bad = [c["name"] for c in report["criteria"] if c["status"] != "pass"]
    return [f"the hand solution of lab {lab} no longer passes {bad}"] if bad else []


def run(names=(), solution_each: bool = True, say=print) -> list[tuple[Case, Outcome | None, Outcome | None]]:
    full = full_sandbox()
    listener = Listener()
    rows = []
    try:
        for case in cases(names):
            scanned = check(case, True, listener.port, listener)
            bare = check(case, False, listener.port, listener) if full else None
            if solution_each:
                scanned.problems += solution_passes(case.lab)
                scanned.ok = not scanned.problems
            rows.append((case, scanned, bare))
            say(line(case, scanned, bare))
    finally:
        listener.close()
    if not full:
        say("(the runs without the scan need the full sandbox, as root: not run here)")
    return rows


def line(case: Case, scanned: Outcome, bare: Outcome | None) -> str:
    def cell(o):
        if o is None:
            return "-"
        return f"{'ok' if o.ok else 'BAD'} {o.seconds:5.1f} s  {o.reason[:110]}" + \
            ("" if o.ok else f"  PROBLEMS: {o.problems}")
    return f"{os.path.basename(case.path):<26} scanned: {cell(scanned)}\n{'':<26} no scan: {cell(bare)}"


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    each = "--no-solution" not in argv
    names = [a for a in argv if not a.startswith("--")]
    rows = run(names, each)
    bad = [c for c, a, b in rows if not a.ok or (b is not None and not b.ok)]
    print(f"hostile corpus: {len(rows)} files, {len(rows) - len(bad)} held" +
          (f"; NOT HELD: {[os.path.basename(c.path) for c in bad]}" if bad else ""))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
