/*
 * bench/xfer — what a prefill -> decode hand-off costs over pd_net.
 *
 * Two pd_net nodes (prefill + decode) in this process, connected through the
 * bootstrap port on 127.0.0.1, move one request's KV pages, Mamba state and
 * metadata row per room, exactly as the engines drive the transport
 * (receiver_open, sender_open, wait for WAITING_FOR_INPUT, send_final, wait
 * for SUCCESS on the decode side). Sizes come from the model presets
 * (pd_model_config_shape: KV bytes per token, Mamba slot bytes), page size 16.
 * Destination pages are contiguous, as the pools hand them out when they can,
 * so one request is one put of KV plus two small puts.
 *
 * Figures, each the median over --runs rooms after a warm-up room:
 *   hand-off   time from send_final to the decode side seeing SUCCESS
 *              (every byte landed and the completion notice arrived), and
 *              bytes / that time;
 *   memcpy     the same bytes copied page by page inside one process (what
 *              the loopback transport does): the ceiling for one host;
 *   fixed cost a 16-token request from receiver_open to SUCCESS: bootstrap
 *              round trip, three puts, flush, notice.
 * Transports: UCX_TLS=shm and UCX_TLS=tcp (UCX_NET_DEVICES=lo) unless
 * --transports says otherwise. The last lines are the summary.
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "pdserve/model.h"
#include "pdserve/net.h"

#define LIST_MAX 8

typedef struct opts {
    int runs;
    uint32_t page_size;
    uint32_t tokens[LIST_MAX];
    int n_tokens;
    char configs[LIST_MAX][16];
    int n_configs;
    char transports[LIST_MAX][16];
    int n_transports;
    const char *net_devices;
    int32_t spin_us;
} opts;

typedef struct node {
    pd_net *net;
    pd_xfer x;
    uint8_t *kv, *mamba;
    pd_meta_row meta[4];
} node;

typedef struct link {
    node pre, dec;
    char peer[64];
    uint64_t room;
    uint32_t pages_max, page_size;
    size_t page_bytes, slot_bytes;
} link;

static void die(const char *what, const char *msg) {
    fprintf(stderr, "xfer: %s: %s\n", what, msg);
    exit(1);
}

static void wait_status(pd_xfer x, uint64_t room, pd_xfer_status want) {
    uint64_t t0 = bench_now_ns();
    for (;;) {
        pd_xfer_status st = x.vt->status(x.self, room);
        if (st == want) return;
        if (st == PD_XFER_FAILED) die("room", "failed");
        if (bench_now_ns() - t0 > 120ull * 1000000000ull) die("room", "timed out");
        sched_yield();
    }
}

static void node_open(node *n, pd_net_role role, const opts *o, const char *tls, uint32_t pages,
                      size_t page_bytes, size_t slot_bytes) {
    pd_net_config c;
    pd_net_config_default(&c, role);
    c.listen_host = "127.0.0.1";
    c.bootstrap_port = 0;
    c.page_size = o->page_size;
    c.rooms_max = 64;
    c.ucx_tls = tls;
    c.spin_us = o->spin_us;
    if (!strcmp(tls, "tcp")) c.ucx_net_devices = o->net_devices;
    char msg[256];
    if (pd_net_create(&n->net, &c, msg, sizeof(msg))) die("create", msg);
    n->kv = malloc(pages * page_bytes);
    n->mamba = malloc(slot_bytes);
    if (!n->kv || !n->mamba) die("memory", "out of memory");
    for (size_t i = 0; i < pages * page_bytes; i++)
        n->kv[i] = role == PD_NET_PREFILL ? (uint8_t)(i * 7 + i / 4093) : 0;
    memset(n->mamba, role == PD_NET_PREFILL ? 0x3C : 0, slot_bytes);
    for (int r = 0; r < 4; r++)
        n->meta[r] = (pd_meta_row){.nonce = 1 + (uint64_t)r, .first_token = r};
    pd_exec_memory mem = {.kv = n->kv, .kv_page_bytes = page_bytes, .kv_pages = pages,
                          .mamba = n->mamba, .mamba_slot_bytes = slot_bytes, .mamba_slots = 1};
    if (pd_net_register(n->net, &mem, n->meta, 4, msg, sizeof(msg))) die("register", msg);
    if (pd_net_start(n->net, msg, sizeof(msg))) die("start", msg);
    n->x = pd_net_endpoint(n->net);
}

static void node_close(node *n) {
    pd_net_destroy(n->net);
    free(n->kv);
    free(n->mamba);
}

/* One room of `pages` pages. Returns the hand-off time; *boot_ns and
 * *total_ns get the bootstrap and the whole room's times. */
