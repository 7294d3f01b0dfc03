# Every target works from a fresh clone: `make demo` and `make test` install what they need first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast constraints clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall only when the dependency declarations change. --no-compile: pip would byte-compile every
# module of every package (torch, jax, ray: 68 s of install instead of 30 on this 2-core machine);
# Python compiles the modules a process imports on first use instead.
$(STAMP): $(PY) pyproject.toml constraints.txt locojax/_bind_shim.c
	$(PY) -m pip install --quiet --no-compile -c constraints.txt -e '.[test]'
	touch $(STAMP)

# The dashboard's browser libraries: exact versions from package.json (no lock file, see .npmrc),
# their dist files copied into web/static/vendor/ (ignored by git).
VENDOR := web/static/vendor
$(VENDOR)/.installed: package.json
	npm install --no-save --no-audit --no-fund
	mkdir -p $(VENDOR)
	cp node_modules/htmx.org/dist/htmx.min.js node_modules/uplot/dist/uPlot.iife.min.js \
	   node_modules/uplot/dist/uPlot.min.css $(VENDOR)/
	touch $@

install: $(STAMP) $(VENDOR)/.installed

# The embedded control plane (API, dashboard, scheduler, one local host worker on SQLite), with the
# demo submitted through its REST API; `locojax demo` runs the same two runs without the control plane.
demo: install
	$(VENV)/bin/locojax up --hosts 1 --demo

# Two pytest-xdist workers (this machine has 2 cores), handed whole modules (tests/e2e as one unit) in
# the order tests/conftest.py sets: its pytest_xdist_make_scheduler serves any --dist mode but "no".
XDIST := -n 2 --dist loadscope

# Two workers too: the suite's processes leave cores idle while they wait (on Ray, Celery, a restarted
# service), which the other worker fills (README, "Quick start"); three overloaded the 2 cores (a test
# failed, none ran faster). `make test XDIST_TEST=` runs one process.
XDIST_TEST ?= $(XDIST)
test: install
	$(PY) -m pytest -q $(XDIST_TEST) --durations=25

# The inner loop: everything that neither starts processes of its own nor drives a browser.
test-fast: install
	$(PY) -m pytest -q $(XDIST) -m "not slow and not multiprocess and not e2e and not browser"

constraints: $(STAMP)
	( echo "# Exact pins for every package the project installs (name==version only). Regenerate with 'make constraints'."; \
	  $(PY) -m pip freeze --exclude-editable | grep -v '^#' | sed 's/+cpu//' ) > constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache
