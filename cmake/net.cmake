# The network transport (src/xfer/net.c): a TCP bootstrap channel plus UCX
# one-sided writes between a prefill and a decode process. Library, CLI
# hook, benchmark, tests. Included by the top-level CMakeLists.txt.
find_package(Threads REQUIRED)
pkg_check_modules(UCX REQUIRED IMPORTED_TARGET ucx)
# libsodium: the bootstrap handshake's HMAC-SHA-256 proofs, nonces and
# constant-time comparison (never hand-written crypto).
pkg_check_modules(SODIUM REQUIRED IMPORTED_TARGET libsodium)

add_library(pd_net STATIC src/xfer/net.c src/xfer/net_conn.c src/xfer/net_ucx.c src/xfer/net_dns.c src/xfer/net_copy.c src/xfer/bootstrap_proto.c)
target_link_libraries(pd_net PUBLIC pd_xfer PkgConfig::UCX PkgConfig::SODIUM Threads::Threads)

list(APPEND PD_CLI_LIBS pd_net)

add_executable(bench_xfer bench/xfer.c)
target_link_libraries(bench_xfer PRIVATE pd_net pd_model)
set_target_properties(bench_xfer PROPERTIES OUTPUT_NAME xfer RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bench)

if(PD_BUILD_TESTS)
  # Wire format: pure encode/decode, no sockets.
  pd_add_test(test_net_proto tests/xfer/test_net_proto.c pd_net)
  target_include_directories(test_net_proto PRIVATE ${CMAKE_SOURCE_DIR}/src/xfer)

  # Two pd_net instances (prefill + decode) in one process on 127.0.0.1, once
  # per UCX transport that works on a machine without RDMA: shared memory and
  # TCP over loopback. UCX_NET_DEVICES=lo keeps UCX's own TCP traffic on
  # loopback too. The same binaries run under both settings.
  add_executable(test_net tests/xfer/test_net.c)
  add_executable(test_net_bad_input tests/xfer/test_net_bad_input.c)
  # The prefill and decode engines (synthetic executor) driving pd_net.
  add_executable(test_net_engines tests/xfer/test_net_engines.c)
  target_link_libraries(test_net_engines PRIVATE pd_engine pd_exec)
  foreach(t test_net test_net_bad_input test_net_engines)
    target_link_libraries(${t} PRIVATE pd_net PkgConfig::CMOCKA)
    target_include_directories(${t} PRIVATE ${CMAKE_SOURCE_DIR}/src/xfer)
    set_target_properties(${t} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
    foreach(tls shm tcp)
      add_test(NAME ${t}_${tls} COMMAND ${t})
      set_tests_properties(${t}_${tls} PROPERTIES TIMEOUT 300
        ENVIRONMENT "UCX_TLS=${tls};UCX_NET_DEVICES=lo;UCX_WARN_UNUSED_ENV_VARS=n")
    endforeach()
  endforeach()

  # bench/xfer keeps working: both transports, tiny sizes, one run.
  add_test(NAME bench_xfer_smoke COMMAND bench_xfer --quick --runs 1 --tokens 64,256 --configs tiny)
  set_tests_properties(bench_xfer_smoke PROPERTIES TIMEOUT 300
    ENVIRONMENT "UCX_WARN_UNUSED_ENV_VARS=n"
    PASS_REGULAR_EXPRESSION "summary: ")
  # ... and with large tcp segments (ucx_tcp_large_segments) the bytes still
  # land intact: it checks every room's destination against its source.
  add_test(NAME bench_xfer_smoke_tcp_large_segments
           COMMAND bench_xfer --quick --runs 1 --tokens 64,4096 --configs tiny --transports tcp
                   --tcp-large-segments --no-perftest)
  set_tests_properties(bench_xfer_smoke_tcp_large_segments PROPERTIES TIMEOUT 300
    ENVIRONMENT "UCX_WARN_UNUSED_ENV_VARS=n"
    PASS_REGULAR_EXPRESSION "summary: ")
  # ... and 8 MiB rooms over shared memory copied by four threads
  # (copy_threads) land intact.
  add_test(NAME bench_xfer_smoke_copy_threads
           COMMAND bench_xfer --quick --runs 1 --tokens 16384 --configs tiny --transports shm
                   --copy-threads 4 --no-perftest)
  set_tests_properties(bench_xfer_smoke_copy_threads PROPERTIES TIMEOUT 300
    ENVIRONMENT "UCX_WARN_UNUSED_ENV_VARS=n"
    PASS_REGULAR_EXPRESSION "on 4 threads")
  # ... and compares with the right perftest figure (no perftest needed).
  add_test(NAME bench_xfer_check COMMAND bench_xfer --check)
endif()
