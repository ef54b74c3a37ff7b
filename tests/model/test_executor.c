/* The model behind the engines' executor vtable: launch/poll order and
 * limits, refusal of contract-breaking batches without side effects, state
 * copies, host write-back and loads, and the memory and info the engines and
 * transports read. */
#include <stdlib.h>

#include "model_fixture.h"

#define PS 4
#define PAGES 16
#define SLOTS 4
#define LEN 10

typedef struct node {
    pd_model *m;
    pd_executor ex;
    pd_exec_memory mem;
    int32_t prompt[LEN];
    uint32_t pages[PAGES];
} node;

static node *mk_node(const char *layers) {
    node *n = calloc(1, sizeof(*n));
    n->m = fx_model(layers, 21);
    n->ex = fx_exec(n->m, PS, PAGES, SLOTS, 1);
    n->ex.vt->memory(n->ex.self, &n->mem);
    fx_prompt(n->prompt, LEN, 1);
    fx_iota(n->pages, PAGES, 0);
    return n;
}

static void free_node(node *n) {
    pd_model_executor_destroy(&n->ex);
    pd_model_destroy(n->m);
    free(n);
}

static pd_batch_item prefill_item(node *n, uint64_t req, uint32_t slot) {
    return (pd_batch_item){.req = req, .tokens = n->prompt, .n_tokens = LEN, .start_pos = 0,
                           .pages = n->pages, .n_pages = PAGES, .mamba_slot = slot,
                           .snapshot_slot = PD_POOL_NONE, .sample = true};
}

static void launched_batches_are_polled_in_order_with_forward_results(void **state) {
    (void)state;
    node *n = mk_node("MAMA");
    /* reference: the same item through the synchronous call */
    pd_batch_item it = prefill_item(n, 5, 0);
    pd_item_result want;
    fx_forward(&n->ex, &it, 1, &want, NULL);

    pd_item_result res[2];
    pd_item_top tops[2];
    for (uint64_t id = 10; id < 10 + PD_MODEL_INFLIGHT_MAX; id++) {
        pd_batch b = {id, &it, 1};
        assert_ok(n->ex.vt->launch(n->ex.self, &b));
    }
    pd_batch extra = {100, &it, 1};
    assert_err(n->ex.vt->launch(n->ex.self, &extra), PD_ERR_NOMEM);
    for (uint64_t id = 10; id < 10 + PD_MODEL_INFLIGHT_MAX; id++) {
        assert_true(n->ex.vt->poll(n->ex.self, id, res, tops));
        assert_int_equal(res[0].req, 5);
        assert_int_equal(res[0].token, want.token);
        assert_memory_equal(&res[0].logprob, &want.logprob, sizeof(float));
    }
    assert_false(n->ex.vt->poll(n->ex.self, 200, res, tops)); /* nothing in flight */
    /* ids must increase */
    pd_batch old = {12, &it, 1};
    assert_err(n->ex.vt->launch(n->ex.self, &old), PD_ERR_INVALID);
    /* an item that does not sample reports token -1 */
    it.sample = false;
    pd_batch quiet = {300, &it, 1};
    assert_ok(n->ex.vt->launch(n->ex.self, &quiet));
    assert_true(n->ex.vt->poll(n->ex.self, 300, res, tops));
    assert_int_equal(res[0].token, -1);
    free_node(n);
}

/* Top logprobs come back beside the results: poll writes tops[i] for the
 * item that asked (as the synchronous call computes them) and leaves the
 * other's entry alone; the synchronous call without a place for them
 * refuses the batch. */
