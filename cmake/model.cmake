# The tiny hybrid model (src/model): library, CLI hook, benchmark, tests.
# Included by the top-level CMakeLists.txt before the pdserve executable.
find_package(Threads REQUIRED)

add_library(pd_model STATIC
  src/model/config.c
  src/model/hf_config.c
  src/model/weights.c
  src/model/safetensors.c
  src/model/tokenizer.c
  src/model/detmath.c
  src/model/kernels.c
  src/model/threads.c
  src/model/mamba2.c
  src/model/attention.c
  src/model/sample.c
  src/model/forward.c
  src/model/executor.c
  src/model/hf_tokenizer.c
  src/model/hf_encode.c)
# tokenizer.json: PCRE2 for the pre-tokenizer's Unicode regex, utf8proc for
# NFC (docs/model.md, "Tokenizer").
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)
target_link_libraries(pd_model PUBLIC pd_cache PkgConfig::JANSSON PkgConfig::PCRE2
                      PkgConfig::UTF8PROC Threads::Threads m)
# The sanitizer build is -O0 by default; the model's arithmetic is the bulk
# of the test suite's time, so it is optimised there too (sanitizers stay on,
# and the floating-point rules do not change with the optimisation level).
if(CMAKE_BUILD_TYPE STREQUAL "Debug")
  target_compile_options(pd_model PRIVATE -O2)
endif()

list(APPEND PD_CLI_LIBS pd_model)

add_executable(bench_model bench/model.c)
target_link_libraries(bench_model PRIVATE pd_model)
set_target_properties(bench_model PROPERTIES OUTPUT_NAME model RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bench)

if(PD_BUILD_TESTS)
  pd_add_test(test_model_forward tests/model/test_forward.c pd_model)
  pd_add_test(test_model_mamba2 tests/model/test_mamba2.c pd_model)
  pd_add_test(test_model_safetensors tests/model/test_safetensors.c pd_model)
  pd_add_test(test_model_executor tests/model/test_executor.c pd_model)
  pd_add_test(test_model_parts tests/model/test_parts.c pd_model)
  pd_add_test(test_model_kernels tests/model/test_kernels.c pd_model)
  foreach(t test_model_forward test_model_mamba2 test_model_safetensors test_model_executor test_model_parts
            test_model_kernels)
    target_include_directories(${t} PRIVATE ${CMAKE_SOURCE_DIR}/src/model)
  endforeach()

  # The command line: generate is invariant to page and chunk size, model
  # init + generate --model round-trips, bad input gets exit code 2 or 1.
  add_test(NAME model_cli
           COMMAND ${CMAKE_COMMAND} -DPDSERVE=$<TARGET_FILE:pdserve> -DWORK=${CMAKE_BINARY_DIR}/model_cli
                   -P ${CMAKE_SOURCE_DIR}/tests/model/cli.cmake)
  add_test(NAME bench_model_smoke COMMAND bench_model --quick --runs 1 --configs tiny)
  set_tests_properties(bench_model_smoke PROPERTIES PASS_REGULAR_EXPRESSION "GFLOP/s")
endif()

# tokenizer.json (src/model/hf_*.c): the error paths, and the same ids as the
# reference implementation in node for real Qwen3 and Llama-3 files
# (tests/tokenizer; SKIPPED without node and its npm packages).
if(PD_BUILD_TESTS)
  pd_add_test(test_hf_tokenizer tests/tokenizer/test_hf_tokenizer.c pd_model)
  add_executable(tok_dump tests/tokenizer/tok_dump.c)
  target_link_libraries(tok_dump PRIVATE pd_model)
  set_target_properties(tok_dump PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  add_test(NAME tokenizer_reference
           COMMAND python3 ${CMAKE_SOURCE_DIR}/tests/tokenizer/test_reference.py
                   $<TARGET_FILE:tok_dump> ${CMAKE_BINARY_DIR}/tokenizer_reference)
  set_tests_properties(tokenizer_reference PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
