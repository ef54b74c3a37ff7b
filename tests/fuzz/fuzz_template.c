/* Chat templates (src/model/chat_template.c): the input is a template,
 * compiled and, when it compiles, rendered with a small fixed conversation.
 * Checks what the node will rely on: compile and render either succeed, with
 * output whose length is what they report, or fail with a message; nothing
 * crashes, leaks or reads out of bounds whatever the template says. */
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "pdserve/chat_template.h"

static const char CONTEXT[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"sys\"},"
    "{\"role\": \"user\", \"content\": \"<think>a</think>hi\"},"
    "{\"role\": \"assistant\", \"content\": \"ok\", \"tool_calls\": [{\"function\":"
    "{\"name\": \"f\", \"arguments\": {\"x\": 1.5}}}]}],"
    "\"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\","
    "\"tools\": [{\"name\": \"f\"}], \"enable_thinking\": false}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 64 * 1024) return 0;
    char msg[256];
    pd_chat_template *t = NULL;
    if (pd_chat_template_compile((const char *)data, size, &t, msg, sizeof(msg)) != PD_OK) {
        PD_ASSERT(t == NULL && msg[0] != 0);
        return 0;
    }
    json_t *ctx = json_loads(CONTEXT, 0, NULL);
    PD_ASSERT(ctx != NULL);
    char *out = NULL;
    size_t len = 0;
    if (pd_chat_template_render(t, ctx, &out, &len, msg, sizeof(msg)) == PD_OK) {
        PD_ASSERT(out != NULL && out[len] == 0);
    } else {
        PD_ASSERT(out == NULL);
    }
    free(out);
    json_decref(ctx);
    pd_chat_template_free(t);
    return 0;
}
