/* Progress lines: plain lines on a stream that is not a terminal, one line
 * rewritten in place on a terminal, both paced by a clock the test drives. */
#include <stdio.h>

#include "../test_util.h"
#include "pdserve/progress.h"

typedef struct fake_clock {
    double now_s;
} fake_clock;

static double fake_now(void *ctx) { return ((fake_clock *)ctx)->now_s; }

typedef struct capture {
    char *text;
    size_t len;
    FILE *f;
    fake_clock clock;
    pd_progress p;
} capture;

static void capture_open(capture *c, pd_progress_style style, uint64_t total) {
    *c = (capture){0};
    c->f = open_memstream(&c->text, &c->len);
    assert_non_null(c->f);
    pd_progress_options o = {.out = c->f,
                             .label = "sim",
                             .unit = "seeds",
                             .total = total,
                             .style = style,
                             .clock = fake_now,
                             .clock_ctx = &c->clock};
    pd_progress_init(&c->p, &o);
}

static void capture_close(capture *c) {
    fclose(c->f);
    free(c->text);
}

static size_t count_char(const char *s, size_t len, char ch) {
    size_t n = 0;
    for (size_t i = 0; i < len; i++) n += s[i] == ch;
    return n;
}

static void plain_line_every_interval_then_final(void **state) {
    (void)state;
    capture c;
    capture_open(&c, PD_PROGRESS_PLAIN, 100);
    int written = 0;
    for (int t = 1; t <= 35; t++) {
        c.clock.now_s = t;
        written += pd_progress_update(&c.p, (uint64_t)t, "failed seeds 0");
    }
    assert_int_equal(written, 3); /* at 10, 20 and 30 s */
    fflush(c.f);
    assert_int_equal(count_char(c.text, c.len, '\n'), 3);
    assert_int_equal(count_char(c.text, c.len, '\r'), 0);
    assert_non_null(strstr(c.text,
                           "sim: 10/100 seeds (10.0%), 1.0/s, elapsed 0:10, "
                           "ETA 1:30, failed seeds 0\n"));
    assert_non_null(strstr(c.text, "sim: 30/100 seeds (30.0%)"));
    c.clock.now_s = 40;
    pd_progress_finish(&c.p, 100, "failed seeds 1");
    fflush(c.f);
    assert_int_equal(count_char(c.text, c.len, '\n'), 4);
    assert_non_null(strstr(c.text,
                           "sim: 100/100 seeds (100.0%) done in 0:40, 2.5 seeds/s, "
                           "failed seeds 1\n"));
    capture_close(&c);
}

static void short_run_prints_only_the_final_line(void **state) {
    (void)state;
    capture c;
    capture_open(&c, PD_PROGRESS_PLAIN, 5);
    for (int i = 1; i <= 5; i++) {
        c.clock.now_s = i * 0.5;
        assert_false(pd_progress_due(&c.p));
        assert_false(pd_progress_update(&c.p, (uint64_t)i, NULL));
    }
    pd_progress_finish(&c.p, 5, NULL);
    fflush(c.f);
    assert_string_equal(c.text, "sim: 5/5 seeds (100.0%) done in 0:03, 2.0 seeds/s\n");
    /* Finished: later updates and a second finish write nothing. */
    c.clock.now_s = 100;
    assert_false(pd_progress_update(&c.p, 6, NULL));
    pd_progress_finish(&c.p, 7, NULL);
    fflush(c.f);
    assert_int_equal(count_char(c.text, c.len, '\n'), 1);
    capture_close(&c);
}

static void tty_rewrites_one_line_at_most_ten_times_a_second(void **state) {
    (void)state;
    capture c;
    capture_open(&c, PD_PROGRESS_TTY, 1000);
    int written = 0;
    for (int i = 1; i <= 300; i++) { /* 300 updates in 3 s */
        c.clock.now_s = i * 0.01;
        written += pd_progress_update(&c.p, (uint64_t)i, i < 150 ? "a long extra text" : "x");
    }
    assert_in_range(written, 25, 30);
    fflush(c.f);
    assert_int_equal(count_char(c.text, c.len, '\n'), 0);
    assert_int_equal(count_char(c.text, c.len, '\r'), (size_t)written);
    /* Each rewrite covers all the text of the one before (padded with
     * spaces when shorter), so no tail of a longer line stays on screen. */
    size_t prev_text = 0, shorter = 0;
    for (const char *s = c.text + 1, *end = c.text + c.len; s < end;) {
        const char *cr = memchr(s, '\r', (size_t)(end - s));
        size_t seg = (size_t)((cr ? cr : end) - s), text = seg;
        while (text > 0 && s[text - 1] == ' ') text--;
        assert_true(seg >= prev_text);
        shorter += text < prev_text;
        prev_text = text;
        s = cr ? cr + 1 : end;
    }
    assert_true(shorter >= 1); /* the extra text did get shorter once */
    c.clock.now_s = 3.5;
    pd_progress_finish(&c.p, 300, NULL);
    fflush(c.f);
    assert_int_equal(count_char(c.text, c.len, '\n'), 1);
    assert_int_equal(c.text[c.len - 1], '\n');
    assert_non_null(strstr(c.text, "\rsim: 300/1000 seeds (30.0%) done in 0:04"));
    capture_close(&c);
}

