/* The libFuzzer entry point every target in tests/fuzz defines. Built two
 * ways: with clang's -fsanitize=fuzzer for `make fuzz`, and with
 * tests/fuzz/replay.c as main for `make test`, which feeds every file of the
 * target's corpus (tests/fuzz/corpus/<target>/) through it under ASan+UBSan. */
#ifndef PD_TESTS_FUZZ_H
#define PD_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif
