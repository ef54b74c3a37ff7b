/* pd_chat_template: each construct of the subset renders as @huggingface/jinja
 * renders it (tests/template/reference.sh compares whole real templates), and
 * each way out of the subset fails with a message a person can act on. */
#include <stdio.h>

#include "../test_util.h"
#include "pdserve/chat_template.h"

static const char *CONV =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
    "{\"role\": \"user\", \"content\": \"Hi\"},"
    "{\"role\": \"assistant\", \"content\": \"<think>\\nhm\\n</think>\\n\\nHello\"}],"
    "\"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"n\": 3, \"x\": 2.5,"
    "\"d\": {\"b\": 1, \"a\": [1, \"two\", null, true]}}";

/* Renders tpl with the JSON context ctx; returns the malloc'd output or NULL
 * (with the error in msg and its code in *err). */
static char *try_render(const char *tpl, const char *ctx_json, pd_err *err, char *msg,
                        size_t msg_cap) {
    json_error_t jerr;
    json_t *ctx = json_loads(ctx_json, 0, &jerr);
    assert_non_null(ctx);
    pd_chat_template *t = NULL;
    char *out = NULL;
    size_t out_len = 0;
    *err = pd_chat_template_compile(tpl, strlen(tpl), &t, msg, msg_cap);
    if (!*err) *err = pd_chat_template_render(t, ctx, &out, &out_len, msg, msg_cap);
    if (!*err) assert_int_equal(strlen(out), out_len);
    pd_chat_template_free(t);
    json_decref(ctx);
    return out;
}

static void expect_render(const char *tpl, const char *want) {
    char msg[256] = "";
    pd_err err;
    char *out = try_render(tpl, CONV, &err, msg, sizeof(msg));
    if (err) fprintf(stderr, "template %s: %s\n", tpl, msg);
    assert_ok(err);
    assert_string_equal(out, want);
    free(out);
}

/* Fails with code want and a message containing every one of needles. */
static void expect_error(const char *tpl, pd_err want, const char *needle, const char *needle2) {
    char msg[256] = "";
    pd_err err;
    char *out = try_render(tpl, CONV, &err, msg, sizeof(msg));
    assert_null(out);
    assert_err(err, want);
    if (!strstr(msg, needle) || (needle2 && !strstr(msg, needle2)))
        fprintf(stderr, "message: %s\n", msg);
    assert_non_null(strstr(msg, needle));
    if (needle2) assert_non_null(strstr(msg, needle2));
}

static void text_comments_and_whitespace_control(void **state) {
    (void)state;
    expect_render("a{# note #}b", "ab");
    expect_render("a  {{- 'x' -}}  \n b", "axb");
    expect_render("a \n{#- c -#}\n b", "ab");
    expect_render("line\n", "line"); /* one trailing newline dropped */
    /* trim_blocks and lstrip_blocks, as transformers configures Jinja */
    expect_render("x\n    {% if true %}\n    y\n    {% endif %}\nz", "x\n    y\nz");
    expect_render("{{ 'a' }}\n{{ 'b' }}", "a\nb");
}

static void loops_and_loop_variables(void **state) {
    (void)state;
    expect_render("{% for m in messages %}{{ loop.index0 }}{{ loop.index }}{{ loop.length }}"
                  "{% if loop.first %}F{% endif %}{% if loop.last %}L{% endif %},{% endfor %}",
                  "013F,123,233L,");
    expect_render("{% for m in messages %}{{ loop.previtem.role if loop.previtem is defined "
                  "else '-' }} {% endfor %}",
                  "- system user ");
    expect_render("{% for m in [] %}x{% else %}empty{% endfor %}", "empty");
    expect_render("{% for k in d %}{{ k }}{% endfor %}", "ba");
    expect_render("{% for k, v in d.items() %}{{ k }}={{ v|length if v is sequence else v }};"
                  "{% endfor %}",
                  "b=1;a=4;");
    expect_render("{% for m in messages[::-1] %}{{ m.role[0] }}{% endfor %}", "aus");
    expect_render("{% for i in range(10) %}{% if i == 1 %}{% continue %}{% endif %}"
                  "{% if i > 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
                  "023");
    expect_render("{{ range(3) }} {{ range(1, 7, 2) }} {{ range(3, 0, -1) }} {{ range(0) }}",
                  "[0, 1, 2] [1, 3, 5] [3, 2, 1] []");
}

