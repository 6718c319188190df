# podmeter: `make lab` runs the main job, `make test` runs every check. Both install what they need.
VENV := .venv
PY := $(VENV)/bin/python
ARCH := $(shell uname -m)
BPF_SRC := $(wildcard bpf/*.bpf.c)
BPF_OBJ := $(patsubst bpf/%.bpf.c,src/podmeter/bpf/%.bpf.o,$(BPF_SRC))

.PHONY: setup test lint lab demo bench bpf clean

setup:
	@scripts/setup.sh

bpf: $(BPF_OBJ)

src/podmeter/bpf/%.bpf.o: bpf/%.bpf.c $(wildcard bpf/*.h)
	@mkdir -p src/podmeter/bpf
	clang -O2 -g -Wall -target bpf -I/usr/include/$(ARCH)-linux-gnu -Ibpf -c $< -o $@

lint: setup
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy --strict
	$(VENV)/bin/lint-imports

test: lint
	$(VENV)/bin/pytest -q

lab: setup
	$(VENV)/bin/podmeter lab

demo: setup
	$(VENV)/bin/podmeter demo

bench: setup
	$(PY) -m bench.core

clean:
	rm -rf $(VENV) src/podmeter/bpf/*.o .pytest_cache .mypy_cache .ruff_cache
