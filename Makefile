# pdserve — the commands a newcomer types. Everything else is CMake + ctest.
#
#   make run     the main job: router + prefill + decode serving the tiny model (pdserve run)
#   make test    install missing Debian packages, build with ASan+UBSan, run ctest
#   make bench   optimised build, then every benchmark with its figures
#                (the release build is profile-guided, docs/build.md; PGO=0: plain)
#   make bench-serving  pdserve bench against pdserve run: three loads, JSON + report.html
#   make soak    the simulator's long swarm (SOAK_SEEDS=100000 seeds, all faults)
#   make tidy    the house style's mechanical rules (tools/tidy, docs/tidy.md); CI runs it
#   make format-check  clang-format on the lines changed since tools/format-base; CI too
#   make fuzz    every parser's libFuzzer target for FUZZ_SECONDS (default 60) each (clang)
#   make tsan    ThreadSanitizer build, then every threaded test (node, router, UCX, e2e)
#   make mutants every planted bug in tests/mutants/*.patch must be caught by the swarm
#                or the explore (tools/mutants.sh; MUTANTS="a.patch b.patch" for a subset)
#   make chaos   network and process faults across network namespaces (root; tests/chaos)
#
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)
TEST_DIR := build/test
REL_DIR  := build/release

SOAK_SEEDS ?= 100000
FUZZ_SECONDS ?= 60
FUZZ_DIR := build/fuzz
TSAN_DIR := build/tsan

.PHONY: all deps test build-test release run bench bench-serving soak mutants tidy format-check clean help chaos

all: release

help:
	@sed -n '2,16p' Makefile

deps:
	@scripts/deps.sh

$(TEST_DIR)/CMakeCache.txt:
	cmake -S . -B $(TEST_DIR) -DCMAKE_BUILD_TYPE=Debug -DPD_SANITIZE=ON

build-test: deps $(TEST_DIR)/CMakeCache.txt
	cmake --build $(TEST_DIR) -j $(JOBS)

test: build-test
	cd $(TEST_DIR) && ctest --output-on-failure -j $(JOBS)

# The release build's scheduler core is compiled with the profiles of a
# training run (docs/build.md): its build first runs scripts/pgo-train.sh,
# which builds the instrumented benchmarks in $(PGO_GEN) and, whenever they
# changed, their workload into $(PGO_DATA). PGO=0 builds without
# (build/release-plain).
PGO ?= 1
PGO_GEN  := build/pgo-gen
PGO_DATA := build/pgo-data
ifeq ($(PGO),0)
REL_DIR := build/release-plain
endif

# Configured every time: a build directory made before PGO (or with other
# settings) takes these.
release: deps
	cmake -S . -B $(REL_DIR) -DCMAKE_BUILD_TYPE=Release -DPD_BUILD_TESTS=OFF \
		$(if $(filter 0,$(PGO)),-DPD_PGO=,-DPD_PGO=use -DPD_PGO_DIR=$(abspath $(PGO_DATA)) \
		-DPD_PGO_GEN_DIR=$(abspath $(PGO_GEN))) >/dev/null
	cmake --build $(REL_DIR) -j $(JOBS)

run: release
	$(REL_DIR)/pdserve run $(RUN_ARGS)

bench: release
	@scripts/bench.sh $(REL_DIR)

bench-serving: release
	@bench/serving.sh $(REL_DIR) build/bench-serving

# The long swarm: SOAK_SEEDS seeds (default 100,000) with every fault, on an
# optimised build, split across two processes. Each writes a progress line
# every 10 s into its output file; the latest of each is shown here.
soak: release
	@half=$$(( $(SOAK_SEEDS) / 2 )); out=$(REL_DIR)/soak; \
	echo "soak: $(SOAK_SEEDS) seeds, all faults; output in $${out}_a.txt and $${out}_b.txt"; \
	rm -f $${out}_a.rc $${out}_b.rc; \
	( $(REL_DIR)/pdserve sim --seeds 1..$$half --faults all --quiet > $${out}_a.txt 2>&1; echo $$? > $${out}_a.rc ) & \
	( $(REL_DIR)/pdserve sim --seeds $$((half + 1))..$(SOAK_SEEDS) --faults all --quiet > $${out}_b.txt 2>&1; echo $$? > $${out}_b.rc ) & \
	i=0; while [ ! -f $${out}_a.rc ] || [ ! -f $${out}_b.rc ]; do \
	  sleep 1; i=$$((i + 1)); \
	  if [ $$((i % 10)) -eq 0 ]; then for h in a b; do \
	    grep -a '^sim: ' $${out}_$$h.txt | tail -n 1 | sed "s/^sim:/soak $$h:/"; done; fi; \
	done; wait; ra=$$(cat $${out}_a.rc); rb=$$(cat $${out}_b.rc); \
	tail -n 3 $${out}_a.txt $${out}_b.txt; \
	test $$ra -eq 0 -a $$rb -eq 0

# Mutation testing (not part of make test): each patch applied to a scratch
# copy under build/mutants, rebuilt, and run through the swarm and the explore.
tidy:
	@tools/tidy

# Formatting of what changed since the format rule was adopted (tools/format-base).
format-check:
	@tools/tidy --changed $$(cat tools/format-base) --lines --rule format

mutants: deps
	@tools/mutants.sh $(MUTANTS)

clean:
	rm -rf build

# Chaos across real network boundaries (tests/chaos/README.md; needs root, else it
# says SKIPPED): prefill, decode and router each in a network namespace of its own,
# one fault at a time under a 500-request abort storm. CHAOS_SEED=N replays a run,
# CHAOS_FAULTS=loss,tbf,... picks faults.
chaos: release
	python3 tests/chaos/run.py $(REL_DIR)/pdserve

fuzz: deps
	cmake -S . -B $(FUZZ_DIR) -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug \
		-DPD_BUILD_TESTS=OFF -DPD_FUZZ=ON \
		"-DCMAKE_C_FLAGS=-O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address,undefined" \
		"-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined"
	cmake --build $(FUZZ_DIR) -j $(JOBS) --target fuzz_targets
	tools/fuzz.sh $(FUZZ_DIR) $(FUZZ_SECONDS)

# UCX_MEM_EVENTS=no: UCX's memory-event hooks patch mmap/munmap at run time,
# which crashes under ThreadSanitizer's own interceptors before main; they
# feed UCX's registration cache only, which nothing here relies on (pools are
# registered once). No report is suppressed: halt_on_error makes the first
# race end the process, and the test with it.
TSAN_TESTS := test_http_server|test_router|test_net|test_colocated|test_node|test_engine|e2e|bench_sched|bench_xfer|sim_same_seed
tsan: deps
	cmake -S . -B $(TSAN_DIR) -DCMAKE_BUILD_TYPE=Debug \
		"-DCMAKE_C_FLAGS=-fsanitize=thread -O1 -g -fno-omit-frame-pointer" \
		"-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread"
	cmake --build $(TSAN_DIR) -j $(JOBS)
	cd $(TSAN_DIR) && UCX_MEM_EVENTS=no TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
		ctest -j $(JOBS) --output-on-failure -R '$(TSAN_TESTS)'