static void conditions_and_assignment(void **state) {
    (void)state;
    expect_render("{% if n > 5 %}big{% elif n > 2 %}mid{% else %}small{% endif %}", "mid");
    expect_render("{% if missing %}a{% elif not n %}b{% endif %}", "");
    expect_render("{% set ns = namespace(count=0, seen=false) %}"
                  "{% for m in messages %}{% set ns.count = ns.count + 1 %}{% endfor %}"
                  "{{ ns.count }}",
                  "3");
    /* a plain set inside a loop stays in the loop */
    expect_render("{% set v = 'out' %}{% for m in messages %}{% set v = m.role %}{% endfor %}"
                  "{{ v }}",
                  "out");
    expect_render("{{ 'yes' if add_generation_prompt else 'no' }}", "yes");
}

static void filters_of_the_subset(void **state) {
    (void)state;
    expect_render("[{{ '  a b \\n'|trim }}]", "[a b]");
    expect_render("{{ messages|length }} {{ 'héllo'|length }} {{ d|length }}", "3 5 2");
    expect_render("{{ d|tojson }}", "{\"b\": 1, \"a\": [1, \"two\", null, true]}");
    expect_render("{{ {'k': [1, {}], 'e': []}|tojson(indent=2) }}",
                  "{\n  \"k\": [\n    1,\n    {}\n  ],\n  \"e\": []\n}");
    expect_render("{{ 'a\"\\\\\\n'|tojson }}", "\"a\\\"\\\\\\n\"");
    expect_render("{{ n|string ~ x|string }}", "32.5");
    expect_render("{{ missing|default('dflt') }} {{ ''|default('e', true) }}", "dflt e");
    expect_render("{{ 'Ab'|upper }}{{ 'Ab'|lower }}", "ABab");
    expect_render("{{ ['a', 'b', 3]|join(', ') }} {{ d.a|first }} {{ d.a|last }}",
                  "a, b, 3 1 true");
    expect_render("{{ [1, 2]|reverse|list }} {{ {'k': 'v'}|items }}", "[2, 1] [[\"k\", \"v\"]]");
    expect_render(
        "{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|list }}"
        " {{ messages|rejectattr('role', 'eq', 'user')|map(attribute='role')|join(',') }}",
        "[\"Hi\"] system,assistant");
    expect_render("{{ 'a-b-c'|replace('-', '+') }}", "a+b+c");
}

static void tests_of_the_subset(void **state) {
    (void)state;
    expect_render("{{ n is defined }} {{ missing is defined }} {{ missing is not defined }}",
                  "true false true");
    expect_render("{{ d.a[2] is none }} {{ 'a' is string }} {{ d is mapping }}", "true true true");
    expect_render("{{ d.a is sequence }} {{ 'x' is iterable }} {{ n is iterable }}",
                  "true true false");
    expect_render("{{ d.a[3] is true }} {{ false is false }} {{ 0 is false }}", "true true false");
}

static void operators(void **state) {
    (void)state;
    expect_render("{{ 'ell' in 'hello' }} {{ 'b' in d }} {{ 1 in d.a }} {{ 'z' not in d.a }}",
                  "true true true true");
    expect_render("{{ 'a' ~ 1 ~ true }} {{ 'n=' + n }} {{ n + 1 }} {{ n * 2 - 1 }}",
                  "a1true n=3 4 5");
    expect_render("{{ 7 // 2 }} {{ 7 % 3 }} {{ 7 / 2 }} {{ x + 1 }} {{ 2.0 }} {{ -n }}",
                  "3 1 3.5 3.5 2.0 -3");
    expect_render("{{ n == 3 and not (n != 3) }} {{ n < 2 or n >= 3 }} {{ none or 'x' }}",
                  "true true x");
    expect_render("{{ [1] + [2] }} {{ none }}|{{ missing }}|", "[1, 2] ||");
}