static double one_room(link *l, uint32_t tokens, uint32_t *idx, double *boot_ns,
                       double *total_ns) {
    uint64_t room = ++l->room;
    uint32_t pages = PD_DIV_CEIL(tokens, l->page_size);
    pd_xfer pre = l->pre.x, dec = l->dec.x;
    pd_xfer_dest d = {.prompt_tokens = tokens, .pages = idx, .n_pages = pages, .mamba_slot = 0,
                      .meta_row = 1};
    uint64_t t0 = bench_now_ns();
    if (dec.vt->receiver_open(dec.self, room, l->peer, &d)) die("receiver_open", "refused");
    if (pre.vt->sender_open(pre.self, room)) die("sender_open", "refused");
    wait_status(pre, room, PD_XFER_WAITING_FOR_INPUT);
    uint64_t t1 = bench_now_ns();
    if (pre.vt->send_final(pre.self, room, 0, idx, pages, 0, 2)) die("send_final", "refused");
    wait_status(dec, room, PD_XFER_SUCCESS);
    uint64_t t2 = bench_now_ns();
    wait_status(pre, room, PD_XFER_SUCCESS);
    while (!pre.vt->drained(pre.self, room) || !dec.vt->drained(dec.self, room)) sched_yield();
    pre.vt->close(pre.self, room);
    dec.vt->close(dec.self, room);
    if (boot_ns) *boot_ns = (double)(t1 - t0);
    if (total_ns) *total_ns = (double)(t2 - t0);
    return (double)(t2 - t1);
}

static bool landed(const link *l, uint32_t pages) {
    return !memcmp(l->pre.kv, l->dec.kv, pages * l->page_bytes) &&
           !memcmp(l->pre.mamba, l->dec.mamba, l->slot_bytes) &&
           !memcmp(&l->pre.meta[2], &l->dec.meta[1], sizeof(pd_meta_row));
}

static double memcpy_ns(const link *l, uint32_t pages, int runs, uint8_t *dst_kv,
                        uint8_t *dst_mamba) {
    double t[64];
    pd_meta_row row;
    for (int r = 0; r < runs + 1; r++) {
        uint64_t t0 = bench_now_ns();
        for (uint32_t p = 0; p < pages; p++)
            memcpy(dst_kv + (size_t)p * l->page_bytes, l->pre.kv + (size_t)p * l->page_bytes,
                   l->page_bytes);
        memcpy(dst_mamba, l->pre.mamba, l->slot_bytes);
        memcpy(&row, &l->pre.meta[2], sizeof(row));
        __asm__ volatile("" : : "r"(dst_kv), "r"(&row) : "memory");
        if (r > 0) t[r - 1] = (double)(bench_now_ns() - t0);
    }
    return bench_median(t, (size_t)runs);
}

static void fmt_bytes(char *out, size_t cap, double b) {
    if (b >= 1 << 20) snprintf(out, cap, "%.2f MiB", b / (1 << 20));
    else snprintf(out, cap, "%.1f KiB", b / 1024);
}

static void fmt_time(char *out, size_t cap, double ns) {
    if (ns >= 1e6) snprintf(out, cap, "%.2f ms", ns / 1e6);
    else snprintf(out, cap, "%.0f us", ns / 1e3);
}

static int parse_list(const char *s, char out[][16], int max) {
    int n = 0;
    const char *p = s;
    while (*p && n < max) {
        size_t len = strcspn(p, ",");
        if (len == 0 || len >= 16) return -1;
        memcpy(out[n], p, len);
        out[n][len] = 0;
        n++;
        p += len;
        if (*p == ',') p++;
    }
    return n;
}

static void usage(void) {
    fprintf(stderr,
            "usage: xfer [--quick] [--runs N] [--tokens 1024,16384] [--configs tiny,small]\n"
            "            [--transports shm,tcp] [--net-devices lo] [--spin-us N]\n");
    exit(2);
}

typedef struct result {
    char config[16], transport[16];
    uint32_t tokens;
    double bytes, ns, memcpy_ns;
} result;

/* Everything measured: one result per (config, transport, tokens), and the
 * fixed cost per transport. */
typedef struct tally {
    result res[LIST_MAX * LIST_MAX * LIST_MAX];
    int n_res;
    double fixed[LIST_MAX], fixed_boot[LIST_MAX];
} tally;

