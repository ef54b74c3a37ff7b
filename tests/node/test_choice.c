/*
 * test_choice — one choice's text (src/node/choice.c) apart from any server:
 * stop strings across token boundaries, what a stream may show, the UTF-8
 * carry, echo, and the token that completed a stop.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <setjmp.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "gen.h"

typedef struct fixture {
    call c;
    gen_params p;
    gen_choice ch;
    int32_t tokens[64];
    float lps[64];
    int32_t prompt[8];
} fixture;

/* A call whose output is the bytes of `out`, and params with the stops. */
static void setup(fixture *f, const char *out, const char *const *stops, uint32_t n_stops,
                  bool echo) {
    memset(f, 0, sizeof(*f));
    size_t n = strlen(out);
    for (size_t i = 0; i < n; i++) f->tokens[i] = (unsigned char)out[i];
    f->c.tokens = f->tokens;
    f->c.logprobs = f->lps;
    f->c.spec.max_new_tokens = 64;
    f->prompt[0] = 'h';
    f->prompt[1] = 'i';
    f->c.prompt = f->prompt;
    f->c.prompt_len = 2;
    f->p.api = GEN_API_COMPLETIONS;
    f->p.echo = echo;
    for (uint32_t i = 0; i < n_stops; i++) {
        f->p.stops[i] = (char *)stops[i];
        if (strlen(stops[i]) > f->p.stop_longest) f->p.stop_longest = strlen(stops[i]);
    }
    f->p.n_stops = n_stops;
    assert_true(gen_choice_init(&f->ch, &f->c, 0, &f->p));
}

static void feed(fixture *f, uint32_t have, bool done) {
    assert_true(gen_choice_feed(&f->ch, &f->p, have, done));
}

/* "lo w" spans tokens; the earliest of two stops wins; the text ends before
 * it and the token completing it (the 'w', index 6) is the last counted. */
static void a_stop_across_tokens_cuts_the_text(void **state) {
    (void)state;
    static const char *const stops[] = {"orld", "lo w"};
    fixture f;
    setup(&f, "hello world, again", stops, 2, false);
    for (uint32_t have = 1; have <= 18 && !f.ch.stopped; have++) {
        feed(&f, have, false);
        /* nothing shown may be, or begin, a stop string */
        size_t show = gen_choice_showable(&f.ch, &f.p);
        assert_null(memmem(f.ch.text, show, "lo w", 4));
    }
    assert_int_equal(f.ch.stopped, 2);
    assert_string_equal(f.ch.text, "hel");
    assert_int_equal(f.ch.kept, 7);
    assert_string_equal(gen_choice_finish(&f.ch), "stop");
    gen_choice_free(&f.ch);
}

/* While the text ends in a prefix of a stop string, that tail is held back;
 * once it cannot be one any more, it shows. */
static void a_possible_stop_is_held_back(void **state) {
    (void)state;
    static const char *const stops[] = {"END"};
    fixture f;
    setup(&f, "abcENx", stops, 1, false);
    feed(&f, 4, false); /* "abcE" */
    assert_int_equal(gen_choice_showable(&f.ch, &f.p), 3);
    feed(&f, 5, false); /* "abcEN" */
    assert_int_equal(gen_choice_showable(&f.ch, &f.p), 3);
    feed(&f, 6, false); /* "abcENx": not a stop after all */
    assert_int_equal(gen_choice_showable(&f.ch, &f.p), 6);
    assert_int_equal(f.ch.stopped, 0);
    f.c.done = true;
    feed(&f, 6, true);
    assert_true(gen_choice_done(&f.ch));
    assert_int_equal(f.ch.kept, 6);
    gen_choice_free(&f.ch);
}

/* An incomplete UTF-8 character waits for its next byte; echo starts the
 * text and is never searched for a stop. */
static void utf8_is_carried_and_echo_is_not_searched(void **state) {
    (void)state;
    static const char *const stops[] = {"hi"};
    fixture f;
    setup(&f, "\xc3\xa9!hi", stops, 1, true); /* "é!hi" */
    assert_string_equal(f.ch.text, "hi");
    feed(&f, 1, false); /* the lead byte alone: carried */
    assert_string_equal(f.ch.text, "hi");
    feed(&f, 2, false);
    assert_string_equal(f.ch.text, "hi\xc3\xa9");
    feed(&f, 5, false);
    assert_int_equal(f.ch.stopped, 1);
    assert_string_equal(f.ch.text, "hi\xc3\xa9!");
    assert_int_equal(f.ch.kept, 5);
    gen_choice_free(&f.ch);
}

/* At the end an invalid tail shows as U+FFFD; without stops all is shown. */
static void the_end_flushes_the_carry(void **state) {
    (void)state;
    fixture f;
    setup(&f, "ab\xe2\x82", NULL, 0, false);
    feed(&f, 4, false);
    assert_string_equal(f.ch.text, "ab");
    f.c.done = true;
    f.c.kind = PD_TERM_FINISHED;
    f.c.finish = PD_FINISH_LENGTH;
    feed(&f, 4, true);
    assert_string_equal(f.ch.text, "ab\xef\xbf\xbd\xef\xbf\xbd"); /* one per byte */
    assert_string_equal(gen_choice_finish(&f.ch), "length");
    gen_choice_free(&f.ch);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(a_stop_across_tokens_cuts_the_text),
        cmocka_unit_test(a_possible_stop_is_held_back),
        cmocka_unit_test(utf8_is_carried_and_echo_is_not_searched),
        cmocka_unit_test(the_end_flushes_the_carry),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
