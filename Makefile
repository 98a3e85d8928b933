VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: demo test bench lint system-deps dashboards clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

system-deps:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null && command -v wrk >/dev/null && command -v hey >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus wrk hey >/dev/null; }

demo: $(STAMP)
	$(VENV)/bin/modelcanary demo $(ARGS)

test: $(STAMP) system-deps
	$(PY) -m pytest tests $(ARGS)

bench: $(STAMP) system-deps
	$(PY) benchmarks/run_all.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

dashboards: $(STAMP)
	$(VENV)/bin/modelcanary dashboards build

clean:
	rm -rf $(VENV) .modelcanary build *.egg-info
