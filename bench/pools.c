/*
 * bench/pools — allocation throughput of every pool kind, alone and behind
 * the ownership ledger (plain and strict), so the cost of accounting is
 * visible next to the raw allocator in the same run.
 *
 *   pools [--iters N] [--runs R] [--kv-pages N]
 *
 * Each figure is the median of R runs; a "pair" is one alloc plus one free.
 */
#include <stdio.h>
#include <string.h>

#include "bench_util.h"
#include "pdserve/ledger.h"

typedef struct spec {
    const char *name;
    pd_pool_kind kind;
    uint32_t units, unit_tokens, batch;
} spec;

typedef enum mode { RAW, LEDGER, STRICT } mode;
static const char *mode_name[] = {"pool", "ledger", "strict"};

/* Steady state: keep the pool half full, free the oldest batch, allocate a
 * new one (FIFO order fragments the free set the way real traffic does). */
static double run_once(const spec *s, mode md, uint64_t iters) {
    pd_pool *p;
    PD_MUST(pd_pool_create(&p, s->name, s->kind, s->units, s->unit_tokens));
    pd_ledger *l = NULL;
    int id = -1;
    if (md != RAW) {
        PD_MUST(pd_ledger_create(&l, md == STRICT));
        PD_MUST(pd_ledger_add_pool(l, p, &id));
    }
    uint32_t slots = s->units / 2 / s->batch;
    if (slots == 0) slots = 1;
    uint32_t *held = malloc((size_t)slots * s->batch * sizeof(uint32_t));
    for (uint32_t i = 0; i < slots; i++) {
        if (md == RAW) PD_MUST(pd_pool_alloc_n(p, s->batch, held + (size_t)i * s->batch));
        else PD_MUST(pd_ledger_alloc(l, id, s->batch, 1 + i, held + (size_t)i * s->batch));
    }
    uint64_t pairs = 0, t0 = bench_now_ns();
    for (uint64_t it = 0; it < iters; it++) {
        uint32_t slot = (uint32_t)(it % slots);
        uint32_t *b = held + (size_t)slot * s->batch;
        pd_owner owner = 1 + slot + (it / slots) * slots;
        pd_owner prev = it < slots ? 1 + slot : owner - slots;
        if (md == RAW) {
            if (s->batch == 1) {
                PD_MUST(pd_pool_free(p, b[0]));
                PD_MUST(pd_pool_alloc(p, &b[0]));
            } else {
                PD_MUST(pd_pool_free_n(p, b, s->batch));
                PD_MUST(pd_pool_alloc_n(p, s->batch, b));
            }
        } else {
            PD_MUST(pd_ledger_free(l, id, b, s->batch, PD_UNIT_REQ, prev));
            PD_MUST(pd_ledger_alloc(l, id, s->batch, owner, b));
        }
        pairs += s->batch;
    }
    uint64_t dt = bench_now_ns() - t0;
    free(held);
    pd_ledger_destroy(l);
    pd_pool_destroy(p);
    return (double)pairs / ((double)dt / 1e9);
}

int main(int argc, char **argv) {
    uint64_t iters = 200000;
    int runs = 5;
    uint32_t kv_pages = 262144;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--kv-pages") && i + 1 < argc)
            kv_pages = (uint32_t)strtoul(argv[++i], NULL, 0);
        else {
            fprintf(stderr,
                    "usage: pools [--iters N] [--runs R] [--kv-pages N]\n"
                    "  Measures alloc+free pairs per second for each pool kind, raw and\n"
                    "  through the ledger (counts only) and the strict ledger (owner map).\n");
            return strcmp(argv[i], "--help") ? 2 : 0;
        }
    }
    if (runs < 1) runs = 1;
    const spec specs[] = {
        {"kv page x1", PD_POOL_KV, kv_pages, 16, 1},
        {"kv pages x64", PD_POOL_KV, kv_pages, 16, 64},
        {"kv pages x1024", PD_POOL_KV, kv_pages, 16, 1024},
        {"row slot", PD_POOL_ROW, 1024, 0, 1},
        {"mamba slot x3", PD_POOL_MAMBA, 192, 0, 3},
        {"meta row", PD_POOL_META, 1024, 0, 1},
        {"host pages x64", PD_POOL_HOST, kv_pages * 4u, 16, 64},
    };
    printf("%-16s %16s %16s %16s   (alloc+free unit pairs per second, median of %d)\n",
           "pool", mode_name[RAW], mode_name[LEDGER], mode_name[STRICT], runs);
    double *v = malloc(sizeof(double) * (size_t)runs);
    double worst_raw = 0;
    for (size_t s = 0; s < PD_ARRAY_LEN(specs); s++) {
        double med[3];
        for (int md = RAW; md <= STRICT; md++) {
            for (int r = 0; r < runs; r++) v[r] = run_once(&specs[s], (mode)md, iters);
            med[md] = bench_median(v, (size_t)runs);
        }
        printf("%-16s %16.0f %16.0f %16.0f\n", specs[s].name, med[RAW], med[LEDGER], med[STRICT]);
        if (s == 0) worst_raw = med[RAW];
        if (med[RAW] < worst_raw) worst_raw = med[RAW];
    }
    free(v);
    printf("slowest pool, raw: %.0f ops/s (%.1f ns per alloc+free)\n", worst_raw, 1e9 / worst_raw);
    return 0;
}
