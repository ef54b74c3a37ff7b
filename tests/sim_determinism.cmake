# Same seed, same binary -> byte-identical trace; and the trace, replayed as
# a scenario, passes (it is a valid scenario file).
foreach(i 1 2)
  execute_process(COMMAND ${PDSERVE} sim --seeds 7..7 --requests 40 --trace ${OUT}/det_trace_${i}.scn
                  RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "run ${i} failed (${rc}): ${err}")
  endif()
endforeach()
file(SHA256 ${OUT}/det_trace_1.scn h1)
file(SHA256 ${OUT}/det_trace_2.scn h2)
if(NOT h1 STREQUAL h2)
  message(FATAL_ERROR "the same seed produced different traces")
endif()
file(SIZE ${OUT}/det_trace_1.scn size)
if(size LESS 1000)
  message(FATAL_ERROR "trace suspiciously short (${size} bytes)")
endif()
execute_process(COMMAND ${PDSERVE} sim --scenario ${OUT}/det_trace_1.scn
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the trace does not replay as a scenario: ${out} ${err}")
endif()
# A different seed gives a different trace.
execute_process(COMMAND ${PDSERVE} sim --seeds 8..8 --requests 40 --trace ${OUT}/det_trace_3.scn
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
file(SHA256 ${OUT}/det_trace_3.scn h3)
if(h1 STREQUAL h3)
  message(FATAL_ERROR "different seeds produced the same trace")
endif()
message(STATUS "trace ${h1} (${size} bytes) reproduced and replayed")