static void poll_returns_top_logprobs_apart(void **state) {
    (void)state;
    node *n = mk_node("MAMA");
    pd_batch_item it = prefill_item(n, 5, 0);
    it.sampling.top_logprobs = 3;
    pd_item_result want;
    pd_item_top want_top;
    char msg[200] = "";
    assert_ok(pd_model_forward(&n->ex, &it, 1, &want, &want_top, NULL, msg, sizeof(msg)));
    assert_int_equal(want.n_top, 3);
    assert_err(pd_model_forward(&n->ex, &it, 1, &want, NULL, NULL, msg, sizeof(msg)),
               PD_ERR_INVALID);
    assert_non_null(strstr(msg, "top logprobs"));
    pd_batch_item two[2] = {prefill_item(n, 6, 1), it};
    two[0].pages = n->pages + 8; /* its own pages */
    two[0].n_pages = PAGES - 8;
    pd_batch b = {1, two, 2};
    assert_ok(n->ex.vt->launch(n->ex.self, &b));
    pd_item_result res[2];
    pd_item_top tops[2];
    memset(tops, 0x5A, sizeof(tops));
    pd_item_top untouched;
    memset(&untouched, 0x5A, sizeof(untouched));
    assert_true(n->ex.vt->poll(n->ex.self, 1, res, tops));
    assert_int_equal(res[0].n_top, 0);
    assert_memory_equal(&tops[0], &untouched, sizeof(untouched));
    assert_int_equal(res[1].n_top, 3);
    assert_int_equal(res[1].token, want.token);
    assert_memory_equal(tops[1].token, want_top.token, 3 * sizeof(int32_t));
    assert_memory_equal(tops[1].logprob, want_top.logprob, 3 * sizeof(float));
    free_node(n);
}

typedef void (*breaker)(pd_batch_item *it, int32_t *bad_tokens);

static void b_token(pd_batch_item *it, int32_t *t) { t[3] = 258; it->tokens = t; }
static void b_negative(pd_batch_item *it, int32_t *t) { t[0] = -1; it->tokens = t; }
static void b_no_tokens(pd_batch_item *it, int32_t *t) { (void)t; it->n_tokens = 0; }
static void b_short_table(pd_batch_item *it, int32_t *t) { (void)t; it->n_pages = 2; }
static void b_page_range(pd_batch_item *it, int32_t *t) {
    (void)t;
    static uint32_t pages[PAGES];
    fx_iota(pages, PAGES, 0);
    pages[1] = PAGES;
    it->pages = pages;
}
static void b_slot(pd_batch_item *it, int32_t *t) { (void)t; it->mamba_slot = SLOTS; }
static void b_snapshot_is_running(pd_batch_item *it, int32_t *t) {
    (void)t;
    it->snapshot_slot = it->mamba_slot;
}
static void b_top_p(pd_batch_item *it, int32_t *t) {
    (void)t;
    it->sampling = (pd_sampling){.temperature = 1.0f, .top_p = 0.0f};
}
static void b_too_long(pd_batch_item *it, int32_t *t) { (void)t; it->start_pos = PAGES * PS; }

/* A batch breaking the contract is refused, by launch and by the direct
 * call, before anything is computed: the node's memory is untouched. */
static void contract_breaking_items_are_refused_without_side_effects(void **state) {
    (void)state;
    node *n = mk_node("MAMA");
    const breaker cases[] = {b_token, b_negative, b_no_tokens, b_short_table, b_page_range,
                             b_slot, b_snapshot_is_running, b_top_p, b_too_long};
    const char *messages[] = {"outside the vocabulary", "outside the vocabulary", "no tokens",
                              "page table has 2 pages", "outside the pool", "Mamba slot 4 outside",
                              "used twice", "top_p", "more pages than the pool"};
    size_t kv_bytes = (size_t)n->mem.kv_pages * n->mem.kv_page_bytes;
    size_t mamba_bytes = (size_t)n->mem.mamba_slots * n->mem.mamba_slot_bytes;
    memset(n->mem.kv, 0x11, kv_bytes);
    memset(n->mem.mamba, 0x22, mamba_bytes);
    uint8_t *kv_before = malloc(kv_bytes), *mamba_before = malloc(mamba_bytes);
    memcpy(kv_before, n->mem.kv, kv_bytes);
    memcpy(mamba_before, n->mem.mamba, mamba_bytes);
    for (size_t c = 0; c < PD_ARRAY_LEN(cases); c++) {
        /* a valid first item, then the broken one */
        int32_t toks[LEN];
        memcpy(toks, n->prompt, sizeof(toks));
        pd_batch_item items[2] = {prefill_item(n, 1, 0), prefill_item(n, 2, 1)};
        cases[c](&items[1], toks);
        pd_batch b = {c + 1, items, 2};
        assert_err(n->ex.vt->launch(n->ex.self, &b), PD_ERR_INVALID);
        pd_item_result res[2];
        char msg[300] = "";
        assert_err(pd_model_forward(&n->ex, items, 2, res, NULL, NULL, msg, sizeof(msg)),
                   PD_ERR_INVALID);
        if (!strstr(msg, messages[c])) fail_msg("case %zu: '%s' lacks '%s'", c, msg, messages[c]);
        assert_memory_equal(n->mem.kv, kv_before, kv_bytes);
        assert_memory_equal(n->mem.mamba, mamba_before, mamba_bytes);
    }
    /* two items on one running slot */
    pd_batch_item twice[2] = {prefill_item(n, 1, 2), prefill_item(n, 2, 2)};
    pd_batch b = {50, twice, 2};
    assert_err(n->ex.vt->launch(n->ex.self, &b), PD_ERR_INVALID);
    /* the marks of refused batches are cleared: the valid batch now runs */
    pd_batch_item ok[2] = {prefill_item(n, 1, 2), prefill_item(n, 2, 3)};
    pd_batch good = {51, ok, 2};
    assert_ok(n->ex.vt->launch(n->ex.self, &good));
    pd_item_result res[2];
    pd_item_top tops[2];
    assert_true(n->ex.vt->poll(n->ex.self, 51, res, tops));
    free(mamba_before);
    free(kv_before);
    free_node(n);
}

