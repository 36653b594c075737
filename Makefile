# Two commands a newcomer needs: `make train` and `make test`. Both install first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install train test coverage gpu-check clean

install: $(STAMP)

# Re-installs only when the project metadata changes; the venv is created once.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

train: install
	$(PY) scripts/train.py --strategy mirrored

# Tests run in parallel, one pytest worker per core (most of a test is single-threaded graph
# building); an idle worker takes tests queued on a busy one (worksteal), so a slow file at the
# end of the queue does not leave a core idle. JOBS=0: serial.
JOBS ?= auto
test: install
	$(PY) -m pytest -q -n $(JOBS) --dist worksteal $(PYTEST_ARGS)

# The same suite with line and branch coverage of tfpar/ and its floor (pyproject.toml).
# Coverage's tracer makes the suite's Python about 35% slower (tests/test_oracle.py and
# tests/test_progress.py: 43 s against 32 s), so `make test`, which CI runs, goes without.
coverage: install
	$(PY) -m pytest -q -n $(JOBS) --dist worksteal --cov --cov-report=term $(PYTEST_ARGS)

# The GPU suite (tests/gpu): cuDNN in the traced graph, mirrored over every GPU with NCCL, a
# killed run resumed exactly, verify with TF32 off, the pipeline on 2 GPUs, tokens/s (cuDNN
# against the CPU recurrence; mirrored on 1 and every GPU); it ends with a report to paste
# into an issue (tfpar/docs/gpu.md, "The report"). Where an
# NVIDIA GPU is expected (tfpar.parallel.host.gpus_expected, the check training makes) the
# gpu extra (TensorFlow's CUDA and cuDNN libraries) is installed first. tests/gpu/check.py
# then runs the suite where TensorFlow sees a GPU, fails with one line naming what is
# missing where it should and does not, and skips with one line where there is no NVIDIA GPU.
GPU_STAMP := $(VENV)/.installed-gpu

gpu-check: install
	@if [ ! -f $(GPU_STAMP) -o pyproject.toml -nt $(GPU_STAMP) ] && $(PY) -c "import sys; \
	from tfpar.parallel.host import gpus_expected; sys.exit(gpus_expected() is None)"; then \
	$(PY) -m pip install --quiet -e ".[test,bench,gpu]" && touch $(GPU_STAMP); fi
	@$(PY) tests/gpu/check.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs
