/* The decode batch kept from step to step (decode.c, poll_and_keep): every
 * item the executor sees is the one built fresh from its request — position,
 * fed token, sample index, page table — while requests join, finish, are
 * aborted in the middle of the running queue and wait beyond batch_max.
 *
 * A prefill and a decode engine over one loopback. Both executors sample
 * token g(end, k) = (end * 7) % 1000 + k for an item whose positions end at
 * `end` sampling the k-th output token, so the decode side can tell what a
 * right item holds (its fed token is g(start_pos, sample_index - 1)) and the
 * sink what each streamed token must be. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../test_util.h"
#include "pdserve/engine.h"
#include "pdserve/loopback.h"

#define PS 16u
#define LIVE 40u
#define REQS 400u
#define SLOTS 512u

static int32_t g_tok(uint32_t end, uint32_t k) { return (int32_t)((end * 7u) % 1000u + k); }

/* A per-request record of the decode side's items, by the record index of
 * the engine's request id ((gen << 32) | (index + 1)). */
typedef struct seen {
    uint64_t owner;
    uint32_t next_index; /* the sample index its next item must have */
    uint64_t last_batch; /* the batch of its last item */
    const uint32_t *pages;
    bool gone; /* it missed a batch: it must never come back */
} seen;

typedef struct cexec {
    bool decode;
    uint64_t ids[2];
    uint32_t n[2];
    int32_t tok[2][64];
    uint64_t req[2][64];
    uint32_t head, count;
    uint64_t *kv, *mamba;
    seen s[SLOTS];
    uint64_t batches, kept_items;
    uint64_t prev_id;
    uint64_t prev_req[64];
    uint32_t prev_n;
} cexec;

static seen *seen_of(cexec *x, uint64_t owner) {
    uint32_t i = (uint32_t)(owner & 0xffffffffu) - 1u;
    assert_true(i < SLOTS);
    return &x->s[i];
}

/* A decode item must be what eng_batch_add builds for its request now. */
static void check_decode_item(cexec *x, const pd_batch *b, const pd_batch_item *it) {
    seen *s = seen_of(x, it->req);
    if (s->owner != it->req) *s = (seen){.owner = it->req, .next_index = 1, .pages = it->pages};
    else x->kept_items++;
    assert_false(s->gone);
    assert_int_equal(it->n_tokens, 1);
    assert_true(it->sample);
    assert_int_equal(it->snapshot_slot, PD_POOL_NONE);
    assert_int_equal(it->sample_index, s->next_index);
    assert_ptr_equal(it->pages, s->pages);
    assert_int_equal(it->tokens[0], g_tok(it->start_pos, it->sample_index - 1));
    assert_true((uint64_t)it->n_pages * PS >= (uint64_t)it->start_pos + 1);
    /* The prompt's pages, then one more each time a position needs it. */
    assert_int_equal(it->n_pages, PD_DIV_CEIL(it->start_pos + 1, PS));
    s->next_index++;
    s->last_batch = b->id;
}

static pd_err c_launch(void *self, const pd_batch *b) {
    cexec *x = self;
    assert_true(x->count < 2 && b->n_items <= 64);
    uint32_t slot = (x->head + x->count) % 2;
    x->ids[slot] = b->id;
    x->n[slot] = b->n_items;
    for (uint32_t i = 0; i < b->n_items; i++) {
        const pd_batch_item *it = &b->items[i];
        if (x->decode) check_decode_item(x, b, it);
        x->req[slot][i] = it->req;
        x->tok[slot][i] = it->sample ? g_tok(it->start_pos + it->n_tokens, it->sample_index) : -1;
    }
    if (x->decode) {
        /* A request of the last batch missing from this one has ended. */
        for (uint32_t i = 0; i < x->prev_n; i++) {
            seen *s = seen_of(x, x->prev_req[i]);
            if (s->owner == x->prev_req[i] && s->last_batch != b->id) s->gone = true;
        }
        for (uint32_t i = 0; i < b->n_items; i++) x->prev_req[i] = b->items[i].req;
        x->prev_n = b->n_items;
    }
    x->batches++;
    x->count++;
    return PD_OK;
}

