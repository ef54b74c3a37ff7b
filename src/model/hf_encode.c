/*
 * hf_encode.c — text to ids for a loaded tokenizer.json (hf_internal.h).
 *
 * The stages, in the reference implementations' order: added tokens out of
 * the raw text; each piece between them cut into valid UTF-8 runs and single
 * invalid bytes; runs normalized (NFC), split by the pre-tokenizer's regex,
 * and each pre-token's bytes merged by BPE. An invalid byte is a pre-token of
 * its own whose id is that byte's token, which keeps decode(encode(x)) == x
 * for any bytes (the references only ever see valid strings).
 *
 * The regex is PCRE2 with PCRE2_UTF | PCRE2_UCP, so \p{L}, \p{N} and (?i:)
 * use Unicode's tables, not hand-written ones. One rewrite happens before
 * compiling: \s and \S become explicit classes of Unicode's White_Space
 * property, which is what the Rust `tokenizers` crate's regex means by \s.
 * PCRE2's own \s adds U+180E; JavaScript's drops U+0085 and adds U+FEFF
 * (docs/model.md lists the difference and tests pin it).
 *
 * Per encode call everything is local (match data, scratch), so one
 * tokenizer serves any number of threads.
 */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "hf_internal.h"

/* ---- the Split regex ------------------------------------------------------------ */

#define WHITE_SPACE                                                                      \
    "\\x{09}-\\x{0d}\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}" \
    "\\x{202f}\\x{205f}\\x{3000}"

typedef struct text_buf {
    char *s;
    size_t n, cap;
    bool oom;
} text_buf;

