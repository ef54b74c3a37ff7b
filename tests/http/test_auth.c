/* --api-key (src/http/auth.c): which routes need the key (SGLang's exempt
 * set: OPTIONS, /health..., /metrics...), what an Authorization header must
 * say, which keys a server takes. The 401 itself is tested through the
 * servers (tests/e2e/test_flags.py). */
#include <string.h>

#include "../test_util.h"
#include "pdserve/http.h"

static void probes_and_scrapes_need_no_key(void **state) {
    (void)state;
    assert_true(pd_http_api_key_exempt("GET", "/health"));
    assert_true(pd_http_api_key_exempt("GET", "/health_generate"));
    assert_true(pd_http_api_key_exempt("GET", "/metrics"));
    assert_true(pd_http_api_key_exempt("OPTIONS", "/generate"));
    assert_true(pd_http_api_key_exempt("POST", "/health")); /* a 405 says no more than a 401 */
}

static void everything_else_needs_the_key(void **state) {
    (void)state;
    const char *paths[] = {"/generate",  "/v1/completions", "/v1/chat/completions",
                           "/v1/models", "/server_info",    "/abort_request",
                           "/",          "/nope",           "/heal",
                           "/metric"};
    for (size_t i = 0; i < PD_ARRAY_LEN(paths); i++) {
        assert_false(pd_http_api_key_exempt("GET", paths[i]));
        assert_false(pd_http_api_key_exempt("POST", paths[i]));
    }
}

static void only_the_exact_bearer_token_matches(void **state) {
    (void)state;
    const char *key = "sk-secret";
    assert_true(pd_http_bearer_matches("Bearer sk-secret", key));
    assert_true(pd_http_bearer_matches("bearer sk-secret", key)); /* the scheme in any case */
    assert_true(pd_http_bearer_matches("Bearer   sk-secret", key));
    const char *wrong[] = {"Bearer sk-secre",
                           "Bearer sk-secretx",
                           "Bearer SK-SECRET",
                           "Bearer ",
                           "Bearer",
                           "sk-secret",
                           "Basic sk-secret",
                           "",
                           "Bearer sk-secret extra"};
    for (size_t i = 0; i < PD_ARRAY_LEN(wrong); i++)
        assert_false(pd_http_bearer_matches(wrong[i], key));
    assert_false(pd_http_bearer_matches(NULL, key));
}

static void keys_are_visible_ascii_of_bounded_length(void **state) {
    (void)state;
    char k[PD_HTTP_API_KEY_MAX + 1];
    memset(k, 'a', sizeof k);
    k[PD_HTTP_API_KEY_MAX - 1] = '\0';
    assert_true(pd_http_api_key_valid(k));
    k[PD_HTTP_API_KEY_MAX - 1] = 'a';
    k[PD_HTTP_API_KEY_MAX] = '\0';
    assert_false(pd_http_api_key_valid(k));
    assert_true(pd_http_api_key_valid("sk-0123_~+/="));
    const char *bad[] = {"", "a b", "a\r\nX-Injected: 1", "tab\t", "del\x7f", "caf\xc3\xa9"};
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++) assert_false(pd_http_api_key_valid(bad[i]));
    assert_false(pd_http_api_key_valid(NULL));
}

static void a_401_is_an_authentication_error(void **state) {
    (void)state;
    assert_string_equal(pd_http_error_type(401), "authentication_error");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(probes_and_scrapes_need_no_key),
        cmocka_unit_test(everything_else_needs_the_key),
        cmocka_unit_test(only_the_exact_bearer_token_matches),
        cmocka_unit_test(keys_are_visible_ascii_of_bounded_length),
        cmocka_unit_test(a_401_is_an_authentication_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