static bool c_poll(void *self, uint64_t id, pd_item_result *res, pd_item_top *tops) {
    (void)tops;
    cexec *x = self;
    assert_true(x->count > 0 && x->ids[x->head] == id);
    for (uint32_t i = 0; i < x->n[x->head]; i++)
        res[i] = (pd_item_result){.req = x->req[x->head][i], .token = x->tok[x->head][i]};
    x->head = (x->head + 1) % 2;
    x->count--;
    return true;
}

static pd_err c_copy(void *self, uint32_t d, uint32_t s) {
    (void)self, (void)d, (void)s;
    return PD_OK;
}
static void c_wb(void *self, const uint32_t *d, const uint32_t *h, uint32_t n) {
    (void)self, (void)d, (void)h, (void)n;
}
static pd_err c_lb(void *self, uint64_t id, const uint32_t *d, const uint32_t *h, uint32_t n) {
    (void)self, (void)id, (void)d, (void)h, (void)n;
    return PD_OK;
}
static bool c_lp(void *self, uint64_t id) {
    (void)self, (void)id;
    return true;
}
static void c_lc(void *self, uint64_t id) { (void)self, (void)id; }
static void c_mem(void *self, pd_exec_memory *m) {
    cexec *x = self;
    *m = (pd_exec_memory){.kv = x->kv, .kv_page_bytes = 8, .kv_pages = 2048};
}
static void c_info(void *self, pd_model_info *i) {
    (void)self;
    *i = (pd_model_info){.vocab = 2000, .eos_token = -1, .page_size = PS};
}
static const pd_executor_vtable cvt = {c_launch, c_poll, c_copy, c_wb,  c_lb,
                                       c_lp,     c_lc,   c_mem,  c_info};

/* The decode side's sink: every streamed token is the one its index calls for,
 * every request ends once, a finished one after all its tokens. With meddle
 * set, its token callback calls back into the engines (meddle_on_token). */
typedef struct stream {
    uint32_t prompt_len[REQS], got[REQS], max_new[REQS], terms[REQS];
    pd_terminal_kind kind[REQS];
    uint32_t ended, finished;
    struct pair *meddle;
} stream;

static void meddle_on_token(struct pair *p, uint64_t tag, uint32_t i);

static void s_token(void *self, uint64_t tag, const char *rid, uint64_t room, int32_t t, float lp,
                    uint32_t i) {
    (void)rid, (void)room, (void)lp;
    stream *st = self;
    assert_true(tag < REQS);
    assert_int_equal(st->terms[tag], 0);
    assert_int_equal(i, st->got[tag]);
    assert_int_equal(t, g_tok(st->prompt_len[tag] + i, i));
    st->got[tag]++;
    if (st->meddle) meddle_on_token(st->meddle, tag, i);
}
static void s_term(void *self, const pd_terminal_event *ev) {
    stream *st = self;
    assert_true(ev->tag < REQS);
    st->terms[ev->tag]++;
    st->kind[ev->tag] = ev->kind;
    st->ended++;
    if (ev->kind != PD_TERM_FINISHED) return;
    st->finished++;
    assert_int_equal(st->got[ev->tag], st->max_new[ev->tag]);
}
static const pd_sink_vtable svt = {.token = s_token, .terminal = s_term};

static void n_token(void *self, uint64_t tag, const char *rid, uint64_t room, int32_t t, float lp,
                    uint32_t i) {
    (void)self, (void)tag, (void)rid, (void)room, (void)t, (void)lp, (void)i;
}
static void n_term(void *self, const pd_terminal_event *ev) { (void)self, (void)ev; }
static const pd_sink_vtable nvt = {.token = n_token, .terminal = n_term};

typedef struct pair {
    cexec x[2];
    pd_meta_row meta[2][2 * LIVE + 8];
    stream st[2];
    pd_loopback *lb;
    pd_engine *e[2];
} pair;