static void text_put(text_buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = (b->n + n + 1) * 2;
        char *p = b->oom ? NULL : realloc(b->s, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->s = p, b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

#define PUT(b, lit) text_put((b), (lit), sizeof(lit) - 1)

/* Copies pattern with \s and \S spelled as White_Space classes. Returns
 * false for \S inside a class (no single class can say it). */
static bool rewrite_spaces(const char *p, text_buf *out) {
    bool in_class = false;
    for (size_t i = 0; p[i];) {
        if (p[i] == '\\' && p[i + 1]) {
            char d = p[i + 1];
            if (d == 's' && in_class) PUT(out, WHITE_SPACE);
            if (d == 's' && !in_class) PUT(out, "[" WHITE_SPACE "]");
            if (d == 'S' && in_class) return false;
            if (d == 'S') PUT(out, "[^" WHITE_SPACE "]");
            if (d != 's' && d != 'S') text_put(out, p + i, 2);
            i += 2;
            continue;
        }
        if (p[i] == '[' && !in_class) {
            in_class = true;
            size_t j = i + 1;
            if (p[j] == '^') j++;
            if (p[j] == ']') j++; /* a leading ] is literal */
            text_put(out, p + i, j - i);
            i = j;
            continue;
        }
        if (p[i] == ']' && in_class) in_class = false;
        text_put(out, p + i, 1);
        i++;
    }
    return true;
}

pd_err hf_compile_split(pd_hf_tokenizer *tok, const char *pattern, char *msg, size_t cap) {
    PD_ASSERT(tok->re == NULL);
    text_buf b = {0};
    if (!rewrite_spaces(pattern, &b) || b.oom) {
        free(b.s);
        return pd_errorf(msg, cap, PD_ERR_INVALID, "Split regex: \\S inside a class: unsupported");
    }
    int code;
    PCRE2_SIZE at;
    tok->re = pcre2_compile((PCRE2_SPTR)b.s, b.n, PCRE2_UTF | PCRE2_UCP, &code, &at, NULL);
    free(b.s);
    if (!tok->re) {
        PCRE2_UCHAR why[160];
        pcre2_get_error_message(code, why, sizeof(why));
        return pd_errorf(msg, cap, PD_ERR_INVALID, "Split regex \"%s\": %s", pattern,
                         (const char *)why);
    }
    (void)pcre2_jit_compile(tok->re, PCRE2_JIT_COMPLETE); /* the interpreter if no JIT */
    return PD_OK;
}

/* ---- the output and the scratch of one encode call -------------------------------- */

/* A candidate merge of the symbol at pos with the one after it. */
typedef struct bpe_pair {
    uint32_t rank, pos;
} bpe_pair;

typedef struct enc {
    const pd_hf_tokenizer *tok;
    int32_t *ids;
    size_t n_ids, cap_ids;
    int32_t *sym;   /* one pre-token's symbols during BPE; -1: merged away */
    uint32_t *next; /* the symbol after i, PD_NONE at the end */
    uint32_t *prev; /* the symbol before i, PD_NONE at the start */
    bpe_pair *heap; /* candidate merges, lowest (rank, pos) on top */
    size_t n_heap;
    size_t cap_sym;
    text_buf mapped; /* a pre-token in the byte-level alphabet (ignore_merges) */
    pcre2_match_data *md;
    text_buf *norm; /* not NULL: pd_hf_tokenizer_normalize, text instead of ids */
    char *msg;
    size_t msg_cap;
} enc;

static pd_err push_id(enc *e, int32_t id) {
    if (e->n_ids == e->cap_ids) {
        size_t cap = e->cap_ids ? e->cap_ids * 2 : 256;
        int32_t *p = realloc(e->ids, cap * sizeof(*p));
        if (!p) return pd_errorf(e->msg, e->msg_cap, PD_ERR_NOMEM, "out of memory");
        e->ids = p, e->cap_ids = cap;
    }
    e->ids[e->n_ids++] = id;
    return PD_OK;
}

/* Room for a pre-token of n bytes: n symbols and at most 3n heap entries
 * (n - 1 pairs to start with, two new ones per merge). */
static pd_err reserve_sym(enc *e, size_t n) {
    if (n <= e->cap_sym) return PD_OK;
    free(e->sym), free(e->next), free(e->prev), free(e->heap);
    e->sym = malloc(n * sizeof(*e->sym));
    e->next = malloc(n * sizeof(*e->next));
    e->prev = malloc(n * sizeof(*e->prev));
    e->heap = malloc(3 * n * sizeof(*e->heap));
    e->cap_sym = e->sym && e->next && e->prev && e->heap ? n : 0;
    if (!e->cap_sym) return pd_errorf(e->msg, e->msg_cap, PD_ERR_NOMEM, "out of memory");
    return PD_OK;
}

/* ---- BPE over one pre-token --------------------------------------------------------- */

static uint32_t rank_of(const pd_hf_tokenizer *tok, int32_t left, int32_t right) {
    const hf_merge *m = hf_merge_find(tok, left, right);
    return m ? m->rank : UINT32_MAX;
}

/* With ignore_merges a pre-token that is itself a vocabulary entry is taken
 * whole, whatever the merges would have made of it (Llama-3). */
static int32_t whole_token(enc *e, const uint8_t *b, size_t n) {
    e->mapped.n = 0;
    for (size_t i = 0; i < n; i++)
        text_put(&e->mapped, e->tok->byte_char[b[i]], e->tok->byte_char_len[b[i]]);
    return e->mapped.oom ? -1 : hf_vocab_find(e->tok, e->mapped.s);
}

static bool pair_less(bpe_pair a, bpe_pair b) {
    return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos);
}

static void heap_push(enc *e, uint32_t pos) {
    uint32_t nx = e->next[pos];
    if (nx == PD_NONE) return;
    uint32_t rank = rank_of(e->tok, e->sym[pos], e->sym[nx]);
    if (rank == UINT32_MAX) return;
    PD_ASSERT(e->n_heap < 3 * e->cap_sym);
    size_t i = e->n_heap++;
    bpe_pair p = {rank, pos};
    for (; i > 0 && pair_less(p, e->heap[(i - 1) / 2]); i = (i - 1) / 2)
        e->heap[i] = e->heap[(i - 1) / 2];
    e->heap[i] = p;
}

static bpe_pair heap_pop(enc *e) {
    PD_ASSERT(e->n_heap > 0);
    bpe_pair top = e->heap[0], last = e->heap[--e->n_heap];
    size_t i = 0, n = e->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && pair_less(e->heap[c + 1], e->heap[c])) c++;
        if (!pair_less(e->heap[c], last)) break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n > 0) e->heap[i] = last;
    return top;
}

/* Merges the symbol at pos with its successor if the candidate is still
 * current: both alive and still the pair that had this rank (a pair's rank
 * is unique and symbols only grow, so an equal rank means the same pair). */
static void bpe_apply(enc *e, bpe_pair p) {
    uint32_t nx = e->next[p.pos];
    if (e->sym[p.pos] < 0 || nx == PD_NONE) return;
    const hf_merge *m = hf_merge_find(e->tok, e->sym[p.pos], e->sym[nx]);
    if (!m || m->rank != p.rank) return;
    e->sym[p.pos] = m->merged;
    e->sym[nx] = -1;
    e->next[p.pos] = e->next[nx];
    if (e->next[nx] != PD_NONE) e->prev[e->next[nx]] = p.pos;
    if (e->prev[p.pos] != PD_NONE) heap_push(e, e->prev[p.pos]);
    heap_push(e, p.pos);
}

