# Every target works from a fresh clone: `make demo` and `make test` install what they need first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast constraints clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall only when the dependency declarations change.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/locojax demo

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow and not multiprocess"

constraints: $(STAMP)
	( echo "# Exact pins for every package the project installs (name==version only). Regenerate with 'make constraints'."; \
	  $(PY) -m pip freeze --exclude-editable | grep -v '^#' | sed 's/+cpu//' ) > constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache
