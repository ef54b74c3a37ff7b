/* The http layer's error body: the API's format and status-to-type table,
 * and valid JSON whatever bytes the message quotes (invalid UTF-8 becomes
 * U+FFFD), since both servers send it as is. The responses it queues are
 * tested through the servers (tests/router, tests/e2e). */
#include <jansson.h>

#include "../test_util.h"
#include "pdserve/http.h"

#define REPLACEMENT "\xef\xbf\xbd"

/* The parsed body's error object, checked against the API's shape. */
static json_t *error_of(const char *body, unsigned status, const char *type) {
    assert_non_null(body);
    json_t *o = json_loads(body, 0, NULL);
    assert_non_null(o);
    json_t *e = json_object_get(o, "error");
    assert_true(json_is_object(e));
    assert_string_equal(json_string_value(json_object_get(e, "type")), type);
    assert_int_equal(json_integer_value(json_object_get(e, "code")), status);
    assert_true(json_is_string(json_object_get(e, "message")));
    json_incref(e);
    json_decref(o);
    return e;
}

static void error_bodies_follow_the_api(void **state) {
    (void)state;
    const unsigned statuses[] = {400, 404, 405, 409, 413, 429, 500, 502, 503, 504, 418, 599};
    const char *types[] = {"invalid_request_error", "not_found_error",       "method_not_allowed",
                           "conflict_error",        "request_too_large",     "rate_limit_error",
                           "internal_error",        "bad_gateway",           "unavailable_error",
                           "timeout_error",         "invalid_request_error", "internal_error"};
    for (size_t i = 0; i < PD_ARRAY_LEN(statuses); i++) {
        assert_string_equal(pd_http_error_type(statuses[i]), types[i]);
        char *body = pd_http_error_body(statuses[i], "quote \" and %s", "newline\n");
        json_t *e = error_of(body, statuses[i], types[i]);
        assert_string_equal(json_string_value(json_object_get(e, "message")),
                            "quote \" and newline\n");
        json_decref(e);
        free(body);
    }
}

static void invalid_utf8_in_the_message_becomes_the_replacement_character(void **state) {
    (void)state;
    /* Each invalid byte is replaced, valid text kept. */
    const char *path = "/a\xff"        /* a byte no character starts with */
                       "b\x80"         /* a lone continuation byte */
                       "c\xc3"         /* a character cut short */
                       "d\xc0\xaf"     /* an overlong '/' */
                       "e\xed\xa0\x80" /* a surrogate */
                       "f\xc3\xa9";    /* U+00E9, valid */
    char *body = pd_http_error_body(404, "unknown path %s", path);
    json_t *e = error_of(body, 404, "not_found_error");
    assert_string_equal(json_string_value(json_object_get(e, "message")),
                        "unknown path /a" REPLACEMENT "b" REPLACEMENT "c" REPLACEMENT
                        "d" REPLACEMENT REPLACEMENT "e" REPLACEMENT REPLACEMENT REPLACEMENT
                        "f\xc3\xa9");
    json_decref(e);
    free(body);
}

static void a_message_cut_inside_a_character_stays_valid(void **state) {
    (void)state;
    /* The formatted message keeps PD_HTTP_MESSAGE_MAX bytes: the cut falls
     * between the two bytes of U+00E9. */
    char text[PD_HTTP_MESSAGE_MAX + 2];
    memset(text, 'a', PD_HTTP_MESSAGE_MAX - 1);
    memcpy(text + PD_HTTP_MESSAGE_MAX - 1, "\xc3\xa9", 3);
    char *body = pd_http_error_body(400, "%s", text);
    json_t *e = error_of(body, 400, "invalid_request_error");
    const char *m = json_string_value(json_object_get(e, "message"));
    assert_int_equal(strlen(m), PD_HTTP_MESSAGE_MAX - 1 + 3);
    assert_memory_equal(m, text, PD_HTTP_MESSAGE_MAX - 1);
    assert_string_equal(m + PD_HTTP_MESSAGE_MAX - 1, REPLACEMENT);
    json_decref(e);
    free(body);
}

static void a_message_of_only_invalid_bytes_is_kept_whole(void **state) {
    (void)state;
    /* The worst case: every byte triples, and nothing more is cut. */
    char text[PD_HTTP_MESSAGE_MAX + 1];
    memset(text, 0xfe, PD_HTTP_MESSAGE_MAX);
    text[PD_HTTP_MESSAGE_MAX] = '\0';
    char *body = pd_http_error_body(502, "%s", text);
    json_t *e = error_of(body, 502, "bad_gateway");
    const char *m = json_string_value(json_object_get(e, "message"));
    assert_int_equal(strlen(m), 3 * PD_HTTP_MESSAGE_MAX);
    for (size_t i = 0; i < PD_HTTP_MESSAGE_MAX; i++) assert_memory_equal(m + 3 * i, REPLACEMENT, 3);
    json_decref(e);
    free(body);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(error_bodies_follow_the_api),
        cmocka_unit_test(invalid_utf8_in_the_message_becomes_the_replacement_character),
        cmocka_unit_test(a_message_cut_inside_a_character_stays_valid),
        cmocka_unit_test(a_message_of_only_invalid_bytes_is_kept_whole),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