/* The lowest-ranked adjacent pair is merged first, the leftmost among equal
 * ranks: the order of the references' priority queues, and the same kind of
 * heap (O(n log n) in the pre-token's length; stale candidates are skipped). */
static pd_err bpe_piece(enc *e, const uint8_t *b, size_t n) {
    const pd_hf_tokenizer *tok = e->tok;
    if (n == 0) return PD_OK;
    if (tok->ignore_merges && n > 1) {
        int32_t id = whole_token(e, b, n);
        if (id >= 0) return push_id(e, id);
    }
    if (n >= UINT32_MAX / 3)
        return pd_errorf(e->msg, e->msg_cap, PD_ERR_TOOBIG, "a pre-token of %zu bytes", n);
    pd_err err = reserve_sym(e, n);
    if (err) return err;
    for (size_t i = 0; i < n; i++) {
        e->sym[i] = tok->byte_id[b[i]];
        e->next[i] = i + 1 < n ? (uint32_t)i + 1 : PD_NONE;
        e->prev[i] = i > 0 ? (uint32_t)i - 1 : PD_NONE;
    }
    e->n_heap = 0;
    for (size_t i = 0; i + 1 < n; i++) heap_push(e, (uint32_t)i);
    while (e->n_heap > 0) bpe_apply(e, heap_pop(e));
    for (uint32_t i = 0; i != PD_NONE && !err; i = e->next[i]) err = push_id(e, e->sym[i]);
    return err;
}

/* ---- pre-tokenizing a valid UTF-8 run ------------------------------------------------- */

/* Isolated: every match is a pre-token, and so is every gap between them. */
static pd_err split_run(enc *e, const uint8_t *s, size_t n) {
    size_t off = 0, from = 0; /* from: where the next search starts */
    while (off < n) {
        int rc = pcre2_match(e->tok->re, s, n, from, PCRE2_NO_UTF_CHECK, e->md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT) /* the interpreter keeps its stack on the heap */
            rc =
                pcre2_match(e->tok->re, s, n, from, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, e->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0)
            return pd_errorf(e->msg, e->msg_cap, PD_ERR_INTERNAL, "pre-tokenizer regex: error %d",
                             rc);
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        PD_ASSERT(ov[0] >= from && ov[1] <= n);
        if (ov[1] == ov[0]) { /* an empty match cuts nothing: search on */
            from = ov[0] + hf_utf8_len(s + ov[0], n - ov[0]);
            if (ov[0] == n) break;
            continue;
        }
        pd_err err = bpe_piece(e, s + off, ov[0] - off);
        if (!err) err = bpe_piece(e, s + ov[0], ov[1] - ov[0]);
        if (err) return err;
        off = from = ov[1];
    }
    return bpe_piece(e, s + off, n - off);
}

static bool all_ascii(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] >= 0x80) return false;
    return true;
}

/* Normalizing only: the text goes to e->norm instead of the regex. */
static pd_err normalized(enc *e, const uint8_t *s, size_t n) {
    if (e->norm) text_put(e->norm, (const char *)s, n);
    if (e->norm && e->norm->oom)
        return pd_errorf(e->msg, e->msg_cap, PD_ERR_NOMEM, "out of memory");
    return e->norm ? PD_OK : split_run(e, s, n);
}

static pd_err encode_run(enc *e, const uint8_t *s, size_t n) {
    if (!e->tok->nfc || all_ascii(s, n)) return normalized(e, s, n);
    utf8proc_uint8_t *nfc = NULL;
    utf8proc_ssize_t len =
        utf8proc_map(s, (utf8proc_ssize_t)n, &nfc, UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    if (len < 0)
        return pd_errorf(e->msg, e->msg_cap, PD_ERR_INVALID, "NFC: %s", utf8proc_errmsg(len));
    pd_err err = normalized(e, nfc, (size_t)len);
    free(nfc);
    return err;
}

/* Valid runs go through the pre-tokenizer; each invalid byte is its own
 * pre-token and so its own byte token. */
static pd_err encode_plain(enc *e, const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        size_t j = i;
        uint32_t l;
        while (j < n && (l = hf_utf8_len(s + j, n - j)) > 0) j += l;
        pd_err err = j > i ? encode_run(e, s + i, j - i) : PD_OK;
        if (!err && j < n)
            err = e->norm ? normalized(e, s + j, 1) : push_id(e, e->tok->byte_id[s[j]]);
        j += j < n;
        if (err) return err;
        i = j;
    }
    return PD_OK;
}

/* ---- added tokens ------------------------------------------------------------------------ */

