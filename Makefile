# The README's commands. Everything installs what it needs first (scripts/setup.sh).
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=

.PHONY: all setup configure build test demo bench fuzz test-asan clean

all: build

setup:
	@bash scripts/setup.sh

$(BUILD)/build.ninja:
	@bash scripts/setup.sh
	cmake -S . -B $(BUILD) -G Ninja $(CMAKE_ARGS)

configure: $(BUILD)/build.ninja

build: setup configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

demo: build
	bash scripts/demo.sh $(BUILD)

bench: build
	bash bench/run.sh $(BUILD)

# libFuzzer targets (clang, ASan+UBSan), FUZZ_SECONDS each (default 60).
fuzz:
	bash fuzz/run.sh

# The unit suite under ASan+UBSan in its own build folder.
test-asan:
	@bash scripts/setup.sh
	cmake -S . -B build-asan -G Ninja -DTESSERA_SANITIZE=ON -DTESSERA_BUILD_BENCH=OFF
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=0 ctest --output-on-failure -j $(JOBS) --timeout 900

clean:
	rm -rf $(BUILD)
