/* Base layer: bounded strings, error names, PRNG and hash properties. */
#include <stdlib.h>

#include "../test_util.h"

static void strbuf_never_overflows_and_flags_truncation(void **state) {
    (void)state;
    char buf[8];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    pd_strbuf_append(&sb, "abc");
    assert_false(sb.truncated);
    assert_string_equal(buf, "abc");
    pd_strbuf_append(&sb, "defghij");
    assert_true(sb.truncated);
    assert_int_equal(sb.len, 7);
    assert_string_equal(buf, "abcdefg");
    pd_strbuf_printf(&sb, "%d", 12345);
    assert_int_equal(sb.len, 7);
    assert_int_equal(buf[7], '\0');
    pd_strbuf_reset(&sb);
    pd_strbuf_printf(&sb, "%s-%u", "x", 42u);
    assert_string_equal(buf, "x-42");
    assert_false(sb.truncated);
}

static void strbuf_json_string_escapes(void **state) {
    (void)state;
    char buf[64];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    pd_strbuf_json_string(&sb, "a\"b\\c\n\x01");
    assert_string_equal(buf, "\"a\\\"b\\\\c\\n\\u0001\"");
}

static void errorf_fills_message_and_returns_code(void **state) {
    (void)state;
    char msg[32];
    assert_err(pd_errorf(msg, sizeof(msg), PD_ERR_PARSE, "bad %s", "json"), PD_ERR_PARSE);
    assert_string_equal(msg, "bad json");
    assert_err(pd_errorf(NULL, 0, PD_ERR_IO, "ignored"), PD_ERR_IO);
    assert_string_equal(pd_err_name(PD_ERR_NOMEM), "nomem");
    assert_string_equal(pd_err_name((pd_err)999), "unknown");
}

static void rng_is_deterministic_per_seed(void **state) {
    (void)state;
    pd_rng a, b, c;
    pd_rng_seed(&a, 7);
    pd_rng_seed(&b, 7);
    pd_rng_seed(&c, 8);
    int differ = 0;
    for (int i = 0; i < 1000; i++) {
        uint64_t x = pd_rng_next(&a), y = pd_rng_next(&b), z = pd_rng_next(&c);
        assert_true(x == y);
        differ += x != z;
    }
    assert_true(differ > 990);
}

static void rng_below_is_in_range_and_roughly_uniform(void **state) {
    (void)state;
    pd_rng r;
    pd_rng_seed(&r, 1);
    uint32_t hist[10] = {0};
    for (int i = 0; i < 100000; i++) {
        uint64_t v = pd_rng_below(&r, 10);
        assert_true(v < 10);
        hist[v]++;
    }
    for (int i = 0; i < 10; i++) {
        assert_true(hist[i] > 9500);
        assert_true(hist[i] < 10500);
    }
    for (int i = 0; i < 1000; i++) {
        int64_t v = pd_rng_range(&r, -3, 3);
        assert_true(v >= -3 && v <= 3);
        double u = pd_rng_unit(&r);
        assert_true(u >= 0.0 && u < 1.0);
    }
}

static void hash_depends_on_order_and_content(void **state) {
    (void)state;
    int32_t a[] = {1, 2, 3, 4, 5};
    int32_t b[] = {1, 2, 3, 5, 4};
    int32_t c[] = {1, 2, 3, 4, 6};
    uint64_t ha = pd_hash_tokens(a, 5, 0);
    assert_true(ha == pd_hash_tokens(a, 5, 0));
    assert_true(ha != pd_hash_tokens(b, 5, 0));
    assert_true(ha != pd_hash_tokens(c, 5, 0));
    assert_true(ha != pd_hash_tokens(a, 4, 0));
    assert_true(ha != pd_hash_tokens(a, 5, 1));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(strbuf_never_overflows_and_flags_truncation),
        cmocka_unit_test(strbuf_json_string_escapes),
        cmocka_unit_test(errorf_fills_message_and_returns_code),
        cmocka_unit_test(rng_is_deterministic_per_seed),
        cmocka_unit_test(rng_below_is_in_range_and_roughly_uniform),
        cmocka_unit_test(hash_depends_on_order_and_content),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
