# The whole set-up on a fresh machine: `make train` and `make test` create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test test-gpu venv benchmark clean

# pyproject.toml holds ranges; constraints.txt the exact versions installed here (and so in CI), which are
# also every package cnns needs: `pip install -r constraints.txt` installs them all but cnns itself.
# The C++ kernels (src/cnns/kernels) need neither torch nor Python headers, so setup.py compiles them in the
# background while pip unpacks torch (gigabytes of disk writes): the set-up costs what the install costs.
# The editable install at the end, without build isolation, takes the libraries compiled in place
# (setup.py's _built_in_place) and adds the `cnns` command. setuptools comes first: torch needs a newer one
# than a new venv has, and replacing it while the compile runs would pull it from under that process.
$(STAMP): pyproject.toml constraints.txt setup.py $(wildcard src/cnns/kernels/*.cpp src/cnns/kernels/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet 'setuptools>=77.0.3' wheel
	$(PY) setup.py --quiet build_ext --inplace > $(VENV)/kernels.log 2>&1 & compile=$$!; \
	$(PY) -m pip install --quiet -r constraints.txt; installed=$$?; \
	wait $$compile || { cat $(VENV)/kernels.log; exit 1; }; exit $$installed
	$(PY) -m pip install --quiet -c constraints.txt --no-build-isolation -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# Quick start: train ResNet-8 on the built-in 10-class dataset (written on first use) and validate it.
train: $(STAMP)
	$(PY) train.py --config quickstart

# --durations=10: the ten slowest tests end the report, so the next slow one is seen when it arrives.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=10 tests

# The CUDA tier (tests marked cuda), one process: the GPU is not shared between test workers. `make test`
# hides any GPU (tests/conftest.py), so it is the same CPU suite on every machine.
test-gpu: $(STAMP)
	CNNS_TEST_GPU=1 $(PY) -m pytest -q -m cuda tests

benchmark: $(STAMP)
	$(PY) -m cnns benchmark --spec benchmarks.yml

clean:
	rm -rf logs data/builtin build .pytest_cache
