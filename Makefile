# polyshard: `make demo` runs the main job, `make test` runs the test suite.
# Both set up .venv first. For a CUDA build of torch: make setup TORCH="torch==2.13.0 --index-url ..."

PYTHON ?= python3
TORCH ?= torch==2.13.0
# Where a CPU build of torch lies on this kind of machine; pip prefers it to PyPI's multi-GB CUDA build.
WHEELS := $(wildcard /opt/wheels)
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := packages/mesh packages/collectives packages/data packages/checkpoint packages/tp packages/pp packages/dp packages/ep packages/cp packages/models packages/trainer packages/planner benchmarks apps/cli
STAMP := $(VENV)/.polyshard-setup

.PHONY: setup test test-cpus test-long test-system test-bench demo lint docs format clean

setup: $(STAMP)

# pip's output (setuptools warns once per editable package) goes to a log, shown only if a step fails.
SETUP_LOG := $(VENV)/setup.log
QUIET = > $(SETUP_LOG) 2>&1 || { cat $(SETUP_LOG); exit 1; }

$(STAMP): Makefile requirements-dev.txt $(addsuffix /pyproject.toml,$(PACKAGES))
	@echo "setting up $(VENV) (torch, dev tools, the polyshard packages)..."
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --upgrade pip $(QUIET)
	@$(BIN)/pip install --quiet $(if $(WHEELS),--find-links $(WHEELS)) $(TORCH) $(QUIET)
	@$(BIN)/pip install --quiet -r requirements-dev.txt $(QUIET)
	@$(BIN)/pip install --quiet $(addprefix -e ,$(PACKAGES)) $(QUIET)
	@touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

# The parity tests again under the other CPU kernels torch picks on other machines (ATEN_CPU_CAPABILITY:
# a laptop, a CI runner and a cluster node each take their own), so no bound is read off one machine's
# rounding. Kinds this CPU lacks (avx2 on an older one) and its own (`make test` ran it) are skipped.
CPU_KINDS := default avx2
PARITY_TESTS := tests/collectives tests/tp tests/pp tests/dp tests/ep tests/cp tests/models tests/trainer
test-cpus: setup
	@own=$$($(BIN)/python -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	case "$$own" in default|avx2|avx512) ;; *) echo "test-cpus: $$own is not an x86 kind; nothing to switch"; exit 0;; esac; \
	for kind in $(CPU_KINDS); do \
		if [ "$$kind" = "$$own" ]; then echo "test-cpus: $$kind is this CPU's own kernels, which make test ran"; continue; fi; \
		if [ "$$kind" = avx2 ] && [ "$$own" = default ]; then echo "test-cpus: this CPU has no AVX2; skipped"; continue; fi; \
		echo "test-cpus: ATEN_CPU_CAPABILITY=$$kind"; \
		ATEN_CPU_CAPABILITY=$$kind $(BIN)/python -m pytest -q $(PARITY_TESTS) || exit 1; \
	done

# Whole jobs on several processes (parity layouts, Hugging Face round trips, the longer examples); CI runs them too.
test-long: setup
	$(BIN)/python -m pytest -q -m long

# The system around training (workers killed at each point and restarted, hangs, Ctrl-C, two agents as two
# nodes, losing a node, installs of package subsets in fresh virtualenvs); CI runs them after test-long.
test-system: setup
	$(BIN)/python -m pytest -q -m system

# Every `polyshard bench` command through the CLI at its smallest sizes (minutes: compile's cold cache,
# the peers' jobs); CI runs them after test-long.
test-bench: setup
	$(BIN)/python -m pytest -q -m bench

DEMO_CONFIG := apps/configs/gpt-shakespeare-3d.toml
# The main job: a GPT on Shakespeare over dp=2 x tp=2 x pp=2 (8 CPU processes), then a text sample (a new
# run each time: --overwrite replaces an earlier demo's checkpoints).
# Then its last checkpoint is resharded to tp=4 x pp=2 and training continues there for 20 steps.
demo: setup
	$(BIN)/polyshard train $(DEMO_CONFIG) --out runs/demo --overwrite
	rm -rf runs/demo-tp4
	$(BIN)/polyshard reshard runs/demo runs/demo-tp4/checkpoints --mesh tp=4,pp=2
	$(BIN)/polyshard train $(DEMO_CONFIG) --out runs/demo-tp4 --resume --set parallel.dp=1 --set parallel.tp=4 \
		--set training.steps=620 --set eval.every=20 --set eval.sample_tokens=0

TYPED := mesh collectives data checkpoint tp pp dp ep cp models trainer planner bench cli

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy $(addprefix -p polyshard.,$(TYPED))

# The docs site from docs/ into site/ (MkDocs + Material, API pages from the docstrings); --strict makes
# every warning (a broken link, a docstring mkdocstrings cannot read) an error.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV)
