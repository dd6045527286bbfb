# Every target that runs code first makes sure .venv exists and is current.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: setup demo test test-slow bench lock clean settings-doc

# Each step says what it does before it starts: a first setup downloads torch (hundreds of MB)
# and the project's dependencies, minutes that would otherwise pass without a line.
# constraints.txt holds the version of every dependency (torch aside: step 3 installs it) the
# suite last passed with, so a release on the registry cannot change what a fresh setup gets
# (one did: a new grpcio-tools failed the generated-code check). `make lock` rewrites it.
$(VENV)/.installed: pyproject.toml constraints.txt
	@echo "setup [1/4] creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "setup [2/4] upgrading pip"
	$(PY) -m pip install --quiet --upgrade pip
	@echo "setup [3/4] torch: $(TORCH_PIN) unless $(VENV) has a torch (a large download the first time)"
	# Never an unpinned torch: a plain `torch` would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --progress-bar on $(TORCH_PIN)
	@echo "setup [4/4] this project and its test extras at the tested versions (pip install -c constraints.txt -e '.[dev]')"
	$(PY) -m pip install --progress-bar on -c constraints.txt -e '.[dev]'
	touch $@
	@echo "setup: done ($(VENV); run source $(VENV)/bin/activate for the dspark command)"

setup: $(VENV)/.installed

# The main job: the bundled model (assets/dspark-small) served by the three services; plain,
# always-k and gated generations of four prompts, then the table (training/demo.py).
# DEMO_ARGS: the demo's options, e.g. make demo DEMO_ARGS="--port-base 52150 --repeats 5"
demo: setup
	@echo "demo: starting the three services on the bundled model (serving within about 10-60 s), then"
	@echo "demo: four prompts as plain / always-k / gated generations and the table"
	$(PY) -m training.demo $(DEMO_ARGS)

# -o console_output_style=count: each line of dots ends with [done/total], so a slow module
# still shows how far the suite has come. -m "not slow": the soak-sized checks (the full
# sampling grids, the bundled-model statistical test) run with `make test-slow`.
# --durations=15: the slowest tests close the log, to keep the suite inside CI's time budget.
test: setup
	@echo "test: running the suite (pytest; several minutes on a 2-core CPU machine)"
	$(PY) -m pytest -q -o console_output_style=count -m "not slow" --durations=15

test-slow: setup
	@echo "test-slow: the tests marked slow (tens of minutes on a 2-core CPU machine)"
	$(PY) -m pytest -q -o console_output_style=count -m slow

# Benchmarks print ratios measured in one run; nothing is asserted.
bench: setup
	$(PY) -m bench.bench_trunk
	$(PY) -m bench.bench_verify

# After a change of dependencies: install it into .venv without the old pins (e.g.
# `.venv/bin/pip install -e '.[dev]'` after editing pyproject.toml, or `pip install -U NAME`),
# then `make lock` records what .venv holds, and `make test` checks that set from scratch.
# It reads .venv as it is (no setup first: setup would enforce the very pins being replaced).
lock:
	@test -x $(PY) || { echo "lock: no $(VENV) yet: run make setup first"; exit 1; }
	$(PY) -m pip freeze --exclude-editable > constraints.txt.freeze
	{ echo "# The versions the test suite last passed with on a fresh setup (make lock writes this file;"; \
	  echo "# torch is pinned separately by the Makefile). pip install -c: constraints, never installed alone."; \
	  grep -v -i -E '^torch *(==|@)' constraints.txt.freeze; } > constraints.txt.new
	@rm constraints.txt.freeze
	@# replaced only when it changes: a newer constraints.txt would make the next target set up again
	@if cmp -s constraints.txt.new constraints.txt; then rm constraints.txt.new; echo "lock: constraints.txt unchanged"; \
	else mv constraints.txt.new constraints.txt; \
	echo "lock: constraints.txt now pins $$(grep -c == constraints.txt) packages; commit it with the change"; fi

# docs/settings.md and the README's key-settings table, from services/settings_vars.py
# (tests/test_settings_doc.py fails while they are stale).
settings-doc: setup
	$(PY) -m services.settings_doc

clean:
	rm -rf $(VENV) build *.egg-info
