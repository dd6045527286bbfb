# Every target that runs code first makes sure .venv exists and is current.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: setup demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Never an unpinned torch: a plain `torch` would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

# The main job: the bundled model (assets/dspark-small) served by the three services; plain,
# always-k and gated generations of four prompts, then the table (training/demo.py).
demo: setup
	$(PY) -m training.demo

test: setup
	$(PY) -m pytest -q

# Benchmarks print ratios measured in one run; nothing is asserted.
bench: setup
	$(PY) -m bench.bench_trunk
	$(PY) -m bench.bench_verify

clean:
	rm -rf $(VENV) build *.egg-info