static void access_slicing_and_literals(void **state) {
    (void)state;
    expect_render("{{ messages[0]['role'] }} {{ messages[-1].role }} {{ d.a.1 }}",
                  "system assistant two");
    expect_render("{{ 'abcdef'[1:3] }} {{ 'abcdef'[::-1] }} {{ 'abcdef'[-2:] }} {{ 'abc'[5] }}",
                  "bc fedcba ef ");
    expect_render("{{ [1, 2, 3, 4][1:] }} {{ [1, 2, 3, 4][::2] }}", "[2, 3, 4] [1, 3]");
    expect_render("{{ {'k': [1, {'z': none}]} }}", "{\"k\": [1, {\"z\": null}]}");
    expect_render("{{ missing.attr.deeper }}|{{ n.foo }}", "|");
}

static void string_methods(void **state) {
    (void)state;
    expect_render("{{ 'hello'.startswith('he') }} {{ 'hello'.endswith(('x', 'lo')) }}",
                  "true true");
    expect_render("{% set c = messages[2].content %}[{{ c.split('</think>')[-1].lstrip('\\n') }}]"
                  "[{{ c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}]",
                  "[Hello][hm]");
    expect_render("{{ ' a  b '.split() }} {{ 'a,b,c'.split(',', 1) }}",
                  "[\"a\", \"b\"] [\"a\", \"b,c\"]");
    expect_render("[{{ '\\n x \\n'.strip('\\n') }}][{{ '  y '.strip() }}]", "[ x ][y]");
    expect_render("{{ 'aXbXc'.replace('X', '-') }} {{ 'aXbXc'.replace('X', '', 1) }}",
                  "a-b-c abXc");
    expect_render("{{ 'MiXed'.upper() }}{{ 'MiXed'.lower() }}", "MIXEDmixed");
    /* a literal that is not UTF-8: a run of stray continuation bytes is one character */
    expect_render("{{ '\x9a\x9a"
                  "ab'|length }} {{ '\x9a"
                  "ab'[1:] }} {{ '\x9a"
                  "ab'[::-1]|length }}",
                  "3 ab 2");
    expect_render("{{ d.get('b') }} {{ d.get('zz', 'no') }} {{ d.keys()|join }}", "1 no ba");
}

/* The clock's value varies; its shape does not. */
static void strftime_now_formats_the_utc_date(void **state) {
    (void)state;
    char msg[128];
    pd_err err;
    char *out = try_render("{{ strftime_now('%Y-%m-%d %H:%M %% %q') }}|{{ strftime_now('%b') }}",
                           CONV, &err, msg, sizeof(msg));
    assert_ok(err);
    assert_int_equal(strlen(out), strlen("2026-11-30 22:40 % %q|Nov"));
    assert_true(out[4] == '-' && out[7] == '-' && out[13] == ':');
    assert_memory_equal(out + 17, "% %q|", 5);
    free(out);
}

static void raise_exception_message_is_the_error(void **state) {
    (void)state;
    expect_error("a{% if n == 3 %}{{ raise_exception('Conversation roles must alternate') }}"
                 "{% endif %}",
                 PD_ERR_INVALID, "Conversation roles must alternate", NULL);
    char msg[128];
    pd_err err;
    assert_null(try_render("{{ raise_exception('exact') }}", CONV, &err, msg, sizeof(msg)));
    assert_string_equal(msg, "exact");
}

static void constructs_outside_the_subset_are_named(void **state) {
    (void)state;
    expect_error("ok\n{{ x|wordcount }}", PD_ERR_PARSE, "line 2 col 6", "filter 'wordcount'");
    expect_error("{% macro m() %}{% endmacro %}", PD_ERR_PARSE, "the tag 'macro'", NULL);
    expect_error("{{ x is divisibleby }}", PD_ERR_PARSE, "the test 'divisibleby'", NULL);
    expect_error("{{ cycler(1, 2) }}", PD_ERR_PARSE, "function 'cycler'", NULL);
    expect_error("{{ 'a'.title() }}", PD_ERR_PARSE, "method 'title'", NULL);
    expect_error("{{ d|tojson(sort_keys=true) }}", PD_ERR_PARSE, "'tojson' takes no argument",
                 NULL);
    expect_error("{% break %}", PD_ERR_PARSE, "'break' outside a loop", NULL);
    expect_error("{{ messages|selectattr('role', 'divisibleby', 3) }}", PD_ERR_PARSE,
                 "must be string literals", NULL);
    expect_error("{{ messages|selectattr('role', 'divisibleby') }}", PD_ERR_PARSE,
                 "the test 'divisibleby'", NULL);
    expect_error("{% for m in messages %}{% else %}{% continue %}{% endfor %}", PD_ERR_PARSE,
                 "'continue' outside a loop", NULL);
    expect_error("{{ 2 ** 3 }}", PD_ERR_PARSE, "'**'", NULL);
    expect_error("{{ 'a' if n }}", PD_ERR_PARSE, "without 'else'", NULL);
}