static void pair_open(pair *p) {
    pd_loopback_config lc = {
        .latency = 1, .dead_grace = 10, .rooms_max = 4 * LIVE + 64, .page_size = PS};
    assert_ok(pd_loopback_create(&p->lb, &lc));
    for (int side = 0; side < 2; side++) {
        cexec *x = &p->x[side];
        x->decode = side == 1;
        x->kv = calloc(2048, 8);
        pd_engine_config c;
        pd_engine_config_default(&c, side == 0 ? PD_ROLE_PREFILL : PD_ROLE_DECODE);
        c.page_size = PS;
        c.kv_pages = 2048;
        c.rows = LIVE + 8;
        c.meta_rows = 2 * LIVE + 8;
        c.requests_max = 2 * LIVE + 16;
        c.chunk_tokens = 256;
        c.batch_max = 16; /* below LIVE: some running requests wait a step */
        c.prompt_tokens_max = 256;
        c.new_tokens_max = 24;
        c.strict = true;
        c.meta_mem = p->meta[side];
        char msg[256];
        pd_lb_side ls = side == 0 ? PD_LB_PREFILL : PD_LB_DECODE;
        pd_err err = pd_engine_create(
            &p->e[side], &c, (pd_executor){&cvt, x}, pd_loopback_endpoint(p->lb, ls),
            (pd_sink){side ? &svt : &nvt, &p->st[side]}, msg, sizeof(msg));
        assert_true(err == PD_OK);
        pd_exec_memory m;
        c_mem(x, &m);
        pd_loopback_register(p->lb, ls, &m, p->meta[side], c.meta_rows);
    }
}

static void pair_close(pair *p) {
    for (int side = 0; side < 2; side++) {
        pd_engine_destroy(p->e[side]);
        free(p->x[side].kv);
    }
    pd_loopback_destroy(p->lb);
}

static void submit_one(pair *p, uint32_t k, const int32_t *prompt, uint32_t len, uint32_t max_new,
                       uint64_t now) {
    char rid[16];
    snprintf(rid, sizeof(rid), "r%u", k);
    pd_request_spec s = {.rid = rid,
                         .room = k + 1,
                         .tag = k,
                         .prompt = prompt,
                         .prompt_len = len,
                         .max_new_tokens = max_new,
                         .sampling = {.top_p = 1.0f}};
    p->st[1].prompt_len[k] = len;
    p->st[1].max_new[k] = max_new;
    assert_ok(pd_engine_submit(p->e[0], &s, now, NULL));
    assert_ok(pd_engine_submit(p->e[1], &s, now, NULL));
}

static void submit(pair *p, pd_rng *rng, uint32_t k, const int32_t *sys, uint64_t now) {
    int32_t prompt[256];
    uint32_t len = (uint32_t)pd_rng_range(rng, 8, 200);
    for (uint32_t i = 0; i < len; i++)
        prompt[i] = i < 64 ? sys[i] : (int32_t)pd_rng_below(rng, 2000);
    submit_one(p, k, prompt, len, (uint32_t)pd_rng_range(rng, 2, 24), now);
}

static void kept_items_are_the_fresh_ones(void **state) {
    (void)state;
    pair *p = calloc(1, sizeof(pair));
    pair_open(p);
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(13));
    int32_t sys[64];
    for (int i = 0; i < 64; i++) sys[i] = (int32_t)pd_rng_below(&rng, 2000);
    uint32_t submitted = 0, aborted = 0;
    for (uint64_t now = 1; now < 4000 && p->st[1].ended < REQS; now++) {
        while (submitted < REQS && submitted - p->st[1].ended < LIVE)
            submit(p, &rng, submitted++, sys, now);
        /* Now and then, abort a request of the decode side: most are running,
         * so the batch loses one in its middle. */
        if (pd_rng_below(&rng, 4) == 0) {
            char rid[16];
            uint32_t k = submitted - 1 - (uint32_t)pd_rng_below(&rng, PD_MIN(submitted, LIVE));
            snprintf(rid, sizeof(rid), "r%u", k);
            if (pd_engine_abort(p->e[1], rid) == PD_OK) aborted++;
            (void)pd_engine_abort(p->e[0], rid);
        }
        pd_loopback_advance(p->lb, now);
        pd_engine_step(p->e[0], now);
        pd_engine_step(p->e[1], now);
    }
    assert_int_equal(p->st[1].ended, REQS);
    assert_true(aborted > 20);
    assert_true(p->st[1].finished > REQS / 2);
    /* The kept path ran: most items were a running request's next one. */
    assert_true(p->x[1].kept_items > p->x[1].batches * 4);
    pair_close(p);
    free(p);
}

