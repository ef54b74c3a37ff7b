# pdserve — the commands a newcomer types. Everything else is CMake + ctest.
#
#   make run     the project's main job on the embedded defaults
#   make test    install missing Debian packages, build with ASan+UBSan, run ctest
#   make bench   optimised build, then every benchmark with its figures
#
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)
TEST_DIR := build/test
REL_DIR  := build/release

.PHONY: all deps test build-test release run bench clean help

all: release

help:
	@sed -n '2,8p' Makefile

deps:
	@scripts/deps.sh

$(TEST_DIR)/CMakeCache.txt:
	cmake -S . -B $(TEST_DIR) -DCMAKE_BUILD_TYPE=Debug -DPD_SANITIZE=ON

build-test: deps $(TEST_DIR)/CMakeCache.txt
	cmake --build $(TEST_DIR) -j $(JOBS)

test: build-test
	cd $(TEST_DIR) && ctest --output-on-failure -j $(JOBS)

$(REL_DIR)/CMakeCache.txt:
	cmake -S . -B $(REL_DIR) -DCMAKE_BUILD_TYPE=Release -DPD_BUILD_TESTS=OFF

release: deps $(REL_DIR)/CMakeCache.txt
	cmake --build $(REL_DIR) -j $(JOBS)

run: release
	@scripts/bench.sh --quick $(REL_DIR)

bench: release
	@scripts/bench.sh $(REL_DIR)

clean:
	rm -rf build
