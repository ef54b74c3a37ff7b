/* A client's request body at the router: the first byte picks the route
 * (0 /generate, 1 /v1/completions, 2 /v1/chat/completions, 3 /abort_request),
 * the rest is the body,
 * judged as the router judges it (src/router/body.c) before anything is
 * forwarded. Every body is accepted with a JSON object or refused with a
 * 400 and a message; an accepted object has the types the router relies
 * on (a rid it can key a request by). */
#include <string.h>

#include "../../src/router/body.h"
#include "fuzz.h"
#include "pdserve/base.h"

static void check_accepted(rt_body_kind kind, json_t *o) {
    PD_ASSERT(json_is_object(o));
    json_t *rid = json_object_get(o, "rid");
    if (rid) {
        PD_ASSERT(json_is_string(rid));
        size_t n = json_string_length(rid);
        PD_ASSERT(n > 0 && n < PD_RID_MAX && strlen(json_string_value(rid)) == n);
    }
    if (kind == RT_BODY_ABORT) PD_ASSERT(rid || json_is_true(json_object_get(o, "abort_all")));
    json_t *stream = json_object_get(o, "stream");
    if (kind != RT_BODY_ABORT && stream) PD_ASSERT(json_is_boolean(stream));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    rt_body_kind kind = (rt_body_kind)(data[0] % 4);
    json_t *o = NULL;
    char why[256];
    why[0] = '\0';
    unsigned st = rt_body_parse(kind, (const char *)data + 1, size - 1, &o, why, sizeof why);
    if (st == 0) {
        check_accepted(kind, o);
        json_decref(o);
    } else {
        PD_ASSERT(st == 400 && !o && why[0] != '\0');
    }
    return 0;
}
