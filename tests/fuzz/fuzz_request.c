/* A node's request body from the outside world: the first byte picks the
 * route (high bit: POST /v1/chat/completions; else even: POST /generate,
 * odd: POST /v1/completions), the rest is the
 * body, parsed as the node's HTTP handler parses it (tokenizer, sampling
 * parameters, bootstrap fields, rid). Every body is either accepted or
 * refused with a 4xx/5xx status and a message; nothing crashes or leaks. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../src/node/node_internal.h"
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);

static pd_node *node_for_fuzzing;

static void node_done(void) {
    pd_node_destroy(node_for_fuzzing);
    node_for_fuzzing = NULL;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    pd_node_config c;
    pd_node_config_default(&c, PD_NODE_DECODE);
    c.transfer_backend = "ucx";
    c.prefill_peers = "127.0.0.1:8998";
    c.max_prompt_tokens = 256;
    char msg[256];
    if (pd_node_create(&node_for_fuzzing, &c, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "fuzz_request: %s\n", msg);
        return 1;
    }
    atexit(node_done);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!node_for_fuzzing) LLVMFuzzerInitialize(NULL, NULL);
    if (size < 1 || !node_for_fuzzing) return 0;
    char err[512] = "";
    int status = node_http_check_body(node_for_fuzzing, (const char *)data + 1, size - 1,
                                      (data[0] & 0x80) ? 2 : (data[0] & 1), err, sizeof(err));
    PD_ASSERT(status == 0 || (status >= 400 && status <= 599));
    PD_ASSERT(status == 0 || err[0] != '\0');
    return 0;
}
