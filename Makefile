# The front door: thin targets over the one CMake build (see README.md).
#   make run        install the C++ packages that are missing, build the CLI alone (no
#                   tests, no Python environment), plan the embedded default
#   make test       the same, then every test (unit, engine, CLI, the installed package, a
#                   bounded fuzz run), then the Python suite (pytest, python/tests)
#   make test-python  the Python suite alone (the package in build/python)
#   make bench      the benchmarks (bench/), figures recorded in docs/PERFORMANCE.md
#   make bench-torch  the PyTorch adapter's benchmarks (bench/torch/)
#   make test-asan  the suite under AddressSanitizer + UBSan
#   make test-tsan  the suite under ThreadSanitizer
#   make install    headers, libraries, the CLI and the CMake package under PREFIX
#   make format     clang-format over the sources
#   make fuzz       the fuzzers (FUZZERS: the config loaders, plan JSON against a model),
#                   each for FUZZ_SECONDS (default 60)
JOBS ?= $(shell nproc)
BUILD ?= build
PREFIX ?= /usr/local
CMAKE_FLAGS ?=
FUZZ_SECONDS ?= 60
FUZZERS ?= fuzz_model_config fuzz_plan_json
CTEST = ctest --output-on-failure -j $(JOBS)
# The Python environment (scripts/install-python.sh: pinned, cached under ~/.cache/spillway)
PYENV := $(shell bash scripts/install-python.sh --print)
PYTHON = $(PYENV)/bin/python

.PHONY: all deps deps-python deps-arm configure build build-cli run test test-python bench bench-torch install test-asan test-tsan format fuzz fuzz-smoke clean

all: build

# The Debian packages of the C++ build (scripts/install-deps.sh), and the Python
# environment of the adapter and its tests (scripts/install-python.sh, ~2.7 GB of wheels):
# `make run` needs only the first.
deps:
	@bash scripts/install-deps.sh

deps-python:
	@bash scripts/install-python.sh

# The Arm check's cross compiler, emulator and arm64 libraries (`make test` only).
deps-arm:
	@bash scripts/install-deps.sh --arm

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(PYTHON) \
	  $(CMAKE_FLAGS)

# Configured again once the Python environment exists (a build first configured by
# `make run`, before it did, then gains the extension module); a no-op otherwise.
configure: deps deps-python $(BUILD)/CMakeCache.txt
	@cmake -S . -B $(BUILD) -DPython_EXECUTABLE=$(PYTHON) > /dev/null

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The CLI alone: the libraries it links and bin/spillway, nothing else.
build-cli: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS) --target spillway_cli

run: build-cli
	./$(BUILD)/bin/spillway plan --model Qwen3-30B-A3B --hardware gh200 \
	  --micro-batch 2 --seq-len 8192 --ep 8 --dp 8

test: build fuzz-smoke deps-arm
	cd $(BUILD) && $(CTEST)
	@$(MAKE) --no-print-directory test-python

test-python: build
	PYTHONPATH=$(CURDIR)/$(BUILD)/python SPILLWAY_BUILD=$(CURDIR)/$(BUILD) \
	  $(PYTHON) -m pytest -q -p no:cacheprovider python/tests

bench: build
	./$(BUILD)/bin/spillway_bench_plan
	./$(BUILD)/bin/spillway_bench_sim
	./$(BUILD)/bin/spillway bench offload
	./$(BUILD)/bin/spillway bench adam
	./$(BUILD)/bin/spillway bench optim-offload
	./$(BUILD)/bin/spillway bench gemm --seq-len 256 --repeats 3
	./$(BUILD)/bin/spillway bench stream
	./$(BUILD)/bin/spillway bench serve
	./$(BUILD)/bin/spillway bench serve-live
	$(PYTHON) bench/text/bench_tokenizer.py --build $(BUILD)
	./$(BUILD)/bin/spillway train --model small-moe --steps 6 --micro-batch 16 --seq-len 64 --device-memory-mb 512 --d2h-gbps 10 --h2d-gbps 10 --quiet --optimizer offload
	./$(BUILD)/bin/spillway train --model small-moe --compare --steps 4 --micro-batch 16 --seq-len 64 --device-memory-mb 512 --d2h-gbps 10 --h2d-gbps 10 --quiet

bench-torch: build
	bash scripts/install-python.sh --bench
	PYTHONPATH=$(BUILD)/python $(PYTHON) bench/torch/bench_hooks.py
	PYTHONPATH=$(BUILD)/python $(PYTHON) bench/torch/bench_stream_hooks.py
	PYTHONPATH=$(BUILD)/python $(PYTHON) bench/torch/bench_cpu_adamw.py
	PYTHONPATH=$(BUILD)/python SPILLWAY_BUILD=$(BUILD) $(PYTHON) bench/torch/bench_train.py --device cpu --tiny --model llama-3.1-8b
	PYTHONPATH=$(BUILD)/python SPILLWAY_BUILD=$(BUILD) $(PYTHON) bench/torch/bench_train.py --device cpu --tiny --model qwen3-30b-a3b

install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

test-asan: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DSPILLWAY_SANITIZE=address -DSPILLWAY_CUDA=OFF -DSPILLWAY_BENCH=OFF \
	  -DSPILLWAY_PYTHON=OFF
	cmake --build build-asan -j $(JOBS)
	cd build-asan && UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 $(CTEST)

test-tsan: deps
	cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPILLWAY_SANITIZE=thread -DSPILLWAY_CUDA=OFF -DSPILLWAY_BENCH=OFF \
	  -DSPILLWAY_PYTHON=OFF
	cmake --build build-tsan -j $(JOBS)
	cd build-tsan && TSAN_OPTIONS=halt_on_error=1:suppressions=$(CURDIR)/tests/tsan.supp $(CTEST)

build-fuzz/CMakeCache.txt:
	CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Release \
	  -DSPILLWAY_FUZZ=ON -DSPILLWAY_CUDA=OFF -DSPILLWAY_TESTS=OFF -DSPILLWAY_BENCH=OFF \
	  -DSPILLWAY_PYTHON=OFF

fuzz: deps build-fuzz/CMakeCache.txt
	cmake --build build-fuzz -j $(JOBS) --target $(FUZZERS)
	for f in $(FUZZERS); do bash scripts/run-fuzz.sh build-fuzz/$$f $(FUZZ_SECONDS) || exit 1; done

# A bounded fuzz run that is part of `make test` (CI): 30 s split between the fuzzers.
fuzz-smoke:
	@$(MAKE) --no-print-directory fuzz FUZZ_SECONDS=15

format:
	clang-format -i $$(git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh')

clean:
	rm -rf build build-asan build-tsan build-fuzz