static void copy_state_copies_one_slot(void **state) {
    (void)state;
    node *n = mk_node("MAMA");
    pd_batch_item it = prefill_item(n, 1, 0);
    pd_item_result r;
    fx_forward(&n->ex, &it, 1, &r, NULL);
    char *slot0 = (char *)n->mem.mamba, *slot3 = slot0 + 3 * n->mem.mamba_slot_bytes;
    assert_true(memcmp(slot0, slot3, n->mem.mamba_slot_bytes) != 0);
    assert_ok(n->ex.vt->copy_state(n->ex.self, 3, 0));
    assert_memory_equal(slot0, slot3, n->mem.mamba_slot_bytes);
    assert_err(n->ex.vt->copy_state(n->ex.self, SLOTS, 0), PD_ERR_INVALID);
    assert_err(n->ex.vt->copy_state(n->ex.self, 0, PD_POOL_NONE), PD_ERR_INVALID);
    free_node(n);
}

/* Evict a request's pages to host, overwrite them on device, load them back
 * (to other device pages): decoding continues exactly as if nothing
 * happened. */
static void host_write_back_and_load_restore_pages_exactly(void **state) {
    (void)state;
    node *n = mk_node("MAMA");
    pd_batch_item it = prefill_item(n, 1, 0);
    pd_item_result r;
    fx_forward(&n->ex, &it, 1, &r, NULL);
    const uint32_t used = PD_DIV_CEIL(LEN, PS);
    /* save the Mamba state so both continuations start equal */
    assert_ok(n->ex.vt->copy_state(n->ex.self, 1, 0));

    uint32_t dev[4], host[4], moved[PAGES];
    for (uint32_t i = 0; i < used; i++) {
        dev[i] = i;
        host[i] = 3 - i;
    }
    n->ex.vt->write_back(n->ex.self, dev, host, used);
    uint32_t to[4] = {9, 7, 12};
    assert_ok(n->ex.vt->load_begin(n->ex.self, 77, to, host, used));
    assert_true(n->ex.vt->load_poll(n->ex.self, 77));
    memset(n->mem.kv, 0, (size_t)used * n->mem.kv_page_bytes); /* the old copies are gone */
    fx_iota(moved, PAGES, 0);
    for (uint32_t i = 0; i < used; i++) moved[i] = to[i];
    moved[used] = 13; /* the decode writes here */

    int32_t tok = r.token;
    pd_batch_item d1 = {.req = 1, .tokens = &tok, .n_tokens = 1, .start_pos = LEN, .pages = moved,
                        .n_pages = PAGES, .mamba_slot = 1, .snapshot_slot = PD_POOL_NONE,
                        .sample = true, .sample_index = 1};
    float *l1 = calloc(PD_TOKENIZER_VOCAB, sizeof(float));
    float *l2 = calloc(PD_TOKENIZER_VOCAB, sizeof(float));
    pd_item_result r1, r2;
    fx_forward(&n->ex, &d1, 1, &r1, l1);

    /* a fresh node that never evicted anything */
    node *o = mk_node("MAMA");
    pd_batch_item it2 = prefill_item(o, 1, 0);
    fx_forward(&o->ex, &it2, 1, &r2, NULL);
    pd_batch_item d2 = d1;
    d2.pages = o->pages;
    d2.mamba_slot = 0;
    fx_forward(&o->ex, &d2, 1, &r2, l2);
    assert_int_equal(r1.token, r2.token);
    assert_memory_equal(l1, l2, sizeof(float) * PD_TOKENIZER_VOCAB);

    uint32_t bad_dev[1] = {PAGES}, ok_host[1] = {0};
    assert_err(n->ex.vt->load_begin(n->ex.self, 78, bad_dev, ok_host, 1), PD_ERR_INVALID);
    n->ex.vt->load_cancel(n->ex.self, 78);
    free(l2);
    free(l1);
    free_node(o);
    free_node(n);
}