static void tty_line_is_cut_to_the_terminal_width(void **state) {
    (void)state;
    capture c = {0};
    c.f = open_memstream(&c.text, &c.len);
    assert_non_null(c.f);
    pd_progress_init(&c.p,
                     &(pd_progress_options){.out = c.f,
                                            .label = "bench",
                                            .unit = "requests",
                                            .total = 200,
                                            .style = PD_PROGRESS_TTY,
                                            .tty_columns = 40,
                                            .clock = fake_now,
                                            .clock_ctx = &c.clock});
    c.clock.now_s = 1;
    assert_true(pd_progress_update(&c.p, 10, "p50 TTFT 12.3 ms, errors 2"));
    fflush(c.f);
    assert_string_equal(c.text, "\rbench: 10/200 requests (5.0%), 10.0/s, ");
    pd_progress_finish(&c.p, 200, NULL);
    capture_close(&c);
}

static void unknown_total_has_no_percent_nor_eta(void **state) {
    (void)state;
    capture c;
    capture_open(&c, PD_PROGRESS_PLAIN, 0);
    c.clock.now_s = 10;
    assert_true(pd_progress_update(&c.p, 42, NULL));
    fflush(c.f);
    assert_string_equal(c.text, "sim: 42 seeds, 4.2/s, elapsed 0:10\n");
    pd_progress_finish(&c.p, 42, NULL);
    capture_close(&c);
}

static void rate_follows_recent_speed_eta_the_average(void **state) {
    (void)state;
    capture c;
    capture_open(&c, PD_PROGRESS_PLAIN, 10000);
    c.clock.now_s = 10;
    assert_true(pd_progress_update(&c.p, 100, NULL)); /* 10/s */
    for (int t = 20; t <= 100; t += 10) {
        c.clock.now_s = t;
        assert_true(pd_progress_update(&c.p, 100 + (uint64_t)(t - 10) * 100, NULL));
    }
    /* Now 100/s for 90 s: the smoothed rate is close to 100, not to the
     * average of 91/s; the ETA uses the average: 900 left at 91/s. */
    assert_in_range((long)c.p.rate, 99, 100);
    fflush(c.f);
    assert_non_null(strstr(c.text, "sim: 9100/10000 seeds (91.0%), 100.0/s"));
    assert_non_null(strstr(c.text, "ETA 0:10\n"));
    pd_progress_finish(&c.p, 9100, NULL);
    capture_close(&c);
}

/* A first sample that is off (a slow start) is not carried for the whole
 * smoothing window: early on the rate is the average since the start. */
static void early_rate_is_the_average_since_the_start(void **state) {
    (void)state;
    capture c;
    capture_open(&c, PD_PROGRESS_TTY, 1000);
    c.clock.now_s = 0.1;
    assert_true(pd_progress_update(&c.p, 1, NULL)); /* 10/s */
    for (int i = 2; i <= 10; i++) {                 /* then 40/s */
        c.clock.now_s = i * 0.1;
        pd_progress_update(&c.p, 1 + (uint64_t)(i - 1) * 4, NULL);
    }
    /* 37 in 1 s: the average is 37/s; a rate still near 10/s is wrong. */
    assert_in_range((long)c.p.rate, 35, 38);
    pd_progress_finish(&c.p, 37, NULL);
    capture_close(&c);
}

static void extra_text_is_cut_not_overflowed(void **state) {
    (void)state;
    capture c;
    capture_open(&c, PD_PROGRESS_PLAIN, 1);
    char big[400];
    memset(big, 'e', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    pd_progress_finish(&c.p, 1, big);
    fflush(c.f);
    assert_int_equal(strlen(c.p.extra), PD_PROGRESS_EXTRA_MAX - 1);
    assert_true(c.len <= PD_PROGRESS_LINE_MAX);
    assert_int_equal(c.text[c.len - 1], '\n');
    capture_close(&c);
}

static void auto_style_on_a_file_is_plain(void **state) {
    (void)state;
    FILE *f = tmpfile();
    assert_non_null(f);
    fake_clock clock = {0};
    pd_progress p;
    pd_progress_init(&p, &(pd_progress_options){.out = f, .clock = fake_now, .clock_ctx = &clock});
    assert_false(p.tty);
    assert_true(p.interval_s == 10.0);
    clock.now_s = 9.9;
    assert_false(pd_progress_update(&p, 1, NULL));
    clock.now_s = 10.0;
    assert_true(pd_progress_update(&p, 2, NULL));
    pd_progress_finish(&p, 2, NULL);
    assert_int_equal(p.lines, 2);
    fclose(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(plain_line_every_interval_then_final),
        cmocka_unit_test(short_run_prints_only_the_final_line),
        cmocka_unit_test(tty_rewrites_one_line_at_most_ten_times_a_second),
        cmocka_unit_test(tty_line_is_cut_to_the_terminal_width),
        cmocka_unit_test(unknown_total_has_no_percent_nor_eta),
        cmocka_unit_test(rate_follows_recent_speed_eta_the_average),
        cmocka_unit_test(early_rate_is_the_average_since_the_start),
        cmocka_unit_test(extra_text_is_cut_not_overflowed),
        cmocka_unit_test(auto_style_on_a_file_is_plain),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
