# Every target that runs code first makes sure .venv exists and is current.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: setup demo test bench clean

# Each step says what it does before it starts: a first setup downloads torch (hundreds of MB)
# and the project's dependencies, minutes that would otherwise pass without a line.
$(VENV)/.installed: pyproject.toml
	@echo "setup [1/4] creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "setup [2/4] upgrading pip"
	$(PY) -m pip install --quiet --upgrade pip
	@echo "setup [3/4] torch: $(TORCH_PIN) unless $(VENV) has a torch (a large download the first time)"
	# Never an unpinned torch: a plain `torch` would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --progress-bar on $(TORCH_PIN)
	@echo "setup [4/4] this project and its test extras (pip install -e '.[dev]')"
	$(PY) -m pip install --progress-bar on -e '.[dev]'
	touch $@
	@echo "setup: done ($(VENV); run source $(VENV)/bin/activate for the dspark command)"

setup: $(VENV)/.installed

# The main job: the bundled model (assets/dspark-small) served by the three services; plain,
# always-k and gated generations of four prompts, then the table (training/demo.py).
demo: setup
	@echo "demo: starting the three services on the bundled model (about a minute to load), then"
	@echo "demo: four prompts as plain / always-k / gated generations and the table"
	$(PY) -m training.demo

# -o console_output_style=count: each line of dots ends with [done/total], so a slow module
# still shows how far the suite has come.
test: setup
	@echo "test: running the suite (pytest; several minutes on a 2-core CPU machine)"
	$(PY) -m pytest -q -o console_output_style=count

# Benchmarks print ratios measured in one run; nothing is asserted.
bench: setup
	$(PY) -m bench.bench_trunk
	$(PY) -m bench.bench_verify

clean:
	rm -rf $(VENV) build *.egg-info