static void memory_and_info_describe_the_node(void **state) {
    (void)state;
    node *n = mk_node("MAMA");
    const pd_model_shape *s = pd_model_shape_get(n->m);
    assert_non_null(n->mem.kv);
    assert_int_equal(n->mem.kv_pages, PAGES);
    assert_int_equal(n->mem.kv_page_bytes, PS * s->kv_bytes_per_token);
    assert_non_null(n->mem.mamba);
    assert_int_equal(n->mem.mamba_slots, SLOTS);
    assert_int_equal(n->mem.mamba_slot_bytes, s->mamba_slot_bytes);
    assert_non_null(n->mem.host);
    assert_int_equal(n->mem.host_page_bytes, n->mem.kv_page_bytes);
    assert_int_equal(n->mem.host_pages, 4);
    pd_model_info info;
    n->ex.vt->info(n->ex.self, &info);
    assert_int_equal(info.vocab, 258);
    assert_int_equal(info.eos_token, PD_TOKEN_EOS);
    assert_int_equal(info.page_size, PS);
    assert_true(info.has_mamba);
    assert_true(pd_model_executor_is(&n->ex));
    free_node(n);

    /* attention only: no Mamba memory */
    node *a = mk_node("AA");
    assert_null(a->mem.mamba);
    assert_int_equal(a->mem.mamba_slots, 0);
    a->ex.vt->info(a->ex.self, &info);
    assert_false(info.has_mamba);
    free_node(a);
}

static void create_refuses_bad_sizes_with_a_message(void **state) {
    (void)state;
    pd_model *m = fx_model("MAMA", 1);
    pd_executor ex;
    char msg[200];
    assert_err(pd_model_executor_create(&ex, m, 0, 8, 1, 0, 1, msg, sizeof(msg)), PD_ERR_INVALID);
    assert_non_null(strstr(msg, "page size"));
    assert_err(pd_model_executor_create(&ex, m, 16, 8, 1, 0, 0, msg, sizeof(msg)), PD_ERR_INVALID);
    assert_non_null(strstr(msg, "threads"));
    assert_err(pd_model_executor_create(&ex, m, 16, 0, 1, 0, 1, msg, sizeof(msg)), PD_ERR_INVALID);
    assert_non_null(strstr(msg, "KV pages"));
    assert_err(pd_model_executor_create(&ex, m, 16, 8, 0, 0, 1, msg, sizeof(msg)), PD_ERR_INVALID);
    assert_non_null(strstr(msg, "Mamba slots"));
    assert_null(ex.self);
    assert_false(pd_model_executor_is(&ex));
    pd_model_destroy(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(launched_batches_are_polled_in_order_with_forward_results),
        cmocka_unit_test(poll_returns_top_logprobs_apart),
        cmocka_unit_test(contract_breaking_items_are_refused_without_side_effects),
        cmocka_unit_test(copy_state_copies_one_slot),
        cmocka_unit_test(host_write_back_and_load_restore_pages_exactly),
        cmocka_unit_test(memory_and_info_describe_the_node),
        cmocka_unit_test(create_refuses_bad_sizes_with_a_message),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
