# User-facing targets: setup, demo, test (see README). bench runs every benchmark; docs builds the documentation site.
# check-cuda-build builds and imports the CUDA extension against a CUDA torch, no GPU needed (docs/kernels.md).
# gpu-check runs the whole GPU checklist in one call of <= 8 minutes on a GPU machine (no package index
# needed); gpu-wheels prepares on a CPU machine the wheels it installs there (.whl/, copied along).
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
KSTAMP  := $(VENV)/.kernels
KSRC    := $(shell find csrc -type f) lioncub_ds/kernels/build.py
export OMP_NUM_THREADS ?= 1
# Keep the JIT-built ops (DeepSpeed's CPU comm op, LionCub's kernels when not prebuilt) in one cache. The README
# tells a plain shell to export the same, else DeepSpeed's CPU op builds a second time (8-13 min).
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions

.PHONY: setup demo test bench clean check-cuda-build gpu-check gpu-wheels docs

setup: $(STAMP) $(KSTAMP)

$(STAMP): requirements.txt setup.py
	@echo "make setup: one-time: .venv with torch==2.13.0 (from your pip's indexes; TORCH_INDEX=<url> adds one) and the pinned packages of requirements.txt"
	@echo "  (mostly downloads: minutes, depending on the network; then the C++ kernels, below)"
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(VPY) -m pip install -q --no-build-isolation -r requirements.txt
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

# The C++ kernels, built ahead of time into lioncub_ds/_lioncub_cpu*.so (git-ignored), where the loader looks
# first; rebuilt when csrc/ changes. If this build fails, setup still succeeds: the loader JIT-builds the
# kernels on first use instead (and falls back to the pure-torch kernels if that fails too).
$(KSTAMP): $(STAMP) $(KSRC)
	@echo "make setup: one-time build of the C++ kernels (2-13 min on 2 cores: 773 s on a loaded 2-core machine;"
	@echo "  pip prints nothing meanwhile)"
	@t0=$$(date +%s); \
	if LIONCUB_BUILD_EXT=1 MAX_JOBS=2 $(VPY) -m pip install -q --no-build-isolation --no-deps -e . ; then \
	  echo "make setup: C++ kernels built in $$(( $$(date +%s) - t0 )) s"; \
	else \
	  echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"; \
	  echo "make setup: WARNING: the ahead-of-time build of the C++ kernels FAILED (output above)."; \
	  echo "  Setup goes on: lioncub_ds will JIT-build them on first use (1-3 min, cached), and use the"; \
	  echo "  pure-torch kernels if that fails too. To retry: rm $(KSTAMP) && make setup"; \
	  echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"; \
	  rm -f lioncub_ds/_lioncub_cpu*.so; \
	fi
	touch $(KSTAMP)

# The main job: GPT pretraining under the deepspeed launcher on 2 CPU ranks with LionCub,
# side by side with Lion + DeepSpeed's gradient all-reduce (loss and bytes sent).
demo: setup
	@if ! ls $(TORCH_EXTENSIONS_DIR)/deepspeed_shm_comm/*.so >/dev/null 2>&1; then \
	  echo "make demo: one-time build first: DeepSpeed's CPU comm op, JIT, into $(TORCH_EXTENSIONS_DIR)"; \
	  echo "  (8-13 min on a loaded 2-core machine, nothing printed meanwhile; cached for every later run)"; fi
	$(VPY) -m benchmarks.ds_demo

test: setup
	$(VPY) -m pytest -q tests

# The unit tier only (one process; about 20 s on 2 idle cores, up to ~2 min on a loaded machine; tiers in pytest.ini).
.PHONY: test-fast
test-fast: setup
	$(VPY) -m pytest -q -m unit tests

bench: setup
	$(VPY) -m benchmarks all --out results

# Not part of `make test` (a 2.7 GB venv outside the repository, ~2-5 min build); .ci/run runs it after the tests.
check-cuda-build:
	PY=$(PY) bash .ci/check_cuda_build.sh

# On the GPU machine (docs/kernels.md, "GPU checklist"). GPU_CHECK_DRY=1: the dry run. The venv's python once
# `make setup` made it (the system python3 may have no torch); else $(PY). `make gpu-check GPU_PY=...` picks one.
GPU_PY ?= $(if $(wildcard $(VPY)),$(VPY),$(PY))
gpu-check:
	$(GPU_PY) -m benchmarks.gpu_check

gpu-wheels: setup
	$(VPY) -m benchmarks.gpu_check wheels

# The documentation site (MkDocs + mkdocstrings, pinned in requirements.txt): the pages of docs/ and an API
# reference made from the docstrings, into build/site. Strict: a broken link, anchor or API reference fails.
docs: setup
	$(VPY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info lioncub_ds/_lioncub_*.so
