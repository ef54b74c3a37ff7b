# `pdserve router` on the command line:
#   - --help explains the options and exits 0;
#   - bad usage (no workers, bad URL, bad policy, unknown option, duplicate
#     worker) gets a one-line message and exit code 2;
#   - with good options it listens (port 0: any free port), says where, and
#     SIGINT stops it with exit code 0.
# Invoked with -DPDSERVE=<binary> -DWORK=<scratch dir>.

function(expect_fail want_rc pattern)
  execute_process(COMMAND ${PDSERVE} router ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err TIMEOUT 20)
  if(NOT rc EQUAL want_rc)
    message(FATAL_ERROR "pdserve router ${ARGN}: exit ${rc}, expected ${want_rc}: ${err}")
  endif()
  if(NOT err MATCHES "${pattern}")
    message(FATAL_ERROR "pdserve router ${ARGN}: message '${err}' lacks '${pattern}'")
  endif()
endfunction()

execute_process(COMMAND ${PDSERVE} router --help RESULT_VARIABLE rc OUTPUT_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "pdserve router --help: exit ${rc}")
endif()
foreach(opt "--prefill URL\\[@PORT\\]" "--decode URL" "--bootstrap-port" "--policy" "least_load"
            "--host" "--port" "--health-interval-ms" "--request-timeout-s" "--max-body-bytes")
  if(NOT out MATCHES "${opt}")
    message(FATAL_ERROR "pdserve router --help lacks ${opt}")
  endif()
endforeach()

execute_process(COMMAND ${PDSERVE} --help OUTPUT_VARIABLE out)
if(NOT out MATCHES "router")
  message(FATAL_ERROR "pdserve --help does not list router")
endif()

set(P --prefill http://127.0.0.1:1)
set(D --decode http://127.0.0.1:2)
expect_fail(2 "at least one --prefill")
expect_fail(2 "at least one --decode" ${P})
expect_fail(2 "must start with http://" ${P} --decode 127.0.0.1:2)
expect_fail(2 "bootstrap port" --prefill http://127.0.0.1:1@x ${D})
expect_fail(2 "prefill nodes only" ${P} --decode http://127.0.0.1:2@9)
expect_fail(2 "--policy: bad value 'fastest'" ${P} ${D} --policy fastest)
expect_fail(2 "--port: bad value" ${P} ${D} --port 70000)
expect_fail(2 "unknown option '--bogus'" ${P} ${D} --bogus 1)
expect_fail(2 "needs a value" ${P} ${D} --host)
expect_fail(2 "listed twice" ${P} ${D} --decode http://127.0.0.1:2)

# SIGINT stops it cleanly (exit 0), even started in the background by a
# shell, which starts background jobs with SIGINT ignored. The signal is sent
# once the router says it listens (its signal mask is set by then).
file(MAKE_DIRECTORY ${WORK})
set(log ${WORK}/router_sigint.txt)
file(REMOVE ${log})
execute_process(COMMAND sh -c "'${PDSERVE}' router --prefill http://127.0.0.1:1 --decode http://127.0.0.1:2 --port 0 > '${log}' 2>&1 & pid=$!; i=0; while ! grep -q listening '${log}' && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; kill -INT $pid; wait $pid"
                RESULT_VARIABLE rc TIMEOUT 60)
file(READ ${log} out)
if(NOT out MATCHES "pdserve router listening on http://127.0.0.1:[0-9]+ \\(1 prefill, 1 decode, policy round_robin\\)")
  message(FATAL_ERROR "pdserve router did not report listening: '${out}'")
endif()
if(NOT rc EQUAL 0 OR NOT out MATCHES "signal 2, stopping")
  message(FATAL_ERROR "pdserve router did not stop on SIGINT: exit ${rc}: '${out}'")
endif()
