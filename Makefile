# minipar: `make run` and `make test` work from a clean clone (they install into .venv first).
VENV   ?= .venv
PY     := $(VENV)/bin/python
MPIRUN := $(VENV)/bin/mpirun
NP     ?= 4
# Several ranks share few cores: one BLAS thread per rank.
export OMP_NUM_THREADS := 1
export OPENBLAS_NUM_THREADS := 1
export MKL_NUM_THREADS := 1

.PHONY: install run test test-serial test-mpi labs-check labs-check-full lab lab-run bench clean bytecode

install: $(VENV)/.installed

# Every test launches many Pythons (4 ranks per mpirun); each compiles minipar afresh when no
# .pyc is cached, which PYTHONDONTWRITEBYTECODE forbids. compileall writes the cache anyway
# (only for files changed since), so a 4-rank launch starts in 0.8 s instead of 1.1 s.
# tests/hostile/ is left out: some of its student files are not Python on purpose.
bytecode: install
	@$(PY) -m compileall -q -x 'tests/hostile/' minipar labs tests scripts > /dev/null

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[mpich,test,plot]'
	touch $@

# On 4 ranks: 2 data-parallel replicas with ZeRO-1, each a 2-stage 1F1B pipeline, on the
# built-in corpus. NP=1: one process; RUN_FLAGS="..." for any other layout. The log, the
# trace and the plots go to one directory, runs/<date-time>/ (RUN_DIR=... to choose).
RUN_FLAGS ?= $(if $(filter 4,$(NP)),--dp 2 --pp 2 --zero 1 --micro-batches 4,)
ifndef RUN_DIR
RUN_DIR := runs/$(shell date +%Y%m%d-%H%M%S)
endif
run: bytecode
	@mkdir -p $(RUN_DIR)
	$(MPIRUN) -n $(NP) $(PY) -m minipar.train $(RUN_FLAGS) --eval-every 50 \
		--log $(RUN_DIR)/log.jsonl --trace $(RUN_DIR)/trace.json
	@$(PY) -m minipar.plot $(RUN_DIR)/log.jsonl --trace $(RUN_DIR)/trace.json --out $(RUN_DIR) \
		|| echo "(no plots: see the line above)"
	@echo "run directory: $(RUN_DIR)/  log.jsonl (a row per step, then the summary), trace.json" \
		"(open in https://ui.perfetto.dev), *.png and *.svg (the plots)"

test: test-serial labs-check test-mpi

# The serial tests in JOBS worker processes (pytest-xdist): most of them wait on an mpirun or a
# sandboxed grader, so two workers keep both cores of a small machine busy. JOBS=0: one process.
JOBS ?= 2
test-serial: bytecode
	$(PY) -m pytest -q $(if $(filter-out 0,$(JOBS)),-n $(JOBS),) tests

# MPI tests: 4 ranks, a hard timeout, and any failing rank aborts the world (tests/mpi/conftest.py).
test-mpi: bytecode
	timeout -k 10 900 $(MPIRUN) -n $(NP) $(PY) -m pytest -q -p no:cacheprovider --with-mpi tests/mpi

# The teaching labs (labs/README.md): every grader passes the hand-written solution, fails the
# stub and catches a planted mistake (labs-check-full: minipar's code too, and every mistake).
labs-check: bytecode
	timeout -k 10 600 $(PY) -m labs.check_all --quick --jobs $(if $(filter-out 0,$(JOBS)),$(JOBS),1)

# Every mutant of every lab, then the whole hostile corpus (tests/hostile/), with the hand
# solution graded after each hostile file, and every command the handouts print, run as printed
# (run before changing a lab or the grader).
labs-check-full: install
	timeout -k 10 3600 $(PY) -m labs.check_all --jobs $(if $(filter-out 0,$(JOBS)),$(JOBS),1)
	MINIPAR_HOSTILE_ALL=1 MINIPAR_HANDOUTS_RUN=1 timeout -k 10 3600 $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_hostile.py tests/test_handouts.py

# Grade one lab: make lab L=02 (labs/02_*/student.py), or STUDENT=path/to/file.py.
lab: install
	@test -n "$(L)" || { echo "make lab L=NN [STUDENT=file.py]: which lab? see labs/README.md"; exit 2; }
	$(PY) -m labs.grade $(L) $(if $(STUDENT),--student $(STUDENT),)

# The student's code in the real trainer: make lab-run L=02 NP=4 STUDENT=ring.py FLAGS="--dp 4 --zero 2 --verify"
lab-run: install
	@test -n "$(L)" || { echo "make lab-run L=NN NP=4 [STUDENT=file.py] FLAGS='...': which lab?"; exit 2; }
	$(PY) -m labs.run $(L) -n $(NP) $(if $(STUDENT),--student $(STUDENT),) -- $(FLAGS)

bench: install
	@for s in scripts/bench_*.py; do echo "== $$s"; $(PY) $$s || exit 1; done

clean:
	rm -rf $(VENV) *.egg-info