static bool is_word_byte(uint8_t c) {
    return c >= 0x80 || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') ||
        (c >= 'A' && c <= 'Z') || c == '_';
}

static bool is_space_byte(uint8_t c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

typedef struct added_match {
    size_t start, end;
    int32_t id;
} added_match;

/* The longest added token starting at s[i], or NULL. */
static const hf_added *added_at(const pd_hf_tokenizer *tok, const uint8_t *s, size_t n, size_t i) {
    const hf_added *best = NULL;
    for (uint32_t k = 0; k < tok->n_added; k++) {
        const hf_added *a = &tok->added[k];
        if ((uint8_t)a->content[0] != s[i] || a->len > n - i) continue;
        if (memcmp(a->content, s + i, a->len) || (best && best->len >= a->len)) continue;
        if (a->single_word &&
            ((i > 0 && is_word_byte(s[i - 1])) || (i + a->len < n && is_word_byte(s[i + a->len]))))
            continue;
        best = a;
    }
    return best;
}

/* Leftmost-longest, as the references' Aho-Corasick automaton finds them;
 * lstrip/rstrip take the whitespace beside the token with it. */
static bool next_added(const pd_hf_tokenizer *tok, const uint8_t *s, size_t n, size_t from,
                       added_match *m) {
    for (size_t i = from; i < n; i++) {
        if (!tok->added_first[s[i]]) continue;
        const hf_added *a = added_at(tok, s, n, i);
        if (!a) continue;
        m->start = i, m->end = i + a->len, m->id = a->id;
        while (a->lstrip && m->start > from && is_space_byte(s[m->start - 1])) m->start--;
        while (a->rstrip && m->end < n && is_space_byte(s[m->end])) m->end++;
        return true;
    }
    return false;
}

static pd_err encode_text(enc *e, const uint8_t *s, size_t n, bool add_special) {
    const pd_hf_tokenizer *tok = e->tok;
    pd_err err = PD_OK;
    for (uint32_t i = 0; add_special && i < tok->n_prefix && !err; i++)
        err = push_id(e, tok->prefix[i]);
    size_t pos = 0;
    added_match m;
    while (!err && pos < n) {
        bool found = next_added(tok, s, n, pos, &m);
        size_t stop = found ? m.start : n;
        err = encode_plain(e, s + pos, stop - pos);
        if (!err && found && e->norm) /* the token as decoded: lstrip/rstrip ate spaces */
            err = normalized(e, tok->tokens[m.id].bytes, tok->tokens[m.id].n_bytes);
        if (!err && found && !e->norm) err = push_id(e, m.id);
        pos = found ? m.end : n;
    }
    for (uint32_t i = 0; add_special && i < tok->n_suffix && !err; i++)
        err = push_id(e, tok->suffix[i]);
    return err;
}

pd_err pd_hf_tokenizer_encode(const pd_hf_tokenizer *tok, const char *text, size_t len,
                              bool add_special, int32_t **ids, size_t *n_ids, char *msg,
                              size_t msg_cap) {
    PD_ASSERT(tok != NULL && tok->re != NULL);
    *ids = NULL;
    *n_ids = 0;
    enc e = {.tok = tok, .msg = msg, .msg_cap = msg_cap};
    e.md = pcre2_match_data_create_from_pattern(tok->re, NULL);
    pd_err err = e.md ? push_id(&e, 0) : pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    e.n_ids = 0; /* the array exists even for no ids: callers may memcmp or free it */
    if (!err) err = encode_text(&e, (const uint8_t *)text, len, add_special);
    pcre2_match_data_free(e.md);
    free(e.sym), free(e.next), free(e.prev), free(e.heap);
    free(e.mapped.s);
    if (err) {
        free(e.ids);
        return err;
    }
    *ids = e.ids;
    *n_ids = e.n_ids;
    return PD_OK;
}

pd_err pd_hf_tokenizer_normalize(const pd_hf_tokenizer *tok, const char *text, size_t len,
                                 char **out, size_t *out_len, char *msg, size_t msg_cap) {
    PD_ASSERT(tok != NULL);
    text_buf norm = {0};
    text_put(&norm, "", 0); /* an empty text is still a string */
    enc e = {.tok = tok, .norm = &norm, .msg = msg, .msg_cap = msg_cap};
    pd_err err = norm.oom ? pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory")
                          : encode_text(&e, (const uint8_t *)text, len, false);
    free(e.ids);
    *out = err ? NULL : norm.s;
    *out_len = err ? 0 : norm.n;
    if (err) free(norm.s);
    return err;
}
