# polyshard: `make demo` runs the main job, `make test` runs the test suite.
# Both set up .venv first. For a CUDA build of torch: make setup TORCH="torch==2.13.0 --index-url ..."

PYTHON ?= python3
TORCH ?= torch==2.13.0
# Where a CPU build of torch lies on this kind of machine; pip prefers it to PyPI's multi-GB CUDA build.
WHEELS := $(wildcard /opt/wheels)
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := packages/mesh packages/collectives packages/tp packages/pp packages/dp packages/ep packages/trainer apps/cli
STAMP := $(VENV)/.polyshard-setup

.PHONY: setup test demo lint format clean

setup: $(STAMP)

$(STAMP): Makefile requirements-dev.txt $(addsuffix /pyproject.toml,$(PACKAGES))
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(if $(WHEELS),--find-links $(WHEELS)) $(TORCH)
	$(BIN)/pip install --quiet -r requirements-dev.txt
	$(BIN)/pip install --quiet $(addprefix -e ,$(PACKAGES))
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

# The main job: a GPT on Shakespeare over dp=2 x tp=2 x pp=2 (8 CPU processes), then a text sample.
demo: setup
	$(BIN)/polyshard train apps/configs/gpt-shakespeare-3d.toml --out runs/demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV)