static void malformed_templates_fail_cleanly(void **state) {
    (void)state;
    expect_error("abc {{ n ", PD_ERR_PARSE, "line 1", "inside a tag");
    expect_error("abc {{ n %}", PD_ERR_PARSE, "line 1 col 10", "expected '}}'");
    expect_error("{% if n %}open", PD_ERR_PARSE, "unterminated 'if'", "endif");
    expect_error("{% for m in messages %}", PD_ERR_PARSE, "unterminated 'for'", NULL);
    expect_error("{% endif %}", PD_ERR_PARSE, "without its opening tag", NULL);
    expect_error("{{ 'unterminated }}", PD_ERR_PARSE, "unterminated string", NULL);
    expect_error("{# no end", PD_ERR_PARSE, "unterminated comment", NULL);
    expect_error("{{ n @ 2 }}", PD_ERR_PARSE, "unexpected character '@'", NULL);
}

static void runtime_type_errors_name_the_line(void **state) {
    (void)state;
    expect_error("\n\n{{ missing + 'a' }}", PD_ERR_INVALID, "line 3", "undefined");
    expect_error("{% for c in n %}{% endfor %}", PD_ERR_INVALID, "cannot loop over an integer",
                 NULL);
    expect_error("{% set n.x = 1 %}", PD_ERR_INVALID, "only of a namespace", NULL);
    expect_error("{{ n // 0 }}", PD_ERR_INVALID, "division by zero", NULL);
    expect_error("{{ messages|map('upper') }}", PD_ERR_INVALID, "map(attribute=", NULL);
}

static void nesting_is_bounded(void **state) {
    (void)state;
    char tpl[2048];
    size_t k = 0;
    k += (size_t)snprintf(tpl + k, sizeof(tpl) - k, "{{ ");
    for (int i = 0; i < 200; i++) tpl[k++] = '(';
    tpl[k++] = '1';
    for (int i = 0; i < 200; i++) tpl[k++] = ')';
    snprintf(tpl + k, sizeof(tpl) - k, " }}");
    expect_error(tpl, PD_ERR_PARSE, "nesting deeper than 128", NULL);
    k = 0;
    for (int i = 0; i < 200; i++) k += (size_t)snprintf(tpl + k, sizeof(tpl) - k, "{%%if 1%%}");
    expect_error(tpl, PD_ERR_PARSE, "nesting deeper than 128", NULL);
    /* a chain of 10,000 additions is a 10,000-deep tree: refused, not a stack overflow */
    char *chain = malloc(30010);
    k = (size_t)snprintf(chain, 30010, "{{ 0");
    for (int i = 0; i < 10000; i++) k += (size_t)snprintf(chain + k, 30010 - k, "+1");
    snprintf(chain + k, 30010 - k, " }}");
    expect_error(chain, PD_ERR_PARSE, "nesting deeper than 128", NULL);
    free(chain);
    /* 30 levels of blocks, 40 additions and a 20-link chain are fine */
    expect_render(
        "{{ 1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1 }}"
        "{{ ' x '|trim|upper|lower|trim|upper|lower|trim|upper|lower|trim|upper|lower|trim"
        "|upper|lower|trim|upper|lower|trim|upper }}",
        "40X");
    k = 0;
    for (int i = 0; i < 30; i++) k += (size_t)snprintf(tpl + k, sizeof(tpl) - k, "{%%if 1%%}");
    k += (size_t)snprintf(tpl + k, sizeof(tpl) - k, "deep");
    for (int i = 0; i < 30; i++) k += (size_t)snprintf(tpl + k, sizeof(tpl) - k, "{%%endif%%}");
    expect_render(tpl, "deep");
}

