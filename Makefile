# The README's commands. Everything installs what it needs first (scripts/setup.sh).
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=

.PHONY: all setup configure build test demo bench fuzz test-asan soak test-tsan clean \
        python-base python-torch2 build-torch2 test-torch2 bench-torch2 test-python test-python-torch2 \
        check-docs

all: build

setup:
	@bash scripts/setup.sh

# The Python readers and peers the tests use (scripts/setup-python.sh): .venv over Debian's
# python3 for the default build, .venv-torch2 with torch 2.x from PyPI for build-torch2.
python-base:
	@bash scripts/setup-python.sh base >/dev/null
python-torch2:
	@bash scripts/setup-python.sh torch2 >/dev/null

$(BUILD)/build.ninja:
	@bash scripts/setup.sh
	cmake -S . -B $(BUILD) -G Ninja $(CMAKE_ARGS)

configure: $(BUILD)/build.ninja

build: setup configure
	cmake --build $(BUILD) -j $(JOBS)

# The Python package's pure functions (python/tests: layout arithmetic, metadata parsing, the
# overlap sweep), without torch or the C++ build: seconds, so before the build.
test-python: python-base
	.venv/bin/python -m pytest -q -p no:cacheprovider python/tests

# Every repository path a comment or a doc names exists, and every link between the docs
# finds its heading (scripts/check-doc-paths.py, Python's standard library: a second).
check-docs:
	python3 scripts/check-doc-paths.py

# The Python environment first: configuring the suite detects what that Python can do.
test: python-base test-python check-docs build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

# ---- the same project against the libtorch inside PyPI's torch 2.x wheel (a CUDA build):
# CUDA and NCCL code compiled; the suite runs on the CPU, GPU-only tests skip.
TORCH2_BUILD ?= build-torch2
TORCH2_PY = $(CURDIR)/.venv-torch2/bin/python
CUDA_HOME ?= /usr/local/cuda

$(TORCH2_BUILD)/build.ninja:
	@bash scripts/setup.sh
	@bash scripts/setup-python.sh torch2 >/dev/null
	cmake -S . -B $(TORCH2_BUILD) -G Ninja -DTESSERA_PYTHON=$(TORCH2_PY) \
	  -DCMAKE_PREFIX_PATH="$$($(TORCH2_PY) -c 'import os, torch; print(os.path.dirname(torch.__file__))')" \
	  -DCUDAToolkit_ROOT=$(CUDA_HOME) -DCMAKE_CUDA_COMPILER=$(CUDA_HOME)/bin/nvcc $(CMAKE_ARGS)

build-torch2: setup python-torch2 $(TORCH2_BUILD)/build.ninja
	cmake --build $(TORCH2_BUILD) -j $(JOBS)

test-python-torch2: python-torch2
	$(TORCH2_PY) -m pytest -q -p no:cacheprovider python/tests

test-torch2: test-python-torch2 build-torch2
	cd $(TORCH2_BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

# The demo needs only the library, the CLI and the GPT example (a first run on a fresh
# machine skips compiling the test suite and benchmarks; `make test` builds the rest).
demo: setup configure
	cmake --build $(BUILD) -j $(JOBS) --target tessera_cli gpt
	bash scripts/demo.sh $(BUILD)

# The torch 2.x side of make bench: .venv-torch2 (torch, Lightning) and the programs the
# peers' benchmarks run against that wheel's libtorch (bench/peers/).
bench-torch2: setup python-torch2 $(TORCH2_BUILD)/build.ninja
	cmake --build $(TORCH2_BUILD) -j $(JOBS) --target tessera_cli gpt checkpoint_bench bench_collectives

bench: build bench-torch2
	bash bench/run.sh $(BUILD)

# libFuzzer targets (clang, ASan+UBSan), FUZZ_SECONDS each (default 60).
fuzz:
	bash fuzz/run.sh

# The unit suite under ASan+UBSan in its own build folder (the Python environment first,
# as for `make test`: configuring detects what the tests' Python can do).
test-asan: python-base
	@bash scripts/setup.sh
	cmake -S . -B build-asan -G Ninja -DTESSERA_SANITIZE=ON -DTESSERA_BUILD_BENCH=OFF
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=0 ctest --output-on-failure -j $(JOBS) --timeout 900

# The reliability suite at soak scale (TESSERA_SOAK=1): long kill/corruption loops.
soak: python-base build
	bash scripts/soak.sh $(BUILD)

# Async saves, the launcher and a dead rank under ThreadSanitizer (build-tsan): the
# library, CLI and worker built with -fsanitize=thread, run by scripts/tsan.sh.
# libtorch/Gloo are not instrumented: see docs/development.md, "ThreadSanitizer", and
# scripts/tsan.supp.
test-tsan:
	@bash scripts/setup.sh
	cmake -S . -B build-tsan -G Ninja -DTESSERA_BUILD_BENCH=OFF \
	  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread
	cmake --build build-tsan -j $(JOBS) --target tessera_cli tessera_test_worker
	bash scripts/tsan.sh build-tsan

clean:
	rm -rf $(BUILD)