static void parse_args(int argc, char **argv, opts *o) {
    *o = (opts){.runs = 5, .page_size = 16, .tokens = {1024, 16384}, .n_tokens = 2,
                .n_configs = 2, .n_transports = 2, .net_devices = "lo"};
    strcpy(o->configs[0], "tiny");
    strcpy(o->configs[1], "small");
    strcpy(o->transports[0], "shm");
    strcpy(o->transports[1], "tcp");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--quick")) {
            o->runs = 3;
        } else if (!strcmp(a, "--runs") && v) {
            o->runs = atoi(v), i++;
            if (o->runs < 1 || o->runs > 63) usage();
        } else if (!strcmp(a, "--tokens") && v) {
            char tmp[LIST_MAX][16];
            o->n_tokens = parse_list(v, tmp, LIST_MAX), i++;
            if (o->n_tokens <= 0) usage();
            for (int k = 0; k < o->n_tokens; k++)
                if ((o->tokens[k] = (uint32_t)atoi(tmp[k])) == 0) usage();
        } else if (!strcmp(a, "--configs") && v) {
            if ((o->n_configs = parse_list(v, o->configs, LIST_MAX)) <= 0) usage();
            i++;
        } else if (!strcmp(a, "--transports") && v) {
            if ((o->n_transports = parse_list(v, o->transports, LIST_MAX)) <= 0) usage();
            i++;
        } else if (!strcmp(a, "--spin-us") && v) {
            o->spin_us = atoi(v), i++;
        } else if (!strcmp(a, "--net-devices") && v) {
            o->net_devices = v, i++;
        } else {
            usage();
        }
    }
}

/* Hand-offs of each request size over link l (config c, transport t), and
 * the same bytes through memcpy. */
static void measure_sizes(link *l, const opts *o, int c, int t, uint32_t *idx,
                          uint8_t *scratch_kv, uint8_t *scratch_mb, tally *tl) {
    for (int k = 0; k < o->n_tokens; k++) {
        uint32_t tokens = o->tokens[k], pages = PD_DIV_CEIL(tokens, o->page_size);
        double ns[64];
        memset(l->dec.kv, 0, pages * l->page_bytes);
        for (int r = 0; r < o->runs; r++) ns[r] = one_room(l, tokens, idx, NULL, NULL);
        if (!landed(l, pages)) die("check", "the decode side's bytes differ from the prefill's");
        result *x = &tl->res[tl->n_res++];
        snprintf(x->config, sizeof(x->config), "%s", o->configs[c]);
        snprintf(x->transport, sizeof(x->transport), "%s", o->transports[t]);
        x->tokens = tokens;
        x->bytes = (double)pages * (double)l->page_bytes + (double)l->slot_bytes +
                   sizeof(pd_meta_row);
        x->ns = bench_median(ns, (size_t)o->runs);
        x->memcpy_ns = memcpy_ns(l, pages, o->runs, scratch_kv, scratch_mb);
    }
}

/* Fixed cost of a room over transport t: a 16-token request, start to finish. */
static void measure_fixed_cost(link *l, const opts *o, int t, uint32_t *idx, tally *tl) {
    int reps = PD_MAX(o->runs, 20);
    double tot[64], boot[64];
    reps = PD_MIN(reps, 63);
    for (int r = 0; r < reps; r++) one_room(l, o->page_size, idx, &boot[r], &tot[r]);
    tl->fixed[t] = bench_median(tot, (size_t)reps);
    tl->fixed_boot[t] = bench_median(boot, (size_t)reps);
}

/* Every transport and request size for model config c. */
static void measure_config(const opts *o, int c, uint32_t pages_max, uint32_t *idx, tally *tl) {
    pd_model_config mc;
    char msg[256];
    if (pd_model_config_preset(&mc, o->configs[c], msg, sizeof(msg))) die("config", msg);
    pd_model_shape sh;
    pd_model_config_shape(&mc, &sh);
    size_t page_bytes = sh.kv_bytes_per_token * o->page_size;
    size_t slot_bytes = sh.mamba_slot_bytes ? sh.mamba_slot_bytes : 64;
    uint8_t *scratch_kv = malloc(pages_max * page_bytes), *scratch_mb = malloc(slot_bytes);
    for (int t = 0; t < o->n_transports; t++) {
        const char *tls = o->transports[t];
        link l = {.pages_max = pages_max, .page_size = o->page_size, .page_bytes = page_bytes,
                  .slot_bytes = slot_bytes};
        node_open(&l.pre, PD_NET_PREFILL, o, tls, pages_max, page_bytes, slot_bytes);
        node_open(&l.dec, PD_NET_DECODE, o, tls, pages_max, page_bytes, slot_bytes);
        snprintf(l.peer, sizeof(l.peer), "127.0.0.1:%u", pd_net_bootstrap_port(l.pre.net));
        one_room(&l, o->page_size, idx, NULL, NULL); /* warm-up: connection and UCX wire-up */
        measure_sizes(&l, o, c, t, idx, scratch_kv, scratch_mb, tl);
        if (c == 0) measure_fixed_cost(&l, o, t, idx, tl);
        node_close(&l.dec);
        node_close(&l.pre);
    }
    free(scratch_kv);
    free(scratch_mb);
}