static void long_output_is_fine(void **state) {
    (void)state;
    /* 5,000 messages of 1 KiB each: a 5 MB prompt */
    json_t *msgs = json_array();
    char content[1025];
    memset(content, 'x', 1024);
    content[1024] = 0;
    for (int i = 0; i < 5000; i++)
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", content));
    json_t *ctx = json_pack("{s:o}", "messages", msgs);
    const char *tpl = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
    pd_chat_template *t;
    char msg[128], *out;
    size_t len;
    assert_ok(pd_chat_template_compile(tpl, strlen(tpl), &t, msg, sizeof(msg)));
    assert_ok(pd_chat_template_render(t, ctx, &out, &len, msg, sizeof(msg)));
    assert_int_equal(len, 5000u * (6 + 1024 + 1));
    assert_memory_equal(out + len - 7, "xxxxxx\n", 7);
    free(out);
    pd_chat_template_free(t);
    json_decref(ctx);
}

/* Nested loops multiply: work is bounded by the memory and step budgets
 * (whichever runs out first), never by time. */
static void runaway_work_is_refused(void **state) {
    (void)state;
    char tpl[512];
    size_t k = 0;
    for (int i = 0; i < 9; i++)
        k += (size_t)snprintf(tpl + k, sizeof(tpl) - k, "{%%for a%d in l%%}", i);
    for (int i = 0; i < 9; i++) k += (size_t)snprintf(tpl + k, sizeof(tpl) - k, "{%%endfor%%}");
    char msg[128];
    pd_err err;
    char *out = try_render(tpl, "{\"l\": [0,1,2,3,4,5,6,7,8,9]}", &err, msg, sizeof(msg));
    assert_null(out);
    assert_err(err, PD_ERR_TOOBIG);
    assert_true(strstr(msg, "evaluation steps") || strstr(msg, "MiB"));
}

/* Random bytes and random splices of template syntax: compile and render
 * either succeed or fail with a message; never crash (ASan/UBSan watch). */
static void garbage_never_crashes(void **state) {
    (void)state;
    static const char *const PIECES[] = {
        "{{",  "}}",       "{%", "%}", "{#", "#}", "-", " if ",  " for ", " in ",  "x",
        "'s'", "(",        ")",  "[",  "]",  ":",  "|", "trim",  " is ",  "endif", "endfor",
        "\n",  "messages", ".",  ",",  "{",  "}",  "=", " set ", "\\"};
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(7));
    json_t *ctx = json_loads(CONV, 0, NULL);
    char tpl[256], msg[128];
    for (int iter = 0; iter < 20000; iter++) {
        size_t k = 0;
        while (k < 200) {
            const char *p = PIECES[pd_rng_next(&rng) % PD_ARRAY_LEN(PIECES)];
            if (pd_rng_next(&rng) % 8 == 0) {
                tpl[k++] = (char)(1 + pd_rng_next(&rng) % 255);
                continue;
            }
            size_t n = strlen(p);
            if (k + n >= 200) break;
            memcpy(tpl + k, p, n);
            k += n;
        }
        pd_chat_template *t = NULL;
        char *out = NULL;
        size_t len;
        if (pd_chat_template_compile(tpl, k, &t, msg, sizeof(msg)) == PD_OK) {
            if (pd_chat_template_render(t, ctx, &out, &len, msg, sizeof(msg)) == PD_OK)
                assert_non_null(out);
        } else {
            assert_true(strlen(msg) > 0);
        }
        free(out);
        pd_chat_template_free(t);
    }
    json_decref(ctx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(text_comments_and_whitespace_control),
        cmocka_unit_test(loops_and_loop_variables),
        cmocka_unit_test(conditions_and_assignment),
        cmocka_unit_test(filters_of_the_subset),
        cmocka_unit_test(tests_of_the_subset),
        cmocka_unit_test(operators),
        cmocka_unit_test(access_slicing_and_literals),
        cmocka_unit_test(string_methods),
        cmocka_unit_test(strftime_now_formats_the_utc_date),
        cmocka_unit_test(raise_exception_message_is_the_error),
        cmocka_unit_test(constructs_outside_the_subset_are_named),
        cmocka_unit_test(malformed_templates_fail_cleanly),
        cmocka_unit_test(runtime_type_errors_name_the_line),
        cmocka_unit_test(nesting_is_bounded),
        cmocka_unit_test(long_output_is_fine),
        cmocka_unit_test(runaway_work_is_refused),
        cmocka_unit_test(garbage_never_crashes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