/* Requests that finish in the same decode poll have their reason recorded at
 * their last token and are retired after the poll. Meanwhile the sink's
 * callback (meddle_on_token) may call back into the engine: on r3's last
 * token it aborts r2, which ended a moment before in the same poll (the
 * abort finds the reason recorded, so r2 still ends finished, once), and
 * submits r8, which takes r2's freed record: the retires after the poll must
 * leave r8 alone. On r5's last token it aborts r5 itself (aborted, as a
 * request aborted from its own token callback always was). */
enum { TOGETHER = 8, TOGETHER_NEW = 6 };

static void meddle_on_token(struct pair *p, uint64_t tag, uint32_t i) {
    if (i + 1 != TOGETHER_NEW) return;
    if (tag == 3) {
        assert_int_equal(p->st[1].got[2], TOGETHER_NEW); /* r2's last token came first */
        uint64_t r2 = pd_engine_request_id(p->e[1], "r2");
        pd_err err = pd_engine_abort(p->e[1], "r2");
        assert_true(err == PD_OK || err == PD_ERR_NOTFOUND);
        assert_int_equal(p->st[1].terms[2], 1);
        assert_int_equal(p->st[1].kind[2], PD_TERM_FINISHED);
        int32_t prompt[20];
        for (uint32_t k = 0; k < 20; k++) prompt[k] = (int32_t)(900 + k);
        submit_one(p, TOGETHER, prompt, 20, TOGETHER_NEW, 1000);
        /* The same record (the low half of the id), another request. */
        uint64_t r8 = pd_engine_request_id(p->e[1], "r8");
        assert_int_equal(r8 & 0xffffffffu, r2 & 0xffffffffu);
        assert_true(r8 != r2);
    } else if (tag == 5) {
        assert_ok(pd_engine_abort(p->e[1], "r5"));
        assert_int_equal(p->st[1].kind[5], PD_TERM_ABORTED);
    }
}

static void requests_finishing_together_end_once_each(void **state) {
    (void)state;
    pair *p = calloc(1, sizeof(pair));
    pair_open(p);
    /* Same shape, submitted together: computed in one prefill batch,
     * committed in one decode step, finishing in one poll. */
    for (uint32_t k = 0; k < TOGETHER; k++) {
        int32_t prompt[20];
        for (uint32_t j = 0; j < 20; j++) prompt[j] = (int32_t)(k * 50 + j);
        submit_one(p, k, prompt, 20, TOGETHER_NEW, 1);
    }
    p->st[1].meddle = p;
    for (uint64_t now = 1; now < 200 && p->st[1].ended < TOGETHER + 1; now++) {
        pd_loopback_advance(p->lb, now);
        pd_engine_step(p->e[0], now);
        pd_engine_step(p->e[1], now);
        char buf[4096];
        pd_strbuf sb;
        pd_strbuf_init(&sb, buf, sizeof(buf));
        if (pd_engine_check(p->e[1], &sb) != PD_OK) fail_msg("%s", buf);
    }
    for (uint32_t k = 0; k <= TOGETHER; k++) {
        assert_int_equal(p->st[1].terms[k], 1);
        assert_int_equal(p->st[1].kind[k], k == 5 ? PD_TERM_ABORTED : PD_TERM_FINISHED);
    }
    for (uint64_t now = 200; now < 400 && !(pd_engine_idle(p->e[0]) && pd_engine_idle(p->e[1]));
         now++) {
        pd_loopback_advance(p->lb, now);
        pd_engine_step(p->e[0], now);
        pd_engine_step(p->e[1], now);
    }
    for (int side = 0; side < 2; side++) {
        assert_true(pd_engine_idle(p->e[side]));
        assert_ok(pd_engine_check(p->e[side], NULL));
    }
    pair_close(p);
    free(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(kept_items_are_the_fresh_ones),
        cmocka_unit_test(requests_finishing_together_end_once_each),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
