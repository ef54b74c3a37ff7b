# The model commands end to end:
#   - `pdserve generate` gives the same tokens whatever the page size, prefill
#     chunk size and thread count;
#   - `pdserve model init` writes a directory that `generate --model` loads to
#     the same tokens as the built-in model with the same seed;
#   - bad input gets a one-line message and exit code 2 (usage) or 1 (runtime).
# Invoked with -DPDSERVE=<binary> -DWORK=<scratch dir>.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})

function(run_ok out_var)
  execute_process(COMMAND ${PDSERVE} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "pdserve ${ARGN}: exit ${rc}: ${err}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

function(output_ids out_var)
  run_ok(out generate --json ${ARGN})
  string(REGEX MATCH "\"output_ids\":\\[[0-9,]+\\]" ids "${out}")
  if(ids STREQUAL "")
    message(FATAL_ERROR "no output_ids in: ${out}")
  endif()
  foreach(key text prompt_tokens timing decode_tokens_per_s)
    if(NOT out MATCHES "\"${key}\"")
      message(FATAL_ERROR "no ${key} in: ${out}")
    endif()
  endforeach()
  set(${out_var} "${ids}" PARENT_SCOPE)
endfunction()

function(expect_fail want_rc pattern)
  execute_process(COMMAND ${PDSERVE} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL want_rc)
    message(FATAL_ERROR "pdserve ${ARGN}: exit ${rc}, expected ${want_rc}: ${err}")
  endif()
  if(NOT err MATCHES "${pattern}")
    message(FATAL_ERROR "pdserve ${ARGN}: message '${err}' lacks '${pattern}'")
  endif()
  string(REGEX MATCHALL "\n" newlines "${err}")
  list(LENGTH newlines n)
  if(n GREATER 1)
    message(FATAL_ERROR "pdserve ${ARGN}: more than one line of error: ${err}")
  endif()
endfunction()

set(prompt "The quick brown fox jumps over the lazy dog")

# --- invariance to how the work is cut
output_ids(base --prompt ${prompt} --max-new-tokens 12)
foreach(variant "--page-size;1" "--page-size;7" "--page-size;64" "--chunked-prefill-size;1"
                "--chunked-prefill-size;5;--page-size;3" "--threads;2")
  output_ids(ids --prompt ${prompt} --max-new-tokens 12 ${variant})
  if(NOT ids STREQUAL base)
    message(FATAL_ERROR "generate ${variant}: ${ids} differs from ${base}")
  endif()
endforeach()

# --- a model directory round trip, and another seed changes the tokens
run_ok(out model init --out ${WORK}/tiny --seed 0)
output_ids(loaded --model ${WORK}/tiny --prompt ${prompt} --max-new-tokens 12)
if(NOT loaded STREQUAL base)
  message(FATAL_ERROR "generate --model ${WORK}/tiny: ${loaded} differs from the built-in ${base}")
endif()
output_ids(other --prompt ${prompt} --max-new-tokens 12 --seed 1)
if(other STREQUAL base)
  message(FATAL_ERROR "seed 1 gave the tokens of seed 0: ${other}")
endif()
run_ok(out model init --out ${WORK}/half --layers MMA --dim 32 --dtype bf16 --seed 3)
run_ok(out generate --model ${WORK}/half --prompt hi --max-new-tokens 3)
run_ok(out model info --model ${WORK}/half)
if(NOT out MATCHES "KV per token +256 bytes")
  message(FATAL_ERROR "model info: ${out}")
endif()

# --- help explains every option
run_ok(help generate --help)
foreach(opt --prompt --max-new-tokens --model --layers --seed --page-size --chunked-prefill-size
            --json --temperature --top-p --sampling-seed --threads --config --ignore-eos)
  if(NOT help MATCHES "${opt}")
    message(FATAL_ERROR "generate --help does not mention ${opt}")
  endif()
endforeach()
run_ok(help model --help)
foreach(opt --out --config --layers --dim --seed --dtype --model --page-size)
  if(NOT help MATCHES "${opt}")
    message(FATAL_ERROR "model --help does not mention ${opt}")
  endif()
endforeach()

# --- bad input
expect_fail(2 "unknown option '--bogus'" generate --prompt x --bogus 1)
expect_fail(2 "--max-new-tokens: bad value 'abc'" generate --prompt x --max-new-tokens abc)
expect_fail(2 "--page-size: bad value '0'" generate --prompt x --page-size 0)
expect_fail(2 "--prompt is required" generate)
expect_fail(2 "layer 2 is 'X'" generate --prompt x --layers MAXA)
expect_fail(2 "cannot be combined" generate --prompt x --model ${WORK}/tiny --seed 3)
expect_fail(1 "config.json: cannot open" generate --prompt x --model ${WORK}/missing)
file(MAKE_DIRECTORY ${WORK}/broken)
file(COPY ${WORK}/tiny/config.json DESTINATION ${WORK}/broken)
file(WRITE ${WORK}/broken/model.safetensors "not a safetensors file at all")
expect_fail(1 "model.safetensors: header length" generate --prompt x --model ${WORK}/broken)
expect_fail(2 "--out DIR is required" model init)
expect_fail(2 "unknown subcommand 'frobnicate'" model frobnicate)
expect_fail(2 "not a multiple of mamba_heads" model init --out ${WORK}/odd --dim 7)
expect_fail(2 "bad number for --dim" model init --out ${WORK}/odd --dim -4)
expect_fail(2 "--dtype must be" model init --out ${WORK}/odd --dtype f8)
