# pdserve bench (src/loadgen, src/cli/cmd_bench.c): the load client, its
# datasets and results. libcurl's multi interface drives the requests (the
# same library the router uses upstream); jansson reads and writes JSON.
add_library(pd_loadgen STATIC src/loadgen/dataset.c src/loadgen/client.c src/loadgen/sample.c
            src/loadgen/results.c)
target_link_libraries(pd_loadgen PUBLIC pd_base PkgConfig::CURL PkgConfig::JANSSON m)
list(APPEND PD_CLI_SOURCES src/cli/cmd_bench.c)
list(APPEND PD_CLI_LIBS pd_loadgen pd_report)

if(PD_BUILD_TESTS)
  pd_add_test(test_loadgen tests/loadgen/test_loadgen.c pd_loadgen)
  # Against `pdserve run` and `serve` on 127.0.0.1 (tests/e2e/test_bench.py).
  find_package(Python3 REQUIRED COMPONENTS Interpreter)
  add_test(NAME e2e_bench COMMAND ${Python3_EXECUTABLE} ${CMAKE_SOURCE_DIR}/tests/e2e/test_bench.py
                                  $<TARGET_FILE:pdserve>)
  set_tests_properties(e2e_bench PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77)
endif()
