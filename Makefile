# Two commands a newcomer needs: `make train` and `make test`. Both install first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install train test clean

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
	$(PY) -m pytest -q -n $(JOBS) --dist worksteal --cov --cov-report=term $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs
