# Generates a small trace and replays it through bench/radix (plain and
# hybrid with a host tier): the tools must run and print their figures.
execute_process(COMMAND ${GEN} --kind mixed --requests 300 --system-len 200
                        --suffix-len 40 --turn-len 30 --out ${OUT}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "gen_trace failed: ${rc}")
endif()
foreach(args "--page-size;4;--pages;2048;--runs;1"
             "--page-size;1;--pages;3000;--hybrid;--mamba-slots;32;--host-pages;2000;--runs;1;--strict")
  execute_process(COMMAND ${RADIX} --trace ${OUT} ${args}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "radix ${args} failed (${rc}): ${out} ${err}")
  endif()
  if(NOT out MATCHES "requests/s: [0-9]+" OR NOT out MATCHES "p99 us per request: [0-9.]+")
    message(FATAL_ERROR "radix ${args} printed no figures: ${out}")
  endif()
  message(STATUS "${out}")
endforeach()