static bool same_request(const result *a, const result *b) {
    return !strcmp(a->config, b->config) && a->tokens == b->tokens;
}

/* The table, grouped by request: memcpy (the best of its measurements)
 * first, then each transport. */
static void print_table(tally *tl) {
    result *res = tl->res;
    for (int i = 0; i < tl->n_res; i++) {
        result *x = &res[i];
        bool seen = false;
        for (int j = 0; j < i; j++) seen |= same_request(&res[j], x);
        if (seen) continue;
        double best = x->memcpy_ns;
        for (int j = i; j < tl->n_res; j++)
            if (same_request(&res[j], x)) best = PD_MIN(best, res[j].memcpy_ns);
        char b[32], tm[32];
        fmt_bytes(b, sizeof(b), x->bytes);
        fmt_time(tm, sizeof(tm), best);
        printf("%-6s %7u %11s  %-8s %10s %8.2f GB/s %9s\n", x->config, x->tokens, b, "memcpy", tm,
               x->bytes / best, "1.00x");
        for (int j = i; j < tl->n_res; j++) {
            result *y = &res[j];
            if (!same_request(y, x)) continue;
            y->memcpy_ns = best;
            char rel[16];
            snprintf(rel, sizeof(rel), "%.2fx", best / y->ns);
            fmt_time(tm, sizeof(tm), y->ns);
            printf("%-6s %7u %11s  ucx-%-4s %10s %8.2f GB/s %9s\n", y->config, y->tokens, b,
                   y->transport, tm, y->bytes / y->ns, rel);
        }
    }
}

static void print_fixed_costs(const opts *o, const tally *tl) {
    printf("\nper-room fixed cost (one-page request, receiver_open -> SUCCESS; "
           "bootstrap round trip in brackets):\n");
    for (int t = 0; t < o->n_transports; t++) {
        char a[32], b[32];
        fmt_time(a, sizeof(a), tl->fixed[t]);
        fmt_time(b, sizeof(b), tl->fixed_boot[t]);
        printf("  ucx-%-4s %9s  (%s)\n", o->transports[t], a, b);
    }
}

/* Summary: the largest request measured, and the fixed costs. */
static void print_summary(const opts *o, const tally *tl) {
    const result *res = tl->res;
    int big = 0;
    for (int i = 1; i < tl->n_res; i++)
        if (res[i].bytes > res[big].bytes) big = i;
    printf("\nsummary: %s %u-token hand-off (%.1f MiB): memcpy %.2f GB/s", res[big].config,
           res[big].tokens, res[big].bytes / (1 << 20), res[big].bytes / res[big].memcpy_ns);
    for (int i = 0; i < tl->n_res; i++)
        if (same_request(&res[i], &res[big]))
            printf(", ucx-%s %.2f GB/s", res[i].transport, res[i].bytes / res[i].ns);
    printf("\nsummary: per-room fixed cost");
    for (int t = 0; t < o->n_transports; t++) {
        char a[32];
        fmt_time(a, sizeof(a), tl->fixed[t]);
        printf("%s ucx-%s %s", t ? "," : "", o->transports[t], a);
    }
    printf("\n");
}

int main(int argc, char **argv) {
    opts o;
    parse_args(argc, argv, &o);
    uint32_t tokens_max = 16;
    for (int k = 0; k < o.n_tokens; k++) tokens_max = PD_MAX(tokens_max, o.tokens[k]);
    uint32_t pages_max = PD_DIV_CEIL(tokens_max, o.page_size);
    uint32_t *idx = malloc(pages_max * sizeof(uint32_t));
    for (uint32_t p = 0; p < pages_max; p++) idx[p] = p;

    static tally tl;
    printf("== xfer: prefill -> decode hand-off over pd_net "
           "(page size %u, contiguous pages), median of %d ==\n",
           o.page_size, o.runs);
    printf("%-6s %7s %11s  %-8s %10s %11s %9s\n", "model", "tokens", "bytes", "path", "hand-off",
           "bandwidth", "vs memcpy");
    for (int c = 0; c < o.n_configs; c++) measure_config(&o, c, pages_max, idx, &tl);
    print_table(&tl);
    print_fixed_costs(&o, &tl);
    print_summary(&o, &tl);
    free(idx);
    return 0;
}
