# nvfp4-train: two commands set up a fresh machine: `make train` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST := $(PY) -m pytest -q

.PHONY: install data train test test-unit test-triton test-dist test-gpu bench bench-kernels bench-linear bench-train bench-rms-norm wheelhouse wheelhouse-h200 clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py requirements/cpu-constraints.txt requirements/modelopt.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -c requirements/cpu-constraints.txt -e ".[dev]"
	$(PIP) install -q --no-deps -r requirements/modelopt.txt
	$(PY) -c "import torch, triton, megatron.core; print('torch', torch.__version__, 'triton', triton.__version__)"
	touch $(STAMP)

# The README's test command (what CI runs through .ci/run): CPU unit tests, Triton kernels under the
# interpreter (the flag is read at import, so they get their own process), then the multi-rank gloo tests (two ranks; four for the layout combinations).
test: $(STAMP)
	$(PYTEST) -m "not triton and not dist and not gpu" tests
	$(MAKE) --no-print-directory test-dist
	TRITON_INTERPRET=1 $(PYTEST) -m triton tests

test-unit: $(STAMP)
	$(PYTEST) -m "not triton and not dist and not gpu" tests

test-triton: $(STAMP)
	TRITON_INTERPRET=1 $(PYTEST) -m triton tests

# exit 5 = no test collected: the tier is empty until the two-rank tests land (issue 3/4)
test-dist: $(STAMP)
	$(PYTEST) -m dist tests || [ $$? -eq 5 ]

# On a CUDA machine (no venv: the machine's own torch/triton, packages from the wheelhouse on PYTHONPATH):
# the same Triton tests natively, plus the GPU-only tests.
GPU_PY ?= python3
test-gpu:
	$(GPU_PY) -m pytest -q -m "triton or gpu" tests

# GPU benchmarks (docs/benchmarks.md has their results and commands). bench_linear.py exits 1 when a target
# is missed; -k runs the other benchmarks anyway (make still reports the failure)
bench:
	$(MAKE) -k bench-kernels bench-linear bench-train bench-rms-norm

bench-kernels:
	$(GPU_PY) scripts/bench_kernels.py

bench-linear:
	$(GPU_PY) scripts/bench_linear.py --profile nvfp4 fp8

# the step of 4 micro-batches under CUDA graphs, fused and unfused (docs/benchmarks.md, "Fused step"); install
# causal-conv1d first (docs/wheelhouse.md): without it bench_train.py refuses the cases with Mamba layers (their
# conv would be its PyTorch fallback, about twice the `small` step; --conv-fallback times that deliberately)
bench-train:
	$(GPU_PY) scripts/bench_train.py --cases small slice12b 1.2b --recipes bf16 fp8 nvfp4 --grad-accum 4 \
		--cuda-graph on --fusion off on

# RMSNorm's backward: torch's two kernels against ours (fusion.rms_norm), and Liger-Kernel's when it imports
bench-rms-norm:
	$(GPU_PY) scripts/bench_rms_norm.py

# (the venv gives the build its torch and uv)
wheelhouse: $(STAMP)
	bash scripts/wheelhouse.sh

# the minimal set our H200 machine lacks, into .whl/ (carried to the device; see docs/wheelhouse.md)
wheelhouse-h200: $(STAMP)
	bash scripts/wheelhouse.sh --minimal --out .whl

# the default corpus and its tokens (both steps are cheap when up to date)
data: $(STAMP)
	$(PY) scripts/build_corpus.py
	$(PY) scripts/prepare_data.py --input data/corpus/text/train.jsonl \
		--valid-input data/corpus/text/validation.jsonl --output-prefix data/tokens/text

# A few minutes of training on this machine's CPU: model=tiny precision=nvfp4, evaluation, checkpoints and
# the loss plots in the run directory. Running it again resumes the run (delete the run directory to start
# over); TRAIN_ARGS adds overrides, e.g. TRAIN_ARGS="schedule.train_steps=50". See docs/training.md.
TRAIN_RUN ?= runs/tiny_nvfp4_cpu
TRAIN_ARGS ?=
train: $(STAMP)
	test -f data/tokens/text_train.idx -a -f data/tokens/text_validation.idx || $(MAKE) --no-print-directory data
	$(PY) train.py model=tiny precision=nvfp4 schedule=cpu_smoke data=text_cpu logging.progress=lines \
		experiment.name=tiny_nvfp4_cpu experiment.run_dir=$(TRAIN_RUN) $(TRAIN_ARGS)
	$(PY) scripts/plot_runs.py $(TRAIN_RUN) --smooth 10 --out $(TRAIN_RUN)/loss.png
	$(PY) scripts/plot_runs.py $(TRAIN_RUN) --metric val_loss --out $(TRAIN_RUN)/val_loss.png

clean:
	rm -rf $(VENV) .pytest_cache
