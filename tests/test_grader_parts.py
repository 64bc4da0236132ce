"""The grader's parts, each on its own: the scan (labs/scan.py), the records a child hands back
(labs/results.py), the sandbox (labs/sandbox.py) and the file reading of labs/grade.py. Each
hostile input here must fail safely: a clear reason, never a hang, a traceback or a pass."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from labs import framework, grade, results, scan  # noqa: E402
from labs.sandbox import Sandbox, Stream  # noqa: E402

LAB02 = scan.Allowed(modules={"minipar.comm": {"traffic"}},
                     refused={"minipar.comm.reduce_scatter": "minipar's own collective"})


def reasons(source, allowed=LAB02):
    return [f"{f.line}: {f.reason}" for f in scan.scan(source, "s.py", allowed)]


# --- the scan -----------------------------------------------------------------------------

@pytest.mark.parametrize("source, reason", [
    ("import os", "import of os"),
    ("import subprocess", "import of subprocess"),
    ("import ctypes", "import of ctypes"),
    ("import importlib", "import of importlib"),
    ("import builtins", "import of builtins"),
    ("import sys", "import of sys"),
    ("from labs import framework", "the labs' own code"),
    ("from labs.framework import first_difference", "the labs' own code"),
    ("from minipar.comm import ring", "minipar.comm.ring is not part of this lab's API"),
    ("from minipar.comm.algorithms.ring import reduce_scatter", "not a module this lab's handout gives"),
    ("from minipar import comm\ncomm.reduce_scatter(1, 2)", "minipar's own collective"),
    ("from minipar import comm as c\nc.all_gather(1, 2)", "minipar.comm.all_gather is not part of this lab's API"),
    ("from . import x", "a relative import"),
    ("from numpy import *", "a star import"),
    ("__import__('os')", "__import__: imports a module by name"),
    ("exec('1')", "exec: runs code"), ("eval('1')", "eval: runs code"), ("compile('1', 'f', 'exec')", "compile"),
    ("open('/etc/passwd')", "open: opens files"),
    ("f = open", "open: opens files"),
    ("globals()['x'] = 1", "globals"),
    ("import numpy as np\ngetattr(np, 'lo' + 'ad')", "not a plain string literal"),
    ("import numpy as np\ngetattr(np, '__dict__')", "a refused attribute"),
    ("x = ().__class__.__base__.__subclasses__()", "__class__"),
    ("import numpy as np\nnp.load('x.npy')", "reads or writes files"),
    ("import numpy as np\nnp.zeros(3).tofile('x')", "reads or writes files"),
    ("import numpy as np\nnp.ctypeslib", "reaches raw memory"),
    ("import numpy as np\nnp.isclose = None", "changes numpy.isclose"),
    ("import numpy as np\ndel np.allclose", "changes numpy.allclose"),
    ("def f(g):\n    g.comm.Allreduce(1, 2)", "an MPI collective"),
    ("def f(g):\n    g.comm.Abort(0)", "ends or reshapes the MPI job"),
    ("def f(g):\n    return g.f_back", "the interpreter's insides"),
    ("'{0.__class__}'.format(1)", "reaches into attributes"),
    ("s = '{0}'\ns.format(1)", "not a literal"),
    ("x = __builtins__", "__builtins__"),
    ("import mpi4py", "import of mpi4py"),
    ("import numpy.ctypeslib", "import of numpy.ctypeslib"),
    ("import minipar.comm\nminipar.train.main()", "minipar.train is not part of this lab's API"),
    ("from minipar import comm\ngetattr(comm, 'reduce_scatter')", "minipar's own collective"),
    ("from minipar import comm\ngetattr(comm, 'all_gather')(1, 2)", "minipar.comm.all_gather is not part"),
    ("x = [].__class__", "__class__"),
])
def test_the_scan_refuses(source, reason):
    found = reasons(source)
    assert any(reason in f for f in found), found


@pytest.mark.parametrize("source", [
    "import numpy as np\nx = np.linalg.norm(np.zeros(3)) + np.random.default_rng(0).standard_normal()",
    "from __future__ import annotations\nimport math, itertools, functools\nfrom dataclasses import dataclass",
    "from minipar import comm\ncomm.traffic()",
    "class A:\n    def __init__(self):\n        self.x = 1\n    def __eq__(self, o):\n        return True",
    "getattr(object(), 'name', None)",
    "'{:.3f} {}'.format(1.0, 2)",
    "if __name__ == '__main__':\n    print(f'{1:.2f}')",
    "import time\nt = time.perf_counter()",
    "class A(object):\n    def __init__(self):\n        super().__init__()\n        object.__init__(self)",
    "import minipar.comm\nminipar.comm.traffic()",
])
def test_the_scan_passes_plain_solutions(source):
    assert reasons(source) == []


def test_the_scan_names_the_line_and_a_syntax_error():
    found = scan.scan("import numpy as np\n\n\nimport os\n", "ring.py", LAB02)
    assert [(f.line, f.code) for f in found] == [(4, "import os")]
    with pytest.raises(SyntaxError) as e:
        scan.scan("def f(:\n", "ring.py", LAB02)
    assert e.value.lineno == 1


def test_every_lab_declares_what_a_solution_may_use():
    for lab_dir in framework.lab_dirs():
        lab = framework.load_lab(lab_dir)
        assert isinstance(lab.ALLOWED, scan.Allowed), lab_dir
        for name in ("solution.py", "student.py"):
            with open(os.path.join(lab_dir, name), encoding="utf-8") as f:
                found = scan.scan(f.read(), name, lab.ALLOWED)
            assert not found, f"{lab_dir}/{name}: {[str(x) for x in found]}"


# --- the records a child hands back ----------------------------------------------------------

def write_record(folder, rank=0, values=None, meta=None):
    rec = results.Encoder()
    encoded = {k: rec.encode(v) for k, v in (values or {}).items()}
    results.write(str(folder), rank, encoded, rec.arrays, meta or {"error": None})


def test_values_come_back_as_they_went(tmp_path):
    class Mine:
        def __repr__(self):
            raise RuntimeError("never called")
    values = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "f": 1.5, "nan": float("nan"), "i": 2**80,
              "b": True, "npb": np.bool_(False), "s": "text", "n": None, "t": (1, [2.0, "x"]),
              "d": {"k": np.float32(3)}, "o": Mine(), "e": np.zeros((0, 4))}
    write_record(tmp_path, values=values)
    got = results.Results(str(tmp_path), 1).values[0]
    assert got["a"].dtype == np.int32 and got["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["f"] == 1.5 and np.isnan(got["nan"]) and got["i"] == 2**80 and got["b"] is True
    assert isinstance(got["npb"], np.bool_) and got["s"] == "text" and got["n"] is None
    assert got["t"] == (1, [2.0, "x"]) and got["d"]["k"].dtype == np.float32
    assert isinstance(got["o"], results.Opaque) and got["o"].typename == "Mine"
    assert got["e"].shape == (0, 4)


def test_a_missing_value_names_the_rank_its_error_or_its_exit(tmp_path):
    write_record(tmp_path, 0, {"x": 1})
    write_record(tmp_path, 1, {}, {"error": "p=2 rank 1 n=7: ValueError: boom (ring.py, line 3)",
                                   "error_type": "ValueError"})
    res = results.Results(str(tmp_path), 3)
    assert res.get(0, "x") == 1
    with pytest.raises(results.Unanswered, match="rank 1: p=2 rank 1 n=7: ValueError: boom"):
        res.get(0, "y")
    os.unlink(tmp_path / "rank1.json")
    (tmp_path / "progress2").write_text("p=3 n=9")
    with pytest.raises(results.Unanswered, match=r"rank 1 exited before returning its results"):
        results.Results(str(tmp_path), 3).get(1, "y")


@pytest.mark.parametrize("damage, reason", [
    ("fifo", "not a regular file"),
    ("symlink", "Too many levels of symbolic links|not a regular file|Symbolic"),
    ("huge", "more than"),
    ("not json", "not JSON"),
    ("deep", "nests too deep|not in the results' format|RecursionError"),
    ("compressed", "compressed"),
    ("pickled", "cannot be read"),
    ("bad kind", "not in the results' format"),
])
def test_a_damaged_record_is_refused_quickly(tmp_path, damage, reason):
    write_record(tmp_path, 0, {"x": np.arange(3)})
    js, npz = tmp_path / "rank0.json", tmp_path / "rank0.npz"
    if damage == "fifo":
        js.unlink()
        os.mkfifo(js)
    elif damage == "symlink":
        js.unlink()
        js.symlink_to("/etc/passwd")
    elif damage == "huge":
        with open(npz, "wb") as f:
            f.truncate(results.MAX_FILE_BYTES + 1)
    elif damage == "not json":
        js.write_text("{")
    elif damage == "deep":
        js.write_text('{"values": {"x": ' + '{"list": [' * 5000 + ']}' * 5000 + '}}')
    elif damage == "compressed":
        np.savez_compressed(npz, a0=np.arange(3))
    elif damage == "pickled":
        with open(npz, "wb") as f:
            np.save(f, np.array([object()], dtype=object), allow_pickle=True)
    elif damage == "bad kind":
        js.write_text(json.dumps({"values": {"x": {"eval": "1"}}}))
    start = time.monotonic()
    res = results.Results(str(tmp_path), 1)
    assert time.monotonic() - start < 5
    with pytest.raises(results.Unanswered) as e:
        res.get(0, "x")
    assert any(r in str(e.value) for r in reason.split("|")), str(e.value)


# --- the sandbox ------------------------------------------------------------------------------

def test_a_flood_is_kept_at_its_two_ends():
    s = Stream()
    s.add(b"head-" + b"x" * 100_000)
    for _ in range(200):
        s.add(b"y" * 65536)
    s.add(b"-tail")
    text = s.text()
    assert text.startswith("head-") and text.endswith("-tail") and len(text) < 20_000
    assert "bytes not kept" in text and s.total == 5 + 100_000 + 200 * 65536 + 5


def test_every_process_a_child_leaves_is_killed_and_its_output_capped():
    s = Sandbox()
    try:
        folder = s.scratch()
        code = ("import subprocess, sys; subprocess.Popen(['sleep', '300'], start_new_session=True); "
                "sys.stdout.write('z' * 5_000_000); print('done')")
        out = s.run([sys.executable, "-c", code], folder, {}, timeout=60)
        assert out.returncode == 0 and out.leftovers >= 1 and out.output_bytes > 5_000_000
        assert out.stdout.endswith("done\n") and len(out.stdout) < 20_000
        spin = s.run([sys.executable, "-c", "while True: pass"], s.scratch(), {}, timeout=2)
        assert spin.timed_out and spin.seconds < 10
    finally:
        s.close()


def test_full_sandbox_keeps_the_child_away_from_the_repository_the_answers_and_the_network():
    s = Sandbox()
    try:
        if os.geteuid() != 0 or not sys.platform.startswith("linux"):
            pytest.skip(f"needs the full sandbox (root on Linux): {s.mode_line()}")
        assert s.mode == "full", s.mode_line()          # root: a partial sandbox is a fault
        code = ("import os, socket\n"
                "print(os.getuid() != 0, os.access(os.environ['PYTHONPATH'], os.W_OK))\n"
                "print(os.path.getsize(os.environ['PYTHONPATH'] + '/labs/02_ring/solution.py'))\n"
                "print([i[1] for i in socket.if_nameindex()])\n"
                "import resource; print(resource.getrlimit(resource.RLIMIT_NPROC)[0])\n"
                "print(sorted(os.listdir('/')))\n"
                "print([os.path.exists(p) for p in ('/home', '/opt', '/var', '/root/.bashrc', '/etc/shadow')])")
        out = s.run([sys.executable, "-c", code], s.scratch(), {}, timeout=60)
        lines = out.stdout.split("\n")
        assert lines[:4] == ["True False", "0", "['lo']", str(s.limits.processes)], out
        system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "sys", "tmp", "usr"}
        own = {p.strip("/").split("/")[0] for p in (REPO, sys.prefix, sys.base_prefix)}
        assert set(eval(lines[4])) <= system | own, lines[4]         # the rest of the machine is not there
        assert lines[5] == "[False, False, False, False, True]", lines[5]   # /etc is there, unreadable
    finally:
        s.close()


def test_the_partial_sandbox_says_so_in_one_line():
    s = Sandbox(want_full=False)
    try:
        assert s.mode == "partial" and s.mode_line().startswith("sandbox: partial: ") and "\n" not in s.mode_line()
    finally:
        s.close()


# --- reading the student's file ---------------------------------------------------------------

def test_a_student_file_that_is_not_text_is_a_verdict_not_a_traceback(tmp_path):
    for name, data, reason in (("latin1.py", "# résumé\n".encode("latin-1"), "not UTF-8 text"),
                               ("binary.py", b"\x7fELF\x00\x01", "a binary file")):
        (tmp_path / name).write_bytes(data)
        p = subprocess.run([sys.executable, "-m", "labs.grade", "02", "--student", str(tmp_path / name),
                            "--json", str(tmp_path / "r.json")], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 1 and "Traceback" not in p.stdout + p.stderr, p.stderr
        report = json.loads((tmp_path / "r.json").read_text())
        assert reason in report["criteria"][0]["message"] and report["not_run"] == report["total"] - 1


@pytest.mark.parametrize("kind", ["fifo", "directory", "missing", "huge"])
def test_a_student_path_that_is_no_file_is_refused_in_one_line(tmp_path, kind):
    path = tmp_path / "ring.py"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        path.write_bytes(b"#" * (grade.MAX_STUDENT_BYTES + 1))
    p = subprocess.run([sys.executable, "-m", "labs.grade", "02", "--student", str(path)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("python -m labs.grade: error:")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr


def test_student_always_grades_the_file_it_names_and_mutant_grades_the_patch(tmp_path):
    """A file named like a mutant, holding one comment, is graded as it is (its own sha256),
    never as the hand solution the patch format would make of it."""
    import hashlib
    tiny = tmp_path / "x.mutant"
    tiny.write_text("# criterion: reduce_scatter against NumPy\n")
    p = subprocess.run([sys.executable, "-m", "labs.grade", "02", "--student", str(tiny), "--first-failure",
                        "--json", str(tmp_path / "r.json")], cwd=REPO, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "r.json").read_text())
    assert p.returncode == 1 and report["sha256"] == hashlib.sha256(tiny.read_bytes()).hexdigest()
    assert report["graded_as"] == "student" and "the file defines no reduce_scatter" in report["criteria"][1]["message"]
    mutant = os.path.join(REPO, "labs", "02_ring", "mutants", "m01_no_reduction.mutant")
    p = subprocess.run([sys.executable, "-m", "labs.grade", "02", "--mutant", mutant, "--first-failure",
                        "--json", str(tmp_path / "m.json")], cwd=REPO, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "m.json").read_text())
    assert report["graded_as"] == "mutant" and report["criteria"][1]["status"] == "fail"
    assert "largest |difference|" in report["criteria"][1]["message"]


def test_two_graders_with_different_tmpdirs_never_share_a_uid(tmp_path):
    """The uid's lock is the machine's, not TMPDIR's: a grader that kills every process of its
    uid must not hold the uid of a grader started with another TMPDIR."""
    import tempfile                                                 # noqa: PLC0415
    first = Sandbox()
    try:
        if first.mode != "full":
            pytest.skip(f"the full sandbox is not available here: {first.why}")
        saved = tempfile.tempdir
        other = tmp_path / "elsewhere"
        other.mkdir()
        tempfile.tempdir = str(other)                               # as TMPDIR=elsewhere would
        try:
            second = Sandbox()
        finally:
            tempfile.tempdir = saved
        try:
            assert second.uid != first.uid, (first.uid, second.uid)
            assert not any(f.startswith("minipar-sandbox-uid-") for f in os.listdir(other))
        finally:
            second.close()
    finally:
        first.close()
