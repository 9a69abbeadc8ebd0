# User-facing targets: setup, demo, test (see README). bench runs every benchmark.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
# Keep DeepSpeed's JIT-built ops in one cache for the whole run.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): requirements.txt setup.py
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q --no-build-isolation -r requirements.txt
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

# The main job: GPT pretraining under the deepspeed launcher on 2 CPU ranks with LionCub,
# side by side with Lion + DeepSpeed's gradient all-reduce (loss and bytes sent).
demo: setup
	$(VPY) -m lioncub_ds.deepspeed.demo

test: setup
	$(VPY) -m pytest -q tests

# The unit tier only (one process, about 2 minutes; tiers in pytest.ini).
.PHONY: test-fast
test-fast: setup
	$(VPY) -m pytest -q -m unit tests

bench: setup
	$(VPY) -m lioncub_ds.bench all --out results

clean:
	rm -rf $(VENV) build *.egg-info
