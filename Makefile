# podmeter: `make lab` runs the main job, `make test` runs every check. Both install what they need.
VENV := .venv
PY := $(VENV)/bin/python
ARCH := $(shell uname -m)
BPF_SRC := $(wildcard bpf/*.bpf.c)
BPF_OBJ := $(patsubst bpf/%.bpf.c,src/podmeter/bpf/%.bpf.o,$(BPF_SRC))

.PHONY: setup test test-fast lint lab demo bench bpf proto clean

setup:
	@scripts/setup.sh

bpf: $(BPF_OBJ)

src/podmeter/bpf/%.bpf.o: bpf/%.bpf.c $(wildcard bpf/*.h)
	@mkdir -p src/podmeter/bpf
	clang -O2 -g -Wall -target bpf -I/usr/include/$(ARCH)-linux-gnu -Ibpf -c $< -o $@

# The bench's reference builds include the counting program's source.
src/podmeter/bpf/podmeter_noflows.bpf.o $(patsubst bpf/%.bpf.c,src/podmeter/bpf/%.bpf.o,$(wildcard bpf/podmeter_ref_*.bpf.c)): bpf/podmeter.bpf.c
src/podmeter/bpf/podmeter_nodns.bpf.o: bpf/podmeter.bpf.c

# The Python stubs of Hubble's API (docs/hubble.md), generated from the .proto files and committed: the
# package needs no code generator to install. tests/adapters/test_hubble_proto.py checks they match the .proto files.
HUBBLE_PROTO := src/podmeter/adapters/hubble/proto
proto: setup
	$(PY) -m grpc_tools.protoc -I src --plugin=protoc-gen-mypy=$(VENV)/bin/protoc-gen-mypy \
		--python_out=src --mypy_out=src $(HUBBLE_PROTO)/*.proto
	$(PY) -m grpc_tools.protoc -I src --plugin=protoc-gen-mypy_grpc=$(VENV)/bin/protoc-gen-mypy_grpc \
		--grpc_python_out=src --mypy_grpc_out=src $(HUBBLE_PROTO)/observer.proto $(HUBBLE_PROTO)/peer.proto \
		$(HUBBLE_PROTO)/health.proto

lint: setup
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy --strict
	$(VENV)/bin/lint-imports

test: lint
	$(VENV)/bin/pytest -q --durations=25

# The fast tier: the tests marked `fast` (model, property, decoder and reflector-rule tests), in seconds,
# without root. It starts no process: with PODMETER_FAST_TESTS=1, tests/conftest.py makes every
# subprocess/fork fail the test.
test-fast: setup
	PODMETER_FAST_TESTS=1 $(VENV)/bin/pytest -q --timeout=60 -m "fast and not process"

lab: setup
	$(VENV)/bin/podmeter lab

demo: setup
	$(VENV)/bin/podmeter demo

bench: setup
	$(PY) -m bench.core

clean:
	rm -rf $(VENV) src/podmeter/bpf/*.o .pytest_cache .mypy_cache .ruff_cache
