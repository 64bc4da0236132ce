"""The hostile corpus (tests/hostile/, its runner corpus.py): each file must fail with its named
reason, scanned and (with the full sandbox) unscanned, leaving no process, no file outside its
scratch folder and an intact report. `make test` runs a sample (and tests/test_classroom.py
grades the hand solution in full in a class with hostile files beside it);
MINIPAR_HOSTILE_ALL=1 (make labs-check-full) runs every file, and the hand solution of its lab
after each, which must pass every criterion."""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "hostile"))

import corpus  # noqa: E402

ALL = os.environ.get("MINIPAR_HOSTILE_ALL") == "1"
# the detached report rewriter runs in tests/test_classroom.py, a file that is not UTF-8 there and in
# tests/test_grader_parts.py; the flood, the hangs and the other exits only in the full run
SAMPLE = ["exit_in_function.py", "patch_numpy.py", "forge_results.py", "wrap_ring.py"]
CASES = corpus.cases() if ALL else corpus.cases(SAMPLE)


def test_the_corpus_is_large_and_every_file_says_what_stops_it():
    every = corpus.cases()
    assert len(every) >= 25
    for c in every:
        assert c.tries and c.lab and c.scan and c.sandbox, c.path


@pytest.mark.parametrize("case", CASES, ids=[os.path.basename(c.path) for c in CASES])
def test_a_hostile_file_fails_with_its_reason_and_harms_nothing(case):
    rows = corpus.run([os.path.basename(case.path)], solution_each=ALL, say=lambda line: None)
    (_, scanned, bare), = rows
    assert scanned.ok, f"scanned: {scanned.reason} {scanned.problems}"
    assert bare is None or bare.ok, f"without the scan: {bare.reason} {bare.problems}"

