# The HTTP router (src/router): library, CLI hook, tests.
# Included by the top-level CMakeLists.txt before the pdserve executable.
find_package(Threads REQUIRED)
pkg_check_modules(CURL REQUIRED IMPORTED_TARGET libcurl)

add_library(pd_router STATIC
  src/router/policy.c
  src/router/workers.c
  src/router/health.c
  src/router/client.c
  src/router/forward.c
  src/router/loop.c
  src/router/feed.c
  src/router/sse.c
  src/router/body.c
  src/router/stats.c
  src/router/router.c
  src/router/sglang.c)
# Its public header is include/pdserve/router.h; the rest is private (the
# router's own tests, beside it, reach the internals through the test kit).
target_include_directories(pd_router PRIVATE ${CMAKE_SOURCE_DIR}/src/router)
target_link_libraries(pd_router PUBLIC pd_http PkgConfig::JANSSON PkgConfig::CURL
                      Threads::Threads)

list(APPEND PD_CLI_SOURCES src/cli/cmd_router.c)
list(APPEND PD_CLI_LIBS pd_router)

if(PD_BUILD_TESTS)
  # The fake prefill/decode workers and a small HTTP client for the tests.
  # The fake workers are a libmicrohttpd server: an HTTP implementation other
  # than the one under test (pd_http_server), so the two are checked against
  # each other rather than against themselves.
  pkg_check_modules(MICROHTTPD REQUIRED IMPORTED_TARGET libmicrohttpd)
  add_library(pd_router_testkit STATIC tests/router/fake_worker.c tests/router/test_client.c)
  target_link_libraries(pd_router_testkit PUBLIC pd_router PkgConfig::MICROHTTPD)
  target_include_directories(pd_router_testkit PUBLIC ${CMAKE_SOURCE_DIR}/src/router)

  pd_add_test(test_router_units tests/router/test_units.c pd_router_testkit)
  pd_add_test(test_router_forward tests/router/test_forward.c pd_router_testkit)
  pd_add_test(test_router_health tests/router/test_health.c pd_router_testkit)
  pd_add_test(test_router_failures tests/router/test_failures.c pd_router_testkit)
  pd_add_test(test_router_abort tests/router/test_abort.c pd_router_testkit)
  pd_add_test(test_router_input tests/router/test_input.c pd_router_testkit)
  pd_add_test(test_router_storm tests/router/test_storm.c pd_router_testkit)
  pd_add_test(test_router_events tests/router/test_events.c pd_router_testkit)
  set_tests_properties(test_router_units test_router_forward test_router_health
                       test_router_failures test_router_abort test_router_input test_router_storm
                       test_router_events PROPERTIES TIMEOUT 120)
  # Stream feeds with real nodes (src/node) behind the router.
  pd_add_test(test_node_stream_feed tests/node/test_stream_feed.c pd_router_testkit pd_node)
  target_include_directories(test_node_stream_feed PRIVATE ${CMAKE_SOURCE_DIR}/src/node)
  set_tests_properties(test_node_stream_feed PROPERTIES TIMEOUT 180)

  # The command line: --help, bad usage, a router process that listens and
  # stops on SIGINT.
  add_test(NAME router_cli
           COMMAND ${CMAKE_COMMAND} -DPDSERVE=$<TARGET_FILE:pdserve>
                   -DWORK=${CMAKE_BINARY_DIR}/router_cli
                   -P ${CMAKE_SOURCE_DIR}/tests/router/cli.cmake)
endif()

# bench/router.sh's two ends of the many-streams run (a stand-in worker
# that holds any number of streams, and the clients that open them).
add_executable(bench_router_streams bench/router_streams.c)
set_target_properties(bench_router_streams PROPERTIES OUTPUT_NAME router_streams
                      RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bench)
